"""Our tokenizers as HF tokenizer files, so an ``--format hf`` folder tokenizes by itself.

* CLIP BPE (open_clip's ``SimpleTokenizer``): ``vocab.json`` + ``merges.txt`` built from
  its bundled BPE file, special tokens renamed to HF's ``<|startoftext|>`` /
  ``<|endoftext|>`` (same ids), written through ``CLIPTokenizer``.  HF pads with
  ``<|endoftext|>`` where we pad with 0; the pooled position (the first end-of-text) and,
  under the causal mask, its value are unchanged.
* sentencepiece (:class:`mmalign.data.tokenizer.SentencePieceTokenizer`): a ``tokenizers``
  pipeline rebuilt from the model file with our id layout (0 = ``<pad>``, spm id + 1,
  then ``<start_of_text>``, ``<end_of_text>``), our caption cleaning (collapse whitespace,
  strip, lower-case) ahead of sentencepiece's own normaliser (its precompiled charsmap),
  a ``▁`` prefix and whitespace split as sentencepiece does by default, and
  ``[sot] pieces [eot]`` with truncation keeping both.  Unigram models keep their scores;
  BPE models get their merges re-derived from the piece ranks, as transformers' own
  converter does.  Python's ``str.lower``/``\\s`` and Rust's may differ on rare
  characters; the tests compare ids on ordinary and accented text.

Either way ``model_max_length`` is our context length (= ``max_position_embeddings``).
"""

from __future__ import annotations

import json
from pathlib import Path

# open_clip names its special tokens differently; HF's CLIP tokenizer expects these.
_CLIP_SPECIAL = {"<start_of_text>": "<|startoftext|>", "<end_of_text>": "<|endoftext|>"}
SOT, EOT, PAD = "<start_of_text>", "<end_of_text>", "<pad>"


def _special_tokens_map(out: Path, bos: str, eos: str, unk: str, pad: str) -> None:
    # transformers 5 folds this file into tokenizer_config.json; older readers still look for it.
    special = {"bos_token": bos, "eos_token": eos, "unk_token": unk, "pad_token": pad}
    (out / "special_tokens_map.json").write_text(json.dumps(special, indent=2))


def write_clip_tokenizer(tokenizer, out: Path, context_length: int) -> None:
    """open_clip's CLIP BPE (``SimpleTokenizer``) -> HF ``CLIPTokenizer`` files in ``out``."""
    from transformers import CLIPTokenizer

    vocab = {_CLIP_SPECIAL.get(tok, tok): int(i) for tok, i in tokenizer.encoder.items()}  # 49408 entries
    merges = [" ".join(pair) for pair, _ in sorted(tokenizer.bpe_ranks.items(), key=lambda kv: kv[1])]
    (out / "vocab.json").write_text(json.dumps(vocab, ensure_ascii=False), encoding="utf-8")
    (out / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n", encoding="utf-8")
    hf_tok = CLIPTokenizer(
        vocab=str(out / "vocab.json"), merges=str(out / "merges.txt"), model_max_length=int(context_length)
    )
    hf_tok.save_pretrained(str(out))  # tokenizer_config.json, tokenizer.json
    _special_tokens_map(out, "<|startoftext|>", "<|endoftext|>", "<|endoftext|>", "<|endoftext|>")


def write_sentencepiece_tokenizer(model_file: Path, out: Path, context_length: int) -> None:
    """Our sentencepiece layout -> ``tokenizer.json`` + configs (a ``PreTrainedTokenizerFast``)."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import SentencePieceExtractor, generate_merges

    proto = SentencePieceExtractor(str(model_file)).proto
    pieces = list(proto.pieces)
    n = len(pieces)
    unk = pieces[proto.trainer_spec.unk_id].piece
    model: models.Model
    if proto.trainer_spec.model_type == 1:  # unigram
        scored = [(PAD, 0.0)] + [(p.piece, p.score) for p in pieces] + [(SOT, 0.0), (EOT, 0.0)]
        model = models.Unigram(scored, unk_id=proto.trainer_spec.unk_id + 1, byte_fallback=False)
    else:  # bpe
        spm_vocab = {p.piece: i for i, p in enumerate(pieces)}
        vocab = {PAD: 0, **{piece: i + 1 for piece, i in spm_vocab.items()}, SOT: n + 1, EOT: n + 2}
        model = models.BPE(
            vocab, generate_merges(spm_vocab), unk_token=unk, fuse_unk=True, byte_fallback=False
        )
    tok = Tokenizer(model)
    steps = [
        normalizers.Replace(Regex(r"\s+"), " "),
        normalizers.Strip(),
        normalizers.Lowercase(),
    ]  # clean_caption
    if proto.normalizer_spec.precompiled_charsmap:
        steps.append(normalizers.Precompiled(proto.normalizer_spec.precompiled_charsmap))
    steps.append(normalizers.Replace(Regex(" {2,}"), " "))  # sentencepiece drops repeated spaces
    tok.normalizer = normalizers.Sequence(steps)
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always", split=True)
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="always", split=True)
    tok.add_special_tokens([SOT, EOT, PAD])
    tok.post_processor = processors.TemplateProcessing(
        single=f"{SOT} $A {EOT}", special_tokens=[(SOT, n + 1), (EOT, n + 2)]
    )
    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=SOT,
        eos_token=EOT,
        pad_token=PAD,
        unk_token=unk,
        model_max_length=int(context_length),
    )
    hf_tok.save_pretrained(str(out))
    _special_tokens_map(out, SOT, EOT, unk, PAD)
