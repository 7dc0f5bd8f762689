"""The one model loader (mmalign/models/load.py): a model folder, a run directory, ``RUN/final``
and ``RUN/checkpoints/step_N`` give the same model; every command that takes ``--model``
reads all four; a step checkpoint is rebuilt from the config stored in it, whatever
``RUN/config.yaml`` says later; a bad path is one line and exit 2.

One short ZeRO-1 run (2 steps, a checkpoint at step 2, ``final/`` from the same weights) is
shared by the module.  The reference model is built in the test from the micro preset and
the safetensors file read directly, not through the loader.
"""

from __future__ import annotations

import copy
import json
import logging
import math
import shutil

import numpy as np
import pytest
import torch
import yaml
from safetensors.torch import load_file

import mmalign
from mmalign.cli import main
from mmalign.errors import UsageError
from mmalign.models import TwoTower
from mmalign.models.presets import PRESETS

STEP = "step_00000002"
CAPTIONS = ["a red circle", "a blue square on a white background", "x"]


@pytest.fixture(scope="module")
def run(shapes_dir, tmp_path_factory):
    from mmalign.config import load_config
    from mmalign.run.train import train

    out = tmp_path_factory.mktemp("load") / "run"
    train(
        load_config(
            None,
            [
                "model.preset=micro",
                f"data.train={shapes_dir}/train/{{00000..00001}}.tar",
                f"data.val={shapes_dir}/val/00000.tar",
                "data.workers=0",
                "data.shuffle_buffer=50",
                "train.global_batch_size=8",
                "train.steps=2",
                "train.warmup_steps=1",
                "train.lr=0.01",
                "train.checkpoint_every=2",
                "monitor.probe_size=0",
                "deepspeed.zero_stage=1",
                "eval.suite=none",
                f"output={out}",
            ],
        ),
        show_progress=False,
    )
    return out


@pytest.fixture(scope="module")
def reference(run):
    """The final weights in a micro TwoTower built here (the loader is not involved)."""
    model = TwoTower(copy.deepcopy(PRESETS["micro"]))
    model.load_state_dict(load_file(str(run / "final" / "model.safetensors")))
    assert not torch.equal(
        model.state_dict()["visual.proj"], TwoTower(PRESETS["micro"]).state_dict()["visual.proj"]
    )
    # no_grad as the loaded bundle's encoders (torch's attention takes another kernel with grad)
    return torch.no_grad()(model.eval().encode_image), torch.no_grad()(model.encode_text), model.state_dict()


def _path(run, kind: str, tmp_path):
    if kind == "model_folder":  # a copy of final/ outside any run
        return shutil.copytree(run / "final", tmp_path / "somewhere" / "my_model")
    return {"run": run, "final": run / "final", "step": run / "checkpoints" / STEP}[kind]


def _inputs(tokenizer):
    g = torch.Generator().manual_seed(0)
    return torch.randn(4, 3, 16, 16, generator=g), tokenizer(CAPTIONS)  # (4, 3, S, S), (3, L)


def test_the_checkpoint_stores_its_resolved_config(run):
    from mmalign.config import load_config, to_dict

    stored = run / "checkpoints" / STEP / "config.yaml"
    assert stored.is_file()  # checkpoint.save -> rundir.save_into
    assert to_dict(load_config(stored)) == to_dict(load_config(run / "config.yaml"))


@pytest.mark.parametrize("kind", ["model_folder", "run", "final", "step"])
def test_every_path_kind_loads_the_same_model(kind, run, reference, tmp_path):
    loaded = mmalign.load(_path(run, kind, tmp_path))
    assert loaded.kind == ("checkpoint" if kind == "step" else "model")
    assert not loaded.model.training
    assert not any(p.requires_grad for p in loaded.model.parameters())  # as an export folder loads
    ref_image, ref_text, theirs = reference
    ours = loaded.model.state_dict()
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
    images, tokens = _inputs(loaded.tokenizer)
    assert torch.equal(loaded.encode_image(images), ref_image(images))
    assert torch.equal(loaded.encode_text(CAPTIONS), ref_text(tokens))
    assert loaded.preprocess_cfg["size"] == 16 and loaded.config["arch"]["embed_dim"] == 32
    assert loaded.config["train_config"]["model"]["preset"] == "micro"  # eval's default suite and data


@pytest.mark.parametrize("kind", ["model_folder", "run", "final", "step"])
def test_export_reads_every_path_kind(kind, run, tmp_path):
    from mmalign.export import export

    export(_path(run, kind, tmp_path), "open_clip", tmp_path / "oc")
    export(run / "final", "open_clip", tmp_path / "oc_final")
    got = load_file(str(tmp_path / "oc" / "open_clip_model.safetensors"))
    want = load_file(str(tmp_path / "oc_final" / "open_clip_model.safetensors"))
    assert len(got) > 10 and got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in got)


def _metrics(path):
    return [(r["task"], r["metrics"]) for r in json.loads(path.read_text())]


@pytest.mark.integration
def test_cli_eval_of_a_step_checkpoint_equals_eval_of_the_exported_weights(run, tmp_path):
    step = run / "checkpoints" / STEP
    assert main(["eval", "--model", str(step), "--suite", "shapes", "--limit", "40"]) == 0
    from_step = run / f"eval_cli_shapes_{STEP}.json"  # beside the run, not inside the checkpoint
    assert from_step.is_file() and not list(step.glob("eval_cli_*"))
    exported = tmp_path / "exported"
    assert (
        main(["eval", "--model", str(run), "--suite", "shapes", "--limit", "40", "--out", str(exported)]) == 0
    )
    a, b = _metrics(from_step), _metrics(exported)
    assert a == b and len(a) == 3 and all(m for _, m in a)


@pytest.mark.integration
def test_cli_embed_index_search_serve_and_mine_from_a_step_checkpoint(run, shapes_dir, tmp_path, capsys):
    from data_pipelines.mine import mine
    from mmalign.search.searcher import Searcher
    from mmalign.search.serve import make_server

    step = run / "checkpoints" / STEP
    val = str(shapes_dir / "val" / "00000.tar")
    assert main(["embed", "--model", str(step), "--data", val, "--out", str(tmp_path / "e_step")]) == 0
    assert main(["embed", "--model", str(run), "--data", val, "--out", str(tmp_path / "e_final")]) == 0
    for name in ("img_emb/img_emb_0.npy", "text_emb/text_emb_0.npy"):
        a, b = np.load(tmp_path / "e_step" / name), np.load(tmp_path / "e_final" / name)
        assert a.shape[0] >= 120 and np.array_equal(a, b)
    assert main(["index", "--emb", str(tmp_path / "e_step"), "--out", str(tmp_path / "idx")]) == 0
    capsys.readouterr()
    assert (
        main(["search", "--index", str(tmp_path / "idx"), "--model", str(step), "--text", "a red circle"])
        == 0
    )
    assert capsys.readouterr().out.strip()
    searcher = Searcher(tmp_path / "idx", step)  # what `mmalign serve` builds
    make_server(searcher, port=0).server_close()
    assert np.array_equal(
        searcher.encode_text(["a red circle"]), Searcher(tmp_path / "idx", run).encode_text(["a red circle"])
    )
    a = mine(val, step, tmp_path / "m_step", k=2, progress=False)
    b = mine(val, run / "final", tmp_path / "m_final", k=2, progress=False)
    own = ("model", "out", "seconds")
    assert {k: v for k, v in a.items() if k not in own} == {k: v for k, v in b.items() if k not in own}
    assert a["negatives_written"] > 0


def _copy_run(run, tmp_path):
    copied = tmp_path / "run"
    shutil.copytree(run, copied, ignore=shutil.ignore_patterns("eval_cli_*"))
    return copied, copied / "checkpoints" / STEP


def _edit_run_config(run, **changes):
    tree = yaml.safe_load((run / "config.yaml").read_text())
    for key, value in changes.items():
        tree["model"][key] = value
    (run / "config.yaml").write_text(yaml.safe_dump(tree))


@pytest.mark.parametrize("edit", [{"embed_dim": 48}, {"preset": "tiny"}])
def test_editing_the_run_config_does_not_change_how_a_step_is_rebuilt(edit, run, reference, tmp_path, caplog):
    copied, step = _copy_run(run, tmp_path)
    _edit_run_config(copied, **edit)
    with caplog.at_level(logging.WARNING):
        loaded = mmalign.load(step)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert (
        loaded.config["arch"]["embed_dim"] == 32
        and loaded.config["train_config"]["model"]["preset"] == "micro"
    )
    images, _ = _inputs(loaded.tokenizer)
    assert torch.equal(loaded.encode_image(images), reference[0](images))


def test_an_old_step_without_its_config_falls_back_to_the_run_config_with_one_warning(
    run, reference, tmp_path, caplog
):
    copied, step = _copy_run(run, tmp_path)
    (step / "config.yaml").unlink()  # a checkpoint from before checkpoints stored their config
    with caplog.at_level(logging.WARNING):
        loaded = mmalign.load(step)
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "no config.yaml of its own" in warnings[0].getMessage()
    images, _ = _inputs(loaded.tokenizer)
    assert torch.equal(loaded.encode_image(images), reference[0](images))
    # ... and then an edited run config is all there is: a mismatch is one line, not a traceback
    _edit_run_config(copied, embed_dim=48)
    with pytest.raises(UsageError, match="do not fit") as err:
        mmalign.load(step)
    assert "\n" not in str(err.value) and str(step) in str(err.value)


def test_bad_paths_are_one_line_usage_errors(run, tmp_path, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    unfinished, _ = _copy_run(run, tmp_path)
    shutil.rmtree(unfinished / "final")
    no_engine = tmp_path / "r" / "checkpoints" / STEP
    no_engine.mkdir(parents=True)
    cases = {
        tmp_path / "missing": "does not exist",
        empty: "no mmalign model",
        unfinished: f"no final/ yet; its newest checkpoint is {unfinished / 'checkpoints' / STEP}",
        no_engine: "no mmalign model",
    }
    for path, why in cases.items():
        with pytest.raises(UsageError) as err:
            mmalign.load(path)
        assert why in str(err.value) and "\n" not in str(err.value), str(err.value)
        for command in (
            ["eval", "--model", str(path), "--suite", "shapes"],
            ["embed", "--model", str(path), "--data", str(empty), "--out", str(tmp_path / "e")],
        ):
            assert main(command) == 2
            err_line = capsys.readouterr().err.strip()
            assert err_line.startswith("mmalign: error:") and "\n" not in err_line and why in err_line, (
                err_line
            )


def test_old_names_still_work(run):
    from mmalign.pretrained import Loaded, clip_benchmark_loader, load

    assert isinstance(load(run), Loaded)
    model, transform, tokenizer = clip_benchmark_loader(pretrained=str(run / "checkpoints" / STEP))
    assert (
        model.embed_dim == 32
        and tokenizer(["a"]).shape[0] == 1
        and math.isfinite(float(model.logit_scale.detach()))
    )
