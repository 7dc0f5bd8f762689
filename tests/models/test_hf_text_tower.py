"""A Hugging Face text tower from a local folder (``model.text.hf_local_dir``): a tiny random
BERT and WordPiece tokenizer written by the test, trained for 5 steps, saved, reloaded without
the folder, exported to open_clip and reloaded there; misuse is one ConfigError line."""

import json
import shutil

import pytest
import torch

from mmalign.cli import main
from mmalign.config import ConfigError, ModelConfig, load_config

WORDS = [
    "a",
    "an",
    "the",
    "red",
    "green",
    "blue",
    "yellow",
    "purple",
    "orange",
    "circle",
    "square",
    "triangle",
    "star",
    "small",
    "large",
    "big",
    "left",
    "right",
    "top",
    "bottom",
    "of",
    "on",
    "in",
    "and",
    "photo",
    "shape",
    "image",
    "picture",
    "with",
    "to",
    "at",
    "above",
    "below",
    "next",
    "center",
]
SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
CONTEXT = 12  # < max_position_embeddings (24): the tokenizer length is model.text.context_length


def make_bert_folder(path, weights: bool = True, vocab_size: int | None = None, seed: int = 0):
    """A transformers BERT folder: config (+ random weights) and a WordPiece fast tokenizer."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors
    from transformers import BertConfig, BertModel, PreTrainedTokenizerFast

    vocab = SPECIAL + WORDS + ["##s", "##ed", "##ing"]
    tok = Tokenizer(models.WordPiece({w: i for i, w in enumerate(vocab)}, unk_token="[UNK]"))
    tok.normalizer = normalizers.BertNormalizer(lowercase=True)
    tok.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
    tok.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[("[CLS]", 2), ("[SEP]", 3)]
    )
    PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="[UNK]",
        pad_token="[PAD]",
        cls_token="[CLS]",
        sep_token="[SEP]",
        mask_token="[MASK]",
    ).save_pretrained(str(path))
    config = BertConfig(
        vocab_size=vocab_size or len(vocab),
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=32,
        max_position_embeddings=24,
    )
    if weights:
        torch.manual_seed(seed)
        BertModel(config, add_pooling_layer=False).save_pretrained(str(path))
    else:
        config.save_pretrained(str(path))
    return path


@pytest.fixture
def bert_dir(tmp_path):
    return make_bert_folder(tmp_path / "bert")


def hf_ids(folder, texts, length=CONTEXT):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    return tok(texts, padding="max_length", truncation=True, max_length=length, return_tensors="pt")[
        "input_ids"
    ]


def test_folder_weights_and_tokenizer_are_the_towers(bert_dir):
    from transformers import BertModel

    from mmalign.data.tokenizer import HFTextTokenizer
    from mmalign.models import build_model
    from mmalign.models.tokenizers import build_tokenizer

    cfg = load_config(
        None,
        ["model.preset=micro", f"model.text.hf_local_dir={bert_dir}", f"model.text.context_length={CONTEXT}"],
    )
    model = build_model(cfg.model)
    text_cfg = model.arch["text_cfg"]
    assert text_cfg["hf_model_pretrained"] is True and "hf_local_dir" not in text_cfg
    assert model.context_length == CONTEXT and model.text.context_length == 24
    source = BertModel.from_pretrained(str(bert_dir), add_pooling_layer=False).state_dict()
    own = model.text.transformer.state_dict()
    assert set(own) == set(source) and all(torch.equal(own[k], source[k]) for k in source)
    tokenizer = build_tokenizer(model.arch)
    assert isinstance(tokenizer, HFTextTokenizer)
    texts = ["a small  red circle", "the large blue square on the left of a yellow star and a green triangle"]
    ids = tokenizer(texts)
    assert ids.shape == (2, CONTEXT) and torch.equal(
        ids, hf_ids(bert_dir, [" ".join(t.split()) for t in texts])
    )
    assert ids[0, 0] == 2 and ids[1, -1] == 3 and (ids[0, 6:] == 0).all()  # [CLS] ... [SEP], cut, [PAD]=0
    # without weights in the folder the tower starts from random init
    nw = make_bert_folder(bert_dir.parent / "bert_config_only", weights=False)
    cfg = load_config(None, ["model.preset=micro", f"model.text.hf_local_dir={nw}"])
    assert build_model(cfg.model).arch["text_cfg"]["hf_model_pretrained"] is False


@pytest.mark.integration
def test_train_save_reload_without_folder_and_export_open_clip(
    bert_dir, micro_overrides, tmp_path, monkeypatch, capsys
):
    import open_clip

    from mmalign.errors import UsageError
    from mmalign.export import export
    from mmalign.models.load import load
    from mmalign.run.train import train

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    cfg = load_config(
        None,
        micro_overrides
        + [
            "train.steps=5",
            "train.global_batch_size=8",
            "eval.suite=none",
            "monitor.probe_size=0",
            f"model.text.hf_local_dir={bert_dir}",
            f"model.text.context_length={CONTEXT}",
        ],
    )
    # The tower's 43-id embedding table: CLIP BPE ids (up to 49407) would fail the first step,
    # so training ran on the folder's tokenizer.
    run = train(cfg, show_progress=False)
    final = run / "final"
    saved = json.loads((final / "model_config.json").read_text())
    assert saved["tokenizer"]["type"] == "hf" and (final / "hf_text" / "tokenizer.json").is_file()
    assert saved["arch"]["text_cfg"]["hf_model_name"] == "hf_text"
    assert not (final / "hf_text" / "model.safetensors").exists()  # the trained weights are the model's
    texts = ["a red circle", "a big blue square left of a star"]
    want_ids = hf_ids(bert_dir, texts)
    moved = bert_dir.rename(bert_dir.with_name("elsewhere"))  # final/ must not need the original folder
    source = load(run)
    assert torch.equal(source.tokenizer(texts), want_ids)
    emb = source.encode_text(texts)  # (2, 32)
    assert emb.shape == (2, 32) and torch.allclose(emb.norm(dim=1), torch.ones(2), atol=1e-5)
    trained = source.model.text.transformer.state_dict()
    from safetensors.torch import load_file

    initial = load_file(str(moved / "model.safetensors"))
    assert any(not torch.equal(trained[k], initial[k]) for k in initial)  # the text tower trained
    # a new run initialised from this one (model.pretrained) rebuilds the tower from final/hf_text
    from mmalign.models import build_model
    from mmalign.models.tokenizers import build_tokenizer

    again = build_model(load_config(None, [f"model.pretrained={run}"]).model).eval()
    with torch.no_grad():
        assert torch.allclose(again.encode_text(build_tokenizer(again.arch)(texts)), emb, atol=1e-6)

    out = export(run, "open_clip", tmp_path / "oc")
    oc = open_clip.create_model("local-dir:" + str(out))
    oc.eval()
    oc_tok = open_clip.get_tokenizer("local-dir:" + str(out))
    assert torch.equal(oc_tok(texts), want_ids)
    with torch.no_grad():
        theirs = torch.nn.functional.normalize(oc.encode_text(oc_tok(texts)), dim=-1)
    assert torch.allclose(theirs, emb, atol=1e-5)
    import onnxruntime as ort
    from transformers import AutoTokenizer

    onnx_dir = export(run, "onnx", tmp_path / "onnx")
    info = json.loads((onnx_dir / "onnx_config.json").read_text())["tokenizer"]
    assert info == {"type": "hf", "folder": "hf_text", "context_length": CONTEXT}
    shipped = AutoTokenizer.from_pretrained(str(onnx_dir / "hf_text"), local_files_only=True)
    ids = shipped(texts, padding="max_length", truncation=True, max_length=CONTEXT, return_tensors="np")[
        "input_ids"
    ]
    session = ort.InferenceSession(str(onnx_dir / "text_encoder.onnx"), providers=["CPUExecutionProvider"])
    assert torch.allclose(torch.from_numpy(session.run(None, {"tokens": ids})[0]), emb, atol=1e-5)
    with pytest.raises(UsageError, match="hf_model_name"):  # no CLIPModel equivalent: one line
        export(run, "hf", tmp_path / "hf")
    assert main(["eval", "--model", str(final), "--suite", "shapes", "--limit", "20"]) == 0, (
        capsys.readouterr().err
    )


def test_misuse_is_one_config_error_line(bert_dir, tmp_path):
    from mmalign.models import check_buildable

    def refused(*overrides, match):
        with pytest.raises(ConfigError, match=match) as e:
            check_buildable(load_config(None, ["model.preset=micro", *overrides]).model)
        assert "\n" not in str(e.value)

    refused(f"model.text.hf_local_dir={tmp_path / 'nope'}", match="hf_local_dir.*not a folder")
    (tmp_path / "empty").mkdir()
    refused(f"model.text.hf_local_dir={tmp_path / 'empty'}", match="hf_local_dir.*no config.json")
    no_tok = tmp_path / "no_tok"
    shutil.copytree(bert_dir, no_tok)
    for f in no_tok.glob("tok*"):
        f.unlink()
    refused(f"model.text.hf_local_dir={no_tok}", match="hf_local_dir.*no tokenizer")
    small = make_bert_folder(tmp_path / "small_vocab", weights=False, vocab_size=10)
    refused(
        f"model.text.hf_local_dir={small}", match="hf_local_dir.*more than the model config's vocab_size 10"
    )
    refused(
        f"model.text.hf_local_dir={bert_dir}",
        "model.text.context_length=40",
        match="context_length'=40 exceeds the max_position_embeddings",
    )
    with pytest.raises(ConfigError, match="hub name .*hf_local_dir"):  # open_clip's hub-named HF towers
        check_buildable(ModelConfig(preset="roberta-ViT-B-32"))
    assert (
        main(["train", "--set", "model.preset=micro", "--set", f"model.text.hf_local_dir={tmp_path / 'x'}"])
        == 2
    )
