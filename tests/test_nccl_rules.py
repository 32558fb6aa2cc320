"""Layer (a), threads instead of processes: the real attention runtime under NCCL's rules.

``nccl_sim.NcclSim`` replaces ``torch.distributed`` inside ``attention.comm`` and ``attention.groups``
with communicators that follow NCCL: FIFO P2P matching per (communicator, src, dst) with tags
ignored (a matched pair with different tags is a logical mismatch), one serial stream per
communicator, lazy communicator creation (every member must join a group's first operation),
deadlock detection. The runtime itself is unchanged: ``build_hexiseq_groups`` (with its warm-up)
and ``hexiseq_attn_func`` forward and backward, on 200 seeded random layouts (uneven segments and
heads, GQA/MQA, 0-token and 0-head ranks, 2-8 ranks) for every ``comm_chunks`` in 1..4; each rank's
output and gradients are also compared with single-device float64 attention. The layouts rotate
float64 (both CPU kernels; tolerance 1e-10: float64 roundings of reductions over <= 60 tokens),
float32 (1e-5 relative and absolute: u = 6e-8 times the reduction, with margin) and bf16 (the
normwise bounds of ``attention.kernel_check``, oracle on the same bf16-rounded inputs), batch 1-2
and head dims 2-8: this is the broad correctness test of the runtime; tests/test_attention_ranks.py
repeats named cases and a few random ones on real gloo processes.

The simulator's own tests show that it fails on what it must catch: two ranks posting the same
pair of messages in different orders, a wait cycle, a group whose member never joins its first
batch, and the runtime with its group warm-up removed.
"""

from __future__ import annotations

import random

import pytest
import torch
from nccl_sim import NcclSim, SimError

import megatron_hexiseq.attention.comm as comm
import megatron_hexiseq.attention.groups as groups_mod
from megatron_hexiseq.attention import build_hexiseq_groups, hexiseq_attn_func, reference_attention
from megatron_hexiseq.attention.kernel_check import (
    BACKWARD_ROUNDINGS,
    FORWARD_ROUNDINGS,
    normwise_bound,
    normwise_error,
)
from megatron_hexiseq.attention.testing_layouts import random_layout
from megatron_hexiseq.layout import Layout, make_layout

LAYOUTS = 200
TOL = {torch.float64: dict(rtol=1e-10, atol=1e-10), torch.float32: dict(rtol=1e-5, atol=1e-5)}


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _simulated(monkeypatch: pytest.MonkeyPatch, world: int) -> NcclSim:
    sim = NcclSim(world)
    monkeypatch.setattr(comm, "dist", sim)
    monkeypatch.setattr(groups_mod, "dist", sim)
    return sim


def _run_layout(
    monkeypatch: pytest.MonkeyPatch,
    lay: Layout,
    chunks: int,
    seed: int,
    kernel: str,
    dtype: torch.dtype = torch.float64,
    batch: int = 1,
    head_dim: int = 4,
) -> NcclSim:
    gen = torch.Generator().manual_seed(seed)
    S, B, D, H, G = lay.seq_length, batch, head_dim, lay.num_attention_heads, lay.num_query_groups
    q, k, v = (
        torch.randn(S, B, n, D, generator=gen, dtype=torch.float64)
        .to(dtype)
        .double()
        .requires_grad_()
        for n in (H, G, G)
    )
    dout = torch.randn(S, B, H * D, generator=gen, dtype=torch.float64).to(dtype).double()
    ref = reference_attention(q, k, v)
    ref.backward(dout)
    sim = _simulated(monkeypatch, lay.world_size)

    def rank_fn(r: int):
        groups = build_hexiseq_groups(lay)
        pos = torch.tensor(lay.ranks[r].positions(), dtype=torch.long)
        ql, kl, vl = (x.detach()[pos].to(dtype).requires_grad_() for x in (q, k, v))
        out = hexiseq_attn_func(ql, kl, vl, groups=groups, kernel=kernel, comm_chunks=chunks)
        out.backward(dout[pos].to(dtype))
        return pos, out.detach(), ql.grad, kl.grad, vl.grad

    for pos, *got in sim.run(rank_fn):
        for name, g, want in zip(("out", "dq", "dk", "dv"), got, (ref, q.grad, k.grad, v.grad)):
            want = want.detach()[pos]
            if dtype in TOL:
                torch.testing.assert_close(
                    g.double(), want, **TOL[dtype], msg=lambda m, n=name: f"{n}: {m}"
                )
            else:
                bound = normwise_bound(
                    dtype,
                    roundings=FORWARD_ROUNDINGS if name == "out" else BACKWARD_ROUNDINGS,
                    reduction=S,
                )
                assert normwise_error(g, want) <= bound, (
                    f"{name}: normwise error {normwise_error(g, want):.3g}"
                )
    return sim


def _variant(i: int) -> dict:
    """Rotate dtype, kernel, batch and head dim over the random layouts."""
    dtype = (torch.float64, torch.float32, torch.float64, torch.bfloat16)[i % 4]
    kernel = "reference" if dtype == torch.float64 and i % 8 == 0 else "auto"
    return dict(dtype=dtype, kernel=kernel, batch=1 + i % 2, head_dim=(4, 2, 8)[i % 3])


@pytest.mark.parametrize("chunks", [1, 2, 3, 4])
def test_runtime_follows_nccl_rules_on_random_layouts(
    monkeypatch: pytest.MonkeyPatch, chunks: int
) -> None:
    rng = random.Random(2026)
    messages = 0
    for i in range(LAYOUTS):
        lay = random_layout(rng, rng.randint(2, 8))
        try:
            sim = _run_layout(monkeypatch, lay, chunks, seed=i, **_variant(i))
        except (SimError, AssertionError) as e:
            raise AssertionError(
                f"layout {i} (world {lay.world_size}, groups "
                f"{[len(g.ranks) for g in lay.groups]}), comm_chunks {chunks}: {e}"
            ) from None
        messages += sim.messages
    assert messages > LAYOUTS  # the layouts do exchange K/V


def test_zero_head_rank_needs_the_warm_up(monkeypatch: pytest.MonkeyPatch) -> None:
    """Rank 1 holds no heads, so it posts no sub-ring batch; without the warm-up collective the CP
    communicator is never created and the other ranks' first batch waits forever."""
    lay = make_layout(
        seq_length=12,
        num_attention_heads=2,
        num_query_groups=1,
        group_sizes=[2, 1],
        segments=[[(0, 3)], [(3, 6)], [(6, 12)]],
        heads=[[0, 1], [], [0, 1]],
    )
    _run_layout(monkeypatch, lay, 1, seed=0, kernel="reference")  # with the warm-up: fine
    monkeypatch.setattr(groups_mod, "warm_up", lambda group, device: None)
    with pytest.raises(SimError, match=r"deadlock: .*never joined its first operation"):
        _run_layout(monkeypatch, lay, 1, seed=0, kernel="reference")


def _p2p(sim: NcclSim, sends: list[tuple[int, int]], recvs: list[tuple[int, int]]) -> list:
    """Post one batch: (peer, tag) pairs, one-element tensors."""
    ops = [sim.P2POp(sim.isend, torch.ones(1), p, None, t) for p, t in sends]
    ops += [sim.P2POp(sim.irecv, torch.zeros(1), p, None, t) for p, t in recvs]
    return sim.batch_isend_irecv(ops)


def test_sim_detects_messages_posted_in_different_orders() -> None:
    sim = NcclSim(2)

    def fn(r: int) -> None:
        if r == 0:
            works = _p2p(sim, [(1, 1)], []) + _p2p(sim, [(1, 2)], [])
        else:
            works = _p2p(sim, [], [(0, 2)]) + _p2p(sim, [], [(0, 1)])
        for w in works:
            w.wait()

    with pytest.raises(SimError, match="order mismatch.*tag 1 from rank 0 where it expects tag 2"):
        sim.run(fn)


def test_sim_detects_a_wait_cycle() -> None:
    sim = NcclSim(2)

    def fn(r: int) -> None:  # each receives before it sends, in separate batches
        for w in _p2p(sim, [], [(1 - r, 0)]):
            w.wait()
        _p2p(sim, [(1 - r, 0)], [])

    with pytest.raises(SimError, match="deadlock: rank 0 waits for a P2P batch"):
        sim.run(fn)


def test_sim_detects_a_member_missing_from_the_first_batch() -> None:
    sim = NcclSim(3)

    def fn(r: int) -> None:
        g = sim.new_group([0, 1, 2])
        if r < 2:
            ops = [
                sim.P2POp(sim.isend, torch.ones(1), 1 - r, g, 0),
                sim.P2POp(sim.irecv, torch.zeros(1), 1 - r, g, 0),
            ]
            for w in sim.batch_isend_irecv(ops):
                w.wait()

    with pytest.raises(SimError, match=r"members \[2\] never joined"):
        sim.run(fn)
