"""CPU testbed pinning and `profile`.

Layers: (a) no processes — shape parsing and pinning logic; (b) gloo ranks — `profile` on a
2-rank testbed writes a cluster spec that the cluster loader accepts and `plan` can read, and
the library's `run_profile` takes the CPU calibration only as an argument. (c): none.
"""

import os

import pytest
import yaml

from megatron_hexiseq.cli import main
from megatron_hexiseq.cluster import cluster_from_dict
from megatron_hexiseq.errors import HexiSeqError
from megatron_hexiseq.model import get_model
from megatron_hexiseq.profile.measure import ProfileOptions
from megatron_hexiseq.profile.run import CpuCalibration, cluster_spec_from_measurements, run_profile
from megatron_hexiseq.testbed.pinning import TestbedShape, cpu_sets, node_names
from megatron_hexiseq.testbed.spawn import run_ranks


def test_shape_parse_and_world_size():
    assert TestbedShape.parse("1+2").ranks_per_core == (1, 2)
    assert TestbedShape.parse("1,3").world_size == 4
    assert str(TestbedShape.parse("2+1")) == "2+1"
    for bad in ("", "a+b", "1+0", "-1"):
        with pytest.raises(HexiSeqError):
            TestbedShape.parse(bad)


def test_cpu_sets_pin_ranks_core_by_core():
    assert cpu_sets(TestbedShape.parse("1+2"), [0, 1]) == [[0], [1], [1]]
    assert cpu_sets(TestbedShape.parse("2+1"), [4, 7]) == [[4], [4], [7]]
    assert node_names(TestbedShape.parse("1+2"), [0, 1], host="h") == ["h-c0", "h-c1", "h-c1"]
    with pytest.raises(HexiSeqError, match="needs 3 cores but only 2"):
        cpu_sets(TestbedShape.parse("1+1+1"), [0, 1])


def test_spec_from_measurements_groups_nodes_and_bandwidths():
    ranks = [
        {
            "rank": 0,
            "node": "a",
            "device": "CPU",
            "matmul_flops": 100e9,
            "attention_flops": 30e9,
            "memory_gib": 4.0,
            "alltoall_Bps": 1e9,
            "pair_Bps": {"0-1": 2e9, "0-2": 4e9},
        },
        {
            "rank": 1,
            "node": "b",
            "device": "CPU",
            "matmul_flops": 40e9,
            "attention_flops": 10e9,
            "memory_gib": 4.0,
            "alltoall_Bps": 1e9,
            "pair_Bps": {"1-2": 6e9},
        },
        {
            "rank": 2,
            "node": "b",
            "device": "CPU",
            "matmul_flops": 60e9,
            "attention_flops": 20e9,
            "memory_gib": 3.0,
            "alltoall_Bps": 1e9,
            "pair_Bps": {},
        },
    ]
    spec = cluster_spec_from_measurements(ranks)
    assert [n["name"] for n in spec["nodes"]] == ["a", "b"]
    b = spec["nodes"][1]
    assert b["count"] == 2 and b["nvlink_GBps"] == 6.0 and b["network_GBps"] == 3.0
    t = spec["gpus"][b["gpu"]]
    assert t["bf16_tflops"] == 0.05 and t["attention_tflops"] == 0.015 and t["memory_gib"] == 3.0
    ranks[2]["node"] = "a"  # rank 2 not next to rank 0: layouts number ranks node by node
    with pytest.raises(ValueError, match="not next to"):
        cluster_spec_from_measurements(ranks)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 cores")
def test_profile_two_rank_testbed_writes_valid_spec(tmp_path, capsys):
    from megatron_hexiseq.cluster import load_cluster

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
                "-o",
                str(out),
                "--quiet",
            ]
        )
        == 0
    )
    cluster = load_cluster(out)
    assert cluster.world_size == 2
    assert not any(d.gpu.curve("cpu-flash/causal") for d in cluster.devices)  # no model: flat
    assert all(d.memory_gib == 2.0 for d in cluster.devices)
    raw = yaml.safe_load((tmp_path / "cluster.raw.json").read_text())
    shape = TestbedShape.parse("1+1")
    assert raw["testbed"] == {"shape": "1+1", "cpu_sets": cpu_sets(shape)}
    assert [r["node"] for r in raw["ranks"]] == node_names(
        shape
    )  # each rank measured on its own core
    want = cluster_spec_from_measurements(
        raw["ranks"]
    )  # the written spec is the raw numbers, assembled
    assert yaml.safe_load(out.read_text()) == {**want, "name": "cpu-testbed-1+1"}


def test_profile_errors_are_one_line_exit_2(tmp_path, capsys):
    assert main(["profile", "-o", str(tmp_path / "missing" / "c.yaml"), "--testbed", "1"]) == 2
    assert "does not exist" in capsys.readouterr().err
    env = {k: os.environ.pop(k) for k in ("RANK", "WORLD_SIZE") if k in os.environ}
    try:
        assert main(["profile", "-o", str(tmp_path / "c.yaml")]) == 2
        assert "torchrun" in capsys.readouterr().err
    finally:
        os.environ.update(env)
    assert not (tmp_path / "c.yaml").exists()


# ---- run_profile with and without a CPU calibration (layer (b), one gloo rank) ---------------
def _step(model, tokens, opts):
    return {"flops_per_s": 3e12, "step_overhead_s": 0.25, "points": [{"tokens": tokens}]}


def _attention(model, tokens, opts):
    return 1e9 * tokens  # tokens: the model's sequence, capped at 2048


def _fit(spec, calls, model):
    for entry in spec["gpus"].values():
        entry["collective_latency_us"] = calls["marker"]
    return {"seen": calls["marker"]}


def _profile(rank: int, world: int, opts: ProfileOptions, calibration: CpuCalibration | None):
    return run_profile(opts, cpu_calibration=calibration)


def test_run_profile_uses_the_calibration_it_is_given():
    """The calibration's numbers reach the spec unchanged; without one no testbed measurement runs
    (no step overhead, no fixed costs: the model's layer and SDPA are timed instead)."""
    model = get_model("gpt-tiny", overrides={"seq_length": 3000})
    opts = ProfileOptions(
        seconds_per_test=0.01, repeats=1, message_bytes=1 << 12, memory_gib=1.0, model=model
    )
    fake = CpuCalibration(
        model_step=_step,
        attention_flops=_attention,
        can_time_fixed_costs=_always,
        fixed_costs=_marker,
        fit_latencies=_fit,
        attention_curve=_curve,
    )
    ((spec, raw),) = run_ranks(_profile, 1, opts, fake)
    (gpu,) = spec["gpus"].values()
    # the kernel's rows become cpu-flash curves beside the flat rate: fractions of the largest size
    H = model.num_attention_heads
    assert gpu["attention_curves"] == {
        "cpu-flash/causal": [[16 * 17 // 2 * H, 0.25], [2048 * 2049 // 2 * H, 1.0]],
        "cpu-flash/full": [[16 * 16 * H, 0.5], [2048 * 2048 * H, 2.0]],
    }
    assert cluster_from_dict(spec).devices[0].gpu.curve("cpu-flash/full") is not None
    assert (
        gpu["bf16_tflops"] == 3.0 and gpu["attention_tflops"] == 2.048
    )  # 3000 tokens capped at 2048
    assert gpu["step_overhead_ms"] == 250.0 and gpu["collective_latency_us"] == 42.0
    assert raw["latency_fit"] == {"seen": 42.0} and raw["ranks"][0]["model_step"] == [
        {"tokens": 3000}
    ]
    ((plain, raw_plain),) = run_ranks(_profile, 1, opts, None)
    (gpu,) = plain["gpus"].values()
    assert (
        "step_overhead_ms" not in gpu
        and "collective_latency_us" not in gpu
        and "latency_fit" not in raw_plain
    )
    assert "model_step" not in raw_plain["ranks"][0] and "attention_curves" not in gpu


def _curve(model, tokens, opts):
    rate = {(True, 16): 0.25, (True, 2048): 1.0, (False, 16): 0.5, (False, 2048): 2.0}
    return [
        {"kernel": "cpu-flash", "dtype": "fp32", "D": model.kv_channels, "causal": c, "S": S}
        | {"H": model.num_attention_heads, "fwd_bwd_tflops": r}
        for (c, S), r in rate.items()
    ]


def _always(model, world):
    return True


def _marker(model, opts):
    return {"marker": 42.0}
