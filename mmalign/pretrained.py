"""``mmalign.load(PATH)``: a trained model as plain Python objects.

The returned bundle follows clip_benchmark's model protocol: ``encode_image`` and
``encode_text`` return L2-normalised joint-space embeddings (after the projection
heads), ``preprocess`` maps a PIL image to a tensor and ``tokenizer(list[str])``
returns token ids.

clip_benchmark (1.6) loads models through a function returning
``(model, transform, tokenizer)``; :func:`clip_benchmark_loader` is one, so a run
plugs into its metric functions, or into its CLI after
``clip_benchmark.models.TYPE2FUNC["mmalign"] = clip_benchmark_loader`` (with
``--pretrained RUN_DIR``).  Pass ``amp=False`` to its functions on CPU: their
autocast would run the towers in bfloat16.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from mmalign.data.tokenizer import build_tokenizer
from mmalign.data.transforms import eval_transform
from mmalign.models.io import load_pretrained, resolve_model_dir
from mmalign.models.two_tower import TwoTower


@dataclass
class Loaded:
    model: TwoTower
    preprocess: Callable
    tokenizer: Callable
    config: dict

    @torch.no_grad()
    def encode_image(self, images: torch.Tensor) -> torch.Tensor:
        return self.model.encode_image(images)  # (B, D), normalised

    @torch.no_grad()
    def encode_text(self, tokens: torch.Tensor | list[str]) -> torch.Tensor:
        if isinstance(tokens, (list, str)):
            tokens = self.tokenizer(tokens)
        return self.model.encode_text(tokens)  # (B, D), normalised

    @property
    def logit_scale(self) -> float:
        return float(self.model.logit_scale.exp())


def load(path: str | Path, device: str = "cpu") -> Loaded:
    model, config = load_pretrained(path)
    model.to(device)
    return Loaded(
        model=model,
        preprocess=eval_transform(int(config["preprocess_cfg"]["size"])),
        tokenizer=build_tokenizer(model.arch, base_dir=resolve_model_dir(path)),  # a saved tokenizer.model
        config=config,
    )


def clip_benchmark_loader(model_name: str = "mmalign", pretrained: str | Path = "", cache_dir: str | None = None,
                          device: str = "cpu"):
    """clip_benchmark's loader protocol: ``pretrained`` is a run directory or its final/.

    Returns ``(model, transform, tokenizer)``: the TwoTower module (``encode_image`` /
    ``encode_text`` give normalised joint-space embeddings; ``eval()`` and ``to()`` work
    as on any module), the eval transform and ``tokenizer(list[str]) -> LongTensor``.
    ``model_name`` and ``cache_dir`` are part of the protocol and unused.
    """
    loaded = load(pretrained, device=device)
    loaded.model.eval()
    return loaded.model, loaded.preprocess, loaded.tokenizer
