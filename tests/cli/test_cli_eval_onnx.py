"""`mmalign eval --model` on an ONNX export says ONNX exports are for serving and names the
folders eval takes (issue 39, point 6): one line, exit 2."""

import time

import pytest

from tests.harness import run_cli
from tests.harness.searchdata import save_random_model


@pytest.fixture(scope="module")
def onnx_export(tmp_path_factory):
    pytest.importorskip("onnx")
    from mmalign.export import export

    root = tmp_path_factory.mktemp("onnx")
    model = save_random_model(root / "model", seed=4)
    export(model, "onnx", root / "onnx")
    assert any((root / "onnx").glob("*.onnx"))
    return root / "onnx"


def test_eval_on_an_onnx_export_is_one_line_naming_what_eval_takes(onnx_export):
    start = time.monotonic()
    res = run_cli("eval", "--model", str(onnx_export), "--suite", "retrieval")
    elapsed = time.monotonic() - start
    assert res.returncode == 2, res.stderr[-2000:]
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, res.stderr
    for words in (
        "ONNX export is for serving",
        "run directory",
        "final/",
        "RUN/checkpoints/step_N",
        "open_clip / Hugging Face export folder",
    ):
        assert words in lines[0], words
    assert elapsed < 60  # answered before loading anything (generous on 2 busy cores)


def test_a_model_folder_beside_onnx_graphs_is_still_a_model(tmp_path):
    from mmalign.cli_eval import check_not_onnx

    model = save_random_model(tmp_path / "model", seed=4)
    (tmp_path / "model" / "extra.onnx").write_bytes(b"")
    check_not_onnx(model)  # model.safetensors present: eval loads it
