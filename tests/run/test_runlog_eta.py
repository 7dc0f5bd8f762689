"""No ETA from the set-up cost (issue 39, point 5): the first step's set-up is never
extrapolated; the lines say "warming up" until a few steps after it have been timed, then
the ETA is the post-warm-up rate times the steps left. A fake clock drives the steps."""

from mmalign.progress import train_line
from mmalign.run import runlog as runlog_mod
from mmalign.run.runlog import RunLog


class FakeClock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _record(step: int) -> dict:
    return {"step": step, "loss": 2.0, "lr": 1e-3, "samples_per_s": 10.0}


def test_a_slow_first_step_gives_no_eta_then_the_post_warmup_rate(tmp_path, capsys, monkeypatch):
    said = []
    monkeypatch.setattr(runlog_mod, "say", said.append)
    clock = FakeClock()
    steps, first_s, step_s = 350, 100.0, 1.0  # a set-up of 100 s, then 1 s a step
    etas = {}
    with RunLog(tmp_path, 0, 0, steps, 1, show_progress=True, clock=clock) as log:
        for step in range(1, 11):
            clock.now += first_s if step == 1 else step_s
            etas[step] = log.progress(step)
            log.record(step, _record(step), etas[step])
    warm = runlog_mod.WARMUP_STEPS + runlog_mod.TIMED_STEPS
    assert warm >= 3  # "a few steps after warm-up"
    assert all(etas[s] is None for s in range(1, warm))
    for s in range(warm, 11):  # the naive extrapolation would say (100 + s - 1) / s per step
        assert abs(etas[s] - (steps - s) * step_s) < 1e-9, (s, etas[s])
    printed = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("step ")]
    assert printed[0].endswith("warming up") and "ETA" not in printed[0]
    assert printed[warm - 1].endswith(f"ETA 0:05:{(steps - warm) % 60:02d}"), printed[warm - 1]
    # the one early estimate is the warm-up plus the post-warm-up rate, never 350 x the first step
    assert len(said) == 1 and "1.00 s/step" in said[0] and "estimated training time 0:07:29" in said[0], said


def test_the_last_step_and_a_missing_eta_read_plainly():
    record = _record(5)
    assert train_line(5, 5, record, None).endswith("warming up")
    assert train_line(5, 5, record, 0.0).endswith("ETA 0:00:00")


def test_a_run_shorter_than_the_warmup_ends_at_eta_zero(tmp_path):
    clock = FakeClock()
    with RunLog(tmp_path, 0, 0, 2, 1, show_progress=False, clock=clock) as log:
        clock.now += 50
        assert log.progress(1) is None
        clock.now += 1
        assert log.progress(2) == 0.0
