"""Achieved rates of one CUDA GPU: GEMMs and each attention kernel at several block sizes.

What the cost model prices (``costmodel.rates``, docs/specs.md "Achieved rates"), measured with
CUDA events (median of repeated calls after two warm-ups, fresh random inputs). The attention
kernels are called through the aten ops the runtime calls (``attention/kernels.py``), on
``[B, H, S, D]`` views, square blocks (S = T), causal and full:

- ``flash``: ``aten._scaled_dot_product_flash_attention`` and its ``_backward``;
- ``efficient``: ``aten._scaled_dot_product_efficient_attention`` and its ``_backward``;
- ``cudnn``: ``aten._scaled_dot_product_cudnn_attention`` and its ``_backward``.

FLOPs in the FlashAttention papers' count: forward ``4 * pairs * H * D`` (causal counts the
``S (S + 1) / 2`` visible pairs), forward + backward 3.5x that. ``bench/gpu_kernel_rates.py`` and
``profile`` (:func:`measure_kernel_rates`) share this code. CUDA only: every function here needs
a GPU except :func:`attention_flops` and :func:`rates_to_spec`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch

DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16"}


class Timing(NamedTuple):
    median_ms: float
    reps: int


def time_cuda(fn: Callable[[], Any], *, budget_s: float = 0.25, max_reps: int = 50) -> Timing:
    """Median CUDA-event time of ``fn()`` after two warm-up calls, about ``budget_s`` in all."""
    fn()
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    once = max(time.perf_counter() - t0, 1e-5)
    reps = int(max(3, min(max_reps, budget_s / once)))
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    times.sort()
    return Timing(times[len(times) // 2], reps)


# ---- kernels, called as the runtime calls them ([B, H, S, D] views) ------------------------------
def flash_call(q, k, v, causal: bool, scale: float, grad):  # type: ignore[no-untyped-def]
    """Forward (``grad`` None: returns out) or forward + backward (returns dq, dk, dv)."""
    out, lse, *_ = torch.ops.aten._scaled_dot_product_flash_attention(
        q, k, v, 0.0, causal, False, scale=scale
    )
    if grad is None:
        return out
    rng = torch.empty(2, dtype=torch.int64, device=q.device)
    return torch.ops.aten._scaled_dot_product_flash_attention_backward(
        grad,
        q,
        k,
        v,
        out,
        lse,
        None,
        None,
        q.shape[2],
        k.shape[2],
        0.0,
        causal,
        rng,
        rng[:1],
        scale=scale,
    )


def efficient_call(q, k, v, causal: bool, scale: float, grad):  # type: ignore[no-untyped-def]
    out, lse, seed, off = torch.ops.aten._scaled_dot_product_efficient_attention(
        q, k, v, None, True, 0.0, causal, scale=scale
    )
    if grad is None:
        return out
    return torch.ops.aten._scaled_dot_product_efficient_attention_backward(
        grad,
        q,
        k,
        v,
        None,
        out,
        lse,
        seed,
        off,
        0.0,
        [True, True, True, False],
        causal,
        scale=scale,
    )


def cudnn_call(q, k, v, causal: bool, scale: float, grad):  # type: ignore[no-untyped-def]
    res = torch.ops.aten._scaled_dot_product_cudnn_attention(
        q, k, v, None, True, 0.0, causal, False, scale=scale
    )
    out, lse, cq, ck, mq, mk, seed, off = res[:8]
    if grad is None:
        return out
    return torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
        grad, q, k, v, out, lse, seed, off, None, cq, ck, mq, mk, 0.0, causal, scale=scale
    )


KERNEL_CALLS: dict[str, Callable[..., Any]] = {
    "flash": flash_call,
    "efficient": efficient_call,
    "cudnn": cudnn_call,
}


def attention_flops(S: int, T: int, H: int, D: int, causal: bool) -> float:
    """Forward FLOPs of one square (causal) or rectangular (full) block, FlashAttention count."""
    pairs = S * (S + 1) / 2 if causal else S * T
    return 4.0 * pairs * H * D


def pair_heads(S: int, H: int, causal: bool) -> int:
    """Visible (query, key) pairs x heads of a square block of S tokens: the curves' x axis."""
    return (S * (S + 1) // 2 if causal else S * S) * H


def attention_rates(
    fn: Callable[..., Any], dtype: torch.dtype, H: int, S: int, D: int, causal: bool
) -> dict[str, Any]:
    """Forward and forward + backward time and TFLOP/s of one kernel on one square block (B = 1);
    ``{"error": ...}`` when the kernel refuses the inputs."""
    try:
        q, k, v, g = (torch.randn(1, H, S, D, device="cuda", dtype=dtype) for _ in range(4))
        sc = D**-0.5
        fl = attention_flops(S, S, H, D, causal)
        tf = time_cuda(lambda: fn(q, k, v, causal, sc, None))
        tb = time_cuda(lambda: fn(q, k, v, causal, sc, g))
    except Exception as e:  # noqa: BLE001 (record what does not run)
        return {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}
    return {
        "fwd_ms": tf.median_ms,
        "fwd_tflops": fl / tf.median_ms / 1e9,
        "fwd_bwd_ms": tb.median_ms,
        "fwd_bwd_tflops": 3.5 * fl / tb.median_ms / 1e9,
    }


def measure_gemm(dtype: torch.dtype, M: int, K: int, N: int) -> dict[str, Any]:
    """TFLOP/s of one ``[M, K] @ [K, N]`` GEMM (``2 M N K`` FLOPs)."""
    a = torch.randn(M, K, device="cuda", dtype=dtype)
    b = torch.randn(K, N, device="cuda", dtype=dtype)
    t = time_cuda(lambda: torch.matmul(a, b))
    return {"ms": t.median_ms, "tflops": 2.0 * M * N * K / t.median_ms / 1e9}


PROFILE_SIZES = (512, 1024, 2048, 4096, 8192, 16384)
"""Square block sizes ``profile`` measures each kernel at (the bench measures 128 to 32K)."""


def measure_kernel_rates(
    dtype: torch.dtype,
    heads: int,
    head_dim: int,
    sizes: Sequence[int] = PROFILE_SIZES,
    kernels: Sequence[str] = tuple(KERNEL_CALLS),
) -> list[dict[str, Any]]:
    """Forward + backward rates of every kernel that runs here, causal and full, at ``sizes``:
    one row per (kernel, mask, size) as :func:`attention_rates` returns it, plus its keys."""
    rows = []
    for kernel in kernels:
        for causal in (True, False):
            for S in sizes:
                row: dict[str, Any] = {
                    "kernel": kernel,
                    "dtype": DTYPE_NAMES.get(dtype, str(dtype)),
                    "D": head_dim,
                    "causal": causal,
                    "S": S,
                    "H": heads,
                }
                row.update(attention_rates(KERNEL_CALLS[kernel], dtype, heads, S, head_dim, causal))
                rows.append(row)
                if "error" in row:
                    break  # the kernel refuses these inputs: no larger size will run either
    return rows


def rates_to_spec(rows: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """``achieved_tflops`` and ``attention_curves`` of a cluster spec's GPU type from
    :func:`measure_kernel_rates` rows: per kernel, the long-block figure is its causal rate at the
    largest size measured; each curve point is ``[pair-heads, rate / that figure]``. A kernel
    without a causal rate at every size is left out."""
    achieved: dict[str, float] = {}
    curves: dict[str, list[list[float]]] = {}
    for kernel in dict.fromkeys(r["kernel"] for r in rows):
        mine = [r for r in rows if r["kernel"] == kernel]
        causal = sorted((r for r in mine if r["causal"]), key=lambda r: r["S"])
        if not causal or any("error" in r for r in mine):
            continue
        top = causal[-1]["fwd_bwd_tflops"]
        achieved[f"{kernel}/{causal[-1]['dtype']}/{causal[-1]['D']}"] = round(top, 3)
        for mask, want in (("causal", True), ("full", False)):
            pts = sorted((r for r in mine if r["causal"] == want), key=lambda r: r["S"])
            curves[f"{kernel}/{mask}"] = [
                [float(pair_heads(r["S"], r["H"], want)), round(r["fwd_bwd_tflops"] / top, 4)]
                for r in pts
            ]
    return {"achieved_tflops": achieved, "attention_curves": curves}
