"""The HF export in HF's own workflows: ``AutoProcessor.from_pretrained(DIR)`` and
``pipeline("zero-shot-image-classification", model=DIR)`` give mmalign's own zero-shot
probabilities softmax(scale * cos) on a real (PIL) image, offline."""

from __future__ import annotations

import copy
import json
import math

import numpy as np
import pytest
import torch
from PIL import Image

import mmalign
from mmalign.data.transforms import preprocess_cfg
from mmalign.export import export
from mmalign.models import TwoTower
from mmalign.models.io import save_pretrained
from mmalign.models.presets import PRESETS

LABELS = ["cat", "dog", "airplane", "a red truck on a road", "ship"]


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    root = tmp_path_factory.mktemp("hfp")
    torch.manual_seed(3)
    # A large temperature so that the probabilities are far from uniform (random towers
    # give nearly equal cosines).
    model = TwoTower(copy.deepcopy(PRESETS["micro"]), init_logit_scale=math.log(100.0))
    save_pretrained(model, root / "final", preprocess=preprocess_cfg(model.image_size))
    export(root / "final", "hf", root / "hf")
    return root / "final", root / "hf"


def _image(seed: int) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 255, (23, 31, 3), dtype=np.uint8))


def _ours(final, image, prompts, pixels=None):
    """mmalign's zero-shot probabilities (K,); ``pixels`` (3, S, S) replaces our preprocessing."""
    ours = mmalign.load(final)
    pixels = ours.preprocess(image) if pixels is None else pixels
    with torch.no_grad():
        img = ours.encode_image(pixels[None])  # (1, D), normalised
        txt = ours.encode_text(ours.tokenizer(prompts))  # (K, D)
    return (100.0 * img @ txt.T).softmax(dim=-1)[0]  # (K,)


def test_tokenizer_files_and_processor(exported):
    from transformers import AutoProcessor

    final, hf = exported
    for name in (
        "vocab.json",
        "merges.txt",
        "tokenizer_config.json",
        "special_tokens_map.json",
        "preprocessor_config.json",
    ):
        assert (hf / name).is_file(), name
    assert json.loads((hf / "tokenizer_config.json").read_text())["model_max_length"] == 16
    processor = AutoProcessor.from_pretrained(str(hf))
    ours = mmalign.load(final)
    prompts = ["a photo of a cat.", "Blue   SQUARE", "x"]
    got = processor.tokenizer(prompts, padding="max_length", max_length=16, return_tensors="pt")["input_ids"]
    want = ours.tokenizer(prompts)  # (3, 16): [sot, ..., eot, 0, ...]
    # HF pads with <|endoftext|> where we pad with 0; every id up to the first eot is equal.
    assert torch.equal(torch.where(want == 0, torch.full_like(want, 49407), want), got)
    image = _image(1)
    pixels = processor(images=image, return_tensors="pt")["pixel_values"]
    want = ours.preprocess(image)  # (3, S, S)
    # HF's default image backend (torchvision on uint8 tensors) rounds the bicubic resize
    # differently from PIL's: at most one 8-bit level, i.e. 1 / (255 * std) after normalising.
    assert (pixels[0] - want).abs().max() <= 1.01 / (255 * min(preprocess_cfg(16)["std"]))
    pil = AutoProcessor.from_pretrained(str(hf), backend="pil")  # PIL's resize, as ours: exact
    assert torch.allclose(pil(images=image, return_tensors="pt")["pixel_values"][0], want, atol=1e-5)


def _scores(result) -> torch.Tensor:
    return torch.tensor([next(r["score"] for r in result if r["label"] == x) for x in LABELS])


def test_zero_shot_pipeline_gives_mmalign_probabilities(exported):
    from transformers import AutoImageProcessor, pipeline

    final, hf = exported
    prompts = [f"This is a photo of {x}." for x in LABELS]  # the pipeline's default template
    pipe = pipeline("zero-shot-image-classification", model=str(hf), device="cpu")
    pil_pipe = pipeline(
        "zero-shot-image-classification",
        model=str(hf),
        device="cpu",
        image_processor=AutoImageProcessor.from_pretrained(str(hf), backend="pil"),
    )
    for seed in (0, 1):
        image = _image(seed)
        want = _ours(final, image, prompts)
        assert float(want.max() - want.min()) > 0.1  # not uniform: the check can fail
        # HF's PIL image backend resizes as we do: the whole pipeline is mmalign's.
        assert (_scores(pil_pipe(image, candidate_labels=LABELS)) - want).abs().max() <= 1e-4
        # The default (torchvision) backend: model, tokenizer, eot pooling and scale are
        # exact on its pixels; its resize rounding (<= one 8-bit level) moves the
        # probabilities of this steep (scale 100) random model by ~2e-4.
        got = _scores(pipe(image, candidate_labels=LABELS))
        hf_pixels = pipe.image_processor(images=image, return_tensors="pt")["pixel_values"][0]
        assert (got - _ours(final, image, prompts, pixels=hf_pixels)).abs().max() <= 1e-4
        assert (got - want).abs().max() <= 1e-3


@pytest.fixture(scope="module", params=["bpe", "unigram"])
def spm_export(request, tmp_path_factory):
    """A micro model with a sentencepiece tokenizer trained here, saved and exported."""
    import random

    import sentencepiece as spm

    from data_pipelines import shapes
    from mmalign.config import load_config
    from mmalign.data.tokenizer import clean_caption
    from mmalign.models import build_model

    root = tmp_path_factory.mktemp(f"spm_{request.param}")
    rng = random.Random(0)
    captions = [c for _ in range(400) for c in shapes.captions_for(shapes.sample_attributes(rng), rng, n=2)]
    captions += ["naïve café, résumé — ½ ﬁve", "a zebra, photographed"]
    (root / "captions.txt").write_text("\n".join(clean_caption(c) for c in captions))
    # the settings of data_pipelines.tokenizer_train (no bos/eos/pad inside sentencepiece)
    spm.SentencePieceTrainer.train(
        input=str(root / "captions.txt"),
        model_prefix=str(root / "spm"),
        vocab_size=90,
        model_type=request.param,
        character_coverage=1.0,
        hard_vocab_limit=False,
        unk_id=0,
        bos_id=-1,
        eos_id=-1,
        pad_id=-1,
        minloglevel=2,
    )
    cfg = load_config(None, ["model.preset=micro", f"model.tokenizer={root / 'spm.model'}"])
    torch.manual_seed(4)
    model = build_model(cfg.model)
    model.logit_scale.data.fill_(math.log(100.0))
    save_pretrained(model, root / "final", preprocess=preprocess_cfg(model.image_size))
    export(root / "final", "hf", root / "hf")
    return root / "final", root / "hf"


def test_sentencepiece_export_tokenizes_and_classifies_like_mmalign(spm_export):
    from transformers import AutoImageProcessor, AutoProcessor, pipeline

    final, hf = spm_export
    assert (hf / "tokenizer.model").is_file() and (hf / "special_tokens_map.json").is_file()
    ours = mmalign.load(final)
    processor = AutoProcessor.from_pretrained(str(hf))
    texts = [
        "This is a photo of a red circle.",
        "A  LARGE blue   square, on the left",
        "naïve café — ½ ﬁve",
        "unseen words: zebra 日本",
        "x",
        "",
        "a very long caption about a small green star in the top right corner of a gray picture",
    ]
    got = processor.tokenizer(
        texts, padding="max_length", truncation=True, max_length=16, return_tensors="pt"
    )["input_ids"]
    assert torch.equal(got, ours.tokenizer(texts))  # same ids, same 0 padding, eot kept on truncation
    pipe = pipeline(
        "zero-shot-image-classification",
        model=str(hf),
        device="cpu",
        image_processor=AutoImageProcessor.from_pretrained(str(hf), backend="pil"),
    )
    labels = ["red circle", "blue square", "green star"]
    image = _image(2)
    want = _ours(final, image, [f"a {x}." for x in labels])
    # short prompts: a 90-piece vocabulary makes long token sequences, and the pipeline of
    # transformers 5.24 drops tokenizer_kwargs, so it cannot truncate
    result = pipe(image, candidate_labels=labels, hypothesis_template="a {}.")
    scores = torch.tensor([next(r["score"] for r in result if r["label"] == x) for x in labels])
    assert float(want.max() - want.min()) > 0.05
    assert (scores - want).abs().max() <= 1e-4
