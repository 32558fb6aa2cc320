"""Where each group's tokens sit in the sequence: arrangements and their Stage II split.

An ``Arrangement`` cuts the sequence into consecutive blocks. Its *prefix* blocks each hold the
groups of one class of identical groups (typically one GPU type), in order from the start of the
sequence; the *final* block ``[P, N)`` holds every other group. The groups of a block share it in
the mirrored head+tail arrangement (``planner.build``), outermost first. With an empty prefix this
is the plain mirrored arrangement (Megatron's zig-zag generalised). Why a prefix: a token at
position p attends to p + 1 keys and a group receives the K/V of every other group's tokens before
its last query, so a group early in the sequence does less attention per token and receives
little K/V. Slow GPUs or GPUs on a slow network placed first (slow-to-fast) stop paying for the
whole sequence's K/V (``planner.coef`` has the position-aware terms).

Stage II for an arrangement with a prefix (``split_arranged``; the plain mirrored arrangement uses
``stage2_split.split_sequence``): for an attention bound A (and linear bound L) each prefix block
takes the most units its groups can hold within A at its start (a closed form for identical
members: the attention term grows with the block's size and start, the K/V term with what lies
before its end); taking the most is optimal, since a longer prefix only makes the final block's
tokens fewer. The final block then takes the rest within its groups' unit ranges; the smallest
feasible A is a bisection, L a branch-and-bound search, as in ``stage2_split``. The bound this
gives is a lower bound over every split of these groups in this arrangement (prefix blocks split
evenly among their groups).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Sequence

from megatron_hexiseq.planner.coef import INF, GroupCoef
from megatron_hexiseq.planner.linsearch import LIN_COARSE_EVALS, LIN_EVALS, best_lin
from megatron_hexiseq.planner.stage2_split import (A_TOL, Split, _hand_out, closed_range, group_time, linear_phase,
                                                    units_range)

COARSE_A_TOL = 1e-3  # Stage I's coarse split: the attention bound's bisection to 0.1%


@dataclass(frozen=True)
class Arrangement:
    """Blocks of group indices in sequence order: ``prefix`` blocks (each the groups of one class),
    then the ``final`` block's groups, outermost first. ``order`` is the sub-ring order."""

    prefix: tuple[tuple[int, ...], ...]
    final: tuple[int, ...]
    name: str = "mirrored"

    @property
    def order(self) -> list[int]:
        return [g for block in self.prefix for g in block] + list(self.final)

    @property
    def blocks(self) -> list[tuple[int, ...]]:
        return list(self.prefix) + [self.final]


def mirrored(num_groups: int, order: Sequence[int] | None = None) -> Arrangement:
    """One block of every group (outermost first: ``order``, default the grouping's order)."""
    return Arrangement(prefix=(), final=tuple(order if order is not None else range(num_groups)))


def _class_keys(g: GroupCoef) -> tuple[float, float]:
    """(K/V ns per visible unit, attention ns per group unit) of one member rank with an even head split."""
    per_rank = g.heads / g.size
    return max(g.c) * per_rank, max(g.b) * per_rank


def arrangements(coefs: Sequence[GroupCoef]) -> list[Arrangement]:
    """The arrangements Stage I tries for a grouping (``coefs``: one per group; identical groups
    share one object). Classes of identical groups are ordered slow-to-fast by two keys — K/V cost
    per visible unit first, attention cost first — and each order gives the prefix of its slowest
    class and the prefix of all but its fastest class (one block per class) before a final block of
    the rest. The final block's order (the sub-ring order) is settled when the layout is built
    (``ring_blocks``). The first arrangement is the plain mirrored one."""
    classes: dict[GroupCoef, list[int]] = {}
    for i, c in enumerate(coefs):
        classes.setdefault(c, []).append(i)
    keys = {c: _class_keys(c) for c in classes}
    first = list(classes)

    def final(cs: Sequence[GroupCoef]) -> tuple[int, ...]:
        return tuple(i for c in sorted(cs, key=lambda c: (keys[c][0], first.index(c))) for i in classes[c])

    out = [Arrangement(prefix=(), final=final(first))]
    seen = {((), out[0].final)}
    for name, key in (("kv", lambda c: (-keys[c][0], -keys[c][1], first.index(c))),
                      ("compute", lambda c: (-keys[c][1], -keys[c][0], first.index(c)))):
        slow_first = sorted(first, key=key)
        for m in sorted({1, len(slow_first) - 1} - {0}):
            prefix = tuple(tuple(classes[c]) for c in slow_first[:m])
            arr = Arrangement(prefix=prefix, final=final(slow_first[m:]), name=f"prefix-{name}-{m}")
            if (arr.prefix, arr.final) not in seen:
                seen.add((arr.prefix, arr.final))
                out.append(arr)
    return out


def ring_blocks(coefs: Sequence[GroupCoef], arr: Arrangement, units: Sequence[int], reverse: bool = False
                ) -> list[list[int]]:
    """The arrangement's blocks for ``build_layout``, the final block's groups ordered by the ratio
    of their K/V transfer to their attention per received unit, ``c / (b T)`` (``reverse``: the other
    way round). In a mirrored block the outermost group's last query is the block's end, so it
    receives everything before it, an inner group less; which order hides the K/V better depends on
    how the rounds pipeline, so the planner builds both and ``estimate`` decides (2 H100 + 1 A100
    groups, gpt-7b, 128K: 3.652 s with the A100 group innermost, 3.798 s outermost). The surrogate's
    K/V term, an upper bound, is the same in any order."""
    def key(g: int) -> tuple[float, int]:
        c = coefs[g]
        return (max(c.c) / max(1, max(c.b) * units[g]), arr.final.index(g))
    final = sorted(arr.final, key=key)
    return [list(b) for b in arr.prefix] + [final[::-1] if reverse else final]


def positioned(coefs: Sequence[GroupCoef], arr: Arrangement, units: Sequence[int]) -> list[GroupCoef]:
    """Each group's coefficients at the place ``arr`` and ``units`` give it (``GroupCoef.start``,
    ``end``, ``band``)."""
    N = coefs[0].num_units
    out = list(coefs)
    P = 0
    for block in arr.blocks:
        Q = P + sum(units[g] for g in block)
        for g in block:
            band = len(block) == 1 and block is not arr.final
            out[g] = coefs[g].placed(P, 0 if Q >= N else Q, band)
        P = Q
    return out


def _block_time(g: GroupCoef, k: int, P: int, T: int, lin: float) -> float:
    """Attention phase of each of k identical groups of identical members holding T units each in a
    prefix block starting at P (k = 1: a band), as ``stage2_split._identical_time`` (the larger of
    the continuous even split and the member with ceil(H/n) heads); inf past memory, the linear bound
    or the minimum."""
    n, H = g.size, g.heads
    a, s, b, c, e, free, mt, mh = g.rows[0][1:9]
    t = T / n
    hmax = -(-H // n)
    if T < n or t * mt + H / n * T * mh > free or mt + hmax * T * mh > free or (a > 0 and t * a > lin):
        return INF
    att = b * T * (2 * P + k * T) // g.num_units
    beta = max(att, (P + (k - 1) * T) * c) + T * e
    return max(s * t + H * beta / n, s + hmax * beta)


def _block_max(g: GroupCoef, k: int, P: int, z: float, lin: float, room: int) -> int | None:
    """Most units per group (all k groups equal) of a prefix block starting at P within attention
    bound z, at most ``room`` units for the block; None when not even each group's minimum fits."""
    n, H, N = g.size, g.heads, g.num_units
    tmax = room // k
    if tmax < n:
        return None
    if len(g.rows) != 1:  # members differ: bisection on the positioned group's own time
        def ok(T: int) -> bool:
            q = P + k * T
            return group_time(g.placed(P, 0 if q >= N else q, k == 1), T, lin) <= z
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
    a, s, b, c, e, free, mt, mh = g.rows[0][1:9]
    # attention b T (2P + k T) / N per head; the outermost group sees the block's other units and
    # everything before it: visible = P + (k - 1) T
    real = closed_range(n, H, z, s, e, c, b * k / N, 2 * P * b / N, c * (k - 1), P * c)
    if real is None:
        return None
    x = min(real[1], float(tmax))
    hmax = -(-H // n)
    if mt + H * mh > 0:
        x = min(x, n * free / (mt + H * mh))
    if mh > 0:
        x = min(x, (free - mt) / (hmax * mh))
    if a > 0 and math.isfinite(lin):
        x = min(x, n * lin / a)
    T = min(tmax, math.floor(x + 1e-9)) if math.isfinite(x) else tmax
    for _ in range(6):  # settle on integers (att() rounds down)
        if T < n:
            return None
        if _block_time(g, k, P, T, lin) <= z:
            if T + 1 <= tmax and _block_time(g, k, P, T + 1, lin) <= z:
                T += 1
                continue
            return T
        T -= 1
    return T if T >= n and _block_time(g, k, P, T, lin) <= z else None


def _feasible(coefs: Sequence[GroupCoef], arr: Arrangement, N: int, z: float, lin: float
              ) -> tuple[list[int], int, dict[GroupCoef, tuple[int, int]], list[GroupCoef]] | None:
    """Per prefix block its units per group (greedy most), the final block's start and its groups'
    positioned coefficients and unit ranges, or None when the arrangement cannot hold N within z."""
    final_min = sum(coefs[g].min_units() for g in arr.final)
    sizes, P = [], 0
    for block in arr.prefix:
        g = coefs[block[0]]
        T = _block_max(g, len(block), P, z, lin, N - P - final_min)
        if T is None:
            return None
        sizes.append(T)
        P += T * len(block)
    # the final block [P, N): its groups' ranges at that start (their K/V does not depend on it)
    final_classes: dict[GroupCoef, int] = {}
    for g in arr.final:
        final_classes[coefs[g]] = final_classes.get(coefs[g], 0) + 1

    def final_ranges(P: int) -> tuple[dict[GroupCoef, tuple[int, int]], list[GroupCoef]] | None:
        moved = {c: c.placed(P, 0, False) for c in final_classes}
        out: dict[GroupCoef, tuple[int, int]] = {}
        for c, m in moved.items():
            r = units_range(m, z, lin)
            if r is None:
                return None
            out[m] = r
        return out, [moved[coefs[g]] for g in arr.final]

    got = final_ranges(P)
    if got is None:
        return None
    ranges, pos = got
    lo_sum = sum(ranges[c][0] for c in pos)
    if P + lo_sum > N:  # the final block's K/V-bound groups need more room: a shorter prefix
        P_short = N - lo_sum
        prefix_min = sum(coefs[block[0]].min_units() * len(block) for block in arr.prefix)
        if P_short < prefix_min:
            return None
        sizes = _shrink(coefs, arr, sizes, P - P_short)
        P = sum(T * len(block) for T, block in zip(sizes, arr.prefix))
        got = final_ranges(P)
        if got is None:
            return None
        ranges, pos = got
    if P + sum(ranges[c][1] for c in pos) < N:
        return None
    return sizes, P, ranges, pos


def _shrink(coefs: Sequence[GroupCoef], arr: Arrangement, sizes: list[int], cut: int) -> list[int]:
    """Prefix block sizes with ``cut`` units less, taken from the last block first (earlier blocks
    keep their place; a later block that moves earlier only gets cheaper)."""
    sizes = list(sizes)
    for i in range(len(sizes) - 1, -1, -1):
        k, n = len(arr.prefix[i]), coefs[arr.prefix[i][0]].size
        take = min(-(-cut // k), sizes[i] - n)
        sizes[i] -= take
        cut -= take * k
        if cut <= 0:
            break
    return sizes


def _split_at(coefs: Sequence[GroupCoef], arr: Arrangement, N: int, lin: float, tol: float
              ) -> tuple[Split, list[GroupCoef]] | None:
    """The arranged split for a fixed linear bound (see the module docstring)."""
    share = max(1, N // len(coefs))
    even = [group_time(c, min(max(share, c.min_units()), c.max_units()), lin) for c in set(coefs)]
    lo, hi = 0.0, max(even) if all(math.isfinite(x) for x in even) else 1e6
    at_hi = _feasible(coefs, arr, N, hi, lin)
    while at_hi is None:
        lo, hi = hi, hi * 2
        if hi > 1e18:
            return None
        at_hi = _feasible(coefs, arr, N, hi, lin)
    for _ in range(80):
        if hi - lo <= tol * hi:
            break
        mid = (lo + hi) / 2
        at_mid = _feasible(coefs, arr, N, mid, lin)
        if at_mid is not None:
            hi, at_hi = mid, at_mid
        else:
            lo = mid
    sizes, P, ranges, pos = at_hi
    units = [0] * len(coefs)
    for block, T in zip(arr.prefix, sizes):
        for g in block:
            units[g] = T
    distinct: dict[GroupCoef, int] = {}
    for c in pos:
        distinct[c] = distinct.get(c, 0) + 1
    for g, u in zip(arr.final, _hand_out(pos, distinct, ranges, N - P)):
        units[g] = u
    placed = positioned(coefs, arr, units)
    pairs = set(zip(placed, units))
    att = max(group_time(c, u, lin) for c, u in pairs)
    lin_used = lin if math.isfinite(lin) else max(linear_phase(c, u, group_time(c, u)) for c, u in pairs)
    return Split(units=tuple(units), z_relaxed_ns=lin_used + hi, z_rounded_ns=lin_used + att,
                 lin_ns=lin_used, att_ns=hi), placed


def split_arranged(coefs: Sequence[GroupCoef], arr: Arrangement, N: int, search_lin: bool = True
                   ) -> tuple[Split, list[GroupCoef]] | None:
    """Stage II for an arrangement with a prefix: units per group and each group's positioned
    coefficients; ``Split.bound_ns`` bounds every split of these groups in this arrangement
    (``search_lin``; 0 for the coarse search)."""
    tol = A_TOL if search_lin else COARSE_A_TOL
    free = _split_at(coefs, arr, N, INF, tol)
    if free is None:
        return None
    inv = sum(1.0 / a for g in coefs for a in g.a if a > 0)
    lo = N / inv if inv > 0 and all(min(g.a) > 0 for g in coefs) else 0.0
    hi = free[0].lin_ns
    cache: dict[float, tuple[Split, list[GroupCoef]] | None] = {}

    def at(L: float) -> tuple[Split, list[GroupCoef]] | None:
        if L not in cache:
            cache[L] = _split_at(coefs, arr, N, L, tol)
        return cache[L]

    def f(L: float) -> float:
        got = at(L)
        return got[0].z_relaxed_ns if got is not None else INF

    def ok(L: float) -> bool:
        return _feasible(coefs, arr, N, 1e30, L) is not None

    L, bound = best_lin(f, min(lo, hi), hi, ok, LIN_EVALS if search_lin else LIN_COARSE_EVALS)
    best = at(L)
    if best is None or best[0].z_rounded_ns > free[0].z_rounded_ns:
        best = free
    split, placed = best
    proven = min(bound, free[0].z_relaxed_ns) * (1 - tol) if search_lin else 0.0
    return replace(split, bound_ns=min(proven, split.z_rounded_ns)), placed
