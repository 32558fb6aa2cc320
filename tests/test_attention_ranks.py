"""Layer (b): HexiSeq attention on multi-rank gloo vs the single-process full attention.

Each spawned world runs a batch of cases (layouts x dtype x kernel x comm_chunks); every rank
compares its output and dq/dk/dv shard with ``reference_attention`` on the whole sequence, with
``torch.testing.assert_close`` (float64: 1e-10; float32: 1e-5 relative, against a float64 oracle), and
for bf16/fp16 with the normwise bounds of ``attention.kernel_check`` (derived from the dtype's unit
roundoff; the oracle runs in float64 on the same rounded inputs).
Processes for worlds 2, 3, 4, 8 (20 seeded random layouts, the named cases of those worlds, Megatron's
zig-zag split, two domains on 6 ranks); the named cases of worlds 5 and 6 run in threads under NCCL's
rules (tests/nccl_sim.py), where the broad random test lives too (test_nccl_rules.py).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import pytest
import torch

from megatron_hexiseq.attention import build_hexiseq_groups, hexiseq_attn_func, reference_attention
from megatron_hexiseq.attention.kernel_check import (
    BACKWARD_ROUNDINGS,
    FORWARD_ROUNDINGS,
    normwise_bound,
    normwise_error,
)
from megatron_hexiseq.attention.testing_layouts import random_layout
from megatron_hexiseq.layout import Layout, make_layout, split_evenly, zigzag_segments
from megatron_hexiseq.testbed.spawn import run_ranks

TOL = {torch.float64: dict(rtol=1e-10, atol=1e-10), torch.float32: dict(rtol=1e-5, atol=1e-5)}


@dataclass(frozen=True)
class Case:
    name: str
    layout: Layout
    dtype: torch.dtype = torch.float64
    kernel: str = "reference"
    comm_chunks: int = 1
    batch: int = 2
    head_dim: int = 4
    seed: int = 0
    fp32_grad_wire: bool = False


LOW_PRECISION = (torch.bfloat16, torch.float16)


def _full_inputs(case: Case):
    """Seeded full-sequence q, k, v, dout (float64; already rounded to bf16/fp16 for those cases)."""
    lay = case.layout
    gen = torch.Generator().manual_seed(case.seed)
    S, B, D, H, G = (
        lay.seq_length,
        case.batch,
        case.head_dim,
        lay.num_attention_heads,
        lay.num_query_groups,
    )
    q = torch.randn(S, B, H, D, generator=gen, dtype=torch.float64)
    k = torch.randn(S, B, G, D, generator=gen, dtype=torch.float64)
    v = torch.randn(S, B, G, D, generator=gen, dtype=torch.float64)
    dout = torch.randn(S, B, H * D, generator=gen, dtype=torch.float64)
    if case.dtype in LOW_PRECISION:
        q, k, v, dout = (x.to(case.dtype).double() for x in (q, k, v, dout))
    return q, k, v, dout


def _reference(q, k, v, dout):
    q, k, v = (x.clone().requires_grad_() for x in (q, k, v))
    out = reference_attention(q, k, v)
    out.backward(dout)
    return out.detach(), q.grad, k.grad, v.grad


def _run_case(case: Case, groups, pos: torch.Tensor, select=None) -> None:
    """Run one case on this rank and assert against the oracle. ``select(x_SB...)`` gives my shard."""
    q, k, v, dout = _full_inputs(case)
    ref = _reference(q, k, v, dout)
    select = select or (lambda x: x[pos])
    ql, kl, vl = (select(x).to(case.dtype).requires_grad_() for x in (q, k, v))
    out = hexiseq_attn_func(
        ql,
        kl,
        vl,
        groups=groups,
        kernel=case.kernel,
        comm_chunks=case.comm_chunks,
        fp32_grad_wire=case.fp32_grad_wire,
    )
    out.backward(select(dout).to(case.dtype))
    for name, got, want in zip(("out", "dq", "dk", "dv"), (out, ql.grad, kl.grad, vl.grad), ref):
        if case.dtype in LOW_PRECISION:
            bound = normwise_bound(
                case.dtype,
                roundings=FORWARD_ROUNDINGS if name == "out" else BACKWARD_ROUNDINGS,
                reduction=case.layout.seq_length,
            )
            err = normwise_error(got, select(want))
            assert err <= bound, (
                f"{case.name} rank {groups.rank} {name}: normwise error {err:.3g} > {bound:.3g}"
            )
            continue
        torch.testing.assert_close(
            got.double(),
            select(want),
            **TOL[case.dtype],
            msg=lambda m, n=name: f"{case.name} rank {groups.rank} {n}: {m}",
        )


def _worker(rank: int, world: int, cases: list[Case]) -> int:
    for case in cases:
        groups = build_hexiseq_groups(case.layout)
        _run_case(case, groups, torch.tensor(case.layout.ranks[rank].positions(), dtype=torch.long))
    return len(cases)


def _named_cases(world: int) -> list[Case]:
    """Hand-picked shapes: unequal groups, GQA/MQA, zero-token and zero-head ranks."""
    out = []
    if world == 4:
        # groups [3, 1]; rank 1 holds no tokens, rank 2 no heads; H=8/G=2 with a split GQA group
        lay = make_layout(
            seq_length=23,
            num_attention_heads=8,
            num_query_groups=2,
            group_sizes=[3, 1],
            segments=[[(0, 3), (17, 23)], [], [(3, 5), (9, 11)], [(5, 9), (11, 17)]],
            heads=[[0, 1, 2], [3, 4, 5, 6, 7], [], list(range(8))],
        )
        out.append(Case("groups31_zero_token_zero_head", lay))
        out.append(
            Case("groups31_sdpa_fp32", lay, dtype=torch.float32, kernel="cpu-flash", comm_chunks=2)
        )
        out.append(
            Case(
                "groups31_bf16", lay, dtype=torch.bfloat16, kernel="auto", comm_chunks=2, head_dim=8
            )
        )
        out.append(
            Case(
                "groups31_bf16_fp32_wire",
                lay,
                dtype=torch.bfloat16,
                comm_chunks=2,
                head_dim=8,
                kernel="auto",
                fp32_grad_wire=True,
            )
        )
    if world == 5:
        # groups [2, 2, 1]; H=6/G=3, non-contiguous heads; a 0-token rank in the middle group
        lay = make_layout(
            seq_length=31,
            num_attention_heads=6,
            num_query_groups=3,
            group_sizes=[2, 2, 1],
            segments=[[(0, 4), (27, 31)], [(4, 9)], [(9, 12), (20, 27)], [], [(12, 20)]],
            heads=[[0, 3, 5], [1, 2, 4], [0, 1, 2, 3], [4, 5], list(range(6))],
        )
        out.append(Case("groups221_gqa63", lay, batch=3))
    if world == 6:
        # groups [3, 2, 1]; H=6/G=3; one group ends before the others start (hidden blocks)
        lay = make_layout(
            seq_length=29,
            num_attention_heads=6,
            num_query_groups=3,
            group_sizes=[3, 2, 1],
            segments=[[(20, 22)], [(22, 29)], [(18, 20)], [(0, 5)], [(5, 9)], [(9, 18)]],
            heads=[[0], [1, 2, 3], [4, 5], [0, 1, 2, 5], [3, 4], list(range(6))],
        )
        out.append(Case("groups321_gqa63", lay, comm_chunks=2))
    if world == 8:
        # groups [4, 2, 2]; H=12/G=4 uneven heads; MQA variant
        segs = [
            [(0, 2)],
            [(2, 5), (40, 44)],
            [(5, 9)],
            [(9, 10)],
            [(10, 20)],
            [(20, 25), (33, 40)],
            [(25, 33)],
            [(44, 50)],
        ]
        heads = [
            [0, 1, 2, 3, 4],
            [5, 6],
            [7, 8, 9],
            [10, 11],
            list(range(7)),
            list(range(7, 12)),
            [0, 2, 4, 6, 8, 10],
            [1, 3, 5, 7, 9, 11],
        ]
        out.append(
            Case(
                "groups422_gqa124",
                make_layout(
                    seq_length=50,
                    num_attention_heads=12,
                    num_query_groups=4,
                    group_sizes=[4, 2, 2],
                    segments=segs,
                    heads=heads,
                ),
            )
        )
        out.append(
            Case(
                "groups422_mqa",
                make_layout(
                    seq_length=50,
                    num_attention_heads=12,
                    num_query_groups=1,
                    group_sizes=[4, 2, 2],
                    segments=segs,
                    heads=heads,
                ),
                dtype=torch.float32,
                comm_chunks=3,
            )
        )
    return out


# world -> number of random layouts on real gloo processes; variations rotate through dtype/kernel/chunks.
# The broad random-layout test (200 layouts x comm_chunks 1-4, every dtype) is tests/test_nccl_rules.py,
# which runs the same runtime in threads under NCCL's rules.
RANDOM_LAYOUTS = {2: 5, 3: 5, 4: 5, 8: 5}
THREAD_WORLDS = (5, 6)  # named cases run in threads under NCCL's rules (tests/nccl_sim.py)


def _random_cases(world: int) -> list[Case]:
    rng = random.Random(1000 + world)
    cases = []
    for i in range(RANDOM_LAYOUTS[world]):
        lay = random_layout(rng, world)
        dtype = torch.float32 if i % 3 == 2 else torch.bfloat16 if i % 5 == 3 else torch.float64
        kernel = "auto" if i % 4 == 1 or dtype == torch.bfloat16 else "reference"
        cases.append(
            Case(
                f"random{world}_{i}",
                lay,
                dtype=dtype,
                kernel=kernel,
                comm_chunks=1 + i % 3,
                batch=1 + i % 2,
                head_dim=2 + 2 * (i % 3),
                seed=i,
            )
        )
    return cases


@pytest.mark.parametrize("world", sorted(RANDOM_LAYOUTS))
def test_random_and_named_layouts(world: int) -> None:
    cases = _random_cases(world) + _named_cases(world)
    assert run_ranks(_worker, world, cases) == [len(cases)] * world


@pytest.mark.parametrize("world", THREAD_WORLDS)
def test_named_layouts_in_threads(monkeypatch: pytest.MonkeyPatch, world: int) -> None:
    """The named cases of worlds without a process test, in threads under NCCL's rules."""
    from nccl_sim import NcclSim

    import megatron_hexiseq.attention.comm as comm
    import megatron_hexiseq.attention.groups as groups_mod

    sim = NcclSim(world)
    monkeypatch.setattr(comm, "dist", sim)
    monkeypatch.setattr(groups_mod, "dist", sim)
    cases = _named_cases(world)
    assert cases
    assert sim.run(lambda rank: _worker(rank, world, cases)) == [len(cases)] * world


def test_random_layouts_cover_the_edge_cases() -> None:
    """The random generator actually produces the shapes the runtime must support."""
    lays = [c.layout for w in RANDOM_LAYOUTS for c in _random_cases(w)]
    assert len(lays) >= 20
    assert any(r.num_tokens == 0 for lay in lays for r in lay.ranks)
    assert any(not r.heads for lay in lays for r in lay.ranks)
    assert any(len(r.segments) > 1 for lay in lays for r in lay.ranks)
    assert any(len({len(g.ranks) for g in lay.groups}) > 1 for lay in lays)
    assert any(lay.num_query_groups == 1 for lay in lays)
    assert any(1 < lay.num_query_groups < lay.num_attention_heads for lay in lays)


# ---- Megatron's even zig-zag split -------------------------------------------------------------
def _even_layouts(S: int, cp: int, H: int, G: int) -> list[tuple[str, Layout]]:
    """Ring (cp groups of 1), Ulysses (1 group of cp), and 2 x cp/2, all on the zig-zag split."""
    segs = zigzag_segments(S, cp)
    out = []
    for name, gsize in (("ring", 1), ("ulysses", cp), ("usp", 2)):
        counts = split_evenly(H, gsize)
        per_group = [list(range(sum(counts[:i]), sum(counts[: i + 1]))) for i in range(gsize)]
        out.append(
            (
                name,
                make_layout(
                    seq_length=S,
                    num_attention_heads=H,
                    num_query_groups=G,
                    group_sizes=[gsize] * (cp // gsize),
                    segments=segs,
                    heads=per_group * (cp // gsize),
                ),
            )
        )
    return out


def _megatron_worker(rank: int, world: int, S: int) -> int:
    from megatron.core.utils import get_batch_on_this_cp_rank

    done = 0
    for name, lay in _even_layouts(S, world, H=4, G=2):
        groups = build_hexiseq_groups(lay)
        # Megatron's split (batch-first tensors, sequence on dim 1) must give this rank's positions
        tokens = torch.arange(S).unsqueeze(0)
        mine = get_batch_on_this_cp_rank({"tokens": tokens}, cp_group=groups.cp_group)["tokens"][0]
        assert mine.tolist() == lay.ranks[rank].positions(), (name, mine.tolist())

        def megatron_split(x):  # [S, B, ...] -> this rank's Megatron shard [s, B, ...]
            return get_batch_on_this_cp_rank({"x": x.transpose(0, 1)}, cp_group=groups.cp_group)[
                "x"
            ].transpose(0, 1)

        for kernel in ("reference", "auto"):
            _run_case(
                Case(f"megatron_{name}_{kernel}", lay, kernel=kernel),
                groups,
                None,
                select=megatron_split,
            )
            done += 1
    return done


def test_even_layout_matches_megatron_zigzag() -> None:
    assert run_ranks(_megatron_worker, 4, 32) == [6] * 4


# ---- several domains (data-parallel replicas), each one copy of the layout ---------------------
def _domains_worker(rank: int, world: int, lay: Layout) -> int:
    domains = [[0, 1, 2], [3, 4, 5]]
    groups = build_hexiseq_groups(lay, domains=domains)
    assert groups.cp_global_ranks == tuple(domains[rank // 3])
    case = Case("two_domains", lay, seed=rank // 3)  # replicas see different data
    _run_case(case, groups, torch.tensor(lay.ranks[groups.rank].positions(), dtype=torch.long))
    return groups.rank


def test_two_domains_run_independent_copies() -> None:
    lay = make_layout(
        seq_length=17,
        num_attention_heads=4,
        num_query_groups=2,
        group_sizes=[2, 1],
        segments=[[(0, 3), (12, 17)], [(3, 6)], [(6, 12)]],
        heads=[[0, 1, 3], [2], [0, 1, 2, 3]],
    )
    assert run_ranks(_domains_worker, 6, lay) == [0, 1, 2, 0, 1, 2]
