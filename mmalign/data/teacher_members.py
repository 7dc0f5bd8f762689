"""A distillation teacher's embeddings stored in the shards (``loss.distill.teacher: stored``).

The contract with ``mmalign embed``, which writes them into a copy of the shards: each sample
carries three ``.npy`` members,

* ``teacher_image.npy``: (D,) float32, the teacher's L2-normalised image embedding;
* ``teacher_text.npy``: (D,) float32, its L2-normalised caption embedding; (C, D) for a sample
  with C captions, one row per caption in the order the loader parses them (the row of the
  caption a step draws is the one it reads);
* ``teacher_scale.npy``: (1,) float32, the teacher's logit scale, exp'd (the multiplier).

:func:`read_teacher` parses them for one sample (a member missing or malformed is a counted
skip); :func:`check_teacher_members` reads the first sample of the first training shard at
start-up, so a data set without them is one line before any step.
"""

from __future__ import annotations

import io

import numpy as np

from mmalign.data.shards import BadSample

__all__ = ["MEMBERS", "STORED", "check_teacher_members", "read_teacher"]

STORED = "stored"  # loss.distill.teacher's value that reads the members instead of running a model
IMAGE, TEXT, SCALE = "teacher_image.npy", "teacher_text.npy", "teacher_scale.npy"
MEMBERS = (IMAGE, TEXT, SCALE)


def _array(members: dict[str, bytes], name: str, ndims: tuple[int, ...] = (1,)) -> np.ndarray:
    raw = members.get(name)
    if raw is None:
        raise BadSample("missing_teacher", f"no {name} member")
    try:
        value = np.load(io.BytesIO(raw), allow_pickle=False)
    except (ValueError, OSError, EOFError) as e:
        raise BadSample("bad_teacher", f"{name}: {e}") from None
    if value.ndim not in ndims or value.dtype.kind != "f" or not np.isfinite(value).all():
        shape = " or ".join(f"{n}-d" for n in ndims)
        raise BadSample(
            "bad_teacher", f"{name}: expected a finite {shape} float array, got {value.dtype} {value.shape}"
        )
    return value.astype(np.float32, copy=False)


def read_teacher(
    members: dict[str, bytes], caption: int = 0, n_captions: int | None = 1
) -> tuple[np.ndarray, np.ndarray, float]:
    """(image (D,), text (D,), scale) of one sample, the text of its caption number ``caption`` (of
    ``n_captions``; None: any number of rows); BadSample when a member is missing or malformed."""
    image, text, scale = _array(members, IMAGE), _array(members, TEXT, (1, 2)), _array(members, SCALE)
    if text.ndim == 2:  # one row per caption
        if n_captions is not None and text.shape[0] != n_captions:
            raise BadSample("bad_teacher", f"{TEXT}: {text.shape[0]} rows for {n_captions} caption(s)")
        text = text[caption]
    if image.shape != text.shape or scale.shape != (1,) or not scale[0] > 0:
        raise BadSample(
            "bad_teacher",
            f"image {image.shape}, text {text.shape}, scale {scale.tolist()}: need (D,), (D,), (1,) > 0",
        )
    return image, text, float(scale[0])


def check_teacher_members(urls: list[str], key: str, remote=None, max_member: int | None = None) -> int:
    """The teacher's width D from the first sample of ``urls[0]``; one ConfigError line naming
    ``key`` when that sample lacks the members (shards that ``mmalign embed`` did not write)."""
    from mmalign.data.tario import iter_samples, open_shard
    from mmalign.errors import ConfigError

    if not urls:
        raise ConfigError(f"config key '{key}': stored, but data.train names no shard")
    with open_shard(urls[0], remote) as f:
        first = next(iter_samples(f, max_member=max_member), None)
    if first is None:
        raise ConfigError(f"config key '{key}': stored, but {urls[0]} holds no sample")
    try:
        image, _, _ = read_teacher(first.members, n_captions=None)  # its captions: the loader's business
    except BadSample as e:
        raise ConfigError(
            f"config key '{key}': stored, but sample {first.key} of {urls[0]} has {e}: "
            "write the teacher's embeddings into the shards with `mmalign embed` first"
        ) from None
    return int(image.shape[0])
