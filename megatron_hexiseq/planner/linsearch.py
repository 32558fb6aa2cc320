"""Stage II's 1-D search over the linear-phase bound L: minimise ``f(L) = L + A(L)`` with ``A``
non-increasing, by bisection to the first feasible L and branch and bound (see ``best_lin``)."""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable

LIN_TOL = 1e-3  # the linear-phase search stops once its best point is proven within 0.1%
FIRST_TOL = 1e-3  # the bisection to the first feasible linear bound: to 0.1%
LIN_EVALS = 8  # at most this many evaluations of f per search (see best_lin)


def best_lin(
    f: Callable[[float], float],
    lo: float,
    hi: float,
    ok: Callable[[float], bool] | None = None,
    max_evals: int | None = None,
    tol: float | None = None,
) -> tuple[float, float]:
    """(argmin, lower bound) of ``f(L) = L + A(L)`` over [lo, hi] where ``A`` is non-increasing (a
    larger linear bound never raises the attention bound) and f is infinite below the first feasible
    L (``ok(L)`` false). Deterministic.

    A bisection on the cheap feasibility test ``ok(L)`` (default: f(L) finite) finds the first feasible
    L; then branch and bound on intervals: on [x, y] every f(L) >= x + A(y), so the interval with the
    smallest such bound is halved until the best value found is within ``tol`` of the smallest bound
    (or ``max_evals`` evaluations). The returned bound is the smallest bound of the intervals left
    (the best value when none is left): no L in [lo, hi] has a smaller f. When A is flat (the
    attention phase does not need a larger linear bound, the common case) the two ends prove the
    first feasible L optimal: 2 evaluations.
    """
    max_evals = LIN_EVALS if max_evals is None else max_evals
    tol = LIN_TOL if tol is None else tol
    ok = ok or (lambda L: math.isfinite(f(L)))
    if hi <= lo or not ok(hi):
        return hi, f(hi)
    gap = None  # (a, first): L in (a, first) was not tested; f(L) >= a + A(first) there
    if not ok(lo):
        a, b = lo, hi
        for _ in range(40):
            mid = (a + b) / 2
            if ok(mid):
                b = mid
            else:
                a = mid
            if b - a <= FIRST_TOL * b:
                break
        lo, gap = b, a
    val = {lo: f(lo), hi: f(hi)}
    best = min((lo, hi), key=lambda x: (val[x], x))
    heap = [(lo + val[hi] - hi, lo, hi)]  # (lower bound of f on [x, y], x, y)
    while heap and len(val) < max_evals:
        bound, x, y = heap[0]
        if math.isfinite(val[best]) and val[best] - bound <= tol * val[best]:
            break
        m = (x + y) / 2
        if m in val:  # the interval cannot be halved further
            break
        heapq.heappop(heap)
        val[m] = f(m)
        if (val[m], m) < (val[best], best):
            best = m
        heapq.heappush(heap, (x + val[m] - m, x, m))
        heapq.heappush(heap, (m + val[y] - y, m, y))
    lower = min([val[best]] + [b for b, _, _ in heap])
    if gap is not None:
        lower = min(lower, gap + val[lo] - lo)
    return best, lower
