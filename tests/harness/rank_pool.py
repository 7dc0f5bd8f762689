"""A session-wide pool of long-lived rank processes for the multi-rank tests.

Starting a rank costs seconds (a Python interpreter, then torch, DeepSpeed and mmalign imports),
more than most rank tasks themselves. :func:`run` hands ``worker(rank, world, *args)`` to the
first ``world`` of :data:`SIZE` processes that stay up for the whole session (spawned on first use,
closed by the session fixture in conftest), with the semantics of a fresh launch:

- before a task: the caller's environment and working directory, RANK / WORLD_SIZE / LOCAL_RANK /
  MASTER_ADDR and a free loopback MASTER_PORT, one torch thread, this process's start-up seeds, and the
  gloo group of the task's own world size (none for one rank, as a launcher would leave it);
- after it: the group destroyed, DeepSpeed's references to it released, and what a task could
  leave behind put back as the process had it after its imports (see :class:`_ProcessState`).

A rank that raises fails the test with that rank's traceback; a rank that dies, or a task that
outlives its timeout, fails it with the ranks concerned. Either way the pool is killed and the next
task gets a fresh one: a rank that failed may hold a half-torn group or a peer stuck in a
collective, which no reset can vouch for.
"""

from __future__ import annotations

import functools
import gc
import io
import logging
import multiprocessing as mp
import multiprocessing.connection as mpc
import os
import pickle
import random
import signal
import sys
import time
import traceback
import warnings

import numpy as np
import torch

SIZE = 2  # ranks in the pool: the tests' largest world size
START_TIMEOUT_S = 300.0  # interpreter plus imports on a busy 2-core machine
# Imported by every rank before it reports ready: the start-up cost paid once, and the module state
# that _ProcessState records is the state right after these imports.
PRELOAD = (
    "deepspeed",
    "mmalign.run.engine",
    "mmalign.run.train",
    "mmalign.evaluation.sharded",
    "tests.harness",
)

_pool: RankPool | None = None


def run(worker, world: int, args: tuple, timeout_s: float) -> list:
    """``worker(rank, world, *args)`` on ranks 0..world-1 of the session's pool: what each returned,
    in rank order. ``worker`` and ``args`` must pickle (a module-level function of a test file)."""
    global _pool
    if not 1 <= world <= SIZE:
        raise ValueError(f"the rank pool has {SIZE} ranks, not enough for world size {world}")
    if _pool is None or not _pool.alive():
        close()
        _pool = RankPool(SIZE)
    try:
        return _pool.run(worker, world, args, timeout_s)
    except BaseException:
        close()  # replaced, never reused after a failure (see the module doc)
        raise


def pids() -> list[int]:
    """The process ids of the current pool's ranks ([] when none is up)."""
    return [] if _pool is None else [p.pid for p in _pool.procs]


def close() -> None:
    """End the session's pool, if one is up."""
    global _pool
    if _pool is not None:
        _pool.close()
        _pool = None


class RankPool:
    """``size`` spawned rank processes, each serving tasks over its own pipe."""

    def __init__(self, size: int):
        ctx = mp.get_context("spawn")
        self.procs, self.conns = [], []
        for index in range(size):
            parent, child = ctx.Pipe()
            proc = ctx.Process(target=_serve, args=(child, index), name=f"rank-pool-{index}", daemon=True)
            proc.start()
            child.close()
            self.procs.append(proc)
            self.conns.append(parent)
        try:
            self._collect(range(size), START_TIMEOUT_S, "starting the pool")
        except BaseException:
            self.kill()
            raise

    def alive(self) -> bool:
        return all(p.is_alive() for p in self.procs)

    def run(self, worker, world: int, args: tuple, timeout_s: float) -> list:
        from mmalign.dist.distributed import free_port

        # Pickled here, before anything is sent: a task that does not pickle fails in the test's own
        # process and no rank starts it alone.
        env, cwd, port = dict(os.environ), os.getcwd(), int(free_port())
        tasks = [pickle.dumps((worker, rank, world, port, args, env, cwd)) for rank in range(world)]
        for conn, task in zip(self.conns, tasks):
            conn.send_bytes(task)
        return self._collect(range(world), timeout_s, "running the task")

    def _collect(self, ranks, limit_s: float, phase: str) -> list:
        """Each rank's reply, in rank order; the first error, death or ``limit_s`` raises."""
        pending, replies, deadline = set(ranks), {}, time.monotonic() + limit_s
        while pending:
            waiting = {self.conns[r]: r for r in pending} | {self.procs[r].sentinel: r for r in pending}
            ready = mpc.wait(list(waiting), timeout=max(0.0, deadline - time.monotonic()))
            if not ready:
                raise AssertionError(
                    f"ranks {sorted(pending)} still {phase} after {limit_s:.0f} s: stopped, "
                    "the pool is replaced"
                )
            for r in sorted({waiting[obj] for obj in ready}):
                try:
                    kind, body = pickle.loads(self.conns[r].recv_bytes())
                except (EOFError, OSError):
                    self.procs[r].join(5)
                    raise AssertionError(
                        f"rank {r} died {phase} (exit code {self.procs[r].exitcode}): the pool is replaced"
                    ) from None
                if kind == "error":
                    raise AssertionError(f"rank {r} raised:\n{body}")
                replies[r] = body
                pending.discard(r)
        return [
            None if replies[r] is None else torch.load(io.BytesIO(replies[r]), weights_only=False)
            for r in sorted(replies)
        ]

    def close(self) -> None:
        for conn in self.conns:
            try:
                conn.send_bytes(pickle.dumps(None))
            except OSError:
                pass
        for proc in self.procs:
            proc.join(10)
        self.kill()

    def kill(self) -> None:
        for proc in self.procs:
            if proc.is_alive():
                proc.kill()
            proc.join()
        for conn in self.conns:
            conn.close()


def _serve(conn, index: int) -> None:
    """A pool rank's main: import once, then run tasks until told to stop (a None task)."""
    import importlib

    torch.set_num_threads(1)
    try:
        for name in PRELOAD:
            try:
                importlib.import_module(name)
            except ModuleNotFoundError as e:
                if (
                    e.name != name
                ):  # a module that moved is only not preloaded; a missing dependency is an error
                    raise
        state = _ProcessState()
    except BaseException:
        conn.send_bytes(pickle.dumps(("error", traceback.format_exc())))
        return
    conn.send_bytes(pickle.dumps(("ready", None)))
    while True:
        task = pickle.loads(conn.recv_bytes())
        if task is None:
            return
        try:
            reply = ("ok", _run_task(*task))
            state.restore()
        except BaseException:
            # reported at once, without tearing the group down: a peer may be stuck in a collective,
            # and the parent kills this pool anyway
            reply = ("error", traceback.format_exc())
        conn.send_bytes(pickle.dumps(reply))


def _run_task(worker, rank: int, world: int, port: int, args: tuple, env: dict, cwd: str) -> bytes | None:
    """One task on one rank, set up as run_ranks' fresh ranks are; its result as torch.save bytes."""
    from mmalign.dist import distributed as mdist

    os.environ.clear()
    os.environ.update(
        env,
        RANK=str(rank),
        WORLD_SIZE=str(world),
        LOCAL_RANK=str(rank),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    os.chdir(cwd)
    mdist.init_from_env(backend="gloo")
    result = worker(rank, world, *args)
    buffer = io.BytesIO()
    torch.save(result, buffer)
    if mdist.is_initialized():
        mdist.barrier()  # no rank leaves the group while another still uses it
    _destroy_groups()
    return buffer.getvalue()


def _destroy_groups() -> None:
    """The default group and every group made from it, on torch's side and DeepSpeed's."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return
    ds_comm = sys.modules.get("deepspeed.comm.comm")
    if ds_comm is not None and ds_comm.cdb is not None:
        ds_comm.destroy_process_group()  # also drops DeepSpeed's cached data-parallel / world groups
    else:
        dist.destroy_process_group()


# Torch's namespaces that DeepSpeed's ZeRO-3 rebinds (F.linear for the rest of the process; the
# tensor constructors, Tensor.__new__ and Module's hooks inside zero.Init) and that tests patch.
_PATCHED_NAMESPACES = (torch, torch.nn.functional, torch.Tensor, torch.nn.Module)
# Packages whose module globals are put back after a task: mmalign's run state (its slow-barrier
# group, the group's timeout, the evaluation timer), torch.distributed's defaults that
# init_from_env sets, and DeepSpeed's communication backend and group caches.
_STATEFUL_PACKAGES = ("mmalign", "deepspeed", "torch.distributed")
_SIGNALS = tuple(
    s for s in (signal.SIGTERM, signal.SIGINT, getattr(signal, "SIGUSR1", None)) if s is not None
)


class _ProcessState:
    """What a task can change in its process, recorded after the imports and put back after each
    task: that is the state a freshly started rank begins in."""

    def __init__(self):
        self.seed = torch.initial_seed()  # drawn by torch at start-up (a fresh rank's is random too)
        self.namespaces = [(ns, dict(vars(ns))) for ns in _PATCHED_NAMESPACES]
        self.globals = {
            name: dict(vars(mod))
            for name, mod in list(sys.modules.items())
            if mod is not None and any(name == p or name.startswith(p + ".") for p in _STATEFUL_PACKAGES)
        }
        self.class_state = _class_state()
        self.loggers = {name: _logger_state(lg) for name, lg in _all_loggers()}
        self.log_disable = logging.root.manager.disable
        self.warning_filters = list(warnings.filters)
        self.handlers = {s: signal.getsignal(s) for s in _SIGNALS}
        self.flags = [(get, set_, get()) for get, set_ in _torch_flags()]
        self.autocast = {d: torch.get_autocast_dtype(d) for d in ("cpu", "cuda")}

    def restore(self) -> None:
        warnings.filters[:] = self.warning_filters  # first: a task's "error" filter must not fire below
        for ns, saved in self.namespaces:
            for name, value in saved.items():
                if vars(ns).get(name, _MISSING) is not value:
                    setattr(ns, name, value)
        for name, saved in self.globals.items():
            mod = sys.modules.get(name)
            if mod is None:
                continue
            for value in list(vars(mod).values()):
                # type(), not isinstance(): some module globals are deprecation proxies that warn on
                # any attribute read, __class__ included
                if type(value) is functools._lru_cache_wrapper:
                    value.cache_clear()  # DeepSpeed's warn-once / log-once memory
            current = vars(mod)
            for key, value in saved.items():
                if current.get(key, _MISSING) is not value:
                    current[key] = value
        for cls, key, value in self.class_state:
            if isinstance(value, list):
                getattr(cls, key).__defaults__[0][:] = value  # see _class_state
            else:
                setattr(cls, key, value)
        for name, lg in _all_loggers():
            _set_logger_state(lg, self.loggers.get(name, (logging.NOTSET, [], True, False)))
        logging.disable(self.log_disable)
        for s, handler in self.handlers.items():
            if handler is not None:
                signal.signal(s, handler)
        for _, set_, value in self.flags:
            set_(value)
        for device, dtype in self.autocast.items():
            torch.set_autocast_enabled(device, False)
            torch.set_autocast_dtype(device, dtype)
        torch.clear_autocast_cache()
        torch.set_grad_enabled(True)
        torch.set_default_dtype(torch.float32)
        torch.set_num_threads(1)
        if "torch._dynamo" in sys.modules:
            torch._dynamo.reset()  # compiled frames and their guards
        random.seed(0)
        np.random.seed(0)
        torch.manual_seed(self.seed)
        gc.collect()


_MISSING = object()
_SCALARS = (int, float, bool, str, type(None))


def _class_state() -> list:
    """DeepSpeed's process-wide counters that live on its classes: scalar class attributes (ZeRO-3's
    ``Init.param_id`` and persistence totals) and the list in a method's default argument (ZeRO-3
    numbers its modules with ``_register_deepspeed_module(module, count=[0])``). Left as a task left
    them, two ranks that ran different tasks before would number one model differently, and ZeRO-3
    refuses the disagreement. (cls, name, value) each; a list value is the first default's contents."""
    found = []
    for name, mod in list(sys.modules.items()):
        if mod is None or not name.startswith("deepspeed."):
            continue
        for cls in list(vars(mod).values()):
            if not isinstance(cls, type) or cls.__module__ != name:
                continue
            for key, value in list(vars(cls).items()):
                if key.startswith("__"):
                    continue
                if type(value) in _SCALARS:
                    found.append((cls, key, value))
                elif (
                    callable(value)
                    and isinstance(getattr(value, "__defaults__", None), tuple)
                    and value.__defaults__
                    and type(value.__defaults__[0]) is list
                ):
                    found.append((cls, key, list(value.__defaults__[0])))
    return found


def _all_loggers():
    yield "", logging.root
    for name, lg in list(logging.root.manager.loggerDict.items()):
        if isinstance(lg, logging.Logger):
            yield name, lg


def _logger_state(lg: logging.Logger) -> tuple:
    return lg.level, list(lg.handlers), lg.propagate, lg.disabled


def _set_logger_state(lg: logging.Logger, state: tuple) -> None:
    lg.setLevel(state[0])
    lg.handlers[:] = state[1]
    lg.propagate, lg.disabled = state[2], state[3]


def _torch_flags():
    """(getter, setter) of torch's process-wide numeric switches."""
    cudnn, matmul = torch.backends.cudnn, torch.backends.cuda.matmul
    flags = [
        (torch.are_deterministic_algorithms_enabled, torch.use_deterministic_algorithms),
        (torch.get_float32_matmul_precision, torch.set_float32_matmul_precision),
        (torch.is_anomaly_enabled, torch.set_anomaly_enabled),
        (lambda: cudnn.deterministic, lambda v: setattr(cudnn, "deterministic", v)),
        (lambda: cudnn.benchmark, lambda v: setattr(cudnn, "benchmark", v)),
    ]
    if hasattr(matmul, "fp32_precision"):  # torch 2.9+; the legacy allow_tf32 flags refuse to mix with it
        flags.append((lambda: matmul.fp32_precision, lambda v: setattr(matmul, "fp32_precision", v)))
    return flags
