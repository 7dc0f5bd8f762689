"""A SigLIP-family model exported with ``--format hf`` is a transformers SiglipModel /
Siglip2Model folder: ``pipeline("zero-shot-image-classification")`` gives mmalign's own sigmoid
scores, and a checkpoint fine-tuned for a few steps with the sigmoid loss exports and reloads
with identical embeddings (in transformers and in mmalign), and evaluates."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from tests.harness import cli_main
from tests.harness.hubcache import fabricate, offline_env
from tests.harness.siglip_fab import siglip_folder

FAMILIES = ("siglip", "siglip2")
LABELS = ["cat", "dog", "red circle", "blue square"]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("siglip_export")
    return {family: siglip_folder(root / family, family, seed=10 + i) for i, family in enumerate(FAMILIES)}


def _sigmoid_scores(loaded, image, labels, template="This is a photo of {}."):
    """mmalign's own zero-shot probabilities: sigmoid(scale * img @ txt + bias) per label."""
    with torch.no_grad():
        img = loaded.encode_image(loaded.preprocess(image)[None])  # (1, D)
        txt = loaded.encode_text([template.format(c) for c in labels])  # (K, D)
        logits = loaded.logit_scale * img @ txt.T + loaded.model.logit_bias  # (1, K)
    return torch.sigmoid(logits)[0].double()


@pytest.mark.parametrize("family", FAMILIES)
def test_pipeline_probabilities_equal_ours(folders, family, tmp_path, seed):
    from PIL import Image
    from transformers import pipeline

    from mmalign.export import export
    from mmalign.models.load import load

    out = export(folders[family], "hf", tmp_path / "hf")
    assert json.loads((out / "config.json").read_text())["model_type"] == family
    ours_loaded = load(folders[family])
    pixels = np.random.default_rng(seed).integers(0, 256, (32, 32, 3), dtype=np.uint8)
    image = Image.fromarray(pixels)  # the model's square size: both resize it to itself
    classify = pipeline("zero-shot-image-classification", model=str(out), device="cpu")
    theirs = {r["label"]: r["score"] for r in classify(image, candidate_labels=LABELS)}
    want = torch.tensor([theirs[c] for c in LABELS], dtype=torch.float64)
    ours = _sigmoid_scores(ours_loaded, image, LABELS)
    assert float(((ours - want).abs() / want).max()) <= 1e-5
    # the export read back by mmalign is the same model
    again = _sigmoid_scores(load(out), image, LABELS)
    assert float(((again - ours).abs() / ours).max()) <= 1e-6


@pytest.mark.integration
@pytest.mark.parametrize("family", FAMILIES)
def test_finetuned_by_name_exports_and_reloads_identically(
    folders, family, micro_overrides, tmp_path, monkeypatch, gen
):
    from safetensors.torch import load_file
    from transformers import AutoModel, AutoTokenizer

    from mmalign.config import load_config
    from mmalign.export import export
    from mmalign.models.load import load
    from mmalign.run.train import train

    hf_home = tmp_path / "hf_home"
    repo = f"google/{family}-tiny-finetune"
    fabricate(hf_home, repo, folders[family])
    offline_env(monkeypatch, hf_home)  # the name resolves from this cache alone
    overrides = [o for o in micro_overrides if not o.startswith("model.preset")]
    cfg = load_config(
        None,
        overrides
        + [
            f"model.pretrained={repo}",
            "loss.name=siglip",  # model.init_logit_bias unset: the checkpoint carries its bias
            "train.steps=3",
            "train.global_batch_size=8",
            "train.grad_cache_chunk_size=4",  # the chunked step replays the towers exactly
            "eval.suite=none",
            "monitor.probe_size=0",
        ],
    )
    run = train(cfg, show_progress=False)
    trained = load(run)
    before = load_file(str(folders[family] / "model.safetensors"))
    assert float(trained.model.logit_bias.detach()) != float(before["logit_bias"])  # the bias trained
    assert trained.logit_scale > 100  # the published-like scale was kept, not clamped to 100

    out = export(run, "hf", tmp_path / "hf")
    hf = AutoModel.from_pretrained(str(out), local_files_only=True).eval()
    tok = AutoTokenizer.from_pretrained(str(out), local_files_only=True)
    texts = ["a red circle.", "a photo of a dog", "two small birds"]
    enc = tok(texts, padding="max_length", max_length=64, return_tensors="pt")
    assert set(enc) == {"input_ids"}  # the export's tokenizer gives no attention mask, as the towers run
    with torch.no_grad():
        hf_text = F.normalize(hf.get_text_features(**enc).pooler_output, dim=-1)
    ours_text = trained.encode_text(texts)
    assert float((hf_text - ours_text).norm() / ours_text.norm()) <= 1e-5
    assert float(hf.logit_scale.detach().exp()) == pytest.approx(trained.logit_scale, rel=1e-6)
    assert float(hf.logit_bias.detach()) == float(trained.model.logit_bias.detach())

    reloaded = load(out)  # the export, read back by mmalign: identical embeddings
    images = torch.randn(2, 3, 32, 32, generator=gen)
    assert torch.equal(reloaded.encode_image(images), trained.encode_image(images))
    assert torch.equal(reloaded.encode_text(texts), ours_text)

    val = next(o.split("=", 1)[1] for o in overrides if o.startswith("data.val="))
    result = cli_main(
        "eval", "--model", str(out), "--suite", "shapes", "--data", val, "--out", str(tmp_path / "eval.json")
    )
    assert result.returncode == 0, result.stderr
    records = json.loads((tmp_path / "eval.json").read_text())
    assert {r["task"] for r in records} >= {"zeroshot_classification"}


def test_onnx_export_of_siglip_equals_ours(folders, tmp_path, gen):
    ort = pytest.importorskip("onnxruntime")
    from mmalign.data.tokenizer import HFTextTokenizer
    from mmalign.export import export
    from mmalign.models.load import load

    out = export(folders["siglip"], "onnx", tmp_path / "onnx")
    loaded = load(folders["siglip"])
    pixels = torch.randn(3, 3, 32, 32, generator=gen)  # another batch size than the traced one
    ids = HFTextTokenizer(out / "hf_text", 64)(
        ["a photo of a cat", "two small birds"]
    )  # the shipped tokenizer
    assert torch.equal(ids, loaded.tokenizer(["a photo of a cat", "two small birds"]))
    image = ort.InferenceSession(str(out / "image_encoder.onnx")).run(None, {"pixels": pixels.numpy()})[0]
    text = ort.InferenceSession(str(out / "text_encoder.onnx")).run(None, {"tokens": ids.numpy()})[0]
    assert torch.allclose(torch.from_numpy(image), loaded.encode_image(pixels), atol=1e-5)
    assert torch.allclose(torch.from_numpy(text), loaded.encode_text(ids), atol=1e-5)


@pytest.mark.parametrize(
    ("family", "fmt", "words"),
    [("siglip2", "onnx", "NaFlex"), ("siglip", "open_clip", "no open_clip export")],
)
def test_formats_it_cannot_take_are_one_line(folders, family, fmt, words, tmp_path):
    result = cli_main(
        "export", "--model", str(folders[family]), "--format", fmt, "--out", str(tmp_path / fmt)
    )
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and words in lines[0] and not (tmp_path / fmt).exists()


@pytest.mark.integration
def test_gradient_cache_gives_the_uncached_step(folders, micro_overrides, tmp_path):
    """Two SGD steps of a SigLIP model with and without the gradient cache: the same weights.
    (SGD: the key projections' biases have a zero gradient up to rounding, which Adam would
    scale to a full step.)"""
    from safetensors.torch import load_file

    from mmalign.config import load_config
    from mmalign.run.train import train

    overrides = [o for o in micro_overrides if not o.startswith(("model.preset", "output"))]
    finals = []
    for i, extra in enumerate(([], ["train.grad_cache_chunk_size=4"])):
        cfg = load_config(
            None,
            overrides
            + [
                f"model.pretrained={folders['siglip']}",
                "loss.name=siglip",
                "model.init_logit_bias=-10",
                "train.optimizer=sgd",
                "train.lr=0.05",
                "train.steps=2",
                "train.warmup_steps=0",
                "train.global_batch_size=8",
                "eval.suite=none",
                "monitor.probe_size=0",
                f"output={tmp_path / f'run{i}'}",
            ]
            + extra,
        )
        finals.append(load_file(str(train(cfg, show_progress=False) / "final" / "model.safetensors")))
    plain, cached = finals
    source = load_file(str(folders["siglip"] / "model.safetensors"))
    moved = plain["visual.hf.head.mlp.fc2.weight"] - source["vision_model.head.mlp.fc2.weight"]
    assert moved.norm() > 1e-4 * source["vision_model.head.mlp.fc2.weight"].norm()  # the steps did train
    ours = {k.replace("visual.hf.", "vision_model.").replace("text.hf.", "text_model."): k for k in plain}
    step = torch.cat([(plain[k] - source[h]).flatten() for h, k in ours.items()])  # the two steps' update
    gap = torch.cat([(cached[k] - plain[k]).flatten() for k in ours.values()])
    assert float(gap.norm()) <= 1e-5 * float(step.norm())


def test_siglip_loss_from_a_source_without_bias_is_one_line(micro_overrides, tmp_path):
    from mmalign.config import load_config
    from mmalign.data.transforms import preprocess_cfg
    from mmalign.errors import ConfigError
    from mmalign.models import build_model
    from mmalign.models.io import save_pretrained
    from mmalign.run.train import train

    clip = build_model(load_config(None, ["model.preset=micro"]).model)  # a CLIP: no bias
    source = save_pretrained(clip, tmp_path / "clip", preprocess=preprocess_cfg(clip.image_size))
    overrides = [o for o in micro_overrides if not o.startswith("model.preset")]
    cfg = load_config(None, overrides + [f"model.pretrained={source}", "loss.name=siglip", "eval.suite=none"])
    with pytest.raises(ConfigError) as e:
        train(cfg, show_progress=False)
    assert (
        "\n" not in str(e.value) and "model.init_logit_bias" in str(e.value) and str(source) in str(e.value)
    )
