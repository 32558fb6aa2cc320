"""Heuristic candidates: simple layouts without a solver, scored by ``estimate`` like the baselines.

They are offered to the final choice next to the baselines and the planner's own candidates, so
the plan is never worse than any of them, and they show what the solver adds.

- ``proportional(hp=k)``: groups of k consecutive canonical ranks (one group per node for
  ``k`` = the node size; for larger k spanning consecutive canonical nodes, of one type where the
  node counts allow: the "cross-node USP" with uneven tokens), tokens per group proportional to
  the group's FLOP rate, even inside the group, the mirrored arrangement, even heads; k every
  head-parallel size and every multiple of the node size that divides the heads (the last group
  may then be smaller).
- ``drop-slowest+usp(k=j,hp=m)``: the j slowest GPU types hold one token per rank at the start of
  the sequence (their node groups are bands before everything else: they attend to almost nothing
  and receive almost no K/V), the other ranks run the best symmetric USP (groups of m consecutive
  canonical ranks, zig-zag over the rest of the sequence). m is tried over the head-parallel sizes
  of the kept ranks down from the largest, at most ``DROP_HP_TRIED`` of them, at least the node size.
- ``drop-slowest+proportional(k=j,hp=m)``: the same, with the kept ranks' groups holding tokens
  proportional to their FLOP rate (mirrored) instead of even ones (when the kept types differ in
  speed the symmetric USP leaves the faster ones idle), m the USP's sizes and the two largest
  multiples of the node size that divide the heads (the last group may be smaller).
- ``knode-<arrangement>(k=j)``: whole nodes of one GPU type, j per group (every j with
  ``j * node size <= heads``; a type's last group takes its remaining nodes), the types slowest
  first, arranged as ``bands`` (each group a block of its own, the slowest first, each band's
  compute time, linear plus attention at its place, equal: ``balanced_bands``) or one mirrored
  block with the slowest group outermost (``mirrored-slow-out``) or the fastest
  (``mirrored-fast-out``), tokens proportional to the FLOP rate. These are the shapes
  ``bench/planner_counters.py`` sweeps; Stage I's groupings of k same-type nodes are split by the
  surrogate, which can misjudge the cost model's ring order and bands, so they are also offered as
  they are.

Every heuristic is built on the canonical cluster (``planner.canonical``) like the baselines.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from megatron_hexiseq.cluster import Cluster
from megatron_hexiseq.costmodel.formulas import attention_s_per_pair_head, linear_s_per_token
from megatron_hexiseq.layout import Layout, split_evenly
from megatron_hexiseq.model import ModelSpec
from megatron_hexiseq.planner.baselines import Baseline, even_in_groups, head_parallel_sizes
from megatron_hexiseq.planner.canonical import canonical_cluster, to_original
from megatron_hexiseq.planner.stage1_groups import node_blocks
from megatron_hexiseq.run_config import TrainOptions

DROP_HP_TRIED = 2  # head-parallel sizes tried for the USP on the kept ranks (largest first)
KNODE_ARRANGEMENTS = ("bands", "mirrored-slow-out", "mirrored-fast-out")


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


def _types_slow_first(cluster: Cluster) -> list[str]:
    """GPU types by FLOP rate, then attention rate, then network, slowest first."""
    rate = {
        d.gpu.name: (d.flops_per_s, d.attention_flops_per_s, d.network_GBps)
        for d in cluster.devices
    }
    return sorted(rate, key=lambda t: rate[t])


def knode_groups(cluster: Cluster, k: int, types: Sequence[str]) -> list[list[int]]:
    """Groups of k whole nodes of one GPU type, the types in the order given, each type's nodes in
    the cluster's order (its last group takes the remaining nodes)."""
    nodes = node_blocks(cluster)
    groups = []
    for t in types:
        of_type = [b for b in nodes if cluster.devices[b[0]].gpu.name == t]
        for i in range(0, len(of_type), k):
            groups.append([r for b in of_type[i : i + k] for r in b])
    return groups


def balanced_bands(
    cluster: Cluster, model: ModelSpec, groups: Sequence[Sequence[int]], total: int
) -> list[int]:
    """Tokens per band (the groups in sequence order, each a band from the start) so that every
    band's compute time is the same: a band of T tokens at P on n ranks takes
    ``(T/n) lin + (H/n) att T (2P + T) / 2`` (its first rank's device; ``lin`` per token, ``att``
    per causal pair and head, ``costmodel.formulas``); each band at least one token per rank."""
    H, opts = model.num_attention_heads, TrainOptions()
    rates = []
    for g in groups:
        d, n = cluster.devices[g[0]], len(g)
        rates.append(
            (
                linear_s_per_token(model, d, opts) / n,
                H * attention_s_per_pair_head(model, d, opts) / n,
            )
        )

    def fill(tau: float) -> list[int]:
        P, out = 0, []
        for (lin, att), g in zip(rates, groups):
            a, b = att / 2, lin + att * P  # a T^2 + b T = tau
            T = (-b + math.sqrt(b * b + 4 * a * tau)) / (2 * a) if a > 0 else tau / b
            out.append(max(len(g), int(T)))
            P += out[-1]
        return out

    lo, hi = 0.0, 1.0
    while sum(fill(hi)) < total:
        hi *= 2
    for _ in range(100):
        mid = (lo + hi) / 2
        if sum(fill(mid)) < total:
            lo = mid
        else:
            hi = mid
    out = fill(hi)
    excess = sum(out) - total
    for i in range(len(out) - 1, -1, -1):  # the rounding off the last (fastest) bands
        take = min(excess, out[i] - len(groups[i]))
        out[i] -= take
        excess -= take
    return out


def knode(cluster: Cluster, model: ModelSpec, seq_length: int, k: int, arrangement: str) -> Layout:
    """``knode-<arrangement>(k)`` (see the module docstring)."""
    groups = knode_groups(cluster, k, _types_slow_first(cluster))
    n = len(groups)
    if arrangement == "bands":
        tokens = balanced_bands(cluster, model, groups, seq_length)
        blocks = [[i] for i in range(n)]
    else:
        rate = [sum(cluster.devices[r].flops_per_s for r in g) for g in groups]
        tokens = _largest_remainder(rate, seq_length, [len(g) for g in groups])
        order = list(range(n))
        blocks = [order if arrangement == "mirrored-slow-out" else order[::-1]]
    return even_in_groups(cluster, model, seq_length, groups, tokens, blocks)


def _node_multiples(node: int, heads: int, ranks: int) -> list[int]:
    """Group sizes of whole nodes that divide the heads, up to ``ranks`` (a last group of
    ``ranks`` may then be smaller)."""
    return [hp for hp in range(node, min(heads, ranks) + 1, node) if heads % hp == 0]


def drop_proportional(
    cluster: Cluster, model: ModelSpec, seq_length: int, slow: set[str], hp: int
) -> Layout:
    """The GPU types ``slow`` hold one token per rank at the start; groups of ``hp`` consecutive
    kept ranks (the last may be smaller) with tokens proportional to their FLOP rate (mirrored) on
    the rest."""
    dropped = [b for b in node_blocks(cluster) if cluster.devices[b[0]].gpu.name in slow]
    kept = [r for r in range(cluster.world_size) if cluster.devices[r].gpu.name not in slow]
    groups = [kept[i : i + hp] for i in range(0, len(kept), hp)]
    rest = seq_length - sum(len(b) for b in dropped)
    rate = [sum(cluster.devices[r].flops_per_s for r in g) for g in groups]
    tokens = [len(b) for b in dropped] + _largest_remainder(rate, rest, [len(g) for g in groups])
    lead = len(dropped)
    blocks = [[i] for i in range(lead)] + [list(range(lead, lead + len(groups)))]
    return even_in_groups(
        cluster, model, seq_length, [list(b) for b in dropped] + groups, tokens, blocks
    )


def heuristic_layouts(cluster: Cluster, model: ModelSpec, seq_length: int) -> list[Baseline]:
    """Every heuristic candidate for this cluster and model (see the module docstring), numbered for
    ``cluster``; ``layout`` is None with a ``reason`` when one cannot be built."""
    canon, order = canonical_cluster(cluster)
    W, H = canon.world_size, model.num_attention_heads
    node = min(len(b) for b in node_blocks(canon))
    out: list[Baseline] = []
    if seq_length < W:
        return out
    sizes = sorted(
        {node}
        | {hp for hp in head_parallel_sizes(W, H) if hp > node}
        | set(_node_multiples(node, H, W))
    )
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
        if kept == 0:  # one GPU type on nodes of different networks: nothing is left to keep
            continue
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
        if seq_length - (W - kept) < kept:
            continue
        tried = sorted(hps, reverse=True)[:DROP_HP_TRIED]  # the USP's, and whole-node groups
        tried += sorted(_node_multiples(node, H, kept), reverse=True)[:DROP_HP_TRIED]
        for hp in sorted(set(tried), reverse=True):
            out.append(
                Baseline(
                    "drop-slowest+proportional",
                    {"k": k, "hp": hp, "dropped_types": sorted(slow)},
                    to_original(drop_proportional(canon, model, seq_length, slow, hp), order),
                )
            )
    per_type = max(
        sum(1 for b in node_blocks(canon) if canon.devices[b[0]].gpu.name == t)
        for t in {d.gpu.name for d in canon.devices}
    )
    for k in range(1, per_type + 1):
        if k * node > H or W > seq_length:
            break
        for arrangement in KNODE_ARRANGEMENTS:
            out.append(
                Baseline(
                    f"knode-{arrangement}",
                    {"k": k, "arrangement": arrangement},
                    to_original(knode(canon, model, seq_length, k, arrangement), order),
                )
            )
    return out
