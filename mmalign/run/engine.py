"""The DeepSpeed engine: model + optimiser + schedule under DeepSpeed, one call per step.

The batch arithmetic (global = micro x accumulation x world) is decided in
:mod:`mmalign.run.engine_config`. With gradient caching a micro batch is one chunk and the accumulation steps are the chunks,
so ``engine.step()`` after each chunk only updates at the last one; the surrogate backward
uses ``scale_wrt_gas=False`` because the cached gradients are already those of the full
local loss.  DeepSpeed then averages gradients over ranks, which together with the losses'
local-rows convention gives the exact full-batch gradient.

This module uses DeepSpeed's public API; whatever reads or swaps DeepSpeed's private layout
(flat partitions, fragment maps, counters, the checkpoint engine, module-level swaps) is in
:mod:`mmalign.layout.ds_adapter`, and the forward's boundary (autocast, Embeddings as a dict) in
:mod:`mmalign.run.engine_forward`.
"""

from __future__ import annotations

import copy
import itertools
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from mmalign.layout.ds_adapter import default_accelerator

default_accelerator()  # before deepspeed is imported
import deepspeed  # noqa: E402
from deepspeed.utils import (  # noqa: E402
    safe_get_full_fp32_param,
    safe_get_full_grad,
    safe_get_local_fp32_param,
    safe_set_local_fp32_param,
)

from mmalign.config import Config  # noqa: E402
from mmalign.data.batch import Batch  # noqa: E402
from mmalign.dist import distributed as mdist  # noqa: E402
from mmalign.layout import ds_adapter  # noqa: E402
from mmalign.layout.ds_adapter import consolidate_checkpoint  # noqa: E402,F401 (re-exported: tests)
from mmalign.models.batchnorm import StepStatistics, check_batchnorm  # noqa: E402
from mmalign.models.embeddings import Embeddings  # noqa: E402
from mmalign.run import reshard  # noqa: E402
from mmalign.run.compile import compile_failures, compile_towers  # noqa: E402
from mmalign.run.engine_config import BatchPlan, ds_config, plan_batch  # noqa: E402,F401 (re-exported)
from mmalign.run.engine_forward import (  # noqa: E402,F401 (autocast_for re-exported)
    InnerAutocast,
    autocast_for,
    dict_at_the_deepspeed_boundary,
    module_device,
)
from mmalign.run.gradcache import grad_cache_step  # noqa: E402
from mmalign.run.optim import Lamb, build_optimizer, train_param_groups, warmup_cosine  # noqa: E402
from mmalign.run.zero_stage import effective_stage  # noqa: E402

if TYPE_CHECKING:
    from mmalign.models.two_tower import TwoTower
    from mmalign.objective import LossOutput, Objective

log = logging.getLogger("mmalign.run.engine")
logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
deepspeed.utils.logger.setLevel(logging.WARNING)


@dataclass
class StepResult:
    loss_output: LossOutput  # what the loss function returned (loss, stats)
    skipped: bool  # a non-finite loss or gradient: no update was made

    @property
    def loss(self) -> torch.Tensor:
        return self.loss_output.loss

    @property
    def stats(self) -> dict:
        return self.loss_output.stats


class Engine:
    """Model + optimiser + schedule under DeepSpeed, one call per training step."""

    def __init__(self, model: TwoTower, cfg: Config):
        mdist.init_from_env(require_group=True)  # DeepSpeed needs a process group, even for 1 rank
        self.cfg = cfg
        self.world_size = mdist.get_world_size()
        self.plan = plan_batch(cfg, self.world_size)
        # BatchNorm towers: an explicit mode under caching / several ranks (ConfigError before DeepSpeed)
        bn_line = check_batchnorm(
            model, cfg.model.batchnorm, chunks=self.plan.accumulation, world_size=self.world_size
        )
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
        # state is indexed by it (mmalign.run.reshard re-cuts it into ZeRO partitions and back)
        names = {id(p): n for n, p in model.named_parameters()}
        self.param_group_names = [[names[id(p)] for p in g["params"]] for g in groups]
        optimizer = build_optimizer(groups, t)
        scheduler = torch.optim.lr_scheduler.LambdaLR(
            optimizer, lambda s: warmup_cosine(s, t.warmup_steps, t.steps)
        )
        self._output_type = dict_at_the_deepspeed_boundary(model)  # before DeepSpeed's own hooks
        # the stage DeepSpeed runs at: ZeRO-0 for ZeRO-1/2 on one fp32 rank (mmalign.run.zero_stage);
        # every stage-dependent path below (LAMB's layout, the clamp, full_params, resharding) reads it
        self.stage, stage_line = effective_stage(cfg, self.world_size)
        self.ds_config = ds_config(cfg, self.plan, self.stage)
        if mdist.get_rank() == 0:
            if stage_line is not None:
                log.info("%s", stage_line)
            log.info("DeepSpeed config: %s", json.dumps(self.ds_config, sort_keys=True))
        ds_adapter.check_version(deepspeed.__version__)
        with ds_adapter.without_shm_comm_op():
            self.ds, self.optimizer, _, self.scheduler = deepspeed.initialize(
                model=model,
                optimizer=optimizer,
                lr_scheduler=scheduler,
                config=copy.deepcopy(self.ds_config),
                dist_init_required=False,
            )
        self.module = self.ds.module
        if self.world_size == 1 and self.stage == 0 and cfg.deepspeed.precision == "fp32":
            # One rank, fp32 ZeRO-0: DeepSpeed's gradient "all-reduce" would flatten every gradient
            # into one buffer, average it over 1 rank and copy it back (about 7% of a tiny-tower
            # step on CPU, bench/step.py): an identity, skipped.
            ds_adapter.skip_backward_allreduce(self.ds)
        self.base_optimizer = optimizer  # ours; under ZeRO it steps DeepSpeed's flat partitions
        if isinstance(optimizer, Lamb) and self.stage >= 1:
            optimizer.set_partition_layout(*self._partition_layout(), mdist.all_reduce_sum)
        # With bf16/fp16 weights DeepSpeed casts the module; images must follow.
        self.input_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(cfg.deepspeed.precision)
        # train.precision's autocast, entered inside the module DeepSpeed calls (module doc of
        # InnerAutocast): a caller's autocast around the engine is switched off on CUDA.
        self._inner = InnerAutocast(self.module)
        self.autocast = autocast_for(cfg, module_device(self.module))

    def _partition_layout(self) -> tuple[list, int]:
        """LAMB's layout: the flat fp32 partitions DeepSpeed steps our optimiser with on this rank,
        each with the segments (tensor index in named_parameters order, offset, length) in it."""
        parts = ds_adapter.partitions(self.ds, self.stage, self.base_optimizer)
        segments: dict[int, list[tuple[int, int, int]]] = {id(t): [] for t in parts}
        for f in self.partition_fragments():
            if f.length:
                segments[id(f.partition)].append((f.index, f.offset, f.length))
        return [(t, segments[id(t)]) for t in parts], sum(1 for _ in self.module.named_parameters())

    def partition_fragments(self) -> list[ds_adapter.Fragment]:
        """This rank's piece of every trainable parameter in the flat fp32 partitions ZeRO steps
        (none at ZeRO-0): what LAMB's per-tensor layout and :mod:`mmalign.run.reshard` need."""
        return ds_adapter.fragments(self.ds, self.module, self.stage, self.base_optimizer, mdist.get_rank())

    @torch.no_grad()
    def master_pieces(self) -> list[tuple[str, int, torch.Tensor]]:
        """This rank's fp32 master weights of the trainable parameters, as (name, start in the
        flattened parameter, a flat view): its fragments of ZeRO's flat partitions (stages 1-3,
        DeepSpeed's BF16 optimizer: over all ranks they tile each trainable parameter once), else
        (ZeRO-0, :attr:`master_replicated`) every trainable parameter whole, the same on every
        rank. What :mod:`mmalign.run.ema` averages."""
        if not self.master_replicated:
            return [
                (f.name, f.start, f.partition.narrow(0, f.offset, f.length))
                for f in self.partition_fragments()
                if f.length > 0
            ]
        return [
            (name, 0, p.detach().reshape(-1) if p.dtype == torch.float32 else p.detach().float().reshape(-1))
            for name, p in self.module.named_parameters()
            if p.requires_grad
        ]

    @property
    def master_replicated(self) -> bool:
        """Whether every rank holds the whole master weights (ZeRO-0 without DeepSpeed's BF16
        optimizer: the module is the master copy) rather than a piece of them."""
        return self.stage == 0 and not ds_adapter.linked_to_master(self.module)

    def trainable_shapes(self) -> dict[str, torch.Size]:
        """The whole shape of every trainable parameter (also under ZeRO-3), in named_parameters order."""
        return {
            name: ds_adapter.full_shape(p) for name, p in self.module.named_parameters() if p.requires_grad
        }

    # -------------------------------------------------------------- stepping

    def forward(
        self, images: torch.Tensor | None, tokens: torch.Tensor | None, autocast=None, **extra: torch.Tensor
    ) -> Embeddings:
        """The model's Embeddings; ``extra``: further model inputs by keyword (``images2``, ``neg_texts``).
        A None input skips its tower.

        ``autocast``: a ``() -> context manager`` the towers run under, entered inside the
        module DeepSpeed calls; None = train.precision's (:attr:`autocast`). Do not wrap this
        call in an autocast of your own: on CUDA DeepSpeed switches it off for the module."""
        if self.input_dtype is not None:
            images = None if images is None else images.to(self.input_dtype)
            extra = {k: v.to(self.input_dtype) if v.is_floating_point() else v for k, v in extra.items()}
        with self._inner.using(autocast or self.autocast):
            out = self.ds(images, tokens, **extra)  # the fields as a dict (dict_at_the_deepspeed_boundary)
        return self._output_type[0](**out) if isinstance(out, dict) else out

    def encode(self, batch: Batch, autocast=None, first: Embeddings | None = None) -> Embeddings:
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

    def step(
        self, batch: Batch, objective: Objective, autocast=None, before_update=None, stats: bool | None = None
    ) -> StepResult:
        """Forward, loss, backward and one optimiser update over the local batch.

        ``batch``: this rank's :class:`~mmalign.data.batch.Batch` on the device; every
        model input it holds (images, tokens, and ``images2`` / ``neg_tokens`` when
        present) is encoded, chunk by chunk (:meth:`Batch.slice`) with gradient caching.
        ``objective``: a :class:`mmalign.objective.Objective`; its loss on this batch
        (``objective.loss_for(batch, stats=stats)``) receives the full local batch's float32
        :class:`~mmalign.models.embeddings.Embeddings`. ``stats``: whether the loss also
        computes its stats (default: the objective's ``compute_stats``).
        ``before_update()`` runs after the last backward, before the update (the
        averaged gradients are then readable with :meth:`full_grads`).  A step whose
        loss or representation gradients are non-finite on any rank is skipped
        before anything reaches the model (``StepResult.skipped``).
        """
        loss_fn = objective.loss_for(batch, stats=stats)

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
                    encode,
                    chunks,
                    loss_fn,
                    self._backward,
                    after_chunk=update,
                    guard=self._all_finite,
                    replay=bn.replay,
                    # a fully locked tower: forwarded once per chunk, its first-pass outputs reused
                    reencode=(lambda chunk, first: self.encode(chunk, autocast, first))
                    if self._fully_locked()
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
        grads = dict(
            zip(keys, torch.autograd.grad(result.loss, [leaves[k] for k in keys], allow_unused=True))
        )
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
        bad = (
            torch.stack(checks).logical_not().sum().to(torch.float32).reshape(1)
        )  # (1,) on the loss's device
        return bool(mdist.all_reduce_sum(bad).item() == 0)

    @torch.no_grad()
    def clamp_logit_scale(self) -> None:
        """Clamp log-scale into the model's range (:meth:`TwoTower.log_scale_range`, its one
        owner) in the module and in ZeRO's fp32 master copy (otherwise the next update would
        write the unclamped master value back).

        No collective: each rank clamps what it holds. The module copy is whole on every
        rank (stages 0-2, equal after the update) or this rank's partition (stage 3); the
        fp32 master lives on the rank that owns its fragment (stages 1-2 and DeepSpeed's
        BF16 optimizer: :func:`mmalign.layout.ds_adapter.master_fragment`; stage 3: the local partition).
        Clamping is elementwise, so the pieces stay consistent with the whole."""
        low, high = self.module.log_scale_range()
        p = self.module.logit_scale
        if ds_adapter.is_zero3(p):
            # ZeRO-3: this rank's partition of the master copy (DeepSpeed's full-param setter
            # cannot split a 1-element parameter across ranks)
            master = safe_get_local_fp32_param(p)
            if master is not None and master.numel():
                safe_set_local_fp32_param(p, master.clamp(low, high))
        else:
            master = ds_adapter.master_fragment(p)  # None at stage 0: no master copy
            if master is not None:
                master.clamp_(low, high)  # a view into the flat fp32 partition
        ds_adapter.local_partition(p).data.clamp_(low, high)  # ZeRO-3 keeps only a partition

    def full_grads(self) -> dict[str, torch.Tensor | None]:
        """Rank-averaged full gradients (between the last backward and the update;
        a collective under ZeRO-3); None for a parameter without one."""
        grads: dict[str, torch.Tensor | None] = {}
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
        (:func:`mmalign.layout.ds_adapter.weights_only_resume`): DeepSpeed's own checkpoint engine would
        run whatever a planted pickle holds.
        ZeRO partitions written by another world size, and checkpoints written at ZeRO-0 for a
        ZeRO-1/2/3 engine or the other way round (a one-process run of a zero_stage 1 config
        runs ZeRO-0, :mod:`mmalign.run.zero_stage`), are consolidated and re-cut (:mod:`mmalign.run.reshard`)."""
        engine_dir = Path(directory) / tag
        # ZeRO-0 reading a ZeRO-0 checkpoint (no optimizer partition files): DeepSpeed's own loader,
        # without reading the model-states file (module + optimizer) an extra time
        if self.stage >= 1 or any(engine_dir.glob("*optim_states.pt")):
            states = ds_adapter.safe_load(reshard.model_states_file(engine_dir))
            if reshard.needs_conversion(states, self.stage, self.world_size):
                reshard.load_resharded(
                    self, Path(directory), tag, consolidate_checkpoint, ds_adapter.safe_load
                )
                return {}
        with ds_adapter.weights_only_resume(self.ds):
            _, client_state = self.ds.load_checkpoint(str(directory), tag=tag)
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
    # What the training loop (mmalign.run.train) and the re-partitioning of a checkpoint
    # (mmalign.run.reshard) need from DeepSpeed's engine: nothing outside this module reads ``.ds``.

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

    def set_step_counters(self, global_steps: int, global_samples: int, skipped_steps: int) -> None:
        """DeepSpeed's own step counters, as restored from a checkpoint's model-states file."""
        ds_adapter.set_step_counters(self.ds, global_steps, global_samples, skipped_steps)
