"""``mmalign embed``: a dataset's embeddings for search (``--out``), or a copy of its shards with a
teacher's embeddings per sample for distillation (``--teacher-shards``). Both split whole shards
over ``--nproc`` local processes (or an outside torchrun / SLURM launch) and resume after a kill."""

from __future__ import annotations

import os
from pathlib import Path

from mmalign.cli_model import ema_folder, loading
from mmalign.errors import UsageError


def _check_launch(args, out: str, done_file: str, flag: str, what: str) -> None:
    """One line for a bad ``--nproc`` or a finished ``out``, before torch is imported."""
    from mmalign.dist.cluster import check_nproc

    if args.nproc < 1:
        raise UsageError(f"--nproc must be >= 1, got {args.nproc}")
    check_nproc(args.nproc, os.environ)
    first = os.environ.get("RANK", os.environ.get("SLURM_PROCID", "0")) == "0"  # a late rank > 0 just ends
    if first and os.path.isfile(os.path.join(out, done_file)):
        raise UsageError(f"{flag}: {out} already holds {what}; choose an empty directory")


def _launch_ranks(args, out: str) -> int | None:
    """``--nproc N`` without a launcher around us: check the model and the data once (one line
    here, not one per rank), then start N ranks of this command; None when this is a rank."""
    if args.nproc <= 1 or "WORLD_SIZE" in os.environ:
        return None
    from mmalign.cli_train import output_lock
    from mmalign.dist.launch import launch_local
    from mmalign.models.load import export_kind
    from mmalign.models.locate import check_exists, locate
    from mmalign.search.embed_inputs import plan_units

    model = check_exists(args.model)  # a name: its cache folder
    if export_kind(model) is None:  # an open_clip / HF folder is read as it is
        locate(model)
    plan_units(args.data)
    with output_lock(Path(out), "mmalign embed"):  # the ranks inherit it (mmalign.dirlock.ENV)
        return launch_local(args.nproc, args.argv)  # rank 0 printed the summary


def _embed_teacher(args) -> int:
    out = args.teacher_shards
    if args.out is not None:
        raise UsageError(
            "embed: give --out (embeddings for search) or --teacher-shards (shards for distillation), not both"
        )
    _check_launch(
        args, out, "teacher.json", "--teacher-shards", "teacher shards"
    )  # embed_teacher.TEACHER_INFO
    loading(args.model)
    ema_folder(args)
    if (code := _launch_ranks(args, out)) is not None:
        return code
    from mmalign.cli_train import output_lock
    from mmalign.dist.distributed import env_dist_info
    from mmalign.search.embed_teacher import embed_teacher

    rank = env_dist_info().rank
    with output_lock(out, "mmalign embed", take=rank == 0):
        info = embed_teacher(args.model, args.data, out, batch_size=args.batch_size, device=args.device)
    if info is not None:
        print(
            f"{info['count']} of {info['samples']} samples with teacher embeddings (dim {info['embed_dim']}, "
            f"scale {info['logit_scale']:.4g}) in {info['shards']} shard(s) -> {out}"
        )
    return 0


def cmd_embed(args) -> int:
    if args.teacher_shards is not None:
        return _embed_teacher(args)
    if args.out is None:
        raise UsageError("embed: --out is required (or --teacher-shards DIR for a copy of the shards)")
    _check_launch(args, args.out, "embed.json", "--out", "embeddings")  # search.embed.EMBED_INFO
    loading(args.model)
    ema_folder(args)
    if (code := _launch_ranks(args, args.out)) is not None:
        return code
    from mmalign.cli_train import output_lock
    from mmalign.dist.distributed import env_dist_info
    from mmalign.search.embed import embed

    rank = env_dist_info().rank
    # one writer per output folder: a second embed is one line (rank 0 holds it for an outside launch)
    with output_lock(args.out, "mmalign embed", take=rank == 0):
        info = embed(
            args.model,
            args.data,
            args.out,
            batch_size=args.batch_size,
            part_size=args.part_size,
            device=args.device,
        )
    if info is None:
        return 0
    print(
        f"{info['images']} images, {info['rows']} rows (dim {info['dim']}) in {info['parts']} part(s) -> {args.out}"
    )
    return 0
