"""Exact reference: one CP-SAT model over all surrogate decisions, for clusters of at most 16 GPUs.

Decisions: the grouping (every node split into groups of any sizes — all integer partitions of its
GPU count, not only the equal splits Stage I tries — plus the single cross-node group of all
ranks), every group's token count ``T_g``, and every
rank's tokens ``t_r >= 1`` unit and heads ``h_r``; the same surrogate model as the stages
(``planner.surrogate``) with the bilinear term ``w_r = h_r * T_g`` modelled exactly
(``AddMultiplicationEquality``) and the same phase objective ``min Z_lin + Z_att``. Groupings are enumerated (nodes of one type are interchangeable,
so only size multisets are enumerated per node) and pruned with Stage II's continuous value as an
estimate; for each surviving grouping one joint CP-SAT model over (T, t, h) is solved to optimality.
The result is the proven optimum of the surrogate over all decisions up to the enumerated set
(reported as ``bound``); ``bench/optimality_gap.py`` compares the hierarchical planner against it.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import NamedTuple

from ortools.sat.python import cp_model

from megatron_hexiseq.cluster import Cluster
from megatron_hexiseq.costmodel import Estimate
from megatron_hexiseq.layout import Layout
from megatron_hexiseq.model import ModelSpec
from megatron_hexiseq.planner.arrange import mirrored, with_fan_out
from megatron_hexiseq.planner.build import build_layout, hosts_and_gpus
from megatron_hexiseq.planner.candidate import Candidate, Deadline
from megatron_hexiseq.planner.coef import MIN_UNITS_PER_RANK, GroupCoef
from megatron_hexiseq.planner.stage1_groups import Grouping, group_coef, node_blocks, score_arranged
from megatron_hexiseq.planner.stage2_split import split_sequence
from megatron_hexiseq.planner.stage3_refine import floors, refine_group
from megatron_hexiseq.planner.surrogate import Surrogate, build_surrogate, calibrate
from megatron_hexiseq.run_config import TrainOptions

MAX_EXACT_GPUS = 16
JOINT_DETERMINISTIC_TIME = (
    20.0  # CP-SAT limit of one grouping's joint model (deterministic seconds)
)


def partitions(n: int, largest: int | None = None) -> list[tuple[int, ...]]:
    """Integer partitions of n, parts non-increasing: 4 -> (4), (3,1), (2,2), (2,1,1), (1,1,1,1)."""
    largest = n if largest is None else largest
    if n == 0:
        return [()]
    return [(k,) + rest for k in range(min(n, largest), 0, -1) for rest in partitions(n - k, k)]


def all_groupings(cluster: Cluster) -> list[Grouping]:
    """Every split of every node into groups (sizes non-increasing), plus one group of all ranks
    when the cluster has several nodes (the cross-node candidate Stage I also scores)."""
    out = []
    blocks = node_blocks(cluster)
    for choice in itertools.product(*[partitions(len(b)) for b in blocks]):
        groups = []
        for ranks, parts in zip(blocks, choice):
            start = 0
            for p in parts:
                groups.append(tuple(ranks[start : start + p]))
                start += p
        out.append(tuple(groups))
    if len(blocks) > 1:
        out.append((tuple(range(cluster.world_size)),))
    return out


class JointSolution(NamedTuple):
    """One grouping's joint CP-SAT solve (``solve_joint``), in units and integer ns."""

    status: str  # "OPTIMAL" or "FEASIBLE"
    z_ns: int  # the objective zl + za
    bound_ns: int  # CP-SAT's best bound
    tokens: list[int]  # units per rank
    heads: list[int]  # heads per rank


class ExactBest(NamedTuple):
    """The best grouping of the exact reference and its joint solve (``exact_surrogate``)."""

    grouping: Grouping
    status: str
    z_ns: int
    bound_ns: int
    tokens: list[int]
    heads: list[int]


def solve_joint(
    sur: Surrogate,
    grouping: Grouping,
    upper_ns: int | None = None,
    node_of: list[str] | None = None,
) -> JointSolution | None:
    """One CP-SAT model over (T_g, t_r, h_r) for a fixed grouping."""
    N, H = sur.num_units, sur.heads
    # the same surrogate as the hierarchical planner's mirrored arrangement, K/V fan-out included
    coefs = with_fan_out(
        [
            group_coef(
                sur, g, len(grouping), node_of is not None and len({node_of[r] for r in g}) > 1
            )
            for g in grouping
        ],
        mirrored(len(grouping)),
    )
    if sum(len(g) for g in grouping) * MIN_UNITS_PER_RANK > N or any(
        min(co.cap) < MIN_UNITS_PER_RANK for co in coefs
    ):
        return None  # fewer units than ranks, or some rank cannot hold one unit
    model = cp_model.CpModel()
    # a group holds at least one unit per member
    T = {
        g: model.new_int_var(len(grouping[g]) * MIN_UNITS_PER_RANK, N, f"T_{g}")
        for g in range(len(grouping))
    }
    horizon = upper_ns if upper_ns is not None else 10**15
    # the phase maxima over every rank (bulk-synchronous phases, as ``estimate``); objective zl + za
    zl = model.new_int_var(0, horizon, "zl")
    za = model.new_int_var(0, horizon, "za")
    model.add(zl + za <= horizon)
    t, h = {}, {}
    model.add(sum(T.values()) == N)  # the groups partition the sequence
    for gi, (members, co) in enumerate(zip(grouping, coefs)):
        for k, r in enumerate(members):
            # every rank owns >= 1 unit: Megatron cannot run an empty sequence shard
            t[r] = model.new_int_var(MIN_UNITS_PER_RANK, min(co.cap[k], N), f"t_{r}")
            h[r] = model.new_int_var(0, H, f"h_{r}")
            w = model.new_int_var(0, H * N, f"w_{r}")  # heads x group units (attention work)
            model.add_multiplication_equality(w, [h[r], T[gi]])
            # memory: own activations + attention core of the group's tokens for own heads
            model.add(t[r] * co.mt[k] + w * co.mh[k] <= co.free[k])
            # linear phase; attention phase = A2A + max(attention, K/V ring)
            att = model.new_int_var(0, horizon, f"att_{r}")
            model.add(att >= w * co.b[k])
            model.add(att >= (h[r] * N - w) * co.c[k])
            model.add(t[r] * co.a[k] <= zl)
            model.add(t[r] * co.s_(k) + att + w * co.e[k] <= za)
        model.add(sum(t[r] for r in members) == T[gi])  # a group's tokens are its members'
        model.add(sum(h[r] for r in members) == H)  # each group holds every head
    # symmetry: identical members of a group hold non-increasing tokens
    for members, co in zip(grouping, coefs):
        for k in range(len(members) - 1):
            if _same(co, k, k + 1):
                model.add(t[members[k]] >= t[members[k + 1]])
    model.minimize(zl + za)
    # hint: the hierarchical solution for this grouping (Stage II split + Stage III per group)
    hint = _hierarchical_point(sur, grouping, coefs)
    if hint is not None:
        units, th, hh = hint
        for gi, u in enumerate(units):
            model.add_hint(T[gi], u)
        for r in t:
            model.add_hint(t[r], th[r])
            model.add_hint(h[r], hh[r])
    solver = cp_model.CpSolver()
    solver.parameters.num_workers = 1
    solver.parameters.random_seed = 0
    # a deterministic limit (no wall-clock limit): the same inputs give the same result on any load
    solver.parameters.max_deterministic_time = JOINT_DETERMINISTIC_TIME
    status = solver.solve(model)
    if status not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        assert status != cp_model.MODEL_INVALID, model.validate()
        return None  # INFEASIBLE (memory) or UNKNOWN (no solution in time)
    W = len(t)
    return JointSolution(
        "OPTIMAL" if status == cp_model.OPTIMAL else "FEASIBLE",
        int(solver.objective_value),
        int(solver.best_objective_bound),
        [solver.value(t[r]) for r in range(W)],
        [solver.value(h[r]) for r in range(W)],
    )


def _same(co: GroupCoef, i: int, j: int) -> bool:
    return co.s_(i) == co.s_(j) and all(
        getattr(co, f)[i] == getattr(co, f)[j] for f in ("a", "b", "c", "e", "free", "mt", "mh")
    )


def _hierarchical_point(
    sur: Surrogate, grouping: Grouping, coefs: list[GroupCoef]
) -> tuple[list[int], dict[int, int], dict[int, int]] | None:
    split = split_sequence(coefs, sur.num_units)
    if split is None:
        return None
    th, hh = {}, {}
    for members, co, u in zip(grouping, coefs, split.units):
        sol = refine_group(co, u, *floors(split))
        if sol.status == "INFEASIBLE":
            return None
        for r, x, y in zip(members, sol.tokens, sol.heads):
            th[r], hh[r] = x, y
    return list(split.units), th, hh


def exact_surrogate(
    cluster: Cluster, sur: Surrogate, *, deadline: Deadline | None = None
) -> ExactBest | None:
    """Best grouping and its joint optimum, or None.
    Once ``deadline`` has passed, no further grouping is solved (the first always is)."""
    scored = []
    node_of = [d.node for d in cluster.devices]
    for grouping in all_groupings(cluster):
        got = score_arranged(sur, grouping, mirrored(len(grouping)), node_of)
        if got is not None:
            scored.append((got.split.z_rounded_ns, len(grouping), grouping))
    scored.sort()
    best: ExactBest | None = None
    for est_ns, _, grouping in scored:
        # continuous Stage II value is a near-bound: skip groupings clearly worse than the incumbent
        if best is not None and est_ns > best.z_ns * 1.02:
            continue
        if best is not None and deadline is not None and deadline.passed():
            break
        res = solve_joint(sur, grouping, upper_ns=best.z_ns if best else None, node_of=node_of)
        if res is not None and (best is None or res.z_ns < best.z_ns):
            best = ExactBest(grouping, *res)
    return best


def exact_candidates(
    cluster: Cluster,
    model: ModelSpec,
    seq_length: int,
    options: TrainOptions,
    score: Callable[[Layout], Estimate],
    *,
    deadline: Deadline | None = None,
) -> list[Candidate]:
    """The exact optimum as a planner candidate."""
    assert cluster.world_size <= MAX_EXACT_GPUS, "exact reference is for <= 16 GPUs"
    k_lin, k_att = calibrate(cluster, model, options, seq_length)
    sur = build_surrogate(cluster, model, options, seq_length, k_lin=k_lin, k_att=k_att)
    best = exact_surrogate(cluster, sur, deadline=deadline)
    if best is None:
        return []
    grouping, status, z, bound, t, h = best
    hosts, gpus = hosts_and_gpus(cluster)
    layout = build_layout(
        seq_length=seq_length,
        num_attention_heads=model.num_attention_heads,
        num_query_groups=model.num_query_groups,
        groups=[list(g) for g in grouping],
        rank_tokens=[x * sur.unit for x in t],
        rank_heads=h,
        hosts=hosts,
        gpus=gpus,
    )
    info = {
        "status": status,
        "surrogate_time_s": z * 1e-9,
        "surrogate_bound_s": bound * 1e-9,
        "surrogate_gap": (z - bound) / z if z else 0.0,
        "group_sizes": [len(g) for g in grouping],
        "granularity_tokens": sur.unit,
        "k_lin": k_lin,
        "k_att": k_att,
    }
    return [Candidate(layout, score(layout), info)]
