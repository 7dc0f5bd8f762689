"""models/packed_attention.py: the packed self-attention equals torch's nn.MultiheadAttention
(the reference: its own generic forward on the same parameters), outputs and the gradients of
the input and every parameter, in float64; off-path calls fall back unchanged."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from mmalign.models.packed_attention import PackedSelfAttention, pack_self_attention
from mmalign.models.presets import PRESETS
from mmalign.models.two_tower import TwoTower


def _pair(seed: int, dropout: float = 0.0):
    torch.manual_seed(seed)
    ref = nn.MultiheadAttention(48, 4, batch_first=True, dropout=dropout).double()
    with torch.no_grad():
        ref.in_proj_bias.normal_()  # torch initialises the biases to 0: make them count
        ref.out_proj.bias.normal_()
    packed = copy.deepcopy(ref)
    assert pack_self_attention(packed) == 1 and type(packed) is PackedSelfAttention
    return ref, packed


def _run(module, x, **kw):
    x = x.clone().requires_grad_(True)
    module.zero_grad(set_to_none=True)
    out = module(x, x, x, need_weights=False, **kw)[0]  # (B, N, E)
    w = torch.linspace(-1, 1, out.numel(), dtype=out.dtype).reshape(out.shape)
    (out * w).sum().backward()
    return out.detach(), x.grad, {n: p.grad for n, p in module.named_parameters()}


@pytest.mark.parametrize("mask", [None, "causal"])
def test_packed_self_attention_equals_multihead_attention_with_gradients(mask, seed):
    ref, packed = _pair(seed)
    x = torch.randn(5, 9, 48, dtype=torch.float64, generator=torch.Generator().manual_seed(seed))
    kw = {} if mask is None else {"attn_mask": torch.full((9, 9), float("-inf"), dtype=torch.float64).triu(1)}
    want, want_x, want_p = _run(ref, x, **kw)
    got, got_x, got_p = _run(packed, x, **kw)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    torch.testing.assert_close(got_x, want_x, rtol=0, atol=1e-12)
    assert got_p.keys() == want_p.keys()
    for name in want_p:
        torch.testing.assert_close(got_p[name], want_p[name], rtol=0, atol=1e-12, msg=name)
    assert packed.state_dict().keys() == ref.state_dict().keys()


def test_off_path_calls_fall_back_to_torch(seed):
    ref, packed = _pair(seed)
    g = torch.Generator().manual_seed(seed)
    x, y = (
        torch.randn(3, 7, 48, dtype=torch.float64, generator=g),
        torch.randn(3, 5, 48, dtype=torch.float64, generator=g),
    )
    pad = torch.zeros(3, 7, dtype=torch.bool)
    pad[0, 5:] = True
    for args, kw in [
        ((x, y, y), {}),  # cross-attention
        ((x, x, x), {"key_padding_mask": pad, "need_weights": False}),
        ((x, x, x), {"need_weights": True}),  # the weights are returned
        ((x, x, x), {"attn_mask": torch.ones(7, 7, dtype=torch.bool).triu(1)}),
    ]:  # bool mask
        want, got = ref(*args, **kw), packed(*args, **kw)
        torch.testing.assert_close(got[0], want[0], rtol=0, atol=1e-12)
        assert (got[1] is None) == (want[1] is None)


def test_dropout_follows_training_mode(seed):
    _, packed = _pair(seed, dropout=0.5)
    x = torch.randn(2, 6, 48, dtype=torch.float64)
    packed.eval()
    a, b = packed(x, x, x, need_weights=False)[0], packed(x, x, x, need_weights=False)[0]
    assert torch.equal(a, b)
    packed.train()
    assert not torch.equal(packed(x, x, x, need_weights=False)[0], a)


def test_the_towers_use_it_and_keep_open_clip_names():
    model = TwoTower(copy.deepcopy(PRESETS["tiny"]))
    kinds = [type(m) for m in model.modules() if isinstance(m, nn.MultiheadAttention)]
    assert kinds and all(k is PackedSelfAttention for k in kinds)  # 4 vision + 4 text blocks
    assert len(kinds) == 8
    assert "visual.transformer.resblocks.0.attn.in_proj_weight" in model.state_dict()
