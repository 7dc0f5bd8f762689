"""The one line a run prints when a signal stops it.

SIGTERM (a scheduler's time limit, ``kill``, a preemption) and SIGINT (Ctrl-C) both unwind
the run (``finally`` blocks run, the data workers stop); rank 0 then says, on stderr and in
``train.log``, which signal stopped it, at which step, which checkpoint is the last good
one, and the command that continues the run::

    mmalign: stopped by SIGTERM at step 37 of 100; last checkpoint runs/x/checkpoints/step_00000030;
    resume with: mmalign train --config x.yaml --resume latest

The exit status stays the shell's convention: 128 + the signal's number (143, 130).
"""

from __future__ import annotations

import contextlib
import logging
import shlex
import signal
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

log = logging.getLogger("mmalign.run.train")

# The loop's frame, read from the traceback the signal's exception carries: where the run
# stopped is in its locals (the config, the step in progress), with no bookkeeping on the
# hot path of every step.
_LOOP = ("mmalign.run.train", "_train")
# flags of the interrupted command line that must not be given again: --overwrite would delete
# the checkpoint, an explicit --resume PATH would rewind the run to it
_DROPPED = {"--overwrite": 0, "--resume": 1, "--local_rank": 1, "--local-rank": 1}


# The signal the handler last raised, until the run has stopped (clear()). Python runs a
# handler wherever the main thread is, finalizers included (a __del__ of torch's shared-memory
# bookkeeping runs for every batch a DataLoader worker sends), and an exception raised there is
# printed as "Exception ignored" and dropped: the run trained on as if never signalled.
_caught: int | None = None


class Terminated(SystemExit):
    """SIGTERM, raised in the main thread so that the run unwinds as Ctrl-C does."""

    def __init__(self, signum: int = signal.SIGTERM):
        super().__init__(128 + signum)


def _exception(signum: int) -> BaseException:
    return KeyboardInterrupt() if signum == signal.SIGINT else Terminated(signum)


def raise_terminated(signum, frame) -> None:
    """The SIGTERM (and SIGINT) handler of a run (main thread only): the signal is recorded for
    :func:`check`, then its exception raised here."""
    global _caught
    _caught = signum
    raise _exception(signum)


def check() -> None:
    """Raise the exception of a signal whose first one was dropped by a finalizer; called at
    every step, so that a run signalled stops within a step whatever the handler interrupted."""
    if _caught is not None:
        raise _exception(_caught)


def clear() -> None:
    """Forget the recorded signal (a run's end: the next run in this process starts afresh)."""
    global _caught
    _caught = None


@contextlib.contextmanager
def deferred() -> Iterator[None]:
    """SIGTERM and SIGINT held until the block ends (a checkpoint save): raised inside torch's
    writer, the signal's exception came out as a failed write ("unexpected pos") and stopped
    the run as a full disk would, exit 1 with the save removed. Held, the save completes and
    the signal then stops the run as it would anywhere else. Main thread only (elsewhere no
    handler can be installed, and nothing changes)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held: list[int] = []
    previous = {
        sig: signal.signal(sig, lambda signum, frame: held.append(signum))
        for sig in (signal.SIGTERM, signal.SIGINT)
    }
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    if held:  # the first signal that came, through the handler that was in place before
        handler = previous[signal.Signals(held[0])]
        if callable(handler):
            handler(held[0], None)
        elif handler == signal.SIG_DFL:
            signal.raise_signal(held[0])


def where_stopped(error: BaseException) -> tuple[object | None, int | None]:
    """(the run's Config, the step in progress) from the frames ``error`` unwound; None for
    what is not known (a signal before the loop has no step)."""
    tb = error.__traceback__
    while tb is not None:
        frame = tb.tb_frame
        if (frame.f_globals.get("__name__"), frame.f_code.co_name) == _LOOP:
            return frame.f_locals.get("cfg"), frame.f_locals.get("step")
        tb = tb.tb_next
    return None, None


def resume_command(argv: list[str], cfg) -> str:
    """The interrupted ``mmalign train`` line with ``--resume latest`` in place of ``--overwrite``
    / ``--resume PATH``; for a run started from Python, the same through its ``config.yaml``."""
    args = list(argv[1:])
    if not args or args[0] != "train":
        return shlex.join(
            ["mmalign", "train", "--config", str(Path(cfg.output) / "config.yaml"), "--resume", "latest"]
        )
    kept, skip = [], 0
    for arg in args:
        name, given = arg.partition("=")[0], "=" in arg
        # argparse also takes an unambiguous prefix (--overw); --o alone is ambiguous (--output)
        dropped = [f for f in _DROPPED if name.startswith("--") and len(name) > 3 and f.startswith(name)]
        if skip:
            skip -= 1
        elif dropped:
            skip = 0 if given else _DROPPED[dropped[0]]
        else:
            kept.append(arg)
    return shlex.join(["mmalign", *kept, "--resume", "latest"])


def stop_line(signame: str, cfg, step: int | None, argv: list[str], world: int = 1) -> str:
    """The one line for a run that ``signame`` stopped (``cfg`` None: nothing is known of it)."""
    from mmalign.errors import UserError
    from mmalign.run import checkpoint

    if cfg is None:
        return f"mmalign: stopped by {signame}"
    where = f"at step {step} of {cfg.train.steps}" if step is not None else "before its first step"
    try:
        last = checkpoint.resolve(cfg.output, "latest")
    except UserError:  # a pointer edited by hand: resume says so itself
        last = None
    if last is not None:
        saved = f"last checkpoint {last}"
    else:
        saved = (
            "no checkpoint saved yet"
            + (" (train.checkpoint_every is 0)" if not cfg.train.checkpoint_every else "")
            + ", so it starts again from step 0"
        )
    launcher = f" (under the launcher of its {world} ranks)" if world > 1 else ""
    verb = "resume" if last is not None else "restart"
    return (
        f"mmalign: stopped by {signame} {where}; {saved}; {verb} with: {resume_command(argv, cfg)}{launcher}"
    )


def report(error: BaseException, rank: int, world: int, argv: list[str] | None = None) -> None:
    """Rank 0 prints (stderr) and logs the line for ``error`` (:class:`Terminated` or
    ``KeyboardInterrupt``); every rank marks it ``reported``, so the CLI adds nothing."""
    error.reported = True  # type: ignore[attr-defined]  # a mark the CLI reads (mmalign/cli.py)
    if rank != 0:
        return
    signame = "SIGTERM" if isinstance(error, Terminated) else "SIGINT"
    try:
        cfg, step = where_stopped(error)
        line = stop_line(signame, cfg, step, sys.argv if argv is None else argv, world)
    except Exception as e:  # noqa: BLE001 - the run is already stopping: say less, never mask the signal
        line = f"mmalign: stopped by {signame} ({type(e).__name__} while describing where)"
    print(line, file=sys.stderr, flush=True)
    log.warning("%s", line)
