import pytest
import yaml

from mmalign.config import Config, ConfigError, load_config, parse_override, save_config
from tests.harness import cli_main, run_cli


def test_defaults_are_a_complete_config():
    cfg = load_config()
    assert isinstance(cfg, Config)
    assert cfg.train.optimizer == "adamw" and cfg.loss.name == "infonce"
    assert cfg.train.grad_cache_chunk_size == 0 and cfg.deepspeed.zero_stage == 0


def test_yaml_and_overrides_coerced_to_field_types(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"train": {"steps": 7, "lr": 0.01}, "model": {"preset": "micro"}}))
    cfg = load_config(
        path,
        [
            "train.steps=11",
            "train.warmup_steps=2",
            "train.lr=1e-4",
            "seed=5",
            "data.augment.hflip=true",
            "data.augment.crop_scale=[0.5, 1.0]",
            "model.vision.layers=2",
        ],
    )
    assert cfg.train.steps == 11 and isinstance(cfg.train.steps, int)
    assert cfg.train.lr == pytest.approx(1e-4) and isinstance(cfg.train.lr, float)
    assert cfg.seed == 5 and cfg.data.augment.hflip is True
    assert cfg.data.augment.crop_scale == [0.5, 1.0]
    assert cfg.model.vision == {"layers": 2}
    assert cfg.model.preset == "micro"


def test_int_accepted_for_float_field():
    assert load_config(None, ["train.lr=1"]).train.lr == 1.0


@pytest.mark.parametrize(
    "override, key",
    [
        ("train.stepz=3", "train.stepz"),
        ("trian.steps=3", "trian"),
        ("train.steps=abc", "train.steps"),
        ("train.steps=1.5", "train.steps"),
        ("train.optimizer=rmsprop", "train.optimizer"),
        ("loss.name=triplet", "loss.name"),
        ("data.augment.hflip=maybe", "data.augment.hflip"),
        ("train.steps=0", "train.steps"),
        ("train.warmup_steps=500", "train.warmup_steps"),
        ("deepspeed.zero_stage=4", "deepspeed.zero_stage"),
        ("train.grad_cache_chunk_size=4096", "train.grad_cache_chunk_size"),
        ("data.augment.crop_scale=[0.9, 0.1]", "data.augment.crop_scale"),
    ],
)
def test_errors_name_the_key(override, key):
    with pytest.raises(ConfigError) as err:
        load_config(None, [override])
    msg = str(err.value)
    assert key in msg and "\n" not in msg


def test_impossible_combinations():
    with pytest.raises(ConfigError, match="model.init_logit_bias"):
        load_config(None, ["loss.name=siglip"])
    with pytest.raises(ConfigError, match="loss.false_negative_ids"):
        load_config(None, ["loss.false_negative_ids=label", "data.id_field=class_id"])
    # an id field named by the loss is read by the loader
    assert load_config(None, ["loss.false_negative_ids=label"]).data.id_field == "label"


def test_unknown_key_in_yaml(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("train:\n  stpes: 3\n")
    with pytest.raises(ConfigError, match="train.stpes"):
        load_config(path)


def test_saved_config_round_trips(tmp_path):
    cfg = load_config(None, ["train.steps=9", "train.warmup_steps=1", "model.text.layers=1"])
    save_config(cfg, tmp_path / "config.yaml")
    assert load_config(tmp_path / "config.yaml") == cfg


def test_parse_override():
    assert parse_override("a.b=3") == ("a.b", 3)
    assert parse_override("a=1e-3") == ("a", 1e-3)
    with pytest.raises(ConfigError):
        parse_override("novalue")


def test_cli_config_error_is_one_line_exit_2_from_a_real_process(tmp_path):
    """The one real process of the CLI's error paths: what a user sees is the interpreter's
    whole stderr, so no warning, traceback or late teardown message comes with the line
    (the other error paths run in-process, through tests.conftest.cli_main)."""
    res = run_cli("train", "--set", "train.stepz=3", "--output", str(tmp_path / "x"))
    assert res.returncode == 2
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "train.stepz" in lines[0] and "Traceback" not in res.stderr, res.stderr
    assert not (tmp_path / "x").exists()


def test_cli_config_error_is_one_line_exit_2(tmp_path):
    res = cli_main("train", "--set", "train.stepz=3", "--output", str(tmp_path / "x"))
    assert res.returncode == 2
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "train.stepz" in lines[0] and "Traceback" not in res.stderr
    res = cli_main("train", "--config", str(tmp_path / "missing.yaml"))
    lines = res.stderr.strip().splitlines()
    assert (
        res.returncode == 2 and len(lines) == 1 and "not found" in lines[0] and "Traceback" not in res.stderr
    )
    res = cli_main("eval", "--model", str(tmp_path / "nomodel"))
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2 and len(lines) == 1 and lines[0].startswith("mmalign: error: ")


@pytest.mark.parametrize(
    "override, key",
    [
        ("train.lr=nan", "train.lr"),
        ("train.lr=.inf", "train.lr"),
        ("loss.momentum=nan", "loss.momentum"),
        ("train.device=tpu", "train.device"),
        ("train.device=cuda:x", "train.device"),
        ("model.embed_dim=0", "model.embed_dim"),
        ("model.image_size=-3", "model.image_size"),
        ("eval.batch_size=0", "eval.batch_size"),
        ("train.threads=-1", "train.threads"),
        ("monitor.probe_size=-1", "monitor.probe_size"),
        ("data.max_consecutive_skips=0", "data.max_consecutive_skips"),
    ],
)
def test_values_that_used_to_fail_late_are_rejected_at_load(override, key):
    """Each of these trained (or set up DeepSpeed for 20 s) and then died with a traceback."""
    with pytest.raises(ConfigError) as err:
        load_config(None, [override])
    assert f"'{key}" in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("value", ["3", "[1, 2]", "null", "abc"])
def test_non_mapping_tower_config_is_one_line(value):
    with pytest.raises(ConfigError, match="config key 'model.vision': expected dict"):
        load_config(None, [f"model.vision={value}"])


def test_accepted_devices():
    for device in ("auto", "cpu", "cuda", "cuda:1"):
        assert load_config(None, [f"train.device={device}"]).train.device == device


def test_output_that_is_a_file_and_non_utf8_config(tmp_path):
    afile = tmp_path / "afile"
    afile.write_text("x")
    with pytest.raises(ConfigError, match="'output'.*not a directory"):
        load_config(None, [f"output={afile}"])
    bad = tmp_path / "bad.yaml"
    bad.write_bytes(b"seed: 1\nx: '\xff\xfe'\n")
    with pytest.raises(ConfigError, match="not UTF-8"):
        load_config(bad)


@pytest.mark.parametrize(
    "override", ["model.vision.patch_size=x", "model.vision.layers=abc", "model.text.width=-4"]
)
def test_towers_that_cannot_be_built_are_one_line_before_any_engine(tmp_path, override):
    from mmalign.models import check_buildable

    cfg = load_config(None, ["model.preset=micro", override])
    with pytest.raises(ConfigError, match="config key 'model': the towers of preset 'micro' cannot be built"):
        check_buildable(cfg.model)
    check_buildable(load_config(None, ["model.preset=micro"]).model)  # a good one builds


def test_cli_reports_unbuildable_towers_in_one_line_fast(tmp_path, monkeypatch):
    import time

    import mmalign.run.train

    def no_training(*args, **kwargs):
        raise AssertionError("training started before the towers were checked")

    monkeypatch.setattr(mmalign.run.train, "train", no_training)
    t0 = time.time()
    (tmp_path / "00000.tar").touch()  # a shard by name: the shards are checked before the towers
    proc = cli_main(
        "train",
        "--set",
        "model.preset=micro",
        "--set",
        "model.vision.patch_size=x",
        "--set",
        f"output={tmp_path / 'run'}",
        "--set",
        f"data.train={tmp_path / '00000.tar'}",
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith("mmalign: error: config key 'model'")
    assert not (tmp_path / "run").exists()  # nothing was started
    assert time.time() - t0 < 60
