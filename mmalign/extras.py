"""The optional extras of the install, and the one line a command says when it needs one.

The core install trains, evaluates and exports to open_clip and Hugging Face. What only some
commands use comes in extras (``[project.optional-dependencies]`` in pyproject.toml):

* ``search``: faiss (``mmalign index`` / ``search`` / ``serve``, curate's k-means, ``mine``);
* ``export``: onnx, onnxruntime (``mmalign export --format onnx``);
* ``report``: matplotlib, scikit-learn, tensorboard (plots and t-SNE, linear probes, the
  digits suite, DataComp's macro F1; a run's event files).

Their owning modules import them inside functions, in a ``with extra(...)`` block::

    with extra("search", "mmalign index"):
        import faiss

so a missing one is a :class:`~mmalign.errors.UsageError` (one line, exit 2) that names the
extra to install, never a traceback. The import statement stays where it was, so the layer
tests still see which module owns which dependency. A command that would reach its import only
after a long pass calls :func:`require` first.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from contextlib import contextmanager

from mmalign.errors import UsageError

__all__ = ["EXTRAS", "extra", "missing_extra", "require"]

# extra -> the top-level modules it provides (import names)
EXTRAS: dict[str, tuple[str, ...]] = {
    "search": ("faiss",),
    "export": ("onnx", "onnxruntime"),
    "report": ("matplotlib", "sklearn", "tensorboard"),
}
# import name -> the distribution pip installs, where the two differ
_DISTRIBUTION = {"faiss": "faiss-cpu", "sklearn": "scikit-learn"}


def missing_extra(module: str, name: str, what: str) -> str:
    """The one line for ``what`` (a command or a feature) needing ``module`` of extra ``name``."""
    return (
        f"{what} needs {_DISTRIBUTION.get(module, module)}, from the [{name}] extra: "
        f"pip install 'mmalign[{name}]'"
    )


@contextmanager
def extra(name: str, what: str) -> Iterator[None]:
    """Run the imports of the block; a module of extra ``name`` that is not installed becomes a
    UsageError naming the extra. Any other failed import (a broken install, a missing module
    of the core) propagates as it is: installing the extra would not fix it."""
    if name not in EXTRAS:
        raise KeyError(f"no extra {name!r}; the extras are {', '.join(EXTRAS)}")
    try:
        yield
    except ModuleNotFoundError as e:
        module = (e.name or "").partition(".")[0]
        if module not in EXTRAS[name]:
            raise
        raise UsageError(missing_extra(module, name, what)) from None


def require(name: str, module: str, what: str) -> None:
    """The same line as :func:`extra`, before a long pass that ends in ``module``'s import; found
    by importlib's ``find_spec``, so nothing is imported."""
    if module not in EXTRAS[name]:
        raise KeyError(f"{module} is not in the [{name}] extra")
    if importlib.util.find_spec(module) is None:
        raise UsageError(missing_extra(module, name, what))
