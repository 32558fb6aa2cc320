"""The step's fixed costs (``costmodel.step``): rings, overlap, gradient reduction, Megatron-FSDP,
the optimizer step.

Layer (a) only (no processes): exact values on hand-computed cases; the overlap rule against a
brute-force simulation of the bucket pipeline; Megatron-FSDP's time inside ``estimate`` by hand;
the distributed optimizer's single-sequence estimate unchanged by the new fields.
"""

from __future__ import annotations

import math
import random

import pytest

from megatron_hexiseq.cluster import GPU_CATALOG, cluster_from_dict, cluster_to_dict
from megatron_hexiseq.costmodel import estimate
from megatron_hexiseq.costmodel.step import (
    ADAM_BYTES_PER_PARAM,
    GradSync,
    fsdp_comm,
    grad_buckets,
    grad_sync,
    grad_sync_exposed_s,
    optimizer_bytes,
    optimizer_s,
    overlapped_s,
    ring_bus_GBps,
    ring_collective_s,
    step_fixed,
    step_once_s,
    step_time_s,
)
from megatron_hexiseq.errors import HexiSeqError
from megatron_hexiseq.layout import make_layout
from megatron_hexiseq.model import ModelSpec, get_model
from megatron_hexiseq.run_config import TrainOptions, megatron_flags, options_record

TINY = ModelSpec(
    name="tiny",
    num_layers=2,
    hidden_size=8,
    num_attention_heads=2,
    num_query_groups=2,
    ffn_hidden_size=16,
    vocab_size=16,
    kv_channels=4,
    swiglu=False,
    seq_length=8,
)


def _two_nodes() -> object:
    return cluster_from_dict(
        {
            "name": "h2a2",
            "nodes": [
                {"name": "h", "gpu": "H100-SXM-80GB", "count": 2, "network_GBps": 25},
                {"name": "a", "gpu": "A100-SXM-80GB", "count": 2, "network_GBps": 25},
            ],
        }
    )


def test_ring_bus_is_the_slowest_link_the_ring_crosses():
    c = _two_nodes()
    assert ring_bus_GBps(c) == 50.0  # 2 GPUs' NICs leave each node: 2 x 25 < NVLink 300
    assert ring_bus_GBps(c, [0, 1]) == 450.0  # one H100 node: NVLink
    assert ring_bus_GBps(c, [2, 3]) == 300.0
    assert ring_bus_GBps(c, [0, 2]) == 25.0  # one GPU of each node: one NIC each
    assert ring_bus_GBps(c, [0]) == math.inf
    assert ring_bus_GBps(c, [0, 1], replicas=2) == 50.0  # copies elsewhere: over the network
    # all-gather of 8 GB over 4 ranks at 50 GB/s: 3/4 of it through every link
    assert ring_collective_s(8 * 10**9, 4, 50.0) == pytest.approx(0.12)
    assert ring_collective_s(8 * 10**9, 1, 50.0) == 0.0


def _pipeline(comm: float, compute: float, chunks: int) -> float:
    """Brute force: piece i ready when compute reaches (i+1)/chunks, pieces one after another."""
    end = 0.0
    for i in range(chunks):
        end = max(end, compute * (i + 1) / chunks) + comm / chunks
    return end - compute


def test_overlap_rule_is_the_bucket_pipeline():
    assert overlapped_s(1.0, 10.0, 4) == 0.25  # compute-bound: the last piece
    assert overlapped_s(10.0, 4.0, 5) == pytest.approx(6.8)  # comm-bound: 10 - 4/5 x 4
    assert overlapped_s(0.0, 3.0, 7) == 0.0
    rng = random.Random(5)
    for _ in range(300):
        comm, compute, chunks = rng.uniform(0, 5), rng.uniform(0, 5), rng.randint(1, 40)
        assert overlapped_s(comm, compute, chunks) == pytest.approx(
            _pipeline(comm, compute, chunks)
        )


def test_grad_sync_of_the_distributed_optimizer():
    m = get_model("gpt-7b")
    p = m.num_parameters
    s = grad_sync(m, TrainOptions(), 16, 200.0)
    assert s.reduce_scatter_s == pytest.approx(15 / 16 * 4 * p / 200e9)  # fp32 gradients
    assert s.all_gather_s == pytest.approx(15 / 16 * 2 * p / 200e9)  # bf16 parameters
    assert s.buckets == math.ceil(p / 40e6) == grad_buckets(m, 16)
    assert grad_buckets(m, 1024) == math.ceil(p / 1024e6)  # Megatron's 1M x dp bucket
    # fsdp reduces and gathers every micro-batch (in estimate): nothing is left for the step
    assert grad_sync(m, TrainOptions(memory_mode="fsdp"), 16, 200.0) == GradSync(0.0, 0.0, 1)
    sync = GradSync(reduce_scatter_s=2.0, all_gather_s=1.0, buckets=10)
    assert grad_sync_exposed_s(sync, TrainOptions(), 5.0, 5.0) == 3.0  # not overlapped
    over = TrainOptions(overlap_grad_sync=True)
    # all-gather behind a 5 s forward: its last bucket 0.1 s; reduce-scatter 2 s behind 1 s: 2 - 0.9
    assert grad_sync_exposed_s(sync, over, 5.0, 1.0) == pytest.approx(0.1 + 1.1)


def test_optimizer_step_moves_the_shard_at_hbm_bandwidth():
    p = TINY.num_parameters
    assert p == 1 * 128 * 2 + 2 * 600 + 16 == 1472
    shard = -(-p // 4)
    # Adam over the shard, plus zeroing the unsharded fp32 gradient buffer (the shard under fsdp)
    assert optimizer_bytes(TINY, TrainOptions(), 4) == ADAM_BYTES_PER_PARAM * shard + 4 * p == 18400
    assert optimizer_bytes(TINY, TrainOptions(memory_mode="fsdp"), 4) == 38 * shard == 13984
    assert optimizer_s(TINY, TrainOptions(), 4, 1e9) == pytest.approx(18400e-9)
    assert optimizer_s(TINY, TrainOptions(), 4, 0.0) == 0.0  # unknown bandwidth: not priced
    h100 = GPU_CATALOG["H100-SXM-80GB"]
    assert (h100.hbm_GBps, GPU_CATALOG["A100-SXM-80GB"].hbm_GBps) == (3350.0, 2039.0)
    m = get_model("gpt-7b")
    seconds = optimizer_s(m, TrainOptions(), 16, 2039e9)
    assert seconds == pytest.approx(
        (34 * -(-m.num_parameters // 16) + 4 * m.num_parameters) / 2039e9
    )


def test_step_fixed_and_step_time():
    c = _two_nodes()
    m = get_model("gpt-7b")
    fixed = step_fixed(c, [[0, 1], [2, 3]], m, TrainOptions())
    assert fixed.bus_GBps == 50.0 and fixed.ranks == 4 and not fixed.measured
    assert fixed.sync == grad_sync(m, TrainOptions(), 4, 50.0)
    # the slowest memory sets the optimizer's pace (A100: 2039 GB/s)
    assert fixed.optimizer_s == optimizer_s(m, TrainOptions(), 4, 2039e9)
    # domains of 1 s and 3 s per micro-batch, offsets 0.5 / 0.1, shares 3 / 1: max(3.5, 3.1) + opt
    assert step_time_s([1.0, 3.0], [0.5, 0.1], [3, 1], fixed) == pytest.approx(
        3.5 + fixed.optimizer_s
    )
    # fsdp shards over every rank too (Megatron's dp_cp) and leaves no reduction for the step
    fsdp = TrainOptions(memory_mode="fsdp")
    ff = step_fixed(c, [[0, 1], [2, 3]], m, fsdp)
    assert ff.sync == GradSync(0.0, 0.0, 1) and ff.optimizer_s == optimizer_s(m, fsdp, 4, 2039e9)
    # a measured step overhead (the CPU testbed) replaces the modelled reduction and optimizer
    spec = cluster_to_dict(c)
    for g in spec["gpus"].values():
        g["step_overhead_ms"] = 20.0
    measured = step_fixed(cluster_from_dict(spec), [[0, 1, 2, 3]], m, TrainOptions())
    assert measured.measured and measured.overhead_s == pytest.approx(0.02)
    assert measured.sync == GradSync(0.0, 0.0, 1) and measured.optimizer_s == 0.0
    assert measured.once_s == pytest.approx(0.02)  # no per-micro-batch part measured


def test_per_micro_batch_overhead_is_paid_once_per_micro_batch():
    """A step of m micro-batches pays step_overhead + (m - 1) x micro_batch_overhead: the job's
    step (``step_time_s`` on micro-batch times that carry the per-micro-batch part) and what
    ``step_once_s`` leaves of a priced micro-batch's overhead agree on it."""
    spec = cluster_to_dict(_two_nodes())
    for g in spec["gpus"].values():
        g["step_overhead_ms"] = 20.0
    spec["gpus"]["A100-SXM-80GB"]["micro_batch_overhead_ms"] = 5.0
    c = cluster_from_dict(spec)
    assert c.devices[2].micro_batch_overhead_s == pytest.approx(0.005)
    assert c.devices[0].micro_batch_overhead_s == 0.0
    # the spec keeps it when written back
    assert cluster_to_dict(c)["gpus"]["A100-SXM-80GB"]["micro_batch_overhead_ms"] == 5.0
    fixed = step_fixed(c, [[0, 1], [2, 3]], get_model("gpt-7b"), TrainOptions())
    assert fixed.micro_batch_overhead_s == pytest.approx(0.005)  # the job's largest
    assert fixed.once_s == pytest.approx(0.015)
    # micro-batches of 1 s of work each carrying 5 ms, three of them: 3 x 1 s + 20 + 2 x 5 ms
    assert step_time_s([1.005], [0.0], [3], fixed) == pytest.approx(3.0 + 0.020 + 0.010)
    # a priced micro-batch carries the whole 20 ms; a further one keeps 5 ms of it
    assert step_once_s(c.devices) == pytest.approx(0.015)
    assert step_once_s(c.devices[:2]) == pytest.approx(0.020)  # no part measured there


def test_fsdp_collectives_in_estimate_by_hand():
    spec = {
        "name": "t",
        "gpus": {"T": {"bf16_tflops": 1, "memory_gib": 1, "nvlink_GBps": 10, "efficiency": 1.0}},
        "nodes": [{"name": "n0", "gpu": "T", "count": 2, "network_GBps": 10}],
    }
    c = cluster_from_dict(spec)
    lay = make_layout(
        seq_length=8,
        num_attention_heads=2,
        num_query_groups=2,
        group_sizes=[2],
        segments=[[(0, 3)], [(3, 8)]],
        heads=[[0], [1]],
        hosts=["n0"] * 2,
        gpus=["T"] * 2,
    )
    dist = estimate(lay, c, TINY)
    fsdp = estimate(lay, c, TINY, TrainOptions(memory_mode="fsdp"))
    p = TINY.num_parameters
    # a ring of 2 on NVLink (10 GB/s): forward gathers 2P bytes, backward 2P + 4P, half of each moves
    comm = fsdp_comm(TINY, 2, 10.0)
    assert comm.forward_s == pytest.approx(0.5 * 2 * p / 10e9)
    assert comm.backward_s == pytest.approx(0.5 * 6 * p / 10e9)
    for r, tokens in ((0, 3), (1, 5)):
        lin = dist.per_rank[r].breakdown["linear_s"]
        assert lin == pytest.approx(tokens * 6 * (2 * 512 + 8 * 16) * 1e-12)  # 1e12 FLOP/s
        # communication-bound over L = 2 layers: comm - 1/2 x its window (1/3, 2/3 of lin)
        want = comm.forward_s - lin / 6 + comm.backward_s - lin / 3
        got = fsdp.per_rank[r].breakdown["fsdp_exposed_s"]
        assert got == pytest.approx(want)
        assert fsdp.per_rank[r].breakdown["linear_s"] == pytest.approx(lin + want)
    assert fsdp.iteration_time_s == pytest.approx(
        dist.iteration_time_s + fsdp.per_rank[1].breakdown["fsdp_exposed_s"]
    )
    # a shard group over more ranks and a slower ring (a job's): priced with those
    job = TrainOptions(memory_mode="fsdp", shard_group_size=8, shard_group_GBps=1.0)
    e = estimate(lay, c, TINY, job)
    slow = fsdp_comm(TINY, 8, 1.0)
    assert e.per_rank[0].breakdown["fsdp_exposed_s"] == pytest.approx(
        slow.forward_s
        - dist.per_rank[0].breakdown["linear_s"] / 6
        + slow.backward_s
        - dist.per_rank[0].breakdown["linear_s"] / 3
    )
    # the distributed optimizer: no FSDP term, static memory sharded over the job's 8 ranks
    assert dist.per_rank[0].breakdown["fsdp_exposed_s"] == 0.0
    d8 = estimate(lay, c, TINY, TrainOptions(shard_group_size=8))
    assert d8.per_rank[0].breakdown["mem_static"] == 6 * p + -(-12 * p // 8)
    assert d8.iteration_time_s == dist.iteration_time_s


def test_options_record_writes_the_new_fields_only_when_set():
    assert "shard_group_size" not in options_record(TrainOptions(), [])
    rec = options_record(
        TrainOptions(shard_group_size=16, shard_group_GBps=50.0, overlap_grad_sync=True), []
    )
    assert (rec["shard_group_size"], rec["shard_group_GBps"], rec["overlap_grad_sync"]) == (
        16,
        50.0,
        True,
    )
    assert rec["megatron_flags"][-2:] == ["--overlap-grad-reduce", "--overlap-param-gather"]
    assert "--overlap-grad-reduce" not in megatron_flags(TrainOptions())
    assert TrainOptions(data_parallel_size=3).shard_ranks(4) == 12
    assert TrainOptions(shard_group_size=5, data_parallel_size=3).shard_ranks(4) == 5
    for bad in ({"shard_group_size": -1}, {"shard_group_GBps": float("nan")},
                {"overlap_grad_sync": "yes"}):  # fmt: skip
        with pytest.raises(HexiSeqError):
            TrainOptions(**bad)


def test_cluster_spec_records_hbm_only_when_not_the_catalogs():
    c = _two_nodes()
    assert all("hbm_GBps" not in g for g in cluster_to_dict(c)["gpus"].values())
    assert c.devices[0].hbm_Bps == 3350e9
    spec = cluster_to_dict(c)
    spec["gpus"]["H100-SXM-80GB"]["hbm_GBps"] = 3000
    again = cluster_from_dict(spec)
    assert again.devices[0].hbm_Bps == 3000e9
    assert cluster_to_dict(again)["gpus"]["H100-SXM-80GB"]["hbm_GBps"] == 3000
    assert cluster_from_dict(cluster_to_dict(again)) == again
