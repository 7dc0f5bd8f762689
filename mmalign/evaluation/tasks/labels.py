"""A labelled task's class indices, read from the samples' ``.json`` (``label_field``)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from mmalign.errors import ConfigError, UsageError


def class_labels(
    metas: list[dict], name: str, field: str, classnames: Sequence[str], label_index: bool | None = None
) -> torch.Tensor:
    """(N,) indices into ``classnames`` of task ``name``: each sample's ``field`` is a class
    name, or with ``label_index`` already its index (clip_benchmark's ``.cls``)."""
    if label_index:
        bad = [
            m.get(field)
            for m in metas
            if not isinstance(m.get(field), int) or not 0 <= m[field] < len(classnames)
        ]
        if bad:
            raise UsageError(
                f"task {name!r}: label {bad[0]!r} is not a class index "
                f"(0..{len(classnames) - 1}: {len(classnames)} class names)"
            )
        return torch.tensor([m[field] for m in metas], dtype=torch.long)
    index = {n: i for i, n in enumerate(classnames)}
    unknown = {str(m.get(field)) for m in metas if m.get(field) not in index}
    if unknown:
        raise ConfigError(f"task {name!r}: {field!r} values {sorted(unknown)[:3]} are not in its classnames")
    return torch.tensor([index[m[field]] for m in metas])
