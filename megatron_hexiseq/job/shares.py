"""Integer shares of a global batch over domains: the exact min-max.

Domain ``d`` runs a micro-batch in ``t_d`` seconds and waits ``x_d`` more once per step (its exposed
gradient reduction); with ``m_d >= 1`` micro-batches it is busy ``m_d t_d + x_d``. For ``n``
micro-batches per step the shares minimise the busiest domain:

    min over (m_d >= 1, sum m_d = n) of max_d (m_d t_d + x_d)

:func:`min_max_shares` starts every domain at one micro-batch and gives each next one to the domain
whose busy time after taking it is least. That is optimal for any non-decreasing per-domain cost
(the greedy of separable min-max resource allocation; Ibaraki & Katoh, "Resource Allocation
Problems", 1988, ch. 4): after each step the greedy's maximum is the least possible maximum of its
total, by exchange. ``tests/test_job_shares.py`` checks it against every composition on small cases.

:func:`best_combination` chooses one option per *slot* (a slot: some nodes of the cluster; an
option: how they are cut into domains) and the shares together, exactly: for a step length ``T`` a
domain fits ``floor((T - x_d) / t_d)`` micro-batches, an option the sum over its domains (none
below ``max (t_d + x_d)``: every domain runs at least one), and the choice fits ``n`` when, with at
most ``n`` domains in all, the options' capacities reach ``n`` (a small knapsack over slots). The
least such ``T`` is one of the values ``x_d + m t_d``: a binary search over them.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from megatron_hexiseq.errors import HexiSeqError

EPS = 1e-9  # relative slack when a step length is compared with a domain's finish times


class DomainTime(NamedTuple):
    """What the shares see of a domain: seconds per micro-batch and once per step."""

    micro_batch_s: float
    offset_s: float


def busy_s(domains: Sequence[DomainTime], shares: Sequence[int]) -> float:
    """The busiest domain's ``m_d t_d + x_d``."""
    return max(m * d.micro_batch_s + d.offset_s for d, m in zip(domains, shares))


def min_max_shares(domains: Sequence[DomainTime], n: int) -> tuple[int, ...]:
    """The shares (each >= 1, summing to ``n``) that minimise the busiest domain (module
    docstring); ties go to the lower index. An error when ``n`` < the number of domains."""
    if n < len(domains):
        raise HexiSeqError(
            f"{n} micro-batches cannot give each of {len(domains)} domains one; "
            "use fewer domains or a larger global batch"
        )
    shares = [1] * len(domains)
    heap = [(2 * d.micro_batch_s + d.offset_s, i) for i, d in enumerate(domains)]
    heapq.heapify(heap)
    for _ in range(n - len(domains)):
        _, i = heapq.heappop(heap)
        shares[i] += 1
        d = domains[i]
        heapq.heappush(heap, ((shares[i] + 1) * d.micro_batch_s + d.offset_s, i))
    return tuple(shares)


def equal_shares(count: int, n: int) -> tuple[int, ...] | None:
    """``n / count`` each (stock Megatron: every data-parallel replica takes the same number of
    micro-batches), or None when ``count`` does not divide ``n``."""
    return (n // count,) * count if count and n % count == 0 else None


class Choice(NamedTuple):
    """:func:`best_combination`'s answer: an option per slot and the busiest domain's time."""

    options: tuple[int, ...]
    busy_s: float


def _capacity(option: Sequence[DomainTime], T: float) -> float:
    """Micro-batches ``option``'s domains fit in ``T`` seconds (-inf if one cannot run one)."""
    total = 0
    for d in option:
        m = int(np.floor((T - d.offset_s) / d.micro_batch_s * (1 + EPS) + EPS))
        if m < 1:
            return -np.inf
        total += m
    return total


def best_combination(slots: Sequence[Sequence[Sequence[DomainTime]]], n: int) -> Choice | None:
    """One option per slot, minimising the busiest domain of the min-max shares of ``n``
    micro-batches over all chosen domains (module docstring); None when no choice gives every
    domain a micro-batch. ``slots[s][o]``: the domains of option ``o`` of slot ``s``."""
    slots = [[list(o) for o in slot] for slot in slots]
    if not slots or any(not slot for slot in slots):
        return None
    pairs = sorted({(d.micro_batch_s, d.offset_s) for slot in slots for o in slot for d in o})
    m = np.arange(1, n + 1, dtype=np.float64)
    candidates = np.unique(np.concatenate([x + m * t for t, x in pairs]))

    def table(T: float) -> tuple[np.ndarray, list[np.ndarray]]:
        """best[j]: the most micro-batches with ``j`` domains; per slot, the option taken."""
        best = np.full(n + 1, -np.inf)
        best[0] = 0.0
        picks = []
        for slot in slots:
            new = np.full(n + 1, -np.inf)
            pick = np.full(n + 1, -1)
            for o, option in enumerate(slot):
                k = len(option)
                cap = _capacity(option, T)
                if k > n or cap == -np.inf:
                    continue
                cand = np.full(n + 1, -np.inf)
                cand[k:] = best[: n + 1 - k] + cap
                better = cand > new
                new[better], pick[better] = cand[better], o
            best = new
            picks.append(pick)
        return best, picks

    def fits(T: float) -> bool:
        return bool(table(T)[0].max() >= n)

    lo, hi = 0, len(candidates) - 1
    if not fits(candidates[hi]):
        return None
    while lo < hi:
        mid = (lo + hi) // 2
        if fits(candidates[mid]):
            hi = mid
        else:
            lo = mid + 1
    T = float(candidates[lo])
    best, picks = table(T)
    j = int(np.argmax(best >= n))  # the fewest domains that reach n
    chosen = []
    for s in range(len(slots) - 1, -1, -1):
        o = int(picks[s][j])
        chosen.append(o)
        j -= len(slots[s][o])
    options = tuple(reversed(chosen))
    domains = [d for s, o in enumerate(options) for d in slots[s][o]]
    return Choice(options, busy_s(domains, min_max_shares(domains, n)))


def best_equal_combination(
    slots: Sequence[Sequence[Sequence[DomainTime]]], n: int
) -> Choice | None:
    """:func:`best_combination` when every domain must take the same number of micro-batches
    (Megatron-FSDP: every rank joins each micro-batch's collectives): for every count ``D`` of
    domains dividing ``n``, the choice of one option per slot with ``D`` domains in all that
    minimises the busiest ``(n / D) t_d + x_d`` (a knapsack over the slots on exactly ``D``
    domains), then the best ``D``. None when no choice has a number of domains dividing ``n``."""
    slots = [[list(o) for o in slot] for slot in slots]
    if not slots or any(not slot for slot in slots):
        return None
    best: Choice | None = None
    for D in (d for d in range(1, n + 1) if n % d == 0):
        m = n // D
        worst = np.full(D + 1, np.inf)  # worst[j]: the least busiest domain with j domains
        worst[0] = 0.0
        picks = []
        for slot in slots:
            new, pick = np.full(D + 1, np.inf), np.full(D + 1, -1)
            for o, option in enumerate(slot):
                k = len(option)
                if k > D:
                    continue
                busy = max(m * d.micro_batch_s + d.offset_s for d in option)
                cand = np.full(D + 1, np.inf)
                cand[k:] = np.maximum(worst[: D + 1 - k], busy)
                better = cand < new
                new[better], pick[better] = cand[better], o
            worst = new
            picks.append(pick)
        if not np.isfinite(worst[D]) or (best is not None and worst[D] >= best.busy_s):
            continue
        j, chosen = D, []
        for s in range(len(slots) - 1, -1, -1):
            o = int(picks[s][j])
            chosen.append(o)
            j -= len(slots[s][o])
        best = Choice(tuple(reversed(chosen)), float(worst[D]))
    return best
