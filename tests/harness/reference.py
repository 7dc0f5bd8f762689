"""The naive references the tests (and bench/) compare against: the symmetric CLIP loss written
out over the full logit matrix, and the random inputs of the exactness tests."""

import torch
import torch.nn.functional as F


def unit(gen: torch.Generator, b: int, d: int, dtype=torch.float32) -> torch.Tensor:
    """(b, d) random unit vectors, drawn in float64."""
    return F.normalize(torch.randn(b, d, generator=gen, dtype=torch.float64), dim=1).to(dtype)


def clip_batch(n: int, seed: int, image_size: int = 16, context: int = 16):
    """(n, 3, S, S) random images and (n, L) token rows of random lengths (start token, a few
    random ids, end token, zero padding): the inputs of the engine exactness tests."""
    g = torch.Generator().manual_seed(seed)
    images = torch.randn(n, 3, image_size, image_size, generator=g)
    tokens = torch.randint(1, 49000, (n, context), generator=g)
    tokens[:, 0] = 49406
    ends = torch.randint(3, context - 1, (n,), generator=g)
    for i, e in enumerate(ends):
        tokens[i, e] = 49407
        tokens[i, e + 1 :] = 0
    return images, tokens


def naive_clip_loss(img: torch.Tensor, txt: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The symmetric CLIP loss written out over the full (B, B) logit matrix: the reference."""
    logits = scale * img @ txt.T  # (B, B)
    labels = torch.arange(img.shape[0], device=img.device)
    return (F.cross_entropy(logits, labels) + F.cross_entropy(logits.T, labels)) / 2


def chunkwise_clip_loss(outs) -> torch.Tensor:
    """The reference loss of chunks forwarded one by one (each with grad, in order): the naive CLIP
    loss of their features concatenated in chunk order, (B, D) each, at the first chunk's scale."""
    return naive_clip_loss(
        torch.cat([o.image for o in outs]), torch.cat([o.text for o in outs]), outs[0].logit_scale
    )


def max_rel_error(got: dict, want: dict) -> tuple[float, str]:
    """The largest relative error over the floating-point tensors of a state dict (attention
    masks skipped), with the tensor's name."""
    return max(
        (float((got[n] - w).norm() / w.norm().clamp_min(1e-12)), n)
        for n, w in want.items()
        if w.is_floating_point() and not n.endswith("attn_mask")
    )
