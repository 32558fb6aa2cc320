"""Layer (b): the ragged all-to-all autograd collective, and byte counting of HexiSeq attention.

One 4-rank gloo spawn runs everything: ``uneven_all_to_all`` forward/backward vs the expected
permutation of values (and identity for a size-1 group), the benchmark baselines (plain even Ulysses
and zig-zag ring) vs the oracle, then attention on hand-made layouts with a
``CommStats`` counter: causally hidden tokens are never sent (a group earlier than another receives no
K/V from it), receivers get exactly the K/V heads they need, and backward returns as many dK/dV bytes
as forward sent. Outputs/gradients are also checked against the single-process oracle.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_hexiseq.attention import (
    CommStats,
    build_hexiseq_groups,
    hexiseq_attn_func,
    reference_attention,
)
from megatron_hexiseq.attention.comm import uneven_all_to_all
from megatron_hexiseq.attention.ring import ring_attn_func
from megatron_hexiseq.attention.ulysses import ulysses_attn_func
from megatron_hexiseq.layout import make_layout
from megatron_hexiseq.testbed.spawn import run_ranks

B, D, F64 = 2, 3, 8  # batch, head dim, bytes per float64


def _check_all_to_all(rank: int, world: int) -> None:
    # rank r sends (r + j + 1) elements to rank j, each element = 100 * r + j (+ offset)
    send = [rank + j + 1 for j in range(world)]
    recv = [i + rank + 1 for i in range(world)]
    x = torch.cat(
        [
            torch.full((n,), 100.0 * rank + j, dtype=torch.float64) + torch.arange(n) / 10
            for j, n in enumerate(send)
        ]
    ).requires_grad_()
    y = uneven_all_to_all(x, group=dist.group.WORLD, send_splits=send, recv_splits=recv)
    want = torch.cat(
        [
            torch.full((n,), 100.0 * i + rank, dtype=torch.float64) + torch.arange(n) / 10
            for i, n in enumerate(recv)
        ]
    )
    torch.testing.assert_close(y, want)
    (
        y * torch.arange(y.numel(), dtype=torch.float64)
    ).sum().backward()  # grad of y[i] = its index on me
    # element e of my chunk for j lands on j at offset offs_j(rank) + e
    want_grad = torch.cat(
        [
            torch.arange(n, dtype=torch.float64) + sum(rank_i + j + 1 for rank_i in range(rank))
            for j, n in enumerate(send)
        ]
    )
    torch.testing.assert_close(x.grad, want_grad)
    z = torch.ones(3)  # no group (an A2A group of one rank) is the identity
    assert uneven_all_to_all(z, group=None, send_splits=[3], recv_splits=[3]) is z


def _attention_with_stats(lay, rank):
    groups = build_hexiseq_groups(lay)
    gen = torch.Generator().manual_seed(3)
    S, H, G = lay.seq_length, lay.num_attention_heads, lay.num_query_groups
    q, k, v = (
        torch.randn(S, B, n, D, generator=gen, dtype=torch.float64, requires_grad=True)
        for n in (H, G, G)
    )
    dout = torch.randn(S, B, H * D, generator=gen, dtype=torch.float64)
    ref = reference_attention(q, k, v)
    ref.backward(dout)
    pos = torch.tensor(lay.ranks[rank].positions(), dtype=torch.long)
    ql, kl, vl = (x.detach()[pos].clone().requires_grad_() for x in (q, k, v))
    stats = CommStats()
    out = hexiseq_attn_func(ql, kl, vl, groups=groups, stats=stats)
    out.backward(dout[pos])
    for got, want in zip((out, ql.grad, kl.grad, vl.grad), (ref.detach(), q.grad, k.grad, v.grad)):
        torch.testing.assert_close(got, want[pos], rtol=1e-10, atol=1e-10)
    return stats


def _plain(stats: CommStats) -> dict:
    return {
        "sent": {k: dict(v) for k, v in stats.sent.items()},
        "received": {k: dict(v) for k, v in stats.received.items()},
        "blocks": dict(stats.blocks),
    }


def _check_baselines(rank: int, world: int) -> None:
    """The benchmark's plain even Ulysses and zig-zag ring are exact too (fwd + bwd, GQA)."""
    S, H, G = 32, 8, 4
    gen = torch.Generator().manual_seed(5)
    q, k, v = (
        torch.randn(S, B, n, D, generator=gen, dtype=torch.float64, requires_grad=True)
        for n in (H, G, G)
    )
    dout = torch.randn(S, B, H * D, generator=gen, dtype=torch.float64)
    ref = reference_attention(q, k, v)
    ref.backward(dout)
    c = S // (2 * world)
    splits = {
        "ulysses": torch.arange(rank * 2 * c, (rank + 1) * 2 * c),
        "ring": torch.cat(
            [
                torch.arange(rank * c, (rank + 1) * c),
                torch.arange((2 * world - 1 - rank) * c, (2 * world - rank) * c),
            ]
        ),
    }
    for name, pos in splits.items():
        for kernel in ("reference", "auto"):
            if name == "ulysses" and kernel == "reference":
                continue  # Ulysses always runs torch's SDPA
            ql, kl, vl = (x.detach()[pos].clone().requires_grad_() for x in (q, k, v))
            if name == "ulysses":
                out = ulysses_attn_func(ql, kl, vl, group=dist.group.WORLD)
            else:
                out = ring_attn_func(ql, kl, vl, group=dist.group.WORLD, kernel=kernel)
            out.backward(dout[pos])
            for got, want in zip(
                (out, ql.grad, kl.grad, vl.grad), (ref.detach(), q.grad, k.grad, v.grad)
            ):
                torch.testing.assert_close(
                    got, want[pos], rtol=1e-10, atol=1e-10, msg=lambda m: f"{name}: {m}"
                )


def _worker(rank: int, world: int) -> list[dict]:
    _check_all_to_all(rank, world)
    _check_baselines(rank, world)
    # layout A: group 0 = ranks 0,1 holds the LATE tokens [8, 16); group 1 = ranks 2,3 the early [0, 8).
    # H=8, G=4 (2 query heads per K/V head): rank0 heads 0,1 (kv 0); rank1 heads 2-7 (kv 1,2,3);
    # rank2 heads 0-3 (kv 0,1); rank3 heads 4-7 (kv 2,3).
    lay_a = make_layout(
        seq_length=16,
        num_attention_heads=8,
        num_query_groups=4,
        group_sizes=[2, 2],
        segments=[[(8, 11)], [(11, 16)], [(0, 5)], [(5, 8)]],
        heads=[[0, 1], [2, 3, 4, 5, 6, 7], [0, 1, 2, 3], [4, 5, 6, 7]],
    )
    # layout B: group 1 ends at position 11, so it needs only group 0's tokens [6, 10), not [12, 16)
    lay_b = make_layout(
        seq_length=16,
        num_attention_heads=8,
        num_query_groups=4,
        group_sizes=[2, 2],
        segments=[[(6, 10)], [(12, 16)], [(0, 6)], [(10, 12)]],
        heads=[[0, 1], [2, 3, 4, 5, 6, 7], [0, 1, 2, 3], [4, 5, 6, 7]],
    )
    return [_plain(_attention_with_stats(lay_a, rank)), _plain(_attention_with_stats(lay_b, rank))]


def test_all_to_all_and_bytes() -> None:
    res = run_ranks(_worker, 4)
    a = [r[0] for r in res]
    kv = lambda tokens, heads: 2 * tokens * B * heads * D * F64  # noqa: E731  K and V
    # layout A, forward K/V: group 1 (early tokens) receives nothing; group 0 receives all 8 tokens of
    # group 1, only its own K/V heads, from the least-loaded holder
    assert a[2]["received"].get("kv", {}) == {} and a[3]["received"].get("kv", {}) == {}
    assert a[0]["received"]["kv"] == {2: kv(8, 1)}  # kv head 0 from rank 2
    assert a[1]["received"]["kv"] == {
        2: kv(8, 1),
        3: kv(8, 2),
    }  # kv 1 from rank 2, kv 2,3 from rank 3
    assert a[2]["sent"]["kv"] == {0: kv(8, 1), 1: kv(8, 1)} and a[3]["sent"]["kv"] == {1: kv(8, 2)}
    assert a[2]["blocks"] == {"local": 1} and a[0]["blocks"] == {"local": 1, "remote": 1}
    # backward: the same K/V fetched again, and the same bytes of dK/dV returned to the holders
    for r in range(4):
        assert a[r]["received"].get("kv_bwd", {}) == a[r]["received"].get("kv", {})
        assert a[r]["sent"].get("dkv", {}) == a[r]["received"].get("kv", {})
        assert a[r]["received"].get("dkv", {}) == a[r]["sent"].get("kv", {})
    # head all-to-all of rank 0 (3 tokens) to rank 1 (6 q heads + 2 x 3 kv heads), and the outputs
    # back (rank 1 sends rank 0's 3 tokens x 6 heads; rank 0 sends rank 1's 5 tokens x 2 heads)
    assert a[0]["sent"]["a2a"] == {1: 3 * B * D * (6 + 2 * 3) * F64 + 5 * B * 2 * D * F64}
    # layout B: group 1 (max position 11) receives group 0's tokens [6, 10) only (4 of 8)
    b = [r[1] for r in res]
    assert b[2]["received"]["kv"] == {
        0: kv(4, 1),
        1: kv(4, 1),
    }  # kv 0 from rank 0, kv 1 from rank 1
    assert b[3]["received"]["kv"] == {1: kv(4, 2)}
    assert b[0]["received"]["kv"] == {2: kv(8, 1)}  # group 1 is all in group 0's past


def test_stats_ignore_size_one_groups() -> None:
    """A world of one rank: no traffic is counted at all."""
    lay = make_layout(
        seq_length=5,
        num_attention_heads=2,
        num_query_groups=1,
        group_sizes=[1],
        segments=[[(0, 5)]],
        heads=[[0, 1]],
    )
    res = run_ranks(_one_worker, 1, lay)
    assert res == [{"sent": {}, "received": {}, "blocks": {"local": 1}}]


def _one_worker(rank: int, world: int, lay) -> dict:
    return _plain(_attention_with_stats(lay, rank))
