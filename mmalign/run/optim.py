"""Optimisers, parameter groups and the learning-rate schedule.

LAMB follows You et al. 2019, "Large Batch Optimization for Deep Learning:
Training BERT in 76 minutes" (the optimiser of EVA-CLIP's recipes): Adam moments
with bias correction, decoupled weight decay added to the update, and a
per-tensor trust ratio ||w|| / ||update|| scaling the step.  DeepSpeed's fused
LAMB is CUDA-only, so this one is plain PyTorch and runs anywhere.

Under ZeRO >= 1 DeepSpeed hands the optimiser one flat fp32 partition per
parameter group (or sub-group) and rank, which holds slices of many tensors and
only part of some.  The engine then describes each partition as segments
(tensor index, offset, length) (:meth:`Lamb.set_partition_layout`); the squared
norms of each tensor's weight and update are summed over its segments on every
rank, so the trust ratio stays per tensor whatever the stage or world size.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence

import torch

from mmalign.config import TrainConfig
from mmalign.errors import ConfigError

# Parameters of a tower's stem: layer 0 of layer-wise decay (relative to the tower module).
_EMBEDDING_PREFIXES = (
    "conv1.",
    "class_embedding",
    "positional_embedding",
    "ln_pre.",
    "token_embedding.",
    "cls_emb",
)
_BLOCK = re.compile(r"^transformer\.resblocks\.(\d+)\.")


def _no_weight_decay(name: str, p: torch.nn.Parameter) -> bool:
    # open_clip's rule: tensors with fewer than 2 dims (gains, biases, the temperature), plus names
    return p.ndim < 2 or "bias" in name or "ln" in name or "norm" in name or "logit_" in name


def _tower_layers(tower: torch.nn.Module, key: str) -> tuple[Callable[[str], int], int]:
    """(name within the tower -> layer id, L) for an open_clip transformer tower of n blocks:
    the stem (patch / token / positional embeddings, class token, ln_pre) is layer 0, block i
    is layer i + 1, everything after the blocks (final norm, projection, pooler) is L = n + 1
    (the layer numbering of BEiT / EVA's layer-wise decay)."""
    blocks = getattr(getattr(tower, "transformer", None), "resblocks", None)
    if not isinstance(blocks, torch.nn.ModuleList):
        raise ConfigError(
            f"config key '{key}': layer-wise decay needs open_clip transformer towers; "
            f"the {type(tower).__name__} tower has no transformer.resblocks (use {key}: 1.0)"
        )
    depth = len(blocks) + 1

    def layer(name: str) -> int:
        if name.startswith(_EMBEDDING_PREFIXES):
            return 0
        match = _BLOCK.match(name)
        return int(match.group(1)) + 1 if match else depth

    return layer, depth


def param_groups(
    model: torch.nn.Module,
    weight_decay: float,
    lr: float | None = None,
    lr_image: float | None = None,
    lr_text: float | None = None,
    layer_decay: float = 1.0,
) -> list[dict]:
    """Optimiser parameter groups: one per (learning rate, weight decay or not) pair, the
    decayed groups first.

    No weight decay on gains, biases, norms or the temperature (open_clip's rule: tensors
    with fewer than 2 dims, which covers all of these, plus names).  Frozen parameters
    (``requires_grad=False``) are in no group, so they get no optimiser state.

    Learning rates (only with ``lr``; without it the groups carry none, the optimiser's
    default applies): parameters of the vision tower (``visual.*``) start from ``lr_image``,
    of the text tower (``text.*``) from ``lr_text`` (None: ``lr``), anything else (the
    temperature, the SigLIP bias) uses ``lr``.  With ``layer_decay`` < 1 a tower
    parameter in layer i of a tower with layers 0..L (:func:`_tower_layers`) gets
    ``tower lr x layer_decay ** (L - i)`` (layer-wise decay as in BEiT, Bao et al. 2021,
    and EVA-CLIP, Sun et al. 2023).  The schedule multiplies each group's own base lr,
    so the ratios hold over the run.
    """
    towers: dict[str, tuple[float | None, Callable[[str], int] | None, int]] = {}
    for prefix, tower_lr in (("visual", lr_image), ("text", lr_text)):
        module = getattr(model, prefix, None)
        if module is None:
            continue
        base = lr if tower_lr is None else tower_lr
        if layer_decay != 1.0:
            layer_of, depth = _tower_layers(module, "train.layer_decay")
            towers[prefix + "."] = (base, layer_of, depth)
        else:
            towers[prefix + "."] = (base, None, 0)
    groups: dict[tuple, list] = {}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        group_lr = lr
        for prefix, (base, layer, depth) in towers.items():
            if name.startswith(prefix):
                group_lr = base
                if layer is not None and base is not None:
                    group_lr = base * layer_decay ** (depth - layer(name[len(prefix) :]))
                break
        # keyed by the flag, not the value: with weight_decay 0 the two kinds stay two groups,
        # as they always were (a checkpoint's optimiser state has one entry per group)
        groups.setdefault((group_lr, _no_weight_decay(name, p)), []).append(p)
    out = []
    for (group_lr, exempt), params in sorted(
        groups.items(), key=lambda kv: kv[0][1]
    ):  # stable: decayed first
        group = {"params": params, "weight_decay": 0.0 if exempt else weight_decay}
        if group_lr is not None:
            group["lr"] = group_lr
        out.append(group)
    return out


def train_param_groups(model: torch.nn.Module, t: TrainConfig) -> list[dict]:
    """:func:`param_groups` from the ``train.*`` keys (weight_decay, lr, lr_image, lr_text, layer_decay)."""
    return param_groups(
        model, t.weight_decay, lr=t.lr, lr_image=t.lr_image, lr_text=t.lr_text, layer_decay=t.layer_decay
    )


Segment = tuple[int, int, int]  # (tensor index, offset in the flat partition, length)


def _sum_sq(x: torch.Tensor) -> torch.Tensor:
    # a pairwise-summed sum of squares: torch's CPU norm() of a 1.6M-element fp32 tensor
    # (a token embedding) is ~2e-4 off, which would make the trust ratio depend on the split
    return x.pow(2).sum()


class Lamb(torch.optim.Optimizer):
    def __init__(
        self, params, lr: float = 1e-3, betas=(0.9, 0.999), eps: float = 1e-6, weight_decay: float = 0.0
    ):
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))
        self._layout: dict[int, tuple[torch.Tensor, list[Segment]]] = {}
        self._n_tensors = 0
        self._reduce_sum: Callable[[torch.Tensor], torch.Tensor] | None = None

    def set_partition_layout(
        self,
        layout: Sequence[tuple[torch.Tensor, Sequence[Segment]]],
        n_tensors: int,
        reduce_sum: Callable[[torch.Tensor], torch.Tensor],
    ) -> None:
        """Declare flat partitions: ``layout`` pairs each partition tensor this optimiser
        will be stepped with (the very object) with the segments of the model's tensors
        inside it on this rank; indices are in [0, n_tensors) and agree across ranks.
        Elements outside every segment are padding and are not updated.
        ``reduce_sum`` sums a tensor in place over the data-parallel ranks; every
        rank then calls :meth:`step` the same number of times (each call reduces once).
        """
        self._layout = {id(t): (t, [(int(i), int(at), int(n)) for i, at, n in segs]) for t, segs in layout}
        self._n_tensors = int(n_tensors)
        self._reduce_sum = reduce_sum

    def _moments_update(self, p: torch.Tensor, group: dict) -> torch.Tensor:
        """Adam moments (bias-corrected) plus decoupled weight decay: the update before its trust ratio."""
        b1, b2 = group["betas"]
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
        return update

    @staticmethod
    def _trust(w_norm: torch.Tensor, u_norm: torch.Tensor) -> torch.Tensor:
        # trust ratio; 1 where either norm is zero (fresh zero-init tensors, zero grads)
        return torch.where((w_norm > 0) & (u_norm > 0), w_norm / u_norm, torch.ones_like(w_norm))

    @torch.no_grad()
    def step(self, closure=None):
        loss = closure() if closure is not None else None
        flat = []  # (partition, its update, its segments, lr) awaiting the reduced norms
        for group in self.param_groups:
            for p in group["params"]:
                entry = self._layout.get(id(p))
                if self._layout and (entry is None or entry[0] is not p):
                    raise RuntimeError("Lamb was given a partition layout but stepped a tensor outside it")
                if p.grad is None:
                    continue
                update = self._moments_update(p, group)
                if entry is not None:
                    flat.append((p, update, entry[1], group["lr"]))
                    continue
                p.add_(update * self._trust(_sum_sq(p).sqrt(), _sum_sq(update).sqrt()), alpha=-group["lr"])
        if self._layout:
            self._step_segments(flat)
        return loss

    def _step_segments(self, flat: list) -> None:
        """Per-tensor trust ratios from the segments of every rank, then the updates."""
        device = next(iter(self._layout.values()))[0].device
        sq = torch.zeros(
            2, self._n_tensors + 1, dtype=torch.float32, device=device
        )  # (||w||^2, ||u||^2) per tensor
        for p, update, segments, _ in flat:
            if not segments:
                continue
            index = torch.tensor([s[0] for s in segments], device=device)
            for row, source in enumerate((p, update)):
                sums = torch.stack(
                    [_sum_sq(source.narrow(0, offset, length)) for _, offset, length in segments]
                )
                sq[row].index_add_(0, index, sums.float())
        assert self._reduce_sum is not None  # set with the layout
        self._reduce_sum(sq)  # every rank, even with nothing here: the call is collective
        trust = self._trust(sq[0].sqrt(), sq[1].sqrt())
        trust[-1] = 0.0  # padding: no tensor, no update
        for p, update, segments, lr in flat:
            # one trust value per element: runs of segments, gaps (padding) mapped to the last slot
            ids, lengths, at = [], [], 0
            for t, offset, length in sorted(segments, key=lambda s: s[1]):
                if offset > at:
                    ids.append(self._n_tensors)
                    lengths.append(offset - at)
                ids.append(t)
                lengths.append(length)
                at = offset + length
            if p.numel() > at:
                ids.append(self._n_tensors)
                lengths.append(p.numel() - at)
            scale = trust[torch.tensor(ids, device=device)].repeat_interleave(
                torch.tensor(lengths, device=device), output_size=p.numel()
            )  # (numel,)
            p.add_(update * scale.to(update.dtype), alpha=-lr)


def build_optimizer(groups: list[dict], t: TrainConfig) -> torch.optim.Optimizer:
    if t.optimizer == "adamw":
        # fused: one kernel over all tensors of a group instead of a per-tensor Python loop
        # (tiny towers on 2 CPU cores: 187 vs 568 CPU ms per step, bench/quality_cifar10.py's
        # profile); same update rule, float-rounding-level differences only.
        return torch.optim.AdamW(
            groups, lr=t.lr, betas=(t.betas[0], t.betas[1]), eps=t.eps, fused=_fusable(groups)
        )
    if t.optimizer == "lamb":
        return Lamb(groups, lr=t.lr, betas=tuple(t.betas), eps=t.eps)
    if t.optimizer == "sgd":
        return torch.optim.SGD(groups, lr=t.lr, momentum=t.momentum)
    raise ValueError(t.optimizer)


def _fusable(groups: list[dict]) -> bool:
    """torch's fused AdamW needs floating tensors on CPU or CUDA (it raises otherwise)."""
    params = [p for g in groups for p in g["params"]]
    return bool(params) and all(p.is_floating_point() and p.device.type in ("cpu", "cuda") for p in params)


def warmup_cosine(step: int, warmup: int, total: int) -> float:
    """LR multiplier: linear warmup to 1, then cosine decay to 0 at ``total``."""
    if step < warmup:
        return (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
