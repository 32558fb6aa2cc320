"""Closed forms of Stage II's unit ranges at a place in an arrangement, evaluated without
building the placed group.

A test of ``arranged_split`` moves every prefix block and every final group to a new start on
almost every call, so the cached per-group forms of ``unit_range`` (keyed by the placed
``GroupCoef``) would miss. Here the parts that do not depend on the place are cached per (group,
linear bound) (``BlockConsts`` for a prefix block of k identical groups, ``FinalConsts`` for a final
group) and the place-dependent parts are filled in per call, with the same IEEE operations in the
same order as ``unit_range._identical_range`` (``tests/test_planner_fast_paths``
compares them exactly). Groups whose members differ fall back to the placed group's own range.
"""

from __future__ import annotations

import math
from functools import lru_cache
from typing import NamedTuple

from megatron_hexiseq.planner.coef import INF, MIN_UNITS_PER_RANK, GroupCoef
from megatron_hexiseq.planner.unit_range import (
    ClosedBounds,
    closed_bounds,
    closed_eval,
    general_range,
    group_time,
    range_consts,
    settle_range,
    units_range,
)


class BlockConsts(NamedTuple):
    """What ``block_upper`` reads of a prefix block of k groups of identical members at one linear
    bound (``block_consts``)."""

    s: float  # A2A ns per own unit
    b: float  # attention ns per head per unit, whole sequence
    e: float  # A2A ns per head per group unit
    c: float  # K/V ns per head per visible unit
    N: int  # units in the sequence
    bounds: ClosedBounds  # ``closed_bounds`` with quad = b k / N, kv_slope = c (k - 1)
    cap: float  # the smallest of the memory and linear-bound caps on a group's units


@lru_cache(maxsize=200_000)
def block_time(g: GroupCoef, k: int, P: int, V: float, T: int, lin: float) -> float:
    """Attention phase of each of k identical groups of identical members holding T units each in a
    prefix block starting at P that sees V units before it (k = 1: a band), as
    ``unit_range._identical_time`` (the larger of the continuous even split and the member with
    ceil(H/n) heads); inf past memory, the linear bound or the minimum."""
    n, H = g.size, g.heads
    a, s, b, c, e, free, mt, mh = g.rows[0][1:9]
    t = T / n
    hmax = -(-H // n)
    if (
        T < n
        or t * mt + H / n * T * mh > free
        or mt + hmax * T * mh > free
        or (a > 0 and t * a > lin)
    ):
        return INF
    att = b * T * (2 * P + k * T) // g.num_units
    beta = max(att, (round(V) + (k - 1) * T) * c) + T * e
    return max(s * t + H * beta / n, s + hmax * beta)


@lru_cache(maxsize=100_000)
def block_consts(g: GroupCoef, k: int, lin: float) -> BlockConsts:
    """What ``block_upper`` reads of a prefix block of k groups of identical members: per lower
    bound of ``block_time`` (the continuous even split, the member with ceil(H/n) heads) the parts
    of the closed form that do not depend on the block's start or what it sees (``closed_bounds``),
    and the smallest of the memory and linear-bound caps on the units."""
    n, H, N = g.size, g.heads, g.num_units
    a, s, b, c, e, free, mt, mh = g.rows[0][1:9]
    bounds = closed_bounds(n, H, s, e, b * k / N, c * (k - 1))
    hmax = -(-H // n)
    cap = INF
    if mt + H * mh > 0:
        cap = min(cap, n * free / (mt + H * mh))
    if mh > 0:
        cap = min(cap, (free - mt) / (hmax * mh))
    if a > 0 and math.isfinite(lin):
        cap = min(cap, n * lin / a)
    return BlockConsts(s, b, e, c, N, bounds, cap)


def block_upper(consts: BlockConsts, P: int, V: int, z: float) -> float | None:
    """The real upper end of the closed form (``unit_range.closed_eval``) for a prefix block
    starting at P that sees V units (attention ``b T (2P + k T) / N`` per head, visible
    ``V + (k - 1) T``: the outermost group sees the block's other units and what lies before it),
    capped by memory and the linear bound; None when the range is empty."""
    s, b, e, c, N, bounds, cap = consts
    real = closed_eval(bounds, 2 * P * b / N, e, V * c, z, s)
    if real is None:
        return None
    return real[1] if real[1] < cap else cap


def block_max(
    g: GroupCoef, k: int, P: int, V: float, z: float, lin: float, room: int
) -> int | None:
    """Most units per group (all k groups equal) of a prefix block starting at P that sees V units
    before it (fan-out counted), within attention bound z, at most ``room`` units for the block;
    None when not even each group's minimum fits."""
    n, N = g.size, g.num_units
    tmax = room // k
    if tmax < n:
        return None
    if len(g.rows) != 1:  # members differ: bisection on the positioned group's own time

        def ok(T: int) -> bool:
            q = P + k * T
            return group_time(g.placed(P, 0 if q >= N else q, k == 1, round(V) - P), T, lin) <= z

        if not ok(n):
            return None
        lo, hi = n, tmax
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if ok(mid):
                lo = mid
            else:
                hi = mid - 1
        return lo
    x = block_upper(block_consts(g, k, lin), P, round(V), z)
    if x is None:
        return None
    x = min(x, float(tmax))
    T = min(tmax, math.floor(x + 1e-9)) if math.isfinite(x) else tmax
    for _ in range(6):  # settle on integers (att() rounds down)
        if T < n:
            return None
        if block_time(g, k, P, V, T, lin) <= z:
            if T + 1 <= tmax and block_time(g, k, P, V, T + 1, lin) <= z:
                T += 1
                continue
            return T
        T -= 1
    return T if T >= n and block_time(g, k, P, V, T, lin) <= z else None


_SEEN_MAX = 20_000  # exact times kept per (group, linear bound)


class FinalConsts(NamedTuple):
    """What ``final_range`` reads of a final group of identical members at one linear bound
    (``final_consts``): the closed form's parts that do not depend on the group's place
    (``bounds``), ``_identical_time``'s coefficients, and the exact times computed so far."""

    n: int  # members
    N: int  # units in the sequence
    s: float  # A2A ns per own unit
    b: float  # attention ns per head per unit, whole sequence
    c: float  # K/V ns per head per visible unit
    e: float  # A2A ns per head per group unit
    bounds: ClosedBounds  # ``closed_bounds`` with quad = 0, kv_slope = -c
    hmax: int  # ceil(H / n)
    hi_cap: float  # memory, the sequence, ``lin``: the upper end's cap wherever the group sits
    floor: int  # one unit per member
    H: int  # heads
    a: float  # linear ns per own unit
    free: float  # free memory per member
    mt: float  # memory per own unit
    mh: float  # memory per head per group unit
    cap: int  # units a member holds with no heads
    g: GroupCoef
    seen: dict[tuple[int, int, int], float]  # exact times by (start, kv_extra, units)


@lru_cache(maxsize=4096)
def final_consts(g: GroupCoef, lin: float) -> FinalConsts | None:
    """What ``final_range`` reads of a final group of identical members (None when its
    members differ): the parts of ``unit_range.range_consts`` that do not depend on where the
    group is placed."""
    if len(g.rows) != 1:
        return None
    n, H, N = g.size, g.heads, g.num_units
    k, a, s, b, c, e, free, mt, mh, cap = g.rows[0]
    hmax = -(-H // n)
    hi_cap = range_consts(
        g, lin
    ).hi_cap  # memory, the sequence, ``lin``: wherever the group is placed
    # a final group's attention term has no T^2 part, its K/V term the slope -c (visible N - T + kv)
    bounds = closed_bounds(n, H, s, e, 0.0, -c)
    floor = n * MIN_UNITS_PER_RANK
    # the exact times computed so far by (start, kv_extra, units): a search probes the same places
    # again and again
    return FinalConsts(
        n,
        N,
        s,
        b,
        c,
        e,
        bounds,
        hmax,
        hi_cap,
        floor,
        H,
        a,
        free,
        mt,
        mh,
        cap,
        g,
        {},
    )


def final_range(
    consts: FinalConsts, p: int, kv: int, z: float, lin: float, settle: bool
) -> tuple[int, int] | None:
    """``units_range(placed_final(g, p, kv), z, lin, settle)`` for a group of identical members
    (``consts``: ``final_consts(g, lin)``), the same IEEE operations in the same order as
    ``unit_range._identical_range`` without building the placed group or its caches (the tests
    of a search place the final groups at a new start on almost every call). The final block ends
    at N: attention ``b T (p + N) / N`` per head and unit, visible ``N - T + kv`` units."""
    # unpacked whole: the planner's innermost loop
    n, N, s, b, c, e, bounds, hmax, hi_cap, floor, H, a, free, mt, mh, cap, g, seen = consts
    real = closed_eval(bounds, b * (p + N) / N, e, (N + kv) * c, z, s)
    if real is None:
        return None
    head_share = H / n

    def time_at(T: int) -> float:  # ``_identical_time`` of the placed group
        key = (p, kv, T)
        got = seen.get(key)
        if got is not None:
            return got
        t = T / n
        if T < floor or T > N or t > cap or (a > 0 and t * a > lin):
            got = INF
        elif t * mt + head_share * T * mh > free or mt + hmax * T * mh > free:
            got = INF
        else:
            beta = max(b * T * (p + N) // N, max(0, N - T + kv) * c) + T * e
            got = max(s * t + H * beta / n, s + hmax * beta)
        if len(seen) >= _SEEN_MAX:
            seen.clear()
        seen[key] = got
        return got

    ok, got = settle_range(real, hi_cap, floor, N, z, settle, time_at)
    return got if ok else general_range(placed_final(g, p, kv), z, lin)  # off by more than rounding


@lru_cache(maxsize=100_000)
def placed_final(g: GroupCoef, start: int, kv_extra: int) -> GroupCoef:
    """``g.placed(start, 0, False, kv_extra)``, one object per place: the bisections over the
    attention bound move the final groups to the same starts again and again, and the unit-range
    caches then hit by identity."""
    return g.placed(start, 0, False, kv_extra)


def key_range(
    consts: FinalConsts | None, g: GroupCoef, p: int, kv: int, z: float, lin: float, settle: bool
) -> tuple[GroupCoef | None, tuple[int, int] | None]:
    """The unit range of a final group ``g`` placed at ``p`` with ``kv`` fan-out units: in closed
    form from ``consts`` (``final_consts(g, lin)``) without placing it, else from the placed group,
    which is returned too (None when not placed)."""
    if consts is not None:
        return None, final_range(consts, p, kv, z, lin, settle)
    moved = placed_final(g, p, kv)
    return moved, units_range(moved, z, lin, settle)
