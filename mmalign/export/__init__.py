"""``mmalign export``: a trained model (``final/`` or a step checkpoint) in another format.

Formats: ``open_clip`` (its local-dir folder), ``hf`` (a transformers CLIPModel
folder) and ``onnx`` (image and text encoder graphs).  Every format carries the
weights exactly; the tests check the embeddings against mmalign's own.

An export never mixes with what was there: a non-empty ``out`` is refused unless
``force``; the files are written into ``OUT.tmp``, which is renamed to ``OUT`` only
once complete (a failed export leaves neither), and they get the modes a plain
``open()`` gives under the user's umask.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from mmalign.errors import UsageError

FORMATS = ("open_clip", "hf", "onnx")


def _check_out(out: Path, model_dir: Path, force: bool) -> None:
    """One-line errors for an ``--out`` that cannot or must not be written, before any work."""
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out: {out} exists and is not a directory")
    target, model = out.resolve(), model_dir.resolve()
    if target == model or target in model.parents:
        raise UsageError(f"--out: {out} would replace the model being exported ({model_dir})")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise UsageError(f"--out: {out} is not empty (pass --force to replace it)")


def _publish(tmp: Path, out: Path) -> None:
    from mmalign.models.io import respect_umask

    respect_umask(*(p for p in tmp.rglob("*") if p.is_file()))
    if out.exists():  # empty, or replaced under --force
        shutil.rmtree(out)
    os.replace(tmp, out)


def export(
    model_dir: str | Path, fmt: str, out: str | Path, *, force: bool = False, weights: str = "raw"
) -> Path:
    """Write ``model_dir`` (a saved model, run directory or ``RUN/checkpoints/step_N``) as ``fmt`` into ``out``;
    ``weights="ema"``: its EMA weights (:func:`mmalign.models.load.ema_source`), checked before any write."""
    if fmt not in FORMATS:
        raise UsageError(f"--format: unknown format {fmt!r} (choose from {', '.join(FORMATS)})")
    out = Path(out)
    if weights != "raw":
        from mmalign.models.load import WEIGHTS, ema_source

        if weights not in WEIGHTS:
            raise UsageError(f"--weights: {weights!r} is not one of {', '.join(WEIGHTS)}")
        model_dir = ema_source(model_dir)  # the folder read: --out must not replace it either
    _check_out(out, Path(model_dir), force)
    tmp = out.with_name(out.name + ".tmp")
    try:
        if tmp.exists():  # left by an interrupted export
            shutil.rmtree(tmp)
        tmp.mkdir(parents=True)
    except OSError as e:
        raise UsageError(f"--out: cannot write {tmp} ({e.strerror or type(e).__name__})") from None
    try:
        from mmalign.models.load import load

        source = load(model_dir, weights=weights)
        if fmt == "open_clip":
            from mmalign.export.to_open_clip import export_open_clip

            export_open_clip(source, tmp, final=out)
        elif fmt == "hf":
            from mmalign.export.to_hf import export_hf

            export_hf(source, tmp)
        else:
            from mmalign.export.to_onnx import export_onnx

            export_onnx(source, tmp)
        _publish(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


__all__ = ["FORMATS", "export"]
