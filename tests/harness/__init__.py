"""What the tests share: the naive references, the CLI runners, the rank runner and the paths.
``from tests.harness import cli_main, clip_batch, ...``; the fixtures stay in tests/conftest.py."""

from tests.harness.cli import CliRun, cli_main, run_cli
from tests.harness.paths import ROOT, SEED_ENV, pick_seed
from tests.harness.ranks import ENGINE_BATCH, engine_batch, engine_cfg, run_ranks
from tests.harness.reference import chunkwise_clip_loss, clip_batch, max_rel_error, naive_clip_loss, unit

__all__ = [
    "ENGINE_BATCH",
    "ROOT",
    "SEED_ENV",
    "CliRun",
    "chunkwise_clip_loss",
    "cli_main",
    "clip_batch",
    "engine_batch",
    "engine_cfg",
    "max_rel_error",
    "naive_clip_loss",
    "pick_seed",
    "run_cli",
    "run_ranks",
    "unit",
]
