"""Document-masked blocks: the windows of ``documents.py`` run through the block kernels.

Legend: S = query rows (my group sequence), T = keys of the block (S for the local block), B =
micro-batch, H / G = my query / K/V heads, D = head dim, N / M = packed query / key rows of a
variable-length call.

Two ways to run a block's windows (``peers.Window``: rows x key range x sample):
- **loop** (CPU, and every kernel but ``flash``): one ``kernels.block_forward`` / ``block_backward``
  call per window on views ``q[row_lo:row_hi, sample]``, ``k[key_lo:key_hi, sample]``.
- **varlen** (``flash`` on CUDA): one ``aten._flash_attention_forward`` / ``_backward`` call per
  block on packed tensors: ``q [S, B, H, D] -> [N, H, D]`` and ``k/v [T, B, G, D] -> [M, G, D]``
  gathered by index (each (window, sample) one sequence; windows of the same keys overlap, so K/V
  rows may repeat), ``cu_seqlens_q/k`` int32, ``max_q/max_k`` Python ints from the host schedule
  (no ``.item()``). The result is scattered back with ``index_copy_`` (local block: the windows
  partition the rows) or merged by LSE (received block: disjoint rows); gradients return with
  ``index_add_``. K/V reach the kernel with G heads when my query heads read them regularly (head i
  reads K/V head ``i // (H / G)``, the kernel's native GQA), else expanded to H heads.
  The index tensors are built on the host once per (schedule, block, B, device) and copied to the
  device in one transfer from pinned memory, without blocking (no host sync inside the sub-ring
  loop); the schedule lives for one micro-batch, so later layers reuse them.

Forward returns / merges ``out [S, B, H, D]`` and ``lse [S, B, H]`` in the accumulation dtype;
backward (recompute with the final out/LSE) returns gradients in the accumulation dtype.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import Tensor

from megatron_hexiseq.attention.kernels import (
    Kernel,
    KVMap,
    acc_dtype,
    block_backward,
    block_forward,
    merge_into,
)
from megatron_hexiseq.attention.peers import Window


class WindowKernel(NamedTuple):
    """How to run windows: the kernel, the scale, the GQA map, and the packed-index cache."""

    kernel: Kernel
    scale: float
    kv_of_head_H: Tensor | None  # None: query head i reads K/V head i
    native_gqa: bool  # query head i reads K/V head i // (H / G): the varlen kernel maps it itself
    cache: dict  # (block key, B, device) -> _Packed; one schedule = one micro-batch
    kv_map: KVMap | None = (
        None  # the same map on the host, for block_forward (None: read the tensor)
    )

    @property
    def block_map(self) -> KVMap | Tensor | None:
        """What ``block_forward``/``block_backward`` take as ``kv_of_head_H`` (no device read)."""
        return self.kv_map if self.kv_map is not None else self.kv_of_head_H


class _Packed(NamedTuple):
    q_idx: Tensor  # [N] int64: row * B + sample of each packed query row
    k_idx: Tensor  # [M] int64: key * B + sample of each packed key row
    cu_q: Tensor  # [n + 1] int32
    cu_k: Tensor  # [n + 1] int32
    max_q: int
    max_k: int


def _varlen_ops() -> tuple[Callable[..., Any], Callable[..., Any]]:
    """PyTorch's flash-attention 2 variable-length forward and backward (torch 2.11+ signatures)."""
    return torch.ops.aten._flash_attention_forward, torch.ops.aten._flash_attention_backward


def uses_varlen(kernel: Kernel) -> bool:
    """Whether document windows run as one variable-length flash call per block. ``cudnn`` goes
    there too: wherever it applies flash does (bf16/fp16, head dim <= 128, Hopper), and cuDNN
    builds an execution plan per distinct call shape, which one call per window would rebuild for
    every document."""
    return kernel in (Kernel.FLASH, Kernel.CUDNN)


def _samples(w: Window, B: int) -> range:
    return range(B) if w.sample is None else range(w.sample, w.sample + 1)


def _packed(
    wk: WindowKernel, windows: tuple[Window, ...], key: object, B: int, device: torch.device
) -> _Packed:
    ck = (key, B, device)
    if ck in wk.cache:
        return wk.cache[ck]
    q_parts, k_parts, lq, lk = [], [], [0], [0]
    for w in windows:
        for b in _samples(w, B):
            q_parts.append(torch.arange(w.row_lo, w.row_hi) * B + b)
            k_parts.append(torch.arange(w.key_lo, w.key_hi) * B + b)
            lq.append(w.row_hi - w.row_lo)
            lk.append(w.key_hi - w.key_lo)
    q_idx, k_idx = torch.cat(q_parts), torch.cat(k_parts)
    cu_q, cu_k = torch.tensor(lq).cumsum(0), torch.tensor(lk).cumsum(0)
    ints = torch.cat([q_idx, k_idx, cu_q, cu_k])
    if device.type == "cuda":
        ints = ints.pin_memory()  # the copy below then does not wait for the device
    ints = ints.to(device, non_blocking=True)  # one host-to-device copy, no host sync
    N, M, n = len(q_idx), len(k_idx), len(lq)
    packed = _Packed(
        q_idx=ints[:N],
        k_idx=ints[N : N + M],
        cu_q=ints[N + M : N + M + n].to(torch.int32),
        cu_k=ints[N + M + n :].to(torch.int32),
        max_q=max(lq),
        max_k=max(lk),
    )
    wk.cache[ck] = packed
    return packed


def _pack_kv(wk: WindowKernel, x_TBGD: Tensor, p: _Packed) -> Tensor:
    """[T, B, G, D] -> [M, G, D] (or [M, H, D] where the GQA map is irregular)."""
    T, B, G, D = x_TBGD.shape
    x_MGD = x_TBGD.reshape(T * B, G, D).index_select(0, p.k_idx)
    if wk.kv_of_head_H is not None and not wk.native_gqa:
        x_MGD = x_MGD.index_select(1, wk.kv_of_head_H)
    return x_MGD


def _varlen_forward(
    wk: WindowKernel, p: _Packed, q_SBHD: Tensor, k_TBGD: Tensor, v_TBGD: Tensor, causal: bool
) -> tuple[Tensor, Tensor]:
    """Packed ``out [N, H, D]`` (input dtype) and ``lse [N, H]`` (float32)."""
    S, B, H, D = q_SBHD.shape
    q_NHD = q_SBHD.reshape(S * B, H, D).index_select(0, p.q_idx)
    fwd, _ = _varlen_ops()
    out_NHD, lse_HN, *_ = fwd(
        q_NHD,
        _pack_kv(wk, k_TBGD, p),
        _pack_kv(wk, v_TBGD, p),
        p.cu_q,
        p.cu_k,
        p.max_q,
        p.max_k,
        0.0,
        causal,
        False,
        scale=wk.scale,
    )
    return out_NHD, lse_HN.t()


def _varlen_backward(
    wk: WindowKernel,
    p: _Packed,
    dout_SBHD: Tensor,
    q_SBHD: Tensor,
    k_TBGD: Tensor,
    v_TBGD: Tensor,
    out_SBHD: Tensor,
    lse_SBH: Tensor,
    causal: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    """Packed ``dq [N, H, D]``, ``dk, dv [M, G, D]`` in the accumulation dtype."""
    S, B, H, D = q_SBHD.shape
    G = k_TBGD.shape[2]
    acc, dt = acc_dtype(q_SBHD.dtype), q_SBHD.dtype

    def rows(x: Tensor) -> Tensor:
        return x.reshape(S * B, *x.shape[2:]).index_select(0, p.q_idx)

    _, bwd = _varlen_ops()
    # no dropout: the RNG state is not read
    rng = torch.empty(2, dtype=torch.int64, device=q_SBHD.device)
    dq_NHD, dk_MxD, dv_MxD = bwd(
        rows(dout_SBHD).to(dt),
        rows(q_SBHD),
        _pack_kv(wk, k_TBGD, p),
        _pack_kv(wk, v_TBGD, p),
        rows(out_SBHD).to(dt),
        rows(lse_SBH).t().to(acc).contiguous(),  # float32 for bf16/fp16
        p.cu_q,
        p.cu_k,
        p.max_q,
        p.max_k,
        0.0,
        causal,
        rng,
        rng[:1],
        scale=wk.scale,
    )
    dk_MGD, dv_MGD = dk_MxD.to(acc), dv_MxD.to(acc)
    if wk.kv_of_head_H is not None and not wk.native_gqa:  # [M, H, D] -> [M, G, D]
        M = dk_MGD.shape[0]
        dk_MGD = dk_MGD.new_zeros(M, G, D).index_add_(1, wk.kv_of_head_H, dk_MGD)
        dv_MGD = dv_MGD.new_zeros(M, G, D).index_add_(1, wk.kv_of_head_H, dv_MGD)
    return dq_NHD.to(acc), dk_MGD, dv_MGD


def _view(x: Tensor, w: Window, lo: int, hi: int) -> Tensor:
    return x[lo:hi] if w.sample is None else x[lo:hi, w.sample : w.sample + 1]


def local_forward(
    wk: WindowKernel, windows: tuple[Window, ...], q_SBHD: Tensor, k_SBGD: Tensor, v_SBGD: Tensor
) -> tuple[Tensor, Tensor]:
    """The local block (square causal windows partitioning the rows): ``out [S, B, H, D]``,
    ``lse [S, B, H]``, accumulation dtype."""
    S, B, H, D = q_SBHD.shape
    acc = acc_dtype(q_SBHD.dtype)
    out_SBHD = q_SBHD.new_zeros(S, B, H, D, dtype=acc)
    lse_SBH = q_SBHD.new_zeros(S, B, H, dtype=acc)
    if uses_varlen(wk.kernel) and windows:
        p = _packed(wk, windows, "local", B, q_SBHD.device)
        o_NHD, l_NH = _varlen_forward(wk, p, q_SBHD, k_SBGD, v_SBGD, causal=True)
        out_SBHD.view(S * B, H, D).index_copy_(0, p.q_idx, o_NHD.to(acc))
        lse_SBH.view(S * B, H).index_copy_(0, p.q_idx, l_NH.to(acc))
        return out_SBHD, lse_SBH
    for w in windows:
        o, lse = block_forward(
            _view(q_SBHD, w, w.row_lo, w.row_hi),
            _view(k_SBGD, w, w.key_lo, w.key_hi),
            _view(v_SBGD, w, w.key_lo, w.key_hi),
            causal=True,
            kv_of_head_H=wk.block_map,
            scale=wk.scale,
            kernel=wk.kernel,
        )
        _view(out_SBHD, w, w.row_lo, w.row_hi).copy_(o)
        _view(lse_SBH, w, w.row_lo, w.row_hi).copy_(lse)
    return out_SBHD, lse_SBH


def merge_forward(
    wk: WindowKernel,
    windows: tuple[Window, ...],
    key: object,
    q_SBHD: Tensor,
    k_TBGD: Tensor,
    v_TBGD: Tensor,
    out_SBHD: Tensor,
    lse_SBH: Tensor,
) -> None:
    """Merge a received block's unmasked windows into (out, lse) in place. ``key`` names the block
    in the packed-index cache."""
    S, B, H, D = q_SBHD.shape
    if uses_varlen(wk.kernel) and len(windows) > 1:
        p = _packed(wk, windows, key, B, q_SBHD.device)
        o_NHD, l_NH = _varlen_forward(wk, p, q_SBHD, k_TBGD, v_TBGD, causal=False)
        out_flat, lse_flat = out_SBHD.view(S * B, H, D), lse_SBH.view(S * B, H)
        o, lse = merge_into(
            out_flat.index_select(0, p.q_idx), lse_flat.index_select(0, p.q_idx), o_NHD, l_NH
        )
        out_flat.index_copy_(0, p.q_idx, o)
        lse_flat.index_copy_(0, p.q_idx, lse)
        return
    for w in windows:
        o, lse = block_forward(
            _view(q_SBHD, w, w.row_lo, w.row_hi),
            _view(k_TBGD, w, w.key_lo, w.key_hi),
            _view(v_TBGD, w, w.key_lo, w.key_hi),
            causal=False,
            kv_of_head_H=wk.block_map,
            scale=wk.scale,
            kernel=wk.kernel,
        )
        rows_o, rows_l = (
            _view(out_SBHD, w, w.row_lo, w.row_hi),
            _view(lse_SBH, w, w.row_lo, w.row_hi),
        )
        new_o, new_l = merge_into(rows_o, rows_l, o, lse)
        rows_o.copy_(new_o)
        rows_l.copy_(new_l)


def windows_backward(
    wk: WindowKernel,
    windows: tuple[Window, ...],
    key: object,
    dout_SBHD: Tensor,
    q_SBHD: Tensor,
    k_TBGD: Tensor,
    v_TBGD: Tensor,
    out_SBHD: Tensor,
    lse_SBH: Tensor,
    dq_SBHD: Tensor,
    *,
    causal: bool,
) -> tuple[Tensor, Tensor]:
    """Backward of a block's windows: adds into ``dq [S, B, H, D]`` (accumulation dtype,
    contiguous) in place, returns ``dk, dv [T, B, G, D]`` (accumulation dtype)."""
    S, B, H, D = q_SBHD.shape
    T, _, G, _ = k_TBGD.shape
    acc = acc_dtype(q_SBHD.dtype)
    dk_TBGD = k_TBGD.new_zeros(T, B, G, D, dtype=acc)
    dv_TBGD = k_TBGD.new_zeros(T, B, G, D, dtype=acc)
    if uses_varlen(wk.kernel) and (causal or len(windows) > 1) and windows:
        p = _packed(wk, windows, key, B, q_SBHD.device)
        dq_NHD, dk_MGD, dv_MGD = _varlen_backward(
            wk, p, dout_SBHD, q_SBHD, k_TBGD, v_TBGD, out_SBHD, lse_SBH, causal
        )
        dq_SBHD.view(S * B, H, D).index_add_(0, p.q_idx, dq_NHD)
        dk_TBGD.view(T * B, G, D).index_add_(0, p.k_idx, dk_MGD)
        dv_TBGD.view(T * B, G, D).index_add_(0, p.k_idx, dv_MGD)
        return dk_TBGD, dv_TBGD
    for w in windows:
        dq, dk, dv = block_backward(
            _view(dout_SBHD, w, w.row_lo, w.row_hi),
            _view(q_SBHD, w, w.row_lo, w.row_hi),
            _view(k_TBGD, w, w.key_lo, w.key_hi),
            _view(v_TBGD, w, w.key_lo, w.key_hi),
            _view(out_SBHD, w, w.row_lo, w.row_hi),
            _view(lse_SBH, w, w.row_lo, w.row_hi),
            causal=causal,
            kv_of_head_H=wk.block_map,
            scale=wk.scale,
            kernel=wk.kernel,
        )
        _view(dq_SBHD, w, w.row_lo, w.row_hi).add_(dq)
        _view(dk_TBGD, w, w.key_lo, w.key_hi).add_(dk)
        _view(dv_TBGD, w, w.key_lo, w.key_hi).add_(dv)
    return dk_TBGD, dv_TBGD
