"""The planner's and cost model's fast paths give exactly the values of their plain formulations.

Layer (a): no processes. Each fast path (per-cluster link tables and vectorised byte matrices of the
head all-to-all, K/V heads passed in, the closed forms split into bound-independent constants and a
per-bound evaluation, group coefficients shared between groupings, the layout check's one-pass
path) is compared with ``==`` (not a tolerance: the planner's decisions compare these
floats, so the fast paths must reproduce them bit for bit) against a plain reference written here from
the formulas, on random inputs. Layers (b) and (c): none (pure functions, no ranks, no GPU).
"""

import math
import random
from collections.abc import Callable

import pytest

from megatron_hexiseq.cluster import cluster_from_dict
from megatron_hexiseq.costmodel import alltoall_time_s, kv_exchange_forward
from megatron_hexiseq.costmodel.estimate import _a2a_layer_s
from megatron_hexiseq.model import get_model
from megatron_hexiseq.planner.arranged_forms import (
    block_consts,
    block_upper,
    final_consts,
    final_range,
    placed_final,
)
from megatron_hexiseq.planner.baselines import baseline_layouts
from megatron_hexiseq.planner.coef import INF, GroupCoef
from megatron_hexiseq.planner.unit_range import (
    _identical_range,
    _identical_time,
    general_range,
    units_range,
)

pytestmark = pytest.mark.usefixtures("pinned_catalog")  # tests/conftest.py

TYPES = ("H100-SXM-80GB", "A100-SXM-80GB", "L40S-48GB")


def _cluster(rng: random.Random, nodes: int = 4):
    return cluster_from_dict(
        {
            "name": "t",
            "nodes": [
                {
                    "name": f"n{i}",
                    "gpu": rng.choice(TYPES),
                    "count": 4,
                    "network_GBps": rng.choice((12.5, 25.0, 50.0)),
                }
                for i in range(nodes)
            ],
        }
    )


def test_a2a_layer_matches_list_formula() -> None:
    rng = random.Random(7)
    model = get_model("gpt-7b")
    for _ in range(30):
        cl = _cluster(rng)
        ranks = tuple(sorted(rng.sample(range(cl.world_size), rng.randint(2, cl.world_size))))
        tok = [rng.randint(1, 1 << 20) for _ in ranks]
        hq = [rng.randint(0, 32) for _ in ranks]
        hkv = [rng.randint(0, 8) for _ in ranks]
        b = rng.choice((1, 2))
        unit = b * model.kv_channels * 2
        q = [[unit * ti * hj for hj in hq] for ti in tok]
        kv = [[unit * ti * hj for hj in hkv] for ti in tok]
        out = [[unit * tj * hi for tj in tok] for hi in hq]
        want = (
            alltoall_time_s(q, ranks, cl)
            + 2 * alltoall_time_s(kv, ranks, cl)
            + alltoall_time_s(out, ranks, cl)
        )
        assert _a2a_layer_s(cl, model, ranks, b, tok, hq, hkv) == want


def test_kv_exchange_with_given_kv_heads_is_the_same() -> None:
    rng = random.Random(3)
    model = get_model("llama3-8b", overrides={"seq_length": 4096})
    cl = _cluster(rng)
    for base in baseline_layouts(cl, model, 4096):
        if base.layout is None:
            continue
        lay = base.layout
        given = kv_exchange_forward(
            lay, cl, model, 1, kv_heads=[lay.kv_heads(r) for r in range(lay.world_size)]
        )
        assert given == kv_exchange_forward(lay, cl, model, 1)


def _closed_range_ref(n, H, z, s, e, c, quad, lin_att, kv_slope, kv_const):
    """The closed form written out in one piece."""
    lo, hi = 0.0, INF
    hmax = -(-H // n)
    for alpha, heads, budget in ((s / n, H / n, z), (0.0, hmax, z - s)):
        qa, qb = heads * quad, alpha + heads * (lin_att + e)
        if budget < 0:
            return None
        root = (
            (-qb + math.sqrt(qb * qb + 4 * qa * budget)) / (2 * qa)
            if qa > 0
            else (budget / qb if qb > 0 else INF)
        )
        hi = min(hi, root)
        m, k0 = alpha + heads * (kv_slope + e), heads * kv_const
        if m > 0:
            hi = min(hi, (budget - k0) / m)
        elif m < 0:
            lo = max(lo, (k0 - budget) / -m)
        elif k0 > budget:
            return None
    return (lo, hi) if lo <= hi + 1.0 else None


def _identical_range_ref(g, z, lin, settle):
    """Stage II's unit range of identical members written out in one piece."""
    n, H, N = g.size, g.heads, g.num_units
    k, a, s, b, c, e, free, mt, mh, cap = g.rows[0]
    if g.band:
        real = _closed_range_ref(
            n, H, z, s, e, c, b / N, 2 * g.start * b / N, 0.0, (g.start + g.kv_extra) * c
        )
    else:
        num, den = g.att_scale(0)
        real = _closed_range_ref(
            n, H, z, s, e, c, 0.0, b * num / den, -c, (g.block_end + g.kv_extra) * c
        )
    if real is None:
        return None
    lo, hi = real
    hi = min(hi, float(min(N, n * cap)))
    if a > 0 and math.isfinite(lin):
        hi = min(hi, n * lin / a)
    hmax = -(-H // n)
    if mt + H * mh > 0:
        hi = min(hi, n * free / (mt + H * mh))
    if mh > 0:
        hi = min(hi, (free - mt) / (hmax * mh))
    lo = max(lo, float(n))
    if not (lo <= hi + 1.0):
        return None
    ilo, ihi = max(n, math.ceil(lo - 1e-9)), min(N, math.floor(hi + 1e-9))
    if ilo > ihi:
        return None
    if not settle:
        return ilo, ihi
    ok = lambda T: _identical_time(g, T, lin) <= z  # noqa: E731
    settled = False
    for _ in range(4):
        if not ok(ihi):
            ihi -= 1
            if ihi < ilo:
                return None
        elif ihi + 1 <= N and ok(ihi + 1):
            ihi += 1
        else:
            settled = True
            break
    for _ in range(4 if settled else 0):
        if not ok(ilo):
            ilo += 1
        elif ilo - 1 >= n and ok(ilo - 1):
            ilo -= 1
        else:
            return ilo, ihi
    return general_range(g, z, lin)


def _placed_group(
    rng: random.Random, n: int, N: int, col: Callable[[int, int], tuple[int, ...]]
) -> GroupCoef:
    """A random group of n members over N units at a random place; ``col(lo, hi)`` draws one
    coefficient column (every member equal, or in classes)."""
    start = rng.randint(0, N // 2)
    return GroupCoef(
        a=col(10**5, 10**8),
        b=col(10**3, 10**7),
        c=col(0, 10**6),
        e=col(0, 10**5),
        free=col(10**9, 10**11),
        mt=col(10**5, 10**8),
        mh=col(0, 10**5),
        heads=rng.choice((8, 32, 40)),
        num_units=N,
        s=col(0, 10**5),
        start=start,
        end=rng.choice((0, rng.randint(start + n, N))),
        band=rng.random() < 0.3,
        kv_extra=rng.randint(0, N // 4),
    )


def test_identical_range_matches_reference() -> None:
    rng = random.Random(5)
    for _ in range(400):
        n, N = rng.choice((1, 2, 4, 8)), rng.randint(64, 4096)
        g = _placed_group(rng, n, N, lambda lo, hi, n=n: (rng.randint(lo, hi),) * n)
        for _ in range(20):
            z, lin = rng.uniform(1e6, 1e12), rng.choice((INF, rng.uniform(1e6, 1e12)))
            for settle in (True, False):
                assert _identical_range(g, z, lin, settle) == _identical_range_ref(
                    g, z, lin, settle
                )


def test_prefix_block_closed_form_matches_reference() -> None:
    # arranged_forms.block_upper: the closed form's upper end for k groups of identical members in a
    # prefix block at P seeing V units (attention b T (2P + k T) / N, visible V + (k - 1) T),
    # capped by memory and the linear bound
    rng = random.Random(11)
    found = empty = 0
    for _ in range(300):
        n, N = rng.choice((1, 2, 4, 8)), rng.randint(64, 4096)
        g = _placed_group(rng, n, N, lambda lo, hi, n=n: (rng.randint(lo, hi),) * n)
        H = g.heads
        _, a, s, b, c, e, free, mt, mh, _ = g.rows[0]
        for _ in range(20):
            k, P, V = rng.randint(1, 4), rng.randint(0, N), rng.randint(0, 2 * N)
            z = rng.choice((rng.uniform(-1e3, 1e6), rng.uniform(1e6, 1e12)))
            lin = rng.choice((INF, rng.uniform(1e6, 1e12)))
            real = _closed_range_ref(n, H, z, s, e, c, b * k / N, 2 * P * b / N, c * (k - 1), V * c)
            want = None
            if real is not None:
                want = real[1]
                if mt + H * mh > 0:
                    want = min(want, n * free / (mt + H * mh))
                if mh > 0:
                    want = min(want, (free - mt) / (-(-H // n) * mh))
                if a > 0 and math.isfinite(lin):
                    want = min(want, n * lin / a)
            got = block_upper(block_consts(g, k, lin), P, V, z)
            assert got == want, (k, P, V, z, lin)
            found += want is not None
            empty += want is None
    assert found > 1000 and empty > 100  # both outcomes were exercised


def test_final_group_range_matches_the_placed_group() -> None:
    # arranged_forms.final_range: the unit range of a final group of identical members placed at p with
    # kv_extra kv, without building the placed group: Stage I's coarse range and the settled one
    rng = random.Random(13)
    hits = 0
    for _ in range(300):
        n, N = rng.choice((1, 2, 4, 8)), rng.randint(64, 4096)
        g = _placed_group(rng, n, N, lambda lo, hi, n=n: (rng.randint(lo, hi),) * n)
        for _ in range(20):
            p, kv = rng.randint(0, N - 1), rng.randint(0, N)
            z, lin = rng.uniform(1e6, 1e12), rng.choice((INF, rng.uniform(1e6, 1e12)))
            placed = g.placed(p, 0, False, kv)
            for settle in (False, True):
                want = _identical_range_ref(placed, z, lin, settle)
                got = final_range(final_consts(g, lin), p, kv, z, lin, settle)
                assert got == want == units_range(placed_final(g, p, kv), z, lin, settle)
                hits += got is not None
    assert hits > 1000
    mixed = _placed_group(rng, 4, 1024, lambda lo, hi: tuple(rng.randint(lo, hi) for _ in range(4)))
    assert final_consts(mixed, INF) is None  # members differ: the general range is used


# ---- the layout check's one-pass path ------------------------------------------------------------
def _raw_layout(**fields):
    """A Layout object with the given fields and no validation (to feed the checks broken layouts)."""
    from megatron_hexiseq.layout import Layout

    lay = object.__new__(Layout)
    for name, value in fields.items():
        object.__setattr__(lay, name, value)
    return lay


def test_layout_one_pass_check_agrees_with_the_named_checks() -> None:
    # _validate trusts _partitions_hold's True: it must never accept what _check_partitions refuses
    # (and a False only costs the slow path, which then names the problem)
    from dataclasses import replace

    from megatron_hexiseq.errors import HexiSeqError
    from megatron_hexiseq.layout import _check_partitions, _partitions_hold, make_layout

    rng = random.Random(11)
    accepted = refused = 0
    for _ in range(400):
        S, H, sizes = (
            rng.randint(4, 30),
            rng.choice((3, 4, 6)),
            [rng.randint(1, 3) for _ in range(3)],
        )
        W = sum(sizes)
        if S < W:
            continue
        cuts = sorted(rng.sample(range(1, S), W - 1))
        bounds = [0, *cuts, S]
        order = list(range(W))
        rng.shuffle(order)
        segments = [[(bounds[order[r]], bounds[order[r] + 1])] for r in range(W)]
        heads = []
        for size in sizes:
            edges = [0, *sorted(rng.sample(range(1, H), size - 1)), H]
            heads += [list(range(edges[i], edges[i + 1])) for i in range(size)]
        lay = make_layout(
            seq_length=S,
            num_attention_heads=H,
            num_query_groups=1,
            group_sizes=sizes,
            segments=segments,
            heads=heads,
        )
        ranks = list(lay.ranks)
        r = rng.randrange(W)
        kind = rng.randrange(9)
        if kind == 0:  # overlap or gap
            s, e = ranks[r].segments[0]
            ranks[r] = replace(ranks[r], segments=((s, e + rng.choice((-1, 1))),))
        elif kind == 1:  # a head dropped or duplicated
            other = rng.randrange(W)
            ranks[r] = replace(
                ranks[r], heads=tuple(sorted({*ranks[r].heads, *ranks[other].heads}))
            )
        elif kind == 2:  # a head outside 0..H-1
            ranks[r] = replace(ranks[r], heads=(*ranks[r].heads, H))
        elif kind == 3:  # unsorted heads
            ranks[r] = replace(ranks[r], heads=tuple(reversed(ranks[r].heads)))
        elif kind == 4:  # a rank without tokens (and maybe heads)
            ranks[r] = replace(ranks[r], segments=(), heads=rng.choice(((), ranks[r].heads)))
        elif kind == 5 and ranks[r].heads:  # a head that equals an integer but is not one
            hs = ranks[r].heads
            ranks[r] = replace(ranks[r], heads=(rng.choice((float, bool))(hs[0]), *hs[1:]))
        elif kind == 5:  # a segment end that is not an integer
            s, e = ranks[r].segments[0]
            ranks[r] = replace(ranks[r], segments=((s, float(e)),))
        elif kind == 6:  # an empty or reversed segment
            s, e = ranks[r].segments[0]
            ranks[r] = replace(ranks[r], segments=((e, s),))
        elif kind == 7:  # segments out of order
            ranks[r] = replace(ranks[r], segments=tuple(reversed(ranks[r].segments + ((S, S),))))
        raw = _raw_layout(
            seq_length=S,
            num_attention_heads=H,
            num_query_groups=1,
            world_size=W,
            groups=lay.groups,
            ranks=tuple(ranks),
        )
        try:
            _check_partitions(raw)
            valid = True
        except HexiSeqError:
            valid = False
        assert _partitions_hold(raw) == valid, (kind, raw.ranks)
        accepted += valid
        refused += not valid
    assert accepted > 50 and refused > 150  # both sides were exercised


def test_group_coefficients_are_built_once_per_kind_and_equal_the_plain_ones() -> None:
    # base_coefs keeps one GroupCoef per (member devices, spans nodes, more than one group) for the
    # life of a surrogate; each equals group_coef built afresh for that grouping
    from megatron_hexiseq.planner.stage1_groups import base_coefs, group_coef, make_grouping
    from megatron_hexiseq.planner.surrogate import build_surrogate
    from megatron_hexiseq.run_config import TrainOptions

    rng = random.Random(5)
    cl = _cluster(rng, nodes=4)
    m = get_model("gpt-7b", overrides={"seq_length": 65536})
    sur = build_surrogate(cl, m, TrainOptions(), 65536)
    node_of = [d.node for d in cl.devices]
    blocks = [list(range(i, i + 4)) for i in range(0, 16, 4)]
    first: dict = {}
    for sizes in ([4, 4, 4, 4], [2, 4, 1, 4], [8, 8, 4, 4], [16, 16, 16, 16], [1, 2, 2, 1]):
        grouping = make_grouping(blocks, sizes, [0, 0, 1, 1] if sizes[0] == 8 else list(range(4)))
        coefs = base_coefs(sur, grouping, node_of)
        for g, c in zip(grouping, coefs):
            spans = len({node_of[r] for r in g}) > 1
            assert c == group_coef(sur, g, len(grouping), spans)
            key = (tuple(sur.devices[r] for r in g), spans, len(grouping) > 1)
            assert first.setdefault(key, c) is c  # the same object in every grouping


def test_longest_prefix_search_from_a_hint_finds_what_the_bisection_finds() -> None:
    # the arranged split's exact test shortens the prefix to the longest that keeps the final
    # block's ranges; started from the last bound's answer it must give the bisection's answer
    from megatron_hexiseq.planner.arranged_split import longest

    rng = random.Random(2)
    for _ in range(3000):
        lo = rng.randint(0, 50)
        hi = lo + rng.randint(1, 300)
        top = rng.randint(lo - 1, hi - 1)  # holds on [lo, top]; top = lo - 1: nowhere
        calls = []

        def holds(x: int, top: int = top, calls: list = calls) -> tuple[int] | None:
            assert lo <= x < hi, (lo, x, hi)
            calls.append(x)
            return (x,) if x <= top else None

        want = None if top < lo else (top, (top,))
        assert longest(holds, lo, hi, None) == want
        near = rng.choice((None, rng.randint(lo - 5, hi + 5), top, top + 1))
        calls.clear()
        assert longest(holds, lo, hi, near) == want
        if near is not None and lo < near < hi and top >= lo:
            # a gallop: about 2 log2 of the distance, never far beyond the bisection
            assert len(calls) <= 2 * math.log2(abs(top - near) + 2) + 3


# ---- unit ranges of groups with unequal members; the attention-bound search -----------------------
def _unequal_group(rng: random.Random) -> GroupCoef:
    """A group of 2-8 members in one or two classes (a memory feedback or a time feedback of another
    grouping makes members of one GPU type unequal), at a random place."""
    n, N = rng.choice((2, 4, 8)), rng.randint(64, 2048)
    split = rng.randint(1, n - 1)

    def col(lo: int, hi: int) -> tuple[int, ...]:
        x, y = rng.randint(lo, hi), rng.randint(lo, hi)
        return (x,) * split + (y,) * (n - split)

    return _placed_group(rng, n, N, col)


def test_unequal_members_range_from_the_slowest_members_start_is_the_exhaustive_one() -> None:
    # general_range starts its two edge bisections inside the range of the group with every member
    # replaced by the slowest (closed form) instead of at the group's fastest unit count (a ternary
    # search): the range must be the set of feasible unit counts, counted one by one
    from megatron_hexiseq.planner.unit_range import feasible, slowest_members

    rng = random.Random(13)
    checked = 0
    for _ in range(150):
        g = _unequal_group(rng)
        slow = slowest_members(g)
        assert len(slow.rows) == 1 and (slow.start, slow.end, slow.band) == (g.start, g.end, g.band)
        for _ in range(4):
            z, lin = rng.uniform(1e6, 1e12), rng.choice((INF, rng.uniform(1e6, 1e12)))
            got = general_range(g, z, lin)
            ok = [T for T in range(g.min_units(), g.max_units() + 1) if feasible(g, T, z, lin)]
            inner = _identical_range(slow, z, lin)
            if inner is not None:  # the slowest-members range lies inside the real one
                assert all(feasible(g, T, z, lin) for T in range(inner[0], inner[1] + 1))
            if not ok:
                assert got is None
                continue
            if ok != list(range(ok[0], ok[-1] + 1)):
                continue  # not an interval (the model's quasi-convexity fails): no claim
            assert got == (ok[0], ok[-1])
            checked += 1
    assert checked > 100


def test_smallest_bound_finds_the_threshold_from_a_bracket_or_from_scratch() -> None:
    # the attention-bound search shared by the mirrored and the arranged split ends with lo failing
    # and hi holding, hi within the tolerance of the threshold, and returns the test's value at hi
    from megatron_hexiseq.planner.stage2_split import smallest_bound

    rng = random.Random(17)
    for _ in range(2000):
        t = 10 ** rng.uniform(3, 12)
        tol = rng.choice((1e-6, 1e-3))
        calls: list[float] = []

        def test(z: float, t: float = t, calls: list = calls) -> tuple[float] | None:
            calls.append(z)
            return (z,) if z >= t else None

        bracket = rng.choice((None, (t * 0.5, t * rng.uniform(0.9, 1.5))))
        hi, (value,) = smallest_bound(test, bracket, lambda: t * rng.uniform(1e-4, 10), tol)
        assert value == hi and t <= hi <= t * (1 + 2 * tol)
        assert all(z < t for z in calls if z < hi)  # every smaller bound tested failed
    assert smallest_bound(lambda z: None, None, lambda: 1e6, 1e-3) is None
    assert smallest_bound(lambda z: None, (1.0, 2.0), lambda: 1e6, 1e-3) is None


def test_identical_members_time_and_heads_agree_at_the_linear_bound() -> None:
    # where the closed-form time of a group of identical members is finite, the continuous head
    # split must exist at that time: the two once tested the linear bound differently (t a > L vs
    # t > L / a) and disagreed by a rounding when L was the group's own lin_floor, so Stage III's
    # rounding got no tokens and plan() raised IndexError (found with LIN_TOL = 3e-3)
    from megatron_hexiseq.planner.stage2_split import lin_floor
    from megatron_hexiseq.planner.unit_range import feasible

    rng = random.Random(19)
    hits = 0
    for _ in range(3000):
        n = rng.choice((1, 2, 4, 8, 16, 40))
        N = rng.randint(n, 8192)
        row = lambda lo, hi, n=n: (rng.randint(lo, hi),) * n  # noqa: E731
        g = GroupCoef(
            a=row(10**5, 10**8),
            b=row(10**3, 10**7),
            c=row(0, 10**6),
            e=row(0, 10**5),
            free=row(10**12, 10**13),
            mt=row(1, 10**3),
            mh=row(0, 10),
            heads=rng.choice((8, 32, 40, 64)),
            num_units=N,
            s=row(0, 10**5),
        )
        T = rng.randint(n, N)
        for lin in (T / n * g.a[0], lin_floor([g], T), T / sum(1.0 / a for a in g.a)):
            z = _identical_time(g, T, lin)
            if math.isfinite(z):
                hits += 1
                assert feasible(g, T, z, lin), (g, T, lin, z)
    assert hits > 1000


def test_estimate_per_rank_columns_equal_the_scalar_formulas() -> None:
    # estimate computes every rank's terms as arrays; each rank's values must be what the scalar
    # formulas give (same IEEE operations, integers for the bytes), as plain Python numbers, and the
    # iteration the slowest linear phase plus the slowest rest
    from megatron_hexiseq.costmodel import estimate
    from megatron_hexiseq.costmodel.formulas import (
        a2a_buffer_bytes_per_token,
        activation_bytes_per_token,
        attention_backward_bytes_per_block_token,
        attention_bytes_per_group_token,
        attention_s_per_pair_head,
        causal_pairs,
        kv_block_bytes_per_token,
        linear_s_per_token,
        static_memory_bytes,
    )
    from megatron_hexiseq.run_config import TrainOptions

    rng = random.Random(23)
    checked = 0
    for _ in range(6):
        cl = _cluster(rng)
        model = get_model(rng.choice(("gpt-7b", "llama3-8b")), overrides={"seq_length": 65536})
        opts = TrainOptions(recompute=rng.random() < 0.5)
        b, L = opts.micro_batch_size, model.num_layers
        passes = 2 if opts.recompute else 1
        for base in baseline_layouts(cl, model, 65536):
            lay = base.layout
            if lay is None:
                continue
            est = estimate(lay, cl, model, opts)
            kv_of = [lay.kv_heads(r) for r in range(lay.world_size)]
            ex = kv_exchange_forward(lay, cl, model, b, kv_heads=kv_of)
            static = static_memory_bytes(model, opts, opts.data_parallel_size * lay.world_size)
            pairs = {
                g.id: causal_pairs(lay.group_segments(g.id), [(0, lay.seq_length)])
                for g in lay.groups
            }
            group_of = {g.id: g for g in lay.groups}
            slowest_linear = slowest_rest = 0.0
            for p, got in zip(lay.ranks, est.per_rank):
                d, r, t = cl.devices[p.rank], p.rank, p.num_tokens
                g = group_of[p.group]
                tok = [lay.ranks[m].num_tokens for m in g.ranks]
                hq = [len(lay.ranks[m].heads) for m in g.ranks]
                hkv = [len(kv_of[m]) for m in g.ranks]
                a2a = (passes + 1) * L * _a2a_layer_s(cl, model, g.ranks, b, tok, hq, hkv)
                if len(g.ranks) > 1:
                    a2a += (
                        (passes + 1)
                        * L
                        * 4
                        * max(cl.devices[m].collective_latency_s for m in g.ranks)
                    )
                linear = t * linear_s_per_token(model, d, opts) + d.step_overhead_s
                att = (
                    pairs[p.group]
                    * len(p.heads)
                    * attention_s_per_pair_head(model, d, opts)
                    * ex.slowdown[r]
                )
                lat = (passes + 2) * L * ex.rounds[r] * d.p2p_latency_s
                kv_s = (passes + 2) * ex.comm_s[r] + lat
                kv_exp = (passes + 2) * ex.exposed_s[r] + lat
                mem = (
                    static
                    + b * t * activation_bytes_per_token(model, opts)
                    + b
                    * sum(tok)
                    * attention_bytes_per_group_token(model, opts, len(p.heads), len(kv_of[r]))
                    + b
                    * ex.max_block_tokens[r]
                    * attention_backward_bytes_per_block_token(model, len(p.heads), len(kv_of[r]))
                    + b * t * a2a_buffer_bytes_per_token(model)
                    + 4
                    * b
                    * ex.max_block_tokens[r]
                    * len(kv_of[r])
                    * kv_block_bytes_per_token(model)
                )
                want = {
                    "rank": r,
                    "tokens": t,
                    "heads": len(p.heads),
                    "compute_s": linear + att,
                    "comm_s": a2a + kv_s,
                    "exposed_comm_s": a2a + kv_exp,
                    "time_s": linear + att + (a2a + kv_exp),
                    "memory_bytes": mem,
                    "capacity_bytes": int(opts.capacity_fraction * d.memory_bytes),
                }
                for k, v in want.items():
                    assert getattr(got, k) == v and type(getattr(got, k)) is type(v), (k, v)
                assert (
                    got.breakdown["linear_s"] == linear and got.breakdown["kv_exposed_s"] == kv_exp
                )
                slowest_linear = max(slowest_linear, linear)
                slowest_rest = max(slowest_rest, want["time_s"] - linear)
                checked += 1
            assert est.iteration_time_s == slowest_linear + slowest_rest
            assert est.values("time_s") == [x.time_s for x in est.per_rank]
            assert est.values("kv_exchange_s") == [
                x.breakdown["kv_exchange_s"] for x in est.per_rank
            ]
            assert est.feasible == all(x.memory_bytes <= x.capacity_bytes for x in est.per_rank)
    assert checked > 400


def test_memory_floor_matches_the_per_rank_formula() -> None:
    # the memory floor (static + own tokens' activations + the group's attention core per rank) with
    # its per-(heads, K/V heads) memo gives the verdict of the plain per-rank sum, both ways
    from megatron_hexiseq.costmodel.estimate import memory_floor_fits
    from megatron_hexiseq.costmodel.formulas import (
        activation_bytes_per_token,
        attention_bytes_per_group_token,
        static_memory_bytes,
    )
    from megatron_hexiseq.run_config import TrainOptions

    rng = random.Random(29)
    verdicts = []
    for _ in range(8):
        cl = _cluster(rng)
        seq = rng.choice((65536, 1 << 20, 1 << 22))
        model = get_model(rng.choice(("gpt-7b", "llama3-8b")), overrides={"seq_length": seq})
        for opts in (TrainOptions(), TrainOptions(recompute=True)):
            b = opts.micro_batch_size
            static = static_memory_bytes(model, opts, opts.data_parallel_size * cl.world_size)
            act = activation_bytes_per_token(model, opts)
            for base in baseline_layouts(cl, model, seq):
                lay = base.layout
                if lay is None:
                    continue
                want = all(
                    static
                    + b * p.num_tokens * act
                    + b
                    * lay.group_num_tokens(p.group)
                    * attention_bytes_per_group_token(
                        model, opts, len(p.heads), len(lay.kv_heads(p.rank))
                    )
                    <= int(opts.capacity_fraction * cl.devices[p.rank].memory_bytes)
                    for p in lay.ranks
                )
                assert memory_floor_fits(lay, cl, model, opts) == want
                verdicts.append(want)
    assert True in verdicts and False in verdicts


def test_split_of_groups_in_any_order_is_the_direct_search_in_that_order() -> None:
    # split_sequence searches a multiset of groups once (canonical order, cached) and hands the units
    # back in the caller's order; that must be exactly the uncached search in the caller's order,
    # ties between classes included (classes differing only in ample free memory tie on their room)
    from megatron_hexiseq.planner.stage2_split import _split_search, split_sequence

    rng = random.Random(41)
    checked = ties = 0
    for _ in range(60):
        N, heads = rng.randint(64, 1024), rng.choice((8, 32))
        n = rng.choice((1, 2, 4))
        base = dict(
            a=(rng.randint(10**5, 10**7),) * n,
            b=(rng.randint(10**3, 10**6),) * n,
            c=(rng.randint(0, 10**5),) * n,
            e=(rng.randint(0, 10**4),) * n,
            mt=(rng.randint(10**4, 10**6),) * n,
            mh=(0,) * n,
            heads=heads,
            num_units=N,
        )
        classes = [
            GroupCoef(free=(10**15 + i,) * n, **base)
            if rng.random() < 0.5
            else GroupCoef(free=(10**15,) * n, **{**base, "b": (rng.randint(10**3, 10**6),) * n})
            for i in range(rng.randint(2, 4))
        ]
        groups = [g for g in classes for _ in range(rng.randint(1, 3))]
        if len(groups) * n > N:
            continue
        ties += len({(g.b, g.a) for g in classes}) < len(set(classes))
        for _ in range(4):
            rng.shuffle(groups)
            assert split_sequence(list(groups), N) == _split_search(list(groups), N, None)
            checked += 1
    assert checked > 150 and ties > 10


def test_make_layout_rank_plans_equal_the_dataclass_ones() -> None:
    # make_layout fills each RankPlan's fields directly (the planner builds ~30 layouts per plan):
    # the objects must be what RankPlan(...) builds, every field set, ints converted
    from dataclasses import fields

    import numpy as np

    from megatron_hexiseq.layout import RankPlan, make_layout

    segments = [[(0, 3), (np.int64(9), 12)], [(np.int32(3), np.int64(6))], [(6, 9)]]
    heads = [[0], [np.int64(1)], [0, 1]]
    lay = make_layout(
        seq_length=12,
        num_attention_heads=2,
        num_query_groups=1,
        group_sizes=[2, 1],
        segments=segments,
        heads=heads,
        hosts=["a", "a", "b"],
        gpus=["G", "G", "G"],
    )
    names = {f.name for f in fields(RankPlan)}
    for r, plan in enumerate(lay.ranks):
        want = RankPlan(
            rank=r,
            host=["a", "a", "b"][r],
            gpu="G",
            group=0 if r < 2 else 1,
            segments=tuple((int(s), int(e)) for s, e in segments[r]),
            heads=tuple(int(h) for h in heads[r]),
        )
        assert plan == want and set(vars(plan)) == names
        assert all(type(x) is int for seg in plan.segments for x in seg)
        assert all(type(h) is int for h in plan.heads)
