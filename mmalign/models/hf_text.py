"""Hugging Face text towers from a local folder: ``model.text.hf_local_dir: PATH``.

The folder is what ``AutoModel.save_pretrained`` + ``AutoTokenizer.save_pretrained`` write:
a transformers ``config.json``, optionally the weights (``model.safetensors`` /
``pytorch_model.bin``; without them the tower starts from random init) and the tokenizer
files.  The tower is open_clip's ``HFTextEncoder`` (pooler ``model.text.hf_pooler_type``,
default mean pooling over the attention mask; projection ``model.text.hf_proj_type``,
default a 2-layer MLP), built from the folder's path: transformers reads a local directory without contacting
the hub (HF_HUB_OFFLINE=1 on an offline cluster makes sure of it).

In the architecture dict the folder becomes open_clip's ``hf_model_name`` /
``hf_tokenizer_name`` (its absolute path) and ``hf_model_pretrained`` (whether it holds
weights).  A saved model copies the folder's config and tokenizer files (not its weights:
the trained ones are in ``model.safetensors``) into ``hf_text/`` and records that relative
name, so ``mmalign eval RUN/final`` needs neither the original folder nor the network.
The folder's tokenizer is the one used for training, evaluation and export
(:class:`mmalign.data.tokenizer.HFTextTokenizer`).
"""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

from mmalign.errors import ConfigError

LOCAL_DIR = "hf_local_dir"  # the user's key in model.text
SAVED_DIR = "hf_text"  # the copy beside a saved model's weights
WEIGHT_FILES = (
    "model.safetensors",
    "pytorch_model.bin",
    "model.safetensors.index.json",
    "pytorch_model.bin.index.json",
)
# files a transformers tokenizer may be saved as (any one makes a tokenizer)
TOKENIZER_FILES = (
    "tokenizer.json",
    "vocab.txt",
    "vocab.json",
    "spiece.model",
    "sentencepiece.bpe.model",
    "tokenizer.model",
)
TOKENIZER_SIDE_FILES = ("tokenizer_config.json", "special_tokens_map.json", "merges.txt", "added_tokens.json")
DEFAULT_CONTEXT = 77  # open_clip's, when neither model.text.context_length nor a smaller model limit is given


def is_hf_text(text_cfg: dict) -> bool:
    return bool(text_cfg.get("hf_model_name") or text_cfg.get("hf_tokenizer_name") or text_cfg.get(LOCAL_DIR))


def apply_local_dir(text_cfg: dict, preset: str | None) -> dict:
    """``text_cfg`` with ``hf_local_dir`` turned into open_clip's ``hf_*`` keys (a new dict; the
    tower's sizes are the folder's config, so a preset's text keys do not apply).

    A hub name (``hf_model_name`` that is no local folder, as in open_clip's own
    ``roberta`` / ``xlm-roberta`` / ``nllb`` configs) is read from the Hugging Face cache, fetched
    when missing and online (:func:`mmalign.models.hub.resolve_text_model`: config and tokenizer,
    and the weights when the tower starts from them); where it cannot be, one ConfigError line.
    A tokenizer named alone (``hf_tokenizer_name`` without ``hf_model_name``) stays refused.
    """
    text_cfg = dict(text_cfg)
    folder = text_cfg.pop(LOCAL_DIR, None)
    if folder is None:
        name = text_cfg.get("hf_model_name") or text_cfg.get("hf_tokenizer_name")
        if name and Path(name).is_dir():  # an arch already resolved (a saved model's, made absolute)
            return text_cfg
        why = "not supported offline"
        if text_cfg.get("hf_model_name"):
            from mmalign.models.hub import resolve_text_model

            try:
                folder = str(
                    resolve_text_model(
                        str(text_cfg["hf_model_name"]),
                        "model.text.hf_model_name",
                        bool(text_cfg.get("hf_model_pretrained", True)),
                    )
                )
            except ConfigError as e:
                why = str(e).removeprefix("config key 'model.text.hf_model_name': ")
    if folder is None:
        raise ConfigError(
            f"config key 'model.preset': {preset!r} uses a Hugging Face text tower by hub name "
            f"({name!r}), {why}; or save it on a connected machine and set "
            f"model.text.{LOCAL_DIR} to that folder"
        )
    path = Path(folder).expanduser()
    key = f"config key 'model.text.{LOCAL_DIR}'"
    if not path.is_dir():
        raise ConfigError(f"{key}: {folder} is not a folder")
    if not (path / "config.json").is_file():
        raise ConfigError(
            f"{key}: {folder} has no config.json (save it with AutoModel/AutoConfig.save_pretrained)"
        )
    if not any((path / f).is_file() for f in TOKENIZER_FILES):
        raise ConfigError(
            f"{key}: {folder} has no tokenizer ({' / '.join(TOKENIZER_FILES[:3])}; save it with "
            f"AutoTokenizer.save_pretrained into the same folder)"
        )
    try:
        config = json.loads((path / "config.json").read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(
            f"{key}: {path / 'config.json'} is not valid JSON ({str(e).splitlines()[0]})"
        ) from None
    from open_clip.hf_configs import arch_dict

    if config.get("model_type") not in arch_dict:
        raise ConfigError(
            f"{key}: model_type {config.get('model_type')!r} of {folder} is not one open_clip's "
            f"HFTextEncoder knows ({', '.join(sorted(arch_dict))})"
        )
    limit = int(config.get("max_position_embeddings") or DEFAULT_CONTEXT)
    length = int(text_cfg.get("context_length") or min(DEFAULT_CONTEXT, limit))
    if length > limit:
        raise ConfigError(
            f"config key 'model.text.context_length'={length} exceeds the max_position_embeddings "
            f"({limit}) of {folder}"
        )
    absolute = str(path.resolve())
    text_cfg.update(
        hf_model_name=absolute,
        hf_tokenizer_name=absolute,
        context_length=length,
        # an explicit false (a tower inside a full checkpoint) keeps it off
        hf_model_pretrained=bool(text_cfg.get("hf_model_pretrained", True))
        and any((path / f).is_file() for f in WEIGHT_FILES),
    )
    text_cfg["vocab_size"] = int(config.get("vocab_size", 0))  # the model's own (for the tokenizer check)
    return text_cfg


def check_tokenizer(text_cfg: dict) -> None:
    """The folder's tokenizer loads and its ids fit the tower's embedding table (one ConfigError)."""
    from mmalign.data.tokenizer import HFTextTokenizer

    key = f"config key 'model.text.{LOCAL_DIR}'"
    try:
        tok = HFTextTokenizer(text_cfg["hf_tokenizer_name"], int(text_cfg["context_length"]))
    except Exception as e:  # transformers raises OSError / ValueError / its own types for a broken folder
        raise ConfigError(
            f"{key}: its tokenizer cannot be loaded ({type(e).__name__}: "
            f"{str(e).strip().splitlines()[0][:160] if str(e).strip() else ''})"
        ) from None
    vocab = int(text_cfg.get("vocab_size") or 0)
    if tok.vocab_size > vocab:
        raise ConfigError(
            f"{key}: its tokenizer has {tok.vocab_size} ids, more than the model config's vocab_size {vocab}"
        )


def absolutize(arch: dict, base_dir: str | Path | None) -> dict:
    """A saved arch's relative ``hf_text`` folder, resolved against the model folder (a copy)."""
    text = arch.get("text_cfg", {})
    name = text.get("hf_model_name")
    if not name or base_dir is None or Path(name).is_absolute():
        return arch
    arch = copy.deepcopy(arch)
    folder = str((Path(base_dir) / name).resolve())
    arch["text_cfg"]["hf_model_name"] = folder
    if arch["text_cfg"].get("hf_tokenizer_name"):
        arch["text_cfg"]["hf_tokenizer_name"] = folder
    return arch


def copy_config_and_tokenizer(source: str | Path, target: Path) -> None:
    """The folder's transformers config and tokenizer files (never its weights) into ``target``."""
    source = Path(source)
    target.mkdir(parents=True, exist_ok=True)
    for name in ("config.json",) + TOKENIZER_FILES + TOKENIZER_SIDE_FILES:
        if (source / name).is_file() and (source / name).resolve() != (target / name).resolve():
            shutil.copyfile(source / name, target / name)


def record_for_save(arch: dict, out: Path) -> tuple[dict, dict]:
    """For ``save_pretrained``: the arch naming ``hf_text/`` (relative, no pretrained load: the
    trained weights are the model's) and the tokenizer description; copies the files."""
    text = arch["text_cfg"]
    copy_config_and_tokenizer(text["hf_model_name"], out / SAVED_DIR)
    arch = copy.deepcopy(arch)
    arch["text_cfg"].update(hf_model_name=SAVED_DIR, hf_tokenizer_name=SAVED_DIR, hf_model_pretrained=False)
    return arch, {
        "type": "hf",
        "folder": SAVED_DIR,
        "context_length": int(text["context_length"]),
        "vocab_size": int(text.get("vocab_size") or 0),
    }


__all__ = [
    "LOCAL_DIR",
    "SAVED_DIR",
    "absolutize",
    "apply_local_dir",
    "check_tokenizer",
    "copy_config_and_tokenizer",
    "is_hf_text",
    "record_for_save",
]
