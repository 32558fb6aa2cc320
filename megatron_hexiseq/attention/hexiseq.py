"""HexiSeq attention: ragged head all-to-all inside the A2A group + sub-ring K/V exchange across groups.

Legend: s = my tokens, S = my group's tokens (group sequence), B = micro-batch, D = head dim,
H_all / G_all = all query / K/V heads, H / G = my query / K/V heads (``layout.ranks[r].heads``,
``layout.kv_heads(r)``); member j of my A2A group has s_j tokens, H_j query heads, G_j K/V heads.

    q [s, B, H_all, D], k/v [s, B, G_all, D]                     (my tokens, every head)
      -- pack: for each member j: q[:, :, H_j], k[:, :, G_j], v[:, :, G_j], flattened, concatenated
      -- uneven_all_to_all (one collective for q, k and v)
      -- unpack: from member i: [s_i, B, H, D], [s_i, B, G, D] x2; concatenate the members'
         segments on dim 0 in position order (``peers.group_pieces``)
    q [S, B, H, D], k/v [S, B, G, D]                            (my group's tokens by position, my heads)
      -- subring_attn_func (K/V of other groups in rounds, LSE merge)
    out [S, B, H, D]
      -- for each member j: rows of j's segments (in j's order), flattened; uneven_all_to_all
      -- from member i: [s, B, H_i, D]; concatenate on dim 2 (member order), reorder heads to 0..H_all-1
    out [s, B, H_all * D]

A K/V head needed by several members is packed once per member (backward sums their gradients).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor

from megatron_hexiseq.attention.comm import CommStats, uneven_all_to_all
from megatron_hexiseq.attention.documents import DocumentBounds, parse_cu_seqlens
from megatron_hexiseq.attention.groups import HexiSeqGroups
from megatron_hexiseq.attention.kernels import Kernel, resolve_kernel
from megatron_hexiseq.attention.peers import group_pieces
from megatron_hexiseq.attention.subring import select_heads, subring_attn_func


def _members(groups: HexiSeqGroups) -> list[tuple[int, int, tuple[int, ...], tuple[int, ...]]]:
    """(layout rank, tokens, query heads, K/V heads) of every member of my A2A group, ascending."""
    lay = groups.layout
    return [
        (j, lay.ranks[j].num_tokens, lay.ranks[j].heads, lay.kv_heads(j))
        for j in lay.group_of(groups.rank).ranks
    ]


class _PackHeads(torch.autograd.Function):
    """Send buffer of the head all-to-all, one copy, no zero-filled full-size gradients.

    forward: q [s, B, H_all, D], k/v [s, B, G_all, D] -> flat [sum_j s*B*D*(|H_j| + 2|G_j|)], member j's
    chunk = (q[:, :, H_j], k[:, :, G_j], v[:, :, G_j]) flattened. backward: the inverse gather; query
    heads go to exactly one member (plain copies), K/V heads may go to several (summed).
    """

    @staticmethod
    def forward(
        ctx, q_sBHD: Tensor, k_sBGD: Tensor, v_sBGD: Tensor, heads: tuple, groups: HexiSeqGroups
    ) -> Tensor:
        s, B, _, D = q_sBHD.shape
        ctx.heads, ctx.shapes, ctx.groups = heads, (q_sBHD.shape, k_sBGD.shape), groups
        flat = q_sBHD.new_empty(sum(s * B * D * (len(hj) + 2 * len(gj)) for hj, gj in heads))
        off = 0
        for hj, gj in heads:
            for x, ix in ((q_sBHD, hj), (k_sBGD, gj), (v_sBGD, gj)):
                n = s * B * len(ix) * D
                flat[off : off + n].view(s, B, len(ix), D).copy_(
                    select_heads(x, 2, ix, x.shape[2], groups)
                )
                off += n
        return flat

    @staticmethod
    def backward(ctx, grad_N: Tensor):
        q_shape, k_shape = ctx.shapes
        s, B, _, D = q_shape
        dq = grad_N.new_empty(q_shape)
        dk, dv = grad_N.new_zeros(k_shape), grad_N.new_zeros(k_shape)
        off = 0
        for hj, gj in ctx.heads:
            for dx, ix, first in ((dq, hj, True), (dk, gj, False), (dv, gj, False)):
                n = s * B * len(ix) * D
                piece = grad_N[off : off + n].view(s, B, len(ix), D)
                if ix and first:
                    dx.index_copy_(2, ctx.groups.index(ix, dx.device), piece)
                elif ix:
                    dx.index_add_(2, ctx.groups.index(ix, dx.device), piece)
                off += n
        return dq, dk, dv, None, None


class _PackRows(torch.autograd.Function):
    """Send buffer of the output all-to-all: rows of [S, B, h, D] in the given (start, end) order,
    flattened (one copy). The row ranges partition [0, S), so backward is a plain scatter."""

    @staticmethod
    def forward(ctx, x_SBhD: Tensor, rows: tuple) -> Tensor:
        ctx.rows, ctx.shape = rows, x_SBhD.shape
        per_row = x_SBhD[0].numel() if x_SBhD.shape[0] else 0
        flat = x_SBhD.new_empty(x_SBhD.numel())
        off = 0
        for a, b in rows:
            flat[off : off + (b - a) * per_row].view(b - a, *x_SBhD.shape[1:]).copy_(x_SBhD[a:b])
            off += (b - a) * per_row
        return flat

    @staticmethod
    def backward(ctx, grad_N: Tensor):
        dx = grad_N.new_empty(ctx.shape)
        per_row = dx[0].numel() if dx.shape[0] else 0
        off = 0
        for a, b in ctx.rows:
            dx[a:b] = grad_N[off : off + (b - a) * per_row].view(b - a, *ctx.shape[1:])
            off += (b - a) * per_row
        return dx, None


def heads_to_group(
    q_sBHD: Tensor,
    k_sBGD: Tensor,
    v_sBGD: Tensor,
    *,
    groups: HexiSeqGroups,
    stats: CommStats | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """[s, B, H_all, D], [s, B, G_all, D] x2 -> [S, B, H, D], [S, B, G, D] x2 (see module docstring)."""
    s, B, H_all, D = q_sBHD.shape
    if groups.a2a_group is None:  # a group of one rank: my tokens (sorted) are the group sequence
        return q_sBHD, k_sBGD, v_sBGD
    members = _members(groups)
    me = groups.layout.ranks[groups.rank]
    H, G = len(me.heads), len(groups.layout.kv_heads(groups.rank))
    send = [s * B * D * (len(hj) + 2 * len(gj)) for _, _, hj, gj in members]
    recv = [si * B * D * (H + 2 * G) for _, si, _, _ in members]
    packed = _PackHeads.apply(
        q_sBHD, k_sBGD, v_sBGD, tuple((hj, gj) for _, _, hj, gj in members), groups
    )
    flat = uneven_all_to_all(
        packed,
        group=groups.a2a_group,
        send_splits=send,
        recv_splits=recv,
        stats=stats,
        peers=[j for j, _, _, _ in members],
    )
    qs, ks, vs = {}, {}, {}
    for (j, si, _, _), chunk in zip(members, flat.split(recv)):
        q_i, k_i, v_i = chunk.split([si * B * H * D, si * B * G * D, si * B * G * D])
        qs[j], ks[j], vs[j] = q_i.view(si, B, H, D), k_i.view(si, B, G, D), v_i.view(si, B, G, D)
    pieces = group_pieces(groups.layout, groups.layout.ranks[groups.rank].group)
    return (
        _in_position_order(qs, pieces),
        _in_position_order(ks, pieces),
        _in_position_order(vs, pieces),
    )


def _in_position_order(by_member: dict[int, Tensor], pieces) -> Tensor:
    """Members' tokens {j: [s_j, B, h, D]} -> the group sequence [S, B, h, D] in position order."""
    parts = [
        by_member[j] if (a, b) == (0, by_member[j].shape[0]) else by_member[j][a:b]
        for j, a, b, _ in pieces
    ]
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def group_to_tokens(
    out_SBHD: Tensor, *, groups: HexiSeqGroups, num_heads: int, stats: CommStats | None = None
) -> Tensor:
    """[S, B, H, D] (my heads, group tokens) -> [s, B, H_all * D] (all heads, my tokens)."""
    _, B, H, D = out_SBHD.shape
    s = groups.layout.ranks[groups.rank].num_tokens
    if groups.a2a_group is None:  # a group of one rank holds every head of its own tokens
        return out_SBHD.reshape(s, B, num_heads * D)
    members = _members(groups)
    send = [sj * B * H * D for _, sj, _, _ in members]
    recv = [s * B * len(hi) * D for _, _, hi, _ in members]
    rows: dict[int, list[tuple[int, int]]] = {
        j: [] for j, _, _, _ in members
    }  # member j's tokens = these rows of the group sequence
    for j, a, b, off in group_pieces(groups.layout, groups.layout.ranks[groups.rank].group):
        rows[j].append((off, off + b - a))
    flat_N = _PackRows.apply(out_SBHD, tuple(r for j, _, _, _ in members for r in rows[j]))
    flat = uneven_all_to_all(
        flat_N,
        group=groups.a2a_group,
        send_splits=send,
        recv_splits=recv,
        stats=stats,
        peers=[j for j, _, _, _ in members],
    )
    parts = [
        chunk.view(s, B, len(hi), D)
        for (_, _, hi, _), chunk in zip(members, flat.split(recv))
        if hi
    ]
    out_sBHD = torch.cat(parts, dim=2)
    order = [h for _, _, hi, _ in members for h in hi]
    if order != list(range(num_heads)):
        where = {h: i for i, h in enumerate(order)}
        out_sBHD = select_heads(
            out_sBHD, 2, tuple(where[h] for h in range(num_heads)), num_heads, groups
        )
    return out_sBHD.reshape(s, B, num_heads * D)


def hexiseq_attn_func(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    groups: HexiSeqGroups,
    softmax_scale: float | None = None,
    kernel: str | Kernel = Kernel.AUTO,
    comm_chunks: int = 1,
    stats: CommStats | None = None,
    fp32_grad_wire: bool = False,
    cu_seqlens: Any = None,
) -> Tensor:
    """Exact causal (GQA/MQA) attention of the full sequence, restricted to this rank's tokens.

    ``q [s_r, B, H, D]``, ``k, v [s_r, B, G, D]``: this rank's tokens in segment order (RoPE
    applied), every head. Returns ``[s_r, B, H * D]``; differentiable in q, k, v.
    ``kernel``: a ``kernels.Kernel`` or its name (``auto`` picks by device and dtype). ``comm_chunks``:
    each sub-ring round's K/V is sent in this many token pieces, each a separate P2P step overlapped
    with the previous piece's block compute (see ``peers.py``); every rank must pass the same value in
    a given call. ``fp32_grad_wire``: return dK/dV to their holders in float32 instead of the input
    dtype. ``stats``: optional byte/block counter. ``cu_seqlens``: packed documents, boundaries in
    global positions ``[0, b1, ..., S]`` (the same on every rank), or one such list per sample, or a
    ``documents.DocumentBounds``; attention is then causal inside each document and nothing crosses
    a boundary, and only K/V some document needs is exchanged (``documents.py``). ``None``: one
    document (today's behaviour, bit for bit).
    """
    lay = groups.layout
    H, G = lay.num_attention_heads, lay.num_query_groups
    s_r = lay.ranks[groups.rank].num_tokens
    if (
        q.dim() != 4
        or k.shape != v.shape
        or q.shape[0] != s_r
        or q.shape[2] != H
        or k.shape[2] != G
        or k.shape[0] != s_r
        or k.shape[1] != q.shape[1]
        or k.shape[3] != q.shape[3]
    ):
        raise ValueError(
            f"layout rank {groups.rank} expects q [{s_r}, b, {H}, d] and k, v [{s_r}, b, {G}, d]; "
            f"got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    documents = None
    if isinstance(cu_seqlens, DocumentBounds):
        documents = cu_seqlens.for_batch(lay.seq_length, q.shape[1])
    elif cu_seqlens is not None:
        documents = parse_cu_seqlens(cu_seqlens, seq_length=lay.seq_length, batch=q.shape[1])
    concrete = resolve_kernel(kernel, device=q.device, dtype=q.dtype, head_dim=q.shape[3])
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(q.shape[3])
    q_SBHD, k_SBGD, v_SBGD = heads_to_group(q, k, v, groups=groups, stats=stats)
    out_SBHD = subring_attn_func(
        q_SBHD,
        k_SBGD,
        v_SBGD,
        groups=groups,
        scale=scale,
        kernel=concrete,
        comm_chunks=comm_chunks,
        stats=stats,
        fp32_grad_wire=fp32_grad_wire,
        documents=documents,
    )
    return group_to_tokens(out_SBHD, groups=groups, num_heads=H, stats=stats)
