"""Which scaled-dot-product-attention kernel the towers' attention runs, per device and dtype.

``train.attention_kernel`` (set for the process by :func:`set_mode`):

- ``auto`` (default): on CUDA, and on CPU in fp32, torch's own choice (flash / memory-efficient /
  cuDNN on a GPU, its flash kernel on a CPU). On CPU with bf16 / fp16 inputs (autocast) the
  fastest of three measured candidates for the call's shape (below).
- ``default``: always torch's own choice.
- ``flash`` / ``math``: that SDPA backend in the inputs' dtype.
- ``flash_fp32``: the flash kernel in float32 on upcast inputs, the output cast back.

Why CPU bf16 needs its own choice: on a CPU with native bf16 (avx512_bf16 / AMX) oneDNN runs
the towers' bf16 matmuls several times faster than fp32, but torch's CPU flash-attention
*backward* in bf16 is slower than in fp32 (measured at (256, 4 heads, 65 tokens, 32): 0.05 s
fp32, 0.16-0.24 s bf16 flash, 0.07-0.15 s bf16 math), and it was half of a bf16 step, eating
the matmuls' gain. Which candidate wins depends on the CPU and the shape, so it is measured
once per shape class (a few ms on a small batch slice; attention cost is linear in the batch)
and cached. Every candidate computes the same function; the bf16 error of each is bounded in
tests/models/test_attention_kernel.py against the fp32 step. ``flash_fp32`` is the most accurate of
the three (softmax and both products in fp32).

The choice is made per process and may differ between runs on different machines; set an
explicit mode for bit-reproducible bf16 runs across machines.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils._python_dispatch import _get_current_dispatch_mode

__all__ = ["MODES", "CANDIDATES", "set_mode", "get_mode", "using", "attention", "choose", "clear_cache"]

log = logging.getLogger("mmalign.attention")

MODES = ("auto", "default", "flash", "math", "flash_fp32")
CANDIDATES = ("flash", "math", "flash_fp32")  # measured by ``auto`` on CPU in bf16 / fp16
_LOW = (torch.bfloat16, torch.float16)

_state = {"mode": "auto"}
_cache: dict[tuple, str] = {}
_lock = threading.Lock()


def set_mode(mode: str) -> None:
    """The process-wide kernel choice (train.attention_kernel); clears the measured choices."""
    if mode not in MODES:
        raise ValueError(f"attention kernel must be one of {', '.join(MODES)}, got {mode!r}")
    _state["mode"] = mode
    clear_cache()


def get_mode() -> str:
    return _state["mode"]


def clear_cache() -> None:
    with _lock:
        _cache.clear()


def _run(kind: str, q, k, v, attn_mask, dropout_p: float, is_causal: bool) -> torch.Tensor:
    """SDPA with the candidate ``kind`` ('default' = torch's choice)."""
    if kind == "default":
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal
        )
    if kind == "flash_fp32":
        # below autocast: CPU autocast would cast the fp32 inputs straight back to bf16
        with torch.autocast(q.device.type, enabled=False), sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            mask = None if attn_mask is None else attn_mask.float()
            out = F.scaled_dot_product_attention(
                q.float(), k.float(), v.float(), attn_mask=mask, dropout_p=dropout_p, is_causal=is_causal
            )
        return out.to(q.dtype)
    backend = SDPBackend.FLASH_ATTENTION if kind == "flash" else SDPBackend.MATH
    with sdpa_kernel([backend]):
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal
        )


def _pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def _key(q, k, attn_mask, is_causal: bool) -> tuple:
    # shape class: batch and sequence lengths rounded up to powers of two (the text trim varies
    # the length from batch to batch; one measurement serves the whole class)
    b, h, n, d = q.shape
    return (
        q.device.type,
        q.dtype,
        _pow2(b),
        h,
        _pow2(n),
        _pow2(k.shape[-2]),
        d,
        is_causal,
        attn_mask is not None,
    )


def _same(t):
    return t


def _time_candidates(q, k, v, attn_mask, is_causal: bool, grad: bool) -> dict[str, float]:
    """Seconds of one forward (+ backward when ``grad``) per candidate, on a batch slice of at most
    32 rows with fresh random inputs of the call's shape and dtype (best of 2 after a warm-up)."""
    rows = min(q.shape[0], 32)
    gen = torch.Generator(device=q.device).manual_seed(0)

    def rand(t):
        x = torch.randn(rows, *t.shape[1:], generator=gen, device=t.device, dtype=torch.float32).to(t.dtype)
        return x.requires_grad_(grad)

    mask = None if attn_mask is None else (attn_mask[:rows] if attn_mask.dim() == 4 else attn_mask)
    times = {}
    # identity saved-tensor hooks on top of the stack: an outer hook (a memory probe counting the
    # activations a step saves) does not see the measurement's tensors
    hide = (
        torch.autograd.graph.saved_tensors_hooks(_same, _same)
        if torch._C._autograd._saved_tensors_hooks_is_enabled()  # type: ignore[attr-defined]  # private, not in torch's stubs
        else contextlib.nullcontext()
    )
    with hide, torch.enable_grad() if grad else torch.no_grad():
        for kind in CANDIDATES:
            qs, ks, vs = rand(q), rand(k), rand(v)
            best = float("inf")
            for rep in range(3):
                t0 = time.perf_counter()
                out = _run(kind, qs, ks, vs, mask, 0.0, is_causal)
                if grad:
                    out.sum().backward()
                if rep:  # the first run warms up the kernel
                    best = min(best, time.perf_counter() - t0)
            times[kind] = best
    return times


def choose(q, k, v, attn_mask=None, is_causal: bool = False, timer: Callable[..., dict] | None = None) -> str:
    """The kernel for this call: a candidate name, or 'default' (torch's choice).

    One choice per shape class whether or not the call records gradients: gradient caching
    runs each chunk once without and once with gradients, and both passes must compute the
    same representations bit for bit, so they must run the same kernel. The candidates are
    timed forward + backward (training is what the choice is for).

    ``timer``: ``(q, k, v, attn_mask, is_causal, grad) -> {candidate: seconds}`` (tests inject one)."""
    mode = _state["mode"]
    if mode != "auto":
        return mode
    if q.device.type != "cpu" or q.dtype not in _LOW:
        return "default"  # CUDA: flash / memory-efficient; CPU fp32: torch's flash kernel
    if torch.compiler.is_compiling():
        return "default"  # no timing inside a trace; inductor picks its own attention
    if _get_current_dispatch_mode() is not None:
        return "default"  # e.g. a FLOP counter: the measurement's kernels would be counted; not cached
    key = _key(q, k, attn_mask, is_causal)
    with _lock:
        if key in _cache:
            return _cache[key]
    # the measurement draws nothing from the run's streams, and its backward runs outside inference
    # mode even when the call is in it (a distillation teacher's forward), on a mask autograd may save
    with torch.random.fork_rng(devices=[]), torch.inference_mode(False):
        mask = None if attn_mask is None or not attn_mask.is_inference() else attn_mask.clone()
        times = (timer or _time_candidates)(q, k, v, attn_mask if mask is None else mask, is_causal, True)
    best = min(times, key=lambda kind: times[kind])
    with _lock:
        _cache[key] = best
    log.info(
        "attention kernel for %s %s%s: %s (fwd+bwd %s)",
        tuple(q.shape),
        str(q.dtype).replace("torch.", ""),
        ", causal" if is_causal else "",
        best,
        ", ".join(f"{k_} {t * 1e3:.2f} ms" for k_, t in times.items()),
    )
    return best


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
) -> torch.Tensor:
    """``F.scaled_dot_product_attention`` on (B, H, N, d) inputs through the kernel :func:`choose`
    picks. Returns (B, H, N, d) in the inputs' dtype."""
    return _run(choose(q, k, v, attn_mask, is_causal), q, k, v, attn_mask, dropout_p, is_causal)


@contextlib.contextmanager
def using(name: str):
    """:func:`set_mode` for a block (tests, benches); the previous mode and its cache come back."""
    previous = _state["mode"]
    with _lock:
        saved = dict(_cache)
    set_mode(name)
    try:
        yield
    finally:
        _state["mode"] = previous
        with _lock:
            _cache.clear()
            _cache.update(saved)
