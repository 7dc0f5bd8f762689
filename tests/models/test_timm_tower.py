"""timm image towers offline (``model.vision.timm_model_name``, ``model.timm_weights``): random
init or a local timm checkpoint loaded as timm itself loads it, every weight trained, saved and
exported (open_clip when it can build the trunk, else one line), misuse as one ConfigError line."""

import pytest
import torch
from safetensors.torch import save_file

from mmalign.config import ConfigError, load_config
from tests.harness import clip_batch, naive_clip_loss

VIT = ["model.preset=micro", "model.vision.timm_model_name=test_vit", "model.image_size=32"]
# a few seconds of training: small batches, no end-of-run evaluation (tests/models/test_hf_text_tower.py runs `mmalign eval`)
FAST = ["train.steps=3", "train.global_batch_size=8", "eval.suite=none", "monitor.probe_size=0"]


@pytest.fixture
def vit_file(tmp_path):
    """test_vit's weights at its default 160 px with its 1000-class head, as timm saves them."""
    import timm

    torch.manual_seed(5)
    path = tmp_path / "test_vit.safetensors"
    save_file({k: v.contiguous() for k, v in timm.create_model("test_vit").state_dict().items()}, str(path))
    return path


def test_weights_from_a_local_file_equal_timms_own_load(vit_file):
    import timm

    from mmalign.models import build_model

    model = build_model(load_config(None, VIT + [f"model.timm_weights={vit_file}"]).model).eval()
    assert model.arch["vision_cfg"]["timm_model_pretrained"] is False  # never timm's download
    # the reference: timm's own file loading (its filter resamples the 10x10 position grid to 2x2)
    ref = timm.create_model(
        "test_vit",
        img_size=32,
        num_classes=0,
        pretrained=True,
        pretrained_cfg_overlay={"file": str(vit_file)},
    ).eval()
    x = torch.randn(3, 3, 32, 32, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.allclose(model.visual.trunk.forward_features(x), ref.forward_features(x), atol=1e-6)
    own = model.visual.trunk.state_dict()
    assert all(torch.equal(own[k], v) for k, v in ref.state_dict().items())


def test_every_parameter_gets_a_gradient(seed):
    from mmalign.models import build_model

    torch.manual_seed(seed)
    model = build_model(load_config(None, VIT).model).train()
    images, texts = clip_batch(4, seed, image_size=32)
    out = model(images, texts)
    naive_clip_loss(out.image.double(), out.text.double(), out.logit_scale.double()).backward()
    trunk = [n for n, p in model.visual.named_parameters()]
    assert any(n.startswith("trunk.blocks.") for n in trunk) and "head.proj.weight" in trunk
    missing = [n for n, p in model.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
    assert not missing, missing


@pytest.mark.integration
def test_train_eval_and_export(vit_file, micro_overrides, tmp_path):
    import open_clip

    from mmalign.data.transforms import preprocess_cfg
    from mmalign.errors import UsageError
    from mmalign.export import export
    from mmalign.models import build_model
    from mmalign.models.io import save_pretrained
    from mmalign.models.load import load
    from mmalign.run.train import train

    cfg = load_config(None, micro_overrides + VIT[1:] + FAST + [f"model.timm_weights={vit_file}"])
    run = train(cfg, show_progress=False)
    loaded = load(run)
    assert loaded.model.visual.trunk.pos_embed.shape == (1, 5, 64)
    images = torch.randn(2, 3, 32, 32)
    assert torch.allclose(loaded.encode_image(images).norm(dim=1), torch.ones(2), atol=1e-5)
    # a ViT trunk resized to 32 px: open_clip builds it at 160 px, so the export is refused in one line
    with pytest.raises(UsageError, match="resized to image_size 32") as e:
        export(run, "open_clip", tmp_path / "oc_vit")
    assert "\n" not in str(e.value)
    with pytest.raises(UsageError, match="timm_model_name"):
        export(run, "hf", tmp_path / "hf")
    # a convolutional trunk takes any size unchanged: open_clip rebuilds it and gives our embeddings
    torch.manual_seed(0)
    rn = build_model(
        load_config(
            None, ["model.preset=micro", "model.vision.timm_model_name=test_resnet", "model.image_size=32"]
        ).model
    ).eval()
    save_pretrained(rn, tmp_path / "rn", preprocess=preprocess_cfg(32))
    out = export(tmp_path / "rn", "open_clip", tmp_path / "oc_rn")
    oc = open_clip.create_model("local-dir:" + str(out)).eval()
    x = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        assert torch.allclose(
            torch.nn.functional.normalize(oc.encode_image(x), dim=-1), rn.encode_image(x), atol=1e-5
        )


def test_misuse_is_one_config_error_line(vit_file, tmp_path):
    from mmalign.models import check_buildable

    def refused(*overrides, match):
        with pytest.raises(ConfigError, match=match) as e:
            check_buildable(load_config(None, list(overrides)).model)
        assert "\n" not in str(e.value)

    refused(
        *VIT, "model.vision.timm_model_pretrained=true", match="timm_model_pretrained.*download.*timm_weights"
    )
    refused("model.preset=micro", f"model.timm_weights={vit_file}", match="timm_weights.*timm_model_name")
    refused(*VIT, f"model.timm_weights={tmp_path / 'none.pth'}", match="timm_weights.*not a file")
    refused(
        "model.preset=micro",
        "model.vision.timm_model_name=no_such_net",
        match="timm has no model 'no_such_net'",
    )
    other = tmp_path / "other.pth"
    torch.save({"state_dict": {"blocks.0.attn.qkv.weight": torch.zeros(3, 3)}}, other)
    refused(*VIT, f"model.timm_weights={other}", match="timm_weights.*does not fit.*missing")
    evil = tmp_path / "evil.pth"
    torch.save({"state_dict": {"x": torch.zeros(1)}, "cfg": ConfigError("x")}, evil)
    refused(*VIT, f"model.timm_weights={evil}", match="timm_weights.*not a readable weights file")
