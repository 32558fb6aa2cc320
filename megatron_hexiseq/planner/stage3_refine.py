"""Stage III: per-rank tokens and heads inside one A2A group, with CP-SAT.

Data: the group's members (coefficients ``a_r``, ``beta_r(T)`` in integer ns, memory cap in units,
see ``planner.surrogate``), its token count ``T`` (units, fixed by Stage II) and ``H`` heads.
Variables: ``t[r]`` units, ``h[r]`` heads, ``z`` the group's time. Minimise ``z``.
Seeded with a greedy hint (continuous optimum, largest-remainder rounding), fixed seed, one worker
(deterministic), time-limited; every solver status is handled (a feasible-but-not-proven result
reports its bound and gap; no solution at all falls back to the hint when it is valid).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from ortools.sat.python import cp_model

from megatron_hexiseq.planner.stage2_split import GroupCoef, group_time, max_heads


@dataclass(frozen=True)
class GroupSolution:
    tokens: tuple[int, ...]   # units per member
    heads: tuple[int, ...]
    time_ns: int
    bound_ns: int
    status: str               # OPTIMAL, FEASIBLE, HINT (solver found nothing, greedy kept), INFEASIBLE


def largest_remainder(values: list[float], total: int, caps: list[int] | None = None) -> list[int]:
    """Round non-negative reals to integers summing to ``total`` (respecting ``caps`` when given)."""
    base = [int(v) for v in values]
    if caps:
        base = [min(b, c) for b, c in zip(base, caps)]
    order = sorted(range(len(values)), key=lambda i: (-(values[i] - int(values[i])), i))
    left = total - sum(base)
    while left > 0:
        moved = False
        for i in order:
            if left == 0:
                break
            if caps is None or base[i] < caps[i]:
                base[i] += 1
                left -= 1
                moved = True
        if not moved:
            break
    while left < 0:  # values summed to more than total
        i = max(range(len(base)), key=lambda j: (base[j], -j))
        base[i] -= 1
        left += 1
    return base


def greedy(g: GroupCoef, T: int) -> tuple[list[int], list[int]] | None:
    """Rounded continuous optimum: a feasible integer point (or None when the tokens don't fit)."""
    n = g.size
    if T > sum(g.cap):
        return None
    z = group_time(g, T)
    _, t_cont = max_heads(g, T, z)
    t = largest_remainder(t_cont, T, list(g.cap))
    betas = [g.beta(i, T) for i in range(n)]
    h_cont = [max(0.0, min((z - t[i] * g.a[i]) / betas[i] if betas[i] else 0.0, g.head_mem_cap(i, T, t[i])))
              for i in range(n)]
    s = sum(h_cont) or 1.0
    h = largest_remainder([x * g.heads / s for x in h_cont], g.heads)
    for i in range(n):  # a rank must do something: give an idle rank one head from the largest holder
        if t[i] == 0 and h[i] == 0:
            j = max(range(n), key=lambda k: (h[k], -k))
            if h[j] > 1:
                h[j] -= 1
                h[i] += 1
    return t, h


def _member(g: GroupCoef, i: int) -> tuple:
    return g.a[i], g.b[i], g.c[i], g.e[i], g.free[i], g.mt[i], g.mh[i]


def _identical_runs(g: GroupCoef) -> list[list[int]]:
    """Members with identical coefficients, grouped (each list ascending)."""
    runs: dict[tuple, list[int]] = {}
    for i in range(g.size):
        runs.setdefault(_member(g, i), []).append(i)
    return list(runs.values())


def _fits(g: GroupCoef, T: int, t: list[int], h: list[int]) -> bool:
    return all(t[i] * g.mt[i] + h[i] * T * g.mh[i] <= g.free[i] and t[i] + h[i] >= 1 for i in range(g.size))


def _time(g: GroupCoef, T: int, t: list[int], h: list[int]) -> int:
    return max(t[i] * g.a[i] + h[i] * g.beta(i, T) for i in range(g.size))


@lru_cache(maxsize=100_000)
def refine_group(g: GroupCoef, T: int, time_limit_s: float = 2.0) -> GroupSolution:
    """Optimal (or best found) integer tokens/heads per member for a group holding T units."""
    n, H = g.size, g.heads
    if T > sum(g.cap):
        return GroupSolution((), (), 0, 0, "INFEASIBLE")
    if n == 1:
        t, h = [T], [H]
        if T * g.mt[0] + H * T * g.mh[0] > g.free[0]:
            return GroupSolution((), (), 0, 0, "INFEASIBLE")
        z = _time(g, T, t, h)
        return GroupSolution((T,), (H,), z, z, "OPTIMAL")
    hint = greedy(g, T)
    if hint and not _fits(g, T, *hint):
        hint = None
    betas = [g.beta(i, T) for i in range(n)]
    ub = _time(g, T, *hint) if hint else max(T * max(g.a), 1) + H * max(betas)

    model = cp_model.CpModel()
    # variables: tokens (units) and heads per member, the group time
    t = {i: model.new_int_var(0, min(g.cap[i], T), f"t_{i}") for i in range(n)}
    h = {i: model.new_int_var(0, H, f"h_{i}") for i in range(n)}
    z = model.new_int_var(0, ub, "z")
    # the group's tokens and heads are all placed
    model.add(sum(t.values()) == T)
    model.add(sum(h.values()) == H)
    # every member does something (the layout forbids a rank with neither tokens nor heads)
    for i in range(n):
        model.add(t[i] + h[i] >= 1)
    # z bounds every member's modelled time
    for i in range(n):
        model.add(t[i] * g.a[i] + h[i] * betas[i] <= z)
    # memory: own activations + attention core for the group's tokens and own heads
    for i in range(n):
        model.add(t[i] * g.mt[i] + h[i] * (T * g.mh[i]) <= g.free[i])
    # symmetry: identical members hold non-increasing tokens
    for run in _identical_runs(g):
        for i, j in zip(run, run[1:]):
            model.add(t[i] >= t[j])
    model.minimize(z)
    if hint:
        for i in range(n):
            model.add_hint(t[i], hint[0][i])
            model.add_hint(h[i], hint[1][i])

    solver = cp_model.CpSolver()
    solver.parameters.num_workers = 1
    solver.parameters.random_seed = 0
    solver.parameters.max_time_in_seconds = time_limit_s
    status = solver.solve(model)
    if status in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        z_best, bound = int(solver.objective_value), int(solver.best_objective_bound)
        tv = [solver.value(t[i]) for i in range(n)]
        hv = [solver.value(h[i]) for i in range(n)]
        # phase 2: among solutions as fast as z_best, the most even split between identical members
        # (the max-time optimum is flat; evenness keeps the terms the surrogate leaves out balanced)
        runs = _identical_runs(g)
        if any(len(run) > 1 for run in runs):
            model.add(z <= z_best)
            spread = []
            for k, run in enumerate(runs):
                if len(run) < 2:
                    continue
                for var, name, hi in ((t, "t", T), (h, "h", H)):
                    lo_v = model.new_int_var(0, hi, f"{name}min_{k}")
                    hi_v = model.new_int_var(0, hi, f"{name}max_{k}")
                    model.add_min_equality(lo_v, [var[i] for i in run])
                    model.add_max_equality(hi_v, [var[i] for i in run])
                    spread.append(hi_v - lo_v)
            model.minimize(sum(spread))
            model.clear_hints()
            for i in range(n):
                model.add_hint(t[i], tv[i])
                model.add_hint(h[i], hv[i])
            status2 = solver.solve(model)
            if status2 in (cp_model.OPTIMAL, cp_model.FEASIBLE):
                tv = [solver.value(t[i]) for i in range(n)]
                hv = [solver.value(h[i]) for i in range(n)]
        return GroupSolution(tuple(tv), tuple(hv), _time(g, T, tv, hv), bound,
                             "OPTIMAL" if status == cp_model.OPTIMAL else "FEASIBLE")
    if status == cp_model.INFEASIBLE:
        return GroupSolution((), (), 0, 0, "INFEASIBLE")
    assert status != cp_model.MODEL_INVALID, model.validate()
    # UNKNOWN: time ran out before any solution; keep the valid greedy point
    if hint:
        zt = _time(g, T, *hint)
        return GroupSolution(tuple(hint[0]), tuple(hint[1]), zt, 0, "HINT")
    return GroupSolution((), (), 0, 0, "INFEASIBLE")
