"""What a user sees from start to end of a run (issue 15, points 4 and 5): a line per start-up
phase, no DeepSpeed op build, readable progress lines off a terminal, config mistakes before
training, suite paths from any directory, and no orphaned data workers after a kill."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from mmalign.config import ConfigError, load_config
from mmalign.errors import UsageError
from mmalign.progress import duration, track, train_line
from tests.harness import ROOT, cli_main


def _train_cmd(overrides: list[str], *extra: str) -> list[str]:
    cmd = [sys.executable, "-m", "mmalign.cli", "train", *extra]
    for o in overrides:
        cmd += ["--set", o]
    return cmd


# ------------------------------------------------------------------ start-up


def test_two_trainings_in_one_process_and_an_engine_after_them(micro_overrides, tmp_path):
    """`mmalign train` destroys its process group at the end, DeepSpeed's cached groups with it
    (mmalign.layout.ds_adapter.release_groups): a second in-process run, and an engine built
    after both, find no destroyed group (they did, before)."""
    import torch

    from mmalign.data.batch import Batch
    from mmalign.dist import distributed as mdist
    from mmalign.models import build_model
    from mmalign.objective import build_objective
    from mmalign.run.engine import Engine
    from tests.harness import engine_batch, engine_cfg

    ov = [o for o in micro_overrides if not o.startswith(("output=", "train.steps="))]
    for name in ("first", "second"):
        args = [
            "train",
            "--output",
            str(tmp_path / name),
            "--set",
            "train.steps=2",
            "--set",
            "eval.suite=none",
            "--set",
            "monitor.probe_size=0",
        ]
        for o in ov:
            args += ["--set", o]
        res = cli_main(*args)
        assert res.returncode == 0, res.stderr[-3000:]
        assert not mdist.is_initialized()  # the run's group is gone, as at a process's end
    cfg = engine_cfg(0)
    engine = Engine(build_model(cfg.model), cfg)
    out = engine.step(Batch(*engine_batch(1, 0, 1)), build_objective(cfg))
    assert torch.isfinite(out.loss)


@pytest.mark.integration
def test_cli_run_announces_each_phase_builds_no_op_and_logs_readable_lines(micro_overrides, tmp_path):
    """Non-TTY stdout: one line per phase, an early run-time estimate, one line per log_every;
    no DeepSpeed JIT build (a fresh extensions dir stays empty), no CUDA_HOME warning;
    eval.suite none: no evaluation."""
    extensions = tmp_path / "torch_extensions"
    env = dict(os.environ, TORCH_EXTENSIONS_DIR=str(extensions), PYTHONPATH=str(ROOT))
    overrides = micro_overrides + [
        "train.steps=6",
        "train.log_every=3",
        "eval.suite=none",
        "monitor.probe_size=0",
    ]
    res = subprocess.run(
        _train_cmd(overrides), capture_output=True, text=True, cwd=ROOT, env=env, timeout=300
    )
    assert res.returncode == 0, res.stderr[-2000:]
    out = res.stdout
    phases = [
        "building model micro",
        "starting DeepSpeed",
        "global batch 32",
        "opening data: 2 training shard",
        "training 6 step(s), no evaluation",
        "first 3 step(s)",
        "trained 6 step(s)",
    ]
    where = [out.find("mmalign: " + p) for p in phases]
    assert -1 not in where and where == sorted(where), out
    steps = [line for line in out.splitlines() if line.startswith("step ")]
    assert len(steps) == 2, out  # steps 3 and 6
    pattern = (
        r"step +(\d+)/6 \(\s*\d+%\)  loss \d+\.\d{4}  lr \d\.\d{3}e[+-]\d\d  scale \d+\.\d\d  "
        r"samples/s \d+\.\d  ETA \d+:\d\d:\d\d(?:  GFLOP/s \d+\.\d+)?"
    )
    assert [int(re.fullmatch(pattern, s).group(1)) for s in steps] == [3, 6], steps
    both = out + res.stderr
    assert "CUDA_HOME" not in both and "built successfully" not in both and "\r" not in both
    assert not extensions.exists() or not any(extensions.rglob("*.so")), list(extensions.rglob("*"))
    run = Path(micro_overrides[-1].split("=", 1)[1])
    log = (run / "train.log").read_text()
    assert "step 6/6 (100%)  loss" in log and '"samples_per_s"' not in log  # the JSON is in metrics.jsonl
    assert [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()] == [3, 6]
    assert (run / "final" / "model.safetensors").is_file() and not (run / "eval.json").exists()
    assert out.splitlines()[-1].startswith("run written to") and "eval.json" not in out.splitlines()[-1]


# ------------------------------------------------------- config mistakes early


def test_eval_suite_typo_fails_before_anything_is_built(micro_overrides, monkeypatch):
    import mmalign.run.train as train_mod

    def no_model(*args, **kwargs):
        raise AssertionError("the model was built before eval.suite was checked")

    monkeypatch.setattr(train_mod, "build_model", no_model)
    cfg = load_config(None, micro_overrides + ["eval.suite=shapez"])
    with pytest.raises(ConfigError, match=r"config key 'eval.suite': unknown suite 'shapez'"):
        train_mod.train(cfg, show_progress=False)
    assert not Path(cfg.output).exists()
    # a shard suite with neither its own shards nor data.val: also before training
    missing = load_config(
        None, micro_overrides + ["data.val=" + str(Path(cfg.output).parent / "nowhere.tar")]
    )
    with pytest.raises(ConfigError, match="config key 'data.val': shard not found"):
        train_mod.train(missing, show_progress=False)
    assert train_mod.resolve_suite(load_config(None, ["eval.suite=none"])) is None


def test_suite_paths_resolve_against_the_suite_file_then_the_working_directory(tmp_path, monkeypatch):
    from mmalign.evaluation import load_suite
    from mmalign.evaluation.suite import check_suite_data

    suites, data, elsewhere = tmp_path / "suites", tmp_path / "data", tmp_path / "elsewhere"
    for d in (suites, data / "folder", elsewhere):
        d.mkdir(parents=True)
    for name in ("a.tar", "b.tar"):
        (data / name).write_bytes(b"")
    (suites / "by_file.yaml").write_text("name: by_file\ndataset: ../data/{a,b}.tar\ntasks: []\n")
    (suites / "folder.yaml").write_text(
        "name: folder\ndataset: {type: imagefolder, path: ../data/folder}\ntasks: []\n"
    )
    (suites / "by_cwd.yaml").write_text("name: by_cwd\ndataset: data/a.tar\ntasks: []\n")
    (suites / "gone.yaml").write_text("name: gone\ndataset: {type: imagefolder, path: nowhere}\ntasks: []\n")
    monkeypatch.chdir(elsewhere)
    assert load_suite(str(suites / "by_file.yaml"))["dataset"] == f"{data}/{{a,b}}.tar"
    assert load_suite(str(suites / "folder.yaml"))["dataset"]["path"] == str(data / "folder")
    monkeypatch.chdir(tmp_path)  # not next to the suite file, but under the working directory
    assert load_suite(str(suites / "by_cwd.yaml"))["dataset"] == str(data / "a.tar")
    check_suite_data(load_suite(str(suites / "by_cwd.yaml")))
    with pytest.raises(ConfigError, match="image folder 'nowhere' not found"):
        check_suite_data(load_suite(str(suites / "gone.yaml")))
    # the built-in suites name their data relative to their own file: the same from any directory
    monkeypatch.chdir(elsewhere)
    from_elsewhere = load_suite("imagefolder_cifar10")["dataset"]["path"]
    monkeypatch.chdir(ROOT)
    assert load_suite("imagefolder_cifar10")["dataset"]["path"] == from_elsewhere
    # --data / data.val replaces a shard suite's files
    assert check_suite_data(load_suite(str(suites / "by_cwd.yaml")), str(data / "b.tar"))["urls"] == str(
        data / "b.tar"
    )


# ------------------------------------------------------------------ progress


def test_progress_lines_off_a_terminal(capsys):
    assert duration(0) == "0:00:00" and duration(3725.4) == "1:02:05" and duration(90061) == "1 days, 1:01:01"
    assert duration(float("nan")) == "?"
    line = train_line(
        40,
        1000,
        {"loss": 3.25, "lr": 1e-3, "logit_scale": 14.2857, "samples_per_s": 85.12, "skipped_steps": 0},
        754,
    )
    assert (
        line == "step   40/1000 (  4%)  loss 3.2500  lr 1.000e-03  scale 14.29  samples/s 85.1  ETA 0:12:34"
    )
    assert list(track(range(5), "eval x", total=5, unit="images", every_s=0.0)) == list(range(5))
    printed = capsys.readouterr().out.splitlines()  # pytest's capture is not a terminal: lines, no bar
    assert len(printed) == 6 and printed[0].startswith("mmalign: eval x: 1 of 5 images")
    assert (
        "ETA" in printed[0]
        and printed[-1].startswith("mmalign: eval x: 5 of 5 images")
        and "done in" in printed[-1]
    )
    assert list(track(range(3), "quiet", enabled=False)) == [0, 1, 2] and capsys.readouterr().out == ""


# ------------------------------------------------------------- no orphans


def _descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                ppid = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            out.append(child)
            todo.append(child)
    return out


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@contextlib.contextmanager
def _training(cmd: list[str], log: Path, limit_s: float):
    """A training run in its own session, stdout to ``log``, until its first step line; yields
    (the process, the live processes under it then).  Afterwards the run and every one of
    those processes is gone, whatever the test asserted."""
    with log.open("w") as sink:
        # SIGINT at its default in the run: a shell's background job (make test under nohup, CI)
        # can hand pytest an ignored SIGINT, which its children would inherit and never see Ctrl-C
        proc = subprocess.Popen(
            cmd,
            stdout=sink,
            stderr=subprocess.STDOUT,
            cwd=ROOT,
            env=dict(os.environ, PYTHONPATH=str(ROOT)),
            start_new_session=True,
            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
        )
    family: list[int] = []
    try:
        deadline = time.time() + limit_s
        while "\nstep " not in log.read_text() and time.time() < deadline and proc.poll() is None:
            time.sleep(0.2)
        assert "\nstep " in log.read_text(), log.read_text()[-2000:]
        family.extend(p for p in _descendants(proc.pid) if _alive(p))
        yield proc, family
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)
        for p in family:
            if _alive(p):
                os.kill(p, signal.SIGKILL)


def _wait_gone(pids: list[int], within_s: float) -> None:
    deadline = time.time() + within_s
    while any(_alive(p) for p in pids) and time.time() < deadline:
        time.sleep(0.1)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
@pytest.mark.integration
def test_killing_a_run_ends_its_data_workers(micro_overrides, tmp_path, sig):
    overrides = [o for o in micro_overrides if not o.startswith("data.workers")] + [
        "data.workers=2",
        "train.steps=1000",
        "monitor.probe_size=0",
        "eval.suite=none",
    ]
    log = tmp_path / "stdout.txt"
    with _training(_train_cmd(overrides), log, 180) as (proc, workers):
        assert len(workers) >= 2, workers  # the two DataLoader workers
        proc.send_signal(sig)  # the main process only, as `kill` or a scheduler would
        code = proc.wait(timeout=60)
        _wait_gone(workers, 2)  # workers go with the run, not at PyTorch's next 5 s poll
        assert not [p for p in workers if _alive(p)], log.read_text()[-2000:]
        # ... and the run ended as an interrupted one (exit handlers ran), not killed outright
        assert code == {signal.SIGTERM: 143, signal.SIGINT: 130}[sig], log.read_text()[-2000:]


def test_embed_total_comes_from_the_shards_sizes_json(shapes_dir, tmp_path):
    from mmalign.search.embed import shard_total

    assert shard_total(f"{shapes_dir}/train/{{00000..00001}}.tar") == 400
    assert shard_total(shapes_dir / "train") == 400 and shard_total(f"{shapes_dir}/val/00000.tar") == 120
    (tmp_path / "x.tar").write_bytes(b"")  # no sizes.json: no total, no error
    assert shard_total(str(tmp_path / "x.tar")) is None
    (tmp_path / "sizes.json").write_text('{"y.tar": 3}')  # a shard the listing does not name
    assert shard_total(str(tmp_path / "x.tar")) is None


def test_probes_say_what_they_fit():
    import torch

    from mmalign.evaluation.probes import run_probes

    g = torch.Generator().manual_seed(0)
    labels = torch.arange(60) % 3
    features = torch.randn(60, 8, generator=g) + 3 * torch.nn.functional.one_hot(labels, 8)
    heard: list[str] = []
    quiet = run_probes(features, labels, 3, {"Cs": [0.1, 1.0]})
    loud = run_probes(features, labels, 3, {"Cs": [0.1, 1.0]}, say=heard.append)
    assert heard == [
        "linear probe: fitting C=0.1 (1/2) on 30 samples",
        "linear probe: fitting C=1 (2/2) on 30 samples",
        "kNN probes",
        "few-shot probes",
    ]
    assert loud == quiet  # progress changes no number


def test_a_suite_typo_stops_a_multi_process_run_before_its_ranks_start(micro_overrides, monkeypatch):
    import mmalign.dist.launch

    def no_ranks(*args, **kwargs):
        raise AssertionError("ranks were launched before eval.suite was checked")

    monkeypatch.setattr(mmalign.dist.launch, "launch_local", no_ranks)
    res = cli_main(
        "train", "--nproc", "2", *[a for o in micro_overrides + ["eval.suite=shapez"] for a in ("--set", o)]
    )
    assert res.returncode == 2 and res.stderr.startswith(
        "mmalign: error: config key 'eval.suite': unknown suite"
    )
    assert len(res.stderr.strip().splitlines()) == 1, res.stderr  # no per-rank copies, no launcher traceback


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.integration
def test_killing_a_multi_process_run_ends_every_rank_and_worker(micro_overrides, tmp_path):
    """SIGTERM to `mmalign train --nproc 2` reaches torchrun, its ranks and their data workers."""
    overrides = [o for o in micro_overrides if not o.startswith("data.workers")] + [
        "data.workers=1",
        "train.steps=1000",
        "monitor.probe_size=0",
        "eval.suite=none",
    ]
    log = tmp_path / "stdout.txt"
    with _training(_train_cmd(overrides, "--nproc", "2"), log, 240) as (proc, family):
        assert len(family) >= 5, family  # torchrun, 2 ranks, a worker each
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=90)
        _wait_gone(family, 5)
        assert not [p for p in family if _alive(p)], log.read_text()[-2000:]


def test_data_flag_replaces_an_image_folder_suite_path_from_any_directory(tmp_path):
    """``--data`` points an imagefolder suite at another folder (the run's data.val does not:
    those are shards); a digits suite refuses it in one line.  End to end through ``mmalign eval``."""
    from PIL import Image

    from mmalign.evaluation import load_suite
    from mmalign.evaluation.suite import check_suite_data

    folder = tmp_path / "folder"
    for c, colour in (("red", (220, 20, 20)), ("blue", (20, 20, 220))):
        (folder / c).mkdir(parents=True)
        for i in range(3):
            Image.new("RGB", (20, 20), colour).save(folder / c / f"{i}.png")
    suite_file = tmp_path / "suites" / "colours.yaml"
    suite_file.parent.mkdir()
    suite_file.write_text(
        "name: colours\ndataset: {type: imagefolder, path: nowhere, classnames: [red, blue]}\n"
        "tasks: [{name: colours, type: zeroshot, label_field: classname, classnames: [red, blue],"
        " templates: ['a {c} square.']}]\n"
    )
    suite = load_suite(str(suite_file))
    with pytest.raises(ConfigError, match="image folder 'nowhere' not found"):
        check_suite_data(suite, "shards/{0..1}.tar")  # data.val leaves an image folder alone
    assert check_suite_data(suite, "shards/{0..1}.tar", user_data=str(folder))["path"] == str(folder)
    with pytest.raises(ConfigError, match=r"--data: image folder '.*gone' not found"):
        check_suite_data(suite, user_data=str(tmp_path / "gone"))
    with pytest.raises(UsageError, match="reads sklearn's digits"):  # a flag, not a config key
        check_suite_data(load_suite("digits"), user_data=str(folder))

    final = _saved_micro_model(tmp_path / "run" / "final")  # the weights do not matter: --data's path does
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    out = tmp_path / "colours.json"
    res = cli_main(
        "eval", "--model", final, "--suite", suite_file, "--data", folder, "--output", out, cwd=elsewhere
    )
    assert res.returncode == 0, res.stderr[-2000:]
    (record,) = json.loads(out.read_text())
    assert record["dataset"] == "colours/colours" and record["n_images"] == 6 and "acc1" in record["metrics"]
    res = cli_main(
        "eval", "--model", final, "--suite", suite_file, "--data", tmp_path / "gone", cwd=elsewhere
    )
    assert res.returncode == 2 and len(res.stderr.strip().splitlines()) == 1, res.stderr


def _saved_micro_model(folder: Path) -> Path:
    """An untrained micro model saved as a run's final/ is (seeded)."""
    import torch

    from mmalign.config import ModelConfig
    from mmalign.data.transforms import preprocess_cfg
    from mmalign.models.arch import resolve_arch
    from mmalign.models.io import save_pretrained
    from mmalign.models.two_tower import TwoTower

    torch.manual_seed(0)
    model = TwoTower(resolve_arch(ModelConfig(preset="micro")))
    return save_pretrained(model, folder, preprocess=preprocess_cfg(model.image_size))
