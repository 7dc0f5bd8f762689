"""``make test`` on a 2-core machine: two pytest processes at once, over two halves of the tests.

Much of the suite waits rather than computes: the two-host fault tests sit out collective
timeouts and kill grace periods, the signal and restart tests wait for processes to end,
and a test of two ranks leaves a core idle whenever one rank waits for the other.  Run one
after the other, the suite keeps about 1.15 of the 2 cores busy.  So the test files are split
in two by their measured durations (:data:`DURATIONS`, seconds per file on 2 idle cores; a
file not listed counts as :data:`UNLISTED_S`), the waiting-heavy files together, and the two
halves run side by side, each with its own ``--basetemp`` and its own pool of ranks.

    python tests/run_halves.py [pytest options...]     # e.g. -m "not gpu and not slow"

Each half's output goes to ``.pytest_halves/<half>.log`` (its temporary files under the system's
temporary folder, removed at the end); both are printed when they end, and
the exit status is the first non-zero one (0 when both pass).  ``MMALIGN_TEST_SERIAL=1`` runs
one pytest over everything instead, as before.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
UNLISTED_S = 1.0
# Seconds per test file (make test's selection, the sum of its tests' setup, call and teardown
# from ``--durations=0``), measured 2026-12-01 with the two halves running; only the balance
# depends on them, so stale values cost time, never correctness.
DURATIONS: dict[str, float] = {
    f"tests/{k}": v
    for k, v in {
        "multihost": 208,
        "test_conftest.py": 57.1,
        "test_cli_startup.py": 53.8,
        "test_compile.py": 53.7,
        "test_cli_gradcache.py": 32.9,
        "test_data_remote.py": 32.4,
        "test_checkpoint_diskfull.py": 31.7,
        "test_same_model_any_cluster.py": 27.2,
        "test_memory_plan.py": 26.2,
        "test_reshard_cli.py": 24.3,
        "test_engine_autocast.py": 21.4,
        "test_install.py": 20.8,
        "test_models_batchnorm.py": 17.3,
        "test_gpu_check.py": 16.8,
        "test_signals.py": 16.4,
        "test_curate_cli.py": 15.9,
        "test_monitors_ranks.py": 15.8,
        "test_gpu_vs_openclip.py": 13.7,
        "test_ds_adapter.py": 13.3,
        "test_cluster_launch.py": 13.3,
        "test_one_rank_zero.py": 13,
        "test_data_global_order.py": 12.6,
        "test_eval_during.py": 12.1,
        "test_supervise.py": 11.2,
        "test_engine_exact.py": 10.3,
        "test_progress.py": 10.2,
        "test_reshard_engine.py": 10.1,
        "test_lock.py": 10,
        "test_optim_lamb_zero.py": 9.7,
        "test_engine_checkpoint.py": 8.8,
        "test_quickstart.py": 8.7,
        "test_objective_queue.py": 8.6,
        "test_rundir.py": 7.7,
        "test_train_run.py": 7.6,
        "test_evaluation_suite.py": 7.1,
        "test_export.py": 6.3,
        "test_layers.py": 6.3,
        "test_serve_page.py": 6.2,
        "test_towers.py": 6.1,
        "test_train.py": 5.8,
        "test_engine_extras.py": 5.8,
        "test_serve.py": 5.7,
        "test_models_load.py": 5.6,
        "test_config_recipes.py": 5.6,
        "test_losses.py": 5,
        "test_host_syncs.py": 4.8,
        "test_data_pipelines_mine.py": 4.7,
        "test_cpu_chunks.py": 4.2,
        "test_engine_bf16_accum.py": 4.1,
        "test_attention_kernel.py": 4.1,
        "test_models_init_from.py": 3.9,
        "test_data_resharding.py": 3.9,
        "test_search.py": 3.8,
        "test_trainable.py": 3.3,
        "test_data_pipelines_build.py": 3.1,
        "test_losses_ntxent.py": 3.1,
        "test_search_usable.py": 3.1,
        "test_data_stream.py": 3,
        "test_data_loader.py": 2.9,
        "test_grad_checkpointing.py": 2.8,
        "test_monitors_flops.py": 2.7,
        "test_export_to_hf.py": 2.7,
        "test_timm_tower.py": 2.6,
        "test_export_atomic.py": 2.4,
        "test_patch_dropout.py": 2.4,
        "test_config_domains.py": 2,
        "test_text_trim.py": 2,
        "test_serve_key.py": 1.8,
        "test_evaluation_sharded.py": 1.8,
        "test_eval_cb_wds.py": 1.7,
        "test_data_samples.py": 1.7,
        "test_data_keep_keys.py": 1.6,
        "test_cli_manners.py": 1.2,
        "test_engine_ds_config.py": 1.2,
        "test_finetune_recipe.py": 1.1,
        "test_import_graph.py": 1.1,
        "test_optim.py": 1.1,
        "test_eval_benchmark.py": 1,
        "test_rundir_finished.py": 1,
    }.items()
}
# Files that wait more than they compute (timeouts, kills, network namespaces): always in half
# "a", so the computing files of half "b" fill the cores while they wait.
WAITING = (
    "tests/multihost",
    "tests/test_signals.py",
    "tests/test_cli_startup.py",
    "tests/test_conftest.py",
    "tests/test_data_remote.py",
    "tests/test_curate_cli.py",
)


def test_files() -> list[str]:
    files = sorted(
        str(p.relative_to(ROOT)) for p in (ROOT / "tests").rglob("test_*.py") if "multihost" not in p.parts
    )
    return files + ["tests/multihost"] if (ROOT / "tests" / "multihost").is_dir() else files


def split(files: list[str]) -> tuple[list[str], list[str]]:
    """The waiting files in ``a``, then each other file (longest first) to the lighter half."""
    cost = {f: DURATIONS.get(f, UNLISTED_S) for f in files}
    a = [f for f in files if f.startswith(WAITING)]
    b: list[str] = []
    load = {"a": sum(cost[f] for f in a), "b": 0.0}
    for f in sorted((f for f in files if f not in a), key=lambda f: -cost[f]):
        half = "a" if load["a"] < load["b"] else "b"
        (a if half == "a" else b).append(f)
        load[half] += cost[f]
    return sorted(a), sorted(b)


def main(argv: list[str]) -> int:
    pytest = [sys.executable, "-m", "pytest", *argv]
    if os.environ.get("MMALIGN_TEST_SERIAL") == "1":
        return subprocess.call(pytest, cwd=ROOT)
    logs = ROOT / ".pytest_halves"
    logs.mkdir(exist_ok=True)
    # outside the repository: the install test checks that its venv's package is not the checkout
    temp = Path(tempfile.mkdtemp(prefix="mmalign_test_halves_"))
    start = time.time()
    procs = {}
    for name, files in zip(("a", "b"), split(test_files())):
        log = (logs / f"{name}.log").open("w")
        cmd = [*pytest, "-p", "no:cacheprovider", f"--basetemp={temp / name}", *files]
        # one intra-op thread per half (unless the caller chose): two halves of 2 threads each on 2
        # cores spend their time preempting each other
        env = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", **os.environ}
        procs[name] = (
            subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env),
            log,
            len(files),
        )
    codes = {}
    for name, (proc, log, n) in procs.items():
        codes[name] = proc.wait()
        log.close()
    for name, (proc, log, n) in procs.items():
        print(f"\n======== half {name}: {n} test files, exit {codes[name]} ========", flush=True)
        print((logs / f"{name}.log").read_text(), end="", flush=True)
    shutil.rmtree(temp, ignore_errors=True)
    print(f"\nboth halves done in {time.time() - start:.0f} s; exit codes {codes}", flush=True)
    # pytest's 5 (nothing collected) in a half with no selected tests is no failure
    bad = [c for c in codes.values() if c not in (0, 5)]
    return bad[0] if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
