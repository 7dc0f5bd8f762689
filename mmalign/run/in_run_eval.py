"""What a run evaluates, and when: the suites (checked before any training), their schedule,
the fixed probe batch of the collapse monitors, and the evaluation of the engine's weights
(in the loop on each suite's own steps, and at the end, after saving ``final/``).

The schedule (issue 32) is a list of periodic entries ``{suite, every, limit}``:

* each entry of ``eval.during``: its suite every ``every`` optimizer steps, on a seeded
  stratified draw of ``limit`` images (:mod:`mmalign.evaluation.limited`, the draw of
  ``mmalign eval --limit``), or on the whole suite;
* ``train.eval_every`` with ``eval.suite``: one more entry, ``{suite: eval.suite, every:
  train.eval_every}`` (the whole suite), with the outputs it always had.

At step s every entry with ``s % every == 0`` is due, except at the last step, whose
evaluation is the final one.  The suites due at a step are evaluated on one consolidation
of the weights, into ``eval_stepN.json`` (their records together) and TensorBoard
(``eval/<suite>/<task>/<metric>``); an ``eval.during`` suite's evaluation is also one
``metrics.jsonl`` record, ``{"step", "eval": <suite>, "images", "eval/<suite>/<task>/<metric>": ...}``
(train.eval_every's is not: readers of metrics.jsonl see what they saw before).  Each suite's
image embedding and its zero-shot classifiers' prompts are sharded over the ranks (every rank
holds the gathered classifiers, built once per evaluation); rank 0 runs the tasks
(:mod:`mmalign.evaluation.sharded`).

The final evaluation (``eval.json``, TensorBoard, and ``metrics.jsonl`` for the eval.during
suites) runs ``eval.suite`` and then every eval.during suite not already run, each once and
whole: a ``limit`` makes the periodic evaluations cheap, the final one is the full measure.
One suite name is one set of log names, so two entries of a suite (or of two different
suites of one name) are refused, as is an entry of the suite train.eval_every evaluates.

With ``train.ema_decay`` every evaluation runs twice: on the raw weights, then on the EMA
weights (:mod:`mmalign.run.ema`, consolidated once per evaluation), whose records follow the
raw ones in the same file, marked ``"weights": "ema"``, with ``+ema`` after their ``model`` and
``dataset`` (so TensorBoard's and metrics.jsonl's names, and the end-of-run headline, keep the
two apart); the final evaluation writes the EMA model to ``final_ema/`` beside ``final/``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from mmalign.config import Config, ConfigError, to_dict
from mmalign.data.shards import expand_urls, read_samples
from mmalign.data.transforms import eval_transform, preprocess_cfg
from mmalign.dist import distributed as mdist
from mmalign.evaluation import load_suite, sharded, write_results
from mmalign.evaluation.limited import limited_suite
from mmalign.evaluation.suite import check_suite_data
from mmalign.evaluation.suite_fit import check_suite_fields
from mmalign.layout.run_dir import FINAL_EMA
from mmalign.models import build_model
from mmalign.models.io import save_pretrained
from mmalign.models.siglip_hf import resize_mode
from mmalign.run.monitors import probe_stats

log = logging.getLogger("mmalign.run.train")  # the loop's log: train.log's lines keep their origin


def resolve_suite(cfg: Config) -> dict | None:
    """The evaluation suite of ``eval.suite``, loaded and its data checked now, before any
    training (``none``: no evaluation, None)."""
    if str(cfg.eval.suite).strip().lower() in ("none", ""):
        return None
    suite = load_suite(cfg.eval.suite)
    spec = check_suite_data(suite, cfg.data.val or None)
    check_suite_fields(
        suite, spec, "data.val" if cfg.data.val else "its own dataset"
    )  # a probe of a few samples
    return suite


@dataclass(frozen=True)
class Periodic:
    """One entry of the schedule: ``suite`` (loaded; with a limit, its dataset a draw of that
    many images) every ``every`` steps; ``jsonl``: its evaluations are metrics.jsonl records."""

    name: str  # the suite's name, which its log names carry
    suite: dict
    every: int
    limit: int | None
    jsonl: bool

    def describe(self) -> str:
        return f"{self.name} every {self.every} step(s)" + (f" on {self.limit} images" if self.limit else "")


@dataclass(frozen=True)
class EvalPlan:
    """What a run evaluates: ``periodic`` entries in the loop, ``final`` suites at the end."""

    periodic: tuple[Periodic, ...] = ()
    final: tuple[dict, ...] = ()

    def due(self, step: int, last: int) -> list[Periodic]:
        """The entries evaluated after ``step`` (none at the ``last``: the final evaluation's)."""
        return [p for p in self.periodic if step % p.every == 0 and step != last]

    def logged(self) -> list[str]:
        """The suites whose evaluations are metrics.jsonl records (the eval.during ones), in order."""
        return [p.name for p in self.periodic if p.jsonl]

    def final_names(self) -> str:
        """``suite A`` / ``suites A, B``: what the final evaluation runs."""
        return f"suite{'s' if len(self.final) > 1 else ''} " + ", ".join(s["name"] for s in self.final)

    def describe(self) -> str:
        """``, evaluating A every 2 step(s), ..., evaluating on suites A, B at the end`` (or no evaluation)."""
        if not self.final:
            return ", no evaluation"
        return (
            "".join(f", evaluating {p.describe()}" for p in self.periodic)
            + f", evaluating on {self.final_names()} at the end"
        )


def plan_evaluations(cfg: Config, suite: dict | None) -> EvalPlan:
    """The run's schedule and final suites, every suite loaded and its data checked now, before
    any training. ``suite``: :func:`resolve_suite`'s (``eval.suite``; None: none)."""
    periodic: list[Periodic] = []
    if suite is not None and cfg.train.eval_every:
        periodic.append(Periodic(suite["name"], suite, cfg.train.eval_every, None, jsonl=False))
    final = [suite] if suite is not None else []
    for i, entry in enumerate(cfg.eval.during):
        key = f"eval.during[{i}].suite"
        whole = _entry_suite(entry.suite, key, cfg.data.val or None)
        name = whole["name"]
        for p in periodic:
            if p.name == name:
                other = "train.eval_every (eval.suite)" if not p.jsonl else "an earlier eval.during entry"
                raise ConfigError(
                    f"config key '{key}': suite {name!r} is already evaluated during training by "
                    f"{other}: one schedule per suite (its log names are eval/{name}/...)"
                )
        same = [s for s in final if s["name"] == name]
        if same and same[0] != whole:
            raise ConfigError(
                f"config key '{key}': {entry.suite!r} and eval.suite={cfg.eval.suite!r} are two "
                f"suites of one name, {name!r}: their log names (eval/{name}/...) would mix"
            )
        if not same:
            final.append(whole)
        run = limited_suite(whole, entry.limit) if entry.limit else whole
        periodic.append(Periodic(name, run, entry.every, entry.limit, jsonl=True))
    return EvalPlan(tuple(periodic), tuple(final))


def _entry_suite(name: str, key: str, val: str | None) -> dict:
    """An eval.during entry's suite, loaded and its data checked; load_suite and
    check_suite_data word their errors for eval.suite, so they are reworded for ``key``."""
    if name.strip().lower() == "none":
        raise ConfigError(f"config key '{key}': 'none' is not a suite (drop the entry to evaluate nothing)")
    try:
        suite = load_suite(name)
        spec = check_suite_data(suite, val)
        check_suite_fields(
            suite,
            spec,
            "data.val" if val else "its own dataset",
            key="eval.suite",
            flag="suite ",
            nothing="drop the entry to evaluate nothing",
        )
    except ConfigError as e:
        raise ConfigError(str(e).replace("config key 'eval.suite'", f"config key '{key}'")) from None
    return suite


def probe_batch(cfg: Config, image_size: int, tokenizer) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The first ``monitor.probe_size`` validation pairs: a fixed batch for collapse indicators."""
    n = cfg.monitor.probe_size
    if n <= 0 or not cfg.data.val:
        return None
    transform, images, captions = eval_transform(image_size), [], []
    for sample in read_samples(expand_urls(cfg.data.val)):
        images.append(transform(sample["image"]))
        captions.append(sample["captions"][0])
        if len(images) == n:
            break
    return (torch.stack(images), tokenizer(captions)) if images else None


def model_name(cfg: Config) -> str:
    """The preset, or (its architecture taken from a pretrained folder) that folder's name."""
    if cfg.model.preset:
        return cfg.model.preset
    assert cfg.model.pretrained is not None  # resolve() sets a preset when there is no folder
    return f"pretrained:{Path(cfg.model.pretrained).name}"


@torch.no_grad()
def probe(engine, probe: tuple, device: torch.device, autocast) -> dict:
    """Collapse indicators on the fixed probe batch (every rank runs the forward: ZeRO-3 gathers)."""
    engine.eval_mode()
    out = engine.forward(
        probe[0].to(device), probe[1].to(device), autocast=autocast
    )  # inside DeepSpeed's call
    engine.train_mode()
    return probe_stats(out.image.float().cpu(), out.text.float().cpu())


def evaluate_engine(
    engine,
    cfg: Config,
    tokenizer,
    path: Path,
    device: torch.device,
    final: Path | None = None,
    suites: list[dict] | tuple = (),
    show_progress: bool = False,
    ema=None,
) -> dict[str, list[dict]]:
    """Consolidate the weights (collective), then rank 0 saves ``final``, and every rank
    evaluates each of ``suites`` in turn (none: no evaluation), the embedding sharded, rank 0
    the tasks. With ``ema`` (:class:`mmalign.run.ema.Ema`) the same again on the EMA weights
    (saved to ``final``'s sibling ``final_ema/``; results under ``<suite>+ema``). Returns suite
    name -> its records on rank 0 (empty lists elsewhere); rank 0 writes all of them, in order,
    to ``path``."""
    results: dict[str, list[dict]] = {}
    main = mdist.get_rank() == 0
    with torch.random.fork_rng(devices=[]):  # building the model must not move the training RNG
        model = build_model(cfg.model)
    weights = [("raw", engine.consolidated_state_dict, final)]
    if ema is not None:
        ema_final = None if final is None else final.parent / FINAL_EMA
        weights.append(("ema", ema.consolidated_state_dict, ema_final))
    for kind, consolidate, folder in weights:
        model.load_state_dict(consolidate())  # a collective
        if main and folder is not None:
            extra: dict = {"train_config": to_dict(cfg)}
            if kind == "ema":
                extra.update(weights="ema", ema_decay=ema.decay, ema_updates=ema.updates)
            save_pretrained(model, folder, preprocess=preprocess_cfg(model.image_size), extra=extra)
            log.info("saved %s", folder)
        if suites:
            model = model.to(device)
        for (
            suite
        ) in suites:  # every rank embeds its share; rank 0 runs the tasks (mmalign.evaluation.sharded)
            records = sharded.evaluate(
                model,
                eval_transform(model.image_size, resize_mode=resize_mode(model.arch)),  # SigLIP: no crop
                tokenizer,
                suite,
                cfg.data.val,
                batch_size=cfg.eval.batch_size,
                device=str(device),
                model_name=model_name(cfg),
                progress=show_progress and main,
            )
            if kind == "ema":
                results[suite["name"] + EMA_SUFFIX] = [ema_record(r) for r in records]
            else:
                results[suite["name"]] = records
    if main and suites:
        write_results([r for records in results.values() for r in records], path)
        log.info("evaluation written to %s", path)
    mdist.barrier()
    return results


EMA_SUFFIX = "+ema"


def ema_record(record: dict) -> dict:
    """An evaluation record of the EMA weights: marked, its model and dataset suffixed."""
    out = dict(record)
    for key in ("model", "dataset"):
        if isinstance(out.get(key), str):
            out[key] += EMA_SUFFIX
    out["weights"] = "ema"
    return out


def evaluate_due(
    plan: EvalPlan,
    step: int,
    engine,
    cfg: Config,
    tokenizer,
    out: Path,
    device: torch.device,
    runlog,
    show_progress: bool = False,
    ema=None,
) -> None:
    """The loop's evaluation after ``step``: the entries of ``plan`` due then (a collective when
    any is), into ``eval_stepN.json``, TensorBoard and (eval.during's) metrics.jsonl; with
    ``ema``, the EMA weights' too."""
    due = plan.due(step, cfg.train.steps)
    if not due:
        return
    results = evaluate_engine(
        engine,
        cfg,
        tokenizer,
        out / f"eval_step{step:08d}.json",
        device,
        suites=[p.suite for p in due],
        show_progress=show_progress,
        ema=ema,
    )
    runlog.evaluation([r for records in results.values() for r in records], step)
    for p in due:
        if p.jsonl:
            for name in _names(p.name, ema):
                runlog.eval_record(step, name, results[name])


def _names(suite: str, ema) -> list[str]:
    """The result keys of ``suite``: its own, and its EMA's when there is one."""
    return [suite] + ([suite + EMA_SUFFIX] if ema is not None else [])


def evaluate_final(
    plan: EvalPlan,
    engine,
    cfg: Config,
    tokenizer,
    out: Path,
    device: torch.device,
    runlog,
    show_progress: bool = False,
    ema=None,
) -> list[dict]:
    """After the loop: ``final/`` saved, then every final suite whole, into ``eval.json``,
    TensorBoard (with the run's hyper-parameters against these metrics) and, for the
    eval.during suites, metrics.jsonl; with ``ema``, ``final_ema/`` and the EMA weights' records
    after the raw ones. Returns the records (rank 0; empty elsewhere)."""
    results = evaluate_engine(
        engine,
        cfg,
        tokenizer,
        out / "eval.json",
        device,
        final=out / "final",
        suites=plan.final,
        show_progress=show_progress,
        ema=ema,
    )
    records = [r for found in results.values() for r in found]
    step = cfg.train.steps
    runlog.evaluation(records, step, hparams=to_dict(cfg))
    for suite in plan.logged():
        for name in _names(suite, ema):
            runlog.eval_record(step, name, results[name])
    return records
