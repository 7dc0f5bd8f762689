"""How fast a `Searcher` over a 100M-row corpus starts, and how much memory it holds: the
memory-mapped path (`metadata.arrow` through an Arrow memory map, FAISS `IO_FLAG_MMAP_IFC`)
against today's (the base revision's Searcher: the whole metadata as a pandas frame, the index
read whole), side by side at a row count that fits in RAM.

    python bench/search_start.py                          # 100M rows (new path), 10M (both paths)
    python bench/search_start.py --write-doc              # also rewrite the section in docs/benchmarks.md
    python bench/search_start.py --rows 1000000 --old-rows 1000000 --vectors 200000   # a quick look

The corpus is built once into ``--work`` (kept and reused: the 100M-row build writes about 12 GB
and takes minutes). ``metadata.arrow`` holds ``--rows`` img2dataset-like rows (``key``,
``caption`` of about 30 characters, ``caption_index``, ``url`` of about 50, ``width``,
``height``) in record batches of 1M rows. The FAISS index is an ``IVF1024,SQ8`` (``--factory``)
over ``--vectors`` clustered 512-d vectors (2M by default; SQ8 because its training is a min and
a max, where PQ's 64 k-means take minutes on 2 cores), whose ``image_rows.npy`` spreads them
evenly over all the metadata rows: the index holds fewer vectors than the metadata has rows
because adding 100M vectors takes hours on 2 cores, and what is measured here is the start-up
and the lookups, which touch the metadata and the mapped index, not the vector count
(bench/search_scale.py measures indexes at scale). The index directory at ``--old-rows``
shares that index file, with rows spread over its own rows, and carries ``metadata.parquet``
too, which today's Searcher reads.

Each path runs in a fresh process: the time from spawning it to a ready ``Searcher`` (the
interpreter, imports and the open; the open alone beside it), the resident memory after the
open, then after ``--lookups`` random single-row metadata lookups (``searcher.metadata([row])``;
today's: every column of the row from the frame) and ``--queries`` single-vector
``search_vectors`` calls (k=10, no model: random unit vectors). The page cache is warm (the
files were just written or read); a cold disk adds the reads of the pages a lookup touches.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import _bootstrap  # noqa: F401  (python bench/x.py: puts the repository root on sys.path)

from bench.harness import DOC, ROOT, LoadWatch, command, cpu_line, parser, ratio, table, today, write_section

SECTION = "## Search start-up: memory-mapped against a pandas frame (bench/search_start.py)"
BASE = "4346fd8"  # the last commit before issue 41's work: today's Searcher
BATCH_ROWS = 1_000_000  # metadata.arrow's record batch size
DIM = 512
WORDS = "cat dog red car tree boat bird house sunset plane horse flower bridge river city beach".split()
HOSTS = [f"https://cdn{i}.example-images.org" for i in range(40)]
ARROW_BYTES_PER_ROW = 140  # metadata.arrow, measured at 1M rows (138): strings, offsets and ints
PARQUET_BYTES_PER_ROW = 30  # metadata.parquet (snappy), measured at 200k rows (24)
READY = "ready"

# The child: a fresh interpreter that opens a Searcher and reports times and memory as JSON.
PROBE = r"""
import json, sys, time
cfg = json.loads(sys.argv[1])
def mem():
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, value = line.split(":", 1)
            if key in ("VmRSS", "RssAnon", "RssFile", "VmHWM"):
                out[key] = int(value.split()[0]) * 1024
    return out
import numpy as np
from mmalign.search.searcher import Searcher
t = time.perf_counter()
s = Searcher(cfg["index"]) if cfg["old"] else Searcher(cfg["index"], mmap=cfg["mmap"])
opened = time.perf_counter() - t
ready = time.time()
after_open = mem()
rng = np.random.default_rng(1)
rows = rng.integers(0, cfg["rows"], cfg["lookups"])
if cfg["old"]:  # today's Searcher holds the frame: every column of a row, as its hits read them
    cols = list(s.meta.columns)
    def look(r):
        return {c: s.meta.at[r, c] for c in cols}
else:
    def look(r):
        return s.metadata([r])[0]
first = {k: (v.item() if hasattr(v, "item") else v) for k, v in look(int(rows[0])).items()}
t = time.perf_counter()
for r in rows:
    look(int(r))
lookup = (time.perf_counter() - t) / max(1, len(rows))
q = rng.standard_normal((cfg["queries"], cfg["dim"])).astype(np.float32)
q /= np.linalg.norm(q, axis=1, keepdims=True)
t = time.perf_counter()
hits = [s.search_vectors(q[i : i + 1], k=10)[0] for i in range(len(q))]
search = (time.perf_counter() - t) / max(1, len(q))
print(json.dumps({"ready": ready, "open_s": opened, "after_open": after_open, "after_queries": mem(),
    "lookup_s": lookup, "search_s": search, "first_row": int(rows[0]), "first": first,
    "hit_rows": [h.row for h in hits[0]]}))
"""


def metadata_batch(start: int, n: int):
    """Rows ``start .. start+n`` of the synthetic corpus (row i's values depend on i alone)."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc

    rows = np.arange(start, start + n, dtype=np.int64)
    digits = (rows[:, None] // 10 ** np.arange(8, -1, -1)) % 10 + 48  # (n, 9) ASCII, zero-padded
    offsets = pa.py_buffer((np.arange(n + 1, dtype=np.int32) * 9).tobytes())
    key = pa.StringArray.from_buffers(n, offsets, pa.py_buffer(digits.astype(np.uint8).tobytes()))
    h = (rows * 2654435761) % (1 << 32)  # a cheap per-row hash: the same row, the same words
    words = pa.array(WORDS)
    w1, w2 = words.take(pa.array(h % len(WORDS))), words.take(pa.array((h >> 8) % len(WORDS)))
    caption = pc.binary_join_element_wise("a photo of a", w1, "by the", w2, key, " ")
    host = pa.array(HOSTS).take(pa.array((h >> 16) % len(HOSTS)))
    url = pc.binary_join_element_wise(host, "/images/", key, ".jpg", "")
    sizes = np.array([256, 320, 480, 512, 640, 800, 1024, 1280], dtype=np.int64)
    return pa.record_batch(
        {
            "key": key,
            "caption": caption,
            "caption_index": pa.array(np.zeros(n, dtype=np.int64)),
            "url": url,
            "width": pa.array(sizes[h % len(sizes)]),
            "height": pa.array(sizes[(h >> 4) % len(sizes)]),
        }
    )


def build_index(work: Path, vectors: int, factory: str) -> Path:
    """An IVF index (``factory``) over ``vectors`` clustered unit vectors, trained on a sample, added in blocks."""
    import faiss
    import numpy as np

    path = work / f"{factory.replace(',', '-')}-{vectors}.index"
    if path.is_file():
        return path
    rng = np.random.default_rng(0)
    centres = rng.standard_normal((1000, DIM)).astype(np.float32)  # (C, D) clusters, not uniform noise

    def block(n: int):
        x = centres[rng.integers(0, len(centres), n)] + 0.7 * rng.standard_normal((n, DIM)).astype(np.float32)
        return x / np.linalg.norm(x, axis=1, keepdims=True)  # (n, D)

    index = faiss.index_factory(DIM, factory, faiss.METRIC_INNER_PRODUCT)
    index.train(block(min(vectors, max(40 * faiss.extract_index_ivf(index).nlist, 10_000))))
    for a in range(0, vectors, 100_000):
        index.add(block(min(100_000, vectors - a)))
    tmp = path.with_suffix(".tmp")
    faiss.write_index(index, str(tmp))
    tmp.rename(path)
    return path


def build_dir(work: Path, rows: int, index_file: Path, vectors: int, parquet: bool) -> Path:
    """An index directory (contract C2) with ``rows`` metadata rows; ``parquet``: metadata.parquet too."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.ipc as ipc
    import pyarrow.parquet as pq

    out = work / f"rows-{rows}"
    out.mkdir(parents=True, exist_ok=True)
    arrow = out / "metadata.arrow"
    if not (out / ".arrow-done").is_file():
        schema = metadata_batch(0, 1).schema
        with ipc.new_file(str(arrow), schema) as w:  # uncompressed: a memory map reads it in place
            for a in range(0, rows, BATCH_ROWS):
                w.write_batch(metadata_batch(a, min(BATCH_ROWS, rows - a)))
        (out / ".arrow-done").touch()
    if parquet and not (out / ".parquet-done").is_file():
        reader = ipc.open_file(pa.memory_map(str(arrow), "r"))
        with pq.ParquetWriter(str(out / "metadata.parquet"), reader.schema) as w:
            for i in range(reader.num_record_batches):
                w.write_batch(reader.get_batch(i))
        (out / ".parquet-done").touch()
    target = out / "image.index"
    if not target.exists():
        try:
            os.link(index_file, target)  # one index file for every row count
        except OSError:
            shutil.copyfile(index_file, target)
    np.save(out / "image_rows.npy", (np.arange(vectors, dtype=np.int64) * rows) // vectors)  # spread evenly
    factory = index_file.name.rsplit("-", 1)[0].replace("-", ",")
    params = {"kind": "ivf-sq8", "factory": factory, "count": vectors, "nprobe": 16}  # nprobe: today's key
    params |= {"search": {"nprobe": 16}, "shards": [{"index": "image.index", "rows": "image_rows.npy"}]}
    info = {"dim": DIM, "metric": "inner_product", "emb_dir": str(work), "model": None, "rows": rows}
    (out / "index.json").write_text(json.dumps({**info, "image": params}))
    return out


def base_tree(rev: str, work: Path) -> Path:
    """The repository at ``rev`` (``git archive``), extracted once into ``work``."""
    import tarfile

    out = work / f"base-{rev}"
    if (out / ".done").is_file():
        return out
    out.mkdir(parents=True, exist_ok=True)
    archive = work / "base.tar"
    with open(archive, "wb") as f:
        subprocess.run(["git", "archive", rev], cwd=ROOT, stdout=f, check=True)
    with tarfile.open(archive) as tar:
        tar.extractall(out, filter="data")
    archive.unlink()
    (out / ".done").touch()
    return out


def probe(
    tree: Path, index_dir: Path, rows: int, *, old: bool, mmap: bool, lookups: int, queries: int
) -> dict:
    """One fresh process opening a Searcher from ``tree``: its times and memory."""
    cfg = {"index": str(index_dir), "rows": rows, "old": old, "mmap": mmap, "lookups": lookups}
    cfg |= {"queries": queries, "dim": DIM}
    env = {**os.environ, "PYTHONPATH": str(tree)}
    spawned = time.time()
    proc = subprocess.run(
        [sys.executable, "-c", PROBE, json.dumps(cfg)], cwd=tree, env=env, capture_output=True, text=True
    )
    if proc.returncode:
        tail = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise SystemExit(f"bench/search_start.py: the probe of {index_dir} failed: {tail}")
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    out["start_s"] = out["ready"] - spawned
    return out


def mem_available() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def check_room(work: Path, args) -> None:
    """One line and exit 2 when the disk cannot hold the corpus or RAM the old path's frame."""
    need = args.rows * ARROW_BYTES_PER_ROW + args.vectors * (DIM + 8)
    if args.old_rows and args.old_rows != args.rows:
        need += args.old_rows * ARROW_BYTES_PER_ROW
    need += args.old_rows * PARQUET_BYTES_PER_ROW
    have = [p for p in (work / f"rows-{args.rows}", work / f"rows-{args.old_rows}") if p.is_dir()]
    built = sum(f.stat().st_size for p in have for f in p.iterdir() if f.is_file())
    free = shutil.disk_usage(work).free
    if need - built > free:
        raise SystemExit(
            f"bench/search_start.py: {work} has {free / 1e9:.1f} GB free, the corpus needs about "
            f"{(need - built) / 1e9:.1f} GB more (--rows {args.rows:,}, --old-rows {args.old_rows:,}); "
            "pass a smaller --rows or another --work"
        )
    old_ram = args.old_rows * 3 * ARROW_BYTES_PER_ROW  # the frame plus the table it was decoded from
    if old_ram > mem_available():
        raise SystemExit(
            f"bench/search_start.py: today's path at --old-rows {args.old_rows:,} needs about "
            f"{old_ram / 1e9:.1f} GB of RAM, {mem_available() / 1e9:.1f} GB is available; pass a smaller --old-rows"
        )


def expected_row(row: int) -> dict:
    """The generator's values of one row (the reference the lookups are checked against)."""
    return metadata_batch(row, 1).to_pylist()[0]


def markdown(points: list[dict], args, rev: str) -> str:
    mb = 1 / 2**20
    rows_out = []
    for p in points:
        r = p["result"]
        rows_out.append(
            [
                f"{p['rows']:,}",
                p["path"],
                f"{r['start_s']:.2f} ({r['open_s']:.2f})",
                f"{r['after_open']['VmRSS'] * mb:,.0f} ({r['after_open'].get('RssAnon', 0) * mb:,.0f})",
                f"{r['after_queries']['VmRSS'] * mb:,.0f} ({r['after_queries'].get('RssAnon', 0) * mb:,.0f})",
                f"{r['after_queries']['VmHWM'] * mb:,.0f}",
                f"{r['lookup_s'] * 1e6:,.1f}",
                f"{r['search_s'] * 1e3:.2f}",
            ]
        )
    cols = [
        "rows",
        "path",
        "start s (open s)",
        "RSS MB after open (anon)",
        "RSS MB after queries (anon)",
        "peak RSS MB",
        "lookup µs/row",
        "search ms/query",
    ]
    header = (
        f"Command: `{command()}` · {today()} · {cpu_line()} · base `{rev}` · `{args.factory}` over "
        f"{args.vectors:,} x {DIM} vectors spread over the rows, nprobe 16 · {args.lookups} lookups, "
        f"{args.queries} queries · warm page cache"
    )
    lines = [f"{SECTION}\n\n{header}\n\n" + table(cols, rows_out)]
    new = next((p["result"] for p in points if p["rows"] == args.old_rows and p["path"] == "new, mmap"), None)
    old = next((p["result"] for p in points if p["path"].startswith("today")), None)
    whole = next((p["result"] for p in points if p["path"] == "new, no mmap"), None)
    if new and old:
        lines.append(
            f"\nNew (mmap) against today's at {args.old_rows:,} rows: start "
            f"{ratio(new['start_s'], old['start_s'])}, open {ratio(new['open_s'], old['open_s'])}, "
            f"RSS after open {ratio(new['after_open']['VmRSS'], old['after_open']['VmRSS'])}, "
            f"peak RSS {ratio(new['after_queries']['VmHWM'], old['after_queries']['VmHWM'])}, "
            f"lookup {ratio(new['lookup_s'], old['lookup_s'])}.\n"
        )
    if whole and old and args.rows > args.old_rows:  # both read the index whole: the rest is the frame
        anon = "RssAnon" if "RssAnon" in old["after_open"] else "VmRSS"
        per_row = (old["after_open"][anon] - whole["after_open"][anon]) / args.old_rows
        peak_row = (old["after_queries"]["VmHWM"] - whole["after_queries"]["VmHWM"]) / args.old_rows
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        fits = max(per_row, peak_row) * args.rows < ram
        verdict = "within" if fits else "more than"
        lines.append(
            f"\nToday's path holds the frame: about {per_row:.0f} bytes a row of its own memory more than "
            f"the new path without mmap (which also reads the index whole) after the open and {peak_row:.0f} bytes a row more at its peak, so at {args.rows:,} rows it "
            f"would hold about {per_row * args.rows / 2**30:.1f} GiB and peak near "
            f"{peak_row * args.rows / 2**30:.1f} GiB, {verdict} this machine's {ram / 2**30:.0f} GiB "
            f"(measured at {args.old_rows:,} rows; the per-row figures include pandas' own import).\n"
        )
    lines.append(
        "\nstart s: spawning the process to a ready Searcher (interpreter, imports, open); open s: "
        "the `Searcher(...)` call alone. RSS counts the mapped file pages a process has touched "
        "(anon: its own memory). The index holds fewer vectors than the metadata has rows (adding "
        "100M vectors takes hours on 2 cores); the start-up measured here reads the metadata and "
        "maps the index whatever the vector count. The issue's claim (a 100M-row corpus starts in "
        "seconds with bounded RSS) is the default run: `python bench/search_start.py --write-doc`, "
        "100M rows on the new path and 10M on both.\n"
    )
    return "".join(lines)


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--rows", type=int, default=100_000_000, help="metadata rows of the new path's corpus")
    p.add_argument("--old-rows", type=int, default=10_000_000, help="rows where both paths run (fits in RAM)")
    p.add_argument("--vectors", type=int, default=2_000_000, help="vectors in the IVF-PQ index")
    p.add_argument("--nlist", type=int, default=1024, help="IVF lists (fewer when the vectors are few)")
    p.add_argument(
        "--factory", default="IVF{nlist},SQ8", help="FAISS factory of the index ({nlist}: --nlist)"
    )
    p.add_argument("--lookups", type=int, default=1000, help="random single-row metadata lookups")
    p.add_argument("--queries", type=int, default=100, help="single-vector searches")
    p.add_argument("--base", default=BASE, help=f"the git revision of today's Searcher (default {BASE})")
    p.add_argument("--work", type=Path, default=None, help="the corpus cache (default: a temporary folder)")
    p.add_argument("--doc", type=Path, default=DOC, help="the document --write-doc rewrites")
    p.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = p.parse_args()
    if min(args.rows, args.old_rows, args.vectors) < 1 or args.old_rows > args.rows:
        raise SystemExit("bench/search_start.py: need 1 <= --old-rows <= --rows and --vectors >= 1")
    watch = LoadWatch()
    with tempfile.TemporaryDirectory(prefix="search_start-") as tmp:
        work = args.work or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        check_room(work, args)
        rev = subprocess.run(
            ["git", "rev-parse", "--short", args.base], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout.strip()
        t = time.perf_counter()
        args.factory = args.factory.format(
            nlist=max(1, min(args.nlist, args.vectors // 40))
        )  # k-means: >= 39 a list
        index_file = build_index(work, args.vectors, args.factory)
        big = build_dir(work, args.rows, index_file, args.vectors, parquet=args.rows == args.old_rows)
        small = build_dir(work, args.old_rows, index_file, args.vectors, parquet=True)
        print(f"corpus ready in {time.perf_counter() - t:.0f} s under {work}", flush=True)
        base = base_tree(rev, work)
        runs = [(args.rows, big, "new, mmap", ROOT, False, True)]
        if args.old_rows != args.rows:
            runs.append((args.old_rows, small, "new, mmap", ROOT, False, True))
        runs += [
            (args.old_rows, small, "new, no mmap", ROOT, False, False),
            (args.old_rows, small, f"today's ({rev}): pandas frame", base, True, False),
        ]
        points = []
        for rows, index_dir, path, tree, old, mmap in runs:
            r = probe(tree, index_dir, rows, old=old, mmap=mmap, lookups=args.lookups, queries=args.queries)
            want = expected_row(r["first_row"])
            got = {k: r["first"].get(k) for k in want}
            if got != want:
                raise SystemExit(
                    f"bench/search_start.py: {path} read row {r['first_row']} as {got}, not {want}"
                )
            points.append({"rows": rows, "path": path, "result": r})
            print(
                f"{rows:>12,} {path:<32} start {r['start_s']:6.2f} s (open {r['open_s']:6.2f} s)  RSS "
                f"{r['after_open']['VmRSS'] / 2**20:8.0f} -> {r['after_queries']['VmRSS'] / 2**20:8.0f} MB  "
                f"lookup {r['lookup_s'] * 1e6:8.1f} us  search {r['search_s'] * 1e3:6.2f} ms",
                flush=True,
            )
    text = markdown(points, args, rev)
    print(text)
    if args.json:
        args.json.write_text(json.dumps(points))
    if args.write_doc:
        write_section(args.doc, text, watch, args.allow_loaded)


if __name__ == "__main__":
    main()
