"""Turn planner decisions (groups, tokens per rank, heads per rank) into a ``Layout``.

Causal balance ("mirrored head+tail" arrangement). Group ``g`` (in planning order) owns a head chunk
``[o_g, o_g + T_g//2)`` and a mirrored tail chunk ``[S - o_g - ceil(T_g/2), S - o_g)`` where ``o_g`` is
the sum of the earlier groups' head halves. For a chunk pair of equal length ``n`` at mirrored
offsets the causal query-key pairs are exactly ``n*(S+1)`` whatever the offset (sum of ``p+1`` over
both chunks), so a group's attention work is ``T_g*(S+1)/2`` pairs: proportional to its token count.
This is Megatron's 2xCP zig-zag generalised to uneven group sizes. The same holds inside a block
``[P, Q)`` of the sequence (``planner.arrange`` cuts the sequence into blocks): a mirrored pair of
n tokens there has ``n (P + Q + 1) / 2`` causal pairs. Inside a group, the group sequence is
``head chunk ++ tail chunk`` and each member rank takes a consecutive piece of it in ascending rank
order (at most two segments per rank). Heads go to member ranks as consecutive index ranges in rank
order, which keeps GQA ranks on as few K/V heads as possible.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from megatron_hexiseq.cluster import Cluster
from megatron_hexiseq.layout import Layout, Segment, make_layout


def mirrored_group_chunks(
    seq_length: int, group_tokens: Sequence[int]
) -> list[tuple[Segment, Segment]]:
    """Per group: (head chunk, tail chunk) as [start, end) pairs; empty chunks have start == end.

    ``group_tokens`` must sum to ``seq_length``.
    """
    assert sum(group_tokens) == seq_length, (sum(group_tokens), seq_length)
    out, front, back = [], 0, seq_length
    for t in group_tokens:
        head = t // 2
        tail = t - head
        out.append(((front, front + head), (back - tail, back)))
        front += head
        back -= tail
    assert front == back, (front, back)
    return out


def split_group_sequence(
    chunks: tuple[Segment, Segment], rank_tokens: Sequence[int]
) -> list[list[Segment]]:
    """Consecutive pieces of ``head ++ tail`` of sizes ``rank_tokens`` -> segments per rank."""
    pieces: list[Segment] = [c for c in chunks if c[1] > c[0]]
    # merge when the head chunk touches the tail chunk (the innermost group)
    if len(pieces) == 2 and pieces[0][1] == pieces[1][0]:
        pieces = [(pieces[0][0], pieces[1][1])]
    out: list[list[Segment]] = []
    idx, pos = 0, pieces[0][0] if pieces else 0
    for n in rank_tokens:
        segs: list[Segment] = []
        while n > 0:
            s, e = pieces[idx]
            take = min(n, e - pos)
            segs.append((pos, pos + take))
            n -= take
            pos += take
            if pos == e and idx + 1 < len(pieces):
                idx += 1
                pos = pieces[idx][0]
        out.append(segs)
    return out


def head_ranges(head_counts: Sequence[int]) -> list[list[int]]:
    """Consecutive query-head indices per rank: [2, 1, 1] -> [[0, 1], [2], [3]]."""
    out, start = [], 0
    for h in head_counts:
        out.append(list(range(start, start + h)))
        start += h
    return out


def build_layout(
    *,
    seq_length: int,
    num_attention_heads: int,
    num_query_groups: int,
    groups: Sequence[Sequence[int]],
    rank_tokens: Sequence[int],
    rank_heads: Sequence[int],
    hosts: Sequence[str],
    gpus: Sequence[str],
    blocks: Sequence[Sequence[int]] | None = None,
    **extra: Any,
) -> Layout:
    """Build a Layout from groups (lists of cluster ranks, in planning order) and per-rank counts.

    ``rank_tokens[r]`` / ``rank_heads[r]`` are indexed by cluster rank. ``blocks``: indices into
    ``groups``, consecutive blocks of the sequence in order (``planner.arrange``); the groups of a
    block share it in the mirrored arrangement, the first outermost. Default: one block of every
    group in the order given (group 0 outermost: first and last tokens). Groups are numbered in
    block order, which is the sub-ring order.
    """
    world = len(rank_tokens)
    blocks = [list(range(len(groups)))] if blocks is None else [list(b) for b in blocks]
    order = [i for b in blocks for i in b]
    assert sorted(order) == list(range(len(groups))), "blocks must list every group once"
    group_tokens = [sum(rank_tokens[r] for r in g) for g in groups]
    chunks: dict[int, tuple[Segment, Segment]] = {}
    start = 0
    for b in blocks:
        size = sum(group_tokens[i] for i in b)
        for i, (head, tail) in zip(b, mirrored_group_chunks(size, [group_tokens[i] for i in b])):
            chunks[i] = ((head[0] + start, head[1] + start), (tail[0] + start, tail[1] + start))
        start += size
    assert start == seq_length, (start, seq_length)
    segments: list[list[Segment]] = [[] for _ in range(world)]
    heads: list[list[int]] = [[] for _ in range(world)]
    for i in order:
        members = sorted(groups[i])
        for r, segs in zip(
            members, split_group_sequence(chunks[i], [rank_tokens[r] for r in members])
        ):
            segments[r] = segs
        for r, hs in zip(members, head_ranges([rank_heads[r] for r in members])):
            heads[r] = hs
    return make_layout(
        seq_length=seq_length,
        num_attention_heads=num_attention_heads,
        num_query_groups=num_query_groups,
        groups=[sorted(groups[i]) for i in order],
        segments=segments,
        heads=heads,
        hosts=hosts,
        gpus=gpus,
        **extra,
    )


def hosts_and_gpus(cluster: Cluster) -> tuple[list[str], list[str]]:
    """Host name and GPU type name of every cluster rank (layout rank r runs on devices[r])."""
    return [d.node for d in cluster.devices], [d.gpu.name for d in cluster.devices]


def with_fields(layout: Layout, **fields: Any) -> Layout:
    """A copy of ``layout`` with its non-structural fields (predicted, baselines, planner, meta) replaced."""
    kw: dict[str, Any] = dict(
        seq_length=layout.seq_length,
        num_attention_heads=layout.num_attention_heads,
        num_query_groups=layout.num_query_groups,
        world_size=layout.world_size,
        groups=layout.groups,
        ranks=layout.ranks,
        tensor_model_parallel_size=layout.tensor_model_parallel_size,
        predicted=layout.predicted,
        baselines=layout.baselines,
        planner=layout.planner,
        meta=layout.meta,
    )
    kw.update(fields)
    return Layout(**kw)
