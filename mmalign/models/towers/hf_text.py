"""A Hugging Face text model in open_clip's HFTextEncoder, from a local folder
(``text_cfg.hf_model_name``; how the folder is checked, saved and copied: models/hf_text.py)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mmalign.models.towers.base import Tokenizer, TowerSpec, register_tower
from mmalign.models.towers.text import example_tokens

if TYPE_CHECKING:
    import torch
    from torch import nn


@register_tower("hf_text")
@dataclass
class HFTextSpec(TowerSpec):
    side = "text"
    marker = "hf_model_name"
    ships_files = True  # its transformers config and tokenizer (export_files)

    hf_model_name: str = ""
    hf_tokenizer_name: str = ""
    hf_model_pretrained: bool = True
    hf_pooler_type: str = "mean_pooler"
    hf_proj_type: str = "mlp"
    context_length: int = 77
    vocab_size: int = 49408

    @classmethod
    def claims(cls, cfg: dict[str, Any]) -> bool:
        from mmalign.models.hf_text import is_hf_text

        return is_hf_text(cfg)

    @property
    def folder(self) -> str | None:
        """The folder holds the tokenizer too (no sentencepiece file)."""
        return self.hf_model_name or self.hf_tokenizer_name or None

    def build(self, embed_dim: int, quick_gelu: bool) -> nn.Module:
        import torch
        from open_clip.model import _build_text_tower

        cfg = self.to_cfg()
        if self.hf_model_pretrained and torch.get_default_device().type == "meta":
            # check_buildable: transformers refuses from_pretrained on meta; the config gives the shapes
            cfg["hf_model_pretrained"] = False
        module: nn.Module = _build_text_tower(embed_dim, cfg, quick_gelu)
        return module

    def tokenizer(self, base_dir: str | Path | None = None) -> Tokenizer:
        from mmalign.data.tokenizer import HFTextTokenizer

        path = Path(self.hf_tokenizer_name or self.hf_model_name)
        if not path.is_absolute() and base_dir is not None:
            path = Path(base_dir) / path
        return HFTextTokenizer(path, self.context_length)

    def lock_groups(self, module: nn.Module) -> int:
        return int(getattr(module.config, "num_hidden_layers", 0))

    def open_clip_cfg(self) -> dict[str, Any]:
        return self.to_cfg()  # the exporter names the folder itself (export/to_open_clip.py)

    def onnx_tokenizer(self, tokenizer_file: str | None) -> dict[str, Any]:
        from mmalign.models.hf_text import SAVED_DIR

        return {"type": "hf", "folder": SAVED_DIR, "context_length": self.context_length}

    def export_files(self, out: Path) -> None:
        """The folder's transformers config and tokenizer (never its weights) into ``out``."""
        from mmalign.models.hf_text import copy_config_and_tokenizer

        copy_config_and_tokenizer(self.hf_model_name or self.hf_tokenizer_name, out)

    def onnx_input(self, batch: int, tokenizer: Tokenizer | None = None) -> torch.Tensor:
        return example_tokens(batch, tokenizer or self.tokenizer())  # (B, L)

    def flops(self, embed_dim: int) -> int:
        """Counted on a randomly initialised copy (transformers' encoders differ per model_type,
        and their attention masks read values, which the meta device has not)."""
        import torch

        from mmalign.models.flops import flop_counter

        module = self.replace(hf_model_pretrained=False).build(embed_dim, False).eval()
        counter = flop_counter()
        with counter, torch.no_grad():
            module(torch.ones(1, self.context_length, dtype=torch.long))
        return int(counter.get_total_flops())
