"""Export round trips: open_clip local-dir, transformers CLIPModel and ONNX reproduce
mmalign's embeddings on fresh random inputs; checkpoints (ZeRO-3) export the same
weights as final/; bad input is a one-line error (exit 2)."""

from __future__ import annotations

import copy
import json
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image

import mmalign
from mmalign.cli import main
from mmalign.data.transforms import preprocess_cfg
from mmalign.errors import UsageError
from mmalign.export import export
from mmalign.models import TwoTower
from mmalign.models.io import save_pretrained
from mmalign.models.presets import PRESETS

CAPTIONS = [
    "a small red circle in the top left corner",
    "blue square",
    "x",
    "there is a green star in the center of the picture",
    "one large cross, coloured pink, on gray",
]


def _save_random(path, seed: int, **arch_changes) -> str:
    """A random micro model with a non-default temperature, saved as mmalign's final/."""
    arch = copy.deepcopy(PRESETS["micro"])
    arch.update(arch_changes.pop("top", {}))
    for tower, changes in arch_changes.items():
        arch[tower].update(changes)
    torch.manual_seed(seed)
    model = TwoTower(arch, init_logit_scale=math.log(23.0))
    save_pretrained(model, path, preprocess=preprocess_cfg(model.image_size))
    return str(path)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return _save_random(tmp_path_factory.mktemp("m") / "final", seed=11)


def _inputs(loaded, n: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    images = torch.randn(n, 3, 16, 16, generator=g)  # (n, 3, S, S), fresh per test
    captions = [CAPTIONS[int(i)] for i in torch.randint(len(CAPTIONS), (n,), generator=g)]
    return images, loaded.tokenizer(captions), captions


def test_open_clip_local_dir_round_trip(model_dir, tmp_path):
    import open_clip

    out = tmp_path / "oc"
    export(model_dir, "open_clip", out)
    cfg = json.loads((out / "open_clip_config.json").read_text())
    assert cfg["model_cfg"]["custom_text"] is True and cfg["preprocess_cfg"]["size"] == 16
    oc, _, preprocess = open_clip.create_model_and_transforms(f"local-dir:{out}")
    tokenizer = open_clip.get_tokenizer(f"local-dir:{out}")
    oc.eval()
    assert type(oc).__name__ == "CustomTextCLIP"
    assert oc.logit_scale.ndim == 0 and math.isclose(float(oc.logit_scale.exp()), 23.0, rel_tol=1e-6)
    ours = mmalign.load(model_dir)
    images, tokens, captions = _inputs(ours, 6, seed=1)
    assert torch.equal(tokenizer(captions), tokens)
    with torch.no_grad():
        assert (oc.encode_image(images, normalize=True) - ours.encode_image(images)).abs().max() <= 1e-5
        assert (oc.encode_text(tokens, normalize=True) - ours.encode_text(tokens)).abs().max() <= 1e-5
    # open_clip's eval transform rebuilt from preprocess_cfg equals ours on a real image
    pil = Image.fromarray(np.random.default_rng(2).integers(0, 255, (23, 31, 3), dtype=np.uint8))
    assert torch.allclose(preprocess(pil), ours.preprocess(pil), atol=1e-6)


@pytest.mark.parametrize("quick_gelu", [False, True])
def test_hf_clipmodel_round_trip(tmp_path, quick_gelu):
    from transformers import CLIPModel

    src = _save_random(tmp_path / "final", seed=5 + quick_gelu, top={"quick_gelu": quick_gelu})
    out = tmp_path / "hf"
    export(src, "hf", out)
    hf = CLIPModel.from_pretrained(str(out)).eval()
    assert (
        hf.config.text_config.hidden_act
        == hf.config.vision_config.hidden_act
        == ("quick_gelu" if quick_gelu else "gelu")
    )
    assert hf.config.text_config.eos_token_id == 49407 and hf.config.text_config.pad_token_id == 0
    assert math.isclose(float(hf.logit_scale.exp()), 23.0, rel_tol=1e-6)
    ours = mmalign.load(src)
    images, tokens, _ = _inputs(ours, 5, seed=3)
    with torch.no_grad():
        # transformers 5.x: get_*_features return a ModelOutput whose pooler_output is the
        # projected, unnormalised embedding.
        img = F.normalize(hf.get_image_features(pixel_values=images).pooler_output, dim=-1)
        txt = F.normalize(hf.get_text_features(input_ids=tokens).pooler_output, dim=-1)
    assert (img - ours.encode_image(images)).abs().max() <= 1e-4
    assert (txt - ours.encode_text(tokens)).abs().max() <= 1e-4


def test_hf_rejects_towers_without_clipmodel_equivalent(tmp_path):
    src = _save_random(tmp_path / "final", seed=0, vision_cfg={"ls_init_value": 0.1})
    with pytest.raises(UsageError, match="ls_init_value"):
        export(src, "hf", tmp_path / "hf")
    src = _save_random(tmp_path / "final2", seed=0, vision_cfg={"pool_type": "avg"})
    with pytest.raises(UsageError, match="pool_type"):
        export(src, "hf", tmp_path / "hf2")


def test_onnx_round_trip_two_batch_sizes(model_dir, tmp_path):
    import onnx
    import onnxruntime as ort

    out = tmp_path / "onnx"
    export(model_dir, "onnx", out)
    ours = mmalign.load(model_dir)
    sessions = {}
    for name in ("image_encoder", "text_encoder"):
        graph = onnx.load(str(out / f"{name}.onnx"))
        assert max(o.version for o in graph.opset_import if o.domain in ("", "ai.onnx")) >= 14
        assert graph.graph.input[0].type.tensor_type.shape.dim[0].dim_param  # symbolic (dynamic) batch
        sessions[name] = ort.InferenceSession(str(out / f"{name}.onnx"), providers=["CPUExecutionProvider"])
    for n, seed in ((1, 7), (9, 8)):
        images, tokens, _ = _inputs(ours, n, seed)
        img = sessions["image_encoder"].run(None, {"pixels": images.numpy()})[0]
        txt = sessions["text_encoder"].run(None, {"tokens": tokens.numpy()})[0]
        assert img.shape == txt.shape == (n, 32)
        assert np.abs(img - ours.encode_image(images).numpy()).max() <= 1e-4
        assert np.abs(txt - ours.encode_text(tokens).numpy()).max() <= 1e-4


@pytest.mark.integration
def test_export_from_zero3_checkpoint_matches_final(shapes_dir, tmp_path):
    from safetensors.torch import load_file

    from mmalign.config import load_config
    from mmalign.run.train import train

    run = tmp_path / "run"
    train(
        load_config(
            None,
            [
                "model.preset=micro",
                f"data.train={shapes_dir}/train/{{00000..00001}}.tar",
                f"data.val={shapes_dir}/val/00000.tar",
                "data.workers=0",
                "data.shuffle_buffer=50",
                "train.global_batch_size=8",
                "train.steps=2",
                "train.warmup_steps=1",
                "train.lr=0.01",
                "train.checkpoint_every=2",
                "monitor.probe_size=0",
                "deepspeed.zero_stage=3",
                f"output={run}",
            ],
        ),
        show_progress=False,
    )
    step = run / "checkpoints" / "step_00000002"
    assert (
        main(["export", "--model", str(step), "--format", "open_clip", "--out", str(tmp_path / "from_ckpt")])
        == 0
    )
    export(run, "open_clip", tmp_path / "from_final")
    a = load_file(str(tmp_path / "from_ckpt" / "open_clip_model.safetensors"))
    b = load_file(str(tmp_path / "from_final" / "open_clip_model.safetensors"))
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    init = TwoTower(PRESETS["micro"]).state_dict()  # the run really moved the weights
    assert not torch.equal(a["visual.proj"], init["visual.proj"])
    # a pickle planted into this real checkpoint is refused (one line, exit 2), never run
    from tests.models.test_models_load_untrusted import plant

    marker = tmp_path / "MARKER"
    plant(next((step / "engine").glob("*optim_states.pt")), marker)
    assert (
        main(["export", "--model", str(step), "--format", "open_clip", "--out", str(tmp_path / "again")]) == 2
    )
    assert not marker.exists() and not (tmp_path / "again").exists()


def test_cli_errors_are_one_line(model_dir, tmp_path, capsys):
    assert (
        main(["export", "--model", str(tmp_path / "missing"), "--format", "hf", "--out", str(tmp_path / "o")])
        == 2
    )
    err = capsys.readouterr().err.strip()
    assert err.startswith("mmalign: error:") and "missing" in err and "\n" not in err
    assert main(["export", "--model", model_dir, "--format", "tensorflow", "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip()
    assert "invalid choice: 'tensorflow'" in err and "\n" not in err  # argparse's choices, one line
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("fmt", ["open_clip", "hf"])
def test_load_reads_an_export_folder_as_the_model_it_came_from(model_dir, tmp_path, fmt):
    """``mmalign.load`` (so eval, embed, mine and curate) takes another tool's folder: the
    embeddings equal the source model's, computed by open_clip's / HF's own forward in the
    round trips above; a folder without weights is a one-line error naming it."""
    out = tmp_path / fmt
    export(model_dir, fmt, out)
    ours, theirs = mmalign.load(model_dir), mmalign.load(out)
    assert theirs.kind == "export" and theirs.source == f"export folder {out}"
    images, tokens, captions = _inputs(ours, 4, seed=7)
    assert torch.equal(theirs.tokenizer(captions), tokens)
    with torch.no_grad():
        assert (theirs.encode_image(images) - ours.encode_image(images)).abs().max() <= 1e-5
        assert (theirs.encode_text(tokens) - ours.encode_text(tokens)).abs().max() <= 1e-5
    assert math.isclose(theirs.logit_scale, 23.0, rel_tol=1e-5)
    for weights in out.glob("*.safetensors"):
        weights.unlink()
    with pytest.raises(UsageError) as e:
        mmalign.load(out)
    assert str(out) in str(e.value) and "\n" not in str(e.value)
