"""Layer (a): attention pieces without processes — block kernels, LSE merge, oracle, peer tables.

Block kernels are checked against plain autograd attention of one masked block (including rows with
no visible key and GQA), and blockwise merge + recompute backward against full attention. The peer
tables (pure functions of a layout) are checked for coverage, trimming, determinism and balance.
"""
from __future__ import annotations

import math
import random

import pytest
import torch

from megatron_hexiseq.attention.kernels import block_backward, block_forward, merge_into, visible_mask
from megatron_hexiseq.attention.peers import (build_schedule, build_transfers, group_pieces, group_runs, runs_num_tokens,
                                              runs_positions, split_runs, trim_runs)
from megatron_hexiseq.attention.reference import reference_attention
from megatron_hexiseq.attention.testing_layouts import random_layout
from megatron_hexiseq.layout import make_layout

TOL = {torch.float64: dict(rtol=1e-10, atol=1e-10), torch.float32: dict(rtol=1e-5, atol=1e-5)}


def _plain_block(q, k, v, mask, kv_of_head, scale):
    """Autograd oracle of one block: out [S,B,H,D] (0 for rows without keys), lse [S,B,H]."""
    kx, vx = k.index_select(2, kv_of_head), v.index_select(2, kv_of_head)
    s = torch.einsum("sbhd,tbhd->bhst", q, kx) * scale
    s = s.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - torch.where(torch.isinf(lse), 0.0, lse)[..., None])
    return torch.einsum("bhst,tbhd->sbhd", p, vx), lse.permute(2, 0, 1)


@pytest.mark.parametrize("kernel", ["reference", "sdpa"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_block_forward_with_empty_rows_and_gqa(kernel: str, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    S, T, B, H, G, D = 7, 9, 2, 6, 2, 4
    q = torch.randn(S, B, H, D, generator=gen, dtype=torch.float64)
    k = torch.randn(T, B, G, D, generator=gen, dtype=torch.float64)
    v = torch.randn(T, B, G, D, generator=gen, dtype=torch.float64)
    q_pos = torch.tensor([3, 20, 8, 0, 15, 4, 11])   # unsorted, like a group sequence
    k_pos = torch.tensor([5, 6, 7, 12, 13, 1, 2, 30, 9])
    mask = visible_mask(q_pos, k_pos)
    assert not mask[3].any()  # position 0 sees no key of this block
    kv_of_head = torch.tensor([0, 0, 0, 1, 1, 1])
    out, lse = block_forward(q.to(dtype), k.to(dtype), v.to(dtype), mask_ST=mask, kv_of_head_H=kv_of_head,
                             scale=0.3, kernel=kernel)
    want_out, want_lse = _plain_block(q, k, v, mask, kv_of_head, 0.3)
    torch.testing.assert_close(out.double(), want_out, **TOL[dtype])
    torch.testing.assert_close(lse.double(), want_lse, **TOL[dtype])
    assert torch.isinf(lse[3]).all() and (out[3] == 0).all()


@pytest.mark.parametrize("kernel", ["reference", "sdpa"])
def test_blockwise_merge_and_recompute_backward_equal_full_attention(kernel: str) -> None:
    """Split the keys into 3 blocks (one full, one partial, one with key-less rows), merge, backprop."""
    gen = torch.Generator().manual_seed(1)
    S, B, H, G, D = 12, 2, 4, 2, 3
    scale = 1 / math.sqrt(D)
    q, k, v = (torch.randn(S, B, n, D, generator=gen, dtype=torch.float64, requires_grad=True) for n in (H, G, G))
    dout = torch.randn(S, B, H * D, generator=gen, dtype=torch.float64)
    ref = reference_attention(q, k, v, softmax_scale=scale)
    ref.backward(dout)
    pos = torch.arange(S)
    q_rows = torch.tensor([4, 5, 6, 7, 8, 9, 10, 11])  # queries 4..11 ("my group")
    blocks = [torch.tensor([4, 5, 6, 7, 8, 9, 10, 11]), torch.tensor([0, 1, 2]), torch.tensor([3])]
    kv_of_head = torch.tensor([0, 0, 1, 1])
    qd, kd, vd = q.detach(), k.detach(), v.detach()
    out = lse = None
    for i, cols in enumerate(blocks):
        mask = None if i == 1 else visible_mask(pos[q_rows], pos[cols])
        o, l = block_forward(qd[q_rows], kd[cols], vd[cols], mask_ST=mask, kv_of_head_H=kv_of_head, scale=scale,
                             kernel=kernel)
        out, lse = (o, l) if out is None else merge_into(out, lse, o, l)
    torch.testing.assert_close(out.reshape(len(q_rows), B, H * D), ref.detach()[q_rows], rtol=1e-10, atol=1e-10)
    do = dout[q_rows].view(len(q_rows), B, H, D)
    delta = (do * out).sum(-1)
    dq = torch.zeros_like(qd[q_rows])
    dk, dv = torch.zeros_like(kd), torch.zeros_like(vd)
    for i, cols in enumerate(blocks):
        mask = None if i == 1 else visible_mask(pos[q_rows], pos[cols])
        gq, gk, gv = block_backward(do, qd[q_rows], kd[cols], vd[cols], out, lse, delta, mask_ST=mask,
                                    kv_of_head_H=kv_of_head, scale=scale, kernel=kernel)
        dq += gq
        dk[cols] += gk
        dv[cols] += gv
    # queries 0..3 (not computed here) contribute to dk/dv of keys 0..3; subtract them via the oracle
    q2, k2, v2 = (x.detach().clone().requires_grad_() for x in (q, k, v))
    part = reference_attention(q2, k2, v2, softmax_scale=scale)[:4]
    part.backward(dout[:4])
    torch.testing.assert_close(dq, q.grad[q_rows], rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(dk, k.grad - k2.grad, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(dv, v.grad - v2.grad, rtol=1e-10, atol=1e-10)


def test_reference_attention_matches_torch_causal_sdpa() -> None:
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(10, 2, 6, 4, generator=gen, dtype=torch.float64)
    k = torch.randn(10, 2, 3, 4, generator=gen, dtype=torch.float64)
    v = torch.randn(10, 2, 3, 4, generator=gen, dtype=torch.float64)
    want = torch.nn.functional.scaled_dot_product_attention(
        q.permute(1, 2, 0, 3), k.permute(1, 2, 0, 3), v.permute(1, 2, 0, 3), is_causal=True, enable_gqa=True)
    torch.testing.assert_close(reference_attention(q, k, v), want.permute(2, 0, 1, 3).reshape(10, 2, 24))


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
        assert transfers == build_transfers(lay, chunks)[0]  # deterministic
        for r in lay.ranks:
            g = lay.group(r.group)
            kv_r = lay.kv_heads(r.rank)
            got: dict[int, list[int]] = {}  # source group -> positions received per head
            for x in transfers:
                if x.dst != r.rank:
                    continue
                src_group = lay.ranks[x.src].group
                assert src_group != r.group
                assert [lay.kv_heads(x.src)[i] for i in x.src_heads] == [kv_r[i] for i in x.dst_heads]
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
                for o in lay.groups if o.id != g.id)


def test_holders_are_balanced_and_zero_head_ranks_idle() -> None:
    # group 0 (ranks 0,1) both hold K/V head 0 (MQA); group 1 (ranks 2,3) both need it
    lay = make_layout(seq_length=8, num_attention_heads=4, num_query_groups=1, group_sizes=[2, 2],
                      segments=[[(0, 2)], [(2, 4)], [(4, 6)], [(6, 8)]], heads=[[0, 1], [2, 3], [0, 1, 2, 3], []])
    transfers, _ = build_transfers(lay)
    assert {(x.src, x.dst) for x in transfers} == {(0, 2)}  # rank 3 has no heads: receives nothing
    lay2 = make_layout(seq_length=8, num_attention_heads=4, num_query_groups=1, group_sizes=[2, 2],
                       segments=[[(0, 2)], [(2, 4)], [(4, 6)], [(6, 8)]], heads=[[0, 1], [2, 3], [0, 1], [2, 3]])
    transfers, _ = build_transfers(lay2)
    assert {(x.src, x.dst) for x in transfers} == {(0, 2), (1, 3)}  # one holder each: balanced
    sched = build_schedule(lay, 3)
    assert sched.steps == () and sched.heads == ()


def test_schedule_marks_full_blocks() -> None:
    # group 1 [6, 12) sees group 0's tokens [0, 6) fully; group 0 sees nothing of group 1
    lay = make_layout(seq_length=12, num_attention_heads=2, num_query_groups=2, group_sizes=[1, 1],
                      segments=[[(0, 6)], [(6, 12)]], heads=[[0, 1], [0, 1]])
    s0, s1 = build_schedule(lay, 0, 2), build_schedule(lay, 1, 2)
    assert all(not st.computes for st in s0.steps) and len(s0.steps) == 2  # rank 0 only sends
    assert [st.rows for st in s1.steps] == [(0, 0), (0, 0)]  # every query row sees every key
    assert [runs_positions(st.k_runs) for st in s1.steps] == [[0, 1, 2], [3, 4, 5]]


def test_zigzag_ring_rows_split_like_megatron() -> None:
    """Even 2-rank zig-zag ring: rank 0's early chunk sees nothing of rank 1, its late chunk all."""
    lay = make_layout(seq_length=8, num_attention_heads=2, num_query_groups=1, group_sizes=[1, 1],
                      segments=[[(0, 2), (6, 8)], [(2, 6)]], heads=[[0, 1], [0, 1]])
    (st0,), (st1,) = build_schedule(lay, 0).steps, build_schedule(lay, 1).steps
    assert st0.rows == (2, 2) and runs_positions(st0.k_runs) == [2, 3, 4, 5]
    assert st1.rows == (0, 0) and runs_positions(st1.k_runs) == [0, 1]  # [6, 8) is hidden: not sent
    # a partial block: 3 query rows, keys [2, 6): row 4 sees some, row 7 all, row 0 none
    lay2 = make_layout(seq_length=8, num_attention_heads=1, num_query_groups=1, group_sizes=[1, 1],
                       segments=[[(0, 1), (4, 5), (7, 8)], [(1, 4), (5, 7)]], heads=[[0], [0]])
    assert build_schedule(lay2, 0).steps[0].rows == (1, 2)


def test_group_sequence_is_in_position_order() -> None:
    lay = make_layout(seq_length=10, num_attention_heads=2, num_query_groups=1, group_sizes=[2, 1],
                      segments=[[(0, 2), (5, 7)], [(2, 4)], [(4, 5), (7, 10)]], heads=[[0], [1], [0, 1]])
    assert group_pieces(lay, 0) == ((0, 0, 2, 0), (1, 0, 2, 2), (0, 2, 4, 4))
    assert group_runs(lay, 0) == ((0, 4, 0), (4, 6, 5))  # [0,2) and [2,4) touch: one run
    assert runs_positions(group_runs(lay, 1)) == [4, 7, 8, 9]


@pytest.mark.parametrize("kernel", ["reference", "sdpa"])
def test_causal_block_equals_masked_block(kernel: str) -> None:
    gen = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(6, 2, 3, 4, generator=gen, dtype=torch.float64) for _ in range(3))
    pos = torch.arange(6)
    o1, l1 = block_forward(q, k, v, mask_ST=None, causal=True, kv_of_head_H=None, scale=0.5, kernel=kernel)
    o2, l2 = block_forward(q, k, v, mask_ST=visible_mask(pos, pos), kv_of_head_H=None, scale=0.5, kernel="reference")
    torch.testing.assert_close(o1, o2)
    torch.testing.assert_close(l1, l2)
