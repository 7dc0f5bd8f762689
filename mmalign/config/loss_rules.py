"""Which parts of the objective combine: the one table of combination rules.

Each :class:`Part` is something a config switches on (a term, or an option of the
contrastive term: its positive structure, its estimator).  A pair that cannot be
combined is refused by exactly ONE of its two parts (the one listing the other in
``refuses``), so every rule lives in one place and the error names that part's
config key.  :func:`check` runs at config validation (``mmalign.config.validate``)
and again in :func:`mmalign.objective.build_objective`; it needs no torch.

Single-key checks (a value's range, a key another key needs, e.g. ``data.views: 2``
for the image-image term) stay with the config's validation.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from mmalign.errors import ConfigError

__all__ = ["Part", "PARTS", "active_parts", "check"]


@dataclass(frozen=True)
class Part:
    name: str
    keys: tuple[str, ...]  # the config key(s) that switch it on (errors name the ones set)
    active: Callable[[Any], bool]
    refuses: dict[str, str] = field(default_factory=dict)  # other part -> why (this part owns the rule)
    one_process: str = ""  # non-empty: why it cannot run sharded
    example: tuple[str, ...] = ()  # overrides that switch it on (docs, tests)

    def key_of(self, cfg: Any) -> str:
        if len(self.keys) == 1:
            return f"'{self.keys[0]}'"
        set_keys = [k for k in self.keys if _get(cfg, k)] or list(self.keys)
        return " / ".join(f"'{k}'" for k in set_keys)


def _get(cfg: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        cfg = getattr(cfg, part)
    return cfg


PARTS: tuple[Part, ...] = (
    Part(
        "siglip",
        ("loss.name",),
        lambda c: c.loss.name == "siglip",
        example=("loss.name=siglip", "model.init_logit_bias=-10"),
    ),
    Part(
        "ids",
        ("loss.false_negative_ids",),
        lambda c: c.loss.false_negative_ids != "none",
        example=("loss.false_negative_ids=caption",),
    ),
    Part(
        "mask",
        ("loss.positive_mask",),
        lambda c: c.loss.positive_mask != "none",
        refuses={
            "siglip": "metadata positives are an InfoNCE target (needs loss.name=infonce)",
            "ids": "the mask replaces the id positives (needs loss.false_negative_ids=none)",
        },
        one_process="the (B, B) mask covers one process's batch",
        example=("loss.positive_mask=attribute_subset", "data.id_field=subset_code"),
    ),
    Part(
        "hardneg",
        ("loss.hard_negative_beta", "loss.debias_prior"),
        lambda c: bool(c.loss.hard_negative_beta or c.loss.debias_prior),
        refuses={"siglip": "the estimators reweight InfoNCE's softmax (needs loss.name=infonce)"},
        example=("loss.hard_negative_beta=0.5", "loss.debias_prior=0.1"),
    ),
    # Queued entries are negatives of the plain (multi-positive) InfoNCE only: the estimators'
    # weights / priors and a B x B metadata mask say nothing about entries of past batches.
    Part(
        "queue",
        ("loss.queue_size",),
        lambda c: c.loss.queue_size > 0,
        refuses={
            "siglip": "queued entries are InfoNCE negatives (needs loss.name=infonce)",
            "hardneg": "the estimators' weights and prior say nothing about entries of past batches",
            "mask": "a (B, B) metadata mask says nothing about entries of past batches",
        },
        example=("loss.queue_size=64",),
    ),
    Part(
        "mined",
        ("data.hard_negatives",),
        lambda c: c.data.hard_negatives > 0,
        refuses={
            "siglip": "mined negatives extend the plain InfoNCE (needs loss.name=infonce)",
            "hardneg": "mined negatives extend the plain InfoNCE, not the estimators",
            "queue": "mined negatives with a momentum queue are not implemented",
        },
        example=("data.hard_negatives=2",),
    ),
    Part(
        "views",
        ("loss.image_image_weight",),
        lambda c: c.loss.image_image_weight > 0,
        example=("data.views=2", "loss.image_image_weight=0.5"),
    ),
    # open_clip's distillation matches softmax distributions, the InfoNCE student's; a sigmoid
    # student's pairs are not a distribution over the batch
    Part(
        "distill",
        ("loss.distill.teacher",),
        lambda c: c.loss.distill.teacher is not None and c.loss.distill.weight > 0,
        refuses={
            "siglip": "the teacher's softmax distributions distil into an InfoNCE student (needs loss.name=infonce)"
        },
        example=("loss.distill.teacher=stored", "loss.distill.weight=0.5"),
    ),
)

_BY_NAME = {p.name: p for p in PARTS}
assert all(other in _BY_NAME for p in PARTS for other in p.refuses)
# one owner per pair: never both a->b and b->a
assert not any(p.name in _BY_NAME[o].refuses for p in PARTS for o in p.refuses)


def active_parts(cfg: Any) -> list[str]:
    return [p.name for p in PARTS if p.active(cfg)]


def check(cfg: Any, world_size: int = 1) -> None:
    """Raise one one-line ConfigError for the first refused combination in ``cfg``."""
    on = active_parts(cfg)
    for name in on:
        part = _BY_NAME[name]
        for other in on:
            if other in part.refuses:
                raise ConfigError(
                    f"config key {part.key_of(cfg)} {_with(_BY_NAME[other], cfg)}: {part.refuses[other]}"
                )
        if part.one_process and world_size > 1:
            raise ConfigError(
                f"config key {part.key_of(cfg)} needs one process ({part.one_process}), "
                f"got a world size of {world_size}"
            )


def _with(other: Part, cfg: Any) -> str:
    if other.name == "siglip":
        return "is set with loss.name=siglip"
    return f"is set with {other.key_of(cfg).replace(chr(39), '')}"
