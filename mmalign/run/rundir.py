"""What a run directory may be used for: a fresh start, an overwrite, or a resume of the same run.

The silent failures this module exists to prevent:

* starting a new run in a directory that holds another run's checkpoints, then
  ``--resume latest``, continued the *old* run while ``config.yaml`` recorded the
  new settings (and ``final/`` kept the old weights until the end);
* resuming with a config that changes the run (another model, batch, loss, data
  order) mixed two experiments in one curve.

And a third: ``--resume latest`` on a run that saved no checkpoint (``train.checkpoint_every:
0``, the default) started over from step 0 and replaced the finished run's ``final/``,
``eval.json`` and ``config.yaml``.

So a fresh start needs an empty (or absent) directory, or ``--overwrite``; a resume with
nothing to resume may not replace a finished run or another config's run; and each
checkpoint stores the resolved config it was written under, which a resume must
match except for the keys in :data:`RESUMABLE_CHANGES` (a longer run, another
evaluation or logging schedule, another output path).

A third, across nodes: a run directory that is node-local (each host its own disk at the
same path) lets every node write its own checkpoint shards where no other node reads them.
:func:`check_shared` finds it at start-up: rank 0 writes a nonce there, the others read it.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import shutil
import socket
import time
from pathlib import Path

import yaml

from mmalign.config import Config, ConfigError, to_dict
from mmalign.dirlock import LOCK_FILE  # the launch's own lock (mmalign.dirlock): not run content
from mmalign.layout.run_dir import (
    CONFIG_FILE,  # noqa: F401 (re-exported)
    DECONTAMINATION,
    ENGINE_TAG,
    ROOT,
    is_step_name,
)

# What a run writes; --overwrite removes these and nothing else (a directory may hold the
# user's own files too).
NONCE_PREFIX = ".mmalign-shared-check-"  # check_shared's file (removed at once; one a kill left is ignored)
RUN_ARTEFACTS = (
    "checkpoints",
    "final",
    "final_ema",
    "tensorboard",
    "report",
    "config.yaml",
    "train.log",
    "metrics.jsonl",
    "eval.json",
    "eval_step*.json",
    DECONTAMINATION,
    "samples_rank*.jsonl",
    NONCE_PREFIX + "*",
)

# Keys a resumed run may change: how long it runs, when it evaluates / logs / saves, where
# its files go, how many threads and how it watches itself. Everything else shapes the
# optimisation or the data order, and a change would splice two experiments into one run.
RESUMABLE_CHANGES = (
    "output",
    "train.steps",
    "train.eval_every",
    "train.log_every",
    "train.checkpoint_every",
    "train.keep_checkpoints",
    "train.max_consecutive_skips",
    "train.threads",
    "eval.",
    "monitor.",
    "data.val",
    "data.max_consecutive_skips",
    "dist.",
    # how the step is computed, not what it computes: the cache chunk the memory
    # budget picks (caching is exact) and the attention kernel (the same function)
    "train.memory_budget_gb",
    "train.attention_kernel",
)


def _flat(tree: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in tree.items():
        if (
            isinstance(value, dict)
            and value
            and prefix + key not in ("model.vision", "model.text", "deepspeed.extra")
        ):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[prefix + key] = value
    return out


def config_hash(cfg: Config | dict) -> str:
    tree = cfg if isinstance(cfg, dict) else to_dict(cfg)
    return hashlib.sha256(json.dumps(tree, sort_keys=True, default=str).encode()).hexdigest()[:16]


def artefacts(out: Path) -> list[Path]:
    found: list[Path] = []
    for pattern in RUN_ARTEFACTS:
        found += sorted(out.glob(pattern))
    return found


def check_writable(out: Path) -> None:
    """A run writes into ``out`` (a resume too: config.yaml, train.log, metrics.jsonl, its
    checkpoints): one line when it, its ``checkpoints/`` (a mount of its own) or the folder it
    will be made in is read-only, instead of a traceback from the first write. Pure."""
    existing = next((d for d in (out, *out.parents) if d.is_dir()), None)
    for folder in (existing, out / ROOT):
        if folder is None or not folder.is_dir() or os.access(folder, os.W_OK):
            continue
        try:
            read_only = bool(os.statvfs(folder).f_flag & os.ST_RDONLY)
        except OSError:
            read_only = False
        why = "on a read-only filesystem" if read_only else "not writable by this user"
        raise ConfigError(
            f"config key 'output': {folder} is {why}; a run (a resume too) writes its checkpoints, "
            f"logs and final/ there: copy the run to a writable folder and resume it there, or "
            f"use another output directory"
        )


def check_fresh_start(out: Path, resume: str | None, overwrite: bool, cfg: Config | None = None) -> None:
    """A start without ``--resume`` needs an empty or absent directory, or ``--overwrite``;
    with ``--resume`` and ``cfg``, :func:`check_something_to_resume`; any start needs a
    writable directory (:func:`check_writable`).
    Pure (no writes): every rank may call it before any rank writes."""
    check_writable(out)
    if overwrite or not out.is_dir():
        return
    if resume:
        if resume == "latest" and cfg is not None:
            check_something_to_resume(out, cfg)
        return
    entries = sorted(
        p.name for p in out.iterdir() if not p.name.startswith(NONCE_PREFIX) and p.name != LOCK_FILE
    )
    if entries:
        shown = ", ".join(entries[:4]) + (f" (+{len(entries) - 4} more)" if len(entries) > 4 else "")
        raise ConfigError(
            f"config key 'output': {out} is not empty ({shown}); continue that run with "
            f"--resume latest, or start over with --overwrite (removes its run files)"
        )


def check_something_to_resume(out: Path, cfg: Config) -> None:
    """``--resume latest`` where ``out`` holds no checkpoint is a fresh start, which rewrites
    ``config.yaml``, ``metrics.jsonl``, ``final/`` and ``eval.json``. That is refused (one
    line; ``--overwrite`` is the way to start over) where it would replace a run:

    * a finished run (``final/``): there is nothing to resume, with its config or another;
    * a run whose ``config.yaml`` differs in a key that changes the run (named, as
      :func:`check_resume` names them): another experiment would take its place.

    The leftovers of an attempt of the *same* run killed before its first save (the launch lines
    of docs/training.md carry ``--resume latest``, and a requeued job runs them again) start over."""
    if (out / "checkpoints" / "latest").is_file():
        return  # a checkpoint to resume from: checkpoint.resume and check_resume take it from here
    finished = (out / "final").is_dir()
    run_config = out / CONFIG_FILE
    if not finished and not run_config.is_file():
        return
    changed = ""
    if run_config.is_file():
        try:
            stored = yaml.safe_load(run_config.read_text())
        except (yaml.YAMLError, UnicodeDecodeError, OSError) as e:
            raise ConfigError(
                f"config key 'output': {run_config} cannot be read ({type(e).__name__}) and {out} "
                f"holds no checkpoint to resume from; start over with --overwrite"
            ) from None
        if not isinstance(stored, dict):
            raise ConfigError(
                f"config key 'output': {run_config} is not an mmalign config and {out} holds no "
                f"checkpoint to resume from; start over with --overwrite"
            )
        changed = _shown(*_changes(stored, cfg))
    if finished:
        raise ConfigError(
            f"config key 'output': {out} holds a finished run (final/) and no checkpoint to resume from"
            + (
                f"; this config differs from its config.yaml in keys that change the run: {changed}"
                if changed
                else ""
            )
            + "; nothing to resume: retrain it with --overwrite (removes its "
            "run files), or use another output directory"
        )
    if changed:
        raise ConfigError(
            f"config key 'output': {out} holds a run of another config ({changed}) that saved no "
            f"checkpoint; nothing to resume: start over with --overwrite (removes its run files), "
            f"or use another output directory"
        )


def clear(out: Path) -> list[str]:
    """``--overwrite``: remove what an earlier run wrote (rank 0 only); returns the names removed."""
    removed = []
    for path in artefacts(out):
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()
        removed.append(path.name)
    return removed


def save_into(cfg: Config, directory: Path) -> None:
    """The resolved config (and its hash, as a comment on line 1) beside a checkpoint's state."""
    tree = to_dict(cfg)
    text = f"# config hash {config_hash(tree)}\n" + yaml.safe_dump(tree, sort_keys=False)
    (directory / CONFIG_FILE).write_text(text)


def stored_config(checkpoint: Path) -> dict | None:
    """The config a checkpoint was written under (None for checkpoints from before this rule)."""
    file = checkpoint / CONFIG_FILE
    if not file.is_file():
        return None
    tree = yaml.safe_load(file.read_text())
    return tree if isinstance(tree, dict) else None


def _changes(stored: dict, cfg: Config) -> tuple[list[str], dict, dict]:
    """The keys in which ``cfg`` differs from the ``stored`` config tree in a way that changes
    the run (:data:`RESUMABLE_CHANGES` pass), and both flat views."""
    old, new = _flat(stored), _flat(to_dict(cfg))
    # a key the stored config lacks was added to mmalign after it was written: it ran with
    # that key's default (a checkpoint from before train.attention_kernel still resumes)
    defaults = _flat(to_dict(Config()))
    old.update({k: defaults[k] for k in new if k not in old and k in defaults})
    # model.text's sentencepiece path is derived from model.tokenizer (config.resolve makes it
    # absolute): with the same model.tokenizer it differs only where the run directory was
    # moved or resumed from another folder, which does not change the run
    if old.get("model.tokenizer") == new.get("model.tokenizer"):
        old["model.text"], new["model.text"] = (
            _without_derived_path(old.get("model.text")),
            _without_derived_path(new.get("model.text")),
        )
    differing = [
        k
        for k in sorted(set(old) | set(new))
        if old.get(k) != new.get(k)
        and not any(k == r or (r.endswith(".") and k.startswith(r)) for r in RESUMABLE_CHANGES)
    ]
    return differing, old, new


def _without_derived_path(text_cfg):
    if not isinstance(text_cfg, dict) or not isinstance(text_cfg.get("tokenizer_kwargs"), dict):
        return text_cfg
    kwargs = {k: v for k, v in text_cfg["tokenizer_kwargs"].items() if k != "sentencepiece"}
    return {**text_cfg, "tokenizer_kwargs": kwargs}


def _shown(differing: list[str], old: dict, new: dict) -> str:
    """``key: old -> new`` for the first four keys ("" for none)."""
    shown = "; ".join(f"{k}: {old.get(k)!r} -> {new.get(k)!r}" for k in differing[:4])
    return shown + (f" (+{len(differing) - 4} more)" if len(differing) > 4 else "")


def check_resume(cfg: Config, checkpoint: Path, step: int | None = None) -> None:
    """One line naming every key that differs from the checkpoint's config in a way that
    changes the run; the resumable changes of :data:`RESUMABLE_CHANGES` pass."""
    stored = stored_config(checkpoint)
    if stored is None:
        return
    shown = _shown(*_changes(stored, cfg))
    if shown:
        raise ConfigError(
            f"--resume: the config differs from the one {checkpoint.name} was trained with in keys "
            f"that change the run: {shown}; resume with the run's own config, or start a new "
            f"run in another output directory"
        )
    if step is not None and cfg.train.steps < step:
        raise ConfigError(
            f"config key 'train.steps'={cfg.train.steps} is below the checkpoint's step {step} "
            f"({checkpoint.name})"
        )


def _sees(file: Path, text: str, tries: int = 10, pause_s: float = 0.5) -> bool:
    """Whether ``file`` holds ``text``; a few tries, for network filesystems whose clients
    cache directory attributes for a moment (only a failing check waits)."""
    for attempt in range(tries):
        try:
            if file.read_text() == text:
                return True
        except OSError:
            pass
        if attempt + 1 < tries:
            time.sleep(pause_s)
    return False


def check_shared(out: Path) -> None:
    """Collective (every rank, after rank 0 created ``out``): a one-line ConfigError on every
    rank when some rank does not see rank 0's files in ``out``.

    Rank 0 writes a random nonce into the run directory; after a barrier every other rank
    reads it back.  A node-local path (another disk, a tmpfs, a container's private volume
    at the same path) shows another file or none: the checkpoints, whose shards every rank
    writes, would be split across hosts and a resume could never load them."""
    from mmalign.dist import distributed as mdist

    if mdist.get_world_size() == 1:
        return
    rank = mdist.get_rank()
    token = secrets.token_hex(16) if rank == 0 else None
    name = mdist.all_gather_object(token)[0]  # rank 0's nonce, by the network, to compare with the file
    file = out / f"{NONCE_PREFIX}{name}"
    try:
        if rank == 0:
            file.write_text(name)
        mdist.barrier()
        seen = _sees(file, name)
        verdicts = mdist.all_gather_object(None if seen else socket.gethostname())
    finally:
        if rank == 0:
            file.unlink(missing_ok=True)
    blind = [(r, host) for r, host in enumerate(verdicts) if host is not None]
    if blind:
        shown = ", ".join(f"rank {r} on {host}" for r, host in blind[:4]) + (" ..." if len(blind) > 4 else "")
        raise ConfigError(
            f"config key 'output': {out} is not shared between the ranks ({shown} cannot see rank 0's "
            f"files there); the output directory must be on a filesystem every node mounts at "
            f"the same path"
        )


def step_of(path: Path) -> int:
    return int(path.name.split("_", 1)[1])


def _pointer_text(out: str | Path) -> str | None:
    """What ``checkpoints/latest`` says ("" when it is empty or unreadable); None without one."""
    pointer = Path(out) / ROOT / "latest"
    if not pointer.is_file():
        return None
    try:
        return pointer.read_text().strip()
    except (OSError, UnicodeDecodeError):
        return ""


def empty_pointer(out: str | Path, resume: str | None) -> bool:
    """``--resume latest`` where ``latest`` exists but names nothing (a save cut on a full disk,
    a hand edit): :func:`candidates` then tries every checkpoint, newest first."""
    return resume == "latest" and _pointer_text(out) == ""


def candidates(out: str | Path, resume: str | None) -> list[Path]:
    """The checkpoints a resume may load, in the order to try them: for ``latest``, the one
    it names and then every older ``step_N`` of the run, newest first (the fallbacks when
    the newest is damaged); an empty ``latest``, every ``step_N``, newest first; for an
    explicit path, that one alone."""
    if not resume:
        return []
    base = Path(out) / ROOT
    if resume == "latest":
        name = _pointer_text(out)
        if name is None:
            return []
        steps = sorted(
            (p for p in base.glob("step_*") if p.is_dir() and is_step_name(p.name)), key=step_of, reverse=True
        )
        if name == "":
            return steps
        # only a sibling step_N: the pointer is a file anyone may edit, never a path to follow
        if not is_step_name(name):
            raise ConfigError(
                f"--resume latest: {base / 'latest'} names {name[:80]!r}, not a step_N checkpoint of this run"
            )
        newest = base / name
        return [newest, *(p for p in steps if step_of(p) < step_of(newest))]
    path = Path(resume)
    if not is_step_name(path.name) or path.resolve().parent.name != ROOT:
        raise ConfigError(f"--resume: {path} is not a checkpoint directory RUN/{ROOT}/step_N")
    if not (path / ENGINE_TAG).is_dir():
        raise ConfigError(f"--resume: {path} is not a complete mmalign checkpoint")
    return [path]


def check_newest(out: str | Path, resume: str | None, cfg: Config) -> None:
    """:func:`check_resume` on the checkpoint a resume tries first (the fallbacks are checked as
    they are loaded). Torch-free: the ``--nproc`` launcher runs it before any rank starts, so a
    changed key is one line instead of one per rank and torchrun's report of failed children."""
    for newest in candidates(out, resume)[:1]:
        check_resume(cfg, newest, step_of(newest))
