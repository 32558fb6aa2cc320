"""Kernel calls of packed documents in the cost model (``costmodel.documents``): the windows it
prices against the runtime's own windows, and their price on a CPU type with a call-size curve.

Layer (a): no processes. ``document_calls`` must list exactly the windows the runtime runs
(``attention.documents.local_windows`` / ``block_windows``: rows x keys per (group, source)) on
random uneven layouts x random boundaries; on a flat-rate CPU type with ``cpu-flash`` curves many
small windows must cost more than one window of the same pairs (a flat rate prices them alike), and
a GPU that runs one variable-length call per block (flash) prices a block's windows as one call.
"""

from __future__ import annotations

import random
from collections import Counter

import numpy as np
import pytest
from test_costmodel_documents import _case, _random_cu

from megatron_hexiseq.attention.documents import DocumentBounds, block_windows, local_windows
from megatron_hexiseq.attention.peers import group_runs
from megatron_hexiseq.cluster import cluster_from_dict
from megatron_hexiseq.costmodel.document_calls import document_calls
from megatron_hexiseq.costmodel.documents import estimate_documents
from megatron_hexiseq.costmodel.pieces import (
    check_cu_seqlens,
    document_pieces,
)
from megatron_hexiseq.costmodel.rates import attention_rate
from megatron_hexiseq.layout import make_layout
from megatron_hexiseq.model import ModelSpec
from megatron_hexiseq.run_config import TrainOptions

H, D = 4, 16
# achieved fraction of the long-block rate against pair-heads of one call (a CPU kernel's shape:
# a 32-token causal window runs at a fifth of a 2048-token one)
CURVE = [[528.0 * H, 0.2], [8256.0 * H, 0.57], [2098176.0 * H, 1.0]]


def _runtime_calls(lay, cu):
    """Counter of (group, source, pairs, causal) over the runtime's windows."""
    bounds = DocumentBounds(lay.seq_length, (tuple(cu),), shared=True)
    out: Counter = Counter()
    runs = [group_runs(lay, g.id) for g in lay.groups]
    for gi, q in enumerate(runs):
        for w in local_windows(q, bounds):
            n = w.row_hi - w.row_lo
            out[(gi, gi, n * (n + 1) // 2, True)] += 1
        for si, k in enumerate(runs):
            if si != gi:
                for w in block_windows(q, k, bounds):
                    out[(gi, si, (w.row_hi - w.row_lo) * (w.key_hi - w.key_lo), False)] += 1
    return out


@pytest.mark.parametrize("seed", range(4))
def test_document_calls_are_the_runtime_windows(seed: int) -> None:
    rng = random.Random(4100 + seed)
    for _ in range(15):
        lay, _, _ = _case(rng)
        cu = check_cu_seqlens(_random_cu(rng, lay), lay.seq_length)
        index = {g.id: i for i, g in enumerate(lay.groups)}
        gi = np.array([index[p.group] for p in lay.ranks])
        pieces = document_pieces(lay, cu)
        calls = document_calls(pieces, gi[pieces.rank], len(lay.groups), cu)
        assert calls.exact
        assert (calls.windows == 1).all()
        mine = Counter(
            zip(
                calls.group.tolist(),
                calls.source.tolist(),
                calls.pairs.astype(np.int64).tolist(),
                calls.causal.tolist(),
            )
        )
        assert mine == _runtime_calls(lay, cu), cu.tolist()


def test_spread_windows_keep_each_groups_pairs(monkeypatch) -> None:
    rng = random.Random(77)
    for _ in range(10):
        lay, _, _ = _case(rng)
        cu = check_cu_seqlens(_random_cu(rng, lay), lay.seq_length)
        index = {g.id: i for i, g in enumerate(lay.groups)}
        gi = np.array([index[p.group] for p in lay.ranks])
        pieces, n = document_pieces(lay, cu), len(lay.groups)
        exact = document_calls(pieces, gi[pieces.rank], n, cu)
        monkeypatch.setattr("megatron_hexiseq.costmodel.document_calls.MAX_WINDOWS", -1)
        spread = document_calls(pieces, gi[pieces.rank], n, cu)
        monkeypatch.undo()
        assert not spread.exact
        for causal in (True, False):
            sums = [
                np.bincount(
                    c.group[c.causal == causal], (c.pairs * c.windows)[c.causal == causal], n
                )
                for c in (exact, spread)
            ]
            assert sums[1] == pytest.approx(sums[0], rel=1e-12, abs=1e-9)
        # the runtime's windows before neighbours merge: at least the merged ones
        assert spread.windows[~spread.causal].sum() >= exact.windows[~exact.causal].sum()


def _cpu_cluster(curves: bool):
    gpu = {
        "bf16_tflops": 0.05,
        "attention_tflops": 0.01,
        "memory_gib": 4,
        "efficiency": 1.0,
        "nvlink_GBps": 5,
    }
    if curves:
        gpu["attention_curves"] = {"cpu-flash/causal": CURVE, "cpu-flash/full": CURVE}
    return cluster_from_dict(
        {
            "name": "cpu",
            "gpus": {"cpu": gpu},
            "nodes": [
                {"name": "n0", "gpu": "cpu", "count": 1, "nvlink_GBps": 5, "network_GBps": 1}
            ],
        }
    )


def _one_rank(S: int):
    lay = make_layout(
        seq_length=S,
        num_attention_heads=H,
        num_query_groups=H,
        group_sizes=[1],
        segments=[[(0, S)]],
        heads=[list(range(H))],
        hosts=["n0"],
        gpus=["cpu"],
    )
    model = ModelSpec(
        name="t",
        num_layers=2,
        hidden_size=H * D,
        ffn_hidden_size=128,
        vocab_size=64,
        kv_channels=D,
        num_attention_heads=H,
        num_query_groups=H,
        seq_length=S,
        swiglu=False,
    )
    return lay, model


def test_cpu_curve_prices_many_small_windows_above_one_big_window() -> None:
    """2048 tokens as 64 documents of 32 (64 causal windows of 528 pairs) or as one document."""
    lay, model = _one_rank(2048)
    small = [0, *range(32, 2049, 32)]
    flat, curved = _cpu_cluster(False), _cpu_cluster(True)
    assert attention_rate(curved.devices[0].gpu, D).causal is not None
    assert attention_rate(flat.devices[0].gpu, D).causal is None
    opts = TrainOptions()
    e_flat = estimate_documents(lay, flat, model, opts, small)
    e_curve = estimate_documents(lay, curved, model, opts, small)
    # 32-token windows: 528 pairs x H pair-heads, the curve's first point: 1 / 0.2 slower
    assert e_curve.attention_s[0] == pytest.approx(5 * e_flat.attention_s[0], rel=1e-9)
    one = estimate_documents(lay, curved, model, opts, [0, 2048])
    assert one.attention_s[0] == pytest.approx(
        estimate_documents(lay, flat, model, opts, [0, 2048]).attention_s[0], rel=1e-9
    )
    # the same pairs in one window cost 1/5 of the 64 windows
    per_pair_small = e_curve.attention_s[0] / e_curve.pairs[0]
    per_pair_one = one.attention_s[0] / one.pairs[0]
    assert per_pair_small == pytest.approx(5 * per_pair_one, rel=1e-9)
    # a forced flat kernel keeps the flat price
    forced = estimate_documents(
        lay, curved, model, TrainOptions(attention_kernel="reference"), small
    )
    assert forced.attention_s[0] == pytest.approx(e_flat.attention_s[0], rel=1e-12)


def _gpu_pair(kernel_rates: dict):
    return cluster_from_dict(
        {
            "name": "g",
            "gpus": {
                "G": {
                    "bf16_tflops": 900,
                    "memory_gib": 80,
                    "nvlink_GBps": 300,
                    "compute_capability": 8.0,
                    "achieved_tflops": kernel_rates,
                }
            },
            "nodes": [
                {"name": "n0", "gpu": "G", "count": 2, "nvlink_GBps": 300, "network_GBps": 50}
            ],
        }
    )


def test_varlen_kernel_prices_a_block_as_one_call() -> None:
    """Two ranks (two groups), 64 documents each cut in two: flash runs each block's windows as one
    variable-length call, the memory-efficient kernel one call per window (slower)."""
    S = 4096
    lay = make_layout(
        seq_length=S,
        num_attention_heads=H,
        num_query_groups=H,
        group_sizes=[1, 1],
        segments=[[(0, S // 2)], [(S // 2, S)]],
        heads=[list(range(H))] * 2,
        hosts=["n0", "n0"],
        gpus=["G", "G"],
    )
    _, model = _one_rank(S)
    cu = [0, *range(16, S + 1, 16)]
    rates = {"flash/bf16/64": 300.0, "efficient/bf16/64": 300.0, "matmul/bf16": 600.0}
    c = _gpu_pair(rates)
    flash = estimate_documents(lay, c, model, TrainOptions(attention_kernel="flash"), cu)
    eff = estimate_documents(lay, c, model, TrainOptions(attention_kernel="efficient"), cu)
    assert flash.pairs.tolist() == eff.pairs.tolist()
    assert (eff.attention_s > 1.5 * flash.attention_s).all()


@pytest.mark.parametrize("kernel", ["auto", "efficient"])
def test_one_document_reproduces_estimate_on_catalog_curves(kernel: str) -> None:
    """Catalog GPUs (kernel curves, per-call pricing): with one document the calls, the pipeline
    and every rank's time are ``estimate``'s."""
    from megatron_hexiseq.attention.testing_layouts import random_layout
    from megatron_hexiseq.costmodel import estimate

    rng = random.Random(5)
    gpus = ["H100-SXM-80GB", "A100-SXM-80GB", "L40S-48GB"]
    for _ in range(12):
        W = rng.choice([2, 4, 8])
        c = cluster_from_dict(
            {
                "name": "x",
                "gpus": {},
                "nodes": [{"name": "n0", "gpu": rng.choice(gpus), "count": W, "network_GBps": 50}],
            }
        )
        base = random_layout(rng, W)
        lay = make_layout(
            seq_length=base.seq_length * 64,
            num_attention_heads=base.num_attention_heads,
            num_query_groups=base.num_query_groups,
            groups=[g.ranks for g in base.groups],
            segments=[[(s * 64, e * 64) for s, e in r.segments] for r in base.ranks],
            heads=[r.heads for r in base.ranks],
            hosts=[d.node for d in c.devices],
            gpus=[d.gpu.name for d in c.devices],
        )
        model = ModelSpec(
            name="t",
            num_layers=2,
            hidden_size=lay.num_attention_heads * 64,
            ffn_hidden_size=256,
            vocab_size=64,
            kv_channels=64,
            num_attention_heads=lay.num_attention_heads,
            num_query_groups=lay.num_query_groups,
            seq_length=lay.seq_length,
            swiglu=False,
        )
        opts = TrainOptions(attention_kernel=kernel)
        est = estimate(lay, c, model, opts)
        doc = estimate_documents(lay, c, model, opts, [0, lay.seq_length])
        assert doc.attention_s == pytest.approx(np.array(est.values("attention_s")), rel=1e-12)
        assert doc.time_s == pytest.approx(np.array(est.values("time_s")), rel=1e-12, abs=1e-15)
        assert doc.iteration_time_s == pytest.approx(est.iteration_time_s, rel=1e-12)


def test_packed_blocks_of_a_cudnn_run_are_priced_as_flash_varlen() -> None:
    """On Hopper ``auto`` picks cuDNN, but the runtime runs every packed block as flash's
    variable-length call (``kernel_rules.packed_kernel``): with several documents ``auto`` and
    ``cudnn`` price attention exactly as ``flash``; with one document (the dense path) cuDNN's own,
    faster rate stays; the per-micro-batch planner prices its micro-batches the same way."""
    from megatron_hexiseq.varlen.batch import BatchPlanner

    S = 8192
    c = cluster_from_dict(
        {
            "name": "h",
            "gpus": {},
            "nodes": [{"name": "n0", "gpu": "H100-SXM-80GB", "count": 2, "network_GBps": 50}],
        }
    )
    lay = make_layout(
        seq_length=S,
        num_attention_heads=8,
        num_query_groups=8,
        group_sizes=[1, 1],
        segments=[[(0, S // 2)], [(S // 2, S)]],
        heads=[list(range(8))] * 2,
        hosts=["n0", "n0"],
        gpus=["H100-SXM-80GB"] * 2,
    )
    model = ModelSpec(
        name="t",
        num_layers=2,
        hidden_size=8 * 128,
        ffn_hidden_size=2048,
        vocab_size=64,
        kv_channels=128,
        num_attention_heads=8,
        num_query_groups=8,
        seq_length=S,
        swiglu=False,
    )
    auto, cudnn, flash = (TrainOptions(attention_kernel=k) for k in ("auto", "cudnn", "flash"))
    assert attention_rate(c.devices[0].gpu, 128).kernel == "cudnn"
    docs = [0, 1000, 3000, 4500, 8192]
    want = estimate_documents(lay, c, model, flash, docs)
    for opts in (auto, cudnn):
        got = estimate_documents(lay, c, model, opts, docs)
        assert got.attention_s.tolist() == want.attention_s.tolist()
        assert got.iteration_time_s == want.iteration_time_s
    one = [0, S]
    dense = estimate_documents(lay, c, model, auto, one)
    flash_one = estimate_documents(lay, c, model, flash, one)
    assert (dense.attention_s < 0.8 * flash_one.attention_s).all()
    # a packed run's one-document micro-batch runs the packed path too
    packed_one = estimate_documents(lay, c, model, auto, one, packed=True)
    assert packed_one.attention_s.tolist() == flash_one.attention_s.tolist()
    # Transformer Engine's THD ring keeps its fused (cuDNN) kernel
    ring = make_layout(
        seq_length=S,
        num_attention_heads=8,
        num_query_groups=8,
        group_sizes=[1, 1],
        segments=[[(0, S // 4), (3 * S // 4, S)], [(S // 4, 3 * S // 4)]],
        heads=[list(range(8))] * 2,
        hosts=["n0", "n0"],
        gpus=["H100-SXM-80GB"] * 2,
    )
    te = [estimate_documents(ring, c, model, o, docs, exchange="te-ring") for o in (auto, flash)]
    assert (te[0].attention_s < 0.8 * te[1].attention_s).all()
    auto_bp, flash_bp = BatchPlanner(lay, c, model, auto), BatchPlanner(lay, c, model, flash)
    cu = np.array(docs)
    assert auto_bp.predict(lay, cu) == flash_bp.predict(lay, cu)
