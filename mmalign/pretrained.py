"""``mmalign.load(PATH)``: a trained model as plain Python objects.

The returned bundle follows clip_benchmark's model protocol: ``encode_image`` and
``encode_text`` return L2-normalised joint-space embeddings (after the projection
heads), ``preprocess`` maps a PIL image to a tensor and ``tokenizer(list[str])``
returns token ids.
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
