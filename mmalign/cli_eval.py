"""``mmalign eval``: a model (folder, run or step checkpoint) on a suite, its records written
next to the model, and the table of results that ``eval`` and ``quickstart`` print.

Three routes: a suite (``--suite``, default the run's ``eval.suite``) writes the list of
run_suite's records; a clip_benchmark dataset (``--cb-dataset DIR`` or a suite ``cb:DIR``)
writes the one record clip_benchmark's CLI writes for it; a benchmark (``--benchmark``)
writes a record per task and ``summary.json`` into a folder.
"""

from __future__ import annotations

import json
from pathlib import Path

from mmalign.errors import UsageError


def _check_flags(args) -> None:
    """Flags that exclude each other, before anything loads."""
    if args.benchmark:
        clash = [
            f
            for f, v in (("--suite", args.suite), ("--cb-dataset", args.cb_dataset), ("--data", args.data))
            if v
        ]
        if clash:
            raise UsageError(f"--benchmark runs its own tasks: drop {', '.join(clash)}")
    elif args.root:
        raise UsageError("--root goes with --benchmark (the folder of its clip_benchmark datasets)")
    if args.cb_dataset and args.suite:
        raise UsageError("give one of --suite and --cb-dataset (or --suite cb:DIR)")


def check_not_onnx(model: str) -> None:
    """An ONNX export (``mmalign export --format onnx``: ``*.onnx`` graphs) is for serving, not
    weights eval can load: one line naming the folders it takes, before anything loads."""
    path = Path(model)
    if path.is_dir() and any(path.glob("*.onnx")) and not (path / "model.safetensors").is_file():
        raise UsageError(
            f"--model {model}: an ONNX export is for serving (onnxruntime), not for mmalign eval; "
            f"give the run directory it was exported from, its final/, a step checkpoint "
            f"RUN/checkpoints/step_N, or an open_clip / Hugging Face export folder"
        )


def cmd_eval(args) -> int:
    from mmalign.models.locate import check_exists

    if getattr(args, "wise_ft", None):
        return _cmd_wise_ft(args)
    suites = args.suite or []
    if len(suites) > 1:
        raise UsageError("--suite once per evaluation (several go with --wise-ft; or use --benchmark)")
    args.suite = suites[0] if suites else None
    _check_flags(args)
    check_exists(args.model)  # one line before the seconds of importing torch and open_clip
    check_not_onnx(args.model)
    print(f"mmalign: loading the model from {args.model} ...", flush=True)
    import torch

    from mmalign.evaluation import load_suite, run_suite, write_results
    from mmalign.evaluation.cb_wds import PREFIX, is_cb
    from mmalign.models.load import load

    if args.benchmark:
        return _cmd_benchmark(args)
    split = args.cb_split or "test"
    named = PREFIX + args.cb_dataset if args.cb_dataset else args.suite
    suite = load_suite(named, split) if is_cb(named) else None  # the layout checked before the model loads
    ema = _ema_tag(args)  # --weights ema: the run's EMA weights, their records and file marked
    loaded = load(args.model, weights=getattr(args, "weights", "raw"))  # a model folder, a run, a step_N
    train_cfg = loaded.config.get("train_config", {})
    suite_name = named or train_cfg.get("eval", {}).get("suite", "shapes")
    if suite is None:
        suite = load_suite(suite_name, split)
    if args.cb_split and "cb" not in suite:
        raise UsageError(f"--cb-split goes with --cb-dataset or a cb:DIR suite, not suite {suite_name!r}")
    data = train_cfg.get("data", {}).get("val") or None  # the run's own shards, for a shards suite
    _fit_suite(suite, data, args)  # one line before the model is on the device
    device = "cuda" if torch.cuda.is_available() else "cpu"
    loaded.model.to(device)
    records = run_suite(
        loaded.model,
        loaded.preprocess,
        loaded.tokenizer,
        suite,
        data,
        device=device,
        model_name=str(args.model) + ema,
        batch_size=args.batch_size,
        progress=True,
        user_data=args.data,
    )
    if "cb" in suite:  # clip_benchmark's record, one object, as its CLI writes it
        from mmalign.evaluation.cb_wds import cb_record

        label = "cb_" + _suite_label(suite["cb"]["dataset"].split("/", 1)[-1]) + ema.replace("+", "_")
        out = Path(args.out) if args.out else _eval_out(loaded, Path(args.model), label)
        write_record(cb_record(records[0], suite, pretrained=str(args.model)), out)
    else:
        label = _suite_label(suite_name) + ema.replace("+", "_")
        out = Path(args.out) if args.out else _eval_out(loaded, Path(args.model), label)
        write_results(records, out)
    _print_table(records)
    print(f"results written to {out}")
    return 0


def _cmd_wise_ft(args) -> int:
    """``--model A --wise-ft B --alphas ...``: each alpha's interpolated model (WiSE-FT, built in
    memory) on every ``--suite``; all records written as one results JSON (each with its
    ``wise_ft`` alpha), and the curve printed: alpha against each task's main metric."""
    from mmalign.models.locate import check_exists
    from mmalign.models.wise_ft import parse_alphas

    alphas = parse_alphas(args.alphas, "--alphas")
    if getattr(args, "weights", "raw") != "raw":
        raise UsageError(
            f"--weights {args.weights} reads one model; with --wise-ft give the EMA folder itself "
            f"(e.g. --wise-ft RUN/final_ema)"
        )
    clash = [f for f, v in (("--benchmark", args.benchmark), ("--root", args.root)) if v]
    if clash:
        raise UsageError(f"--wise-ft evaluates suites (--suite, repeatable): drop {', '.join(clash)}")
    for flag, model in (("--model", args.model), ("--wise-ft", args.wise_ft)):
        try:
            check_exists(model, flag)  # a model name: found in the hub cache, or fetched now
            check_not_onnx(model)
        except UsageError as e:
            line = str(e).replace("--model ", f"{flag} ", 1) if str(e).startswith("--model ") else str(e)
            raise UsageError(line if flag in line else f"{flag}: {line}") from None
    print(f"mmalign: loading the models from {args.model} and {args.wise_ft} ...", flush=True)
    import torch

    from mmalign.evaluation import load_suite, run_suite, write_results
    from mmalign.evaluation.cb_wds import PREFIX
    from mmalign.models.load import load
    from mmalign.models.wise_ft import check_compatible, mixed_model

    zero_shot, fine_tuned = load(args.model), load(args.wise_ft)
    check_compatible(zero_shot, fine_tuned, ("--model", "--wise-ft"))
    train_cfg = fine_tuned.config.get("train_config") or zero_shot.config.get("train_config") or {}
    named = list(args.suite or []) + ([PREFIX + args.cb_dataset] if args.cb_dataset else [])
    named = named or [train_cfg.get("eval", {}).get("suite", "shapes")]
    data = train_cfg.get("data", {}).get("val") or None  # the fine-tuning run's shards, for a shards suite
    suites = []
    for name in named:  # every suite's data checked before the first forward
        suite = load_suite(name, args.cb_split or "test")
        suites.append(_fit_suite(suite, data, args))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    base = {k: v.detach().clone() for k, v in zero_shot.model.state_dict().items()}  # (the zero-shot weights)
    model = zero_shot.model.to(device)
    records = []
    for alpha in alphas:
        mixed_model(zero_shot, fine_tuned, alpha, base=base, into=model)
        for suite in suites:
            for record in run_suite(
                model,
                zero_shot.preprocess,
                zero_shot.tokenizer,
                suite,
                data,
                device=device,
                model_name=f"{args.model}+wise_ft({args.wise_ft}, alpha={alpha:g})",
                batch_size=args.batch_size,
                progress=True,
                user_data=args.data,
            ):
                record["wise_ft"] = {
                    "zero_shot": str(args.model),
                    "fine_tuned": str(args.wise_ft),
                    "alpha": alpha,
                }
                records.append(record)
    label = "wise_ft_" + "_".join(_suite_label(str(n)) for n in named)
    out = Path(args.out) if args.out else _eval_out(fine_tuned, Path(args.wise_ft), label)
    write_results(records, out)
    print_curve(records)
    print(f"results written to {out}")
    return 0


def curve(records: list[dict]) -> tuple[list[str], list[tuple[float, list[float | None]]]]:
    """The WiSE-FT curve of ``records`` (each with its ``wise_ft`` alpha): the columns (a
    task's dataset and main metric) and, per alpha in order, each column's value."""
    from mmalign.evaluation.benchmark import _main_value

    columns: list[str] = []
    rows: dict[float, dict[str, float | None]] = {}
    for record in records:
        metric, value, _ = _main_value(record, None)
        if metric is None:
            continue  # a diagnostics task: no main metric to plot
        column = f"{record['dataset']} {metric}"
        if column not in columns:
            columns.append(column)
        rows.setdefault(record["wise_ft"]["alpha"], {})[column] = value
    return columns, [(alpha, [row.get(c) for c in columns]) for alpha, row in rows.items()]


def print_curve(records: list[dict]) -> None:
    from rich.console import Console
    from rich.table import Table

    columns, rows = curve(records)
    table = Table(title="WiSE-FT: alpha (0 zero-shot, 1 fine-tuned) against each task's main metric")
    for col in ["alpha", *columns]:
        table.add_column(col)
    for alpha, values in rows:
        table.add_row(f"{alpha:g}", *("n/a" if v is None else f"{v:.4f}" for v in values))
    Console(width=max(100, 24 * (len(columns) + 1))).print(table)


def write_record(record: dict, path: Path) -> Path:
    """One clip_benchmark record as its CLI writes it (``json.dump``, one line; NaN as ``NaN``)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record))
    return path


def _cmd_benchmark(args) -> int:
    import torch

    from mmalign.evaluation import write_results
    from mmalign.evaluation.benchmark import load_benchmark, run_benchmark, summary
    from mmalign.evaluation.suite import check_suite_data, label_field
    from mmalign.models.load import load

    name, tasks = load_benchmark(args.benchmark, args.root, args.cb_split or "test")
    present = [t for t in tasks if t.status == "present"]
    for task in present:  # every dataset's files checked before the model loads
        suite = task.loaded()
        check_suite_data(suite)
        if args.limit:
            suite["dataset"] = _limited(suite.get("dataset"), args.limit, label_field(suite))
    loaded = load(args.model, weights=getattr(args, "weights", "raw"))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    loaded.model.to(device)
    run_benchmark(
        loaded.model,
        loaded.preprocess,
        loaded.tokenizer,
        tasks,
        batch_size=args.batch_size,
        device=device,
        pretrained=str(args.model),
        progress=True,
    )
    out = (
        Path(args.out)
        if args.out
        else _eval_out(loaded, Path(args.model), f"benchmark_{_suite_label(name)}", suffix="")
    )
    out.mkdir(parents=True, exist_ok=True)
    for task in present:
        for row in task.rows:
            row["file"] = f"{_suite_label(row['dataset'].replace('/', '-'))}.json"
            if "cb" in task.loaded():  # clip_benchmark's record, as its CLI writes it
                write_record(row["record"], out / row["file"])
            else:
                write_results([row["record"]], out / row["file"])
    result = summary(name, tasks, model=str(args.model), root=args.root, limit=args.limit)
    (out / "summary.json").write_text(json.dumps(result, indent=2))
    _print_benchmark(result)
    print(f"results written to {out}/ (summary.json and one record per task)")
    return 0


def _print_benchmark(result: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"mmalign benchmark {result['benchmark']}")
    for col in ("task", "main metric", "value", "note"):
        table.add_column(col)
    for row in result["tasks"]:
        value = "n/a" if row["value"] is None else f"{row['value']:.4f}"
        table.add_row(row["task"], row["main_metric"] or "-", value, row["note"])
    Console().print(table)
    if result["average"] is None:
        print("average: n/a (no task scored)")
    else:
        missing = len(result["absent"]) + len(result["unsupported"]) + len(result["undefined"])
        mark = f" (partial: {missing} task(s) missing)" if result["partial"] else ""
        print(f"average over {result['average_over']} task(s): {result['average']:.4f}{mark}")
    for status in ("absent", "unsupported", "not_scored", "undefined"):
        if result[status]:
            print(f"{status.replace('_', ' ')} ({len(result[status])}): {', '.join(result[status])}")


def _eval_out(loaded, model: Path, label: str, suffix: str = ".json") -> Path:
    """MODEL/eval_cli_SUITE.json; for a step checkpoint RUN/eval_cli_SUITE_step_N.json (a
    checkpoint's folder is pruned and replaced by training).  ``suffix=""``: a folder's name.
    A model name (``ARCH/TAG``, ``ORG/NAME``): ``./eval_cli_SUITE_ARCH_TAG.json``, never inside the
    shared Hugging Face cache nor a folder spelled like the name (which would then shadow it)."""
    from mmalign.models.hub import is_name

    if is_name(str(model)):
        return Path(f"eval_cli_{label}_{_suite_label(str(model))}{suffix}")
    if loaded.kind == "checkpoint":
        return model.resolve().parent.parent / f"eval_cli_{label}_{model.name}{suffix}"
    return model / f"eval_cli_{label}{suffix}"


def _ema_tag(args) -> str:
    """``+ema`` under ``--weights ema`` (after the model's name; ``_ema`` in a file name), else empty."""
    return "+ema" if getattr(args, "weights", "raw") == "ema" else ""


def _suite_label(name: str) -> str:
    """A suite name or YAML path as a file-name part: ``eval/cifar10.yaml`` -> ``cifar10``."""
    import re

    stem = Path(str(name)).stem if str(name).endswith((".yaml", ".yml")) else str(name)
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", stem).strip("_") or "suite"


def _fit_suite(suite: dict, data: str | None, args) -> dict:
    """``suite`` with its data checked against what its tasks read (one line each) and cut to
    ``--limit``; ``data``: the run's own ``data.val``, for a shards suite without ``--data``."""
    from mmalign.evaluation.suite import check_suite_data, label_field
    from mmalign.evaluation.suite_fit import check_suite_fields

    spec = check_suite_data(suite, data, user_data=args.data)
    check_suite_fields(
        suite,
        spec,
        "--data" if args.data else "data.val" if data else "its own dataset",
        key="--suite",
        flag="--suite ",
        nothing="or --data with shards that have the field",
    )
    if args.limit:
        suite["dataset"] = _limited(suite.get("dataset"), args.limit, label_field(suite))
    return suite


def _limited(dataset, limit: int, stratify: str = "label") -> dict:
    """A suite's dataset entry with a seeded, stratified draw of ``limit`` images: the one
    draw, shared with eval.during's ``limit`` (:mod:`mmalign.evaluation.limited`; imported
    here, not at the top: ``mmalign --help`` imports this module, and that one imports torch)."""
    from mmalign.evaluation.limited import limited_dataset

    return limited_dataset(dataset, limit, stratify)


def _print_table(records: list[dict]) -> None:
    from rich.console import Console
    from rich.table import Table

    from mmalign.evaluation import summary_rows

    table = Table(title="mmalign evaluation")
    for col in ("task", "metric", "value"):
        table.add_column(col)
    for task, metric, value in summary_rows(records):
        table.add_row(task, metric, "n/a" if value is None else f"{value:.3f}")
    Console().print(table)
    from mmalign.evaluation.caveats import note_lines

    for line in note_lines(records):  # Recall@k over class-template captions
        print(line)
