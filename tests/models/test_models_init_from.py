"""``model.pretrained`` / ``pretrained_image`` / ``pretrained_text``: a model started from a
saved mmalign model, its open_clip export (local-dir folder and bare weights file), an
``open_clip_train``-style checkpoint (``{"state_dict": {"module.…"}}``, written here from a real
open_clip ``CLIP``) and its HF ``CLIPModel`` export reproduces the source's embeddings at
step 0; misfits, a disagreeing preset and pickled code are one-line ConfigErrors."""

from __future__ import annotations

import copy
import logging
import math
import pathlib

import pytest
import torch
from safetensors.torch import load_file, save_file

from mmalign.config import Config, ConfigError, ModelConfig, resolve, validate
from mmalign.data.transforms import preprocess_cfg
from mmalign.export import export
from mmalign.models import TwoTower, build_model, check_buildable
from mmalign.models.init_from import differences
from mmalign.models.io import save_pretrained
from mmalign.models.load import load
from mmalign.models.presets import PRESETS
from mmalign.models.tokenizers import build_tokenizer

CAPTIONS = ["a small red circle in the top left corner", "blue square", "there is a green star", "x"]


@pytest.fixture(scope="module")
def src(tmp_path_factory):
    """A random micro model (non-default temperature) saved as a run's final/, plus its exports."""
    root = tmp_path_factory.mktemp("init_from")
    torch.manual_seed(5)
    model = TwoTower(copy.deepcopy(PRESETS["micro"]), init_logit_scale=math.log(23.0))
    save_pretrained(model, root / "run" / "final", preprocess=preprocess_cfg(model.image_size))
    export(root / "run", "open_clip", root / "oc")
    export(root / "run", "hf", root / "hf")
    return root


def _cfg(**model_keys) -> ModelConfig:
    cfg = Config(model=ModelConfig(**model_keys))
    resolve(cfg)  # what load_config does: fills model.preset when the source carries no architecture
    validate(cfg)
    return cfg.model


def _embeddings(model, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    images = torch.randn(4, 3, 16, 16, generator=g)  # (4, 3, S, S)
    tokens = build_tokenizer(model.arch)(CAPTIONS)  # (4, L)
    model.eval()
    with torch.no_grad():
        return model.encode_image(images), model.encode_text(tokens), model.logit_scale.detach().clone()


def _open_clip_train_checkpoint(src, path):
    """What open_clip_train saves under DDP: a real open_clip CLIP (text tower at the top level,
    0-dim logit_scale), its keys prefixed ``module.``, wrapped with the epoch and optimizer."""
    import open_clip

    towers = load(src / "run").model.towers  # open_clip's tower dicts (model.arch adds each kind:)
    clip = open_clip.model.CLIP(
        towers.embed_dim, towers.vision.open_clip_cfg(), towers.text.open_clip_cfg(), quick_gelu=False
    )
    state = load_file(str(src / "oc" / "open_clip_model.safetensors"))
    plain = {(k[len("text.") :] if k.startswith("text.") else k): v for k, v in state.items()}
    clip.load_state_dict(plain, strict=True)  # open_clip's own names: the layout is real
    torch.save(
        {
            "epoch": 2,
            "name": "run",
            "state_dict": {"module." + k: v for k, v in clip.state_dict().items()},
            "optimizer": {"state": {}, "param_groups": [{"lr": 0.1, "params": [0, 1]}]},
        },
        path,
    )
    return clip.eval()


@pytest.mark.parametrize(
    "source,preset,tol",
    [
        ("run", None, 1e-5),
        ("run/final", "micro", 1e-5),
        ("oc", None, 1e-5),
        ("oc/open_clip_model.safetensors", "micro", 1e-5),
        ("train.pt", "micro", 1e-5),
        ("hf", None, 1e-4),
    ],
)
def test_init_from_each_source_reproduces_the_source_embeddings(src, source, preset, tol):
    reference = load(src / "run").model
    if source == "train.pt" and not (src / source).exists():
        _open_clip_train_checkpoint(src, src / source)
    torch.manual_seed(99)  # another random init: everything must come from the source
    model = build_model(_cfg(pretrained=str(src / source), preset=preset))
    assert differences(model.arch, reference.arch) == []  # the architecture came from the source
    shapes = {k: v.shape for k, v in reference.state_dict().items()}
    assert {k: v.shape for k, v in model.state_dict().items()} == shapes
    for got, want in zip(_embeddings(model), _embeddings(reference)):
        assert (got - want).abs().max().item() <= tol
    assert math.isclose(float(model.logit_scale.detach().exp()), 23.0, rel_tol=1e-6)


def test_open_clip_train_checkpoint_matches_open_clip_itself(src, tmp_path):
    """Against open_clip's own CLIP forward (not ours) on the same inputs."""
    clip = _open_clip_train_checkpoint(src, tmp_path / "epoch_2.pt")
    model = build_model(_cfg(pretrained=str(tmp_path / "epoch_2.pt"), preset="micro"))
    image, text, _ = _embeddings(model)
    g = torch.Generator().manual_seed(0)
    images = torch.randn(4, 3, 16, 16, generator=g)
    import open_clip

    with torch.no_grad():
        want_image = clip.encode_image(images, normalize=True)
        want_text = clip.encode_text(
            open_clip.get_tokenizer("ViT-B-32", context_length=16)(CAPTIONS), normalize=True
        )
    assert (image - want_image).abs().max().item() <= 1e-5
    assert (text - want_text).abs().max().item() <= 1e-5


def _misfit(src, tmp_path):
    state = load_file(str(src / "oc" / "open_clip_model.safetensors"))
    del state["visual.ln_post.bias"]
    state["visual.extra_head.weight"] = torch.zeros(3)
    save_file(state, str(tmp_path / "misfit.safetensors"))
    return tmp_path / "misfit.safetensors"


@pytest.mark.parametrize("at", ["build", "start-up"])
def test_missing_and_unexpected_weights_are_one_config_error_listing_them(src, tmp_path, at):
    path = _misfit(src, tmp_path)
    with pytest.raises(ConfigError) as e:  # start-up: the meta-device check, names and shapes only
        (build_model if at == "build" else check_buildable)(_cfg(pretrained=str(path), preset="micro"))
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("config key 'model.pretrained': ")
    assert "missing visual.ln_post.bias" in msg and "unexpected visual.extra_head.weight" in msg


@pytest.mark.parametrize("source", ["train.pt", "oc", "hf", "run"])
def test_start_up_check_passes_a_fitting_source_and_refuses_another_shape(src, tmp_path, source):
    if not (src / "train.pt").exists():  # each case needs it (the refusal below), in any order
        _open_clip_train_checkpoint(src, src / "train.pt")
    preset = "micro" if source == "train.pt" else None
    check_buildable(_cfg(pretrained=str(src / source), preset=preset))
    with pytest.raises(ConfigError, match=r"model.pretrained_text.*of shape .* the model needs"):
        check_buildable(_cfg(preset="micro", text={"width": 48}, pretrained_text=str(src / "train.pt")))


def test_strict_false_logs_the_misfit_and_loads_the_rest(src, tmp_path, caplog):
    path = _misfit(src, tmp_path)
    torch.manual_seed(3)
    fresh = build_model(_cfg(preset="micro"))
    torch.manual_seed(3)
    with caplog.at_level(logging.WARNING, logger="mmalign.models.init_from"):
        model = build_model(_cfg(pretrained=str(path), preset="micro", pretrained_strict=False))
    assert "visual.ln_post.bias" in caplog.text and "visual.extra_head.weight" in caplog.text
    source = load(src / "run").model.state_dict()
    got = model.state_dict()
    assert torch.equal(got["visual.ln_post.weight"], source["visual.ln_post.weight"])
    assert torch.equal(got["visual.proj"], source["visual.proj"])
    assert torch.equal(got["visual.ln_post.bias"], fresh.state_dict()["visual.ln_post.bias"])  # left at init


@pytest.mark.parametrize(
    "key,tower,other", [("pretrained_image", "visual.", "text."), ("pretrained_text", "text.", "visual.")]
)
def test_one_tower_loads_only_that_tower(src, key, tower, other):
    source = load(src / "run").model.state_dict()
    torch.manual_seed(7)
    fresh = build_model(_cfg(preset="micro")).state_dict()
    torch.manual_seed(7)  # the same random init, then one tower from the source
    got = build_model(_cfg(preset="micro", **{key: str(src / "oc")})).state_dict()
    for name, value in got.items():
        if name.startswith(tower):
            assert torch.equal(value, source[name]), name
        else:
            assert torch.equal(value, fresh[name]), name
    differs = [n for n in got if n.startswith(other) and not torch.equal(source[n], fresh[n])]
    assert differs  # the untouched tower really is not the source's
    assert torch.equal(got["logit_scale"], fresh["logit_scale"])


def test_load_happens_before_locking(src):
    model = build_model(_cfg(pretrained=str(src / "hf"), lock_image=True))
    source = load(src / "run").model.state_dict()
    assert torch.equal(model.state_dict()["visual.conv1.weight"], source["visual.conv1.weight"])
    assert not any(p.requires_grad for p in model.visual.parameters())
    assert all(p.requires_grad for p in model.text.parameters())


@pytest.mark.parametrize("source", ["run", "oc", "hf"])
def test_a_disagreeing_preset_is_refused(src, source):
    with pytest.raises(
        ConfigError, match=r"^config key 'model.preset': 'tiny' differs from the architecture"
    ) as e:
        build_model(_cfg(pretrained=str(src / source), preset="tiny"))
    assert "\n" not in str(e.value)


def test_a_one_tower_source_of_another_architecture_is_refused(src):
    with pytest.raises(ConfigError, match="model.pretrained_image"):
        build_model(_cfg(preset="tiny", pretrained_image=str(src / "run")))


def test_config_time_errors_name_the_key(src, tmp_path):
    for key in ("pretrained", "pretrained_image", "pretrained_text"):
        with pytest.raises(ConfigError, match=f"config key 'model.{key}': .* does not exist"):
            _cfg(**{key: str(tmp_path / "nowhere")})
    with pytest.raises(ConfigError, match="config key 'model.pretrained'"):
        _cfg(pretrained=str(src / "run"), pretrained_image=str(src / "oc"))
    assert _cfg().preset == "tiny" and _cfg(pretrained=str(src / "run")).preset is None
    (tmp_path / "empty").mkdir()
    with pytest.raises(
        ConfigError, match="config key 'model.pretrained': .* is no open_clip checkpoint file"
    ):
        build_model(_cfg(pretrained=str(tmp_path / "empty")))


def test_a_pickle_with_code_is_refused_not_run(src, tmp_path):
    torch.save(
        {"state_dict": {"visual.proj": torch.zeros(2)}, "where": pathlib.PurePosixPath("/x")},
        tmp_path / "planted.pt",
    )
    with pytest.raises(ConfigError, match="is not a plain weights file"):
        build_model(_cfg(pretrained=str(tmp_path / "planted.pt"), preset="micro"))


def test_a_run_starts_from_an_open_clip_export_with_the_preset_omitted(src, micro_overrides):
    """The whole path: load_config -> train; the image tower locked, so final/ must hold the
    source's vision weights bitwise, and the run's architecture is the source's."""
    from mmalign.config import load_config
    from mmalign.run.train import train

    overrides = [o for o in micro_overrides if not o.startswith("model.preset")]
    cfg = load_config(
        None,
        overrides
        + [
            f"model.pretrained={src / 'oc'}",
            "model.lock_image=true",
            "train.steps=2",
            "train.warmup_steps=0",
            "monitor.probe_size=0",
            "train.checkpoint_every=0",
            "train.eval_every=0",
        ],
    )
    assert cfg.model.preset is None
    out = train(cfg, show_progress=False)
    final, source = load(out).model, load(src / "run").model
    assert differences(final.arch, source.arch) == []
    got, want = final.state_dict(), source.state_dict()
    assert all(torch.equal(got[k], want[k]) for k in want if k.startswith("visual."))
    assert any(not torch.equal(got[k], want[k]) for k in want if k.startswith("text."))  # it did train
