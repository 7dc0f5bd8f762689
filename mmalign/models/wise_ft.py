"""WiSE-FT (Wortsman et al., 2022): the weights of a zero-shot model and of its fine-tuned
version, mixed per tensor as ``(1 - alpha) * zero_shot + alpha * fine_tuned``.

``alpha = 0`` is the zero-shot model, ``1`` the fine-tuned one; in between, the paper finds
accuracy under distribution shift above both ends at little cost on the fine-tuning task.
Every floating tensor is mixed, the log temperature (``logit_scale``) and the SigLIP bias
included, in float64 and stored in the zero-shot model's dtype; an integer or boolean buffer
is taken from the nearer end (``alpha < 0.5``: the zero-shot model's). The ends are the two
models' tensors exactly.

The two must be one architecture: the same architecture settings, the same weight names and
shapes, the same tokenizer (its vocabulary file, and its ids for a few probe captions); the
first difference is one line (:func:`check_compatible`).
"""

from __future__ import annotations

import copy
import logging
from pathlib import Path

import torch

from mmalign.errors import UsageError

log = logging.getLogger(__name__)

PREPROCESS_KEYS = ("size", "mean", "std", "interpolation", "resize_mode")
# text_cfg keys that say where a Hugging Face text tower's files are (a saved model copies them
# into its own hf_text/), not what the tower is: its hf_config and weights say that
HF_LOCATION_KEYS = ("hf_model_name", "hf_tokenizer_name", "hf_model_pretrained")
TOKEN_PROBE = ["a photo of a dog", "Two birds, 3 cats & a café: naïve résumé!", "x"]


def parse_alphas(text: str | float, flag: str = "--alpha") -> list[float]:
    """``"0.5"`` or ``"0,0.25,0.5"`` -> the alphas, each in [0, 1], in the given order without
    repeats; anything else is one line naming ``flag``."""
    out: list[float] = []
    for part in str(text).split(","):
        try:
            alpha = float(part.strip())
        except ValueError:
            raise UsageError(
                f"{flag} {text}: {part.strip()!r} is not a number (e.g. 0.5 or 0,0.25,0.5)"
            ) from None
        if not 0.0 <= alpha <= 1.0:  # NaN fails this too
            raise UsageError(f"{flag} {text}: alpha {part.strip()} is outside [0, 1]")
        if alpha not in out:
            out.append(alpha)
    return out


def alpha_label(alpha: float) -> str:
    """The folder name of one alpha: ``alpha_0.25``."""
    return f"alpha_{alpha:g}"


def check_compatible(zero_shot, fine_tuned, names: tuple[str, str] = ("--zero-shot", "--fine-tuned")) -> None:
    """Refuse (one UsageError line naming the first difference) two loaded models
    (:class:`~mmalign.models.load.Loaded`) that are not one architecture."""
    from mmalign.models.arch import differences
    from mmalign.models.hf_text import LOCAL_DIR

    def arch(loaded) -> dict:
        a = copy.deepcopy(loaded.model.arch)
        for key in (LOCAL_DIR, *HF_LOCATION_KEYS):  # where an HF text tower's files are, not what it is
            a["text_cfg"].pop(key, None)
        return a

    first = f"{names[0]} {zero_shot.path} and {names[1]} {fine_tuned.path} are not one architecture"
    differ = differences(arch(zero_shot), arch(fine_tuned))
    if differ:
        raise UsageError(f"{first}: {differ[0]}" + (f" (+{len(differ) - 1} more)" if len(differ) > 1 else ""))
    a, b = zero_shot.model.state_dict(), fine_tuned.model.state_dict()
    only_a, only_b = sorted(set(a) - set(b)), sorted(set(b) - set(a))
    if only_a or only_b:
        name, which = (only_a[0], names[0]) if only_a else (only_b[0], names[1])
        raise UsageError(f"{first}: only {which} has the weight {name}")
    for name in a:
        if a[name].shape != b[name].shape:
            raise UsageError(f"{first}: {name} is {tuple(a[name].shape)} vs {tuple(b[name].shape)}")
        if a[name].is_floating_point() != b[name].is_floating_point():
            raise UsageError(f"{first}: {name} is {a[name].dtype} vs {b[name].dtype}")
    ta, tb = zero_shot.tokenizer_file, fine_tuned.tokenizer_file
    if _vocabulary(ta) != _vocabulary(tb) or not _same_ids(zero_shot.tokenizer, fine_tuned.tokenizer):
        raise UsageError(f"{first}: their tokenizers differ ({ta or 'CLIP BPE'} vs {tb or 'CLIP BPE'})")


def _same_ids(a, b) -> bool:
    """Whether two tokenizers (sentencepiece, CLIP's BPE, an HF tokenizer) give the same ids
    for a few probe captions: the check for tokenizers that name no vocabulary file."""
    ids_a, ids_b = a(TOKEN_PROBE), b(TOKEN_PROBE)  # (P, L)
    return tuple(ids_a.shape) == tuple(ids_b.shape) and bool(torch.equal(ids_a, ids_b))


def _vocabulary(spm_file) -> list[str] | None:
    """A sentencepiece model's pieces in id order (None: CLIP's BPE, the same for every model)."""
    if spm_file is None:
        return None
    import sentencepiece

    sp = sentencepiece.SentencePieceProcessor(model_file=str(spm_file))
    return [sp.id_to_piece(i) for i in range(sp.get_piece_size())]


def interpolate(zero_shot: dict, fine_tuned: dict, alpha: float) -> dict:
    """``(1 - alpha) * zero_shot + alpha * fine_tuned`` per floating tensor (float64, then the
    zero-shot tensor's dtype); other tensors from the nearer end. Two state dicts of the same
    names and shapes (:func:`check_compatible`)."""
    if not 0.0 <= alpha <= 1.0:
        raise UsageError(f"alpha {alpha} is outside [0, 1]")
    out = {}
    for name, a in zero_shot.items():
        b = fine_tuned[name]
        if alpha == 0.0 or alpha == 1.0 or not a.is_floating_point():
            out[name] = (a if alpha < 0.5 else b.to(a.dtype)).detach().clone()  # an end: its tensor exactly
        else:
            mixed = (1.0 - alpha) * a.detach().double() + alpha * b.detach().to(a.device).double()
            out[name] = mixed.to(a.dtype)
    return out


def mixed_model(zero_shot, fine_tuned, alpha: float, base: dict | None = None, into=None):
    """The zero-shot model (a copy, or ``into`` reused) holding the weights at ``alpha``.
    ``base``: the zero-shot state dict kept aside when ``into`` is the zero-shot model itself."""
    model = into if into is not None else copy.deepcopy(zero_shot.model)
    a = base if base is not None else zero_shot.model.state_dict()
    state = interpolate(a, fine_tuned.model.state_dict(), alpha)
    model.max_logit_scale = max(zero_shot.model.max_logit_scale, fine_tuned.model.max_logit_scale)
    with torch.no_grad():
        for name, value in model.state_dict().items():
            value.copy_(state[name])
    return model


def _check_preprocess(zero_shot, fine_tuned) -> None:
    a, b = zero_shot.preprocess_cfg, fine_tuned.preprocess_cfg
    other = [k for k in PREPROCESS_KEYS if a.get(k) != b.get(k)]
    if other:
        log.warning(
            "the fine-tuned model's preprocessing differs (%s); the interpolated models keep the "
            "zero-shot model's",
            ", ".join(f"{k}: {a.get(k)!r} vs {b.get(k)!r}" for k in other),
        )


def _absolute_tokenizer(loaded) -> None:
    """A model folder's sentencepiece file is named relative to that folder in its arch; the
    copy written elsewhere needs where it really is (save_pretrained copies it beside it)."""
    from mmalign.data.tokenizer import SPM_KEY

    kwargs = loaded.model.arch["text_cfg"].get("tokenizer_kwargs") or {}
    if loaded.tokenizer_file is not None and SPM_KEY in kwargs:
        kwargs[SPM_KEY] = str(Path(loaded.tokenizer_file).resolve())


def wise_ft(
    zero_shot: str | Path,
    fine_tuned: str | Path,
    alphas: list[float],
    out: str | Path,
    overwrite: bool = False,
) -> list[Path]:
    """Write the interpolated model of each alpha: ``out`` itself for one alpha, else
    ``out/alpha_A/`` per alpha; each a model folder (``mmalign.load`` reads it) whose
    ``model_config.json`` records its sources under ``wise_ft``. Returns the folders."""
    from mmalign.models.io import CONFIG, WEIGHTS, save_pretrained
    from mmalign.models.load import load

    out = Path(out)
    targets = [out] if len(alphas) == 1 else [out / alpha_label(a) for a in alphas]
    if not overwrite:
        taken = [t for t in targets if (t / WEIGHTS).exists() or (t / CONFIG).exists()]
        if taken:
            raise UsageError(f"--out {out}: {taken[0]} already holds a model (--overwrite replaces it)")
    a, b = load(zero_shot), load(fine_tuned)
    check_compatible(a, b)
    _check_preprocess(a, b)
    base = {k: v.detach().clone() for k, v in a.model.state_dict().items()}
    _absolute_tokenizer(a)
    for alpha, target in zip(alphas, targets):
        model = mixed_model(a, b, alpha, base=base, into=a.model)
        record = {"zero_shot": str(zero_shot), "fine_tuned": str(fine_tuned), "alpha": alpha}
        save_pretrained(model, target, preprocess=dict(a.preprocess_cfg), extra={"wise_ft": record})
        log.info("alpha %g: %s", alpha, target)
    return targets


__all__ = ["alpha_label", "check_compatible", "interpolate", "mixed_model", "parse_alphas", "wise_ft"]
