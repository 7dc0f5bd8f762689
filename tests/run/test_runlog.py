"""The run log (mmalign.run.runlog): what a training run writes while it runs (metrics.jsonl,
the per-rank sample keys, TensorBoard, readable lines, collapse alarms, the resume
truncation), and that every file it opens is closed however the loop ends: its last step,
an exception, or SystemExit (SIGTERM)."""

from __future__ import annotations

import json
import logging
import os
import signal
from pathlib import Path

import pytest

from mmalign.config import load_config
from mmalign.run import runlog
from mmalign.run.runlog import RunLog


def _open_files_under(path: Path) -> list[str]:
    """This process's open file descriptors that point into ``path`` (Linux /proc)."""
    found = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # closed meanwhile (the listing's own descriptor)
            continue
        if target.startswith(str(path.resolve())):
            found.append(target)
    return sorted(found)


def _record(step: int) -> dict:
    return {
        "step": step,
        "loss": 2.5,
        "lr": 1e-3,
        "logit_scale": 14.0,
        "samples_per_s": 64.0,
        "skipped_steps": 0,
    }


def _steps(path: Path) -> list[int]:
    return [json.loads(line)["step"] for line in path.read_text().splitlines()]


def test_records_keys_lines_alarms_and_the_resume_truncation(tmp_path, capsys, caplog):
    metrics, keys = tmp_path / "metrics.jsonl", tmp_path / "samples_rank0.jsonl"
    with RunLog(tmp_path, 0, 0, 6, 2, sample_keys=True, show_progress=True) as log:
        for step in range(1, 5):
            log.sample_keys(step, [f"k{step}"])
            if step % 2 == 0:
                log.record(
                    step, _record(step), eta=3.0, alarms=["text embeddings collapsing"] if step == 4 else []
                )
    assert _steps(metrics) == [2, 4] and _steps(keys) == [1, 2, 3, 4]
    assert json.loads(metrics.read_text().splitlines()[0]) == _record(2)
    printed = [line for line in capsys.readouterr().out.splitlines() if line.startswith("step ")]
    assert printed == [
        "step 2/6 ( 33%)  loss 2.5000  lr 1.000e-03  scale 14.00  samples/s 64.0  ETA 0:00:03",
        "step 4/6 ( 67%)  loss 2.5000  lr 1.000e-03  scale 14.00  samples/s 64.0  ETA 0:00:03",
    ]
    assert [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING] == [
        "COLLAPSE ALARM at step 4: text embeddings collapsing"
    ]

    # a kill tore the last lines; a resume from step 2 drops them and the records after step 2
    for path in (metrics, keys):
        path.write_text(path.read_text() + '{"step": 5, "lo')
    with RunLog(tmp_path, 0, 2, 6, 2, sample_keys=True, show_progress=False) as log:
        assert _steps(metrics) == [2] and _steps(keys) == [1, 2]
        log.sample_keys(3, ["again"])
        log.record(4, _record(4), eta=1.0)
    assert _steps(metrics) == [2, 4] and _steps(keys) == [1, 2, 3]
    assert capsys.readouterr().out == ""  # show_progress off: no lines

    # another rank writes its own keys and nothing else; a fresh start (step 0) starts them over
    other = tmp_path / "samples_rank1.jsonl"
    other.write_text('{"step": 9, "keys": []}\n')
    with RunLog(tmp_path, 1, 0, 6, 2, sample_keys=True, tensorboard=True) as log:
        log.sample_keys(1, ["r1"])
        log.record(2, _record(2), eta=1.0)  # rank 0's job: nothing here
    assert _steps(other) == [1] and _steps(metrics) == [2, 4] and not (tmp_path / "tensorboard").exists()


@pytest.mark.parametrize(
    "exc", [RuntimeError("a step failed"), SystemExit(128 + signal.SIGTERM)], ids=["exception", "sigterm"]
)
def test_every_file_is_closed_when_the_loop_raises(tmp_path, exc):
    with pytest.raises(type(exc)):
        with RunLog(tmp_path, 0, 0, 4, 1, sample_keys=True, tensorboard=True, show_progress=False) as log:
            log.sample_keys(1, ["a"])
            log.record(1, _record(1), eta=0.0)
            board = log.board
            board.flush()  # its writer thread opens the event file per write: none under way now
            assert [Path(p).name for p in _open_files_under(tmp_path)] == [
                "metrics.jsonl",
                "samples_rank0.jsonl",
            ]
            assert board is not None and board.all_writers  # the premise: all were open
            raise exc
    assert _open_files_under(tmp_path) == []
    assert board.all_writers is None  # TensorBoard's writer is closed (it opens its event file per flush)
    assert _steps(tmp_path / "metrics.jsonl") == [1]  # written before the failure, and kept


def test_every_file_is_closed_at_the_normal_end(tmp_path):
    with RunLog(tmp_path, 0, 0, 2, 1, tensorboard=True, show_progress=False) as log:
        log.record(1, _record(1), eta=0.0)
        board = log.board
        board.flush()  # as above: no event-file write under way while the files are listed
        assert len(_open_files_under(tmp_path)) == 1  # metrics.jsonl (no sample keys asked)
        log.end_loop()  # the jsonl files close with the loop; TensorBoard stays for the final evaluation
        assert _open_files_under(tmp_path) == [] and board.all_writers
        log.evaluation(
            [{"dataset": "shapes/shape", "metrics": {"acc1": 0.5}}], 2, hparams={"train": {"steps": 2}}
        )
    assert _open_files_under(tmp_path) == [] and board.all_writers is None


@pytest.mark.integration
@pytest.mark.parametrize("how", ["exception", "sigterm"])
def test_a_run_that_stops_mid_loop_leaves_no_file_open(micro_overrides, monkeypatch, how):
    """The real loop: a step fails (an exception), or SIGTERM arrives (SystemExit from the
    run's handler), at step 3: metrics, sample keys and TensorBoard are all closed."""
    import mmalign.run.train as train_mod

    real = train_mod._train_step

    def failing(p, step, *args):
        if step == 3:
            if how == "sigterm":
                os.kill(os.getpid(), signal.SIGTERM)  # the run's handler raises SystemExit(143) here
            raise RuntimeError("a step failed")
        return real(p, step, *args)

    monkeypatch.setattr(train_mod, "_train_step", failing)
    boards = []
    make_board = runlog._tensorboard
    monkeypatch.setattr(runlog, "_tensorboard", lambda out: boards.append(make_board(out)) or boards[-1])
    cfg = load_config(
        None,
        micro_overrides
        + ["train.steps=6", "monitor.probe_size=0", "monitor.log_sample_keys=true", "eval.suite=none"],
    )
    with pytest.raises(SystemExit if how == "sigterm" else RuntimeError) as stopped:
        train_mod.train(cfg, show_progress=False)
    if how == "sigterm":
        assert stopped.value.code == 128 + signal.SIGTERM
    out = Path(cfg.output)
    assert _steps(out / "metrics.jsonl") == [1, 2] and _steps(out / "samples_rank0.jsonl") == [1, 2]
    assert len(boards) == 1 and boards[0].all_writers is None and list((out / "tensorboard").glob("events.*"))
    assert [Path(p).name for p in _open_files_under(out)] == ["train.log"]  # the logging handler's, by design


def test_the_first_record_carries_the_run_fields_given_once(tmp_path):
    """The parameter counts and tower states (issue 28, point 10) are in metrics.jsonl's first
    record only; TensorBoard takes their numbers and skips the words."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    once = {
        "params_trainable": 1200,
        "params_frozen": 340,
        "image_tower": "locked",
        "text_tower": "trainable",
    }
    with RunLog(tmp_path, 0, 0, 4, 2, tensorboard=True, show_progress=False) as log:
        log.record(2, _record(2), eta=1.0, once=once)
        log.record(4, _record(4), eta=0.0, once=once)
    first, second = (json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines())
    assert first == {**_record(2), **once} and second == _record(4)
    events = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    tags = events.Tags()["scalars"]
    assert "params_trainable" in tags and "loss" in tags and "image_tower" not in tags
    assert [e.value for e in events.Scalars("params_frozen")] == [340]
