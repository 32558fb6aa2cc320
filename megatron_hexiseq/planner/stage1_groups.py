"""Stage I: A2A group formation and the groups' arrangement in the sequence.

Groups. Nodes fall into *classes* (same GPU type, count, bandwidths, memory). Each class picks one
group size: a divisor ``s`` of the node's GPU count (groups inside a node: the all-to-all stays on
NVLink/PCIe, ``s = count`` is one group per node, ``s = 1`` ring-like), or ``k`` whole nodes of the
class per group (``k = 2, 3, ...`` while every rank can still hold a head, ``k * count <= H``; a
class whose node count is not a multiple of k adds one group of the remaining nodes). Groups that
span nodes run their all-to-all over the network but hold fewer heads per rank, so each rank
receives less K/V from the other groups: at scale, where the K/V exchange dominates, that wins.
Different classes may pick different sizes, so groups of different sizes coexist. The single group
of all ranks (uneven Ulysses) is offered too, up to ``SINGLE_GROUP_MAX_GPUS`` GPUs and only when every
rank can hold a head (``W <= H``; with more ranks than heads, whole heads leave most ranks without
attention: planner_scale, 128 GPUs, 40 heads: 69.7 s continuous, 200 s as integers).

Arrangements (``planner.arrange``): every grouping is scored in the plain mirrored arrangement and
with prefix blocks of its slowest classes first (the seed grouping with every prefix length in
both slowness orders, the others with the shortest, the longest and the seed's best share of the
classes in the order of the seed's best prefix: which classes go first depends on the GPU types,
hardly on the group sizes). Search: every combination of class
options when there are at most ``EXHAUSTIVE_MAX``, else coordinate descent over the classes from
the best of "one group per node" and "k nodes per group in every class" (groups of one size have
no K/V fan-out between them, a coupled move that one class at a time does not reach), each
(grouping, arrangement) scored by Stage II's coarse phase split (the ``L = inf`` split with a 0.1%
bisection and unsettled unit-range ends: an upper bound of its phase optimum). The
``FULL_RESCORE`` best get the full split; the ``top_k`` best of those go on to Stage III and
``estimate``, at least one in the mirrored arrangement and one with a prefix when both were scored
(the surrogate ranks the two families less reliably than either within itself).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

from megatron_hexiseq.cluster import Cluster
from megatron_hexiseq.planner.arrange import (
    Arrangement,
    arrangements,
    mirrored,
    with_fan_out,
)
from megatron_hexiseq.planner.arranged_split import split_arranged
from megatron_hexiseq.planner.coef import GroupCoef
from megatron_hexiseq.planner.stage2_split import Split, split_sequence
from megatron_hexiseq.planner.surrogate import Surrogate

Grouping = tuple[tuple[int, ...], ...]
SINGLE_GROUP_MAX_GPUS = 256  # the cross-node single group is a candidate up to this many GPUs
EXHAUSTIVE_MAX = (
    32  # class-option combinations up to this many are all scored (else coordinate descent)
)
DESCENT_PASSES = 2  # coordinate-descent passes over the classes (the second only after a move)
FULL_RESCORE = 6  # the best (grouping, arrangement) pairs by the coarse split that get the full one


@dataclass(frozen=True)
class Scored:
    """A grouping in an arrangement with its positioned coefficients and Stage II split."""

    grouping: Grouping
    arrangement: Arrangement
    coefs: tuple[GroupCoef, ...]
    split: Split

    @property
    def value(self) -> float:
        return self.split.z_rounded_ns


def node_blocks(cluster: Cluster) -> list[list[int]]:
    """Ranks of each node, in node order."""
    blocks: dict[str, list[int]] = {}
    for d in cluster.devices:
        blocks.setdefault(d.node, []).append(d.index)
    return list(blocks.values())


class NodeClass(NamedTuple):
    """Nodes that Stage I treats alike: the same GPU type, GPU count, bandwidths and memory."""

    gpu: str
    gpus: int
    nvlink_GBps: float
    network_GBps: float
    memory_gib: float


def _node_class(cluster: Cluster, ranks: Sequence[int]) -> NodeClass:
    d = cluster.devices[ranks[0]]
    return NodeClass(d.gpu.name, len(ranks), d.nvlink_GBps, d.network_GBps, d.memory_gib)


def divisors(n: int) -> list[int]:
    return [s for s in range(n, 0, -1) if n % s == 0]


def class_options(count: int, nodes: int, heads: int) -> list[int]:
    """Group sizes (ranks) a class of ``nodes`` nodes of ``count`` GPUs may pick: the divisors of
    ``count`` (inside a node), then k whole nodes for k = 2, 3, ... while ``k * count <= heads``."""
    out = divisors(count)
    out += [k * count for k in range(2, nodes + 1) if k * count <= heads]
    return out


def make_grouping(
    blocks: Sequence[Sequence[int]],
    sizes: Sequence[int],
    classes: Sequence[NodeClass] | None = None,
) -> Grouping:
    """Split the nodes into groups: ``sizes[i]`` is node i's class option; up to the node's GPU count it
    splits the node into consecutive groups of that size, beyond it whole nodes of the same class
    (``classes[i]``) are joined in order, ``size // count`` at a time (the remaining nodes of the class
    form one group)."""
    out: list[tuple[int, ...]] = []
    # (class, option) -> ranks of the nodes waiting for a group
    pending: dict[tuple[NodeClass | None, int], list[int]] = {}
    for i, (ranks, s) in enumerate(zip(blocks, sizes)):
        if s <= len(ranks):
            out += [tuple(ranks[j : j + s]) for j in range(0, len(ranks), s)]
            continue
        key = (classes[i] if classes is not None else None, s)
        pending.setdefault(key, []).extend(ranks)
        if len(pending[key]) >= s:
            out.append(tuple(sorted(pending.pop(key))))
    out += [tuple(sorted(r)) for r in pending.values()]
    return tuple(out)


def group_coef(
    sur: Surrogate, members: Sequence[int], num_groups: int, spans_nodes: bool = False
) -> GroupCoef:
    """Integer-ns coefficients of one group (see ``planner.surrogate``), at the default position."""
    cols = [sur.rank_coef_ns(r, len(members), num_groups, spans_nodes) for r in members]
    return GroupCoef(
        a=tuple(c.lin for c in cols),
        s=tuple(c.s for c in cols),
        b=tuple(c.b for c in cols),
        c=tuple(c.c for c in cols),
        e=tuple(c.e for c in cols),
        free=tuple(sur.devices[r].free_bytes for r in members),
        mt=tuple(sur.devices[r].mem_tok_bytes for r in members),
        mh=tuple(sur.devices[r].mem_head_bytes for r in members),
        heads=sur.heads,
        num_units=sur.num_units,
    )


def base_coefs(
    sur: Surrogate, grouping: Grouping, node_of: Sequence[str] | None
) -> list[GroupCoef]:
    """Every group's coefficients; identical groups share one object (cache lookups hit by identity),
    computed once per distinct (member devices, spans nodes)."""
    ids, memo = sur.device_kinds, sur.group_coefs
    many = len(grouping) > 1  # ``rank_coef_ns`` reads the group count only as "more than one"
    out = []
    for g in grouping:
        spans = node_of is not None and len({node_of[r] for r in g}) > 1
        key = (tuple(ids[r] for r in g), spans, many)
        if key not in memo:
            memo[key] = group_coef(sur, g, len(grouping), spans)
        out.append(memo[key])
    return out


def score_grouping(
    sur: Surrogate,
    grouping: Grouping,
    node_of: Sequence[str] | None = None,
    search_lin: bool = True,
) -> tuple[list[GroupCoef], Split | None]:
    """Stage II's continuous split of one grouping in the mirrored arrangement (grouping order);
    ``node_of[r]`` marks groups spanning nodes. ``search_lin=False``: the coarse split."""
    coefs = base_coefs(sur, grouping, node_of)
    return coefs, split_sequence(coefs, sur.num_units, search_lin=search_lin)


def score_arranged(
    sur: Surrogate,
    grouping: Grouping,
    arr: Arrangement,
    node_of: Sequence[str] | None,
    search_lin: bool = True,
    coefs: list[GroupCoef] | None = None,
) -> Scored | None:
    """Stage II's split of a grouping in an arrangement (None when it does not fit); ``coefs``: the
    grouping's ``base_coefs`` when the caller has them. The K/V coefficients get the fan-out of the
    arrangement (``arrange.with_fan_out``)."""
    coefs = with_fan_out(coefs if coefs is not None else base_coefs(sur, grouping, node_of), arr)
    if not arr.prefix:
        order = arr.final
        split = split_sequence([coefs[i] for i in order], sur.num_units, search_lin=search_lin)
        if split is None:
            return None
        units = [0] * len(coefs)
        for i, u in zip(order, split.units):
            units[i] = u
        return Scored(
            grouping,
            arr,
            tuple(coefs),
            Split(
                tuple(units),
                split.z_relaxed_ns,
                split.z_rounded_ns,
                split.lin_ns,
                split.att_ns,
                split.bound_ns,
            ),
        )
    got = split_arranged(coefs, arr, sur.num_units, search_lin)
    if got is None:
        return None
    split, placed = got
    return Scored(grouping, arr, tuple(placed), split)


def _best_arranged(
    sur: Surrogate,
    grouping: Grouping,
    node_of: Sequence[str],
    arranged: bool,
    shares: Sequence[float] | None = None,
    orders: Sequence[str] | None = None,
) -> list[Scored]:
    """The coarse split of a grouping in the mirrored arrangement and in its best prefix arrangement
    (``arrange.arrangements``: every prefix length in both slowness orders, or the few that
    ``shares`` suggests in the ``orders`` given)."""
    coefs = base_coefs(sur, grouping, node_of)
    arrs = (
        arrangements(coefs, shares, orders)
        if arranged
        else [mirrored(len(grouping), arrangements(coefs, ())[0].final)]
    )
    scored = [
        s for s in (score_arranged(sur, grouping, a, node_of, False, coefs) for a in arrs) if s
    ]
    out = [s for s in scored if not s.arrangement.prefix][:1]
    prefixed = [s for s in scored if s.arrangement.prefix]
    if prefixed:
        out.append(min(prefixed, key=lambda s: s.value))
    return out


def candidate_groupings(
    cluster: Cluster,
    sur: Surrogate,
    *,
    top_k: int = 3,
    fixed_size: str | None = None,
    arranged: bool = True,
) -> list[Scored]:
    """Best ``top_k`` (grouping, arrangement) pairs by Stage II's time (fastest first).

    ``fixed_size="node"`` gives only one group per node (the [Foundation] planner);
    ``arranged=False`` only the mirrored arrangement.
    """
    blocks = node_blocks(cluster)
    node_of = [d.node for d in cluster.devices]
    classes = [_node_class(cluster, b) for b in blocks]
    keys = sorted(set(classes), key=classes.index)
    nodes_of = {k: classes.count(k) for k in keys}
    options = {
        k: ([k[1]] if fixed_size == "node" else class_options(k[1], nodes_of[k], sur.heads))
        for k in keys
    }
    choice = {k: k[1] for k in keys}  # start: one group per node
    seen: dict[Grouping, list[Scored]] = {}

    shares: list[float] | None = None  # after the seed: prefix lengths near its best one's share
    orders: list[str] | None = None  # and the slowness order of its best prefix

    def evaluate(ch: dict) -> float:
        grouping = make_grouping(blocks, [ch[c] for c in classes], classes)
        if grouping not in seen:
            seen[grouping] = _best_arranged(sur, grouping, node_of, arranged, shares, orders)
        return min((s.value for s in seen[grouping]), default=float("inf"))

    best = evaluate(choice)
    if fixed_size != "node":
        # uniform cross-node groups (k nodes per group in every class): groups of one size have no
        # K/V fan-out between them (``arrange.kappa``), which one class at a time never reaches
        seed = choice
        for n_nodes in range(2, max(nodes_of.values()) + 1):
            trial = {c: max([s for s in options[c] if s <= n_nodes * c[1]]) for c in keys}
            if trial != seed and any(s > c[1] for c, s in trial.items()):
                z = evaluate(trial)
                if z < best:
                    best, choice = z, trial
    # the seeds were scored with every prefix length in both slowness orders; the others with those
    # near the best seed's share, in its order
    seed_prefixed = [
        s.arrangement
        for s in seen[make_grouping(blocks, [choice[c] for c in classes], classes)]
        if s.arrangement.prefix
    ]
    shares = [a.share for a in seed_prefixed]
    orders = [a.order_name for a in seed_prefixed] or None  # no prefix fitted: both orders
    if (
        fixed_size != "node"
        and 1 < len(blocks)
        and cluster.world_size <= SINGLE_GROUP_MAX_GPUS
        and cluster.world_size <= sur.heads
    ):
        everyone: Grouping = (
            tuple(range(cluster.world_size)),
        )  # uneven Ulysses; the A2A crosses the network
        # scored with the full split: its members differ, and at L = inf its continuous split piles
        # the tokens on the fast linear layers (2.4x its optimum on an optimality_gap instance)
        alone = score_arranged(sur, everyone, mirrored(1), node_of)
        seen[everyone] = [alone] if alone is not None else []
    combos = 1
    for k in keys:
        combos *= len(options[k])
    if combos <= EXHAUSTIVE_MAX:  # few classes and options: every combination
        for sizes in itertools.product(*[options[k] for k in keys]):
            evaluate(dict(zip(keys, sizes)))
    else:
        for _ in range(DESCENT_PASSES):
            improved = False
            for k in keys:
                for s in options[k]:
                    if s == choice[k]:
                        continue
                    trial = {**choice, k: s}
                    z = evaluate(trial)
                    if z < best:
                        best, choice, improved = z, trial, True
            if not improved:
                break
    ranked = sorted(
        (s for found in seen.values() for s in found), key=lambda s: (s.value, len(s.grouping))
    )
    # the survivors get the full phase split (the linear bound searched; see stage2_split)
    head = ranked[: max(top_k, FULL_RESCORE)]
    for want_prefix in (False, True):  # the best of each family gets the full split too
        other = [s for s in ranked if bool(s.arrangement.prefix) == want_prefix]
        if other and not any(bool(s.arrangement.prefix) == want_prefix for s in head):
            head.append(other[0])
    full = [
        f
        for f in (score_arranged(sur, s.grouping, s.arrangement, node_of) for s in head)
        if f is not None
    ]
    full.sort(key=lambda s: (s.value, len(s.grouping)))
    out = full[:top_k]
    for want_prefix in (False, True):  # keep one of each family when both were scored
        if full and not any(bool(s.arrangement.prefix) == want_prefix for s in out):
            other = [s for s in full if bool(s.arrangement.prefix) == want_prefix]
            if other:
                out = out[: max(1, top_k - 1)] + [other[0]]
    return out
