"""WiSE-FT: the interpolated weights equal a naive per-tensor ``(1 - a) * A + a * B``; the ends
are the two models exactly; the written folders load; other architectures, weight sets and
tokenizers are refused in one line naming the first difference."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from mmalign.data.transforms import preprocess_cfg
from mmalign.errors import UsageError
from mmalign.models import TwoTower
from mmalign.models.io import save_pretrained
from mmalign.models.load import load
from mmalign.models.presets import PRESETS
from mmalign.models.tokenizers import build_tokenizer
from mmalign.models.wise_ft import interpolate, parse_alphas, wise_ft

CAPTIONS = ["a red circle", "two blue squares on grey", "x"]


def _model(seed: int, scale: float, arch: dict | None = None, **kw) -> TwoTower:
    torch.manual_seed(seed)
    return TwoTower(copy.deepcopy(arch or PRESETS["micro"]), init_logit_scale=math.log(scale), **kw)


def _save(model: TwoTower, folder):
    save_pretrained(model, folder, preprocess=preprocess_cfg(model.image_size))
    return folder


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("wise_ft")
    return _save(_model(1, 10.0), root / "zs"), _save(_model(2, 40.0), root / "ft")


def _naive(a: dict, b: dict, alpha: float) -> dict:
    """The WiSE-FT paper's per-tensor mix, written out (float64, back to A's dtype)."""
    out = {}
    for k in a:
        if a[k].is_floating_point():
            out[k] = ((1 - alpha) * a[k].double() + alpha * b[k].double()).to(a[k].dtype)
        else:
            out[k] = a[k] if alpha < 0.5 else b[k]
    return out


def _embeddings(loaded_or_model, tokenizer=None):
    model = getattr(loaded_or_model, "model", loaded_or_model).eval()
    images = torch.randn(3, 3, 16, 16, generator=torch.Generator().manual_seed(0))  # (3, 3, S, S)
    tokens = (tokenizer or build_tokenizer(model.arch))(CAPTIONS)  # (3, L)
    with torch.no_grad():
        return model.encode_image(images), model.encode_text(tokens)


@pytest.mark.parametrize("alpha", [0.0, 0.1, 0.25, 0.5, 0.8, 1.0])
def test_interpolation_equals_the_naive_per_tensor_mix(pair, alpha):
    a, b = load(pair[0]).model.state_dict(), load(pair[1]).model.state_dict()
    a["counter"], b["counter"] = torch.tensor(3), torch.tensor(7)  # an integer buffer: the nearer end's
    got = interpolate(a, b, alpha)
    want = _naive(a, b, alpha)
    assert set(got) == set(a)
    for k in a:
        assert got[k].dtype == a[k].dtype and torch.equal(got[k], want[k]), k
        if a[k].is_floating_point():  # and the float32 formula, as the WiSE-FT code computes it
            assert torch.allclose(got[k], (1 - alpha) * a[k] + alpha * b[k], rtol=1e-6, atol=1e-7), k
    assert int(got["counter"]) == (3 if alpha < 0.5 else 7)
    scale = math.exp((1 - alpha) * math.log(10.0) + alpha * math.log(40.0))  # the log temperature mixed
    assert math.isclose(float(got["logit_scale"].exp()), scale, rel_tol=1e-6)


def test_the_ends_are_the_two_models_exactly_and_the_middle_loads(pair, tmp_path):
    folders = wise_ft(pair[0], pair[1], [0.0, 0.5, 1.0], tmp_path / "out")
    assert [f.name for f in folders] == ["alpha_0", "alpha_0.5", "alpha_1"]
    for folder, source in ((folders[0], pair[0]), (folders[2], pair[1])):
        got, want = _embeddings(load(folder)), _embeddings(load(source))
        assert all(torch.equal(g, w) for g, w in zip(got, want))
    middle = load(folders[1])
    assert middle.config["wise_ft"] == {"zero_shot": str(pair[0]), "fine_tuned": str(pair[1]), "alpha": 0.5}
    naive = _model(0, 1.0)
    naive.load_state_dict(
        _naive(load(pair[0]).model.state_dict(), load(pair[1]).model.state_dict(), 0.5), strict=True
    )
    got, want = _embeddings(middle), _embeddings(naive)
    assert all(torch.equal(g, w) for g, w in zip(got, want))
    assert (tmp_path / "one").exists() is False
    (single,) = wise_ft(pair[0], pair[1], [0.25], tmp_path / "one")
    assert single == tmp_path / "one" and load(single).config["wise_ft"]["alpha"] == 0.25


def test_a_siglip_bias_is_interpolated_too(tmp_path):
    a = _save(_model(1, 10.0, init_logit_bias=-10.0), tmp_path / "a")
    b = _save(_model(2, 10.0, init_logit_bias=-2.0), tmp_path / "b")
    (out,) = wise_ft(a, b, [0.25], tmp_path / "out")
    assert math.isclose(float(load(out).model.logit_bias.detach().reshape(-1)[0]), -8.0, rel_tol=1e-6)


def test_mismatches_are_one_line_naming_the_first_difference(pair, tmp_path):
    wide = copy.deepcopy(PRESETS["micro"])
    wide["text_cfg"]["width"] = 48
    other = _save(_model(3, 10.0, wide), tmp_path / "wide")
    with pytest.raises(UsageError) as e:
        wise_ft(pair[0], other, [0.5], tmp_path / "o1")
    msg = str(e.value)
    assert "\n" not in msg and "are not one architecture: text_cfg.width: 32 vs 48" in msg
    biased = _save(_model(3, 10.0, init_logit_bias=-10.0), tmp_path / "biased")
    with pytest.raises(UsageError, match="only --fine-tuned has the weight logit_bias"):
        wise_ft(pair[0], biased, [0.5], tmp_path / "o2")
    assert not (tmp_path / "o1").exists() and not (tmp_path / "o2").exists()  # nothing written


def _spm_model(root, model_type: str, seed: int):
    """A micro model whose text tower reads a small sentencepiece vocabulary (exactly 28 pieces)."""
    spm = pytest.importorskip("sentencepiece")
    from mmalign.config import load_config
    from mmalign.models import build_model

    root.mkdir(parents=True, exist_ok=True)
    words = "red green blue circle square star small large left right top bottom corner a the of"
    (root / "captions.txt").write_text(
        "\n".join(f"{w} {v} {u}" for w in words.split() for v in words.split() for u in "abc")
    )
    spm.SentencePieceTrainer.train(
        input=str(root / "captions.txt"),
        model_prefix=str(root / "spm"),
        vocab_size=28,
        model_type=model_type,
        character_coverage=1.0,
        unk_id=0,
        bos_id=-1,
        eos_id=-1,
        pad_id=-1,
        minloglevel=2,
    )
    cfg = load_config(None, ["model.preset=micro", f"model.tokenizer={root / 'spm.model'}"])
    torch.manual_seed(seed)
    return _save(build_model(cfg.model), root / "model")


def test_sentencepiece_models_mix_with_their_tokenizer_and_another_vocabulary_is_refused(tmp_path):
    a = _spm_model(tmp_path / "a", "unigram", 1)
    b = _spm_model(tmp_path / "b", "unigram", 2)  # the same vocabulary, trained again
    c = _spm_model(tmp_path / "c", "bpe", 3)  # 28 pieces too: same shapes, other ids
    (out,) = wise_ft(a, b, [0.5], tmp_path / "out")
    mixed, source = load(out), load(a)
    assert (out / "tokenizer.model").read_bytes() == (tmp_path / "a" / "spm.model").read_bytes()
    assert torch.equal(mixed.tokenizer(CAPTIONS), source.tokenizer(CAPTIONS))
    with pytest.raises(UsageError, match="their tokenizers differ") as e:
        wise_ft(a, c, [0.5], tmp_path / "out2")
    assert "\n" not in str(e.value)


def test_bad_alphas_are_one_line_each():
    assert parse_alphas("0,0.25, 0.5,0.25") == [0.0, 0.25, 0.5]
    for text, why in (
        ("1.5", r"outside \[0, 1\]"),
        ("-0.1", r"outside \[0, 1\]"),
        ("nan", "outside"),
        ("a", "not a number"),
    ):
        with pytest.raises(UsageError, match=why) as e:
            parse_alphas(text)
        assert "\n" not in str(e.value) and str(e.value).startswith(f"--alpha {text}: ")
    with pytest.raises(UsageError, match=r"outside \[0, 1\]"):
        interpolate({}, {}, 1.01)


def test_an_existing_model_in_out_is_kept_unless_overwrite(pair, tmp_path):
    wise_ft(pair[0], pair[1], [0.5], tmp_path / "out")
    with pytest.raises(UsageError, match="already holds a model"):
        wise_ft(pair[0], pair[1], [0.5], tmp_path / "out")
    wise_ft(pair[0], pair[1], [0.75], tmp_path / "out", overwrite=True)
    assert load(tmp_path / "out").config["wise_ft"]["alpha"] == 0.75


@pytest.mark.parametrize("family", ["siglip", "siglip2"])
def test_a_siglip_checkpoint_and_its_fine_tuned_copy(tmp_path, family):
    """A transformers SigLIP folder (its own tokenizer, scale above 100, bias) as the zero-shot
    model and a saved copy with moved weights as the fine-tuned one: the ends are the two, the
    middle mixes the scale and the bias, and every output loads with the SigLIP tokenizer."""
    pytest.importorskip("transformers")
    from tests.harness.siglip_fab import CAPTIONS as SIGLIP_CAPTIONS
    from tests.harness.siglip_fab import siglip_folder

    zero = siglip_folder(tmp_path, family, seed=0)
    source = load(zero)
    tuned = copy.deepcopy(source.model)
    with torch.no_grad():
        for p in tuned.parameters():
            p.add_(0.01 * torch.randn_like(p))
        tuned.logit_bias.fill_(-4.5)
    save_pretrained(tuned, tmp_path / "ft", preprocess=dict(source.preprocess_cfg))
    folders = wise_ft(zero, tmp_path / "ft", [0.0, 0.5, 1.0], tmp_path / "out")
    ends = [load(folders[0]), load(folders[2])]
    for got, want in zip(ends, (source.model, tuned)):
        state = got.model.state_dict()
        assert all(torch.equal(state[k], v) for k, v in want.state_dict().items())
    middle = load(folders[1])
    assert math.isclose(float(middle.model.logit_bias.detach().reshape(-1)[0]), -8.5, rel_tol=1e-6)
    assert middle.model.max_logit_scale >= math.exp(4.75)  # the published scale is not clamped
    assert torch.equal(middle.tokenizer(SIGLIP_CAPTIONS), source.tokenizer(SIGLIP_CAPTIONS))
