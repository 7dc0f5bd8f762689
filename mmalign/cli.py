"""The ``mmalign`` command line (thin: parse, call, report).

User mistakes (bad config keys, missing files) end with a one-line error and exit
code 2, never a traceback.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from mmalign.errors import UsageError, UserError


def _no_default(action: argparse.Action) -> bool:
    # identity, not ==: a default of 0 is worth showing, False (an off switch) is not;
    # nor is the empty list a repeatable flag starts from
    return any(action.default is v for v in (None, False, argparse.SUPPRESS)) or action.default == []


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """``--help`` shows every flag's default, except where there is none to show (None, an
    off switch) or the help text already states it."""

    def _get_help_string(self, action):
        text = action.help or ""
        if _no_default(action) or "default" in text or action.required:
            return text
        return super()._get_help_string(action)


class _Parser(argparse.ArgumentParser):
    """Every (sub-)parser gets :class:`_HelpFormatter` (sub-parsers are made of the parent's class)."""

    def __init__(self, *args, formatter_class=_HelpFormatter, **kwargs):
        super().__init__(*args, formatter_class=formatter_class, **kwargs)

    def error(self, message: str):
        # A usage mistake is one line and exit 2 like any other (argparse prints the usage first).
        raise UsageError(f"{message} (see `{self.prog} --help`)")


class _RawDescriptionFormatter(argparse.RawDescriptionHelpFormatter, _HelpFormatter):
    """Defaults as :class:`_HelpFormatter`; the description's line breaks kept (a table of routes)."""


# The export formats (mmalign.export.FORMATS; not imported here: it pulls in torch).
EXPORT_FORMATS = ("open_clip", "hf", "onnx")


def _add_config_args(p: argparse.ArgumentParser, default_config: str | None = None) -> None:
    p.add_argument("--config", default=default_config,
                   help="experiment YAML, or a shipped recipe's name, e.g. cifar10_cpu (defaults: the embedded quickstart)")
    p.add_argument("--output", help="run directory (overrides the config's output)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config key, e.g. --set train.steps=100 (repeatable)")


def _load(args, world_size: int = 1) -> "Config":  # noqa: F821
    from mmalign.config import load_config

    overrides = list(args.set)
    if args.output:
        overrides.append(f"output={args.output}")
    return load_config(args.config, overrides, world_size)


def _world_size(nproc: int, env) -> int:
    """The ranks this ``mmalign train`` trains on, known before torch is imported: ``--nproc``'s
    own, else the launcher's (the variables mmalign.dist.distributed.env_dist_info reads)."""
    if nproc > 1 and "RANK" not in env:
        return nproc
    if "RANK" in env and "WORLD_SIZE" in env:
        return int(env["WORLD_SIZE"])
    if "SLURM_PROCID" in env and "SLURM_NTASKS" in env:
        return int(env["SLURM_NTASKS"])
    return 1


def cmd_train(args) -> int:
    # resolved and validated once, at the run's world size, before spawning anything (and before importing torch)
    cfg = _load(args, _world_size(args.nproc, os.environ))
    from mmalign.models import check_buildable

    meta_model = check_buildable(cfg.model)
    from mmalign.run.rundir import check_fresh_start

    from mmalign.dist import cluster

    cluster.check_nproc(args.nproc, os.environ)  # not N local ranks per rank of a multi-node job
    typed_resume = args.resume
    restart = _continue_on_restart(args, Path(cfg.output))
    try:  # before spawning ranks or DeepSpeed; with cfg: a finished run is not restarted by --resume
        check_fresh_start(Path(cfg.output), args.resume, args.overwrite, cfg)
    except UserError as e:
        if not restart or typed_resume == "latest":  # the hint would repeat what the line already says
            raise
        raise type(e)(f"{e} (this is torchrun's restart {restart}: put --resume latest on the launch line, "
                          f"so that a restart continues the run)") from None
    if args.nproc > 1 and "RANK" not in os.environ:
        from mmalign.dist.launch import launch_local

        _check_batchnorm(cfg, meta_model, args.nproc)
        from mmalign.run.train import resolve_suite

        resolve_suite(cfg)  # eval.suite and its data, once here rather than once per rank
        return launch_local(args.nproc, args.argv)
    from mmalign.dist import distributed as mdist
    from mmalign.run.train import train

    out = train(cfg, resume=args.resume, overwrite=args.overwrite)
    if mdist.get_rank() == 0:
        written = "final/ weights, metrics.jsonl" + (", eval.json" if (out / "eval.json").exists() else "")
        print(f"run written to {out} ({written})")
    mdist.shutdown()
    return 0


def _continue_on_restart(args, out: Path) -> int:
    """Under a torchrun restart (TORCHELASTIC_RESTART_COUNT >= 1) the launch line runs again
    as it was typed.  ``--overwrite`` would delete the checkpoints this job wrote, and an older
    ``--resume PATH`` would, at its first save, prune every newer checkpoint and move
    ``latest`` back: a restart instead continues from the run's ``latest`` (with nothing saved
    yet, from step 0).  Returns the restart count (0: the first attempt)."""
    from mmalign.dist import cluster

    restart = cluster.restart_count(os.environ)
    if not restart or not (args.overwrite or args.resume not in (None, "latest")):
        return restart  # the first attempt, or a line that already continues the run
    has_latest = (out / "checkpoints" / "latest").is_file()
    given = " ".join(flag for flag, on in (("--overwrite", args.overwrite),
                                           (f"--resume {args.resume}", args.resume not in (None, "latest"))) if on)
    if args.overwrite or has_latest:
        args.overwrite, args.resume = False, "latest"
    if os.environ.get("RANK", "0") == "0":
        print(f"mmalign: torchrun restart {restart}: continuing the run from its latest checkpoint, if any "
              f"(`{given}` is not applied again)" if args.resume == "latest" else
              f"mmalign: torchrun restart {restart}: no checkpoint in {out}; `{given}` applies as given", flush=True)
    return restart


def _check_batchnorm(cfg, model, world_size: int) -> None:
    """The engine's BatchNorm gate, once before spawning ranks (each would print it), on the
    meta-device model of :func:`~mmalign.models.check_buildable`."""
    from mmalign.run.gradcache import chunk_sizes
    from mmalign.models.batchnorm import check_batchnorm

    local = cfg.train.global_batch_size // world_size
    chunk = cfg.train.grad_cache_chunk_size
    # auto: chosen per run from a memory measurement (mmalign.run.memory_plan); the engine checks again with it
    chunks = len(chunk_sizes(local, chunk)) if isinstance(chunk, int) else 1
    check_batchnorm(model, cfg.model.batchnorm, chunks=chunks, world_size=world_size)


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


def cmd_report(args) -> int:
    from mmalign.evaluation.report import write_report

    out = write_report(args.run, args.output, suite=args.suite, data=args.data, limit=args.limit, progress=True)
    print(f"report written to {out}")
    return 0


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


def quickstart_verdict(records: list[dict]) -> list[str]:
    """The quickstart's promise: shape zero-shot >= 2x chance, text->image R@5 >= 3x chance."""
    from mmalign.quickstart import verdict

    return verdict(records)


def cmd_quickstart(args) -> int:
    from mmalign.quickstart import PhaseClock, run

    clock = PhaseClock()  # from the process start: the summary prints each phase's time

    def load():
        if args.config is None:  # the shipped recipe: the config defaults' settings, with their comments
            from mmalign.resources import RECIPES, shipped

            args.config = str(shipped(RECIPES, "quickstart"))
        return _load(args)

    # data: `mmalign shards shapes --out data/shapes`, the registered builder
    return run(clock, load, lambda out: _run_command("shards", ["shapes", "--out", out]), _print_table)


def _run_command(name: str, argv: list[str]) -> None:
    """Run a sub-command another package adds (:mod:`mmalign.commands`), e.g. the shapes builder."""
    from mmalign.commands import discover

    if name not in discover():
        raise UsageError(f"`mmalign {name}` is not installed (it comes with the package's data_pipelines "
                         f"through the mmalign.commands entry points): install mmalign again, e.g. pip install -e .")
    args = build_parser().parse_args([name, *argv])
    args.func(args)


def cmd_models(args) -> int:
    from mmalign.models.presets import describe_presets

    header = f"{'preset':<36} {'parameters':>11} {'image':>6}"
    print(header, flush=True)
    for row in describe_presets(include_unavailable=args.all):  # rows stream: building each takes ~0.1-1 s
        if row["offline"]:
            print(f"{row['name']:<36} {row['params'] / 1e6:>10.1f}M {row['image_size']:>6}", flush=True)
        else:
            print(f"{row['name']:<36} {'-':>11} {'-':>6}  [not offline: {row['why']}]", flush=True)
    if not args.all:
        print("(presets that need a download are hidden; --all lists them, marked)")
    return 0


def cmd_export(args) -> int:
    from mmalign.export import export

    out = export(args.model, args.format, args.out, force=args.force)
    print(f"{args.format} export written to {out}")
    return 0


def cmd_embed(args) -> int:
    from mmalign.search.embed import embed

    info = embed(args.model, args.data, args.out, batch_size=args.batch_size, part_size=args.part_size,
                 device=args.device)
    print(f"{info['images']} images, {info['rows']} rows (dim {info['dim']}) in {info['parts']} part(s) -> {args.out}")
    return 0


def cmd_index(args) -> int:
    from mmalign.search.index import build_index

    info = build_index(args.emb, args.out, exact_max=args.exact_max, nlist=args.nlist, pq_m=args.pq_m,
                       nbits=args.nbits, nprobe=args.nprobe)
    for name in ("image", "text"):
        if name in info:
            print(f"{name}: {info[name]['count']} vectors, {info[name]['factory']} (inner product, dim {info['dim']})")
    print(f"index written to {args.out}")
    return 0


def cmd_search(args) -> int:
    from mmalign.search.searcher import Searcher, format_hits

    if (args.text is None) == (args.image is None):
        raise UsageError("search: give exactly one of --text or --image")
    searcher = Searcher(args.index, args.model)
    dedupe = not args.no_dedupe
    hits = searcher.text(args.text, args.k, args.against, dedupe) if args.text is not None else \
        searcher.image(args.image, args.k, args.against, dedupe)
    print(format_hits(hits))
    return 0


def cmd_serve(args) -> int:
    from mmalign.search.serve import serve

    serve(args.index, args.model, host=args.host, port=args.port, max_k=args.max_k, timeout=args.timeout,
          workers=args.workers, max_connections=args.max_connections)
    return 0


def build_parser() -> argparse.ArgumentParser:
    from mmalign import __version__
    from mmalign.search.serve_page import ROUTES_HELP

    parser = _Parser(prog="mmalign", description="CLIP-style image-text pretraining toolkit")
    parser.add_argument("--version", action="version", version=f"mmalign {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("train", help="train a model from a config")
    _add_config_args(p)
    p.add_argument("--nproc", type=int, default=1, help="local processes (gloo on CPU, nccl on GPU)")
    p.add_argument("--resume", help="'latest' (the run directory's newest loadable checkpoint; nothing to resume "
                   "yet is a fresh start, unless the directory holds a finished run (final/) or another "
                   "config's run) or a checkpoint path RUN/checkpoints/step_N")
    p.add_argument("--overwrite", action="store_true",
                   help="start over in a run directory that is not empty (removes the earlier run's files)")
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("eval", help="evaluate a saved model on a suite")
    p.add_argument("--model", required=True, help="a run directory, its final/, or RUN/checkpoints/step_N")
    p.add_argument("--suite", help="a shipped suite's name (eval/) or a suite YAML (default: the run's)")
    p.add_argument("--data", help="evaluation data: shards for a shards suite (default: the run's data.val), "
                   "or a directory / tar of class folders for an imagefolder suite (default: the suite's path)")
    p.add_argument("--output", "--out", dest="out",
                   help="results JSON (default: MODEL/eval_cli_SUITE.json, for a step checkpoint "
                   "RUN/eval_cli_SUITE_step_N.json; the run's own eval.json is kept)")
    p.add_argument("--limit", type=int,
                   help="evaluate N images: a seeded random draw, stratified by the first zero-shot task's label")
    p.add_argument("--batch-size", type=int, default=256, help="images / captions per encoder call")
    p.set_defaults(func=cmd_eval)

    p = sub.add_parser("report", help="HTML page + PNGs of a run: curves, similarity histograms, t-SNE, Recall@k")
    p.add_argument("--run", required=True, help="a run directory (metrics.jsonl, final/, eval.json)")
    p.add_argument("--output", help="report directory (default: RUN/report)")
    p.add_argument("--suite", help="suite whose dataset is embedded (default: the run's)")
    p.add_argument("--data", help="evaluation data: shards for a shards suite (default: the run's data.val), "
                   "or a directory / tar of class folders for an imagefolder suite (default: the suite's path)")
    p.add_argument("--limit", type=int, default=1000, help="images embedded for the plots")
    p.set_defaults(func=cmd_report)

    p = sub.add_parser("quickstart", help="generate data, train, evaluate and save the embedded default")
    _add_config_args(p)
    p.set_defaults(func=cmd_quickstart)

    p = sub.add_parser("models", help="list architecture presets that build offline (parameters, image size)")
    p.add_argument("--all", action="store_true", help="also list the presets that need a download, marked")
    p.set_defaults(func=cmd_models)

    p = sub.add_parser("export", help="export a model (final/ or a step checkpoint) as open_clip, hf or onnx")
    p.add_argument("--model", required=True, help="a run directory, its final/, or RUN/checkpoints/step_N")
    p.add_argument("--format", required=True, choices=EXPORT_FORMATS, help="output format")
    p.add_argument("--out", required=True, help="output directory (must be empty or absent)")
    p.add_argument("--force", action="store_true", help="replace a non-empty --out")
    p.set_defaults(func=cmd_export)

    p = sub.add_parser("embed", help="embed a dataset into clip-retrieval's layout (img_emb/, text_emb/, metadata/)")
    p.add_argument("--model", required=True, help="a run directory, its final/, or RUN/checkpoints/step_N")
    p.add_argument("--data", required=True, help="shards (dir/{00000..00009}.tar), a directory of .tar, or an image folder")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--part-size", type=int, default=100_000, help="rows per img_emb_N/text_emb_N/metadata_N part")
    p.add_argument("--device", default="cpu")
    p.set_defaults(func=cmd_embed)

    p = sub.add_parser("index", help="build FAISS inner-product indexes from `mmalign embed` output")
    p.add_argument("--emb", required=True, help="an `mmalign embed` output directory")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--exact-max", type=int, default=100_000,
                   help="corpora up to this size get an exact IndexFlatIP, larger ones IVF-PQ")
    p.add_argument("--nlist", type=int, help="IVF lists (default ~4 sqrt(n))")
    p.add_argument("--pq-m", type=int, help="PQ sub-quantizers, a divisor of the dim (default ~dim/4)")
    p.add_argument("--nbits", type=int, help="bits per PQ code (default 8)")
    p.add_argument("--nprobe", type=int, default=16, help="IVF lists probed per query")
    p.set_defaults(func=cmd_index)

    p = sub.add_parser("search", help="query an index with text or an image")
    p.add_argument("--index", required=True, help="an `mmalign index` output directory")
    p.add_argument("--model", required=True, help="the model that made the embeddings")
    p.add_argument("--text", help="a text query")
    p.add_argument("--image", help="an image file as the query")
    p.add_argument("-k", type=int, default=10, help="results to show")
    p.add_argument("--against", default="image", choices=("image", "text"),
                   help="search the image index or the caption index")
    p.add_argument("--no-dedupe", action="store_true",
                   help="--against text: keep identical captions (default: one row per distinct caption, its best)")
    p.set_defaults(func=cmd_search)

    p = sub.add_parser("serve", help="answer search queries over HTTP (JSON; 127.0.0.1 by default)",
                       description=ROUTES_HELP, formatter_class=_RawDescriptionFormatter)
    p.add_argument("--index", required=True, help="an `mmalign index` output directory")
    p.add_argument("--model", required=True, help="the model that made the embeddings")
    p.add_argument("--host", default="127.0.0.1", help="bind address (127.0.0.1: local)")
    p.add_argument("--port", type=int, default=8765)
    p.add_argument("--max-k", type=int, default=100, help="largest k a request may ask for")
    p.add_argument("--timeout", type=float, default=10.0, metavar="S",
                   help="seconds a request has to arrive whole (else 408), and its reply to be written")
    p.add_argument("--workers", type=int, default=8, metavar="N", help="threads that answer complete requests")
    p.add_argument("--max-connections", type=int, default=256, metavar="N",
                   help="connections open at once; more wait in the listen backlog")
    p.set_defaults(func=cmd_serve)

    from mmalign.commands import add_commands, discover

    # shards, mine, tokenizer: declared by data_pipelines as entry points (mmalign does not import it)
    add_commands(sub, discover(reserved=sub.choices))
    _show_bare_defaults(parser)
    return parser


def _show_bare_defaults(parser: argparse.ArgumentParser) -> None:
    """argparse prints no help line, hence no default, for a flag declared without help text."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                _show_bare_defaults(sub)
        elif action.help is None and not _no_default(action):
            action.help = "(default: %(default)s)"


def drop_local_rank(argv: list[str]) -> list[str]:
    """The deepspeed launcher inserts ``--local_rank=N`` before the sub-command; the
    LOCAL_RANK environment variable (which it also sets) is what we use."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg in ("--local_rank", "--local-rank"):
            skip = True
        elif not arg.startswith(("--local_rank=", "--local-rank=")):
            out.append(arg)
    return out


def _lost_peer(e: BaseException) -> str | None:
    """One line when ``e`` is a collective that lost another rank (see mmalign.dist.distributed)."""
    if "torch.distributed" not in sys.modules:
        return None
    from mmalign.dist.distributed import lost_peer

    return lost_peer(e)


def main(argv: list[str] | None = None) -> int:
    argv = drop_local_rank(sys.argv[1:] if argv is None else argv)
    try:
        args = build_parser().parse_args(argv)
        args.argv = argv
        return args.func(args)
    except UserError as e:  # ConfigError or UsageError
        print(f"mmalign: error: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # a stopped run: one line, not a traceback
        if type(e).__name__ == "RunStopped":
            print(f"mmalign: stopped: {e}", file=sys.stderr)
            return 1
        lost = _lost_peer(e)
        if lost is None:
            raise
        print(f"mmalign: error: {lost}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        # Not a normal exit: tearing down a process group whose peer is gone can block on
        # that peer (the reason we are here), so this rank leaves at once.
        os._exit(1)
    except KeyboardInterrupt as e:
        if not getattr(e, "reported", False):  # a training run already said where it stopped (mmalign.run.signals)
            print("mmalign: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
