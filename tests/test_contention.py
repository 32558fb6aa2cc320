"""Core contention (``shared_core`` nodes: the CPU testbed) and the kernel-call overhead of packed
micro-batches (``window_overhead_us``): cluster fields, the cost model's terms, the profile's fit. Layer (a), no processes, except
the last test (b: two gloo ranks in ``run_profile``)."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from megatron_hexiseq.cluster import cluster_from_dict, cluster_to_dict
from megatron_hexiseq.costmodel import TrainOptions, estimate
from megatron_hexiseq.costmodel.contention import contention_scale, shared_core_members
from megatron_hexiseq.costmodel.documents import estimate_documents
from megatron_hexiseq.errors import HexiSeqError
from megatron_hexiseq.model import get_model
from megatron_hexiseq.planner.baselines import hosts_and_gpus
from megatron_hexiseq.profile.measure import ProfileOptions
from megatron_hexiseq.profile.run import run_profile
from megatron_hexiseq.testbed.calibrate import (
    calibration_cu_seqlens,
    calibration_layouts,
    fit_latencies,
)
from megatron_hexiseq.testbed.spawn import run_ranks

MODEL = get_model("gpt-tiny", overrides={"seq_length": 768})
ONE = replace(MODEL, num_layers=1)
OPTS = TrainOptions()


def _spec(shared: bool = True, counts=(1, 2), **fixed) -> dict:
    """A 1+2 testbed-like spec: a fast rank alone on its core, two slower ranks sharing one."""
    gpu = {"memory_gib": 4.0, "nvlink_GBps": 2.0, "efficiency": 1.0, **fixed}
    return {
        "name": "t",
        "gpus": {
            "F": {"bf16_tflops": 2.0, "attention_tflops": 1.0, **gpu},
            "S": {"bf16_tflops": 1.0, "attention_tflops": 0.5, **gpu},
        },
        "nodes": [
            {"name": f"c{i}", "gpu": g, "count": n, "network_GBps": 1.0}
            | ({"shared_core": True} if shared else {})
            for i, (g, n) in enumerate(zip("FS", counts))
        ],
    }


def _layouts(cluster, seq=768):
    hosts, gpus = hosts_and_gpus(cluster)
    return calibration_layouts(
        cluster.world_size, seq, MODEL.num_attention_heads, MODEL.num_query_groups, hosts, gpus
    )


def _phases(e):
    """(linear, attention phase without fixed costs) per rank of a zero-latency estimate."""
    linear = np.array(e.values("linear_s"))
    return linear, np.array(e.values("time_s")) - linear


def test_fields_validate_and_round_trip():
    cl = cluster_from_dict(_spec(p2p_latency_us=50, window_overhead_us=80))
    assert [d.shared_core for d in cl.devices] == [True, True, True]
    assert cl.devices[0].window_overhead_s == pytest.approx(8e-5)
    assert cluster_from_dict(cluster_to_dict(cl)) == cl
    plain = cluster_from_dict(_spec(shared=False, p2p_latency_us=50))
    assert not any(d.shared_core for d in plain.devices) and not shared_core_members(plain)
    assert plain.devices[0].window_overhead_s == 0.0  # default: none (GPUs)
    assert "shared_core" not in str(cluster_to_dict(plain))
    bad = _spec()
    bad["nodes"][1]["shared_core"] = "yes"
    with pytest.raises(HexiSeqError, match="shared_core must be true or false"):
        cluster_from_dict(bad)
    with pytest.raises(HexiSeqError, match="window_overhead_us must be a number >= 0"):
        cluster_from_dict(_spec(window_overhead_us=-1))


def test_scale_is_the_busiest_siblings_share_of_the_step():
    cl = cluster_from_dict(_spec(counts=(1, 3)))
    linear = np.array([1.0, 2.0, 1.0, 0.5])
    phase = np.array([3.0, 2.0, 1.0, 2.0])
    step = 2.0 + 3.0
    # rank 0 alone on its core: 0; ranks 1-3: the busiest other member (busy 4, 2, 2.5)
    assert contention_scale(cl, linear, phase) == pytest.approx(
        [0.0, 2.5 / step, 4.0 / step, 4.0 / step]
    )
    plain = cluster_from_dict(_spec(shared=False, counts=(1, 3)))
    assert contention_scale(plain, linear, phase).tolist() == [1.0] * 4


@pytest.mark.parametrize("name", ["a2a", "p2p"])
def test_estimate_scales_fixed_costs_by_contention(name):
    fixed = {"collective_latency_us": 300.0, "p2p_latency_us": 200.0}
    bare = cluster_from_dict(_spec())
    plain = cluster_from_dict(_spec(shared=False, **fixed))
    shared = cluster_from_dict(_spec(**fixed))
    lay = _layouts(bare)[name]
    e0, e1, e2 = (estimate(lay, c, MODEL, OPTS) for c in (bare, plain, shared))
    scale = contention_scale(shared, *_phases(e0))
    assert scale[0] == 0.0 and 0.0 < scale[1] <= 1.0 and 0.0 < scale[2] <= 1.0
    for key in ("a2a_s", "kv_latency_s", "kv_exposed_s"):
        extra = np.array(e1.values(key)) - np.array(e0.values(key))
        assert np.array(e2.values(key)) - np.array(e0.values(key)) == pytest.approx(
            extra * scale, rel=1e-12, abs=1e-15
        )
    # a layout without fixed costs does not change with the flag
    assert estimate(lay, cluster_from_dict(_spec(shared=False)), MODEL, OPTS).values(
        "time_s"
    ) == e0.values("time_s")


def test_documents_scale_like_estimate_and_add_each_kernel_calls_overhead():
    fixed = {"collective_latency_us": 300.0, "p2p_latency_us": 200.0, "window_overhead_us": 70.0}
    L = MODEL.num_layers
    for shared in (False, True):
        cl = cluster_from_dict(_spec(shared=shared, **fixed))
        no_calls = cluster_from_dict(
            _spec(shared=shared, collective_latency_us=300.0, p2p_latency_us=200.0)
        )
        lays = _layouts(cl)
        # one document: estimate's figures (its contention scaling), no kernel-call overhead
        for name in ("a2a", "p2p"):
            est = estimate(lays[name], cl, MODEL, OPTS)
            one = estimate_documents(lays[name], cl, MODEL, OPTS, [0, 768])
            assert one.time_s == pytest.approx(np.array(est.values("time_s")), rel=1e-12)
        # several documents: each rank's kernel calls, forward and backward, every layer
        cu = calibration_cu_seqlens(768, 3)
        e0 = estimate_documents(lays["p2p_docs"], no_calls, MODEL, OPTS, cu)
        e1 = estimate_documents(lays["p2p_docs"], cl, MODEL, OPTS, cu)
        assert (e0.kernel_calls > 12).all()  # 12 local windows and the received ones
        assert e1.attention_s - e0.attention_s == pytest.approx(
            2 * L * e0.kernel_calls * 70e-6, rel=1e-12
        )


def test_kernel_calls_count_the_runtimes_windows():
    """Two ranks, two documents each cut in 4 zig-zag chunks: rank 0 holds chunks 0 and 3, rank 1
    chunks 1-2. Per document: one local window each; rank 0's chunk 3 reads rank 1's chunks (one
    window), rank 1's chunks read rank 0's chunk 0 (one window): 4 calls per rank."""
    spec = _spec(shared=False, counts=(1, 1))
    cl = cluster_from_dict(spec)
    hosts, gpus = hosts_and_gpus(cl)
    lay = calibration_layouts(
        2, 64, MODEL.num_attention_heads, MODEL.num_query_groups, hosts, gpus
    )["p2p_docs"]
    assert calibration_cu_seqlens(64, 2) == [0, 5, 10, 16, 21, 26, 32, 37, 42, 48, 53, 58, 64]
    cu = [0, 32, 64]
    from megatron_hexiseq.layout import make_layout
    from megatron_hexiseq.varlen.schemes import zigzag_docs

    two = make_layout(
        seq_length=64,
        num_attention_heads=MODEL.num_attention_heads,
        num_query_groups=MODEL.num_query_groups,
        group_sizes=[1, 1],
        segments=zigzag_docs(np.array(cu), [0, 1], 2),
        heads=[list(range(MODEL.num_attention_heads))] * 2,
        hosts=hosts,
        gpus=gpus,
    )
    m = replace(MODEL, seq_length=64)
    assert estimate_documents(two, cl, m, OPTS, cu).kernel_calls.tolist() == [4, 4]
    assert estimate_documents(
        lay, cl, m, OPTS, calibration_cu_seqlens(64, 2)
    ).kernel_calls.tolist() == [24, 24]


@pytest.mark.parametrize("counts", [(1, 2), (1, 3)])
def test_fit_recovers_fixed_costs_under_contention(counts):
    """Closure: calls measured as the contention-scaled model with known fixed costs give back those
    costs, and the fitted spec then predicts the measured calls."""
    known = {"collective_latency_us": 2000.0, "p2p_latency_us": 1000.0, "window_overhead_us": 90.0}
    true = cluster_from_dict(_spec(counts=counts, **known))
    bare = cluster_from_dict(_spec(counts=counts))
    W = true.world_size
    lays = _layouts(true)
    cu = calibration_cu_seqlens(768, W)
    assert len(cu) == 13  # 12 equal documents

    def attention_phase(e):
        return max(r.time_s - r.breakdown["linear_s"] for r in e.per_rank)

    e_a2a = estimate(lays["a2a"], bare, ONE, OPTS)
    compute = max(r.breakdown["attention_s"] for r in e_a2a.per_rank)
    a2a_bytes = max(r.breakdown["a2a_s"] for r in e_a2a.per_rank)
    # the a2a call measured: the measured compute + bytes + the slowest member's scaled latency
    scale_a2a = contention_scale(true, *_phases(e_a2a))
    docs = estimate_documents(lays["p2p_docs"], true, ONE, OPTS, cu)
    calib = {
        "seq_length": 768,
        "a2a_compute_call_s": compute,
        "a2a_call_s": compute + a2a_bytes + 8 * 2e-3 * scale_a2a.max(),
        "p2p_call_s": attention_phase(estimate(lays["p2p"], true, ONE, OPTS)),
        "p2p_docs_call_s": float((docs.time_s - docs.linear_s).max()),
    }
    spec = _spec(counts=counts)
    fit = fit_latencies(spec, calib, MODEL)
    assert fit["a2a"]["latency_us"] == pytest.approx(2000.0, rel=1e-6)
    assert fit["p2p"]["latency_us"] == pytest.approx(1000.0, rel=1e-6)
    assert fit["p2p_docs"]["latency_us"] == pytest.approx(90.0, rel=1e-6)
    fitted = cluster_from_dict(spec)
    assert fitted.devices[1].window_overhead_s == pytest.approx(90e-6, rel=1e-6)
    again = estimate_documents(lays["p2p_docs"], fitted, ONE, OPTS, cu)
    assert float((again.time_s - again.linear_s).max()) == pytest.approx(
        calib["p2p_docs_call_s"], rel=1e-6
    )
    # an old calibration (no packed call) leaves the overhead unset
    old = _spec(counts=counts)
    fit = fit_latencies(old, {k: v for k, v in calib.items() if k != "p2p_docs_call_s"}, MODEL)
    assert "p2p_docs" not in fit and "window_overhead_us" not in old["gpus"]["S"]


def _profile(rank, world, opts):
    return run_profile(opts)


@pytest.mark.parametrize("nodes, flagged", [(("a", "a"), True), (("a", "b"), False)])
def test_profile_flags_shared_cores_only_when_a_core_is_shared(nodes, flagged):
    """(b) two gloo ranks: ``shared_cores`` marks every node once some node holds two ranks."""
    opts = ProfileOptions(
        seconds_per_test=0.01,
        repeats=1,
        message_bytes=1 << 12,
        memory_gib=1.0,
        node_names=nodes,
        shared_cores=True,
    )
    spec, _ = run_ranks(_profile, 2, opts)[0]
    assert [n.get("shared_core", False) for n in spec["nodes"]] == [flagged] * len(set(nodes))
