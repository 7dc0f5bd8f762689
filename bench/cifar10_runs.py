"""The two trainings of bench/quality_cifar10.py as subprocesses: open_clip_train and mmalign.

Each ``run_*`` trains the tiny towers on the given shards with the given settings, logs to
``WORK/<name>.log`` and returns the steady samples/s (mean of the log windows after the
first), the mean data wait per step over the same windows and the process's wall time.

open_clip_train needs webdataset <= 0.2.86; it is installed into a side directory
(``data/bench_pkgs/``) that only the open_clip subprocess puts on its PYTHONPATH, so the
project's venv keeps webdataset 1.x.  The tiny architecture reaches open_clip through its
offline ``local-dir:`` route (a folder holding ``open_clip_config.json`` and no weights, so
the model starts from random init).
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

from bench.harness import ROOT
from mmalign.data.transforms import eval_transform, preprocess_cfg
from mmalign.evaluation import load_suite, run_suite
from mmalign.models.presets import PRESETS
from mmalign.models.tokenizers import build_tokenizer

WDS_OLD = "0.2.86"
SIDE_DIR = ROOT / "data" / "bench_pkgs" / f"webdataset-{WDS_OLD}"
# open_clip_train's sample shuffle buffer (data.py _SAMPLE_SHUFFLE_SIZE); mmalign gets the same.
OPENCLIP_SHUFFLE = 5000


# ------------------------------------------------------------- open_clip


def ensure_side_webdataset() -> Path:
    if not (SIDE_DIR / "webdataset").is_dir():
        print(f"  installing webdataset=={WDS_OLD} into {SIDE_DIR} (open_clip_train only)", flush=True)
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "install",
                "--quiet",
                "--no-deps",
                "--target",
                str(SIDE_DIR),
                f"webdataset=={WDS_OLD}",
            ],
            check=True,
        )
    return SIDE_DIR


def openclip_model_dir(work: Path) -> Path:
    """The tiny towers as an open_clip ``local-dir:`` model (config only: random init)."""
    d = work / "openclip_tiny"
    d.mkdir(parents=True, exist_ok=True)
    arch = PRESETS["tiny"]
    pre = preprocess_cfg(arch["vision_cfg"]["image_size"])
    (d / "open_clip_config.json").write_text(json.dumps({"model_cfg": arch, "preprocess_cfg": pre}, indent=2))
    return d


def run_openclip(
    work: Path,
    name: str,
    *,
    train: str,
    n_train: int,
    batch: int,
    epochs: int,
    lr: float,
    warmup: int,
    precision: str,
    log_every: int,
    workers: int = 1,
    compile: bool = False,
    seed: int = 0,
) -> dict:
    logs = work / "openclip_logs"
    shutil.rmtree(logs / name, ignore_errors=True)  # open_clip refuses an existing experiment name
    cmd = [
        sys.executable,
        "-m",
        "open_clip_train.main",
        "--model",
        f"local-dir:{openclip_model_dir(work)}",
        "--train-data",
        train,
        "--dataset-type",
        "webdataset",
        "--train-num-samples",
        str(n_train),
        "--batch-size",
        str(batch),
        "--epochs",
        str(epochs),
        "--lr",
        str(lr),
        "--warmup",
        str(warmup),
        "--wd",
        "0.1",
        "--beta1",
        "0.9",
        "--beta2",
        "0.98",
        "--eps",
        "1e-6",
        "--precision",
        precision,
        "--device",
        "cpu",
        "--workers",
        str(workers),
        "--seed",
        str(seed),
        "--save-most-recent",
        "--logs",
        str(logs),
        "--name",
        name,
        "--log-every-n-steps",
        str(log_every),
        "--zeroshot-frequency",
        "0",
    ] + (["--torchcompile"] if compile else [])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ensure_side_webdataset()), str(ROOT)]))
    wall = _run(cmd, work / f"{name}.log", env)
    text = (logs / name / "out.log").read_text()
    # "Batch (t): 1.234" is the mean step time (data included) since the previous log line.
    step_times = [float(x) for x in re.findall(r"Batch \(t\): ([0-9.]+)", text)]
    data_times = [
        float(x) for x in re.findall(r"Data \(t\): ([0-9.]+)", text)
    ]  # mean wait per step, same windows
    steps = epochs * math.ceil(n_train / batch)
    return {
        "tool": "open_clip",
        "name": name,
        "precision": precision,
        "steps": steps,
        "batch": batch,
        "seed": seed,
        "samples_per_s": _steady(batch / t for t in step_times),
        "process_s": wall,
        "data_ms_per_step": 1000 * _steady(data_times),
        "checkpoint": str(logs / name / "checkpoints" / "epoch_latest.pt"),
    }


class _Normalised(torch.nn.Module):
    """open_clip's CLIP returns unnormalised features by default; the suite wants unit vectors."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def encode_image(self, x):
        return self.model.encode_image(x, normalize=True)

    def encode_text(self, t):
        return self.model.encode_text(t, normalize=True)


def eval_openclip(work: Path, checkpoint: str, test: str) -> dict:
    import open_clip

    model = open_clip.create_model(f"local-dir:{openclip_model_dir(work)}")
    state = torch.load(checkpoint, map_location="cpu", weights_only=False)["state_dict"]
    model.load_state_dict({k.removeprefix("module."): v for k, v in state.items()})
    return _zeroshot(_Normalised(model), test, "open_clip")


# --------------------------------------------------------------- mmalign


def run_mmalign(
    work: Path,
    name: str,
    *,
    train: str,
    test: str,
    steps: int,
    batch: int,
    lr: float,
    warmup: int,
    precision: str,
    log_every: int,
    workers: int = 1,
    compile: bool = False,
    evaluate: bool = True,
    seed: int = 0,
    extra_sets: tuple[str, ...] = (),
) -> dict:
    out = work / "mmalign_runs" / name
    shutil.rmtree(out, ignore_errors=True)
    sets = [
        f"output={out}",
        "model.preset=tiny",
        f"seed={seed}",
        f"data.train={train}",
        f"data.val={test}",
        "data.mode=epoch",
        f"data.workers={workers}",
        f"data.shuffle_buffer={OPENCLIP_SHUFFLE}",
        # open_clip's default training augmentation: random-resized-crop scale 0.9-1, no flip
        "data.augment.crop_scale=[0.9,1.0]",
        "data.augment.hflip=false",
        f"train.steps={steps}",
        f"train.global_batch_size={batch}",
        f"train.lr={lr}",
        f"train.warmup_steps={warmup}",
        "train.weight_decay=0.1",
        "train.betas=[0.9,0.98]",
        "train.eps=1e-6",
        "train.optimizer=adamw",
        f"train.precision={precision}",
        "train.device=cpu",
        f"train.log_every={log_every}",
        "loss.name=infonce",
        "loss.tile_size=0",
        "loss.false_negative_ids=none",
        # open_clip has no probe forward and logs nowhere here; keep the work equal
        "monitor.probe_size=0",
        "monitor.tensorboard=false",
        f"eval.suite={'cifar10' if evaluate else 'none'}",
        f"train.compile={str(compile).lower()}",
        *extra_sets,
    ]
    cmd = [
        sys.executable,
        "-m",
        "mmalign.cli",
        "train",
        "--config",
        str(ROOT / "configs" / "cifar10_cpu.yaml"),
        "--overwrite",
    ]
    for s in sets:
        cmd += ["--set", s]
    wall = _run(cmd, work / f"{name}.log", dict(os.environ))
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line]
    row = {
        "tool": "mmalign",
        "name": name,
        "precision": precision,
        "steps": steps,
        "batch": batch,
        "seed": seed,
        "samples_per_s": _steady(r["samples_per_s"] for r in records),
        "process_s": wall,
        # data_wait_s is the window's sum; log_every steps per window (the last may be shorter)
        "data_ms_per_step": 1000 * _steady(r["data_wait_s"] / log_every for r in records),
    }
    if evaluate:  # the run's own final evaluation: run_suite on eval/cifar10.yaml, as for open_clip
        evals = json.loads((out / "eval.json").read_text())
        row["acc1"] = next(r["metrics"]["acc1"] for r in evals if r["dataset"] == "cifar10/zeroshot")
    return row


# ----------------------------------------------------------------- common


def _zeroshot(model, test: str, model_name: str) -> float:
    arch = PRESETS["tiny"]
    records = run_suite(
        model,
        eval_transform(arch["vision_cfg"]["image_size"]),
        build_tokenizer(arch),
        load_suite("cifar10"),
        test,
        model_name=model_name,
    )
    return next(r["metrics"]["acc1"] for r in records if r["dataset"] == "cifar10/zeroshot")


def _steady(rates) -> float:
    """Mean of the per-window rates, without the first window (start-up, buffer fill)."""
    rates = list(rates)
    rates = rates[1:] if len(rates) > 1 else rates
    return sum(rates) / len(rates) if rates else float("nan")


def _run(cmd: list[str], log: Path, env: dict) -> float:
    start = time.time()
    with log.open("w") as f:
        proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=ROOT)
    if proc.returncode:
        tail = "".join(log.read_text().splitlines(keepends=True)[-25:])
        raise SystemExit(f"{' '.join(cmd[:4])} ... failed (exit {proc.returncode}); see {log}:\n{tail}")
    return time.time() - start
