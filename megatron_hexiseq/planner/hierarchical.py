"""The hierarchical planner: Stage I (groups) -> Stage II (split between groups) -> Stage III (per rank).

``planner_candidates`` runs the stages with memory and time feedback from ``costmodel.estimate``
(``planner.feedback``) and returns every layout it built as a scored ``Candidate``; ``planner.plan``
makes the final choice among them, the baselines and the heuristics. The surrogate
(``planner.surrogate``) is how the stages search; ``estimate`` is the judge.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from megatron_hexiseq.cluster import Cluster
from megatron_hexiseq.costmodel import Estimate
from megatron_hexiseq.layout import Layout
from megatron_hexiseq.model import ModelSpec
from megatron_hexiseq.planner.arrange import Arrangement, ring_blocks
from megatron_hexiseq.planner.build import build_layout, hosts_and_gpus
from megatron_hexiseq.planner.candidate import Candidate, Deadline, fastest_feasible
from megatron_hexiseq.planner.feedback import (
    SurrogateTimes,
    feedback_factors,
    lower_free,
    surrogate_times,
)
from megatron_hexiseq.planner.relaxed_bound import arranged_bound
from megatron_hexiseq.planner.stage1_groups import (
    Grouping,
    Scored,
    candidate_groupings,
    score_arranged,
)
from megatron_hexiseq.planner.stage3_refine import floors, integer_split, refine_group
from megatron_hexiseq.planner.surrogate import Surrogate, build_surrogate, calibrate
from megatron_hexiseq.run_config import TrainOptions

FEEDBACK_GROUPINGS = 2
# time-feedback schemes, each its own track of rounds from round 0 ("one": one factor per rank;
# "kv": the K/V ring calibrated apart; see feedback_factors)
FEEDBACK_SCHEMES = ("one", "kv")
# a track stops once every factor (rounded to 3 decimals) is within this of 1: its next round
# would re-split a surrogate that changed by at most 0.1% (changed none of 95 plans, saves a round
# on most single-factor tracks)
FEEDBACK_CONVERGED = 0.001
# Stage II's bound is proven for arrangements with at most this many prefix blocks (see solve_grouping)
MAX_PROVEN_PREFIX_BLOCKS = 1
# memory-feedback rounds before round 0 gives up on a memory mode (``planner_candidates``)
MEMORY_FEEDBACK_ROUNDS = 4


class ForkState(NamedTuple):
    """Where the time-feedback tracks start (``planner_candidates``' round 0, stopped at its first
    time feedback)."""

    sur: Surrogate  # the surrogate after round 0's memory feedback
    groupings: list[Scored]  # the (grouping, arrangement) pairs kept for feedback
    best: Candidate  # the fastest feasible candidate of the last round
    best_times: SurrogateTimes  # its surrogate times
    next_round: int
    memory_rounds: int  # memory-feedback rounds spent
    feedback_left: int  # time-feedback rounds left
    solved: dict[
        tuple[Grouping, str], tuple[Candidate, SurrogateTimes]
    ]  # by (grouping, arrangement name)


def solve_grouping(sur: Surrogate, scored: Scored) -> tuple[list[int], list[int], dict[str, Any]]:
    """Stage III on every group of a scored (grouping, arrangement); per-rank (tokens, heads) indexed
    by rank, and solver info."""
    grouping, coefs, split = scored.grouping, list(scored.coefs), scored.split
    W = sum(len(g) for g in grouping)
    tokens, heads = [0] * W, [0] * W
    statuses: dict[str, int] = {}
    if scored.arrangement.prefix:  # positioned coefficients: Stage II's units as they are
        units, (lin_floor, att_floor) = list(split.units), floors(split)
    else:  # the mirrored arrangement: Stage II made integer-aware first
        repaired = integer_split(coefs, sur.num_units)
        if repaired is None:
            return [], [], {"status": "INFEASIBLE"}
        units = repaired[1]
        lin_floor, att_floor = floors(repaired[0])
    lin_ns = att_ns = 0
    for members, coef, T in zip(grouping, coefs, units):
        # the other groups' phase maxima (Stage II's continuous L and A) are the group's floors
        sol = refine_group(coef, T, lin_floor, att_floor)
        statuses[sol.status] = statuses.get(sol.status, 0) + 1
        if sol.status == "INFEASIBLE":
            return [], [], {"status": "INFEASIBLE"}
        for r, t, h in zip(members, sol.tokens, sol.heads):
            tokens[r], heads[r] = t * sur.unit, h
        lin_ns, att_ns = max(lin_ns, sol.lin_ns), max(att_ns, sol.att_ns)
    # the phase objective over the whole domain: slowest linear phase + slowest attention phase
    z_ns = lin_ns + att_ns
    status = "OPTIMAL" if set(statuses) == {"OPTIMAL"} else "FEASIBLE"
    # bound: Stage II's proven lower bound for these groups in this arrangement (every group keeps its
    # minimum; integer units per group, tokens and heads per member continuous): no integer split of
    # them is faster in the surrogate. Proven for the mirrored arrangement and one prefix block; with
    # two or more the prefix split is greedy and its bound is no bound (docs/planner.md, "Known gap"),
    # so it is reported apart, never as ``surrogate_bound_s``, until ``prove_bound`` replaces it
    lower = min(math.floor(split.bound_ns), z_ns)
    blocks = len(scored.arrangement.prefix)
    if blocks > MAX_PROVEN_PREFIX_BLOCKS:
        bound: dict[str, Any] = {"unproven_bound_s": lower * 1e-9, "prefix_blocks": blocks}
    else:
        bound = _bound_info(lower, z_ns)
    return (
        tokens,
        heads,
        {
            "status": status,
            "group_statuses": statuses,
            "stage2_units": units,
            "surrogate_time_s": z_ns * 1e-9,
            **bound,
        },
    )


def _bound_info(lower_ns: float, z_ns: float) -> dict[str, Any]:
    """The reported bound and gap of a candidate whose surrogate time is ``z_ns``."""
    return {
        "surrogate_bound_s": lower_ns * 1e-9,
        "surrogate_gap": (z_ns - lower_ns) / z_ns if z_ns else 0.0,
    }


def prove_bound(info: dict[str, Any], scored: Scored, num_units: int) -> None:
    """Replace the unproven figure of a candidate with two or more prefix blocks (``solve_grouping``)
    by ``relaxed_bound.arranged_bound``, the relaxation's proven bound, in ``info`` (``bound_relaxed``:
    True); nothing changes when the relaxation cannot place the sequence. About a hundred relaxed
    tests: run once per plan, for the planner's best candidate."""
    if "unproven_bound_s" not in info:
        return
    unplaced = [c.placed(0, 0, False, 0) for c in scored.coefs]
    got = arranged_bound(unplaced, scored.arrangement, num_units)
    if got is None:
        return
    z_ns = info["surrogate_time_s"] * 1e9
    del info["unproven_bound_s"]
    info.update(_bound_info(min(math.floor(got), z_ns), z_ns), bound_relaxed=True)


def planner_candidates(
    cluster: Cluster,
    model: ModelSpec,
    seq_length: int,
    options: TrainOptions,
    score: Callable[[Layout], Estimate],
    *,
    deadline: Deadline | None = None,
    method: str = "hierarchical",
    top_k: int = 3,
    feedback_rounds: int = 2,
    feedback_schemes: Sequence[str] = FEEDBACK_SCHEMES,
    progress: Callable[[str], None] | None = None,
    arranged: bool = True,
    memory_feedback_rounds: int = MEMORY_FEEDBACK_ROUNDS,
    seed_groupings: Sequence[Scored] | None = None,
    stage_one_found: list[Scored] | None = None,
) -> list[Candidate]:
    """Stages I-III with memory and time feedback; every candidate scored by ``score``.

    Round 0 solves the ``top_k`` groupings of Stage I; time-feedback rounds re-split the
    ``FEEDBACK_GROUPINGS`` that did best by the cost model.

    Memory feedback: ranks ``estimate`` finds over capacity get their free memory lowered by the
    overflow; before the tracks Stage I runs again, inside a track the track's grouping is re-split
    (Stage I only when it no longer fits). Time feedback: each rank's time coefficients are scaled
    by (estimated time / surrogate time) of the round's best candidate, so terms the surrogate leaves
    out (K/V fan-out between groups of different sizes, causal visibility, collective A2A) steer the
    next round. For each of the
    ``FEEDBACK_GROUPINGS`` kept groupings, two tracks of ``feedback_rounds`` rounds start from round
    0 (``feedback_schemes``), calibrated on that grouping's own candidate: one factor per rank, and
    the K/V ring calibrated apart (``feedback_factors``); they win on different instances, and the
    cost model picks among all candidates. A track stops early once its factors are all within
    ``FEEDBACK_CONVERGED`` of 1. Empty when nothing fits. ``progress`` receives one
    short message per round ("stage I: 3 groupings", "feedback kv round 2", ...). Once ``deadline``
    has passed, no further round starts (round 0 always runs). ``arranged=False``: only the mirrored
    arrangement (no slow-first prefix blocks; what the exact reference models).
    ``memory_feedback_rounds``: how many memory-feedback rounds round 0 may take before it gives up.
    ``seed_groupings``: round 0 re-splits these (grouping, arrangement) pairs (Stage I's of another
    memory mode, ``stage_one_found``) for this mode instead of running Stage I; ``stage_one_found``,
    when given, receives round 0's Stage I pairs.
    """
    say = progress or (lambda message: None)
    k_lin, k_att = calibrate(cluster, model, options, seq_length)
    sur0 = build_surrogate(cluster, model, options, seq_length, k_lin=k_lin, k_att=k_att)
    hosts, gpus = hosts_and_gpus(cluster)
    out: list[Candidate] = []
    node_of = [d.node for d in cluster.devices]
    last_round = 4 + feedback_rounds

    ring_order: dict[tuple[Grouping, Arrangement], bool] = {}  # -> final block reversed
    several: dict[int, tuple[Scored, int]] = {}  # candidates with 2+ prefix blocks: their split

    def build_scored(
        scored: Scored, tokens: list[int], heads: list[int]
    ) -> tuple[Layout, Estimate]:
        """The layout of a solved grouping; the first time a (grouping, arrangement) is built, in both
        orders of its final block (``arrange.ring_blocks``), the faster kept for the later rounds."""
        units = [sum(tokens[r] for r in g) for g in scored.grouping]
        key = (scored.grouping, scored.arrangement)
        distinct = len({scored.coefs[g] for g in scored.arrangement.final})
        tries = (
            [ring_order[key]] if key in ring_order else ([False, True] if distinct > 1 else [False])
        )
        best = None
        for reverse in tries:
            layout = build_layout(
                seq_length=seq_length,
                num_attention_heads=model.num_attention_heads,
                num_query_groups=model.num_query_groups,
                groups=[list(g) for g in scored.grouping],
                rank_tokens=tokens,
                rank_heads=heads,
                hosts=hosts,
                gpus=gpus,
                blocks=ring_blocks(scored.coefs, scored.arrangement, units, reverse),
            )
            est = score(layout)
            if best is None or (est.feasible, -est.iteration_time_s) > (
                best[1].feasible,
                -best[1].iteration_time_s,
            ):
                best, ring_order[key] = (layout, est), reverse
        assert best is not None
        return best

    def rounds(
        sur: Surrogate,
        groupings: list[Scored],
        round_: int,
        memory_rounds: int,
        feedback_left: int,
        scheme: str | None,
    ) -> ForkState | None:
        """Rounds from ``round_`` on; ``scheme=None`` stops at the first time feedback and returns the
        state to fork the tracks from."""

        def stage_one(sur: Surrogate) -> list[Scored]:
            found = candidate_groupings(
                cluster,
                sur,
                top_k=top_k,
                fixed_size="node" if method == "node" else None,
                arranged=arranged,
            )
            say(f"stage I: {len(found)} groupings (round {round_})")
            return found

        after_memory = False  # the last round lowered the memory (inside a track)
        while round_ < last_round:
            if round_ > 0 and deadline is not None and deadline.passed():
                say(f"time limit reached before round {round_}")
                return None
            if not groupings:  # Stage I; time-feedback rounds re-split the same groupings
                groupings = stage_one(sur)
                if stage_one_found is not None and round_ == 0:
                    stage_one_found.extend(groupings)
            else:
                say(
                    f"feedback {scheme} round {round_}"
                    if scheme
                    else (
                        f"memory feedback round {round_}"
                        if round_
                        else f"{len(groupings)} groupings of another memory mode (round 0)"
                    )
                )
                rescored = [
                    score_arranged(sur, s.grouping, s.arrangement, node_of) for s in groupings
                ]
                groupings = [s for s in rescored if s is not None]
                if not groupings and after_memory:  # the track's grouping no longer fits
                    groupings = stage_one(sur)
            after_memory = False
            over: dict[int, int] = {}
            new: list[tuple[Candidate, SurrogateTimes]] = []
            solved: dict[tuple[Grouping, str], tuple[Candidate, SurrogateTimes]] = {}
            for scored in groupings:
                grouping = scored.grouping
                tokens, heads, info = solve_grouping(sur, scored)
                if info["status"] == "INFEASIBLE":
                    continue
                layout, est = build_scored(scored, tokens, heads)
                info.update(
                    group_sizes=[len(g) for g in grouping],
                    stage2_continuous_units=list(scored.split.units),
                    stage2_relaxed_s=scored.split.z_relaxed_ns * 1e-9,
                    round=round_,
                    feedback=scheme,
                    arrangement=scored.arrangement.name,
                    granularity_tokens=sur.unit,
                    k_lin=k_lin,
                    k_att=k_att,
                )
                cand = Candidate(layout, est, info)
                out.append(cand)
                if "unproven_bound_s" in info:
                    several[id(cand)] = (scored, sur.num_units)
                new.append(
                    (cand, surrogate_times(sur, grouping, list(scored.coefs), tokens, heads))
                )
                solved[(scored.grouping, scored.arrangement.name)] = new[-1]
                if not est.feasible:
                    for pr in est.per_rank:
                        if pr.memory_bytes > pr.capacity_bytes:
                            over[pr.rank] = max(
                                over.get(pr.rank, 0), pr.memory_bytes - pr.capacity_bytes
                            )
            round_ += 1
            feasible = [(c, st) for c, st in new if c.estimate.feasible]
            if not feasible:
                if not over or memory_rounds >= memory_feedback_rounds:
                    return None
                memory_rounds += 1
                sur = lower_free(sur, over)
                say(f"memory feedback: {len(over)} ranks over capacity")
                # memory changed: form groups again before the tracks; a track re-splits its own
                # grouping (Stage I there, with the track's factors making other groupings' members
                # unequal, cost up to 2.1 of a plan's 3.2 s, and changed none of 95 plans)
                after_memory = scheme is not None
                groupings = list(groupings) if after_memory else []
                continue
            if feedback_left == 0:
                return None
            feedback_left -= 1
            best, st = min(feasible, key=lambda x: x[0].estimate.iteration_time_s)
            # feedback rounds refine the groupings that did best by the cost model; one that was faster
            # but over memory stays in, with the memory feedback applied
            by_time = sorted(new, key=lambda x: x[0].estimate.iteration_time_s)
            keep = [
                (c.info["group_sizes"], c.info["arrangement"])
                for c, _ in by_time[:FEEDBACK_GROUPINGS]
            ]
            groupings = [
                s for s in groupings if ([len(g) for g in s.grouping], s.arrangement.name) in keep
            ] or groupings
            if any(not c.estimate.feasible for c, _ in by_time[:FEEDBACK_GROUPINGS]) and over:
                sur = lower_free(sur, over)
            if scheme is None:
                return ForkState(
                    sur, groupings, best, st, round_, memory_rounds, feedback_left, solved
                )
            factors, kv_factors = feedback_factors(
                sur, best.layout, best.estimate, st, separate_kv=scheme == "kv"
            )
            near = (1.0 - FEEDBACK_CONVERGED, 1.0 + FEEDBACK_CONVERGED)
            if all(near[0] <= x <= near[1] for x in (*factors, *kv_factors)):
                return None  # the surrogate already agrees with the cost model: the track is done
            sur = sur.scaled(factors, kv_factors)
        return None

    fork = rounds(sur0, list(seed_groupings or ()), 0, 0, feedback_rounds, None)
    if fork is not None:
        # one track of time-feedback rounds per (kept grouping, scheme), from the same round-0 state,
        # each calibrated on its own grouping's round-0 candidate: factors are averaged per (device,
        # group size) of the layout they come from, so another grouping's members would get unequal
        # factors (and lose the closed forms of identical members: a 1024-GPU plan took 18.7 s, not 7)
        sur, groupings, _, _, round_, memory_rounds, left, solved = fork
        tracks: dict[Surrogate, tuple[Scored, str]] = {}  # a track equal to another would repeat it
        for scored in groupings:
            own = solved.get((scored.grouping, scored.arrangement.name))
            source, source_st = (
                own
                if own is not None and own[0].estimate.feasible
                else (fork.best, fork.best_times)
            )
            for scheme in feedback_schemes:
                fed = sur.scaled(
                    *feedback_factors(
                        sur, source.layout, source.estimate, source_st, separate_kv=scheme == "kv"
                    )
                )
                tracks.setdefault(fed, (scored, scheme))
        for fed, (scored, scheme) in tracks.items():
            rounds(fed, [scored], round_, memory_rounds, left, scheme)
    best = fastest_feasible(out)  # the one plan() takes: its bound proven, whatever its arrangement
    if best is not None and id(best) in several:
        prove_bound(best.info, *several[id(best)])
    return out
