"""Heuristic candidates: simple layouts without a solver, scored by ``estimate`` like the baselines.

They are offered to the final choice next to the baselines and the planner's own candidates, so
the plan is never worse than any of them, and they show what the solver adds.

- ``proportional(hp=k)``: groups of k consecutive canonical ranks (one group per node for
  ``k`` = the node size; for larger k spanning consecutive canonical nodes, of one type where the
  node counts allow: the "cross-node USP" with uneven tokens), tokens per group proportional to the group's FLOP rate, even inside the group, the
  mirrored arrangement, even heads.
- ``drop-slowest+usp(k=j,hp=m)``: the j slowest GPU types hold one token per rank at the start of
  the sequence (their node groups are bands before everything else: they attend to almost nothing
  and receive almost no K/V), the other ranks run the best symmetric USP (groups of m consecutive
  canonical ranks, zig-zag over the rest of the sequence). m is tried over the head-parallel sizes
  of the kept ranks down from the largest, at most ``DROP_HP_TRIED`` of them, at least the node size.

Every heuristic is built on the canonical cluster (``planner.canonical``) like the baselines.
"""

from __future__ import annotations

from collections.abc import Sequence

from megatron_hexiseq.cluster import Cluster
from megatron_hexiseq.layout import Layout, split_evenly
from megatron_hexiseq.model import ModelSpec
from megatron_hexiseq.planner.baselines import Baseline, even_in_groups, head_parallel_sizes
from megatron_hexiseq.planner.canonical import canonical_cluster, to_original
from megatron_hexiseq.planner.stage1_groups import node_blocks

DROP_HP_TRIED = 2  # head-parallel sizes tried for the USP on the kept ranks (largest first)


def _largest_remainder(weights: Sequence[float], total: int, low: Sequence[int]) -> list[int]:
    """Integers >= ``low`` summing to ``total``, proportional to ``weights`` beyond the minimum."""
    rest = total - sum(low)
    w = sum(weights)
    shares = [rest * x / w for x in weights]
    out = [lo + int(s) for lo, s in zip(low, shares)]
    order = sorted(range(len(out)), key=lambda i: (-(shares[i] - int(shares[i])), i))
    for i in order[: total - sum(out)]:
        out[i] += 1
    return out


def proportional(cluster: Cluster, model: ModelSpec, seq_length: int, hp: int) -> Layout:
    """Groups of ``hp`` consecutive ranks, tokens per group proportional to its FLOP rate, mirrored."""
    W = cluster.world_size
    groups = [list(range(i, min(W, i + hp))) for i in range(0, W, hp)]
    rate = [sum(cluster.devices[r].flops_per_s for r in g) for g in groups]
    tokens = _largest_remainder(rate, seq_length, [len(g) for g in groups])
    return even_in_groups(cluster, model, seq_length, groups, tokens)


def drop_slowest(
    cluster: Cluster, model: ModelSpec, seq_length: int, types: int, hp: int
) -> Layout:
    """The ``types`` slowest GPU types hold one token per rank at the start; USP(hp) on the rest."""
    speed = sorted({(d.flops_per_s, d.network_GBps, d.gpu.name) for d in cluster.devices})
    slow = {name for _, _, name in speed[:types]}
    dropped = [b for b in node_blocks(cluster) if cluster.devices[b[0]].gpu.name in slow]
    kept = [r for r in range(cluster.world_size) if cluster.devices[r].gpu.name not in slow]
    usp = [kept[i : i + hp] for i in range(0, len(kept), hp)]
    rest = seq_length - sum(len(b) for b in dropped)
    groups = [list(b) for b in dropped] + usp
    tokens = [len(b) for b in dropped] + split_evenly(rest, len(usp))
    blocks = [[i] for i in range(len(dropped))] + [list(range(len(dropped), len(groups)))]
    return even_in_groups(cluster, model, seq_length, groups, tokens, blocks)


def heuristic_layouts(cluster: Cluster, model: ModelSpec, seq_length: int) -> list[Baseline]:
    """Every heuristic candidate for this cluster and model (see the module docstring), numbered for
    ``cluster``; ``layout`` is None with a ``reason`` when one cannot be built."""
    canon, order = canonical_cluster(cluster)
    W, H = canon.world_size, model.num_attention_heads
    node = min(len(b) for b in node_blocks(canon))
    out: list[Baseline] = []
    if seq_length < W:
        return out
    sizes = sorted({node} | {hp for hp in head_parallel_sizes(W, H) if hp > node})
    for hp in sizes:
        out.append(
            Baseline(
                "proportional",
                {"hp": hp, "spans_nodes": hp > node},
                to_original(proportional(canon, model, seq_length, hp), order),
            )
        )
    types = sorted({(d.flops_per_s, d.network_GBps, d.gpu.name) for d in canon.devices})
    for k in range(1, len(types)):
        slow = {name for _, _, name in types[:k]}
        kept = sum(d.gpu.name not in slow for d in canon.devices)
        hps = [
            hp
            for hp in head_parallel_sizes(kept, H) + ([kept] if H % kept == 0 else [])
            if hp >= node
        ]
        for hp in sorted(hps, reverse=True)[:DROP_HP_TRIED]:
            cfg = {"k": k, "hp": hp, "dropped_types": sorted(slow)}
            if seq_length - (W - kept) < kept:
                out.append(
                    Baseline(
                        "drop-slowest+usp", cfg, None, "the kept ranks have fewer tokens than ranks"
                    )
                )
                continue
            out.append(
                Baseline(
                    "drop-slowest+usp",
                    cfg,
                    to_original(drop_slowest(canon, model, seq_length, k, hp), order),
                )
            )
    return out
