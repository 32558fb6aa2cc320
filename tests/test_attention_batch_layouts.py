"""Per-micro-batch layouts on the job's process groups (``HexiSeqGroups.with_layout``).

Layer (a), and threads under NCCL's rules (``tests/nccl_sim.py``) for the multi-rank runs:
- the structure check: a layout with other groups, heads, hosts, GPUs or world size is one
  ``HexiSeqError`` line naming the difference; views are cached, share the process groups and the
  head index tensors, and a view of a view is a view of the job's groups;
- the runtime: the groups are built ONCE from a random job layout, then every micro-batch runs a
  different random layout of the same structure (random multi-run segments, 0-token ranks, whole
  documents inside one group) with random boundaries, forward and backward, float64 at 1e-10
  against the single-process document-masked oracle, for ``comm_chunks`` 1-4 and both CPU kernels;
  after the groups exist no ``new_group``, broadcast or all-reduce is called (only the head
  all-to-alls and the sub-ring P2P of each micro-batch); ``CommStats`` equal ``counts.rank_counts``
  of the micro-batch's layout;
- a second call of the same micro-batch's view builds no tensor from host data.
- bf16 with ``cpu-flash``: three micro-batches of 300-500 tokens, each with its own layout, within
  ``kernel_check``'s normwise bounds of the float64 oracle on the same rounded inputs.
Layer (b): 4 gloo processes run two consecutive micro-batches with different per-batch layouts
on the same groups, each matching the oracle.
Layer (c), skipped without CUDA: ``test_per_batch_layouts_flash_on_cuda``, the same bf16 run with
``flash`` (the variable-length path) on the GPU; each simulated rank runs its own backward
(``set_multithreading_enabled(False)``, checked in the CPU twin too), as the documents test does.
"""

from __future__ import annotations

import contextlib
import random
from dataclasses import replace

import pytest
import torch
from nccl_sim import NcclSim
from test_attention_documents import _Recorder
from test_attention_documents import _sim_dist as _sim_dist  # noqa: F401 (fixture)

import megatron_hexiseq.attention.comm as comm
import megatron_hexiseq.attention.groups as groups_mod
from megatron_hexiseq.attention import (
    CommStats,
    build_hexiseq_groups,
    hexiseq_attn_func,
    reference_attention,
)
from megatron_hexiseq.attention.counts import rank_counts
from megatron_hexiseq.attention.documents import parse_cu_seqlens
from megatron_hexiseq.attention.testing_layouts import (
    random_batch_layout,
    random_bounds,
    random_layout,
)
from megatron_hexiseq.errors import HexiSeqError
from megatron_hexiseq.layout import Layout, make_layout
from megatron_hexiseq.testbed.spawn import run_ranks

TOL = dict(rtol=1e-10, atol=1e-10)

JOB = make_layout(  # groups [2, 1, 1]; GQA 8/2; non-contiguous heads
    seq_length=48,
    num_attention_heads=8,
    num_query_groups=2,
    group_sizes=[2, 1, 1],
    segments=[[(0, 6), (30, 36)], [(6, 14), (36, 42)], [(14, 30)], [(42, 48)]],
    heads=[[0, 2, 5, 7], [1, 3, 4, 6], list(range(8)), list(range(8))],
)


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _with_segments(job: Layout, segments: list[list[tuple[int, int]]], **kw) -> Layout:
    ranks = tuple(replace(r, segments=tuple(s)) for r, s in zip(job.ranks, segments))
    return replace(job, ranks=ranks, **kw)


# ---- the structure check and the views (no processes beyond the simulator) ---------------------
def test_views_share_the_groups_and_refuse_another_structure(_sim_dist) -> None:
    sim = NcclSim(JOB.world_size)
    comm.dist, groups_mod.dist = sim, sim
    batch = _with_segments(JOB, [[(0, 20)], [(20, 21)], [(21, 40)], [(40, 48)]])
    other = _with_segments(JOB, [[(0, 1)], [(1, 21)], [(21, 40)], [(40, 48)]])

    def fn(r: int):
        groups = build_hexiseq_groups(JOB)
        made = sim.local.groups_made
        view = groups.with_layout(batch)
        assert view.layout is batch and view.job_layout is JOB and groups.job_layout is JOB
        assert (view.cp_group, view.a2a_group, view.rank) == (
            groups.cp_group,
            groups.a2a_group,
            groups.rank,
        )
        assert view._indices is groups._indices  # head index tensors: one per job
        assert groups.with_layout(batch) is view  # cached
        assert groups.with_layout(replace(batch)) is view  # equal layout, same view
        assert view.with_layout(other) is groups.with_layout(other)  # a view of the job's groups
        assert view.with_layout(JOB) is groups and groups.with_layout(JOB) is groups
        assert sim.local.groups_made == made  # no process group created
        for lay in [
            _with_segments(  # 1-token runs, a rank without tokens
                JOB,
                [
                    [(i, i + 1) for i in range(0, 40, 2)],
                    [],
                    [(i, i + 1) for i in range(1, 40, 2)] + [(40, 44)],
                    [(44, 48)],
                ],
            ),
            *(random_batch_layout(random.Random(i), JOB) for i in range(6)),
        ]:
            groups.with_layout(lay)
        assert len(groups._views) == groups_mod.BATCH_LAYOUTS_KEPT
        return True

    assert all(sim.run(fn))


@pytest.mark.parametrize(
    "change,match",
    [
        (dict(heads=[[0, 1, 2, 5, 7], [3, 4, 6]]), "rank 0 has heads \\(0, 1, 2, 5, 7\\), the job"),
        (dict(host="other"), "rank 0 has host 'other', the job's layout"),
        (dict(gpu="H100"), "rank 0 has gpu 'H100'"),
        (dict(groups=[[0], [1, 2], [3]]), "its groups are \\[\\[0\\], \\[1, 2\\], \\[3\\]\\]"),
        (dict(num_attention_heads=16), "num_attention_heads is 16, the job's is 8"),
    ],
)
def test_another_structure_is_one_clear_error(_sim_dist, change: dict, match: str) -> None:
    segs = [list(r.segments) for r in JOB.ranks]
    if "heads" in change:
        heads = change["heads"] + [list(range(8))] * 2
        lay = make_layout(
            seq_length=48,
            num_attention_heads=8,
            num_query_groups=2,
            group_sizes=[2, 1, 1],
            segments=segs,
            heads=heads,
        )
    elif "groups" in change:
        lay = make_layout(
            seq_length=48,
            num_attention_heads=8,
            num_query_groups=2,
            groups=change["groups"],
            segments=segs,
            heads=[list(range(8)), [0, 1, 2, 3], [4, 5, 6, 7], list(range(8))],
        )
    elif "num_attention_heads" in change:
        lay = make_layout(
            seq_length=48,
            num_attention_heads=16,
            num_query_groups=2,
            group_sizes=[2, 1, 1],
            segments=segs,
            heads=[list(range(8)), list(range(8, 16))] + [list(range(16))] * 2,
        )
    else:
        ranks = (replace(JOB.ranks[0], **change),) + JOB.ranks[1:]
        lay = replace(JOB, ranks=ranks)
    sim = NcclSim(JOB.world_size)
    comm.dist, groups_mod.dist = sim, sim

    def fn(r: int):
        groups = build_hexiseq_groups(JOB)
        with pytest.raises(HexiSeqError, match=match) as err:
            groups.with_layout(lay)
        assert "\n" not in str(err.value) and "does not fit the job's process groups" in str(
            err.value
        )
        return True

    assert all(sim.run(fn))


# ---- the runtime: one set of groups, a new layout every micro-batch -------------------------------
def _oracle(lay: Layout, cu, batch: int, seed: int, head_dim: int):
    gen = torch.Generator().manual_seed(seed)
    S, H, G = lay.seq_length, lay.num_attention_heads, lay.num_query_groups
    q, k, v = (
        torch.randn(S, batch, n, head_dim, generator=gen, dtype=torch.float64).requires_grad_()
        for n in (H, G, G)
    )
    dout = torch.randn(S, batch, H * head_dim, generator=gen, dtype=torch.float64)
    ref = reference_attention(q, k, v, cu_seqlens=cu)
    ref.backward(dout)
    return (q, k, v, dout), (ref.detach(), q.grad, k.grad, v.grad)


def _micro_batches(rng: random.Random, job: Layout, n: int) -> list[tuple]:
    """``n`` micro-batches: (per-batch layout, boundaries, B, seed, head dim, kernel)."""
    out = []
    for i in range(n):
        S = job.seq_length if i % 3 else rng.randint(job.world_size + 2, 5 * job.world_size + 12)
        cu = random_bounds(rng, make_layout(  # boundaries drawn on a plain layout of S tokens
            seq_length=S, num_attention_heads=1, num_query_groups=1, group_sizes=[1],
            segments=[[(0, S)]], heads=[[0]],
        ))  # fmt: skip
        lay = random_batch_layout(rng, job, seq_length=S, bounds=cu if i % 2 else None)
        if i % 4 == 3:  # boundaries on the micro-batch's own segment edges too
            cu = random_bounds(rng, lay)
        batch = 1 + i % 2
        if batch == 2 and i % 4 == 1:
            cu = [cu, random_bounds(rng, lay)]  # per-sample boundaries
        kernel = "reference" if i % 2 else "auto"
        out.append((lay, cu, batch, 100 * i + 7, (4, 2, 8)[i % 3], kernel))
    return out


def _run_micro_batches(job: Layout, cases: list[tuple], chunks: int, stats: bool = False):
    oracles = [_oracle(lay, cu, batch, seed, d) for lay, cu, batch, seed, d, _ in cases]
    sim = NcclSim(job.world_size)
    comm.dist, groups_mod.dist = sim, sim
    calls: list[tuple[int, str]] = []
    collective = sim._collective

    def record(kind, group, *args, **kwargs):
        if getattr(sim.local, "recording", False):
            calls.append((sim.local.rank, kind))
        return collective(kind, group, *args, **kwargs)

    sim._collective = record

    def fn(r: int):
        groups = build_hexiseq_groups(job)
        made = sim.local.groups_made
        sim.local.recording = True  # from here on: record every collective of this rank
        counted = []
        for (lay, cu, _, _, _, kernel), ((q, k, v, dout), want) in zip(cases, oracles):
            view = groups.with_layout(lay)
            pos = torch.tensor(lay.ranks[r].positions(), dtype=torch.long)
            ql, kl, vl = (x.detach()[pos].requires_grad_() for x in (q, k, v))
            st = CommStats() if stats else None
            out = hexiseq_attn_func(
                ql, kl, vl, groups=view, kernel=kernel, comm_chunks=chunks, cu_seqlens=cu, stats=st
            )
            out.backward(dout[pos])
            for name, got, ref in zip(
                ("out", "dq", "dk", "dv"), (out, ql.grad, kl.grad, vl.grad), want
            ):
                torch.testing.assert_close(
                    got.detach(), ref[pos], **TOL, msg=lambda m, n=name: f"rank {r} {n}: {m}"
                )  # fmt: skip
            counted.append(st)
        assert sim.local.groups_made == made, "a micro-batch created a process group"
        return counted

    results = sim.run(fn)
    kinds = {kind for _, kind in calls}
    assert kinds <= {"all_to_all"}, kinds  # no broadcast, all-reduce or group creation
    return results


@pytest.mark.parametrize("chunks", [1, 2, 3, 4])
def test_per_batch_layouts_on_one_set_of_groups(_sim_dist, chunks: int) -> None:
    rng = random.Random(500 + chunks)
    seen = dict(zero_tokens=0, multi_run=0, per_sample=0, whole_doc_in_group=0, other_length=0)
    for j in range(6):
        job = random_layout(rng, rng.randint(2, 6))
        cases = _micro_batches(rng, job, 5)
        for lay, cu, *_ in cases:
            seen["zero_tokens"] += any(r.num_tokens == 0 for r in lay.ranks)
            seen["multi_run"] += any(len(r.segments) > 2 for r in lay.ranks)
            seen["per_sample"] += isinstance(cu[0], list)
            seen["other_length"] += lay.seq_length != job.seq_length
            flat = cu if not isinstance(cu[0], list) else cu[0]
            for a, b in zip(flat, flat[1:]):
                owners = {lay.ranks[r].group for r in range(lay.world_size) for s, e in
                          lay.ranks[r].segments if s < b and e > a}  # fmt: skip
                seen["whole_doc_in_group"] += len(owners) == 1 and len(lay.groups) > 1
        try:
            _run_micro_batches(job, cases, chunks)
        except AssertionError as e:
            raise AssertionError(f"job {j} ({job.world_size} ranks): {e}") from None
    assert all(seen.values()), seen


def test_stats_follow_the_micro_batch_layout(_sim_dist) -> None:
    """``CommStats`` of each micro-batch equal ``rank_counts`` of that micro-batch's layout."""
    rng = random.Random(71)
    job = random_layout(rng, 5)
    cases = _micro_batches(rng, job, 4)
    results = _run_micro_batches(job, cases, 2, stats=True)
    for r, per_rank in enumerate(results):
        for (lay, cu, batch, _, d, _), st in zip(cases, per_rank):
            bounds = parse_cu_seqlens(cu, seq_length=lay.seq_length, batch=batch)
            want = rank_counts(
                lay, r, documents=bounds, comm_chunks=2, batch=batch, head_dim=d, element_bytes=8
            )
            for kind in want.sent:
                assert st.total_sent(kind) == want.sent[kind], (r, kind)
                assert st.total_received(kind) == want.received[kind], (r, kind)
            for name in ("blocks", "calls", "pairs"):
                got = {k: v for k, v in getattr(st, name).items() if v}
                assert got == {k: v for k, v in getattr(want, name).items() if v}, (r, name)


def test_second_layer_of_a_micro_batch_builds_nothing_from_host_data(_sim_dist) -> None:
    """Every layer of a micro-batch asks ``with_layout`` again: it gets the cached view, whose
    schedule and index tensors the first layer built (no ``lift_fresh``: no host-to-device copy)."""
    rng = random.Random(3)
    cu = [0, 7, 10, 11, 30, 46, 48]
    lay = random_batch_layout(rng, JOB, bounds=cu)
    sim = NcclSim(JOB.world_size)
    comm.dist, groups_mod.dist = sim, sim

    def fn(r: int) -> _Recorder:
        groups = build_hexiseq_groups(JOB)
        s = lay.ranks[r].num_tokens
        rec = _Recorder()
        for call in range(2):
            q = torch.randn(s, 1, 8, 8, dtype=torch.float64, requires_grad=True)
            k, v = (torch.randn(s, 1, 2, 8, dtype=torch.float64, requires_grad=True) for _ in "kv")
            with rec if call == 1 else contextlib.nullcontext():
                out = hexiseq_attn_func(
                    q, k, v, groups=groups.with_layout(lay), kernel="cpu-flash", cu_seqlens=cu
                )
                out.sum().backward()
        return rec

    for r, rec in enumerate(sim.run(fn)):
        assert rec.ops and "aten.lift_fresh.default" not in rec.ops, r


# ---- gloo processes ----------------------------------------------------------------------------
def _gloo_worker(rank: int, world: int, job: Layout, cases: list) -> int:
    groups = build_hexiseq_groups(job)  # once: every micro-batch runs on these groups
    for lay, cu, batch, seed, d, kernel, chunks in cases:
        (q, k, v, dout), want = _oracle(lay, cu, batch, seed, d)
        pos = torch.tensor(lay.ranks[rank].positions(), dtype=torch.long)
        ql, kl, vl = (x.detach()[pos].requires_grad_() for x in (q, k, v))
        out = hexiseq_attn_func(
            ql,
            kl,
            vl,
            groups=groups.with_layout(lay),
            kernel=kernel,
            comm_chunks=chunks,
            cu_seqlens=cu,
        )
        out.backward(dout[pos])
        for got, ref in zip((out, ql.grad, kl.grad, vl.grad), want):
            torch.testing.assert_close(got.detach(), ref[pos], **TOL)
    return len(cases)


def test_two_micro_batches_with_different_layouts_on_gloo() -> None:
    # micro-batch 1: short documents whole inside one group each, a long one over every group
    first = _with_segments(
        JOB, [[(0, 5), (20, 30)], [(5, 10), (30, 34)], [(10, 20), (34, 40)], [(40, 48)]]
    )
    # micro-batch 2: many runs per rank, rank 1 holds no tokens
    second = _with_segments(JOB, [[(0, 3), (9, 12), (40, 48)], [], [(3, 9), (12, 20)], [(20, 40)]])
    assert first.ranks[0].segments != second.ranks[0].segments
    cases = [
        (first, [0, 10, 20, 48], 2, 1, 4, "reference", 1),
        (second, [[0, 1, 2, 12, 20, 48], [0, 24, 48]], 2, 2, 4, "auto", 2),
    ]
    assert run_ranks(_gloo_worker, 4, JOB, cases) == [2] * 4


# ---- low precision: the CUDA varlen path (layer c) and its CPU twin ------------------------------
def _low_precision_micro_batches(device: str, kernel: str) -> None:
    """bf16 runtime on one set of groups, a new layout every micro-batch, against the float64
    oracle on the same bf16-rounded inputs, within ``kernel_check``'s normwise bounds."""
    from megatron_hexiseq.attention.kernel_check import (
        BACKWARD_ROUNDINGS,
        FORWARD_ROUNDINGS,
        normwise_bound,
        normwise_error,
    )

    rng = random.Random(9)
    job = random_layout(rng, 4, seq_length=400, heads=(8, 2))
    cases = []
    for i in range(3):
        S = rng.randint(300, 500)
        cu = random_bounds(rng, random_layout(rng, 4, seq_length=S, heads=(8, 2)))
        lay = random_batch_layout(rng, job, seq_length=S, bounds=cu)
        gen = torch.Generator().manual_seed(i)
        q, k, v = (
            torch.randn(S, 1, n, 64, generator=gen).bfloat16().double().requires_grad_()
            for n in (8, 2, 2)
        )
        dout = torch.randn(S, 1, 8 * 64, generator=gen).bfloat16().double()
        ref = reference_attention(q, k, v, cu_seqlens=cu)
        ref.backward(dout)
        cases.append((lay, cu, (q, k, v, dout), (ref.detach(), q.grad, k.grad, v.grad)))
    sim = NcclSim(job.world_size)
    comm.dist, groups_mod.dist = sim, sim

    def fn(r: int):
        groups = build_hexiseq_groups(job)
        out = []
        for i, (lay, cu, (q, k, v, dout), _) in enumerate(cases):
            pos = torch.tensor(lay.ranks[r].positions(), dtype=torch.long)
            ql, kl, vl = (x.detach()[pos].bfloat16().to(device).requires_grad_() for x in (q, k, v))
            o = hexiseq_attn_func(
                ql,
                kl,
                vl,
                groups=groups.with_layout(lay),
                kernel=kernel,
                comm_chunks=1 + i % 2,
                cu_seqlens=cu,
            )
            seen: list[bool] = []
            o.register_hook(lambda g, seen=seen: seen.append(torch._C._is_multithreading_enabled()))
            # the backward on this rank's thread: autograd's shared CUDA device thread would carry
            # no simulated rank (and one rank's wait would block the others' backward)
            with torch.autograd.set_multithreading_enabled(False):
                o.backward(dout[pos].bfloat16().to(device))
            assert seen == [False], seen  # it ran with autograd's device threads off
            out.append([t.detach().double().cpu() for t in (o, ql.grad, kl.grad, vl.grad)])
        return out

    for r, per_case in enumerate(sim.run(fn)):
        for (lay, _, _, want), got in zip(cases, per_case):
            pos = lay.ranks[r].positions()
            for name, g, w in zip(("out", "dq", "dk", "dv"), got, want):
                rounds = FORWARD_ROUNDINGS if name == "out" else BACKWARD_ROUNDINGS
                bound = normwise_bound(torch.bfloat16, roundings=rounds, reduction=lay.seq_length)
                err = normwise_error(g, w[pos]) if pos else 0.0
                assert err <= bound, (r, name, err, bound)


def test_per_batch_layouts_bf16_cpu_flash(_sim_dist) -> None:
    _low_precision_micro_batches("cpu", "cpu-flash")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_per_batch_layouts_flash_on_cuda(_sim_dist) -> None:
    _low_precision_micro_batches("cuda", "flash")
