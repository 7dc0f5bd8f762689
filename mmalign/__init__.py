"""mmalign: pretrain, evaluate and export CLIP-style image-text models."""

__version__ = "0.1.0"


def load(path, device: str = "cpu"):
    """Load a trained model: a run directory, its ``final/``, a model folder or a step
    checkpoint ``RUN/checkpoints/step_N``; see :mod:`mmalign.models.load`."""
    from mmalign.models.load import load as _load

    return _load(path, device)


__all__ = ["__version__", "load"]
