"""``mmalign train``: the training loop, top to bottom.

setup -> model -> engine (DeepSpeed: optimiser, schedule, ZeRO, gradient caching)
-> data -> resume -> loop (guarded step, monitors, periodic eval, atomic
checkpoints) -> save ``final/`` -> evaluate.  The same code runs
as one process, as ``--nproc N`` local processes, or under torchrun / the
DeepSpeed launcher / SLURM across nodes; rank 0 writes the outputs.
"""

from __future__ import annotations

import contextlib
import json
import logging
import random
import signal
import threading
import time
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from mmalign import checkpoint, progress, reshard, rundir
from mmalign import distributed as mdist
from mmalign.config import Config, ConfigError, save_config, to_dict
from mmalign.data.loader import build_train_loader
from mmalign.data.shards import check_train_shards, expand_urls, read_samples
from mmalign.data.tokenizer import build_tokenizer
from mmalign.data.transforms import describe, eval_transform, preprocess_cfg, train_transform
from mmalign.evaluation import load_suite, sharded, write_results
from mmalign.evaluation.suite import check_suite_data
from mmalign.models import TwoTower, build_model, check_buildable
from mmalign.models.io import save_pretrained
from mmalign.objective import MomentumQueue, build_objective
from mmalign.monitors import (collapse_alarms, forward_flops_per_sample, global_log_values, mfu, peak_tflops,
                              probe_stats)

log = logging.getLogger("mmalign.train")


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


def setup_logging(out: Path) -> None:
    handler = logging.FileHandler(out / "train.log")
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger("mmalign")
    root.setLevel(logging.INFO)
    root.handlers = [h for h in root.handlers if not isinstance(h, logging.FileHandler)] + [handler]


def resolve_suite(cfg: Config) -> dict | None:
    """The evaluation suite of ``eval.suite``, loaded and its data checked now, before any
    training (``none``: no evaluation, None)."""
    if str(cfg.eval.suite).strip().lower() in ("none", ""):
        return None
    suite = load_suite(cfg.eval.suite)
    check_suite_data(suite, cfg.data.val or None)
    return suite


def _say(line: str) -> None:
    """A start-up phase or a run event: one line on stdout and in train.log (rank 0 calls it)."""
    print(f"mmalign: {line}", flush=True)
    log.info("%s", line)


# ---------------------------------------------------------------- the run


class RunStopped(RuntimeError):
    """The run cannot go on (e.g. too many non-finite steps in a row); one line for the user."""


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


def _truncate_jsonl(path: Path, last_step: int) -> None:
    """On resume, drop records of steps after the checkpoint (they will be redone), and a
    line torn by a kill mid-write."""
    if not path.is_file():
        return
    keep = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue  # a torn (partly written) line
        if isinstance(record, dict) and isinstance(record.get("step"), int) and record["step"] <= last_step:
            keep.append(line)
    path.write_text("".join(line + "\n" for line in keep))


@contextlib.contextmanager
def _exit_on_sigterm():
    """SIGTERM ends the run as Ctrl-C does: Python unwinds (``finally`` blocks run, exit
    handlers stop the DataLoader workers) instead of the process vanishing and leaving its
    workers behind. Only the main thread can install a handler; elsewhere nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum, frame):
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def train(cfg: Config, show_progress: bool = True, resume: str | None = None, overwrite: bool = False) -> Path:
    """Run ``cfg`` to completion (or resume it); returns the output directory.

    Without ``resume`` the output directory must be empty or absent, or ``overwrite``
    given (which removes the earlier run's files); a resume must continue the same run
    (:mod:`mmalign.rundir`). SIGTERM stops it like Ctrl-C (its data workers too)."""
    with _exit_on_sigterm():
        return _train(cfg, show_progress, resume, overwrite)


def _train(cfg: Config, show_progress: bool, resume: str | None, overwrite: bool) -> Path:
    from mmalign.engine import Engine  # deepspeed is imported only when training

    # setup: everything that depends only on the config, the shard list and the run directory
    # is checked here, before any write and before the model and DeepSpeed are built
    info = mdist.init_from_env(require_group=True, timeout_s=cfg.dist.timeout_s)
    rank, world = mdist.get_rank(), mdist.get_world_size()
    main = rank == 0
    out = Path(cfg.output)
    check_buildable(cfg.model)
    check_train_shards(cfg.data, rank, mdist.broadcast_object)  # rank 0 looks, every rank learns the result
    suite = resolve_suite(cfg)  # a typo in eval.suite fails now, not after training
    rundir.check_fresh_start(out, resume, overwrite)
    for newest in checkpoint.candidates(out, resume)[:1]:
        rundir.check_resume(cfg, newest, checkpoint.step_of(newest))
    mdist.barrier()  # every rank has looked before rank 0 writes
    if main:
        if overwrite and out.is_dir():
            removed = rundir.clear(out)
            if removed:
                print(f"mmalign: --overwrite removed {', '.join(removed)} from {out}", flush=True)
        out.mkdir(parents=True, exist_ok=True)
        save_config(cfg, out / "config.yaml")
        setup_logging(out)
        checkpoint.clean_partial(out)
    mdist.barrier()
    rundir.check_shared(out)  # every rank sees rank 0's files (not a node-local directory)
    if main and info.source == "slurm":
        _say(f"SLURM: {world} tasks, rendezvous at {info.master_addr}:{info.master_port} ({info.master_from})")
    seed_everything(cfg.seed)  # same init on every rank (reseeded per rank once the engine is built)
    if cfg.train.threads > 0:
        torch.set_num_threads(cfg.train.threads)
    device = pick_device(cfg.train.device)
    t, mon = cfg.train, cfg.monitor
    if t.precision == "fp16" and device.type != "cuda":
        raise ConfigError("config key 'train.precision': fp16 autocast needs a GPU (use bf16 on CPU)")

    # model
    if main:
        _say(f"building model {cfg.model.preset} on {device}")
    model: TwoTower = build_model(cfg.model)
    # the objective (loss terms); a MoCo queue's EMA encoder starts as a copy of the initial
    # weights, taken before DeepSpeed partitions (ZeRO-3) or casts (bf16) the model
    objective = build_objective(cfg, world, model=model, device=device)
    queue = objective.queue  # its state is checkpointed (None without a queue term)
    model_flops = 3 * forward_flops_per_sample(model, model.image_size, model.context_length,  # fwd + bwd, train mode
                                               second_view="image2" in objective.embeddings,
                                               negatives=cfg.data.hard_negatives if "neg_text" in objective.embeddings
                                               else 0)
    model = model.to(device)
    n_params = sum(p.numel() for p in model.parameters())
    log.info("model %s: %.2fM parameters, embed_dim %d, %.2f GFLOP/sample (fwd+bwd)", cfg.model.preset,
             n_params / 1e6, model.embed_dim, model_flops / 1e9)
    tokenizer = build_tokenizer(model.arch)

    # engine (DeepSpeed: optimiser, schedule, ZeRO stage, gradient caching plan)
    if main:
        _say(f"starting DeepSpeed (ZeRO stage {cfg.deepspeed.zero_stage}, {cfg.deepspeed.precision} weights, "
             f"{world} process{'es' if world > 1 else ''})")
    engine = Engine(model, cfg)
    if main:
        _say(f"{engine.plan.describe()}, ZeRO stage {cfg.deepspeed.zero_stage}")
    # Per-rank randomness from here on (dropout, patch dropout), as open_clip does: the model's
    # init above is identical on every rank; a resume restores each rank's own RNG state.
    seed_everything(cfg.seed + rank)

    # data
    if main:
        _say(f"opening data: {len(expand_urls(cfg.data.train))} training shard(s), {cfg.data.workers} worker(s)"
             + (", reading the probe batch" if cfg.monitor.probe_size > 0 and cfg.data.val else ""))
    loader = build_train_loader(cfg.data, train_transform(model.image_size, cfg.data.augment), tokenizer,
                                engine.plan.local_batch, seed=cfg.seed, rank=rank, world_size=world,
                                grad_cache_chunk=t.grad_cache_chunk_size, pin_memory=device.type == "cuda")
    log.info(describe(cfg.data.augment, cfg.data.views))
    probe = probe_batch(cfg, model.image_size, tokenizer)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(t.precision)
    peak = peak_tflops(device, mon.peak_tflops)

    def autocast():
        return torch.autocast(device.type, dtype=dtype, enabled=dtype is not None)

    # resume: model, optimiser, schedule (DeepSpeed), RNG, step, loader position
    start, skipped_steps, consecutive = 0, 0, 0
    found = checkpoint.resume(engine, out, resume, cfg, say=lambda line: (print(line, flush=True),
                                                                        log.warning("%s", line)))
    if found is not None:
        ckpt, trainer, loader_state = found
        start, skipped_steps = trainer["step"], trainer["skipped_steps"]
        # another world size: fresh per-rank RNG, the data position converted to the new slots
        trainer, loader_state, changed = reshard.adopt(trainer, loader_state, loader.spec, cfg.seed, start, rank)
        if changed and main:
            _say(changed)
        checkpoint.set_rng_state(trainer["rng"])
        loader.load_state_dict(loader_state)
        if queue is not None:
            _load_queue(queue, ckpt)
        if main:
            print(f"mmalign: resumed from {ckpt} at step {start}", flush=True)
            log.info("resumed from %s at step %d", ckpt, start)
    elif resume and main:
        print(f"mmalign: no checkpoint in {out} yet, starting from step 0", flush=True)
    keys_path = out / f"samples_rank{rank}.jsonl"
    if main:
        _truncate_jsonl(out / "metrics.jsonl", start)
    if mon.log_sample_keys and start:
        _truncate_jsonl(keys_path, start)
    elif mon.log_sample_keys:
        keys_path.unlink(missing_ok=True)
    mode = "a" if start else "w"
    metrics_file = (out / "metrics.jsonl").open(mode) if main else None
    keys_file = keys_path.open("a") if mon.log_sample_keys else None
    board = _tensorboard(out) if main and mon.tensorboard else None

    # loop: a bar on a terminal; elsewhere (a log file, a pipe) one readable line per log_every
    if main:
        _say(f"training {t.steps - start} step(s)" + (f" (steps {start + 1}..{t.steps})" if start else "")
             + (f", evaluating on suite {suite['name']} at the end" if suite is not None else ", no evaluation"))
    batches = iter(loader)
    use_bar = show_progress and main and progress.is_terminal()
    lines = show_progress and main and not use_bar
    bar = tqdm(total=t.steps, initial=start, desc="train", disable=not use_bar, dynamic_ncols=True)
    window_start, window_samples, data_wait = time.time(), 0, 0.0
    loop_start, estimated = time.time(), False
    engine.ds.train()
    for step in range(start + 1, t.steps + 1):
        fetch = time.time()
        batch = next(batches)
        data_wait += time.time() - fetch
        batch = objective.select(batch).to(device)  # the inputs the terms read; uint8 images -> normalised
        if keys_file is not None:
            keys_file.write(json.dumps({"step": step, "keys": batch.keys}) + "\n")
            keys_file.flush()

        result = engine.step(batch, objective, autocast)
        if not result.skipped:  # terms with state follow the update (the queue: EMA, then enqueue)
            objective.after_update(engine.full_params, lambda: dict(engine.module.named_buffers()), batch,
                                   chunk=engine.plan.micro_batch, autocast=autocast)
        window_samples += len(batch) * world
        if result.skipped:
            skipped_steps += 1
            consecutive += 1
            log.warning("step %d skipped: non-finite loss or gradient (%d in a row)", step, consecutive)
            if consecutive >= t.max_consecutive_skips:
                last = checkpoint.resolve(out, "latest")
                raise RunStopped(f"{consecutive} non-finite steps in a row at step {step}; stopping. "
                                 f"Last good checkpoint: {last or 'none (nothing saved yet)'}")
        else:
            consecutive = 0

        done = step - start
        eta = (time.time() - loop_start) / done * (t.steps - step)
        if main and not estimated and step != t.steps and (step % t.log_every == 0 or time.time() - loop_start >= 10):
            # the run time as the first steps measure it, before the first log line is due
            estimated = True
            per_step = (time.time() - loop_start) / done
            _say(f"first {done} step(s): {per_step:.2f} s/step, estimated training time "
                 f"{progress.duration(per_step * (t.steps - start))} (ETA {progress.duration(eta)})")

        if step % t.log_every == 0 or step == t.steps:
            elapsed = time.time() - window_start
            sps = window_samples / max(elapsed, 1e-9)
            summed = global_log_values(result.loss, data_wait, batch.skipped)  # collective
            record = {
                "step": step,
                "loss": summed.pop("loss"),  # the global batch's loss (mean over ranks)
                "lr": engine.lr,
                "grad_norm": engine.grad_norm(),
                "samples_per_s": sps,
                "data_wait_s": summed.pop("data_wait_s"),  # summed over ranks
                "tflops": sps * model_flops / 1e12,
                "skipped_steps": skipped_steps,
                **{k: float(v) for k, v in result.stats.items() if k != "loss"},
                **summed,  # skipped_samples/<reason>, summed over ranks
            }
            if peak:
                record["mfu"] = mfu(record["tflops"], peak, world)  # over the peak of all devices
            if queue is not None:
                record["queue_fill"] = queue.fill
            if probe is not None:
                record.update(_probe(engine, probe, device, autocast))
            if main:
                # A random tower's outputs are anisotropic; judge collapse once warmup is over.
                watch = probe is not None and step > t.warmup_steps
                for alarm in collapse_alarms(record, model.embed_dim, mon.min_dim_std,
                                             mon.min_effective_rank_frac) if watch else []:
                    log.warning("COLLAPSE ALARM at step %d: %s", step, alarm)
                    bar.write(f"mmalign: COLLAPSE ALARM at step {step}: {alarm}")
                metrics_file.write(json.dumps(record) + "\n")
                metrics_file.flush()
                if board is not None:
                    for k, v in record.items():
                        if k != "step":
                            board.add_scalar(k, v, step)
                line = progress.train_line(step, t.steps, record, eta)
                log.info("%s", line)  # readable; the full record is in metrics.jsonl
                if lines:
                    print(line, flush=True)
                bar.set_postfix(loss=f"{record['loss']:.3f}", scale=f"{record.get('logit_scale', 0):.1f}",
                                sps=f"{sps:.0f}")
            window_start, window_samples, data_wait = time.time(), 0, 0.0

        if t.eval_every and step % t.eval_every == 0 and step != t.steps and suite is not None:
            records = _evaluate_engine(engine, cfg, tokenizer, out / f"eval_step{step:08d}.json", device,
                                       suite=suite, show_progress=show_progress and not use_bar)
            if main and board is not None:
                _board_eval(board, records, step)
        if t.checkpoint_every and step % t.checkpoint_every == 0 and consecutive == 0:  # no saves mid-streak
            shared = {"momentum": queue.state_dict()} if queue is not None and main else None
            checkpoint.save(engine, out, step, {"rng": checkpoint.rng_state(), "skipped_steps": skipped_steps},
                            loader.state_dict(), t.keep_checkpoints, shared=shared, config=cfg)
        bar.update(1)
    bar.close()
    for f in (metrics_file, keys_file):
        if f is not None:
            f.close()

    if main:
        _say(f"trained {t.steps - start} step(s) in {progress.duration(time.time() - loop_start)}; saving final/"
             + (f", then evaluating on suite {suite['name']}" if suite is not None else ""))
    # save consolidated fp32 weights (a collective under ZeRO-3), then evaluate them
    records = _evaluate_engine(engine, cfg, tokenizer, out / "eval.json", device, final=out / "final", suite=suite,
                               show_progress=show_progress)
    if board is not None:  # the final metrics, and the run's hyper-parameters against them
        _board_eval(board, records, t.steps, hparams=to_dict(cfg))
        board.close()
    mdist.barrier()
    return out


def _load_queue(queue: MomentumQueue, ckpt: Path) -> None:
    """Restore the EMA weights and the queue (rank 0's file, read by every rank); one-line errors."""
    state = checkpoint.load_shared(ckpt, "momentum")
    if state is None:
        raise ConfigError(f"config key 'loss.queue_size': {ckpt} holds no momentum queue (written by a run "
                          f"without one)")
    try:
        queue.load_state_dict(state)
    except (ValueError, RuntimeError, KeyError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError(f"config key 'loss.queue_size': the checkpoint's momentum queue does not fit: "
                          f"{first}") from None


@torch.no_grad()
def _probe(engine, probe: tuple, device: torch.device, autocast) -> dict:
    """Collapse indicators on the fixed probe batch (every rank runs the forward: ZeRO-3 gathers)."""
    engine.ds.eval()
    with autocast():
        out = engine.forward(probe[0].to(device), probe[1].to(device))
    engine.ds.train()
    return probe_stats(out.image.float().cpu(), out.text.float().cpu())


def _evaluate_engine(engine, cfg: Config, tokenizer, path: Path, device: torch.device,
                     final: Path | None = None, suite: dict | None = None, show_progress: bool = False) -> list[dict]:
    """Consolidate the weights (collective), then rank 0 saves ``final``, and every rank
    evaluates on ``suite`` (none: no evaluation): the embedding sharded, rank 0 the tasks."""
    state = engine.consolidated_state_dict()
    records: list[dict] = []
    main = mdist.get_rank() == 0
    with torch.random.fork_rng(devices=[]):  # building the model must not move the training RNG
        model = build_model(cfg.model)
    model.load_state_dict(state)
    if main and final is not None:
        save_pretrained(model, final, preprocess=preprocess_cfg(model.image_size),
                        extra={"train_config": to_dict(cfg)})
        log.info("saved %s", final)
    if suite is not None:  # every rank embeds its share; rank 0 runs the tasks (mmalign.evaluation.sharded)
        records = sharded.evaluate(model.to(device), eval_transform(model.image_size), tokenizer, suite,
                                   cfg.data.val, batch_size=cfg.eval.batch_size, device=str(device),
                                   model_name=cfg.model.preset, progress=show_progress and main)
        if main:
            write_results(records, path)
            log.info("evaluation written to %s", path)
    mdist.barrier()
    return records


def _tensorboard(out: Path):
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:  # tensorboard is a dependency; degrade rather than die mid-run
        log.warning("tensorboard is not importable; no event files")
        return None
    return SummaryWriter(str(out / "tensorboard"))


def _board_eval(board, records: list[dict], step: int, hparams: dict | None = None) -> None:
    """``eval/<suite>/<task>/<metric>`` scalars; with ``hparams``, TensorBoard's HPARAMS entry
    (the flattened config against the final metrics, tagged ``hparam/...``)."""
    metrics = {f"{r['dataset']}/{k}": float(v) for r in records for k, v in r["metrics"].items()
               if isinstance(v, (int, float)) and not isinstance(v, bool)}
    for k, v in metrics.items():
        board.add_scalar(f"eval/{k}", v, step)
    if hparams is not None:
        flat, todo = {}, [("", hparams)]
        while todo:
            prefix, d = todo.pop()
            for k, v in d.items():
                if isinstance(v, dict):
                    todo.append((f"{prefix}{k}.", v))
                else:  # HPARAMS takes numbers, strings and bools only
                    flat[prefix + k] = v if isinstance(v, (int, float, str, bool)) else str(v)
        board.add_hparams(flat, {f"hparam/{k}": v for k, v in metrics.items()}, run_name=".", global_step=step)
