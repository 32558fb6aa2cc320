"""Sub-ring attention across A2A groups: exact causal attention of a rank's group sequence.

Legend: S = tokens of my group sequence, T = tokens of one received K/V block, B = micro-batch,
H = my query heads, G = my K/V heads, D = head dim. ``kv_SBGD`` etc.; ``kv2`` tensors stack K and V
on a leading dimension of 2 (one message carries both).

Input (after the head all-to-all): ``q [S, B, H, D]``, ``k, v [S, B, G, D]``; output ``[S, B, H, D]``.

Forward schedule (code order in ``subring_forward``)::

    post step 0 exchange into kv_next          # batch_isend_irecv, async
    compute local block (my group's own K/V)
    for each of my steps i:
        wait kv_next -> kv_cur                 # double buffers: kv_cur is computed, kv_next in flight
        post step i+1 exchange into kv_next
        compute block(kv_cur), merge by LSE

Backward (``subring_backward``) fetches the same K/V again (nothing of other groups is kept between
forward and backward), recomputes each block with the final out/LSE, and returns each block's dK/dV
to the holders that sent it (reverse direction, tag offset by the number of steps); a holder adds the
dK/dV it receives to the gradient of its own group-sequence K/V::

    post step 0 K/V fetch; local block backward
    for each of my steps i:
        wait kv_next -> kv_cur; post step i+1 K/V fetch
        block backward(kv_cur) -> dq += ..., dkv_blk
        wait dkv of step i-1 and add it; post dkv_blk of step i back to the holders
    wait dkv of the last step and add it
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from megatron_hexiseq.attention.comm import CommStats, post_p2p, wait_all
from megatron_hexiseq.attention.groups import HexiSeqGroups
from megatron_hexiseq.attention.kernels import acc_dtype, block_backward, block_forward, merge_into, visible_mask
from megatron_hexiseq.attention.peers import RankSchedule, RankStep, Run, runs_num_tokens


@dataclass(frozen=True)
class _Ctx:
    """Per-call constants: schedule, groups, index tensors on the input's device."""

    sched: RankSchedule
    groups: HexiSeqGroups
    scale: float
    kernel: str
    stats: CommStats | None
    q_pos_S: Tensor | None       # positions of my group sequence; only built when a block is partial
    kv_of_head_H: Tensor | None  # None when query head i reads K/V head i (no GQA expansion)


def positions(runs: tuple[Run, ...], like: Tensor) -> Tensor:
    """Global positions of runs as a long tensor on ``like``'s device."""
    parts = [torch.arange(p, p + e - s, device=like.device) for s, e, p in runs]
    return torch.cat(parts) if parts else torch.empty(0, dtype=torch.long, device=like.device)


def _index(ix: tuple[int, ...], like: Tensor) -> Tensor:
    return torch.tensor(ix, dtype=torch.long, device=like.device)


def _select_heads(x: Tensor, dim: int, heads: tuple[int, ...], total: int) -> Tensor:
    if heads == tuple(range(total)):
        return x
    if heads and heads == tuple(range(heads[0], heads[0] + len(heads))):
        return x.narrow(dim, heads[0], len(heads))
    return x.index_select(dim, _index(heads, x))


def _gather_kv2(k_SBGD: Tensor, v_SBGD: Tensor, runs: tuple[Run, ...], heads: tuple[int, ...]) -> Tensor:
    """[S, B, G, D] x2 -> one send buffer [2, T, B, h, D]: the tokens of ``runs``, K/V heads ``heads``."""
    _, B, G, D = k_SBGD.shape
    buf = k_SBGD.new_empty(2, runs_num_tokens(runs), B, len(heads), D)
    off = 0
    for s, e, _ in runs:
        for i, x_SBGD in enumerate((k_SBGD, v_SBGD)):
            buf[i, off:off + e - s] = _select_heads(x_SBGD[s:e], 2, heads, G)
        off += e - s
    return buf


def _post_kv(c: _Ctx, step: RankStep, k_SBGD: Tensor, v_SBGD: Tensor,
             kind: str) -> tuple[list, list[Tensor], list[Tensor]]:
    """Post the K/V exchange of one step. Returns (works, send buffers, receive buffers)."""
    B, D = k_SBGD.shape[1], k_SBGD.shape[3]
    sends = [(c.groups.global_rank(x.dst), _gather_kv2(k_SBGD, v_SBGD, x.runs, x.src_heads)) for x in step.sends]
    recvs = [(c.groups.global_rank(x.src), k_SBGD.new_empty(2, x.num_tokens, B, len(x.dst_heads), D))
             for x in step.recvs]
    if c.stats is not None:
        for x, (_, t) in zip(step.sends, sends):
            c.stats.add(kind, sent_to=x.dst, nbytes=t.numel() * t.element_size())
        for x, (_, t) in zip(step.recvs, recvs):
            c.stats.add(kind, received_from=x.src, nbytes=t.numel() * t.element_size())
    works = post_p2p(sends, recvs, group=c.groups.cp_group, tag=step.step)
    return works, [t for _, t in sends], [t for _, t in recvs]


def _assemble_kv2(step: RankStep, bufs: list[Tensor], num_kv: int) -> Tensor:
    """Received pieces (one per holder, each some of my K/V heads) -> [2, T, B, G, D]."""
    if len(bufs) == 1 and step.recvs[0].dst_heads == tuple(range(num_kv)):
        return bufs[0]
    two, T, B, _, D = bufs[0].shape
    kv2_TBGD = bufs[0].new_empty(two, T, B, num_kv, D)
    for x, buf in zip(step.recvs, bufs):
        kv2_TBGD.index_copy_(3, _index(x.dst_heads, buf), buf)
    return kv2_TBGD


def _partial_mask(c: _Ctx, step: RankStep) -> Tensor:
    """Mask of the query rows [a, b) that see some but not all keys of the block: [b - a, T]."""
    a, b = step.rows
    return visible_mask(c.q_pos_S[a:b], positions(step.k_runs, c.q_pos_S))


def _block_forward(c: _Ctx, step: RankStep, q_SBHD: Tensor, kv2_TBGD: Tensor, out_SBHD: Tensor,
                   lse_SBH: Tensor) -> None:
    """Merge one received block into (out, lse) in place: rows [a, b) masked, rows [b, S) full."""
    a, b = step.rows
    kw = dict(kv_of_head_H=c.kv_of_head_H, scale=c.scale, kernel=c.kernel)
    for lo, hi, mask in ((a, b, _partial_mask(c, step) if b > a else None), (b, q_SBHD.shape[0], None)):
        if hi > lo:
            blk_out, blk_lse = block_forward(q_SBHD[lo:hi], kv2_TBGD[0], kv2_TBGD[1], mask_ST=mask, **kw)
            out_SBHD[lo:hi], lse_SBH[lo:hi] = merge_into(out_SBHD[lo:hi], lse_SBH[lo:hi], blk_out, blk_lse)


def _block_backward(c: _Ctx, step: RankStep, dout_SBHD: Tensor, q_SBHD: Tensor, kv2_TBGD: Tensor,
                    out_SBHD: Tensor, lse_SBH: Tensor, delta_SBH: Tensor, dq_SBHD: Tensor) -> Tensor:
    """Backward of one received block: adds into dq in place, returns dK/dV ``[2, T, B, G, D]``."""
    a, b = step.rows
    kw = dict(kv_of_head_H=c.kv_of_head_H, scale=c.scale, kernel=c.kernel)
    dkv2_TBGD = None
    for lo, hi, mask in ((a, b, _partial_mask(c, step) if b > a else None), (b, q_SBHD.shape[0], None)):
        if hi > lo:
            dq, dk, dv = block_backward(dout_SBHD[lo:hi], q_SBHD[lo:hi], kv2_TBGD[0], kv2_TBGD[1], out_SBHD[lo:hi],
                                        lse_SBH[lo:hi], delta_SBH[lo:hi], mask_ST=mask, **kw)
            dq_SBHD[lo:hi] += dq
            dkv2_TBGD = torch.stack([dk, dv]) if dkv2_TBGD is None else dkv2_TBGD + torch.stack([dk, dv])
    assert dkv2_TBGD is not None, "the schedule never sends a block that no query sees"
    return dkv2_TBGD


def subring_forward(c: _Ctx, q_SBHD: Tensor, k_SBGD: Tensor, v_SBGD: Tensor) -> tuple[Tensor, Tensor]:
    """Returns ``out [S, B, H, D]`` and ``lse [S, B, H]`` in the accumulation dtype."""
    steps = c.sched.steps
    kv_next = _post_kv(c, steps[0], k_SBGD, v_SBGD, "kv") if steps else None
    out_SBHD, lse_SBH = block_forward(q_SBHD, k_SBGD, v_SBGD, mask_ST=None, causal=True, kv_of_head_H=c.kv_of_head_H,
                                      scale=c.scale, kernel=c.kernel)
    if c.stats is not None:
        c.stats.blocks["local"] += 1
    for i, step in enumerate(steps):
        wait_all(kv_next[0])
        kv_cur = kv_next
        kv_next = _post_kv(c, steps[i + 1], k_SBGD, v_SBGD, "kv") if i + 1 < len(steps) else None
        if step.computes:
            _block_forward(c, step, q_SBHD, _assemble_kv2(step, kv_cur[2], k_SBGD.shape[2]), out_SBHD, lse_SBH)
            if c.stats is not None:
                c.stats.blocks["remote"] += 1
    return out_SBHD, lse_SBH


def _post_dkv(c: _Ctx, step: RankStep, dkv2_TBGD: Tensor | None,
              like: Tensor) -> tuple[list, list[Tensor], list[Tensor]]:
    """Return a block's dK/dV to the holders that sent it; receive dK/dV for the K/V I sent."""
    B, D = like.shape[2], like.shape[4]
    sends = []
    if dkv2_TBGD is not None:
        G = dkv2_TBGD.shape[3]
        sends = [(c.groups.global_rank(x.src), _select_heads(dkv2_TBGD, 3, x.dst_heads, G).contiguous())
                 for x in step.recvs]
    recvs = [(c.groups.global_rank(x.dst), like.new_empty(2, x.num_tokens, B, len(x.src_heads), D))
             for x in step.sends]
    if c.stats is not None:
        for x, (_, t) in zip(step.recvs, sends):
            c.stats.add("dkv", sent_to=x.src, nbytes=t.numel() * t.element_size())
        for x, (_, t) in zip(step.sends, recvs):
            c.stats.add("dkv", received_from=x.dst, nbytes=t.numel() * t.element_size())
    works = post_p2p(sends, recvs, group=c.groups.cp_group, tag=c.sched.num_steps + step.step)
    return works, [t for _, t in sends], [t for _, t in recvs]


def _add_dkv(dkv2_SBGD: Tensor, step: RankStep, bufs: list[Tensor]) -> None:
    """Holder side: add received dK/dV pieces into my group-sequence dK/dV, in place."""
    for x, buf in zip(step.sends, bufs):
        every_head = x.src_heads == tuple(range(dkv2_SBGD.shape[3]))
        heads = None if every_head else _index(x.src_heads, buf)
        off = 0
        for s, e, _ in x.runs:
            if every_head:
                dkv2_SBGD[:, s:e] += buf[:, off:off + e - s]
            else:
                dkv2_SBGD[:, s:e].index_add_(3, heads, buf[:, off:off + e - s])
            off += e - s


def subring_backward(c: _Ctx, dout_SBHD: Tensor, q_SBHD: Tensor, k_SBGD: Tensor, v_SBGD: Tensor,
                     out_SBHD: Tensor, lse_SBH: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Returns dq ``[S, B, H, D]``, dk, dv ``[S, B, G, D]`` in the accumulation dtype."""
    acc = acc_dtype(q_SBHD.dtype)
    delta_SBH = (dout_SBHD.to(acc) * out_SBHD).sum(-1)
    steps = c.sched.steps
    kv_next = _post_kv(c, steps[0], k_SBGD, v_SBGD, "kv_bwd") if steps else None
    dq_SBHD, dk_SBGD, dv_SBGD = block_backward(dout_SBHD, q_SBHD, k_SBGD, v_SBGD, out_SBHD, lse_SBH, delta_SBH,
                                               mask_ST=None, causal=True, kv_of_head_H=c.kv_of_head_H,
                                               scale=c.scale, kernel=c.kernel)
    dkv2_SBGD = torch.stack([dk_SBGD, dv_SBGD])
    dkv_pending: tuple[RankStep, tuple] | None = None
    for i, step in enumerate(steps):
        wait_all(kv_next[0])
        kv_cur = kv_next
        kv_next = _post_kv(c, steps[i + 1], k_SBGD, v_SBGD, "kv_bwd") if i + 1 < len(steps) else None
        dkv2_TBGD = None
        if step.computes:
            kv2_TBGD = _assemble_kv2(step, kv_cur[2], k_SBGD.shape[2])
            dkv2_TBGD = _block_backward(c, step, dout_SBHD, q_SBHD, kv2_TBGD, out_SBHD, lse_SBH, delta_SBH, dq_SBHD)
        if dkv_pending is not None:
            wait_all(dkv_pending[1][0])
            _add_dkv(dkv2_SBGD, dkv_pending[0], dkv_pending[1][2])
        dkv_pending = (step, _post_dkv(c, step, dkv2_TBGD, dkv2_SBGD))
    if dkv_pending is not None:
        wait_all(dkv_pending[1][0])
        _add_dkv(dkv2_SBGD, dkv_pending[0], dkv_pending[1][2])
    return dq_SBHD, dkv2_SBGD[0], dkv2_SBGD[1]


class _SubRingAttention(torch.autograd.Function):
    """forward q [S,B,H,D], k/v [S,B,G,D] -> out [S,B,H,D]; backward dout -> dq, dk, dv (same shapes)."""

    @staticmethod
    def forward(ctx, q_SBHD: Tensor, k_SBGD: Tensor, v_SBGD: Tensor, c: _Ctx) -> Tensor:
        out_SBHD, lse_SBH = subring_forward(c, q_SBHD, k_SBGD, v_SBGD)
        ctx.c = c
        ctx.save_for_backward(q_SBHD, k_SBGD, v_SBGD, out_SBHD, lse_SBH)
        return out_SBHD.to(q_SBHD.dtype)

    @staticmethod
    def backward(ctx, dout_SBHD: Tensor):
        q_SBHD, k_SBGD, v_SBGD, out_SBHD, lse_SBH = ctx.saved_tensors
        dq, dk, dv = subring_backward(ctx.c, dout_SBHD, q_SBHD, k_SBGD, v_SBGD, out_SBHD, lse_SBH)
        return dq.to(q_SBHD.dtype), dk.to(k_SBGD.dtype), dv.to(v_SBGD.dtype), None


def subring_attn_func(q_SBHD: Tensor, k_SBGD: Tensor, v_SBGD: Tensor, *, groups: HexiSeqGroups, scale: float,
                      kernel: str = "reference", comm_chunks: int = 1, stats: CommStats | None = None) -> Tensor:
    """Exact causal attention of my group sequence (all groups' K/V taken into account).

    ``q [S, B, H, D]``, ``k, v [S, B, G, D]`` for my group sequence, my query heads and my K/V heads
    (``groups.schedule(comm_chunks)``) -> ``[S, B, H, D]``. A rank with no query heads returns an
    empty ``[S, B, 0, D]`` and takes no part in the exchange.
    """
    sched = groups.schedule(comm_chunks)
    if not sched.heads:
        return q_SBHD * 0  # [S, B, 0, D], keeps the autograd graph
    assert q_SBHD.shape[0] == runs_num_tokens(sched.q_runs), (q_SBHD.shape, sched.q_runs)
    identity = sched.kv_of_head == tuple(range(len(sched.heads))) and len(sched.kv_heads) == len(sched.heads)
    c = _Ctx(sched=sched, groups=groups, scale=scale, kernel=kernel, stats=stats,
             q_pos_S=positions(sched.q_runs, q_SBHD) if any(b > a for a, b in (st.rows for st in sched.steps))
             else None,
             kv_of_head_H=None if identity else _index(sched.kv_of_head, q_SBHD))
    return _SubRingAttention.apply(q_SBHD, k_SBGD, v_SBGD, c)
