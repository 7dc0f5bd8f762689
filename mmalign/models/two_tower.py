"""The paired encoders: a vision tower, a text tower and the learnable temperature.

No loss and no distributed code lives here: the model maps images and token ids to
L2-normalised joint-space features (after each tower's projection head) and exposes
the logit scale (and optional SigLIP bias) for the loss to use.
"""

from __future__ import annotations

import math
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from mmalign.errors import ConfigError
from mmalign.models.embeddings import Embeddings
from mmalign.models.flip import VIEW2, seeded, set_patch_dropout
from mmalign.models.packed_attention import mark_causal, pack_self_attention
from mmalign.models.text_trim import short_context, trim_tokens, trimmable
from mmalign.models.towers import Towers

# which forward keywords feed a tower, and which Embeddings fields it produces
TOWER_INPUTS = {"visual": ("images", "images2", "seeds"), "text": ("texts", "neg_texts")}
TOWER_FIELDS = {"visual": ("image", "image2"), "text": ("text", "neg_text")}


class TwoTower(nn.Module):
    """CLIP-style dual encoder built from an open_clip architecture dict.

    ``logit_scale`` stores log(scale) with shape [1]: DeepSpeed's parameter broadcast
    crashes on 0-dim parameters.  ``forward`` returns the exponentiated scale so that
    callers (and ZeRO-3, where parameters read outside ``forward`` are empty
    partitions) never touch the raw parameter.
    """

    def __init__(
        self,
        arch: dict,
        init_logit_scale: float = math.log(1 / 0.07),
        init_logit_bias: float | None = None,
        max_logit_scale: float = 100.0,
    ):
        super().__init__()
        towers = Towers.from_arch(arch)  # each tower's kind builds it (models/towers/)
        self.arch = towers.to_arch()  # the saved form: each tower's kind: explicit
        self.max_logit_scale = float(max_logit_scale)
        quick_gelu = bool(towers.quick_gelu)
        self.visual = towers.vision.build(towers.embed_dim, quick_gelu)
        self.text = towers.text.build(towers.embed_dim, quick_gelu)
        # open_clip's blocks call nn.MultiheadAttention: the same function without its layout
        # copies (models/packed_attention.py; parameters and state_dict unchanged)
        pack_self_attention(self)
        mark_causal(self.text)  # its blocks pass is_causal=True, not the additive mask (same function)
        self.logit_scale = nn.Parameter(torch.full([1], float(init_logit_scale)))
        self.logit_bias = (
            None if init_logit_bias is None else nn.Parameter(torch.full([1], float(init_logit_bias)))
        )
        # models/text_trim.py: a causal, EOT-pooled text tower ignores trailing pad columns, so
        # encode_text cuts them from CPU token tensors (exact); train.trim_text_padding: false
        # turns it off (the loop then passes full-length tokens too).
        self.text_trimmable = trimmable(self.text)
        self.trim_text = True

    @property
    def towers(self) -> Towers:
        """The typed towers of ``self.arch`` (read anew: the dict stays the saved format)."""
        return Towers.from_arch(self.arch)

    @property
    def embed_dim(self) -> int:
        return int(self.arch["embed_dim"])

    @property
    def context_length(self) -> int:
        # the tokenizer's length (an HF text tower's module reports its model's limit instead)
        return self.towers.context_length

    @property
    def image_size(self) -> int:
        return self.towers.image_size

    def lock(self, tower: str, unlocked: int = 0) -> None:
        """LiT (Zhai et al. 2022, "LiT: Zero-Shot Transfer with Locked-image text Tuning"):
        the tower's own ``lock()`` sets ``requires_grad=False`` on its weights but its last
        ``unlocked`` groups (open_clip's VisionTransformer / timm: layer groups; TextTransformer:
        layers).  A tower without ``lock()`` (or a ResNet asked for partial locking) is a
        one-line ConfigError."""
        key = {"visual": "model.lock_image", "text": "model.lock_text"}[tower]
        spec = self.towers.vision if tower == "visual" else self.towers.text
        spec.lock(getattr(self, tower), unlocked, key)

    def fully_locked(self) -> tuple[str, ...]:
        """The towers (``visual``, ``text``) none of whose weights takes a gradient."""
        return tuple(
            name
            for name in TOWER_FIELDS
            if not any(p.requires_grad for p in getattr(self, name).parameters())
        )

    def without_locked(self, inputs: dict, first: Embeddings) -> tuple[dict, dict]:
        """For a re-forward of the same rows: ``inputs`` (forward keywords) less those of the
        fully locked towers, and those towers' fields taken from ``first`` (their earlier,
        gradient-free outputs), to set on the re-forward's Embeddings."""
        inputs, reused = dict(inputs), {}
        for tower in self.fully_locked():
            for key in TOWER_INPUTS[tower]:
                inputs.pop(key, None)
            reused.update(
                {f: getattr(first, f) for f in TOWER_FIELDS[tower] if getattr(first, f) is not None}
            )
        return inputs, reused

    def _tower_order(self) -> tuple[str, ...]:
        # A fully locked tower runs last: the trainable towers' random draws (dropout, patch
        # dropout) then start at the RNG state a gradient-cache chunk recorded, and a
        # re-forward that skips the locked tower replays them exactly.
        return ("text", "visual") if "visual" in self.fully_locked() else ("visual", "text")

    def encode_image(self, images: torch.Tensor, normalize: bool = True) -> torch.Tensor:
        features = self.visual(images)  # (B, D) after the vision projection head
        return F.normalize(features, dim=-1) if normalize else features

    def encode_text(self, tokens: torch.Tensor, normalize: bool = True) -> torch.Tensor:
        if not self.text_trimmable:
            features = self.text(tokens)  # (B, D) after the text projection head
        else:
            if self.trim_text and tokens.device.type == "cpu":  # a device tensor would need a host read
                pad_id = cast(int, self.text.pad_id)  # an int attribute of open_clip's TextTransformer
                tokens = trim_tokens(tokens, pad_id=pad_id)  # (B, L') L' <= context length
            with short_context(self.text, tokens.shape[1]):  # the loop trims on the host before the copy
                features = self.text(tokens)  # (B, D)
        return F.normalize(features, dim=-1) if normalize else features

    def forward(
        self,
        images: torch.Tensor | None = None,
        texts: torch.Tensor | None = None,
        images2: torch.Tensor | None = None,
        neg_texts: torch.Tensor | None = None,
        seeds: torch.Tensor | None = None,
    ) -> Embeddings:
        """Features of whatever is given, as :class:`~mmalign.models.embeddings.Embeddings`.

        ``images2`` (B, 3, H, W), a second augmented view of ``images``, adds
        ``image2`` (B, D); ``neg_texts`` (B, k, L), k mined negative captions per
        sample, adds ``neg_text`` (B, k, D).  Each tower runs once on the
        concatenation (views / captions are independent rows of one batch): under
        ZeRO-3 its parameters are gathered once per forward, and the gradient hooks
        fire once per backward, as without the extra inputs.  A fully locked image tower
        runs after the text tower (:meth:`_tower_order`).  ``seeds`` (B,) int64, each sample's
        seed (``Batch.seeds``, on the CPU), draws each row's FLIP mask (models/flip.py).
        """
        out = Embeddings(logit_scale=self.logit_scale.exp(), logit_bias=self.logit_bias)  # (1,), (1,) or None
        if (images2 is not None and images is None) or (neg_texts is not None and texts is None):
            raise ValueError("images2 needs images and neg_texts needs texts")
        for tower in self._tower_order():
            if tower == "visual" and images is not None:
                self._image_fields(out, images, images2, seeds)
            elif tower == "text" and texts is not None:
                self._text_fields(out, texts, neg_texts)
        return out

    def _image_fields(
        self, out: Embeddings, images: torch.Tensor, images2: torch.Tensor | None, seeds: torch.Tensor | None
    ) -> None:
        rows = None if seeds is None else [int(s) for s in seeds.tolist()]  # a CPU tensor: no device sync
        if images2 is None:
            with seeded(self.visual, rows):
                out.image = self.encode_image(images)  # (B, D)
        else:
            with seeded(self.visual, None if rows is None else rows + [s ^ VIEW2 for s in rows]):
                both = self.encode_image(torch.cat([images, images2]))  # (2B, D)
            out.image, out.image2 = both.split([images.shape[0], images2.shape[0]])

    def _text_fields(self, out: Embeddings, texts: torch.Tensor, neg_texts: torch.Tensor | None) -> None:
        if neg_texts is None:
            out.text = self.encode_text(texts)  # (B, D)
        else:
            b, k, length = neg_texts.shape
            both = self.encode_text(torch.cat([texts, neg_texts.reshape(b * k, length)]))  # (B + B k, D)
            out.text = both[: texts.shape[0]]  # (B, D)
            out.neg_text = both[texts.shape[0] :].reshape(b, k, -1)  # (B, k, D)

    def set_grad_checkpointing(self, enable: bool = True) -> None:
        """Activation checkpointing through each tower's own ``set_grad_checkpointing``
        (open_clip's transformers: each block's activations are recomputed in the backward
        by ``torch.utils.checkpoint`` (non-reentrant, RNG state preserved, so dropout masks
        match the first forward)).  A tower whose method is missing or does nothing
        (open_clip's ModifiedResNet) is a ConfigError naming ``train.grad_checkpointing``."""
        for name in ("visual", "text"):
            tower = getattr(self, name)
            setter = getattr(tower, "set_grad_checkpointing", None)
            if setter is not None:
                setter(enable)
            flags = [
                getattr(m, attr)
                for m in tower.modules()
                for attr in ("grad_checkpointing", "gradient_checkpointing")
                if hasattr(m, attr)
            ]
            if enable and not any(f is True for f in flags):
                raise ConfigError(
                    f"config key 'train.grad_checkpointing': the {'image' if name == 'visual' else 'text'}"
                    f" tower ({type(tower).__name__}) does not support activation checkpointing"
                )

    def set_patch_dropout(self, prob: float) -> int:
        """FLIP (models/flip.py): the drop fraction of the image tower's patch dropout (0 = every
        patch kept, as in the last ``train.unmasked_steps``); returns how many modules it set."""
        return set_patch_dropout(self.visual, prob)

    def log_scale_range(self) -> tuple[float, float]:
        """open_clip's convention: log-scale in [0, ln max], i.e. scale in [1, max]. The one
        statement of the range: the engine clamps ZeRO's copies of the parameter into it."""
        return 0.0, math.log(self.max_logit_scale)

    @torch.no_grad()
    def clamp_logit_scale(self) -> None:
        """The logit scale clamped into :meth:`log_scale_range` (a plain-PyTorch update's clamp)."""
        self.logit_scale.clamp_(*self.log_scale_range())
