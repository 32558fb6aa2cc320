"""Integer shares of a global batch (``job.shares``): the min-max greedy and the slot search.

Layer (a) only (no processes): the greedy's shares against every composition of small batches
over 1-4 domains (random times and offsets, ties included); the slot search against enumerating
every combination of options with the greedy; refusals and hand-computed cases.
"""

from __future__ import annotations

import itertools
import random

import pytest

from megatron_hexiseq.errors import HexiSeqError
from megatron_hexiseq.job.shares import (
    DomainTime,
    best_combination,
    best_equal_combination,
    busy_s,
    equal_shares,
    min_max_shares,
)


def _compositions(n: int, k: int):
    """Every (m_1..m_k), m_i >= 1, summing to n."""
    for cut in itertools.combinations(range(1, n), k - 1):
        bounds = (0, *cut, n)
        yield tuple(bounds[i + 1] - bounds[i] for i in range(k))


def _brute(domains, n) -> float:
    return min(busy_s(domains, m) for m in _compositions(n, len(domains)))


def test_greedy_by_hand():
    # 1 s and 3 s per micro-batch, 8 micro-batches: 6 + 2 -> max(6, 6) = 6
    d = [DomainTime(1.0, 0.0), DomainTime(3.0, 0.0)]
    assert min_max_shares(d, 8) == (6, 2) and busy_s(d, (6, 2)) == 6.0
    # an offset (exposed gradient reduction) moves a micro-batch to the other domain
    # ((6, 2): max(6 + 3.5, 6) = 9.5; (5, 3): max(8.5, 9) = 9)
    d = [DomainTime(1.0, 3.5), DomainTime(3.0, 0.0)]
    assert min_max_shares(d, 8) == (5, 3) and busy_s(d, (5, 3)) == 9.0
    assert min_max_shares([DomainTime(2.0, 0.0)] * 3, 7) in {(3, 2, 2), (2, 3, 2), (2, 2, 3)}
    with pytest.raises(HexiSeqError, match="cannot give each of 3 domains one"):
        min_max_shares([DomainTime(1.0, 0.0)] * 3, 2)
    assert equal_shares(4, 8) == (2, 2, 2, 2) and equal_shares(3, 8) is None


def test_greedy_is_optimal_against_every_composition():
    rng = random.Random(11)
    for _ in range(400):
        k = rng.randint(1, 4)
        n = rng.randint(k, 11)
        # integer-ish times make ties common
        domains = [
            DomainTime(
                rng.choice([1.0, 2.0, 3.0, rng.uniform(0.5, 4)]),
                rng.choice([0.0, 0.5, rng.uniform(0, 3)]),
            )
            for _ in range(k)
        ]
        shares = min_max_shares(domains, n)
        assert sum(shares) == n and min(shares) >= 1
        assert busy_s(domains, shares) == pytest.approx(_brute(domains, n)), (domains, n)


def test_slot_search_is_the_best_combination():
    rng = random.Random(3)
    for _ in range(150):
        slots = []
        for _ in range(rng.randint(1, 3)):
            options = []
            for _ in range(rng.randint(1, 3)):
                t = rng.choice([1.0, 1.5, rng.uniform(0.5, 3)])
                x = rng.choice([0.0, rng.uniform(0, 1)])
                options.append(
                    [DomainTime(t * rng.choice([1, 1, 2]), x) for _ in range(rng.randint(1, 3))]
                )
            slots.append(options)
        n = rng.randint(1, 12)
        want = None
        for combo in itertools.product(*[range(len(s)) for s in slots]):
            domains = [d for s, o in zip(slots, combo) for d in s[o]]
            if len(domains) <= n:
                b = busy_s(domains, min_max_shares(domains, n))
                want = b if want is None else min(want, b)
        got = best_combination(slots, n)
        if want is None:
            assert got is None
        else:
            assert got is not None and got.busy_s == pytest.approx(want), (slots, n)
            domains = [d for s, o in zip(slots, got.options) for d in s[o]]
            assert busy_s(domains, min_max_shares(domains, n)) == pytest.approx(got.busy_s)


def test_slot_search_refuses_too_many_domains():
    assert best_combination([[[DomainTime(1.0, 0.0)] * 3]], 2) is None
    assert best_combination([], 4) is None
    # the cheaper option has too many domains for 2 micro-batches: the other one is taken
    slots = [[[DomainTime(1.0, 0.0)] * 3, [DomainTime(5.0, 0.0)]]]
    got = best_combination(slots, 2)
    assert got is not None and got.options == (1,) and got.busy_s == 10.0


def test_equal_slot_search_is_the_best_equal_combination():
    # every domain the same number of micro-batches (Megatron-FSDP): against enumerating every
    # combination whose domain count divides n
    rng = random.Random(8)
    for _ in range(150):
        slots = [
            [
                [
                    DomainTime(rng.uniform(0.5, 3), rng.choice([0.0, 0.3]))
                    for _ in range(rng.randint(1, 3))
                ]
                for _ in range(rng.randint(1, 3))
            ]
            for _ in range(rng.randint(1, 3))
        ]
        n = rng.randint(1, 12)
        want = None
        for combo in itertools.product(*[range(len(s)) for s in slots]):
            domains = [d for s, o in zip(slots, combo) for d in s[o]]
            if n % len(domains) == 0:
                b = busy_s(domains, [n // len(domains)] * len(domains))
                want = b if want is None else min(want, b)
        got = best_equal_combination(slots, n)
        if want is None:
            assert got is None
        else:
            assert got is not None and got.busy_s == pytest.approx(want), (slots, n)
            domains = [d for s, o in zip(slots, got.options) for d in s[o]]
            assert n % len(domains) == 0
            assert busy_s(domains, [n // len(domains)] * len(domains)) == pytest.approx(got.busy_s)
