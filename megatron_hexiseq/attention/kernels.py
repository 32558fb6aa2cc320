"""Block attention kernels with log-sum-exp in and out, chosen by device and dtype.

Legend: S = query tokens of the block, T = key tokens of the block, B = micro-batch, H = query
heads of this rank, G = K/V heads of this rank, D = head dim. ``kv_of_head_H[h]`` is the index (into
the G K/V heads) that query head h reads (GQA/MQA; ``None`` when query head h reads K/V head h).

The block schedule (``peers.py``) only ever asks for two kinds of block, so no mask exists here:
- *causal*: queries and keys are the same position-sorted tokens (a square block; key j is visible
  to query i iff j <= i). Top-left and bottom-right causal alignment coincide on a square block.
- *full*: every key is visible to every query (no mask; any S and T, T >= 1).

Forward returns the block's ``out [S, B, H, D]`` (the kernel's dtype: the input dtype for the fused
kernels, the accumulation dtype for the reference) and ``lse [S, B, H]`` (float32 or wider). The
backward is a recompute with the FINAL merged ``out`` and ``lse`` (``dS = P * (dP - rowsum(dO * O))``,
``P = exp(S - LSE_final)``), as ring-flash-attention does with flash-attn; it returns ``dq [S, B, H, D]``,
``dk, dv [T, B, G, D]`` in the accumulation dtype.

Kernels (``Kernel``; ``resolve_kernel`` turns ``auto`` into a concrete one; calls in ``kernel_ops.py``
and ``flash_attn_ops.py``):
- ``reference``: matmul + softmax in pure PyTorch in the accumulation dtype, any device: the oracle.
- ``cudnn``: PyTorch's cuDNN attention (``aten._scaled_dot_product_cudnn_attention``); bf16/fp16,
  head dim a multiple of 8 up to 128 (the limit torch 2.13 applies to the backward), cuDNN >= 9.
- ``flash``: PyTorch's CUDA flash kernel; bf16/fp16, head dim a multiple of 8 up to 256, compute
  capability 8.0-12.1, and not head dims 193-224 on sm 8.6/8.9/12.x (its backward refuses them).
- ``efficient``: PyTorch's CUDA memory-efficient kernel; fp32/bf16/fp16, where flash does not apply.
- ``cpu-flash``: PyTorch's CPU flash kernel; any floating dtype on CPU.
- ``flash-attn``: the optional ``flash_attn`` package 2.5-2.8; chosen only explicitly.
- ``auto``: ``cpu-flash`` on CPU; on CUDA ``cudnn`` on compute capability 9.x with cuDNN > 9.15
  (faster than ``flash`` at every block size measured on an H200: 546 vs 324 TFLOP/s fwd+bwd at 32K
  tokens, 195 vs 109 at 1K; the cuDNN version torch itself requires before preferring it), else
  ``flash`` where it applies, else ``efficient``; fp64 on CUDA takes ``reference``; deterministic
  mode (``torch.use_deterministic_algorithms``) never takes ``cudnn``. ``check_kernel`` (run at
  start-up by ``build_runtime``) proves the choice on the real device and dtype.
All fused kernels are O(S * D) in memory: no score tensor.

GQA without copies of K/V. K/V stay at their G heads. ``kv_map`` sorts the query heads by the K/V
head they read (a no-op for every layout the planner makes: a rank's heads are ascending) and cuts
them into *segments*: a contiguous range of K/V heads, each read by the same number r of query heads
that follow each other. The kernels with native GQA (``cudnn``, ``flash``, ``flash-attn``,
``cpu-flash``) take one segment per call as views (query head i of a segment reads K/V head i // r);
the others (``efficient`` refuses G < H, and the reference) make r calls of one query head per K/V
head (a strided view of the segment's queries) and add the r dK/dV in float32. A rank's whole head
range aligned to the query groups is one segment (one call); an unaligned range [a, b) is at most 3.
The backward keeps nothing at H heads but dq; dK/dV are accumulated in float32 at G heads.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from typing import NamedTuple

import torch
from torch import Tensor

from megatron_hexiseq import kernel_rules
from megatron_hexiseq.attention import flash_attn_ops, kernel_ops
from megatron_hexiseq.attention.kernel_ops import acc_dtype
from megatron_hexiseq.errors import HexiSeqError

__all__ = [
    "KERNELS",
    "KVMap",
    "Kernel",
    "acc_dtype",
    "block_backward",
    "block_forward",
    "cudnn_applies",
    "efficient_applies",
    "flash_applies",
    "head_index",
    "kv_map",
    "merge_into",
    "parse_kernel",
    "resolve_kernel",
]


class Kernel(str, Enum):  # noqa: UP042 (StrEnum changes str() of a member)
    """Block kernels; the value is the ``--hexiseq-kernel`` name."""

    AUTO = "auto"
    REFERENCE = "reference"
    FLASH = "flash"
    EFFICIENT = "efficient"
    CPU_FLASH = "cpu-flash"
    FLASH_ATTN = "flash-attn"
    CUDNN = "cudnn"


KERNELS = tuple(k.value for k in Kernel)
_ALIASES = {"sdpa": Kernel.AUTO}  # the name of the CPU fused kernel before the CUDA kernels existed
_CUDA_KERNELS = (Kernel.FLASH, Kernel.EFFICIENT, Kernel.FLASH_ATTN, Kernel.CUDNN)
CUDNN_MAX_HEAD_DIM = kernel_rules.CUDNN_MAX_HEAD_DIM
CUDNN_PREFERRED_FROM = kernel_rules.CUDNN_PREFERRED_FROM


def parse_kernel(name: str | Kernel) -> Kernel:
    """``"flash"`` -> ``Kernel.FLASH``; unknown names are a one-line error."""
    if isinstance(name, Kernel):
        return name
    if name in _ALIASES:
        return _ALIASES[name]
    try:
        return Kernel(name)
    except ValueError:
        raise HexiSeqError(
            f"unknown attention kernel {name!r}; choose one of {', '.join(KERNELS)}"
        ) from None


# ---- applicability (torch 2.13, aten/src/ATen/native/transformers/cuda/sdp_utils.cpp) ---------
def _capability(device: torch.device) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device)


def _cudnn_version() -> int:
    return (torch.backends.cudnn.version() or 0) if torch.backends.cudnn.is_available() else 0


def _half(dtype: torch.dtype) -> bool:
    return dtype in (torch.float16, torch.bfloat16)


_SHORT = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


def _short(dtype: torch.dtype) -> str:
    return _SHORT.get(dtype, str(dtype).removeprefix("torch."))


def flash_applies(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    """Would PyTorch's CUDA flash kernel take these inputs for training (fwd + bwd)?"""
    if device.type != "cuda":
        return False
    return kernel_rules.flash_takes(_capability(device), _short(dtype), head_dim)


def cudnn_applies(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    """Would PyTorch's cuDNN attention take these inputs for training (conservative)?"""
    if device.type != "cuda":
        return False
    return kernel_rules.cudnn_takes(_capability(device), _short(dtype), head_dim, _cudnn_version())


def efficient_applies(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    """Would PyTorch's memory-efficient kernel take these inputs (its GEMM alignment)?"""
    return device.type == "cuda" and kernel_rules.efficient_takes(_short(dtype), head_dim)


def _cudnn_preferred(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    return kernel_rules.cudnn_preferred(
        _capability(device),
        _short(dtype),
        head_dim,
        _cudnn_version(),
        torch.are_deterministic_algorithms_enabled(),
    )


def resolve_kernel(
    kernel: str | Kernel, *, device: torch.device, dtype: torch.dtype, head_dim: int
) -> Kernel:
    """A concrete kernel for this device, dtype and head dim (``auto`` chooses; others are checked)."""
    k = parse_kernel(kernel)
    if k is Kernel.AUTO:
        if device.type == "cpu":
            return Kernel.CPU_FLASH
        if device.type == "cuda" and dtype != torch.float64:
            if _cudnn_preferred(device, dtype, head_dim):
                return Kernel.CUDNN
            return Kernel.FLASH if flash_applies(device, dtype, head_dim) else Kernel.EFFICIENT
        return Kernel.REFERENCE
    if k is Kernel.CPU_FLASH and device.type != "cpu":
        raise HexiSeqError(
            f"attention kernel 'cpu-flash' runs on CPU tensors, got {device.type}; use --hexiseq-kernel auto"
        )
    if k in _CUDA_KERNELS and device.type != "cuda":
        raise HexiSeqError(
            f"attention kernel '{k.value}' runs on CUDA tensors, got {device.type}; "
            "use --hexiseq-kernel auto"
        )
    got = f"(got {dtype}, head dim {head_dim})"
    if k is Kernel.FLASH and not flash_applies(device, dtype, head_dim):
        raise HexiSeqError(
            "attention kernel 'flash' needs bf16/fp16, head dim a multiple of 8 up to 256 (not "
            f"193-224 on sm 8.6/8.9/12.x) and compute capability 8.0-12.1 {got}; "
            "use 'efficient' or 'auto'"
        )
    if k is Kernel.CUDNN and not cudnn_applies(device, dtype, head_dim):
        raise HexiSeqError(
            f"attention kernel 'cudnn' needs bf16/fp16, head dim a multiple of 8 up to "
            f"{CUDNN_MAX_HEAD_DIM}, cuDNN >= 9 and compute capability 8.0-12.1 {got}; use 'auto'"
        )
    if k is Kernel.FLASH_ATTN:
        if not _half(dtype) or head_dim % 8 or head_dim > 256:
            raise HexiSeqError(
                f"attention kernel 'flash-attn' needs bf16/fp16 and head dim a multiple of 8 up to "
                f"256 {got}; use 'auto'"
            )
        flash_attn_ops.load_api()  # missing package or unsupported version: one line
    return k


# ---- query heads grouped by the K/V head they read -----------------------------------------------
class HeadSegment(NamedTuple):
    """Query heads ``[q_lo, q_hi)`` (in K/V-head order) reading K/V heads ``[kv_lo, kv_hi)``, the
    same number ``ratio`` of query heads per K/V head: query head q_lo + i reads kv_lo + i // ratio."""

    q_lo: int
    q_hi: int
    kv_lo: int
    kv_hi: int

    @property
    def ratio(self) -> int:
        return (self.q_hi - self.q_lo) // (self.kv_hi - self.kv_lo)


@dataclass(frozen=True)
class KVMap:
    """Which K/V head each query head reads, cut into ``HeadSegment``s (see the module docstring).

    ``order``: the query heads sorted by K/V head (stable), ``None`` when they already are.
    """

    of_head: tuple[int, ...]
    num_kv: int
    order: tuple[int, ...] | None
    segments: tuple[HeadSegment, ...]

    @property
    def num_heads(self) -> int:
        return len(self.of_head)

    @property
    def inverse(self) -> tuple[int, ...] | None:
        """The permutation back from K/V-head order to the query heads' order (None: no-op)."""
        return None if self.order is None else _inverse(self.order)

    @property
    def single(self) -> bool:
        """One segment over every query head and every K/V head, in order: one kernel call."""
        return self.order is None and self.segments == (
            HeadSegment(0, self.num_heads, 0, self.num_kv),
        )


@functools.lru_cache(maxsize=256)
def kv_map(of_head: tuple[int, ...], num_kv: int) -> KVMap:
    """The ``KVMap`` of ``of_head`` (query head -> K/V head index in ``[0, num_kv)``)."""
    if any(not 0 <= g < num_kv for g in of_head):
        raise ValueError(f"K/V head indices {of_head} outside [0, {num_kv})")
    order = tuple(sorted(range(len(of_head)), key=lambda h: of_head[h]))
    sorted_kv = [of_head[h] for h in order]
    runs: list[list[int]] = []  # [kv, count] in order
    for g in sorted_kv:
        if runs and runs[-1][0] == g:
            runs[-1][1] += 1
        else:
            runs.append([g, 1])
    segments: list[HeadSegment] = []
    q = 0
    for g, count in runs:
        last = segments[-1] if segments else None
        if last is not None and last.kv_hi == g and last.ratio == count:
            segments[-1] = HeadSegment(last.q_lo, q + count, last.kv_lo, g + 1)
        else:
            segments.append(HeadSegment(q, q + count, g, g + 1))
        q += count
    identity = order == tuple(range(len(of_head)))
    return KVMap(tuple(of_head), num_kv, None if identity else order, tuple(segments))


_TENSOR_MAPS: dict[int, tuple[weakref.ref, KVMap]] = {}
_INDEX: dict[tuple[tuple[int, ...], torch.device], Tensor] = {}


def _map_of(kv_of_head_H: Tensor | KVMap | None, num_heads: int, num_kv: int) -> KVMap:
    """A ``KVMap`` from what the caller passed. An index tensor is read on the host once per tensor
    object (callers pass the same cached tensor every call: one device-to-host copy per layout)."""
    if isinstance(kv_of_head_H, KVMap):
        return kv_of_head_H
    if kv_of_head_H is None:
        if num_heads != num_kv:
            raise AssertionError(f"kv_of_head_H=None needs H == G, got {num_heads} and {num_kv}")
        return kv_map(tuple(range(num_heads)), num_kv)
    hit = _TENSOR_MAPS.get(id(kv_of_head_H))
    if hit is not None and hit[0]() is kv_of_head_H and hit[1].num_kv == num_kv:
        return hit[1]
    m = kv_map(tuple(int(g) for g in kv_of_head_H.tolist()), num_kv)
    key = id(kv_of_head_H)
    _TENSOR_MAPS[key] = (weakref.ref(kv_of_head_H, lambda _: _TENSOR_MAPS.pop(key, None)), m)
    return m


def head_index(ix: tuple[int, ...], device: torch.device) -> Tensor:
    """``torch.tensor(ix)`` on ``device``, created once per (ix, device) (a head permutation: the
    hot path copies nothing from the host after the first call)."""
    key = (ix, device)
    if key not in _INDEX:
        _INDEX[key] = torch.tensor(ix, dtype=torch.long, device=device)
    return _INDEX[key]


def _inverse(order: tuple[int, ...]) -> tuple[int, ...]:
    inv = [0] * len(order)
    for i, h in enumerate(order):
        inv[h] = i
    return tuple(inv)


# ---- dispatch ---------------------------------------------------------------------------------
Forward = Callable[[Tensor, Tensor, Tensor, bool, float], tuple[Tensor, Tensor]]
Backward = Callable[..., tuple[Tensor, Tensor, Tensor]]

_reference_forward = kernel_ops.reference_forward  # the oracle, also under its former name
_reference_backward = kernel_ops.reference_backward
_FORWARD: dict[Kernel, Forward] = {
    Kernel.REFERENCE: kernel_ops.reference_forward,
    Kernel.CPU_FLASH: kernel_ops.cpu_forward,
    Kernel.FLASH: kernel_ops.flash_forward,
    Kernel.EFFICIENT: kernel_ops.efficient_forward,
    Kernel.CUDNN: kernel_ops.cudnn_forward,
    Kernel.FLASH_ATTN: flash_attn_ops.flash_attn_forward,
}
_BACKWARD: dict[Kernel, Backward] = {
    Kernel.REFERENCE: kernel_ops.reference_backward,
    Kernel.CPU_FLASH: kernel_ops.cpu_backward,
    Kernel.FLASH: kernel_ops.flash_backward,
    Kernel.EFFICIENT: kernel_ops.efficient_backward,
    Kernel.CUDNN: kernel_ops.cudnn_backward,
    Kernel.FLASH_ATTN: flash_attn_ops.flash_attn_backward,
}
NATIVE_GQA = frozenset({Kernel.CPU_FLASH, Kernel.FLASH, Kernel.CUDNN, Kernel.FLASH_ATTN})


def _calls(seg: HeadSegment, native: bool) -> list[tuple[slice, slice]]:
    """(query heads, K/V heads) of each kernel call of a segment, as slices of the sorted heads."""
    kv = slice(seg.kv_lo, seg.kv_hi)
    r = seg.ratio
    if native or r == 1:
        return [(slice(seg.q_lo, seg.q_hi), kv)]
    return [(slice(seg.q_lo + j, seg.q_hi, r), kv) for j in range(r)]  # one query head per K/V head


def block_forward(
    q_SBHD: Tensor,
    k_TBGD: Tensor,
    v_TBGD: Tensor,
    *,
    causal: bool,
    kv_of_head_H: Tensor | KVMap | None,
    scale: float,
    kernel: Kernel,
) -> tuple[Tensor, Tensor]:
    """Attention of one (query block, key block) pair: ``out [S, B, H, D]``, ``lse [S, B, H]`` (see top).

    ``kv_of_head_H``: an index tensor ``[H]``, a ``KVMap`` (no device-to-host read), or ``None``."""
    if causal and q_SBHD.shape[0] != k_TBGD.shape[0]:
        raise AssertionError("a causal block pairs the same tokens as queries and keys")
    S, B, H, D = q_SBHD.shape
    m = _map_of(kv_of_head_H, H, k_TBGD.shape[2])
    fwd, native = _FORWARD[kernel], kernel in NATIVE_GQA
    q_BHSD = q_SBHD.permute(1, 2, 0, 3)
    k_BGTD, v_BGTD = k_TBGD.permute(1, 2, 0, 3), v_TBGD.permute(1, 2, 0, 3)
    if m.single and (native or H == m.num_kv):
        out_BHSD, lse_BHS = fwd(q_BHSD, k_BGTD, v_BGTD, causal, scale)
        return out_BHSD.permute(2, 0, 1, 3), lse_BHS.permute(2, 0, 1)
    if m.order is not None:
        q_BHSD = q_BHSD.index_select(1, head_index(m.order, q_SBHD.device))
    out_SBHD: Tensor | None = None
    lse_SBH: Tensor | None = None
    for seg in m.segments:
        for qh, kvh in _calls(seg, native):
            o_BHSD, l_BHS = fwd(q_BHSD[:, qh], k_BGTD[:, kvh], v_BGTD[:, kvh], causal, scale)
            if out_SBHD is None or lse_SBH is None:
                out_SBHD = o_BHSD.new_empty(S, B, H, D)
                lse_SBH = l_BHS.new_empty(S, B, H)
            out_SBHD[:, :, qh] = o_BHSD.permute(2, 0, 1, 3)
            lse_SBH[:, :, qh] = l_BHS.permute(2, 0, 1)
    assert out_SBHD is not None and lse_SBH is not None  # a map has at least one segment
    if m.order is not None:
        inv = head_index(_inverse(m.order), q_SBHD.device)
        out_SBHD, lse_SBH = out_SBHD.index_select(2, inv), lse_SBH.index_select(2, inv)
    return out_SBHD, lse_SBH


def block_backward(
    dout_SBHD: Tensor,
    q_SBHD: Tensor,
    k_TBGD: Tensor,
    v_TBGD: Tensor,
    out_SBHD: Tensor,
    lse_SBH: Tensor,
    *,
    causal: bool,
    kv_of_head_H: Tensor | KVMap | None,
    scale: float,
    kernel: Kernel,
) -> tuple[Tensor, Tensor, Tensor]:
    """Recompute backward of one block with the FINAL ``out`` (input dtype for the fused kernels)
    and ``lse``: ``dq [S, B, H, D]``, ``dk, dv [T, B, G, D]`` in the accumulation dtype.

    Memory beyond the results: one call's dq/dk/dv in the kernel's dtype (G heads for K/V). For
    ``cudnn`` the query-side tensors are made [S, B, H, D]-contiguous (a no-op for the runtime's
    tensors) so q, out and dout reach it with the same strides (cuDNN caches its plan by q's
    strides)."""
    acc = acc_dtype(q_SBHD.dtype)
    S, B, H, D = q_SBHD.shape
    T, _, G, _ = k_TBGD.shape
    m = _map_of(kv_of_head_H, H, G)
    bwd, native = _BACKWARD[kernel], kernel in NATIVE_GQA
    side = [dout_SBHD, q_SBHD, out_SBHD]
    if kernel is Kernel.CUDNN:  # its plan cache keys on q's strides only: give all three q's layout
        side = [x.contiguous() for x in side]
    lse_BHS = lse_SBH.permute(1, 2, 0).to(acc)
    do_BHSD, q_BHSD, o_BHSD = (x.permute(1, 2, 0, 3) for x in side)
    k_BGTD, v_BGTD = k_TBGD.permute(1, 2, 0, 3), v_TBGD.permute(1, 2, 0, 3)
    if m.single and (native or H == G):
        dq, dk, dv = bwd(do_BHSD, q_BHSD, k_BGTD, v_BGTD, o_BHSD, lse_BHS, causal, scale)
        return tuple(x.permute(2, 0, 1, 3).to(acc) for x in (dq, dk, dv))  # type: ignore[return-value]
    if m.order is not None:
        ix = head_index(m.order, q_SBHD.device)
        do_BHSD, q_BHSD, o_BHSD = (x.index_select(1, ix) for x in (do_BHSD, q_BHSD, o_BHSD))
        lse_BHS = lse_BHS.index_select(1, ix)
    dq_SBHD = q_SBHD.new_empty(S, B, H, D, dtype=acc)
    dk_TBGD = k_TBGD.new_zeros(T, B, G, D, dtype=acc)  # K/V heads no query head reads stay 0
    dv_TBGD = v_TBGD.new_zeros(T, B, G, D, dtype=acc)
    for seg in m.segments:
        for qh, kvh in _calls(seg, native):
            dq, dk, dv = bwd(
                do_BHSD[:, qh],
                q_BHSD[:, qh],
                k_BGTD[:, kvh],
                v_BGTD[:, kvh],
                o_BHSD[:, qh],
                lse_BHS[:, qh],
                causal,
                scale,
            )
            dq_SBHD[:, :, qh] = dq.permute(2, 0, 1, 3)
            dk_TBGD[:, :, kvh] += dk.permute(2, 0, 1, 3)
            dv_TBGD[:, :, kvh] += dv.permute(2, 0, 1, 3)
    if m.order is not None:
        dq_SBHD = dq_SBHD.index_select(2, head_index(_inverse(m.order), q_SBHD.device))
    return dq_SBHD, dk_TBGD, dv_TBGD


# ---- merge ------------------------------------------------------------------------------------
def merge_into(
    out_SBHD: Tensor, lse_SBH: Tensor, blk_out_SBHD: Tensor, blk_lse_SBH: Tensor
) -> tuple[Tensor, Tensor]:
    """Merge a block's (out, lse) into the running (out, lse), both with finite LSE (every block the
    schedule computes has at least one visible key per row). Returns the new (out, lse) in the
    running tensors' dtype."""
    new_lse = torch.logaddexp(lse_SBH, blk_lse_SBH.to(lse_SBH.dtype))
    out = (
        out_SBHD * torch.exp(lse_SBH - new_lse)[..., None]
        + blk_out_SBHD.to(out_SBHD.dtype)
        * torch.exp(blk_lse_SBH.to(lse_SBH.dtype) - new_lse)[..., None]
    )
    return out, new_lse
