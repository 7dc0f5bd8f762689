"""What a training run writes about itself while it runs, behind one object.

:class:`RunLog` owns every output of the loop that is not a checkpoint: ``metrics.jsonl``
(one JSON record per ``train.log_every``, rank 0, and one per evaluation of an ``eval.during``
suite: :meth:`RunLog.eval_record`), ``samples_rank<R>.jsonl`` (the sample
keys of every step, each rank, with ``monitor.log_sample_keys``), the TensorBoard event
files (rank 0), the progress (a tqdm bar on a terminal, one readable line per record
elsewhere, an early run-time estimate) and the collapse alarms.

It is a context manager: entering it truncates the jsonl files of a resumed run to the
checkpoint's step and opens them; leaving it closes every handle, however the loop ends
(its last step, an exception, or ``SystemExit`` from SIGTERM).
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import IO, Any, Literal

from tqdm import tqdm

from mmalign import progress
from mmalign.errors import UsageError, first_line
from mmalign.extras import extra

# the run's lines: train.log names them mmalign.run.train, whichever module of the run writes them
log = logging.getLogger("mmalign.run.train")


WARMUP_STEPS = 1  # the first step carries the set-up (loader workers, first allocations): never extrapolated
TIMED_STEPS = 2  # steps after the warm-up before any ETA ("warming up" until then)


def say(line: str) -> None:
    """A start-up phase or a run event: one line on stdout and in train.log (rank 0 calls it)."""
    print(f"mmalign: {line}", flush=True)
    log.info("%s", line)


def truncate_jsonl(path: Path, last_step: int) -> None:
    """On resume, drop records of steps after the checkpoint (they will be redone), and a
    line torn by a kill mid-write."""
    if not path.is_file():
        return
    keep = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            record = json.loads(line)
        except ValueError:
            continue  # a torn (partly written) line
        if isinstance(record, dict) and isinstance(record.get("step"), int) and record["step"] <= last_step:
            keep.append(line)
    path.write_text("".join(line + "\n" for line in keep))


class RunLog:
    """The loop's outputs from step ``start + 1`` to ``steps`` in the run directory ``out``.

    Rank 0 (``main``) writes the metrics, TensorBoard and progress; every rank its own
    sample keys (``sample_keys``). ``show_progress``: a bar on a terminal, else plain lines.
    """

    def __init__(
        self,
        out: str | Path,
        rank: int,
        start: int,
        steps: int,
        log_every: int,
        *,
        sample_keys: bool = False,
        tensorboard: bool = False,
        show_progress: bool = True,
        clock=time.time,
    ):
        self.out, self.start, self.steps, self.log_every = Path(out), start, steps, log_every
        self.clock = clock  # seconds; a test passes a fake one
        self.main = rank == 0
        self.keys_path = self.out / f"samples_rank{rank}.jsonl" if sample_keys else None
        self.tensorboard = tensorboard and self.main
        # a bar only on a terminal of known, non-zero width; else one line per record
        self.use_bar = show_progress and self.main and progress.use_bar()
        self.lines = show_progress and self.main and not self.use_bar
        self.first_written = False  # the first record of this log carries the run's ``once`` fields
        self.metrics_file: IO[str] | None = None
        self.keys_file: IO[str] | None = None
        self.board: Any = None  # TensorBoard's SummaryWriter (imported when used)
        self.bar: tqdm | None = None
        self.loop_start, self.estimated = clock(), False
        self.warm_at: float | None = None  # when the warm-up steps ended (the ETA's rate starts there)

    # ---------------------------------------------------------- open / close

    def __enter__(self) -> RunLog:
        try:
            self._open()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> Literal[False]:
        self.close()
        return False

    def _open(self) -> None:
        metrics = self.out / "metrics.jsonl"
        if self.main:
            truncate_jsonl(metrics, self.start)
        if self.keys_path is not None:
            if self.start:
                truncate_jsonl(self.keys_path, self.start)
            else:
                self.keys_path.unlink(missing_ok=True)
        if self.main:
            self.metrics_file = metrics.open("a" if self.start else "w")
        if self.keys_path is not None:
            self.keys_file = self.keys_path.open("a")
        if self.tensorboard:
            self.board = _tensorboard(self.out)
        self.bar = tqdm(
            total=self.steps, initial=self.start, desc="train", disable=not self.use_bar, dynamic_ncols=True
        )
        self.loop_start = self.clock()

    def end_loop(self) -> None:
        """The loop is over: the bar and the jsonl files close (TensorBoard stays open for the
        final evaluation). Safe to call again."""
        bar, self.bar = self.bar, None
        files, self.metrics_file, self.keys_file = (self.metrics_file, self.keys_file), None, None
        try:
            if bar is not None:
                bar.close()
        finally:
            for f in files:
                if f is not None:
                    f.close()

    def close(self) -> None:
        """Every handle closed; safe to call again."""
        try:
            self.end_loop()
        finally:
            board, self.board = self.board, None
            if board is not None:
                board.close()

    # ---------------------------------------------------------------- writes

    def sample_keys(self, step: int, keys: list) -> None:
        """This rank's sample keys of ``step`` (with ``monitor.log_sample_keys``)."""
        if self.keys_file is not None:
            self.keys_file.write(json.dumps({"step": step, "keys": keys}) + "\n")
            self.keys_file.flush()

    def progress(self, step: int) -> float | None:
        """After ``step``: the estimated seconds left, or None while warming up (the first
        :data:`WARMUP_STEPS` steps carry the set-up and are never extrapolated; the rate is
        that of the :data:`TIMED_STEPS` or more steps after them). Once, when the first
        estimate exists and a record is due (or 10 s have passed), rank 0 says it in one line."""
        now, done = self.clock(), step - self.start
        if self.warm_at is None and done >= WARMUP_STEPS:
            self.warm_at = now
        if step >= self.steps:
            return 0.0
        timed = done - WARMUP_STEPS
        if timed < TIMED_STEPS:
            return None
        per_step = (now - self.warm_at) / timed
        eta = per_step * (self.steps - step)
        if self.main and not self.estimated and (step % self.log_every == 0 or now - self.loop_start >= 10):
            self.estimated = True
            warm = self.warm_at - self.loop_start
            say(
                f"first {done} step(s): {per_step:.2f} s/step after {WARMUP_STEPS} warm-up step(s) of "
                f"{progress.duration(warm)}, estimated training time "
                f"{progress.duration(warm + per_step * (self.steps - self.start - WARMUP_STEPS))} "
                f"(ETA {progress.duration(eta)})"
            )
        return eta

    def record(
        self,
        step: int,
        record: dict,
        eta: float | None,
        alarms: list[str] | tuple[str, ...] = (),
        once: dict | None = None,
    ) -> None:
        """Rank 0: the collapse alarms, the record in metrics.jsonl and TensorBoard, and one
        readable line in train.log (and on stdout off a terminal, or the bar's postfix).
        ``once``: fields that only the first record of this log carries (e.g. the parameter
        counts, :mod:`mmalign.run.trainable`)."""
        if not self.main:
            return
        assert self.bar is not None and self.metrics_file is not None  # opened by __enter__
        if once and not self.first_written:
            record = {**record, **once}
        self.first_written = True
        for alarm in alarms:
            log.warning("COLLAPSE ALARM at step %d: %s", step, alarm)
            self.bar.write(f"mmalign: COLLAPSE ALARM at step {step}: {alarm}")
        self.metrics_file.write(json.dumps(record) + "\n")
        self.metrics_file.flush()
        if self.board is not None:
            for k, v in record.items():
                if k != "step" and isinstance(v, (int, float)):  # scalars only (a tower's state is a word)
                    self.board.add_scalar(k, v, step)
        line = progress.train_line(step, self.steps, record, eta) + _throughput(record)
        log.info("%s", line)  # readable; the full record is in metrics.jsonl
        if self.lines:
            print(line, flush=True)
        self.bar.set_postfix(
            loss=f"{record['loss']:.3f}",
            scale=f"{record.get('logit_scale', 0):.1f}",
            sps=f"{record['samples_per_s']:.0f}",
        )

    def advance(self) -> None:
        assert self.bar is not None  # opened by __enter__
        self.bar.update(1)

    def evaluation(self, records: list[dict], step: int, hparams: dict | None = None) -> None:
        """Rank 0: ``eval/<suite>/<task>/<metric>`` scalars in TensorBoard; with ``hparams``
        (the run's config), TensorBoard's HPARAMS entry against these final metrics."""
        if self.board is not None:
            _board_eval(self.board, records, step, hparams)

    def eval_record(self, step: int, suite: str, records: list[dict]) -> None:
        """Rank 0: one suite's evaluation at ``step`` as a metrics.jsonl record, its metrics
        under their TensorBoard names, ``{"step", "eval": suite, "images", "eval/...": value}``,
        and one line in train.log. After the loop (the final evaluation) it is appended."""
        if not self.main:
            return
        images = max((int(r.get("n_images") or 0) for r in records), default=0)
        record = {"step": step, "eval": suite, "images": images, **eval_scalars(records)}
        if self.metrics_file is not None:
            self.metrics_file.write(json.dumps(record) + "\n")
            self.metrics_file.flush()
        else:
            with (self.out / "metrics.jsonl").open("a") as f:
                f.write(json.dumps(record) + "\n")
        top1 = [
            f"{r['dataset']} top-1 {100 * r['metrics']['acc1']:.1f}%"
            for r in records
            if isinstance((r.get("metrics") or {}).get("acc1"), (int, float))
        ]
        line = f"step {step}: eval {suite} on {images} images" + (f": {', '.join(top1)}" if top1 else "")
        log.info("%s", line)
        if self.lines:
            print(line, flush=True)

    def elapsed(self) -> float:
        """Seconds since the loop started."""
        return self.clock() - self.loop_start


def _throughput(record: dict) -> str:
    """The model FLOP rate for the readable line: GFLOP/s on a CPU (the record's ``gflops``: no
    peak is known there), else TFLOP/s; then MFU where a peak is known. Empty without a rate."""
    if "gflops" in record:
        rate = f"  GFLOP/s {_figure(record['gflops'])}"
    elif "tflops" in record:
        rate = f"  TFLOP/s {_figure(record['tflops'])}"
    else:
        return ""
    return rate + (f"  MFU {100 * record['mfu']:.1f}%" if record.get("mfu") is not None else "")


def _figure(value: float) -> str:
    # one decimal, but three below 1 (a unit-test tower's 0.042 GFLOP/s is not "0.0")
    return f"{value:.1f}" if abs(value) >= 1 else f"{value:.3f}"


def _tensorboard(out: Path):
    try:
        with extra("report", "monitor.tensorboard"):
            from torch.utils.tensorboard import SummaryWriter
    except (UsageError, ImportError) as e:  # degrade rather than die mid-run: the run itself is fine
        log.warning("%s; no event files", first_line(e))
        return None
    return SummaryWriter(str(out / "tensorboard"))


def eval_scalars(records: list[dict]) -> dict[str, float]:
    """An evaluation's numeric metrics by their one name, ``eval/<suite>/<task>/<metric>``
    (a record's ``dataset`` is ``<suite>/<task>``): TensorBoard's tags and metrics.jsonl's keys."""
    return {
        f"eval/{r['dataset']}/{k}": float(v)
        for r in records
        for k, v in r["metrics"].items()
        if isinstance(v, (int, float)) and not isinstance(v, bool)
    }


def _board_eval(board, records: list[dict], step: int, hparams: dict | None = None) -> None:
    """``eval/<suite>/<task>/<metric>`` scalars; with ``hparams``, TensorBoard's HPARAMS entry
    (the flattened config against the final metrics, tagged ``hparam/...``)."""
    metrics = {tag[len("eval/") :]: v for tag, v in eval_scalars(records).items()}
    for k, v in metrics.items():
        board.add_scalar(f"eval/{k}", v, step)
    if hparams is not None:
        flat, todo = {}, [("", hparams)]
        while todo:
            prefix, d = todo.pop()
            for k, v in d.items():
                if isinstance(v, dict):
                    todo.append((f"{prefix}{k}.", v))
                else:  # HPARAMS takes numbers, strings and bools only
                    flat[prefix + k] = v if isinstance(v, (int, float, str, bool)) else str(v)
        board.add_hparams(
            flat, {f"hparam/{k}": v for k, v in metrics.items()}, run_name=".", global_step=step
        )
