"""The naive references the tests (and bench/) compare against: the symmetric CLIP loss written
out over the full logit matrix, GradCache written out naively, and the random inputs of the
exactness tests."""

import copy

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


def bf16_chunks_summed_exactly(model, images: torch.Tensor, tokens: torch.Tensor, chunk: int) -> dict:
    """GradCache written out naively with bf16 weights: no-grad chunk features, the fp32 naive loss's
    gradient, each chunk re-forwarded and back-propagated, the chunks' bf16 gradients summed in
    float64 (on the CPU): the gradient a cached step would give without accumulation error."""
    model = copy.deepcopy(model).bfloat16()
    chunks = list(zip(images.bfloat16().split(chunk), tokens.split(chunk)))
    with torch.no_grad():
        outs = [model(im, tok) for im, tok in chunks]
    img = torch.cat([o.image.float() for o in outs]).requires_grad_(True)  # (B, D)
    txt = torch.cat([o.text.float() for o in outs]).requires_grad_(True)
    scale = outs[0].logit_scale.float().detach().requires_grad_(True)
    naive_clip_loss(img, txt, scale).backward()
    total = {n: torch.zeros(p.shape, dtype=torch.float64) for n, p in model.named_parameters()}
    for k, (im, tok) in enumerate(chunks):
        model.zero_grad(set_to_none=True)
        out = model(im, tok)
        rows = slice(k * chunk, (k + 1) * chunk)
        surrogate = (out.image.float() * img.grad[rows]).sum() + (out.text.float() * txt.grad[rows]).sum()
        if k == 0:  # the temperature's gradient belongs to the step, not to a chunk
            surrogate = surrogate + (out.logit_scale.float() * scale.grad).sum()
        surrogate.backward()
        for n, p in model.named_parameters():
            if p.grad is not None:
                total[n] += p.grad.double().cpu()
    return {n: g.float() for n, g in total.items()}


def max_rel_error(got: dict, want: dict) -> tuple[float, str]:
    """The largest relative error over the floating-point tensors of a state dict (attention
    masks skipped), with the tensor's name."""
    return max(
        (float((got[n] - w).norm() / w.norm().clamp_min(1e-12)), n)
        for n, w in want.items()
        if w.is_floating_point() and not n.endswith("attn_mask")
    )
