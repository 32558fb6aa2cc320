"""Global-batch scheduling: the integer scheduler, the global planner, the whole-cluster schemes and
``varlen --global-batch-tokens`` / ``--job``.

Layer (a) only (no processes). The scheduler on hand-built integer tables gives the bins worked out
by hand (earliest finish, capacity, loader order inside a bin, small bins filled), is a pure
function of its integers (a table one attosecond off can change the bins; equal tables give equal
digests), and refuses a unit no domain can hold in one line. On a small mixed cluster every unit of
the global batch lands in exactly one bin, every bin's layout covers its tokens on its domain's
structure, and faster domains take more tokens. ``compare_global`` reports every scheme with
per-rank records naming domain and group; the CLI writes them, with a job file too.
"""

from __future__ import annotations

import json
import random
from collections import namedtuple
from dataclasses import replace

import pytest

from megatron_hexiseq.cli import main
from megatron_hexiseq.cluster import cluster_from_dict, cluster_to_dict
from megatron_hexiseq.errors import HexiSeqError
from megatron_hexiseq.job import Domain as JobDomain
from megatron_hexiseq.job import JobPlan
from megatron_hexiseq.model import get_model
from megatron_hexiseq.run_config import TrainOptions, options_record
from megatron_hexiseq.varlen import global_batch
from megatron_hexiseq.varlen.domain_choice import (
    TOKENS_PER_GPU,
    domains_from_job,
    other_modes,
    plan_domains,
    regime,
)
from megatron_hexiseq.varlen.domains import (
    Domain,
    cp_groups,
    domain_options,
    replica_blocks,
    speed_shares,
    sub_cluster,
    typed_blocks,
)
from megatron_hexiseq.varlen.global_batch import (
    ATTO,
    DomainCosts,
    LongUnit,
    as_of,
    schedule_global,
)
from megatron_hexiseq.varlen.global_compare import (
    APPENDIX,
    SCHEMES,
    _count_variants,
    compare_global,
    modes_for,
)
from megatron_hexiseq.varlen.global_planner import PROBE_FILLERS, PROBE_GRAIN_AS, GlobalPlanner
from megatron_hexiseq.varlen.global_schemes import (
    MicroBatchRun,
    Pricer,
    hybrid_cp_step,
    lockstep_s,
    thd_step,
)
from megatron_hexiseq.varlen.packing import heavy_tailed_lengths, pack_batches

MIX = cluster_from_dict(
    {
        "name": "mix8",
        "nodes": [
            {"name": "a0", "gpu": "A100-SXM-80GB", "count": 2, "network_GBps": 25},
            {"name": "h0", "gpu": "H100-SXM-80GB", "count": 2, "network_GBps": 25},
            {"name": "a1", "gpu": "A100-SXM-80GB", "count": 2, "network_GBps": 25},
            {"name": "h1", "gpu": "H100-SXM-80GB", "count": 2, "network_GBps": 25},
        ],
    }
)
S = 8192


# ---- the integer scheduler ---------------------------------------------------------------------
def test_schedule_by_hand() -> None:
    fast = DomainCosts(token_as=1, pair_as=0, batch_as=0, capacity=100)
    slow = DomainCosts(token_as=2, pair_as=0, batch_as=0, capacity=100)
    # units (loader order): 30, 20, 10, 10, 10; longest first, each to the earliest finish:
    # 30 -> fast (30 vs 60); 20 -> slow (50 vs 40); 10 -> fast (40 vs 60);
    # 10 -> fast (50 vs 60); 10 -> fast? (60 vs 60: tie -> lower index = fast)
    sched = schedule_global([10, 30, 10, 20, 10], [fast, slow], [1, 1])
    assert sched.bins == ((tuple(sorted((1, 0, 2, 4))),), ((3,),))
    assert sched.predicted_as == (60, 40)
    # two micro-batches: inside the domain the cheaper bin with room; bins keep loader order
    sched = schedule_global([10, 30, 10, 20, 10], [fast], [2])
    assert sched.bins == (((1, 2), (0, 3, 4)),)
    assert [sum([10, 30, 10, 20, 10][u] for u in b) for b in sched.bins[0]] == [40, 40]


def test_schedule_respects_capacity_and_pairs() -> None:
    # pairs dominate: a 9-token unit costs 45 pairs, nine 1-token units cost 9
    a = DomainCosts(token_as=0, pair_as=1, batch_as=0, capacity=10)
    sched = schedule_global([9] + [1] * 9, [a, a], [1, 1])
    assert sched.bins == (((0,),), ((1, 2, 3, 4, 5, 6, 7, 8, 9),))
    with pytest.raises(HexiSeqError, match="fits no domain's micro-batch"):
        schedule_global([11, 1], [a, a], [1, 1])
    with pytest.raises(HexiSeqError, match="does not fit the domains' memory"):
        schedule_global([6, 6, 6, 6, 6], [a, a], [1, 1])


def test_schedule_is_a_function_of_integers() -> None:
    lengths = heavy_tailed_lengths(200, seed=3, median=300)
    t = [DomainCosts(7, 3, 50, 10**6), DomainCosts(11, 5, 50, 10**6), DomainCosts(7, 3, 50, 10**6)]
    a = schedule_global(lengths, t, [2, 1, 2])
    b = schedule_global(list(lengths), list(t), [2, 1, 2])
    assert a == b and a.digest() == b.digest()
    # one attosecond more per pair on one domain: still a valid schedule, another digest
    c = schedule_global(lengths, [t[0], t[1]._replace(pair_as=4), t[2]], [2, 1, 2])
    assert sorted(u for d in c.bins for bb in d for u in bb) == list(range(len(lengths)))
    assert c.digest() != a.digest()
    assert all(isinstance(x, int) for x in a.predicted_as)


def test_small_bins_take_units_from_the_fullest_bin() -> None:
    # pairs only: the 8-token unit (36 pairs) fills bin 0; the six 3-token units (6 pairs each) go
    # to bin 1 until it costs as much: bin 0 has 8 tokens, fewer than its 9 ranks, and takes the
    # smallest unit (the first 3, unit 1) of bin 1
    pairs = DomainCosts(token_as=0, pair_as=1, batch_as=0, capacity=100)
    lengths = [8, 3, 3, 3, 3, 3, 3]
    sched = schedule_global(lengths, [pairs], [2], min_tokens=[9])
    assert sched.bins == (((0, 1), (2, 3, 4, 5, 6)),)
    assert sched.tokens(lengths) == [[11, 15]]


def test_long_unit_table_by_hand() -> None:
    t = DomainCosts(1, 0, 5, 100, floor_as=30, long_unit=(LongUnit(10, 4), LongUnit(20, 10)))
    # 0 at 0 tokens, linear to the first point, between points, the last slope beyond
    assert [t.long_unit_as(x) for x in (0, 5, 10, 15, 20, 30)] == [0, 2, 4, 7, 10, 16]
    # a micro-batch: fixed 5 + the larger of the floor and its work plus its longest unit's
    assert t.bin_as([3, 2]) == 5 + 30  # work 5 + long 1 < floor 30
    assert t.bin_as([20, 15]) == 5 + 35 + 10
    one = DomainCosts(1, 0, 0, 100, long_unit=(LongUnit(8, 4),))
    assert [one.long_unit_as(x) for x in (4, 8, 16)] == [2, 4, 8]


def test_schedule_fills_micro_batches_up_to_their_floor() -> None:
    # every micro-batch lasts at least 10 (e.g. Megatron-FSDP's gathers): the units go where
    # they cost nothing; the finish ties at 20 on both domains, the lower index wins each tie
    floor = DomainCosts(token_as=1, pair_as=0, batch_as=0, capacity=100, floor_as=10)
    sched = schedule_global([6, 4, 3, 3], [floor, floor], [1, 1])
    assert sched.bins == (((0, 1),), ((2, 3),))
    assert sched.predicted_as == (10, 10)
    # without the floor the same units balance by work: 6 + 3 | 4 + 3
    plain = floor._replace(floor_as=0)
    assert schedule_global([6, 4, 3, 3], [plain, plain], [1, 1]).predicted_as == (9, 7)


def test_a_domains_micro_batches_come_costliest_first() -> None:
    # floor 10: 8 -> bin 0; 6 -> bin 1 (free); 5 -> bin 1 (grows by 1, bin 0 by 3): bin 1 costs
    # 11, bin 0 10; under Megatron-FSDP micro-batch k of every domain runs in lockstep, so each
    # domain's costliest comes first
    t = DomainCosts(token_as=1, pair_as=0, batch_as=0, capacity=100, floor_as=10)
    assert schedule_global([8, 6, 5], [t], [2]).bins == (((1, 2), (0,)),)


def test_lockstep_repacks_each_domain_against_the_slots() -> None:
    # balanced by domain totals: 10 | 4 and 6 | 5 + 3, both 14; costliest first the slots are
    # max(10, 8) + max(4, 6) = 16. In lockstep (Megatron-FSDP) domain 1 fills its first
    # micro-batch up to slot 0's level (10, set by domain 0's 10-token unit): 6 + 3 | 5, and
    # the slots cost 10 + 5 = 15; domain totals and every unit's domain unchanged
    t = DomainCosts(token_as=1, pair_as=0, batch_as=0, capacity=100)
    lengths = [10, 6, 5, 4, 3]
    free = schedule_global(lengths, [t, t], [2, 2])
    assert free.tokens(lengths) == [[10, 4], [8, 6]]
    step = schedule_global(lengths, [t, t], [2, 2], lockstep=True)
    assert step.bins == (((0,), (3,)), ((1, 4), (2,)))
    assert step.tokens(lengths) == [[10, 4], [9, 5]]
    slots = [max(x) for x in zip(*step.tokens(lengths))]
    assert sum(slots) == 15 < sum(max(x) for x in zip(*free.tokens(lengths)))


def test_lockstep_never_raises_a_slot() -> None:
    # generated steps on mixed tables (floors, long units, fill): by the tables, the lockstep
    # step (sum over slots of the costliest bin) is never above the schedule's without the
    # re-packing, every unit is placed once, and somewhere it is lower
    rng = random.Random(11)
    lower = 0
    for trial in range(40):
        lengths = heavy_tailed_lengths(rng.randrange(20, 120), seed=trial, median=300)
        tables = [
            DomainCosts(
                rng.randrange(1, 9), rng.randrange(0, 3), 5, 10**5, floor_as=rng.randrange(0, 900),
                long_unit=(LongUnit(400, rng.randrange(0, 300)), LongUnit(4000, rng.randrange(300, 9000))),
            )
            for _ in range(rng.randrange(2, 5))
        ]  # fmt: skip
        m = [rng.randrange(2, 5)] * len(tables)

        def slots(sched) -> int:
            return sum(
                max(row)
                for row in zip(
                    *[
                        sorted((t.bin_as([lengths[u] for u in b]) for b in d), reverse=True)
                        for t, d in zip(tables, sched.bins)
                    ]
                )
            )

        free = schedule_global(lengths, tables, m)
        step = schedule_global(lengths, tables, m, lockstep=True)
        assert sorted(u for d in step.bins for b in d for u in b) == list(range(len(lengths)))
        assert slots(step) <= slots(free)
        lower += slots(step) < slots(free)
    assert lower > 0


def test_a_domain_full_in_memory_takes_the_long_unit(monkeypatch) -> None:
    # domain 0 holds 8 tokens and pays 2 per token; domain 1 holds 100 and pays 1; both 1 per
    # pair. Longest first: 6 -> 1 (27 vs 33); 3 -> 0 (12); 3 -> 0 (24); 3 -> 1 (0 has no room:
    # 36); 2 -> 0 (31, full). Domain 0 idles 5 while domain 1 paces at 36: the exchange gives
    # domain 0 the 6 (12 + 21 = 33) for its three short units, domain 1 then runs 11 tokens and
    # 21 pairs (32): the step 36 -> 33; domain 1 offering the 6 back would cost 59 there
    small = DomainCosts(token_as=2, pair_as=1, batch_as=0, capacity=8)
    big = DomainCosts(token_as=1, pair_as=1, batch_as=0, capacity=100)
    lengths = [3, 3, 3, 2, 6]
    sched = schedule_global(lengths, [small, big], [1, 1])
    assert sched.bins == (((4,),), ((0, 1, 2, 3),))
    assert sched.predicted_as == (33, 32)
    monkeypatch.setattr(global_batch, "SWAP_ROUNDS", 0)
    greedy = schedule_global(lengths, [small, big], [1, 1])
    assert greedy.bins == (((0, 1, 3),), ((2, 4),)) and greedy.predicted_as == (31, 36)


def _random_table(rng: random.Random, capacity: int) -> DomainCosts:
    return DomainCosts(
        rng.randrange(1, 9), rng.randrange(0, 3), 5, capacity, floor_as=rng.randrange(0, 900),
        long_unit=(LongUnit(400, rng.randrange(0, 300)), LongUnit(4000, rng.randrange(300, 9000))),
        fill=capacity - capacity // 16, unit_as=rng.randrange(0, 4),
    )  # fmt: skip


def test_an_exchange_is_priced_as_the_rebuilt_bins() -> None:
    # the running sums give the levels the two bins have when rebuilt from their units
    rng = random.Random(5)
    checked = 0
    for trial in range(300):
        lengths = heavy_tailed_lengths(rng.randrange(4, 40), seed=trial, median=300)
        t = [_random_table(rng, rng.randrange(2000, 9000)) for _ in range(2)]
        units = list(range(len(lengths)))
        rng.shuffle(units)
        cut = rng.randrange(1, len(units))
        src = global_batch._Sorted(units[:cut], t[0], lengths)
        dst = global_batch._Sorted(units[cut:], t[1], lengths)
        for u in src.units:
            got = global_batch._exchange(u, src, dst, t[0], t[1], lengths, (1, 1))
            if got is None:
                continue
            moved = dst.units[: got.moved]
            assert all(lengths[j] < lengths[u] for j in moved)
            new_src = [j for j in src.units if j != u] + moved
            new_dst = dst.units[got.moved :] + [u]
            assert got.src_level == t[0].bin_as([lengths[j] for j in new_src]) - t[0].batch_as
            assert got.dst_level == t[1].bin_as([lengths[j] for j in new_dst]) - t[1].batch_as
            for table, b in ((t[0], new_src), (t[1], new_dst)):
                limit = table.fill_tokens if len(b) > 1 else table.capacity
                assert sum(lengths[j] for j in b) <= limit
            checked += 1
    assert checked > 100


@pytest.mark.parametrize("lockstep", [False, True])
def test_exchanges_never_raise_the_step(lockstep: bool, monkeypatch) -> None:
    # generated steps, bins from the greedy pass alone: the exchanges keep every unit once,
    # every bin within its capacity (``fill`` once it holds several units) and its need, never
    # raise the step by the tables (the slowest domain, or the sum over slots), and lower it
    # somewhere
    rng = random.Random(23)
    lower = 0
    for trial in range(40):
        lengths = heavy_tailed_lengths(rng.randrange(20, 120), seed=trial, median=300)
        tables = [
            _random_table(rng, rng.randrange(3000, 20000)) for _ in range(rng.randrange(2, 5))
        ]
        m = [rng.randrange(1, 4)] * len(tables) if lockstep else [
            rng.randrange(1, 4) for _ in tables
        ]  # fmt: skip
        need = [rng.randrange(1, 8) for _ in tables]
        monkeypatch.setattr(global_batch, "SWAP_ROUNDS", 0)
        try:
            greedy = schedule_global(lengths, tables, m, need)
        except HexiSeqError:  # the step does not fit these tables
            continue
        monkeypatch.undo()
        bins = [
            [global_batch._refilled(t, b, lengths) for b in d] for t, d in zip(tables, greedy.bins)
        ]
        fixed = [len(d) * t.batch_as + t.step_as for t, d in zip(tables, bins)]

        def step() -> int:
            profiles = [
                [global_batch._bin_cost(t, b, lengths) for b in d] for t, d in zip(tables, bins)
            ]
            return global_batch._Pace.of(profiles, fixed, lockstep).now

        before = step()
        global_batch._swap_long_units(bins, tables, lengths, need, lockstep)
        assert sorted(u for d in bins for b in d for u in b.units) == list(range(len(lengths)))
        for t, n, d in zip(tables, need, bins):
            for b in d:
                tokens = sum(lengths[u] for u in b.units)
                assert n <= tokens <= (t.fill_tokens if len(b.units) > 1 else t.capacity)
        assert step() <= before
        lower += step() < before
    assert lower > 0


@pytest.mark.parametrize("lockstep", [False, True])
def test_a_schedule_with_exchanges_is_never_slower_by_the_tables(
    lockstep: bool, monkeypatch
) -> None:
    # whole schedules (under lockstep the re-packing, the exchanges, the re-packing again) against
    # the same without exchanges: never a slower step by the tables, somewhere a faster one
    rng = random.Random(31)
    lower = 0
    for trial in range(40):
        lengths = heavy_tailed_lengths(rng.randrange(20, 120), seed=100 + trial, median=300)
        tables = [
            _random_table(rng, rng.randrange(3000, 20000)) for _ in range(rng.randrange(2, 5))
        ]
        m = [rng.randrange(2, 4)] * len(tables)
        try:
            got = schedule_global(lengths, tables, m, lockstep=lockstep)
        except HexiSeqError:
            continue
        monkeypatch.setattr(global_batch, "SWAP_ROUNDS", 0)
        plain = schedule_global(lengths, tables, m, lockstep=lockstep)
        monkeypatch.undo()

        def step(sched) -> int:
            profiles = [
                [t.bin_as([lengths[u] for u in b]) - t.batch_as for b in d]
                for t, d in zip(tables, sched.bins)
            ]
            fixed = [len(d) * t.batch_as + t.step_as for t, d in zip(tables, sched.bins)]
            return global_batch._Pace.of(profiles, fixed, lockstep).now

        assert sorted(u for d in got.bins for b in d for u in b) == list(range(len(lengths)))
        assert step(got) <= step(plain)
        lower += step(got) < step(plain)
    assert lower > 0


def test_schedule_prices_what_a_long_unit_adds() -> None:
    # the 8-token unit adds 8 to its micro-batch: the other domain takes every short unit
    long = DomainCosts(1, 0, 0, 100, long_unit=(LongUnit(7, 0), LongUnit(8, 8)))
    sched = schedule_global([8, 2, 2, 2, 2, 2, 2], [long, long], [1, 1])
    assert sched.bins == (((0,),), ((1, 2, 3, 4, 5, 6),))
    assert sched.predicted_as == (16, 12)
    # by the divided work alone the tokens balance (8 + 2 | 5 x 2), and the long unit's domain,
    # really 18, would end last
    divided = long._replace(long_unit=())
    assert schedule_global([8, 2, 2, 2, 2, 2, 2], [divided, divided], [1, 1]).bins == (
        ((0, 5),),
        ((1, 2, 3, 4, 6),),
    )


def test_a_micro_batch_of_several_units_stops_at_fill() -> None:
    # a first unit may take the whole capacity (one document splits at will); once a micro-batch
    # holds units it may reach `fill` only (whole short documents do not split exactly)
    t = DomainCosts(token_as=1, pair_as=0, batch_as=0, capacity=64)
    assert schedule_global([64, 50, 8, 3], [t, t], [1, 1]).bins == (((0,),), ((1, 2, 3),))
    with pytest.raises(HexiSeqError, match="does not fit the domains' memory"):
        schedule_global([64, 50, 8, 3], [t._replace(fill=60)] * 2, [1, 1])
    assert t._replace(fill=60).room(50, True) == 10 and t._replace(fill=60).room(0, False) == 64


def test_an_empty_micro_batch_takes_a_unit_from_another_domain() -> None:
    # domain 0 takes the 50-token unit in one micro-batch and nothing else is cheaper there: its
    # other micro-batch would run without a token (the runtime refuses it); it takes the
    # smallest unit of the fullest micro-batch that can give one, on domain 1
    t = DomainCosts(token_as=1, pair_as=0, batch_as=0, capacity=100)
    sched = schedule_global([50, 2, 2], [t, t], [2, 1])
    assert sched.bins == (((0,), (1,)), ((2,),))
    assert sched.tokens([50, 2, 2]) == [[50, 2], [2]]
    assert sched.predicted_as == (52, 2)


def test_probes_price_long_documents_and_the_floor(typed) -> None:
    m, docs, doms = typed
    with_probes, without = GlobalPlanner(doms, m), GlobalPlanner(doms, m, probes=False)
    assert all(not c.long_unit and c.floor_as == 0 for c in without.costs)
    for d, c in enumerate(with_probes.costs):
        assert c.long_unit and [p.tokens for p in c.long_unit] == sorted(
            {p.tokens for p in c.long_unit}
        )
        assert all(a.extra_as <= b.extra_as for a, b in zip(c.long_unit, c.long_unit[1:]))
        # each point: the table prices its own probe as the cost model does (to the microsecond
        # grain) where its divided work passes the floor, unless a shorter probe's point was
        # higher (the points never decrease); below the floor, between the two
        top = min(c.capacity, m.seq_length)
        filler = top // PROBE_FILLERS
        tight = 0
        for p in c.long_unit:
            probe = [p.tokens] + [filler] * ((top - p.tokens) // filler)
            priced = as_of(with_probes.price(d, with_probes.plan_lengths(d, probe)))
            work = c.cost_as(sum(probe), sum(x * (x + 1) // 2 for x in probe))
            assert c.batch_as + c.floor_as <= priced + PROBE_GRAIN_AS
            if work >= c.floor_as:
                assert c.bin_as(probe) >= priced - PROBE_GRAIN_AS
                tight += abs(c.bin_as(probe) - priced) <= PROBE_GRAIN_AS
            else:
                assert c.batch_as + c.floor_as <= c.bin_as(probe) <= priced
        assert tight >= 1
    # the schedule's per-domain prediction, with probes, is nearer the priced micro-batches
    units = [x for s in pack_batches(docs, S, 16, 11) for x in s]
    errors = []
    for gp in (with_probes, without):
        sched = gp.schedule(units)
        err = 0.0
        for d, dom in enumerate(doms):
            real = sum(
                gp.price(d, gp.plan_bin(sched, units, d, k)) for k in range(dom.micro_batches)
            )
            err += abs(sched.predicted_as[d] / ATTO - real) / real
        errors.append(err / len(doms))
    assert errors[0] < errors[1], errors


def test_fsdp_micro_batches_run_in_lockstep() -> None:
    # micro-batch k of every domain joins the same gathers: the slowest of each k sets the pace
    Est = namedtuple("Est", "iteration_time_s")
    runs = [
        MicroBatchRun(d, k, (), None, (), Est(t))  # type: ignore[arg-type]
        for d, k, t in ((0, 0, 3.0), (0, 1, 1.0), (1, 0, 1.0), (1, 1, 2.5))
    ]
    assert lockstep_s(runs, 2) == 3.0 + 2.5  # not max(3 + 1, 1 + 2.5) = 4
    with pytest.raises(HexiSeqError, match="same count"):
        lockstep_s(runs[:3], 2)


# ---- domains -------------------------------------------------------------------------------------
def test_domain_blocks_and_sub_clusters() -> None:
    assert replica_blocks(MIX, 2) == [[2, 3, 0, 1], [6, 7, 4, 5]]  # H100s first (canonical)
    assert replica_blocks(MIX, 3) is None
    assert typed_blocks(MIX, 2) == [[2, 3], [6, 7], [0, 1], [4, 5]]
    assert cp_groups(MIX, 4) == [[2, 3, 6, 7], [0, 1, 4, 5]]
    sub = sub_cluster(MIX, [6, 2, 3])
    assert [d.index for d in sub.devices] == [0, 1, 2]
    assert [d.node for d in sub.devices] == ["h1", "h0", "h0"]
    assert {n.name: n.count for n in sub.nodes} == {"h1": 1, "h0": 2}
    assert speed_shares(10, [2.0, 1.0, 1.0]) == [5, 3, 2]
    with pytest.raises(HexiSeqError, match="cannot give each"):
        speed_shares(2, [1.0, 1.0, 1.0])


@pytest.fixture(scope="module")
def typed():
    m = get_model("gpt-tiny", overrides={"seq_length": S})
    docs = heavy_tailed_lengths(3000, seed=5, median=700)
    doms = plan_domains(MIX, m, typed_blocks(MIX, 2), S, 16, docs, time_limit_s=20)
    return m, docs, doms


def test_other_modes_reprice_the_planned_domains(typed) -> None:
    # domains planned in one mode come back in every other one where each micro-batch still holds
    # a token per GPU (gpt-tiny: all), in the order of the modes, with their counts: equal under
    # Megatron-FSDP (lockstep), by speed otherwise; flagged lighter when they come before it
    m, docs, doms = typed
    assert {(d.options.memory_mode, d.options.recompute) for d in doms} == {
        ("distributed_optimizer", False)
    }
    got = other_modes(doms, m, 16, docs, S)
    assert [(v.suffix, v.lighter) for v in got] == [
        ("+mode:fsdp", False),
        ("+mode:distributed_optimizer+recompute", False),
        ("+mode:fsdp+recompute", False),
    ]
    heavy = [
        replace(d, options=replace(d.options, memory_mode="fsdp", recompute=True)) for d in doms
    ]
    got = other_modes(heavy, m, 16, docs, S)
    assert [(v.suffix, v.lighter) for v in got] == [
        ("+mode:distributed_optimizer", True),
        ("+mode:fsdp", True),
        ("+mode:distributed_optimizer+recompute", True),
    ]
    for v in got:
        mode = v.suffix.removeprefix("+mode:")
        assert all(
            (d.options.memory_mode + ("+recompute" if d.options.recompute else "")) == mode
            for d in v.domains
        )
        assert [d.ranks for d in v.domains] == [d.ranks for d in doms]
        counts = [d.micro_batches for d in v.domains]
        assert counts == ([4] * 4 if mode == "fsdp" else [d.micro_batches for d in doms])
        # the scheduler re-packs against the slots where the domains run in lockstep
        assert GlobalPlanner(v.domains, m).lockstep is (mode == "fsdp")


def test_count_variants_hold_the_step(typed) -> None:
    # a candidate's own counts, equal ones, then fewer and fewer while the step's tokens fit the
    # micro-batches; a heavier mode's variant keeps the fewer ones only
    m, docs, doms = typed
    fills = [c.fill_tokens for c in GlobalPlanner(doms, m).costs]
    got = _count_variants("x", doms, 16, m, S)
    names = [n for n, _ in got]
    assert names[:2] == ["x", "x+equal"] and "x+mb/2" in names and "x+equal+mb/2" in names
    for _, variant in got:
        assert sum(d.micro_batches * f for d, f in zip(variant, fills)) >= 16 * S
        assert [d.ranks for d in variant] == [d.ranks for d in doms]
    halves = dict(got)["x+mb/2"]
    assert [d.micro_batches for d in halves] == [-(-d.micro_batches // 2) for d in doms]
    fewer = [n for n in names if "+mb/" in n]
    assert [n for n, _ in _count_variants("x", doms, 16, m, S, own_counts=False)] == fewer
    assert _count_variants("x", doms, 16) == got[:2]  # without the model: no fewer ones
    # a step of more tokens than half the micro-batches hold: none fewer
    most = sum(d.micro_batches * f for d, f in zip(doms, fills)) // S
    assert [n for n, _ in _count_variants("x", doms, most, m, S)][:1] == ["x"]
    assert not [n for n, _ in _count_variants("x", doms, most, m, S) if n.startswith("x+mb/")]


def test_global_planner_places_every_unit_once(typed) -> None:
    m, docs, doms = typed
    counts = [d.micro_batches for d in doms]  # H100 domains first (canonical order), faster
    assert min(counts[:2]) >= max(counts[2:]) and sum(counts) == 16
    gp = GlobalPlanner(doms, m)
    units = [x for s in pack_batches(docs, S, 16, 9) for x in s]
    sched = gp.schedule(units)
    assert sched == gp.schedule(units)
    placed = sorted(u for d in sched.bins for b in d for u in b)
    assert placed == list(range(len(units)))
    tokens = sched.tokens(units)
    per_domain = [sum(t) for t in tokens]
    assert min(per_domain[:2]) > max(per_domain[2:])  # the H100 domains take more tokens
    for d, dom in enumerate(doms):
        for k in range(dom.micro_batches):
            a = gp.plan_bin(sched, units, d, k)
            assert a.layout.seq_length == tokens[d][k]
            assert [r.host for r in a.layout.ranks] == [x.node for x in dom.cluster.devices]
            assert a.doc_lengths == [units[u] for u in sched.bins[d][k]]
            assert all(r.num_tokens >= 1 for r in a.layout.ranks)


# ---- the comparison and the CLI ---------------------------------------------------------------
def test_compare_global_reports_every_scheme(typed) -> None:
    m, docs, _ = typed
    res = compare_global(MIX, m, docs, S, 16 * S, 1, 4, time_limit_s=20)
    assert set(res["schemes"]) == set(SCHEMES) | set(APPENDIX)
    for name, rec in res["schemes"].items():
        assert rec["tokens_per_s"] > 0 and rec["mean_step_s"] > 0, name
    ours = res["schemes"]["hexiseq-global"]
    assert ours["schedule_ms_max"] > 0 and ours["domain_imbalance"] >= 1.0
    assert res["domains"]["hexiseq-global"]["chosen"]
    # Megatron's CP groups and one domain per type are HexiSeq candidates too
    names = [c["name"] for c in res["domains"]["hexiseq-global"]["candidates"]]
    assert any("cp-groups(c=" in n for n in names) and any("per-type" in n for n in names)
    step = res["steps"][0]
    assert sum(len(s) for s in step["samples"]) > 0
    for rec in step["schemes"].values():
        for mb in rec["micro_batches"]:
            ranks = mb["ranks"]
            assert all({"rank", "domain", "group", "segments", "heads"} <= set(r) for r in ranks)
            assert all(0 <= r["rank"] < MIX.world_size for r in ranks)
    # hexiseq-global covers the global batch: every sample's tokens, once
    total = sum(sum(mb["doc_lengths"]) for mb in step["schemes"]["hexiseq-global"]["micro_batches"])
    assert total == 16 * S


def test_regime_widens_only_where_no_cp_size_fits() -> None:
    lo, hi = TOKENS_PER_GPU
    assert regime(TOKENS_PER_GPU, 131072, 64) == TOKENS_PER_GPU  # the suite's cases: unchanged
    assert regime(TOKENS_PER_GPU, lo, 4) == TOKENS_PER_GPU  # one GPU at the lower bound
    # the CPU testbed's 2K samples: every CP size, from a sample over all GPUs to one on one
    assert regime(TOKENS_PER_GPU, 2048, 4) == (512, 2048)
    # a sample longer than the upper bound over every GPU: the same
    assert regime(TOKENS_PER_GPU, 64 * hi, 32) == (2 * hi, 64 * hi)


def test_compare_global_tries_short_samples(typed) -> None:
    """Samples of 2K (below the 4K-32K regime at every CP size) still get every stock scheme and
    hexiseq-global, not the appendix row alone."""
    m, docs, _ = typed
    short = [max(1, x // 4) for x in docs]
    res = compare_global(MIX, m, short, 2048, 16 * 2048, 1, 4, time_limit_s=20)
    assert set(res["schemes"]) == set(SCHEMES) | set(APPENDIX)
    cps = {r["cp"] for r in res["tried"]["megatron-cp-dp"]}
    assert cps == {1, 2, 4, 8}
    # Megatron's hybrid CP at the widened regime's powers of two: 256 to 2048 tokens per rank
    tried = {r["max_seqlen_per_rank"] for r in res["tried"]["megatron-hybrid-cp"]}
    assert tried == {256, 512, 1024, 2048}


def test_varlen_global_cli(typed, tmp_path, capsys) -> None:
    _, docs, _ = typed
    spec = tmp_path / "c.yaml"
    spec.write_text(
        "name: mix8\nnodes:\n"
        + "".join(
            f"  - {{name: {n}, gpu: {g}, count: 2, network_GBps: 25}}\n"
            for n, g in (("a0", "A100-SXM-80GB"), ("h0", "H100-SXM-80GB"))
        )
    )
    lp = tmp_path / "L.json"
    lp.write_text(json.dumps(docs[:1500]))
    out = tmp_path / "out.json"
    args = ["varlen", "--cluster", str(spec), "--model", "gpt-tiny", "--doc-lengths", str(lp),
            "--tokens-per-batch", str(S), "--global-batch-tokens", str(8 * S), "--batches", "1",
            "-o", str(out)]  # fmt: skip
    assert main(args) == 0, capsys.readouterr().err
    data = json.loads(out.read_text())
    assert data["samples_per_step"] == 8 and set(data["schemes"]) >= {"hexiseq-global"}
    printed = capsys.readouterr().out
    assert "hexiseq-global" in printed and "megatron-thd-cp (appendix)" in printed
    assert main([*args, "--plot", str(tmp_path / "p.png")]) == 2
    assert "--plot draws per-micro-batch" in capsys.readouterr().err
    # TP bundles of 2 (one per node here): the same comparison on the bundle problem
    assert main([*args, "--tensor-model-parallel-size", "2"]) == 0, capsys.readouterr().err
    data = json.loads(out.read_text())
    assert data["tensor_model_parallel_size"] == 2 and data["world_size"] == 4
    assert "in TP bundles of 2" in capsys.readouterr().out
    no_global = [a for a in args if a not in ("--global-batch-tokens", str(8 * S))]
    assert main([*no_global, "--tensor-model-parallel-size", "2"]) == 2
    err = capsys.readouterr().err
    assert "add --global-batch-tokens" in err and len(err.strip().splitlines()) == 1


def _job(m, doms) -> JobPlan:
    return JobPlan(
        global_batch=sum(d.micro_batches for d in doms),
        seq_length=S,
        model=m.to_dict(),
        cluster=cluster_to_dict(MIX),
        options=options_record(doms[0].options, []),
        domains=tuple(
            JobDomain(ranks=d.ranks, micro_batches=d.micro_batches, layout=d.structure)
            for d in doms
        ),
    )


def test_job_domains_and_the_cli(typed, tmp_path, capsys) -> None:
    m, docs, doms = typed
    job = _job(m, [d for d in doms])
    got = domains_from_job(job)
    assert [d.ranks for d in got] == [d.ranks for d in doms]
    assert [d.micro_batches for d in got] == [d.micro_batches for d in doms]
    assert got[0].options == domain_options(doms[0].options, MIX, list(range(8)), 2)
    jp = tmp_path / "job.json"
    job.save(jp)
    lp = tmp_path / "L.json"
    lp.write_text(json.dumps(docs[:2000]))
    out = tmp_path / "out.json"
    rc = main(["varlen", "--job", str(jp), "--doc-lengths", str(lp), "--batches", "1",
               "-o", str(out)])  # fmt: skip
    assert rc == 0, capsys.readouterr().err
    data = json.loads(out.read_text())
    assert data["mode"] == "global" and data["domains"]["hexiseq-global"]["chosen"] == "job"
    assert data["global_batch_tokens"] == job.global_batch * S
    assert "hexiseq-global" in capsys.readouterr().out
    # bad input: one line, exit 2, nothing written
    out2 = tmp_path / "o2.json"
    assert main(["varlen", "--job", str(jp), "--doc-lengths", str(lp), "--tokens-per-batch",
                 "4096", "-o", str(out2)]) == 2  # fmt: skip
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "4,096" in err[0] and not out2.exists()


def test_domain_needs_a_micro_batch() -> None:
    sub = sub_cluster(MIX, [0])
    from megatron_hexiseq.varlen.domain_choice import _trivial

    with pytest.raises(HexiSeqError, match="micro_batches must be at least 1"):
        Domain(
            index=0,
            ranks=(0,),
            micro_batches=0,
            structure=_trivial(sub, get_model("gpt-tiny")),
            cluster=sub,
            options=TrainOptions(),
        )


def _cpu_pair(micro_batch_overhead_ms: float) -> object:
    """Two CPU ranks whose profile measured a 20 ms step overhead, of which each micro-batch
    pays ``micro_batch_overhead_ms``."""
    gpu = {
        "bf16_tflops": 0.05,
        "attention_tflops": 0.04,
        "memory_gib": 4.0,
        "nvlink_GBps": 3.0,
        "efficiency": 1.0,
        "step_overhead_ms": 20.0,
        "micro_batch_overhead_ms": micro_batch_overhead_ms,
    }
    return cluster_from_dict(
        {
            "name": "cpu-pair",
            "gpus": {"CPU-a": gpu},
            "nodes": [{"name": "a", "gpu": "CPU-a", "count": 2, "network_GBps": 3.0}],
        }
    )


def test_stock_steps_pay_the_measured_overhead_once_per_step() -> None:
    """``megatron-thd-cp`` prices 8 samples as 8 micro-batches and ``megatron-hybrid-cp`` each
    unit as its own forward and backward: a step pays the measured step overhead once and each
    further micro-batch its per-micro-batch part (when that part is the whole overhead, every
    micro-batch pays all of it: the 20 ms difference per further micro-batch)."""
    m = get_model("gpt-tiny", overrides={"seq_length": 2048})
    samples = [[1024, 1024]] * 8
    units = [1024] * 16
    full, part = (Pricer(_cpu_pair(x), m) for x in (20.0, 0.0))
    modes = modes_for(m)
    a, b = (thd_step(p, samples, modes) for p in (full, part))
    assert a.domain_s[0] - b.domain_s[0] == pytest.approx(7 * 0.020, rel=1e-9)
    a, b = (hybrid_cp_step(p, units, 1024, modes) for p in (full, part))
    # 16 units of 1024 tokens at 1024 per rank: one group, each rank runs 8 one after another
    assert b.config["groups"] == 1
    assert a.domain_s[0] - b.domain_s[0] == pytest.approx(7 * 0.020, rel=1e-9)


def test_compare_global_over_tp_bundles(typed) -> None:
    """``tensor_model_parallel_size`` t: every scheme on TP bundles, compared on the bundle
    problem (one device per bundle, one TP rank's model, options with t): the domains' and the
    stock schemes' options carry t (their TP collectives and activations priced), CP sizes count
    bundles, the record reports the real GPUs; a t that does not split the nodes is one line."""
    from megatron_hexiseq.costmodel.tp import bundle_cluster, rank_model

    m, docs, _ = typed
    t = 2
    res = compare_global(
        MIX, m, docs, S, 16 * S, 1, 4, time_limit_s=20, tensor_model_parallel_size=t
    )
    assert res["tensor_model_parallel_size"] == t and res["world_size"] == MIX.world_size
    assert res["model"] == m.name
    assert set(res["schemes"]) == set(SCHEMES) | set(APPENDIX)
    assert {r["cp"] for r in res["tried"]["megatron-cp-dp"]} <= {1, 2, 4}  # 4 bundles
    assert all(
        0 <= r["rank"] < MIX.world_size // t
        for mb in res["steps"][0]["schemes"]["hexiseq-global"]["micro_batches"]
        for r in mb["ranks"]
    )
    bundles, rank_m = bundle_cluster(MIX, t), rank_model(m, t)
    assert all(o.tensor_model_parallel_size == t for o in modes_for(rank_m, t))
    doms = plan_domains(
        bundles, rank_m, typed_blocks(bundles, 1), S, 16, docs, time_limit_s=20,
        tensor_model_parallel_size=t,
    )  # fmt: skip
    assert doms and all(d.options.tensor_model_parallel_size == t for d in doms)
    with pytest.raises(HexiSeqError, match="does not divide|bundle|tensor-model-parallel-size 3"):
        compare_global(MIX, m, docs, S, 16 * S, 1, 4, time_limit_s=20, tensor_model_parallel_size=3)
