"""Evaluation on every rank: the dataset's embedding and the zero-shot classifiers are
sharded, the tasks run on rank 0.

The costly parts of a suite are embedding its images (and captions) and, for a zero-shot
task of many classes, its C x T prompts (ImageNet: 1000 x 80).  Rank r embeds samples
r, r + W, r + 2W, ... of the dataset's fixed order, and prompts r, r + W, ... of each
zero-shot task; the pieces are gathered and put back in order on every rank, so rank 0
receives exactly what one process would have computed (up to the last bits of fp32 matrix
products over other batch compositions; tests/evaluation/test_evaluation_sharded.py bounds it).  Each
classifier is built once per evaluation.  Rank 0 then runs the tasks on the gathered
features (recalls, probes, counterfactuals reuse the classifiers) and writes the results.

The other ranks wait for rank 0 in a barrier with its own timeout
(:func:`mmalign.dist.distributed.slow_barrier`), not the process group's: three times
the measured length of rank 0's last task phase on the same suite (its name and image
limit: a run may evaluate several, of very different sizes), or of the embedding x world
size before the first one, and never less than :data:`MIN_WAIT_S`.  The value is
stated in the log.
"""

from __future__ import annotations

import logging
import time

import torch

from mmalign.dist import distributed as mdist
from mmalign.errors import UsageError, UserError
from mmalign.evaluation.datasets import dataset_spec, iter_dataset
from mmalign.evaluation.features import embed_dataset, text_encoder
from mmalign.evaluation.suite import embedding_needs, embedding_total, run_suite
from mmalign.evaluation.zeroshot import classifier_from_prompts, encode_prompts, prompt_texts
from mmalign.progress import track

log = logging.getLogger("mmalign.evaluation")

MIN_WAIT_S = 600.0
WAIT_FACTOR = 3.0
_last_tasks_s: dict[tuple, float] = {}  # rank 0: its task phase at the previous evaluation of each suite


def _embed_mine(
    model,
    preprocess,
    tokenizer,
    samples,
    rank: int,
    world: int,
    batch_size: int,
    device: str,
    pre_projection: bool,
    captions: bool,
) -> dict:
    """This rank's share (every ``world``-th sample from ``rank``); empty results when it has none."""
    count = 0

    def mine():
        nonlocal count
        for i, sample in enumerate(samples):
            if i % world == rank:
                count += 1
                yield sample

    try:
        return embed_dataset(
            model, preprocess, tokenizer, mine(), batch_size, device, pre_projection, captions
        )
    except UserError:  # embed_dataset found no sample (or refused the features) on this rank
        if count:
            raise
        # no sample on this rank (fewer samples than ranks); all ranks empty is reported by interleave
        dim = int(getattr(model, "embed_dim", 0))
        return {
            "image_features": torch.zeros(0, dim),
            "text_features": torch.zeros(0, dim),
            "text_to_image": torch.zeros(0, dtype=torch.long),
            "captions": [],
            "metas": [],
            "keys": [],
        }


def interleave(parts: list[dict]) -> dict:
    """The per-rank pieces (rank r holding samples r, r + W, ...) back in dataset order."""
    world = len(parts)
    n = sum(len(p["keys"]) for p in parts)
    if n == 0:
        raise UsageError("the evaluation dataset holds no readable samples")
    out: dict = {"keys": [None] * n, "metas": [None] * n}
    for key in ("image_features", "image_pre_projection"):
        present = [p[key] for p in parts if key in p and len(p["keys"])]
        if present:
            out[key] = torch.empty(n, present[0].shape[1], dtype=present[0].dtype)  # (N, D)
    for r, p in enumerate(parts):
        out["keys"][r::world] = p["keys"]
        out["metas"][r::world] = p["metas"]
        for key in ("image_features", "image_pre_projection"):
            if key in out and len(p["keys"]):
                out[key][r::world] = p[key]
    # captions in image order, each image's own in their order: (global image, rank, local row)
    rows = sorted(
        (int(j) * world + r, r, i) for r, p in enumerate(parts) for i, j in enumerate(p["text_to_image"])
    )
    dim = parts[0]["text_features"].shape[1]
    out["text_features"] = (
        torch.stack([parts[r]["text_features"][i] for _, r, i in rows]) if rows else torch.zeros(0, dim)
    )  # (M, D)
    out["text_to_image"] = torch.tensor([g for g, _, _ in rows], dtype=torch.long)  # (M,)
    out["captions"] = [parts[r]["captions"][i] for _, r, i in rows]
    return out


@torch.no_grad()
def embed_sharded(
    model,
    preprocess,
    tokenizer,
    suite: dict,
    data: str | None = None,
    *,
    batch_size: int = 256,
    device: str = "cpu",
    progress: bool = False,
) -> tuple[dict, float]:
    """Collective: the suite dataset's embeddings on every rank, each rank computing 1/W of
    them; and the longest rank's embedding time in seconds.  ``progress``: rank 0 shows
    the pass over the dataset (every rank reads all of it and embeds its share)."""
    rank, world = mdist.get_rank(), mdist.get_world_size()
    pre_projection, captions = embedding_needs(suite["tasks"])
    was_training = model.training
    model.eval()
    start = time.time()
    try:
        spec = dataset_spec(suite, data)
        samples = track(
            iter_dataset(spec),
            f"eval {suite['name']}: embedding",
            unit="images",
            total=embedding_total(spec),
            enabled=progress and rank == 0,
        )
        local = _embed_mine(
            model, preprocess, tokenizer, samples, rank, world, batch_size, device, pre_projection, captions
        )
    finally:
        model.train(was_training)
    gathered = mdist.all_gather_object({"emb": local, "seconds": time.time() - start})
    return interleave([g["emb"] for g in gathered]), max(g["seconds"] for g in gathered)


@torch.no_grad()
def build_classifiers(model, tokenizer, suite: dict, device: str = "cpu") -> dict:
    """Collective: every zero-shot task's classifier W (D, C) on every rank, each rank encoding
    prompts r, r + W, ... of the task's C x T (class-major) and the pieces gathered."""
    rank, world = mdist.get_rank(), mdist.get_world_size()
    encode = text_encoder(model, device)  # (B, L) -> (B, D), in cache-sized pieces on a CPU
    was_training = model.training
    model.eval()
    out = {}
    try:
        for task in (t for t in suite["tasks"] if t["type"] == "zeroshot"):
            texts = prompt_texts(task["classnames"], task["templates"])
            mine = range(rank, len(texts), world)
            local = encode_prompts(encode, tokenizer, texts, mine)  # (ceil(n / W) or less, D)
            parts = mdist.all_gather_object(local)  # rank order
            emb = torch.empty(len(texts), max(p.shape[1] for p in parts))  # (C T, D)
            for r, part in enumerate(parts):
                if len(part):
                    emb[r::world] = part
            out[task["name"]] = classifier_from_prompts(emb, len(task["classnames"]), len(task["templates"]))
    finally:
        model.train(was_training)
    return out


def evaluate(
    model,
    preprocess,
    tokenizer,
    suite: dict,
    data: str | None = None,
    *,
    batch_size: int = 256,
    device: str = "cpu",
    model_name: str = "mmalign",
    progress: bool = False,
) -> list[dict]:
    """Collective: the suite's records on rank 0 (an empty list elsewhere); see the module doc."""
    rank, world = mdist.get_rank(), mdist.get_world_size()
    mdist.prepare_slow_barrier()
    last = mdist.broadcast_object(_last_tasks_s.get(_phase_key(suite)))  # rank 0's measurement, on every rank
    emb, embed_s = embed_sharded(
        model, preprocess, tokenizer, suite, data, batch_size=batch_size, device=device, progress=progress
    )
    classifiers = build_classifiers(model, tokenizer, suite, device)
    expected = last if last is not None else embed_s * world
    wait_s = max(MIN_WAIT_S, WAIT_FACTOR * expected)
    records: list[dict] = []
    if rank == 0:
        if world > 1:
            what = (
                "the last task phase"
                if last is not None
                else "the estimated task phase (embedding x world size)"
            )
            log.info(
                "evaluation %s: embedding sharded over %d ranks took %.1f s; ranks 1-%d wait for rank 0's "
                "tasks with a %.0f s timeout (%.0f x %s, %.1f s; at least %.0f s)",
                suite["name"],
                world,
                embed_s,
                world - 1,
                wait_s,
                WAIT_FACTOR,
                what,
                expected,
                MIN_WAIT_S,
            )
        start = time.time()
        records = run_suite(
            model,
            preprocess,
            tokenizer,
            suite,
            data,
            batch_size=batch_size,
            device=device,
            model_name=model_name,
            progress=progress,
            embedded=emb,
            built=classifiers,
        )
        took = _last_tasks_s[_phase_key(suite)] = time.time() - start
        log.info("evaluation %s: rank 0's tasks took %.1f s", suite["name"], took)
    mdist.slow_barrier(wait_s)
    return records


def _phase_key(suite: dict) -> tuple:
    """What a task phase's length depends on: the suite, and how many of its images are drawn."""
    dataset = suite.get("dataset")
    return suite["name"], dataset.get("limit") if isinstance(dataset, dict) else None
