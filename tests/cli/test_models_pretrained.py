"""``mmalign models --pretrained`` (open_clip's registry, cache marks, no torch import) and
``--fetch`` (names into the cache), and a model name on a command's ``--model``: one line
for each mistake, exit 2, no traceback, no hang."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

from tests.harness import ROOT, cli_main
from tests.harness.hubcache import fabricate, offline_env


def _cache_with_one_tag(home):
    src = home / "src"
    src.mkdir()
    (src / "open_clip_model.safetensors").write_bytes(b"x")  # the listing reads names only
    fabricate(home, "laion/CLIP-ViT-B-32-laion2B-s34B-b79K", src)


def test_pretrained_lists_open_clips_tags_and_marks_the_cached_one(tmp_path, monkeypatch):
    _cache_with_one_tag(tmp_path)
    offline_env(monkeypatch, tmp_path)
    run = cli_main("models", "--pretrained")
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    assert "* ViT-B-32/laion2b_s34b_b79k" in run.stdout
    assert any(line.startswith("  RN50/openai ") and "timm/resnet50_clip.openai" in line for line in lines)
    assert "(1 of " in lines[-1] and str(tmp_path / "hub") in lines[-1]


def test_pretrained_is_fast_and_imports_no_torch(tmp_path):
    code = (
        "import sys; from mmalign.cli import main; code = main(['models', '--pretrained', 'ViT-B-32']); "
        "print('TORCH' if 'torch' in sys.modules else 'NO-TORCH', code)"
    )
    env = {**os.environ, "HF_HOME": str(tmp_path), "HF_HUB_OFFLINE": "1"}
    start = time.monotonic()
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, env=env, timeout=60
    )
    assert out.stdout.splitlines()[-1] == "NO-TORCH 0", out.stderr
    assert time.monotonic() - start < 20  # an interpreter and a file read; torch alone would be seconds


def test_an_unknown_arch_is_one_line(tmp_path, monkeypatch):
    offline_env(monkeypatch, tmp_path)
    run = cli_main("models", "--pretrained", "ViT-B-3")
    assert run.returncode == 2 and run.stderr.count("\n") == 1
    assert "no pretrained tags for ViT-B-3" in run.stderr and "ViT-B-32" in run.stderr


def test_fetch_prints_the_folder_of_a_cached_name(tmp_path, monkeypatch):
    src = tmp_path / "src"
    src.mkdir()
    (src / "config.json").write_text(json.dumps({"model_type": "clip", "architectures": ["CLIPModel"]}))
    (src / "model.safetensors").write_bytes(b"x")
    snapshot = fabricate(tmp_path, "test-org/tiny-clip", src)
    offline_env(monkeypatch, tmp_path)
    run = cli_main("models", "--fetch", "test-org/tiny-clip")
    assert run.returncode == 0 and run.stdout.strip() == f"test-org/tiny-clip: {snapshot}"


def test_fetch_offline_and_not_cached_is_one_line(tmp_path, monkeypatch):
    offline_env(monkeypatch, tmp_path)
    run = cli_main("models", "--fetch", "ViT-B-32/laion2b_s34b_b79k")
    assert run.returncode == 2 and run.stderr.count("\n") == 1
    assert "laion/CLIP-ViT-B-32-laion2B-s34B-b79K" in run.stderr and str(tmp_path / "hub") in run.stderr


def test_an_unreachable_hub_is_one_line_at_once(tmp_path):
    """Online by the environment, but the hub refuses connections: one line, no retry loop."""
    env = {**os.environ, "HF_HOME": str(tmp_path), "HF_ENDPOINT": "http://127.0.0.1:9"}
    for var in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        env.pop(var, None)
    start = time.monotonic()
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "mmalign.cli",
            "export",
            "--model",
            "test-org/absent",
            "--format",
            "hf",
            "--out",
            str(tmp_path / "o"),
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=120,
    )
    assert out.returncode == 2 and out.stderr.count("\n") == 1, out.stderr
    assert "the hub (http://127.0.0.1:9) cannot be reached" in out.stderr and "Traceback" not in out.stderr
    assert time.monotonic() - start < 30  # huggingface_hub alone retries for ~25 s


def test_a_name_on_a_commands_model_flag_not_cached_is_one_line(tmp_path, monkeypatch):
    offline_env(monkeypatch, tmp_path)
    run = cli_main("export", "--model", "test-org/absent", "--format", "hf", "--out", str(tmp_path / "o"))
    assert run.returncode == 2 and run.stderr.count("\n") == 1
    assert "--model: test-org/absent: no such local path" in run.stderr


def test_eval_and_export_by_name(tmp_path, monkeypatch):
    """A name on eval's and export's --model: eval's record lands in the working folder (not in
    the cache, nor in a folder spelled like the name, which would then shadow it); the export
    reloads with the name's own embeddings."""
    import torch

    from mmalign.models.load import load
    from tests.harness.cb_wds_gen import write_wds
    from tests.models.test_hub import _tiny_clip_hf

    fabricate(tmp_path / "home", "test-org/tiny-clip", _tiny_clip_hf(3, tmp_path / "src"))
    offline_env(monkeypatch, tmp_path / "home")
    monkeypatch.setenv("MMALIGN_CACHE", str(tmp_path / "views"))
    work = tmp_path / "work"
    write_wds(work / "wds_pets", "classification", n=12, size=32)
    run = cli_main("eval", "--model", "test-org/tiny-clip", "--cb-dataset", "wds_pets", cwd=work)
    assert run.returncode == 0, run.stderr
    records = sorted(p.name for p in work.glob("eval_cli_*"))
    assert (
        len(records) == 1
        and records[0].endswith("test-org_tiny-clip.json")
        and not (work / "test-org").exists()
    )
    run = cli_main(
        "export", "--model", "test-org/tiny-clip", "--format", "open_clip", "--out", "oc", cwd=work
    )
    assert run.returncode == 0, run.stderr
    images = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    assert torch.allclose(
        load(work / "oc").encode_image(images), load("test-org/tiny-clip").encode_image(images)
    )


def test_curates_resume_stamp_of_a_name_lists_the_cached_weights(tmp_path, monkeypatch):
    """curate's resume stamp fingerprints the weights a name resolves to (a new revision in the
    cache is a changed model), not a folder spelled like the name."""
    from data_pipelines.curate.run import Options
    from data_pipelines.curate.stamp import stamp_content

    src = tmp_path / "src"
    src.mkdir()
    (src / "config.json").write_text(json.dumps({"model_type": "clip", "architectures": ["CLIPModel"]}))
    (src / "model.safetensors").write_bytes(b"weights")
    snapshot = fabricate(tmp_path / "home", "test-org/tiny-clip", src)
    offline_env(monkeypatch, tmp_path / "home")
    stamp = stamp_content(Options(data="d", model="test-org/tiny-clip", out="o"), [])
    assert stamp["model"] == str(snapshot.resolve())
    assert [w[0] for w in stamp["weights"]] == ["model.safetensors"]
