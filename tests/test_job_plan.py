"""The job planner (``job.search.plan_job``) and its model.

Layer (a) only (no processes): on generated clusters (2-3 GPU types, node order shuffled) the job
is never slower, in its own model, than any alternative it records, and its file prices again to
its own figure (``job.evaluate.price_job``); the paper's testbed at 32K with 64 sequences splits
by GPU type and beats one domain over everything; a planned job round-trips and each feasible
alternative is a valid job; domains of one shape share one plan. Over TP bundles (t = 2 given,
and ``auto``): the same guarantees, every domain's bundles on one node each and its layout over
bundles, each alternative's TP size recorded and each feasible one a valid job of its own size;
the step of a job over bundles is the bundle problem's (``evaluate.bundle_problem_of_job``).
"""

from __future__ import annotations

import random

import pytest

from megatron_hexiseq.cluster import cluster_from_dict, load_cluster
from megatron_hexiseq.errors import HexiSeqError
from megatron_hexiseq.job import JobPlan
from megatron_hexiseq.job.candidates import ALTERNATIVES
from megatron_hexiseq.job.domains import NodeIndex, move_layout, sub_cluster
from megatron_hexiseq.job.evaluate import price_job
from megatron_hexiseq.job.search import plan_job
from megatron_hexiseq.model import get_model
from megatron_hexiseq.run_config import AUTO_MODES, TrainOptions

TYPES = ("H100-SXM-80GB", "A100-SXM-80GB", "L40S-48GB", "A800-80GB")


def generated(seed: int) -> tuple:
    rng = random.Random(seed)
    types = rng.sample(TYPES, rng.choice((2, 3)))
    nodes = [
        {"gpu": t, "count": rng.choice((4, 8)), "network_GBps": rng.choice((12.5, 25.0, 50.0))}
        for t in types
        for _ in range(rng.randint(1, 2))
    ]
    rng.shuffle(nodes)
    for i, n in enumerate(nodes):
        n["name"] = f"n{i}"
    cluster = cluster_from_dict({"name": f"gen{seed}", "nodes": nodes})
    seq = rng.choice((16384, 32768, 65536))
    return cluster, rng.choice(("gpt-7b", "llama3-8b")), seq, rng.choice((4, 8, 32))


@pytest.mark.parametrize("seed", range(6))
def test_never_slower_than_any_alternative(seed):
    cluster, name, seq, batch = generated(seed)
    model = get_model(name, overrides={"seq_length": seq})
    options = TrainOptions.for_model(model, overlap_grad_sync=True)
    job = plan_job(cluster, model, seq, batch, options, modes=AUTO_MODES, reproducible=True)
    step = job.predicted["step_time_s"]
    assert [a["name"] for a in job.alternatives] == list(ALTERNATIVES)
    for alt in job.alternatives:
        if alt["feasible"]:
            assert step <= alt["step_time_s"], (alt["name"], alt["config"])
            again = price_job(job.alternative(alt["name"]))
            assert again.step_s == pytest.approx(alt["step_time_s"], rel=1e-8)
    assert any(a["feasible"] for a in job.alternatives)
    # the file prices again to its own step, and its shares are the min-max of its domains
    assert price_job(job).step_s == pytest.approx(step, rel=1e-8)
    assert sum(d.micro_batches for d in job.domains) == batch
    # Megatron-FSDP: every rank joins each micro-batch's collectives, so the shares are equal
    for j in [job] + [job.alternative(a["name"]) for a in job.alternatives if a["feasible"]]:
        if j.options["memory_mode"] == "fsdp":
            assert len({d.micro_batches for d in j.domains}) == 1
    assert JobPlan.from_json(job.to_json()) == job


def test_paper_testbed_splits_by_gpu_type():
    cluster = load_cluster("examples/clusters/mixed-h100-a100.yaml")
    model = get_model("gpt-7b", overrides={"seq_length": 32768})
    options = TrainOptions.for_model(model, overlap_grad_sync=True)
    job = plan_job(cluster, model, 32768, 64, options, modes=AUTO_MODES, reproducible=True)
    alt = {a["name"]: a for a in job.alternatives}
    one = alt["hexiseq-one-domain"]["step_time_s"]
    assert one / job.predicted["step_time_s"] > 1.05  # the issue measured 1.12 without fixed costs
    # every domain holds one GPU type, the H100 domains take more sequences
    for d in job.domains:
        assert len({job.cluster_spec.devices[r].gpu.name for r in d.ranks}) == 1
    h100 = [
        d.micro_batches
        for d in job.domains
        if job.cluster_spec.devices[d.ranks[0]].gpu.name.startswith("H100")
    ]
    a100 = [
        d.micro_batches
        for d in job.domains
        if job.cluster_spec.devices[d.ranks[0]].gpu.name.startswith("A100")
    ]
    assert min(h100) > max(a100)
    assert job.predicted["optimizer_s"] > 0 and 0 <= job.predicted["idle_fraction"] < 0.1
    assert JobPlan.load  # the file is a valid job
    assert job.options["overlap_grad_sync"] is True
    assert "--overlap-grad-reduce" in job.options["megatron_flags"]


def test_domains_of_one_shape_share_a_plan_and_move_between_hosts():
    cluster = load_cluster("examples/clusters/mixed-h100-a100.yaml")
    index = NodeIndex(cluster)
    assert [k[0].name for k in index.kinds] == ["H100-SXM-80GB", "A100-SXM-80GB"]
    a, b = (0, 1, 2, 3), (4, 5, 6, 7)
    assert index.shape(a) == index.shape(b)
    from megatron_hexiseq.planner.baselines import symmetric_layout

    model = get_model("gpt-7b", overrides={"seq_length": 4096})
    lay = symmetric_layout(sub_cluster(cluster, a, "x"), model, 4096, 2)
    moved = move_layout(lay, sub_cluster(cluster, b, "y"))
    assert [r.host for r in moved.ranks] == ["h100-0"] * 4 and moved.groups == lay.groups
    # a job refuses a global batch the micro-batch size does not divide
    opts = TrainOptions(micro_batch_size=2)
    with pytest.raises(HexiSeqError, match="not a multiple of the micro-batch size 2"):
        plan_job(cluster, model, 4096, 5, opts)


def test_cpu_testbed_cluster_pays_its_measured_step_overhead_once():
    # what profile --testbed 1+2 writes: one type, measured fixed costs, a shared-core node
    spec = {
        "name": "testbed-1+2",
        "gpus": {
            "CPU": {
                "bf16_tflops": 0.02,
                "attention_tflops": 0.01,
                "efficiency": 1.0,
                "memory_gib": 4,
                "nvlink_GBps": 3,
                "step_overhead_ms": 25.0,
                "collective_latency_us": 900.0,
                "p2p_latency_us": 1200.0,
            }
        },
        "nodes": [
            {"name": "h-c0", "gpu": "CPU", "count": 1, "network_GBps": 2},
            {"name": "h-c1", "gpu": "CPU", "count": 2, "network_GBps": 2, "shared_core": True},
        ],
    }
    cluster = cluster_from_dict(spec)
    model = get_model(None, config_path="examples/models/cpu-demo.yaml")
    job = plan_job(cluster, model, 2048, 4, TrainOptions.for_model(model), reproducible=True)
    pred = job.predicted
    assert pred["overhead_s"] == pytest.approx(0.025)
    assert pred["grad_reduce_s"] == pred["optimizer_s"] == 0.0  # measured, not modelled again
    busy = max(d["busy_s"] for d in pred["domains"])
    assert pred["step_time_s"] == pytest.approx(busy + 0.025)
    assert price_job(job).step_s == pytest.approx(pred["step_time_s"], rel=1e-8)


# ---- TP bundles -------------------------------------------------------------------------------
def _check_tp_job(job: JobPlan, batch: int) -> None:
    """Never slower than an alternative; the file and every alternative price again to their
    figures; domains are bundles of ``t`` GPUs of one node; the file round-trips."""
    step = job.predicted["step_time_s"]
    t = job.tensor_model_parallel_size
    for alt in job.alternatives:
        if alt["feasible"]:
            assert step <= alt["step_time_s"], (alt["name"], alt["config"])
            other = job.alternative(alt["name"])
            assert other.tensor_model_parallel_size == alt["tensor_model_parallel_size"]
            assert price_job(other).step_s == pytest.approx(alt["step_time_s"], rel=1e-8)
    assert price_job(job).step_s == pytest.approx(step, rel=1e-8)
    assert sum(d.micro_batches for d in job.domains) == batch
    devices = job.cluster_spec.devices
    for d, dom in enumerate(job.domains):
        assert dom.layout.tensor_model_parallel_size == t
        assert dom.layout.world_size * t == len(dom.ranks)
        for bundle in job.bundles(d):
            assert len({devices[r].node for r in bundle}) == 1
        assert all(r.num_tokens % t == 0 for r in dom.layout.ranks)
    assert JobPlan.from_json(job.to_json()) == job


@pytest.mark.parametrize("seed", [1, 4])
def test_a_job_over_tp_bundles_of_2(seed):
    cluster, name, seq, batch = generated(seed)
    model = get_model(name, overrides={"seq_length": seq})
    options = TrainOptions.for_model(model, overlap_grad_sync=True)
    job = plan_job(
        cluster,
        model,
        seq,
        batch,
        options,
        tensor_model_parallel_size=2,
        modes=AUTO_MODES,
        reproducible=True,
    )
    assert job.tensor_model_parallel_size == 2 and job.options["tensor_model_parallel_size"] == 2
    assert "--sequence-parallel" in job.options["megatron_flags"]
    assert {a.get("tensor_model_parallel_size") for a in job.alternatives if a["feasible"]} == {2}
    _check_tp_job(job, batch)


def test_auto_tp_keeps_the_best_size_and_records_every_size():
    cluster = load_cluster("examples/clusters/four-types-64.yaml")
    model = get_model("gpt-13b", overrides={"seq_length": 131072})
    options = TrainOptions.for_model(model, overlap_grad_sync=True)
    kw = dict(modes=AUTO_MODES, reproducible=True)
    job = plan_job(cluster, model, 131072, 32, options, tensor_model_parallel_size="auto", **kw)
    _check_tp_job(job, 32)
    sizes = job.planner["tensor_parallel"]["sizes"]
    assert [s["tensor_model_parallel_size"] for s in sizes] == [1, 2, 4, 8]
    chosen = [s for s in sizes if s.get("chosen")]
    assert [s["tensor_model_parallel_size"] for s in chosen] == [job.tensor_model_parallel_size]
    assert job.tensor_model_parallel_size > 1  # 13B fits the distributed optimizer only with TP
    tp1 = plan_job(cluster, model, 131072, 32, options, **kw)
    assert job.predicted["step_time_s"] < tp1.predicted["step_time_s"]
    # every alternative is its best over the sizes: never slower than at TP = 1
    for a, b in zip(job.alternatives, tp1.alternatives):
        if b["feasible"]:
            assert a["step_time_s"] <= b["step_time_s"] * (1 + 1e-9), a["name"]


def test_job_file_with_a_one_gpu_alternative_loads():
    # profile --testbed 1+3 writes two types, the fast one a single "GPU": fast-only runs on one
    # rank, whose reduction has no ring (its bus bandwidth is infinite, written as null)
    cpu = {"bf16_tflops": 0.02, "efficiency": 1.0, "memory_gib": 4, "nvlink_GBps": 3}
    spec = {
        "name": "testbed-1+3",
        "gpus": {"CPU-fast": cpu, "CPU-shared": cpu | {"bf16_tflops": 0.007}},
        "nodes": [
            {"name": "h-c0", "gpu": "CPU-fast", "count": 1, "network_GBps": 2},
            {"name": "h-c1", "gpu": "CPU-shared", "count": 3, "network_GBps": 2},
        ],
    }
    model = get_model(None, config_path="examples/models/cpu-demo.yaml")
    job = plan_job(cluster_from_dict(spec), model, 2048, 8, TrainOptions.for_model(model))
    again = JobPlan.from_json(job.to_json())
    fast_only = [a for a in again.alternatives if a["name"] == "fast-only"]
    assert fast_only and fast_only[0]["feasible"]
    assert fast_only[0]["predicted"]["shard_group"]["bus_GBps"] is None
    for alt in again.alternatives:
        if alt["feasible"]:
            assert again.alternative(alt["name"]).global_batch == 8
