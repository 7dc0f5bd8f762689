"""Text queries per second through `mmalign serve` at 1, 4 and 16 concurrent clients: today's
server (the tree at a base git revision) against the working tree's, side by side in one run.

    python bench/search_serve.py                     # 100k x 512 exact index, 10 s per point
    python bench/search_serve.py --write-doc         # also rewrite the section in docs/benchmarks.md
    python bench/search_serve.py --n 2000 --seconds 1 --clients 1 4   # a quick look

Both servers load the same index directory and the same model (a seeded random micro model
with a 512-d projection: weights do not change the time) and run with the same flags
(``--workers`` = the most clients). The index is written here directly: ``--n`` random unit
vectors in an exact Flat index (``--factory`` for another FAISS kind), one shard, with both
``metadata.parquet`` (which today's server reads) and ``metadata.arrow``. The base tree comes
from ``git archive BASE`` into a temporary folder, started with that folder first on
``PYTHONPATH``. Each client is a thread that sends ``GET /search?text=...&k=10`` with a new
connection per request (the server answers one request per connection, HTTP/1.0 style), each
query a different text; latency is measured from connect to the last byte. Per point: a
warm-up, then ``--seconds`` of load; the servers take turns at each client count (base, then
new). The issue's goal: at 16 clients >= 3x the base QPS with p99 no worse.
"""

from __future__ import annotations

import http.client
import json
import os
import socket
import statistics
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from pathlib import Path
from urllib.parse import quote

import _bootstrap  # noqa: F401  (python bench/x.py: puts the repository root on sys.path)

from bench.harness import DOC, ROOT, LoadWatch, command, cpu_line, parser, ratio, table, today, write_section

SECTION = "## Search server throughput (bench/search_serve.py)"
BASE = "4346fd8"  # the last commit before issue 41's work
WORDS = [
    "cat",
    "dog",
    "red car",
    "tree",
    "boat",
    "bird",
    "house",
    "sunset",
    "plane",
    "horse",
    "flower",
    "bridge",
]


def build_corpus(work: Path, n: int, dim: int, factory: str) -> tuple[str, str]:
    """A micro model with a ``dim`` projection and an index directory of ``n`` random unit vectors."""
    import faiss
    import numpy as np
    import pyarrow as pa
    import pyarrow.ipc as ipc
    import pyarrow.parquet as pq

    from tests.harness.searchdata import save_random_model

    model = save_random_model(work / "model", seed=41, embed_dim=dim)
    idx = work / "idx"
    idx.mkdir()
    rng = np.random.default_rng(0)
    index = faiss.index_factory(dim, factory, faiss.METRIC_INNER_PRODUCT)
    chunk = 50_000
    if not index.is_trained:
        train = rng.standard_normal((min(n, 50_000), dim)).astype(np.float32)
        index.train(train / np.linalg.norm(train, axis=1, keepdims=True))
    for a in range(0, n, chunk):
        x = rng.standard_normal((min(chunk, n - a), dim)).astype(np.float32)  # (c, D)
        index.add(x / np.linalg.norm(x, axis=1, keepdims=True))
    faiss.write_index(index, str(idx / "image.index"))
    np.save(idx / "image_rows.npy", np.arange(n, dtype=np.int64))
    params = {"kind": factory, "factory": factory, "count": n}
    if "IVF" in factory:
        params["nprobe"] = 16  # the old format's place for it; the new reader accepts it too
    info = {"dim": dim, "metric": "inner_product", "emb_dir": str(work), "model": model, "rows": n}
    (idx / "index.json").write_text(json.dumps({**info, "image": params}))
    meta = pa.table(
        {
            "key": [f"{i:09d}" for i in range(n)],
            "caption": [f"a photo of a {WORDS[i % len(WORDS)]}, number {i}" for i in range(n)],
            "caption_index": pa.array([0] * n, pa.int64()),
            "json": ["{}"] * n,
            "url": [f"https://example.org/img/{i}.jpg" for i in range(n)],
        }
    )
    pq.write_table(meta, idx / "metadata.parquet")
    with ipc.new_file(str(idx / "metadata.arrow"), meta.schema) as w:
        w.write_table(meta, max_chunksize=65_536)
    return model, str(idx)


def base_tree(rev: str, work: Path) -> Path:
    """The repository at ``rev``, extracted with ``git archive``."""
    out = work / f"base-{rev}"
    out.mkdir()
    archive = work / "base.tar"
    with open(archive, "wb") as f:
        subprocess.run(["git", "archive", rev], cwd=ROOT, stdout=f, check=True)
    with tarfile.open(archive) as tar:
        tar.extractall(out, filter="data")
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """``python -m mmalign.cli serve`` from ``tree`` (first on PYTHONPATH), its access log discarded."""

    def __init__(self, tree: Path, model: str, index: str, workers: int, log: Path):
        self.port = free_port()
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tree), os.environ.get("PYTHONPATH", "")])}
        probe = subprocess.run(
            [sys.executable, "-c", "import mmalign; print(mmalign.__file__)"],
            cwd=tree,
            env=env,
            capture_output=True,
            text=True,
            check=True,
        )
        if not Path(probe.stdout.strip()).resolve().is_relative_to(tree.resolve()):
            raise SystemExit(f"bench/search_serve.py: {tree} does not come first ({probe.stdout.strip()})")
        argv = ["serve", "--index", index, "--model", model, "--port", str(self.port)]
        argv += ["--workers", str(workers), "--max-per-client", str(4 * workers)]
        self.log = open(log, "w")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "mmalign.cli", *argv], cwd=tree, env=env, stdout=self.log, stderr=self.log
        )
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise SystemExit(f"bench/search_serve.py: the server from {tree} exited; see {log}")
            try:
                status, _ = request(self.port, "/health")
                if status == 200:
                    for i in range(3):  # first-query costs (lazy imports, first forward) out of the points
                        request(self.port, f"/search?text=warm+up+{i}&k=10")
                    return
            except OSError:
                pass
            time.sleep(0.2)
        raise SystemExit(f"bench/search_serve.py: the server from {tree} did not answer in 300 s")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


def request(port: int, path: str) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        conn.request("GET", path)
        reply = conn.getresponse()
        return reply.status, reply.read()
    finally:
        conn.close()


def load(port: int, clients: int, seconds: float, warmup: float) -> dict:
    """``clients`` threads querying for ``warmup`` + ``seconds``; QPS and latency of the timed part."""
    start = time.monotonic()
    t0, t1 = start + warmup, start + warmup + seconds
    latencies: list[list[float]] = [[] for _ in range(clients)]
    errors = [0] * clients
    first_error: list[str] = []

    def client(c: int) -> None:
        i = 0
        while True:
            sent = time.monotonic()
            if sent >= t1:
                return
            text = f"a photo of a {WORDS[(c + i) % len(WORDS)]} seen by client {c}, query {i}"
            i += 1
            try:
                status, body = request(port, f"/search?text={quote(text)}&k=10")
                ok = status == 200 and b'"hits"' in body
            except OSError as e:
                ok, status, body = False, 0, str(e).encode()
            if not ok and not first_error:
                first_error.append(f"{status} {body[:200]!r}")
            done = time.monotonic()
            if t0 <= sent and done <= t1:
                if ok:
                    latencies[c].append(done - sent)
                else:
                    errors[c] += 1

    threads = [threading.Thread(target=client, args=(c,)) for c in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if first_error:
        print(f"  first error at {clients} clients: {first_error[0]}", file=sys.stderr)
    lat = sorted(x for per in latencies for x in per)
    if not lat:
        return {"qps": 0.0, "p50_ms": float("nan"), "p99_ms": float("nan"), "ok": 0, "errors": sum(errors)}
    p99 = lat[min(len(lat) - 1, int(round(0.99 * (len(lat) - 1))))]
    return {
        "qps": len(lat) / seconds,
        "p50_ms": statistics.median(lat) * 1e3,
        "p99_ms": p99 * 1e3,
        "ok": len(lat),
        "errors": sum(errors),
    }


def markdown(results: dict, args, rev: str) -> str:
    rows = []
    for c in args.clients:
        old, new = results["base"][c], results["new"][c]
        rows.append(
            [
                c,
                f"{old['qps']:.1f}",
                f"{new['qps']:.1f}",
                ratio(new["qps"], old["qps"]),
                f"{old['p50_ms']:.1f} / {old['p99_ms']:.1f}",
                f"{new['p50_ms']:.1f} / {new['p99_ms']:.1f}",
                ratio(new["p99_ms"], old["p99_ms"]),
                f"{old['errors']} / {new['errors']}",
            ]
        )
    top = max(args.clients)
    old, new = results["base"][top], results["new"][top]
    met = old["qps"] > 0 and new["qps"] >= 3 * old["qps"] and new["p99_ms"] <= old["p99_ms"]
    header = (
        f"Command: `{command()}` · {today()} · {cpu_line()} · base `{rev}` · "
        f"{args.n:,} x {args.dim} `{args.factory}` vectors, k=10, {args.seconds:g} s per point, "
        f"a new connection per request"
    )
    goal = (
        f"Goal (issue 41): at {top} clients >= 3x the base QPS with p99 no worse: "
        f"{'met' if met else 'not met'} ({ratio(new['qps'], old['qps'])} QPS, p99 "
        f"{new['p99_ms']:.1f} ms against {old['p99_ms']:.1f} ms)."
    )
    cols = [
        "clients",
        "base QPS",
        "new QPS",
        "new / base QPS",
        "base p50 / p99 ms",
        "new p50 / p99 ms",
        "new / base p99",
        "errors base / new",
    ]
    return f"{SECTION}\n\n{header}\n\n" + table(cols, rows) + f"\n{goal}\n"


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--base", default=BASE, help=f"the git revision of today's server (default {BASE})")
    p.add_argument("--n", type=int, default=100_000, help="vectors in the index")
    p.add_argument("--dim", type=int, default=512, help="embedding dimension (the model's projection)")
    p.add_argument("--factory", default="Flat", help="FAISS factory string of the index (Flat: exact)")
    p.add_argument("--clients", type=int, nargs="+", default=[1, 4, 16], help="concurrent clients per point")
    p.add_argument("--seconds", type=float, default=10.0, help="timed load per point")
    p.add_argument("--warmup", type=float, default=2.0, help="untimed load before each point")
    p.add_argument(
        "--work", type=Path, default=None, help="a folder for the corpus and logs (default: temporary)"
    )
    p.add_argument("--doc", type=Path, default=DOC, help="the document --write-doc rewrites")
    p.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = p.parse_args()
    watch = LoadWatch()
    with tempfile.TemporaryDirectory(prefix="search_serve-") as tmp:
        work = args.work or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        rev = subprocess.run(
            ["git", "rev-parse", "--short", args.base], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout.strip()
        model, index = build_corpus(work, args.n, args.dim, args.factory)
        trees = {"base": base_tree(rev, work), "new": ROOT}
        workers = max(args.clients)
        servers = {}
        try:
            for name, tree in trees.items():
                servers[name] = Server(tree, model, index, workers, work / f"{name}.log")
            results: dict = {"base": {}, "new": {}}
            for c in args.clients:
                for name in ("base", "new"):  # the two take turns at each point
                    results[name][c] = load(servers[name].port, c, args.seconds, args.warmup)
                    r = results[name][c]
                    print(
                        f"{name:>4} {c:>3} clients: {r['qps']:8.1f} QPS  p50 {r['p50_ms']:7.1f} ms  "
                        f"p99 {r['p99_ms']:7.1f} ms  errors {r['errors']}",
                        flush=True,
                    )
        finally:
            for s in servers.values():
                s.stop()
    text = markdown(results, args, rev)
    print(text)
    if args.json:
        args.json.write_text(json.dumps({k: {str(c): v for c, v in r.items()} for k, r in results.items()}))
    if args.write_doc:
        write_section(args.doc, text, watch, args.allow_loaded)


if __name__ == "__main__":
    main()
