"""Tensor parallelism inside a HexiSeq layout, layer (a): no processes.

The head rule (Megatron's split and its K/V replication), the layout over TP bundles (JSON, the
cluster and model checks, ``meta.model_spec``), the runtime's start-up checks of a TP run, the
launcher's rank table with TP, and the test harness's weight slicing (``testbed/tp_cpu.py``).
The gloo runs are in ``tests/test_megatron_tp.py``.
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch

from megatron_hexiseq.cluster import cluster_from_dict
from megatron_hexiseq.errors import HexiSeqError
from megatron_hexiseq.layout import Layout, check_matches, make_layout
from megatron_hexiseq.megatron.launch import placements
from megatron_hexiseq.megatron.runtime import RunShape, check_run
from megatron_hexiseq.megatron.tensor_parallel import check_bundle_hosts, check_bundle_tokens
from megatron_hexiseq.model import get_model
from megatron_hexiseq.tensor_parallel import (
    global_kv_head,
    global_query_head,
    tp_heads,
    valid_tp_sizes,
)
from megatron_hexiseq.testbed.tp_cpu import tp_slice


def test_tp_heads_follows_megatron():
    assert tp_heads(64, 8, 1) == (64, 8)
    assert tp_heads(64, 8, 8) == (8, 1)  # llama3-70b on 8: one K/V head each, no replication
    assert tp_heads(32, 8, 4) == (8, 2)
    assert tp_heads(8, 2, 4) == (2, 1)  # G < t: K/V replicated on t / G = 2 ranks
    assert tp_heads(8, 1, 2) == (4, 1)  # MQA
    with pytest.raises(HexiSeqError, match="40 attention heads do not divide"):
        tp_heads(40, 40, 3)
    with pytest.raises(HexiSeqError, match="12 query groups do not divide"):
        tp_heads(48, 12, 8)
    with pytest.raises(HexiSeqError, match="multiple of the query groups"):
        tp_heads(12, 3, 2 * 2)  # 3 groups on 4 ranks: Megatron cannot replicate
    assert valid_tp_sizes(64, 8, [8, 8, 4]) == [1, 2, 4]
    assert valid_tp_sizes(40, 40, [8]) == [1, 2, 4, 8]


def test_global_heads_are_megatrons_slices():
    # TP rank i computes the model's query heads i*H/t .. and their K/V heads (attention.py)
    H, G, t = 8, 2, 4  # replication: K/V head of rank i is i // (t / G)
    for i in range(t):
        q = [global_query_head(h, i, H, t) for h in range(H // t)]
        assert q == list(range(i * 2, i * 2 + 2))
        assert global_kv_head(0, i, G, t) == q[0] // (H // G) == i // 2
    H, G, t = 8, 4, 2
    for i in range(t):
        kv = [global_kv_head(g, i, G, t) for g in range(G // t)]
        q = [global_query_head(h, i, H, t) for h in range(H // t)]
        assert kv == sorted({h // (H // G) for h in q})


def _bundles(**kw) -> Layout:
    base = dict(
        seq_length=48,
        num_attention_heads=4,
        num_query_groups=1,
        group_sizes=[2, 1],
        segments=[[(0, 6), (36, 42)], [(6, 16)], [(16, 36), (42, 48)]],
        heads=[[0, 1, 2], [3], [0, 1, 2, 3]],
        hosts=["n0", "n0", "n1"],
        gpus=["H100-SXM-80GB"] * 3,
        tensor_model_parallel_size=2,
    )
    base.update(kw)
    return make_layout(**base)


def test_layout_json_records_tp_only_above_one():
    lay = _bundles()
    data = lay.to_dict()
    assert data["tensor_model_parallel_size"] == 2
    assert list(data)[:6] == [
        "format",
        "version",
        "seq_length",
        "num_attention_heads",
        "num_query_groups",
        "world_size",
    ]
    back = Layout.from_json(lay.to_json())
    assert back == lay and back.tensor_model_parallel_size == 2
    plain = _bundles(tensor_model_parallel_size=1)
    assert "tensor_model_parallel_size" not in plain.to_dict()  # t = 1 files are unchanged
    assert Layout.from_json(plain.to_json()).tensor_model_parallel_size == 1
    assert lay != plain  # t is part of the structure
    bad = json.loads(lay.to_json())
    bad["tensor_model_parallel_size"] = 0
    with pytest.raises(HexiSeqError, match="tensor_model_parallel_size"):
        Layout.from_dict(bad)


def _cluster(counts=(4, 2)):
    return cluster_from_dict(
        {
            "name": "c",
            "nodes": [
                {"name": f"n{i}", "gpu": "H100-SXM-80GB", "count": c, "network_GBps": 25}
                for i, c in enumerate(counts)
            ],
        }
    )


def test_layout_over_bundles_matches_cluster_and_model():
    lay = _bundles()
    tiny = replace(get_model("gpt-tiny"), num_query_groups=2, seq_length=48)  # 8 heads / 2 groups
    check_matches(lay, _cluster(), tiny)  # 3 bundles of 2 = 6 GPUs; 4 heads / 1 group per TP rank
    with pytest.raises(HexiSeqError, match="3 TP bundles of 2 but cluster 'c' has 8 GPUs"):
        check_matches(lay, _cluster((4, 4)))
    with pytest.raises(HexiSeqError, match="rank 1 is on n1.* device 2 is n0"):
        check_matches(_bundles(hosts=["n0", "n1", "n1"]), _cluster())
    with pytest.raises(HexiSeqError, match="per TP rank of 2 but model .* has 4 in 2"):
        check_matches(lay, _cluster(), replace(tiny, num_query_groups=4))
    # meta.model_spec holds the model: its heads are compared per TP rank
    data = lay.to_dict() | {"meta": {"model_spec": tiny.to_dict()}}
    Layout.from_dict(data)
    data["meta"]["model_spec"]["num_attention_heads"] = 16
    with pytest.raises(HexiSeqError, match="meta.model_spec.num_attention_heads is 8"):
        Layout.from_dict(data)


def _run(**kw) -> RunShape:
    base = dict(
        world_size=6,
        tensor_model_parallel_size=2,
        pipeline_model_parallel_size=1,
        context_parallel_size=3,
        seq_length=48,
        num_attention_heads=8,
        num_query_groups=2,
        sequence_parallel=True,
    )
    base.update(kw)
    return RunShape(**base)


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(tensor_model_parallel_size=1, world_size=3), "planned for TP bundles of 2 GPUs"),
        (dict(num_attention_heads=16), "planned for 4 attention heads in 1 query groups but the"),
        (dict(num_query_groups=4), "the model has 4 in 2 per TP rank"),
        (dict(world_size=9), "world size 9 is not a multiple of TP x PP x CP = 2 x 1 x 3"),
    ],
)
def test_check_run_with_tp(change, message):
    check_run(_bundles(), _run())
    check_run(_bundles(), _run(num_query_groups=1))  # MQA: K/V replicated, still 4 / 1 per rank
    with pytest.raises(HexiSeqError, match=message):
        check_run(_bundles(), _run(**change))


def test_sequence_parallel_needs_t_multiple_tokens():
    odd = _bundles(segments=[[(0, 6), (36, 41)], [(6, 16)], [(16, 36), (41, 48)]])
    check_run(odd, _run(sequence_parallel=False))  # TP without sequence parallelism: any split
    with pytest.raises(HexiSeqError, match="TP bundle 0 holds 11 tokens .and 1 more., not a mult"):
        check_run(odd, _run())
    check_bundle_tokens(odd, 1)
    with pytest.raises(HexiSeqError, match="layout with t=1"):
        check_run(_bundles(tensor_model_parallel_size=1), _run(), source="layout with t=1")


def test_bundle_hosts():
    hosts = ["a", "a", "b", "b"]
    assert check_bundle_hosts([[0, 1], [2, 3]], hosts) == []
    with pytest.raises(HexiSeqError, match=r"TP group \[1, 2\] spans hosts a, b"):
        check_bundle_hosts([[0], [1, 2], [3]], hosts)
    assert len(check_bundle_hosts([[1, 2]], hosts, allow_mismatch=True)) == 1


def test_rank_table_places_bundles_on_their_hosts():
    lay = _bundles()
    nodes = [
        {"name": "n0", "gpu": "H100-SXM-80GB", "count": 4},
        {"name": "n1", "gpu": "H100-SXM-80GB", "count": 2},
    ]
    got = [(p.rank, p.host, p.local_rank) for p in placements(lay, nodes)]
    assert got == [
        (0, "n0", 0),
        (1, "n0", 1),
        (2, "n0", 2),
        (3, "n0", 3),
        (4, "n1", 0),
        (5, "n1", 1),
    ]
    two = placements(lay, nodes + [dict(n, name=n["name"] + "b") for n in nodes], 2)
    assert [(p.rank, p.host, p.local_rank) for p in two[6:8]] == [(6, "n0b", 0), (7, "n0b", 1)]
    with pytest.raises(HexiSeqError, match="puts 6 GPUs on host 'n0', which has 4"):
        placements(_bundles(hosts=["n0", "n0", "n0"]), nodes)


def test_tp_slice_inverts_megatrons_split():
    full = torch.arange(24.0).view(6, 4)
    assert torch.equal(
        tp_slice("x.linear_proj.weight", full, 1, 2, gated_linear_unit=True), full[:, 2:]
    )
    assert torch.equal(
        tp_slice("x.linear_qkv.weight", full, 1, 2, gated_linear_unit=True), full[3:]
    )
    norm = torch.ones(4)
    assert tp_slice("x.input_layernorm.weight", norm, 1, 2, gated_linear_unit=True) is norm
    gate_up = torch.arange(8.0)  # [gate 0..3; up 4..7] -> rank 1: [gate 2, 3; up 6, 7]
    got = tp_slice("x.mlp.linear_fc1.weight", gate_up, 1, 2, gated_linear_unit=True)
    assert got.tolist() == [2.0, 3.0, 6.0, 7.0]
    assert tp_slice("x.mlp.linear_fc1.weight", gate_up, 1, 2, gated_linear_unit=False).tolist() == [
        4.0,
        5.0,
        6.0,
        7.0,
    ]
