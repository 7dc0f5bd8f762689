"""``mmalign curate``: embed a pool once, apply the curation policies, write what is kept.

Passes (each its own module):

1. :mod:`.embed_pass`: every shard's samples embedded with the model (image and captions) and
   their images hashed (:mod:`mmalign.data.phash`), per-shard parquet + embeddings + hashes in
   ``OUT/pool/``; without a model (no policy needs one), hashed only (:mod:`.hash_pass`).
   Split over processes: with ``--nproc N`` (re-run under torchrun, as ``mmalign train
   --nproc`` does) or under an outside torchrun / SLURM launch (``RANK`` / ``WORLD_SIZE``),
   rank r embeds shards r, r + W, r + 2W, ...
2. :mod:`.decide`: rank 0 waits for every shard, then applies the policies to the whole pool.
3. :mod:`.write_out`: new shuffled shards in ``OUT`` (or ``OUT/keep_keys.txt``), and
   :mod:`.report`'s ``curate_report.json`` / ``.html``; before it, a policy dropping more than
   ``--max-drop`` stops the run with nothing written (:func:`.decide.check_drop`).

``OUT`` is curate's alone while it runs (``mmalign.dirlock``, held by rank 0 or the ``--nproc``
launcher), and it writes, removes and replaces only files of its own (:mod:`.outdir`).

Resume: ``OUT/pool/stamp.json`` records the model (its weight files' names, sizes, mtimes and
sha256) and the shards the embeddings came from. Run the same command again after a kill and
pass 1 embeds only the shards without a finished result; passes 2 and 3 are cheap and always
run whole. The policies are not in the stamp, so a second run with other policies reuses the
embeddings. Each shard's result records its input's fingerprint (:mod:`.fingerprint`): a shard
rewritten at the same path since is embedded again, with a line naming it and why.
"""

from __future__ import annotations

import json
import logging
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path

from data_pipelines.curate import outdir
from data_pipelines.curate.decide import Policies
from data_pipelines.curate.embed_pass import POOL, ShardEmbedder, done_shards
from data_pipelines.curate.stamp import STAMP, check_stamp, wait_stamp, write_stamp
from data_pipelines.shard_input import input_shards
from mmalign.errors import UsageError
from mmalign.models.locate import check_exists

log = logging.getLogger("mmalign.curate")

NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")  # a .json field the config's loss.false_negative_ids accepts


@dataclass
class Options:
    data: str
    model: str | None  # None: no policy needs a model, pass 1 only hashes
    out: str
    policies: Policies = field(default_factory=Policies)
    keys_only: bool = False
    per_shard: int = 1000
    batch_size: int = 64
    device: str = "cpu"
    progress: bool = True
    examples: int = 24
    stall_timeout_s: float = 3600.0  # rank 0 waiting for other ranks' shards with no progress
    overwrite: bool = (
        False  # write into a non-empty --out curate did not create (replacing none of its files)
    )


def check(opts: Options) -> None:
    """The argument errors that need no data (one line each)."""
    p = opts.policies
    if p.keep_fraction is not None and not (0.0 < p.keep_fraction <= 1.0):
        raise UsageError(
            f"--keep-fraction must be in (0, 1] (the fraction of the pool kept), got {p.keep_fraction}"
        )
    if p.clip_score_min is not None and not -1.0 <= p.clip_score_min <= 1.0:
        raise UsageError(f"--clip-score-min is a cosine in [-1, 1], got {p.clip_score_min}")
    if not 0.0 <= p.dedupe_eps <= 2.0:
        raise UsageError(f"--dedupe-eps must be in [0, 2] (duplicates: cosine > 1 - eps), got {p.dedupe_eps}")
    if not 0.0 <= p.max_drop <= 1.0:
        raise UsageError(
            f"--max-drop must be in [0, 1] (the largest fraction a policy may drop), got {p.max_drop}"
        )
    if p.dedupe_clusters < 0 or p.kmeans_sample < 0:
        raise UsageError("--dedupe-clusters and --kmeans-sample must be >= 0 (0 = automatic)")
    if p.false_negative_field is not None:
        if not NAME.match(p.false_negative_field):
            raise UsageError(
                f"--false-negative-groups: {p.false_negative_field!r} is not a field name "
                f"(letters, digits, _)"
            )
        if p.false_negative_field == "clip_score":
            raise UsageError("--false-negative-groups: clip_score is the field curate writes the score into")
        if opts.keys_only:
            raise UsageError(
                "--false-negative-groups writes a field into each .json: it needs new shards, not --keys-only"
            )
    from data_pipelines.curate.decontaminate import check as check_decontaminate

    check_decontaminate(p.decontaminate, p.decontaminate_distance)  # reads no image
    if not 0 < opts.per_shard <= 10_000:
        raise UsageError(f"--per-shard must be in 1..10000, got {opts.per_shard}")
    if opts.batch_size < 1:
        raise UsageError(f"--batch-size must be >= 1, got {opts.batch_size}")
    from data_pipelines.curate.hash_pass import check_model

    check_model(opts)  # the perceptual distance; without a model, no policy that needs one
    if opts.model is not None:
        check_exists(opts.model)  # before --out is made and before the seconds of importing torch


def _peek_field(urls: list[str], field_name: str) -> None:
    """Fail before embedding when the first sample's .json already has the field."""
    from mmalign.data.shards import decode_sample, iter_tar_groups

    try:
        meta = decode_sample(next(iter_tar_groups(urls[0])))["json"]
    except Exception:  # no sample, a bad one, an unreadable shard: pass 1 checks every sample
        return
    if field_name in meta:
        _field_exists(field_name, urls[0])


def _field_exists(field_name: str, where: str) -> None:
    raise UsageError(
        f"--false-negative-groups: the samples' .json already has a field {field_name!r} (in {where}); "
        f"choose another name"
    )


def _rank() -> tuple[int, int]:
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))


class _Progress:
    """A line every ``every_s`` seconds: samples embedded, samples/s, and an ETA from the
    shards' listed sizes (``sizes.json``), else from the mean shard so far."""

    def __init__(self, label: str, shards: int, total: int | None, enabled: bool, every_s: float = 10.0):
        self.label, self.shards, self.total, self.enabled, self.every_s = (
            label,
            shards,
            total,
            enabled,
            every_s,
        )
        self.start = self.last = time.time()
        self.samples = self.done = 0

    def sample(self) -> None:
        self.samples += 1
        if self.enabled and time.time() - self.last >= self.every_s:
            self.last = time.time()
            print(self.line(), flush=True)

    def shard_done(self) -> None:
        self.done += 1

    def line(self, final: bool = False) -> str:
        from mmalign.progress import duration

        elapsed = max(time.time() - self.start, 1e-9)
        rate = self.samples / elapsed
        total = self.total
        if total is None and self.done:
            total = round(self.samples / self.done * self.shards)  # the mean shard so far
        of = f" of {'~' if self.total is None else ''}{total}" if total else ""
        eta = f", ETA {duration((total - self.samples) / rate)}" if total and rate and not final else ""
        end = f", done in {duration(elapsed)}" if final else ""
        return (
            f"mmalign: {self.label}: {self.samples}{of} samples, shard {self.done} of {self.shards} "
            f"({rate:.1f} samples/s){eta}{end}"
        )


def embed_part(
    opts: Options, urls: list[str], out: Path, rank: int, world: int, on_loaded=lambda: None
) -> dict:
    """Pass 1 for this rank's shards that are not done yet; returns its counts. ``on_loaded``
    runs once the model has loaded (rank 0 stamps OUT/pool then, the others wait for it)."""
    from mmalign.data.shards import shard_total
    from mmalign.models.load import load

    _embed_changed_again(out, urls, range(rank, len(urls), world))
    todo = [u for u in range(rank, len(urls), world) if u not in done_shards(out, len(urls))]
    counts = {"shards": len(todo), "samples": 0, "seconds": 0.0}
    if not todo and (out / POOL / STAMP).is_file():
        return counts  # everything of this rank is embedded (a resume), and stamped
    if opts.model is None:  # hashes only: never into a pool embedded with a model
        from data_pipelines.curate.hash_pass import check_unembedded

        check_unembedded(out, todo, urls)
    # also when this rank has no shard: the stamp needs a model (none: pass 1 only hashes)
    loaded = None if opts.model is None else load(opts.model, device=opts.device)
    on_loaded()
    if not todo:
        return counts
    embedder = ShardEmbedder(loaded, batch_size=opts.batch_size, device=opts.device)
    listed = [shard_total(urls[u]) if "://" not in urls[u] else None for u in todo]
    label = ("curate: embedding" if loaded else "curate: hashing (no model)") + (
        f" (rank {rank} of {world})" if world > 1 else ""
    )
    known = [c for c in listed if c is not None]
    progress = _Progress(label, len(todo), sum(known) if len(known) == len(listed) else None, opts.progress)
    for u in todo:
        stats = embedder.embed(urls[u], u, out, progress=progress.sample)
        progress.shard_done()
        counts["samples"] += stats["samples"]
        if opts.progress and sum(stats["skipped"].values()):
            print(
                f"mmalign: curate: {urls[u]}: {sum(stats['skipped'].values())} skipped "
                f"({', '.join(f'{k} {v}' for k, v in stats['skipped'].items())})",
                flush=True,
            )
    if opts.progress:
        print(progress.line(final=True), flush=True)
    counts["seconds"] = round(time.time() - progress.start, 3)
    return counts


def _changed_shards(out: Path, urls: list[str], shards) -> dict[int, str]:
    """Embedded shards among ``shards`` whose input changed since (:func:`fingerprint.changed`): number -> why."""
    from data_pipelines.curate.embed_pass import shard_files
    from data_pipelines.curate.fingerprint import changed

    done = sorted(set(shards) & done_shards(out, len(urls)))
    local = [urls[u] for u in done if "://" not in urls[u] and not urls[u].startswith("pipe:")]
    size = sum(os.path.getsize(u) for u in local if os.path.isfile(u))
    if size > 256 << 20:  # reading them takes a while: say so first
        print(
            f"mmalign: curate: checking {len(done)} embedded shard(s) against their inputs "
            f"(sha256 of {size / 2**30:.1f} GiB)",
            flush=True,
        )
    found = {}
    for u in done:
        stored = json.loads(shard_files(out, u)["stats"].read_text()).get("source")
        why = changed(stored, urls[u])
        if why is not None:
            found[u] = why
    return found


def _embed_changed_again(out: Path, urls: list[str], shards) -> None:
    """This rank's embedded shards whose input changed since: marked not done (their stats file
    removed), so that they are embedded again, each with a line saying which and why."""
    from data_pipelines.curate.embed_pass import shard_files

    for u, why in _changed_shards(out, urls, shards).items():
        print(f"mmalign: curate: {urls[u]}: {why}: embedding it again", flush=True)
        shard_files(out, u)["stats"].unlink(missing_ok=True)


def _wait_for_all(out: Path, n: int, stall_timeout_s: float, stale: dict[int, int] | None = None) -> None:
    """Rank 0: until every shard's pass-1 result exists; a one-line error after a stall. ``stale``:
    shard -> the mtime of a stats file another rank is to replace (its input changed): that
    shard is done once the file is a new one."""
    from data_pipelines.curate.embed_pass import shard_files

    stale = stale or {}

    def finished() -> set[int]:
        done = done_shards(out, n)
        for u, mtime in stale.items():
            try:
                if shard_files(out, u)["stats"].stat().st_mtime_ns == mtime:
                    done.discard(u)
            except FileNotFoundError:
                done.discard(u)
        return done

    done, last_change = len(finished()), time.time()
    while done < n:
        time.sleep(0.5)
        now = len(finished())
        if now != done:
            done, last_change = now, time.time()
        elif time.time() - last_change > stall_timeout_s:
            missing = sorted(set(range(n)) - finished())
            raise UsageError(
                f"curate: {len(missing)} shard(s) not embedded after {stall_timeout_s:.0f} s without "
                f"progress (e.g. shard {missing[0]}); another rank stopped? run again to resume"
            )


def curate(opts: Options) -> dict | None:
    """Run all passes (module docstring); returns the report on rank 0, None on other ranks."""
    check(opts)
    start = time.time()
    out = Path(opts.out)
    urls = input_shards(opts.data)
    if any(
        Path(u).resolve().parent == out.resolve()
        for u in urls
        if "://" not in u and not u.startswith("pipe:")
    ):
        raise UsageError(f"--out: {out} is where the input shards are; write the curated pool elsewhere")
    field_name = opts.policies.false_negative_field
    if field_name is not None:
        _peek_field(urls, field_name)
    rank, world = _rank()
    if rank != 0:
        return _curate(opts, urls, out, rank, world, start)
    from mmalign.dirlock import hold

    # one curate per --out for the whole run (a --nproc launcher holds it already: inherited)
    with hold(out, "mmalign curate"):
        outdir.claim(out, opts.overwrite)
        check_stamp(opts, urls, out)
        return _curate(opts, urls, out, rank, world, start)


def _curate(opts: Options, urls: list[str], out: Path, rank: int, world: int, start: float) -> dict | None:
    from data_pipelines.curate import report as report_mod
    from data_pipelines.curate.decide import check_drop, decide, load_pool
    from data_pipelines.curate.decontaminate import contamination_for_run
    from data_pipelines.curate.report import REPORT_HTML, REPORT_JSON
    from data_pipelines.curate.write_out import KEYS_FILE, write_keys, write_shards

    field_name = opts.policies.false_negative_field
    stale = {}
    if rank == 0 and world > 1:  # the other ranks' changed shards: not done until they are embedded again
        from data_pipelines.curate.embed_pass import shard_files

        others = [u for u in range(len(urls)) if u % world != 0]
        for u in _changed_shards(out, urls, others):
            try:
                stale[u] = shard_files(out, u)["stats"].stat().st_mtime_ns
            except FileNotFoundError:
                pass  # its rank removed it already: not done until it is written again
    part = embed_part(
        opts,
        urls,
        out,
        rank,
        world,
        on_loaded=(lambda: write_stamp(opts, urls, out)) if rank == 0 else (lambda: wait_stamp(out)),
    )
    if rank != 0:
        return None
    _wait_for_all(out, len(urls), opts.stall_timeout_s, stale)
    if opts.policies.needs_hashes():  # a pool embedded before pass 1 hashed: its hashes now
        from data_pipelines.curate.hash_pass import ensure_hashes

        ensure_hashes(out, urls, opts.progress)
    pool = load_pool(out, len(urls))
    if len(pool) == 0:
        from data_pipelines.curate.report import skips

        why = ", ".join(f"{k} {v}" for k, v in skips(pool.stats).items())
        raise UsageError(
            f"--data: {opts.data} holds no readable samples" + (f" (skipped: {why})" if why else "")
        )
    if field_name is not None:
        where = next((s["url"] for s in pool.stats if field_name in s["fields"]), None)
        if where is not None:
            _field_exists(field_name, where)
    t_decide = time.time()
    decisions = decide(pool, opts.policies, contamination_for_run(opts, out, pool))
    check_drop(pool, decisions, opts.policies)  # before any output is touched
    t_write = time.time()
    outdir.clear_outputs(out)  # the previous run's outputs, as its manifest lists them: nothing else
    n_out = -(-int(decisions.keep.sum()) // opts.per_shard)
    names = (
        [KEYS_FILE]
        if opts.keys_only
        else [f"{j:05d}.{ext}" for j in range(n_out) for ext in ("tar", "parquet")]
    )
    # listed before they are written: a kill mid-write leaves files the next run knows as its own
    outdir.record(out, names + ["sizes.json", REPORT_JSON, REPORT_HTML, "decisions.parquet"])
    if opts.keys_only:
        written = write_keys(out, pool, decisions.keep)
    else:
        written = write_shards(
            urls, out, pool, decisions, per_shard=opts.per_shard, seed=opts.policies.seed, field=field_name
        )
    embed_seconds = sum(s["seconds"] for s in pool.stats)
    extra = {
        "model": opts.model,
        "data": opts.data,
        "out": str(out),
        "processes": world,
        "written": written,
        "timing": {
            "embed_seconds_summed_over_shards": round(embed_seconds, 3),
            "embed_samples_per_s_per_process": round(sum(s["samples"] for s in pool.stats) / embed_seconds, 2)
            if embed_seconds
            else None,
            "this_run_rank0_embedded_shards": part["shards"],
            "decide_seconds": round(t_write - t_decide, 3),
            "write_seconds": round(time.time() - t_write, 3),
            "total_seconds": round(time.time() - start, 3),
        },
    }
    report = report_mod.summary(pool, decisions, opts.policies, extra)
    report_mod.write(out, urls, pool, decisions, report, examples=opts.examples)
    report_mod.decisions_table(out, pool, decisions)
    return report
