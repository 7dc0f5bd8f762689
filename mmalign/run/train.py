"""``mmalign train``: the training loop, top to bottom.

setup -> model -> engine (DeepSpeed: optimiser, schedule, ZeRO, gradient caching)
-> data -> resume -> loop (guarded step, monitors, each suite's periodic eval
(mmalign.run.in_run_eval), atomic checkpoints) -> save ``final/`` -> evaluate.  The same code runs
as one process, as ``--nproc N`` local processes, or under torchrun / the
DeepSpeed launcher / SLURM across nodes; rank 0 writes the outputs.
"""

from __future__ import annotations

import contextlib
import logging
import random
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from mmalign import progress
from mmalign.config import Config, ConfigError, save_config
from mmalign.data.loader import StreamingLoader, build_train_loader, train_counts
from mmalign.data.shards import check_train_shards, expand_urls
from mmalign.data.transforms import describe, train_transform
from mmalign.dist import distributed as mdist
from mmalign.errors import RunStopped  # re-exported: the loop raises it
from mmalign.evaluation import headline
from mmalign.layout.run_dir import FINAL, FINAL_EMA
from mmalign.models import TwoTower, attention_kernel, build_model, check_buildable
from mmalign.models.flip import patch_dropout_at
from mmalign.models.text_trim import multiple_for, trim_batch
from mmalign.models.tokenizers import build_tokenizer
from mmalign.objective import MomentumQueue, build_objective
from mmalign.run import checkpoint, contamination_check, diskspace, rundir, trainable
from mmalign.run import signals as stop_signals
from mmalign.run.ema import Ema
from mmalign.run.in_run_eval import (
    EvalPlan,
    evaluate_due,
    evaluate_final,
    plan_evaluations,
    probe_batch,
    resolve_suite,
)
from mmalign.run.in_run_eval import model_name as _model_name
from mmalign.run.in_run_eval import probe as _probe
from mmalign.run.memory_plan import resolve_grad_cache_chunk, resolved_config
from mmalign.run.monitors import (
    collapse_alarms,
    describe_peak,
    global_log_values,
    matmul_dtype,
    mfu,
    peak_tflops,
    train_flops_per_sample,
)
from mmalign.run.resume import resume_run
from mmalign.run.runlog import RunLog, say
from mmalign.run.tf32 import set_tf32

if TYPE_CHECKING:
    from mmalign.objective.objective import Objective
    from mmalign.run.engine import Engine  # deepspeed is imported only when training

log = logging.getLogger("mmalign.run.train")


# ------------------------------------------------------------------ setup


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError("config key 'train.device': cuda requested but no CUDA device is available")
    return torch.device(name)


class _LogFile(logging.FileHandler):
    """train.log; a write a full or read-only disk refuses is one warning line, then the file is
    left alone (logging's default prints a traceback for every line that follows)."""

    failed = False

    def emit(self, record: logging.LogRecord) -> None:
        if not self.failed:
            super().emit(record)

    def handleError(self, record: logging.LogRecord) -> None:
        error = sys.exc_info()[1]
        stop = (
            diskspace.run_write_error(error, Path(self.baseFilename).parent, self.baseFilename)
            if error
            else None
        )
        if stop is None:
            super().handleError(record)
            return
        self.failed = True
        print(
            f"mmalign: warning: {self.baseFilename} is no longer written ({str(stop).split(';')[0]})",
            file=sys.stderr,
            flush=True,
        )


def setup_logging(out: Path) -> None:
    handler = _LogFile(out / "train.log")
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger("mmalign")
    root.setLevel(logging.INFO)
    for old in [h for h in root.handlers if isinstance(h, logging.FileHandler)]:  # an earlier run's train.log
        root.removeHandler(old)
        old.close()
    root.addHandler(handler)


# ---------------------------------------------------------------- the run


@contextlib.contextmanager
def _stop_on_signals():
    """SIGTERM ends the run as Ctrl-C does: Python unwinds (``finally`` blocks run, the loop
    stops the DataLoader workers) instead of the process vanishing and leaving its workers
    behind, with exit status 143. Both signals are also recorded, so that one whose exception a
    finalizer dropped still stops the run at the next step (mmalign.run.signals.check). Either
    prints one line on rank 0: which signal, the step, the last checkpoint and the command that
    resumes. Only the main thread can install a handler; elsewhere both are left as they are,
    and so is a SIGINT that the process was told to ignore (a background job)."""

    main_thread = threading.current_thread() is threading.main_thread()
    ours = [signal.SIGTERM]
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        ours.append(signal.SIGINT)
    stop_signals.clear()  # before the handlers: a signal from here on is this run's
    previous = {sig: signal.signal(sig, stop_signals.raise_terminated) for sig in ours} if main_thread else {}
    try:
        yield
    except (KeyboardInterrupt, stop_signals.Terminated) as e:
        stop_signals.report(e, mdist.get_rank(), mdist.get_world_size())
        raise
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        stop_signals.clear()


def train(
    cfg: Config,
    show_progress: bool = True,
    resume: str | None = None,
    overwrite: bool = False,
    *,
    model_checked: bool = False,
) -> Path:
    """Run ``cfg`` to completion (or resume it); returns the output directory.

    Without ``resume`` the output directory must be empty or absent, or ``overwrite``
    given (which removes the earlier run's files); a resume must continue the same run
    (:mod:`mmalign.run.rundir`). SIGTERM stops it like Ctrl-C (its data workers too).
    ``model_checked``: this process already ran :func:`~mmalign.models.check_buildable` on
    ``cfg.model`` (``mmalign train`` does, before it takes the run directory's lock)."""
    # a write refused by a full or read-only disk (metrics.jsonl, TensorBoard, final/, eval.json): one line
    with _stop_on_signals(), diskspace.stop_on_refused_write(Path(cfg.output)):
        return _train(cfg, show_progress, resume, overwrite, model_checked)


@dataclass
class _Parts:
    """What the loop runs on, built once by :func:`_build`."""

    cfg: Config
    out: Path
    device: torch.device
    world: int
    model_flops: float  # per sample, forward + backward (patch dropout's kept tokens only)
    model_flops_unmasked: float  # the same without patch dropout (FLIP's train.unmasked_steps)
    embed_dim: int
    tokenizer: object
    queue: MomentumQueue | None
    engine: Engine
    loader: StreamingLoader
    probe: tuple | None
    objective: Objective  # the loss terms and their state
    autocast: Callable[[], contextlib.AbstractContextManager[Any]]  # the autocast context of train.precision
    peak: float | None  # TFLOP/s of one device in the run's matmul dtype, for MFU; None = no MFU
    text_trim: tuple | None = None  # (pad id, length multiple) of train.trim_text_padding, None = off
    params: dict | None = (
        None  # parameter counts and tower states (mmalign.run.trainable), for the first record
    )
    ema: Ema | None = None  # train.ema_decay's moving average of the weights (None: off)


@dataclass
class _Tally:
    """What the loop counts from step to step."""

    skipped_steps: int = 0  # non-finite steps skipped in the whole run
    consecutive: int = 0  # ... in a row, up to this step
    window_start: float = 0.0  # since the last record: wall time, samples (all ranks), data wait (this rank)
    window_samples: int = 0
    window_flops: float = 0.0  # model FLOPs of those samples (masked and unmasked steps differ)
    data_wait: float = 0.0


def _train(
    cfg: Config, show_progress: bool, resume: str | None, overwrite: bool, model_checked: bool
) -> Path:
    out, evals, device = _setup(cfg, resume, overwrite, model_checked)
    rank, t, mon = mdist.get_rank(), cfg.train, cfg.monitor
    main = rank == 0
    p = _build(cfg, out, device)
    # resume: model, optimiser, schedule (DeepSpeed), RNG, step, loader position, momentum queue
    resumed = resume_run(p.engine, p.loader, p.queue, out, resume, cfg, ema=p.ema)
    start, tally = resumed.start, _Tally(skipped_steps=resumed.skipped_steps)

    # loop: a bar on a terminal; elsewhere (a log file, a pipe) one readable line per log_every
    if main:
        say(
            f"training {t.steps - start} step(s)"
            + (f" (steps {start + 1}..{t.steps})" if start else "")
            + evals.describe()
        )
    with RunLog(
        out,
        rank,
        start,
        t.steps,
        t.log_every,
        sample_keys=mon.log_sample_keys,
        tensorboard=mon.tensorboard,
        show_progress=show_progress,
    ) as runlog:
        # closed on the way out of an error or a signal: the data workers stop now, not at exit
        with contextlib.closing(iter(p.loader)) as batches:
            tally.window_start = time.time()
            p.engine.train_mode()
            for step in range(start + 1, t.steps + 1):
                stop_signals.check()  # a signal whose exception a finalizer dropped stops the run here
                batch, result = _train_step(p, step, batches, tally, runlog)
                eta = runlog.progress(step)  # and, once, the run time the first steps measure
                if logs_at(t, step):
                    _log_step(p, step, batch, result, tally, runlog, eta)
                # the suites due now (eval.during's entries, train.eval_every's), each on its own steps
                evaluate_due(
                    evals,
                    step,
                    p.engine,
                    cfg,
                    p.tokenizer,
                    out,
                    device,
                    runlog,
                    show_progress=show_progress and not runlog.use_bar,
                    ema=p.ema,
                )
                if t.checkpoint_every and step % t.checkpoint_every == 0 and tally.consecutive == 0:
                    _save_checkpoint(p, step, tally)  # no saves mid-streak
                runlog.advance()
        runlog.end_loop()
        stop_signals.check()  # the same, for a signal in the last step

        if main:
            say(
                f"trained {t.steps - start} step(s) in {progress.duration(runlog.elapsed())}; saving final/"
                + (f", then evaluating on {evals.final_names()}" if evals.final else "")
            )
        # save consolidated fp32 weights (a collective under ZeRO-3), then evaluate them on every final suite
        try:
            with diskspace.stop_on_refused_write(out, f"the final weights or evaluation in {out}"):
                records = evaluate_final(
                    evals, p.engine, cfg, p.tokenizer, out, device, runlog, show_progress, p.ema
                )
        except diskspace.RunWriteError as e:
            dropped = [_drop_partial_final(out / name) for name in (FINAL, FINAL_EMA)] if main else []
            if any(dropped):
                raise diskspace.RunWriteError(f"{e} (the partial final/ was removed)") from None
            raise
        if main and evals.final:  # the headline: zero-shot top-1/top-5, R@k, and where eval.json is
            headline.announce(records, out / "eval.json", say)
            contamination_check.announce(out, say)  # was the test set kept out of the shards
    mdist.barrier()
    return out


def _save_checkpoint(p: _Parts, step: int, tally: _Tally) -> None:
    """The step's checkpoint; a signal waits for the save: never a torn checkpoint."""
    shared = {"momentum": p.queue.state_dict()} if p.queue is not None and mdist.get_rank() == 0 else None
    with stop_signals.deferred():
        checkpoint.save(
            p.engine,
            p.out,
            step,
            {"rng": checkpoint.rng_state(), "skipped_steps": tally.skipped_steps},
            p.loader.state_dict(),
            p.cfg.train.keep_checkpoints,
            shared=shared,
            config=p.cfg,
            per_rank={"ema": p.ema.state_dict()} if p.ema is not None else None,
        )


def _drop_partial_final(final: Path) -> bool:
    """Remove ``final`` when its weights are missing or cut (a full disk mid-save), so that it
    passes neither for a finished run nor for a model; True when removed."""
    from safetensors import safe_open

    if not final.is_dir():
        return False
    try:
        with safe_open(str(final / "model.safetensors"), framework="pt") as f:
            for name in f.keys():
                f.get_slice(name)  # the header's offsets lie inside the file
        return False
    except Exception:  # noqa: BLE001 - any unreadable file: not a model
        import shutil

        shutil.rmtree(final, ignore_errors=True)
        return True


def _setup(
    cfg: Config, resume: str | None, overwrite: bool, model_checked: bool
) -> tuple[Path, EvalPlan, torch.device]:
    """Everything that depends only on the config, the shard list and the run directory is
    checked here, before any write and before the model and DeepSpeed are built; then rank 0
    prepares the run directory. Returns (run directory, what it evaluates when, device)."""
    info = mdist.init_from_env(require_group=True, timeout_s=cfg.dist.timeout_s)
    rank, world = mdist.get_rank(), mdist.get_world_size()
    main = rank == 0
    out = Path(cfg.output)
    if not model_checked:  # once per process: mmalign train checked it before taking the lock
        check_buildable(cfg.model)
    check_train_shards(cfg.data, rank, mdist.broadcast_object)  # rank 0 looks, every rank learns the result
    # a typo in eval.suite or eval.during fails now, not after training
    evals = plan_evaluations(cfg, resolve_suite(cfg))
    rundir.check_fresh_start(
        out, resume, overwrite, cfg
    )  # with cfg: a finished run is not restarted by --resume
    rundir.check_newest(out, resume, cfg)  # a changed key that changes the run: one line
    mdist.barrier()  # every rank has looked before rank 0 writes
    if main:
        if overwrite and out.is_dir():
            removed = rundir.clear(out)
            if removed:
                print(f"mmalign: --overwrite removed {', '.join(removed)} from {out}", flush=True)
        out.mkdir(parents=True, exist_ok=True)
        save_config(cfg, out / "config.yaml")
        contamination_check.record(cfg, out)  # data.decontaminate's start-up result, if checked
        setup_logging(out)
        checkpoint.clean_partial(out)
    mdist.barrier()
    rundir.check_shared(out)  # every rank sees rank 0's files (not a node-local directory)
    if main and info.source == "slurm":
        say(f"SLURM: {world} tasks, rendezvous at {info.master_addr}:{info.master_port} ({info.master_from})")
    seed_everything(cfg.seed)  # same init on every rank (reseeded per rank once the engine is built)
    if cfg.train.threads > 0:
        torch.set_num_threads(cfg.train.threads)
    device = pick_device(cfg.train.device)
    set_tf32(device, cfg.train.tf32)  # CUDA only; before the model's first matmul
    attention_kernel.set_mode(cfg.train.attention_kernel)  # CPU bf16: the measured fastest SDPA kernel
    if cfg.train.precision == "fp16" and device.type != "cuda":
        raise ConfigError("config key 'train.precision': fp16 autocast needs a GPU (use bf16 on CPU)")
    return out, evals, device


def _build(cfg: Config, out: Path, device: torch.device) -> _Parts:
    """The model, its momentum queue, the engine, the data and the loss."""
    from mmalign.run.engine import Engine  # deepspeed is imported only when training

    rank, world = mdist.get_rank(), mdist.get_world_size()
    main = rank == 0
    t, mon = cfg.train, cfg.monitor

    # model
    if main:
        say(f"building model {_model_name(cfg)} on {device}")
    model: TwoTower = build_model(cfg.model)
    # the objective (loss terms); a MoCo queue's EMA encoder starts as a copy of the initial
    # weights, taken before DeepSpeed partitions (ZeRO-3) or casts (bf16) the model
    objective = build_objective(cfg, world, model=model, device=device)
    queue = objective.queue  # its state is checkpointed (None without a queue term)
    model = model.to(device)
    # exact trailing-padding trim (models/text_trim.py): on the host, before each batch's copy
    model.trim_text = t.trim_text_padding
    text_trim = (
        (model.text.pad_id, multiple_for(device)) if t.trim_text_padding and model.text_trimmable else None
    )
    flops_kw: dict[str, Any] = {
        "second_view": "image2" in objective.embeddings,
        "negatives": cfg.data.hard_negatives if "neg_text" in objective.embeddings else 0,
    }
    # fwd + bwd, train mode, on the device (its attention kernels), text at the full context length
    # (the count turns the trim off): patch dropout (FLIP) counts only the kept tokens; its unmasked
    # steps all of them
    model_flops = model_flops_unmasked = train_flops_per_sample(
        model, model.image_size, model.context_length, **flops_kw
    )
    if cfg.model.patch_dropout:
        model.set_patch_dropout(0.0)
        model_flops_unmasked = train_flops_per_sample(
            model, model.image_size, model.context_length, **flops_kw
        )
        model.set_patch_dropout(cfg.model.patch_dropout)
    n_params = sum(p.numel() for p in model.parameters())
    log.info(
        "model %s: %.2fM parameters, embed_dim %d, %.4g GFLOP/sample (fwd+bwd)",
        _model_name(cfg),
        n_params / 1e6,
        model.embed_dim,
        model_flops / 1e9,
    )
    params = trainable.param_counts(
        model, cfg.model
    )  # LiT: which towers learn; before ZeRO-3 partitions them
    if main:
        say(trainable.describe(params))
    tokenizer = build_tokenizer(model.arch)

    # train.grad_cache_chunk_size: auto -> an integer, measured on every rank, the same on all
    # (a collective); the engine and the loader are built from it, checkpoints keep the run's cfg
    chunk, chunk_line = resolve_grad_cache_chunk(cfg, model, objective, tokenizer, device)
    if chunk_line is not None and main:
        say(chunk_line)
    run_cfg = cfg if chunk_line is None else resolved_config(cfg, chunk)

    # engine (DeepSpeed: optimiser, schedule, ZeRO stage, gradient caching plan)
    if main:
        say(
            f"starting DeepSpeed (ZeRO stage {cfg.deepspeed.zero_stage}, {cfg.deepspeed.precision} weights, "
            f"{world} process{'es' if world > 1 else ''})"
        )
    engine = Engine(model, run_cfg)
    # train.ema_decay: this rank's pieces of the fp32 master weights, averaged from the first weights on
    ema = Ema(engine, t.ema_decay, t.ema_warmup) if t.ema_decay > 0 else None
    if main:
        say(
            f"{engine.plan.describe()}, ZeRO stage {engine.stage}"
            + (
                f" (deepspeed.zero_stage={cfg.deepspeed.zero_stage}: nothing to partition on one process)"
                if engine.stage != cfg.deepspeed.zero_stage
                else ""
            )
        )
    # Per-rank randomness from here on (tower dropout), as open_clip does: the model's init above
    # is identical on every rank; a resume restores each rank's own RNG state.  Everything a
    # sample draws (augmentation, caption, FLIP mask) is keyed by the sample instead (issue 30).
    seed_everything(cfg.seed + rank)
    line = trainable.dropout_line(model)
    if line is not None and main:
        say(line)

    # data
    if main:
        say(
            f"opening data: {len(expand_urls(cfg.data.train))} training shard(s), {cfg.data.workers} worker(s)"
            + (", reading the probe batch" if cfg.monitor.probe_size > 0 and cfg.data.val else "")
        )
    # the global sample order is built from the shards' sample counts: rank 0 counts, every rank learns
    counts = mdist.broadcast_object(train_counts(cfg.data) if main else None)
    loader = build_train_loader(
        cfg.data,
        train_transform(model.image_size, cfg.data.augment),
        tokenizer,
        engine.plan.local_batch,
        seed=cfg.seed,
        rank=rank,
        world_size=world,
        counts=counts,
        # the configured chunk, not auto's choice: the workers' pieces (and
        # so the loader's resumable state) follow the config alone
        grad_cache_chunk=t.grad_cache_chunk_size if isinstance(t.grad_cache_chunk_size, int) else 0,
        pin_memory=device.type == "cuda",
        teacher="teacher_image" in objective.batch_fields,  # loss.distill.teacher: stored
    )
    log.info(describe(cfg.data.augment, cfg.data.views))
    probe = probe_batch(cfg, model.image_size, tokenizer)
    flops_dtype = matmul_dtype(cfg, device)  # MFU over the peak of the dtype the matmuls actually run in
    peak = peak_tflops(device, mon.peak_tflops, flops_dtype)
    log.info("%s", describe_peak(device, mon.peak_tflops, flops_dtype))
    # train.precision's autocast: the engine's own (entered inside DeepSpeed's call), also for the
    # momentum queue's EMA encoder, which runs outside the engine
    return _Parts(
        cfg,
        out,
        device,
        world,
        model_flops,
        model_flops_unmasked,
        model.embed_dim,
        tokenizer,
        queue,
        engine,
        loader,
        probe,
        objective,
        engine.autocast,
        peak,
        text_trim,
        params,
        ema,
    )


def _train_step(p: _Parts, step: int, batches, tally: _Tally, runlog: RunLog) -> tuple:
    """One step: the next batch, the engine's guarded update, the momentum queue, the count of
    skipped steps (too many in a row stop the run). Returns (batch, StepResult)."""
    engine, objective = p.engine, p.objective
    fetch = time.time()
    batch = next(batches)
    tally.data_wait += time.time() - fetch
    batch = objective.select(batch)  # the inputs the terms read
    if p.text_trim is not None:  # trailing pad columns cut on the host (exact: models/text_trim.py)
        batch = trim_batch(batch, *p.text_trim)
    batch = batch.to(p.device)  # uint8 images -> normalised
    runlog.sample_keys(step, batch.keys)
    masking = patch_dropout_at(
        p.cfg, step
    )  # FLIP: 0 in the last train.unmasked_steps (from the step: resumes agree)
    engine.module.set_patch_dropout(masking)
    # the loss's stats and rank tracks (an all_reduce and a host read) only where they are logged
    result = engine.step(batch, objective, p.autocast, stats=logs_at(p.cfg.train, step))
    if not result.skipped and p.ema is not None:  # train.ema_decay: the average follows each update
        p.ema.update()
    if not result.skipped:  # terms with state follow the update (the queue: EMA, then enqueue)
        objective.after_update(
            engine.full_params,
            lambda: dict(engine.named_buffers()),
            batch,
            chunk=engine.plan.micro_batch,
            autocast=p.autocast,
        )
    tally.window_samples += len(batch) * p.world
    tally.window_flops += len(batch) * p.world * (p.model_flops if masking else p.model_flops_unmasked)
    if result.skipped:
        tally.skipped_steps += 1
        tally.consecutive += 1
        log.warning("step %d skipped: non-finite loss or gradient (%d in a row)", step, tally.consecutive)
        if tally.consecutive >= p.cfg.train.max_consecutive_skips:
            last = checkpoint.resolve(p.out, "latest")
            raise RunStopped(
                f"{tally.consecutive} non-finite steps in a row at step {step}; stopping. "
                f"Last good checkpoint: {last or 'none (nothing saved yet)'}"
            )
    else:
        tally.consecutive = 0
    return batch, result


def logs_at(t, step: int) -> bool:
    """Whether ``step`` writes a record (every ``train.log_every`` steps, and the last)."""
    return step % t.log_every == 0 or step == t.steps


def _log_step(p: _Parts, step: int, batch, result, tally: _Tally, runlog: RunLog, eta: float | None) -> None:
    """The record of ``step`` (a collective: the global loss, data wait and skipped samples;
    every rank runs the probe), written by rank 0; the throughput window restarts."""
    t, mon, engine = p.cfg.train, p.cfg.monitor, p.engine
    elapsed = time.time() - tally.window_start
    sps = tally.window_samples / max(elapsed, 1e-9)
    summed = global_log_values(result.loss, tally.data_wait, batch.skipped)  # collective
    achieved = tally.window_flops / max(elapsed, 1e-9)  # model FLOP/s of all ranks together
    record: dict[str, Any] = {  # a metrics.jsonl line
        "step": step,
        "loss": summed.pop("loss"),  # the global batch's loss (mean over ranks)
        "lr": engine.lr,
        "grad_norm": engine.grad_norm(),
        "samples_per_s": sps,
        "data_wait_s": summed.pop("data_wait_s"),  # summed over ranks
        "tflops": achieved / 1e12,
        "skipped_steps": tally.skipped_steps,
        **{k: float(v) for k, v in result.stats.items() if k != "loss"},
        **summed,  # skipped_samples/<reason>, summed over ranks
    }
    if p.device.type == "cpu":
        record["gflops"] = achieved / 1e9  # no CPU peak, so no MFU: the achieved rate, at a CPU's scale
    if p.peak:  # known (a listed GPU in the run's dtype, or monitor.peak_tflops): MFU
        record["mfu"] = mfu(record["tflops"], p.peak, p.world)  # over the peak of all devices
    if p.queue is not None:
        record["queue_fill"] = p.queue.fill
    if p.probe is not None:
        record.update(_probe(engine, p.probe, p.device, p.autocast))
    # A random tower's outputs are anisotropic; judge collapse once warmup is over.
    watch = runlog.main and p.probe is not None and step > t.warmup_steps
    alarms = (
        collapse_alarms(record, p.embed_dim, mon.min_dim_std, mon.min_effective_rank_frac) if watch else []
    )
    with diskspace.stop_on_refused_write(p.out, f"the run's logs in {p.out} (metrics.jsonl, TensorBoard)"):
        runlog.record(step, record, eta, alarms, once=p.params)  # the first record also holds the counts
    tally.window_start, tally.window_samples, tally.window_flops, tally.data_wait = time.time(), 0, 0.0, 0.0
