"""Evaluation speed: zero-shot CIFAR-10 against clip_benchmark's own CLI, and building an
ImageNet-sized zero-shot classifier.

    python bench/eval_speed.py                 # both parts
    python bench/eval_speed.py --write-doc     # also rewrite the section in docs/benchmarks.md

Part ``zeroshot``: the 10000 CIFAR-10 test images in clip_benchmark's WebDataset layout
(``wds_cifar10``: 10 shards of the source's JPEGs + ``.cls``, its class names, its 18 CIFAR templates),
written once under ``--work``; one tiny-ViT model folder (weights do not change the speed:
a seeded random init unless ``--model`` names a trained one).  Each side runs as the command
a user types, in its own process, alternately, ``--repeats`` times; the table reports the
fastest of each (samples/s = 10000 / wall seconds, start-up and model load included, since
a user pays them) and the two top-1 accuracies, which must agree:

- mmalign: ``mmalign eval --model M --cb-dataset DIR --batch-size B``;
- clip_benchmark 1.6.2: ``clip_benchmark eval --model_type mmalign --pretrained M --dataset
  wds/cifar10 --dataset_root DIR --batch_size B --num_workers W --no_amp`` (its CLI, with
  mmalign's loader registered as README.md shows; fp32 on both sides: its default autocast
  would run the towers in bfloat16 on a CPU, a different computation).

Part ``classifier``: a zero-shot classifier for 1000 synthetic class names x clip_benchmark's
80 ImageNet templates with the tiny text tower (``mmalign.evaluation.zeroshot.build_classifier``,
what every zero-shot evaluation calls), timed in this process after a warm-up; the goal is
at most 60 s on 2 CPU cores.  clip_benchmark's ``zero_shot_classifier`` on the same model and
prompts is timed beside it for the ratio (``--no-cb-classifier`` skips it).
"""

from __future__ import annotations

import datetime
import io
import json
import random
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import _bootstrap  # noqa: F401  (python bench/x.py: puts the repository root on sys.path)

from bench.harness import DOC, ROOT, LoadWatch, command, cpu_line, parser, write_section

SECTION = "## Evaluation speed: zero-shot against clip_benchmark's CLI, classifier construction (bench/eval_speed.py)"
N_CLASSES = 1000

# clip_benchmark's CLI with mmalign's loader registered (README.md's snippet does the same)
CB_SCRIPT = """
import sys
from clip_benchmark import cli, models
from mmalign.pretrained import clip_benchmark_loader
models.TYPE2FUNC["mmalign"] = clip_benchmark_loader
models.MODEL_TYPES.append("mmalign")
sys.argv = ["clip_benchmark", "eval"] + sys.argv[1:]
sys.exit(cli.main())
"""


def cifar_wds(src: Path, out: Path) -> Path:
    """CIFAR-10 test in clip_benchmark's layout (written once; a stamp says it is complete)."""
    from data_pipelines.sources import Captioner, image_folder, load_templates

    if (out / "done.json").is_file():
        return out
    tset = load_templates("cifar10")
    (out / "test").mkdir(parents=True, exist_ok=True)
    _, found = image_folder(src, Captioner(["{c}"]), tset["classnames"], shuffle_seed=0)  # classes mixed, as
    items = [
        (item.image, item.meta["label"], Path(item.meta["source_path"]).suffix.lstrip(".").lower())
        for item in found
    ]  # clip_benchmark's exports hold them
    per = 1000
    for s in range(0, len(items), per):
        with tarfile.open(out / "test" / f"{s // per}.tar", "w") as tar:
            for i, (data, label, kind) in enumerate(items[s : s + per], start=s):
                for ext, body in ((kind, data), ("cls", str(label).encode())):
                    info = tarfile.TarInfo(f"s{i:06d}.{ext}")
                    info.size = len(body)
                    tar.addfile(info, io.BytesIO(body))
    (out / "test" / "nshards.txt").write_text(str((len(items) + per - 1) // per))
    (out / "classnames.txt").write_text("\n".join(tset["classnames"]) + "\n")
    (out / "zeroshot_classification_templates.txt").write_text("\n".join(tset["templates"]) + "\n")
    (out / "done.json").write_text(json.dumps({"n": len(items)}))
    return out


def model_folder(work: Path, given: str | None) -> Path:
    if given:
        return Path(given)
    out = work / "tiny_model"
    if not (out / "model.safetensors").is_file():
        import torch

        from mmalign.data.transforms import preprocess_cfg
        from mmalign.models import TwoTower
        from mmalign.models.io import save_pretrained
        from mmalign.models.presets import PRESETS

        torch.manual_seed(0)
        model = TwoTower(PRESETS["tiny"])
        save_pretrained(model, out, preprocess=preprocess_cfg(model.image_size))
    return out


def timed(cmd: list[str], log: Path) -> float:
    start = time.perf_counter()
    with log.open("w") as f:
        proc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT)
    wall = time.perf_counter() - start
    if proc.returncode:
        raise SystemExit(f"{cmd[:4]} failed (exit {proc.returncode}); see {log}")
    return wall


def zeroshot_part(args, work: Path) -> dict:
    data = cifar_wds(Path(args.data) / "test.tar", work / "wds_cifar10")
    model = model_folder(work, args.model)
    n = json.loads((data / "done.json").read_text())["n"]
    ours_out, cb_out = work / "ours.json", work / "cb.json"
    sides = {
        "mmalign": [
            sys.executable,
            "-m",
            "mmalign.cli",
            "eval",
            "--model",
            str(model),
            "--cb-dataset",
            str(data),
            "--batch-size",
            str(args.batch),
            "--output",
            str(ours_out),
        ],
        "clip_benchmark": [
            sys.executable,
            "-c",
            CB_SCRIPT,
            "--model_type",
            "mmalign",
            "--model",
            "mmalign",
            "--pretrained",
            str(model),
            "--dataset",
            "wds/cifar10",
            "--dataset_root",
            str(data),
            "--task",
            "zeroshot_classification",
            "--batch_size",
            str(args.batch),
            "--num_workers",
            str(args.workers),
            "--no_amp",
            "--output",
            str(cb_out),
        ],
    }
    walls: dict[str, list[float]] = {k: [] for k in sides}
    for r in range(args.repeats):
        for name, cmd in sides.items():
            walls[name].append(timed(cmd, work / f"{name}_{r}.log"))
            print(f"  {name} run {r}: {walls[name][-1]:.1f} s", flush=True)
    ours = json.loads(ours_out.read_text())
    ours = ours[0] if isinstance(ours, list) else ours
    theirs = json.loads(cb_out.read_text())
    best = {k: min(v) for k, v in walls.items()}
    return {
        "n": n,
        "walls": walls,
        "best": best,
        "ratio": best["clip_benchmark"] / best["mmalign"],
        "acc1": {"mmalign": ours["metrics"]["acc1"], "clip_benchmark": theirs["metrics"]["acc1"]},
        "model": str(model),
        "batch": args.batch,
        "workers": args.workers,
    }


def class_names(n: int) -> list[str]:
    rng = random.Random(0)
    a = [
        "red",
        "small",
        "striped",
        "wild",
        "domestic",
        "spotted",
        "giant",
        "mountain",
        "river",
        "desert",
        "northern",
        "common",
        "lesser",
        "greater",
        "golden",
        "black-tailed",
    ]
    b = [
        "fox",
        "owl",
        "beetle",
        "lizard",
        "truck",
        "lamp",
        "violin",
        "kettle",
        "sparrow",
        "tulip",
        "crab",
        "canoe",
        "drum",
        "moth",
        "heron",
        "scooter",
        "teapot",
        "orchid",
        "salamander",
        "harp",
    ]
    # a number in each keeps the names distinct, as ImageNet's 1000 are
    return [f"{rng.choice(a)} {rng.choice(b)} {i}" for i in range(n)]


def classifier_part(args) -> dict:
    import clip_benchmark
    import torch
    from clip_benchmark.metrics import zeroshot_classification as cb_zs

    from mmalign.evaluation.zeroshot import build_classifier
    from mmalign.models import TwoTower
    from mmalign.models.presets import PRESETS
    from mmalign.models.tokenizers import build_tokenizer

    templates = json.loads(
        (
            Path(clip_benchmark.__file__).parent / "datasets" / "en_zeroshot_classification_templates.json"
        ).read_text()
    )["imagenet1k"]
    names = class_names(N_CLASSES)
    torch.manual_seed(0)
    model = TwoTower(PRESETS["tiny"]).eval()
    tokenizer = build_tokenizer(PRESETS["tiny"])
    build_classifier(model.encode_text, tokenizer, names[:20], templates)  # warm-up: threads, allocator
    start = time.perf_counter()
    ours = build_classifier(model.encode_text, tokenizer, names, templates)  # (D, C)
    ours_s = time.perf_counter() - start
    out = {
        "classes": len(names),
        "templates": len(templates),
        "mmalign_s": ours_s,
        "threads": torch.get_num_threads(),
    }
    if args.cb_classifier:
        start = time.perf_counter()
        theirs = cb_zs.zero_shot_classifier(model, tokenizer, names, templates, "cpu", amp=False)  # (D, C)
        out["clip_benchmark_s"] = time.perf_counter() - start
        out["max_abs_diff"] = float((ours - theirs.float()).abs().max())
    return out


def markdown(z: dict | None, c: dict | None, cmd: str, env: str) -> str:
    lines = [SECTION, "", f"Command: `{cmd}` · {env}", ""]
    if z:
        lines += [
            f"**Zero-shot CIFAR-10** ({z['n']} test images in clip_benchmark's `wds_cifar10` layout, tiny ViT "
            f"at 32 px, batch {z['batch']}, fp32; clip_benchmark with `--num_workers {z['workers']} --no_amp`; "
            f"whole command, start-up and model load included; fastest of {len(z['walls']['mmalign'])}):",
            "",
            "| tool | wall s (each run) | samples/s | top-1 |",
            "|---|---|---|---|",
        ]
        for name in ("clip_benchmark", "mmalign"):
            lines.append(
                f"| {name} | {', '.join(f'{w:.1f}' for w in z['walls'][name])} | "
                f"{z['n'] / z['best'][name]:.0f} | {100 * z['acc1'][name]:.2f}% |"
            )
        goal = "met" if z["ratio"] >= 1.2 else "not met"
        lines += [
            "",
            f"- mmalign / clip_benchmark: **{z['ratio']:.2f}x** samples/s (goal >= 1.2x: {goal})",
            "",
        ]
    if c:
        goal = "met" if c["mmalign_s"] <= 60 else "not met"
        lines += [
            f"**Zero-shot classifier construction**: {c['classes']} synthetic class names x {c['templates']} "
            f"ImageNet templates = {c['classes'] * c['templates']} prompts, tiny text tower, "
            f"{c['threads']} torch threads:",
            "",
            "| tool | seconds | prompts/s |",
            "|---|---|---|",
        ]
        if "clip_benchmark_s" in c:
            lines.append(
                f"| clip_benchmark `zero_shot_classifier` | {c['clip_benchmark_s']:.1f} | "
                f"{c['classes'] * c['templates'] / c['clip_benchmark_s']:.0f} |"
            )
        lines += [
            f"| mmalign `build_classifier` | {c['mmalign_s']:.1f} | "
            f"{c['classes'] * c['templates'] / c['mmalign_s']:.0f} |",
            "",
            f"- goal <= 60 s on 2 CPU cores: {goal}"
            + (
                f"; the two classifiers differ by at most {c['max_abs_diff']:.1e}"
                if "max_abs_diff" in c
                else ""
            ),
        ]
    return "\n".join(lines)


def main() -> None:
    p = parser(__doc__, write_doc="")
    p.add_argument("--parts", default="zeroshot,classifier")
    p.add_argument(
        "--data",
        default=str(ROOT.parent / "shared" / "data" / "cifar10"),
        help="folder with CIFAR-10 test.tar (class folders)",
    )
    p.add_argument("--work", default=str(ROOT / "data" / "bench_eval_speed"))
    p.add_argument("--model", help="a tiny-ViT model folder (default: a seeded random init)")
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--workers", type=int, default=2, help="clip_benchmark's --num_workers (the cores here)")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--no-cb-classifier", dest="cb_classifier", action="store_false")
    args = p.parse_args()
    watch = LoadWatch()
    parts = {s.strip() for s in args.parts.split(",")}
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    z = zeroshot_part(args, work) if "zeroshot" in parts else None
    c = classifier_part(args) if "classifier" in parts else None
    import torch

    env = f"{datetime.date.today().isoformat()} · {cpu_line()} · torch {torch.__version__}"
    cmd = command()
    text = markdown(z, c, cmd, env)
    print("\n" + text)
    (work / "results.json").write_text(json.dumps({"zeroshot": z, "classifier": c}, indent=1))
    if args.write_doc:
        write_section(DOC, text, watch, args.allow_loaded)


if __name__ == "__main__":
    main()
