"""A sentencepiece tokenizer trained on shard captions: CLI, token layout, the text tower, save/load."""

import json
import random

import pytest
import torch

from data_pipelines.writer import ShardWriter
from mmalign.cli import main
from mmalign.config import ConfigError, load_config
from mmalign.data.tokenizer import SentencePieceTokenizer
from mmalign.models.tokenizers import build_tokenizer
from tests.harness import pick_seed

WORDS = [
    "red",
    "green",
    "blue",
    "circle",
    "square",
    "small",
    "large",
    "left",
    "right",
    "photo",
    "of",
    "a",
    "the",
]


@pytest.fixture(scope="module")
def caption_shards(tmp_path_factory):
    from PIL import Image

    rng = random.Random(pick_seed(21))
    out = tmp_path_factory.mktemp("caps")
    with ShardWriter(out, samples_per_shard=60) as w:
        for _ in range(120):
            lines = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 9))) for _ in range(2)]
            w.write(Image.new("RGB", (4, 4)), "\n".join(lines))
    return out


@pytest.fixture(scope="module")
def spm_file(caption_shards, tmp_path_factory):
    out = tmp_path_factory.mktemp("tok") / "spm.model"
    assert (
        main(
            [
                "tokenizer",
                "train",
                "--data",
                f"{caption_shards}/{{00000..00001}}.tar",
                "--vocab-size",
                "60",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    return out


def test_token_layout_sot_eot_padding_and_truncation(spm_file, seed):
    info = json.loads(spm_file.with_suffix(".json").read_text())
    assert info["captions"] == 240 and 13 < info["pieces"] <= 60
    # 24 fits two words even split into single characters, and 30 words never fit
    tok = SentencePieceTokenizer(spm_file, context_length=24)
    assert tok.vocab_size == info["vocab_size"] == info["pieces"] + 3
    rng = random.Random(seed)
    short = " ".join(rng.choice(WORDS) for _ in range(2))
    long = " ".join(rng.choice(WORDS) for _ in range(30))
    ids = tok([short, long, "RED  Circle"])
    assert ids.shape == (3, 24) and ids.dtype == torch.long
    n = len(tok.encode(short))
    assert (
        ids[0, 0] == tok.sot_token_id and ids[0, n + 1] == tok.eot_token_id and (ids[0, n + 2 :] == 0).all()
    )
    assert ids[1, -1] == tok.eot_token_id and (ids[1] > 0).all()  # cut, still ends with eot
    assert (ids.argmax(dim=1) == torch.tensor([n + 1, 23, ids[2].tolist().index(tok.eot_token_id)])).all()
    assert tok.decode(ids[0]) == short  # pieces round-trip (lower case, collapsed spaces)
    assert torch.equal(tok(["red circle"]), ids[2:3])
    assert ids.max() < tok.vocab_size and ids[ids > 0].min() >= 1


def test_model_tokenizer_sets_the_tower_and_survives_save_and_load(spm_file, tmp_path):
    from mmalign.models import build_model
    from mmalign.models.io import save_pretrained
    from mmalign.pretrained import load

    cfg = load_config(None, ["model.preset=micro", f"model.tokenizer={spm_file}"])
    tok = SentencePieceTokenizer(spm_file)
    assert cfg.model.text["vocab_size"] == tok.vocab_size
    model = build_model(cfg.model)
    assert model.text.token_embedding.num_embeddings == tok.vocab_size
    tokenizer = build_tokenizer(model.arch)
    assert isinstance(tokenizer, SentencePieceTokenizer) and tokenizer.context_length == model.context_length
    texts = ["a small red circle", "the large blue square on the left"]
    model.eval()
    with torch.no_grad():
        before = model.encode_text(tokenizer(texts))
    save_pretrained(model, tmp_path / "final", preprocess={"size": model.image_size})
    spm_file.rename(spm_file.with_name("moved.model"))  # the saved folder must not need the original
    try:
        loaded = load(tmp_path)
        assert (
            json.loads((tmp_path / "final" / "model_config.json").read_text())["tokenizer"]["type"]
            == "sentencepiece"
        )
        assert torch.allclose(loaded.encode_text(texts), before, atol=1e-6)
    finally:
        spm_file.with_name("moved.model").rename(spm_file)


def test_tokenizer_mistakes_are_one_line_errors(spm_file, caption_shards, tmp_path, capsys):
    with pytest.raises(ConfigError, match="smaller than the tokenizer"):
        load_config(None, [f"model.tokenizer={spm_file}", "model.text={vocab_size: 10}"])
    with pytest.raises(ConfigError, match="file not found"):
        load_config(None, [f"model.tokenizer={tmp_path / 'none.model'}"])
    assert (
        main(
            [
                "tokenizer",
                "train",
                "--data",
                f"{tmp_path}/x.tar",
                "--vocab-size",
                "50",
                "--out",
                str(tmp_path / "a.model"),
            ]
        )
        == 2
    )
    assert (
        main(
            [
                "tokenizer",
                "train",
                "--data",
                f"{caption_shards}/00000.tar",
                "--vocab-size",
                "50",
                "--out",
                str(tmp_path / "a.spm"),
            ]
        )
        == 2
    )
    assert "must end in .model" in capsys.readouterr().err
