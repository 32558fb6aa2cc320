"""Sub-ring attention across A2A groups: exact causal attention of a rank's group sequence.

Legend: S = tokens of my group sequence, T = tokens of one received K/V block, B = micro-batch,
H = my query heads, G = my K/V heads, D = head dim. ``kv2`` tensors stack K and V on a leading
dimension of 2 (one message carries both).

Input (after the head all-to-all): ``q [S, B, H, D]``, ``k, v [S, B, G, D]``; output ``[S, B, H, D]``.

Blocks. The local block (my group's own K/V) is one square causal call; a received block is one
unmasked call per run of query rows with the same visible key prefix (``peers.block_calls``). No
mask or score tensor exists on this path; memory is O(S * D) with the fused kernels. With document
boundaries the schedule carries *windows* instead (``documents.py``: pruned transfers, one causal
window per document in the local block, unmasked key ranges in received blocks), run by
``varlen.py`` (a loop of block calls, or one CUDA varlen call per block); the events are the same.

Ordering rule (NCCL pairs P2P messages per (src, dst) in posting order and ignores tags). Every rank
walks the same global sequence of *events* and posts, for each event, one ``batch_isend_irecv`` with
its own part of it (nothing when it has none)::

    forward:  kv(0), kv(1), ..., kv(N-1)
    backward: kv(0), kv(1), dkv(0), kv(2), dkv(1), ..., kv(N-1), dkv(N-2), dkv(N-1)

(N = global number of steps, the same on every rank; ``kv(t)`` = the K/V messages of step t,
``dkv(t)`` = the dK/dV of step t's blocks returned to their holders). Each message belongs to one
event and both its sender and its receiver post it in that event, so every (src, dst) pair posts its
messages in the same order on both sides, for every ``comm_chunks``. A rank only waits on events it
posted earlier, so the event order also rules out cycles (no deadlock). Tags name the event (gloo
matches by tag; NCCL ignores them and the order alone matches).

Forward schedule (code order in ``subring_forward``)::

    post kv(0); compute local block
    for t in 0..N-1:
        wait kv(t); post kv(t+1)               # double buffers: kv(t) is computed, kv(t+1) in flight
        compute block(kv(t)), merge by LSE

Backward (``subring_backward``) fetches the same K/V again (nothing of other groups is kept between
forward and backward), recomputes each block with the final out/LSE, and returns each block's dK/dV
to the holders that sent it (in the input dtype unless ``fp32_grad_wire``); a holder adds the dK/dV
it receives, in float32, to the gradient of its own group-sequence K/V::

    post kv(0); local block backward
    for t in 0..N-1:
        wait kv(t); post kv(t+1)
        block backward(kv(t)) -> dq += ..., dkv_blk
        post dkv(t); wait dkv(t-1) and add it
    wait dkv(N-1) and add it
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from megatron_hexiseq.attention.comm import CommStats, post_p2p, wait_all
from megatron_hexiseq.attention.documents import DocumentBounds, window_pairs
from megatron_hexiseq.attention.groups import HexiSeqGroups
from megatron_hexiseq.attention.kernels import (
    Kernel,
    KVMap,
    acc_dtype,
    block_backward,
    block_forward,
    kv_map,
    merge_into,
)
from megatron_hexiseq.attention.peers import RankSchedule, RankStep, Run, runs_num_tokens
from megatron_hexiseq.attention.varlen import (
    WindowKernel,
    local_forward,
    merge_forward,
    uses_varlen,
    windows_backward,
)

Posted = tuple[list, list[Tensor], list[Tensor]]  # (works, send buffers, receive buffers)


@dataclass(frozen=True)
class _Ctx:
    """Per-call constants: schedule, groups, kernel, wire dtype of dK/dV."""

    sched: RankSchedule
    groups: HexiSeqGroups
    scale: float
    kernel: Kernel
    stats: CommStats | None
    kv_of_head_H: KVMap  # the K/V head each query head reads (host-side: no index tensor)
    fp32_grad_wire: bool
    wk: WindowKernel | None = None  # with document boundaries: how the windows run

    def index(self, ix: tuple[int, ...], like: Tensor) -> Tensor:
        return self.groups.index(ix, like.device)


def select_heads(
    x: Tensor, dim: int, heads: tuple[int, ...], total: int, groups: HexiSeqGroups
) -> Tensor:
    """The given heads of ``x`` along ``dim``: a view when they are all or contiguous, else a gather
    with an index tensor cached by ``groups``."""
    if heads == tuple(range(total)):
        return x
    if heads and heads == tuple(range(heads[0], heads[0] + len(heads))):
        return x.narrow(dim, heads[0], len(heads))
    return x.index_select(dim, groups.index(heads, x.device))


def _gather_kv2(
    c: _Ctx, k_SBGD: Tensor, v_SBGD: Tensor, runs: tuple[Run, ...], heads: tuple[int, ...]
) -> Tensor:
    """[S, B, G, D] x2 -> one send buffer [2, T, B, h, D]: the tokens of ``runs``, K/V heads ``heads``."""
    _, B, G, D = k_SBGD.shape
    buf = k_SBGD.new_empty(2, runs_num_tokens(runs), B, len(heads), D)
    off = 0
    for s, e, _ in runs:
        for i, x_SBGD in enumerate((k_SBGD, v_SBGD)):
            buf[i, off : off + e - s] = select_heads(x_SBGD[s:e], 2, heads, G, c.groups)
        off += e - s
    return buf


def _count(
    c: _Ctx, kind: str, sends: list, recvs: list, send_peers: list[int], recv_peers: list[int]
) -> None:
    if c.stats is None:
        return
    for peer, (_, t) in zip(send_peers, sends):
        c.stats.add(kind, sent_to=peer, nbytes=t.numel() * t.element_size())
    for peer, (_, t) in zip(recv_peers, recvs):
        c.stats.add(kind, received_from=peer, nbytes=t.numel() * t.element_size())


def _post_kv(
    c: _Ctx, step: RankStep | None, k_SBGD: Tensor, v_SBGD: Tensor, kind: str
) -> Posted | None:
    """Post my part of event kv(step) (None when I have none)."""
    if step is None:
        return None
    B, D = k_SBGD.shape[1], k_SBGD.shape[3]
    sends = [
        (c.groups.global_rank(x.dst), _gather_kv2(c, k_SBGD, v_SBGD, x.runs, x.src_heads))
        for x in step.sends
    ]
    recvs = [
        (c.groups.global_rank(x.src), k_SBGD.new_empty(2, x.num_tokens, B, len(x.dst_heads), D))
        for x in step.recvs
    ]
    _count(c, kind, sends, recvs, [x.dst for x in step.sends], [x.src for x in step.recvs])
    works = post_p2p(sends, recvs, group=c.groups.cp_group, tag=step.step)
    return works, [t for _, t in sends], [t for _, t in recvs]


def _assemble_kv2(c: _Ctx, step: RankStep, bufs: list[Tensor], num_kv: int) -> Tensor:
    """Received pieces (one per holder, each some of my K/V heads) -> [2, T, B, G, D]."""
    if len(bufs) == 1 and step.recvs[0].dst_heads == tuple(range(num_kv)):
        return bufs[0]
    two, T, B, _, D = bufs[0].shape
    kv2_TBGD = bufs[0].new_empty(two, T, B, num_kv, D)
    for x, buf in zip(step.recvs, bufs):
        kv2_TBGD.index_copy_(3, c.index(x.dst_heads, buf), buf)
    return kv2_TBGD


def _block_forward(
    c: _Ctx, step: RankStep, q_SBHD: Tensor, kv2_TBGD: Tensor, out_SBHD: Tensor, lse_SBH: Tensor
) -> None:
    """Merge one received block into (out, lse) in place: one unmasked call per visible prefix."""
    for lo, hi, keys in step.calls:
        blk_out, blk_lse = block_forward(
            q_SBHD[lo:hi],
            kv2_TBGD[0, :keys],
            kv2_TBGD[1, :keys],
            causal=False,
            kv_of_head_H=c.kv_of_head_H,
            scale=c.scale,
            kernel=c.kernel,
        )
        out_SBHD[lo:hi], lse_SBH[lo:hi] = merge_into(
            out_SBHD[lo:hi], lse_SBH[lo:hi], blk_out, blk_lse
        )


def _block_backward(
    c: _Ctx,
    step: RankStep,
    dout_SBHD: Tensor,
    q_SBHD: Tensor,
    kv2_TBGD: Tensor,
    out_SBHD: Tensor,
    lse_SBH: Tensor,
    dq_SBHD: Tensor,
) -> Tensor:
    """Backward of one received block: adds into dq in place, returns dK/dV ``[2, T, B, G, D]`` (acc)."""
    dkv2_TBGD = kv2_TBGD.new_zeros(kv2_TBGD.shape, dtype=dq_SBHD.dtype)
    for lo, hi, keys in step.calls:
        dq, dk, dv = block_backward(
            dout_SBHD[lo:hi],
            q_SBHD[lo:hi],
            kv2_TBGD[0, :keys],
            kv2_TBGD[1, :keys],
            out_SBHD[lo:hi],
            lse_SBH[lo:hi],
            causal=False,
            kv_of_head_H=c.kv_of_head_H,
            scale=c.scale,
            kernel=c.kernel,
        )
        dq_SBHD[lo:hi] += dq
        dkv2_TBGD[0, :keys] += dk
        dkv2_TBGD[1, :keys] += dv
    return dkv2_TBGD


def _count_block(c: _Ctx, step: RankStep | None, q_SBHD: Tensor) -> None:
    """Forward counters: one block, its kernel calls and its (query, key) pairs x my query heads."""
    if c.stats is None:
        return
    kind = "local" if step is None else "remote"
    S, B, H, _ = q_SBHD.shape
    c.stats.blocks[kind] += 1
    windows = c.sched.local_windows if step is None else step.windows
    if windows is not None:
        c.stats.calls[kind] += len(windows) if not c.wk or not uses_varlen(c.wk.kernel) else 1
        c.stats.pairs[kind] += H * window_pairs(windows, B, causal=step is None)
    elif step is None:
        c.stats.calls[kind] += 1
        c.stats.pairs[kind] += H * B * S * (S + 1) // 2
    else:
        c.stats.calls[kind] += len(step.calls)
        c.stats.pairs[kind] += H * B * sum((hi - lo) * keys for lo, hi, keys in step.calls)


def subring_forward(
    c: _Ctx, q_SBHD: Tensor, k_SBGD: Tensor, v_SBGD: Tensor
) -> tuple[Tensor, Tensor]:
    """Returns ``out [S, B, H, D]`` and ``lse [S, B, H]`` in the accumulation dtype."""
    acc = acc_dtype(q_SBHD.dtype)
    N = c.sched.num_steps
    kv_next = _post_kv(c, c.sched.step_at(0), k_SBGD, v_SBGD, "kv")
    if c.wk is not None and c.sched.local_windows is not None:
        out_SBHD, lse_SBH = local_forward(c.wk, c.sched.local_windows, q_SBHD, k_SBGD, v_SBGD)
    else:
        out_SBHD, lse_SBH = block_forward(
            q_SBHD,
            k_SBGD,
            v_SBGD,
            causal=True,
            kv_of_head_H=c.kv_of_head_H,
            scale=c.scale,
            kernel=c.kernel,
        )
        out_SBHD, lse_SBH = out_SBHD.to(acc), lse_SBH.to(acc)
    _count_block(c, None, q_SBHD)
    for t in range(N):
        step, kv_cur = c.sched.step_at(t), kv_next
        if kv_cur is not None:
            wait_all(kv_cur[0])
        kv_next = _post_kv(c, c.sched.step_at(t + 1), k_SBGD, v_SBGD, "kv") if t + 1 < N else None
        if step is not None and step.computes:
            assert kv_cur is not None  # a computing step received its K/V in the previous event
            kv2_TBGD = _assemble_kv2(c, step, kv_cur[2], k_SBGD.shape[2])
            if c.wk is not None and step.windows is not None:
                merge_forward(
                    c.wk,
                    step.windows,
                    step.step,
                    q_SBHD,
                    kv2_TBGD[0],
                    kv2_TBGD[1],
                    out_SBHD,
                    lse_SBH,
                )
            else:
                _block_forward(c, step, q_SBHD, kv2_TBGD, out_SBHD, lse_SBH)
            _count_block(c, step, q_SBHD)
    return out_SBHD, lse_SBH


def _post_dkv(
    c: _Ctx, step: RankStep, dkv2_TBGD: Tensor | None, wire: torch.dtype, like: Tensor
) -> Posted:
    """Post my part of event dkv(step): return the block's dK/dV to the holders that sent it, receive
    dK/dV for the K/V I sent. ``like``: [2, S, B, G, D] (device, B, D)."""
    B, D = like.shape[2], like.shape[4]
    sends = []
    if dkv2_TBGD is not None:
        G = dkv2_TBGD.shape[3]
        sends = [
            (
                c.groups.global_rank(x.src),
                select_heads(dkv2_TBGD, 3, x.dst_heads, G, c.groups).to(wire).contiguous(),
            )
            for x in step.recvs
        ]
    recvs = [
        (
            c.groups.global_rank(x.dst),
            like.new_empty(2, x.num_tokens, B, len(x.src_heads), D, dtype=wire),
        )
        for x in step.sends
    ]
    _count(c, "dkv", sends, recvs, [x.src for x in step.recvs], [x.dst for x in step.sends])
    works = post_p2p(sends, recvs, group=c.groups.cp_group, tag=c.sched.num_steps + step.step)
    return works, [t for _, t in sends], [t for _, t in recvs]


def _add_dkv(c: _Ctx, dkv2_SBGD: Tensor, step: RankStep, bufs: list[Tensor]) -> None:
    """Holder side: add received dK/dV pieces (wire dtype) into my group-sequence dK/dV, in place."""
    for x, buf in zip(step.sends, bufs):
        buf = buf.to(dkv2_SBGD.dtype)
        every_head = x.src_heads == tuple(range(dkv2_SBGD.shape[3]))
        off = 0
        for s, e, _ in x.runs:
            if every_head:
                dkv2_SBGD[:, s:e] += buf[:, off : off + e - s]
            else:
                dkv2_SBGD[:, s:e].index_add_(
                    3, c.index(x.src_heads, buf), buf[:, off : off + e - s]
                )
            off += e - s


def _finish_dkv(c: _Ctx, dkv2_SBGD: Tensor, pending: tuple[RankStep, Posted] | None) -> None:
    if pending is not None:
        wait_all(pending[1][0])
        _add_dkv(c, dkv2_SBGD, pending[0], pending[1][2])


def subring_backward(
    c: _Ctx,
    dout_SBHD: Tensor,
    q_SBHD: Tensor,
    k_SBGD: Tensor,
    v_SBGD: Tensor,
    out_SBHD: Tensor,
    lse_SBH: Tensor,
) -> tuple[Tensor, Tensor, Tensor]:
    """Returns dq ``[S, B, H, D]``, dk, dv ``[S, B, G, D]`` in the accumulation dtype. ``out_SBHD`` is
    the final output as the fused kernels take it (input dtype; the reference takes any dtype)."""
    wire = torch.float32 if c.fp32_grad_wire else k_SBGD.dtype
    N = c.sched.num_steps
    kv_next = _post_kv(c, c.sched.step_at(0), k_SBGD, v_SBGD, "kv_bwd")
    if c.wk is not None and c.sched.local_windows is not None:
        dq_SBHD = q_SBHD.new_zeros(q_SBHD.shape, dtype=acc_dtype(q_SBHD.dtype))
        dk_SBGD, dv_SBGD = windows_backward(
            c.wk,
            c.sched.local_windows,
            "local",
            dout_SBHD,
            q_SBHD,
            k_SBGD,
            v_SBGD,
            out_SBHD,
            lse_SBH,
            dq_SBHD,
            causal=True,
        )
    else:
        dq_SBHD, dk_SBGD, dv_SBGD = block_backward(
            dout_SBHD,
            q_SBHD,
            k_SBGD,
            v_SBGD,
            out_SBHD,
            lse_SBH,
            causal=True,
            kv_of_head_H=c.kv_of_head_H,
            scale=c.scale,
            kernel=c.kernel,
        )
    if not c.sched.steps:  # a single group: nothing to exchange
        return dq_SBHD, dk_SBGD, dv_SBGD
    dkv2_SBGD = torch.stack([dk_SBGD, dv_SBGD])
    pending: tuple[RankStep, Posted] | None = None
    for t in range(N):
        step, kv_cur = c.sched.step_at(t), kv_next
        if kv_cur is not None:
            wait_all(kv_cur[0])
        kv_next = (
            _post_kv(c, c.sched.step_at(t + 1), k_SBGD, v_SBGD, "kv_bwd") if t + 1 < N else None
        )
        if step is None:
            continue
        dkv2_TBGD = None
        if step.computes:
            assert kv_cur is not None  # a computing step received its K/V in the previous event
            kv2_TBGD = _assemble_kv2(c, step, kv_cur[2], k_SBGD.shape[2])
            if c.wk is not None and step.windows is not None:
                dkv2_TBGD = torch.stack(
                    windows_backward(
                        c.wk,
                        step.windows,
                        step.step,
                        dout_SBHD,
                        q_SBHD,
                        kv2_TBGD[0],
                        kv2_TBGD[1],
                        out_SBHD,
                        lse_SBH,
                        dq_SBHD,
                        causal=False,
                    )
                )
            else:
                dkv2_TBGD = _block_backward(
                    c, step, dout_SBHD, q_SBHD, kv2_TBGD, out_SBHD, lse_SBH, dq_SBHD
                )
        posted = _post_dkv(c, step, dkv2_TBGD, wire, dkv2_SBGD)
        _finish_dkv(c, dkv2_SBGD, pending)
        pending = (step, posted)
    _finish_dkv(c, dkv2_SBGD, pending)
    return dq_SBHD, dkv2_SBGD[0], dkv2_SBGD[1]


class _SubRingAttention(torch.autograd.Function):
    """forward q [S,B,H,D], k/v [S,B,G,D] -> out [S,B,H,D]; backward dout -> dq, dk, dv (same shapes)."""

    @staticmethod
    def forward(ctx, q_SBHD: Tensor, k_SBGD: Tensor, v_SBGD: Tensor, c: _Ctx) -> Tensor:
        out_SBHD, lse_SBH = subring_forward(c, q_SBHD, k_SBGD, v_SBGD)
        out = out_SBHD.to(q_SBHD.dtype)
        # the fused backward kernels take the final output in the input dtype, the reference the exact one
        ctx.c = c
        ctx.save_for_backward(
            q_SBHD, k_SBGD, v_SBGD, out_SBHD if c.kernel is Kernel.REFERENCE else out, lse_SBH
        )
        return out

    @staticmethod
    def backward(ctx, dout_SBHD: Tensor):
        q_SBHD, k_SBGD, v_SBGD, out_SBHD, lse_SBH = ctx.saved_tensors
        dq, dk, dv = subring_backward(ctx.c, dout_SBHD, q_SBHD, k_SBGD, v_SBGD, out_SBHD, lse_SBH)
        return dq.to(q_SBHD.dtype), dk.to(k_SBGD.dtype), dv.to(v_SBGD.dtype), None


def subring_attn_func(
    q_SBHD: Tensor,
    k_SBGD: Tensor,
    v_SBGD: Tensor,
    *,
    groups: HexiSeqGroups,
    scale: float,
    kernel: Kernel,
    comm_chunks: int = 1,
    stats: CommStats | None = None,
    fp32_grad_wire: bool = False,
    documents: DocumentBounds | None = None,
) -> Tensor:
    """Exact causal attention of my group sequence (all groups' K/V taken into account).

    ``q [S, B, H, D]``, ``k, v [S, B, G, D]`` for my group sequence, my query heads and my K/V heads
    (``groups.schedule(comm_chunks)``) -> ``[S, B, H, D]``. ``kernel`` is a concrete kernel (see
    ``kernels.resolve_kernel``). A rank with no query heads returns an empty ``[S, B, 0, D]`` and
    takes no part in the exchange (its groups were warmed up at creation). ``documents``: causal
    inside each document only, with the pruned exchange (``documents.py``).
    """
    if documents is None and groups.layout is not groups.job_layout and uses_varlen(kernel):
        # a per-micro-batch layout: its block shapes change every micro-batch, so it runs as one
        # document through the variable-length call (the same schedule and values as without)
        documents = DocumentBounds(groups.layout.seq_length, ((0, groups.layout.seq_length),), True)
    if documents is None:
        sched = groups.schedule(comm_chunks)
    else:
        sched = groups.document_schedule(documents, comm_chunks)
    if not sched.heads:
        return q_SBHD * 0  # [S, B, 0, D], keeps the autograd graph
    assert q_SBHD.shape[0] == runs_num_tokens(sched.q_runs), (q_SBHD.shape, sched.q_runs)
    kvm = kv_map(sched.kv_of_head, len(sched.kv_heads))
    wk = None
    if documents is not None:
        wk = WindowKernel(kernel, scale, kvm, groups.window_cache(sched))
    c = _Ctx(
        sched=sched,
        groups=groups,
        scale=scale,
        kernel=kernel,
        stats=stats,
        kv_of_head_H=kvm,
        fp32_grad_wire=fp32_grad_wire,
        wk=wk,
    )
    return _SubRingAttention.apply(q_SBHD, k_SBGD, v_SBGD, c)
