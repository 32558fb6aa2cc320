"""Stage I: A2A group formation inside high-bandwidth domains (nodes).

Topology-aware: groups are formed inside nodes, so the ragged all-to-all (the heavy, per-layer
traffic) stays on NVLink/PCIe inside a node, and only the overlapped K/V sub-ring traffic crosses
the slow network. The one cross-node candidate is a single group of all ranks (uneven Ulysses),
scored with the network bandwidth for its all-to-all; it wins when the K/V exchange would cost
more than the all-to-all over the network (e.g. few fast GPUs spread over several nodes). It is
offered up to ``SINGLE_GROUP_MAX_GPUS`` GPUs (beyond, an all-to-all over every rank and the network
never wins in the cost model, and scoring it is quadratic in the ranks) and only when every rank can
hold a head (``W <= H``): with more ranks than heads the continuous split spreads fractions of a head
over all ranks, but whole heads leave most ranks without attention and the rest with all of it
(planner_scale, 128 GPUs, 40 heads: 69.7 s continuous, 200 s as integers; its Stage III and cost-model
scoring were a fifth of the planner's time there).

Candidates: nodes are grouped into *classes* (same GPU type, count, bandwidths, memory); each class
splits its nodes into equal groups of a size ``s`` dividing the GPU count (``s = count``: one group per
node, the [Foundation] planner; ``s = 1``: ring-like). Different classes may pick different sizes, so
groups of different sizes coexist. Search: coordinate descent over the classes, starting from one
group per node, each grouping scored by Stage II's coarse phase split (3 linear bounds, ``stage2_split``; an
upper bound of its phase optimum) — the surrogate cost model prunes; the ``top_k`` best groupings
get the full phase split and go on to Stages III and ``estimate``.
"""
from __future__ import annotations

import itertools
from typing import Any, Sequence

from megatron_hexiseq.planner.stage2_split import GroupCoef, Split, split_sequence
from megatron_hexiseq.planner.surrogate import Surrogate

Grouping = tuple[tuple[int, ...], ...]
SINGLE_GROUP_MAX_GPUS = 256  # the cross-node single group is a candidate up to this many GPUs
EXHAUSTIVE_MAX = 32  # class-size combinations up to this many are all scored (else coordinate descent)
FULL_RESCORE = 8  # the best groupings by the coarse phase search that get the full one before the top_k cut


def node_blocks(cluster: Any) -> list[list[int]]:
    """Ranks of each node, in node order."""
    blocks: dict[str, list[int]] = {}
    for d in cluster.devices:
        blocks.setdefault(d.node, []).append(d.index)
    return list(blocks.values())


def _node_class(cluster: Any, ranks: Sequence[int]) -> tuple:
    d = cluster.devices[ranks[0]]
    return (d.gpu.name, len(ranks), d.nvlink_GBps, d.network_GBps, d.memory_gib)


def divisors(n: int) -> list[int]:
    return [s for s in range(n, 0, -1) if n % s == 0]


def make_grouping(blocks: Sequence[Sequence[int]], sizes: Sequence[int]) -> Grouping:
    """Split block i into consecutive groups of sizes[i] ranks."""
    out = []
    for ranks, s in zip(blocks, sizes):
        out += [tuple(ranks[j:j + s]) for j in range(0, len(ranks), s)]
    return tuple(out)


def group_coef(sur: Surrogate, members: Sequence[int], num_groups: int, spans_nodes: bool = False) -> GroupCoef:
    """Integer-ns coefficients of one group (see ``planner.surrogate``)."""
    cols = [sur.rank_coef_ns(r, len(members), num_groups, spans_nodes) for r in members]
    return GroupCoef(a=tuple(c[0] for c in cols), s=tuple(c[1] for c in cols), b=tuple(c[2] for c in cols),
                     c=tuple(c[3] for c in cols), e=tuple(c[4] for c in cols), free=tuple(sur.devices[r].free_bytes for r in members),
                     mt=tuple(sur.devices[r].mem_tok_bytes for r in members),
                     mh=tuple(sur.devices[r].mem_head_bytes for r in members),
                     heads=sur.heads, num_units=sur.num_units)


def score_grouping(sur: Surrogate, grouping: Grouping, node_of: Sequence[str] | None = None,
                   search_lin: bool = True) -> tuple[list[GroupCoef], Split | None]:
    """Stage II's continuous split of one grouping; ``node_of[r]`` marks groups spanning nodes.
    ``search_lin=False``: the coarse split (3 linear bounds; an upper bound of the phase optimum)."""
    same: dict[GroupCoef, GroupCoef] = {}  # identical groups share one object: cache lookups hit by identity
    coefs = [same.setdefault(c, c) for c in
             (group_coef(sur, g, len(grouping), node_of is not None and len({node_of[r] for r in g}) > 1)
              for g in grouping)]
    return coefs, split_sequence(coefs, sur.num_units, search_lin=search_lin)


def candidate_groupings(cluster: Any, sur: Surrogate, *, top_k: int = 3,
                        fixed_size: str | None = None) -> list[tuple[Grouping, list[GroupCoef], Split]]:
    """Best ``top_k`` groupings by Stage II's continuous time (fastest first).

    ``fixed_size="node"`` gives only one group per node (the [Foundation] planner).
    """
    blocks = node_blocks(cluster)
    classes = [_node_class(cluster, b) for b in blocks]
    keys = sorted(set(classes), key=classes.index)
    choice = {k: k[1] for k in keys}  # start: one group per node
    seen: dict[Grouping, tuple[list[GroupCoef], Split | None]] = {}

    def evaluate(ch: dict) -> float:
        grouping = make_grouping(blocks, [ch[c] for c in classes])
        if grouping not in seen:
            seen[grouping] = score_grouping(sur, grouping, search_lin=False)
        split = seen[grouping][1]
        return split.z_rounded_ns if split else float("inf")

    best = evaluate(choice)
    node_of = [d.node for d in cluster.devices]
    if (fixed_size != "node" and 1 < len(blocks) and cluster.world_size <= SINGLE_GROUP_MAX_GPUS
            and cluster.world_size <= sur.heads):
        # one group of all ranks (uneven Ulysses; the A2A crosses the network)
        everyone: Grouping = (tuple(range(cluster.world_size)),)
        seen[everyone] = score_grouping(sur, everyone, node_of, search_lin=False)
    combos = 1
    for k in keys:
        combos *= len(divisors(k[1]))
    if fixed_size != "node" and combos <= EXHAUSTIVE_MAX:  # few classes and sizes: every combination
        for sizes in itertools.product(*[divisors(k[1]) for k in keys]):
            evaluate(dict(zip(keys, sizes)))
    elif fixed_size != "node":
        for _ in range(2):  # coordinate-descent passes
            improved = False
            for k in keys:
                for s in divisors(k[1]):
                    if s == choice[k]:
                        continue
                    trial = {**choice, k: s}
                    z = evaluate(trial)
                    if z < best:
                        best, choice, improved = z, trial, True
            if not improved:
                break
    ranked = sorted(((g, c, s) for g, (c, s) in seen.items() if s is not None),
                    key=lambda x: (x[2].z_rounded_ns, len(x[0])))
    # the survivors get the full phase split (the linear bound searched; see stage2_split)
    out = []
    for g, _, _ in ranked[:max(top_k, FULL_RESCORE)]:
        coefs, split = score_grouping(sur, g, node_of)  # no group spans nodes but the single one
        if split is not None:
            out.append((g, coefs, split))
    return sorted(out, key=lambda x: (x[2].z_rounded_ns, len(x[0])))[:top_k]
