"""``mmalign wise-ft`` writes loadable interpolated models (one alpha: --out itself; a list:
OUT/alpha_A/); ``mmalign eval --wise-ft`` prints the accuracy curve, and its ends equal plain
``mmalign eval`` of the two models; every mistake is one line, exit 2."""

from __future__ import annotations

import copy
import json
import math

import pytest
import torch

from mmalign.data.transforms import preprocess_cfg
from mmalign.models import TwoTower
from mmalign.models.io import save_pretrained
from mmalign.models.load import load
from mmalign.models.presets import PRESETS
from tests.harness import cli_main


@pytest.fixture(scope="module")
def pair(shapes_dir, tmp_path_factory):
    """Two random micro models standing in for a zero-shot model and its fine-tuned run's final/."""
    root = tmp_path_factory.mktemp("cli_wise_ft")
    train_config = {"data": {"val": f"{shapes_dir}/val/00000.tar"}, "eval": {"suite": "shapes"}}
    out = []
    for name, seed, scale in (("zs", 1, 10.0), ("ft", 2, 50.0)):
        torch.manual_seed(seed)
        model = TwoTower(copy.deepcopy(PRESETS["micro"]), init_logit_scale=math.log(scale))
        folder = root / name / "final"
        save_pretrained(
            model, folder, preprocess=preprocess_cfg(model.image_size), extra={"train_config": train_config}
        )
        out.append(root / name)
    return out


def _one_line_error(run, *needles):
    assert run.returncode == 2, run
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("mmalign: error: "), run.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]


def test_wise_ft_writes_loadable_models(pair, tmp_path):
    run = cli_main(
        "wise-ft", "--zero-shot", pair[0], "--fine-tuned", pair[1], "--alpha", "0.5", "--out", tmp_path / "m"
    )
    assert run.returncode == 0, run.stderr
    mixed, a, b = load(tmp_path / "m").model, load(pair[0]).model, load(pair[1]).model
    want = 0.5 * a.state_dict()["visual.proj"].double() + 0.5 * b.state_dict()["visual.proj"].double()
    assert torch.equal(mixed.state_dict()["visual.proj"], want.float())
    run = cli_main(
        "wise-ft", "--zero-shot", pair[0], "--fine-tuned", pair[1], "--alpha", "0,1", "--out", tmp_path / "l"
    )
    assert run.returncode == 0, run.stderr
    assert f"alpha 1: {tmp_path / 'l' / 'alpha_1'}" in run.stdout
    for alpha, source in (("0", a), ("1", b)):
        got = load(tmp_path / "l" / f"alpha_{alpha}").model.state_dict()
        assert all(torch.equal(got[k], v) for k, v in source.state_dict().items())


def test_wise_ft_mistakes_are_one_line(pair, tmp_path):
    base = ["wise-ft", "--zero-shot", pair[0], "--fine-tuned", pair[1], "--out", tmp_path / "o"]
    _one_line_error(cli_main(*base, "--alpha", "1.5"), "--alpha 1.5: alpha 1.5 is outside [0, 1]")
    _one_line_error(cli_main(*base, "--alpha", "half"), "--alpha half: 'half' is not a number")
    _one_line_error(
        cli_main(
            "wise-ft",
            "--zero-shot",
            tmp_path / "nowhere",
            "--fine-tuned",
            pair[1],
            "--alpha",
            "0.5",
            "--out",
            tmp_path / "o",
        ),
        "--zero-shot: ",
        "does not exist",
    )
    torch.manual_seed(0)
    arch = copy.deepcopy(PRESETS["micro"])
    arch["vision_cfg"]["layers"] = 2
    deeper = TwoTower(arch)
    save_pretrained(deeper, tmp_path / "deeper", preprocess=preprocess_cfg(deeper.image_size))
    _one_line_error(
        cli_main(
            "wise-ft",
            "--zero-shot",
            pair[0],
            "--fine-tuned",
            tmp_path / "deeper",
            "--alpha",
            "0.5",
            "--out",
            tmp_path / "o",
        ),
        "are not one architecture: vision_cfg.layers: 1 vs 2",
    )
    assert not (tmp_path / "o").exists()


def test_eval_prints_the_curve_and_its_ends_equal_plain_eval(pair, tmp_path):
    out = tmp_path / "curve.json"
    run = cli_main(
        "eval",
        "--model",
        pair[0],
        "--wise-ft",
        pair[1],
        "--alphas",
        "0,0.5,1",
        "--suite",
        "shapes",
        "--out",
        out,
    )
    assert run.returncode == 0, run.stderr
    records = json.loads(out.read_text())
    alphas = [r["wise_ft"]["alpha"] for r in records]
    assert sorted(set(alphas)) == [0.0, 0.5, 1.0] and alphas == sorted(alphas)
    assert "WiSE-FT" in run.stdout and "alpha" in run.stdout
    for alpha, model in ((0.0, pair[0]), (1.0, pair[1])):
        plain = tmp_path / f"plain_{alpha:g}.json"
        assert cli_main("eval", "--model", model, "--suite", "shapes", "--out", plain).returncode == 0
        want = json.loads(plain.read_text())
        got = [r for r in records if r["wise_ft"]["alpha"] == alpha]
        assert [r["metrics"] for r in got] == [r["metrics"] for r in want]
        first = next(r for r in got if r["task"] == "zeroshot_classification")
        assert f"{first['metrics']['acc1']:.4f}" in run.stdout  # the curve's row for this end
    assert records[0]["wise_ft"] == {"zero_shot": str(pair[0]), "fine_tuned": str(pair[1]), "alpha": 0.0}


def test_eval_curve_mistakes_are_one_line(pair, tmp_path):
    base = ["eval", "--model", pair[0], "--wise-ft", pair[1]]
    _one_line_error(cli_main(*base, "--alphas", "0,2"), "--alphas 0,2: alpha 2 is outside [0, 1]")
    _one_line_error(cli_main(*base, "--benchmark", "datacomp"), "--wise-ft evaluates suites", "--benchmark")
    _one_line_error(cli_main(*base, "--weights", "ema"), "--weights ema reads one model", "RUN/final_ema")
    _one_line_error(
        cli_main("eval", "--model", pair[0], "--wise-ft", tmp_path / "nowhere"),
        "--wise-ft: ",
        "does not exist",
    )
    _one_line_error(
        cli_main("eval", "--model", pair[0], "--suite", "shapes", "--suite", "digits"),
        "--suite once per evaluation",
    )


def test_the_zero_shot_model_by_its_hub_name(pair, tmp_path, monkeypatch):
    """The usual case: the published model by name (here an open_clip hub entry in a fabricated,
    offline cache) and a run fine-tuned from it."""
    from mmalign.export import export
    from tests.harness.hubcache import fabricate, offline_env

    export(pair[0], "open_clip", tmp_path / "oc")  # the zero-shot model in open_clip's hub layout
    fabricate(tmp_path / "hf", "test-org/micro-zs", tmp_path / "oc")
    offline_env(monkeypatch, tmp_path / "hf")
    run = cli_main(
        "wise-ft",
        "--zero-shot",
        "hf-hub:test-org/micro-zs",
        "--fine-tuned",
        pair[1],
        "--alpha",
        "0,0.5",
        "--out",
        tmp_path / "w",
    )
    assert run.returncode == 0, run.stderr
    ends = load(tmp_path / "w" / "alpha_0").model.state_dict()
    assert all(torch.equal(ends[k], v) for k, v in load(pair[0]).model.state_dict().items())
    _one_line_error(
        cli_main(
            "wise-ft",
            "--zero-shot",
            "hf-hub:test-org/absent",
            "--fine-tuned",
            pair[1],
            "--alpha",
            "0.5",
            "--out",
            tmp_path / "x",
        ),
        "test-org/absent",
    )
