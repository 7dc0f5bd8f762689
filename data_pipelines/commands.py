"""The ``mmalign shards …``, ``mine …``, ``curate …`` and ``tokenizer …`` command lines (arguments and dispatch).

Kept apart from ``mmalign/cli.py`` so the builders' options live next to the
builders; heavy imports happen only when a command runs. The CLI finds the four
:class:`~mmalign.commands.Command` objects at the end of this file through the
``mmalign.commands`` entry points in pyproject.toml (mmalign does not import
data_pipelines).
"""

from __future__ import annotations

import argparse
import os

from mmalign.commands import Command
from mmalign.errors import UsageError

SOURCES = ("shapes", "imagefolder", "table", "hf")
PER_SHARD = 1000
SHAPES_PER_SHARD = 2000  # shapes.generate's own default (the quickstart's layout)


# Each source is its own sub-parser (``mmalign shards imagefolder --help`` shows its flags
# only); every parser also takes the other sources' flags, hidden, so that one given to the
# wrong source is a one-line refusal naming its sources rather than argparse's bare
# "unrecognized arguments".


def _common_flags(p, source: str) -> None:
    default = " (default: data/shapes)" if source == "shapes" else ""
    p.add_argument("--out", default=None, help=f"output folder{default}")
    p.add_argument(
        "--per-shard",
        type=int,
        default=None,
        help=f"samples per shard (<= 10000; default {SHAPES_PER_SHARD if source == 'shapes' else PER_SHARD})",
    )


def _input_flag(p) -> None:
    p.add_argument("--input", help="the folder, tar, table or dataset to read")


def _seed_flag(p) -> None:
    p.add_argument(
        "--seed", type=int, default=0, help="seeds the samples' order and the choice of templates per image"
    )


def _shapes_flags(p) -> None:
    p.add_argument("--n-train", type=int, default=16000)
    p.add_argument("--n-val", type=int, default=1000)


def _caption_flags(p) -> None:
    p.add_argument(
        "--templates",
        default=None,
        help="caption templates for class names: a set in data_pipelines/templates (cifar10, generic) "
        "or a YAML path; default generic",
    )
    p.add_argument(
        "--templates-per-image",
        type=_per_image,
        default=1,
        help="captions per image, each a template drawn with --seed (default 1); 'all' writes every "
        "template into every .txt (evaluation, embed and report then embed them all)",
    )


def _imagefolder_flags(p) -> None:
    p.add_argument(
        "--no-shuffle",
        action="store_true",
        help="keep folder order (default: a random order seeded by --seed, so every shard mixes the classes)",
    )
    p.add_argument(
        "--classes",
        default=None,
        help="only these class folders, comma-separated (class ids stay those of the full class list), "
        "e.g. half the classes for a held-out-classes experiment",
    )
    p.add_argument(
        "--limit",
        type=int,
        default=None,
        metavar="N",
        help="the first N images of each class, in the folder's (or tar's) order: a quick subset",
    )


def _column_flags(p) -> None:
    p.add_argument("--image-col", default="image", help="column with the image (path in tables)")
    p.add_argument("--caption-col", default="caption", help="column with the caption(s)")


def _table_flags(p) -> None:
    p.add_argument("--root", default=None, help="folder that relative image paths start from")


def _hf_flags(p) -> None:
    p.add_argument("--label-col", default=None, help="a ClassLabel column to caption from templates")
    p.add_argument(
        "--format", default="disk", choices=["disk", "parquet", "imagefolder"], help="how it is stored"
    )
    p.add_argument("--split", default="train", help="the split of a DatasetDict")


def _output_flags(p) -> None:
    p.add_argument("--resize", type=int, default=0, help="shorter side in pixels (0 = keep)")
    p.add_argument("--resize-mode", default="keep_ratio", choices=["keep_ratio", "center_crop"])
    p.add_argument(
        "--no-dedupe", action="store_true", help="keep exact duplicates (same sha256 of the source bytes)"
    )
    p.add_argument("--processes", type=int, default=1, help="encoder processes")
    p.add_argument("--no-progress", action="store_true")


# source -> (its help line, its flag groups); _common_flags go to every source
SOURCE_FLAGS = {
    "shapes": (
        "synthetic coloured shapes with captions (the quickstart's data)",
        (_seed_flag, _shapes_flags),
    ),
    "imagefolder": (
        "class folders (root/CLASS/*.jpg), a directory or a tar",
        (_input_flag, _seed_flag, _caption_flags, _imagefolder_flags, _output_flags),
    ),
    "table": (
        "a csv / tsv / parquet table of image paths and captions",
        (_input_flag, _column_flags, _table_flags, _output_flags),
    ),
    "hf": (
        "a Hugging Face dataset on disk",
        (_input_flag, _seed_flag, _caption_flags, _column_flags, _hf_flags, _output_flags),
    ),
}


class _Hidden:
    """Another source's flags on this parser: absent from its --help, None unless given."""

    def __init__(self, parser: argparse.ArgumentParser, owners: dict[str, str]):
        self.parser, self.owners = parser, owners

    def add_argument(self, flag: str, **kwargs) -> None:
        store_true = kwargs.get("action") == "store_true"
        action = self.parser.add_argument(
            flag, action="store_true" if store_true else "store", default=None, help=argparse.SUPPRESS
        )
        self.owners[action.dest] = flag


def add_shard_args(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(
        dest="source",
        required=True,
        metavar="SOURCE",
        help="what to read (each source has its own flags: mmalign shards SOURCE --help)",
    )
    for name, (text, groups) in SOURCE_FLAGS.items():
        s = sub.add_parser(name, help=text, description=f"mmalign shards {name}: {text}.")
        _common_flags(s, name)
        for add in groups:
            add(s)
        foreign: dict[str, str] = {}
        hidden = _Hidden(s, foreign)
        for other in {g for _, gs in SOURCE_FLAGS.values() for g in gs} - set(groups):
            other(hidden)
        s.set_defaults(foreign_flags=foreign)


def _refuse_foreign(args) -> None:
    """A flag of another source, given here: one line naming the sources it belongs to."""
    for dest, flag in sorted(args.foreign_flags.items()):
        if getattr(args, dest) is not None:
            owners = [n for n, (_, gs) in SOURCE_FLAGS.items() if any(flag in _flags_of(g) for g in gs)]
            raise UsageError(
                f"mmalign shards {args.source}: {flag} does not apply to this source (a flag of "
                f"{', '.join(owners)}; see `mmalign shards {args.source} --help`)"
            )


def _flags_of(group) -> set[str]:
    probe = argparse.ArgumentParser(add_help=False)  # a throwaway parser: only the flag names are wanted
    group(probe)
    return {flag for action in probe._actions for flag in action.option_strings}


def _per_image(value: str) -> int:
    """``all`` (or 0) -> 0, every template; else a positive count."""
    if value == "all":
        return 0
    try:
        n = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number or 'all', got {value!r}") from None
    if n < 0:
        raise argparse.ArgumentTypeError(f"expected a positive number or 'all', got {value!r}")
    return n


def _items(args):
    from data_pipelines import sources

    if not args.input:
        raise UsageError(f"mmalign shards {args.source} needs --input")
    if args.source in ("imagefolder", "hf"):
        tset = sources.load_templates(args.templates or "generic")
        captioner = sources.Captioner(tset["templates"], args.templates_per_image, args.seed)
    if args.source == "imagefolder":
        seed = None if args.no_shuffle else args.seed
        only = [c.strip() for c in args.classes.split(",") if c.strip()] if args.classes else None
        if args.limit is not None and args.limit < 1:
            raise UsageError(f"--limit must be >= 1 images per class, got {args.limit}")
        _, items = sources.image_folder(
            args.input, captioner, tset.get("classnames"), shuffle_seed=seed, only=only, limit=args.limit
        )
        return items
    if args.source == "table":
        return sources.table(args.input, args.image_col, args.caption_col, args.root)
    caption_col = None if args.label_col else args.caption_col
    return sources.hf_dataset(
        args.input, args.format, args.image_col, caption_col, args.label_col, captioner, args.split
    )


def run_shards(args) -> dict:
    _refuse_foreign(args)
    per_shard = args.per_shard
    if per_shard is None:
        per_shard = SHAPES_PER_SHARD if args.source == "shapes" else PER_SHARD
    if not 0 < per_shard <= 10_000:
        raise UsageError(f"--per-shard must be in 1..10000, got {per_shard}")
    if args.source == "shapes":
        from data_pipelines import shapes

        out = args.out or "data/shapes"
        info = shapes.generate(
            out, n_train=args.n_train, n_val=args.n_val, seed=args.seed, per_shard=per_shard
        )
        print(f"wrote {info['splits']} samples to {out}")
        return info
    if not args.out:
        raise UsageError(f"mmalign shards {args.source} needs --out")
    if args.resize < 0 or args.processes < 1:
        raise UsageError("--resize must be >= 0 and --processes >= 1")
    items = _items(args)  # a missing --input is one line before the writer's imports (pandas, pyarrow)
    from data_pipelines.build import EncodeOptions, build_shards

    summary = build_shards(
        items,
        args.out,
        per_shard=per_shard,
        opts=EncodeOptions(resize=args.resize, resize_mode=args.resize_mode),
        dedupe=not args.no_dedupe,
        processes=args.processes,
        progress=not args.no_progress,
        source=f"{args.source}:{args.input}",
    )
    print(
        f"wrote {summary['written']} samples in {summary['shards']} shards to {args.out} "
        f"({summary['failures']} failures, {summary['duplicates_removed']} duplicates removed)"
    )
    return summary


def add_tokenizer_args(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="action", required=True)
    t = sub.add_parser("train", help="train a sentencepiece tokenizer on the captions of a shard set")
    t.add_argument("--data", required=True, help="shard spec, e.g. data/x/{00000..00009}.tar")
    t.add_argument(
        "--vocab-size", type=int, required=True, help="sentencepiece pieces (the tower adds pad/sot/eot)"
    )
    t.add_argument("--out", required=True, help="the .model file to write")
    t.add_argument("--model-type", default="bpe", choices=["bpe", "unigram"])
    t.add_argument("--max-captions", type=int, default=2_000_000, help="captions read at most")


def run_tokenizer(args) -> dict:
    from mmalign.data.shards import check_urls, expand_urls

    check_urls(expand_urls(args.data), "--data")  # a missing shard is one line before torch is imported
    from data_pipelines.tokenizer_train import train_from_shards

    info = train_from_shards(
        args.data, args.vocab_size, args.out, model_type=args.model_type, max_captions=args.max_captions
    )
    print(
        f"wrote {args.out}: {info['pieces']} pieces from {info['captions']} captions; "
        f"set model.tokenizer={args.out} (text tower vocab_size {info['vocab_size']})"
    )
    return info


def add_mine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--data", required=True, help="shards to mine: a spec (dir/{00000..00009}.tar) or a directory of .tar"
    )
    p.add_argument(
        "--model",
        required=True,
        help="the model that scores candidates: a run directory, its final/, or RUN/checkpoints/step_N",
    )
    p.add_argument("--out", required=True, help="folder for the rewritten shards and mine.json")
    p.add_argument("-k", type=int, default=8, help="negative captions kept per sample (default 8)")
    p.add_argument(
        "--max-similarity",
        type=float,
        default=None,
        help="drop candidates whose cosine with the image exceeds this (suspected false negatives)",
    )
    p.add_argument(
        "--max-relative",
        type=float,
        default=None,
        help="drop candidates above this fraction of the image's own-caption cosine (e.g. 0.95)",
    )
    p.add_argument("--id-field", default=None, help="a .json field: samples with equal values are positives")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--device", default="cpu")
    p.add_argument("--no-progress", action="store_true")


def run_mine(args) -> dict:
    from data_pipelines.shard_input import input_shards
    from mmalign.models.locate import check_exists

    # the two paths, as one line each, before the seconds of importing torch and open_clip
    input_shards(args.data)
    check_exists(args.model)
    print(f"mmalign: loading the model from {args.model} ...", flush=True)
    from data_pipelines.mine import mine

    stats = mine(
        args.data,
        args.model,
        args.out,
        k=args.k,
        max_similarity=args.max_similarity,
        max_relative=args.max_relative,
        id_field=args.id_field,
        batch_size=args.batch_size,
        device=args.device,
        progress=not args.no_progress,
    )
    print(
        f"wrote {stats['negatives_written']} negatives for {stats['mined_samples']} samples into {args.out} "
        f"({stats['samples_with_fewer_than_k']} with fewer than {args.k}, {stats['filtered_false_negatives']} "
        f"suspected false negatives filtered); train on them with data.hard_negatives: k <= {args.k}"
    )
    return stats


def add_curate_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--data",
        required=True,
        help="the pool: a shard spec (local, pipe:, http(s)://, fsspec), or a directory of .tar shards",
    )
    p.add_argument(
        "--model",
        default=None,
        help="the filter model: an mmalign run, its final/, a step "
        "checkpoint, or an open_clip / HF export folder (not needed by --dedupe exact,perceptual)",
    )
    p.add_argument(
        "--out",
        required=True,
        help="folder for the embeddings (pool/), the curated shards or key "
        "list, decisions.parquet and curate_report.json/.html",
    )
    g = p.add_argument_group("score filter (DataComp)")
    g.add_argument("--clip-score-min", type=float, default=None, help="keep image-text cosine >= S")
    g.add_argument(
        "--keep-fraction",
        type=float,
        default=None,
        help="keep the top F of the whole pool by CLIP score, F in (0, 1] (DataComp's baseline: 0.3)",
    )
    g = p.add_argument_group("de-duplication")
    g.add_argument(
        "--dedupe",
        default="",
        help="any of exact (image sha256), perceptual (image hash, no model), semantic (SemDeDup), "
        "comma-separated: exact,perceptual,semantic",
    )
    g.add_argument(
        "--perceptual-distance",
        type=int,
        default=None,
        metavar="BITS",
        help="perceptual: duplicates are within BITS of 64 (default: mmalign.data.phash.DEFAULT_DISTANCE)",
    )
    g.add_argument(
        "--dedupe-eps",
        type=float,
        default=0.002,
        help="semantic: duplicates have image cosine > 1 - eps (default 0.002, safe with weak models; "
        "pick yours from the report's similarity histogram)",
    )
    g.add_argument(
        "--dedupe-clusters", type=int, default=0, help="semantic: k-means clusters (0 = one per 5000 samples)"
    )
    g.add_argument(
        "--kmeans-sample",
        type=int,
        default=0,
        help="semantic: k-means training rows (0 = 256 per cluster), so memory stays bounded",
    )
    g.add_argument(
        "--max-drop",
        type=float,
        default=0.5,
        help="refuse (writing nothing) when de-duplication or --clip-score-min would drop more than "
        "this fraction of the pool (default 0.5; --keep-fraction states its own drop)",
    )
    g.add_argument("--force", action="store_true", help="write the outputs even past --max-drop")
    g = p.add_argument_group("decontamination")
    g.add_argument(
        "--decontaminate",
        action="append",
        default=[],
        metavar="TARGET",
        help="drop pool samples whose image near-duplicates one of an evaluation set: a suite name or "
        "YAML, cb:DIR or a clip_benchmark folder, or .tar shards (repeat, or a comma list); "
        "perceptual, plus semantic (--dedupe-eps) with --model",
    )
    g.add_argument(
        "--decontaminate-distance",
        type=int,
        default=None,
        metavar="BITS",
        help="--decontaminate: a near-duplicate is within BITS of 64 (default: "
        "mmalign.evaluation.contamination.DEFAULT_DISTANCE, one step above --perceptual-distance's)",
    )
    g.add_argument(
        "--false-negative-groups",
        default=None,
        metavar="FIELD",
        help="drop no duplicate: write each sample's group into its .json under FIELD, for "
        "loss.false_negative_ids: FIELD",
    )
    g = p.add_argument_group("output")
    g.add_argument(
        "--overwrite",
        action="store_true",
        help="write into a non-empty --out that curate did not create, beside its files (curate replaces "
        "only files it wrote, listed in OUT/curate_manifest.json)",
    )
    g.add_argument(
        "--keys-only",
        action="store_true",
        help="write OUT/keep_keys.txt (for data.keep_keys) instead of new shards",
    )
    g.add_argument("--per-shard", type=int, default=1000, help="samples per new shard (default 1000)")
    g.add_argument("--seed", type=int, default=0, help="the shuffle of the new shards and the k-means sample")
    g.add_argument("--examples", type=int, default=24, help="dropped pairs shown in the HTML report")
    g = p.add_argument_group("running")
    g.add_argument("--batch-size", type=int, default=64)
    g.add_argument("--device", default="cpu")
    g.add_argument(
        "--nproc",
        type=int,
        default=1,
        help="local processes splitting the shards (re-run under torchrun; an outside torchrun "
        "or SLURM launch sets RANK / WORLD_SIZE itself)",
    )
    g.add_argument("--no-progress", action="store_true")


def run_curate(args) -> dict | None:
    from data_pipelines.curate.decide import Policies
    from data_pipelines.curate.decontaminate import parse_targets
    from data_pipelines.curate.run import Options, check, curate
    from mmalign.data import phash

    modes = tuple(m.strip() for m in args.dedupe.split(",") if m.strip())
    if bad := [m for m in modes if m not in ("exact", "perceptual", "semantic")]:
        raise UsageError(
            f"--dedupe: unknown mode {bad[0]!r} (any of exact, perceptual, semantic, comma-separated)"
        )
    if args.false_negative_groups and not modes:  # groups to write: SemDeDup's (with a model), unless asked
        modes = ("semantic",) if args.model else ("perceptual",)
    policies = Policies(
        clip_score_min=args.clip_score_min,
        keep_fraction=args.keep_fraction,
        dedupe=modes,
        perceptual_distance=phash.DEFAULT_DISTANCE
        if args.perceptual_distance is None
        else args.perceptual_distance,
        dedupe_eps=args.dedupe_eps,
        dedupe_clusters=args.dedupe_clusters,
        kmeans_sample=args.kmeans_sample,
        false_negative_field=args.false_negative_groups,
        seed=args.seed,
        max_drop=args.max_drop,
        force=args.force,
        decontaminate=parse_targets(args.decontaminate),
        decontaminate_distance=args.decontaminate_distance,
    )
    opts = Options(
        data=args.data,
        model=args.model,
        out=args.out,
        policies=policies,
        keys_only=args.keys_only,
        per_shard=args.per_shard,
        batch_size=args.batch_size,
        device=args.device,
        progress=not args.no_progress,
        examples=args.examples,
        overwrite=args.overwrite,
    )
    check(opts)
    if args.nproc < 1:
        raise UsageError(f"--nproc must be >= 1, got {args.nproc}")
    if args.nproc > 1 and "WORLD_SIZE" not in os.environ:
        from mmalign.dirlock import hold
        from mmalign.dist.launch import launch_local

        with hold(args.out, "mmalign curate"):  # the ranks inherit it (mmalign.dirlock.ENV)
            code = launch_local(args.nproc, args.argv)  # what mmalign.cli.main was given (in-process too)
        if code:
            raise SystemExit(code)
        return None
    report = curate(opts)
    if report is not None:
        _print_summary(report, args.out)
    return report


def _print_summary(report: dict, out: str) -> None:
    """Kept per policy, the duplicate groups' sizes, the report's path."""
    n = report["pool"]["readable"]
    for name, v in report["kept_by_policy"].items():
        print(f"  {name}: keeps {v['kept']} of {n} ({100 * v['fraction']:.1f}%)")
    sizes = report["dedupe"].get("group_sizes")
    if sizes is not None:
        print(
            f"  duplicate groups: {sizes['groups']} (largest {sizes['largest']}, median {sizes['median']:g}, "
            f"{sizes['over_10']} of more than 10)"
        )
    near = report["dedupe"].get("nearest_similarity_quantiles")
    if near:
        eps = report["policies"]["dedupe_eps"]
        print(
            f"  nearest other image: median cosine {near['0.5']:.4f}, 10% below {near['0.1']:.4f} "
            f"(duplicates: above 1 - eps = {1 - eps:.4f})"
        )
    kept = report["kept"]
    print(
        f"curated {n} samples into {out}: kept {kept['kept']} ({100 * kept['fraction']:.1f}%); "
        f"report {os.path.join(out, 'curate_report.html')}"
    )


SHARDS = Command(
    "shards", "build WebDataset shards (img2dataset layout) from a source", add_shard_args, run_shards
)
MINE = Command(
    "mine",
    "mine hard negative captions with a trained model into a copy of the shards",
    add_mine_args,
    run_mine,
)
TOKENIZER = Command(
    "tokenizer", "train a sentencepiece tokenizer on shard captions", add_tokenizer_args, run_tokenizer
)
CURATE = Command(
    "curate",
    "score, de-duplicate and filter a shard pool with a CLIP model (DataComp, SemDeDup)",
    add_curate_args,
    run_curate,
)
