"""Stage III: per-rank tokens and heads inside one A2A group, with CP-SAT.

Data: the group's members (coefficients ``a_r``, ``beta_r(T)`` in integer ns, memory cap in units,
see ``planner.surrogate``), its token count ``T`` (units, fixed by Stage II) and ``H`` heads.
Variables: ``t[r] >= 1`` units (no rank may own zero tokens: Megatron cannot run an empty sequence
shard), ``h[r]`` heads, ``zl`` the linear phase (``>= t_r a_r``) and ``za`` the attention phase
(``>= t_r s_r + h_r beta_r``). Minimise ``zl + za`` (bulk-synchronous phases, as ``estimate``).
The phase maxima are global over the domain, so a group is solved with the *other groups' phase
maxima as floors*: ``zl >= L*``, ``za >= A*`` (Stage II's continuous L and A). The group then pays
only for exceeding the domain's maxima and uses the slack below them for free; the grouping's value
is ``max_g zl_g + max_g za_g`` of the solutions.
Seeded with a greedy hint (continuous optimum, largest-remainder rounding), fixed seed, one worker,
a fixed *deterministic* time limit and no wall-clock limit (same stop point under any machine load,
so the same inputs give the same layout) and a small relative gap; every solver status is handled (a feasible-but-not-proven result
reports its bound and gap; no solution at all falls back to the hint when it is valid).
When the rounded continuous optimum is already within ``GREEDY_GAP`` of the continuous bound, the
solver is skipped (status FEASIBLE, bound = the continuous optimum); groups of more than
``CPSAT_MAX_MEMBERS`` ranks (groups spanning nodes) always keep that rounded point, and count as
INFEASIBLE when it is not valid (CP-SAT is not run for them either way: the one such group in 71
planned clusters took CP-SAT 0.18-0.25 s of CPU to prove infeasible).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from operator import mul

from ortools.sat.python import cp_model

from megatron_hexiseq.planner.coef import MIN_UNITS_PER_RANK, GroupCoef
from megatron_hexiseq.planner.stage2_split import Split, split_at, split_sequence
from megatron_hexiseq.planner.unit_range import group_phase_time, max_heads, min_units

GREEDY_GAP = 5e-3  # accept the rounded continuous optimum when within 0.5% of the bound
BALANCE_MAX_MEMBERS = 16  # phase-2 evenness solve only for groups up to this size
CPSAT_MAX_MEMBERS = 16  # larger groups (spanning nodes) keep the rounded continuous optimum
REPAIR_SLACK = 5e-3  # integer repair of the split starts when a group is 0.5% over the split's time
BALANCE_DETERMINISTIC_TIME = 0.02  # budget of the phase-2 evenness solve (deterministic seconds)
RELATIVE_GAP = 1e-4  # CP-SAT stops when its solution is proven within 0.01% of optimal
# CP-SAT's presolve costs ~15 ms of fixed time per call on these 30-40-variable models, which the
# search then proves optimal within a few deterministic milliseconds (the LP relaxation stays: off,
# one 2-solve plan took 0.58 s of CP-SAT instead of 0.05)
CPSAT_PRESOLVE = False
# the phase-2 evenness solve without the LP relaxation: the same optimum (28 of 28 captured solves),
# 3.5x less CPU (0.23 -> 0.07 s on them); phase 1 keeps it (off, one solve took 0.11 s, not 0.03)
BALANCE_LINEARIZATION = 0
SOLVE_DETERMINISTIC_TIME = 0.1  # per group solve (deterministic seconds; 0.02 left 5% on a 10-rank group with the phase objective)


@dataclass(frozen=True)
class GroupSolution:
    tokens: tuple[int, ...]  # units per member
    heads: tuple[int, ...]
    time_ns: int  # own linear phase + own attention phase (no floors)
    bound_ns: int  # lower bound of the floored objective max(zl, L*) + max(za, A*)
    status: str  # OPTIMAL, FEASIBLE, HINT (solver found nothing, greedy kept), INFEASIBLE
    lin_ns: int = 0  # own linear phase: max t_r a_r
    att_ns: int = 0  # own attention phase: max t_r s_r + h_r beta_r


def largest_remainder(
    values: list[float], total: int, caps: list[int] | None = None, low: int = 0
) -> list[int]:
    """Round non-negative reals to integers summing to ``total`` (respecting ``caps`` when given), each
    at least ``low`` (the caller guarantees ``low * len(values) <= total`` and caps >= low)."""
    base = [max(low, int(v)) for v in values]
    if caps:
        base = [max(low, min(b, c)) for b, c in zip(base, caps)]
    order = [i for _, i in sorted((int(v) - v, i) for i, v in enumerate(values))]
    left = total - sum(base)
    while left > 0:
        moved = False
        for i in order:
            if left == 0:
                break
            if caps is None or base[i] < caps[i]:
                base[i] += 1
                left -= 1
                moved = True
        if not moved:
            break
    while left < 0:  # values summed to more than total: take from the largest, never below low
        i = max(range(len(base)), key=lambda j: (base[j], -j))
        assert base[i] > low, "largest_remainder: total below len(values) * low"
        base[i] -= 1
        left += 1
    return base


def greedy(
    g: GroupCoef, T: int, lin_floor: float = 0.0, att_floor: float = 0.0
) -> tuple[list[int], list[int]] | None:
    """Rounded continuous optimum (``group_phase_time`` with the floors): a feasible integer point (or
    None when the tokens don't fit). Every member keeps at least ``MIN_UNITS_PER_RANK`` units (the
    continuous optimum already does)."""
    n = g.size
    if T > sum(g.cap) or T < min_units(g) or min(g.cap) < MIN_UNITS_PER_RANK:
        return None
    lin, z = group_phase_time(g, T, lin_floor, att_floor)
    if not math.isfinite(z):
        return None
    _, t_cont = max_heads(g, T, z, lin)
    if not t_cont:  # no continuous point at (z, lin): nothing to round
        return None
    t = largest_remainder(t_cont, T, list(g.cap), low=MIN_UNITS_PER_RANK)
    betas = g.betas(T)

    def head_room(i: int) -> tuple[float, float]:  # (continuous heads, heads memory holds)
        mem = g.head_mem_cap(i, T, t[i])
        return max(0.0, min((z - t[i] * g.s_(i)) / betas[i] if betas[i] else 0.0, mem)), mem

    if len(g.rows) == 1:  # identical members: one computation per distinct unit count
        room: dict[int, tuple[float, float]] = {}
        for i, ti in enumerate(t):
            if ti not in room:
                room[ti] = head_room(i)
        rooms = [room[ti] for ti in t]
    else:
        rooms = [head_room(i) for i in range(n)]
    h_cont = [x for x, _ in rooms]
    s = sum(h_cont) or 1.0
    # heads: proportional to the continuous head capacity, rounded within each member's memory when
    # the caps can hold every head (else uncapped; ``_fits`` then rejects the point)
    mem = [m for _, m in rooms]
    head_caps = [
        max(0, min(g.heads, math.floor(x + 1e-9))) if math.isfinite(x) else g.heads for x in mem
    ]
    h = largest_remainder(
        [x * g.heads / s for x in h_cont], g.heads, head_caps if sum(head_caps) >= g.heads else None
    )
    if not _fits(g, T, t, h):
        t = _make_room(g, T, t, h) or t
    return t, h


def _make_room(g: GroupCoef, T: int, t: list[int], h: list[int]) -> list[int] | None:
    """Tokens moved off members that a rounded head pushed over memory, onto the members with room
    (fastest linear coefficient first), heads kept; None if they do not fit. A member whose
    continuous share is a fraction of a head (tight memory, e.g. L40S in a large cross-node group)
    otherwise left the rounded point invalid and Stage III without a hint (CP-SAT then ran its whole
    budget for a poor point)."""
    room = [(g.free[i] - h[i] * T * g.mh[i]) // g.mt[i] if g.mt[i] else T for i in range(g.size)]
    if any(r < MIN_UNITS_PER_RANK for r in room):
        return None
    t = list(t)
    spare = 0
    for i in range(g.size):
        if t[i] > room[i]:
            spare += t[i] - room[i]
            t[i] = room[i]
    for i in sorted(range(g.size), key=lambda j: (g.a[j], j)):
        take = min(spare, room[i] - t[i]) if room[i] > t[i] else 0
        t[i] += take
        spare -= take
    return t if spare == 0 else None


def _least_attention(classes: Sequence[tuple[int, float, float]], s: int, T: int) -> float | None:
    """The smallest attention phase za at which members of ``classes`` = (count, heads x beta, most
    units U) hold T units in all, each ``min(U, (za - heads beta) / s)`` units and at least one (units
    continuous); None when they cannot. The holdings are piecewise linear in za: solved per
    saturation order, in closed form."""
    if any(U < MIN_UNITS_PER_RANK for _, _, U in classes) or sum(k * U for k, _, U in classes) < T:
        return None
    least = max(hb + s * MIN_UNITS_PER_RANK for _, hb, _ in classes)  # every member >= one unit
    if s == 0:  # a member's holding does not depend on za once its heads fit
        return least
    order = sorted(classes, key=lambda c: c[1] + s * c[2])  # by the za where a class saturates
    saturated = 0.0  # units of the classes already at their most
    for j, (_, hb, U) in enumerate(order):
        rest = order[j:]
        za = (s * (T - saturated) + sum(k * h for k, h, _ in rest)) / sum(k for k, _, _ in rest)
        if za <= hb + s * U:
            return max(za, least)
        saturated += order[j][0] * U
    return max(least, order[-1][1] + s * order[-1][2])


BALANCED_TOL = 1e-9  # relative width of the ternary search on the linear phase (balanced_point)


def balanced_point(
    g: GroupCoef, T: int, lin_floor: int = 0, att_floor: int = 0
) -> tuple[float, list[int], list[int]] | None:
    """A lower bound of ``refine_group``'s objective for a group of identical members whose heads do
    not split evenly (H mod n > 0), and an integer point near it: (bound, tokens, heads), None when
    it does not apply or nothing fits.

    The bound: heads whole, tokens continuous. A member holding h heads can hold
    ``tau(h) = min(cap, zl / a, (za - h beta) / s, (free - h T mh) / mt)`` units, concave in h, so
    the balanced heads (H mod n members with ceil(H/n), the rest floor(H/n)) hold the most units in
    all and leave every member the most room: no other head split fits where they do not. The
    smallest ``max(zl, L*) + max(za, A*)`` over (zl, za) is then a convex problem in zl (the least za
    for a zl in closed form, ``_least_attention``; a ternary search on zl). The continuous bound
    (heads split into fractions: 2.5 each for 40 heads over 16 members) misses that the members
    with the extra head must hold fewer tokens, so the others more: 1.2-6.3% below the optimum on
    the 16-member groups of two 128-GPU plans, this bound 0.01-0.35%. The point: those members,
    the fewer-head ones first (tokens non-increasing), tokens rounded by largest remainder."""
    n, H = g.size, g.heads
    q, r = divmod(H, n)
    if len(g.rows) != 1 or n < 2 or r == 0:
        return None
    _, a, s, _, _, _, free, mt, mh, cap = g.rows[0]
    beta = g.beta(0, T)
    heads = [q] * (n - r) + [q + 1] * r
    counts = ((n - r, q), (r, q + 1))

    def most(h: int, zl: float) -> float:  # units a member with h heads holds within zl and memory
        mem = (free - h * T * mh) / mt if mt else math.inf
        return min(zl / a if a > 0 else math.inf, mem, cap, T)

    def least_att(zl: float) -> float | None:
        return _least_attention([(k, h * beta, most(h, zl)) for k, h in counts], s, T)

    def value(zl: float) -> float:
        za = least_att(zl)
        return math.inf if za is None else max(zl, lin_floor) + max(za, att_floor)

    if a > 0:
        # max t >= T / n; beyond cap a larger zl changes nothing
        lo, top = a * T / n, float(a * min(T, cap))
        if least_att(top) is None:
            return None
        if least_att(lo) is None:  # the smallest zl at which the units fit at all
            bad, lo = lo, top
            while lo - bad > BALANCED_TOL * lo:
                mid = (bad + lo) / 2
                if least_att(mid) is None:
                    bad = mid
                else:
                    lo = mid
        hi = top
        while hi - lo > BALANCED_TOL * hi:  # value is convex in zl: the minimum stays in [lo, hi]
            m1, m2 = lo + (hi - lo) / 3, hi - (hi - lo) / 3
            if value(m1) <= value(m2):
                hi = m2
            else:
                lo = m1
        # the value's slope in zl lies in [-n s / a, 1] (a larger zl frees units that the members
        # below it absorb at s / a per unit each), so the minimum is at most that far below value(lo)
        zl, slack = lo, max(1.0, n * s / a) * (hi - lo)
    else:
        zl, slack = 0.0, 0.0
    za = least_att(zl)
    if za is None:
        return None
    bound = max(zl, lin_floor) + max(za, att_floor) - slack
    want = [min(most(h, zl), (za - h * beta) / s if s > 0 else T) for h in heads]
    scale = T / sum(want)
    caps = [int(min(cap, T, (free - h * T * mh) // mt if mt else T)) for h in heads]
    if min(caps) < MIN_UNITS_PER_RANK or sum(caps) < T:
        return None
    tokens = largest_remainder([w * scale for w in want], T, caps, low=MIN_UNITS_PER_RANK)
    if not _fits(g, T, tokens, heads):
        return None
    return bound, tokens, heads


def _identical_runs(g: GroupCoef) -> list[list[int]]:
    """Members with identical coefficients, grouped (each list ascending)."""
    runs: dict[tuple[int, ...], list[int]] = {}  # by (a, s, b, c, e, free, mt, mh)
    for i in range(g.size):
        key = (g.a[i], g.s_(i), g.b[i], g.c[i], g.e[i], g.free[i], g.mt[i], g.mh[i])
        runs.setdefault(key, []).append(i)
    return list(runs.values())


def _fits(g: GroupCoef, T: int, t: list[int], h: list[int]) -> bool:
    return all(
        t[i] * g.mt[i] + h[i] * T * g.mh[i] <= g.free[i] and t[i] >= MIN_UNITS_PER_RANK
        for i in range(g.size)
    )


def _phases(g: GroupCoef, T: int, t: list[int], h: list[int]) -> tuple[int, int]:
    """(linear phase, attention phase) of an integer point: max t a, max t s + h beta (ns)."""
    betas, s = g.betas(T), g.s or (0,) * g.size
    return (
        max(map(mul, t, g.a)),
        max(ti * si + hi * bi for ti, si, hi, bi in zip(t, s, h, betas)),
    )


def _time(g: GroupCoef, T: int, t: list[int], h: list[int]) -> int:
    """The group's own phase objective (no floors)."""
    return sum(_phases(g, T, t, h))


def _floored(g: GroupCoef, T: int, t: list[int], h: list[int], lf: int, af: int) -> int:
    lin, att = _phases(g, T, t, h)
    return max(lin, lf) + max(att, af)


def _solution(
    g: GroupCoef, T: int, t: Sequence[int], h: Sequence[int], bound: int, status: str
) -> GroupSolution:
    lin, att = _phases(g, T, list(t), list(h))
    return GroupSolution(tuple(t), tuple(h), lin + att, bound, status, lin, att)


@lru_cache(maxsize=100_000)
def refine_group(g: GroupCoef, T: int, lin_floor: int = 0, att_floor: int = 0) -> GroupSolution:
    """Optimal (or best found) integer tokens/heads per member for a group holding T units:
    minimises ``max(zl, lin_floor) + max(za, att_floor)`` (the floors: the other groups' phase maxima).
    CP-SAT runs under fixed deterministic limits (``SOLVE_DETERMINISTIC_TIME``, then
    ``BALANCE_DETERMINISTIC_TIME``), so the result does not depend on the machine's load."""
    n, H = g.size, g.heads
    lf, af = int(lin_floor), int(att_floor)
    if T > sum(g.cap) or T < min_units(g) or min(g.cap) < MIN_UNITS_PER_RANK:
        return GroupSolution((), (), 0, 0, "INFEASIBLE")
    if n == 1:
        if T * g.mt[0] + H * T * g.mh[0] > g.free[0]:
            return GroupSolution((), (), 0, 0, "INFEASIBLE")
        return _solution(g, T, [T], [H], _floored(g, T, [T], [H], lf, af), "OPTIMAL")
    hint = greedy(g, T, lf, af)
    if hint and not _fits(g, T, *hint):
        hint = None
    betas = g.betas(T)
    ub = (
        _floored(g, T, *hint, lf, af)
        if hint
        else max(lf, T * max(g.a), 1) + max(af, T * max(g.s or (0,)) + H * max(betas))
    )
    # the continuous optimum is a lower bound: a rounded point within GREEDY_GAP of it is kept as is
    lp = (
        sum(group_phase_time(g, T, lf, af))
        if math.isfinite(group_phase_time(g, T, lf, af)[1])
        else 0.0
    )
    lp = max(lp, lf + af)
    if hint and (ub <= lp * (1 + GREEDY_GAP) or n > CPSAT_MAX_MEMBERS):
        return _solution(g, T, hint[0], hint[1], min(ub, math.floor(lp)), "FEASIBLE")
    if n > CPSAT_MAX_MEMBERS:  # no valid rounded point: counted infeasible, CP-SAT not run
        return GroupSolution((), (), 0, 0, "INFEASIBLE")
    # identical members whose heads do not split evenly: the bound with whole heads (the continuous
    # one ignores that the members with the extra head hold fewer tokens) and the balanced point
    balanced = balanced_point(g, T, lf, af)
    if balanced is not None:
        bound_b, t_b, h_b = balanced
        lp_b = max(lp, bound_b)
        ub_b = _floored(g, T, t_b, h_b, lf, af)
        if hint and ub <= ub_b:  # the rounded continuous point is as good: keep it
            t_b, h_b, ub_b = hint[0], hint[1], ub
        if ub_b <= lp_b * (1 + GREEDY_GAP):
            return _solution(g, T, t_b, h_b, min(ub_b, math.floor(lp_b)), "FEASIBLE")

    model = cp_model.CpModel()
    # variables: tokens (units) and heads per member, the two phase maxima (floored by the other groups')
    t = {i: model.new_int_var(MIN_UNITS_PER_RANK, min(g.cap[i], T), f"t_{i}") for i in range(n)}
    h = {i: model.new_int_var(0, H, f"h_{i}") for i in range(n)}
    zl = model.new_int_var(min(lf, ub), ub, "zl")
    za = model.new_int_var(min(af, ub), ub, "za")
    z = zl + za
    # the group's tokens and heads are all placed
    model.add(sum(t.values()) == T)
    model.add(sum(h.values()) == H)
    model.add(z <= ub)
    # every member owns >= 1 unit (t's lower bound): Megatron cannot run an empty sequence shard
    # zl bounds every member's linear phase, za its attention phase (A2A + attention/K-V ring)
    for i in range(n):
        model.add(t[i] * g.a[i] <= zl)
        model.add(t[i] * g.s_(i) + h[i] * betas[i] <= za)
    # memory: own activations + attention core for the group's tokens and own heads
    for i in range(n):
        model.add(t[i] * g.mt[i] + h[i] * (T * g.mh[i]) <= g.free[i])
    # symmetry: identical members hold non-increasing tokens
    for run in _identical_runs(g):
        for i, j in zip(run, run[1:]):
            model.add(t[i] >= t[j])
    model.minimize(z)
    if hint:
        for i in range(n):
            model.add_hint(t[i], hint[0][i])
            model.add_hint(h[i], hint[1][i])

    solver = cp_model.CpSolver()
    solver.parameters.num_workers = 1
    solver.parameters.random_seed = 0
    solver.parameters.cp_model_presolve = CPSAT_PRESOLVE
    # deterministic time limits (no wall-clock limit): the same inputs stop at the same point on any
    # machine load
    solver.parameters.max_deterministic_time = SOLVE_DETERMINISTIC_TIME
    solver.parameters.relative_gap_limit = RELATIVE_GAP
    status = solver.solve(model)
    if status in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        z_best, bound = int(solver.objective_value), int(solver.best_objective_bound)
        tv = [solver.value(t[i]) for i in range(n)]
        hv = [solver.value(h[i]) for i in range(n)]
        # phase 2: among solutions as fast as z_best, the most even split between identical members
        # (the max-time optimum is flat; evenness keeps the terms the surrogate leaves out balanced)
        runs = _identical_runs(g)
        if n <= BALANCE_MAX_MEMBERS and any(len(run) > 1 for run in runs):
            model.add(z <= z_best)
            spread = []
            for k, run in enumerate(runs):
                if len(run) < 2:
                    continue
                for var, name, hi in ((t, "t", T), (h, "h", H)):
                    lo_v = model.new_int_var(0, hi, f"{name}min_{k}")
                    hi_v = model.new_int_var(0, hi, f"{name}max_{k}")
                    model.add_min_equality(lo_v, [var[i] for i in run])
                    model.add_max_equality(hi_v, [var[i] for i in run])
                    spread.append(hi_v - lo_v)
            model.minimize(sum(spread))
            model.clear_hints()
            solver.parameters.max_deterministic_time = BALANCE_DETERMINISTIC_TIME
            solver.parameters.relative_gap_limit = 0.0
            solver.parameters.linearization_level = BALANCE_LINEARIZATION
            for i in range(n):
                model.add_hint(t[i], tv[i])
                model.add_hint(h[i], hv[i])
            status2 = solver.solve(model)
            if status2 in (cp_model.OPTIMAL, cp_model.FEASIBLE):
                tv = [solver.value(t[i]) for i in range(n)]
                hv = [solver.value(h[i]) for i in range(n)]
        return _solution(
            g, T, tv, hv, bound, "OPTIMAL" if status == cp_model.OPTIMAL else "FEASIBLE"
        )
    if status == cp_model.INFEASIBLE:
        return GroupSolution((), (), 0, 0, "INFEASIBLE")
    assert status != cp_model.MODEL_INVALID, model.validate()
    # UNKNOWN: time ran out before any solution; keep the valid greedy point
    if hint:
        return _solution(g, T, hint[0], hint[1], 0, "HINT")
    return GroupSolution((), (), 0, 0, "INFEASIBLE")


@lru_cache(maxsize=200_000)
def probe_time(g: GroupCoef, T: int, lin_floor: int = 0, att_floor: int = 0) -> float:
    """Cheap upper bound of a group's (floored) Stage III objective for T units: the rounded continuous
    optimum (``greedy``), or inf when it does not fit. Used by the integer repair of the split, so
    that only the final per-group solve runs CP-SAT."""
    if T < min_units(g) or T > sum(g.cap):
        return math.inf
    hint = greedy(g, T, lin_floor, att_floor)
    if hint is None or not _fits(g, T, *hint):
        return math.inf
    return float(_floored(g, T, *hint, lin_floor, att_floor))


def floors(split: Split) -> tuple[int, int]:
    """Stage III's phase floors from a split: its continuous linear and attention maxima (integer ns).

    A single group has no other groups, so no floors: its continuous maxima are only a relaxation of
    its own phases, and flooring at them made Stage III minimise ``max(zl, L*) + max(za, A*)``
    instead of ``zl + za`` (optimality_gap instance 1, one group of 7: 3.2% above the exact optimum)."""
    if len(split.units) == 1:
        return 0, 0
    return math.floor(split.lin_ns), math.floor(split.att_ns)


def rebalance_units(
    groups: list[GroupCoef],
    units: list[int],
    target_ns: float,
    max_moves: int | None = None,
    floor_ns: tuple[int, int] = (0, 0),
) -> list[int]:
    """Integer repair of Stage II: while the slowest group's Stage III time (INFEASIBLE = infinite)
    is more than ``REPAIR_SLACK`` above the continuous split's ``target_ns``, move one unit from it to
    the currently fastest group, if that lowers the maximum.

    The continuous split can sit on a knife edge (one more unit no longer fits a rank's memory with
    an even head split, so the integer optimum jumps); this closes that gap. Deterministic.
    """
    units = list(units)

    def f(i: int, T: int) -> float:
        return probe_time(groups[i], T, *floor_ns)

    times = [f(i, T) for i, T in enumerate(units)]
    moves = max_moves if max_moves is not None else 4 * len(groups) + 16
    for _ in range(moves):
        i = max(range(len(units)), key=lambda k: (times[k], -k))
        if times[i] <= target_ns * (1 + REPAIR_SLACK) or units[i] <= min_units(groups[i]):
            break
        j = min(range(len(units)), key=lambda k: (times[k], k))
        if j == i:
            break
        ti, tj = f(i, units[i] - 1), f(j, units[j] + 1)
        if not max(ti, tj) < times[i]:
            break
        units[i] -= 1
        units[j] += 1
        times[i], times[j] = ti, tj
    return units


def integer_split(groups: list[GroupCoef], num_units: int) -> tuple[Split, list[int]] | None:
    """Stage II made integer-aware: split continuously, then cap every group class whose Stage III
    (integer) time exceeds the split's time by more than ``REPAIR_SLACK`` at the largest unit count
    that meets it (bisection), and split again; finally ``rebalance_units`` moves single units.

    Returns (continuous split of the last round, final units) or None when memory cannot hold the sequence.
    """
    caps: dict[GroupCoef, int] = {}

    split = None
    for _ in range(6):
        # later rounds keep the first round's linear bound L (one bisection on A instead of the L
        # search); the full search only when the caps make that L infeasible
        capped = (
            split_sequence(groups, num_units, caps)
            if split is None
            else split_at(groups, num_units, caps, split.lin_ns)
            or split_sequence(groups, num_units, caps)
        )
        if (
            capped is None
        ):  # the caps leave too little room: keep the last split and repair by single units
            if split is None:
                return None
            break
        split = capped
        target = split.z_rounded_ns * (1 + REPAIR_SLACK)
        fl = floors(split)

        def f(g: GroupCoef, T: int, fl: tuple[int, int] = fl) -> float:
            return probe_time(g, T, *fl)

        changed = False
        first: dict[GroupCoef, int] = {}
        for i, g in enumerate(groups):
            first.setdefault(g, i)
        for g, T in sorted(set(zip(groups, split.units)), key=lambda x: (x[1], first[x[0]])):
            if T <= min_units(g) or f(g, T) <= target:
                continue
            lo, hi = (
                min_units(g),
                T - 1,
            )  # largest T' in [|g|, T-1] with f(T') <= target (|g| if none)
            while lo < hi:
                mid = (lo + hi + 1) // 2
                if f(g, mid) <= target:
                    lo = mid
                else:
                    hi = mid - 1
            if lo < caps.get(g, num_units):
                caps[g] = lo
                changed = True
        if not changed:
            break
    assert split is not None
    units = rebalance_units(groups, list(split.units), split.z_rounded_ns, floor_ns=floors(split))
    return split, units
