"""Which (row, candidate) pairs are positives.

Two modes share one representation, ``Positives``:

* **Paired** (no ids): row i's only positive is candidate ``offset + i``
  (CLIP's diagonal; ``offset = rank * B_local`` when each rank scores its
  local rows against all gathered candidates).
* **Id groups** (false-negative-aware, as SupCon / UniCL): every candidate
  whose id equals the row's id is a positive. Ids come from the caller, e.g.
  :func:`caption_ids` for identical captions, or a class / json field id.
* **Mask** (metadata positives, e.g. :func:`.metadata.subset_mask`): an
  explicit (M, N) boolean matrix ``pair_mask``; any relation, not only an
  equivalence. It costs M x N bools, so it suits the untiled path and
  moderate batches (the tiled path slices it per tile and works too).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["Positives", "caption_ids", "normalise_caption", "positive_logit"]


def normalise_caption(text: str) -> str:
    """Case and whitespace variants of one caption are the same caption (the one rule: the
    loss's ``caption`` positives and the hard-negative miner's own captions)."""
    return " ".join(text.split()).casefold()


def caption_ids(captions: list[str]) -> Tensor:
    """Map captions to int64 ids; equal (normalised) captions get equal ids.

    The id is the first 8 bytes of blake2b of the normalised UTF-8 text, so it
    does not depend on the process (unlike ``hash()``, which is salted per
    process): ids computed on different ranks agree and can be all-gathered.
    """
    ids = []
    for text in captions:
        digest = hashlib.blake2b(normalise_caption(text).encode("utf-8"), digest_size=8).digest()
        ids.append(int.from_bytes(digest, "little", signed=True))
    return torch.tensor(ids, dtype=torch.int64)


@dataclass(frozen=True)
class Positives:
    """Positive structure of an (M rows) x (N candidates) score matrix.

    ``row_ids`` (M,) / ``col_ids`` (N,) are None in paired mode, where row i's
    positive is candidate ``offset + i``. ``pair_mask`` (M, N) bool, if set,
    is the positive relation itself (ids unused).
    """

    offset: int = 0
    row_ids: Tensor | None = None  # (M,) int64
    col_ids: Tensor | None = None  # (N,) int64
    pair_mask: Tensor | None = None  # (M, N) bool

    @property
    def paired(self) -> bool:
        return self.row_ids is None and self.pair_mask is None

    def transposed(self) -> Positives:
        """Positives of the candidate->row direction (square case, offset 0)."""
        if self.pair_mask is not None:
            return Positives(0, pair_mask=self.pair_mask.T)
        if self.paired:
            assert self.offset == 0, "transpose is only defined for the square case"
            return self
        return Positives(0, self.col_ids, self.row_ids)

    def mask(
        self, i0: int, i1: int, j0: int, j1: int, device: torch.device, skip_empty: bool = True
    ) -> Tensor | None:
        """Bool (i1-i0, j1-j0) mask of a tile, or None if the tile has no positive.

        Ids and masks: with ``skip_empty`` False an empty tile's all-False mask is returned
        instead of None, which spares the host read that finding out costs (a backward's
        tiles then make no device sync). Paired positives decide it from the indices."""
        if self.paired:
            # Paired positives lie on the shifted diagonal: skip tiles it misses.
            if max(i0 + self.offset, j0) >= min(i1 + self.offset, j1):
                return None
            rows = torch.arange(i0 + self.offset, i1 + self.offset, device=device)
            cols = torch.arange(j0, j1, device=device)
            return rows[:, None] == cols[None, :]
        if self.pair_mask is not None:
            m = self.pair_mask[i0:i1, j0:j1].to(device)
        else:
            assert self.row_ids is not None and self.col_ids is not None  # not paired, no mask
            m = self.row_ids[i0:i1, None] == self.col_ids[None, j0:j1]
        return m if not skip_empty or bool(m.any()) else None

    def full_mask(self, m: int, n: int, device: torch.device) -> Tensor:
        """Bool (M, N) mask; only for the untiled path."""
        mask = self.mask(0, m, 0, n, device)
        return torch.zeros(m, n, dtype=torch.bool, device=device) if mask is None else mask


def positive_logit(rows: Tensor, cols: Tensor, scale: Tensor, pos: Positives) -> Tensor:
    """(M,) mean positive logit per row: ``(1/|P(i)|) sum_{j in P(i)} scale * x_i . y_j``.

    Linear in the logits, so it equals ``scale * x_i . mean_{j in P(i)} y_j``:
    computed in O((M + N) D) memory with plain autograd, no M x N matrix.
    With all ids distinct the group mean of a single vector is that vector
    bit for bit, so the id path reproduces the paired path exactly.
    """
    m = rows.shape[0]
    if pos.paired:
        target = cols[pos.offset : pos.offset + m]  # (M, D)
    elif pos.pair_mask is not None:
        w = pos.pair_mask.to(cols.dtype)  # (M, N)
        counts = w.sum(dim=1, keepdim=True)  # (M, 1)
        if bool((counts == 0).any()):
            raise ValueError("every row needs at least one positive in positive_mask")
        target = (w @ cols) / counts  # (M, D) mean positive candidate
    else:
        assert pos.row_ids is not None and pos.col_ids is not None  # not paired, no mask
        uniq, inv = torch.unique(pos.col_ids, return_inverse=True)
        sums = torch.zeros(uniq.shape[0], cols.shape[1], dtype=cols.dtype, device=cols.device)
        sums = sums.index_add(0, inv, cols)  # (G, D)
        counts = torch.bincount(inv, minlength=uniq.shape[0]).to(cols.dtype)  # (G,)
        group = torch.searchsorted(uniq, pos.row_ids).clamp(max=uniq.shape[0] - 1)  # (M,)
        if not torch.equal(uniq[group], pos.row_ids):
            raise ValueError("every row id must occur among the candidate ids (its own pair)")
        target = sums[group] / counts[group, None]  # (M, D)
    # (M,), no (M, D) temporary; the scale stays at compute precision (never rounded to bf16)
    dot: Tensor = torch.linalg.vecdot(rows, target)
    cdt = torch.float32 if dot.dtype in (torch.float16, torch.bfloat16) else dot.dtype
    return scale.reshape(()).to(cdt) * dot.to(cdt)
