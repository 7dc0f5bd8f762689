"""mmalign: pretrain, evaluate and export CLIP-style image-text models."""

__version__ = "0.1.0"


def load(path, device: str = "cpu", weights: str = "raw"):
    """Load a trained model: a run directory, its ``final/``, a model folder or a step
    checkpoint ``RUN/checkpoints/step_N``; ``weights="ema"``: the EMA weights a run kept
    (``train.ema_decay``); see :mod:`mmalign.models.load`."""
    from mmalign.models.load import load as _load

    return _load(path, device, weights=weights)


__all__ = ["__version__", "load"]
