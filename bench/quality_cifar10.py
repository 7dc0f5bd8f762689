"""Equal-budget quality on CIFAR-10: open_clip's own trainer against mmalign.

Both tools train the same tiny towers (mmalign's ``tiny`` preset: ViT 4x128 on 32 px
with patch 4, text transformer 4x128) on the same CIFAR-10 train shards, where each
caption is one random clip_benchmark CIFAR template over the class name and the
class id sits in ``.json``.  Both final models are then scored by **mmalign's**
zero-shot code (``eval/cifar10.yaml``: the 18 CIFAR templates, the same transform and
tokenizer) on the CIFAR-10 test split, so the metric is identical.

Two budgets:

(a) equal steps, batch, lr, schedule and float32 (same augmentation, weight decay,
    Adam betas/eps, shuffle buffer, one loader worker each);
(b) equal wall-clock: each tool at its best measured settings (float32 or bf16
    autocast, whichever steps faster here), with the step count that fills
    ``--minutes`` of training at the throughput measured by a short calibration run.

open_clip_train needs webdataset <= 0.2.86; it is installed into a side directory
(``data/bench_pkgs/``) that only the open_clip subprocess puts on its PYTHONPATH, so the
project's venv keeps webdataset 1.x.  The tiny architecture reaches open_clip through
its offline ``local-dir:`` route (a folder holding ``open_clip_config.json`` and no
weights, so the model starts from random init).

    python bench/quality_cifar10.py --quick                 # development: minutes
    python bench/quality_cifar10.py --write-doc             # the full benchmark (~1 h+ on 2 cores)

Results go to ``WORK/results.json``; ``--write-doc`` replaces this benchmark's section
of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import random
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from data_pipelines.build import build_shards  # noqa: E402
from data_pipelines.sources import Captioner, image_folder, load_templates  # noqa: E402
from mmalign.data.tokenizer import build_tokenizer  # noqa: E402
from mmalign.data.transforms import eval_transform, preprocess_cfg  # noqa: E402
from mmalign.evaluation import load_suite, run_suite  # noqa: E402
from mmalign.models.presets import PRESETS  # noqa: E402
from idle import LoadWatch, add_flag, write_section  # noqa: E402

SECTION = "## Equal-budget quality on CIFAR-10 (bench/quality_cifar10.py)"
WDS_OLD = "0.2.86"
SIDE_DIR = ROOT / "data" / "bench_pkgs" / f"webdataset-{WDS_OLD}"
# open_clip_train's sample shuffle buffer (data.py _SAMPLE_SHUFFLE_SIZE); mmalign gets the same.
OPENCLIP_SHUFFLE = 5000


# ------------------------------------------------------------------ data


def build_split(src: Path, out: Path, n: int, seed: int, per_shard: int) -> str:
    """``n`` random images of a class-folder tar -> shards with one random template each.

    The folder tar is sorted by class; shuffling before writing gives every shard all
    classes, which open_clip's pipeline (5000-sample buffer) needs as much as ours.
    """
    stamp = out / "bench_stamp.json"
    want = {"src": str(src), "n": n, "seed": seed, "per_shard": per_shard}
    if stamp.is_file() and json.loads(stamp.read_text()) == want:
        return shard_spec(out)
    shutil.rmtree(out, ignore_errors=True)
    tset = load_templates("cifar10")
    _, items = image_folder(src, Captioner(tset["templates"], per_image=1, seed=seed), tset["classnames"])
    items = list(items)  # 60k tiny jpgs: ~100 MB held briefly
    random.Random(seed).shuffle(items)
    summary = build_shards(items[:n], out, per_shard=per_shard, progress=False, source=f"imagefolder:{src}")
    stamp.write_text(json.dumps(want))
    print(f"  built {summary['written']} samples in {summary['shards']} shards under {out}", flush=True)
    return shard_spec(out)


def shard_spec(folder: Path) -> str:
    tars = sorted(folder.glob("*.tar"))
    return str(tars[0]) if len(tars) == 1 else f"{folder}/{{{tars[0].stem}..{tars[-1].stem}}}.tar"


# ------------------------------------------------------------- open_clip


def ensure_side_webdataset() -> Path:
    if not (SIDE_DIR / "webdataset").is_dir():
        print(f"  installing webdataset=={WDS_OLD} into {SIDE_DIR} (open_clip_train only)", flush=True)
        subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(SIDE_DIR),
                        f"webdataset=={WDS_OLD}"], check=True)
    return SIDE_DIR


def openclip_model_dir(work: Path) -> Path:
    """The tiny towers as an open_clip ``local-dir:`` model (config only: random init)."""
    d = work / "openclip_tiny"
    d.mkdir(parents=True, exist_ok=True)
    arch = PRESETS["tiny"]
    pre = preprocess_cfg(arch["vision_cfg"]["image_size"])
    (d / "open_clip_config.json").write_text(json.dumps({"model_cfg": arch, "preprocess_cfg": pre}, indent=2))
    return d


def run_openclip(work: Path, name: str, *, train: str, n_train: int, batch: int, epochs: int, lr: float,
                 warmup: int, precision: str, log_every: int) -> dict:
    logs = work / "openclip_logs"
    shutil.rmtree(logs / name, ignore_errors=True)  # open_clip refuses an existing experiment name
    cmd = [sys.executable, "-m", "open_clip_train.main",
           "--model", f"local-dir:{openclip_model_dir(work)}",
           "--train-data", train, "--dataset-type", "webdataset", "--train-num-samples", str(n_train),
           "--batch-size", str(batch), "--epochs", str(epochs), "--lr", str(lr), "--warmup", str(warmup),
           "--wd", "0.1", "--beta1", "0.9", "--beta2", "0.98", "--eps", "1e-6",
           "--precision", precision, "--device", "cpu", "--workers", "1", "--seed", "0",
           "--save-most-recent", "--logs", str(logs), "--name", name,
           "--log-every-n-steps", str(log_every), "--zeroshot-frequency", "0"]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ensure_side_webdataset()), str(ROOT)]))
    wall = _run(cmd, work / f"{name}.log", env)
    text = (logs / name / "out.log").read_text()
    # "Batch (t): 1.234" is the mean step time (data included) since the previous log line.
    step_times = [float(x) for x in re.findall(r"Batch \(t\): ([0-9.]+)", text)]
    steps = epochs * math.ceil(n_train / batch)
    return {"tool": "open_clip", "name": name, "precision": precision, "steps": steps, "batch": batch,
            "samples_per_s": _steady(batch / t for t in step_times), "process_s": wall,
            "checkpoint": str(logs / name / "checkpoints" / "epoch_latest.pt")}


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


def run_mmalign(work: Path, name: str, *, train: str, test: str, steps: int, batch: int, lr: float, warmup: int,
                precision: str, log_every: int) -> dict:
    out = work / "mmalign_runs" / name
    shutil.rmtree(out, ignore_errors=True)
    sets = [
        f"output={out}", "model.preset=tiny",
        f"data.train={train}", f"data.val={test}", "data.mode=epoch", "data.workers=1",
        f"data.shuffle_buffer={OPENCLIP_SHUFFLE}",
        # open_clip's default training augmentation: random-resized-crop scale 0.9-1, no flip
        "data.augment.crop_scale=[0.9,1.0]", "data.augment.hflip=false",
        f"train.steps={steps}", f"train.global_batch_size={batch}", f"train.lr={lr}", f"train.warmup_steps={warmup}",
        "train.weight_decay=0.1", "train.betas=[0.9,0.98]", "train.eps=1e-6", "train.optimizer=adamw",
        f"train.precision={precision}", "train.device=cpu", f"train.log_every={log_every}",
        "loss.name=infonce", "loss.tile_size=0", "loss.false_negative_ids=none",
        # open_clip has no probe forward and logs nowhere here; keep the work equal
        "monitor.probe_size=0", "monitor.tensorboard=false", "eval.suite=cifar10",
    ]
    cmd = [sys.executable, "-m", "mmalign.cli", "train", "--config", str(ROOT / "configs" / "cifar10_cpu.yaml"), "--overwrite"]
    for s in sets:
        cmd += ["--set", s]
    wall = _run(cmd, work / f"{name}.log", dict(os.environ))
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line]
    evals = json.loads((out / "eval.json").read_text())
    return {"tool": "mmalign", "name": name, "precision": precision, "steps": steps, "batch": batch,
            "samples_per_s": _steady(r["samples_per_s"] for r in records), "process_s": wall,
            # the run's own final evaluation: run_suite on eval/cifar10.yaml, as for open_clip
            "acc1": next(r["metrics"]["acc1"] for r in evals if r["dataset"] == "cifar10/zeroshot")}


# ----------------------------------------------------------------- common


def _zeroshot(model, test: str, model_name: str) -> float:
    arch = PRESETS["tiny"]
    records = run_suite(model, eval_transform(arch["vision_cfg"]["image_size"]), build_tokenizer(arch),
                        load_suite("cifar10"), test, model_name=model_name)
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


def train_pair(work: Path, tag: str, *, train: str, test: str, n_train: int, batch: int, steps_per_epoch: int,
               epochs: int, lr: float, warmup: int, precisions: dict, log_every: int) -> list[dict]:
    """Train open_clip then mmalign for the same number of epochs/steps; evaluate both."""
    oc = run_openclip(work, f"openclip_{tag}", train=train, n_train=n_train, batch=batch, epochs=epochs, lr=lr,
                      warmup=warmup, precision=precisions["open_clip"], log_every=log_every)
    oc["acc1"] = eval_openclip(work, oc.pop("checkpoint"), test)
    _say(oc)
    mm = run_mmalign(work, f"mmalign_{tag}", train=train, test=test, steps=steps_per_epoch * epochs, batch=batch,
                     lr=lr, warmup=warmup, precision=precisions["mmalign"], log_every=log_every)
    _say(mm)
    return [oc, mm]


def _say(r: dict) -> None:
    print(f"  {r['tool']:<9} {r['precision']:<9} {r['steps']:>5} steps: zero-shot top-1 {100 * r['acc1']:.2f}%, "
          f"{r['samples_per_s']:.1f} samples/s, process {r['process_s']:.0f} s", flush=True)


def calibrate(work: Path, *, train: str, test_small: str, n_train: int, batch: int, steps: int, log_every: int) -> dict:
    """Steady samples/s of bf16 autocast per tool, from a short run (fp32 comes from budget a)."""
    oc = run_openclip(work, "openclip_calib_bf16", train=train, n_train=steps * batch, batch=batch, epochs=1,
                      lr=1e-3, warmup=1, precision="amp_bf16", log_every=log_every)
    mm = run_mmalign(work, "mmalign_calib_bf16", train=train, test=test_small, steps=steps, batch=batch, lr=1e-3,
                     warmup=1, precision="bf16", log_every=log_every)
    return {"open_clip": oc["samples_per_s"], "mmalign": mm["samples_per_s"]}


# ------------------------------------------------------------------ report


def table_a(rows: list[dict]) -> str:
    oc, mm = rows
    lines = ["| tool | precision | steps x batch | zero-shot top-1 (%) | train samples/s | process (s) |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['tool']} | {r['precision']} | {r['steps']} x {r['batch']} | {100 * r['acc1']:.2f} | "
                     f"{r['samples_per_s']:.1f} | {r['process_s']:.0f} |")
    lines.append(f"\nmmalign - open_clip: {100 * (mm['acc1'] - oc['acc1']):+.2f} points top-1, "
                 f"{mm['samples_per_s'] / oc['samples_per_s']:.2f}x samples/s.")
    return "\n".join(lines)


def table_b(rows: list[dict], minutes: float, rates: dict) -> str:
    oc, mm = rows
    lines = ["| tool | best settings (measured) | steps x batch | est. train time (s) | zero-shot top-1 (%) | "
             "train samples/s | process (s) |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        est = r["steps"] * r["batch"] / r["samples_per_s"]
        prec = "bf16 autocast" if r["precision"] == "bf16" else "fp32"
        lines.append(f"| {r['tool']} | {prec}, {r['settings']} | {r['steps']} x {r['batch']} | "
                     f"{est:.0f} | {100 * r['acc1']:.2f} | {r['samples_per_s']:.1f} | {r['process_s']:.0f} |")
    lines.append(f"\nBudget {minutes:g} min of training each; steps = budget x calibrated samples/s / batch "
                 f"(calibration: " + ", ".join(f"{k} {v['fp32']:.1f} fp32 / {v['bf16']:.1f} bf16 samples/s"
                                               for k, v in rates.items()) + ").")
    lines.append(f"mmalign - open_clip: {100 * (mm['acc1'] - oc['acc1']):+.2f} points top-1.")
    return "\n".join(lines)


def write_doc(text: str, watch: LoadWatch, allow_loaded: bool) -> None:
    write_section(ROOT / "docs" / "benchmarks.md", text, watch, allow_loaded)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="development size: 3k train / 500 test images, batch 100, "
                                                         "1 epoch, 1 min wall-clock budget")
    p.add_argument("--train-samples", type=int, help="train images used (default 50000, quick 3000)")
    p.add_argument("--test-samples", type=int, help="test images scored (default 10000, quick 500)")
    p.add_argument("--batch", type=int, help="batch size (default 256, quick 100)")
    p.add_argument("--epochs", type=int, help="epochs of budget (a) (default 2, quick 1)")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--minutes", type=float, help="training minutes per tool in budget (b) (default 8, quick 1)")
    p.add_argument("--skip-wallclock", action="store_true", help="only budget (a)")
    p.add_argument("--data", default=str(ROOT.parent / "shared" / "data" / "cifar10"),
                   help="folder with CIFAR-10 train.tar and test.tar (class folders)")
    p.add_argument("--work", default=str(ROOT / "data" / "bench_quality_cifar10"), help="shards, runs, logs")
    p.add_argument("--write-doc", action="store_true", help="write the tables into docs/benchmarks.md")
    add_flag(p)
    args = p.parse_args()
    watch = LoadWatch()
    q = args.quick
    n_train = args.train_samples or (3000 if q else 50000)
    n_test = args.test_samples or (500 if q else 10000)
    batch = args.batch or (100 if q else 256)
    epochs = args.epochs or (1 if q else 2)
    minutes = args.minutes or (1.0 if q else 8.0)
    log_every = 5 if q else 10
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    data = Path(args.data)

    print("data: shuffled CIFAR-10 shards, one random CIFAR template per image", flush=True)
    per_shard = 1000 if n_train >= 5000 else max(1, n_train // 5)  # >= 5 shards: shard shuffling has work to do
    train = build_split(data / "train.tar", work / f"train{n_train}", n_train, 0, per_shard)
    test = build_split(data / "test.tar", work / f"test{n_test}", n_test, 1, 1000)
    test_small = build_split(data / "test.tar", work / "test_calib", 200, 2, 200)  # calibration runs' own eval
    steps_per_epoch = math.ceil(n_train / batch)  # open_clip's count (it rolls over into the next pass)
    warmup = max(1, round(0.1 * steps_per_epoch * epochs))

    print(f"(a) equal steps: {epochs} epoch(s) of {n_train} = {steps_per_epoch * epochs} steps x {batch}, "
          f"lr {args.lr:g}, warmup {warmup}, fp32", flush=True)
    rows_a = train_pair(work, "equal_steps", train=train, test=test, n_train=n_train, batch=batch,
                        steps_per_epoch=steps_per_epoch, epochs=epochs, lr=args.lr, warmup=warmup,
                        precisions={"open_clip": "fp32", "mmalign": "fp32"}, log_every=log_every)
    results = {"budget_a": rows_a}

    rows_b, rates = None, None
    if not args.skip_wallclock:
        print(f"(b) equal wall-clock: {minutes:g} min of training each; calibrating bf16 autocast", flush=True)
        calib_steps = (2 if q else 4) * log_every  # 1 (quick) or 3 steady windows after the first
        bf16 = calibrate(work, train=train, test_small=test_small, n_train=n_train, batch=batch, steps=calib_steps,
                         log_every=log_every)
        rates = {r["tool"]: {"fp32": r["samples_per_s"], "bf16": bf16[r["tool"]]} for r in rows_a}
        rows_b = []
        for tool, names in (("open_clip", ("fp32", "amp_bf16")), ("mmalign", ("fp32", "bf16"))):
            best = "bf16" if rates[tool]["bf16"] > rates[tool]["fp32"] else "fp32"
            # cosine schedules need the length up front: fix the steps from the measured rate
            steps = max(1, round(minutes * 60 * rates[tool][best] / batch))
            warm_b = max(1, round(0.1 * steps))
            prec = names[best == "bf16"]
            if tool == "open_clip":
                # open_clip counts epochs over --train-num-samples: one "epoch" of steps x batch samples
                r = run_openclip(work, "openclip_wallclock", train=train, n_train=steps * batch, batch=batch,
                                 epochs=1, lr=args.lr, warmup=warm_b, precision=prec, log_every=log_every)
                r["acc1"] = eval_openclip(work, r.pop("checkpoint"), test)
                r["settings"] = "ClipLoss"
            else:
                r = run_mmalign(work, "mmalign_wallclock", train=train, test=test, steps=steps, batch=batch,
                                lr=args.lr, warmup=warm_b, precision=prec, log_every=log_every)
                r["settings"] = "InfoNCE untiled, no id positives"
            r["precision"] = best
            _say(r)
            rows_b.append(r)
        results.update(budget_b=rows_b, minutes=minutes, calibration=rates)

    cmd = "python bench/quality_cifar10.py " + " ".join(sys.argv[1:])
    env = (f"{datetime.date.today().isoformat()} · {platform.machine()}, {os.cpu_count()} CPU cores, "
           f"{torch.get_num_threads()} torch threads · torch {torch.__version__}, open_clip_torch "
           f"{_version('open_clip_torch')} (open_clip_train with webdataset {WDS_OLD}), mmalign with webdataset "
           f"{_version('webdataset')}")
    setup = (f"data: CIFAR-10 train, {n_train} images shuffled into {per_shard}-image shards, one random clip_benchmark "
             f"CIFAR template per image; zero-shot top-1 on {n_test} test images with mmalign's suite "
             f"(eval/cifar10.yaml, 18 templates) for both models · tiny towers (ViT 4x128 @32px patch 4, text 4x128) · "
             f"AdamW lr {args.lr:g}, betas (0.9, 0.98), eps 1e-6, wd 0.1, warmup 10% then cosine · random-resized-crop "
             f"0.9-1, no flip · 1 loader worker, {OPENCLIP_SHUFFLE}-sample shuffle buffer, one pass per epoch. "
             f"samples/s: mean over log windows after the first (data wait included). process (s): the training "
             f"subprocess end to end, start-up included; mmalign's also saves final/ and scores the test split.")
    text = [SECTION, "", f"Command: `{cmd.strip()}` · {env}", "", setup, "",
            "**(a) Equal steps, batch, lr and float32**", "", table_a(rows_a)]
    if rows_b:
        text += ["", "**(b) Equal wall-clock, each at its best measured settings**", "", table_b(rows_b, minutes, rates)]
    text = "\n".join(text)
    print("\n" + text)
    results["markdown"] = text
    (work / "results.json").write_text(json.dumps(results, indent=2))
    if args.write_doc:
        write_doc(text, watch, args.allow_loaded)
        print(f"\nwrote {SECTION!r} in docs/benchmarks.md")


def _version(dist: str) -> str:
    from importlib.metadata import version

    try:
        return version(dist)
    except Exception:
        return "?"


if __name__ == "__main__":
    main()
