"""SigLIP and SigLIP2 as mmalign models: loaded from a transformers folder (and by hub name from a
fabricated cache), their embeddings are transformers' own ``get_image_features`` /
``get_text_features`` on the same files; saved and reloaded unchanged; LiT and the errors."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
import torch.nn.functional as F
from open_clip.constants import OPENAI_DATASET_MEAN, OPENAI_DATASET_STD

from tests.harness.hubcache import fabricate, offline_env
from tests.harness.siglip_fab import CAPTIONS, siglip_folder

FAMILIES = ("siglip", "siglip2")


def rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).norm() / want.norm())


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("siglip_models")
    return {family: siglip_folder(root / family, family, seed=i) for i, family in enumerate(FAMILIES)}


def _reference(folder, family, images01, texts, **kwargs):
    """transformers' own normalised features: images in [0, 1] -> its mean/std of 0.5, ids from
    its tokenizer at max length 64 (no attention mask: as SigLIP was trained)."""
    from transformers import AutoModel, AutoTokenizer

    model = AutoModel.from_pretrained(str(folder), local_files_only=True, **kwargs).eval()
    tok = AutoTokenizer.from_pretrained(str(folder), local_files_only=True, **kwargs)
    ids = tok(texts, padding="max_length", max_length=64, truncation=True, return_tensors="pt")["input_ids"]
    pixels = (images01 - 0.5) / 0.5  # (B, 3, S, S)
    with torch.no_grad():
        if family == "siglip":
            image = model.get_image_features(pixel_values=pixels).pooler_output
        else:  # NaFlex by hand: the processor's patch order, a full mask
            b, c, s, _ = pixels.shape
            p = model.config.vision_config.patch_size
            g = s // p
            patches = pixels.reshape(b, c, g, p, g, p).permute(0, 2, 4, 3, 5, 1).reshape(b, g * g, p * p * c)
            image = model.get_image_features(
                pixel_values=patches,
                pixel_attention_mask=torch.ones(b, g * g, dtype=torch.long),
                spatial_shapes=torch.tensor([[g, g]] * b),
            ).pooler_output
        text = model.get_text_features(input_ids=ids).pooler_output
    return F.normalize(image, dim=-1), F.normalize(text, dim=-1), ids, model


def _ours_input(images01):
    mean = torch.tensor(OPENAI_DATASET_MEAN).view(1, 3, 1, 1)
    std = torch.tensor(OPENAI_DATASET_STD).view(1, 3, 1, 1)
    return (images01 - mean) / std  # what mmalign's data side gives every model


@pytest.mark.parametrize("family", FAMILIES)
def test_folder_embeddings_equal_transformers(folders, family, gen):
    from mmalign.models.load import load

    loaded = load(folders[family])
    images = torch.rand(3, 3, 32, 32, generator=gen)
    want_image, want_text, ids, ref = _reference(folders[family], family, images, CAPTIONS[:4])
    assert torch.equal(loaded.tokenizer(CAPTIONS[:4]), ids)
    assert rel(loaded.encode_image(_ours_input(images)), want_image) <= 1e-5
    assert rel(loaded.encode_text(CAPTIONS[:4]), want_text) <= 1e-5
    # the scale and bias are the model's own (the clamp rises above 100 to keep the scale)
    assert loaded.logit_scale == pytest.approx(float(ref.logit_scale.detach().exp()), rel=1e-6)
    assert float(loaded.model.logit_bias) == float(ref.logit_bias.detach())
    assert loaded.model.max_logit_scale >= loaded.logit_scale > 100
    assert loaded.preprocess_cfg["resize_mode"] == "squash"


@pytest.mark.parametrize("family", FAMILIES)
def test_hub_name_embeddings_equal_transformers(folders, family, tmp_path, monkeypatch, gen):
    from mmalign.models.hub import resolve
    from mmalign.models.load import load

    hf_home = tmp_path / "hf"
    repo = f"google/{family}-tiny-test"
    fabricate(hf_home, repo, folders[family])
    offline_env(monkeypatch, hf_home)
    loaded = load(resolve(repo, "--model"))
    images = torch.rand(2, 3, 32, 32, generator=gen)
    want_image, want_text, _, _ = _reference(
        repo, family, images, CAPTIONS[4:7], cache_dir=str(hf_home / "hub")
    )
    assert rel(loaded.encode_image(_ours_input(images)), want_image) <= 1e-5
    assert rel(loaded.encode_text(CAPTIONS[4:7]), want_text) <= 1e-5


@pytest.mark.parametrize("family", FAMILIES)
def test_saved_model_reloads_without_the_source_folder(folders, family, tmp_path, gen):
    from mmalign.data.transforms import preprocess_cfg
    from mmalign.models.io import save_pretrained
    from mmalign.models.load import load

    source = tmp_path / "source"
    shutil.copytree(folders[family], source)
    loaded = load(source)
    saved = save_pretrained(
        loaded.model, tmp_path / "saved", preprocess=preprocess_cfg(loaded.model.image_size)
    )
    shutil.rmtree(source)  # the saved folder carries its tokenizer (hf_text/)
    again = load(saved)
    images = _ours_input(torch.rand(2, 3, 32, 32, generator=gen))
    assert torch.equal(again.encode_image(images), loaded.encode_image(images))
    assert torch.equal(again.encode_text(CAPTIONS[:3]), loaded.encode_text(CAPTIONS[:3]))
    config = json.loads((saved / "model_config.json").read_text())
    assert config["preprocess_cfg"]["resize_mode"] == "squash"
    assert config["max_logit_scale"] == loaded.model.max_logit_scale
    assert again.logit_scale == loaded.logit_scale and torch.equal(
        again.model.logit_bias, loaded.model.logit_bias
    )


def test_eval_transform_resizes_without_crop_like_siglip_processor(folders):
    from PIL import Image
    from transformers import SiglipImageProcessor

    from mmalign.models.load import load

    loaded = load(folders["siglip"])
    image = Image.new("RGB", (60, 30), (200, 30, 30))
    image.paste((20, 20, 220), (0, 0, 12, 30))  # a blue band at the left edge: a centre crop would lose it
    ours = loaded.preprocess(image)  # (3, 32, 32), OpenAI-normalised
    mean = torch.tensor(OPENAI_DATASET_MEAN).view(3, 1, 1)
    std = torch.tensor(OPENAI_DATASET_STD).view(3, 1, 1)
    ours01 = ours * std + mean
    theirs = SiglipImageProcessor.from_pretrained(str(folders["siglip"]))(image, return_tensors="pt")
    theirs01 = theirs["pixel_values"][0] * 0.5 + 0.5
    assert ours01.shape == theirs01.shape == (3, 32, 32)
    assert (ours01 - theirs01).abs().max() <= 2 / 255  # PIL bicubic vs the processor's, uint8 rounding
    assert ours01[2, :, 0].mean() > 0.7  # the blue band is kept


def test_lock_leaves_the_last_layers_trainable(folders):
    from mmalign.config import ModelConfig
    from mmalign.models.arch import resolve_arch
    from mmalign.models.two_tower import TwoTower

    model = TwoTower(resolve_arch(ModelConfig(pretrained=str(folders["siglip"]))), init_logit_bias=-10.0)
    model.lock("visual", 1)
    model.lock("text", 0)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    want = {
        n
        for n, _ in model.visual.named_parameters()
        if ".layers.1." in n or ".head." in n or "post_layernorm" in n
    }
    assert trainable == {"visual." + n for n in want} | {"logit_scale", "logit_bias"}


def test_unsupported_transformers_class_is_one_line(tmp_path):
    from mmalign.errors import UsageError
    from mmalign.models.load import load

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "blip", "architectures": ["BlipModel"]}))
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(UsageError) as e:
        load(tmp_path)
    message = str(e.value)
    assert (
        "\n" not in message and "'blip'" in message and "SiglipModel" in message and "Siglip2Model" in message
    )


def test_folder_without_its_tokenizer_is_one_line(folders, tmp_path):
    from mmalign.errors import UsageError
    from mmalign.models.load import load

    folder = tmp_path / "no_tokenizer"
    shutil.copytree(folders["siglip"], folder)
    for name in ("spiece.model", "tokenizer_config.json"):
        (folder / name).unlink()
    with pytest.raises(UsageError) as e:
        load(folder)
    assert "\n" not in str(e.value) and "tokenizer" in str(e.value) and str(folder) in str(e.value)


def test_new_image_size_resamples_the_position_table_as_timm(folders, tmp_path, gen):
    from safetensors.torch import load_file
    from timm.layers import resample_abs_pos_embed
    from transformers import AutoModel

    from mmalign.config import load_config
    from mmalign.data.transforms import preprocess_cfg
    from mmalign.export import export
    from mmalign.models import build_model
    from mmalign.models.io import save_pretrained
    from mmalign.models.load import load

    cfg = load_config(
        None, [f"model.pretrained={folders['siglip']}", "model.image_size=48", "model.init_logit_bias=-10"]
    )
    model = build_model(cfg.model).eval()  # 4x4 patches of 8 -> 6x6
    source = load_file(str(folders["siglip"] / "model.safetensors"))[
        "vision_model.embeddings.position_embedding.weight"
    ]
    want = resample_abs_pos_embed(source[None], [6, 6], [4, 4], num_prefix_tokens=0)[0]  # (36, D)
    assert torch.equal(model.state_dict()["visual.hf.embeddings.position_embedding.weight"], want)
    # saved and exported at the new size, transformers runs it as mmalign does (no interpolation)
    saved = save_pretrained(model, tmp_path / "saved", preprocess=preprocess_cfg(48))
    out = export(saved, "hf", tmp_path / "hf")
    hf = AutoModel.from_pretrained(str(out), local_files_only=True).eval()
    assert hf.config.vision_config.image_size == 48
    images = torch.rand(2, 3, 48, 48, generator=gen)
    with torch.no_grad():
        theirs = F.normalize(hf.get_image_features(pixel_values=(images - 0.5) / 0.5).pooler_output, dim=-1)
    assert rel(load(saved).encode_image(_ours_input(images)), theirs) <= 1e-5
