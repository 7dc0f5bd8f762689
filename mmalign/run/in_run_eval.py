"""What a run evaluates, and when: the suite of ``eval.suite`` (checked before any training),
the fixed probe batch of the collapse monitors, and the evaluation of the engine's weights
(in the loop every ``train.eval_every`` steps, and at the end, after saving ``final/``).
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from mmalign.config import Config, to_dict
from mmalign.data.shards import expand_urls, read_samples
from mmalign.data.transforms import eval_transform, preprocess_cfg
from mmalign.dist import distributed as mdist
from mmalign.evaluation import load_suite, sharded, write_results
from mmalign.evaluation.suite import check_suite_data
from mmalign.models import build_model
from mmalign.models.io import save_pretrained
from mmalign.run.monitors import probe_stats

log = logging.getLogger("mmalign.run.train")  # the loop's log: train.log's lines keep their origin


def resolve_suite(cfg: Config) -> dict | None:
    """The evaluation suite of ``eval.suite``, loaded and its data checked now, before any
    training (``none``: no evaluation, None)."""
    if str(cfg.eval.suite).strip().lower() in ("none", ""):
        return None
    suite = load_suite(cfg.eval.suite)
    check_suite_data(suite, cfg.data.val or None)
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
    return cfg.model.preset or f"pretrained:{Path(cfg.model.pretrained).name}"


@torch.no_grad()
def probe(engine, probe: tuple, device: torch.device, autocast) -> dict:
    """Collapse indicators on the fixed probe batch (every rank runs the forward: ZeRO-3 gathers)."""
    engine.eval_mode()
    out = engine.forward(probe[0].to(device), probe[1].to(device), autocast=autocast)  # inside DeepSpeed's call
    engine.train_mode()
    return probe_stats(out.image.float().cpu(), out.text.float().cpu())


def evaluate_engine(engine, cfg: Config, tokenizer, path: Path, device: torch.device,
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
                                   model_name=model_name(cfg), progress=show_progress and main)
        if main:
            write_results(records, path)
            log.info("evaluation written to %s", path)
    mdist.barrier()
    return records

