"""The ``mmalign`` command line (thin: parse, call, report).

User mistakes (bad config keys, missing files) end with a one-line error and exit
code 2, never a traceback.
"""

from __future__ import annotations

import argparse
import os
import sys

from mmalign.cli_embed import cmd_embed
from mmalign.cli_eval import _print_table, cmd_eval
from mmalign.cli_model import add_weights_arg, ema_folder, loading
from mmalign.cli_train import _load, _world_size, cmd_train  # noqa: F401 (_world_size: tested here)
from mmalign.errors import RunStopped, UsageError, UserError


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
    p.add_argument(
        "--config",
        default=default_config,
        help="experiment YAML, or a shipped recipe's name, e.g. cifar10_cpu (defaults: the embedded quickstart)",
    )
    p.add_argument("--output", help="run directory (overrides the config's output)")
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config key, e.g. --set train.steps=100 (repeatable)",
    )


def cmd_report(args) -> int:
    if not os.path.isdir(args.run):  # before torch, and before the report folder is made
        raise UsageError(f"--run: {args.run} is not a run directory")
    print(f"mmalign: loading the run's model from {args.run} ...", flush=True)
    from mmalign.evaluation.report import write_report

    out = write_report(
        args.run, args.output, suite=args.suite, data=args.data, limit=args.limit, progress=True
    )
    print(f"report written to {out}")
    return 0


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
        raise UsageError(
            f"`mmalign {name}` is not installed (it comes with the package's data_pipelines "
            f"through the mmalign.commands entry points): install mmalign again, e.g. pip install -e ."
        )
    args = build_parser().parse_args([name, *argv])
    args.func(args)


def cmd_models(args) -> int:
    if args.fetch:  # models by name: into the Hugging Face cache (models/hub.py)
        from mmalign.models.hub import resolve

        for name in args.fetch:
            print(f"{name}: {resolve(name, '--fetch')}", flush=True)
        return 0
    if args.pretrained is not None:  # open_clip's registry, read from its files: no torch
        from mmalign.models.pretrained_list import listing

        for line in listing(args.pretrained or None):
            print(line, flush=True)
        return 0
    from mmalign.models.preset_table import describe, stale

    if todo := stale():  # presets new or changed since the shipped table: each is built on the meta device
        print(
            f"mmalign: counting the parameters of {len(todo)} preset(s) not in the shipped table "
            f"({', '.join(todo[:3])}{', ...' if len(todo) > 3 else ''}): building each takes ~0.1-1 s",
            flush=True,
        )
    header = f"{'preset':<36} {'parameters':>11} {'image':>6}"
    print(header, flush=True)
    for row in describe(include_unavailable=args.all):  # from the shipped table: no model is built
        if row["offline"]:
            print(f"{row['name']:<36} {row['params'] / 1e6:>10.1f}M {row['image_size']:>6}", flush=True)
        else:
            print(f"{row['name']:<36} {'-':>11} {'-':>6}  [not offline: {row['why']}]", flush=True)
    if not args.all:
        print("(presets that need a download are hidden; --all lists them, marked)")
    return 0


def cmd_export(args) -> int:
    loading(args.model)
    from mmalign.export import export

    out = export(args.model, args.format, args.out, force=args.force, weights=args.weights)
    print(f"{args.format} export written to {out}")
    return 0


def cmd_index(args) -> int:
    from mmalign.search.index_plan import parse_size  # torch-free: bad input fails in milliseconds

    budget = None if args.max_index_memory is None else parse_size(args.max_index_memory)
    if args.shards < 1:
        raise UsageError(f"--shards: {args.shards} must be at least 1")
    if not os.path.isfile(
        os.path.join(args.emb, "embed.json")
    ):  # mmalign.search.embed.EMBED_INFO; before torch
        raise UsageError(
            f"--emb: {args.emb} is not an embedding directory (no embed.json; run `mmalign embed`)"
        )
    from mmalign.search.index import build_index

    info = build_index(
        args.emb,
        args.out,
        exact_max=args.exact_max,
        nlist=args.nlist,
        pq_m=args.pq_m,
        nbits=args.nbits,
        nprobe=args.nprobe,
        max_index_memory=budget,
        max_query_ms=args.max_query_ms,
        min_recall=args.min_recall,
        shards=args.shards,
        kind=args.kind,
        log=print,
    )
    for name in ("image", "text"):
        if name in info:
            e = info[name]
            print(
                f"{name}: {e['count']} vectors, {e['factory']} (inner product, dim {info['dim']}) "
                f"in {len(e['shards'])} shard(s), search {e['search']}, recall@10 {e['recall']['@10']}, "
                f"p50 {e['latency_ms']['p50']} ms"
            )
    print(f"index written to {args.out}")
    return 0


def cmd_search(args) -> int:
    if (args.text is None) == (args.image is None):
        raise UsageError("search: give exactly one of --text or --image")
    _check_index(args.index)
    loading(args.model, data_on_stdout=True)
    from mmalign.search.searcher import Searcher, format_hits

    with Searcher(args.index, args.model, mmap=args.mmap) as searcher:
        dedupe = not args.no_dedupe
        hits = (
            searcher.text(args.text, args.k, args.against, dedupe)
            if args.text is not None
            else searcher.image(args.image, args.k, args.against, dedupe)
        )
    print(format_hits(hits))  # a url column when any hit has one
    return 0


INDEX_INFO = "index.json"  # mmalign.search.index.INDEX_INFO (importing it imports torch: seconds)


def _check_index(index: str) -> None:
    """The Searcher's first check, before torch and the model load (the same line)."""
    if not os.path.isfile(os.path.join(index, INDEX_INFO)):
        raise UsageError(f"--index: {index} is not an index directory (no {INDEX_INFO}; run `mmalign index`)")


def cmd_serve(args) -> int:
    from mmalign.search.serve_indexes import parse_indexes

    for _, index in parse_indexes(args.index):
        _check_index(index)
    loading(args.model)
    ema_folder(args)
    from mmalign.search.serve import serve

    serve(
        args.index,
        args.model,
        host=args.host,
        port=args.port,
        max_k=args.max_k,
        timeout=args.timeout,
        workers=args.workers,
        max_connections=args.max_connections,
        max_per_client=args.max_per_client,
        mmap=args.mmap,
        cors=args.cors,
        allow_url_queries=args.allow_url_queries,
    )
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
    p.add_argument(
        "--resume",
        help="'latest' (the run directory's newest loadable checkpoint; nothing to resume "
        "yet is a fresh start, unless the directory holds a finished run (final/) or another "
        "config's run) or a checkpoint path RUN/checkpoints/step_N",
    )
    p.add_argument(
        "--overwrite",
        action="store_true",
        help="start over in a run directory that is not empty (removes the earlier run's files)",
    )
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("eval", help="evaluate a saved model on a suite")
    p.add_argument("--model", required=True, help="a run directory, its final/, or RUN/checkpoints/step_N")
    p.add_argument(
        "--suite",
        action="append",
        help="a shipped suite's name (eval/) or a suite YAML (default: the run's); "
        "repeatable with --wise-ft (a curve per suite)",
    )
    p.add_argument(
        "--data",
        help="evaluation data: shards for a shards suite (default: the run's data.val), "
        "or a directory / tar of class folders for an imagefolder suite (default: the suite's path)",
    )
    p.add_argument(
        "--output",
        "--out",
        dest="out",
        help="results JSON (default: MODEL/eval_cli_SUITE.json, for a step checkpoint "
        "RUN/eval_cli_SUITE_step_N.json; the run's own eval.json is kept)",
    )
    p.add_argument(
        "--limit",
        type=int,
        help="evaluate N images: a seeded random draw, stratified by the first zero-shot task's label",
    )
    p.add_argument("--batch-size", type=int, default=256, help="images / captions per encoder call")
    p.add_argument(
        "--cb-dataset",
        metavar="DIR",
        help="a local clip_benchmark WebDataset dataset (wds_NAME: classnames.txt, templates, "
        "test/N.tar); writes clip_benchmark's record (same as --suite cb:DIR)",
    )
    p.add_argument(
        "--cb-split", metavar="SPLIT", help="the split folder of --cb-dataset / cb:DIR (default: test)"
    )
    p.add_argument(
        "--benchmark",
        metavar="NAME_OR_YAML",
        help="several tasks at once: 'datacomp' (its tasks found under --root) or a YAML list of "
        "suites (cb:DIR, shipped suite names, suite YAMLs); writes a record per task and summary.json",
    )
    p.add_argument(
        "--root",
        metavar="DIR",
        help="with --benchmark: the folder holding the clip_benchmark datasets (wds_NAME/)",
    )
    add_weights_arg(p)
    p.set_defaults(func=cmd_eval)
    from mmalign.cli_wise_ft import add_parsers as add_wise_ft

    add_wise_ft(sub, eval_parser=p)  # `mmalign wise-ft`, and eval's --wise-ft / --alphas

    p = sub.add_parser(
        "report", help="HTML page + PNGs of a run: curves, similarity histograms, t-SNE, Recall@k"
    )
    p.add_argument("--run", required=True, help="a run directory (metrics.jsonl, final/, eval.json)")
    p.add_argument("--output", help="report directory (default: RUN/report)")
    p.add_argument("--suite", help="suite whose dataset is embedded (default: the run's)")
    p.add_argument(
        "--data",
        help="evaluation data: shards for a shards suite (default: the run's data.val), "
        "or a directory / tar of class folders for an imagefolder suite (default: the suite's path)",
    )
    p.add_argument("--limit", type=int, default=1000, help="images embedded for the plots")
    p.set_defaults(func=cmd_report)

    p = sub.add_parser("quickstart", help="generate data, train, evaluate and save the embedded default")
    _add_config_args(p)
    p.set_defaults(func=cmd_quickstart)

    p = sub.add_parser("models", help="list architecture presets that build offline (parameters, image size)")
    p.add_argument("--all", action="store_true", help="also list the presets that need a download, marked")
    p.add_argument(
        "--pretrained",
        nargs="?",
        const="",
        metavar="ARCH",
        help="list open_clip's published weights (of ARCH) as ARCH/TAG names, * where the cache holds them",
    )
    p.add_argument(
        "--fetch",
        nargs="+",
        metavar="NAME",
        help="download models by name (ARCH/TAG, hf-hub:ORG/NAME, ORG/NAME) into the Hugging Face cache",
    )
    p.set_defaults(func=cmd_models)

    p = sub.add_parser("export", help="export a model (final/ or a step checkpoint) as open_clip, hf or onnx")
    p.add_argument("--model", required=True, help="a run directory, its final/, or RUN/checkpoints/step_N")
    p.add_argument("--format", required=True, choices=EXPORT_FORMATS, help="output format")
    p.add_argument("--out", required=True, help="output directory (must be empty or absent)")
    p.add_argument("--force", action="store_true", help="replace a non-empty --out")
    add_weights_arg(p)
    p.set_defaults(func=cmd_export)

    p = sub.add_parser(
        "embed", help="embed a dataset into clip-retrieval's layout (img_emb/, text_emb/, metadata/)"
    )
    p.add_argument("--model", required=True, help="a run directory, its final/, or RUN/checkpoints/step_N")
    p.add_argument(
        "--data",
        required=True,
        help="shards (dir/{00000..00009}.tar), a directory of .tar, or an image folder",
    )
    p.add_argument("--out", help="output directory")
    p.add_argument(
        "--teacher-shards",
        metavar="DIR",
        help="instead of --out: copy the tar shards of --data into DIR with the model's embeddings per sample "
        "(teacher_image.npy, teacher_text.npy, teacher_scale.npy) for loss.distill.teacher: stored",
    )
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument(
        "--part-size", type=int, default=100_000, help="rows per img_emb_N/text_emb_N/metadata_N part"
    )
    p.add_argument("--device", default="cpu")
    p.add_argument(
        "--nproc",
        type=int,
        default=1,
        help="local processes splitting the shards (re-run under torchrun; an outside torchrun "
        "or SLURM launch sets RANK / WORLD_SIZE itself); a rerun after a kill resumes",
    )
    add_weights_arg(p)
    p.set_defaults(func=cmd_embed)

    p = sub.add_parser("index", help="build FAISS inner-product indexes from `mmalign embed` output")
    p.add_argument("--emb", required=True, help="an `mmalign embed` output directory")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument(
        "--max-index-memory",
        help="memory budget of the indexes (512M, 4G, 1.5G; shared by image and text in proportion to "
        "their counts): the first kind that fits of Flat, IVF-Flat (HNSW beside it when it misses "
        "--min-recall), OPQ+IVF-PQ, IVF-PQ. "
        "Without it: Flat up to --exact-max vectors, else IVF-PQ (the old default)",
    )
    p.add_argument(
        "--max-query-ms", type=float, default=10.0, help="time limit of one query when tuning (default 10)"
    )
    p.add_argument(
        "--min-recall",
        type=float,
        default=0.9,
        help="recall@10 against exact search that nprobe/efSearch is tuned to reach (default 0.9)",
    )
    p.add_argument(
        "--shards", type=int, default=1, help="index files per modality, each a contiguous range of rows"
    )
    p.add_argument(
        "--kind",
        default="auto",
        choices=["auto", "flat", "hnsw", "ivf-flat", "ivf-pq", "opq-ivf-pq"],
        help="force an index kind (its parameters still follow the budget)",
    )
    p.add_argument(
        "--exact-max",
        type=int,
        help="Flat up to this many vectors (default without a budget: 100000; larger ones IVF-PQ)",
    )
    p.add_argument("--nlist", type=int, help="IVF lists (default ~4 sqrt(n))")
    p.add_argument(
        "--pq-m", type=int, help="PQ sub-quantizers, a divisor of the dim (default: by budget, else ~dim/4)"
    )
    p.add_argument("--nbits", type=int, help="bits per PQ code (default 8)")
    p.add_argument("--nprobe", type=int, help="IVF lists probed per query (default: tuned to --min-recall)")
    p.set_defaults(func=cmd_index)

    p = sub.add_parser("search", help="query an index with text or an image")
    p.add_argument("--index", required=True, help="an `mmalign index` output directory")
    p.add_argument("--model", required=True, help="the model that made the embeddings")
    p.add_argument("--text", help="a text query")
    p.add_argument("--image", help="an image file as the query")
    p.add_argument("-k", type=int, default=10, help="results to show")
    p.add_argument(
        "--against",
        default="image",
        choices=("image", "text"),
        help="search the image index or the caption index",
    )
    p.add_argument(
        "--no-dedupe",
        action="store_true",
        help="--against text: keep identical captions (default: one row per distinct caption, its best)",
    )
    p.add_argument(
        "--mmap",
        action="store_true",
        help="memory-map the index files instead of reading them into memory (a large index starts at once)",
    )
    p.set_defaults(func=cmd_search)

    p = sub.add_parser(
        "serve",
        help="answer search queries over HTTP (JSON; 127.0.0.1 by default)",
        description=ROUTES_HELP,
        formatter_class=_RawDescriptionFormatter,
    )
    p.add_argument(
        "--index",
        required=True,
        action="append",
        metavar="[NAME=]DIR",
        help="an `mmalign index` output directory; repeat as NAME=DIR to serve several "
        "(the first is the default; a plain DIR is named after the directory)",
    )
    p.add_argument("--model", required=True, help="the model that made the embeddings")
    add_weights_arg(p)
    p.add_argument(
        "--mmap", action="store_true", help="open the indexes memory-mapped (start in seconds, bounded RSS)"
    )
    p.add_argument(
        "--cors",
        metavar="ORIGIN",
        help="let pages from ORIGIN (http://host:port, comma-separated, or *) call the server, "
        "e.g. clip-retrieval's front-end served elsewhere",
    )
    p.add_argument(
        "--allow-url-queries",
        metavar="HOSTS",
        help="host names (comma-separated) that knn-service's image_url may fetch from (default: none, "
        "image_url is off)",
    )
    p.add_argument("--host", default="127.0.0.1", help="bind address (127.0.0.1: local)")
    p.add_argument("--port", type=int, default=8765)
    p.add_argument(
        "--max-k",
        type=int,
        default=100,
        help="largest k a request may ask for (clip-retrieval's num_images and num_result_ids are clamped to it)",
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=10.0,
        metavar="S",
        help="seconds a request has to arrive whole (else 408), to wait for a worker (else 503), "
        "and its reply to be written (work a worker took is never cut short)",
    )
    p.add_argument(
        "--workers", type=int, default=8, metavar="N", help="threads that answer complete requests"
    )
    p.add_argument(
        "--max-connections",
        type=int,
        default=256,
        metavar="N",
        help="connections open at once; more wait in the listen backlog",
    )
    p.add_argument(
        "--max-per-client",
        type=int,
        default=32,
        metavar="N",
        help="connections open at once from one client address; more get a 429 (raise it behind a proxy)",
    )
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
    except RunStopped as e:  # a stopped run (non-finite steps, a full disk): one line, not a traceback
        print(f"mmalign: stopped: {e}", file=sys.stderr)
        return 1
    except Exception as e:
        lost = _lost_peer(e)
        if lost is None:
            raise
        print(f"mmalign: error: {lost}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        # Not a normal exit: tearing down a process group whose peer is gone can block on
        # that peer (the reason we are here), so this rank leaves at once.
        os._exit(1)
    except KeyboardInterrupt as e:
        if not getattr(
            e, "reported", False
        ):  # a training run already said where it stopped (mmalign.run.signals)
            print("mmalign: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
