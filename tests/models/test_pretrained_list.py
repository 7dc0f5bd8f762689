"""open_clip's registry as :mod:`mmalign.models.pretrained_list` reads it (its files, not its
import) equals open_clip's own ``list_pretrained`` / ``get_pretrained_cfg``; the weight file
names are the ones open_clip's downloader tries; the cache marks come from huggingface_hub's
cache layout (a cache fabricated here)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from mmalign.models import pretrained_list as pl
from tests.harness import ROOT
from tests.harness.hubcache import fabricate


def test_the_registry_equals_open_clips():
    from open_clip import pretrained

    ours = pl.registry()
    assert [(a, t) for a in ours for t in ours[a]] == pretrained.list_pretrained()
    for arch, tag in pretrained.list_pretrained():
        assert ours[arch][tag] == pretrained.get_pretrained_cfg(arch, tag)


def test_reading_the_registry_imports_neither_torch_nor_open_clip():
    code = (
        "import sys; from mmalign.models.pretrained_list import registry; n = len(registry()); "
        "print(n, 'torch' in sys.modules, any(m.startswith('open_clip') for m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60)
    count, torch_in, open_clip_in = out.stdout.split()
    assert int(count) > 100 and torch_in == "False" and open_clip_in == "False", out.stderr


@pytest.mark.parametrize(
    "hf_hub, repo, names",
    [
        ("org/name/", "org/name", ["open_clip_model.safetensors", "open_clip_pytorch_model.bin"]),
        ("org/name/pytorch_model.bin", "org/name", ["pytorch_model.safetensors", "pytorch_model.bin"]),
        ("org/name/ViT-x.pt", "org/name", ["ViT-x.pt"]),
        ("org/name/w.bin", "org/name", ["w.safetensors", "w.bin"]),
    ],
)
def test_weight_files_follow_open_clips_download_order(hf_hub, repo, names):
    from open_clip.pretrained import _get_safe_alternatives

    filename = hf_hub.rsplit("/", 1)[1] or "open_clip_pytorch_model.bin"
    assert pl.weight_files(hf_hub) == (repo, names)
    assert names == [*_get_safe_alternatives(filename), filename]  # open_clip's own rule


def test_the_cache_marks_what_it_holds(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    (src / "open_clip_model.safetensors").write_bytes(b"x")
    fabricate(tmp_path, "laion/CLIP-ViT-B-32-laion2B-s34B-b79K", src)
    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({"model_type": "clip", "architectures": ["CLIPModel"]}))
    fabricate(tmp_path, "test-org/tiny-clip", other)
    cache = tmp_path / "hub"
    marked = {f"{r['arch']}/{r['tag']}" for r in pl.rows(cache) if r["cached"]}
    assert marked == {"ViT-B-32/laion2b_s34b_b79k"}
    assert list(pl.cached_ids(cache)) == [("test-org/tiny-clip", "CLIPModel")]
    lines = list(pl.listing("ViT-B-32", cache))
    assert any(line.startswith("* ViT-B-32/laion2b_s34b_b79k ") for line in lines)
    assert f"(1 of {len(pl.registry()['ViT-B-32'])} in the cache {cache}" in lines[-1]
    assert "* test-org/tiny-clip" in "\n".join(pl.listing(None, cache))


def test_the_hub_cache_follows_the_environment_now(monkeypatch, tmp_path):
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HUGGINGFACE_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    assert pl.hub_cache() == tmp_path / "home" / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "elsewhere"))
    assert pl.hub_cache() == tmp_path / "elsewhere"
