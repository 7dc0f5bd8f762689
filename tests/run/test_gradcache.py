"""GradCache (plain PyTorch, injected backward) against one-pass references."""

from dataclasses import dataclass
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from mmalign.config import ModelConfig
from mmalign.models import TwoTower, build_model
from mmalign.models.embeddings import Embeddings, per_sample
from mmalign.run import gradcache
from mmalign.run.gradcache import chunk_sizes, grad_cache_step, split_batch
from tests.harness import chunkwise_clip_loss


def _naive_loss(full):
    img, txt, scale = full.image, full.text, full.logit_scale
    logits = scale * img @ txt.T
    labels = torch.arange(img.shape[0])
    return (F.cross_entropy(logits, labels) + F.cross_entropy(logits.T, labels)) / 2


def _encoder(model):
    """gradcache's ``encode(chunk)`` for tuple chunks of model arguments."""
    return lambda chunk: model(*chunk)


def _batch(b):
    images = torch.randn(b, 3, 16, 16)
    tokens = torch.randint(1, 49000, (b, 16))
    tokens[:, 0], tokens[:, 9], tokens[:, 10:] = 49406, 49407, 0
    return images, tokens


def _grads(model):
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _assert_close_grads(a, b, tol=1e-5):
    assert a.keys() == b.keys()
    for n in a:
        rel = (a[n] - b[n]).norm() / b[n].norm().clamp_min(1e-12)
        assert rel <= tol, (n, float(rel))


def test_chunk_sizes():
    assert chunk_sizes(10, 4) == [4, 4, 2]
    assert chunk_sizes(8, 4) == [4, 4]
    assert chunk_sizes(8, 0) == [8]
    assert chunk_sizes(8, 8) == [8]


@pytest.mark.parametrize("chunk", [3, 5, 6])
def test_cached_equals_one_pass_full_batch_without_dropout(chunk, seed):
    torch.manual_seed(seed)
    model = build_model(ModelConfig(preset="micro"))
    images, tokens = _batch(12)
    out = model(images, tokens)
    _naive_loss(out).backward()
    want = _grads(model)
    model.zero_grad()
    step = grad_cache_step(
        _encoder(model),
        split_batch((images, tokens), chunk_sizes(12, chunk)),
        _naive_loss,
        lambda x: x.backward(),
    )
    _assert_close_grads(_grads(model), want)
    assert step.loss.item() == pytest.approx(_naive_loss(out).item(), rel=1e-6)
    assert not step.loss.requires_grad


def _dropout_model(seed):
    torch.manual_seed(seed)
    model = build_model(ModelConfig(preset="micro", vision={"patch_dropout": 0.5}))
    model.train()
    return model


def test_rng_replay_makes_cached_equal_uncached_with_patch_dropout(monkeypatch, seed):
    data_seed = seed + 1
    torch.manual_seed(data_seed)
    images, tokens = _batch(10)
    chunks = split_batch((images, tokens), chunk_sizes(10, 4))

    # uncached: the same chunks forwarded once, with grad, in the same RNG sequence
    model = _dropout_model(seed)
    torch.manual_seed(data_seed)
    outs = [model(*c) for c in chunks]
    chunkwise_clip_loss(outs).backward()
    want = _grads(model)
    after_uncached = torch.get_rng_state()

    model = _dropout_model(seed)
    torch.manual_seed(data_seed)
    grad_cache_step(_encoder(model), chunks, _naive_loss, lambda x: x.backward())
    _assert_close_grads(_grads(model), want)
    # the generator ends where the single pass left it
    assert torch.equal(torch.get_rng_state(), after_uncached)

    # without the replay the masks differ and so do the gradients: the test can fail
    model = _dropout_model(seed)
    torch.manual_seed(data_seed)
    monkeypatch.setattr(gradcache.RngState, "restore", lambda self: None)
    grad_cache_step(_encoder(model), chunks, _naive_loss, lambda x: x.backward())
    got = _grads(model)
    worst = max(float((got[n] - want[n]).norm() / want[n].norm().clamp_min(1e-12)) for n in want)
    assert worst > 1e-3


def test_scale_gets_its_gradient_once(seed):
    torch.manual_seed(seed)
    model = build_model(ModelConfig(preset="micro"))
    images, tokens = _batch(12)
    _naive_loss(model(images, tokens)).backward()
    want = model.logit_scale.grad.clone()
    model.zero_grad()
    grad_cache_step(
        _encoder(model), split_batch((images, tokens), [3, 3, 3, 3]), _naive_loss, lambda x: x.backward()
    )
    torch.testing.assert_close(model.logit_scale.grad, want, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("sizes", [[12], [6, 6], [3, 3, 3, 3]])
def test_last_chunk_is_back_propagated_from_its_first_forward(sizes, seed):
    """n chunks cost 2n - 1 forwards (the last keeps its graph), one chunk costs one,
    and the gradients still equal the one-pass loss's."""
    torch.manual_seed(seed)
    model = build_model(ModelConfig(preset="micro"))
    images, tokens = _batch(12)
    _naive_loss(model(images, tokens)).backward()
    want = _grads(model)
    model.zero_grad()
    calls = []

    def encode(chunk):
        calls.append(torch.is_grad_enabled())
        return model(*chunk)

    grad_cache_step(encode, split_batch((images, tokens), sizes), _naive_loss, lambda x: x.backward())
    n = len(sizes)
    assert len(calls) == 2 * n - 1
    assert calls[:n] == [False] * (n - 1) + [True]  # first pass: only the last chunk keeps a graph
    _assert_close_grads(_grads(model), want)


# ------------------------------------------- extra per-sample inputs: second view, mined negatives

TAU = 0.1  # the image-image temperature


def _extras_loss(mask):
    """Naive full-batch objective: CLIP + image rows' own mined negatives + 0.5 x NT-Xent of the views."""

    def loss(full):
        img, txt, scale = full.image, full.text, full.logit_scale
        img2, neg = full.image2, full.neg_text  # (B, D), (B, k, D)
        b = img.shape[0]
        labels = torch.arange(b)
        neg_logits = (scale * torch.einsum("bd,bkd->bk", img, neg)).masked_fill(~mask, float("-inf"))
        i2t = F.cross_entropy(torch.cat([scale * img @ txt.T, neg_logits], dim=1), labels)
        t2i = F.cross_entropy(scale * txt @ img.T, labels)
        z = torch.cat([img, img2])  # (2B, D)
        sim = (z @ z.T / TAU).masked_fill(torch.eye(2 * b, dtype=torch.bool), float("-inf"))
        ntxent = F.cross_entropy(sim, torch.cat([labels + b, labels]))
        return (i2t + t2i) / 2 + 0.5 * ntxent

    return loss


def _extras(b, k=2):
    images2 = torch.randn(b, 3, 16, 16)
    _, neg = _batch(b * k)
    mask = torch.rand(b, k) < 0.7
    return images2, neg.reshape(b, k, -1), mask


@pytest.mark.parametrize("sizes", [[12], [5, 5, 2], [3, 3, 3, 3]])
def test_cached_equals_one_pass_with_second_view_and_mined_negatives(sizes, seed):
    torch.manual_seed(seed)
    model = build_model(ModelConfig(preset="micro"))
    images, tokens = _batch(12)
    images2, neg, mask = _extras(12)
    loss_fn = _extras_loss(mask)
    out = model(images, tokens, images2=images2, neg_texts=neg)
    assert out.neg_text.shape == (12, 2, model.embed_dim)
    want_loss = loss_fn(out)
    want_loss.backward()
    want = _grads(model)
    model.zero_grad()

    def encode(chunk):
        im, tok, im2, ng = chunk
        return model(im, tok, images2=im2, neg_texts=ng)

    step = grad_cache_step(
        encode, split_batch((images, tokens, images2, neg), sizes), loss_fn, lambda x: x.backward()
    )
    assert step.loss.item() == pytest.approx(want_loss.item(), rel=1e-6)
    _assert_close_grads(_grads(model), want)


# ------------------------------------------- a new output field: its metadata is all it needs


@dataclass
class _WithRaw(Embeddings):
    image_raw: torch.Tensor | None = per_sample("(B, D) image features before the L2 normalisation")


class _RawModel(TwoTower):
    """A test model with one more per-sample output, listed nowhere but in its Embeddings class."""

    def forward(self, images, texts):
        raw = self.encode_image(images, normalize=False)  # (B, D)
        return _WithRaw(
            image=F.normalize(raw, dim=-1),
            text=self.encode_text(texts),
            logit_scale=self.logit_scale.exp(),
            image_raw=raw,
        )


def _raw_loss(full):
    """CLIP + a penalty on the new field (its gradient reaches the towers only through it)."""
    return _naive_loss(full) + 0.1 * full.image_raw.pow(2).sum(dim=1).mean()


def test_a_field_added_in_a_subclass_gets_its_gradient_cached_and_uncached(seed):
    from mmalign.config import ModelConfig as MC
    from mmalign.models.arch import resolve_arch
    from mmalign.run.engine import Engine

    torch.manual_seed(seed)
    model = _RawModel(resolve_arch(MC(preset="micro")))
    images, tokens = _batch(12)
    _raw_loss(model(images, tokens)).backward()  # naive full-batch autograd
    want = _grads(model)
    model.zero_grad()
    _naive_loss(model(images, tokens)).backward()
    plain = _grads(model)  # the test can fail: without the new field the gradients differ
    assert max(float((want[n] - plain[n]).norm() / plain[n].norm().clamp_min(1e-12)) for n in want) > 1e-2

    # cached: three chunks
    model.zero_grad()
    step = grad_cache_step(
        _encoder(model), split_batch((images, tokens), [5, 5, 2]), _raw_loss, lambda x: x.backward()
    )
    _assert_close_grads(_grads(model), want)
    assert step.loss.item() == pytest.approx(_raw_loss(model(images, tokens)).item(), rel=1e-5)

    # uncached: the engine's single pass (its DeepSpeed backward stood in for by autograd)
    model.zero_grad()
    stub = SimpleNamespace(_all_finite=lambda loss, grads: True, _backward=lambda x: x.backward())
    result, skipped = Engine._single_pass(
        stub, model(images, tokens), lambda e: SimpleNamespace(loss=_raw_loss(e)), lambda: None
    )
    assert not skipped
    _assert_close_grads(_grads(model), want)


def test_a_field_without_its_kind_is_refused():
    @dataclass
    class Bad(Embeddings):
        extra: torch.Tensor | None = None

    with pytest.raises(TypeError, match="per_sample"):
        Bad(image=torch.zeros(2, 3)).tensors()
