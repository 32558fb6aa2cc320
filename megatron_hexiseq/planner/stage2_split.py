"""Stage II: split the sequence between A2A groups by capability (continuous model + integer rounding).

The objective is the cost model's bulk-synchronous phases (see ``planner.surrogate``):
``Z_lin + Z_att`` with ``Z_lin >= t_r a_r`` (linear phase) and ``Z_att >= t_r s_r + h_r beta_r(T_g)``
(attention phase) for every rank of the domain. Both maxima are global, so the split is searched
with both: for a linear bound ``L`` (``t_r <= L / a_r``) and attention bound ``A``, a group's
feasibility with ``T`` units and tokens/heads split *continuously* among its members is a fractional
knapsack: the most heads fit when tokens go first to ranks with the smallest ``s_r / beta_r``
(``max_heads`` below), so feasibility is exact and cheap. ``T_g(A, L)`` = the most units group g can
take (bisection on integers); for a given ``L`` the split is the smallest ``A*`` with
``sum_g T_g(A*, L) >= N`` (bisection), then units are trimmed from the slowest groups until they sum
to ``N`` exactly (``_round_units``); ``L`` is a branch-and-bound search of ``L + A*(L)`` (``best_lin``). Groups with identical
coefficients share every evaluation (cache), so thousands of GPUs of a few types cost about as
much as a few groups.

Causal balance is handled by the arrangement (``planner.build``: mirrored head+tail chunks), which
makes a group's attention work proportional to ``T_g``; the compute-proportional rule is the special
case of this model with free communication and memory.
"""
from __future__ import annotations

import heapq
import math
from dataclasses import dataclass
from functools import cached_property, lru_cache
from typing import Sequence

from megatron_hexiseq.planner.linsearch import LIN_COARSE_EVALS, LIN_EVALS, best_lin

INF = float("inf")
MIN_UNITS_PER_RANK = 1  # every rank owns >= 1 token unit: Megatron cannot run an empty sequence shard


@dataclass(frozen=True)
class GroupCoef:
    """Integer coefficients of a group's members (order = member order).

    Time (ns): a (linear phase, per own unit), s (A2A, attention phase, per own unit), b, c, e
    (attention phase, per head; see ``beta``). Memory (bytes): free, mt (per own
    unit), mh (per head per group unit). ``cap`` = units that fit with no heads.
    """

    a: tuple[int, ...]
    b: tuple[int, ...]
    c: tuple[int, ...]
    e: tuple[int, ...]
    free: tuple[int, ...]
    mt: tuple[int, ...]
    mh: tuple[int, ...]
    heads: int
    num_units: int
    s: tuple[int, ...] = ()  # A2A ns per own unit (attention phase); empty = 0 for every member

    def __hash__(self) -> int:  # hashed on every cache lookup: computed once
        return self._hash

    @cached_property
    def _hash(self) -> int:
        return hash((self.a, self.b, self.c, self.e, self.free, self.mt, self.mh, self.heads, self.num_units, self.s))

    def s_(self, i: int) -> int:
        """A2A ns per own unit of member i (attention phase)."""
        return self.s[i] if self.s else 0

    @cached_property
    def classes(self) -> tuple[tuple[int, ...], ...]:
        """Members with identical coefficients, grouped (they behave identically in the continuous model)."""
        out: dict[tuple, list[int]] = {}
        for i in range(self.size):
            key = (self.a[i], self.s_(i), self.b[i], self.c[i], self.e[i], self.free[i], self.mt[i], self.mh[i])
            out.setdefault(key, []).append(i)
        return tuple(tuple(v) for v in out.values())

    @cached_property
    def rows(self) -> tuple[tuple[int, int, int, int, int, int, int, int, int, int], ...]:
        """Per class of identical members: (count, a, s, b, c, e, free, mt, mh, cap) of its first
        member, precomputed for ``max_heads`` (the planner's innermost loop)."""
        out = []
        for members in self.classes:
            i = members[0]
            out.append((len(members), self.a[i], self.s_(i), self.b[i], self.c[i], self.e[i], self.free[i],
                        self.mt[i], self.mh[i], self.cap[i]))
        return tuple(out)

    @cached_property
    def cap(self) -> tuple[int, ...]:
        return tuple(f // m if m else 1 << 40 for f, m in zip(self.free, self.mt))

    def head_mem_cap(self, i: int, T: int, t: float) -> float:
        """Most heads member i can hold in memory with t own units while the group holds T units."""
        per = T * self.mh[i]
        return (self.free[i] - t * self.mt[i]) / per if per else INF

    def beta(self, i: int, T: int) -> int:
        """Per-head time coefficient of member i when the group holds T units (ns)."""
        return max(T * self.b[i], (self.num_units - T) * self.c[i]) + T * self.e[i]

    @property
    def size(self) -> int:
        return len(self.a)


def max_heads(g: GroupCoef, T: int, z: float, lin: float = INF) -> tuple[float, list[float]]:
    """Most heads (continuous) the group can hold with attention phase ``z`` and linear phase ``lin``
    with ``T`` units; -inf if the tokens don't fit.

    Member i can hold ``h_i(t) = min((z - s_i t)/beta_i, (free_i - mt_i t)/(T mh_i))`` heads with
    ``t <= lin / a_i`` own units: concave, piecewise linear with at most two slopes. Every member holds at least one unit
    (``MIN_UNITS_PER_RANK``: Megatron cannot run an empty sequence shard), so each starts at ``t = 1``
    and the remaining ``T - n`` units are placed. Maximising ``sum h_i(t_i)`` subject to
    ``sum t_i = T, t_i >= 1`` is separable concave, so filling the flattest slope pieces first is exact.
    Returns (heads, token allocation).
    """
    n = g.size
    if T < n * MIN_UNITS_PER_RANK:
        return -INF, []
    lo = float(MIN_UNITS_PER_RANK)
    rest = g.num_units - T
    if len(g.rows) == 1:  # identical members: the even split is optimal (separable, concave, symmetric)
        k, a, s, b, c, e, free, mt, mh, cap = g.rows[0]
        beta = max(T * b, rest * c) + T * e
        per = T * mh
        t = T / n
        tmax = min(cap, z / s if s > 0 else INF, lin / a if a > 0 else INF)
        if tmax < lo or tmax < t:
            return -INF, []
        att = (z - s * t) / beta if beta > 0 else INF
        mem = (free - mt * t) / per if per > 0 else INF
        return n * min(att, mem), [t] * n
    pieces: list[tuple[float, int, float]] = []  # (slope, class, length for the whole class)
    heads0 = 0.0
    room = 0.0
    for ci, (k, a, s, b, c, e, free, mt, mh, cap) in enumerate(g.rows):
        beta = max(T * b, rest * c) + T * e
        per = T * mh
        a0, sa = (z / beta, s / beta) if beta > 0 else (INF, 0.0)
        m0, sm = (free / per, mt / per) if per > 0 else (INF, 0.0)
        tmax = min(cap, z / s if s > 0 else INF, lin / a if a > 0 else INF)
        if tmax < lo:  # the member cannot hold its one unit within z (or memory)
            return -INF, []
        room += k * (tmax - lo)
        first, second = ((a0, sa), (m0, sm)) if a0 <= m0 else ((m0, sm), (a0, sa))
        heads0 += k * min(a0 - sa * lo, m0 - sm * lo)  # heads at the mandatory unit
        # the lines cross where first[0] - first[1] t == second[0] - second[1] t
        cross = (second[0] - first[0]) / (second[1] - first[1]) if second[1] > first[1] else INF
        if cross >= tmax:
            pieces.append((first[1], ci, k * (tmax - lo)))
        elif cross > lo:
            pieces.append((first[1], ci, k * (cross - lo)))
            pieces.append((second[1], ci, k * (tmax - cross)))
        else:
            pieces.append((second[1], ci, k * (tmax - lo)))
    left = float(T - n * MIN_UNITS_PER_RANK)
    if room < left:
        return -INF, []
    pieces.sort()
    classes = g.classes
    per_class, heads = [0.0] * len(classes), heads0
    for slope, ci, length in pieces:
        if left <= 0:
            break
        take = min(left, length)
        per_class[ci] += take
        heads -= slope * take
        left -= take
    t = [0.0] * n
    for ci, members in enumerate(classes):
        for i in members:
            t[i] = lo + per_class[ci] / len(members)
    return heads, t


def feasible(g: GroupCoef, T: int, z: float, lin: float = INF) -> bool:
    return max_heads(g, T, z, lin)[0] >= g.heads - 1e-9


GROUP_TIME_TOL = 1e-7  # relative precision of ``group_time``


@lru_cache(maxsize=200_000)
def group_time(g: GroupCoef, T: int, lin: float = INF) -> float:
    """A_g(T, L): the group's continuous optimal attention phase (ns) for T units within linear phase
    ``lin``; inf when T exceeds its memory or the linear bound."""
    if T > sum(g.cap):
        return INF
    if len(g.rows) == 1 and g.beta(0, T) > 0:
        # identical members: even tokens and heads, so A = s T/n + H beta(T)/n exactly (when it fits)
        n = g.size
        z = g.s_(0) * T / n + g.heads * g.beta(0, T) / n
        return z if feasible(g, T, z, lin) else INF
    hi = T * max(g.s or (0,)) + g.heads * max(g.beta(i, T) for i in range(g.size)) + 1.0
    H = g.heads - 1e-9  # ``feasible``'s test
    f_hi = max_heads(g, T, hi, lin)[0]
    if f_hi < H:  # the heads' attention memory (or the linear bound) does not fit
        return INF
    # F(z) = max_heads(z) is concave in z (a partial maximisation of a jointly concave function over
    # a convex set) and piecewise linear: the chord from an infeasible lo to a feasible hi lies below
    # F, so its root is feasible (a new hi); one probe just below it proves it within the tolerance
    # (exact once lo and hi share a linear piece). Bisection steps when the chord is not usable.
    lo, f_lo = 0.0, max_heads(g, T, 0.0, lin)[0]
    for _ in range(60):
        if hi - lo <= GROUP_TIME_TOL * hi:
            break
        z = (lo + hi) / 2
        if math.isfinite(f_lo) and f_hi > f_lo:
            chord = lo + (H - f_lo) * (hi - lo) / (f_hi - f_lo)
            if lo < chord < hi:
                f_c = max_heads(g, T, chord, lin)[0]
                if f_c >= H:
                    hi, f_hi = chord, f_c
                    z = max(lo, hi * (1 - GROUP_TIME_TOL))
        f_z = max_heads(g, T, z, lin)[0]
        if f_z >= H:
            hi, f_hi = z, f_z
        else:
            lo, f_lo = z, f_z
    return hi


def linear_phase(g: GroupCoef, T: int, z: float, lin: float = INF) -> float:
    """Linear phase (ns) of the continuous point ``max_heads`` picks (largest ``t_i a_i``)."""
    _, t = max_heads(g, T, z, lin)
    return max((ti * ai for ti, ai in zip(t, g.a)), default=0.0)


@lru_cache(maxsize=200_000)
def group_phase_time(g: GroupCoef, T: int, lin_floor: float = 0.0, att_floor: float = 0.0) -> tuple[float, float]:
    """Continuous optimum of ``max(L, lin_floor) + max(A, att_floor)`` for a group holding T units
    (the other groups' phase maxima as floors): returns (L, A) with L >= lin_floor; (inf, inf) if
    T does not fit. Searches L (``best_lin``); A = ``group_time(g, T, L)``."""
    z_free = group_time(g, T)
    if not math.isfinite(z_free):
        return INF, INF
    hi = max(lin_floor, linear_phase(g, T, z_free))  # beyond it a larger L no longer helps A
    lo = max(lin_floor, T / sum(1.0 / a if a > 0 else INF for a in g.a) if min(g.a) > 0 else 0.0)
    lo = min(lo, hi)
    f = lambda L: L + max(group_time(g, T, L), att_floor)  # noqa: E731
    L = best_lin(f, lo, hi, lambda L: feasible(g, T, 1e30, L))
    return L, max(group_time(g, T, L), 0.0)


def min_units(g: GroupCoef) -> int:
    """Fewest units a group can hold: one per member (no rank may own zero tokens)."""
    return g.size * MIN_UNITS_PER_RANK


@lru_cache(maxsize=200_000)
def max_units(g: GroupCoef, z: float, lin: float = INF) -> int:
    """T_g(z): most units the group can take within z (assumes feasibility monotone in T); 0 when it
    cannot even hold its minimum (one unit per member) within z."""
    return max_units_between(g, z, lin)


def max_units_between(g: GroupCoef, z: float, lin: float = INF, known_lo: int = 0, known_hi: int | None = None) -> int:
    """``max_units(g, z, lin)`` with a bracket from earlier calls at the same ``lin``: ``known_lo`` =
    ``max_units`` at some z' <= z (0: unknown), ``known_hi`` = at some z'' >= z. ``max_units`` is
    non-decreasing in z (a larger attention bound only adds feasible points), so the answer lies in
    [known_lo, known_hi] and the bisection over T costs log2 of the bracket, not of the whole range:
    ``split_at``'s bisection on z narrows the bracket at every step (same result, far fewer calls)."""
    lo, full_hi = min_units(g), min(g.num_units, sum(g.cap))
    hi = full_hi if known_hi is None else min(full_hi, known_hi)
    if lo > hi:
        return 0
    if known_lo >= lo:
        lo = known_lo  # feasible at a smaller z, so feasible at z
    elif not feasible(g, lo, z, lin):
        # the K/V ring term (N - T) c makes a group with few units slow: its feasible T are an
        # interval that starts above the minimum; probe the balance point T b = (N - T) c
        b, c = g.b[0], g.c[0]
        mid = min(max(round(g.num_units * c / (b + c)) if b + c > 0 else lo, lo), full_hi)
        if mid == lo or not feasible(g, mid, z, lin):
            return 0
        lo, hi = mid, max(hi, mid)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if feasible(g, mid, z, lin):
            lo = mid
        else:
            hi = mid - 1
    return lo


@dataclass(frozen=True)
class Split:
    """Units per group; the continuous optimum ``lin_ns + att_ns`` (phase maxima of the relaxation)
    and the rounded units' value ``lin_ns + max_g A_g(units_g, lin_ns)``."""

    units: tuple[int, ...]
    z_relaxed_ns: float
    z_rounded_ns: float
    lin_ns: float = 0.0  # linear-phase maximum L of the continuous split
    att_ns: float = 0.0  # attention-phase maximum A of the continuous split


def split_sequence(groups: Sequence[GroupCoef], num_units: int,
                   caps: dict[GroupCoef, int] | None = None, search_lin: bool = True) -> Split | None:
    """Stage II: units per group summing to ``num_units`` (every group >= one unit per member); None if
    memory can't hold it (or the groups have more members than there are units).

    Minimises the phase objective ``L + A`` (slowest linear phase + slowest attention phase, both
    over every rank of the domain): for a given linear bound ``L`` (each rank's tokens <= L / a_r) the
    smallest ``A`` is a bisection (``_split_at``); ``L`` itself is searched by ``best_lin`` between the
    smallest L that places every unit and the linear phase of the unconstrained (``L = inf``) split.

    ``caps[g]``: at most that many units for every group with coefficients ``g`` (set by the
    integer repair in ``stage3_refine.integer_split``). ``search_lin=False``: a coarse search (the
    first feasible L, the ``L = inf`` split's L and one branch-and-bound midpoint), an upper bound
    of the phase optimum that Stage I ranks groupings with.
    """
    if not caps and search_lin:  # the same grouping is split by Stage I, the repair and the exact hint
        return _split_cached(tuple(groups), num_units)
    return _split_search(groups, num_units, caps, search_lin)


@lru_cache(maxsize=4096)
def _split_cached(groups: tuple[GroupCoef, ...], num_units: int) -> Split | None:
    return _split_search(groups, num_units, None, True)


def _split_search(groups: Sequence[GroupCoef], num_units: int, caps: dict[GroupCoef, int] | None,
                  search_lin: bool) -> Split | None:
    free = split_at(groups, num_units, caps, INF)
    if free is None:
        return free
    inv = sum(1.0 / a for g in groups for a in g.a if a > 0)
    lo = num_units / inv if inv > 0 and all(min(g.a) > 0 for g in groups) else 0.0
    hi = free.lin_ns
    cache: dict[float, Split | None] = {}

    def at(L: float) -> Split | None:
        if L not in cache:
            cache[L] = split_at(groups, num_units, caps, L)
        return cache[L]

    def f(L: float) -> float:
        sp = at(L)
        return sp.z_relaxed_ns if sp is not None else INF

    count: dict[GroupCoef, int] = {}
    for g in groups:
        count[g] = count.get(g, 0) + 1

    def ok(L: float) -> bool:  # every unit (and each group's one unit per member) placeable within L
        most = {g: min(max_units(g, 1e30, L), (caps or {}).get(g, num_units)) for g in count}
        return all(most[g] >= min_units(g) for g in count) and sum(k * most[g] for g, k in count.items()) >= num_units

    L = best_lin(f, min(lo, hi), hi, ok, LIN_EVALS if search_lin else LIN_COARSE_EVALS)
    best = at(L)
    if best is None or best.z_rounded_ns > free.z_rounded_ns:
        return free
    return best


def split_at(groups: Sequence[GroupCoef], num_units: int, caps: dict[GroupCoef, int] | None,
             lin: float) -> Split | None:
    """The split for a fixed linear bound ``lin`` (``inf``: none): units per group summing to
    ``num_units`` (every group >= one unit per member) at the smallest attention bound; None if memory
    or ``lin`` can't hold it (or the groups have more members than there are units).

    ``caps[g]``: at most that many units for every group with coefficients ``g`` (set by the
    integer repair in ``stage3_refine.integer_split``).
    """
    caps = caps or {}

    def most(g: GroupCoef, z: float) -> int:
        return min(max_units(g, z, lin), caps.get(g, num_units))

    if sum(min(num_units, sum(g.cap), caps.get(g, num_units)) for g in groups) < num_units:
        return None
    if sum(min_units(g) for g in groups) > num_units or any(min(g.cap) < MIN_UNITS_PER_RANK for g in groups):
        return None  # fewer units than ranks, or a rank cannot hold one unit
    distinct: dict[GroupCoef, int] = {}
    for g in groups:
        distinct[g] = distinct.get(g, 0) + 1
    # start from the slowest group's time for an even share (usually enough), else double
    share = -(-num_units // len(groups))
    even = [group_time(g, min(max(share, min_units(g)), sum(g.cap)), lin) for g in distinct]
    lo, hi = 0.0, max(even) if all(math.isfinite(x) for x in even) else 1e6
    if math.isfinite(lin) and (sum(k * most(g, 1e30) for g, k in distinct.items()) < num_units
                               or any(most(g, 1e30) < min_units(g) for g in distinct)):
        return None  # the linear bound cannot place every unit (or a group's one unit per member)
    # raw max_units (before caps) at the bisection's ends: each step brackets the next one
    at_lo = {g: 0 for g in distinct}
    at_hi = {g: max_units(g, 1e30, lin) for g in distinct}

    def placed(at: dict[GroupCoef, int]) -> int:
        return sum(k * min(at[g], caps.get(g, num_units)) for g, k in distinct.items())

    while True:  # find a feasible upper end
        at_mid = {g: max_units_between(g, hi, lin, at_lo[g], at_hi[g]) for g in distinct}
        if placed(at_mid) >= num_units:
            at_hi = at_mid
            break
        lo, hi, at_lo = hi, hi * 2, at_mid
        if hi > 1e18:  # memory (heads' attention working set) cannot hold the sequence
            return None
    for _ in range(60):
        mid = (lo + hi) / 2
        at_mid = {g: max_units_between(g, mid, lin, at_lo[g], at_hi[g]) for g in distinct}
        if placed(at_mid) >= num_units:
            hi, at_hi = mid, at_mid
        else:
            lo, at_lo = mid, at_mid
        if hi - lo <= 1e-6 * hi:
            break
    start = {g: max(min_units(g), min(at_hi[g], caps.get(g, num_units))) for g in distinct}
    units = _round_units(groups, start, num_units, caps, lin)
    if units is None:
        return None
    pairs = set(zip(groups, units))
    att_round = max(group_time(g, u, lin) for g, u in pairs)
    lin_used = lin if math.isfinite(lin) else max(linear_phase(g, u, group_time(g, u)) for g, u in pairs)
    return Split(units=tuple(units), z_relaxed_ns=lin_used + hi, z_rounded_ns=lin_used + att_round,
                 lin_ns=lin_used, att_ns=hi)


def _round_units(groups: Sequence[GroupCoef], start: dict[GroupCoef, int], num_units: int,
                 caps: dict[GroupCoef, int], lin: float) -> list[int] | None:
    """Units per group summing to ``num_units`` from ``start`` (units per group class at the split's
    attention bound); None if a unit cannot be placed.

    Excess: one unit at a time from the slowest group among those a trim does not slow down (never
    below one unit per member); when every trim slows its group down, from the group that stays
    fastest. A group's time is not always increasing in its units: with many groups the K/V ring
    term ``(N - T) c`` dominates and a group with fewer units is *slower*; trimming the slowest group
    there would crush it to its minimum, one unit at a time. Deficit: one unit to the group whose
    time after the addition is smallest (within ``caps``).

    Worked per *class* of identical groups (thousands of GPUs, a few classes): its groups sit at a
    few unit levels, and when the next choice would be a class mate at the same level anyway, every
    mate at that level moves in one step. Ties go to the class of the lowest group index; inside a
    class the lower group indices hold the fewer units.
    """
    first: dict[GroupCoef, int] = {}
    for i, g in enumerate(groups):
        first.setdefault(g, i)
    by_order = {o: g for g, o in first.items()}
    levels: dict[GroupCoef, dict[int, int]] = {g: {} for g in first}
    for g in groups:
        levels[g][start[g]] = levels[g].get(start[g], 0) + 1

    def t(g: GroupCoef, u: int) -> float:
        return group_time(g, u, lin) if u >= min_units(g) else INF

    def live(heap: list[tuple[float, int, int]]) -> tuple[float, int, int] | None:
        while heap and not levels[by_order[heap[0][1]]].get(heap[0][2]):
            heapq.heappop(heap)  # stale: that level was emptied
        return heap[0] if heap else None

    def move(g: GroupCoef, u: int, v: int, m: int) -> None:
        levels[g][u] -= m
        if not levels[g][u]:
            del levels[g][u]
        levels[g][v] = levels[g].get(v, 0) + m
        for w in (v, u):
            if w in levels[g]:
                push(g, w)

    excess = sum(start[g] for g in groups) - num_units
    shrinking: list[tuple[float, int, int]] = []  # excess, trim no slower: (-time, class order, level)
    cheapest: list[tuple[float, int, int]] = []  # excess: (time after one trim, class order, level)
    fastest: list[tuple[float, int, int]] = []  # deficit: (time after one more unit, class order, level)

    def push(g: GroupCoef, u: int) -> None:
        if excess > 0 and u > min_units(g):
            after = t(g, u - 1)
            heapq.heappush(cheapest, (after, first[g], u))
            if after <= t(g, u):
                heapq.heappush(shrinking, (-t(g, u), first[g], u))
        elif excess < 0 and u < caps.get(g, num_units):
            heapq.heappush(fastest, (t(g, u + 1), first[g], u))

    for g in first:
        for u in levels[g]:
            push(g, u)
    while excess > 0:
        top = live(shrinking)
        if top is not None:  # the slowest group that a trim does not slow down; its mates are next
            heapq.heappop(shrinking)
            g, u = by_order[top[1]], top[2]
            m = min(levels[g][u], excess) if t(g, u - 1) < -top[0] else 1
        else:  # every trim slows a group down: the one that stays fastest
            top = live(cheapest)
            if top is None:  # every group at its minimum (excluded by the caller's checks)
                return None
            heapq.heappop(cheapest)
            g, u = by_order[top[1]], top[2]
            m = min(levels[g][u], excess) if t(g, u - 2) >= top[0] else 1
        move(g, u, u - 1, m)
        excess -= m
    while excess < 0:
        top = live(fastest)
        if top is None or not math.isfinite(top[0]):
            return None
        heapq.heappop(fastest)
        g, u = by_order[top[1]], top[2]
        m = min(levels[g][u], -excess) if t(g, u + 2) >= top[0] else 1
        move(g, u, u + 1, m)
        excess += m
    # hand the levels out: inside a class, ascending group index gets ascending units
    queue = {g: sorted(u for u, k in lv.items() for _ in range(k)) for g, lv in levels.items()}
    taken = {g: 0 for g in first}
    units = []
    for g in groups:
        units.append(queue[g][taken[g]])
        taken[g] += 1
    return units
