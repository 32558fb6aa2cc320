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
from megatron_hexiseq.costmodel.documents import cu_from_lengths, estimate_documents
from megatron_hexiseq.errors import HexiSeqError
from megatron_hexiseq.model import get_model
from megatron_hexiseq.planner.baselines import hosts_and_gpus
from megatron_hexiseq.profile.measure import significant
from megatron_hexiseq.testbed.calibrate import (
    CALIBRATION_STEPS,
    LATENCY_FIELDS,
    calibration_documents,
    calibration_heads,
    calibration_layouts,
    can_calibrate,
    fit_latencies,
    split_layout,
    step_documents,
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


def _steps(cluster, latency_s: list[float]) -> list[dict]:
    """The calibration's steps (``CALIBRATION_STEPS``) as measured = the model's iteration with
    latency ``latency_s[i]`` for step i (its layout's field; the other fixed cost 0)."""
    lays = _layouts(cluster)
    full = replace(MODEL, seq_length=768)
    out = []
    for (name, which, split), lat in zip(CALIBRATION_STEPS, latency_s):
        spec = cluster_to_dict(cluster)
        for gpu in spec["gpus"].values():
            gpu["collective_latency_us"] = gpu["p2p_latency_us"] = 0.0
            gpu[LATENCY_FIELDS[name]] = lat * 1e6
        documents = step_documents(which, 768, 3)
        lay = split_layout(lays[name], documents, split)
        e = estimate_documents(
            lay, cluster_from_dict(spec), full, TrainOptions(), cu_from_lengths(documents)
        )
        out.append(
            {"layout": name, "documents": list(documents), "split": split}
            | {"step_s": e.iteration_time_s}
        )
    return out


def test_fit_recovers_latencies_that_reproduce_the_measured_steps():
    """Closure: steps measured as modelled + known fixed costs give back exactly those costs, and
    the fitted spec then predicts every step. Faster-than-modelled steps give 0."""
    spec = _spec()
    cluster = cluster_from_dict(spec)
    assert calibration_documents(768, 3) == (109, 110, 110, 109, 110, 110, 110)
    steps = _steps(cluster, [2e-3, 2e-3, 1e-3, 1e-3, 1e-3])
    fit = fit_latencies(spec, {"seq_length": 768, "steps": steps}, MODEL)
    assert fit["a2a"]["latency_us"] == pytest.approx(2000.0)
    assert fit["p2p"]["latency_us"] == pytest.approx(1000.0)
    L = MODEL.num_layers
    # a2a: 2 passes x 4 collectives per layer; p2p zig-zag: 2 rounds x 3 exchange steps per layer,
    # contiguous: 110-token documents over 256-token ranks reach back one rank
    assert [r["steps"] for r in fit["a2a"]["steps"]] == [8 * L] * 2
    assert [r["steps"] for r in fit["p2p"]["steps"]] == [6 * L, 6 * L, 3 * L]
    fitted = cluster_from_dict(spec)
    lays = _layouts(fitted)
    for step in steps:
        lay = split_layout(lays[step["layout"]], step["documents"], step["split"])
        e = estimate_documents(
            lay,
            fitted,
            replace(MODEL, seq_length=768),
            TrainOptions(),
            cu_from_lengths(step["documents"]),
        )
        assert e.iteration_time_s == pytest.approx(step["step_s"])
    slow = _spec()
    fast = [{**x, "step_s": x["step_s"] / 2} for x in _steps(cluster, [0.0] * 5)]
    fit = fit_latencies(slow, {"seq_length": 768, "steps": fast}, MODEL)
    assert fit["a2a"]["latency_us"] == 0.0 and slow["gpus"]["X"]["p2p_latency_us"] == 0.0


def test_fit_of_steps_that_disagree_minimises_their_relative_errors():
    """K/V steps that imply 1, 3 and 2 ms: one latency strictly between, each step predicted as the
    fit says, and no nearby latency with a smaller sum of squared relative errors."""
    cluster = cluster_from_dict(_spec())
    steps = _steps(cluster, [0.0, 0.0, 1e-3, 3e-3, 2e-3])
    fit = fit_latencies(_spec(), {"seq_length": 768, "steps": steps}, MODEL)["p2p"]
    x = fit["latency_us"] * 1e-6
    assert 1e-3 < x < 3e-3

    def cost(lat: float) -> float:
        pred = _steps(cluster, [0.0, 0.0] + [lat] * 3)[2:]
        return sum((p["step_s"] / m["step_s"] - 1) ** 2 for p, m in zip(pred, steps[2:]))

    for p, r in zip(_steps(cluster, [0.0, 0.0] + [x] * 3)[2:], fit["steps"]):
        assert r["predicted_s"] == pytest.approx(p["step_s"], rel=1e-9)
    assert cost(x) <= min(cost(x * 0.99), cost(x * 1.01))


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
    layers = get_model(config_path="examples/models/gpt-tiny-gqa.yaml").num_layers
    for name, counts in (("a2a", [8 * layers] * 2), ("p2p", [3 * layers] * 2)):
        rows = fit[name]["steps"]  # one sequence, then packed documents (p2p: + contiguous)
        assert [r["layout"] for r in rows] == [name] * len(rows) and len(rows) == 2 + (
            name == "p2p"
        )
        assert len(rows[0]["documents"]) == 1 and len(rows[1]["documents"]) > 1
        # a2a: 4 collectives per layer and pass; p2p, 1 round: K/V, K/V again, dK/dV back (the
        # contiguous split may need no exchange)
        assert [r["steps"] for r in rows[:2]] == counts
        for r in rows:  # measured steps; with the latency each prediction grows by at most
            # the most any rank pays (the slowest rank may change)
            extra = r["predicted_s"] - r["modelled_without_latency_s"]
            assert r["step_s"] > 0 and -1e-12 <= extra
            assert extra <= r["steps"] * fit[name]["latency_us"] * 1e-6 * (1 + 1e-9)
    per_node = {r["node"]: [] for r in raw["ranks"]}
    for r in raw["ranks"]:
        per_node[r["node"]].append(r["step_overhead_s"])
    for d in cluster.devices:  # the spec carries the fit and each node's mean step overhead
        assert d.collective_latency_s == pytest.approx(fit["a2a"]["latency_us"] * 1e-6)
        assert d.p2p_latency_s == pytest.approx(fit["p2p"]["latency_us"] * 1e-6)
        mean_s = sum(per_node[d.node]) / len(per_node[d.node])
        assert d.step_overhead_s == pytest.approx(significant(mean_s * 1e3) * 1e-3)
    points = raw["ranks"][0]["model_step"]
    assert [p["tokens"] for p in points] == [256, 512, 1024]
