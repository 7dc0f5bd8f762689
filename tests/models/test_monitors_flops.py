"""MFU that tells the truth (issue 27, point 3): the FLOP count at the configured context length,
attention included on every SDPA backend, without a trace; the peak of the dtype a run's matmuls
actually run in; what the log shows on a CPU.

The references are analytic counts written from the architectures' dimensions (2 FLOPs per
multiply-add of every matmul and convolution; norms, softmax and activations are not counted,
as in torch's FLOP counter), never the implementation's own numbers.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from mmalign.config import ModelConfig, load_config
from mmalign.models import build_model
from mmalign.run import runlog
from mmalign.run.monitors import (
    describe_peak,
    flop_counter,
    forward_flops_per_sample,
    matmul_dtype,
    peak_tflops,
    train_flops_per_sample,
)

BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.MATH]  # the two CPU backends the towers may run on


# ------------------------------------------------------------------ analytic counts


def _blocks(layers: int, tokens: int, width: int, mlp_ratio: int = 4) -> int:
    """Forward FLOPs of ``layers`` pre-norm transformer blocks on ``tokens`` tokens: per token the
    qkv (3 d^2), out (d^2) and MLP (2 x ratio d^2) projections; per block Q K^T and A V
    (2 x N^2 d: dense, a causal mask still computes every score)."""
    per_token = (3 + 1 + 2 * mlp_ratio) * width**2
    return 2 * layers * (tokens * per_token + 2 * tokens**2 * width)


def _vit(image: int, patch: int, width: int, layers: int, embed: int) -> int:
    """An open_clip ViT for one image: the patch convolution (3 p^2 -> d per patch), the blocks on
    the patches and the class token, the projection of the pooled class token (d -> embed)."""
    patches = (image // patch) ** 2
    return 2 * patches * width * 3 * patch**2 + _blocks(layers, patches + 1, width) + 2 * width * embed


def _text(context: int, width: int, layers: int, embed: int) -> int:
    """An open_clip causal text transformer for one caption at ``context`` tokens (the embedding
    lookup is no matmul) and the projection of the EOT token (d -> embed)."""
    return _blocks(layers, context, width) + 2 * width * embed


# ViT-B/16 (Dosovitskiy et al.; CLIP's ViT-B/16): 224 px, patch 16, 12 x 768; text 12 x 512 at
# 77 tokens; joint space 512.
VIT_B16 = _vit(224, 16, 768, 12, 512)  # 35.13 GFLOP (17.56 GMACs; 197 tokens, attention 0.72 GMACs)
TEXT_B16 = _text(77, 512, 12, 512)  # 5.96 GFLOP (2.98 GMACs)
# micro (mmalign/models/presets.py): 16 px, patch 4, 1 x 32; text 1 x 32 at 16 tokens; embed 32
VIT_MICRO, TEXT_MICRO = _vit(16, 4, 32, 1, 32), _text(16, 32, 1, 32)


def test_the_analytic_references_are_the_known_figures():
    assert VIT_B16 / 2 == pytest.approx(17.6e9, rel=0.01)  # ~17.6 GMACs forward at 224 px
    assert TEXT_B16 / 2 == pytest.approx(3.0e9, rel=0.01)  # ~3 GMACs at 77 tokens
    assert 3 * (VIT_B16 + TEXT_B16) == pytest.approx(123.3e9, rel=1e-3)  # a step: ~3x the forward


@pytest.fixture(scope="module")
def vit_b16():
    torch.manual_seed(0)
    model = build_model(load_config(None, ["model.preset=ViT-B-16"]).model)  # random init, no download
    arch = model.arch
    v, t = arch["vision_cfg"], arch["text_cfg"]
    # the dimensions the analytic count is written from
    assert (v["image_size"], v["patch_size"], v["width"], v["layers"]) == (224, 16, 768, 12)
    assert (t["context_length"], t["width"], t["layers"], arch["embed_dim"]) == (77, 512, 12, 512)
    return model


def test_vit_b16_step_counts_the_analytic_123_gflop(vit_b16):
    model = vit_b16
    vision = forward_flops_per_sample(model, model.image_size, model.context_length, towers=("visual",))
    text = forward_flops_per_sample(model, model.image_size, model.context_length, towers=("text",))
    assert vision == pytest.approx(VIT_B16, rel=5e-3)
    assert text == pytest.approx(TEXT_B16, rel=5e-3)  # all 77 tokens, not the 2 the probe once kept
    step = train_flops_per_sample(model, model.image_size, model.context_length)
    print(
        f"ViT-B-16: counted {step / 1e9:.2f} GFLOP/sample (vision fwd {vision / 1e9:.2f}, text fwd "
        f"{text / 1e9:.2f}); analytic {3 * (VIT_B16 + TEXT_B16) / 1e9:.2f}"
    )
    assert step == pytest.approx(3 * (VIT_B16 + TEXT_B16), rel=5e-3)


# ------------------------------------------------------------------ the same count whatever runs


@pytest.mark.parametrize("backend", BACKENDS, ids=["flash", "math"])
@pytest.mark.parametrize("trim", [True, False], ids=["trim", "no-trim"])
def test_the_count_ignores_the_trim_and_the_sdpa_backend(trim, backend):
    model = build_model(ModelConfig(preset="micro"))
    model.trim_text = trim
    with sdpa_kernel(backend):
        vision = forward_flops_per_sample(model, 16, 16, towers=("visual",))
        text = forward_flops_per_sample(model, 16, 16, towers=("text",))
        step = train_flops_per_sample(model, 16, 16)
    assert (vision, text) == (VIT_MICRO, TEXT_MICRO)  # exact: integer formulas on both sides
    assert step == 3 * (VIT_MICRO + TEXT_MICRO)


def _ops_seen(model, backend) -> set[str]:
    """The ops the counter credits in a forward of ``model`` under ``backend``."""
    images, tokens = torch.zeros(1, 3, 16, 16), torch.ones(1, 16, dtype=torch.long)
    counter = flop_counter()
    with torch.no_grad(), sdpa_kernel(backend), counter:
        model(images, tokens)
    return {str(op) for op in counter.get_flop_counts()["Global"]}


def test_both_backends_really_run_and_the_flash_kernel_is_credited():
    """The invariance above is not vacuous: under the flash backend the towers run the CPU flash
    kernel (which torch's counter alone would credit with 0), under the math backend plain bmm."""
    model = build_model(ModelConfig(preset="micro"))
    flash, math_ = _ops_seen(model, SDPBackend.FLASH_ATTENTION), _ops_seen(model, SDPBackend.MATH)
    assert any("flash_attention_for_cpu" in op for op in flash) and not any("bmm" in op for op in flash)
    assert any("bmm" in op for op in math_) and not any("flash" in op for op in math_)


@pytest.mark.parametrize("backend", BACKENDS, ids=["flash", "math"])
def test_attention_forward_and_backward_counts(backend, gen):
    b, h, length, s, e = 2, 3, 7, 7, 8
    q, k, v = (torch.randn(b, h, n, e, generator=gen, requires_grad=True) for n in (length, s, s))
    mask = torch.zeros(length, s)  # additive, like the text tower's causal mask
    fwd = 4 * b * h * length * s * e  # Q K^T and A V, 2 FLOPs per multiply-add
    for backward, want in ((False, fwd), (True, None)):
        counter = flop_counter()
        with sdpa_kernel(backend), counter:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
            if backward:
                out.sum().backward()
        got = counter.get_total_flops()
        if not backward:
            assert got == want
        elif backend == SDPBackend.FLASH_ATTENTION:  # recompute Q K^T, then dP, dV, dQ, dK: 2.5x the forward
            assert got == fwd + 10 * b * h * length * s * e
        else:  # the math backend's autograd keeps the probabilities: dP, dV, dQ, dK only
            assert got == fwd + 8 * b * h * length * s * e


def test_the_count_leaves_no_trace():
    torch.manual_seed(1)
    model = build_model(ModelConfig(preset="micro", patch_dropout=0.5))  # the count draws a mask
    for mode, trim in ((False, True), (True, False)):
        model.train(mode)
        model.text.transformer.train(not mode)  # mixed modes come back as they were
        model.trim_text = trim
        rng, modes = torch.get_rng_state(), [m.training for m in model.modules()]
        assert len(set(modes)) == 2
        buffers = {name: (b, b.clone()) for name, b in model.named_buffers()}
        forward_flops_per_sample(model, 16, 16, second_view=True, negatives=2)
        train_flops_per_sample(model, 16, 16)
        assert torch.equal(torch.get_rng_state(), rng)
        assert [m.training for m in model.modules()] == modes
        assert model.trim_text is trim
        now = dict(model.named_buffers())
        assert now.keys() == buffers.keys()
        for name, (obj, value) in buffers.items():  # the same tensors (the causal mask put back), unchanged
            assert now[name] is obj and torch.equal(obj, value), name


# ------------------------------------------------------------------ peaks by dtype


def _cfg(*overrides: str):
    return load_config(None, ["model.preset=micro", *overrides])


@pytest.mark.parametrize(
    "overrides, device, want",
    [
        (["train.precision=bf16"], "cuda", "bf16"),
        (["train.precision=bf16"], "cpu", "bf16"),
        (["train.precision=fp16", "deepspeed.precision=fp16"], "cuda", "fp16"),
        ([], "cuda", "tf32"),  # fp32 tensors, train.tf32 on by default: TF32 tensor cores
        (["train.tf32=false"], "cuda", "fp32"),
        ([], "cpu", "fp32"),  # train.tf32 does nothing on a CPU
        (
            ["deepspeed.precision=bf16", "deepspeed.zero_stage=1"],
            "cuda",
            "bf16",
        ),  # bf16 weights: bf16 matmuls
    ],
)
def test_the_run_dtype_comes_from_its_config(overrides, device, want):
    assert matmul_dtype(_cfg(*overrides), torch.device(device)) == want


@pytest.fixture
def gpu_named(monkeypatch):
    """A stand-in CUDA device name (the test runs on a CPU)."""

    def name(value: str) -> torch.device:
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda *args, **kwargs: value)
        return torch.device("cuda", 0)

    return name


@pytest.mark.parametrize(
    "name, peaks",
    [
        ("NVIDIA H200", {"bf16": 989.0, "fp16": 989.0, "tf32": 494.7, "fp32": 67.0}),
        ("NVIDIA H100 80GB HBM3", {"bf16": 989.0, "tf32": 494.7, "fp32": 67.0}),
        ("NVIDIA H100 PCIe", {"bf16": 756.5, "tf32": 378.0, "fp32": 51.0}),  # not the SXM part's figures
        ("NVIDIA A100-SXM4-80GB", {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5}),
        ("NVIDIA A10", {"bf16": 125.0, "tf32": 62.5, "fp32": 31.2}),  # not matched by "A100"
        ("Tesla V100-SXM2-16GB", {"bf16": None, "fp16": 125.0, "tf32": 15.7, "fp32": 15.7}),  # no bf16 units
        ("Some Future GPU", {"bf16": None, "fp32": None}),
    ],
)
def test_the_peak_is_the_datasheet_figure_of_the_dtype(gpu_named, name, peaks):
    device = gpu_named(name)
    for dtype, want in peaks.items():
        assert peak_tflops(device, 0.0, dtype) == want, dtype
    assert peak_tflops(device, 0.0) == peaks["bf16"]  # the default dtype: bf16, as before


def test_a_configured_peak_overrides_and_a_cpu_has_none(gpu_named):
    device = gpu_named("NVIDIA H200")
    assert peak_tflops(device, 123.0, "fp32") == 123.0 and peak_tflops("cpu", 2.5, "bf16") == 2.5
    for dtype in ("bf16", "fp16", "tf32", "fp32"):
        assert peak_tflops(torch.device("cpu"), 0.0, dtype) is None
    with pytest.raises(ValueError, match="dtype"):
        peak_tflops(device, 0.0, "int8")


def test_the_start_line_names_the_peak(gpu_named):
    device = gpu_named("NVIDIA H200")
    assert "H200 dense tf32 peak, 494.7 TFLOP/s" in describe_peak(device, 0.0, "tf32")
    assert "monitor.peak_tflops = 100 TFLOP/s" in describe_peak(device, 100.0, "bf16")
    assert "GFLOP/s" in describe_peak("cpu", 0.0, "fp32") and "no MFU" in describe_peak("cpu", 0.0, "fp32")
    assert "no MFU" in describe_peak(gpu_named("Tesla V100-SXM2-16GB"), 0.0, "bf16")


# ------------------------------------------------------------------ what the log shows


def test_the_readable_line_shows_the_rate():
    assert runlog._throughput({"tflops": 0.0123, "gflops": 12.34}) == "  GFLOP/s 12.3"
    assert runlog._throughput({"tflops": 40.06, "mfu": 0.0405}) == "  TFLOP/s 40.1  MFU 4.0%"
    assert runlog._throughput({"tflops": 40.06, "gflops": 40060.0, "mfu": 0.5}).endswith("MFU 50.0%")
    assert runlog._throughput({"tflops": 40.06}) == "  TFLOP/s 40.1" and runlog._throughput({}) == ""
    assert runlog._throughput({"tflops": 4.2e-5, "gflops": 0.0421}) == "  GFLOP/s 0.042"  # not "0.0"


def test_a_cpu_run_logs_gflops_of_the_full_count_and_no_mfu(micro_overrides):
    from mmalign.run.train import train

    cfg = load_config(
        None,
        micro_overrides
        + [
            "train.steps=2",
            "train.warmup_steps=0",
            "train.log_every=1",
            "monitor.probe_size=0",
            "eval.suite=none",
        ],
    )
    assert cfg.train.trim_text_padding  # the loop trims the shapes captions; the count does not
    out = train(cfg, show_progress=False)
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    for r in records:
        assert "mfu" not in r
        assert r["gflops"] == pytest.approx(r["tflops"] * 1e3, rel=1e-9)
        # per sample: the analytic micro step at the full 16 tokens (the count ran on the device, untrimmed)
        assert r["tflops"] * 1e12 / r["samples_per_s"] == pytest.approx(
            3 * (VIT_MICRO + TEXT_MICRO), rel=1e-6
        )
    log = (out / "train.log").read_text()
    assert "no peak FLOP/s for a CPU (matmuls in fp32): logging achieved GFLOP/s, no MFU" in log
    steps = [line for line in log.splitlines() if "step 2/2" in line]
    assert steps and "GFLOP/s " in steps[-1] and "MFU" not in steps[-1]
