"""Half-precision features: the tiled losses keep ``logit_scale`` (and the SigLIP bias) in float32.

bf16 has 8 significant bits, so 1/0.07 = 14.2857 rounds to 14.3125 and every logit is
0.19% too large: a systematic loss error of ~3e-3 (InfoNCE) and ~0.12 (SigLIP, a sum over
the row) on the batch below.  The features are quantised to multiples of 1/4 in 16
dimensions, so every dot product is exact in bf16: the only error left in the forward is
float32 rounding, and the reference (float64, the same features) isolates the scale.

The gradients still go through bf16 (the logit-gradient tile is rounded to the feature
dtype before its matmuls): that error is random, about 2^-9 relative, and bounded here.
"""

import pytest
import torch
import torch.nn.functional as F

from mmalign.losses.infonce import clip_loss
from mmalign.losses.siglip import siglip_loss

B, D = 96, 16
SCALE, BIAS = 1 / 0.07, -2.0


def _quantised(gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randint(-1, 2, (B, D), generator=gen).double() / 4
    y = torch.randint(-1, 2, (B, D), generator=gen).double() / 4
    y[: B // 2] = x[: B // 2]  # aligned pairs: positives that matter
    return x, y


def _reference(name: str, x: torch.Tensor, y: torch.Tensor):
    """Full-matrix float64 loss and its gradients (x, y, scale)."""
    x, y = x.clone().requires_grad_(), y.clone().requires_grad_()
    s = torch.tensor(SCALE, dtype=torch.float64, requires_grad=True)
    logits = s * x @ y.T  # (B, B)
    if name == "infonce":
        labels = torch.arange(B)
        loss = 0.5 * (F.cross_entropy(logits, labels) + F.cross_entropy(logits.T, labels))
    else:
        z = 2 * torch.eye(B, dtype=torch.float64) - 1
        loss = -F.logsigmoid(z * (logits + BIAS)).sum() / B
    loss.backward()
    return loss.detach(), x.grad, y.grad, s.grad


@pytest.mark.parametrize("name", ["infonce", "siglip"])
def test_tiled_loss_keeps_the_scale_in_float32_with_bf16_features(name, gen):
    x, y = _quantised(gen)
    ref, gx, gy, gs = _reference(name, x, y)
    xb, yb = x.bfloat16().requires_grad_(), y.bfloat16().requires_grad_()
    s = torch.tensor(SCALE, requires_grad=True)  # float32, as the model's exp(log_scale)
    bias = torch.tensor(BIAS, requires_grad=True)
    loss = (
        clip_loss(xb, yb, s, tile_size=32)
        if name == "infonce"
        else siglip_loss(xb, yb, s, bias, tile_size=32)
    )
    loss.backward()
    # the bf16-rounded scale gave +3e-3 (InfoNCE) / +0.12 (SigLIP) here; float32 leaves ~1e-6
    assert abs(float(loss.detach()) - float(ref)) < 2e-5
    assert s.grad.dtype == torch.float32
    assert abs(float(s.grad) - float(gs)) <= 5e-3 * abs(float(gs))  # bf16 gradient tiles: ~1e-3
    for got, want in ((xb.grad, gx), (yb.grad, gy)):
        assert float((got.double() - want).norm() / want.norm()) < 1e-2
