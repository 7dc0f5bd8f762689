"""The DeepSpeed engine: the only module that imports deepspeed.

The DeepSpeed config is derived from ours, so the batch arithmetic is decided in
one place::

    global batch = micro batch x gradient accumulation x world size

Without gradient caching the micro batch is the whole local batch (accumulation
1).  With caching, a micro batch is one chunk and the accumulation steps are the
chunks, so ``engine.step()`` after each chunk only updates at the last one; the
surrogate backward uses ``scale_wrt_gas=False`` because the cached gradients are
already those of the full local loss.  DeepSpeed then averages gradients over
ranks, which together with the losses' local-rows convention gives the exact
full-batch gradient.
"""

from __future__ import annotations

import contextlib
import copy
import itertools
import json
import logging
import math
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # before deepspeed is imported

import deepspeed  # noqa: E402
from deepspeed.utils import (  # noqa: E402
    safe_get_full_fp32_param,
    safe_get_full_grad,
    safe_get_local_fp32_param,
    safe_set_local_fp32_param,
)

from mmalign import distributed as mdist  # noqa: E402
from mmalign import reshard  # noqa: E402
from mmalign.compile import compile_failures, compile_towers  # noqa: E402
from mmalign.config import Config, ConfigError, grad_accum_dtype  # noqa: E402
from mmalign.data.batch import Batch  # noqa: E402
from mmalign.gradcache import chunk_sizes, grad_cache_step  # noqa: E402
from mmalign.models.batchnorm import StepStatistics, check_batchnorm  # noqa: E402
from mmalign.models.embeddings import Embeddings  # noqa: E402
from mmalign.optim import Lamb, build_optimizer, train_param_groups, warmup_cosine  # noqa: E402
from mmalign.zero_stage import effective_stage  # noqa: E402

log = logging.getLogger("mmalign.engine")
logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
deepspeed.utils.logger.setLevel(logging.WARNING)


@dataclass
class StepResult:
    loss_output: object  # what the loss function returned (LossOutput: loss, stats)
    skipped: bool  # a non-finite loss or gradient: no update was made

    @property
    def loss(self) -> torch.Tensor:
        return self.loss_output.loss

    @property
    def stats(self) -> dict:
        return self.loss_output.stats


@dataclass(frozen=True)
class BatchPlan:
    global_batch: int
    world_size: int
    local_batch: int
    chunks: tuple[int, ...]  # chunk sizes of the local batch; (local_batch,) when caching is off

    @property
    def micro_batch(self) -> int:
        return self.chunks[0]

    @property
    def accumulation(self) -> int:
        return len(self.chunks)

    def describe(self) -> str:
        return (f"global batch {self.global_batch} = micro batch {self.micro_batch} x accumulation "
                f"{self.accumulation} x world size {self.world_size}"
                + ("" if self.local_batch % self.micro_batch == 0 else f" (last chunk {self.chunks[-1]})"))


def plan_batch(cfg: Config, world_size: int) -> BatchPlan:
    t = cfg.train
    if t.global_batch_size % world_size:
        raise ConfigError(f"config key 'train.global_batch_size'={t.global_batch_size} is not divisible "
                          f"by the world size {world_size}")
    if not isinstance(t.grad_cache_chunk_size, int):  # auto: a memory measurement, made before the engine
        raise ValueError("train.grad_cache_chunk_size: auto is resolved before the engine is built "
                         "(mmalign.memory_plan.resolve_grad_cache_chunk), not by plan_batch")
    local = t.global_batch_size // world_size
    return BatchPlan(t.global_batch_size, world_size, local, tuple(chunk_sizes(local, t.grad_cache_chunk_size)))


def ds_config(cfg: Config, plan: BatchPlan, stage: Optional[int] = None) -> dict:
    """Our config -> DeepSpeed's (the single source of the batch arithmetic).

    ``stage``: the ZeRO stage to run (:func:`mmalign.zero_stage.effective_stage`); None =
    deepspeed.zero_stage as configured."""
    configured = cfg.deepspeed.zero_stage
    stage = configured if stage is None else stage
    precision = cfg.deepspeed.precision
    if precision == "fp16" and not torch.cuda.is_available():
        raise ConfigError("config key 'deepspeed.precision': fp16 needs a GPU (use bf16 or fp32 on CPU)")
    conf = {
        # DeepSpeed checks micro x accumulation x world == train_batch_size; with an
        # uneven last chunk the nominal micro batch is the first chunk's size.
        "train_batch_size": plan.micro_batch * plan.accumulation * plan.world_size,
        "train_micro_batch_size_per_gpu": plan.micro_batch,
        "gradient_accumulation_steps": plan.accumulation,
        "gradient_clipping": float(cfg.train.grad_clip),
        "zero_optimization": {"stage": stage},
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
        "bf16": {"enabled": precision == "bf16"},
        "fp16": {"enabled": precision == "fp16"},
    }
    accum = grad_accum_dtype(cfg)
    if accum is not None:
        # bf16/fp16 weights: sum the chunks' gradients in fp32 (DeepSpeed's default is the
        # weight dtype; at ZeRO-1 this selects its BF16_Optimizer). config.validate refuses
        # ZeRO-0 low-precision weights with more than one micro-step.
        conf["data_types"] = {"grad_accum_dtype": accum}
    if precision != "fp32":
        # ... and average them over ranks in fp32: DeepSpeed's default reduces in the weight
        # dtype, which rounds the fp32 sum to bf16 even on one rank and sums ranks in bf16.
        conf["communication_data_type"] = "fp32"
    if stage == 3:
        # Tiny towers: do not keep whole-model copies around for prefetch heuristics.
        conf["zero_optimization"].update({"stage3_param_persistence_threshold": 0})
    # config.validate refused extra keys that contradict the typed ones
    conf = _merged(conf, cfg.deepspeed.extra)
    if stage != configured:
        # ZeRO-0 in place of ZeRO-1/2 on one rank: the extra ZeRO keys left are communication
        # knobs (zero_stage.MOOT_ON_ONE_RANK), with nothing to act on; the stage is ours
        conf["zero_optimization"] = {"stage": stage}
    return conf


def _merged(base: dict, extra: dict) -> dict:
    """``extra`` merged into ``base`` recursively: mappings merge, other values replace."""
    out = dict(base)
    for key, value in extra.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merged(out[key], value)
        else:
            out[key] = copy.deepcopy(value)
    return out


class Engine:
    """Model + optimiser + schedule under DeepSpeed, one call per training step."""

    def __init__(self, model: torch.nn.Module, cfg: Config):
        mdist.init_from_env(require_group=True)  # DeepSpeed needs a process group, even for 1 rank
        self.cfg = cfg
        self.world_size = mdist.get_world_size()
        self.plan = plan_batch(cfg, self.world_size)
        self.max_log_scale = math.log(cfg.model.max_logit_scale)
        # BatchNorm towers: an explicit mode under caching / several ranks (ConfigError before DeepSpeed)
        bn_line = check_batchnorm(model, cfg.model.batchnorm, chunks=self.plan.accumulation,
                                  world_size=self.world_size)
        if bn_line is not None:
            log.info("%s", bn_line)
        t = cfg.train
        if t.grad_checkpointing:
            model.set_grad_checkpointing(True)  # ConfigError for a tower without it, before DeepSpeed
        if t.compile:
            compile_towers(model, t.compile_backend)  # in place: parameter names unchanged for DeepSpeed
        # per-tower lrs and layer-wise decay: each group carries its own lr, which the schedule scales
        groups = train_param_groups(model, t)
        # each group's parameter names, in the optimizer's order: a ZeRO-0 checkpoint's per-parameter
        # state is indexed by it (mmalign.reshard re-cuts it into ZeRO partitions and back)
        names = {id(p): n for n, p in model.named_parameters()}
        self.param_group_names = [[names[id(p)] for p in g["params"]] for g in groups]
        optimizer = build_optimizer(groups, t)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: warmup_cosine(s, t.warmup_steps, t.steps))
        self._output_type = _dict_at_the_deepspeed_boundary(model)  # before DeepSpeed's own hooks
        # the stage DeepSpeed runs at: ZeRO-0 for ZeRO-1/2 on one fp32 rank (mmalign.zero_stage);
        # every stage-dependent path below (LAMB's layout, the clamp, full_params, resharding) reads it
        self.stage, stage_line = effective_stage(cfg, self.world_size)
        self.ds_config = ds_config(cfg, self.plan, self.stage)
        if mdist.get_rank() == 0:
            if stage_line is not None:
                log.info("%s", stage_line)
            log.info("DeepSpeed config: %s", json.dumps(self.ds_config, sort_keys=True))
        with _without_shm_comm_op():
            self.ds, self.optimizer, _, self.scheduler = deepspeed.initialize(
                model=model, optimizer=optimizer, lr_scheduler=scheduler, config=copy.deepcopy(self.ds_config),
                dist_init_required=False,
            )
        self.module = self.ds.module
        if self.world_size == 1 and self.stage == 0 and cfg.deepspeed.precision == "fp32":
            # One rank, fp32 ZeRO-0: DeepSpeed's gradient "all-reduce" would flatten every gradient
            # into one buffer, average it over 1 rank and copy it back (about 7% of a tiny-tower
            # step on CPU, bench/step.py): an identity, skipped.
            self.ds.enable_backward_allreduce = False
        self.base_optimizer = optimizer  # ours; under ZeRO it steps DeepSpeed's flat partitions
        if isinstance(optimizer, Lamb) and self.stage >= 1:
            optimizer.set_partition_layout(*self._partition_layout(optimizer), mdist.all_reduce_sum)
        # With bf16/fp16 weights DeepSpeed casts the module; images must follow.
        self.input_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(cfg.deepspeed.precision)
        # train.precision's autocast, entered inside the module DeepSpeed calls (module doc of
        # _InnerAutocast): a caller's autocast around the engine is switched off on CUDA.
        self._inner = _InnerAutocast(self.module)
        self.autocast = autocast_for(cfg, _module_device(self.module))

    def _partition_layout(self, optimizer: torch.optim.Optimizer) -> tuple[list, int]:
        """The flat fp32 partitions DeepSpeed will step ``optimizer`` with on this rank, each
        with the segments (tensor index, offset, length) of the module's parameters inside it
        (indices in named_parameters order, the same on every rank). Elements in no
        segment are padding."""
        params = [p for _, p in self.module.named_parameters()]
        if self.stage == 3:
            # Each parameter is split evenly over the ranks (the last slice padded); this
            # rank's slices lie back to back in its flat partition of the sub-group.
            z3, rank = self.ds.optimizer, mdist.get_rank()
            parts = list(z3.fp32_partitioned_groups_flat)
            segments = {id(t): [] for t in parts}
            for index, p in enumerate(params):
                if not p.requires_grad:
                    continue
                sub, offset, size = z3.grad_position[z3.get_param_id(p)]
                length = max(0, min(size, p.ds_numel - rank * size))
                if length:
                    segments[id(parts[sub])].append((index, offset, length))
            return [(t, segments[id(t)]) for t in parts], len(params)
        # ZeRO-1/2 (and the BF16 optimizer): DeepSpeed links each parameter to its fragment
        # of a flat partition, a view into the partition the optimiser holds.
        parts = [t for group in optimizer.param_groups for t in group["params"]]
        segments = {id(t): [] for t in parts}
        for index, p in enumerate(params):
            mapping = getattr(p, "_hp_mapping", None)
            if mapping is None:  # not on this rank (or frozen)
                continue
            fragment, address = mapping.hp_fragment, mapping.hp_fragment_address
            owner = [t for t in parts if t.untyped_storage().data_ptr() == fragment.untyped_storage().data_ptr()
                     and fragment.data_ptr() == t.data_ptr() + address.start * t.element_size()]
            if len(owner) != 1:
                raise RuntimeError(f"LAMB under ZeRO-{self.stage}: cannot place parameter {index} in a partition")
            segments[id(owner[0])].append((index, address.start, address.numel))
        return [(t, segments[id(t)]) for t in parts], len(params)

    # -------------------------------------------------------------- stepping

    def forward(self, images: Optional[torch.Tensor], tokens: Optional[torch.Tensor], autocast=None,
                **extra: torch.Tensor) -> Embeddings:
        """The model's Embeddings; ``extra``: further model inputs by keyword (``images2``, ``neg_texts``).
        A None input skips its tower.

        ``autocast``: a ``() -> context manager`` the towers run under, entered inside the
        module DeepSpeed calls; None = train.precision's (:attr:`autocast`). Do not wrap this
        call in an autocast of your own: on CUDA DeepSpeed switches it off for the module."""
        if self.input_dtype is not None:
            images = None if images is None else images.to(self.input_dtype)
            extra = {k: v.to(self.input_dtype) if v.is_floating_point() else v for k, v in extra.items()}
        with self._inner.using(autocast or self.autocast):
            out = self.ds(images, tokens, **extra)  # the fields as a dict (_dict_at_the_deepspeed_boundary)
        return self._output_type[0](**out) if isinstance(out, dict) else out

    def encode(self, batch: Batch, autocast=None, first: Optional[Embeddings] = None) -> Embeddings:
        """float32 Embeddings of ``batch``'s model inputs (:meth:`Batch.model_inputs`), the towers
        under ``autocast`` (None: train.precision's; see :meth:`forward`).

        ``first``: this batch's earlier outputs (a gradient-cache re-forward): the fully locked
        towers (:meth:`TwoTower.fully_locked`) are not run again, their fields are taken from it."""
        inputs, reused = batch.model_inputs(), {}
        if first is not None:
            inputs, reused = self.module.without_locked(inputs, first)
        out = self.forward(inputs.pop("images", None), inputs.pop("texts", None), autocast=autocast, **inputs)
        return out.map(lambda t: t.float()).replace(**reused)

    def _fully_locked(self) -> tuple[str, ...]:
        locked = getattr(self.module, "fully_locked", None)
        return locked() if locked is not None else ()

    def _backward(self, surrogate: torch.Tensor) -> None:
        self.ds.backward(surrogate, scale_wrt_gas=False)

    def step(self, batch: Batch, objective, autocast=None, before_update=None) -> StepResult:
        """Forward, loss, backward and one optimiser update over the local batch.

        ``batch``: this rank's :class:`~mmalign.data.batch.Batch` on the device; every
        model input it holds (images, tokens, and ``images2`` / ``neg_tokens`` when
        present) is encoded, chunk by chunk (:meth:`Batch.slice`) with gradient caching.
        ``objective``: a :class:`mmalign.objective.Objective` (its loss on this batch), or
        any ``loss_fn(embeddings) -> LossOutput``; it receives the full local batch's float32
        :class:`~mmalign.models.embeddings.Embeddings`.
        ``before_update()`` runs after the last backward, before the update (the
        averaged gradients are then readable with :meth:`full_grads`).  A step whose
        loss or representation gradients are non-finite on any rank is skipped
        before anything reaches the model (``StepResult.skipped``).
        """
        loss_fn = objective.loss_for(batch) if hasattr(objective, "loss_for") else objective

        def update(i: int = 0, last: bool = True) -> None:
            if last and before_update is not None:
                before_update()
            if last and self.stage == 0:
                self._own_norm = self._module_grad_norm()  # a device tensor, read by grad_norm() at log steps
            self.ds.step()

        def encode(chunk: Batch) -> Embeddings:
            return self.encode(chunk, autocast)

        # BatchNorm running statistics: recorded by the first pass, one update per step (commit);
        # a torch.compile failure (lazy: in the first step) is one ConfigError line
        with compile_failures(self.cfg.train.compile), StepStatistics(self.module) as bn:
            if self.plan.accumulation == 1:
                result, skipped = self._single_pass(encode(batch), loss_fn, update)
            else:
                bounds = [0, *itertools.accumulate(self.plan.chunks)]
                chunks = [batch.slice(i, j) for i, j in zip(bounds, bounds[1:])]
                cached = grad_cache_step(
                    encode, chunks, loss_fn, self._backward,
                    after_chunk=update, guard=self._all_finite, replay=bn.replay,
                    # a fully locked tower: forwarded once per chunk, its first-pass outputs reused
                    reencode=(lambda chunk, first: self.encode(chunk, autocast, first)) if self._fully_locked()
                    else None,
                )
                result, skipped = cached.result, cached.skipped
            if not skipped:
                bn.commit()
        if not skipped:
            self.clamp_logit_scale()
        return StepResult(result, skipped)

    def _single_pass(self, out: Embeddings, loss_fn, update) -> tuple:
        """Uncached step with the same guard as the cached one: take d(loss)/d(outputs)
        first, check it on every rank, then back-propagate it through the towers."""
        keys = [k for k, v in out.tensors().items() if v.requires_grad]  # every field, per-sample or per-step
        # The loss sees detached leaves, so taking its gradient never runs a backward
        # through the (DeepSpeed-hooked) model; the towers then get one engine backward.
        leaves = {k: getattr(out, k).detach().requires_grad_(True) for k in keys}
        result = loss_fn(out.replace(**leaves))
        grads = dict(zip(keys, torch.autograd.grad(result.loss, [leaves[k] for k in keys], allow_unused=True)))
        if not self._all_finite(result.loss, grads):
            return result, True
        surrogate = sum((getattr(out, k) * g).sum() for k, g in grads.items() if g is not None)
        self._backward(surrogate)
        update()
        return result, False

    def _all_finite(self, loss: torch.Tensor, grads: dict) -> bool:
        """True on every rank iff the loss and the representation gradients are finite on every rank.

        One fused device flag (the count of non-finite tensors on this rank), one all_reduce and
        one host read per step: the step's control flow needs the answer, nothing else does."""
        checks = [torch.isfinite(loss.detach()).all()]
        checks += [torch.isfinite(g).all() for g in grads.values() if g is not None]
        bad = torch.stack(checks).logical_not().sum().to(torch.float32).reshape(1)  # (1,) on the loss's device
        return bool(mdist.all_reduce_sum(bad).item() == 0)

    @torch.no_grad()
    def clamp_logit_scale(self) -> None:
        """Clamp log-scale into [0, ln max] in the module and in ZeRO's fp32 master copy
        (otherwise the next update would write the unclamped master value back).

        No collective: each rank clamps what it holds. The module copy is whole on every
        rank (stages 0-2, equal after the update) or this rank's partition (stage 3); the
        fp32 master lives on the rank that owns its fragment (stages 1-2 and DeepSpeed's
        BF16 optimizer: ``_hp_mapping``, None elsewhere; stage 3: the local partition).
        Clamping is elementwise, so the pieces stay consistent with the whole."""
        p = self.module.logit_scale
        if hasattr(p, "ds_id"):
            # ZeRO-3: this rank's partition of the master copy (DeepSpeed's full-param setter
            # cannot split a 1-element parameter across ranks)
            master = safe_get_local_fp32_param(p)
            if master is not None and master.numel():
                safe_set_local_fp32_param(p, master.clamp(0.0, self.max_log_scale))
        else:
            mapping = getattr(p, "_hp_mapping", None)  # absent at stage 0: no master copy
            if mapping is not None:
                mapping.hp_fragment.clamp_(0.0, self.max_log_scale)  # a view into the flat fp32 partition
        local = p.ds_tensor if hasattr(p, "ds_tensor") else p  # ZeRO-3 keeps only a partition
        local.data.clamp_(0.0, self.max_log_scale)

    def full_grads(self) -> dict[str, torch.Tensor]:
        """Rank-averaged full gradients (between the last backward and the update;
        a collective under ZeRO-3)."""
        grads = {}
        for name, p in self.module.named_parameters():
            g = safe_get_full_grad(p)
            if g is None:
                g = p.grad
            grads[name] = None if g is None else g.detach().float().cpu().clone()
        return grads

    @property
    def lr(self) -> float:
        """train.lr under the schedule (groups with their own lr, train.lr_image / lr_text /
        layer_decay, scale from their base lr by the same factor)."""
        return float(self.scheduler.get_last_lr()[0] / self.scheduler.base_lrs[0] * self.cfg.train.lr)

    def grad_norm(self) -> float:
        """Global gradient norm of the last update (before clipping)."""
        norm = self.ds.get_global_grad_norm()
        if norm is None:  # ZeRO-0 without clipping: DeepSpeed computes none; ours was taken before the update
            norm = getattr(self, "_own_norm", None)
        return float(norm) if norm is not None else float("nan")

    @torch.no_grad()
    def _module_grad_norm(self) -> torch.Tensor | None:
        # ZeRO-0: the module's .grad are the full, rank-averaged gradients after the last backward
        norms = [p.grad.detach().float().norm() for p in self.module.parameters() if p.grad is not None]
        return torch.linalg.vector_norm(torch.stack(norms)) if norms else None

    # ----------------------------------------------------------- checkpoints

    def save_checkpoint(self, directory: str | Path, tag: str, client_state: dict | None = None) -> None:
        """DeepSpeed's own (pickled) engine state; every rank must call this."""
        # save_latest=False: DeepSpeed's own `latest` file is written outside mmalign's checked writer
        # (a full disk there would leave the other ranks in its barrier) and is never read: mmalign
        # names the tag itself (checkpoint.py keeps its own pointer)
        self.ds.save_checkpoint(str(directory), tag=tag, client_state=client_state or {}, save_latest=False)

    def load_checkpoint(self, directory: str | Path, tag: str) -> dict:
        """Resume from DeepSpeed's engine state, every file unpickled with ``weights_only=True``
        (plus :func:`_deepspeed_safe_globals`): DeepSpeed's own checkpoint engine would run
        whatever a planted pickle holds.  All of its resume reads go through
        ``checkpoint_engine.load``, so that one method is swapped for the call.
        ZeRO partitions written by another world size, and checkpoints written at ZeRO-0 for a
        ZeRO-1/2/3 engine or the other way round (a one-process run of a zero_stage 1 config
        runs ZeRO-0, :mod:`mmalign.zero_stage`), are consolidated and re-cut (:mod:`mmalign.reshard`)."""
        engine_dir = Path(directory) / tag
        # ZeRO-0 reading a ZeRO-0 checkpoint (no optimizer partition files): DeepSpeed's own loader,
        # without reading the model-states file (module + optimizer) an extra time
        if self.stage >= 1 or any(engine_dir.glob("*optim_states.pt")):
            states = _safe_load(reshard.model_states_file(engine_dir))
            if reshard.needs_conversion(states, self.stage, self.world_size):
                reshard.load_resharded(self, Path(directory), tag, consolidate_checkpoint, _safe_load)
                return {}
        ckpt_engine = self.ds.checkpoint_engine

        def weights_only_load(path, map_location=None):
            return torch.load(path, map_location=map_location, weights_only=True)

        ckpt_engine.load = weights_only_load  # an instance attribute shadowing the method
        try:
            with torch.serialization.safe_globals(_deepspeed_safe_globals()):
                _, client_state = self.ds.load_checkpoint(str(directory), tag=tag)
        finally:
            del ckpt_engine.load
        return client_state or {}

    @torch.no_grad()
    def full_params(self, master: bool = False) -> dict[str, torch.Tensor]:
        """Every parameter's full fp32 value on the module's device (read-only views
        where possible); a collective under ZeRO-3, and at stages 1-2 with ``master``.

        The fp32 master copy when ZeRO keeps one, else the module's weight. Without
        ``master``, stages 0-2 with fp32 weights read the module itself, no
        communication: DeepSpeed writes the updated master into it after each step,
        so the two are equal (the momentum queue's EMA reads this every step).
        """
        params = {}
        for name, p in self.module.named_parameters():
            if self.stage == 3 and not p.requires_grad:  # locked: no fp32 master; gather the module's
                with deepspeed.zero.GatheredParameters([p]):
                    params[name] = p.detach().float().clone()
                continue
            local = not master and self.stage < 3 and p.dtype == torch.float32
            full = None if local else safe_get_full_fp32_param(p)
            if full is None:  # stage 0 without a master copy: the module holds the weights
                full = p.detach()
            params[name] = full.detach().float()
        return params

    def consolidated_state_dict(self) -> dict[str, torch.Tensor]:
        """Full fp32 weights on every rank (a collective under ZeRO-3).

        ZeRO keeps fp32 master weights in the optimizer (partitioned from stage 1
        on); the module may hold bf16 copies or, at stage 3, empty partitions.
        """
        state = {name: full.cpu().clone() for name, full in self.full_params(master=True).items()}
        persistent = set(self.module.state_dict().keys())
        for name, buf in self.module.named_buffers():
            if name in persistent:
                state[name] = buf.detach().cpu().clone()
        return state

    # ------------------------------------------- for the loop and for resharding
    # What the training loop (mmalign.train) and the re-partitioning of a checkpoint
    # (mmalign.reshard) need from DeepSpeed's engine: nothing outside this module reads ``.ds``.

    def train_mode(self) -> None:
        """Dropout, patch dropout and BatchNorm batch statistics on (the module's ``train()``)."""
        self.ds.train()

    def eval_mode(self) -> None:
        """Deterministic forwards (a probe, an evaluation); :meth:`train_mode` switches back."""
        self.ds.eval()

    def named_parameters(self):
        """The module's (name, parameter) pairs; under ZeRO-3 each holds only this rank's partition."""
        return self.module.named_parameters()

    def named_buffers(self):
        """The module's (name, buffer) pairs (BatchNorm running statistics), whole on every rank."""
        return self.module.named_buffers()

    def zero3_slot(self, p: torch.nn.Parameter) -> tuple[torch.Tensor, int, int]:
        """ZeRO-3: (the flat fp32 partition of the sub-group holding this rank's slice of ``p``,
        the slice's offset in it, the per-rank slice size). ``p`` is split evenly over the
        ranks: rank r holds its flattened elements [r * size, (r + 1) * size)."""
        z3 = self.ds.optimizer
        sub, offset, size = z3.grad_position[z3.get_param_id(p)]
        return list(z3.fp32_partitioned_groups_flat)[sub], int(offset), int(size)

    def set_step_counters(self, global_steps: int, global_samples: int, skipped_steps: int) -> None:
        """DeepSpeed's own step counters, as restored from a checkpoint's model-states file."""
        self.ds.global_steps = global_steps
        self.ds.global_samples = global_samples
        self.ds.skipped_steps = skipped_steps


def autocast_for(cfg: Config, device: torch.device):
    """``() -> context manager``: train.precision's autocast on ``device`` (bf16 / fp16), or a
    no-op for fp32. Weights stay in deepspeed.precision; autocast only casts the ops' inputs."""
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(cfg.train.precision)
    if dtype is None:
        return _null_context
    return lambda: torch.autocast(device.type, dtype=dtype)


def _module_device(module: torch.nn.Module) -> torch.device:
    for t in itertools.chain(module.parameters(), module.buffers()):
        return t.device
    return torch.device("cpu")


class _InnerAutocast:
    """Runs a module's ``forward`` under the autocast context of the current engine call.

    DeepSpeed 0.19.8 runs the module inside ``autocast_if_enabled`` (runtime/torch_autocast.py):
    when the caller's autocast is on and the DeepSpeed config has no ``torch_autocast``
    section, it enters ``torch.autocast(device, enabled=False)`` around the whole module call.
    Its check reads ``torch.is_autocast_enabled()`` without an argument, i.e. CUDA's state, so
    on a GPU a caller's bf16 autocast silently became fp32 towers (on CPU the check is False
    and bf16 survived, which is why CPU tests never saw it). An autocast opened inside the
    module's own ``forward`` is below that wrapper and is left alone.

    DeepSpeed's ``torch_autocast`` section is not the fix: it also casts and reduces the
    gradients of Linear / Conv weights in the low precision, and mmalign sums every gradient
    in fp32. Here only the forward's ops run in bf16; autograd casts each weight gradient back
    to the fp32 parameter's dtype, so accumulation and reduction stay fp32.

    The instance replaces ``module.forward`` (an instance attribute, not a wrapper module), so
    parameter names, ``state_dict`` keys and checkpoints are unchanged."""

    def __init__(self, module: torch.nn.Module):
        self._forward = module.forward  # the bound method of the module's class
        self._context = None
        module.forward = self

    @contextlib.contextmanager
    def using(self, context):
        previous, self._context = self._context, context
        try:
            yield
        finally:
            self._context = previous

    def __call__(self, *args, **kwargs):
        context = self._context
        if context is None:
            return self._forward(*args, **kwargs)
        with context():
            return self._forward(*args, **kwargs)


def _dict_at_the_deepspeed_boundary(model: torch.nn.Module) -> list:
    """Let DeepSpeed see the model's output tensors: it looks for them only in tensors, tuples,
    lists and dicts (its backward hooks on a forward's outputs run the backward prologue that
    fp32 gradient accumulation of bf16 weights needs; ZeRO-3 wraps them for its pre-backward
    parameter fetch).  A forward hook registered before DeepSpeed's turns the model's
    Embeddings into a dict of its present fields; :meth:`Engine.forward` rebuilds the same
    Embeddings class from it.  Returns the one-element list holding that class."""
    kind: list = [Embeddings]

    def to_dict(module, args, output):
        if isinstance(output, Embeddings):
            kind[0] = type(output)
            return output.tensors()
        return output

    model.register_forward_hook(to_dict)
    return kind


@contextlib.contextmanager
def _without_shm_comm_op():
    """``deepspeed.initialize`` without DeepSpeed's shared-memory all-reduce op.

    On the CPU accelerator DeepSpeed's communication backend JIT-compiles the C++ op
    ``deepspeed_shm_comm`` (50-100 s on two cores, printing a CUDA_HOME warning, and
    compiled again whenever torch's extension cache key changes) the first time a backend
    is made. That op serves only ``inference_all_reduce`` (tensor-parallel inference);
    training's collectives go through torch.distributed (gloo), so it is never used here.
    DeepSpeed falls back to torch.distributed when the op is absent, which is what the
    builder returning None means.
    """
    import importlib

    ds_comm_torch = importlib.import_module("deepspeed.comm.torch")  # the package re-binds the name "torch"
    real = ds_comm_torch.build_shm_op
    ds_comm_torch.build_shm_op = lambda: None
    try:
        yield
    finally:
        ds_comm_torch.build_shm_op = real


def _deepspeed_safe_globals() -> list:
    """The non-tensor classes DeepSpeed 0.19 pickles into its ZeRO 1-3 optimizer files
    (found by saving real checkpoints at every stage, fp32 and bf16): allowing exactly
    these lets ``torch.load(weights_only=True)`` read them.  All three are plain data
    (a loss-scale record, an int enum, a dataclass of two ints): unpickling them runs
    no code."""
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [LossScaler, ZeroStageEnum, fragment_address]


def _safe_load(path) -> dict:
    with torch.serialization.safe_globals(_deepspeed_safe_globals()):
        return torch.load(path, map_location="cpu", weights_only=True)


class _WeightsOnlyTorch:
    """``torch`` as seen by DeepSpeed's zero_to_fp32 module while we consolidate: the same
    module except that ``load`` always unpickles with ``weights_only=True``.

    zero_to_fp32 calls ``torch.load(..., weights_only=False)`` itself; swapping its
    module-level name for the duration of our call is narrower than patching
    ``torch.load`` for the whole process.

    ``state_key`` (e.g. ``exp_avg``): each optimizer file's flat fp32 partitions are
    replaced by that optimizer state of the same partitions (cut to the partitions'
    saved lengths: ZeRO-1/2 store the state with its end padding), so zero_to_fp32
    consolidates the state instead of the weights.
    """

    def __init__(self, state_key: str | None = None):
        self.state_key = state_key

    def __getattr__(self, name):
        return getattr(torch, name)

    def load(self, f, *args, **kwargs):
        kwargs["weights_only"] = True
        loaded = torch.load(f, *args, **kwargs)
        osd = loaded.get("optimizer_state_dict") if isinstance(loaded, dict) else None
        if self.state_key is not None and isinstance(osd, dict):
            key = "single_partition_of_fp32_groups" if "single_partition_of_fp32_groups" in osd else "fp32_flat_groups"
            base = osd.get("base_optimizer_state") or osd["optimizer_state_dict"]
            state = base["state"]
            osd[key] = [state[i][self.state_key][:len(part)] for i, part in zip(sorted(state), osd[key])]
        return loaded


_zero_to_fp32_lock = threading.Lock()


def _no_bar(iterable, *args, **kwargs):
    return iterable


def consolidate_checkpoint(directory: str | Path, tag: str, state_key: str | None = None) -> dict[str, torch.Tensor]:
    """One fp32 state dict from a DeepSpeed checkpoint directory (any ZeRO stage);
    with ``state_key`` (ZeRO >= 1), that optimizer state per parameter instead of the weights.

    Every file is read with ``torch.load(weights_only=True)`` (plus the few DeepSpeed
    classes of :func:`_deepspeed_safe_globals`), so a planted pickle fails to load
    (``pickle.UnpicklingError``) instead of running.
    """
    from deepspeed.utils import zero_to_fp32

    path = Path(directory) / tag
    if not path.is_dir():
        raise FileNotFoundError(f"no checkpoint {tag!r} in {directory}")
    with torch.serialization.safe_globals(_deepspeed_safe_globals()):
        if not list(path.glob("*optim_states.pt")):  # ZeRO-0: the module state is stored whole
            if state_key is not None:  # its optimizer state is per parameter: mmalign.reshard.zero0_moments
                raise ValueError(f"consolidate_checkpoint: {path} is a ZeRO-0 checkpoint; state_key is for "
                                 f"ZeRO >= 1 partitions")
            model_file = next(iter(sorted(path.glob("mp_rank_*_model_states.pt"))), None)
            if model_file is None:
                raise FileNotFoundError(f"no model states in {path}")
            state = torch.load(model_file, map_location="cpu", weights_only=True)["module"]
        else:
            with _zero_to_fp32_lock:
                # and no progress bars on stderr (an export or a server start is one line)
                real = zero_to_fp32.torch, zero_to_fp32.tqdm
                zero_to_fp32.torch, zero_to_fp32.tqdm = _WeightsOnlyTorch(state_key), _no_bar
                try:
                    state = zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(str(directory), tag=tag)
                finally:
                    zero_to_fp32.torch, zero_to_fp32.tqdm = real
            if state_key is None:  # locked (frozen) weights: ZeRO-1 keeps them in the module state only
                for model_file in sorted(path.glob("*model_states.pt"))[:1]:
                    module = torch.load(model_file, map_location="cpu", weights_only=True)["module"]
                    state.update({k: v for k, v in module.items() if k not in state and v.numel()})
    return {k: v.float() if v.is_floating_point() else v for k, v in state.items()}


class _null_context:
    def __enter__(self):
        return None

    def __exit__(self, *exc):
        return False
