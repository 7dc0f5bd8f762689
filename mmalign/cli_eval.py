"""``mmalign eval``: a model (folder, run or step checkpoint) on a suite, its records written
next to the model, and the table of results that ``eval`` and ``quickstart`` print.
"""

from __future__ import annotations

from pathlib import Path


def cmd_eval(args) -> int:
    import torch

    from mmalign.evaluation import load_suite, run_suite, write_results
    from mmalign.evaluation.suite import check_suite_data, label_field
    from mmalign.models.load import load

    loaded = load(args.model)  # a model folder, a run directory or RUN/checkpoints/step_N
    train_cfg = loaded.config.get("train_config", {})
    suite_name = args.suite or train_cfg.get("eval", {}).get("suite", "shapes")
    suite = load_suite(suite_name)
    data = train_cfg.get("data", {}).get("val") or None  # the run's own shards, for a shards suite
    check_suite_data(suite, data, user_data=args.data)  # one line before the model is on the device
    if args.limit:
        suite["dataset"] = _limited(suite.get("dataset"), args.limit, label_field(suite))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    loaded.model.to(device)
    records = run_suite(loaded.model, loaded.preprocess, loaded.tokenizer, suite, data, device=device,
                        model_name=str(args.model), batch_size=args.batch_size, progress=True,
                        user_data=args.data)
    out = Path(args.out) if args.out else _eval_out(loaded, Path(args.model), _suite_label(suite_name))
    write_results(records, out)
    _print_table(records)
    print(f"results written to {out}")
    return 0


def _eval_out(loaded, model: Path, label: str) -> Path:
    """MODEL/eval_cli_SUITE.json; for a step checkpoint RUN/eval_cli_SUITE_step_N.json (a
    checkpoint's folder is pruned and replaced by training)."""
    if loaded.kind == "checkpoint":
        return model.resolve().parent.parent / f"eval_cli_{label}_{model.name}.json"
    return model / f"eval_cli_{label}.json"


def _suite_label(name: str) -> str:
    """A suite name or YAML path as a file-name part: ``eval/cifar10.yaml`` -> ``cifar10``."""
    import re

    stem = Path(str(name)).stem if str(name).endswith((".yaml", ".yml")) else str(name)
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", stem).strip("_") or "suite"


def _limited(dataset, limit: int, stratify: str = "label") -> dict:
    """A suite's dataset entry with ``limit`` set (a shard-spec string becomes a mapping).

    The N images are a seeded random draw stratified by ``stratify`` (see
    :mod:`mmalign.evaluation.datasets`), not the first N: shards of a class-sorted source
    would give one class.
    """
    spec = {"type": "shards", "urls": dataset} if dataset is None or isinstance(dataset, str) else dict(dataset)
    return {"stratify": stratify, **spec, "limit": limit}


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
