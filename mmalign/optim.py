"""Optimisers, parameter groups and the learning-rate schedule.

LAMB follows You et al. 2019, "Large Batch Optimization for Deep Learning:
Training BERT in 76 minutes" (the optimiser of EVA-CLIP's recipes): Adam moments
with bias correction, decoupled weight decay added to the update, and a
per-tensor trust ratio ||w|| / ||update|| scaling the step.  DeepSpeed's fused
LAMB is CUDA-only, so this one is plain PyTorch and runs anywhere.
"""

from __future__ import annotations

import math

import torch

from mmalign.config import TrainConfig


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """No weight decay on gains, biases, norms or the temperature (open_clip's rule:
    tensors with fewer than 2 dims, which covers all of these, plus names)."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        exclude = p.ndim < 2 or "bias" in name or "ln" in name or "norm" in name or "logit_" in name
        (no_decay if exclude else decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


class Lamb(torch.optim.Optimizer):
    def __init__(self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-6, weight_decay: float = 0.0):
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            b1, b2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["step"] += 1
                m, v = state["exp_avg"], state["exp_avg_sq"]
                m.mul_(b1).add_(p.grad, alpha=1 - b1)
                v.mul_(b2).addcmul_(p.grad, p.grad, value=1 - b2)
                m_hat = m / (1 - b1 ** state["step"])
                v_hat = v / (1 - b2 ** state["step"])
                update = m_hat / (v_hat.sqrt() + group["eps"])
                if group["weight_decay"]:
                    update.add_(p, alpha=group["weight_decay"])
                w_norm, u_norm = p.norm(), update.norm()
                # trust ratio; 1 where either norm is zero (fresh zero-init tensors, zero grads)
                trust = torch.where((w_norm > 0) & (u_norm > 0), w_norm / u_norm, torch.ones_like(w_norm))
                p.add_(update * trust, alpha=-group["lr"])
        return loss


def build_optimizer(groups: list[dict], t: TrainConfig) -> torch.optim.Optimizer:
    if t.optimizer == "adamw":
        return torch.optim.AdamW(groups, lr=t.lr, betas=tuple(t.betas), eps=t.eps)
    if t.optimizer == "lamb":
        return Lamb(groups, lr=t.lr, betas=tuple(t.betas), eps=t.eps)
    if t.optimizer == "sgd":
        return torch.optim.SGD(groups, lr=t.lr, momentum=t.momentum)
    raise ValueError(t.optimizer)


def warmup_cosine(step: int, warmup: int, total: int) -> float:
    """LR multiplier: linear warmup to 1, then cosine decay to 0 at ``total``."""
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
