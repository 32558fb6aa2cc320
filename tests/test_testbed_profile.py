"""CPU testbed pinning and `profile`.

Layers: (a) no processes — shape parsing and pinning logic; (b) gloo ranks — `profile` on a
2-rank testbed writes a cluster spec that the cluster loader accepts and `plan` can read.
"""
import os

import pytest
import yaml

from megatron_hexiseq.cli import main
from megatron_hexiseq.errors import HexiSeqError
from megatron_hexiseq.profiler import cluster_spec_from_measurements
from megatron_hexiseq.testbed import TestbedShape, cpu_sets, node_names


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
        {"rank": 0, "node": "a", "device": "CPU", "matmul_flops": 100e9, "attention_flops": 30e9,
         "memory_gib": 4.0, "alltoall_Bps": 1e9, "pair_Bps": {"0-1": 2e9, "0-2": 4e9}},
        {"rank": 1, "node": "b", "device": "CPU", "matmul_flops": 40e9, "attention_flops": 10e9,
         "memory_gib": 4.0, "alltoall_Bps": 1e9, "pair_Bps": {"1-2": 6e9}},
        {"rank": 2, "node": "b", "device": "CPU", "matmul_flops": 60e9, "attention_flops": 20e9,
         "memory_gib": 3.0, "alltoall_Bps": 1e9, "pair_Bps": {}},
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
    assert main(["profile", "--testbed", "1+1", "--seconds", "0.05", "--memory-gib", "2",
                 "-o", str(out), "--quiet"]) == 0
    cluster = load_cluster(out)
    assert cluster.world_size == 2
    assert all(d.memory_gib == 2.0 and d.flops_per_s > 0 for d in cluster.devices)
    raw = yaml.safe_load((tmp_path / "cluster.raw.json").read_text())
    assert raw["testbed"]["shape"] == "1+1" and len(raw["ranks"]) == 2


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
