"""Layer (a): attention pieces without processes — block kernels, LSE merge, oracle, peer tables.

Every CPU kernel is checked against plain autograd attention of one block (square causal and
non-square full, GQA), forward and backward; the mask-free block calls of a schedule, merged by LSE,
against full single-device attention; the kernel dispatch and its start-up check; the peer tables
(pure functions of a layout) for coverage, trimming, balance and visible prefixes, and the same
table in three plain Python subprocesses with different hash seeds (the only processes here: no ranks).
Tolerances: float64 1e-10 (a few hundred roundings of 1.1e-16), float32 1e-5 relative to a float64
oracle (reductions of <= 40 terms, u = 6e-8).
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from megatron_hexiseq.attention.kernel_check import check_kernel, normwise_bound, normwise_error
from megatron_hexiseq.attention.kernels import (
    Kernel,
    block_backward,
    block_forward,
    merge_into,
    parse_kernel,
    resolve_kernel,
)
from megatron_hexiseq.attention.peers import (
    block_calls,
    build_schedule,
    build_transfers,
    group_pieces,
    group_runs,
    runs_num_tokens,
    runs_positions,
    split_runs,
    trim_runs,
)
from megatron_hexiseq.attention.reference import reference_attention
from megatron_hexiseq.attention.testing_layouts import random_layout
from megatron_hexiseq.errors import HexiSeqError
from megatron_hexiseq.layout import make_layout

TOL = {torch.float64: dict(rtol=1e-10, atol=1e-10), torch.float32: dict(rtol=1e-5, atol=1e-5)}
CPU_KERNELS = (Kernel.REFERENCE, Kernel.CPU_FLASH)


def _plain_block(q, k, v, kv_of_head, scale, causal):
    """Autograd oracle of one block: out [S,B,H,D], lse [S,B,H] (float64 einsum, explicit mask)."""
    kx, vx = k.index_select(2, kv_of_head), v.index_select(2, kv_of_head)
    s = torch.einsum("sbhd,tbhd->bhst", q, kx) * scale
    if causal:
        s = s.masked_fill(~torch.ones(s.shape[-2:], dtype=torch.bool).tril(), float("-inf"))
    lse = torch.logsumexp(s, -1)
    return torch.einsum("bhst,tbhd->sbhd", torch.exp(s - lse[..., None]), vx), lse.permute(2, 0, 1)


@pytest.mark.parametrize("kernel", CPU_KERNELS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("causal", [True, False])
def test_block_kernels_match_plain_autograd(
    kernel: Kernel, dtype: torch.dtype, causal: bool
) -> None:
    """One block, GQA (6 query heads on 2 K/V heads): forward and the recompute backward (with the
    block's own out/lse as the final ones) equal autograd of plain attention."""
    gen = torch.Generator().manual_seed(0)
    S, B, H, G, D = 7, 2, 6, 2, 4
    T = S if causal else 9
    q = torch.randn(S, B, H, D, generator=gen, dtype=torch.float64, requires_grad=True)
    k, v = (
        torch.randn(T, B, G, D, generator=gen, dtype=torch.float64, requires_grad=True)
        for _ in range(2)
    )
    dout = torch.randn(S, B, H, D, generator=gen, dtype=torch.float64)
    kv_of_head = torch.tensor([0, 0, 0, 1, 1, 1])
    want_out, want_lse = _plain_block(q, k, v, kv_of_head, 0.3, causal)
    want_out.backward(dout)
    kw = dict(causal=causal, kv_of_head_H=kv_of_head, scale=0.3, kernel=kernel)
    ql, kl, vl = (x.detach().to(dtype) for x in (q, k, v))
    out, lse = block_forward(ql, kl, vl, **kw)
    torch.testing.assert_close(out.double(), want_out.detach(), **TOL[dtype])
    torch.testing.assert_close(lse.double(), want_lse.detach(), **TOL[dtype])
    final = out.to(dtype) if kernel is not Kernel.REFERENCE else out
    dq, dk, dv = block_backward(dout.to(dtype), ql, kl, vl, final, lse, **kw)
    for got, want in zip((dq, dk, dv), (q.grad, k.grad, v.grad)):
        torch.testing.assert_close(got.double(), want, **TOL[dtype])


@pytest.mark.parametrize("kernel", CPU_KERNELS)
def test_mask_free_calls_merged_equal_full_attention(kernel: Kernel) -> None:
    """My group holds positions {2, 3, 7, 8, 9}; another group's block holds {0, 1, 4, 5, 6}. The
    local causal block plus the block's unmasked calls (run [2, 3] sees 2 keys, run [7, 9] all 5),
    merged by LSE, give the full attention of my rows; the recompute backward gives my dq and the
    block's dk/dv contributions from my queries."""
    gen = torch.Generator().manual_seed(1)
    S, B, H, G, D = 10, 2, 4, 2, 3
    scale = 1 / math.sqrt(D)
    q, k, v = (
        torch.randn(S, B, n, D, generator=gen, dtype=torch.float64, requires_grad=True)
        for n in (H, G, G)
    )
    dout = torch.randn(S, B, H * D, generator=gen, dtype=torch.float64)
    mine, other = [2, 3, 7, 8, 9], [0, 1, 4, 5, 6]
    ref = reference_attention(q, k, v, softmax_scale=scale)
    ref.backward(dout)
    q_runs, k_runs = ((0, 2, 2), (2, 5, 7)), ((0, 2, 0), (2, 5, 4))
    calls = block_calls(q_runs, k_runs)
    assert calls == ((0, 2, 2), (2, 5, 5))
    kv_of_head = torch.tensor([0, 0, 1, 1])
    kw = dict(kv_of_head_H=kv_of_head, scale=scale, kernel=kernel)
    qm, km, vm = (x.detach()[mine] for x in (q, k, v))
    kb, vb = (x.detach()[other] for x in (k, v))
    out, lse = block_forward(qm, km, vm, causal=True, **kw)
    for lo, hi, n in calls:
        o, l_ = block_forward(qm[lo:hi], kb[:n], vb[:n], causal=False, **kw)
        out[lo:hi], lse[lo:hi] = merge_into(out[lo:hi], lse[lo:hi], o, l_)
    torch.testing.assert_close(
        out.reshape(len(mine), B, H * D), ref.detach()[mine], **TOL[torch.float64]
    )
    do = dout[mine].view(len(mine), B, H, D)
    dq, dkm, dvm = block_backward(do, qm, km, vm, out, lse, causal=True, **kw)
    dkb, dvb = torch.zeros_like(kb), torch.zeros_like(vb)
    for lo, hi, n in calls:
        gq, gk, gv = block_backward(
            do[lo:hi], qm[lo:hi], kb[:n], vb[:n], out[lo:hi], lse[lo:hi], causal=False, **kw
        )
        dq[lo:hi] += gq
        dkb[:n] += gk
        dvb[:n] += gv
    # the other group's queries contribute to dk/dv too: subtract them with the oracle on their rows
    q2, k2, v2 = (x.detach().clone().requires_grad_() for x in (q, k, v))
    reference_attention(q2, k2, v2, softmax_scale=scale)[other].backward(dout[other])
    torch.testing.assert_close(dq, q.grad[mine], **TOL[torch.float64])
    for got_m, got_b, full, part in ((dkm, dkb, k.grad, k2.grad), (dvm, dvb, v.grad, v2.grad)):
        torch.testing.assert_close(got_m, (full - part)[mine], **TOL[torch.float64])
        torch.testing.assert_close(got_b, (full - part)[other], **TOL[torch.float64])


def test_kernel_dispatch_by_device_and_dtype() -> None:
    cpu = torch.device("cpu")
    for dtype in (torch.float64, torch.float32, torch.bfloat16, torch.float16):
        assert resolve_kernel("auto", device=cpu, dtype=dtype, head_dim=64) is Kernel.CPU_FLASH
    assert parse_kernel("sdpa") is Kernel.AUTO  # the former name
    assert (
        resolve_kernel("reference", device=cpu, dtype=torch.bfloat16, head_dim=7)
        is Kernel.REFERENCE
    )
    for name in ("flash", "efficient", "flash-attn"):
        with pytest.raises(HexiSeqError, match=f"'{name}' runs on CUDA tensors"):
            resolve_kernel(name, device=cpu, dtype=torch.bfloat16, head_dim=64)
    with pytest.raises(HexiSeqError, match="unknown attention kernel 'fast'"):
        parse_kernel("fast")


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16])
def test_start_up_check_proves_cpu_kernel(dtype: torch.dtype) -> None:
    assert (
        check_kernel("auto", device=torch.device("cpu"), dtype=dtype, head_dim=16)
        is Kernel.CPU_FLASH
    )


def test_start_up_check_fails_in_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    import megatron_hexiseq.attention.kernels as kernels

    def broken(q, k, v, causal, scale):  # a kernel that drops the last key of every block
        r = q.shape[1] // k.shape[1]  # cpu-flash is called with native GQA: K/V at G heads
        k, v = (x[:, :, :-1].repeat_interleave(r, 1) for x in (k, v))
        return kernels._reference_forward(q, k, v, False, scale)

    def crashing(q, k, v, causal, scale):
        raise RuntimeError("no kernel image is available for execution on the device\nmore text")

    monkeypatch.setitem(kernels._FORWARD, Kernel.CPU_FLASH, broken)
    with pytest.raises(
        HexiSeqError,
        match=r"'cpu-flash' on cpu float32, head dim 16 failed its start-up check: "
        r"out of a causal block is off by",
    ) as err:
        check_kernel("auto", device=torch.device("cpu"), dtype=torch.float32, head_dim=16)
    assert "\n" not in str(err.value)
    monkeypatch.setitem(kernels._FORWARD, Kernel.CPU_FLASH, crashing)
    with pytest.raises(
        HexiSeqError,
        match=r"\(RuntimeError: no kernel image is available for execution on the "
        r"device\); choose another",
    ) as err:
        check_kernel("cpu-flash", device=torch.device("cpu"), dtype=torch.bfloat16, head_dim=16)
    assert "\n" not in str(err.value)


def test_normwise_bounds_follow_the_dtype() -> None:
    u_bf16 = torch.finfo(torch.bfloat16).eps / 2
    assert normwise_bound(torch.bfloat16, roundings=3, reduction=0) == 6 * u_bf16
    assert normwise_bound(torch.float32, roundings=3, reduction=10) == pytest.approx(
        2 * 13 * 2**-24
    )
    assert normwise_error(torch.tensor([1.0, 1.0]), torch.tensor([1.0, 0.0])) == 1.0


def test_reference_attention_matches_torch_causal_sdpa() -> None:
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(10, 2, 6, 4, generator=gen, dtype=torch.float64)
    k = torch.randn(10, 2, 3, 4, generator=gen, dtype=torch.float64)
    v = torch.randn(10, 2, 3, 4, generator=gen, dtype=torch.float64)
    want = torch.nn.functional.scaled_dot_product_attention(
        q.permute(1, 2, 0, 3),
        k.permute(1, 2, 0, 3),
        v.permute(1, 2, 0, 3),
        is_causal=True,
        enable_gqa=True,
    )
    torch.testing.assert_close(
        reference_attention(q, k, v), want.permute(2, 0, 1, 3).reshape(10, 2, 24)
    )


# ---- peer tables ------------------------------------------------------------------------------
def test_runs_helpers() -> None:
    runs = ((0, 3, 10), (3, 8, 2), (8, 9, 30))
    assert trim_runs(runs, 11) == ((0, 2, 10), (3, 8, 2))
    assert runs_positions(trim_runs(runs, 11)) == [10, 11, 2, 3, 4, 5, 6]
    pieces = split_runs(runs, 4)
    assert [runs_num_tokens(p) for p in pieces] == [3, 2, 2, 2]
    assert [x for p in pieces for x in runs_positions(p)] == runs_positions(runs)
    assert split_runs(((0, 2, 5),), 5) == [((0, 1, 5),), ((1, 2, 6),)]  # no empty pieces


@pytest.mark.parametrize("chunks", [1, 2, 3])
def test_transfers_cover_needed_heads_and_only_visible_tokens(chunks: int) -> None:
    rng = random.Random(7)
    for _ in range(40):
        lay = random_layout(rng, rng.randint(2, 8))
        transfers, num_steps = build_transfers(lay, chunks)
        for r in lay.ranks:
            g = lay.group(r.group)
            kv_r = lay.kv_heads(r.rank)
            got: dict[int, list[int]] = {}  # source group -> positions received per head
            for x in transfers:
                if x.dst != r.rank:
                    continue
                src_group = lay.ranks[x.src].group
                assert src_group != r.group
                assert [lay.kv_heads(x.src)[i] for i in x.src_heads] == [
                    kv_r[i] for i in x.dst_heads
                ]
                for i in x.dst_heads:
                    got.setdefault((src_group, kv_r[i]), []).extend(runs_positions(x.runs))
            max_q = max(e for s, e in lay.group_segments(g.id)) - 1
            for other in lay.groups:
                if other.id == g.id:
                    continue
                seq = runs_positions(group_runs(lay, other.id))
                visible = [p for p in seq if p <= max_q]
                for k in kv_r:  # each needed head: exactly the visible tokens, once, in order
                    assert got.get((other.id, k), []) == visible
            assert sum(len(v) for v in got.values()) == sum(
                len([p for p in runs_positions(group_runs(lay, o.id)) if p <= max_q]) * len(kv_r)
                for o in lay.groups
                if o.id != g.id
            )


_TABLES = """
import random, sys
from megatron_hexiseq.attention.peers import build_transfers
from megatron_hexiseq.attention.testing_layouts import random_layout
rng = random.Random(5)
for _ in range(20):
    lay = random_layout(rng, rng.randint(2, 8))
    print(build_transfers(lay, 2))
"""


def test_every_process_builds_the_same_transfer_table() -> None:
    """Each rank builds the table on its own and NCCL pairs P2P calls in posting order, so the table
    must not depend on anything that differs between processes: here the hash seed (set and dict
    iteration order of strings)."""
    import os
    import subprocess
    import sys

    out = [
        subprocess.run(
            [sys.executable, "-c", _TABLES],
            capture_output=True,
            text=True,
            check=True,
            env={**os.environ, "PYTHONHASHSEED": seed},
        ).stdout
        for seed in ("0", "1", "12345")
    ]
    assert out[0].count("\n") == 20 and out[0] == out[1] == out[2]


def test_holders_are_balanced_and_zero_head_ranks_idle() -> None:
    # group 0 (ranks 0,1) both hold K/V head 0 (MQA); group 1 (ranks 2,3) both need it
    lay = make_layout(
        seq_length=8,
        num_attention_heads=4,
        num_query_groups=1,
        group_sizes=[2, 2],
        segments=[[(0, 2)], [(2, 4)], [(4, 6)], [(6, 8)]],
        heads=[[0, 1], [2, 3], [0, 1, 2, 3], []],
    )
    transfers, _ = build_transfers(lay)
    assert {(x.src, x.dst) for x in transfers} == {(0, 2)}  # rank 3 has no heads: receives nothing
    lay2 = make_layout(
        seq_length=8,
        num_attention_heads=4,
        num_query_groups=1,
        group_sizes=[2, 2],
        segments=[[(0, 2)], [(2, 4)], [(4, 6)], [(6, 8)]],
        heads=[[0, 1], [2, 3], [0, 1], [2, 3]],
    )
    transfers, _ = build_transfers(lay2)
    assert {(x.src, x.dst) for x in transfers} == {(0, 2), (1, 3)}  # one holder each: balanced
    sched = build_schedule(lay, 3)
    assert sched.steps == () and sched.heads == ()


def test_schedule_marks_full_blocks() -> None:
    # group 1 [6, 12) sees group 0's tokens [0, 6) fully; group 0 sees nothing of group 1
    lay = make_layout(
        seq_length=12,
        num_attention_heads=2,
        num_query_groups=2,
        group_sizes=[1, 1],
        segments=[[(0, 6)], [(6, 12)]],
        heads=[[0, 1], [0, 1]],
    )
    s0, s1 = build_schedule(lay, 0, 2), build_schedule(lay, 1, 2)
    assert all(not st.computes for st in s0.steps) and len(s0.steps) == 2  # rank 0 only sends
    assert [st.calls for st in s1.steps] == [((0, 6, 3),), ((0, 6, 3),)]  # every row sees every key
    assert [runs_positions(st.k_runs) for st in s1.steps] == [[0, 1, 2], [3, 4, 5]]


def test_zigzag_ring_calls_split_like_megatron() -> None:
    """Even 2-rank zig-zag ring: rank 0's early chunk sees nothing of rank 1, its late chunk all."""
    lay = make_layout(
        seq_length=8,
        num_attention_heads=2,
        num_query_groups=1,
        group_sizes=[1, 1],
        segments=[[(0, 2), (6, 8)], [(2, 6)]],
        heads=[[0, 1], [0, 1]],
    )
    (st0,), (st1,) = build_schedule(lay, 0).steps, build_schedule(lay, 1).steps
    assert st0.calls == ((2, 4, 4),) and runs_positions(st0.k_runs) == [2, 3, 4, 5]
    assert st1.calls == ((0, 4, 2),) and runs_positions(st1.k_runs) == [
        0,
        1,
    ]  # [6, 8) is hidden: not sent
    # rows at positions 0 / 4 / 7 against keys {1, 2, 3, 5, 6}: none, a prefix of 3, all 5
    lay2 = make_layout(
        seq_length=8,
        num_attention_heads=1,
        num_query_groups=1,
        group_sizes=[1, 1],
        segments=[[(0, 1), (4, 5), (7, 8)], [(1, 4), (5, 7)]],
        heads=[[0], [0]],
    )
    assert build_schedule(lay2, 0).steps[0].calls == ((1, 2, 3), (2, 3, 5))


@pytest.mark.parametrize("chunks", [1, 2, 4])
def test_calls_are_the_visible_prefix_of_every_row(chunks: int) -> None:
    """For random layouts, every row of every call sees exactly the block's keys before it (brute
    force over positions), rows outside the calls see none, and every sent key is seen."""
    rng = random.Random(11)
    for _ in range(60):
        lay = random_layout(rng, rng.randint(2, 8))
        for r in lay.ranks:
            sched = build_schedule(lay, r.rank, chunks)
            q_pos = runs_positions(sched.q_runs)
            for st in sched.steps:
                if not st.computes:
                    continue
                k_pos = runs_positions(st.k_runs)
                assert k_pos == sorted(k_pos) and not set(k_pos) & set(q_pos)
                seen = [0] * len(q_pos)
                for lo, hi, n in st.calls:
                    for i in range(lo, hi):
                        seen[i] = n
                assert seen == [sum(p < qp for p in k_pos) for qp in q_pos]
                assert max(seen) == len(k_pos)


def test_group_sequence_is_in_position_order() -> None:
    lay = make_layout(
        seq_length=10,
        num_attention_heads=2,
        num_query_groups=1,
        group_sizes=[2, 1],
        segments=[[(0, 2), (5, 7)], [(2, 4)], [(4, 5), (7, 10)]],
        heads=[[0], [1], [0, 1]],
    )
    assert group_pieces(lay, 0) == ((0, 0, 2, 0), (1, 0, 2, 2), (0, 2, 4, 4))
    assert group_runs(lay, 0) == ((0, 4, 0), (4, 6, 5))  # [0,2) and [2,4) touch: one run
    assert runs_positions(group_runs(lay, 1)) == [4, 7, 8, 9]
