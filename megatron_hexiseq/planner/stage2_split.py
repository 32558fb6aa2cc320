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

A_TOL = 1e-5  # relative width of the bisection on the attention bound
COARSE_A_TOL = 1e-3  # Stage I's coarse split: the attention bound's bisection to 0.1%


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


@lru_cache(maxsize=100_000)
def _closed_consts(
    n: int,
    H: int,
    s: float,
    e: float,
    quad: float,
    lin_att: float,
    kv_slope: float,
    kv_const: float,
) -> tuple[tuple[float, ...], ...]:
    """The closed form's parts that do not depend on the attention bound z: the real range of T (per
    group) where both lower bounds of ``_identical_time`` stay within z, for an attention term
    ``quad T^2 + lin_att T`` per head and a K/V term ``kv_slope T + kv_const`` per head (``c`` times
    the visible units) plus ``e T`` A2A per head. Per lower bound (the continuous even split, the
    member with ceil(H/n) heads): (4 qa, 2 qa, -qb, qb^2, qb, m, k0, qa > 0)."""
    out = []
    hmax = -(-H // n)
    for alpha, heads in ((s / n, H / n), (0.0, hmax)):
        # attention branch: heads (quad T^2 + (lin_att + e) T) + alpha T <= budget
        qa, qb = heads * quad, alpha + heads * (lin_att + e)
        # K/V branch: heads (kv_slope T + kv_const + e T) + alpha T <= budget
        m, k0 = alpha + heads * (kv_slope + e), heads * kv_const
        out.append((4 * qa, 2 * qa, -qb, qb * qb, qb, m, k0, qa > 0))
    return tuple(out)


def _closed_eval(
    consts: tuple[tuple[float, ...], ...], z: float, s: float
) -> tuple[float, float] | None:
    """The closed form's range at attention bound z from its ``_closed_consts`` (budgets z and
    z - s); None when empty. (``arrange._block_upper`` and ``arrange._final_range`` call it with
    constants they build per call, without ``_closed_consts``' cache.)"""
    lo, hi = 0.0, INF
    budget = z
    for qa4, qa2, nqb, qb2, qb, m, k0, quadratic in consts:
        if budget < 0:
            return None
        root = (
            (nqb + math.sqrt(qb2 + qa4 * budget)) / qa2
            if quadratic
            else (budget / qb if qb > 0 else INF)
        )
        if root < hi:
            hi = root
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
def _range_consts(
    g: GroupCoef, lin: float
) -> tuple[int, int, int, tuple[tuple[float, ...], ...], float]:
    """What ``_identical_range`` needs that does not depend on the attention bound: (n, N, s, the
    ``_closed_consts``, the smallest of the caps on the upper end: memory, the sequence, ``lin``)."""
    n, H, N = g.size, g.heads, g.num_units
    k, a, s, b, c, e, free, mt, mh, cap = g.rows[0]
    if g.band:  # att = b T (2P + T) / N, visible = P
        consts = _closed_consts(
            n, H, s, e, b / N, 2 * g.start * b / N, 0.0, (g.start + g.kv_extra) * c
        )
    else:  # att = b T (P + Q) / N, visible = Q - T
        num, den = g.att_scale(0)
        consts = _closed_consts(n, H, s, e, 0.0, b * num / den, -c, (g.block_end + g.kv_extra) * c)
    caps = [float(min(N, n * cap))]
    if a > 0 and math.isfinite(lin):
        caps.append(n * lin / a)
    hmax = -(-H // n)
    if mt + H * mh > 0:
        caps.append(n * free / (mt + H * mh))
    if mh > 0:
        caps.append((free - mt) / (hmax * mh))
    return n, N, s, consts, min(caps)


def _identical_range(
    g: GroupCoef, z: float, lin: float, settle: bool = True
) -> tuple[int, int] | None:
    """``units_range`` of a group of identical members, in closed form (``_closed_consts``, ``_closed_eval``), then
    settled on integers with the exact ``_identical_time`` (``settle=False``: the closed form's
    integers as they are, for Stage I's coarse split)."""
    n, N, s, consts, hi_cap = _range_consts(g, lin)
    real = _closed_eval(consts, z, s)
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
    return got if ok else _general_range(g, z, lin)  # the closed form was off by more than rounding


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
def _general_range(g: GroupCoef, z: float, lin: float) -> tuple[int, int] | None:
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
    return _general_range(g, z, lin)


def max_units(g: GroupCoef, z: float, lin: float = INF) -> int:
    """Most units the group can take within z; 0 when it cannot hold any count within z."""
    r = units_range(g, z, lin)
    return r[1] if r else 0


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
        # the split depends on the groups as a multiset (``_hand_out`` breaks ties by
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
            cache[L] = split_at(groups, num_units, caps, L, bracket=_bracket(cache, L))
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


def _bracket(cache: dict[float, Split | None], L: float) -> tuple[float, float] | None:
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
    attention bound known from the splits at other linear bounds (``_bracket``).
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

    def ranges(z: float) -> dict[GroupCoef, tuple[int, int]] | None:
        out = {}
        lo_sum = hi_sum = 0
        for g, k, cap in capped:
            r = units_range(g, z, lin, settle)
            if r is None or r[0] > cap:
                return None
            hi = r[1] if r[1] < cap else cap
            out[g] = (r[0], hi)
            lo_sum += k * r[0]
            hi_sum += k * hi
        return out if lo_sum <= num_units <= hi_sum else None

    got = smallest_bound(
        ranges,
        bracket,
        lambda: start_bound(distinct, -(-num_units // len(groups)), lin),
        COARSE_A_TOL if coarse else A_TOL,
    )
    if got is None:  # memory (heads' attention working set) or lin cannot hold the sequence
        return None
    hi, at_hi = got
    units = _hand_out(groups, distinct, at_hi, num_units)
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


def _hand_out(
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
