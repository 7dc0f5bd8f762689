"""What mmalign wrote before its flat modules moved into packages still loads (issue 29, point 2):
a run directory, its final/ weights, its step checkpoint (DeepSpeed's pickled engine files,
read weights-only) and an open_clip export, all written by the commit before the move
(tests/fixtures/pre_packages/README.md). The run also resumes from that checkpoint."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

from tests.harness import ROOT

FIXTURE = ROOT / "tests" / "fixtures" / "pre_packages"


@pytest.fixture()
def old_run(tmp_path, monkeypatch):
    from data_pipelines import shapes

    shutil.copytree(FIXTURE, tmp_path / "old")
    work = tmp_path / "old"
    # what make.py read, regenerated: the same seeded shards, the tokenizer its final/ carries
    shapes.generate_split(work / "shapes", "train", 64, seed=3, per_shard=64)
    shapes.generate_split(work / "shapes", "val", 32, seed=3, per_shard=64)
    shutil.copy(work / "run" / "final" / "tokenizer.model", work / "tok.model")
    monkeypatch.chdir(work)  # the run's config names its data and tokenizer relative to this folder
    return work


def _weights(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().float() for k, v in model.state_dict().items()}


def test_a_run_its_checkpoint_and_its_export_from_before_the_move_load(old_run):
    import mmalign

    saved = load_file(str(old_run / "run" / "final" / "model.safetensors"))
    final = _weights(mmalign.load(old_run / "run").model)
    assert final.keys() == saved.keys() and all(torch.equal(final[k], saved[k].float()) for k in saved)
    # the step checkpoint: DeepSpeed's engine files, consolidated (the last step is final/'s weights)
    step = _weights(mmalign.load(old_run / "run" / "checkpoints" / "step_00000002").model)
    assert step.keys() == final.keys() and all(torch.equal(step[k], final[k]) for k in final)
    # the open_clip export: open_clip's own names, the same numbers
    exported = load_file(str(old_run / "export_oc" / "open_clip_model.safetensors"))
    assert (
        json.loads((old_run / "export_oc" / "open_clip_config.json").read_text())["model_cfg"]["embed_dim"]
        == 32
    )
    ours = {k: v for k, v in final.items() if k in exported}
    # (logit_scale is [1] here, a scalar in open_clip: compared by value)
    assert len(ours) > 0.9 * len(exported)
    assert all(torch.equal(ours[k].reshape(-1), exported[k].float().reshape(-1)) for k in ours)


@pytest.mark.integration
def test_the_old_run_resumes_from_its_checkpoint(old_run):
    from mmalign.config import load_config
    from mmalign.run.train import train

    cfg = load_config(old_run / "run" / "config.yaml", ["train.steps=3"])
    train(cfg, show_progress=False, resume="latest")
    records = [json.loads(line) for line in (old_run / "run" / "metrics.jsonl").read_text().splitlines()]
    # steps 1-2 are the old run's records, kept; only step 3 was trained here (from the checkpoint).
    # The run folder is not where it was written: the tokenizer path the old config resolved to
    # an absolute one differs, which a resume must not count as another run
    assert [r["step"] for r in records] == [1, 2, 3]
