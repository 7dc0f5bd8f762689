"""What ``mmalign models`` lists, without building a model or importing torch or open_clip.

Each preset's parameter count, image size and whether it builds offline come from a shipped
table (``preset_data/params.json``), written by building every preset on the meta device
(``python -m mmalign.models.preset_table --write``). A row is used only while its preset's
architecture is the one it was counted from (a fingerprint of the arch dict): a preset that is
new or changed since (an open_clip upgrade, a new YAML preset) is built on the meta device, as
before, and said so first.

The architectures are read from the files they live in: mmalign's YAML presets
(``preset_data/*.yaml``) and open_clip's ``model_configs/*.json``, found without importing
open_clip (its import pulls in torchvision and transformers: seconds), in the order
``open_clip.list_models()`` gives them (``tests/models/test_models_preset_table.py`` holds the two
equal).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import re
from collections.abc import Iterator
from importlib import resources
from pathlib import Path

PRESET_DIR = "preset_data"  # as models/presets.py
TABLE = "params.json"
ARCH_KEYS = ("embed_dim", "vision_cfg", "text_cfg", "quick_gelu")  # what preset_arch keeps of open_clip's


def _natural_key(name: str) -> list:
    # open_clip's order: digit runs compared as numbers, case ignored
    return [int(s) if s.isdigit() else s for s in re.split(r"(\d+)", name.lower())]


def _own_presets() -> dict[str, dict]:
    import yaml

    folder = Path(str(resources.files("mmalign.models") / PRESET_DIR))
    return {p.stem: yaml.safe_load(p.read_text(encoding="utf-8")) for p in sorted(folder.glob("*.yaml"))}


def _open_clip_configs() -> dict[str, dict]:
    """open_clip's architecture registry, read from its package's ``model_configs`` folder."""
    spec = importlib.util.find_spec("open_clip")  # a top-level name: found, not imported
    if spec is None or not spec.submodule_search_locations:
        return {}
    found = {}
    for folder in spec.submodule_search_locations:
        for path in Path(folder, "model_configs").glob("*.json"):
            cfg = json.loads(path.read_text(encoding="utf-8"))
            if all(k in cfg for k in ("embed_dim", "vision_cfg", "text_cfg")):  # open_clip's own filter
                found[path.stem] = {k: cfg[k] for k in ARCH_KEYS if k in cfg}
    return dict(sorted(found.items(), key=lambda kv: _natural_key(kv[0])))


def architectures() -> dict[str, dict]:
    """Every preset's architecture dict, in ``presets.available()``'s order."""
    own = _own_presets()
    return {
        **{name: own[name] for name in sorted(own)},
        **{k: v for k, v in _open_clip_configs().items() if k not in own},
    }


def fingerprint(arch: dict) -> str:
    return hashlib.sha256(json.dumps(arch, sort_keys=True).encode()).hexdigest()[:16]


def _table_path() -> Path:
    return Path(str(resources.files("mmalign.models") / PRESET_DIR / TABLE))


def read_table() -> dict[str, dict]:
    path = _table_path()
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


def stale(names: list[str] | None = None) -> list[str]:
    """The presets (of ``names``, default all) whose row is missing or counted from another arch."""
    archs, table = architectures(), read_table()
    return [
        n
        for n in (archs if names is None else names)
        if n not in table or table[n]["fingerprint"] != fingerprint(archs[n])
    ]


def build_row(name: str) -> dict:
    """A preset's row, by building it on the meta device (imports torch and open_clip)."""
    from mmalign.config import ModelConfig
    from mmalign.errors import ConfigError
    from mmalign.models import check_buildable

    try:
        model = check_buildable(ModelConfig(preset=name))
    except ConfigError as e:
        why = "needs a Hugging Face text tower" if "Hugging Face" in str(e) else str(e).split(": ", 1)[-1]
        return {"offline": False, "params": None, "image_size": None, "why": why[:100]}
    return {
        "offline": True,
        "params": sum(p.numel() for p in model.parameters()),
        "image_size": model.image_size,
        "why": None,
    }


def describe(include_unavailable: bool = False, names: list[str] | None = None) -> Iterator[dict]:
    """Yield ``{"name", "offline", "params", "image_size", "why"}`` per preset, from the table;
    a stale preset's row is built (see :func:`stale`)."""
    archs, table = architectures(), read_table()
    for name in archs if names is None else names:
        row = table.get(name)
        if row is None or row["fingerprint"] != fingerprint(archs[name]):
            row = build_row(name)
        if row["offline"] or include_unavailable:
            yield {"name": name, **{k: row[k] for k in ("offline", "params", "image_size", "why")}}


def write_table() -> Path:
    """Build every preset on the meta device and write the table (minutes on 2 cores)."""
    archs = architectures()
    rows = {name: {"fingerprint": fingerprint(arch), **build_row(name)} for name, arch in archs.items()}
    path = _table_path()
    path.write_text(json.dumps(rows, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    return path


if __name__ == "__main__":
    import sys

    if sys.argv[1:] == ["--write"]:
        print(f"wrote {write_table()}")
    elif sys.argv[1:] == ["--check"]:
        bad = stale()
        print(f"stale rows: {', '.join(bad)}" if bad else "the table matches every preset")
        sys.exit(1 if bad else 0)
    else:
        sys.exit("usage: python -m mmalign.models.preset_table --write | --check")
