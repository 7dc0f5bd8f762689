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
"""

from __future__ import annotations

from pathlib import Path

from mmalign.models.load import Loaded, load  # the one model loader (mmalign/models/load.py)


def clip_benchmark_loader(model_name: str = "mmalign", pretrained: str | Path = "", cache_dir: str | None = None,
                          device: str = "cpu"):
    """clip_benchmark's loader protocol: ``pretrained`` is a run directory, its final/, a model
    folder or a step checkpoint ``RUN/checkpoints/step_N``.

    Returns ``(model, transform, tokenizer)``: the TwoTower module (``encode_image`` /
    ``encode_text`` give normalised joint-space embeddings; ``eval()`` and ``to()`` work
    as on any module), the eval transform and ``tokenizer(list[str]) -> LongTensor``.
    ``model_name`` and ``cache_dir`` are part of the protocol and unused.
    """
    loaded = load(pretrained, device=device)
    loaded.model.eval()
    return loaded.model, loaded.preprocess, loaded.tokenizer


__all__ = ["Loaded", "clip_benchmark_loader", "load"]
