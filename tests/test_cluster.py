"""Cluster spec and GPU catalog.

Layer (a): no processes — parsing, device numbering, link bandwidths, round trip, every invalid-spec
message.
"""

import math
import re
from pathlib import Path

import pytest
import yaml

from megatron_hexiseq.cluster import GPU_CATALOG, cluster_from_dict, cluster_to_dict, load_cluster
from megatron_hexiseq.errors import HexiSeqError

EXAMPLES = Path(__file__).resolve().parent.parent / "examples" / "clusters"


def _spec(**node_extra):
    return {
        "name": "t",
        "gpus": {"MY-GPU": {"bf16_tflops": 200, "memory_gib": 48, "nvlink_GBps": 300}},
        "nodes": [
            {"name": "a", "gpu": "H100-SXM-80GB", "count": 2, "network_GBps": 25, **node_extra},
            {"name": "b", "gpu": "MY-GPU", "count": 3, "network_GBps": 10, "nvlink_GBps": 100},
        ],
    }


def test_catalog_passes_the_user_rules_and_halves_the_quoted_nvlink():
    """Every catalog entry, written out as a user's ``gpus:`` entry, passes the same schema (ranges,
    efficiency in (0, 1]); and its NVLink figure is half the bidirectional number its source quotes
    (the catalog's one-direction convention), so editing one without the other fails here."""
    nodes = [
        {"name": f"n{i}", "gpu": name, "count": 1, "network_GBps": 10}
        for i, name in enumerate(GPU_CATALOG)
    ]
    every = cluster_from_dict({"name": "catalog", "nodes": nodes})
    assert cluster_from_dict(cluster_to_dict(every)) == every
    halved = 0
    for name, g in GPU_CATALOG.items():
        assert g.name == name and g.source
        quoted = re.search(r"([\d.,]+) (GB|TB)/s bidirectional", g.source)
        if quoted is None:
            continue
        gbps = float(quoted[1].replace(",", "")) * (1000 if quoted[2] == "TB" else 1)
        assert g.nvlink_GBps == gbps / 2, name
        halved += 1
    assert halved >= len(GPU_CATALOG) - 1  # all but the CPU placeholder quote a link


def test_devices_numbered_node_by_node_and_links():
    c = cluster_from_dict(_spec())
    assert c.world_size == 5
    assert [(d.index, d.node, d.local_index) for d in c.devices] == [
        (0, "a", 0),
        (1, "a", 1),
        (2, "b", 0),
        (3, "b", 1),
        (4, "b", 2),
    ]
    d0, d2 = c.devices[0], c.devices[2]
    assert d0.flops_per_s == GPU_CATALOG["H100-SXM-80GB"].rate("matmul/bf16") * 1e12  # achieved
    assert d2.flops_per_s == pytest.approx(200e12 * 0.5)  # custom type: default efficiency
    assert d2.memory_bytes == 48 * 2**30 and d0.memory_bytes == 80 * 2**30
    assert c.same_node(0, 1) and not c.same_node(1, 2)
    assert c.link_GBps(0, 1) == 450  # catalog NVLink
    assert c.link_GBps(2, 3) == 100  # node override
    assert c.link_GBps(1, 2) == 10 and c.link_GBps(2, 1) == 10  # min of the two network links
    assert c.link_GBps(3, 3) == math.inf


def test_overrides_of_catalog_entry_and_memory_budget():
    spec = _spec(memory_gib=60)
    spec["gpus"]["H100-SXM-80GB"] = {"efficiency": 0.4, "attention_tflops": 500}
    c = cluster_from_dict(spec)
    d = c.devices[0]
    assert d.memory_gib == 60 and d.gpu.memory_gib == 80
    assert d.flops_per_s == pytest.approx(989.4e12 * 0.4)
    assert d.attention_flops_per_s == pytest.approx(500e12 * 0.4)
    assert c.devices[2].attention_flops_per_s == c.devices[2].flops_per_s


def test_round_trip_through_dict_and_yaml(tmp_path):
    for path in sorted(EXAMPLES.glob("*.yaml")):
        c = load_cluster(path)
        assert cluster_from_dict(cluster_to_dict(c)) == c
        out = tmp_path / path.name
        out.write_text(yaml.safe_dump(cluster_to_dict(c), sort_keys=False))
        assert load_cluster(out) == c
    spec = _spec(memory_gib=60)
    spec["gpus"]["MY-GPU"].update(attention_tflops=50, efficiency=1.0, source="measured")
    c = cluster_from_dict(spec)
    assert cluster_from_dict(cluster_to_dict(c)) == c
    assert cluster_to_dict(c)["gpus"]["MY-GPU"]["attention_tflops"] == 50


def test_bundled_examples():
    sizes = {p.stem: load_cluster(p).world_size for p in EXAMPLES.glob("*.yaml")}
    assert sizes == {"mixed-h100-a100": 16, "h100-a100-l40s-32": 32, "four-types-64": 64}
    four = {d.gpu.name for d in load_cluster(EXAMPLES / "four-types-64.yaml").devices}
    assert four == {"H100-SXM-80GB", "A100-SXM-80GB", "A800-80GB", "L40S-48GB"}


def _bad(mutate):
    spec = _spec()
    mutate(spec)
    return spec


@pytest.mark.parametrize(
    "mutate, message",
    [
        (
            lambda s: s["nodes"][0].update(gpu="H900"),
            r"unknown GPU 'H900'; known: .*A100-SXM-80GB.*MY-GPU",
        ),
        (lambda s: s["nodes"][0].pop("count"), r"nodes\[0\] is missing 'count'"),
        (lambda s: s["nodes"][0].pop("network_GBps"), r"nodes\[0\] is missing 'network_GBps'"),
        (lambda s: s["nodes"][0].update(cuont=2), r"nodes\[0\]: unknown key\(s\) 'cuont'"),
        (lambda s: s.update(nodse=[]), r"top level: unknown key\(s\) 'nodse'"),
        (lambda s: s["gpus"]["MY-GPU"].update(tflops=1), r"gpus.MY-GPU: unknown key\(s\) 'tflops'"),
        (
            lambda s: s["gpus"]["MY-GPU"].pop("memory_gib"),
            r"gpus.MY-GPU is not in the catalog, so it needs memory_gib",
        ),
        (
            lambda s: s["gpus"]["MY-GPU"].update(bf16_tflops=0),
            r"gpus.MY-GPU.bf16_tflops must be a positive number, got 0",
        ),
        (lambda s: s["gpus"]["MY-GPU"].update(efficiency=1.5), r"efficiency must be in \(0, 1\]"),
        (
            lambda s: s["gpus"]["MY-GPU"].update(step_overhead_ms=5, micro_batch_overhead_ms=6),
            r"gpus.MY-GPU.micro_batch_overhead_ms \(6\) exceeds its step_overhead_ms \(5\)",
        ),
        (
            lambda s: s["gpus"]["MY-GPU"].update(micro_batch_overhead_ms=-1),
            r"gpus.MY-GPU.micro_batch_overhead_ms must be a number >= 0, got -1",
        ),
        (
            lambda s: s["nodes"][0].update(count=0),
            r"node 'a': count must be a positive integer, got 0",
        ),
        (lambda s: s["nodes"][0].update(count=2.5), r"count must be a positive integer, got 2.5"),
        (
            lambda s: s["nodes"][0].update(network_GBps=-1),
            r"node 'a': network_GBps must be a positive number, got -1",
        ),
        (
            lambda s: s["nodes"][0].update(nvlink_GBps=0),
            r"nvlink_GBps must be a positive number, got 0",
        ),
        (
            lambda s: s["nodes"][0].update(memory_gib="lots"),
            r"memory_gib must be a positive number, got 'lots'",
        ),
        (lambda s: s["nodes"][1].update(name="a"), r"node name 'a' appears twice"),
        (lambda s: s.update(nodes=[]), r"'nodes' must be a non-empty list"),
        (
            lambda s: s.update(gpus=[1]),
            r"'gpus' must be a mapping of GPU type names to their numbers, got \[1\]",
        ),
    ],
)
def test_invalid_specs_have_one_line_messages(mutate, message):
    with pytest.raises(HexiSeqError, match=message) as e:
        cluster_from_dict(_bad(mutate), source="cluster spec x.yaml")
    assert str(e.value).startswith("cluster spec x.yaml: ") and "\n" not in str(e.value)


def test_load_cluster_file_errors(tmp_path):
    with pytest.raises(HexiSeqError, match=r"does not exist"):
        load_cluster(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("nodes: [\n  - {name: a\n")
    with pytest.raises(HexiSeqError, match=r"bad.yaml is not valid YAML at line"):
        load_cluster(bad)
    empty = tmp_path / "empty.yaml"
    empty.write_text("")
    with pytest.raises(HexiSeqError, match=r"empty.yaml: expected a mapping .* got nothing"):
        load_cluster(empty)
    typo = tmp_path / "typo.yaml"
    typo.write_text(
        "name: x\nnodes:\n  - {name: a, gpu: H100-SXM-80GB, count: 1, network_GBps: 1, nvlnk_GBps: 3}\n"
    )
    with pytest.raises(HexiSeqError, match=r"typo.yaml: nodes\[0\]: unknown key\(s\) 'nvlnk_GBps'"):
        load_cluster(typo)
