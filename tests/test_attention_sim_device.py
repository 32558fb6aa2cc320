"""HexiSeq attention over simulated ranks on the best device here: layer (c) on a GPU, else layer (a).

Every layout rank runs the real runtime (``build_hexiseq_groups`` with its warm-up, then
``hexiseq_attn_func`` forward and backward) in its own thread under ``nccl_sim.NcclSim`` (NCCL's
matching and ordering rules), on CUDA tensors when a GPU is visible (the device's default kernel,
bf16 and fp16) and on CPU tensors otherwise (``cpu-flash``, bf16). The gathered output and gradients
are compared with float64 single-device attention on the same rounded inputs within the normwise
bounds of ``attention.kernel_check``. The layouts have received blocks (several A2A groups), split
and non-contiguous query heads, GQA, B = 2 and ``comm_chunks`` 1-2, so a zero output, a dropped
received block or a wrong head map fails here (``scripts/gpu_check.sh --self-test`` relies on it).
"""

from __future__ import annotations

import random

import pytest
import torch
from nccl_sim import NcclSim

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

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
DTYPES = [torch.bfloat16, torch.float16] if DEVICE.type == "cuda" else [torch.bfloat16]
HEAD_DIM = 64 if DEVICE.type == "cuda" else 8

NAMED = make_layout(
    seq_length=96,
    num_attention_heads=8,
    num_query_groups=2,
    group_sizes=[2, 1],
    segments=[[(0, 12), (75, 96)], [(12, 30)], [(30, 75)]],
    heads=[[0, 1, 2, 5], [3, 4, 6, 7], list(range(8))],
)


def _layouts() -> list[Layout]:
    rng = random.Random(11)
    out = [NAMED]
    for sizes in ([2, 1, 2], [1, 3]):
        lay = random_layout(
            rng, sum(sizes), seq_length=rng.randint(64, 160), heads=(8, 2), group_sizes=sizes
        )
        while not all(lay.group_num_tokens(g.id) for g in lay.groups):  # no 0-length kernel calls
            lay = random_layout(
                rng, sum(sizes), seq_length=rng.randint(64, 160), heads=(8, 2), group_sizes=sizes
            )
        out.append(lay)
    return out


def _run(lay: Layout, dtype: torch.dtype, chunks: int, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    S, B, H, G = lay.seq_length, 2, lay.num_attention_heads, lay.num_query_groups
    q, k, v = (
        torch.randn(S, B, n, HEAD_DIM, generator=gen).to(dtype).to(DEVICE) for n in (H, G, G)
    )
    dout = torch.randn(S, B, H * HEAD_DIM, generator=gen).to(dtype).to(DEVICE)
    qd, kd, vd = (x.double().requires_grad_() for x in (q, k, v))
    ref = reference_attention(qd, kd, vd)
    ref.backward(dout.double())
    sim = NcclSim(lay.world_size)
    saved = comm.dist, groups_mod.dist
    comm.dist = groups_mod.dist = sim

    def rank_fn(r: int):
        # backward in this thread: autograd's shared CUDA worker thread would run every rank's
        # backward nodes one after another, and a rank waiting for another's dK/dV would block it
        with torch.autograd.set_multithreading_enabled(False):
            groups = build_hexiseq_groups(lay, device=DEVICE)
            pos = torch.tensor(lay.ranks[r].positions(), dtype=torch.long, device=DEVICE)
            ql, kl, vl = (x[pos].requires_grad_() for x in (q, k, v))
            out = hexiseq_attn_func(ql, kl, vl, groups=groups, comm_chunks=chunks)
            out.backward(dout[pos])
            return pos, out.detach(), ql.grad, kl.grad, vl.grad

    try:
        results = sim.run(rank_fn)
    finally:
        comm.dist, groups_mod.dist = saved
    assert sim.messages > 0  # K/V did cross groups
    for i, (name, want) in enumerate(
        zip(("out", "dq", "dk", "dv"), (ref, qd.grad, kd.grad, vd.grad))
    ):
        got = torch.zeros_like(want)
        for pos, *res in results:
            if res[i] is not None:
                got[pos] = res[i].to(got.dtype)
        rnd = FORWARD_ROUNDINGS if name == "out" else BACKWARD_ROUNDINGS
        bound = normwise_bound(dtype, roundings=rnd, reduction=S, device=DEVICE)
        err = normwise_error(got, want.detach())
        assert err <= bound, f"{name}: normwise error {err:.3g} > {bound:.3g}"


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("chunks", [1, 2])
@pytest.mark.parametrize("which", range(3))
def test_hexiseq_on_device_matches_float64(which: int, chunks: int, dtype: torch.dtype) -> None:
    lay = _layouts()[which]
    _run(lay, dtype, chunks, seed=which)
