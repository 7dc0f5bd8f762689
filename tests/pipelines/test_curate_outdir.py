"""``mmalign curate --out``: it never deletes or replaces a file it did not write, and one curate
at a time holds the folder (``mmalign.dirlock``).

The pool and the model are test_curate_cli's (the same fixtures); the references are the
files this test writes, compared byte for byte.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pandas as pd

from tests.harness import ROOT, cli_main
from tests.pipelines.test_curate_cli import _curate, _one_thread, _out_with_embeddings, embedded, pool  # noqa: F401

USER_FILES = {
    "2024_backup.tar": b"the user's backup",
    "7days.parquet": b"not a parquet",
    "notes.txt": b"mine",
}


def _one_line_error(run) -> str:
    assert run.returncode == 2, (run.stdout, run.stderr)
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("mmalign: error:") and "Traceback" not in run.stderr, (
        run.stderr
    )
    return lines[0]


def _user_folder(path: Path, extra: dict | None = None) -> Path:
    path.mkdir(parents=True)
    for name, data in {**USER_FILES, **(extra or {})}.items():
        (path / name).write_bytes(data)
    return path


def _run(pool, out, *flags):
    return cli_main(
        "curate",
        "--data",
        pool.dir,
        "--model",
        pool.model,
        "--out",
        out,
        "--no-progress",
        "--batch-size",
        "4",
        "--per-shard",
        "10",
        *flags,
    )


def test_a_folder_curate_did_not_create_is_refused_untouched(pool, tmp_path):
    out = _user_folder(tmp_path / "out", {"00000.tar": b"the user's own shard"})
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    line = _one_line_error(_run(pool, out, "--keep-fraction", "0.5"))
    assert "not empty" in line and "--overwrite" in line and "curate_manifest.json" in line
    # --overwrite writes beside the user's files, but never over one: their 00000.tar is refused by name
    line = _one_line_error(_run(pool, out, "--keep-fraction", "0.5", "--overwrite"))
    assert "00000.tar" in line and "not written by mmalign curate" in line
    assert {p.name: p.read_bytes() for p in out.iterdir() if p.name != ".mmalign.lock"} == before


def test_overwrite_replaces_only_curates_own_files(pool, tmp_path):
    out = _user_folder(tmp_path / "out")
    _curate(pool, out, "--keep-fraction", "0.9", "--overwrite")
    for name, data in USER_FILES.items():
        assert (out / name).read_bytes() == data, name
    manifest = json.loads((out / "curate_manifest.json").read_text())
    first = sorted(p.name for p in out.glob("[0-9]*.tar"))
    assert "2024_backup.tar" in first  # the user's file is still there, beside curate's shards ...
    assert set(first) - {"2024_backup.tar"} <= set(manifest["files"])  # ... and only curate's are listed
    assert not set(USER_FILES) & set(manifest["files"])
    # a rerun on its own folder needs no flag; fewer shards now: its own surplus shards go, the user's stay
    _curate(pool, out, "--keep-fraction", "0.2")
    for name, data in USER_FILES.items():
        assert (out / name).read_bytes() == data, name
    kept = pd.read_parquet(out / "decisions.parquet")["kept"].sum()
    ours = sorted(p.name for p in out.glob("[0-9][0-9][0-9][0-9][0-9].tar"))
    assert len(ours) == -(-kept // 10)
    with_json = 0
    for name in ours:
        with tarfile.open(out / name) as tar:
            with_json += sum(
                m.name.endswith(".json") for m in tar.getmembers()
            )  # every written sample has one
    assert with_json == kept
    assert json.loads((out / "sizes.json").read_text()) == {
        name: min(10, kept - 10 * i) for i, name in enumerate(ours)
    }


def test_a_folder_holding_only_curates_embeddings_is_curates(pool, embedded, tmp_path):
    """pool/ with its stamp (a copy of curate's embeddings, or a run from before the manifest)."""
    out = _out_with_embeddings(embedded, tmp_path / "out")
    _curate(pool, out, "--keep-fraction", "0.5")
    assert (out / "curate_manifest.json").is_file()
    bare = tmp_path / "bare"
    (bare / "pool").mkdir(parents=True)
    (bare / "pool" / "x.npy").write_bytes(b"someone's")
    assert "not empty" in _one_line_error(_run(pool, bare))


def test_a_second_curate_on_one_out_is_refused_naming_the_holder(pool, tmp_path):
    out = tmp_path / "out"
    code = (
        f"import sys, time; sys.path.insert(0, {str(ROOT)!r}); from mmalign.dirlock import hold; "
        f"hold({str(out)!r}, 'mmalign curate'); print('held', flush=True); time.sleep(60)"
    )
    holder = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        start = time.monotonic()
        line = _one_line_error(_run(pool, out))
        assert time.monotonic() - start < 10  # refused at once, no wait
        assert "in use by mmalign curate" in line and f"pid {holder.pid}" in line, line
        assert not (out / "pool").exists()  # nothing embedded
    finally:
        holder.kill()
        holder.wait()
    _curate(pool, out)  # the holder gone, the lock frees itself


def test_the_nproc_launcher_holds_the_lock_and_its_ranks_inherit_it(pool, tmp_path, monkeypatch):
    import os

    import mmalign.dist.launch as launch
    from mmalign.dirlock import ENV, hold, holder

    out = tmp_path / "out"
    seen = []

    def ranks(nproc, argv):  # what the launched ranks would find
        seen.append((os.environ.get(ENV, "").split(os.pathsep), holder(out)))
        with hold(out, "mmalign curate") as lock:  # a rank's own hold: inherited, not refused
            seen.append(lock.inherited)
        return 0

    monkeypatch.setattr(launch, "launch_local", ranks)
    run = _run(pool, out, "--nproc", "2")
    assert run.returncode == 0, run.stderr
    (held, record), inherited = seen
    assert str(out.resolve()) in held and inherited
    assert record["command"] == "mmalign curate" and record["pid"] == os.getpid()
    assert str(out.resolve()) not in os.environ.get(ENV, "").split(os.pathsep)  # released when the ranks end
