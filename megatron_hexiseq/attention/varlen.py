"""Document-masked blocks: the windows of ``documents.py`` run through the block kernels.

Legend: S = query rows (my group sequence), T = keys of the block (S for the local block), B =
micro-batch, H / G = my query / K/V heads, D = head dim, N / M = packed query / key rows of a
variable-length call, h / g = the query / K/V heads of one head segment.

Two ways to run a block's windows (``peers.Window``: rows x key range x sample):
- **loop** (CPU, ``efficient``, ``flash-attn``, ``reference``): one ``kernels.block_forward`` /
  ``block_backward`` call per window on views ``q[row_lo:row_hi, sample]``, ``k[key_lo:key_hi, sample]``.
- **varlen** (``flash`` and ``cudnn`` on CUDA: ``kernel_rules.VARLEN_KERNELS``): EVERY block with
  windows, a block of one window included, is one ``aten._flash_attention_forward`` /
  ``_backward`` call per head segment on packed tensors: ``q [S, B, H, D] -> [N, H, D]`` and
  ``k/v [T, B, G, D] -> [M, G, D]`` gathered by index (each (window, sample) one sequence; windows
  of the same keys overlap, so K/V rows may repeat), ``cu_seqlens_q/k`` int32, ``max_q/max_k``
  Python ints from the host schedule (no ``.item()``). The result is scattered back with
  ``index_copy_`` (local block: the windows partition the rows) or merged by LSE (received block:
  disjoint rows); gradients return with ``index_add_``. ``cudnn`` runs its packed blocks here
  because cuDNN builds (and never evicts) one execution graph per distinct call shape, and a
  packed micro-batch's window shapes change with every micro-batch; flash's variable-length
  kernel takes any lengths with no per-shape state (docs/attention.md, "Packed documents").

GQA without copies of K/V, as in ``kernels.py``: K/V stay at their G heads. The query heads are
sorted by the K/V head they read (``KVMap.order``; a no-op for the planner's layouts) and cut into
``KVMap.segments``; each segment is one call on a head slice (query head i of a segment reads its
K/V head i // ratio: the kernel's native GQA). An aligned head range is one segment and one call;
an unaligned one (a rank holding 2 heads of one query group and 4 of the next) at most 3. The
backward returns dK/dV at G heads (each segment writes its own K/V heads; unread heads stay 0).

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

from megatron_hexiseq import kernel_rules
from megatron_hexiseq.attention.kernels import (
    Kernel,
    KVMap,
    acc_dtype,
    block_backward,
    block_forward,
    head_index,
    merge_into,
)
from megatron_hexiseq.attention.peers import Window


class WindowKernel(NamedTuple):
    """How to run windows: the kernel, the scale, the GQA map (host-side), the packed-index cache."""

    kernel: Kernel
    scale: float
    kv_map: KVMap  # which of my K/V heads each of my query heads reads
    cache: dict  # (block key, B, device) -> _Packed; one schedule = one micro-batch


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
    """Whether a block's document windows run as variable-length flash calls (every block with
    windows, one window or many; ``kernel_rules.VARLEN_KERNELS``), not one call per window."""
    return kernel.value in kernel_rules.VARLEN_KERNELS


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


def _pack_kv(x_TBGD: Tensor, p: _Packed) -> Tensor:
    """[T, B, G, D] -> [M, G, D]: the packed key rows, every K/V head."""
    T, B, G, D = x_TBGD.shape
    return x_TBGD.reshape(T * B, G, D).index_select(0, p.k_idx)


def _pack_q(wk: WindowKernel, x_SBH: Tensor, p: _Packed) -> Tensor:
    """[S, B, H, ...] -> [N, H, ...]: the packed query rows, heads in K/V-head order."""
    S, B = x_SBH.shape[:2]
    x_NH = x_SBH.reshape(S * B, *x_SBH.shape[2:]).index_select(0, p.q_idx)
    order = wk.kv_map.order
    return x_NH if order is None else x_NH.index_select(1, head_index(order, x_NH.device))


def _unsort_heads(wk: WindowKernel, x_NH: Tensor) -> Tensor:
    """Back from K/V-head order to my query heads' order (dim 1)."""
    inverse = wk.kv_map.inverse
    return x_NH if inverse is None else x_NH.index_select(1, head_index(inverse, x_NH.device))


def _in_place(wk: WindowKernel, windows: tuple[Window, ...], key: object, B: int, S: int) -> bool:
    """Whether the packed rows are the block's rows themselves, keys likewise (no gather, no
    scatter: the local block of a micro-batch of one sample, its windows tiling its rows in order,
    query heads in K/V-head order), cached with the block's packed indices."""
    ck = (key, B, "in place")
    if ck not in wk.cache:
        ends = [0] + [w.row_hi for w in windows]
        wk.cache[ck] = (
            B == 1
            and wk.kv_map.order is None
            and ends[-1] == S
            and all(w.row_lo == e and (w.key_lo, w.key_hi) == (w.row_lo, w.row_hi)
                    for w, e in zip(windows, ends))
        )  # fmt: skip
    return wk.cache[ck]


def _calls_forward(
    wk: WindowKernel,
    p: _Packed,
    q_NHD: Tensor,
    k_MGD: Tensor,
    v_MGD: Tensor,
    causal: bool,
    out_NHD: Tensor,
    lse_NH: Tensor,
) -> None:
    """One variable-length call per head segment (``q [N, h, D]`` against ``k, v [M, g, D]``, heads
    in K/V-head order); each segment's ``out`` and LSE are written into its heads of ``out_NHD``,
    ``lse_NH`` (converted to their dtype in place)."""
    fwd, _ = _varlen_ops()
    for seg in wk.kv_map.segments:
        qh, kvh = slice(seg.q_lo, seg.q_hi), slice(seg.kv_lo, seg.kv_hi)
        o_NhD, l_hN, *_ = fwd(
            q_NHD[:, qh],
            k_MGD[:, kvh],
            v_MGD[:, kvh],
            p.cu_q,
            p.cu_k,
            p.max_q,
            p.max_k,
            0.0,
            causal,
            False,
            scale=wk.scale,
        )
        out_NHD[:, qh].copy_(o_NhD)
        lse_NH[:, qh].copy_(l_hN.t())


def _calls_backward(
    wk: WindowKernel,
    p: _Packed,
    packed: tuple[Tensor, ...],
    causal: bool,
    grads: tuple[Tensor, Tensor, Tensor],
) -> None:
    """Backward of ``_calls_forward``: ``packed`` = (dout, q, out ``[N, H, D]`` input dtype, K/V-head
    order; k, v ``[M, G, D]``; lse ``[H, N]`` float32), ``grads`` = (dq ``[N, H, D]``, dk, dv
    ``[M, G, D]``) in the accumulation dtype, added into in place; dK/dV never exist at H heads."""
    do_NHD, q_NHD, o_NHD, k_MGD, v_MGD, lse_HN = packed
    dq_NHD, dk_MGD, dv_MGD = grads
    _, bwd = _varlen_ops()
    # no dropout: the RNG state is not read
    rng = torch.empty(2, dtype=torch.int64, device=q_NHD.device)
    for seg in wk.kv_map.segments:
        qh, kvh = slice(seg.q_lo, seg.q_hi), slice(seg.kv_lo, seg.kv_hi)
        dq, dk, dv = bwd(
            do_NHD[:, qh],
            q_NHD[:, qh],
            k_MGD[:, kvh],
            v_MGD[:, kvh],
            o_NHD[:, qh],
            lse_HN[qh],
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
        dq_NHD[:, qh].add_(dq)
        dk_MGD[:, kvh].add_(dk)  # segments read disjoint K/V heads
        dv_MGD[:, kvh].add_(dv)


def _view(x: Tensor, w: Window, lo: int, hi: int) -> Tensor:
    return x[lo:hi] if w.sample is None else x[lo:hi, w.sample : w.sample + 1]


def local_forward(
    wk: WindowKernel, windows: tuple[Window, ...], q_SBHD: Tensor, k_SBGD: Tensor, v_SBGD: Tensor
) -> tuple[Tensor, Tensor]:
    """The local block (square causal windows partitioning the rows): ``out [S, B, H, D]``,
    ``lse [S, B, H]``, accumulation dtype."""
    S, B, H, D = q_SBHD.shape
    G = k_SBGD.shape[2]
    acc = acc_dtype(q_SBHD.dtype)
    out_SBHD = q_SBHD.new_zeros(S, B, H, D, dtype=acc)
    lse_SBH = q_SBHD.new_zeros(S, B, H, dtype=acc)
    if uses_varlen(wk.kernel) and windows:
        p = _packed(wk, windows, "local", B, q_SBHD.device)
        out_NHD, lse_NH = out_SBHD.view(S * B, H, D), lse_SBH.view(S * B, H)
        if _in_place(wk, windows, "local", B, S):  # the kernel writes into out and lse directly
            kv = (k_SBGD.reshape(S * B, G, D), v_SBGD.reshape(S * B, G, D))
            _calls_forward(wk, p, q_SBHD.reshape(S * B, H, D), *kv, True, out_NHD, lse_NH)
            return out_SBHD, lse_SBH
        q_NHD, kv = _pack_q(wk, q_SBHD, p), (_pack_kv(k_SBGD, p), _pack_kv(v_SBGD, p))
        o_NHD, l_NH = (
            q_NHD.new_empty(q_NHD.shape, dtype=acc),
            q_NHD.new_empty(q_NHD.shape[:2], dtype=acc),
        )
        _calls_forward(wk, p, q_NHD, *kv, True, o_NHD, l_NH)
        out_NHD.index_copy_(0, p.q_idx, _unsort_heads(wk, o_NHD))
        lse_NH.index_copy_(0, p.q_idx, _unsort_heads(wk, l_NH))
        return out_SBHD, lse_SBH
    for w in windows:
        o, lse = block_forward(
            _view(q_SBHD, w, w.row_lo, w.row_hi),
            _view(k_SBGD, w, w.key_lo, w.key_hi),
            _view(v_SBGD, w, w.key_lo, w.key_hi),
            causal=True,
            kv_of_head_H=wk.kv_map,
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
    if uses_varlen(wk.kernel) and windows:  # one window too: no per-shape dense call
        p = _packed(wk, windows, key, B, q_SBHD.device)
        q_NHD, kv = _pack_q(wk, q_SBHD, p), (_pack_kv(k_TBGD, p), _pack_kv(v_TBGD, p))
        acc = out_SBHD.dtype
        o_NHD, l_NH = (
            q_NHD.new_empty(q_NHD.shape, dtype=acc),
            q_NHD.new_empty(q_NHD.shape[:2], dtype=acc),
        )
        _calls_forward(wk, p, q_NHD, *kv, False, o_NHD, l_NH)
        out_flat, lse_flat = out_SBHD.view(S * B, H, D), lse_SBH.view(S * B, H)
        o, lse = merge_into(
            out_flat.index_select(0, p.q_idx),
            lse_flat.index_select(0, p.q_idx),
            _unsort_heads(wk, o_NHD),
            _unsort_heads(wk, l_NH),
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
            kv_of_head_H=wk.kv_map,
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
    acc, dt = acc_dtype(q_SBHD.dtype), q_SBHD.dtype
    dk_TBGD = k_TBGD.new_zeros(T, B, G, D, dtype=acc)
    dv_TBGD = k_TBGD.new_zeros(T, B, G, D, dtype=acc)
    if uses_varlen(wk.kernel) and windows:
        p = _packed(wk, windows, key, B, q_SBHD.device)
        dkv_MGD = (dk_TBGD.view(T * B, G, D), dv_TBGD.view(T * B, G, D))
        dq_NHD = dq_SBHD.view(S * B, H, D)
        lse_SBH = lse_SBH.to(acc)  # float32 for bf16/fp16
        if causal and _in_place(wk, windows, key, B, S):  # gradients land in place
            rows = (x.to(dt).reshape(S * B, H, D) for x in (dout_SBHD, q_SBHD, out_SBHD))
            kv = (k_TBGD.reshape(T * B, G, D), v_TBGD.reshape(T * B, G, D))
            packed = (*rows, *kv, lse_SBH.reshape(S * B, H).t().contiguous())
            _calls_backward(wk, p, packed, causal, (dq_NHD, *dkv_MGD))
            return dk_TBGD, dv_TBGD
        rows = (_pack_q(wk, x.to(dt), p) for x in (dout_SBHD, q_SBHD, out_SBHD))
        kv = (_pack_kv(k_TBGD, p), _pack_kv(v_TBGD, p))
        packed = (*rows, *kv, _pack_q(wk, lse_SBH, p).t().contiguous())
        N, M = len(p.q_idx), len(p.k_idx)
        grads = (
            q_SBHD.new_zeros(N, H, D, dtype=acc),
            k_TBGD.new_zeros(M, G, D, dtype=acc),
            k_TBGD.new_zeros(M, G, D, dtype=acc),
        )
        _calls_backward(wk, p, packed, causal, grads)
        dq_NHD.index_add_(0, p.q_idx, _unsort_heads(wk, grads[0]))
        dkv_MGD[0].index_add_(0, p.k_idx, grads[1])
        dkv_MGD[1].index_add_(0, p.k_idx, grads[2])
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
            kv_of_head_H=wk.kv_map,
            scale=wk.scale,
            kernel=wk.kernel,
        )
        _view(dq_SBHD, w, w.row_lo, w.row_hi).add_(dq)
        _view(dk_TBGD, w, w.key_lo, w.key_hi).add_(dk)
        _view(dv_TBGD, w, w.key_lo, w.key_hi).add_(dv)
    return dk_TBGD, dv_TBGD
