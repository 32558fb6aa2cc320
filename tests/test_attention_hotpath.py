"""Layer (a), threads instead of processes (``nccl_sim``): what the attention hot path does.

- After the first call of a layout, forward+backward create no tensor from host data
  (``aten.lift_fresh``, what ``torch.tensor(list)`` dispatches to; on a GPU that is a host-to-device
  copy and a stream sync): index tensors are built once per layout and device.
- The wire dtype of K/V and of the returned dK/dV is the input dtype (bf16 here): the dK/dV bytes
  equal the K/V bytes, and twice that with ``fp32_grad_wire``; the results stay within the bf16
  bounds of ``kernel_check`` against float64 attention either way.
- No tensor on the path has S x T elements (the mask-free schedule): recorded over every op.
"""

from __future__ import annotations

import pytest
import torch
from nccl_sim import NcclSim
from torch.utils._python_dispatch import TorchDispatchMode

import megatron_hexiseq.attention.comm as comm
import megatron_hexiseq.attention.groups as groups_mod
from megatron_hexiseq.attention import (
    CommStats,
    build_hexiseq_groups,
    hexiseq_attn_func,
    reference_attention,
)
from megatron_hexiseq.attention.kernel_check import (
    BACKWARD_ROUNDINGS,
    FORWARD_ROUNDINGS,
    normwise_bound,
    normwise_error,
)
from megatron_hexiseq.layout import make_layout

# three groups [2, 1, 1]; GQA 8/2; non-contiguous heads; every kind of block (hidden, prefix, full)
LAYOUT = make_layout(
    seq_length=96,
    num_attention_heads=8,
    num_query_groups=2,
    group_sizes=[2, 1, 1],
    segments=[[(0, 10), (70, 80)], [(10, 20), (80, 96)], [(20, 45)], [(45, 70)]],
    heads=[[0, 2, 5, 7], [1, 3, 4, 6], list(range(8)), list(range(8))],
)


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


def _run(monkeypatch, *, dtype, fp32_grad_wire=False, calls=1, record=False):
    sim = NcclSim(LAYOUT.world_size)
    monkeypatch.setattr(comm, "dist", sim)
    monkeypatch.setattr(groups_mod, "dist", sim)
    gen = torch.Generator().manual_seed(0)
    S, B, D = LAYOUT.seq_length, 1, 8
    q, k, v = (
        torch.randn(S, B, n, D, generator=gen).to(dtype).double().requires_grad_()
        for n in (8, 2, 2)
    )
    dout = torch.randn(S, B, 8 * D, generator=gen).to(dtype).double()
    ref = reference_attention(q, k, v)
    ref.backward(dout)

    def rank_fn(r: int):
        groups = build_hexiseq_groups(LAYOUT)
        pos = torch.tensor(LAYOUT.ranks[r].positions(), dtype=torch.long)
        rec, stats = _Recorder(), CommStats()
        for i in range(calls):
            ql, kl, vl = (x.detach()[pos].to(dtype).requires_grad_() for x in (q, k, v))
            last = i == calls - 1
            with rec if (record and last) else _NoMode():
                out = hexiseq_attn_func(
                    ql,
                    kl,
                    vl,
                    groups=groups,
                    stats=stats if last else None,
                    fp32_grad_wire=fp32_grad_wire,
                )
                out.backward(dout[pos].to(dtype))
        return pos, rec, stats, (out, ql.grad, kl.grad, vl.grad)

    results = sim.run(rank_fn)
    return results, (ref, q.grad, k.grad, v.grad)


class _NoMode:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_no_host_data_and_no_score_tensor_after_the_first_call(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    results, _ = _run(monkeypatch, dtype=torch.float32, calls=2, record=True)
    S = LAYOUT.seq_length
    for r, (_, rec, _, _) in enumerate(results):
        assert rec.ops, "nothing recorded"
        assert "aten.lift_fresh.default" not in rec.ops, (
            f"rank {r} builds a tensor from host data on the hot path"
        )
        # the largest tensor is an activation [S_group, B, H, D] or a K/V block, never [S, T] per head pair
        assert rec.max_numel <= S * 8 * 8, (r, rec.max_numel)


@pytest.mark.parametrize("fp32_grad_wire", [False, True])
def test_grad_wire_dtype_and_bf16_accuracy(
    monkeypatch: pytest.MonkeyPatch, fp32_grad_wire: bool
) -> None:
    results, ref = _run(monkeypatch, dtype=torch.bfloat16, fp32_grad_wire=fp32_grad_wire)
    kv = sum(st.total_sent("kv_bwd") for _, _, st, _ in results)
    dkv = sum(st.total_sent("dkv") for _, _, st, _ in results)
    assert kv > 0 and dkv == (2 if fp32_grad_wire else 1) * kv
    for pos, _, _, got in results:
        for name, g, want in zip(("out", "dq", "dk", "dv"), got, ref):
            bound = normwise_bound(
                torch.bfloat16,
                roundings=FORWARD_ROUNDINGS if name == "out" else BACKWARD_ROUNDINGS,
                reduction=LAYOUT.seq_length,
            )
            assert normwise_error(g, want.detach()[pos]) <= bound, name
