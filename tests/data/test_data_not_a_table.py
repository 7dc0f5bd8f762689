"""A table given where shards belong says to run `mmalign shards table` (issue 39, point 6),
instead of "0 samples" after the whole start-up: one line, exit 2, before any model is built."""

import pytest

from mmalign.config import ConfigError
from mmalign.data.shards import check_urls
from tests.harness import run_cli


@pytest.mark.parametrize("name", ["pairs.csv", "pairs.TSV", "pairs.parquet"])
def test_a_table_is_refused_with_the_command_that_makes_shards(tmp_path, name):
    table = tmp_path / name
    table.write_text("path,text\na.jpg,a cat\n")
    with pytest.raises(ConfigError) as e:
        check_urls([str(table)], "data.train")
    line = str(e.value)
    assert "\n" not in line and "mmalign shards table --input" in line and str(table) in line
    assert "'data.train'" in line


def test_train_with_a_csv_as_data_train_is_one_line_exit_2(tmp_path):
    table = tmp_path / "pairs.csv"
    table.write_text("path,text\na.jpg,a cat\n")
    res = run_cli(
        "train",
        "--config",
        "configs/quickstart.yaml",
        "--output",
        str(tmp_path / "run"),
        "--set",
        f"data.train={table}",
        "--set",
        "eval.suite=none",
    )
    assert res.returncode == 2, res.stderr[-2000:]
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and "mmalign shards table" in lines[0] and "0 samples" not in lines[0], res.stderr
    assert "building model" not in res.stdout
