"""Per-sample FLIP masks (issue 30: drawn from each sample's seed, not the rank's generator) and
logs that tell the truth across ranks (issue 13, points 4 and 7)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

from mmalign.config import ModelConfig, load_config
from mmalign.models import build_model
from mmalign.run.monitors import forward_flops_per_sample, global_log_values, mfu
from tests.harness import run_ranks

WORLD = 2


# ------------------------------------------------------------- the reduction


def _reduce_worker(rank, world):
    skipped = [{"decode": 1}, {"decode": 3, "too_small": 2}][rank]  # rank 1 knows a reason rank 0 does not
    return global_log_values(torch.tensor(1.0 + 2 * rank), 0.5 + rank, skipped)


def test_global_log_values_mean_the_loss_and_sum_waits_and_skips():
    got = run_ranks(_reduce_worker, WORLD, pooled=True)[0]
    # losses 1 and 3 -> mean 2; waits 0.5 + 1.5; skips {decode: 1 + 3, too_small: 0 + 2}
    assert got == {
        "loss": 2.0,
        "data_wait_s": 2.0,
        "skipped_samples/decode": 4,
        "skipped_samples/too_small": 2,
    }


def test_global_log_values_in_one_process_are_the_local_values():
    got = global_log_values(torch.tensor(0.25), 1.5, {"decode": 2})
    assert got == {"loss": 0.25, "data_wait_s": 1.5, "skipped_samples/decode": 2}
    assert mfu(8.0, 2.0, 2) == 2.0 and mfu(8.0, None, 2) is None


# ---------------------------------------------------------- FLOPs in train mode


def test_flops_are_counted_in_train_mode_without_a_trace():
    plain = build_model(ModelConfig(preset="micro"))
    dropped = build_model(ModelConfig(preset="micro", vision={"patch_dropout": 0.5}))
    dropped.eval()
    state = torch.get_rng_state()
    f_dropped = forward_flops_per_sample(dropped, 16, 16)
    assert torch.equal(torch.get_rng_state(), state)  # the run's dropout stream is untouched
    assert not dropped.training  # the mode is restored
    f_plain = forward_flops_per_sample(plain, 16, 16)
    assert f_dropped < f_plain  # 16 patches -> 8 kept: the vision tower's share shrinks
    # BatchNorm (tiny-rn): two samples in train mode, running statistics restored
    rn = build_model(ModelConfig(preset="tiny-rn"))
    rn.train()
    rn(torch.randn(2, 3, 64, 64), torch.zeros(2, 32, dtype=torch.long))  # non-trivial running stats
    before = {k: v.clone() for k, v in rn.named_buffers()}
    assert forward_flops_per_sample(rn, 64, 32) > 0
    for k, v in rn.named_buffers():
        assert torch.equal(v, before[k]), k


# ------------------------------------------------- 2-rank training runs


def _train_worker(rank, world, overrides, out):
    """A straight run (recording every train-mode patch-dropout mask with the seeds it was drawn
    from, and every step's local loss), then, in the same processes, a resume from its step-3
    checkpoint."""
    import open_clip.transformer as oct

    from mmalign.dist import distributed as mdist
    from mmalign.models import flip
    from mmalign.run import engine as eng
    from mmalign.run.train import train

    masks, losses = [], []
    original = oct.PatchDropout.forward
    seeded = flip.SeededPatchDropout.forward

    def recording(self, x):  # the unseeded path (the FLOP count): redraw without consuming the RNG
        if self.training and self.prob > 0:
            state = torch.get_rng_state()
            rand = torch.randn(x.shape[0], x.shape[1] - int(self.exclude_first_token))
            torch.set_rng_state(state)
            masks.append((None, rand.topk(max(1, int(rand.shape[1] * (1 - self.prob))), dim=-1).indices))
        return original(self, x)

    def recording_seeded(self, x):
        out = seeded(self, x)
        if self.training and self.prob > 0 and self.row_seeds is not None:
            # which patch tokens were kept: match the kept rows of x back to their positions
            kept = out[:, 1:]  # (B, K, W)
            index = (kept[:, :, None, :] == x[:, None, 1:, :]).all(-1).float().argmax(-1)  # (B, K)
            masks.append((list(self.row_seeds), index))
        return out

    oct.PatchDropout.forward = recording
    flip.SeededPatchDropout.forward = recording_seeded
    step = eng.Engine.step

    def recording_step(self, *args, **kwargs):
        result = step(self, *args, **kwargs)
        losses.append(float(result.loss.detach()))
        return result

    eng.Engine.step = recording_step
    cfg = load_config(None, overrides)
    run = train(cfg, show_progress=False)
    torch.save({"masks": masks, "losses": losses}, f"{out}/rank{rank}.pt")
    if rank == 0:
        shutil.copy(run / "metrics.jsonl", f"{out}/straight_metrics.jsonl")
        shutil.move(run / "final", f"{out}/straight_final")
    mdist.barrier()
    train(cfg, show_progress=False, resume=str(run / "checkpoints" / "step_00000003"))


@pytest.fixture(scope="module")
def two_rank_run(shapes_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("two_rank")
    ov = [
        "model.preset=micro",
        f"data.train={shapes_dir}/train/{{00000..00001}}.tar",
        f"data.val={shapes_dir}/val/00000.tar",
        "data.workers=0",
        "data.shuffle_buffer=50",
        "train.global_batch_size=16",
        "train.steps=6",
        "train.warmup_steps=2",
        "train.lr=0.002",
        "train.log_every=1",
        "train.checkpoint_every=3",
        "train.keep_checkpoints=5",
        "model.vision.patch_dropout=0.5",
        "monitor.peak_tflops=0.001",
        f"output={out / 'run'}",
    ]
    # fresh ranks: train() makes and ends its own group, as under a launcher (run_ranks' doc)
    run_ranks(_train_worker, WORLD, ov, str(out), group=False)
    return out


def _naive_mask(seed: int, patches: int, keep: int) -> torch.Tensor:
    """A sample's FLIP mask by hand: its own generator's scores over the patches, the top ``keep``."""
    return torch.rand(patches, generator=torch.Generator().manual_seed(seed)).topk(keep).indices


@pytest.mark.integration
def test_each_sample_draws_its_own_mask_and_the_logs_hold_global_values(two_rank_run):
    out = two_rank_run
    r0, r1 = torch.load(out / "rank0.pt"), torch.load(out / "rank1.pt")
    # call 0: the FLOP count (train mode, no sample seeds, before the per-rank reseed): the same
    assert r0["masks"][0][0] is None and torch.equal(r0["masks"][0][1], r1["masks"][0][1])
    # then every training forward: each row's mask is its sample's (seed -> scores -> top half)
    assert len(r0["masks"]) == len(r1["masks"]) == 7
    for (s0, m0), (s1, m1) in zip(r0["masks"][1:], r1["masks"][1:]):
        assert len(s0) == len(s1) == 8 and not set(s0) & set(s1)  # other samples on the other rank
        for seeds, mask in ((s0, m0), (s1, m1)):
            for seed, row in zip(seeds, mask):
                assert torch.equal(row, _naive_mask(seed, 16, 8)), seed
    records = [json.loads(line) for line in (out / "straight_metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
    for r, l0, l1 in zip(records, r0["losses"], r1["losses"]):
        assert l0 != l1  # different local batches: the test can tell the mean from rank 0's loss
        assert r["loss"] == pytest.approx((l0 + l1) / 2, rel=1e-6, abs=1e-7)
        assert r["mfu"] == pytest.approx(r["tflops"] / (0.001 * WORLD), rel=1e-9)


def test_two_rank_resume_with_dropout_is_bit_exact(two_rank_run):
    out = two_rank_run
    straight = load_file(str(out / "straight_final" / "model.safetensors"))
    resumed = load_file(str(out / "run" / "final" / "model.safetensors"))
    for k in straight:
        assert torch.equal(resumed[k], straight[k]), k
    losses = [json.loads(line)["loss"] for line in (out / "run" / "metrics.jsonl").read_text().splitlines()]
    assert losses == [
        json.loads(line)["loss"] for line in (out / "straight_metrics.jsonl").read_text().splitlines()
    ]
