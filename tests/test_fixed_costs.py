"""Fixed costs (step overhead, collective and K/V-step latency): cluster fields, cost-model terms,
the profile's fit. Layers (a) no processes and (b) gloo ranks (``profile`` with a model)."""

from __future__ import annotations

import json
import os
from dataclasses import replace

import pytest

from megatron_hexiseq.cli import main
from megatron_hexiseq.cluster import cluster_from_dict, cluster_to_dict
from megatron_hexiseq.costmodel import TrainOptions, estimate
from megatron_hexiseq.errors import HexiSeqError
from megatron_hexiseq.model import get_model
from megatron_hexiseq.planner.baselines import hosts_and_gpus
from megatron_hexiseq.profile.measure import significant
from megatron_hexiseq.testbed.calibrate import (
    calibration_heads,
    calibration_layouts,
    can_calibrate,
    fit_latencies,
)


def _spec(**fixed) -> dict:
    return {
        "name": "t",
        "gpus": {
            "X": {
                "bf16_tflops": 1.0,
                "attention_tflops": 0.5,
                "memory_gib": 4.0,
                "nvlink_GBps": 2.0,
                "efficiency": 1.0,
                **fixed,
            }
        },
        "nodes": [
            {"name": "n0", "gpu": "X", "count": 1, "network_GBps": 1.0},
            {"name": "n1", "gpu": "X", "count": 2, "network_GBps": 1.0},
        ],
    }


MODEL = get_model("gpt-tiny", overrides={"seq_length": 768})


def _layouts(cluster, seq=768):
    hosts, gpus = hosts_and_gpus(cluster)
    return calibration_layouts(
        cluster.world_size, seq, MODEL.num_attention_heads, MODEL.num_query_groups, hosts, gpus
    )


def test_fixed_cost_fields_validate_and_round_trip():
    cl = cluster_from_dict(_spec(step_overhead_ms=5, collective_latency_us=100, p2p_latency_us=50))
    d = cl.devices[0]
    assert (d.step_overhead_s, d.collective_latency_s, d.p2p_latency_s) == pytest.approx(
        (5e-3, 1e-4, 5e-5)
    )
    assert cluster_from_dict(cluster_to_dict(cl)) == cl
    assert cluster_from_dict(_spec()).devices[0].p2p_latency_s == 0.0  # default: none (GPUs)
    with pytest.raises(HexiSeqError, match="p2p_latency_us must be a number >= 0"):
        cluster_from_dict(_spec(p2p_latency_us=-1))


def test_estimate_adds_each_fixed_cost_where_documented():
    base = cluster_from_dict(_spec())
    fixed = cluster_from_dict(
        _spec(step_overhead_ms=5, collective_latency_us=100, p2p_latency_us=50)
    )
    L, opts = MODEL.num_layers, TrainOptions()
    lays = _layouts(base)
    for name, lay in lays.items():
        e0, e1 = estimate(lay, base, MODEL, opts), estimate(lay, fixed, MODEL, opts)
        for r0, r1 in zip(e0.per_rank, e1.per_rank):
            assert r1.breakdown["linear_s"] - r0.breakdown["linear_s"] == pytest.approx(5e-3)
            if name == "a2a":  # one group of 3: 4 collectives per layer, forward and backward
                assert r1.breakdown["a2a_s"] - r0.breakdown["a2a_s"] == pytest.approx(
                    2 * L * 4 * 1e-4
                )
                assert r1.breakdown["kv_exposed_s"] == 0.0
            else:  # ring of 3, zig-zag: 2 rounds per layer; K/V, K/V again and dK/dV back
                assert r1.breakdown["kv_latency_s"] == pytest.approx(3 * L * 2 * 5e-5)
                assert r1.breakdown["kv_exposed_s"] - r0.breakdown["kv_exposed_s"] == pytest.approx(
                    3 * L * 2 * 5e-5
                )
                assert r1.breakdown["a2a_s"] == 0.0


def test_calibration_heads_are_equal_within_a_node():
    assert calibration_heads(8, ["a", "b", "b"]) == [4, 2, 2]
    assert calibration_heads(8, ["a", "b", "b", "b"]) == [2, 2, 2, 2]
    assert calibration_heads(9, ["a", "b", "b", "c"]) == [3, 2, 2, 2]
    assert calibration_heads(7, ["a", "b"]) == [
        4,
        3,
    ]  # no way to keep both equal: leftover to rank 0
    assert calibration_heads(2, ["a", "b", "b"]) == [2, 0, 0]  # more ranks than heads
    assert not can_calibrate(replace(MODEL, seq_length=5), 3) and not can_calibrate(MODEL, 1)
    assert can_calibrate(replace(MODEL, seq_length=6), 3)


def test_fit_recovers_latencies_that_reproduce_the_measured_calls():
    """Closure: calls measured as modelled + known fixed costs give back exactly those costs, and
    the fitted spec then predicts the measured calls. Faster-than-modelled calls give 0."""
    spec = _spec()
    cluster = cluster_from_dict(spec)
    one = replace(MODEL, num_layers=1, seq_length=768)
    lays = _layouts(cluster)
    e_a2a = estimate(lays["a2a"], cluster, one, TrainOptions())
    e_p2p = estimate(lays["p2p"], cluster, one, TrainOptions())
    compute = max(r.breakdown["attention_s"] for r in e_a2a.per_rank)
    a2a_bytes = max(r.breakdown["a2a_s"] for r in e_a2a.per_rank)
    ring = max(r.time_s - r.breakdown["linear_s"] for r in e_p2p.per_rank)
    calib = {
        "seq_length": 768,
        "a2a_compute_call_s": compute,
        "a2a_call_s": compute + a2a_bytes + 8 * 2e-3,
        "p2p_call_s": ring + 3 * 2 * 1e-3,
    }
    fit = fit_latencies(spec, calib, MODEL)
    assert fit["a2a"]["latency_us"] == pytest.approx(2000.0) and fit["p2p"][
        "latency_us"
    ] == pytest.approx(1000.0)
    assert fit["a2a"]["steps"] == 8 and fit["p2p"]["steps"] == 6
    fitted = cluster_from_dict(spec)
    e = estimate(lays["p2p"], fitted, one, TrainOptions())
    assert max(r.time_s - r.breakdown["linear_s"] for r in e.per_rank) == pytest.approx(
        calib["p2p_call_s"]
    )
    e = estimate(lays["a2a"], fitted, one, TrainOptions())
    assert max(r.time_s - r.breakdown["linear_s"] for r in e.per_rank) == pytest.approx(
        calib["a2a_call_s"]
    )
    slow = _spec()
    fit = fit_latencies(slow, {**calib, "a2a_call_s": compute / 2, "p2p_call_s": ring / 2}, MODEL)
    assert fit["a2a"]["latency_us"] == 0.0 and slow["gpus"]["X"]["p2p_latency_us"] == 0.0


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 cores")
def test_profile_with_a_model_measures_fixed_costs(tmp_path):
    """(b) gloo: `profile --model-config` on a 1+1 testbed writes the fixed-cost fields and the fit."""
    out = tmp_path / "cluster.yaml"
    assert (
        main(
            [
                "profile",
                "--testbed",
                "1+1",
                "--seconds",
                "0.05",
                "--memory-gib",
                "2",
                "--quiet",
                "--model-config",
                "examples/models/gpt-tiny-gqa.yaml",
                "-o",
                str(out),
            ]
        )
        == 0
    )
    cluster = cluster_from_dict(__import__("yaml").safe_load(out.read_text()))
    raw = json.loads((tmp_path / "cluster.raw.json").read_text())
    fit = raw["latency_fit"]
    assert fit["a2a"]["steps"] == 8 and fit["p2p"]["steps"] == 3  # 1 round: K/V, K/V again, dK/dV
    for name in ("a2a", "p2p"):  # measured minus modelled, per step, never negative
        f = fit[name]
        assert f["latency_us"] == significant(
            max(0.0, f["measured_s"] - f["modelled_without_fixed_s"]) / f["steps"] * 1e6
        )
    per_node = {r["node"]: [] for r in raw["ranks"]}
    per_micro = {r["node"]: [] for r in raw["ranks"]}
    for r in raw["ranks"]:
        per_node[r["node"]].append(r["step_overhead_s"])
        per_micro[r["node"]].append(r["micro_batch_overhead_s"])
        # a part of the rank's fixed local cost, never negative
        assert 0.0 <= r["micro_batch_overhead_s"] <= r["step_overhead_s"]
    for d in cluster.devices:  # the spec carries the fit and each node's mean step overhead
        assert d.collective_latency_s == pytest.approx(fit["a2a"]["latency_us"] * 1e-6)
        assert d.p2p_latency_s == pytest.approx(fit["p2p"]["latency_us"] * 1e-6)
        mean_s = sum(per_node[d.node]) / len(per_node[d.node])
        assert d.step_overhead_s == pytest.approx(significant(mean_s * 1e3) * 1e-3)
        mean_s = sum(per_micro[d.node]) / len(per_micro[d.node])
        assert d.micro_batch_overhead_s == pytest.approx(significant(mean_s * 1e3) * 1e-3)
    points = raw["ranks"][0]["model_step"]
    # the three sizes as one micro-batch, then the largest as four of the smallest
    assert [(p["tokens"], p["micro_batches"]) for p in points] == [
        (256, 1),
        (512, 1),
        (1024, 1),
        (256, 4),
    ]
