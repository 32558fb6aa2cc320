"""Achieved attention rates: which kernel runs on a GPU, its rate for the model's head dim, and how
the rate falls with the work of one kernel call.

``auto`` mirrors the runtime's choice (``attention/kernels.py``): cuDNN on compute capability 9.x,
else PyTorch's flash (compute capability >= 8.0, fp16/bf16, head dim a multiple of 8 and at most
256), else the memory-efficient kernel. A forced kernel (``TrainOptions.attention_kernel``) must
have a figure for the GPU (``GpuType.achieved_tflops``), or the model refuses it in one line.

The rate of one call is ``long-block rate x f(pair-heads of the call)``, ``f`` interpolated
linearly in log(pair-heads) between the points of the kernel's curve (``gpu_rates.ATTENTION_CURVES``
or the GPU type's own ``attention_curves`` from ``profile``): ``causal`` for a group's own block
(round 0), ``full`` for a received block. Below the first point the call's time stays that of the
first point (the per-call overhead: launches and host time); above the last, ``f`` is the last
point's. A GPU type with ``attention_tflops`` or without kernel figures keeps one flat rate, except
a type with its own ``cpu-flash`` curves (the CPU testbed's ``profile`` measures them: the runtime's
CPU kernel at several window sizes): ``attention_tflops`` is then that kernel's long-block rate and
its calls are priced on its curves like a GPU kernel's.
"""

from __future__ import annotations

from functools import lru_cache
from typing import NamedTuple

import numpy as np

from megatron_hexiseq import gpu_rates, kernel_rules
from megatron_hexiseq.cluster import Cluster, Curve, GpuType, auto_kernel_order
from megatron_hexiseq.costmodel.comm import cluster_arrays
from megatron_hexiseq.errors import HexiSeqError
from megatron_hexiseq.kernel_rules import capability_of

RUNTIME_KERNELS = ("auto", "flash", "efficient", "cudnn", "flash-attn", "flash-attn3")
"""Kernel names the model prices; ``reference`` and ``cpu-flash`` (CPU, oracle) keep the flat rate
(``cpu-flash`` with its curves where the type has them)."""
FLAT_KERNELS = ("reference", "cpu-flash")
CPU_KERNEL = "cpu-flash"
"""The CPU runtime's kernel (``auto`` on CPU); the only kernel of a flat-rate type with curves."""


class AttentionRate(NamedTuple):
    """The attention rate of one GPU type for one model and kernel choice.

    ``kernel``: the concrete kernel ("" for a flat rate); ``flops_per_s``: the long-block rate in
    the cost model's count (12 d per pair and head); ``causal`` / ``full``: the curves of the
    achieved fraction against pair-heads per call (None: flat)."""

    kernel: str
    flops_per_s: float
    causal: Curve | None
    full: Curve | None


def _applies(kernel: str, gpu: GpuType, dtype: str, head_dim: int) -> bool:
    """Would ``kernel`` take these inputs on ``gpu``, by the runtime's rules (``kernel_rules``); a
    type without a compute capability is taken to be one the kernel runs on, and cuDNN to be
    current."""
    cc = capability_of(gpu.compute_capability) if gpu.compute_capability is not None else (9, 0)
    if kernel in ("flash", "flash-attn"):
        return kernel_rules.flash_takes(cc, dtype, head_dim)
    if kernel == "cudnn":
        return kernel_rules.cudnn_takes(cc, dtype, head_dim, kernel_rules.CUDNN_PREFERRED_FROM)
    if kernel == "flash-attn3":
        return cc[0] == 9 and dtype in ("bf16", "fp16") and head_dim % 8 == 0 and head_dim <= 256
    return kernel == "efficient" and kernel_rules.efficient_takes(dtype, head_dim)


def _kernel_tflops(gpu: GpuType, kernel: str, dtype: str, head_dim: int) -> float | None:
    """The type's figure for ``kernel`` at ``dtype`` and ``head_dim`` (FlashAttention count): the
    head dims 64 and 128 given, linear in between, the nearer one outside."""
    low, high = gpu.rate(f"{kernel}/{dtype}/64"), gpu.rate(f"{kernel}/{dtype}/128")
    exact = gpu.rate(f"{kernel}/{dtype}/{head_dim}")
    if exact is not None:
        return exact
    if low is None or high is None:
        return low if high is None else high
    if head_dim <= 64:
        return low
    if head_dim >= 128:
        return high
    return low + (high - low) * (head_dim - 64) / 64


def pick_kernel(
    gpu: GpuType, head_dim: int, forced: str = "auto", dtype: str | None = None
) -> str | None:
    """The kernel the runtime would run on ``gpu`` for ``dtype`` (default: the GPU's training dtype)
    and ``head_dim`` (None: no kernel figures, so a flat rate). ``forced`` other than ``auto`` must
    run there and have a figure. The runtime's rule (``attention/kernels.py``): cuDNN on compute
    capability 9.x, else flash, else memory-efficient."""
    dtype = dtype or gpu.train_dtype
    forced = "auto" if forced == "sdpa" else forced  # the runtime's old name of auto
    if forced in FLAT_KERNELS or not gpu.achieved_tflops:
        return None
    if forced == "auto":
        for kernel in auto_kernel_order(gpu):
            if _applies(kernel, gpu, dtype, head_dim) and _kernel_tflops(
                gpu, kernel, dtype, head_dim
            ):
                return kernel
        return None
    if forced not in RUNTIME_KERNELS:
        raise HexiSeqError(
            f"unknown attention kernel {forced!r}; choose one of {', '.join(RUNTIME_KERNELS)}"
        )
    if not _applies(forced, gpu, dtype, head_dim) or not _kernel_tflops(
        gpu, forced, dtype, head_dim
    ):
        raise HexiSeqError(
            f"attention kernel {forced!r} has no rate on {gpu.name} for {dtype} head dim {head_dim} "
            f"(compute capability {gpu.compute_capability}); use --attention-kernel auto or add "
            f"gpus.{gpu.name}.achieved_tflops.{forced}/{dtype}/<head dim>"
        )
    return forced


@lru_cache(maxsize=1024)
def attention_rate(
    gpu: GpuType, head_dim: int, forced: str = "auto", packed: bool = False
) -> AttentionRate:
    """The long-block rate and curves of the kernel ``forced`` names (or ``auto`` picks) on ``gpu``
    (cached: ``formulas.attention_s_per_pair_head`` asks per GPU type on every ``estimate``, and
    the kernel choice reads the type's figures by name; a forced kernel without a figure raises
    every time, since exceptions are not cached). ``packed``: the rate of a packed-document block,
    which runs the kernel's variable-length call where it has one (``kernel_rules.packed_kernel``:
    cuDNN's packed blocks run as flash's variable-length call, ``attention/varlen.py``)."""
    kernel = None if gpu.attention_tflops is not None else pick_kernel(gpu, head_dim, forced)
    if kernel is not None and packed:
        kernel = kernel_rules.packed_kernel(kernel)
    if kernel is None:
        peak = gpu.attention_tflops if gpu.attention_tflops is not None else gpu.bf16_tflops
        causal, full = gpu.curve(f"{CPU_KERNEL}/causal"), gpu.curve(f"{CPU_KERNEL}/full")
        if (
            gpu.attention_tflops is not None
            and causal
            and full
            and forced in ("auto", "sdpa", CPU_KERNEL)
        ):  # the CPU testbed's measured kernel curves
            return AttentionRate(CPU_KERNEL, peak * 1e12 * gpu.efficiency, causal, full)
        return AttentionRate("", peak * 1e12 * gpu.efficiency, None, None)
    tflops = _kernel_tflops(gpu, kernel, gpu.train_dtype, head_dim)
    assert tflops is not None  # pick_kernel checked
    causal = gpu.curve(f"{kernel}/causal") or gpu_rates.ATTENTION_CURVES[f"{kernel}/causal"]
    full = gpu.curve(f"{kernel}/full") or gpu_rates.ATTENTION_CURVES[f"{kernel}/full"]
    return AttentionRate(kernel, tflops * 1e12 * gpu_rates.FA_TO_MODEL, causal, full)


def call_fraction(curve: Curve | None, pair_heads: np.ndarray) -> np.ndarray:
    """Achieved fraction of the long-block rate for calls of ``pair_heads`` (any shape; 0 -> 1).

    Linear in log(pair-heads) between the curve's points; below the first point the call takes the
    first point's time (fraction proportional to the work), above the last the last fraction."""
    x = np.asarray(pair_heads, dtype=np.float64)
    if curve is None:
        return np.ones_like(x)
    xs, fs = _curve_arrays(curve)
    safe = np.maximum(x, 1.0)
    out = np.interp(np.log(safe), xs, fs)
    small = safe < curve[0][0]
    out = np.where(small, fs[0] * safe / curve[0][0], out)
    return np.where(x > 0, out, 1.0)


@lru_cache(maxsize=256)
def _curve_arrays(curve: Curve) -> tuple[np.ndarray, np.ndarray]:
    """log(pair-heads) and the fractions of a curve's points, as arrays (read-only: shared)."""
    xs = np.log(np.array([p[0] for p in curve]))
    fs = np.array([p[1] for p in curve])
    xs.flags.writeable = False
    fs.flags.writeable = False
    return xs, fs


class ClusterRates(NamedTuple):
    """Per layout rank: the attention rate (FLOP/s, model count) and, per distinct curve pair, a
    mask of the ranks that use it."""

    flops_per_s: np.ndarray
    groups: tuple[tuple[AttentionRate, np.ndarray], ...]
    kernels: tuple[str, ...]

    def fraction(self, pair_heads: np.ndarray, mask: str) -> np.ndarray:
        """Achieved fraction per call; ``pair_heads`` has the ranks on its last axis."""
        out = np.ones(np.shape(pair_heads))
        for rate, where in self.groups:
            curve = rate.causal if mask == "causal" else rate.full
            if curve is not None:
                out[..., where] = call_fraction(curve, np.asarray(pair_heads)[..., where])
        return out


def cluster_rates(
    cluster: Cluster, head_dim: int, forced: str = "auto", packed: bool = False
) -> ClusterRates:
    """:func:`attention_rate` of every device (once per GPU type), kept per cluster
    (``comm.cluster_arrays``' memo) and (head dim, kernel, packed): every ``estimate`` reads them,
    and building them took ~0.3 ms per call on 128 GPUs, ~4% of a 128-GPU ``plan()``'s CPU time
    (65 estimates). The arrays are shared read-only."""
    memo = cluster_arrays(cluster).memo.setdefault("cluster_rates", {})
    key = (head_dim, forced, packed)
    if key not in memo:
        memo[key] = _cluster_rates(cluster, head_dim, forced, packed)
    return memo[key]


def _cluster_rates(cluster: Cluster, head_dim: int, forced: str, packed: bool) -> ClusterRates:
    """``cluster_rates`` without the memo."""
    by_type: dict[GpuType, AttentionRate] = {}
    for d in cluster.devices:
        if d.gpu not in by_type:
            by_type[d.gpu] = attention_rate(d.gpu, head_dim, forced, packed)
    rates = [by_type[d.gpu] for d in cluster.devices]
    types = [d.gpu for d in cluster.devices]
    groups = tuple(
        (rate, np.array([t == g for t in types])) for g, rate in by_type.items() if rate.causal
    )
    flops = np.array([r.flops_per_s for r in rates])
    for array in (flops, *(where for _, where in groups)):
        array.flags.writeable = False
    return ClusterRates(flops_per_s=flops, groups=groups, kernels=tuple(r.kernel for r in rates))
