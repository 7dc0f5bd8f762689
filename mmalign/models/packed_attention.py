"""Batch-first self-attention without the layout round trips of ``nn.MultiheadAttention``.

open_clip's transformer blocks call ``nn.MultiheadAttention(x, x, x, need_weights=False)``
on (B, N, E) activations.  In training, torch's generic path then transposes to (N, B, E),
splits the packed q/k/v projection with ``unflatten -> transpose -> contiguous`` and indexes
``[0]``, ``[1]``, ``[2]``, and transposes back.  Measured on the tiny ViT at batch 256
(2 CPU cores) those copies, and the backward of the three index ops (each zero-fills a
(3, N, B, E) buffer before adding its slice), cost about 15% of the vision tower's step.

:class:`PackedSelfAttention` computes the same function from the same parameters: one
(B, N, 3E) projection viewed as (B, N, 3, H, E/H) and split with ``unbind`` (its backward is
one stack, no zero fill), ``scaled_dot_product_attention`` on (B, H, N, E/H) views, one
reshape back and the output projection.  Anything off that path (cross-attention, a key
padding mask, returned weights, a boolean mask, bias_k / zero-attention, sequence-first
layout) goes to ``nn.MultiheadAttention.forward`` unchanged.  :func:`pack_self_attention`
switches the class of a model's plain ``nn.MultiheadAttention`` modules in place:
parameter names, ``state_dict`` and exports are untouched.

The attention itself runs through :mod:`mmalign.models.attention_kernel` (the SDPA kernel per
device and dtype).  A module marked by :func:`mark_causal` (the blocks of an open_clip text
tower whose only mask is its causal one) passes ``is_causal=True`` instead of the additive
(N, N) mask: the same function, and fused kernels can skip the masked half.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from mmalign.models import attention_kernel

__all__ = ["PackedSelfAttention", "pack_self_attention", "mark_causal"]


class PackedSelfAttention(nn.MultiheadAttention):
    """``nn.MultiheadAttention`` with a direct batch-first self-attention path (module doc)."""

    causal_mask: bool = False  # set by mark_causal: its square mask is the causal pattern

    def _packed(self, query, key, value, key_padding_mask, need_weights, attn_mask, is_causal) -> bool:
        return (
            self.batch_first
            and self._qkv_same_embed_dim
            and self.bias_k is None
            and not self.add_zero_attn
            and query is key
            and key is value
            and query.dim() == 3
            and key_padding_mask is None
            and not need_weights
            and not is_causal
            and (attn_mask is None or (attn_mask.dim() == 2 and attn_mask.is_floating_point()))
        )

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        key_padding_mask: torch.Tensor | None = None,
        need_weights: bool = True,
        attn_mask: torch.Tensor | None = None,
        average_attn_weights: bool = True,
        is_causal: bool = False,
    ):
        if not self._packed(query, key, value, key_padding_mask, need_weights, attn_mask, is_causal):
            return super().forward(
                query,
                key,
                value,
                key_padding_mask=key_padding_mask,
                need_weights=need_weights,
                attn_mask=attn_mask,
                average_attn_weights=average_attn_weights,
                is_causal=is_causal,
            )
        b, n, e = query.shape
        h = self.num_heads
        qkv = F.linear(query, self.in_proj_weight, self.in_proj_bias)  # (B, N, 3E)
        q, k, v = qkv.view(b, n, 3, h, e // h).permute(2, 0, 3, 1, 4).unbind(0)  # 3 x (B, H, N, E/H)
        causal = False
        if attn_mask is not None and self.causal_mask and attn_mask.shape == (n, n):
            attn_mask, causal = None, True  # mark_causal: this (N, N) mask is the causal one
        elif attn_mask is not None:
            attn_mask = attn_mask.to(q.dtype)  # (N, N) additive, as nn.MultiheadAttention reads a float mask
        out = attention_kernel.attention(
            q, k, v, attn_mask=attn_mask, is_causal=causal, dropout_p=self.dropout if self.training else 0.0
        )  # (B, H, N, E/H)
        out = out.transpose(1, 2).reshape(b, n, e)  # (B, N, E)
        return F.linear(out, self.out_proj.weight, self.out_proj.bias), None


def pack_self_attention(model: nn.Module) -> int:
    """Switch every module of exact type ``nn.MultiheadAttention`` in ``model`` to
    :class:`PackedSelfAttention` (same parameters and buffers); returns how many."""
    count = 0
    for module in model.modules():
        if type(module) is nn.MultiheadAttention:
            module.__class__ = PackedSelfAttention
            count += 1
    return count


def mark_causal(text: nn.Module) -> int:
    """Mark the attention modules of ``text`` to pass ``is_causal=True`` for their square mask,
    when ``text`` is an open_clip ``TextTransformer`` whose blocks receive nothing but its causal
    mask (no pad mask, no appended class token: open_clip adds those to the mask) and that
    mask's buffer is exactly the causal pattern (0 on and below the diagonal, -inf above; a slice
    [:L, :L] of it, as the text trim passes, is causal too). Returns how many were marked."""
    from open_clip.transformer import TextTransformer

    mask = getattr(text, "attn_mask", None)
    if (
        not isinstance(text, TextTransformer)
        or mask is None
        or getattr(text, "cls_emb", None) is not None
        or getattr(text, "use_pad_mask", False)
        or mask.dim() != 2
        or mask.is_meta
    ):
        return 0
    n = mask.shape[0]
    upper = torch.ones(n, n, dtype=torch.bool, device=mask.device).triu(1)
    if not (bool(torch.isneginf(mask[upper]).all()) and bool((mask[~upper] == 0).all())):
        return 0
    count = 0
    for module in text.modules():
        if isinstance(module, PackedSelfAttention):
            module.causal_mask = True
            count += 1
    return count
