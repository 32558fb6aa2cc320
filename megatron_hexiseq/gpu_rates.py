"""Achieved throughput of the catalog's GPUs: matmul and each attention kernel, with their sources.

Data only (the cost model's ``costmodel.rates`` reads it through ``cluster.GpuType``). Every figure
is an *achieved* rate, not a datasheet peak; docs/specs.md ("Achieved rates") cites the source of
each one or says how it was derived from a measured neighbour.

Keys of the tables (and of a cluster spec's ``gpus.<T>.achieved_tflops``):

- ``matmul/<dtype>``: TFLOP/s of the transformer's linear work (QKV, projection, MLP, logits) in
  training, counted as ``costmodel.linear_flops_per_token`` counts it (matmul FLOPs only), so
  elementwise work, norms and framework time are folded in: a Megatron-level utilisation figure;
- ``<kernel>/<dtype>/<head dim>``: attention forward + backward TFLOP/s of one kernel on long
  causal blocks, in the FlashAttention papers' convention (the backward counts 2.5x the forward's
  ``4 d`` FLOPs per pair and head, so forward + backward = ``14 d``); the cost model, which counts
  ``12 d`` (Narayanan et al.), multiplies by 12/14 (:data:`FA_TO_MODEL`).

dtype is ``bf16`` or ``fp16``; head dims 64 and 128 (the cost model interpolates between them).
Kernels: ``flash`` (PyTorch's flash SDPA, FlashAttention-2 code), ``cudnn`` (PyTorch's cuDNN SDPA),
``efficient`` (PyTorch's memory-efficient SDPA, xFormers/CUTLASS code), ``flash-attn`` (the
``flash_attn`` 2.x package), ``flash-attn3`` (FlashAttention-3, Hopper only; listed for reference,
no runtime kernel calls it).

:data:`ATTENTION_CURVES`: how the achieved rate falls with the work of one kernel call, measured on
the H200 (``docs/measured/h200-2026-12-04``, ``bench/gpu_kernel_rates.py``): points ``(pair-heads
of the call, rate / the kernel's rate on a 32K causal block with 32 heads)``, per kernel and mask
(``causal``: a square block, ``full``: no mask), forward + backward, B = 1, bf16, head dim 128.
The small-call end holds the per-call overhead (launch and host time of the forward and backward:
about 0.13-0.16 ms for a 128-token block), so a call's time never falls below the first point's.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

FA_TO_MODEL = 12.0 / 14.0
"""FlashAttention-convention attention TFLOP/s -> the cost model's (12 d per pair and head)."""

KERNEL_NAMES = ("flash", "cudnn", "efficient", "flash-attn", "flash-attn3")
DTYPES = ("bf16", "fp16")
HEAD_DIMS = (64, 128)

# Rate of (dtype, head dim) relative to (bf16, 128) of the same kernel, measured on the H200 at 16K
# causal tokens (flash: 311 / 312 / 278 / 277; cudnn: 530 / 516 / 433 / 420; efficient: 142 / 143 /
# 106 / 106 TFLOP/s for bf16-128 / fp16-128 / bf16-64 / fp16-64). flash-attn uses flash's ratios
# (same FlashAttention-2 code); flash-attn3 uses cudnn's (the other Hopper wgmma kernel).
_FLASH = {("bf16", 128): 1.0, ("fp16", 128): 1.003, ("bf16", 64): 0.894, ("fp16", 64): 0.891}
_CUDNN = {("bf16", 128): 1.0, ("fp16", 128): 0.974, ("bf16", 64): 0.817, ("fp16", 64): 0.792}
_EFFICIENT = {("bf16", 128): 1.0, ("fp16", 128): 1.007, ("bf16", 64): 0.746, ("fp16", 64): 0.746}
DTYPE_DIM_RATIOS: Mapping[str, Mapping[tuple[str, int], float]] = MappingProxyType(
    {
        "flash": _FLASH,
        "cudnn": _CUDNN,
        "efficient": _EFFICIENT,
        "flash-attn": _FLASH,
        "flash-attn3": _CUDNN,
    }
)


def _attention(
    flash: float | None,
    cudnn: float | None,
    efficient: float | None,
    flash_attn: float | None = None,
    flash_attn3: float | None = None,
) -> dict[str, float]:
    """Per-kernel figures at bf16 / head dim 128, expanded to fp16 and head dim 64 by the ratios the
    H200 measured for the same kernel (:data:`DTYPE_DIM_RATIOS`); ``None``: the kernel does not run."""
    out: dict[str, float] = {}
    for kernel, base in zip(KERNEL_NAMES, (flash, cudnn, efficient, flash_attn, flash_attn3)):
        if base is None:
            continue
        for dtype in DTYPES:
            for dim in HEAD_DIMS:
                out[f"{kernel}/{dtype}/{dim}"] = round(
                    base * DTYPE_DIM_RATIOS[kernel][(dtype, dim)], 1
                )
    return out


def _matmul(bf16: float | None, fp16: float) -> dict[str, float]:
    out = {"matmul/fp16": fp16}
    if bf16 is not None:
        out["matmul/bf16"] = bf16
    return out


# H100 SXM: matmul from MosaicML's llm-foundry training benchmarks (scripts/train/benchmarking/
# README.md, table "H100 80GB BF16", row MPT-7B, 2048 tokens, 8 GPUs: MFU 46.44%, "Model TFLOP"
# 4.595096E+14) -> 459, the same stack and model size as its A100 row below, so their ratio is the
# one that matters (2.29); fp16 x 0.96 (the H200's measured fp16/bf16 GEMM ratio) -> 441.
# flash-attn: the FlashAttention-2 README's H100 figure (Dao-AILab/flash-attention,
# assets/flash2_h100_fwd_bwd_benchmark.png, panel (d): forward + backward, causal, head dim 128,
# 16K, H100 80GB SXM5) -> 328. cudnn and flash-attn3 from the FlashAttention-3 paper (Shah et al.
# 2024, H100 80GB SXM5, head dim 128, 16K): forward causal (Fig. 5d) cuDNN 539, FA3 616; backward
# (Fig. 6b) cuDNN 516, FA3 561 *without* causal mask (the paper plots no causal backward) ->
# 3.5 / (1/fwd + 2.5/bwd) = 522 / 576. The same mix for FlashAttention-2 (335 / 322) gives 326
# against its measured causal 328, and the H200 measured cuDNN at 530 (16K causal), so the mix is
# within ~2%. flash (PyTorch's copy of the FlashAttention-2 code) and efficient: the H200's measured
# 324 and 145 (no published H100 figure; the same GH100 chip, SM count and clock).
_H100 = _matmul(459, 441) | _attention(324, 522, 145, 328, 576)
# H200: the project's measurement (docs/measured/h200-2026-12-04): GEMMs on Megatron layer shapes
# 649-750 bf16 (median of four shapes 678), the same chip as the H100 SXM at the same clock, so the
# training-level matmul is the H100's 459 scaled by the measured GEMM parity (x 1.0); attention
# forward + backward on 32K causal blocks: flash 324, cudnn 546, efficient 145; flash-attn and
# flash-attn3 as on the H100.
_H200 = _matmul(459, 441) | _attention(324, 546, 145, 328, 576)
# A100 SXM (40 and 80 GB) and A800 (the same chip): matmul from llm-foundry's "A100 80GB" table
# (MPT-7B, 2048 tokens, 8 GPUs: MFU 64.23%, "Model TFLOP" 2.003836E+14) -> 200 (Megatron-LM at 1T
# parameters: 163, Narayanan et al. 2021). flash and flash-attn (FlashAttention-2 code) from the
# FlashAttention-2 README/paper figure (assets/flash2_a100_fwd_bwd_benchmark.png = Dao 2023, Fig. 4d:
# forward + backward, causal, head dim 128, 16K, A100 80GB SXM4) -> 189; efficient from the same
# panel's "xformers" bar (xFormers' CUTLASS kernel, the code of PyTorch's memory-efficient SDPA)
# -> 92; cudnn: no published A100 figure, taken equal to flash (cuDNN's Hopper lead comes from
# wgmma/TMA, which Ampere lacks).
_A100 = _matmul(200, 200) | _attention(189, 189, 92, 189)
# B200: matmul = the H100's 459 x 2.0 (NVIDIA's MLPerf Training v4.1 post: Blackwell 2x Hopper per
# GPU on GPT-3 175B pre-training; its 2.2x is Llama 2 70B LoRA fine-tuning) -> 918; fp16 x 0.96 ->
# 881. flash and flash-attn (FlashAttention-2 code: mma.sync, no Blackwell tensor-memory path) =
# the H100's x 148 / 132 SMs -> 363 / 368; efficient likewise -> 163; cudnn (Blackwell kernels) =
# the H100's 522 x the dense BF16 peak ratio 2250 / 989.4 -> 1187. None of the B200 attention
# figures is published; all are derived as stated.
_B200 = _matmul(918, 881) | _attention(363, 1187, 163, 368)
# H100 PCIe: the H100 SXM's figures x the peak ratio 756.5 / 989.4 (114 SMs, lower clock; no
# published training figures).
_H100_PCIE = {k: round(v * 756.5 / 989.4, 1) for k, v in _H100.items()}
# L40S (Ada, sm_89): no published training or attention figures; derived from the A100 by fraction
# of peak x 362: matmul 200 / 312 -> 232; flash 189 / 312 -> 219; cudnn = flash (as on the A100);
# efficient 92 / 312 -> 107.
_L40S = _matmul(232, 232) | _attention(219, 219, 107, 219)
# V100 (no BF16, no flash: compute capability 7.0): matmul fp16 from Megatron-LM (Shoeybi et al.
# 2019: 39 TFLOP/s on one V100, 30% of peak, for the 1.2B baseline) -> 39; efficient fp16 = the
# A100's efficient fraction of peak (92 / 312) x 125 -> 37 (head dim 64: x 0.746 -> 27.6).
_V100 = _matmul(None, 39) | {"efficient/fp16/128": 37.0, "efficient/fp16/64": 27.6}

ACHIEVED_TFLOPS: Mapping[str, Mapping[str, float]] = MappingProxyType(
    {
        "H100-SXM-80GB": _H100,
        "H100-PCIe-80GB": _H100_PCIE,
        "H200-141GB": _H200,
        "B200-192GB": _B200,
        "A100-SXM-80GB": _A100,
        "A100-SXM-40GB": _A100,
        "A800-80GB": _A100,
        "L40S-48GB": _L40S,
        "V100-SXM-32GB": _V100,
    }
)

COMPUTE_CAPABILITY: Mapping[str, float] = MappingProxyType(
    {
        "H100-SXM-80GB": 9.0,
        "H100-PCIe-80GB": 9.0,
        "H200-141GB": 9.0,
        "B200-192GB": 10.0,
        "A100-SXM-80GB": 8.0,
        "A100-SXM-40GB": 8.0,
        "A800-80GB": 8.0,
        "L40S-48GB": 8.9,
        "V100-SXM-32GB": 7.0,
    }
)

# (pair-heads of one call, achieved / the kernel's 32K causal rate); H200, bf16, D = 128, H = 32,
# B = 1, S = T = 128 .. 32768 tokens (bench/gpu_kernel_rates.py, docs/measured/h200-2026-12-04).
Curve = tuple[tuple[float, float], ...]
_CAUSAL_X = (264192, 1052672, 4202496, 16793600, 67141632, 268500992, 1073872896, 4295229440,
             17180393472)  # fmt: skip
_FULL_X = (524288, 2097152, 8388608, 33554432, 134217728, 536870912, 2147483648, 8589934592,
           34359738368)  # fmt: skip
_MEASURED = {
    "flash/causal": (0.0089, 0.0333, 0.1341, 0.3364, 0.5432, 0.7491, 0.8948, 0.9608, 1.0),
    "flash/full": (0.0302, 0.0752, 0.3945, 0.687, 0.8342, 0.9252, 0.9686, 0.9876, 1.0052),
    "cudnn/causal": (0.0109, 0.0451, 0.1538, 0.3561, 0.6059, 0.8459, 0.905, 0.9693, 1.0),
    "cudnn/full": (0.0223, 0.0879, 0.3161, 0.6475, 0.9177, 0.9573, 0.9968, 1.0092, 1.0075),
    "efficient/causal": (0.0462, 0.1283, 0.3552, 0.4965, 0.6921, 0.8381, 0.9254, 0.9799, 1.0),
    "efficient/full": (0.0908, 0.2623, 0.695, 0.8587, 0.9448, 0.9919, 1.0129, 1.0221, 1.0276),
}
_ALIAS = {
    "flash-attn": "flash",
    "flash-attn3": "cudnn",
}  # same code / the other Hopper wgmma kernel
ATTENTION_CURVES: Mapping[str, Curve] = MappingProxyType(
    {
        f"{kernel}/{mask}": tuple(
            zip(
                _CAUSAL_X if mask == "causal" else _FULL_X,
                _MEASURED[f"{_ALIAS.get(kernel, kernel)}/{mask}"],
            )
        )
        for kernel in KERNEL_NAMES
        for mask in ("causal", "full")
    }
)
