"""``mmalign train``: the training loop, top to bottom.

setup -> data -> model -> optimizer/schedule -> loop (forward, loss, step, clamp,
log) -> save ``final/`` -> evaluate.  This is the single-process loop; the
distributed engine, gradient caching and resumable checkpoints plug in here.
"""

from __future__ import annotations

import json
import logging
import math
import random
import time
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from mmalign.config import Config, ConfigError, TrainConfig, save_config, to_dict
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


# ------------------------------------------------------------ optimisation


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """No weight decay on gains, biases, norms or the temperature (open_clip's rule:
    tensors with fewer than 2 dims, which covers all of these)."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        exclude = p.ndim < 2 or "bias" in name or "ln" in name or "norm" in name or "logit_" in name
        (no_decay if exclude else decay).append(p)
    return [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def build_optimizer(model: torch.nn.Module, t: TrainConfig) -> torch.optim.Optimizer:
    groups = param_groups(model, t.weight_decay)
    if t.optimizer == "adamw":
        return torch.optim.AdamW(groups, lr=t.lr, betas=tuple(t.betas), eps=t.eps)
    if t.optimizer == "sgd":
        return torch.optim.SGD(groups, lr=t.lr)
    raise ConfigError(f"config key 'train.optimizer': {t.optimizer!r} needs the DeepSpeed engine (not wired yet)")


def warmup_cosine(step: int, warmup: int, total: int) -> float:
    """LR multiplier: linear warmup to 1, then cosine decay to 0 at ``total``."""
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


# ---------------------------------------------------------------- the run


def positive_ids_for(batch: dict, mode: str) -> torch.Tensor | None:
    if mode == "none":
        return None
    if mode == "caption":
        return caption_ids(batch["captions"])
    return batch["ids"]


def train(cfg: Config, show_progress: bool = True) -> Path:
    """Run ``cfg`` to completion; returns the output directory."""
    # setup
    out = Path(cfg.output)
    out.mkdir(parents=True, exist_ok=True)
    save_config(cfg, out / "config.yaml")
    setup_logging(out)
    seed_everything(cfg.seed)
    if cfg.train.threads > 0:
        torch.set_num_threads(cfg.train.threads)
    device = pick_device(cfg.train.device)
    t = cfg.train
    if t.grad_cache_chunk_size or cfg.deepspeed.zero_stage:
        raise ConfigError("config keys 'train.grad_cache_chunk_size' / 'deepspeed.zero_stage' need the engine (not wired yet)")
    if cfg.loss.false_negative_ids not in ("none", "caption"):
        raise ConfigError("config key 'loss.false_negative_ids': id fields need the full loader (not wired yet)")

    # model
    model: TwoTower = build_model(cfg.model).to(device)
    n_params = sum(p.numel() for p in model.parameters())
    log.info("model %s: %.2fM parameters, embed_dim %d", cfg.model.preset, n_params / 1e6, model.embed_dim)
    tokenizer = build_tokenizer(model.arch)

    # data
    urls = expand_urls(cfg.data.train)
    check_urls(urls, "data.train")
    log.info(describe(cfg.data.augment))
    loader = build_train_loader(
        urls, train_transform(model.image_size, cfg.data.augment), tokenizer, t.global_batch_size,
        seed=cfg.seed, workers=cfg.data.workers, shuffle_buffer=cfg.data.shuffle_buffer,
    )

    # optimizer, schedule, loss
    optimizer = build_optimizer(model, t)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: warmup_cosine(s, t.warmup_steps, t.steps))
    loss_fn = build_loss(cfg.loss)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=t.precision == "bf16")

    # loop
    metrics_file = (out / "metrics.jsonl").open("w")
    batches = iter(loader)
    bar = tqdm(total=t.steps, desc="train", disable=not show_progress, dynamic_ncols=True)
    window_start, window_samples, data_wait = time.time(), 0, 0.0
    model.train()
    for step in range(1, t.steps + 1):
        fetch = time.time()
        batch = next(batches)
        data_wait += time.time() - fetch
        images, tokens = batch["images"].to(device), batch["tokens"].to(device)
        with autocast:
            outputs = model(images, tokens)
        result = loss_fn(
            outputs["image_features"].float(), outputs["text_features"].float(), outputs["logit_scale"],
            outputs.get("logit_bias"), positive_ids=positive_ids_for(batch, cfg.loss.false_negative_ids),
        )
        optimizer.zero_grad(set_to_none=True)
        result.loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), t.grad_clip if t.grad_clip > 0 else math.inf)
        optimizer.step()
        scheduler.step()
        model.clamp_logit_scale()
        window_samples += images.shape[0]

        loss_value = result.loss.item()
        if step % t.log_every == 0 or step == t.steps:
            elapsed = time.time() - window_start
            record = {
                "step": step,
                "loss": loss_value,
                "lr": scheduler.get_last_lr()[0],
                "logit_scale": float(model.logit_scale.detach().exp()),
                "grad_norm": float(grad_norm),
                "samples_per_s": window_samples / max(elapsed, 1e-9),
                "data_wait_s": data_wait,
                **{k: float(v) for k, v in result.stats.items()},
            }
            metrics_file.write(json.dumps(record) + "\n")
            metrics_file.flush()
            log.info("step %d %s", step, json.dumps(record))
            bar.set_postfix(loss=f"{loss_value:.3f}", scale=f"{record['logit_scale']:.1f}",
                            sps=f"{record['samples_per_s']:.0f}")
            window_start, window_samples, data_wait = time.time(), 0, 0.0
        bar.update(1)
    bar.close()
    metrics_file.close()

    # save, then evaluate the saved model
    final = save_pretrained(model, out / "final", preprocess=preprocess_cfg(model.image_size),
                            extra={"train_config": to_dict(cfg)})
    log.info("saved %s", final)
    evaluate_model(model, tokenizer, cfg, out / "eval.json", device)
    return out


def evaluate_model(model: TwoTower, tokenizer, cfg: Config, path: Path, device: torch.device) -> list[dict]:
    suite = load_suite(cfg.eval.suite)
    records = run_suite(model, eval_transform(model.image_size), tokenizer, suite, cfg.data.val,
                        batch_size=cfg.eval.batch_size, device=str(device), model_name=cfg.model.preset)
    write_results(records, path)
    return records
