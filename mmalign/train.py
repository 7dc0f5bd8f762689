"""``mmalign train``: the training loop, top to bottom.

setup -> data -> model -> engine (DeepSpeed: optimiser, schedule, ZeRO, gradient
caching) -> loop (step, log) -> save ``final/`` -> evaluate.  The same code runs
as one process, as ``--nproc N`` local processes, or under torchrun / the
DeepSpeed launcher / SLURM across nodes; rank 0 writes the outputs.
"""

from __future__ import annotations

import json
import logging
import random
import time
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from mmalign import distributed as mdist
from mmalign.config import Config, ConfigError, save_config, to_dict
from mmalign.data.loader import build_train_loader
from mmalign.data.shards import check_urls, expand_urls
from mmalign.data.tokenizer import build_tokenizer
from mmalign.data.transforms import describe, eval_transform, preprocess_cfg, train_transform
from mmalign.evaluation import load_suite, run_suite, write_results
from mmalign.losses import build_loss, caption_ids
from mmalign.models import TwoTower, build_model
from mmalign.models.io import save_pretrained

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


# ---------------------------------------------------------------- the run


def positive_ids_for(batch: dict, mode: str) -> torch.Tensor | None:
    if mode == "none":
        return None
    if mode == "caption":
        return caption_ids(batch["captions"])
    return batch["ids"]


def train(cfg: Config, show_progress: bool = True) -> Path:
    """Run ``cfg`` to completion; returns the output directory."""
    from mmalign.engine import Engine  # deepspeed is imported only when training

    # setup
    mdist.init_from_env(require_group=True)
    rank, world = mdist.get_rank(), mdist.get_world_size()
    main = rank == 0
    out = Path(cfg.output)
    if main:
        out.mkdir(parents=True, exist_ok=True)
        save_config(cfg, out / "config.yaml")
        setup_logging(out)
    mdist.barrier()
    seed_everything(cfg.seed)  # same init on every rank; data streams differ by rank
    if cfg.train.threads > 0:
        torch.set_num_threads(cfg.train.threads)
    device = pick_device(cfg.train.device)
    t = cfg.train
    if cfg.loss.false_negative_ids not in ("none", "caption"):
        raise ConfigError("config key 'loss.false_negative_ids': id fields need the full loader (not wired yet)")
    if t.precision == "fp16" and device.type != "cuda":
        raise ConfigError("config key 'train.precision': fp16 autocast needs a GPU (use bf16 on CPU)")

    # model
    model: TwoTower = build_model(cfg.model).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    log.info("model %s: %.2fM parameters, embed_dim %d", cfg.model.preset, n_params / 1e6, model.embed_dim)
    tokenizer = build_tokenizer(model.arch)

    # engine (DeepSpeed: optimiser, schedule, ZeRO stage, gradient caching plan)
    engine = Engine(model, cfg)
    if main:
        log.info("%s", engine.plan.describe())
        print(f"mmalign: {engine.plan.describe()}, ZeRO stage {cfg.deepspeed.zero_stage}", flush=True)

    # data
    urls = expand_urls(cfg.data.train)
    check_urls(urls, "data.train")
    log.info(describe(cfg.data.augment))
    loader = build_train_loader(
        urls, train_transform(model.image_size, cfg.data.augment), tokenizer, engine.plan.local_batch,
        seed=cfg.seed, rank=rank, workers=cfg.data.workers, shuffle_buffer=cfg.data.shuffle_buffer,
    )
    loss_fn = build_loss(cfg.loss)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(t.precision)

    def autocast():
        return torch.autocast(device.type, dtype=dtype, enabled=dtype is not None)

    # loop
    metrics_file = (out / "metrics.jsonl").open("w") if main else None
    batches = iter(loader)
    bar = tqdm(total=t.steps, desc="train", disable=not (show_progress and main), dynamic_ncols=True)
    window_start, window_samples, data_wait = time.time(), 0, 0.0
    engine.ds.train()
    for step in range(1, t.steps + 1):
        fetch = time.time()
        batch = next(batches)
        data_wait += time.time() - fetch
        images, tokens = batch["images"].to(device), batch["tokens"].to(device)
        ids = positive_ids_for(batch, cfg.loss.false_negative_ids)

        def loss_of(outputs: dict):
            return loss_fn(outputs["image_features"], outputs["text_features"], outputs["logit_scale"],
                           outputs.get("logit_bias"), positive_ids=ids)

        result = engine.step(images, tokens, loss_of, autocast)
        window_samples += images.shape[0] * world

        loss_value = float(result.loss.detach())
        if main and (step % t.log_every == 0 or step == t.steps):
            elapsed = time.time() - window_start
            record = {
                "step": step,
                "loss": loss_value,
                "lr": engine.lr,
                "grad_norm": engine.grad_norm(),
                "samples_per_s": window_samples / max(elapsed, 1e-9),
                "data_wait_s": data_wait,
                **{k: float(v) for k, v in result.stats.items() if k != "loss"},
            }
            metrics_file.write(json.dumps(record) + "\n")
            metrics_file.flush()
            log.info("step %d %s", step, json.dumps(record))
            bar.set_postfix(loss=f"{loss_value:.3f}", scale=f"{record['logit_scale']:.1f}",
                            sps=f"{record['samples_per_s']:.0f}")
        if step % t.log_every == 0:
            window_start, window_samples, data_wait = time.time(), 0, 0.0
        bar.update(1)
    bar.close()
    if metrics_file is not None:
        metrics_file.close()

    # save consolidated fp32 weights (a collective under ZeRO-3), then evaluate them on rank 0
    state = engine.consolidated_state_dict()
    if main:
        final_model = build_model(cfg.model)
        final_model.load_state_dict(state)
        final = save_pretrained(final_model, out / "final", preprocess=preprocess_cfg(model.image_size),
                                extra={"train_config": to_dict(cfg)})
        log.info("saved %s", final)
        evaluate_model(final_model.to(device), tokenizer, cfg, out / "eval.json", device)
    mdist.barrier()
    return out


def evaluate_model(model: TwoTower, tokenizer, cfg: Config, path: Path, device: torch.device) -> list[dict]:
    suite = load_suite(cfg.eval.suite)
    records = run_suite(model, eval_transform(model.image_size), tokenizer, suite, cfg.data.val,
                        batch_size=cfg.eval.batch_size, device=str(device), model_name=cfg.model.preset)
    write_results(records, path)
    return records
