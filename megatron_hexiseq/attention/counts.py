"""What the attention runtime will count, computed from the layout alone (no processes, no tensors).

``rank_counts(layout, rank, ...)`` returns, for one rank and one forward+backward call, exactly the
totals a ``CommStats`` passed to ``hexiseq_attn_func`` records on that rank (tested equal): bytes
sent and received per kind (``a2a``, ``a2a_bwd``, ``kv``, ``kv_bwd``, ``dkv``) and, per ``local`` /
``remote``, blocks, kernel calls and (query, key) pairs x query heads. It reads the same schedules
the runtime executes (``peers.build_schedule`` / ``documents.document_schedule``), so a cost model
that prices document boundaries can be checked against the runtime without running it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from megatron_hexiseq.attention.documents import DocumentBounds, document_schedule, window_pairs
from megatron_hexiseq.attention.peers import build_schedule, runs_num_tokens
from megatron_hexiseq.layout import Layout


@dataclass(frozen=True)
class RankCounts:
    """One rank's totals for one forward+backward (the ``CommStats`` kinds; bytes)."""

    sent: dict[str, int] = field(default_factory=dict)
    received: dict[str, int] = field(default_factory=dict)
    blocks: dict[str, int] = field(default_factory=dict)
    calls: dict[str, int] = field(default_factory=dict)
    pairs: dict[str, int] = field(default_factory=dict)


def rank_counts(
    layout: Layout,
    rank: int,
    *,
    documents: DocumentBounds | None = None,
    comm_chunks: int = 1,
    batch: int = 1,
    head_dim: int,
    element_bytes: int,
    wire_bytes: int | None = None,
    varlen: bool = False,
) -> RankCounts:
    """``element_bytes``: size of the input dtype; ``wire_bytes``: of the dK/dV wire dtype (default
    the input dtype; 4 with ``fp32_grad_wire``); ``varlen``: the kernel runs a block's windows as
    one variable-length call (``flash`` on CUDA)."""
    B, D, e = batch, head_dim, element_bytes
    wire = wire_bytes if wire_bytes is not None else e
    me = layout.ranks[rank]
    sent = {k: 0 for k in ("a2a", "a2a_bwd", "kv", "kv_bwd", "dkv")}
    received = dict(sent)
    blocks, calls, pairs = (
        {"local": 0, "remote": 0},
        {"local": 0, "remote": 0},
        {"local": 0, "remote": 0},
    )
    group = layout.group_of(rank)
    if len(group.ranks) > 1:  # head all-to-all (q, k, v in; out back), and its dual in backward
        H, G = len(me.heads), len(layout.kv_heads(rank))
        for j in group.ranks:
            if j == rank:
                continue
            hj, gj, sj = (
                len(layout.ranks[j].heads),
                len(layout.kv_heads(j)),
                layout.ranks[j].num_tokens,
            )
            out_send = me.num_tokens * B * D * (hj + 2 * gj) + sj * B * H * D
            out_recv = sj * B * D * (H + 2 * G) + me.num_tokens * B * hj * D
            sent["a2a"] += out_send * e
            received["a2a"] += out_recv * e
            sent["a2a_bwd"] += out_recv * e
            received["a2a_bwd"] += out_send * e
    if not me.heads:
        return RankCounts(sent, received, blocks, calls, pairs)
    sched = (
        build_schedule(layout, rank, comm_chunks)
        if documents is None
        else document_schedule(layout, rank, documents, comm_chunks)
    )
    H = len(sched.heads)
    S = runs_num_tokens(sched.q_runs)
    blocks["local"] = 1
    if sched.local_windows is None:
        calls["local"] = 1
        pairs["local"] = H * B * S * (S + 1) // 2
    else:
        calls["local"] = 1 if varlen else len(sched.local_windows)
        pairs["local"] = H * window_pairs(sched.local_windows, B, causal=True)
    for step in sched.steps:
        for x in step.sends:
            n = x.num_tokens * len(x.src_heads) * 2 * B * D
            sent["kv"] += n * e
            sent["kv_bwd"] += n * e
            received["dkv"] += n * wire
        for x in step.recvs:
            n = x.num_tokens * len(x.dst_heads) * 2 * B * D
            received["kv"] += n * e
            received["kv_bwd"] += n * e
            sent["dkv"] += n * wire
        if not step.recvs:
            continue
        blocks["remote"] += 1
        if step.windows is None:
            calls["remote"] += len(step.calls)
            pairs["remote"] += H * B * sum((hi - lo) * keys for lo, hi, keys in step.calls)
        else:
            calls["remote"] += 1 if varlen and len(step.windows) > 1 else len(step.windows)
            pairs["remote"] += H * window_pairs(step.windows, B, causal=False)
    return RankCounts(sent, received, blocks, calls, pairs)
