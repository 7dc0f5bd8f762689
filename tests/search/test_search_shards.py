"""The query side of an index directory (contract C2, written by hand here with FAISS and
pyarrow): sharded indexes merged as one brute-force search over every vector, search
parameters applied, old directories loading, urls and metadata columns in hits, and
memory-mapped loading that does not read the index or the metadata into memory."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc
import pytest

from mmalign.cli import main
from mmalign.errors import UsageError
from mmalign.search.searcher import Searcher, format_hits
from mmalign.search.searcher_meta import MetadataTable
from tests.harness import ROOT
from tests.harness.searchindex import metadata_table, write_index_dir

faiss = pytest.importorskip("faiss")

DIM = 32


def _unit(rng, n: int, d: int = DIM) -> np.ndarray:
    from tests.harness.searchindex import unit_vectors

    return unit_vectors(rng, n, d)


def _brute(vectors: np.ndarray, queries: np.ndarray, k: int):
    """Every row scored in float64; best first, ties by row (numpy's stable sort)."""
    scores = queries.astype(np.float64) @ vectors.astype(np.float64).T  # (q, rows)
    order = np.argsort(-scores, axis=1, kind="stable")[:, :k]
    return order, np.take_along_axis(scores, order, axis=1)


@pytest.mark.parametrize("shards", [1, 3, 4])
def test_sharded_flat_equals_brute_force(tmp_path, shards):
    rng = np.random.default_rng(1)
    vectors, queries = _unit(rng, 1000), _unit(rng, 20)
    write_index_dir(tmp_path / "idx", vectors, shards)
    s = Searcher(tmp_path / "idx")
    assert s.indexes["image"].ntotal == 1000 and len(s.indexes["image"].shards) == shards
    hits = s.search_vectors(queries, k=15)
    want_rows, want_scores = _brute(vectors, queries, 15)
    assert [[h.row for h in q] for q in hits] == want_rows.tolist()
    np.testing.assert_allclose([[h.score for h in q] for q in hits], want_scores, atol=1e-5)
    assert [h.rank for h in hits[0]] == list(range(1, 16))
    s.close()


def test_tied_scores_merge_by_shard_then_position(tmp_path):
    rng = np.random.default_rng(2)
    base = _unit(rng, 5)
    vectors = np.repeat(base, 4, axis=0)  # every vector four times: ties across shards
    rows = write_index_dir(tmp_path / "idx", vectors, 4)
    hits = Searcher(tmp_path / "idx").search_vectors(base[:1], k=4)[0]
    position = {int(r): p for p, r in enumerate(rows)}  # metadata row -> global position
    assert sorted(h.row for h in hits) == [0, 1, 2, 3]
    assert [position[h.row] for h in hits] == sorted(position[r] for r in range(4))


def test_sharded_ivf_keeps_its_search_parameters(tmp_path):
    rng = np.random.default_rng(3)
    vectors, queries = _unit(rng, 2000), _unit(rng, 10)
    write_index_dir(tmp_path / "idx", vectors, 2, factory="IVF16,Flat", search={"nprobe": 16})
    s = Searcher(tmp_path / "idx")
    assert [faiss.extract_index_ivf(x).nprobe for x in s.indexes["image"].shards] == [16, 16]
    hits = s.search_vectors(queries, k=5)  # every list probed: exact
    assert [[h.row for h in q] for q in hits] == _brute(vectors, queries, 5)[0].tolist()
    write_index_dir(tmp_path / "hnsw", vectors, 1, factory="HNSW8", search={"efSearch": 77})
    assert Searcher(tmp_path / "hnsw").indexes["image"].shards[0].hnsw.efSearch == 77


def test_an_old_directory_loads(tmp_path):
    """No ``shards``, ``nprobe`` at the modality level, ``metadata.parquet``."""
    rng = np.random.default_rng(4)
    vectors = _unit(rng, 500)
    write_index_dir(tmp_path / "idx", vectors, 1, factory="IVF8,Flat")
    info = json.loads((tmp_path / "idx/index.json").read_text())
    del info["image"]["shards"], info["image"]["search"]
    info["image"]["nprobe"] = 5
    (tmp_path / "idx/index.json").write_text(json.dumps(info))
    import pyarrow.parquet as pq

    pq.write_table(metadata_table(500), tmp_path / "idx/metadata.parquet")
    (tmp_path / "idx/metadata.arrow").unlink()
    s = Searcher(tmp_path / "idx")
    assert faiss.extract_index_ivf(s.indexes["image"].shards[0]).nprobe == 5
    assert s.num_rows == 500 and s.metadata([7])[0]["key"] == "s00007"


def test_a_missing_shard_is_one_line(tmp_path):
    write_index_dir(tmp_path / "idx", _unit(np.random.default_rng(5), 100), 2)
    (tmp_path / "idx/image.00001.index").unlink()
    with pytest.raises(UsageError, match=r"index shard .*image\.00001\.index is missing"):
        Searcher(tmp_path / "idx")


def test_hits_carry_url_and_the_other_columns(tmp_path):
    rng = np.random.default_rng(6)
    vectors = _unit(rng, 300)
    write_index_dir(tmp_path / "idx", vectors, 2)
    s = Searcher(tmp_path / "idx")
    hits = s.search_vectors(vectors[[1, 3]], k=3)
    assert [h[0].row for h in hits] == [1, 3]
    top = hits[0][0]
    assert top.url == "https://example.org/1.jpg" and top.key == "s00001" and top.caption == "caption 1"
    assert top.meta == {"caption_index": 0, "json": "{}", "width": 1}
    assert hits[1][0].url is None  # row 3 has no url (null)
    table = format_hits(hits[0]).splitlines()
    assert table[0].split() == ["rank", "score", "key", "url", "caption"]
    assert "https://example.org/1.jpg" in table[1]
    assert s.metadata([0, 299]) == [
        {"key": "s00000", "caption": "caption 0", "caption_index": 0, "json": "{}", "url": None, "width": 0},
        {
            "key": "s00299",
            "caption": "caption 299",
            "caption_index": 0,
            "json": "{}",
            "url": "https://example.org/299.jpg",
            "width": 299,
        },
    ]
    with pytest.raises(UsageError, match=r"row 300 is outside"):
        s.metadata([300])
    no_url = format_hits([h for h in hits[1] if h.url is None][:1])
    assert "url" not in no_url.splitlines()[0].split()


def test_search_prints_the_url_column(tmp_path, capsys):
    from tests.harness.searchdata import save_random_model

    model = save_random_model(tmp_path / "model", seed=3, embed_dim=DIM)
    write_index_dir(tmp_path / "idx", _unit(np.random.default_rng(7), 50), 2)
    argv = ["search", "--index", str(tmp_path / "idx"), "--model", model, "--text", "a cat", "-k", "4"]
    assert main(argv) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].split() == ["rank", "score", "key", "url", "caption"] and len(out) == 5
    assert main([*argv, "--mmap"]) == 0  # the same hits from the mapped files
    assert capsys.readouterr().out.splitlines() == out


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


_MEASURE = """
import json, os, sys
import faiss, pyarrow.ipc, pyarrow.parquet  # imported before the measures
from mmalign.search.searcher import Searcher
def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
out, keep = {}, []
for mmap in (True, False):  # nothing freed between the measures: the allocator keeps no slack
    for d in sys.argv[1:]:
        before = rss()
        keep.append(Searcher(d, mmap=mmap))
        out[f"{d} {mmap}"] = rss() - before
print(json.dumps(out))
"""


def test_mmap_does_not_read_the_index_into_memory(tmp_path):
    """RSS of a fresh process before/after opening a Flat and an IVF-Flat index of ~41 MB each."""
    rng = np.random.default_rng(8)
    vectors = _unit(rng, 160_000, 64)  # 41 MB of float32
    dirs = []
    for factory in ("Flat", "IVF32,Flat"):
        out = tmp_path / factory.replace(",", "_")
        out.mkdir()
        index = faiss.index_factory(64, factory, faiss.METRIC_INNER_PRODUCT)
        if not index.is_trained:
            index.train(vectors[:5000])
        index.add(vectors)
        faiss.write_index(index, str(out / "image.index"))
        np.save(out / "image_rows.npy", np.arange(len(vectors), dtype=np.int64))
        info = {"dim": 64, "metric": "inner_product", "rows": len(vectors), "image": {"kind": factory}}
        (out / "index.json").write_text(json.dumps(info))
        keys = pa.table({"key": [f"k{i}" for i in range(len(vectors))], "caption": ["c"] * len(vectors)})
        with ipc.new_file(str(out / "metadata.arrow"), keys.schema) as w:
            w.write_table(keys, max_chunksize=10_000)
        dirs.append(str(out))
        mapped = Searcher(out, mmap=True)  # the mapped index answers as the loaded one
        hits = mapped.search_vectors(vectors[:3], k=2)
        assert [q[0].row for q in hits] == [0, 1, 2]
        mapped.close()
    size = (tmp_path / "Flat" / "image.index").stat().st_size
    done = subprocess.run(
        [sys.executable, "-c", _MEASURE, *dirs], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    grew = json.loads(done.stdout.strip().splitlines()[-1])
    for d in dirs:
        assert grew[f"{d} True"] < size / 8, (d, grew, size)
        assert grew[f"{d} False"] > size / 2, (d, grew, size)  # the measure can see a loaded index


def test_arrow_metadata_is_read_row_by_row(tmp_path):
    n = 100_000
    table = pa.table(
        {"key": [f"k{i:06d}" for i in range(n)], "caption": ["x" * 300 + str(i) for i in range(n)]}
    )
    with ipc.new_file(str(tmp_path / "metadata.arrow"), table.schema) as w:
        w.write_table(table, max_chunksize=4096)
    size = (tmp_path / "metadata.arrow").stat().st_size  # ~31 MB
    del table
    before = _rss()
    meta = MetadataTable(tmp_path)
    grew = _rss() - before
    assert meta.num_rows == n and grew < size / 8, (grew, size)
    rows = [99_999, 5, 4096, 4095, 5]
    assert meta.values("key", rows) == [f"k{i:06d}" for i in rows]
    assert meta.values("caption", [12_345]) == ["x" * 300 + "12345"]
    assert meta.values("url", [1, 2]) == [None, None]  # a column this table lacks
