"""A suite's fields are checked against a probe of the validation shards before any training
(issue 39, point 2): the README tour's config (suite ``shapes``) with CIFAR-like shards as
data.train / data.val fails in one line, before any step, naming the suite, the field and
the ``--set eval.suite=...`` that fits."""

import io
import json
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest
from PIL import Image

from mmalign.config import ConfigError
from mmalign.evaluation.suite import load_suite
from mmalign.evaluation.suite_fit import check_suite_fields, fitting_suites, probe_samples, task_mismatch
from tests.harness import ROOT

CIFAR = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]


def _jpeg() -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (8, 8), (120, 30, 200)).save(buf, format="JPEG")
    return buf.getvalue()


def cifar_like(path: Path, n: int = 40, captions: bool = True) -> Path:
    """A shard as `mmalign shards imagefolder --templates cifar10` writes it: .json label + classname."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(path, "w") as tar:
        for i in range(n):
            label = i % 10
            members = {
                "jpg": _jpeg(),
                "json": json.dumps({"label": label, "classname": CIFAR[label]}).encode(),
            }
            if captions:
                members["txt"] = f"a photo of a {CIFAR[label]}.".encode()
            for ext, data in members.items():
                info = tarfile.TarInfo(f"{i:06d}.{ext}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    return path


def test_probe_reads_json_and_captions_of_the_first_samples(tmp_path):
    shard = cifar_like(tmp_path / "00000.tar", n=40)
    probed = probe_samples(str(shard), n=5)
    assert [p["json"]["classname"] for p in probed] == CIFAR[:5]
    assert all(p["captions"] for p in probed)


def test_each_task_kind_names_its_missing_field(tmp_path):
    probed = probe_samples(str(cifar_like(tmp_path / "a.tar", captions=False)))
    zeroshot = {
        "type": "zeroshot",
        "templates": ["a {c}."],
    }  # the keys a suite's zeroshot task has besides these
    shape = {**zeroshot, "name": "shape", "label_field": "shape", "classnames": ["circle"]}
    assert "'shape'" in task_mismatch(shape, probed) and "classname" in task_mismatch(shape, probed)
    wrong = {**zeroshot, "name": "z", "label_field": "classname", "classnames": ["circle", "square"]}
    assert "airplane" in task_mismatch(wrong, probed)
    right = {**zeroshot, "name": "z", "label_field": "classname", "classnames": CIFAR}
    assert task_mismatch(right, probed) is None
    assert "captions" in task_mismatch({"name": "r", "type": "retrieval"}, probed)
    index = {
        "name": "i",
        "type": "probe",
        "label_field": "label",
        "classnames": CIFAR[:3],
        "label_index": True,
    }
    assert "class index" in task_mismatch(index, probed)  # labels 3..9 are beyond three names


def test_the_shipped_suite_that_fits_cifar_shards_is_suggested_first(tmp_path):
    probed = probe_samples(str(cifar_like(tmp_path / "a.tar")))
    fits = fitting_suites(probed, exclude="shapes")
    assert fits[0] in ("cifar10", "cifar10_heldout") and "shapes" not in fits and "shapes_full" not in fits
    # the caption-only suite comes after every labelled one
    assert fits.index("retrieval") == len(fits) - 1


def test_a_mismatch_is_one_line_naming_suite_field_and_fix(tmp_path):
    shard = cifar_like(tmp_path / "a.tar")
    suite = load_suite("shapes")
    with pytest.raises(ConfigError) as e:
        check_suite_fields(suite, {"type": "shards", "urls": str(shard)}, "data.val")
    line = str(e.value)
    assert "\n" not in line
    assert "'shapes'" in line and "'shape'" in line and "--set eval.suite=cifar10" in line and "none" in line
    check_suite_fields(
        load_suite("cifar10"), {"type": "shards", "urls": str(shard)}, "data.val"
    )  # fits: silent


@pytest.mark.integration
def test_readme_tour_with_cifar_shards_fails_before_any_step(tmp_path):
    train = cifar_like(tmp_path / "cifar" / "train" / "00000.tar", n=64)
    val = cifar_like(tmp_path / "cifar" / "val" / "00000.tar", n=20)
    out = tmp_path / "run"
    cmd = [
        sys.executable,
        "-m",
        "mmalign.cli",
        "train",
        "--config",
        str(ROOT / "configs/quickstart.yaml"),
        "--output",
        str(out),
        "--set",
        f"data.train={train}",
        "--set",
        f"data.val={val}",
        "--set",
        "train.steps=50",
    ]
    start = time.monotonic()
    res = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, timeout=300)
    elapsed = time.monotonic() - start
    assert res.returncode == 2, res.stderr[-2000:]
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, res.stderr
    assert "'shapes'" in lines[0] and "'shape'" in lines[0] and "--set eval.suite=cifar10" in lines[0]
    assert "step" not in res.stdout.lower()
    assert not (out / "metrics.jsonl").exists()
    assert elapsed < 60, (
        elapsed
    )  # the import of torch and the probe; no model, no loop (generous on 2 busy cores)


def test_an_eval_during_entry_that_does_not_fit_is_named_by_its_key(tmp_path):
    from mmalign.config import load_config
    from mmalign.run.in_run_eval import plan_evaluations, resolve_suite

    shard = cifar_like(tmp_path / "val" / "00000.tar")
    cfg = load_config(
        str(ROOT / "configs/quickstart.yaml"),
        [
            f"data.train={shard}",
            f"data.val={shard}",
            "eval.suite=cifar10",
            "eval.during=[{suite: shapes, every: 2}]",
        ],
    )
    suite = resolve_suite(cfg)  # cifar10 fits the CIFAR-like shards
    with pytest.raises(ConfigError) as e:
        plan_evaluations(cfg, suite)
    line = str(e.value)
    assert line.startswith("config key 'eval.during[0].suite': suite 'shapes' does not fit data.val")
    assert "suite cifar10 fits the data" in line and "drop the entry" in line


def test_a_remote_validation_shard_is_probed_too(tmp_path):
    """data.val over HTTP: the first samples are read (a line first) and a missing field is the
    same one line as for a local shard."""
    from tests.harness.shard_server import serve

    cifar_like(tmp_path / "srv" / "00000.tar", n=40)
    suite = {
        "name": "shapes",
        "tasks": [
            {
                "name": "shape",
                "type": "zeroshot",
                "label_field": "shape",
                "classnames": ["circle", "square"],
                "templates": ["a {c}."],
            }
        ],
    }
    with serve(tmp_path / "srv") as server:
        url = f"{server.url}/00000.tar"
        probed = probe_samples(url, n=5)
        assert [p["json"]["classname"] for p in probed] == CIFAR[:5]
        with pytest.raises(
            ConfigError,
            match=r"suite 'shapes' does not fit data.val: task 'shape' needs the "
            r"\.json field 'shape'",
        ):
            check_suite_fields(suite, {"type": "shards", "urls": url}, "data.val")


def test_a_silent_remote_server_costs_the_probe_its_bound_and_no_more(tmp_path, capsys):
    """A server that accepts and never answers: the probe gives up after its bound with nothing
    probed (no check, no hang); the loader's own timeouts speak when it reads."""
    import socket

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)  # accepted by the kernel, never answered
    try:
        t0 = time.monotonic()
        probed = probe_samples(f"http://127.0.0.1:{listener.getsockname()[1]}/00000.tar", remote_s=1.0)
        took = time.monotonic() - t0
    finally:
        listener.close()
    assert probed == [] and 0.9 <= took < 5
    assert "mmalign: probing the first 32 samples of http://127.0.0.1:" in capsys.readouterr().out
