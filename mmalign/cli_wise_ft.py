"""``mmalign wise-ft``: a zero-shot and a fine-tuned model's weights interpolated (WiSE-FT),
written as model folders; and ``mmalign eval``'s ``--wise-ft`` / ``--alphas`` flags, whose
accuracy curve ``cli_eval.py`` prints.

Light at import (``mmalign --help`` imports it): torch loads inside the command.
"""

from __future__ import annotations

import argparse

MODEL_HELP = "a run directory, model folder, step checkpoint or open_clip / Hugging Face folder"


def add_parsers(sub, eval_parser: argparse.ArgumentParser) -> None:
    """The ``wise-ft`` command, and eval's flags for the curve."""
    eval_parser.add_argument(
        "--wise-ft",
        metavar="FINE_TUNED",
        help="evaluate --model (zero-shot) interpolated towards this fine-tuned model of the same "
        "architecture at each of --alphas, and print the accuracy curve (WiSE-FT)",
    )
    eval_parser.add_argument(
        "--alphas",
        default="0,0.25,0.5,0.75,1",
        help="with --wise-ft: the weights of the fine-tuned model, comma-separated, each in [0, 1]",
    )
    p = sub.add_parser(
        "wise-ft",
        help="interpolate a zero-shot and a fine-tuned model's weights (WiSE-FT) into model folders",
    )
    p.add_argument("--zero-shot", required=True, metavar="MODEL", help=f"the zero-shot model: {MODEL_HELP}")
    p.add_argument(
        "--fine-tuned", required=True, metavar="MODEL", help="its fine-tuned version (the same architecture)"
    )
    p.add_argument(
        "--alpha",
        required=True,
        help="the fine-tuned model's weight, in [0, 1] (0: zero-shot, 1: fine-tuned); "
        "a comma-separated list writes OUT/alpha_A/ per alpha",
    )
    p.add_argument("--out", "--output", dest="out", required=True, help="the model folder to write")
    p.add_argument("--overwrite", action="store_true", help="replace a model already in --out")
    p.set_defaults(func=cmd_wise_ft)


def cmd_wise_ft(args) -> int:
    from mmalign.models.locate import check_exists
    from mmalign.models.wise_ft import parse_alphas

    alphas = parse_alphas(args.alpha)  # one line before anything loads
    from mmalign.errors import UsageError

    for flag, model in (("--zero-shot", args.zero_shot), ("--fine-tuned", args.fine_tuned)):
        try:
            check_exists(model, flag)  # a model name: found in the hub cache, or fetched now
        except UsageError as e:
            raise UsageError(str(e) if flag in str(e) else f"{flag}: {e}") from None
    print(f"mmalign: loading {args.zero_shot} and {args.fine_tuned} ...", flush=True)
    from mmalign.models.wise_ft import wise_ft

    folders = wise_ft(args.zero_shot, args.fine_tuned, alphas, args.out, overwrite=args.overwrite)
    for alpha, folder in zip(alphas, folders):
        print(f"alpha {alpha:g}: {folder}")
    return 0
