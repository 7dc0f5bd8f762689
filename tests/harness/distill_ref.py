"""The naive distillation reference: KL(teacher || student) of every row's softmax written out
with explicit loops over rows and candidates (float64 in the tests)."""

from __future__ import annotations

import torch


def _row_kl(teacher_logits: list, student_logits: list):
    """KL(softmax(t) || softmax(s)) of one row, from its lists of 0-dim logits."""
    zt = sum(torch.exp(v) for v in teacher_logits)
    zs = sum(torch.exp(v) for v in student_logits)
    total = 0.0
    for t, s in zip(teacher_logits, student_logits):
        p = torch.exp(t) / zt
        total = total + p * (torch.log(p) - (s - torch.log(zs)))
    return total


def naive_distill(x, y, s, tx, ty, ts):
    """The mean over the image->text and text->image rows of the full batch of the teacher's
    softmax (scale ``ts``, features tx, ty of any width) against the student's (s, x, y)."""
    n = x.shape[0]
    s, ts = s.reshape(()), torch.as_tensor(ts, dtype=tx.dtype).reshape(())
    i2t = t2i = 0.0
    for i in range(n):
        i2t = i2t + _row_kl([ts * tx[i] @ ty[j] for j in range(n)], [s * x[i] @ y[j] for j in range(n)])
        t2i = t2i + _row_kl([ts * ty[i] @ tx[j] for j in range(n)], [s * y[i] @ x[j] for j in range(n)])
    return 0.5 * (i2t / n + t2i / n)


def open_clip_distill(x, y, s, tx, ty, ts):
    """open_clip's DistillClipLoss's distillation part, from its own code: the cross-entropy form
    (the KL plus the teacher's entropy)."""
    from open_clip.loss import DistillClipLoss

    loss = DistillClipLoss()
    ts = torch.as_tensor(ts, dtype=tx.dtype).reshape(())
    _, distill = loss(x, y, s.reshape(()), tx, ty, ts)
    return distill
