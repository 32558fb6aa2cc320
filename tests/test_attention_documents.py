"""Packed documents (``cu_seqlens``): exact document-masked HexiSeq attention and the pruned exchange.

Layer (a), and threads under NCCL's rules (``tests/nccl_sim.py``) for the multi-rank runs:
- boundaries: parsing and one clear ``HexiSeqError`` per bad input;
- windows: on random layouts x random boundaries every (query row, key) pair a block's windows
  compute is visible under the document mask, every visible pair is computed exactly once, and the
  pruned transfers carry exactly the source tokens some query of the destination sees (brute force);
- the runtime (``build_hexiseq_groups`` + ``hexiseq_attn_func`` forward and backward) on 120 random
  layouts x random boundaries (1-token documents, boundaries on segment edges, one document over
  every rank, per-sample boundaries with B = 2, 0-head and 0-token ranks) x ``comm_chunks`` 1-4,
  float64 at 1e-10 against the single-process document-masked oracle, both CPU kernels;
- the variable-length CUDA path (``varlen.py``) run on CPU with a float64 emulation of
  ``aten._flash_attention_forward/_backward`` (same signatures, packed layout, LSE ``[H, N]``), and
  with ``meta`` tensors through the real ops (shapes);
- ``cu_seqlens=None`` is today's path: bit-identical to the one-document boundaries ``[0, S]``;
- ``CommStats``: bytes after pruning equal the brute-force count, backward all-to-all and K/V
  re-fetch counted, pairs equal the brute-force visible pairs.
Layer (b): one gloo process world (4 ranks) repeats named document cases.
Layer (c), skipped without CUDA: ``test_flash_varlen_on_cuda`` (varlen windows, bf16 vs float64) and
``test_documents_end_to_end_flash_on_cuda`` (the runtime with ``flash`` on random layouts).
"""

from __future__ import annotations

import contextlib
import random

import pytest
import torch
from nccl_sim import NcclSim, SimError
from torch.utils._python_dispatch import TorchDispatchMode
from varlen_standin import flash_backward, flash_forward

import megatron_hexiseq.attention.comm as comm
import megatron_hexiseq.attention.groups as groups_mod
import megatron_hexiseq.attention.varlen as varlen
from megatron_hexiseq.attention import (
    CommStats,
    build_hexiseq_groups,
    hexiseq_attn_func,
    reference_attention,
)
from megatron_hexiseq.attention.counts import rank_counts
from megatron_hexiseq.attention.documents import (
    DocumentBounds,
    document_schedule,
    parse_cu_seqlens,
)
from megatron_hexiseq.attention.kernels import Kernel, kv_map
from megatron_hexiseq.attention.peers import build_schedule, group_runs, runs_positions
from megatron_hexiseq.attention.testing_layouts import random_bounds, random_layout
from megatron_hexiseq.errors import HexiSeqError
from megatron_hexiseq.layout import Layout, make_layout
from megatron_hexiseq.testbed.spawn import run_ranks

TOL = dict(rtol=1e-10, atol=1e-10)


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _positions_docs(bounds: tuple[int, ...], S: int) -> list[int]:
    doc = [0] * S
    for i, (a, b) in enumerate(zip(bounds, bounds[1:])):
        for p in range(a, b):
            doc[p] = i
    return doc


# ---- boundaries --------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "cu,match",
    [
        ([0, 5, 5, 12], "not strictly increasing at index 2 \\(5 then 5\\)"),
        ([1, 12], "must start at 0 and end at 12"),
        ([0, 11], "must start at 0 and end at 12"),
        ([0], "must start at 0 and end at 12"),
        ([0, 2.5, 12], "integer positions"),
        ([[0, 12], [0, 3, 12], [0, 12]], "3 lists for a micro-batch of 2 samples"),
        ([[0, 12], [0, 13]], "of sample 1 must start at 0 and end at 12"),
        ("0,12", "must be a list"),
        (torch.zeros(2, 2, 2, dtype=torch.long), "1-D .* or 2-D"),
    ],
)
def test_bad_boundaries_are_one_clear_error(cu, match: str) -> None:
    with pytest.raises(HexiSeqError, match=match):
        parse_cu_seqlens(cu, seq_length=12, batch=2)


def test_boundaries_parse() -> None:
    one = parse_cu_seqlens(torch.tensor([0, 4, 12]), seq_length=12, batch=3)
    assert one == DocumentBounds(12, ((0, 4, 12),), shared=True)
    same = parse_cu_seqlens([[0, 4, 12], [0, 4, 12]], seq_length=12, batch=2)
    assert same.shared and same.samples == ((0, 4, 12),)
    two = parse_cu_seqlens(torch.tensor([[0, 4, 12], [0, 1, 12]]), seq_length=12, batch=2)
    assert not two.shared and two.samples == ((0, 4, 12), (0, 1, 12))


def test_document_bounds_must_fit_the_micro_batch() -> None:
    two = parse_cu_seqlens([[0, 4, 12], [0, 1, 12]], seq_length=12, batch=2)
    assert two.for_batch(12, 2) is two
    with pytest.raises(HexiSeqError, match="for 2 samples given to a micro-batch of 3"):
        two.for_batch(12, 3)
    with pytest.raises(HexiSeqError, match="end at 12 but the sequence has 16 tokens"):
        two.for_batch(16, 2)


def test_hexiseq_attn_func_refuses_bad_boundaries(_sim_dist) -> None:
    lay = make_layout(
        seq_length=6,
        num_attention_heads=2,
        num_query_groups=1,
        group_sizes=[1],
        segments=[[(0, 6)]],
        heads=[[0, 1]],
    )
    sim = NcclSim(1)

    def fn(r: int) -> None:
        comm.dist, groups_mod.dist = sim, sim
        g = build_hexiseq_groups(lay)
        q, k = torch.randn(6, 1, 2, 4), torch.randn(6, 1, 1, 4)
        hexiseq_attn_func(q, k, k, groups=g, cu_seqlens=[0, 3, 2, 6])

    with pytest.raises(
        SimError, match="raised HexiSeqError: cu_seqlens is not strictly increasing"
    ):
        sim.run(fn)


# ---- windows and pruning against brute force ---------------------------------------------------
def _check_schedule(lay: Layout, bounds: DocumentBounds, chunks: int) -> None:
    S = lay.seq_length
    docs = [_positions_docs(b, S) for _, b in bounds.per_sample()]
    samples = [s for s, _ in bounds.per_sample()]
    for r in range(lay.world_size):
        sched = document_schedule(lay, r, bounds, chunks)
        qpos = runs_positions(sched.q_runs)
        # local windows: per sample, exactly the same-document causal pairs of my group, once
        assert sched.local_windows is not None
        for si, doc in zip(samples, docs):
            got = sorted(
                (qpos[i], qpos[j])
                for w in sched.local_windows
                if w.sample == si
                for i in range(w.row_lo, w.row_hi)
                for j in range(w.key_lo, i + 1)
            )
            want = sorted((x, y) for x in qpos for y in qpos if y <= x and doc[x] == doc[y])
            assert got == want, (r, si)
        for step in sched.steps:
            if not step.recvs:
                continue
            kpos = runs_positions(step.recvs[0].runs)
            assert step.windows is not None and step.windows, "a received block computes"
            for si, doc in zip(samples, docs):
                got = sorted(
                    (qpos[i], kpos[j])
                    for w in step.windows
                    if w.sample == si
                    for i in range(w.row_lo, w.row_hi)
                    for j in range(w.key_lo, w.key_hi)
                )
                want = sorted((x, y) for x in qpos for y in kpos if y < x and doc[x] == doc[y])
                assert got == want, (r, step.step, si)
    # pruning: per (source group, destination group) the union of the steps' tokens is exactly
    # the source tokens some destination query sees in some sample
    transfers = {}
    for r in range(lay.world_size):
        for step in document_schedule(lay, r, bounds, chunks).steps:
            for x in step.recvs:
                key = (lay.ranks[x.src].group, lay.ranks[x.dst].group, x.dst, x.dst_heads)
                transfers.setdefault(key, set()).update(runs_positions(x.runs))
    for g in lay.groups:
        gpos = runs_positions(group_runs(lay, g.id))
        for src in lay.groups:
            if src.id == g.id:
                continue
            spos = runs_positions(group_runs(lay, src.id))
            want = {y for y in spos for doc in docs for x in gpos if y < x and doc[x] == doc[y]}
            got_by_rank: dict[int, set[int]] = {}
            for (sg, dg, dst, _), pos in transfers.items():
                if (sg, dg) == (src.id, g.id):
                    got_by_rank.setdefault(dst, set()).update(pos)
            for r in g.ranks:
                if lay.ranks[r].heads:
                    assert got_by_rank.get(r, set()) == want, (src.id, g.id, r)


def test_windows_and_pruning_match_brute_force() -> None:
    rng = random.Random(7)
    for i in range(150):
        lay = random_layout(rng, rng.randint(1, 6))
        if i % 4 == 3:
            cu = [random_bounds(rng, lay) for _ in range(2)]
            bounds = parse_cu_seqlens(cu, seq_length=lay.seq_length, batch=2)
        else:
            bounds = parse_cu_seqlens(random_bounds(rng, lay), seq_length=lay.seq_length, batch=1)
        _check_schedule(lay, bounds, 1 + i % 3)


# ---- the runtime under NCCL's rules --------------------------------------------------------------
def _run(
    lay: Layout,
    cu,
    *,
    chunks: int,
    kernel: str,
    batch: int,
    seed: int,
    head_dim: int = 4,
    stats: list[CommStats] | None = None,
) -> list:
    gen = torch.Generator().manual_seed(seed)
    S, H, G = lay.seq_length, lay.num_attention_heads, lay.num_query_groups
    q, k, v = (
        torch.randn(S, batch, n, head_dim, generator=gen, dtype=torch.float64).requires_grad_()
        for n in (H, G, G)
    )
    dout = torch.randn(S, batch, H * head_dim, generator=gen, dtype=torch.float64)
    ref = reference_attention(q, k, v, cu_seqlens=cu)
    ref.backward(dout)
    sim = NcclSim(lay.world_size)
    comm.dist, groups_mod.dist = sim, sim

    def fn(r: int):
        groups = build_hexiseq_groups(lay)
        pos = torch.tensor(lay.ranks[r].positions(), dtype=torch.long)
        ql, kl, vl = (x.detach()[pos].requires_grad_() for x in (q, k, v))
        st = stats[r] if stats is not None else None
        out = hexiseq_attn_func(
            ql, kl, vl, groups=groups, kernel=kernel, comm_chunks=chunks, cu_seqlens=cu, stats=st
        )
        out.backward(dout[pos])
        return pos, out.detach(), ql.grad, kl.grad, vl.grad

    results = sim.run(fn)
    if cu is not None:
        for pos, *got in results:
            for name, g, want in zip(("out", "dq", "dk", "dv"), got, (ref, q.grad, k.grad, v.grad)):
                torch.testing.assert_close(
                    g, want.detach()[pos], **TOL, msg=lambda m, n=name: f"{n}: {m}"
                )
    return results


@pytest.fixture
def _sim_dist(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(comm, "dist", comm.dist)
    monkeypatch.setattr(groups_mod, "dist", groups_mod.dist)


@pytest.mark.parametrize("chunks", [1, 2, 3, 4])
def test_document_masked_attention_on_random_layouts(_sim_dist, chunks: int) -> None:
    rng = random.Random(300 + chunks)
    seen = dict(
        zero_tokens=0, zero_heads=0, per_sample=0, one_doc=0, single_token_doc=0, segment_edge=0
    )
    for i in range(30):
        lay = random_layout(rng, rng.randint(2, 7))
        batch = 1 + i % 2
        per_sample = batch == 2 and i % 4 == 1
        cu = (
            [random_bounds(rng, lay) for _ in range(batch)]
            if per_sample
            else random_bounds(rng, lay)
        )
        flat = cu if not per_sample else [b for x in cu for b in x]
        seen["per_sample"] += per_sample
        seen["one_doc"] += not per_sample and len(cu) == 2
        seen["single_token_doc"] += any(b - a == 1 for a, b in zip(flat, flat[1:]) if b > a)
        edges = {e for r in lay.ranks for _, e in r.segments if e < lay.seq_length}
        seen["segment_edge"] += bool(edges & set(flat[1:-1]))
        seen["zero_tokens"] += any(r.num_tokens == 0 for r in lay.ranks)
        seen["zero_heads"] += any(not r.heads for r in lay.ranks)
        try:
            _run(
                lay,
                cu,
                chunks=chunks,
                kernel="reference" if i % 2 else "auto",
                batch=batch,
                seed=i,
                head_dim=(4, 2, 8)[i % 3],
            )
        except AssertionError as e:
            raise AssertionError(f"layout {i} ({lay.world_size} ranks), cu {cu}: {e}") from None
    assert all(seen.values()), seen


def test_none_is_todays_path_and_one_document_matches_it(
    _sim_dist, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``cu_seqlens=None`` never reaches the document code (today's schedule and block calls, so
    today's bits); one document ``[0, S]`` gives the same schedule and the same values up to the
    last bits (its blocks are written into fresh contiguous buffers: vectorised ``exp`` differs)."""
    import megatron_hexiseq.attention.documents as documents

    rng = random.Random(11)
    for i in range(12):
        lay = random_layout(rng, rng.randint(2, 6))
        kw = dict(chunks=1 + i % 3, kernel="auto" if i % 2 else "reference", batch=2, seed=i)
        with monkeypatch.context() as m:
            m.setattr(groups_mod, "document_schedule", None)  # would raise if called
            m.setattr(varlen, "local_forward", None)
            m.setattr(documents, "block_windows", None)
            plain = _run(lay, None, **kw)
        one = _run(lay, [0, lay.seq_length], **kw)
        for a, b in zip(plain, one):
            for x, y in zip(a[1:], b[1:]):
                torch.testing.assert_close(x, y, rtol=1e-14, atol=1e-14)
        bounds = parse_cu_seqlens([0, lay.seq_length], seq_length=lay.seq_length, batch=2)
        for r in range(lay.world_size):
            old = build_schedule(lay, r, kw["chunks"])
            new = document_schedule(lay, r, bounds, kw["chunks"])
            assert [(x.sends, x.recvs) for x in old.steps] == [
                (x.sends, x.recvs) for x in new.steps
            ]
            for x, y in zip(old.steps, new.steps):
                assert x.calls == tuple((w.row_lo, w.row_hi, w.key_hi) for w in y.windows or ())


# ---- byte and pair counts ----------------------------------------------------------------------
def _stats_case() -> tuple[Layout, list[int]]:
    # groups [2, 1, 1]; documents [0, 5) [5, 6) [6, 14) [14, 24)
    lay = make_layout(
        seq_length=24,
        num_attention_heads=4,
        num_query_groups=2,
        group_sizes=[2, 1, 1],
        segments=[[(0, 4), (12, 14)], [(4, 8)], [(8, 12), (20, 24)], [(14, 20)]],
        heads=[[0, 1], [2, 3], [0, 1, 2, 3], [0, 1, 2, 3]],
    )
    return lay, [0, 5, 6, 14, 24]


def test_stats_count_pruned_bytes_pairs_and_backward(_sim_dist) -> None:
    lay, cu = _stats_case()
    B, D, S = 2, 4, lay.seq_length
    full = [CommStats() for _ in range(4)]
    docs = [CommStats() for _ in range(4)]
    _run(lay, None, chunks=2, kernel="reference", batch=B, seed=0, head_dim=D, stats=full)
    _run(lay, cu, chunks=2, kernel="reference", batch=B, seed=0, head_dim=D, stats=docs)
    doc = _positions_docs(tuple(cu), S)
    for stats, same_doc in ((full, lambda x, y: True), (docs, lambda x, y: doc[x] == doc[y])):
        pairs = 0
        for st in stats:
            # backward: the all-to-all's dual and the K/V re-fetch are counted, dK/dV mirror K/V
            assert st.total_sent("a2a_bwd") == st.total_received("a2a")
            assert st.total_received("a2a_bwd") == st.total_sent("a2a")
            assert st.total_sent("kv_bwd") == st.total_sent("kv")
            assert st.total_sent("dkv") == st.total_received("kv")
            pairs += st.pairs["local"] + st.pairs["remote"]
        # every visible (query, key) pair once per sample and query head, summed over the ranks
        visible = sum(1 for x in range(S) for y in range(x + 1) if same_doc(x, y))
        assert pairs == visible * B * lay.num_attention_heads
    # K/V bytes received: per (receiver, source group) the source tokens a query of mine sees,
    # for my K/V heads, K and V, B samples, D, 8 bytes
    for stats, same_doc in ((full, lambda x, y: True), (docs, lambda x, y: doc[x] == doc[y])):
        for r, st in enumerate(stats):
            mine = lay.ranks[r].group
            gpos = runs_positions(group_runs(lay, mine))
            want = 0
            for g in lay.groups:
                if g.id != mine and lay.ranks[r].heads:
                    spos = runs_positions(group_runs(lay, g.id))
                    seen = {y for y in spos for x in gpos if y < x and same_doc(x, y)}
                    want += len(seen) * len(lay.kv_heads(r)) * 2 * B * D * 8
            assert st.total_received("kv") == want, r
    assert sum(s.total_received("kv") for s in docs) < sum(s.total_received("kv") for s in full)
    assert sum(s.calls["remote"] for s in docs) <= sum(s.calls["remote"] for s in full) + 4


def test_rank_counts_equal_the_runtime_stats(_sim_dist) -> None:
    """``counts.rank_counts`` (no processes) predicts every ``CommStats`` total of every rank."""
    rng = random.Random(23)
    for i in range(24):
        lay = random_layout(rng, rng.randint(1, 6))
        batch, chunks, D = 1 + i % 2, 1 + i % 3, 4
        cu = None if i % 4 == 0 else random_bounds(rng, lay)
        stats = [CommStats() for _ in range(lay.world_size)]
        _run(lay, cu, chunks=chunks, kernel="auto", batch=batch, seed=i, head_dim=D, stats=stats)
        bounds = (
            None if cu is None else parse_cu_seqlens(cu, seq_length=lay.seq_length, batch=batch)
        )
        for r, st in enumerate(stats):
            want = rank_counts(
                lay,
                r,
                documents=bounds,
                comm_chunks=chunks,
                batch=batch,
                head_dim=D,
                element_bytes=8,
            )
            for kind in want.sent:
                assert st.total_sent(kind) == want.sent[kind], (i, r, kind)
                assert st.total_received(kind) == want.received[kind], (i, r, kind)
            for name in ("blocks", "calls", "pairs"):
                got = {k: v for k, v in getattr(st, name).items() if v}
                assert got == {k: v for k, v in getattr(want, name).items() if v}, (i, r, name)


# ---- the variable-length (CUDA) path, emulated on CPU (tests/varlen_standin.py) -----------------
def test_varlen_path_emulated_on_cpu(_sim_dist, monkeypatch: pytest.MonkeyPatch) -> None:
    """The packing, GQA (one call per head segment, K/V at G heads), scatter and LSE merge of the
    CUDA path, exact."""
    calls = []
    monkeypatch.setattr(varlen, "uses_varlen", lambda kernel: True)
    monkeypatch.setattr(
        varlen,
        "_varlen_ops",
        lambda: (lambda *a, **k: calls.append(a[0].is_contiguous()) or flash_forward(*a, **k),
                 flash_backward),
    )  # fmt: skip
    rng = random.Random(41)
    for i in range(16):
        lay = random_layout(rng, rng.randint(1, 5))
        batch = 1 + i % 2
        cu = (
            [random_bounds(rng, lay) for _ in range(batch)]
            if i % 3 == 0
            else random_bounds(rng, lay)
        )
        _run(lay, cu, chunks=1 + i % 2, kernel="reference", batch=batch, seed=i)
    assert True in calls and False in calls  # whole-head calls and head-segment slices


def test_varlen_path_on_meta_tensors() -> None:
    """The real ``aten`` variable-length ops accept what the CUDA path builds (shapes, dtypes)."""
    from megatron_hexiseq.attention.peers import Window

    S, T, B, H, G, D = 10, 7, 2, 4, 2, 8
    meta = dict(device="meta", dtype=torch.bfloat16)
    for of_head in ((0, 0, 1, 1), (1, 0, 0, 1)):  # aligned; out of order (two segments)
        wk = varlen.WindowKernel(Kernel.FLASH, 0.3, kv_map(of_head, G), {})
        q = torch.empty(S, B, H, D, **meta)
        k = torch.empty(S, B, G, D, **meta)
        local = (Window(None, 0, 4, 0, 4), Window(None, 4, 10, 4, 10))
        out, lse = varlen.local_forward(wk, local, q, k, k)
        assert out.shape == (S, B, H, D) and lse.shape == (S, B, H)
        assert out.dtype == lse.dtype == torch.float32
        kb = torch.empty(T, B, G, D, **meta)
        remote = (Window(0, 0, 3, 0, 2), Window(1, 5, 9, 1, 7))
        varlen.merge_forward(wk, remote, 0, q, kb, kb, out, lse)
        dq = torch.zeros(S, B, H, D, device="meta")
        dk, dv = varlen.windows_backward(wk, remote, 0, q, q, kb, kb, q, lse, dq, causal=False)
        assert dk.shape == dv.shape == (T, B, G, D)
        meta_dev = torch.device("meta")
        assert set(wk.cache) == {("local", B, meta_dev), (0, B, meta_dev), ("local", B, "in place")}


class _Recorder(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []
        self.max_numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.max_numel = max(self.max_numel, t.numel())
        return out


@pytest.mark.parametrize("emulated_varlen", [False, True])
def test_hot_path_reuses_the_micro_batch_schedule(
    _sim_dist, monkeypatch: pytest.MonkeyPatch, emulated_varlen: bool
) -> None:
    """A second layer (call) of the same micro-batch builds no tensor from host data (on a GPU a
    host-to-device copy): schedules and packed index tensors are cached per boundaries. On the
    loop path no tensor has S x T elements per head pair (no mask, no scores)."""
    if emulated_varlen:
        monkeypatch.setattr(varlen, "uses_varlen", lambda kernel: True)
        monkeypatch.setattr(varlen, "_varlen_ops", lambda: (flash_forward, flash_backward))
    lay = make_layout(
        seq_length=96,
        num_attention_heads=8,
        num_query_groups=2,
        group_sizes=[2, 1, 1],
        segments=[[(0, 10), (70, 80)], [(10, 20), (80, 96)], [(20, 45)], [(45, 70)]],
        heads=[[0, 2, 5, 7], [1, 3, 4, 6], list(range(8)), list(range(8))],
    )
    cu = [0, 7, 10, 11, 30, 46, 71, 90, 96]
    sim = NcclSim(lay.world_size)
    comm.dist, groups_mod.dist = sim, sim

    def fn(r: int) -> _Recorder:
        groups = build_hexiseq_groups(lay)
        s = lay.ranks[r].num_tokens
        rec = _Recorder()
        for call in range(2):
            q = torch.randn(s, 1, 8, 8, dtype=torch.float64, requires_grad=True)
            k, v = (torch.randn(s, 1, 2, 8, dtype=torch.float64, requires_grad=True) for _ in "kv")
            with rec if call == 1 else contextlib.nullcontext():
                out = hexiseq_attn_func(
                    q, k, v, groups=groups, kernel="cpu-flash", cu_seqlens=list(cu)
                )
                out.sum().backward()
        return rec

    for r, rec in enumerate(sim.run(fn)):
        assert rec.ops and "aten.lift_fresh.default" not in rec.ops, r
        if not emulated_varlen:
            assert rec.max_numel <= 96 * 8 * 8, (r, rec.max_numel)


# ---- gloo processes ----------------------------------------------------------------------------
def _gloo_worker(rank: int, world: int, cases: list) -> int:
    for lay, cu, batch, chunks, kernel in cases:
        gen = torch.Generator().manual_seed(1)
        S, H, G, D = lay.seq_length, lay.num_attention_heads, lay.num_query_groups, 4
        q, k, v = (
            torch.randn(S, batch, n, D, generator=gen, dtype=torch.float64).requires_grad_()
            for n in (H, G, G)
        )
        dout = torch.randn(S, batch, H * D, generator=gen, dtype=torch.float64)
        ref = reference_attention(q, k, v, cu_seqlens=cu)
        ref.backward(dout)
        groups = build_hexiseq_groups(lay)
        pos = torch.tensor(lay.ranks[rank].positions(), dtype=torch.long)
        ql, kl, vl = (x.detach()[pos].requires_grad_() for x in (q, k, v))
        out = hexiseq_attn_func(
            ql, kl, vl, groups=groups, kernel=kernel, comm_chunks=chunks, cu_seqlens=cu
        )
        out.backward(dout[pos])
        for got, want in zip((out, ql.grad, kl.grad, vl.grad), (ref, q.grad, k.grad, v.grad)):
            torch.testing.assert_close(got, want.detach()[pos], **TOL)
    return len(cases)


def test_documents_on_gloo_processes() -> None:
    lay, cu = _stats_case()
    per_sample = [[0, 1, 2, 3, 12, 24], [0, 14, 20, 24]]  # 1-token documents; segment edges
    cases = [
        (lay, cu, 2, 1, "reference"),
        (lay, per_sample, 2, 3, "auto"),
        (lay, [0, 24], 1, 2, "auto"),
    ]
    assert run_ranks(_gloo_worker, 4, cases) == [3] * 4


# ---- GPU ---------------------------------------------------------------------------------------
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_flash_varlen_on_cuda() -> None:
    """bf16 flash varlen windows (local causal + a received block, aligned and out-of-order GQA)
    against the float64 loop of reference calls on the same rounded inputs."""
    from megatron_hexiseq.attention.kernel_check import (
        BACKWARD_ROUNDINGS,
        FORWARD_ROUNDINGS,
        normwise_bound,
        normwise_error,
    )
    from megatron_hexiseq.attention.peers import Window

    gen = torch.Generator().manual_seed(0)
    S, T, B, H, G, D = 300, 200, 2, 4, 2, 64
    local = (
        Window(None, 0, 1, 0, 1),
        Window(None, 1, 120, 1, 120),
        Window(None, 120, 300, 120, 300),
    )
    remote = (Window(0, 0, 100, 0, 50), Window(1, 10, 60, 20, 200), Window(None, 150, 300, 0, 200))
    for of_head in ((0, 0, 1, 1), (1, 0, 0, 1)):  # aligned; out of order (two segments)
        x = [torch.randn(n, B, h, D, generator=gen).bfloat16() for n, h in ((S, H), (S, G), (S, G))]
        kb, vb = (torch.randn(T, B, G, D, generator=gen).bfloat16() for _ in range(2))
        dout = torch.randn(S, B, H, D, generator=gen).bfloat16()
        results = {}
        for kernel, dev, dt in (
            (Kernel.FLASH, "cuda", torch.bfloat16),
            (Kernel.REFERENCE, "cpu", torch.float64),
        ):
            wk = varlen.WindowKernel(kernel, D**-0.5, kv_map(of_head, G), {})
            q, k, v = (t.to(dev, dt) for t in x)
            kk, vv, do = kb.to(dev, dt), vb.to(dev, dt), dout.to(dev, dt)
            out, lse = varlen.local_forward(wk, local, q, k, v)
            varlen.merge_forward(wk, remote, 0, q, kk, vv, out, lse)
            final = out.to(dt)
            dq = torch.zeros(S, B, H, D, device=dev, dtype=out.dtype)
            dk, dv = varlen.windows_backward(
                wk, local, "local", do, q, k, v, final, lse, dq, causal=True
            )
            dkb, dvb = varlen.windows_backward(
                wk, remote, 0, do, q, kk, vv, final, lse, dq, causal=False
            )
            results[kernel] = [t.double().cpu() for t in (out, dq, dk, dv, dkb, dvb)]
        for i, (got, want) in enumerate(zip(results[Kernel.FLASH], results[Kernel.REFERENCE])):
            rounds = FORWARD_ROUNDINGS if i == 0 else BACKWARD_ROUNDINGS
            bound = normwise_bound(torch.bfloat16, roundings=rounds, reduction=S + T)
            assert normwise_error(got, want) <= bound, (i, normwise_error(got, want), bound)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_documents_end_to_end_flash_on_cuda(_sim_dist) -> None:
    """The whole runtime (threads under the NCCL-rule simulator, one GPU) with ``flash`` in bf16 on
    random layouts x boundaries x comm_chunks, against the float64 document-masked oracle on the
    same bf16-rounded inputs, within the normwise bounds of ``kernel_check``."""
    from megatron_hexiseq.attention.kernel_check import (
        BACKWARD_ROUNDINGS,
        FORWARD_ROUNDINGS,
        normwise_bound,
        normwise_error,
    )

    rng = random.Random(5)
    for i in range(6):
        lay = random_layout(rng, rng.randint(2, 5), seq_length=rng.randint(300, 700), heads=(8, 2))
        cu = random_bounds(rng, lay)
        B, D = 1 + i % 2, 64
        gen = torch.Generator().manual_seed(i)
        S, H, G = lay.seq_length, lay.num_attention_heads, lay.num_query_groups
        q, k, v = (
            torch.randn(S, B, n, D, generator=gen).bfloat16().double().requires_grad_()
            for n in (H, G, G)
        )
        dout = torch.randn(S, B, H * D, generator=gen).bfloat16().double()
        ref = reference_attention(q, k, v, cu_seqlens=cu)
        ref.backward(dout)
        sim = NcclSim(lay.world_size)
        comm.dist, groups_mod.dist = sim, sim

        def fn(r: int, lay=lay, cu=cu, q=q, k=k, v=v, dout=dout, i=i):
            groups = build_hexiseq_groups(lay)
            pos = torch.tensor(lay.ranks[r].positions(), dtype=torch.long)
            ql, kl, vl = (x.detach()[pos].bfloat16().cuda().requires_grad_() for x in (q, k, v))
            out = hexiseq_attn_func(
                ql, kl, vl, groups=groups, kernel="flash", comm_chunks=1 + i % 3, cu_seqlens=cu
            )
            # the backward on this rank's thread: autograd's shared CUDA device thread would carry
            # no simulated rank (and one rank's wait would block the others' backward)
            with torch.autograd.set_multithreading_enabled(False):
                out.backward(dout[pos].bfloat16().cuda())
            return pos, [t.detach().double().cpu() for t in (out, ql.grad, kl.grad, vl.grad)]

        for pos, got in sim.run(fn):
            for name, g, want in zip(("out", "dq", "dk", "dv"), got, (ref, q.grad, k.grad, v.grad)):
                rounds = FORWARD_ROUNDINGS if name == "out" else BACKWARD_ROUNDINGS
                bound = normwise_bound(torch.bfloat16, roundings=rounds, reduction=S)
                err = normwise_error(g, want.detach()[pos])
                assert err <= bound, (i, name, err, bound)
