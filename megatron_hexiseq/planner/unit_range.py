"""One group's side of Stage II: how many units a group can hold within given phase bounds.

For a linear bound ``L`` (member r holds at most ``L / a_r`` units) and an attention bound ``A``,
the most heads a group holding T units can take is a separable concave maximisation
(``max_heads``), exact and cheap. The units a group can hold within (A, L) form an interval
``[lo, hi]`` (``units_range``): above ``hi`` its attention or memory overflows, below ``lo`` the K/V
it receives (more visible with fewer own units) does not hide. Groups of identical members have a
closed form (``closed_bounds`` -> ``ClosedBound`` per lower bound, ``RangeConsts`` per (group, L),
settled on integers by ``settle_range`` with the exact ``_identical_time``); others bisect the exact
continuous test (``general_range``). ``group_time`` is a group's attention phase at T units,
``group_phase_time`` its own phase optimum. ``stage2_split`` splits the sequence between groups on
these ranges.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import replace
from functools import lru_cache
from typing import NamedTuple

from megatron_hexiseq.planner.coef import INF, MIN_UNITS_PER_RANK, GroupCoef
from megatron_hexiseq.planner.linsearch import best_lin


def min_units(g: GroupCoef) -> int:
    """Fewest units a group can hold: one per member (no rank may own zero tokens)."""
    return g.min_units()


def max_heads(g: GroupCoef, T: int, z: float, lin: float = INF) -> tuple[float, list[float]]:
    """Most heads (continuous) the group can hold with attention phase ``z`` and linear phase ``lin``
    with ``T`` units; -inf if the tokens don't fit.

    Member i can hold ``h_i(t) = min((z - s_i t)/beta_i, (free_i - mt_i t)/(T mh_i))`` heads with
    ``t <= lin / a_i`` own units: concave, piecewise linear with at most two slopes. Every member holds
    at least one unit (``MIN_UNITS_PER_RANK``: Megatron cannot run an empty sequence shard), so each
    starts at ``t = 1`` and the remaining ``T - n`` units are placed. Maximising ``sum h_i(t_i)``
    subject to ``sum t_i = T, t_i >= 1`` is separable concave, so filling the flattest slope pieces
    first is exact. Returns (heads, token allocation).
    """
    n = g.size
    if T < n * MIN_UNITS_PER_RANK:
        return -INF, []
    lo = float(MIN_UNITS_PER_RANK)
    num, den = g.att_scale(T)
    vis = g.visible(T)
    if (
        len(g.rows) == 1
    ):  # identical members: the even split is optimal (separable, concave, symmetric)
        k, a, s, b, c, e, free, mt, mh, cap = g.rows[0]
        beta = max(b * T * num // den, vis * c) + T * e
        per = T * mh
        t_even = T / n  # >= MIN_UNITS_PER_RANK (checked above)
        # the even share within the memory cap, z and lin, tested as ``_identical_time`` tests it
        # (t a > lin, not t > lin / a: the two disagree by a rounding at the boundary, and the
        # time of a group then had no split: Stage III's rounding found no tokens to round)
        if t_even > cap or (s > 0 and t_even * s > z) or (a > 0 and t_even * a > lin):
            return -INF, []
        att = (z - s * t_even) / beta if beta > 0 else INF
        mem = (free - mt * t_even) / per if per > 0 else INF
        return n * min(att, mem), [t_even] * n
    pieces: list[tuple[float, int, float]] = []  # (slope, class, length for the whole class)
    heads0 = 0.0
    room = 0.0
    for ci, (k, a, s, b, c, e, free, mt, mh, cap) in enumerate(g.rows):
        beta = max(b * T * num // den, vis * c) + T * e
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


def _identical_time(g: GroupCoef, T: int, lin: float) -> float:
    """Attention phase of a group of identical members at T units, inf when T breaks its memory, its
    linear bound or its minimum: the larger of two lower bounds of Stage III's integer optimum, the
    continuous even split ``(s T + H beta(T)) / n`` and the member holding the most heads,
    ``s + ceil(H/n) beta(T)`` (whole heads: some member holds at least ceil(H/n), and one unit)."""
    n, H = len(g.a), g.heads
    k, a, s, b, c, e, free, mt, mh, cap = g.rows[0]
    t = T / n
    if T < n * MIN_UNITS_PER_RANK or T > g.num_units or t > cap or (a > 0 and t * a > lin):
        return INF
    hmax = -(-H // n)
    if t * mt + H / n * T * mh > free or mt + hmax * T * mh > free:
        return INF
    # beta(T) of GroupCoef, inlined (the planner's innermost loop)
    if g.band:
        att, vis = b * T * (2 * g.start + T) // g.num_units, g.start + g.kv_extra
    else:
        end = g.end or g.num_units
        att, vis = b * T * (g.start + end) // g.num_units, end - T + g.kv_extra
    beta = max(att, max(0, vis) * c) + T * e
    return max(s * t + H * beta / n, s + hmax * beta)


@lru_cache(maxsize=400_000)
def _identical_time_cached(g: GroupCoef, T: int, lin: float) -> float:
    """``_identical_time``, cached: the bisections over the attention bound settle the same unit
    counts again and again."""
    return _identical_time(g, T, lin)


class ClosedBound(NamedTuple):
    """One lower bound of a group's attention phase in the closed form (the continuous even split,
    or the member holding ceil(H/n) heads), less what depends on the group's place: within a budget,
    ``heads (quad T^2 + (lin_att + e) T) + alpha T`` of attention (``quadratic`` when quad > 0) and
    ``heads ((kv_slope + e) T + kv_const) + alpha T`` of K/V (``closed_eval`` adds the place)."""

    alpha: float  # A2A per own unit, per member (s / n for the even split, 0 for the other)
    heads: float  # heads per member (H / n, or ceil(H/n))
    qa4: float  # 4 qa, qa = heads quad
    qa2: float  # 2 qa
    quadratic: bool  # qa > 0
    m: float  # the K/V branch's slope in T: alpha + heads (kv_slope + e)


ClosedBounds = tuple[ClosedBound, ...]  # the continuous even split, then ceil(H/n) heads


class RangeConsts(NamedTuple):
    """What ``_identical_range`` needs of a group of identical members that does not depend on the
    attention bound (``range_consts``, per (group, linear bound))."""

    n: int  # members
    N: int  # units in the sequence
    s: float  # A2A ns per own unit
    bounds: ClosedBounds
    lin_att: float  # the attention term's linear part per head and unit, at the group's place
    e: float  # A2A per head per group unit
    kv_const: float  # the K/V term's constant per head, at the group's place
    hi_cap: float  # the smallest cap on the upper end: memory, the sequence, ``lin``


@lru_cache(maxsize=100_000)
def closed_bounds(n: int, H: int, s: float, e: float, quad: float, kv_slope: float) -> ClosedBounds:
    """The closed form's parts that depend on neither the attention bound z nor the group's place:
    the real range of T (per group) where both lower bounds of ``_identical_time`` stay within z,
    for an attention term ``quad T^2 + lin_att T`` per head and a K/V term ``kv_slope T + kv_const``
    per head (``c`` times the visible units) plus ``e T`` A2A per head."""
    out = []
    hmax = -(-H // n)
    for alpha, heads in ((s / n, H / n), (0.0, hmax)):
        qa = heads * quad
        out.append(
            ClosedBound(alpha, heads, 4 * qa, 2 * qa, qa > 0, alpha + heads * (kv_slope + e))
        )
    return tuple(out)


def closed_eval(
    bounds: ClosedBounds, lin_att: float, e: float, kv_const: float, z: float, s: float
) -> tuple[float, float] | None:
    """The closed form's real range of T at attention bound z (budgets z and z - s) for a group
    whose attention term has ``lin_att`` and whose K/V term ``kv_const`` per head at its place;
    None when empty. Per bound: the attention branch ``qa T^2 + qb T <= budget`` (qb = alpha +
    heads (lin_att + e)) gives an upper end, the K/V branch ``m T + heads kv_const <= budget`` an
    upper end when m > 0, a lower one when m < 0. (``arranged_forms`` calls it with places that
    change on almost every call, so nothing here depends on a cache of the place.)"""
    lo, hi = 0.0, INF
    budget = z
    for alpha, heads, qa4, qa2, quadratic, m in bounds:
        if budget < 0:
            return None
        qb = alpha + heads * (lin_att + e)
        root = (
            (-qb + math.sqrt(qb * qb + qa4 * budget)) / qa2
            if quadratic
            else (budget / qb if qb > 0 else INF)
        )
        if root < hi:
            hi = root
        k0 = heads * kv_const
        if m > 0:
            x = (budget - k0) / m
            if x < hi:
                hi = x
        elif m < 0:
            x = (k0 - budget) / -m
            if x > lo:
                lo = x
        elif k0 > budget:
            return None
        budget = z - s
    return (lo, hi) if lo <= hi + 1.0 else None


GROUP_TIME_TOL = 1e-7  # relative precision of ``group_time``


@lru_cache(maxsize=200_000)
def group_time(g: GroupCoef, T: int, lin: float = INF) -> float:
    """A_g(T, L): the group's continuous optimal attention phase (ns) for T units within linear phase
    ``lin``; inf when T exceeds its memory or the linear bound."""
    if T > sum(g.cap):
        return INF
    if len(g.rows) == 1:
        # identical members: even tokens and heads, so A = s T/n + H beta(T)/n exactly (when it fits)
        return _identical_time(g, T, lin)
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


@lru_cache(maxsize=200_000)
def range_consts(g: GroupCoef, lin: float) -> RangeConsts:
    """What ``_identical_range`` needs that does not depend on the attention bound."""
    n, H, N = g.size, g.heads, g.num_units
    k, a, s, b, c, e, free, mt, mh, cap = g.rows[0]
    if g.band:  # att = b T (2P + T) / N, visible = P
        bounds = closed_bounds(n, H, s, e, b / N, 0.0)
        lin_att, kv_const = 2 * g.start * b / N, (g.start + g.kv_extra) * c
    else:  # att = b T (P + Q) / N, visible = Q - T
        num, den = g.att_scale(0)
        bounds = closed_bounds(n, H, s, e, 0.0, -c)
        lin_att, kv_const = b * num / den, (g.block_end + g.kv_extra) * c
    caps = [float(min(N, n * cap))]
    if a > 0 and math.isfinite(lin):
        caps.append(n * lin / a)
    hmax = -(-H // n)
    if mt + H * mh > 0:
        caps.append(n * free / (mt + H * mh))
    if mh > 0:
        caps.append((free - mt) / (hmax * mh))
    return RangeConsts(n, N, s, bounds, lin_att, e, kv_const, min(caps))


def _identical_range(
    g: GroupCoef, z: float, lin: float, settle: bool = True
) -> tuple[int, int] | None:
    """``units_range`` of a group of identical members, in closed form (``closed_bounds``, ``closed_eval``), then
    settled on integers with the exact ``_identical_time`` (``settle=False``: the closed form's
    integers as they are, for Stage I's coarse split)."""
    n, N, s, bounds, lin_att, e, kv_const, hi_cap = range_consts(g, lin)
    real = closed_eval(bounds, lin_att, e, kv_const, z, s)
    if real is None:
        return None
    ok, got = settle_range(
        real,
        hi_cap,
        n * MIN_UNITS_PER_RANK,
        N,
        z,
        settle,
        lambda T: _identical_time_cached(g, T, lin),
    )
    return got if ok else general_range(g, z, lin)  # the closed form was off by more than rounding


def settle_range(
    real: tuple[float, float],
    hi_cap: float,
    floor: int,
    N: int,
    z: float,
    settle: bool,
    time_at: Callable[[int], float],
) -> tuple[bool, tuple[int, int] | None]:
    """The closed form's real range ``real`` of an identical group as integers: capped at ``hi_cap``,
    at least ``floor`` (one unit per member), at most N, and (``settle``) its ends settled with the
    exact ``time_at(T) <= z`` (the closed form is exact up to the integer rounding of att()).
    (True, the range or None when empty), or (False, None) when the closed form was off by more than
    the rounding and the caller must use the general range."""
    lo, hi = real
    if hi_cap < hi:
        hi = hi_cap
    lo = max(lo, float(floor))
    if not (lo <= hi + 1.0):
        return True, None
    ilo, ihi = max(floor, math.ceil(lo - 1e-9)), min(N, math.floor(hi + 1e-9))
    if ilo > ihi and not (settle and ilo == ihi + 1 <= N):
        return True, None
    if not settle:
        return True, (ilo, ihi)
    # a real range between two integers can still hold the upper one: att() rounds down (the
    # settling below probes it as the upper end)
    ihi = max(ihi, ilo)
    settled = False
    for _ in range(4):
        if not time_at(ihi) <= z:
            ihi -= 1
            if ihi < ilo:
                return True, None
        elif ihi + 1 <= N and time_at(ihi + 1) <= z:
            ihi += 1
        else:
            settled = True
            break
    for _ in range(4 if settled else 0):
        if not time_at(ilo) <= z:
            ilo += 1
        elif ilo - 1 >= floor and time_at(ilo - 1) <= z:
            ilo -= 1
        else:
            return True, (ilo, ihi)
    return False, None


@lru_cache(maxsize=200_000)
def fastest_units(g: GroupCoef, lin: float = INF) -> int:
    """The unit count at which the group's attention phase is smallest: its minimum for a band or a
    compute-bound group; larger when the K/V it receives (fewer units: more visible) dominates.
    Ternary search over integers (the phase is quasi-convex in T: attention grows, K/V shrinks)."""
    lo, hi = g.min_units(), g.max_units()
    if g.band or lo >= hi:
        return lo
    while hi - lo > 2:
        m1, m2 = lo + (hi - lo) // 3, hi - (hi - lo) // 3
        if group_time(g, m1, lin) <= group_time(g, m2, lin):
            hi = m2
        else:
            lo = m1
    return min(range(lo, hi + 1), key=lambda T: (group_time(g, T, lin), T))


@lru_cache(maxsize=100_000)
def general_range(g: GroupCoef, z: float, lin: float) -> tuple[int, int] | None:
    """``units_range`` by bisection on the exact continuous test (any members), on both sides of
    the group's fastest unit count."""
    tmin, tmax = g.min_units(), g.max_units()
    if tmin > tmax:
        return None

    def ok(T: int) -> bool:
        return feasible(g, T, z, lin)

    # a start inside the range: where the group with every member as slow as its slowest holds
    # within z (closed form), else the group's fastest unit count (a ternary search of its time)
    inner = _identical_range(slowest_members(g), z, lin)
    start = (inner[0] + inner[1]) // 2 if inner is not None else -1
    if not (tmin <= start <= tmax and ok(start)):
        start = fastest_units(g, lin)
        if not ok(start):
            return None
    return _edge(ok, tmin, start), _edge(ok, tmax, start)


@lru_cache(maxsize=100_000)
def slowest_members(g: GroupCoef) -> GroupCoef:
    """The group with every member replaced by the slowest of them (each time coefficient its
    largest, free memory its smallest, memory per unit and per head their largest), at the same
    place. Every member's heads ``h_i(t)`` only shrink, so wherever this group holds T units within
    (z, lin) the real one does too: its closed-form range lies inside the real range."""
    n = g.size
    return replace(
        g,
        a=(max(g.a),) * n,
        b=(max(g.b),) * n,
        c=(max(g.c),) * n,
        e=(max(g.e),) * n,
        s=(max(g.s),) * n if g.s else (),
        free=(min(g.free),) * n,
        mt=(max(g.mt),) * n,
        mh=(max(g.mh),) * n,
    )


def _edge(ok: Callable[[int], bool], far: int, near: int) -> int:
    """The feasible integer closest to ``far`` on the way from the feasible ``near`` (``ok`` holds on
    an interval around ``near``): a bisection."""
    if ok(far):
        return far
    while abs(far - near) > 1:
        mid = (far + near) // 2
        if ok(mid):
            near = mid
        else:
            far = mid
    return near


def units_range(
    g: GroupCoef, z: float, lin: float = INF, settle: bool = True
) -> tuple[int, int] | None:
    """The units ``[lo, hi]`` the group can hold within attention bound ``z`` and linear bound ``lin``
    (every member at least one unit), or None when none fits. ``settle=False``: Stage I's coarse
    split, the closed form's ends unchecked on integers (within a unit or so). Not cached: the
    bisections ask at a new bound almost every time (136 hits in 5241 calls on suite row 5), and
    the closed form costs about what the cache lookup did; the general range is cached."""
    if len(g.rows) == 1:
        return _identical_range(g, z, lin, settle)
    return general_range(g, z, lin)


def max_units(g: GroupCoef, z: float, lin: float = INF) -> int:
    """Most units the group can take within z; 0 when it cannot hold any count within z."""
    r = units_range(g, z, lin)
    return r[1] if r else 0


def linear_phase(g: GroupCoef, T: int, z: float, lin: float = INF) -> float:
    """Linear phase (ns) of the continuous point ``max_heads`` picks (largest ``t_i a_i``)."""
    _, t = max_heads(g, T, z, lin)
    return max((ti * ai for ti, ai in zip(t, g.a)), default=0.0)


@lru_cache(maxsize=200_000)
def group_phase_time(
    g: GroupCoef, T: int, lin_floor: float = 0.0, att_floor: float = 0.0
) -> tuple[float, float]:
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
    L, _ = best_lin(f, lo, hi, lambda L: feasible(g, T, 1e30, L))
    return L, max(group_time(g, T, L), 0.0)
