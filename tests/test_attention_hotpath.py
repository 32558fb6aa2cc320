"""Layer (a), threads instead of processes (``nccl_sim``): what the attention hot path does.

- Packed documents on per-micro-batch layouts: forward + backward read nothing back from the device
  (no ``.item()``, no ``nonzero``) in a micro-batch after the first; ``get_batch`` (the plugin's
  prepared-ahead batches) only copies, without blocking, and indexes; the variable-length path's
  index copy does not block either (a ``meta`` device stands for the GPU so copies are seen).

- After the first call of a layout, forward+backward create no tensor from host data
  (``aten.lift_fresh``, what ``torch.tensor(list)`` dispatches to; on a GPU that is a host-to-device
  copy and a stream sync): index tensors are built once per layout and device.
- The wire dtype of K/V and of the returned dK/dV is the input dtype (bf16 here): the dK/dV bytes
  equal the K/V bytes, and twice that with ``fp32_grad_wire``; the results stay within the bf16
  bounds of ``kernel_check`` against float64 attention either way.
- No tensor on the path has S x T elements (the mask-free schedule): recorded over every op.
"""

from __future__ import annotations

from dataclasses import replace

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


# ---- packed documents and per-micro-batch layouts -------------------------------------------------
# the structure of LAYOUT with other segments: two micro-batches, each its own layout and documents
BATCH_LAYOUTS = (
    replace(
        LAYOUT,
        ranks=tuple(
            replace(r, segments=tuple(s))
            for r, s in zip(LAYOUT.ranks, ([(0, 30)], [(30, 50)], [(50, 70), (90, 96)], [(70, 90)]))
        ),
    ),
    replace(
        LAYOUT,
        ranks=tuple(
            replace(r, segments=tuple(s))
            for r, s in zip(LAYOUT.ranks, ([(60, 96)], [(0, 20)], [(20, 40)], [(40, 60)]))
        ),
    ),
)
DOCUMENTS = ((0, 30, 55, 96), (0, 7, 20, 21, 64, 96))  # boundaries of the two micro-batches
SYNCS = ("aten._local_scalar_dense.default", "aten.nonzero.default", "aten.item.default")


def test_documents_and_batch_layouts_read_nothing_from_the_device(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Forward + backward of a packed micro-batch on its own layout (a view of the job's groups):
    nothing read back to the host (``.item()``, ``nonzero``), no tensor of S x T elements, in every
    micro-batch after the first."""
    sim = NcclSim(LAYOUT.world_size)
    monkeypatch.setattr(comm, "dist", sim)
    monkeypatch.setattr(groups_mod, "dist", sim)
    gen = torch.Generator().manual_seed(1)
    S, D = LAYOUT.seq_length, 8
    q, k, v = (torch.randn(S, 1, n, D, generator=gen) for n in (8, 2, 2))

    def rank_fn(r: int):
        groups = build_hexiseq_groups(LAYOUT)
        recs = []
        for lay, cu in zip(BATCH_LAYOUTS, DOCUMENTS):
            view = groups.with_layout(lay)
            pos = torch.tensor(lay.ranks[r].positions(), dtype=torch.long)
            ql, kl, vl = (x[pos].clone().requires_grad_() for x in (q, k, v))
            rec = _Recorder()
            with rec:
                out = hexiseq_attn_func(ql, kl, vl, groups=view, cu_seqlens=tuple(cu))
                out.sum().backward()
            recs.append(rec)
        return recs

    for r, recs in enumerate(sim.run(rank_fn)):
        rec = recs[-1]
        assert rec.ops, "nothing recorded"
        assert not [op for op in rec.ops if op in SYNCS], (r, [op for op in rec.ops if op in SYNCS])
        assert rec.max_numel <= S * 8 * 8, (r, rec.max_numel)


class _Copies(_Recorder):
    """Records ops and every device copy's ``non_blocking``."""

    def __init__(self) -> None:
        super().__init__()
        self.copies: list[bool] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if str(func) == "aten._to_copy.default" and (kwargs or {}).get("device") is not None:
            self.copies.append(bool((kwargs or {}).get("non_blocking", False)))
        return super().__torch_dispatch__(func, types, args, kwargs)


def test_get_batch_only_copies_and_indexes(monkeypatch: pytest.MonkeyPatch) -> None:
    """The prepared-ahead ``get_batch`` (``batch_ahead.AheadBatches`` + the slicer passing its
    batch through): in the training thread, only non-blocking copies of host slices and of the
    plan's index (a ``meta`` device stands for the GPU, so the copies are dispatched and seen);
    no read of device data, no tensor built from host data. The boundaries were read from the CPU
    tokens and the plan built in the planning thread. Also the packed windows' index copy of the
    variable-length path (``attention.varlen``) and the document RoPE angles: non-blocking."""
    from megatron_hexiseq.attention import varlen
    from megatron_hexiseq.attention.kernels import Kernel, kv_map
    from megatron_hexiseq.attention.peers import Window
    from megatron_hexiseq.megatron.batch import LayoutBatchSlicer
    from megatron_hexiseq.megatron.batch_ahead import AheadBatches, Preparer
    from megatron_hexiseq.megatron.batch_layout import MicroBatchLayout
    from megatron_hexiseq.megatron.documents import MicroBatchDocuments

    sim = NcclSim(LAYOUT.world_size)
    monkeypatch.setattr(comm, "dist", sim)
    monkeypatch.setattr(groups_mod, "dist", sim)
    eod, S = 99, LAYOUT.seq_length
    meta = torch.device("meta")

    def batch(cu):
        tokens = torch.arange(S).remainder(90).view(1, S)
        tokens[0, [c - 1 for c in cu[1:]]] = eod
        return {"tokens": tokens, "labels": tokens.clone(), "loss_mask": torch.ones(1, S),
                "position_ids": torch.arange(S).view(1, S)}  # fmt: skip

    def rank_fn(r: int):
        groups = build_hexiseq_groups(LAYOUT)
        table = {tuple(cu): lay for lay, cu in zip(BATCH_LAYOUTS, DOCUMENTS)}
        slot = MicroBatchLayout(groups, lambda b: table[b.samples[0]], reset_position_ids=True)
        docs = MicroBatchDocuments(
            seq_length=S, eod_token=eod, reset_position_ids=True, required=True
        )
        scratch = MicroBatchDocuments(
            seq_length=S, eod_token=eod, reset_position_ids=True, required=True
        )
        prep = Preparer(scratch, slot, reset_attention_mask=True, pin=False)
        ahead = AheadBatches(prep, docs, slot, depth=2, device=meta)
        slicer = LayoutBatchSlicer(
            LAYOUT.ranks[r].segments, S, docs, batch_layout=slot, prepared=True
        )
        stream = iter([batch(cu) for cu in DOCUMENTS])
        slicer(ahead(stream))  # the first micro-batch
        rec = _Copies()
        with rec:
            got = slicer(ahead(stream))
        assert docs.current().samples[0] == DOCUMENTS[1]
        assert slot.current().layout is BATCH_LAYOUTS[1]
        n = BATCH_LAYOUTS[1].ranks[r].num_tokens
        assert got["tokens"].device == meta and got["tokens"].shape == (1, n)
        assert ahead.exposed_s and len(ahead.exposed_s) == 2
        return rec

    for r, rec in enumerate(sim.run(rank_fn)):
        assert rec.copies and all(rec.copies), (r, rec.copies)
        bad = [op for op in rec.ops if op in SYNCS or op == "aten.lift_fresh.default"]
        assert not bad, (r, bad)
    # the variable-length path's packed indices: one non-blocking copy per block
    wk = varlen.WindowKernel(Kernel.FLASH, 0.5, kv_map((0, 0), 1), {})
    rec = _Copies()
    with rec:
        varlen._packed(wk, (Window(None, 0, 4, 0, 4),), "k", 1, meta)
    assert rec.copies == [True]
