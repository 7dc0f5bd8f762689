"""A Hugging Face hub cache made by a test, in huggingface_hub's own layout, so that model names
resolve offline exactly as they would after a real download.

``HF_HOME/hub/models--ORG--NAME/`` holds ``refs/main`` (a commit hash) and
``snapshots/HASH/`` (the files); ``hf_hub_download`` / ``from_pretrained`` with
``HF_HUB_OFFLINE=1`` read it alone.
"""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path


def repo_folder(hf_home: Path, repo_id: str) -> Path:
    """The cache folder of a model repository: ``HF_HOME/hub/models--ORG--NAME``."""
    return Path(hf_home) / "hub" / ("models--" + repo_id.replace("/", "--"))


def fabricate(hf_home: Path, repo_id: str, files: Path, revision: str = "main") -> Path:
    """Copy the files of folder ``files`` into the cache as ``repo_id``'s snapshot at
    ``revision`` and point ``refs/REVISION`` at it; returns the snapshot folder."""
    commit = hashlib.sha1(repo_id.encode()).hexdigest()  # 40 hex, fixed per repository
    repo = repo_folder(hf_home, repo_id)
    snapshot = repo / "snapshots" / commit
    if snapshot.exists():
        shutil.rmtree(snapshot)
    shutil.copytree(files, snapshot)
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / revision).write_text(commit)  # no newline, as huggingface_hub writes it
    return snapshot


def offline_env(monkeypatch, hf_home: Path) -> None:
    """Point the environment at ``hf_home`` with no network, for code that reads it at call time
    and for subprocesses.  huggingface_hub reads ``HF_HOME`` / ``HF_HUB_OFFLINE`` once, at its
    import: in-process calls of open_clip or transformers take ``cache_dir=`` and
    ``local_files_only=True`` instead."""
    monkeypatch.setenv("HF_HOME", str(hf_home))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HUGGINGFACE_HUB_CACHE", raising=False)
