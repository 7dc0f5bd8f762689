"""Trailing-padding trim of the text tower (mmalign/models/text_trim.py, issue 20 point 3).

The reference is open_clip's own full-length forward (``trim_text = False``: every padded
column runs through the causal transformer); the trimmed tower must give the same features
and the same gradient for every text parameter, in float64, while actually running on fewer
columns.  Towers where padding matters (bidirectional, last-token pooling) must not be cut.
"""

from __future__ import annotations

import copy

import pytest
import torch

from mmalign.config import load_config
from mmalign.data.batch import Batch
from mmalign.models.presets import PRESETS
from mmalign.models.text_trim import multiple_for, trim_batch, trimmed_length
from mmalign.models.two_tower import TwoTower
from tests.harness import clip_batch


def _model(**text) -> TwoTower:
    arch = copy.deepcopy(PRESETS["micro"])
    arch["text_cfg"].update({"context_length": 24, "layers": 2, **text})
    torch.manual_seed(0)
    return TwoTower(arch).double()


def _seen_lengths(model: TwoTower) -> list[int]:
    seen = []
    model.text.token_embedding.register_forward_pre_hook(lambda m, args: seen.append(args[0].shape[-1]))
    return seen


def _features_and_grads(model: TwoTower, tokens: torch.Tensor):
    model.zero_grad(set_to_none=True)
    feats = model.encode_text(tokens)  # (B, D)
    w = torch.linspace(-1, 1, feats.numel(), dtype=feats.dtype).reshape(feats.shape)
    (feats * w).sum().backward()  # a loss that weighs every output coordinate differently
    grads = {n: p.grad.clone() for n, p in model.text.named_parameters() if p.grad is not None}
    return feats.detach(), grads


@pytest.mark.parametrize("pool", ["argmax", "eos", "first"])
def test_trimmed_text_tower_equals_the_full_length_forward_and_gradients(pool):
    _, tokens = clip_batch(12, seed=5, context=24)  # ends between 3 and 22: the longest row sets L'
    tokens[:, 12:] = 0  # every caption ends by column 12: half the context is padding
    tokens[0, 10], tokens[0, 11] = 17, 49407
    model = _model(pool_type=pool, eos_id=49407)
    assert model.text_trimmable
    seen = _seen_lengths(model)

    model.trim_text = False  # open_clip's full-length computation: the reference
    want_f, want_g = _features_and_grads(model, tokens)
    model.trim_text = True
    got_f, got_g = _features_and_grads(model, tokens)

    assert seen == [24, 12]  # the trimmed forward really ran on 12 columns
    assert torch.allclose(got_f, want_f, rtol=0, atol=1e-12)
    assert got_g.keys() == want_g.keys() and len(got_g) == len(list(model.text.parameters()))
    for name in want_g:
        assert torch.allclose(got_g[name], want_g[name], rtol=0, atol=1e-12), name
    assert model.text.attn_mask.shape == (24, 24)  # the full mask is back after the call


@pytest.mark.parametrize("text", [{"pool_type": "last"}, {"no_causal_mask": True}, {"embed_cls": True}])
def test_towers_that_read_the_padding_are_not_trimmed(text):
    _, tokens = clip_batch(6, seed=1, context=24)
    tokens[:, 10:] = 0
    model = _model(**text)
    assert not model.text_trimmable
    seen = _seen_lengths(model)
    model.encode_text(tokens)
    assert seen == [24]


def test_cutting_a_last_pooled_tower_would_change_it():
    """Why the guard exists: with last-token pooling the cut moves the pooled position."""
    _, tokens = clip_batch(6, seed=1, context=24)
    tokens[:, 10:] = 0
    model = _model(pool_type="last")
    with torch.no_grad():
        full = model.encode_text(tokens)
        model.text.attn_mask = model.text.attn_mask[:10, :10]
        cut = model.encode_text(tokens[:, :10])
    assert (full - cut).abs().max() > 1e-3


def test_lengths_batches_and_cuda_rounding():
    tokens = torch.zeros(3, 32, dtype=torch.long)
    tokens[0, :5] = 7
    tokens[2, :11] = 9
    assert trimmed_length(tokens) == 11
    assert trimmed_length(tokens, multiple=8) == 16
    assert trimmed_length(torch.zeros(2, 32, dtype=torch.long)) == 1  # all padding: one column kept
    full = torch.ones(2, 32, dtype=torch.long)
    assert trimmed_length(full, multiple=8) == 32  # never longer than the context
    assert multiple_for("cuda") == 8 and multiple_for("cpu") == 1

    neg = torch.zeros(3, 2, 32, dtype=torch.long)
    neg[1, 1, :14] = 3  # a mined negative longer than every positive caption
    batch = Batch(images=torch.zeros(3, 3, 4, 4, dtype=torch.uint8), tokens=tokens, neg_tokens=neg)
    cut = trim_batch(batch)
    assert cut.tokens.shape == (3, 14) and cut.neg_tokens.shape == (3, 2, 14)  # one common length
    assert torch.equal(cut.tokens, tokens[:, :14]) and torch.equal(cut.neg_tokens, neg[..., :14])
    assert trim_batch(Batch(images=batch.images, tokens=full)).tokens is full  # nothing to cut: same batch


@pytest.mark.integration
def test_a_trimmed_run_trains_the_same_weights_as_a_full_length_run(micro_overrides, tmp_path):
    """Three loop steps (DeepSpeed ZeRO-0) with and without train.trim_text_padding: the same final
    weights, while the trimmed run's text tower saw shorter token rows.  SGD, not AdamW: the
    attention's key bias has an exactly-zero gradient (softmax ignores a shift shared by all
    keys), and Adam would scale its float noise (~1e-10, different for each matmul shape) into
    steps of size lr."""
    from torch.nn.modules.module import register_module_forward_pre_hook

    import mmalign
    from mmalign.run.train import train

    widths = {}

    def record(module, args):
        if isinstance(module, torch.nn.Embedding) and args and args[0].dtype == torch.long:
            widths.setdefault(current, set()).add(tuple(args[0].shape))

    handle = register_module_forward_pre_hook(record)
    finals = {}
    try:
        for current in (True, False):
            cfg = load_config(
                None,
                micro_overrides
                + [
                    f"train.trim_text_padding={str(current).lower()}",
                    "train.steps=3",
                    "train.optimizer=sgd",
                    "train.lr=0.5",
                    "eval.suite=none",
                    "monitor.probe_size=0",
                    f"output={tmp_path / str(current)}",
                ],
            )
            finals[current] = mmalign.load(train(cfg, show_progress=False) / "final").model.state_dict()
    finally:
        handle.remove()
    rows = {
        run: {shape[-1] for shape in shapes if shape[0] == 32} for run, shapes in widths.items()
    }  # the batches
    assert max(rows[True]) < 16 and rows[False] == {16}  # micro's context is 16 tokens
    for name, want in finals[False].items():
        assert torch.allclose(finals[True][name], want, rtol=0, atol=2e-5), name


def test_threads_encoding_with_one_model_get_their_own_lengths():
    """short_context swaps the tower's mask for a forward: concurrent callers must take turns
    (otherwise one thread's blocks read the other's (L, L) mask and fail or mix lengths)."""
    import threading

    model = _model().float().eval()
    _, tokens = clip_batch(8, seed=2, context=24)
    short, long_ = tokens.clone(), tokens.clone()
    short[:, 6:], short[:, 5] = 0, 49407
    long_[:, 20:], long_[:, 19] = 0, 49407
    with torch.no_grad():
        want = {"short": model.encode_text(short), "long": model.encode_text(long_)}
    errors, got = [], {"short": [], "long": []}

    def work(name, toks):
        try:
            for _ in range(30):
                with torch.no_grad():
                    got[name].append(model.encode_text(toks))
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(repr(e))

    threads = [threading.Thread(target=work, args=a) for a in (("short", short), ("long", long_))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    for name in want:
        assert all(torch.equal(g, want[name]) for g in got[name]), name
