"""A proven lower bound of Stage II for an arrangement with any number of prefix blocks.

``arranged_split``'s greedy prefix split (each block takes its most) proves a bound with one prefix
block only. ``arranged_bound`` runs the same search (attention bound by bisection, L by branch and
bound) over a relaxation of its feasibility test (``relaxed_feasible``: each block's most units at
the earliest start of a grid of the starts any split can give it, the fewest visible units any
split can give it), which holds whenever some split does; ``bench/arranged_bound.py`` checks it
against brute force with two and three prefix blocks.
"""

from __future__ import annotations

from collections.abc import Sequence
from operator import mul

from megatron_hexiseq.planner.arrange import Arrangement
from megatron_hexiseq.planner.arranged_forms import FinalConsts, block_max, key_range
from megatron_hexiseq.planner.arranged_split import (
    Prepared,
    finals_at,
    longest,
    prepared,
    split_arranged_at,
)
from megatron_hexiseq.planner.coef import INF, GroupCoef
from megatron_hexiseq.planner.linsearch import best_lin
from megatron_hexiseq.planner.stage2_split import (
    COARSE_A_TOL,
    lin_floor,
    smallest_bound,
    start_bound,
)

BOUND_GRID = 16  # starts tried per prefix block in the relaxed test (``relaxed_feasible``)


def least_weighted(
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


def relaxed_feasible(
    coefs: Sequence[GroupCoef],
    arr: Arrangement,
    N: int,
    z: float,
    lin: float,
    prep: Prepared,
    finals: list[FinalConsts | None],
) -> bool:
    """A relaxation of ``arranged_feasible`` for any number of prefix blocks: True whenever some split of
    these groups in ``arr`` (each prefix block's groups holding equal units) holds N units within the
    attention bound z and linear bound ``lin`` (``arranged_bound``).

    A prefix block's most units M(S) at start S only shrink as S grows (more keys per query, more
    visible K/V, less room), so over starts in ``[x_j, x_{j+1}]`` the block's end is at most
    ``x_{j+1} + k M(x_j)``: from the range of starts any split can give a block (``[lo, hi]``, its
    lower end every earlier block at its minimum) and ``BOUND_GRID`` starts in it, the largest end
    any split can reach is bounded, and with it the prefix's length P; the block never holds more
    than ``k M(lo)``. The visible units a block sees (and a final group's ``kv_extra``) are at least
    their smallest value over the earlier blocks' units that add up to its start (``least_weighted``),
    and the final ranges for fewer visible units contain the true ones; then, as in ``arranged_feasible``, the
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
            V = least_weighted(rates, least[:i], most, x - s_lo)
            T = block_max(g, k, x, V, z, lin, N - x - final_min - later)
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
        rates = [w / n for w, n in zip(key.fan, block_len)]
        if min(rates) >= 0:
            per_key.append((rates, None))
        else:  # convex in P (negative rates filled first): its smallest value is where they are full
            full = sum(m - n for r, m, n in zip(rates, most, least) if r < 0)
            low = min(least_weighted(rates, least, most, e) for e in (0, min(full, s_hi - s_lo)))
            per_key.append((rates, round(low)))

    def holds(P: int) -> int | None:
        lo_sum = hi_sum = 0
        for i, (key, k) in enumerate(count.items()):
            rates, fixed = per_key[i]
            kv = fixed if fixed is not None else round(least_weighted(rates, least, most, P - s_lo))
            r = key_range(finals[i], key.coef, P, kv, z, lin, True)[1]
            if r is None:
                return None
            lo_sum += k * r[0]
            hi_sum += k * r[1]
        return hi_sum if P + lo_sum <= N else None

    top = holds(s_hi)
    P = s_hi
    if top is None:
        found = longest(holds, s_lo, s_hi, None)
        if found is None:
            return False
        P, top = found
    return P + top >= N


def arranged_bound(coefs: Sequence[GroupCoef], arr: Arrangement, N: int) -> float | None:
    """A proven lower bound (ns) of the phase objective over every split of these groups in ``arr``
    (prefix blocks split evenly among their groups), for any number of prefix blocks: the smallest
    ``L + A(L)`` of ``relaxed_feasible``, found as ``split_arranged``'s (attention bound by
    bisection, L by branch and bound) and lowered by the bisection's tolerance; None when not even
    the relaxation holds the sequence. ``coefs``: ``with_fan_out``'s, unplaced. Looser than the
    one-block bound of ``split_arranged`` (the blocks' most units are taken at the earliest starts
    of a grid), and about a hundred relaxed tests: computed once per plan, for the planner's best
    candidate (``hierarchical.planner_candidates``)."""
    tol = COARSE_A_TOL
    prep = prepared(tuple(coefs), arr)
    share = max(1, N // len(coefs))

    def att(lin: float) -> float | None:
        finals = finals_at(prep, lin)
        got = smallest_bound(
            lambda z: True if relaxed_feasible(coefs, arr, N, z, lin, prep, finals) else None,
            None,
            lambda: start_bound(set(coefs), share, lin),
            tol,
        )
        return None if got is None else got[0]

    a_inf = att(INF)
    if a_inf is None:
        return None
    # where L stops: the greedy split's linear phase, else where no member's linear bound can bind
    free = split_arranged_at(coefs, arr, N, INF, tol)
    hi = free[0].lin_ns if free is not None else N * max(max(g.a) for g in coefs)

    def f(L: float) -> float:
        a = att(L)
        return INF if a is None else L + a

    def ok(L: float) -> bool:
        return relaxed_feasible(coefs, arr, N, 1e30, L, prep, finals_at(prep, L))

    _, bound = best_lin(f, min(lin_floor(coefs, N), hi), hi, ok)
    # beyond ``hi`` every L + A(L) >= hi + A(inf)
    return min(bound, hi + a_inf) * (1 - tol)
