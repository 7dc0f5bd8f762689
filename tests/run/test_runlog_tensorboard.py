"""TensorBoard gets the evaluation metrics (``eval/<suite>/<task>/<metric>``, periodic and
final) and the run's hyper-parameters (the HPARAMS plugin) beside the training scalars."""

from __future__ import annotations

import json

import pytest

from mmalign.config import load_config

pytestmark = pytest.mark.integration


def test_eval_metrics_and_hparams_reach_tensorboard(micro_overrides):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from mmalign.run.train import train

    cfg = load_config(None, micro_overrides + ["train.steps=4", "train.log_every=2", "train.eval_every=2"])
    out = train(cfg, show_progress=False)
    events = EventAccumulator(str(out / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    tags = events.Tags()["scalars"]
    final = {r["dataset"]: r["metrics"] for r in json.loads((out / "eval.json").read_text())}
    acc = final["shapes/shape"]["acc1"]
    scalars = {e.step: e.value for e in events.Scalars("eval/shapes/shape/acc1")}
    assert set(scalars) == {2, 4}  # the step-2 evaluation and the final one
    assert scalars[4] == pytest.approx(acc, abs=1e-6)
    assert "loss" in tags and "hparam/shapes/shape/acc1" in tags
    plugins = events.PluginTagToContent("hparams")
    assert "_hparams_/session_start_info" in plugins
    from tensorboard.plugins.hparams import plugin_data_pb2

    start = plugin_data_pb2.HParamsPluginData.FromString(
        plugins["_hparams_/session_start_info"]
    ).session_start_info
    assert start.hparams["model.preset"].string_value == "micro"
    assert start.hparams["train.steps"].number_value == 4
