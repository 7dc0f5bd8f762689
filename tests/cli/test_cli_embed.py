"""``mmalign embed``'s command (mmalign/cli_embed.py): what it checks before it starts ranks, and
``--weights ema`` on both of its outputs."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.harness import cli_main
from tests.harness.searchdata import save_random_model


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, str]:
    """A saved mmalign model, its open_clip export and its HF export."""
    from mmalign.export import export

    root = tmp_path_factory.mktemp("embed_cli")
    model = save_random_model(root / "model", seed=5, embed_dim=16)
    out = {"mmalign": model}
    for fmt in ("open_clip", "hf"):
        out[fmt] = str(export(model, fmt, root / fmt))
    return out


@pytest.fixture
def launches(monkeypatch) -> list:
    import mmalign.dist.launch as launch

    seen: list = []
    monkeypatch.setattr(launch, "launch_local", lambda nproc, argv: seen.append((nproc, list(argv))) or 0)
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    return seen


@pytest.mark.parametrize("fmt", ["mmalign", "open_clip", "hf"])
@pytest.mark.parametrize("flag", ["--out", "--teacher-shards"])
def test_nproc_starts_ranks_for_every_model_folder_load_reads(folders, fmt, flag, tmp_path, launches):
    """An open_clip or HF export folder is a model `load()` reads: --nproc 2 starts the ranks
    (the check before them once took only mmalign folders and refused these in one line)."""
    data = tmp_path / "imgs"
    data.mkdir()
    from PIL import Image

    Image.new("RGB", (8, 8)).save(data / "a.png")
    args = ["embed", "--model", folders[fmt], "--data", str(data), flag, str(tmp_path / "o"), "--nproc", "2"]
    run = cli_main(*args)
    assert run.returncode == 0, run.stderr
    assert launches == [(2, args)]


@pytest.mark.parametrize("flag", ["--out", "--teacher-shards"])
def test_weights_ema_of_a_model_without_one_is_one_line(folders, flag, tmp_path):
    run = cli_main(
        "embed",
        "--model",
        folders["mmalign"],
        "--data",
        str(tmp_path),
        flag,
        str(tmp_path / "o"),
        "--weights",
        "ema",
    )
    assert run.returncode == 2, run.stdout
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and "ema" in lines[0].lower(), run.stderr
    assert not Path(tmp_path / "o").exists()
