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
before its end); with one prefix block taking the most is optimal, since a longer prefix only
makes the final block's tokens fewer. With several it is not: an earlier block taking its most
starts the later ones later (fewer units within A) and can leave them less room than their minimum
(docs/planner.md, "Known gap: two or more prefix blocks", has the brute-force figures). The
final block then takes the rest within its groups' unit ranges; the smallest feasible A is a
bisection, L a branch-and-bound search, as in ``stage2_split``. With one prefix block the bound this
gives is a lower bound over every split of these groups in this arrangement (prefix blocks split
evenly among their groups); with several it is not proven (the same brute-force check), and
``arranged_bound`` gives a proven one from a relaxation of the feasibility test
(``_relaxed_feasible``: each block's most units at the earliest start any split gives it), checked
against brute force with two and three prefix blocks.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from functools import lru_cache
from operator import mul

from megatron_hexiseq.planner.coef import INF, MIN_UNITS_PER_RANK, GroupCoef
from megatron_hexiseq.planner.linsearch import best_lin
from megatron_hexiseq.planner.stage2_split import (
    A_TOL,
    COARSE_A_TOL,
    Found,
    Split,
    _bracket,
    _closed_eval,
    _general_range,
    _hand_out,
    _range_consts,
    group_time,
    lin_floor,
    linear_phase,
    settle_range,
    smallest_bound,
    start_bound,
    units_range,
)


@dataclass(frozen=True)
class Arrangement:
    """Blocks of group indices in sequence order: ``prefix`` blocks (each the groups of one class),
    then the ``final`` block's groups, outermost first. ``order`` is the sub-ring order."""

    prefix: tuple[tuple[int, ...], ...]
    final: tuple[int, ...]
    name: str = "mirrored"

    @property
    def share(self) -> float:
        """The prefix's share of the classes (``prefix-kv-4of8``: 0.5), 0 for the mirrored one."""
        if not self.prefix:
            return 0.0
        m, c = self.name.rsplit("-", 1)[1].split("of")
        return int(m) / int(c)

    @property
    def order_name(self) -> str:
        """The slowness order the prefix follows ("kv", "compute"; "" for the mirrored one)."""
        return self.name.split("-")[1] if self.prefix else ""

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


def arrangements(
    coefs: Sequence[GroupCoef],
    shares: Sequence[float] | None = None,
    orders: Sequence[str] | None = None,
) -> list[Arrangement]:
    """The arrangements Stage I tries for a grouping (``coefs``: one per group; identical groups
    share one object). Classes of identical groups are ordered slow-to-fast by two keys — K/V cost
    per visible unit first, attention cost first — and each order gives prefixes of its slowest m
    classes (one block per class) before a final block of the rest: every m from 1 to C - 1, or, with
    ``shares``, m = 1, m = C - 1 and m = round(share * C) for each share (``Arrangement.share``: the
    prefix's share of the classes, which carries over between groupings with other class counts);
    ``orders``: only the orders named ("kv", "compute"; ``Arrangement.order_name``).
    The final block's order (the sub-ring order) is settled when the layout is built
    (``ring_blocks``). The first arrangement is the plain mirrored one."""
    classes: dict[GroupCoef, list[int]] = {}
    for i, c in enumerate(coefs):
        classes.setdefault(c, []).append(i)
    keys = {c: _class_keys(c) for c in classes}
    first = list(classes)
    C = len(first)

    def final(cs: Sequence[GroupCoef]) -> tuple[int, ...]:
        return tuple(
            i for c in sorted(cs, key=lambda c: (keys[c][0], first.index(c))) for i in classes[c]
        )

    out = [Arrangement(prefix=(), final=final(first))]
    seen: set[tuple[tuple[tuple[int, ...], ...], tuple[int, ...]]] = {((), out[0].final)}
    ms = (
        set(range(1, C))
        if shares is None
        else ({1, C - 1} | {round(s * C) for s in shares}) & set(range(1, C))
    )
    for name, key in (
        ("kv", lambda c: (-keys[c][0], -keys[c][1], first.index(c))),
        ("compute", lambda c: (-keys[c][1], -keys[c][0], first.index(c))),
    ):
        if orders is not None and name not in orders:
            continue
        slow_first = sorted(first, key=key)
        for m in sorted(ms):
            prefix = tuple(tuple(classes[c]) for c in slow_first[:m])
            arr = Arrangement(
                prefix=prefix, final=final(slow_first[m:]), name=f"prefix-{name}-{m}of{C}"
            )
            if (arr.prefix, arr.final) not in seen:
                seen.add((arr.prefix, arr.final))
                out.append(arr)
    return out


def kappa(receiver: GroupCoef, sender: GroupCoef) -> float:
    """K/V fan-out of a receiving group from a sending group: ``max(1, n / m)`` for group sizes n, m.

    A holder of K/V heads serves every receiver of the other group that needs them, one copy each
    (the runtime's ``attention/peers.py``; ``costmodel.exchange.fan_units``): with even head splits
    a rank of a group of ``n`` receives ``H/n`` heads' K/V per round from a group of ``m`` ranks whose
    holders send ``H/m`` each, and the round lasts ``max(H/n, H/m)`` blocks. Without it the surrogate
    saw 40-rank groups with one head each at the end of the sequence as cheap (9.5 s) while
    ``estimate`` gave 13.6 s: 8-rank senders with 5 heads each."""
    return max(1.0, receiver.size / sender.size)


def _final_kappa(coefs: Sequence[GroupCoef], arr: Arrangement) -> dict[int, float]:
    """Per final group its ``kappa`` from the other final groups, averaged with their share of the
    block's tokens estimated by their linear FLOP rate (sum of 1/a over members): a small group that
    holds few tokens adds little fan-out. (The largest kappa charged every final group for its
    smallest neighbour whatever that held: 52 H100 + 4 A100 + 8 A800, gpt-13b, 256K, put a 4-GPU
    A100 group next to 8-GPU H100 groups and lost the node groups' plan, 4.68 s, for 5.40 s.)"""
    size: dict[GroupCoef, int] = {}
    weight: dict[GroupCoef, float] = {}
    count: dict[GroupCoef, int] = {}
    for g in arr.final:
        c = coefs[g]
        k = count.get(c)
        if k is None:  # a class's size and weight once (they depend on its coefficients only)
            count[c] = 1
            size[c] = c.size
            weight[c] = sum(1.0 / a for a in c.a if a > 0)
        else:
            count[c] = k + 1
    per: dict[GroupCoef, float] = {}
    for c in count:
        num = den = 0.0
        for d, k in count.items():
            k -= d is c  # the other groups only
            num += k * weight[d] * max(1.0, size[c] / size[d])
            den += k * weight[d]
        per[c] = num / den if den > 0 else 1.0
    return {g: per[coefs[g]] for g in arr.final}


def with_fan_out(coefs: Sequence[GroupCoef], arr: Arrangement) -> list[GroupCoef]:
    """The final block's K/V coefficients ``c`` scaled by their fan-out from the other final groups
    (``_final_kappa``); the fan-out from prefix blocks enters through ``GroupCoef.kv_extra``
    once their sizes are known (``_feasible``, ``positioned``), the prefix blocks' through their
    visible units (``_block_max``)."""
    out = list(coefs)
    for g, mult in _final_kappa(coefs, arr).items():
        if mult > 1.0:
            out[g] = _kv_scaled(coefs[g], mult)
    return out


@lru_cache(maxsize=100_000)
def _kv_scaled(g: GroupCoef, mult: float) -> GroupCoef:
    """``g`` with its K/V coefficients ``c`` times ``mult`` (rounded), one object per (g, mult):
    every arrangement of every grouping scales the same few classes again."""
    return replace(g, c=tuple(round(x * mult) for x in g.c))


def ring_blocks(
    coefs: Sequence[GroupCoef], arr: Arrangement, units: Sequence[int], reverse: bool = False
) -> list[list[int]]:
    """The arrangement's blocks for ``build_layout``, the final block's groups ordered by the ratio
    of their K/V transfer to their attention per received unit, ``c / (b T)`` (``reverse``: the other
    way round). In a mirrored block the outermost group's last query is the block's end, so it
    receives everything before it, an inner group less; which order hides the K/V better depends on
    how the rounds pipeline, so the planner builds both and ``estimate`` decides (2 H100 + 1 A100
    groups, gpt-7b, 128K: 3.652 s with the A100 group innermost, 3.798 s outermost). The surrogate's
    K/V term, an upper bound, is the same in any order."""
    where = {g: i for i, g in enumerate(arr.final)}

    def key(g: int) -> tuple[float, int]:
        c = coefs[g]
        return (max(c.c) / max(1, max(c.b) * units[g]), where[g])

    final = sorted(arr.final, key=key)
    return [list(b) for b in arr.prefix] + [final[::-1] if reverse else final]


@lru_cache(maxsize=4096)
def _fan_weights(
    coefs: tuple[GroupCoef, ...], arr: Arrangement
) -> tuple[tuple[tuple[float, ...], ...], dict[int, tuple[float, ...]]]:
    """The linear weights of ``_extras`` (per prefix block over the earlier blocks' sizes, per final
    group over the prefix blocks' sizes), computed once per (groups, arrangement)."""
    heads = [coefs[b[0]] for b in arr.prefix]
    block_w = tuple(
        tuple(kappa(heads[i], heads[j]) * len(arr.prefix[j]) for j in range(i))
        for i in range(len(heads))
    )
    fin = _final_kappa(coefs, arr)
    final_w = {
        g: tuple((kappa(coefs[g], h) / fin[g] - 1) * len(b) for h, b in zip(heads, arr.prefix))
        for g in arr.final
    }
    return block_w, final_w


def _extras(
    coefs: Sequence[GroupCoef], arr: Arrangement, sizes: Sequence[int]
) -> tuple[list[int], dict[int, int]]:
    """Fan-out in visible units: per prefix block ``V_b - P_b`` (its visible units from the earlier
    blocks, each counted ``kappa`` times, less its start), per final group ``kv_extra`` (the prefix
    blocks' units counted ``kappa / kappa_final`` times instead of once; ``c`` is scaled by
    ``kappa_final``, see ``with_fan_out``). ``sizes``: units per group of each prefix block."""
    block_w, final_w = _fan_weights(tuple(coefs), arr)
    block_extra, P = [], 0
    for i, block in enumerate(arr.prefix):
        block_extra.append(round(sum(map(mul, block_w[i], sizes))) - P)
        P += len(block) * sizes[i]
    return block_extra, {g: round(sum(map(mul, w, sizes))) for g, w in final_w.items()}


def positioned(
    coefs: Sequence[GroupCoef], arr: Arrangement, units: Sequence[int]
) -> list[GroupCoef]:
    """Each group's coefficients at the place ``arr`` and ``units`` give it (``GroupCoef.start``,
    ``end``, ``band``, ``kv_extra``)."""
    N = coefs[0].num_units
    sizes = [units[b[0]] for b in arr.prefix]
    block_extra, final_extra = _extras(coefs, arr, sizes)
    out = list(coefs)
    P = 0
    for i, block in enumerate(arr.blocks):
        Q = P + sum(units[g] for g in block)
        for g in block:
            if block is arr.final:
                out[g] = coefs[g].placed(P, 0 if Q >= N else Q, False, final_extra[g])
            else:
                out[g] = coefs[g].placed(P, 0 if Q >= N else Q, len(block) == 1, block_extra[i])
        P = Q
    return out


@lru_cache(maxsize=200_000)
def _block_time(g: GroupCoef, k: int, P: int, V: float, T: int, lin: float) -> float:
    """Attention phase of each of k identical groups of identical members holding T units each in a
    prefix block starting at P that sees V units before it (k = 1: a band), as
    ``stage2_split._identical_time`` (the larger of the continuous even split and the member with
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
def _block_consts(g: GroupCoef, k: int, lin: float) -> tuple:
    """What ``_block_upper`` reads of a prefix block of k groups of identical members: per lower
    bound of ``_block_time`` (the continuous even split, the member with ceil(H/n) heads) the parts
    of ``stage2_split._closed_consts`` that do not depend on the block's start or what it sees, and
    the smallest of the memory and linear-bound caps on the units."""
    n, H, N = g.size, g.heads, g.num_units
    a, s, b, c, e, free, mt, mh = g.rows[0][1:9]
    quad, kv_slope = b * k / N, c * (k - 1)
    hmax = -(-H // n)
    bounds = []
    for alpha, heads in ((s / n, H / n), (0.0, hmax)):
        qa = heads * quad
        bounds.append((alpha, heads, 4 * qa, 2 * qa, qa > 0, alpha + heads * (kv_slope + e)))
    cap = INF
    if mt + H * mh > 0:
        cap = min(cap, n * free / (mt + H * mh))
    if mh > 0:
        cap = min(cap, (free - mt) / (hmax * mh))
    if a > 0 and math.isfinite(lin):
        cap = min(cap, n * lin / a)
    return (s, b, e, c, N, tuple(bounds), cap)


def _block_upper(consts: tuple, P: int, V: int, z: float) -> float | None:
    """The real upper end of the closed form (``stage2_split._closed_consts``) for a prefix block starting at P that
    sees V units (attention ``b T (2P + k T) / N`` per head, visible ``V + (k - 1) T``: the outermost
    group sees the block's other units and what lies before it), capped by memory and the linear
    bound; None when the range is empty: ``_closed_eval`` on constants built here the way
    ``_closed_consts`` builds them (Stage I's coarse tests move the blocks on almost every call, so
    its cache missed)."""
    s, b, e, c, N, bounds, cap = consts
    lin_att, kv_const = 2 * P * b / N, V * c
    parts = []
    for alpha, heads, qa4, qa2, quadratic, m in bounds:
        qb = alpha + heads * (lin_att + e)
        parts.append((qa4, qa2, -qb, qb * qb, qb, m, heads * kv_const, quadratic))
    real = _closed_eval(tuple(parts), z, s)
    if real is None:
        return None
    return real[1] if real[1] < cap else cap


def _block_max(
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
    x = _block_upper(_block_consts(g, k, lin), P, round(V), z)
    if x is None:
        return None
    x = min(x, float(tmax))
    T = min(tmax, math.floor(x + 1e-9)) if math.isfinite(x) else tmax
    for _ in range(6):  # settle on integers (att() rounds down)
        if T < n:
            return None
        if _block_time(g, k, P, V, T, lin) <= z:
            if T + 1 <= tmax and _block_time(g, k, P, V, T + 1, lin) <= z:
                T += 1
                continue
            return T
        T -= 1
    return T if T >= n and _block_time(g, k, P, V, T, lin) <= z else None


@lru_cache(maxsize=4096)
def _prepared(coefs: tuple[GroupCoef, ...], arr: Arrangement) -> tuple:
    """What ``_feasible`` reads on every call for one (groups, arrangement): the ``_fan_weights``,
    the final block's and the prefix's minimum units, the final groups counted by (coefficients,
    fan-out) and each final group's key, each prefix block's (coefficients, group count) and its
    group count alone."""
    block_w, final_w = _fan_weights(coefs, arr)
    final_min = sum(coefs[g].min_units() for g in arr.final)
    prefix_min = sum(coefs[block[0]].min_units() * len(block) for block in arr.prefix)
    count: dict[
        tuple[GroupCoef, tuple[float, ...]], int
    ] = {}  # final groups by (coefficients, fan-out)
    for g in arr.final:
        key = (coefs[g], final_w[g])
        count[key] = count.get(key, 0) + 1
    keys = [(coefs[g], final_w[g]) for g in arr.final]
    heads = [(coefs[block[0]], len(block)) for block in arr.prefix]
    return block_w, final_min, prefix_min, count, keys, heads, [len(b) for b in arr.prefix]


_Final = dict[tuple, tuple[GroupCoef | None, int, tuple[int, int]]]  # ``_feasible``'s final block


def _feasible(
    coefs: Sequence[GroupCoef],
    arr: Arrangement,
    N: int,
    z: float,
    lin: float,
    exact: bool = True,
    prep: tuple | None = None,
    hint: list[int] | None = None,
    finals: list[tuple | None] | None = None,
) -> tuple[list[int], int, _Final] | None:
    """Per prefix block its units per group, the final block's start and per final key (see
    ``_prepared``) its placed group (None when not built yet: ``_final_placed``), its ``kv_extra``
    and its unit range; None when the arrangement cannot hold N within z.

    The prefix blocks first take the most units each can hold (a later block's most units only grow
    with its start). The final block's ranges then depend on the prefix's length P: their attention
    upper ends shrink as P grows (more keys per query), their K/V lower ends grow with the prefix's
    fan-out; so P is the longest prefix (shortened from its last block) at which every final range is
    non-empty and the final groups' lower ends fit in ``N - P`` (both hold for every shorter prefix),
    and then ``P + sum hi >= N`` decides (it only grows with P). ``exact=False`` (Stage I's coarse
    split) tries a few shorter prefixes instead of the bisection. ``prep``: ``_prepared(tuple(coefs),
    arr)`` when the caller has it. ``hint``: a one-element list with the prefix length the last call
    of a search settled on, updated here (the next attention bound's is near it: ``_longest``).
    ``finals``: ``_final_consts`` of each final key at ``lin`` when the caller has them.
    """
    if prep is None:
        prep = _prepared(tuple(coefs), arr)
    block_w, final_min, prefix_min, count, keys, heads, block_len = prep
    sizes: list[int] = []
    P = 0
    for i, (g, k) in enumerate(heads):
        V = sum(map(mul, block_w[i], sizes))
        T = _block_max(g, k, P, V, z, lin, N - P - final_min)
        if T is None:
            return None
        sizes.append(T)
        P += T * k

    fast = finals if finals is not None else _finals_at(prep, lin)

    def state(
        P_target: int,
    ) -> tuple[list[int], int, _Final] | None:
        """The prefix's block sizes shortened to ``P_target``, its length and per final key (the
        placed group, None when the closed form skipped placing it; its kv_extra; its unit range);
        None when a final range is empty or their lower ends do not fit."""
        sz = _shrink(coefs, arr, sizes, P - P_target) if P_target < P else sizes
        p = sum(map(mul, sz, block_len))
        out: _Final = {}
        lo_sum = 0
        for i, (key, k) in enumerate(count.items()):
            kv = round(sum(map(mul, key[1], sz)))
            moved, r = _key_range(fast[i], key[0], p, kv, z, lin, exact)
            if r is None:
                return None
            out[key] = (moved, kv, r)
            lo_sum += k * r[0]
        return (sz, p, out) if p + lo_sum <= N else None

    got = state(P)
    if got is None and not exact:
        for frac in (0.75, 0.5, 0.25, 0.0):
            got = state(prefix_min + int(frac * (P - prefix_min)))
            if got is not None:
                break
        if got is None:
            return None
    if got is None:  # a shorter prefix: the longest that keeps the final ranges
        found = _longest(state, prefix_min, P, hint[0] if hint else None)
        if found is None:
            return None
        length, got = found
        if hint:
            hint[0] = length
    sz, p, out = got
    if p + sum(k * out[key][2][1] for key, k in count.items()) < N:
        return None
    return got


def _key_range(
    consts: tuple | None, g: GroupCoef, p: int, kv: int, z: float, lin: float, settle: bool
) -> tuple[GroupCoef | None, tuple[int, int] | None]:
    """The unit range of a final group ``g`` placed at ``p`` with ``kv`` fan-out units: in closed
    form from ``consts`` (``_final_consts(g, lin)``) without placing it, else from the placed group,
    which is returned too (None when not placed)."""
    if consts is not None:
        return None, _final_range(consts, p, kv, z, lin, settle)
    moved = _placed_final(g, p, kv)
    return moved, units_range(moved, z, lin, settle)


def _finals_at(prep: tuple, lin: float) -> list[tuple | None]:
    """``_final_consts`` of each final key of ``_prepared``'s answer at linear bound ``lin``."""
    return [_final_consts(key[0], lin) for key in prep[3]]


def _final_placed(
    keys: Sequence[tuple], p: int, out: _Final
) -> tuple[dict[GroupCoef, tuple[int, int]], list[GroupCoef]]:
    """The final groups' positioned coefficients and unit ranges from ``_feasible``'s answer (built
    once for the bound a search settles on, not on every test that holds): per positioned group its
    range, and per final group (``keys``: ``_prepared``'s, in ``arr.final`` order) its positioned
    coefficients."""
    placed = {
        key: moved if moved is not None else _placed_final(key[0], p, kv)
        for key, (moved, kv, _) in out.items()
    }
    return {placed[key]: r for key, (_, _, r) in out.items()}, [placed[key] for key in keys]


def _longest(
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


_SEEN_MAX = 20_000  # exact times kept per (group, linear bound)


@lru_cache(maxsize=4096)
def _final_consts(g: GroupCoef, lin: float) -> tuple | None:
    """What ``_final_range`` reads of a final group of identical members (None when its
    members differ): the parts of ``stage2_split._range_consts`` that do not depend on where the
    group is placed."""
    if len(g.rows) != 1:
        return None
    n, H, N = g.size, g.heads, g.num_units
    k, a, s, b, c, e, free, mt, mh, cap = g.rows[0]
    hmax = -(-H // n)
    hi_cap = _range_consts(g, lin)[4]  # memory, the sequence, ``lin``: wherever the group is placed
    # per lower bound (the continuous even split, the member with ceil(H/n) heads): alpha, heads,
    # and the K/V branch's slope (``_closed_consts`` with kv_slope = -c)
    alpha0, heads0 = s / n, H / n
    m0, m1 = alpha0 + heads0 * (-c + e), 0.0 + hmax * (-c + e)
    floor = n * MIN_UNITS_PER_RANK
    closed = (n, N, s, b, c, e, alpha0, heads0, hmax, m0, m1, hi_cap, floor)
    # the rest: ``_identical_time``'s coefficients, the group, and the exact times computed so far
    # by (start, kv_extra, units) (a search probes the same places again and again)
    return (*closed, H, a, free, mt, mh, cap, g, {})


def _final_range(
    consts: tuple, p: int, kv: int, z: float, lin: float, settle: bool
) -> tuple[int, int] | None:
    """``units_range(_placed_final(g, p, kv), z, lin, settle)`` for a group of identical members
    (``consts``: ``_final_consts(g, lin)``), the same IEEE operations in the same order as
    ``stage2_split._identical_range`` without building the placed group or its caches (the tests
    of a search place the final groups at a new start on almost every call). The final block ends
    at N: attention ``b T (p + N) / N`` per head and unit, visible ``N - T + kv`` units."""
    n, N, s, b, c, e, alpha0, heads0, hmax, m0, m1, hi_cap, floor = consts[:13]
    H, a, free, mt, mh, cap, g, seen = consts[13:]
    lin_att = b * (p + N) / N
    kv_const = (N + kv) * c
    qb0, qb1 = alpha0 + heads0 * (lin_att + e), 0.0 + hmax * (lin_att + e)
    real = _closed_eval(
        (
            (0.0, 0.0, -qb0, qb0 * qb0, qb0, m0, heads0 * kv_const, False),
            (0.0, 0.0, -qb1, qb1 * qb1, qb1, m1, hmax * kv_const, False),
        ),
        z,
        s,
    )
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
    return (
        got if ok else _general_range(_placed_final(g, p, kv), z, lin)
    )  # off by more than rounding


@lru_cache(maxsize=100_000)
def _placed_final(g: GroupCoef, start: int, kv_extra: int) -> GroupCoef:
    """``g.placed(start, 0, False, kv_extra)``, one object per place: the bisections over the
    attention bound move the final groups to the same starts again and again, and the unit-range
    caches then hit by identity."""
    return g.placed(start, 0, False, kv_extra)


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


def _split_at(
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
    prep = _prepared(tuple(coefs), arr)
    hint = [-1]  # the prefix length the last test settled on (``_feasible``)
    finals = _finals_at(prep, lin)  # once per split, not per test

    def test(z: float) -> tuple | None:
        return _feasible(coefs, arr, N, z, lin, exact, prep, hint, finals)

    got = smallest_bound(
        test,
        bracket,
        lambda: start_bound(set(coefs), max(1, N // len(coefs)), lin),
        tol,
    )
    if got is None:
        return None
    hi, (sizes, P, final) = got
    ranges, pos = _final_placed(prep[4], P, final)
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
    free = _split_at(coefs, arr, N, INF, tol)
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
            cache[L] = _split_at(
                coefs, arr, N, L, tol, _bracket({x: s and s[0] for x, s in cache.items()}, L)
            )
        return cache[L]

    def f(L: float) -> float:
        got = at(L)
        return got[0].z_relaxed_ns if got is not None else INF

    prep = _prepared(tuple(coefs), arr)

    def ok(L: float) -> bool:
        return _feasible(coefs, arr, N, 1e30, L, search_lin, prep) is not None

    L, bound = best_lin(f, min(lo, hi), hi, ok)
    best = at(L)
    if best is None or best[0].z_rounded_ns > free[0].z_rounded_ns:
        best = free
    split, placed = best
    proven = min(bound, free[0].z_relaxed_ns) * (1 - tol)
    return replace(split, bound_ns=min(proven, split.z_rounded_ns)), placed


BOUND_GRID = 16  # starts tried per prefix block in the relaxed test (``_relaxed_feasible``)


def _least_weighted(
    rates: Sequence[float], least: Sequence[int], most: Sequence[int], excess: int
) -> float:
    """The smallest ``sum r_b y_b`` over block units ``y_b`` in ``[least_b, most_b]`` that add up to
    ``sum least + excess``: the excess goes to the smallest rates first."""
    total = sum(map(mul, rates, least))
    for r, room in sorted(zip(rates, (m - n for m, n in zip(most, least)))):
        if excess <= 0:
            break
        take = min(room, excess)
        total += r * take
        excess -= take
    return total + max(rates, default=0.0) * max(excess, 0)


def _relaxed_feasible(
    coefs: Sequence[GroupCoef],
    arr: Arrangement,
    N: int,
    z: float,
    lin: float,
    prep: tuple,
    finals: list[tuple | None],
) -> bool:
    """A relaxation of ``_feasible`` for any number of prefix blocks: True whenever some split of
    these groups in ``arr`` (each prefix block's groups holding equal units) holds N units within the
    attention bound z and linear bound ``lin`` (``arranged_bound``).

    A prefix block's most units M(S) at start S only shrink as S grows (more keys per query, more
    visible K/V, less room), so over starts in ``[x_j, x_{j+1}]`` the block's end is at most
    ``x_{j+1} + k M(x_j)``: from the range of starts any split can give a block (``[lo, hi]``, its
    lower end every earlier block at its minimum) and ``BOUND_GRID`` starts in it, the largest end
    any split can reach is bounded, and with it the prefix's length P; the block never holds more
    than ``k M(lo)``. The visible units a block sees (and a final group's ``kv_extra``) are at least
    their smallest value over the earlier blocks' units that add up to its start (``_least_weighted``),
    and the final ranges for fewer visible units contain the true ones; then, as in ``_feasible``, the
    longest P whose final ranges are non-empty with their lower ends fitting decides by
    ``P + sum hi >= N``. (With a negative final fan-out weight its ``kv_extra`` bound is the smallest
    over every P, so that the final test stays monotone in P.)"""
    block_w, final_min, _, count, _, heads, block_len = prep
    least = [g.min_units() * k for g, k in heads]  # each block's units at its minimum
    most: list[int] = []  # each block's units at its most
    s_lo = s_hi = 0
    for i, (g, k) in enumerate(heads):
        rates = [block_w[i][j] / block_len[j] for j in range(i)]
        later = sum(least[i + 1 :])
        xs = sorted({s_lo + (s_hi - s_lo) * j // BOUND_GRID for j in range(BOUND_GRID + 1)})
        reach = None
        for j, x in enumerate(xs):
            V = _least_weighted(rates, least[:i], most, x - s_lo)
            T = _block_max(g, k, x, V, z, lin, N - x - final_min - later)
            if T is None:  # not even the block's minimum fits here, nor at any later start
                break
            if j == 0:
                most.append(k * T)
            end = (xs[j + 1] if j + 1 < len(xs) else x) + k * T
            reach = end if reach is None else max(reach, end)
        if reach is None:
            return False
        s_lo, s_hi = s_lo + least[i], reach
    # per final key: its fan-out rates per prefix unit, or its constant kv_extra bound
    per_key: list[tuple[list[float], int | None]] = []
    for key in count:
        rates = [w / n for w, n in zip(key[1], block_len)]
        if min(rates) >= 0:
            per_key.append((rates, None))
        else:  # convex in P (negative rates filled first): its smallest value is where they are full
            full = sum(m - n for r, m, n in zip(rates, most, least) if r < 0)
            low = min(_least_weighted(rates, least, most, e) for e in (0, min(full, s_hi - s_lo)))
            per_key.append((rates, round(low)))

    def holds(P: int) -> int | None:
        lo_sum = hi_sum = 0
        for i, (key, k) in enumerate(count.items()):
            rates, fixed = per_key[i]
            kv = (
                fixed if fixed is not None else round(_least_weighted(rates, least, most, P - s_lo))
            )
            r = _key_range(finals[i], key[0], P, kv, z, lin, True)[1]
            if r is None:
                return None
            lo_sum += k * r[0]
            hi_sum += k * r[1]
        return hi_sum if P + lo_sum <= N else None

    top = holds(s_hi)
    P = s_hi
    if top is None:
        found = _longest(holds, s_lo, s_hi, None)
        if found is None:
            return False
        P, top = found
    return P + top >= N


def arranged_bound(coefs: Sequence[GroupCoef], arr: Arrangement, N: int) -> float | None:
    """A proven lower bound (ns) of the phase objective over every split of these groups in ``arr``
    (prefix blocks split evenly among their groups), for any number of prefix blocks: the smallest
    ``L + A(L)`` of ``_relaxed_feasible``, found as ``split_arranged``'s (attention bound by
    bisection, L by branch and bound) and lowered by the bisection's tolerance; None when not even
    the relaxation holds the sequence. ``coefs``: ``with_fan_out``'s, unplaced. Looser than the
    one-block bound of ``split_arranged`` (the blocks' most units are taken at the earliest starts
    of a grid), and about a hundred relaxed tests: computed once per plan, for the planner's best
    candidate (``hierarchical.planner_candidates``)."""
    tol = COARSE_A_TOL
    prep = _prepared(tuple(coefs), arr)
    share = max(1, N // len(coefs))

    def att(lin: float) -> float | None:
        finals = _finals_at(prep, lin)
        got = smallest_bound(
            lambda z: True if _relaxed_feasible(coefs, arr, N, z, lin, prep, finals) else None,
            None,
            lambda: start_bound(set(coefs), share, lin),
            tol,
        )
        return None if got is None else got[0]

    a_inf = att(INF)
    if a_inf is None:
        return None
    # where L stops: the greedy split's linear phase, else where no member's linear bound can bind
    free = _split_at(coefs, arr, N, INF, tol)
    hi = free[0].lin_ns if free is not None else N * max(max(g.a) for g in coefs)

    def f(L: float) -> float:
        a = att(L)
        return INF if a is None else L + a

    def ok(L: float) -> bool:
        return _relaxed_feasible(coefs, arr, N, 1e30, L, prep, _finals_at(prep, L))

    _, bound = best_lin(f, min(lin_floor(coefs, N), hi), hi, ok)
    # beyond ``hi`` every L + A(L) >= hi + A(inf)
    return min(bound, hi + a_inf) * (1 - tol)
