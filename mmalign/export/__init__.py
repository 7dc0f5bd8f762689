"""``mmalign export``: a trained model (``final/`` or a step checkpoint) in another format.

Formats: ``open_clip`` (its local-dir folder), ``hf`` (a transformers CLIPModel
folder) and ``onnx`` (image and text encoder graphs).  Every format carries the
weights exactly; the tests check the embeddings against mmalign's own.
"""

from __future__ import annotations

from pathlib import Path

from mmalign.config import ConfigError
from mmalign.export.source import Source, load_source

FORMATS = ("open_clip", "hf", "onnx")


def export(model_dir: str | Path, fmt: str, out: str | Path) -> Path:
    """Write ``model_dir`` (a saved model, run directory or ``RUN/checkpoints/step_N``) as ``fmt`` into ``out``."""
    if fmt not in FORMATS:
        raise ConfigError(f"--format: unknown format {fmt!r} (choose from {', '.join(FORMATS)})")
    source = load_source(model_dir)
    out = Path(out)
    if fmt == "open_clip":
        from mmalign.export.to_open_clip import export_open_clip

        return export_open_clip(source, out)
    if fmt == "hf":
        from mmalign.export.to_hf import export_hf

        return export_hf(source, out)
    from mmalign.export.to_onnx import export_onnx

    return export_onnx(source, out)


__all__ = ["FORMATS", "Source", "export", "load_source"]
