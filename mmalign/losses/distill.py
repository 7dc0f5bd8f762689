"""Distillation from a frozen teacher: the KL divergence between the teacher's and the student's
image->text and text->image softmax distributions over the global batch.

For anchor row i (an image, or a caption) and the W*B candidates j of the other modality,

    p_T(j | i) = softmax_j(s_T * a_T[i] . c_T[j])    (the teacher's own features and scale)
    p_S(j | i) = softmax_j(s_S * a[i] . c[j])        (the student's, with grad)
    KL_i = sum_j p_T(j | i) (log p_T(j | i) - log p_S(j | i))

The loss is the mean of KL_i over the rows of both directions, ``(mean_i2t + mean_t2i) / 2``.
Teacher and student may have different feature widths: only the (rows, W*B) distributions meet.

open_clip's ``DistillClipLoss`` writes the same term as a cross-entropy,
``-sum_j p_T log p_S``; the two differ by the teacher's entropy, a constant of the student, so
their gradients are equal.  The KL form is logged because it is 0 when the student matches the
teacher exactly.

Sharded as :func:`mmalign.losses.infonce.infonce_local`: each rank passes its LOCAL rows and
every rank's candidates (gathered with grad for the student, without for the teacher) and
averages over its local rows; the mean of the ranks' values is the full-batch loss, and after
the data-parallel average each rank's feature gradients are the full-batch rows of its slice.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["distill_kl", "distill_kl_local", "softmax_kl_rows"]


def _wide(x: Tensor) -> Tensor:
    """float32 for half-precision input (softmax in fp16/bf16 loses the tail), else as it is."""
    return x.float() if x.dtype in (torch.float16, torch.bfloat16) else x


def softmax_kl_rows(teacher_logits: Tensor, student_logits: Tensor) -> Tensor:
    """(R, N), (R, N) -> (R,): KL(softmax(teacher) || softmax(student)) of each row.

    The teacher's logits carry no graph; the student's gradient per row is
    ``softmax(student) - softmax(teacher)``."""
    log_t = F.log_softmax(_wide(teacher_logits), dim=1)  # (R, N)
    log_s = F.log_softmax(_wide(student_logits), dim=1)  # (R, N)
    return (log_t.exp() * (log_t - log_s)).sum(dim=1)


def distill_kl_local(
    image: Tensor,
    text: Tensor,
    image_all: Tensor,
    text_all: Tensor,
    scale: Tensor,
    t_image: Tensor,
    t_text: Tensor,
    t_image_all: Tensor,
    t_text_all: Tensor,
    t_scale: Tensor | float,
) -> Tensor:
    """This rank's distillation loss (0-dim).

    Args:
        image, text: (B, D) the student's local features (with grad).
        image_all, text_all: (W*B, D) every rank's student features (gathered with grad).
        scale: the student's logit scale (exp'd; a (1,) tensor with grad).
        t_image, t_text: (B, D_T) the teacher's local features (no grad; any width D_T).
        t_image_all, t_text_all: (W*B, D_T) every rank's teacher features.
        t_scale: the teacher's logit scale (exp'd; no grad).
    """
    if image.shape != text.shape or t_image.shape != t_text.shape:
        raise ValueError("expected (B, D) student and (B, D_T) teacher features of equal shapes")
    if image.shape[0] != t_image.shape[0] or image_all.shape[0] != t_image_all.shape[0]:
        raise ValueError(
            f"the teacher's rows ({t_image.shape[0]} local, {t_image_all.shape[0]} global) must be the "
            f"student's ({image.shape[0]}, {image_all.shape[0]})"
        )
    s = scale.reshape(())
    ts = t_scale.reshape(()).detach() if torch.is_tensor(t_scale) else t_scale
    dtype = _wide(image).dtype  # the teacher's logits in the student's precision (float32 at least)
    with torch.no_grad():
        t_i2t = ts * t_image.to(dtype) @ t_text_all.to(dtype).T  # (B, W*B)
        t_t2i = ts * t_text.to(dtype) @ t_image_all.to(dtype).T  # (B, W*B)
    i2t = softmax_kl_rows(t_i2t, s * image @ text_all.T)  # (B,)
    t2i = softmax_kl_rows(t_t2i, s * text @ image_all.T)  # (B,)
    return 0.5 * (i2t.mean() + t2i.mean())


def distill_kl(
    image: Tensor, text: Tensor, scale: Tensor, t_image: Tensor, t_text: Tensor, t_scale: Tensor | float
) -> Tensor:
    """The one-process form: every row is local."""
    return distill_kl_local(image, text, image, text, scale, t_image, t_text, t_image, t_text, t_scale)
