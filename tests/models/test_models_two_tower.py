import math

import pytest
import torch

from mmalign.config import ConfigError, ModelConfig
from mmalign.losses import clip_loss
from mmalign.models import build_model, resolve_arch


def _batch(model, b=3):
    size = model.image_size
    images = torch.randn(b, 3, size, size)
    tokens = torch.randint(1, 49406, (b, model.context_length))
    tokens[:, 0] = 49406
    tokens[:, 5] = 49407  # end of text: the text tower pools the argmax token
    tokens[:, 6:] = 0
    return images, tokens


@pytest.mark.parametrize("preset", ["micro", "tiny", "tiny-rn"])
def test_forward_shapes_and_normalisation(preset):
    model = build_model(ModelConfig(preset=preset))
    images, tokens = _batch(model)
    out = model(images, tokens)
    d = model.embed_dim
    assert out.image.shape == (3, d) and out.text.shape == (3, d)
    torch.testing.assert_close(out.image.norm(dim=-1), torch.ones(3))
    torch.testing.assert_close(out.text.norm(dim=-1), torch.ones(3))
    assert model.logit_scale.shape == (1,)
    assert model.logit_scale.item() == pytest.approx(math.log(1 / 0.07))
    assert out.logit_scale.item() == pytest.approx(1 / 0.07, rel=1e-5)


def test_logit_scale_clamped_at_100():
    model = build_model(ModelConfig(preset="micro"))
    with torch.no_grad():
        model.logit_scale.fill_(10.0)
    model.clamp_logit_scale()
    assert model.logit_scale.exp().item() == pytest.approx(100.0, rel=1e-5)
    with torch.no_grad():
        model.logit_scale.fill_(-3.0)
    model.clamp_logit_scale()
    assert model.logit_scale.item() == 0.0


def test_every_trainable_parameter_gets_a_nonzero_gradient():
    torch.manual_seed(0)
    model = build_model(ModelConfig(preset="micro"))
    images, tokens = _batch(model, b=4)
    out = model(images, tokens)
    loss = clip_loss(out.image, out.text, out.logit_scale)
    loss.backward()
    missing = [
        n
        for n, p in model.named_parameters()
        if p.requires_grad and (p.grad is None or p.grad.abs().sum() == 0)
    ]
    assert missing == []


def test_open_clip_presets_resolve_and_overrides_apply():
    arch = resolve_arch(ModelConfig(preset="ViT-B-32", image_size=160, text={"layers": 6}, embed_dim=256))
    assert arch["vision_cfg"]["patch_size"] == 32 and arch["vision_cfg"]["image_size"] == 160
    assert arch["text_cfg"]["layers"] == 6 and arch["embed_dim"] == 256
    with pytest.raises(ConfigError, match="model.preset"):
        resolve_arch(ModelConfig(preset="ViT-Q-99"))


def test_second_view_and_negative_captions_are_embedded_like_separate_calls():
    torch.manual_seed(0)
    model = build_model(ModelConfig(preset="micro")).eval()
    images, tokens = _batch(model, b=4)
    images2 = torch.randn_like(images)
    neg = tokens[torch.tensor([[1, 2, 3], [0, 2, 3], [0, 1, 3], [0, 1, 2]])]  # (4, 3, L): the other captions
    out = model(images, tokens, images2=images2, neg_texts=neg)
    torch.testing.assert_close(out.image, model.encode_image(images))
    torch.testing.assert_close(out.image2, model.encode_image(images2))
    torch.testing.assert_close(out.text, model.encode_text(tokens))
    assert out.neg_text.shape == (4, 3, model.embed_dim)
    torch.testing.assert_close(out.neg_text[2, 1], out.text[1])
    with pytest.raises(ValueError, match="images2 needs images"):
        model(None, tokens, images2=images2)


@pytest.mark.parametrize("lock", ["none", "image", "text"])
def test_train_flops_count_a_locked_tower_forward_only(lock):
    """fwd + bwd (3x the forward) for a tower that trains; the forward alone for a fully locked
    one (LiT). Reference: each tower's forward at the full context counted here with torch's
    FlopCounterMode (plus the monitors' formula for the CPU attention kernel, checked against an
    analytic count in tests/models/test_monitors_flops.py)."""
    from mmalign.run.monitors import flop_counter, train_flops_per_sample

    model = build_model(ModelConfig(preset="micro", lock_image=lock == "image", lock_text=lock == "text"))
    size, length = model.image_size, model.context_length
    images, tokens = torch.zeros(1, 3, size, size), torch.ones(1, length, dtype=torch.long)
    tokens[:, 0], tokens[:, -1] = 49406, 49407  # no padding: nothing is trimmed
    tower = {}
    for name, run in (
        ("image", lambda: model.encode_image(images)),
        ("text", lambda: model.encode_text(tokens)),
    ):
        counter = flop_counter()
        with counter:
            run()
        tower[name] = counter.get_total_flops()
    want = sum(f * (1 if name == lock else 3) for name, f in tower.items())
    assert tower["image"] > 0 and tower["text"] > 0
    assert train_flops_per_sample(model, size, length) == pytest.approx(want, rel=1e-9)


def test_flops_per_sample_count_the_second_view_and_the_mined_captions():
    from mmalign.run.monitors import forward_flops_per_sample

    model = build_model(ModelConfig(preset="micro"))
    size, length = model.image_size, model.context_length
    both = forward_flops_per_sample(model, size, length)
    view = forward_flops_per_sample(model, size, length, second_view=True) - both  # one more vision pass
    negs = forward_flops_per_sample(model, size, length, negatives=3) - both  # three more text passes
    assert view > 0 and negs > 0
    assert both == pytest.approx(view + negs / 3, rel=1e-6)  # the two towers, once each
    assert forward_flops_per_sample(model, size, length, second_view=True, negatives=3) == both + view + negs
