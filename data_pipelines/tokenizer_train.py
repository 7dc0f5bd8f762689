"""Train a sentencepiece tokenizer on the captions of a shard set (``mmalign tokenizer train``).

Every caption line of every readable sample is used (bad samples are skipped, as
in training), lower-cased and whitespace-collapsed like the runtime tokenizer
(:mod:`mmalign.data.tokenizer`), which adds padding, sot and eot around the
trained pieces.
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

from mmalign.data.shards import check_urls, expand_urls, read_samples
from mmalign.data.tokenizer import clean_caption
from mmalign.errors import UsageError


def train_from_shards(
    spec: str, vocab_size: int, out: str | Path, *, model_type: str = "bpe", max_captions: int = 2_000_000
) -> dict:
    import sentencepiece as spm

    if vocab_size < 8:
        raise UsageError(f"--vocab-size must be >= 8, got {vocab_size}")
    urls = expand_urls(spec)
    check_urls(urls, "--data")
    out = Path(out)
    if out.suffix != ".model":
        raise UsageError(
            f"--out must end in .model (sentencepiece writes PREFIX.model and PREFIX.vocab), got {out}"
        )
    out.parent.mkdir(parents=True, exist_ok=True)
    count = 0
    with tempfile.TemporaryDirectory() as tmp:
        corpus = Path(tmp) / "captions.txt"
        with corpus.open("w", encoding="utf-8") as f:
            for sample in read_samples(urls):
                for caption in sample["captions"]:
                    f.write(clean_caption(caption) + "\n")
                    count += 1
                if count >= max_captions:
                    break
        if count == 0:
            raise UsageError(f"--data {spec}: no captions found")
        try:
            spm.SentencePieceTrainer.train(
                input=str(corpus),
                model_prefix=str(out.with_suffix("")),
                vocab_size=vocab_size,
                model_type=model_type,
                character_coverage=1.0,
                hard_vocab_limit=False,
                # no bos/eos/pad inside sentencepiece: the runtime tokenizer adds sot/eot/padding
                unk_id=0,
                bos_id=-1,
                eos_id=-1,
                pad_id=-1,
                minloglevel=2,
            )
        except RuntimeError as e:
            raise UsageError(f"sentencepiece could not train: {str(e).splitlines()[0]}") from None
    pieces = spm.SentencePieceProcessor(model_file=str(out)).get_piece_size()
    info = {
        "data": spec,
        "captions": count,
        "requested": vocab_size,
        "pieces": pieces,
        "vocab_size": pieces + 3,
        "model_type": model_type,
    }
    out.with_suffix(".json").write_text(json.dumps(info, indent=2))
    return info
