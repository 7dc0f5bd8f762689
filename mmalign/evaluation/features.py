"""Embedding an evaluation set: which features, computed once per suite.

Two kinds of image features:

- ``joint`` (the default everywhere): what ``TwoTower.encode_image`` returns, the
  L2-normalised joint-space embedding AFTER the vision projection head.  Zero-shot,
  retrieval, diagnostics and counterfactuals use only these.
- ``pre_projection``: open_clip's ``VisionTransformer`` pools (class token or mean,
  after ``ln_post``) and then multiplies by ``visual.proj``.  These features are the
  pooled vector BEFORE that multiplication, L2-normalised here so that probes treat
  both kinds alike.  They are the usual choice for linear probes of the backbone.

Both come from one forward pass: the projection is taken off for the pass and the
joint embedding is computed from the pooled vector as ``normalize(pooled @ proj)``,
the very operations the tower would have done.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F

from mmalign.config import ConfigError
from mmalign.errors import UsageError
from mmalign.models.cpu_chunks import image_tokens, in_pieces, piece_size

FEATURE_KINDS = {
    "joint": "joint-space image embedding after the projection head (encode_image), L2-normalised",
    "pre_projection": "pooled vision-tower output before visual.proj (after ln_post), L2-normalised",
}


@contextmanager
def projection_removed(visual: torch.nn.Module) -> Iterator[torch.Tensor]:
    """Inside the block ``visual(x)`` returns pooled features; yields the (P, D) projection."""
    proj = getattr(visual, "proj", None)
    if not isinstance(proj, torch.Tensor):
        raise ConfigError(
            f"pre_projection features need a vision tower with a 'proj' matrix "
            f"(open_clip VisionTransformer); {type(visual).__name__} has none"
        )
    visual.proj = None  # type: ignore[assignment]  # open_clip's forward skips the projection when proj is None
    try:
        yield proj
    finally:
        visual.proj = proj


@torch.no_grad()
def encode_images(model, images: torch.Tensor, pre_projection: bool = False) -> dict:
    """(B, 3, H, W) -> {"joint": (B, D)} and, if asked, {"pre_projection": (B, P)}, float32 on CPU.

    On a CPU the tower runs in cache-sized pieces of the batch (:mod:`mmalign.models.cpu_chunks`)."""
    visual = getattr(model, "visual", None)  # None: a stand-in model, called whole
    size = piece_size(visual, image_tokens(visual), images.device) if visual is not None else None
    if not pre_projection:
        return {"joint": in_pieces(model.encode_image, images, size).float().cpu()}
    with projection_removed(model.visual) as proj:
        pooled = in_pieces(model.visual, images, size)  # (B, P)
    joint = F.normalize(pooled @ proj, dim=-1)  # (B, D), as encode_image computes it
    return {"joint": joint.float().cpu(), "pre_projection": F.normalize(pooled.float(), dim=-1).cpu()}


@torch.no_grad()
def embed_images(
    model,
    preprocess,
    images: Iterable,
    batch_size: int = 256,
    device: str = "cpu",
    pre_projection: bool = False,
) -> dict:
    """PIL images -> {"joint": (N, D)[, "pre_projection": (N, P)]}.

    Reading, decoding and preprocessing run in a background thread, one batch ahead of the
    encoder (:func:`_prefetched`): PIL's decoders and torch's ops release the GIL, so on a CPU
    the next batch is made while the tower runs (on CIFAR-sized images they are a third of
    the work).  ``images`` is consumed in order, so a generator's side effects happen in order.
    """
    out: dict[str, list] = {}
    for batch in _prefetched(_batches(preprocess, images, batch_size)):
        for kind, feats in encode_images(model, batch.to(device), pre_projection).items():
            out.setdefault(kind, []).append(feats)
    return {kind: torch.cat(feats) for kind, feats in out.items()}


def _batches(preprocess, images: Iterable, batch_size: int) -> Iterator[torch.Tensor]:
    batch: list[torch.Tensor] = []
    for image in images:
        batch.append(preprocess(image))
        if len(batch) == batch_size:
            yield torch.stack(batch)  # (B, 3, H, W)
            batch = []
    if batch:
        yield torch.stack(batch)


def _prefetched(batches: Iterator[torch.Tensor], depth: int = 2) -> Iterator[torch.Tensor]:
    """``batches`` made in a daemon thread, at most ``depth`` ahead; its exception re-raised here."""
    import queue
    import threading

    q: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()
    done = object()

    def produce() -> None:
        try:
            for batch in batches:
                while not stop.is_set():
                    try:
                        q.put(("batch", batch), timeout=0.1)
                        break
                    except queue.Full:
                        continue
                if stop.is_set():
                    return
            q.put(("end", done))
        except BaseException as e:  # noqa: BLE001 - handed to the consumer, which raises it
            q.put(("error", e))

    thread = threading.Thread(target=produce, name="mmalign-eval-prefetch", daemon=True)
    thread.start()
    try:
        while True:
            kind, item = q.get()
            if kind == "end":
                return
            if kind == "error":
                raise item
            yield item
    finally:
        stop.set()  # the consumer stopped early (an error in the encoder): let the producer end
        thread.join(timeout=5)


def text_encoder(model, device: str = "cpu"):
    """tokens (B, L) -> (B, D) float32 on the CPU: ``model.encode_text`` on ``device``, in
    cache-sized pieces on a CPU (sized by the batch's longest caption: the tower trims the
    padding after it)."""
    text = getattr(model, "text", None)

    def encode(tokens: torch.Tensor) -> torch.Tensor:
        size = None
        if text is not None and tokens.ndim == 2 and len(tokens):
            size = piece_size(text, int((tokens != 0).sum(dim=1).max()), device)  # pad id 0
        return in_pieces(lambda t: model.encode_text(t.to(device)).float().cpu(), tokens, size)

    return encode


def embed_texts(
    model, tokenizer, texts: list[str], batch_size: int = 256, device: str = "cpu"
) -> torch.Tensor:
    """Captions -> (M, D) normalised joint-space text embeddings (M may be 0)."""
    encode = text_encoder(model, device)
    feats = [encode(tokenizer(texts[s : s + batch_size])) for s in range(0, len(texts), batch_size)]
    if not feats:
        return torch.zeros(0, int(getattr(model, "embed_dim", 0)))
    return torch.cat(feats)


@torch.no_grad()
def embed_dataset(
    model,
    preprocess,
    tokenizer,
    samples: Iterable[dict],
    batch_size: int = 256,
    device: str = "cpu",
    pre_projection: bool = False,
    captions: bool = True,
) -> dict:
    """Images and every caption of ``samples`` -> normalised embeddings and metadata.

    ``captions=False`` embeds no caption (text features (0, D), no owners): zero-shot and
    probe tasks never read them, and a ``.txt`` of 18 templates would cost 18 text
    passes per image for nothing.
    """
    texts: list[str] = []
    text_to_image: list[int] = []
    metas: list[dict] = []
    keys: list[str] = []

    def images():  # records metadata while the images stream through the encoder
        for i, sample in enumerate(samples):
            keys.append(sample["key"])
            metas.append(sample["json"])
            if captions:
                texts.extend(sample["captions"])
                text_to_image.extend([i] * len(sample["captions"]))
            yield sample["image"]

    feats = embed_images(model, preprocess, images(), batch_size, device, pre_projection)
    if not keys:
        raise UsageError("the evaluation dataset holds no readable samples")
    out = {
        "image_features": feats["joint"],  # (N, D)
        "text_features": embed_texts(model, tokenizer, texts, batch_size, device),  # (M, D)
        "text_to_image": torch.tensor(text_to_image, dtype=torch.long),  # (M,)
        "captions": texts,  # (M,) the texts embedded
        "metas": metas,
        "keys": keys,
    }
    if pre_projection:
        out["image_pre_projection"] = feats["pre_projection"]  # (N, P)
    return out
