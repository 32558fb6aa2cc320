"""The job file: ``JobPlan`` and its JSON form.

Layers: (a) only (no processes): a two-domain job built by hand on a 2 H100 + 2 A100 cluster
round-trips exactly; every rule of the module docstring refuses a broken job in one line naming
the problem; ``locate``, ``run_ranks`` and ``sample_range`` give the orders the runtime relies on.
The same over TP bundles of 2 (a 4 + 4 + 2 GPU cluster, a domain's bundles listed out of order):
bundles, ``run_ranks`` bundle by bundle, ``locate``'s TP rank, and the bundle rules (one node per
bundle, layouts over bundles of the job's t, heads per TP rank).
"""

from __future__ import annotations

import copy
import json

import pytest

from megatron_hexiseq.cluster import cluster_from_dict, cluster_to_dict
from megatron_hexiseq.errors import HexiSeqError
from megatron_hexiseq.job import Domain, DomainRank, JobPlan, SampleRange
from megatron_hexiseq.layout import make_layout
from megatron_hexiseq.model import get_model
from megatron_hexiseq.run_config import TrainOptions, options_record


def mixed_cluster(name: str, h0: int, a0: int, a1: int):
    """Node h0: ``h0`` H100s; nodes a0, a1: ``a0`` and ``a1`` A100s."""
    nodes = [("h0", "H100-SXM-80GB", h0), ("a0", "A100-SXM-80GB", a0), ("a1", "A100-SXM-80GB", a1)]
    return cluster_from_dict(
        {
            "name": name,
            "nodes": [{"name": n, "gpu": g, "count": c, "network_GBps": 25} for n, g, c in nodes],
        }
    )


CLUSTER = mixed_cluster("tiny-mixed", 2, 2, 1)
MODEL = get_model("gpt-7b", overrides={"seq_length": 64})
OPTIONS = options_record(TrainOptions(), [])


def two_rank_layout(hosts: list[str], gpus: list[str], options: dict | None = None):
    return make_layout(
        seq_length=64,
        num_attention_heads=MODEL.num_attention_heads,
        num_query_groups=MODEL.num_query_groups,
        group_sizes=[2],
        segments=[[(0, 40)], [(40, 64)]],
        heads=[list(range(20)), list(range(20, 32))],
        hosts=hosts,
        gpus=gpus,
        meta={"options": options or OPTIONS},
    )


def job_dict() -> dict:
    """Domain 0: the two H100s, 3 micro-batches; domain 1: A100s of node a0 (listed high rank
    first), 1 micro-batch; cluster rank 4 (node a1) is left out."""
    job = JobPlan(
        global_batch=4,
        seq_length=64,
        model=MODEL.to_dict(),
        cluster=cluster_to_dict(CLUSTER),
        options=OPTIONS,
        domains=(
            Domain(
                ranks=(0, 1),
                micro_batches=3,
                layout=two_rank_layout(["h0", "h0"], ["H100-SXM-80GB"] * 2),
            ),
            Domain(
                ranks=(3, 2),
                micro_batches=1,
                layout=two_rank_layout(["a0", "a0"], ["A100-SXM-80GB"] * 2),
            ),
        ),
        predicted={
            "step_time_s": 1.0,
            "tokens_per_s": 256.0,
            "grad_sync_s": 0.1,
            "optimizer_s": 0.01,
            "idle_fraction": 0.2,
        },
    )
    return json.loads(job.to_json())


def test_round_trip_is_exact_and_orders_are_the_documented_ones():
    job = JobPlan.from_dict(job_dict())
    assert JobPlan.from_json(job.to_json()) == job
    assert job.to_json() == JobPlan.from_json(job.to_json()).to_json()
    assert job.run_ranks == (0, 1, 2, 3)
    assert job.locate(3) == DomainRank(domain=1, local_rank=0)
    assert job.locate(1) == DomainRank(domain=0, local_rank=1)
    assert job.sample_range(0) == SampleRange(0, 3) and job.sample_range(1) == SampleRange(3, 4)
    assert job.cluster_spec.world_size == 5 and job.model_spec.seq_length == 64
    with pytest.raises(HexiSeqError, match="cluster rank 4 is in no domain"):
        job.locate(4)


def test_save_and_load(tmp_path):
    job = JobPlan.from_dict(job_dict())
    job.save(tmp_path / "job.json")
    assert JobPlan.load(tmp_path / "job.json") == job


def _broken(edit) -> dict:
    data = copy.deepcopy(job_dict())
    edit(data)
    return data


def _set_gpu(data: dict) -> None:
    data["domains"][1]["layout"]["ranks"][0]["gpu"] = "H100-SXM-80GB"


def _mbs2(data: dict) -> None:
    data["options"]["micro_batch_size"] = 2


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda d: d.update(format="megatron-hexiseq/layout"), "is this a job file"),
        (lambda d: d.update(version=2), "job version 2 is not supported"),
        (lambda d: d.update(global_batch=5), r"take 4 sequences per step \(3 \+ 1 micro-batches"),
        (lambda d: d.update(global_batch=0), "global_batch"),
        (lambda d: d.update(domains=[]), "domains"),
        (lambda d: d["domains"][1].update(ranks=[1, 2]), "cluster rank 1 is in domain 0 too"),
        (lambda d: d["domains"][1].update(ranks=[3, 9]), "rank 9 is not a rank of the cluster"),
        (
            lambda d: d["domains"][1].update(ranks=[3, 2, 4]),
            "layout has 2 ranks but the domain lists 3",
        ),
        (lambda d: d["domains"][0].update(micro_batches=0), "micro_batches"),
        (lambda d: d["domains"][0].update(extra=1), "unknown key"),
        (_set_gpu, "local rank 0 is planned for H100-SXM-80GB on a0 but cluster rank 3 is A100"),
        (_mbs2, "planned with micro_batch_size 1, the job runs 2"),
        (lambda d: d["predicted"].update(idle_fraction=float("nan")), "must be finite|at most 1"),
        (lambda d: d["domains"][0]["layout"].update(seq_length=32), "seq_length"),
    ],
)
def test_broken_jobs_are_refused_in_one_line(edit, message):
    with pytest.raises(HexiSeqError, match=message) as info:
        JobPlan.from_dict(_broken(edit), source="job j.json")
    assert "\n" not in str(info.value) and str(info.value).startswith("job j.json")


def test_alternative_is_a_job_of_its_own():
    data = job_dict()
    data["alternatives"] = [
        {
            "name": "fast-only",
            "step_time_s": 2.0,
            "tokens_per_s": 128.0,
            "feasible": True,
            "domains": [
                {
                    "ranks": [0, 1],
                    "micro_batches": 4,
                    "layout": data["domains"][0]["layout"],
                }
            ],
        },
        {
            "name": "typed-dp",
            "step_time_s": None,
            "tokens_per_s": 0.0,
            "feasible": False,
            "domains": [],
        },
    ]
    job = JobPlan.from_dict(data)
    alt = job.alternative("fast-only")
    assert alt.run_ranks == (0, 1) and alt.domains[0].micro_batches == 4
    assert alt.predicted is not None and alt.predicted["step_time_s"] == 2.0
    with pytest.raises(HexiSeqError, match="not feasible"):
        job.alternative("typed-dp")
    with pytest.raises(
        HexiSeqError, match="no alternative named 'x'; this job has fast-only, typed-dp"
    ):
        job.alternative("x")
    data["alternatives"][0]["domains"][0]["micro_batches"] = 3  # 3 != global batch 4
    with pytest.raises(HexiSeqError, match="alternative 'fast-only': the domains take 3"):
        JobPlan.from_dict(data).alternative("fast-only")


# ---- TP bundles -------------------------------------------------------------------------------
TP_CLUSTER = mixed_cluster("tp-mixed", 4, 4, 2)
TP_OPTIONS = options_record(TrainOptions(tensor_model_parallel_size=2), [])


def bundle_layout(hosts: list[str], gpus: list[str], tp: int = 2, heads: int = 16):
    """A layout over ``len(hosts)`` TP bundles (gpt-7b: 32 heads, 16 per TP rank of 2)."""
    n = len(hosts)
    bounds = [64 * i // n // 2 * 2 for i in range(n + 1)]  # multiples of 2 tokens
    return make_layout(
        seq_length=64,
        num_attention_heads=heads,
        num_query_groups=heads,
        group_sizes=[n],
        segments=[[(bounds[i], bounds[i + 1])] for i in range(n)],
        heads=[list(range(heads * i // n, heads * (i + 1) // n)) for i in range(n)],
        hosts=hosts,
        gpus=gpus,
        tensor_model_parallel_size=tp,
        meta={"options": TP_OPTIONS},
    )


def tp_job_dict() -> dict:
    """Domain 0: the H100 node as two bundles [0, 1], [2, 3], 3 micro-batches; domain 1: two A100
    bundles listed out of order, [8, 9] (node a1) then [5, 4] (node a0, TP rank 0 on GPU 5), 1
    micro-batch; GPUs 6 and 7 of a0 left out."""
    h, a = "H100-SXM-80GB", "A100-SXM-80GB"
    job = JobPlan(
        global_batch=4,
        seq_length=64,
        model=MODEL.to_dict(),
        cluster=cluster_to_dict(TP_CLUSTER),
        options=TP_OPTIONS,
        domains=(
            Domain(ranks=(0, 1, 2, 3), micro_batches=3, layout=bundle_layout(["h0"] * 2, [h] * 2)),
            Domain(
                ranks=(8, 9, 5, 4), micro_batches=1, layout=bundle_layout(["a1", "a0"], [a] * 2)
            ),
        ),
    )
    return json.loads(job.to_json())


def test_a_job_over_tp_bundles_round_trips_with_its_orders():
    job = JobPlan.from_dict(tp_job_dict())
    assert JobPlan.from_json(job.to_json()) == job
    assert job.tensor_model_parallel_size == 2
    assert job.bundles(1) == ((8, 9), (5, 4))
    # bundle by bundle, bundles by their lowest cluster rank, each in its TP-rank order
    assert job.run_ranks == (0, 1, 2, 3, 5, 4, 8, 9)
    assert job.locate(5) == DomainRank(domain=1, local_rank=1, tp_rank=0)
    assert job.locate(9) == DomainRank(domain=1, local_rank=0, tp_rank=1)
    assert job.locate(3) == DomainRank(domain=0, local_rank=1, tp_rank=1)
    # a plain job's files say nothing of TP: its options record has no tensor_model_parallel_size
    assert "tensor_model_parallel_size" not in job_dict()["options"]
    assert JobPlan.from_dict(job_dict()).tensor_model_parallel_size == 1


def _tp_broken(edit) -> dict:
    data = copy.deepcopy(tp_job_dict())
    edit(data)
    return data


def _single_gpu_layouts(data: dict) -> None:
    data["domains"][0]["layout"]["tensor_model_parallel_size"] = 1


def _wrong_heads(data: dict) -> None:
    data["domains"][0]["layout"] = bundle_layout(
        ["h0"] * 2, ["H100-SXM-80GB"] * 2, heads=32
    ).to_dict()


def _t4(data: dict) -> None:
    data["options"]["tensor_model_parallel_size"] = 4


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (
            lambda d: d["domains"][1].update(ranks=[8, 5, 9, 4]),
            r"bundle 0 \(cluster ranks \[8, 5\]\) spans nodes a0, a1",
        ),
        (
            lambda d: d["domains"][1].update(ranks=[8, 9, 5]),
            "3 GPUs do not split into TP bundles of 2",
        ),
        (
            _single_gpu_layouts,
            "planned for TP bundles of 1 GPUs, the job's tensor_model_parallel_size is 2",
        ),
        (_t4, "planned for TP bundles of 2 GPUs, the job's tensor_model_parallel_size is 4"),
        (_wrong_heads, "per TP rank of 2: 16 / 16"),
        (
            lambda d: d["options"].update(tensor_model_parallel_size=3),
            "32 attention heads do not divide",
        ),
        (
            lambda d: (
                d["domains"][1].update(ranks=[8, 9, 0, 1])
                or d["domains"][0].update(ranks=[4, 5, 2, 3])
            ),
            "bundle 0 is planned for H100-SXM-80GB on h0 but its cluster rank 4 is A100",
        ),
    ],
)
def test_broken_tp_jobs_are_refused_in_one_line(edit, message):
    with pytest.raises(HexiSeqError, match=message) as info:
        JobPlan.from_dict(_tp_broken(edit), source="job j.json")
    assert "\n" not in str(info.value) and str(info.value).startswith("job j.json")
