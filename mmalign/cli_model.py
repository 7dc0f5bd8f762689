"""How the commands read ``--model``: a missing path is one line before torch is imported (a name
resolves through the Hugging Face cache first), and ``--weights raw|ema`` picks the trained
weights or the moving average a run kept (``train.ema_decay``)."""

from __future__ import annotations

import argparse
import sys

from mmalign.errors import UsageError


def add_weights_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--weights",
        choices=("raw", "ema"),
        default="raw",
        help="the trained weights, or the moving average a run kept with train.ema_decay "
        "(RUN/final_ema/, or a step checkpoint's)",
    )


def ema_folder(args) -> None:
    """``--weights ema`` of a command that reads a model folder: ``args.model`` becomes the
    folder of the EMA weights (a step checkpoint's are read by ``eval`` and ``export`` only)."""
    if getattr(args, "weights", "raw") != "ema":
        return
    from mmalign.models.load import ema_source
    from mmalign.models.locate import is_step_checkpoint

    source = ema_source(args.model)
    if is_step_checkpoint(source):
        raise UsageError(
            f"--weights ema: {source} is a step checkpoint; `mmalign eval` and `mmalign export` read its "
            "EMA weights, this command reads a model folder (RUN/final_ema/)"
        )
    args.model = str(source)


def loading(model: str, data_on_stdout: bool = False) -> None:
    """A model path that does not exist is one line now, before the seconds that importing torch
    and open_clip and building the model take; else a line saying that those seconds begin.
    ``data_on_stdout`` (search's table of hits, kept clean for a pipe): the line goes to a
    terminal's stderr only, so that an error stays the one line on stderr."""
    from mmalign.models.locate import check_exists

    check_exists(model)
    if not data_on_stdout:
        print(f"mmalign: loading the model from {model} ...", flush=True)
    elif sys.stderr.isatty():
        print(f"mmalign: loading the model from {model} ...", file=sys.stderr, flush=True)
