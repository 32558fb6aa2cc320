"""Stage II: split the sequence between A2A groups by capability (continuous model + integer units).

The objective is the cost model's bulk-synchronous phases (see ``planner.surrogate``):
``Z_lin + Z_att`` with ``Z_lin >= t_r a_r`` (linear phase) and ``Z_att >= t_r s_r + h_r beta_r(T_g)``
(attention phase) for every rank of the domain. Group coefficients, with the group's place in the
sequence, are ``planner.coef.GroupCoef``.

For a linear bound ``L`` (``t_r <= L / a_r``) and an attention bound ``A``, whether a group can hold
``T`` units with its tokens and heads split *continuously* among its members is a fractional
knapsack (``max_heads``: the most heads that fit), exact and cheap. The units a group can hold
within (A, L) form an interval ``[lo, hi]`` (``units_range``; closed form for identical members):
above ``hi`` its attention or memory overflows, below ``lo`` the K/V it receives from the other
groups (``visible(T) c``, larger when it holds fewer units) does not hide. Every group keeps at
least one unit per member. For a given ``L`` the split is the smallest ``A`` at which every group's
interval is non-empty and ``sum lo <= N <= sum hi`` (bisection, ``split_at``); units are then
handed out inside the intervals (every group stays within A). ``L`` is a branch-and-bound search
of ``L + A(L)`` (``linsearch.best_lin``), which also proves a lower bound: ``Split.bound_ns`` is a
lower bound of the phase objective over every split of these groups (integer units per group,
continuous tokens and heads per member), so of Stage III's integer optimum. Groups with identical
coefficients share every evaluation.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from functools import lru_cache
from typing import TypeVar

from megatron_hexiseq.planner.coef import INF, MIN_UNITS_PER_RANK, GroupCoef
from megatron_hexiseq.planner.linsearch import best_lin
from megatron_hexiseq.planner.unit_range import (
    group_time,
    linear_phase,
    max_units,
    min_units,
    units_range,
)

A_TOL = 1e-5  # relative width of the bisection on the attention bound


COARSE_A_TOL = 1e-3  # Stage I's coarse split: the attention bound's bisection to 0.1%


@dataclass(frozen=True)
class Split:
    """Units per group and the phase values of the split.

    ``z_relaxed_ns``: ``lin_ns + att_ns``, the relaxation's value at the split's linear bound;
    ``z_rounded_ns``: ``lin_ns + max_g A_g(units_g, lin_ns)`` of the integer units handed out
    (<= ``z_relaxed_ns`` up to the bisection's tolerance); ``bound_ns``: a proven lower bound of the
    phase objective over every split of these groups (0 when not searched: the coarse split).
    """

    units: tuple[int, ...]
    z_relaxed_ns: float
    z_rounded_ns: float
    lin_ns: float = 0.0  # linear-phase maximum L of the split
    att_ns: float = 0.0  # attention-phase maximum A of the split
    bound_ns: float = 0.0


def split_sequence(
    groups: Sequence[GroupCoef],
    num_units: int,
    caps: dict[GroupCoef, int] | None = None,
    search_lin: bool = True,
) -> Split | None:
    """Stage II: units per group summing to ``num_units`` (every group >= one unit per member); None if
    memory can't hold it (or the groups have more members than there are units).

    Minimises the phase objective ``L + A``: for a given linear bound ``L`` the smallest ``A`` is a
    bisection (``split_at``); ``L`` itself is searched by ``best_lin`` between the smallest L that
    places every unit and the linear phase of the unconstrained (``L = inf``) split.

    ``caps[g]``: at most that many units for every group with coefficients ``g`` (set by the
    integer repair in ``stage3_refine.integer_split``). ``search_lin=False``: Stage I's coarse split,
    the ``L = inf`` split alone with a coarser bisection (an upper bound of the phase optimum).
    """
    if not search_lin:
        return split_at(groups, num_units, caps, INF, True)
    if not caps:  # the same groups are split by Stage I, the repair and the exact hint
        # the split depends on the groups as a multiset (``hand_out`` breaks ties by
        # ``GroupCoef.key``), so it is searched once in canonical order and its units handed back in
        # the caller's order: per class ascending, the lower indices holding the fewer
        canonical = tuple(sorted(groups, key=GroupCoef.key))
        found = _split_cached(canonical, num_units)
        if found is None or canonical == tuple(groups):
            return found
        per_class: dict[GroupCoef, list[int]] = {}
        for g, u in zip(canonical, found.units):
            per_class.setdefault(g, []).append(u)
        taken = {g: iter(sorted(us)) for g, us in per_class.items()}
        return replace(found, units=tuple(next(taken[g]) for g in groups))
    return _split_search(groups, num_units, caps)


@lru_cache(maxsize=4096)
def _split_cached(groups: tuple[GroupCoef, ...], num_units: int) -> Split | None:
    return _split_search(groups, num_units, None)


def _split_search(
    groups: Sequence[GroupCoef], num_units: int, caps: dict[GroupCoef, int] | None
) -> Split | None:
    free = split_at(groups, num_units, caps, INF)
    if free is None:
        return free
    lo, hi = lin_floor(groups, num_units), free.lin_ns
    cache: dict[float, Split | None] = {INF: free}

    def at(L: float) -> Split | None:
        if L not in cache:
            cache[L] = split_at(groups, num_units, caps, L, bracket=att_bracket(cache, L))
        return cache[L]

    def f(L: float) -> float:
        sp = at(L)
        return sp.z_relaxed_ns if sp is not None else INF

    count: dict[GroupCoef, int] = {}
    for g in groups:
        count[g] = count.get(g, 0) + 1

    def ok(
        L: float,
    ) -> bool:  # every unit (and each group's one unit per member) placeable within L
        most = {g: min(max_units(g, 1e30, L), (caps or {}).get(g, num_units)) for g in count}
        return (
            all(most[g] >= min_units(g) for g in count)
            and sum(k * most[g] for g, k in count.items()) >= num_units
        )

    L, bound = best_lin(f, min(lo, hi), hi, ok)
    best = at(L)
    if best is None or best.z_rounded_ns > free.z_rounded_ns:
        best = free
    # beyond the L = inf split's linear phase a larger L cannot lower A: f(L) >= f(hi) there
    proven = min(bound, free.z_relaxed_ns) * (1 - A_TOL)
    return Split(
        units=best.units,
        z_relaxed_ns=best.z_relaxed_ns,
        z_rounded_ns=best.z_rounded_ns,
        lin_ns=best.lin_ns,
        att_ns=best.att_ns,
        bound_ns=min(proven, best.z_rounded_ns),
    )


def lin_floor(groups: Sequence[GroupCoef], num_units: int) -> float:
    """The smallest linear phase that can place every unit: ``sum_r t_r = N`` with ``t_r a_r <= L``."""
    inv = sum(1.0 / a for g in groups for a in g.a if a > 0)
    return num_units / inv if inv > 0 and all(min(g.a) > 0 for g in groups) else 0.0


def att_bracket(cache: dict[float, Split | None], L: float) -> tuple[float, float] | None:
    """Bounds on A*(L) from the splits at other linear bounds: A* is non-increasing in L, so a split
    at x < L gives a feasible upper end, one at y > L an infeasible lower end (its bisection's
    feasible end less the tolerance)."""
    below = [x for x, s in cache.items() if x < L and s is not None]
    above = [y for y, s in cache.items() if y > L and s is not None]
    if not below or not above:
        return None
    hi, lo = cache[max(below)].att_ns, cache[min(above)].att_ns * (1 - A_TOL)  # type: ignore[union-attr]
    return (lo, hi) if lo < hi else None


def split_at(
    groups: Sequence[GroupCoef],
    num_units: int,
    caps: dict[GroupCoef, int] | None,
    lin: float,
    coarse: bool = False,
    bracket: tuple[float, float] | None = None,
) -> Split | None:
    """The split for a fixed linear bound ``lin`` (``inf``: none): units per group summing to
    ``num_units`` (every group >= one unit per member) at the smallest attention bound; None if memory
    or ``lin`` can't hold it (or the groups have more members than there are units).

    ``caps[g]``: at most that many units for every group with coefficients ``g`` (set by the
    integer repair in ``stage3_refine.integer_split``). ``bracket``: (an infeasible, a feasible)
    attention bound known from the splits at other linear bounds (``att_bracket``).
    """
    caps = caps or {}
    distinct: dict[GroupCoef, int] = {}
    for g in groups:
        distinct[g] = distinct.get(g, 0) + 1
    if sum(k * min(g.max_units(), caps.get(g, num_units)) for g, k in distinct.items()) < num_units:
        return None
    if sum(k * min_units(g) for g, k in distinct.items()) > num_units or any(
        min(g.cap) < MIN_UNITS_PER_RANK for g in distinct
    ):
        return None  # fewer units than ranks, or a rank cannot hold one unit

    capped = [(g, k, caps.get(g, num_units)) for g, k in distinct.items()]
    settle = not coarse
    # the group whose range failed last is tried first (as ``arranged_split.arranged_feasible``
    # does with its final keys): a failing test then costs one range; the ranges are pure
    # functions of (group, z), so the order changes no answer
    order = list(range(len(capped)))

    def ranges(z: float) -> dict[GroupCoef, tuple[int, int]] | None:
        got: list[tuple[int, int]] = [(0, 0)] * len(capped)
        lo_sum = hi_sum = 0
        for i in order:
            g, k, cap = capped[i]
            r = units_range(g, z, lin, settle)
            if r is None or r[0] > cap:
                if order[0] != i:
                    order.remove(i)
                    order.insert(0, i)
                return None
            hi = r[1] if r[1] < cap else cap
            got[i] = (r[0], hi)
            lo_sum += k * r[0]
            hi_sum += k * hi
        if not lo_sum <= num_units <= hi_sum:
            return None
        return {g: r for (g, _, _), r in zip(capped, got)}

    got = smallest_bound(
        ranges,
        bracket,
        lambda: start_bound(distinct, -(-num_units // len(groups)), lin),
        COARSE_A_TOL if coarse else A_TOL,
    )
    if got is None:  # memory (heads' attention working set) or lin cannot hold the sequence
        return None
    hi, at_hi = got
    units = hand_out(groups, distinct, at_hi, num_units)
    pairs = set(zip(groups, units))
    att_round = max(group_time(g, u, lin) for g, u in pairs)
    lin_used = (
        lin if math.isfinite(lin) else max(linear_phase(g, u, group_time(g, u)) for g, u in pairs)
    )
    return Split(
        units=tuple(units),
        z_relaxed_ns=lin_used + hi,
        z_rounded_ns=lin_used + att_round,
        lin_ns=lin_used,
        att_ns=hi,
    )


Found = TypeVar("Found")


def smallest_bound(
    test: Callable[[float], Found | None],
    bracket: tuple[float, float] | None,
    start: Callable[[], float],
    tol: float,
) -> tuple[float, Found] | None:
    """The smallest attention bound z where ``test(z)`` is not None (``test`` holds from some z on),
    to a relative ``tol``, and ``test``'s value there; None when nothing up to 1e18 ns holds.

    A bisection of [lo, hi], lo failing and hi holding, until ``hi - lo <= tol * hi``; the first
    bracket is ``bracket`` when its upper end holds, else [0, ``start()``] with the upper end doubled
    while it fails. (Starting near another arrangement's answer and galloping outwards saved a tenth
    of Stage I's coarse tests, but the arranged test is not quite monotone in z (a memory-capped
    prefix block), so from there it found another threshold: suite row 21 lost 63%.)"""
    if bracket is not None:
        at = test(bracket[1])
        if at is not None:
            return _bisect(test, bracket[0], bracket[1], at, tol)
    lo, hi = 0.0, start()
    at = test(hi)
    while at is None:
        lo, hi = hi, hi * 2
        if hi > 1e18:
            return None
        at = test(hi)
    return _bisect(test, lo, hi, at, tol)


def _bisect(
    test: Callable[[float], Found | None], lo: float, hi: float, at: Found, tol: float
) -> tuple[float, Found]:
    """``smallest_bound``'s bisection: lo fails, hi holds with value ``at``."""
    for _ in range(80):
        if hi - lo <= tol * hi:
            break
        mid = (lo + hi) / 2
        at_mid = test(mid)
        if at_mid is not None:
            hi, at = mid, at_mid
        else:
            lo = mid
    return hi, at


def start_bound(groups: Iterable[GroupCoef], share: int, lin: float) -> float:
    """An attention bound to start a split's bisection from (it doubles while infeasible): the
    slowest group's time at an even ``share`` of units (clamped to its unit range), over the groups
    that can hold that share; 1 ms when none can. (Any group out of memory at its share used to make
    it 1 ms: a third of Stage I's coarse splits then spent 10-17 doublings reaching the answer.)"""
    times = [group_time(g, min(max(share, g.min_units()), g.max_units()), lin) for g in groups]
    finite = [x for x in times if math.isfinite(x)]
    return max(finite) if finite else 1e6


def hand_out(
    groups: Sequence[GroupCoef],
    distinct: dict[GroupCoef, int],
    ranges: dict[GroupCoef, tuple[int, int]],
    num_units: int,
) -> list[int]:
    """Units per group inside the feasible ranges, summing to ``num_units``: every group starts at its
    lower end and the rest goes to the classes of identical groups in proportion to their room
    (largest remainder, ties by ``GroupCoef.key``); inside a class the groups differ by at most one unit, the
    lower group indices holding the fewer."""
    rest = num_units - sum(k * ranges[g][0] for g, k in distinct.items())
    room = {g: k * (ranges[g][1] - ranges[g][0]) for g, k in distinct.items()}
    total = sum(room.values())
    extra = {g: 0 for g in distinct}
    if rest > 0 and total > 0:
        shares = {g: rest * room[g] / total for g in distinct}
        extra = {g: min(room[g], math.floor(x)) for g, x in shares.items()}
        left = rest - sum(extra.values())
        # ties by the classes' coefficients, not their order: the split of a multiset of groups is
        # the same in any order (``split_sequence`` caches it so)
        for g in sorted(distinct, key=lambda g: (-(shares[g] - math.floor(shares[g])), g.key())):
            if left <= 0:
                break
            if extra[g] < room[g]:
                extra[g] += 1
                left -= 1
        assert left == 0, "hand_out: the ranges cannot hold the sequence"
    queue = {}
    for g, k in distinct.items():
        q, r = divmod(extra[g], k)
        base = ranges[g][0] + q
        queue[g] = [base] * (k - r) + [base + 1] * r  # ascending: the lower indices hold fewer
    taken = {g: 0 for g in distinct}
    units = []
    for g in groups:
        units.append(queue[g][taken[g]])
        taken[g] += 1
    return units
