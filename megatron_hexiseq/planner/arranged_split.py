"""Stage II for an arrangement with a prefix: units per group, block by block.

The plain mirrored arrangement uses ``stage2_split.split_sequence``. For an attention bound A (and
linear bound L) each prefix block takes the most units its groups can hold within A at its start
(``arranged_forms.block_max``: a closed form for identical members, the attention term growing with
the block's size and start, the K/V term with what lies before its end); with one prefix block
taking the most is optimal, since a longer prefix only makes the final block's tokens fewer. With
several it is not: an earlier block taking its most starts the later ones later (fewer units within
A) and can leave them less room than their minimum (docs/planner.md, "Known gap: two or more prefix
blocks", has the brute-force figures). The final block then takes the rest within its groups' unit
ranges (``feasible``); the smallest feasible A is a bisection, L a branch-and-bound search, as in
``stage2_split``. With one prefix block the bound this gives is a lower bound over every split of
these groups in this arrangement (prefix blocks split evenly among their groups); with several it
is not proven, and ``relaxed_bound.arranged_bound`` gives a proven one.

Records: ``Prepared`` (what every test of one (groups, arrangement) reads, its final groups by
``FinalKey``), ``Feasible`` (a test that holds: the prefix and each final key's range),
``PrefixHint`` (where the last test's prefix ended, carried between the tests of one search).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import replace
from functools import lru_cache
from operator import mul
from typing import NamedTuple

from megatron_hexiseq.planner.arrange import Arrangement, fan_weights, positioned
from megatron_hexiseq.planner.arranged_forms import (
    FinalConsts,
    block_max,
    final_consts,
    key_range,
    placed_final,
)
from megatron_hexiseq.planner.coef import INF, GroupCoef
from megatron_hexiseq.planner.linsearch import best_lin
from megatron_hexiseq.planner.stage2_split import (
    A_TOL,
    COARSE_A_TOL,
    Found,
    Split,
    att_bracket,
    hand_out,
    lin_floor,
    smallest_bound,
    start_bound,
)
from megatron_hexiseq.planner.unit_range import group_time, linear_phase


class FinalKey(NamedTuple):
    """Final groups that behave alike in a split: the same coefficients and the same fan-out
    weights from the prefix blocks (``FanWeights.final``)."""

    coef: GroupCoef
    fan: tuple[float, ...]


class PrefixBlock(NamedTuple):
    """A prefix block: its groups' (identical) coefficients and how many groups it holds."""

    coef: GroupCoef
    groups: int


class Prepared(NamedTuple):
    """What ``arranged_feasible`` reads on every call for one (groups, arrangement) (``prepared``)."""

    block_w: tuple[tuple[float, ...], ...]  # ``FanWeights.block``
    final_min: int  # the final block's minimum units
    prefix_min: int  # the prefix's minimum units
    key_count: dict[
        FinalKey, int
    ]  # final groups per key, in ``arr.final`` order of first appearance
    keys: list[FinalKey]  # each final group's key, in ``arr.final`` order
    blocks: list[PrefixBlock]  # the prefix blocks in sequence order
    block_len: list[int]  # each prefix block's group count


class Feasible(NamedTuple):
    """A test of ``arranged_feasible`` that holds."""

    sizes: list[int]  # units per group of each prefix block
    P: int  # the prefix's length: the final block starts here
    # per final key, in ``Prepared.key_count`` order:
    placed: list[
        GroupCoef | None
    ]  # its positioned coefficients (None: the closed form skipped them)
    kv: list[int]  # its ``kv_extra``
    ranges: list[tuple[int, int]]  # its unit range


class PrefixHint:
    """Carried between the tests of one search: the prefix length the last test settled on (the
    next attention bound's answer is near it: ``longest`` gallops from there; -1 before any), and
    the order in which ``arranged_feasible`` tries the final keys (the one whose range was empty
    last, first)."""

    __slots__ = ("length", "key_order")

    def __init__(self) -> None:
        self.length = -1
        self.key_order: list[int] = []


@lru_cache(maxsize=4096)
def prepared(coefs: tuple[GroupCoef, ...], arr: Arrangement) -> Prepared:
    """What ``arranged_feasible`` reads on every call for one (groups, arrangement)."""
    block_w, final_w = fan_weights(coefs, arr)
    final_min = sum(coefs[g].min_units() for g in arr.final)
    prefix_min = sum(coefs[block[0]].min_units() * len(block) for block in arr.prefix)
    keys = [FinalKey(coefs[g], final_w[g]) for g in arr.final]
    count: dict[FinalKey, int] = {}
    for key in keys:
        count[key] = count.get(key, 0) + 1
    blocks = [PrefixBlock(coefs[block[0]], len(block)) for block in arr.prefix]
    return Prepared(
        block_w, final_min, prefix_min, count, keys, blocks, [len(b) for b in arr.prefix]
    )


def arranged_feasible(
    coefs: Sequence[GroupCoef],
    arr: Arrangement,
    N: int,
    z: float,
    lin: float,
    exact: bool = True,
    prep: Prepared | None = None,
    hint: PrefixHint | None = None,
    finals: list[FinalConsts | None] | None = None,
) -> Feasible | None:
    """Per prefix block its units per group, the final block's start and per final key (see
    ``prepared``) its placed group (None when not built yet: ``final_placed``), its ``kv_extra``
    and its unit range; None when the arrangement cannot hold N within z.

    The prefix blocks first take the most units each can hold (a later block's most units only grow
    with its start). The final block's ranges then depend on the prefix's length P: their attention
    upper ends shrink as P grows (more keys per query), their K/V lower ends grow with the prefix's
    fan-out; so P is the longest prefix (shortened from its last block) at which every final range is
    non-empty and the final groups' lower ends fit in ``N - P`` (both hold for every shorter prefix),
    and then ``P + sum hi >= N`` decides (it only grows with P). ``exact=False`` (Stage I's coarse
    split) tries a few shorter prefixes instead of the bisection. ``prep``: ``prepared(tuple(coefs),
    arr)`` when the caller has it. ``hint``: where the last test of a search settled, updated here.
    ``finals``: ``final_consts`` of each final key at ``lin`` when the caller has them.
    """
    if prep is None:
        prep = prepared(tuple(coefs), arr)
    block_w, final_min, prefix_min, count, _, blocks, block_len = prep
    sizes: list[int] = []
    P = 0
    for i, (g, k) in enumerate(blocks):
        V = sum(map(mul, block_w[i], sizes))
        T = block_max(g, k, P, V, z, lin, N - P - final_min)
        if T is None:
            return None
        sizes.append(T)
        P += T * k

    fast = finals if finals is not None else finals_at(prep, lin)
    items = list(count.items())
    # The final keys are tried with the one whose range was empty last first: a state with an
    # empty range costs one range instead of up to all (a quarter of the ranges Stage II computed
    # on gen:15000:128:7 were of states that another key's empty range then rejected). Every range
    # is a pure function of its key and the state, so the order changes no answer.
    order = hint.key_order if hint is not None else []
    if len(order) != len(items):
        order[:] = range(len(items))

    def state(P_target: int) -> Feasible | None:
        """The prefix's block sizes shortened to ``P_target``, its length and per final key (the
        placed group, None when the closed form skipped placing it; its kv_extra; its unit range);
        None when a final range is empty or their lower ends do not fit."""
        sz = shrink_prefix(coefs, arr, sizes, P - P_target) if P_target < P else sizes
        p = sum(map(mul, sz, block_len))
        placed: list[GroupCoef | None] = [None] * len(items)
        kvs = [0] * len(items)
        ranges: list[tuple[int, int]] = [(0, 0)] * len(items)
        lo_sum = 0
        for i in order:
            key, k = items[i]
            kv = round(sum(map(mul, key.fan, sz)))
            moved, r = key_range(fast[i], key.coef, p, kv, z, lin, exact)
            if r is None:
                if order[0] != i:
                    order.remove(i)
                    order.insert(0, i)
                return None
            placed[i], kvs[i], ranges[i] = moved, kv, r
            lo_sum += k * r[0]
        return Feasible(sz, p, placed, kvs, ranges) if p + lo_sum <= N else None

    got = state(P)
    if got is None and not exact:
        for frac in (0.75, 0.5, 0.25, 0.0):
            got = state(prefix_min + int(frac * (P - prefix_min)))
            if got is not None:
                break
        if got is None:
            return None
    if got is None:  # a shorter prefix: the longest that keeps the final ranges
        found = longest(state, prefix_min, P, hint.length if hint is not None else None)
        if found is None:
            return None
        length, got = found
        if hint is not None:
            hint.length = length
    if got.P + sum(k * r[1] for k, r in zip(count.values(), got.ranges)) < N:
        return None
    return got


def finals_at(prep: Prepared, lin: float) -> list[FinalConsts | None]:
    """``final_consts`` of each final key of ``prepared``'s answer at linear bound ``lin``."""
    return [final_consts(key.coef, lin) for key in prep.key_count]


def final_placed(
    prep: Prepared, got: Feasible
) -> tuple[dict[GroupCoef, tuple[int, int]], list[GroupCoef]]:
    """The final groups' positioned coefficients and unit ranges from ``arranged_feasible``'s answer
    (built once for the bound a search settles on, not on every test that holds): per positioned
    group its range, and per final group (in ``arr.final`` order) its positioned coefficients."""
    placed = {
        key: moved if moved is not None else placed_final(key.coef, got.P, kv)
        for key, moved, kv in zip(prep.key_count, got.placed, got.kv)
    }
    ranges = {placed[key]: r for key, r in zip(prep.key_count, got.ranges)}
    return ranges, [placed[key] for key in prep.keys]


def longest(
    holds: Callable[[int], Found | None], lo: int, hi: int, near: int | None
) -> tuple[int, Found] | None:
    """The largest x in [lo, hi) where ``holds(x)`` is not None, and that value (None when not even
    ``lo`` holds); ``holds`` holds up to some x and not beyond, and not at ``hi``. A bisection of
    [lo, hi); with ``near`` (where the answer was for a nearby bound), a gallop from there first, so
    the answer costs ~2 log2 |answer - near| tests instead of log2 (hi - lo): the same answer."""
    if near is not None and lo < near < hi:
        at = holds(near)
        if at is not None:  # up from near: holds at a, not at b
            a, got, step = near, at, 1
            b = hi
            while a + step < hi:
                at = holds(a + step)
                if at is None:
                    b = a + step
                    break
                a, got, step = a + step, at, 2 * step
        else:  # down from near: not at b
            b, step = near, 1
            while True:
                x = max(lo, b - step)
                at = holds(x)
                if at is not None:
                    a, got = x, at
                    break
                if x == lo:
                    return None
                b, step = x, 2 * step
    else:
        first = holds(lo)
        if first is None:
            return None
        a, b, got = lo, hi, first
    while b - a > 1:
        mid = (a + b) // 2
        at = holds(mid)
        if at is None:
            b = mid
        else:
            a, got = mid, at
    return a, got


def shrink_prefix(
    coefs: Sequence[GroupCoef], arr: Arrangement, sizes: list[int], cut: int
) -> list[int]:
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


def split_arranged_at(
    coefs: Sequence[GroupCoef],
    arr: Arrangement,
    N: int,
    lin: float,
    tol: float,
    bracket: tuple[float, float] | None = None,
) -> tuple[Split, list[GroupCoef]] | None:
    """The arranged split for a fixed linear bound (see the module docstring); ``bracket`` as in
    ``stage2_split.split_at``."""
    exact = tol <= A_TOL
    prep = prepared(tuple(coefs), arr)
    hint = PrefixHint()
    finals = finals_at(prep, lin)  # once per split, not per test

    def test(z: float) -> Feasible | None:
        return arranged_feasible(coefs, arr, N, z, lin, exact, prep, hint, finals)

    got = smallest_bound(
        test,
        bracket,
        lambda: start_bound(set(coefs), max(1, N // len(coefs)), lin),
        tol,
    )
    if got is None:
        return None
    hi, found = got
    sizes, P = found.sizes, found.P
    ranges, pos = final_placed(prep, found)
    units = [0] * len(coefs)
    for block, T in zip(arr.prefix, sizes):
        for g in block:
            units[g] = T
    distinct: dict[GroupCoef, int] = {}
    for c in pos:
        distinct[c] = distinct.get(c, 0) + 1
    for g, u in zip(arr.final, hand_out(pos, distinct, ranges, N - P)):
        units[g] = u
    placed = positioned(coefs, arr, units)
    pairs = set(zip(placed, units))
    att = max(group_time(c, u, lin) for c, u in pairs)
    lin_used = (
        lin if math.isfinite(lin) else max(linear_phase(c, u, group_time(c, u)) for c, u in pairs)
    )
    return Split(
        units=tuple(units),
        z_relaxed_ns=lin_used + hi,
        z_rounded_ns=lin_used + att,
        lin_ns=lin_used,
        att_ns=hi,
    ), placed


def split_arranged(
    coefs: Sequence[GroupCoef], arr: Arrangement, N: int, search_lin: bool = True
) -> tuple[Split, list[GroupCoef]] | None:
    """Stage II for an arrangement with a prefix: units per group and each group's positioned
    coefficients; ``Split.bound_ns`` bounds every split of these groups in this arrangement
    (``search_lin``; 0 for the coarse search)."""
    tol = A_TOL if search_lin else COARSE_A_TOL
    free = split_arranged_at(coefs, arr, N, INF, tol)
    if free is None:
        return None
    if (
        not search_lin
    ):  # Stage I's coarse split: the L = inf split, an upper bound of the phase optimum
        return free
    lo, hi = lin_floor(coefs, N), free[0].lin_ns
    cache: dict[float, tuple[Split, list[GroupCoef]] | None] = {INF: free}

    def at(L: float) -> tuple[Split, list[GroupCoef]] | None:
        if L not in cache:
            cache[L] = split_arranged_at(
                coefs, arr, N, L, tol, att_bracket({x: s and s[0] for x, s in cache.items()}, L)
            )
        return cache[L]

    def f(L: float) -> float:
        got = at(L)
        return got[0].z_relaxed_ns if got is not None else INF

    prep = prepared(tuple(coefs), arr)

    def ok(L: float) -> bool:
        return arranged_feasible(coefs, arr, N, 1e30, L, search_lin, prep) is not None

    L, bound = best_lin(f, min(lo, hi), hi, ok)
    best = at(L)
    if best is None or best[0].z_rounded_ns > free[0].z_rounded_ns:
        best = free
    split, placed = best
    proven = min(bound, free[0].z_relaxed_ns) * (1 - tol)
    return replace(split, bound_ns=min(proven, split.z_rounded_ns)), placed
