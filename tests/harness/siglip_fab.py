"""Tiny random SiglipModel / Siglip2Model folders, saved by transformers itself (config.json,
model.safetensors, its tokenizer and image processor), as the hub ships the real ones.

SigLIP's tokenizer is a sentencepiece model trained here on a few captions (SiglipTokenizer
reads ``spiece.model``); SigLIP2's is a small Gemma-style BPE (Siglip2Tokenizer from a vocab
and merges), since no Gemma tokenizer file ships offline.
"""

from __future__ import annotations

from pathlib import Path

CAPTIONS = [
    "a photo of a cat",
    "a photo of a dog",
    "this is a photo of a red circle",
    "a blue square on a white background",
    "a green triangle",
    "two small birds",
    "an airplane in the sky",
    "a truck on the road",
    "a ship at sea",
    "a horse and a frog",
]
TINY = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)


def _spm(root: Path) -> Path:
    import sentencepiece as spm

    text = root / "captions.txt"
    text.write_text("\n".join(CAPTIONS * 20))
    spm.SentencePieceTrainer.train(
        input=str(text),
        model_prefix=str(root / "spiece"),
        vocab_size=60,
        model_type="unigram",
        character_coverage=1.0,
        hard_vocab_limit=False,
        unk_id=2,
        bos_id=-1,
        eos_id=1,
        pad_id=0,
        minloglevel=2,
    )
    return root / "spiece.model"


def _gemma_like(root: Path):
    from transformers import Siglip2Tokenizer

    specials = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>"]
    chars = sorted(set("".join(CAPTIONS).replace(" ", "")) | set("xyzqjkvw.,"))
    vocab = {t: i for i, t in enumerate(specials + ["▁"] + chars)}
    merges = []
    for a, b in [("▁", "a"), ("o", "f"), ("t", "h"), ("p", "h"), ("▁", "o"), ("▁", "p")]:
        merges.append((a, b))
        vocab.setdefault(a + b, len(vocab))
    return Siglip2Tokenizer(vocab=vocab, merges=merges)


def siglip_folder(
    root: Path, family: str = "siglip", seed: int = 0, image_size: int = 32, patch: int = 8
) -> Path:
    """A random ``family`` (siglip / siglip2) model saved into ``root/family``; returns the folder."""
    import torch
    from transformers import (
        Siglip2Config,
        Siglip2ImageProcessor,
        Siglip2Model,
        SiglipConfig,
        SiglipImageProcessor,
        SiglipModel,
        SiglipTokenizer,
    )

    out = Path(root) / family
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(seed)
    grid = image_size // patch
    if family == "siglip":
        tok = SiglipTokenizer(vocab_file=str(_spm(Path(root))))
        ids = dict(pad_token_id=tok.pad_token_id, bos_token_id=None, eos_token_id=tok.eos_token_id)
        text = dict(TINY, vocab_size=len(tok), max_position_embeddings=64, **ids)
        vision = dict(TINY, image_size=image_size, patch_size=patch)
        model = SiglipModel(SiglipConfig(text_config=text, vision_config=vision))
        processor = SiglipImageProcessor(size={"height": image_size, "width": image_size})
    else:
        tok = _gemma_like(Path(root))
        ids = dict(
            pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id
        )
        text = dict(TINY, vocab_size=len(tok), max_position_embeddings=64, **ids)
        vision = dict(TINY, num_patches=grid * grid, patch_size=patch)
        model = Siglip2Model(Siglip2Config(text_config=text, vision_config=vision))
        processor = Siglip2ImageProcessor(patch_size=patch, max_num_patches=grid * grid)
    with torch.no_grad():  # published-like scale (> mmalign's default clamp of 100) and bias
        model.logit_scale.fill_(4.75)
        model.logit_bias.fill_(-12.5)
    model.save_pretrained(str(out))
    tok.save_pretrained(str(out))
    processor.save_pretrained(str(out))
    return out


__all__ = ["CAPTIONS", "siglip_folder"]
