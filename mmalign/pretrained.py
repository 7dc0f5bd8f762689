"""``mmalign.load(PATH)``: a trained model as plain Python objects.

:func:`load` is :func:`mmalign.models.load.load` (a run directory, its ``final/``, a
model folder or ``RUN/checkpoints/step_N``).  The returned bundle follows clip_benchmark's
model protocol: ``encode_image`` and ``encode_text`` return L2-normalised joint-space
embeddings (after the projection heads), ``preprocess`` maps a PIL image to a tensor and
``tokenizer(list[str])`` returns token ids.

clip_benchmark (1.6) loads models through a function returning
``(model, transform, tokenizer)``; :func:`clip_benchmark_loader` is one, so a run
plugs into its metric functions, or into its CLI after
``clip_benchmark.models.TYPE2FUNC["mmalign"] = clip_benchmark_loader`` (with
``--pretrained RUN_DIR``).  Pass ``amp=False`` to its functions on CPU: their
autocast would run the towers in bfloat16.

Under our pins (numpy >= 2.4) clip_benchmark 1.6.2's zero-shot classification fails in
its ``metrics.zeroshot_classification.accuracy``, which calls ``float()`` on a
one-element array.  :func:`patch_clip_benchmark` replaces that one function with an
equivalent that returns the same numbers as plain floats; :func:`clip_benchmark_loader`
applies it every time clip_benchmark loads a model through it (so its CLI's
classification works), and it does nothing where the installed ``accuracy`` works.
"""

from __future__ import annotations

from pathlib import Path

from mmalign.models.load import Loaded, load  # the one model loader (mmalign/models/load.py)


def clip_benchmark_loader(
    model_name: str = "mmalign",
    pretrained: str | Path = "",
    cache_dir: str | None = None,
    device: str = "cpu",
):
    """clip_benchmark's loader protocol: ``pretrained`` is a run directory, its final/, a model
    folder or a step checkpoint ``RUN/checkpoints/step_N``.

    Returns ``(model, transform, tokenizer)``: the TwoTower module (``encode_image`` /
    ``encode_text`` give normalised joint-space embeddings; ``eval()`` and ``to()`` work
    as on any module), the eval transform and ``tokenizer(list[str]) -> LongTensor``.
    ``model_name`` and ``cache_dir`` are part of the protocol and unused.  Applies
    :func:`patch_clip_benchmark` first (clip_benchmark is loading the model, so it is installed).
    """
    patch_clip_benchmark()
    loaded = load(pretrained, device=device)
    loaded.model.eval()
    return loaded.model, loaded.preprocess, loaded.tokenizer


def _topk_accuracy(output, target, topk=(1,)):
    """Top-k accuracies of logits ``output`` (N, C) for labels ``target`` (N,), one float per k in
    ``topk``: the share of rows whose label is among their k highest logits, ranked by
    ``torch.topk`` as clip_benchmark ranks them (so exact ties fall the same way)."""
    top = output.topk(max(topk), dim=1, largest=True, sorted=True).indices  # (N, kmax)
    hits = top == target.view(-1, 1)  # (N, kmax): at most one True per row
    n = len(target)
    # a count over n: the same float clip_benchmark divides out, as a Python float
    return [int(hits[:, :k].any(dim=1).sum()) / n for k in topk]


_topk_accuracy.mmalign_shim = True  # type: ignore[attr-defined]  # marks the replacement, so patching twice is a no-op


def _accuracy_works(accuracy) -> bool:
    import torch

    try:
        values = accuracy(torch.tensor([[0.0, 1.0], [1.0, 0.0]]), torch.tensor([1, 1]), topk=(1,))
    except TypeError:
        return False
    return values == [0.5]


def patch_clip_benchmark() -> bool:
    """Make clip_benchmark's zero-shot classification work under numpy >= 2.4.

    clip_benchmark 1.6.2's ``metrics.zeroshot_classification.accuracy`` converts a
    one-element array with ``float()``, which numpy 2.4 refuses (``TypeError: only
    0-dimensional arrays can be converted to Python scalars``); its ``evaluate`` (and so its
    CLI's ``--task zeroshot_classification``) then fails after embedding the whole dataset.
    This swaps in :func:`_topk_accuracy` (same arguments, same values, plain floats), only
    when the installed function fails on a two-row probe, and only once.  Returns True when
    the replacement is in place (now or from an earlier call), False when nothing needed it
    or clip_benchmark is not installed.
    """
    try:
        from clip_benchmark.metrics import zeroshot_classification as zsc
    except ImportError:
        return False
    if getattr(zsc.accuracy, "mmalign_shim", False):
        return True
    if _accuracy_works(zsc.accuracy):
        return False
    zsc.accuracy = _topk_accuracy  # evaluate() looks the name up in its module at call time
    return True


__all__ = ["Loaded", "clip_benchmark_loader", "load", "patch_clip_benchmark"]
