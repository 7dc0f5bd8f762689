"""Whether a state dict fits a model: the one-line reason a load is refused.

Its own module, below ``io``, ``two_tower`` and the towers: a tower checks its weights with it
(``timm_tower``) and ``io`` builds towers, so living in ``io`` made an import cycle.
"""

from __future__ import annotations


def misfit(own: dict, state: dict) -> str | None:
    """Why ``state`` cannot be loaded into a model whose state dict is ``own`` (missing or
    unexpected keys, other shapes), as one line; None when it fits."""
    missing = sorted(set(own) - set(state))
    unexpected = sorted(set(state) - set(own))
    wrong = sorted(k for k in set(own) & set(state) if own[k].shape != state[k].shape)
    if not (missing or unexpected or wrong):
        return None

    def few(keys):
        return ", ".join(keys[:3]) + (f" (+{len(keys) - 3} more)" if len(keys) > 3 else "")

    parts = ([f"missing {few(missing)}"] if missing else []) + (
        [f"unexpected {few(unexpected)}"] if unexpected else []
    )
    if wrong:
        k = wrong[0]
        parts.append(
            f"shape of {k} is {tuple(state[k].shape)}, the arch needs {tuple(own[k].shape)}"
            + (f" (+{len(wrong) - 1} more)" if len(wrong) > 1 else "")
        )
    return "; ".join(parts)
