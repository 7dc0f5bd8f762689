"""Remote shard specs (http(s) with and without Range support, pipe:CMD, fsspec): the same
stream as local files, exact resume, retries then a counted skip, gzip resume refusal, a
re-filled shuffle buffer that opens each shard once, and a start-up check done by rank 0."""

import gzip
import json
import os
import random
import signal
import subprocess
import sys
import time

import pytest
import torch

from mmalign.config import ConfigError, DataConfig
from mmalign.data import remote, shards
from tests.harness import ROOT, run_ranks
from tests.harness.shard_server import serve


# The loader-test helpers import open_clip (seconds): imported when used, so the spawned ranks
# of the start-up check, which import this module, start quickly.
def loader_for(*args, **kwargs):
    from tests.data.test_data_loader import loader_for as build

    return build(*args, **kwargs)


def make_shards(*args, **kwargs):
    from tests.data.test_data_loader import make_shards as write

    return write(*args, **kwargs)


def take(*args, **kwargs):
    from tests.data.test_data_loader import take as first

    return first(*args, **kwargs)


@pytest.fixture(autouse=True)
def _fresh_process_state(monkeypatch):
    """Log-once and checked-list memories are per process; each test starts without them."""
    monkeypatch.setattr(remote, "_said", set())
    monkeypatch.setattr(shards, "_checked", set())


def _same(got, ref):
    assert [b.keys for b in got] == [b.keys for b in ref]
    assert [b.captions for b in got] == [b.captions for b in ref]
    for a, b in zip(got, ref):
        assert torch.equal(a.images, b.images)


# ---------------------------------------------------------------- loader level


@pytest.mark.parametrize("kind", ["http", "http-without-ranges", "pipe"])
def test_remote_stream_and_its_resume_equal_the_local_stream(tmp_path, kind, caplog):
    # A fixed draw whose resume point lies inside a shard: with others the refill may start at
    # a shard's first sample, where no seek is needed and so nothing is said.
    rng = random.Random(0)
    make_shards(tmp_path, [rng.randint(9, 14) for _ in range(4)], rng)
    local = f"{tmp_path}/{{00000..00003}}.tar"
    seed, total = rng.randrange(1000), 12
    cut = rng.randrange(3, total - 3)
    reference = take(loader_for(local, mode="resampled", workers=0, seed=seed), total)
    with serve(tmp_path, ranges=kind == "http") as server:
        spec = f"pipe:cat {local}" if kind == "pipe" else f"{server.url}/{{00000..00003}}.tar"
        _same(take(loader_for(spec, mode="resampled", workers=0, seed=seed), total), reference)

        first = loader_for(spec, mode="resampled", workers=0, seed=seed)
        head = take(first, cut)
        state = json.loads(json.dumps(first.state_dict()))
        resumed = loader_for(spec, mode="resampled", workers=0, seed=seed)
        resumed.load_state_dict(state)
        server.requests.clear()
        with caplog.at_level("INFO", logger="mmalign.data"):
            tail = take(resumed, total - cut)
        _same(head + tail, reference)
        ranged = [r for _, r in server.requests if r]
    said = [r.getMessage() for r in caplog.records if "exact resume" in r.getMessage()]
    expected = {
        "http": "by HTTP range requests",
        "http-without-ranges": "ignores HTTP ranges",
        "pipe": "re-runs the command",
    }[kind]
    assert len(said) == 1 and expected in said[0], said  # once, not per sample or per shard
    if kind != "pipe":
        assert ranged, "the resume asked for no byte range"


def test_pipe_and_fsspec_specs_read_the_same_samples(tmp_path):
    fsspec = pytest.importorskip("fsspec")
    rng = random.Random(0)
    make_shards(tmp_path, [7, 9], rng)
    local = f"{tmp_path}/{{00000..00001}}.tar"
    reference = take(loader_for(local, mode="epoch", workers=0, buffer=1, batch=4), 4)
    memory = fsspec.filesystem("memory")
    for name in ("00000.tar", "00001.tar"):
        memory.pipe(f"/remote-test/{name}", (tmp_path / name).read_bytes())
    for spec in (f"pipe:cat {local}", "memory://remote-test/{00000..00001}.tar"):
        _same(take(loader_for(spec, mode="epoch", workers=0, buffer=1, batch=4), 4), reference)
    with pytest.raises(ConfigError, match=r"config key 'data.train': shard not readable: pipe:cat .*missing"):
        loader_for(f"pipe:cat {tmp_path}/missing.tar", mode="epoch", remote_retries=0)


def test_a_shard_that_keeps_failing_is_skipped_and_counted(tmp_path):
    rng = random.Random(0)
    keys = make_shards(tmp_path, [4, 4, 4, 4], rng)
    by_shard = {s: [k for k in keys if k.startswith(f"{s:05d}")] for s in range(4)}
    with serve(tmp_path) as server:
        loader = loader_for(
            f"{server.url}/{{00000..00003}}.tar",
            mode="epoch",
            workers=0,
            buffer=1,
            batch=3,
            remote_retries=2,
            remote_backoff=0.01,
        )
        server.requests.clear()
        server.fail["00001.tar"] = -1  # 503 for ever: retried twice, then skipped
        server.fail["00002.tar"] = 2  # two 503s, then fine: read whole
        server.cut["00000.tar"] = 1  # the body stops half-way once: continued from that byte
        os.rename(tmp_path / "00003.tar", tmp_path / "gone.tar")  # 404: not retried
        batches = take(loader, 6)  # 18 rows: past epoch 0's 8 readable samples on every lane
        requests = [name for name, _ in server.requests]
    got = [k for b in batches for k, e in zip(b.keys, b.epochs.tolist()) if e == 0]
    assert sorted(got) == sorted(by_shard[0] + by_shard[2])
    failed = batches[-1].skipped["unreadable_shard"]  # once per lane's piece of a failing shard
    assert batches[-1].skipped == {"unreadable_shard": failed} and failed >= 2
    reads_of_1 = requests.count("00001.tar")
    assert reads_of_1 % 3 == 0 and requests.count("00002.tar") >= 3 and requests.count("00000.tar") >= 2
    assert failed == reads_of_1 // 3 + requests.count("00003.tar")


@pytest.mark.parametrize("length", [True, False], ids=["content-length", "close-delimited"])
def test_a_shard_cut_at_the_same_byte_every_time_is_a_counted_logged_skip(tmp_path, length, caplog):
    from mmalign.data.tario import iter_samples

    rng = random.Random(3)
    keys = make_shards(tmp_path, [10, 10], rng)
    with open(tmp_path / "00000.tar", "rb") as f:
        starts = [raw.offset for raw in iter_samples(f)]
    with serve(tmp_path) as server:
        server.cut_at["00000.tar"] = starts[4]  # between two samples: no member is cut
        if not length:
            server.no_length.add("00000.tar")  # the cut looks like the end of the body
        loader = loader_for(
            f"{server.url}/{{00000..00001}}.tar",
            mode="epoch",
            workers=0,
            buffer=1,
            batch=2,
            remote_retries=1,
            remote_backoff=0.01,
        )
        batches = take(loader, 10)  # 20 rows: past epoch 0 on both lanes
    got = [k for b in batches for k, e in zip(b.keys, b.epochs.tolist()) if e == 0]
    before_cut = keys[:4] if not length else keys[:3]  # a failed read of the next header loses the 4th
    assert sorted(got) == sorted(before_cut + keys[10:])  # the other shard whole; nothing after the cut
    skipped = batches[-1].skipped
    assert sum(skipped.values()) >= 1 and set(skipped) <= {"truncated_tar", "unreadable_shard"}, skipped
    named = [
        r.getMessage() for r in caplog.records if r.levelname == "WARNING" and "00000.tar" in r.getMessage()
    ]
    assert any("skipped sample" in m for m in named)  # the lane's counted skip, with the shard's name
    assert any("ends early" in m for m in named)  # and the count pass says it at start-up


@pytest.mark.parametrize("bound", ["bytes", "seconds"])
def test_an_endless_remote_shard_stops_start_up_with_one_line(tmp_path, bound, monkeypatch):
    from mmalign.data import shard_sizes

    make_shards(tmp_path, [4], random.Random(0))
    if bound == "bytes":
        monkeypatch.setattr(shard_sizes, "MAX_COUNT_BYTES", 2 << 20)
    else:
        monkeypatch.setattr(shard_sizes, "MAX_COUNT_SECONDS", 0.5)
    with serve(tmp_path) as server:
        server.endless.add("endless.tar")  # valid members for ever, never an end-of-archive block
        start = time.monotonic()
        with pytest.raises(ConfigError) as e:
            loader_for(
                f"{server.url}/00000.tar::{server.url}/endless.tar",
                mode="epoch",
                workers=0,
                batch=2,
                remote_retries=0,
            )
        took = time.monotonic() - start
    message = str(e.value)
    assert "\n" not in message and "endless.tar" in message and "has not ended" in message
    assert took < 20


def test_gzip_shards_stream_but_refuse_exact_resume(tmp_path):
    rng = random.Random(0)
    make_shards(tmp_path, [8, 8], rng)
    for name in ("00000", "00001"):
        (tmp_path / f"{name}.tar.gz").write_bytes(gzip.compress((tmp_path / f"{name}.tar").read_bytes()))
    reference = take(loader_for(f"{tmp_path}/{{00000..00001}}.tar", mode="epoch", workers=0, batch=4), 3)
    with serve(tmp_path) as server:
        for spec in (f"{tmp_path}/{{00000..00001}}.tar.gz", f"{server.url}/{{00000..00001}}.tar.gz"):
            first = loader_for(spec, mode="epoch", workers=0, batch=4)
            _same(take(first, 3), reference)
            again = loader_for(spec, mode="epoch", workers=0, batch=4)
            with pytest.raises(
                ConfigError,
                match=r"^config key 'data.train': cannot resume exactly inside gzip "
                r"shard .*store shards as plain \.tar",
            ):
                again.load_state_dict(first.state_dict())


@pytest.mark.parametrize("where", ["local", "http"])
def test_refilling_the_shuffle_buffer_opens_each_shard_once(tmp_path, where, monkeypatch):
    rng = random.Random(0)
    make_shards(tmp_path, [15] * 4, rng)
    with serve(tmp_path) as server:
        base = server.url if where == "http" else str(tmp_path)
        spec = f"{base}/{{00000..00003}}.tar"
        loader = loader_for(spec, mode="resampled", workers=0, buffer=40, batch=1)  # one lane: all 40 its own
        take(
            loader, 10
        )  # 10 taken, 40 buffered (of a 60-sample virtual epoch): the buffer spans several shards
        slot_state = json.loads(json.dumps(loader.state_dict()))["lane_states"]["0"]
        buffered = {ref[0] for ref in slot_state["buffer"]}
        assert len(slot_state["buffer"]) == 39  # 40 less the last one taken; one open each, before
        from mmalign.data import stream

        opened = []
        real_open = stream.open_shard

        def counting(path, *args, **kwargs):
            opened.append(path)
            return real_open(path, *args, **kwargs)

        monkeypatch.setattr(stream, "open_shard", counting)
        server.requests.clear()
        s = stream.LaneStream(loader.spec, 0, loader.processor, slot_state)
        assert sorted(opened) == sorted(loader.spec.urls[u] for u in buffered)  # was: one open per sample
        if where == "http":
            assert sorted(name for name, _ in server.requests) == sorted(f"{u:05d}.tar" for u in buffered)
        # the shard being read goes on from the file its buffered samples came from
        current, cursor, epoch = loader.spec.urls[slot_state["shard"]["url"]], s.cursor, s.epoch
        samples = s.samples()
        while s.cursor == cursor:  # until the next shard is drawn (and opened)
            next(samples)
        # one open for the refill and the rest of its piece, plus one per later piece of the same
        # shard that this fill went on to (resampled draws may repeat a shard)
        later = (
            s.order.pieces(0, epoch)[cursor : s.cursor]
            if s.epoch == epoch
            else s.order.pieces(0, epoch)[cursor:] + s.order.pieces(0, s.epoch)[: s.cursor]
        )
        assert opened.count(current) == 1 + sum(loader.spec.urls[u] == current for u, _, _ in later)


# ---------------------------------------------------------------- start-up check


def test_startup_probes_a_sample_of_remote_shards_and_names_backends(tmp_path):
    for i in range(250):
        (tmp_path / f"{i:03d}.tar").write_bytes(b"\0" * 1024)
    with serve(tmp_path) as server:
        urls = shards.expand_urls(f"{server.url}/{{000..249}}.tar")
        shards.check_urls(urls, "data.train")
        probed = {name for name, _ in server.requests}
        assert len(server.requests) == len(probed) == shards.REMOTE_SAMPLE
        assert {"000.tar", "249.tar"} <= probed
        server.requests.clear()
        shards.check_urls(urls, "data.train")  # checked once per process
        assert server.requests == []
        (tmp_path / "249.tar").unlink()
        shards._checked.clear()
        with pytest.raises(
            ConfigError,
            match=r"^config key 'data.val': shard not readable: .*/249.tar "
            r"\(PermanentError: HTTP 404",
        ):
            shards.check_urls(urls, "data.val", remote.RemoteOptions(retries=0))
    with pytest.raises(ConfigError, match=r"^config key 'data.train': s3:// shards need .*s3fs"):
        shards.check_urls(["s3://bucket/00000.tar"], "data.train")
    with pytest.raises(ConfigError, match=r"^config key 'data.train': unknown protocol nosuch://"):
        shards.check_urls(["nosuch://x/00000.tar"], "data.train")


def _rank_check(rank: int, world: int, base: str) -> dict:
    from mmalign.dist import distributed as mdist

    results = {}
    for name, spec in (("good", f"{base}/{{00..39}}.tar"), ("bad", f"{base}/{{00..40}}.tar")):
        try:
            shards.check_train_shards(DataConfig(train=spec, remote_retries=0), rank, mdist.broadcast_object)
            results[name] = None
        except ConfigError as e:
            results[name] = str(e)
    return results


@pytest.mark.integration
def test_only_rank_0_checks_the_shards_and_every_rank_learns_the_result(tmp_path):
    for i in range(40):
        (tmp_path / f"{i:02d}.tar").write_bytes(b"\0" * 1024)
    with serve(tmp_path) as server:
        everyone = run_ranks(_rank_check, 2, server.url, pooled=True)
        names = [name for name, _ in server.requests]
    assert everyone[0] == everyone[1]
    assert everyone[0]["good"] is None and "40.tar" in everyone[0]["bad"]
    assert sorted(set(names)) == [f"{i:02d}.tar" for i in range(41)]
    assert len(names) == 41 + 40  # rank 0 alone: 40 probes, then 41 probes (the 41st list is a new list)


# ---------------------------------------------------------------- a training run over HTTP


@pytest.fixture(scope="module")
def eight_shards(tmp_path_factory):
    from data_pipelines import shapes

    out = tmp_path_factory.mktemp("shapes8")
    shapes.generate_split(out, "train", 320, seed=5, per_shard=40)  # 00000..00007.tar
    shapes.generate_split(out, "val", 40, seed=6, per_shard=40)  # the probe batch's shard
    return out / "train"


def _cmd(out, overrides, *extra):
    cmd = [sys.executable, "-m", "mmalign.cli", "train", "--output", str(out)]
    for o in overrides:
        cmd += ["--set", o]
    return cmd + list(extra)


def _keys(out):
    records = [json.loads(line) for line in (out / "samples_rank0.jsonl").read_text().splitlines()]
    return [(r["step"], tuple(r["keys"])) for r in records]


@pytest.mark.integration
def test_training_over_http_killed_and_resumed_equals_the_local_run(eight_shards, tmp_path):
    from safetensors.torch import load_file

    """SIGKILL after the step-6 checkpoint, ``--resume latest`` over HTTP: the same weights (bitwise)
    and sample keys as a straight run from local files, each step logged once, the probe batch on
    (the local twin of this, tests/run/test_train_run.py, is `slow`)."""
    common = [
        "model.preset=micro",
        "data.workers=1",
        "data.shuffle_buffer=50",
        "train.global_batch_size=16",
        "train.steps=12",
        "train.warmup_steps=2",
        "train.lr=0.002",
        "train.checkpoint_every=6",
        "train.log_every=3",
        "monitor.log_sample_keys=true",
        "monitor.probe_size=16",
        "eval.suite=none",
        f"data.val={eight_shards.parent / 'val' / '00000.tar'}",
    ]
    local = tmp_path / "local"
    res = subprocess.run(
        _cmd(local, common + [f"data.train={eight_shards}/{{00000..00007}}.tar"]),
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=600,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    with serve(eight_shards) as server:
        ov = common + [f"data.train={server.url}/{{00000..00007}}.tar"]
        killed = tmp_path / "killed"
        proc = subprocess.Popen(_cmd(killed, ov), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, cwd=ROOT)
        deadline, pointer = time.time() + 600, killed / "checkpoints" / "latest"
        while not pointer.is_file() and proc.poll() is None and time.time() < deadline:
            time.sleep(0.02)
        os.kill(proc.pid, signal.SIGKILL)  # after the step-6 checkpoint, mid-run
        proc.wait()
        assert proc.returncode == -signal.SIGKILL, "the run finished before it could be killed"
        server.requests.clear()
        res = subprocess.run(
            _cmd(killed, ov, "--resume", "latest"), capture_output=True, text=True, cwd=ROOT, timeout=600
        )
        assert res.returncode == 0, res.stderr[-3000:]
        assert "step 6" in res.stdout
        assert any(r for _, r in server.requests), "the resume asked for no byte range"
    said = (killed / "train.log").read_text().count("by HTTP range requests")
    # once per worker process, not per sample or shard: the first run's worker (its lanes seek
    # to their first samples by range) and the resumed run's
    assert said == 2, said
    assert _keys(killed) == _keys(local) and len(_keys(local)) == 12
    steps = [json.loads(line)["step"] for line in (killed / "metrics.jsonl").read_text().splitlines()]
    assert steps == [3, 6, 9, 12]  # each logged once: the resume truncated what the kill left
    a, b = (
        load_file(str(local / "final" / "model.safetensors")),
        load_file(str(killed / "final" / "model.safetensors")),
    )
    for k in a:
        assert torch.equal(a[k], b[k]), k


@pytest.mark.parametrize(
    "override",
    [
        "data.remote_retries=-1",
        "data.remote_retries=1.5",
        "data.remote_backoff=-1",
        "data.remote_timeout=0",
        "data.remote_timeout=nan",
    ],
)
def test_remote_keys_are_validated_at_load(override):
    from mmalign.config import load_config

    with pytest.raises(ConfigError, match=rf"^config key '{override.split('=')[0]}'"):
        load_config(None, [override])
    load_config(None, ["data.remote_retries=0", "data.remote_backoff=0.5", "data.remote_timeout=5"])
