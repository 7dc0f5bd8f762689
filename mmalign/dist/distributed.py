"""Thin wrapper around ``torch.distributed``.

This is the only module in mmalign that imports ``torch.distributed``. Every
helper is a no-op (or the identity) when no process group is initialised, so
single-process code paths never need to branch on distributed state.

Launchers: torchrun and the DeepSpeed launcher export RANK / WORLD_SIZE /
LOCAL_RANK / MASTER_ADDR / MASTER_PORT; SLURM exports SLURM_PROCID /
SLURM_NTASKS / SLURM_LOCALID and the node list, from which the rendezvous address is
derived (:mod:`mmalign.dist.cluster`). :func:`init_from_env` understands both.

Every process group gets the run's ``dist.timeout_s``: a peer that vanished (a lost
host, a network partition) ends the survivors' collectives with an error after that
long, instead of torch's 10-30 minute defaults; :func:`lost_peer` turns that error into
one line for the user.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import cast

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from mmalign.dist import cluster

__all__ = [
    "DistInfo",
    "is_initialized",
    "get_rank",
    "get_world_size",
    "barrier",
    "all_gather_with_grad",
    "gather_path",
    "all_gather_nograd",
    "all_reduce_mean",
    "all_reduce_sum",
    "all_gather_object",
    "broadcast_object",
    "prepare_slow_barrier",
    "slow_barrier",
    "all_reduce_sum_with_grad",
    "init_from_env",
    "env_dist_info",
    "local_device_index",
    "default_timeout_s",
    "lost_peer",
    "shutdown",
]

DEFAULT_MASTER_ADDR = cluster.DEFAULT_MASTER_ADDR
DEFAULT_MASTER_PORT = cluster.DEFAULT_MASTER_PORT
# dist.timeout_s = 0 means these: a GPU job's collectives (a slow all-gather of a large
# model, a checkpoint save on a busy filesystem) get more slack than a CPU job's.
DEFAULT_TIMEOUT_GPU_S, DEFAULT_TIMEOUT_CPU_S = 600.0, 120.0
_timeout_s: float | None = None  # the timeout of the group this process initialised (for lost_peer)


def is_initialized() -> bool:
    return dist.is_available() and dist.is_initialized()


def get_rank() -> int:
    return dist.get_rank() if is_initialized() else 0


def get_world_size() -> int:
    return dist.get_world_size() if is_initialized() else 1


def barrier() -> None:
    if is_initialized():
        dist.barrier()


# The single-tensor collectives (torch 2.14 names; all_gather_into_tensor / reduce_scatter_tensor
# before): one flat (W*B, ...) buffer, no list of W tensors and no concatenation copy.
_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def gather_path(backend: str) -> str:
    """How :func:`all_gather_with_grad` / :func:`all_gather_nograd` talk to the other ranks:
    "single" (one all-gather into a flat tensor forward, one reduce-scatter backward: each
    rank receives only its B rows of the summed gradient, half the traffic of a ring
    all-reduce, which is a reduce-scatter plus an all-gather) on NCCL, or "all_reduce" (a list
    all-gather forward, an all-reduce of the whole (W*B, D) gradient backward, then this rank's
    slice) elsewhere: the path gloo runs have always taken. torch 2.14's gloo also has the
    single-tensor collectives, so tests run the "single" path on CPU by overriding this
    choice. ``backend``: ``torch.distributed.get_backend()``'s name."""
    return "single" if "nccl" in str(backend).lower() else "all_reduce"


def _gather(tensor: torch.Tensor, path: str) -> torch.Tensor:
    """(B, ...) contiguous -> (W*B, ...), every rank's rows in rank order."""
    world = dist.get_world_size()
    if path == "single":
        out = tensor.new_empty((world * tensor.shape[0],) + tuple(tensor.shape[1:]))  # (W*B, ...)
        _gather_single(out, tensor)
        return out
    parts = [torch.empty_like(tensor) for _ in range(world)]
    dist.all_gather(parts, tensor)
    return torch.cat(parts, dim=0)  # (W*B, ...)


class _AllGatherWithGrad(torch.autograd.Function):
    """Concatenate every rank's tensor along dim 0, keeping the graph.

    Backward: rank r's loss L_r depends on every rank's slice of the gathered
    tensor, so the gradient of ``sum_r L_r`` with respect to this rank's input
    is the SUM over ranks of the incoming gradients, restricted to this rank's
    slice: a reduce-scatter ("single" path of :func:`gather_path`), or an
    all-reduce of the whole gradient and a slice ("all_reduce" path, gloo).

    After data-parallel averaging (DDP / DeepSpeed divide by W), the result is
    the gradient of ``mean_r L_r``, i.e. the full-batch gradient when each L_r
    is the mean over its local rows (open_clip's local_loss + gather_with_grad).
    """

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, path: str) -> torch.Tensor:
        tensor = tensor.contiguous()
        ctx.rank, ctx.n, ctx.path = dist.get_rank(), tensor.shape[0], path
        return _gather(tensor, path)  # (W*B, ...)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        if ctx.path == "single":
            grad = grad.contiguous()  # read only: the reduce-scatter writes into its own output
            out = grad.new_empty((ctx.n,) + tuple(grad.shape[1:]))  # (B, ...)
            _reduce_scatter_single(out, grad, op=dist.ReduceOp.SUM)
            return out, None
        grad = grad.contiguous().clone()  # all_reduce is in place; do not clobber autograd's buffer
        dist.all_reduce(grad, op=dist.ReduceOp.SUM)
        return grad.narrow(0, ctx.rank * ctx.n, ctx.n), None


def all_gather_with_grad(tensor: torch.Tensor) -> torch.Tensor:
    """(B, ...) -> (W*B, ...), differentiable; identity when not distributed.

    Every rank must pass the same shape (use drop_last in the data loader).
    """
    if get_world_size() == 1:
        return tensor
    return _AllGatherWithGrad.apply(tensor, gather_path(dist.get_backend()))


@torch.no_grad()
def all_gather_nograd(tensor: torch.Tensor) -> torch.Tensor:
    """(B, ...) -> (W*B, ...), detached; identity when not distributed."""
    if get_world_size() == 1:
        return tensor
    return _gather(tensor.detach().contiguous(), gather_path(dist.get_backend()))


@torch.no_grad()
def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    """Sum ``tensor`` over ranks IN PLACE and return it."""
    if get_world_size() > 1:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


@torch.no_grad()
def all_reduce_mean(tensor: torch.Tensor) -> torch.Tensor:
    """Average ``tensor`` over ranks IN PLACE and return it."""
    if get_world_size() > 1:
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
        tensor.div_(dist.get_world_size())
    return tensor


def all_gather_object(obj) -> list:
    """Every rank's picklable ``obj``, in rank order (``[obj]`` when not distributed)."""
    if get_world_size() == 1:
        return [obj]
    out = [None] * get_world_size()
    dist.all_gather_object(out, obj)
    return out


def broadcast_object(obj, src: int = 0):
    """Rank ``src``'s picklable ``obj`` on every rank (``obj`` itself when not distributed)."""
    if get_world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


_slow_group: dist.ProcessGroup | None = None


def prepare_slow_barrier() -> None:
    """Collective (every rank, at the same point): create the gloo group of
    :func:`slow_barrier` once, before any rank goes off to work alone."""
    global _slow_group
    if get_world_size() > 1 and _slow_group is None:
        _slow_group = cast(dist.ProcessGroup, dist.new_group(backend="gloo"))  # every rank is a member


def slow_barrier(timeout_s: float) -> None:
    """A barrier with its own timeout, for ranks that wait while one rank works alone (rank
    0's evaluation tasks): the process group's timeout is sized for collectives, not for
    that.  A gloo ``monitored_barrier`` on a side group (so it works under NCCL too)."""
    from datetime import timedelta

    if get_world_size() == 1:
        return
    prepare_slow_barrier()
    dist.monitored_barrier(group=_slow_group, timeout=timedelta(seconds=float(timeout_s)))


class _AllReduceSumWithGrad(torch.autograd.Function):
    """Sum over ranks, keeping the graph (e.g. per-channel sums of a synchronised BatchNorm).

    Backward: every rank's loss L_r reads the same sum y = sum_r' x_r', so the
    gradient of ``sum_r L_r`` with respect to this rank's x is the SUM over ranks
    of the incoming gradients. As for :func:`all_gather_with_grad`, DeepSpeed's
    1/W gradient averaging then turns it into the gradient of the global mean
    loss when each L_r is the mean over its local rows.
    """

    @staticmethod
    def forward(ctx, tensor: torch.Tensor) -> torch.Tensor:
        out = tensor.contiguous().clone()
        dist.all_reduce(out, op=dist.ReduceOp.SUM)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        grad = grad.contiguous().clone()  # in place below; do not clobber autograd's buffer
        dist.all_reduce(grad, op=dist.ReduceOp.SUM)
        return grad


def all_reduce_sum_with_grad(tensor: torch.Tensor) -> torch.Tensor:
    """The sum of ``tensor`` over ranks, differentiable; identity when not distributed.

    Every rank must call it, in the same order, with the same shape."""
    if get_world_size() == 1:
        return tensor
    return _AllReduceSumWithGrad.apply(tensor)


@dataclass(frozen=True)
class DistInfo:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    master_addr: str = DEFAULT_MASTER_ADDR
    master_port: str = DEFAULT_MASTER_PORT
    source: str = "none"  # "torchrun" | "slurm" | "none"
    master_from: str = "MASTER_ADDR"  # where master_addr came from (SLURM: the node list)


def env_dist_info(environ: Mapping[str, str] | None = None) -> DistInfo:
    """Read rank/world size from torchrun-style variables, else from SLURM.

    Under SLURM without ``MASTER_ADDR`` the address is the first host of the job's node list
    (a list that cannot be parsed is a one-line ConfigError), not 127.0.0.1, which would
    leave every task of a multi-node job dialling itself until the store timeout."""
    env = os.environ if environ is None else environ
    addr = env.get("MASTER_ADDR", DEFAULT_MASTER_ADDR)
    port = env.get("MASTER_PORT", DEFAULT_MASTER_PORT)
    if "RANK" in env and "WORLD_SIZE" in env:
        return DistInfo(
            rank=int(env["RANK"]),
            world_size=int(env["WORLD_SIZE"]),
            local_rank=int(env.get("LOCAL_RANK", 0)),
            master_addr=addr,
            master_port=port,
            source="torchrun",
        )
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        world = int(env["SLURM_NTASKS"])
        # one task needs no rendezvous (a private loopback group): its node list is not read
        addr, port, where = cluster.slurm_master(env) if world > 1 else (addr, port, "MASTER_ADDR")
        return DistInfo(
            rank=int(env["SLURM_PROCID"]),
            world_size=world,
            local_rank=int(env.get("SLURM_LOCALID", 0)),
            master_addr=addr,
            master_port=port,
            source="slurm",
            master_from=where,
        )
    return DistInfo()


def local_device_index(local_rank: int, visible: int) -> int:
    """The CUDA device of a rank: LOCAL_RANK when that many devices are visible (one process
    per GPU of a node), else 0 (a scheduler bound one GPU to each task, e.g. SLURM's
    ``--gpus-per-task 1``, so every task sees its own GPU as device 0)."""
    return local_rank if local_rank < visible else 0


def default_timeout_s(cuda: bool) -> float:
    return DEFAULT_TIMEOUT_GPU_S if cuda else DEFAULT_TIMEOUT_CPU_S


def free_port() -> str:
    """A currently free TCP port on the loopback interface."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def init_from_env(
    backend: str | None = None, require_group: bool = False, timeout_s: float | None = None
) -> DistInfo:
    """Initialise the default process group from the environment.

    No-op for world size 1 (unless ``require_group``: DeepSpeed needs a group even
    for one process, which then gets a private loopback port) and when a group
    already exists. ``backend`` defaults to nccl when CUDA is available, else
    gloo. With CUDA the current device is :func:`local_device_index`, and nccl binds the
    group to it (``device_id``). ``timeout_s`` (None or 0: :func:`default_timeout_s`)
    bounds every collective of this group and of the groups created later (DeepSpeed's).
    """
    global _timeout_s
    info = env_dist_info()
    if is_initialized():
        return DistInfo(
            get_rank(),
            get_world_size(),
            info.local_rank,
            info.master_addr,
            info.master_port,
            info.source,
            info.master_from,
        )
    if info.world_size <= 1 and not require_group:
        return info
    cuda = torch.cuda.is_available()
    if backend is None:
        backend = "nccl" if cuda else "gloo"
    device_id = None
    if cuda:
        index = local_device_index(info.local_rank, torch.cuda.device_count())
        torch.cuda.set_device(index)
        if backend == "nccl":
            device_id = torch.device("cuda", index)
    _timeout_s = float(timeout_s) if timeout_s else default_timeout_s(cuda)
    timeout = timedelta(seconds=_timeout_s)
    # torch.distributed.new_group() without a timeout (DeepSpeed clones the world group for
    # ZeRO's collectives) takes c10d's module default, 30 min, not the default group's:
    # make ours the default for every group this process creates.
    c10d.default_pg_timeout = timeout
    if isinstance(getattr(c10d, "default_pg_nccl_timeout", None), timedelta):
        c10d.default_pg_nccl_timeout = timeout
    if info.world_size <= 1:
        # A private group on a free loopback port, without touching os.environ
        # (child processes must not inherit a port this process holds). DeepSpeed
        # insists on LOCAL_RANK, which alone does not make a child look distributed.
        os.environ.setdefault("LOCAL_RANK", "0")
        dist.init_process_group(
            backend=backend,
            init_method=f"tcp://127.0.0.1:{free_port()}",
            rank=0,
            world_size=1,
            timeout=timeout,
            device_id=device_id,
        )
        return info
    # env:// reads MASTER_ADDR / MASTER_PORT (SLURM does not set them); DeepSpeed
    # also reads RANK / WORLD_SIZE / LOCAL_RANK, so make them explicit.
    os.environ.setdefault("MASTER_ADDR", info.master_addr)
    os.environ.setdefault("MASTER_PORT", info.master_port)
    for key, value in (("RANK", info.rank), ("WORLD_SIZE", info.world_size), ("LOCAL_RANK", info.local_rank)):
        os.environ.setdefault(key, str(value))
    if "TORCHELASTIC_RESTART_COUNT" in os.environ:
        # torchrun keeps one TCP store for all its restarts, and every attempt's groups write
        # the same keys (each rank's address): a restarted rank would read a dead rank's
        # address from the previous attempt, fail to connect and burn the restart. A prefix
        # per attempt keeps the attempts apart.
        store, _, _ = next(dist.rendezvous("env://", info.rank, info.world_size, timeout=timeout))
        store = dist.PrefixStore(f"mmalign/attempt_{cluster.restart_count(os.environ)}/", store)
        dist.init_process_group(
            backend=backend,
            store=store,
            rank=info.rank,
            world_size=info.world_size,
            timeout=timeout,
            device_id=device_id,
        )
        return info
    dist.init_process_group(
        backend=backend,
        init_method="env://",
        rank=info.rank,
        world_size=info.world_size,
        timeout=timeout,
        device_id=device_id,
    )
    return info


# What gloo / nccl / the TCP store say when a peer is gone or silent: the process was
# killed (connection reset / closed), its host vanished or the network split (timeout).
_LOST_PEER_SIGNS = (
    "timed out",
    "timeout",
    "connection closed by peer",
    "connection reset",
    "broken pipe",
    "connection refused",
    "no route to host",
    "socket closed",
    "nccl communicator was aborted",
)


def lost_peer(exc: BaseException) -> str | None:
    """One line for a collective that failed because another rank is gone (a lost host, a
    killed process, a network partition), or None for any other error."""
    if not is_initialized() and _timeout_s is None:
        return None
    text = str(exc).strip()
    lower = text.lower()
    # a communication error (not, say, a DataLoader that "timed out"), and one that says a peer is gone
    communication = isinstance(exc, getattr(dist, "DistError", ())) or (
        isinstance(exc, RuntimeError)
        and any(k in lower for k in ("gloo", "nccl", "c10d", "processgroup", "store"))
    )
    if not communication or not any(s in lower for s in _LOST_PEER_SIGNS):
        return None
    first = text.splitlines()[0]
    limit = f"dist.timeout_s={_timeout_s:g} s" if _timeout_s else "the process-group timeout"
    return (
        f"lost contact with another rank (a host or process is gone, or the network is split; collectives "
        f"wait at most {limit}): {first[:200]}; once every host is back, relaunch with --resume latest"
    )


def shutdown() -> None:
    """Destroy the default process group, if any, and forget the slow-barrier group made from it
    (a later group in the same process must not find a stale one)."""
    global _slow_group
    if is_initialized():
        dist.destroy_process_group()
    _slow_group = None
