"""A job in one Megatron run, layer (a) only (no processes): the pieces of ``--hexiseq-job``.

- the flags (``--hexiseq-job``, ``--hexiseq-check-params``) and their refusals;
- ``job_runtime``: every process's domain and local rank, each domain's layout renumbered to
  ascending process ranks, every start-up refusal of ``check_job_run`` / ``check_job_args`` in
  one line; a job over TP bundles of 2 (:func:`job_tp`): process bundles, TP ranks, each domain's
  groups per TP rank, its layout over its process bundles, Megatron's TP x CP grid checked;
- ``job_data.JobBatchSampler`` over 1,000 steps of a three-domain job: each step's global batch
  read once (no index twice, none skipped), every rank of a domain the same indices, a resume in
  the middle (under the same job and under another with the same global batch) continuing exactly;
- ``job_plugin``: the schedule runs the domain's micro-batch count, the check runs after every
  N-th training step, the seams replace ``megatron.training.training``'s names (a stand-in
  module) and the data loader reads the domain's samples;
- ``params_check``: the 64-bit hash moves with a one-ULP change anywhere, is the same whatever
  the chunking, and the mismatch message names the odd ranks.

Layer (b) is tests/test_job_train.py (gloo); the real Megatron-LM flags are in
tests/test_megatron_lm_job.py.
"""

from __future__ import annotations

import argparse
import types
from dataclasses import replace

import pytest
import torch

from megatron_hexiseq.cluster import cluster_from_dict, cluster_to_dict
from megatron_hexiseq.errors import HexiSeqError
from megatron_hexiseq.job import Domain, JobPlan, SampleRange
from megatron_hexiseq.layout import Layout, make_layout
from megatron_hexiseq.megatron import job_plugin, params_check
from megatron_hexiseq.megatron.args import HexiSeqArgs, add_hexiseq_args, job_flag
from megatron_hexiseq.megatron.job_data import JobBatchSampler, JobDataLoaders
from megatron_hexiseq.megatron.job_runtime import (
    check_job_run,
    domain_groups,
    domain_layout,
    domain_process_ranks,
    job_place,
    renumber,
)
from megatron_hexiseq.megatron.runtime import RunShape
from megatron_hexiseq.model import ModelSpec
from megatron_hexiseq.run_config import TrainOptions, options_record
from megatron_hexiseq.testbed.train_config import TINY_GPT

SEQ = 48


def cpu_cluster(name: str, fast: int, slow: int):
    """Node c0: ``fast`` fast devices; node c1: ``slow`` slow ones."""
    return cluster_from_dict(
        {
            "name": name,
            "gpus": {
                "FAST-CPU": {
                    "bf16_tflops": 0.2,
                    "memory_gib": 8,
                    "nvlink_GBps": 5,
                    "efficiency": 1.0,
                },
                "SLOW-CPU": {
                    "bf16_tflops": 0.1,
                    "memory_gib": 8,
                    "nvlink_GBps": 5,
                    "efficiency": 1.0,
                },
            },
            "nodes": [
                {"name": "c0", "gpu": "FAST-CPU", "count": fast, "network_GBps": 1},
                {"name": "c1", "gpu": "SLOW-CPU", "count": slow, "network_GBps": 1},
            ],
        }
    )


CLUSTER = cpu_cluster("cpu-job", 1, 3)  # cluster ranks 0 | 1, 2, 3


def layout_on(ranks: list[int], segments, heads, groups) -> Layout:
    """A layout of the tiny GPT on cluster ranks ``ranks`` (local rank j on ``ranks[j]``)."""
    devices = [CLUSTER.devices[r] for r in ranks]
    return make_layout(
        seq_length=SEQ,
        num_attention_heads=TINY_GPT.num_attention_heads,
        num_query_groups=TINY_GPT.num_query_groups,
        segments=segments,
        heads=heads,
        groups=groups,
        hosts=[d.node for d in devices],
        gpus=[d.gpu.name for d in devices],
    )


ALL_HEADS = list(range(8))
ONE_RANK = [[(0, SEQ)]], [ALL_HEADS], [[0]]


def make_job(
    domains: list[tuple[list[int], int, Layout]],
    *,
    micro_batch_size: int = 1,
    model: ModelSpec = TINY_GPT,
) -> JobPlan:
    """A job by hand: ``(cluster ranks, micro_batches, layout)`` per domain."""
    return JobPlan(
        global_batch=micro_batch_size * sum(m for _, m, _ in domains),
        seq_length=SEQ,
        model=replace(model, seq_length=SEQ).to_dict(),
        cluster=cluster_to_dict(CLUSTER),
        options=options_record(TrainOptions(micro_batch_size=micro_batch_size), []),
        domains=tuple(Domain(ranks=tuple(r), micro_batches=m, layout=lay) for r, m, lay in domains),
    )


def job_1_2() -> JobPlan:
    """Two domains, 1 + 2 ranks, 3 and 1 micro-batches: the fast rank alone runs the whole
    sequence; the slow pair (listed high rank first) one A2A group with uneven tokens and heads."""
    pair = layout_on(
        [2, 1],
        [[(0, 10), (30, 48)], [(10, 30)]],
        [[0, 1, 2, 3, 4], [5, 6, 7]],
        [[0, 1]],
    )
    return make_job([([0], 3, layout_on([0], *ONE_RANK)), ([2, 1], 1, pair)])


def job_three_domains() -> JobPlan:
    """Three domains on four ranks, micro-batches of 2 sequences: the fast rank (2 micro-batches),
    a two-rank uneven ring of cluster ranks 3 and 1 (1), cluster rank 2 alone (1)."""
    ring = layout_on([3, 1], [[(0, 30)], [(30, 48)]], [ALL_HEADS, ALL_HEADS], [[0], [1]])
    return make_job(
        [
            ([0], 2, layout_on([0], *ONE_RANK)),
            ([3, 1], 1, ring),
            ([2], 1, layout_on([2], *ONE_RANK)),
        ],
        micro_batch_size=2,
    )


def one_domain_job() -> JobPlan:
    """The same three GPUs and global batch as :func:`job_1_2`, one domain over all of them."""
    three = layout_on(
        [0, 1, 2],
        [[(0, 24)], [(24, 36)], [(36, 48)]],
        [[0, 1, 2, 3], [4, 5], [6, 7]],
        [[0, 1, 2]],
    )
    return make_job([([0, 1, 2], 4, three)])


TP_CLUSTER = cpu_cluster("cpu-job-tp", 2, 4)  # one fast TP bundle of 2 | two slow ones
TP = 2


def job_tp(model: ModelSpec = TINY_GPT) -> JobPlan:
    """Two domains over TP bundles of 2 (the tiny GPT's 8 / 2 heads: 4 / 1 per TP rank): the fast
    bundle [0, 1] alone, 3 micro-batches; two slow bundles listed high first, [4, 5] then [2, 3],
    one A2A group with uneven tokens (28 / 20, multiples of 2) and heads (3 / 1), 1 micro-batch."""
    heads, groups = model.num_attention_heads // TP, max(1, model.num_query_groups // TP)

    def over_bundles(hosts, gpus, segments, heads_of, group_lists):
        return make_layout(
            seq_length=SEQ,
            num_attention_heads=heads,
            num_query_groups=groups,
            segments=segments,
            heads=heads_of,
            groups=group_lists,
            hosts=hosts,
            gpus=gpus,
            tensor_model_parallel_size=TP,
        )

    alone = over_bundles(["c0"], ["FAST-CPU"], [[(0, SEQ)]], [list(range(heads))], [[0]])
    pair = over_bundles(
        ["c1", "c1"],
        ["SLOW-CPU"] * 2,
        [[(0, 10), (30, 48)], [(10, 30)]],
        [[0, 1, 2], [3]],
        [[0, 1]],
    )
    return JobPlan(
        global_batch=4,
        seq_length=SEQ,
        model=replace(model, seq_length=SEQ).to_dict(),
        cluster=cluster_to_dict(TP_CLUSTER),
        options=options_record(TrainOptions(tensor_model_parallel_size=TP), []),
        domains=(
            Domain(ranks=(0, 1), micro_batches=3, layout=alone),
            Domain(ranks=(4, 5, 2, 3), micro_batches=1, layout=pair),
        ),
    )


def run_of(job: JobPlan, **changes) -> RunShape:
    W = len(job.run_ranks)
    shape = RunShape(
        world_size=W,
        tensor_model_parallel_size=1,
        pipeline_model_parallel_size=1,
        context_parallel_size=W,
        seq_length=SEQ,
        num_attention_heads=8,
        num_query_groups=2,
    )
    return replace(shape, **changes)


# ---- flags -------------------------------------------------------------------------------------
def test_job_flags_parse_and_refuse():
    parser = add_hexiseq_args(argparse.ArgumentParser())
    args = parser.parse_args(["--hexiseq-job", "j.json", "--hexiseq-check-params", "10"])
    hs = HexiSeqArgs.from_namespace(args)
    assert hs.job == "j.json" and hs.layout is None and hs.enabled and hs.check_params == 10
    assert job_flag(["--hexiseq-job=a.json", "--x", "--hexiseq-job", "b.json"]) == "b.json"
    with pytest.raises(HexiSeqError, match="not both"):
        HexiSeqArgs(layout="l.json", job="j.json")
    with pytest.raises(HexiSeqError, match="--hexiseq-check-params must be >= 0"):
        HexiSeqArgs(check_params=-1)


# ---- ranks and layouts -------------------------------------------------------------------------
def test_every_process_finds_its_domain_and_layout_rank():
    job = job_three_domains()
    assert job.run_ranks == (0, 1, 2, 3)
    assert domain_process_ranks(job) == [(0,), (3, 1), (2,)]
    ring, ranks = domain_layout(job, 1)
    assert ranks == (1, 3)  # ascending process ranks; layout rank 0 is now cluster rank 1
    assert [r.segments for r in ring.ranks] == [((30, 48),), ((0, 30),)]
    places = [job_place(job, k) for k in range(4)]
    assert [(p.domain, p.local_rank, p.micro_batches) for p in places] == [
        (0, 0, 2),
        (1, 0, 1),
        (2, 0, 1),
        (1, 1, 1),
    ]
    assert {p.total_micro_batches for p in places} == {4}
    assert places[3].samples == SampleRange(4, 6) and places[2].samples == SampleRange(6, 8)
    with pytest.raises(HexiSeqError, match="outside the job's 4 ranks"):
        job_place(job, 4)


def test_domain_layout_records_its_own_cluster_for_the_batch_planner():
    """A domain over two nodes listed high rank first: renumbered, its layout's meta holds the
    domain's GPUs in layout-rank order, the job's model and options, and the batch planner
    (``--hexiseq-batch-plan``) builds on it."""
    from megatron_hexiseq.layout import check_matches
    from megatron_hexiseq.megatron.batch_layout import batch_planner_layouts
    from megatron_hexiseq.run_config import options_from_record

    mixed = layout_on([2, 0], [[(0, 20)], [(20, 48)]], [[0, 1, 2, 3], [4, 5, 6, 7]], [[0, 1]])
    job = make_job([([2, 0], 1, mixed), ([1], 1, layout_on([1], *ONE_RANK))])
    layout, ranks = domain_layout(job, 0)
    assert ranks == (0, 2) and [r.host for r in layout.ranks] == ["c0", "c1"]
    cluster = cluster_from_dict(layout.meta["cluster_spec"])
    check_matches(layout, cluster, replace(TINY_GPT, seq_length=SEQ))
    assert [(n.name, n.count) for n in cluster.nodes] == [("c0", 1), ("c1", 1)]
    assert options_from_record(layout.meta["options"]) == job.train_options
    assert batch_planner_layouts(layout, "job j.json domain 0") is not None


def test_renumbering_keeps_what_every_rank_holds():
    pair = job_1_2().domains[1].layout
    swapped = renumber(pair, [1, 0])
    assert [r.segments for r in swapped.ranks] == [((10, 30),), ((0, 10), (30, 48))]
    assert [r.heads for r in swapped.ranks] == [(5, 6, 7), (0, 1, 2, 3, 4)]
    assert [g.ranks for g in swapped.groups] == [(0, 1)]
    assert renumber(pair, [0, 1]) is pair
    assert renumber(swapped, [1, 0]) == pair


def test_tp_bundles_are_process_bundles_and_each_tp_rank_has_its_groups():
    job = job_tp()
    assert job.run_ranks == (0, 1, 2, 3, 4, 5)  # bundles [0, 1], [2, 3], [4, 5]
    assert domain_process_ranks(job) == [(0, 1), (4, 5, 2, 3)]
    pair, bundles = domain_layout(job, 1)
    assert bundles == (1, 2)  # process bundles, ascending: layout bundle 0 is now [2, 3]
    assert [r.segments for r in pair.ranks] == [((10, 30),), ((0, 10), (30, 48))]
    assert pair.tensor_model_parallel_size == TP and [r.heads for r in pair.ranks] == [
        (3,),
        (0, 1, 2),
    ]
    assert domain_groups(job, 0) == [(0,), (1,)]
    assert domain_groups(job, 1) == [(2, 4), (3, 5)]  # TP rank 0's and TP rank 1's
    places = [job_place(job, k) for k in range(6)]
    assert [(p.domain, p.local_rank, p.tp_rank, p.micro_batches) for p in places] == [
        (0, 0, 0, 3),
        (0, 0, 1, 3),
        (1, 0, 0, 1),
        (1, 0, 1, 1),
        (1, 1, 0, 1),
        (1, 1, 1, 1),
    ]
    # the domain's own cluster for the batch planner: its 4 GPUs, bundle j on devices 2j, 2j+1
    from megatron_hexiseq.layout import check_matches

    check_matches(
        pair, cluster_from_dict(pair.meta["cluster_spec"]), replace(TINY_GPT, seq_length=SEQ)
    )


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            {"tensor_model_parallel_size": 1},
            "planned over TP bundles of 2 GPUs but --tensor-model-parallel-size is 1",
        ),
        (
            {"context_parallel_size": 6},
            "one context-parallel group of all 3 bundles .* set --context-parallel-size 3",
        ),
        ({"sequence_parallel": True, "seq_length": 48}, None),
    ],
)
def test_tp_run_shape_is_checked(change, message):
    job = job_tp()
    run = run_of(job, tensor_model_parallel_size=TP, context_parallel_size=3)
    check_job_run(job, run, global_batch_size=4, micro_batch_size=1)
    if message is None:
        check_job_run(job, replace(run, **change), global_batch_size=4, micro_batch_size=1)
        return
    with pytest.raises(HexiSeqError, match=message) as info:
        check_job_run(job, replace(run, **change), global_batch_size=4, micro_batch_size=1)
    assert "\n" not in str(info.value)


# ---- start-up checks -------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("change", "batch", "message"),
    [
        ({"cp_comm_type": "p2p"}, {}, "--hexiseq-job needs --cp-comm-type hexiseq"),
        ({"pipeline_model_parallel_size": 2}, {}, "use --pipeline-model-parallel-size 1"),
        ({"world_size": 4}, {}, "runs on 3 GPUs but the run has 4 processes"),
        ({"context_parallel_size": 1}, {}, "set --context-parallel-size 3"),
        ({}, {"global_batch_size": 8}, "global batch of 4 sequences but --global-batch-size is 8"),
        ({}, {"micro_batch_size": 2}, "set --micro-batch-size 1"),
        ({"seq_length": 96}, {}, "domain 0 is planned for seq_length 48"),
        ({"num_query_groups": 4}, {}, "query groups"),
        ({"calculate_per_token_loss": False}, {}, "--calculate-per-token-loss"),
        ({"tensor_model_parallel_size": 2}, {}, "--tensor-model-parallel-size 1"),
    ],
)
def test_run_mismatches_are_refused_in_one_line(change, batch, message):
    job = job_1_2()
    sizes = {"global_batch_size": 4, "micro_batch_size": 1} | batch
    with pytest.raises(HexiSeqError, match=message) as info:
        check_job_run(job, run_of(job, **change), source="job j.json", **sizes)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        ({"dataloader_type": "cyclic"}, "--dataloader-type cyclic"),
        ({"rampup_batch_size": [4, 4, 100]}, "--rampup-batch-size"),
        ({"hybrid_context_parallel": True}, "--hybrid-context-parallel"),
        ({"full_validation": True}, "--full-validation"),
        ({"num_experts": 8}, "--num-experts"),
    ],
)
def test_megatron_features_a_job_cannot_run_are_refused(flags, message):
    job_plugin.check_job_args(argparse.Namespace(dataloader_type="single"))
    job_plugin.check_job_args(argparse.Namespace(dataloader_type=None))
    with pytest.raises(HexiSeqError, match=message):
        job_plugin.check_job_args(argparse.Namespace(**({"dataloader_type": "single"} | flags)))


@pytest.mark.parametrize("flag", ["use_megatron_fsdp", "use_torch_fsdp2"])
def test_fsdp_needs_equal_micro_batch_counts(flag):
    """FSDP gathers over every rank in every micro-batch: uneven counts would hang."""
    fsdp = argparse.Namespace(dataloader_type="single", **{flag: True})
    with pytest.raises(HexiSeqError, match=r"domains run 1/3 micro-batches per step") as info:
        job_plugin.check_job_args(fsdp, job_1_2())
    assert "--" + flag.replace("_", "-") in str(info.value)
    job_plugin.check_job_args(fsdp, one_domain_job())  # one count: every rank joins every gather
    job_plugin.check_job_args(argparse.Namespace(dataloader_type="single"), job_1_2())


# ---- data --------------------------------------------------------------------------------------
def _sampler(job: JobPlan, domain: int, consumed: int, total: int) -> JobBatchSampler:
    return JobBatchSampler(
        total_samples=total,
        consumed_samples=consumed,
        micro_batch_size=job.micro_batch_size,
        global_batch=job.global_batch,
        samples=job.sample_range(domain),
    )


def _steps(job: JobPlan, domain: int, consumed: int, total: int) -> list[list[int]]:
    """The domain's indices per step, from its sampler's micro-batches."""
    micro = list(_sampler(job, domain, consumed, total))
    m = job.domains[domain].micro_batches
    return [sum(micro[i : i + m], []) for i in range(0, len(micro), m)]


def test_sampler_splits_1000_steps_exactly_and_resumes_in_the_middle():
    job = job_three_domains()  # shares 4 + 2 + 2 of a global batch of 8, micro-batches of 2
    B, steps = job.global_batch, 1000
    total = steps * B + 5  # a partial last global batch: no domain may run it
    per_domain = [_steps(job, d, 0, total) for d in range(3)]
    assert [len(s) for s in per_domain] == [steps] * 3
    seen: list[int] = []
    for t in range(steps):
        step = [i for d in range(3) for i in per_domain[d][t]]
        assert sorted(step) == list(range(t * B, (t + 1) * B)), t  # once each, none skipped
        seen += step
    assert sorted(seen) == list(range(steps * B))
    # every rank of a domain builds the same sampler: the same indices
    assert _steps(job, 1, 0, total) == per_domain[1]
    # resume after 437 steps (Megatron restores consumed_train_samples = 437 x B)
    for d in range(3):
        assert _steps(job, d, 437 * B, total) == per_domain[d][437:]
    # ... under another job with the same global batch: the same samples, split otherwise
    other = make_job([([0, 1, 2, 3], 4, _four_rank_layout())], micro_batch_size=2)
    resumed = _steps(other, 0, 437 * B, total)
    assert [sorted(s) for s in resumed] == [
        sorted(i for d in range(3) for i in per_domain[d][t]) for t in range(437, steps)
    ]


def _four_rank_layout() -> Layout:
    return layout_on(
        [0, 1, 2, 3],
        [[(0, 21)], [(21, 30)], [(30, 39)], [(39, 48)]],
        [ALL_HEADS] * 4,
        [[0], [1], [2], [3]],
    )


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"consumed_samples": 40}, "no data left"),
        ({"samples": SampleRange(4, 7)}, "whole number of micro-batches"),
        ({"global_batch": 5}, "not a whole number of micro-batches of 2"),
        ({"total_samples": 0}, "no sample"),
    ],
)
def test_sampler_refuses_what_it_cannot_split(kwargs, message):
    base = dict(
        total_samples=40,
        consumed_samples=0,
        micro_batch_size=2,
        global_batch=8,
        samples=SampleRange(4, 6),
    )
    with pytest.raises(HexiSeqError, match=message):
        JobBatchSampler(**(base | kwargs))


def test_data_loader_reads_the_domains_samples():
    job = job_three_domains()
    loaders = JobDataLoaders(
        samples=job.sample_range(1),
        global_batch=job.global_batch,
        micro_batch_size=2,
        get_args=lambda: argparse.Namespace(num_workers=0, exit_signal_handler=False),
    )
    dataset = [torch.tensor([i]) for i in range(24)]
    got = [b.view(-1).tolist() for b in loaders(dataset, 8)]
    assert got == [[12, 13], [20, 21]]  # steps 1 and 2 (consumed 8), domain 1's [4, 6)
    assert loaders(None, 0) is None


# ---- the schedule seam -------------------------------------------------------------------------
class _Recorder:
    def __init__(self):
        self.calls: list[tuple[int, bool]] = []
        self.checked: list[int] = []

    def schedule(self, **kwargs):
        self.calls.append((kwargs["num_microbatches"], kwargs.get("forward_only", False)))
        return ["losses"]


def test_schedule_runs_the_domains_micro_batches_then_the_check():
    rec = _Recorder()
    check = params_check.ParamsCheck(2, groups=lambda: (None, None))
    check.after_step = lambda model: rec.checked.append(len(rec.calls))  # type: ignore[method-assign]
    sched = job_plugin.HexiSeqSchedule(
        rec.schedule, micro_batches=3, total_micro_batches=4, params_check=check
    )
    for forward_only in (False, True, False):
        assert sched(num_microbatches=4, model=["m"], forward_only=forward_only) == ["losses"]
    assert rec.calls == [(3, False), (3, True), (3, False)]
    assert rec.checked == [1, 3]  # after training steps only
    with pytest.raises(HexiSeqError, match="Megatron runs 5 micro-batches per step but the job"):
        sched(num_microbatches=5, model=["m"])


def test_params_check_runs_every_nth_step(monkeypatch):
    seen = []
    monkeypatch.setattr(
        params_check, "check_same_parameters", lambda chunk, **kw: seen.append(kw["when"])
    )
    check = params_check.ParamsCheck(2, groups=lambda: ("dense", None))
    for _ in range(5):
        check.after_step(torch.nn.Linear(1, 1))
    assert seen == [
        "after training step 2 of this run",
        "after training step 4 of this run",
    ]


def test_training_seams_are_installed_once():
    def stock_getter():
        return _Recorder().schedule

    training = types.ModuleType("training_standin")
    training.get_forward_backward_func = stock_getter
    training.build_pretraining_data_loader = None
    job = job_1_2()
    args = argparse.Namespace(num_workers=0)
    hs = HexiSeqArgs(job="j.json")
    place = job_place(job, 2)  # domain 1, local rank 0 (cluster rank 2 runs after 1)
    for _ in range(2):  # set up twice: the stock schedule is wrapped once
        job_plugin.install_training_seams(training, args, hs, place=place, job=job)
    getter = training.get_forward_backward_func
    assert isinstance(getter, job_plugin.ScheduleGetter) and getter.stock is stock_getter
    sched = getter()
    assert sched.micro_batches == 1 and sched.total_micro_batches == 4
    assert sched.params_check is None
    assert training.build_pretraining_data_loader.samples == SampleRange(3, 4)
    # a plain layout: only the parameter check, only when asked for
    plain = types.ModuleType("training_plain")
    plain.get_forward_backward_func = stock_getter
    job_plugin.install_training_seams(plain, args, HexiSeqArgs(layout="l.json"))
    assert plain.get_forward_backward_func is stock_getter
    job_plugin.install_training_seams(plain, args, HexiSeqArgs(layout="l.json", check_params=5))
    sched = plain.get_forward_backward_func()
    assert sched.micro_batches is None and sched.params_check.every == 5
    assert not hasattr(plain, "build_pretraining_data_loader")


# ---- the parameter hash ------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_hash_moves_with_one_ulp_anywhere(dtype):
    g = torch.Generator().manual_seed(0)
    tensors = [torch.randn(n, generator=g).to(dtype) for n in (7, 300, 1)]
    h = params_check.tensors_hash(tensors)
    assert h == params_check.tensors_hash([t.clone() for t in tensors])
    assert 0 <= h < 2**64
    for t in range(3):
        for i in {0, tensors[t].numel() // 2, tensors[t].numel() - 1}:
            moved = [x.clone() for x in tensors]
            moved[t][i] = torch.nextafter(moved[t][i], torch.tensor(float("inf"), dtype=dtype))
            assert not torch.equal(moved[t], tensors[t])
            assert params_check.tensors_hash(moved) != h, (t, i)
    # the same values in another tensor order hash differently (positions count)
    assert params_check.tensors_hash(tensors[::-1]) != h


def test_hash_does_not_depend_on_the_chunking(monkeypatch):
    x = torch.randn(10_000, generator=torch.Generator().manual_seed(1))
    whole = params_check.tensors_hash([x])
    monkeypatch.setattr(params_check, "_CHUNK", 333)
    assert params_check.tensors_hash([x]) == whole


def test_replicated_tensors_leave_per_rank_buffers_out():
    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(2))
            self.e = torch.nn.Parameter(torch.ones(3))
            self.e.allreduce = False  # Megatron's mark of an expert-parallel parameter
            self.register_buffer("kept", torch.zeros(1))
            self.register_buffer("positions", torch.arange(4), persistent=False)

    dense, expert = params_check.replicated_tensors(M())
    assert [t.numel() for t in dense] == [2, 1] and [t.numel() for t in expert] == [3]


def test_mismatch_message_names_the_odd_ranks():
    msg = params_check.mismatch_message("parameters", [5, 5, 9, 5], [0, 1, 2, 3], "at start-up")
    assert msg.startswith("parameters differ across ranks at start-up: global rank 2 hold")
    assert "than global ranks 0, 1, 3" in msg and "0x0000000000000009 vs 0x0000000000000005" in msg
