"""A tokenizer path that holds no sentencepiece model (random bytes, a text file, a BPE vocab,
an empty file, a folder) is one line naming the path and what was expected: from the loader,
from the config (``model.tokenizer``, ``model.text.tokenizer_kwargs``), from a saved model
folder and from the CLI, never sentencepiece's RuntimeError traceback."""

from __future__ import annotations

import copy
import gzip
import random

import pytest

from mmalign.config import ConfigError, load_config
from mmalign.data.tokenizer import SPM_KEY, SentencePieceTokenizer, sentencepiece_vocab_size
from mmalign.errors import UsageError
from mmalign.models.tokenizers import build_tokenizer
from tests.harness import ROOT, cli_main


@pytest.fixture
def not_models(tmp_path, seed):
    """Files a user might pass by mistake, each named for what it is."""
    rng = random.Random(seed)
    files = {
        "random.model": bytes(rng.randrange(256) for _ in range(4096)),
        "captions.txt": b"a red circle\na blue square on the left\n",
        "empty.model": b"",
        "bpe_vocab.txt.gz": gzip.compress(b"#version: 0.2\ni n\nt h\n"),  # open_clip's CLIP BPE format
        "vocab.json": b'{"a": 0, "b": 1}',
    }
    for name, data in files.items():
        (tmp_path / name).write_bytes(data)
    (tmp_path / "folder.model").mkdir()
    return [tmp_path / name for name in files] + [tmp_path / "folder.model"]


def _one_line(msg: str, path) -> None:
    assert "\n" not in msg and str(path) in msg and "sentencepiece .model file" in msg, msg


def test_the_loader_names_the_path_and_what_it_expected(not_models):
    for path in not_models:
        for load in (
            SentencePieceTokenizer,
            sentencepiece_vocab_size,
            lambda p: build_tokenizer({"text_cfg": {"context_length": 8, "tokenizer_kwargs": {SPM_KEY: p}}}),
        ):
            with pytest.raises(UsageError) as err:
                load(str(path))
            _one_line(str(err.value), path)


def test_config_keys_name_the_key_before_anything_is_built(not_models):
    from mmalign.models import check_buildable

    for path in not_models:
        with pytest.raises(ConfigError) as err:
            load_config(None, [f"model.tokenizer={path}"])
        assert str(err.value).startswith("config key 'model.tokenizer': ")
        _one_line(str(err.value), path)
        # the tower's own tokenizer setting, as a saved arch carries it: checked by the start-up build
        cfg = load_config(
            None, ["model.preset=micro", f"model.text={{tokenizer_kwargs: {{{SPM_KEY}: '{path}'}}}}"]
        )
        with pytest.raises(ConfigError) as err:
            check_buildable(cfg.model)
        assert str(err.value).startswith("config key 'model.text.tokenizer_kwargs': ")
        _one_line(str(err.value), path)


def _saved_model_with_a_broken_tokenizer(tmp_path, not_a_model):
    """A micro model whose arch names ``not_a_model`` as its sentencepiece file, saved as a model
    folder (save_pretrained copies the file in as tokenizer.model), as a damaged copy would be."""
    from mmalign.data.transforms import preprocess_cfg
    from mmalign.models.io import save_pretrained
    from mmalign.models.presets import PRESETS
    from mmalign.models.two_tower import TwoTower

    arch = copy.deepcopy(PRESETS["micro"])
    arch["text_cfg"]["tokenizer_kwargs"] = {SPM_KEY: str(not_a_model)}
    model = TwoTower(arch)
    return save_pretrained(model, tmp_path / "final", preprocess=preprocess_cfg(model.image_size))


def test_a_saved_model_whose_tokenizer_is_broken_is_one_line(tmp_path, not_models):
    from mmalign.pretrained import load

    folder = _saved_model_with_a_broken_tokenizer(tmp_path, not_models[0])
    assert (folder / "tokenizer.model").read_bytes() == not_models[0].read_bytes()
    with pytest.raises(UsageError) as err:
        load(folder)
    _one_line(str(err.value), folder / "tokenizer.model")
    res = cli_main("eval", "--model", str(folder))
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2 and "Traceback" not in res.stderr and len(lines) == 1, res.stderr[-2000:]
    assert str(folder / "tokenizer.model") in lines[0]


def test_the_cli_gives_one_line_and_exit_2(not_models, tmp_path):
    out = tmp_path / "run"
    for path in (not_models[0], not_models[1]):  # random bytes, a text file
        res = cli_main(
            "train",
            "--config",
            str(ROOT / "configs" / "quickstart.yaml"),
            "--set",
            f"model.tokenizer={path}",
            "--output",
            str(out),
        )
        lines = res.stderr.strip().splitlines()
        assert res.returncode == 2 and "Traceback" not in res.stderr and len(lines) == 1, res.stderr[-2000:]
        assert lines[0].startswith("mmalign: error: config key 'model.tokenizer': ") and str(path) in lines[0]
        assert not out.exists()
