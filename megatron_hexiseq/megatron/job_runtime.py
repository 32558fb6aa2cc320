"""A job plan in one Megatron run: each process's domain, and every domain's groups.

A job (:class:`megatron_hexiseq.job.JobPlan`) splits the run's GPUs into domains; each domain runs
its own HexiSeq layout on its own ``micro_batches`` micro-batches of every step. Every TP rank
holds its share of the whole model (PP = 1; TP = the job's ``t``, one for the whole job).

**How Megatron's grid sees a job.** TP = ``t``, one context-parallel group per TP rank over every
bundle: ``--context-parallel-size`` = world size / ``t``, data-parallel size 1. So ``dp_cp``
(Megatron's data-parallel group with context parallelism) of TP rank ``i`` is the TP-rank-``i`` GPU
of every bundle: the gradient reduction (DDP, the distributed optimizer, Megatron-FSDP), the token
count of the per-token loss (``finalize_model_grads``) and the loss report run over it, once per
step, exactly as in a one-layout run (with ``t = 1``: every rank); Megatron's global batch is the
job's, ``get_num_microbatches()`` is the job's total number of micro-batches and
``consumed_train_samples`` grows by the global batch per step. Megatron's own CP groups carry no
traffic (HexiSeq attention, RoPE and the batch slicing use the job's groups); the job's groups
are built here.

**Ranks.** Process rank ``k`` runs cluster rank ``job.run_ranks[k]``: with ``t > 1`` every ``t``
consecutive process ranks are one bundle, in its TP-rank order (Megatron's ``tp-cp-ep-dp-pp`` grid
makes them a TP group), so process bundle ``k // t`` and TP rank ``k % t``. A domain's layout
numbers its local ranks (bundles) in the order of ``domain.ranks``, while torch numbers a group's
members by ascending global rank; so each domain's layout is renumbered to its process bundles in
ascending order (:func:`domain_layout`; any numbering of an exact layout's ranks is exact: it only
relabels who holds which segments and heads). TP rank ``i`` of every bundle of a domain runs that
layout with the TP-rank-``i`` GPUs of the domain's other bundles, on its own slice of the heads,
as one layout over TP bundles runs (``megatron/tensor_parallel.py``): Megatron's attention hands
TP rank ``i``'s core attention exactly its query and K/V heads. So each domain has ``t`` groups of
ranks, one per TP rank (:func:`domain_groups`), each a domain of its own for HexiSeq's groups.

:func:`build_job_runtime` (collective over the default group, once per process) checks the run
against the job (:func:`check_job_run`, pure), proves the attention kernel, checks every device
name against its domain's layout (and with ``t > 1`` that every TP group sits on one host),
creates the CP and A2A groups of every domain and TP rank, domain by domain and TP rank by TP rank,
in that order on every process (``dist.new_group`` must be called by every process, and a group's
first collective needs all its members) and returns this process's ``HexiSeqRuntime`` (its
domain's layout and its TP rank's groups) and its :class:`JobPlace`.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from dataclasses import replace
from datetime import timedelta
from typing import Any, NamedTuple

import torch.distributed as dist

from megatron_hexiseq.attention.groups import build_hexiseq_groups
from megatron_hexiseq.cluster import cluster_to_dict
from megatron_hexiseq.errors import HexiSeqError
from megatron_hexiseq.job import JobPlan, SampleRange
from megatron_hexiseq.layout import Layout, make_layout
from megatron_hexiseq.megatron.args import CP_COMM_TYPE
from megatron_hexiseq.megatron.batch_layout import CLUSTER_SPEC_KEY, MODEL_SPEC_KEY
from megatron_hexiseq.megatron.runtime import (
    HexiSeqRuntime,
    RunShape,
    check_devices,
    check_run,
    hexiseq_pg_options,
    local_device_name,
    prove_kernel,
    runtime_device,
)
from megatron_hexiseq.megatron.tensor_parallel import check_tp_group_hosts


class JobPlace(NamedTuple):
    """Where this process runs in a job, and its share of every step."""

    domain: int  # index of its domain in the job
    local_rank: int  # its rank (bundle) in the domain's (renumbered) layout
    micro_batches: int  # micro-batches its domain runs per step
    total_micro_batches: int  # of every domain: the step's global batch / micro-batch size
    samples: SampleRange  # its domain's slice of every step's global batch
    tp_rank: int = 0  # its TP rank in its bundle


def domain_process_ranks(job: JobPlan) -> list[tuple[int, ...]]:
    """Each domain's process ranks, in the order of its ``ranks`` (local rank order)."""
    process = {cluster: k for k, cluster in enumerate(job.run_ranks)}
    return [tuple(process[r] for r in dom.ranks) for dom in job.domains]


def domain_groups(job: JobPlan, domain: int) -> list[tuple[int, ...]]:
    """Domain ``domain``'s process ranks per TP rank: entry ``i`` holds the TP-rank-``i`` process
    of each of its bundles in the renumbered layout's order (ascending); layout rank ``j`` of TP
    rank ``i`` runs on ``entry[i][j]``. With ``t = 1``: one entry, the domain's process ranks."""
    t = job.tensor_model_parallel_size
    _, bundles = domain_layout(job, domain)
    return [tuple(b * t + i for b in bundles) for i in range(t)]


def renumber(layout: Layout, order: Sequence[int]) -> Layout:
    """``layout`` with its ranks renumbered: new rank ``j`` is old rank ``order[j]`` (its segments,
    heads, host and GPU; groups keep their order, members listed ascending). ``layout`` itself
    when ``order`` is the identity."""
    if list(order) == list(range(layout.world_size)):
        return layout
    new_of = {old: new for new, old in enumerate(order)}
    old = [layout.ranks[o] for o in order]
    return make_layout(
        seq_length=layout.seq_length,
        num_attention_heads=layout.num_attention_heads,
        num_query_groups=layout.num_query_groups,
        segments=[r.segments for r in old],
        heads=[r.heads for r in old],
        groups=[sorted(new_of[r] for r in g.ranks) for g in layout.groups],
        hosts=[r.host for r in old],
        gpus=[r.gpu for r in old],
        tensor_model_parallel_size=layout.tensor_model_parallel_size,
        predicted=layout.predicted,
        baselines=layout.baselines,
        planner=layout.planner,
        meta=layout.meta,
    )


def domain_layout(job: JobPlan, domain: int) -> tuple[Layout, tuple[int, ...]]:
    """Domain ``domain``'s layout over its process ranks in ascending order, and those ranks
    (layout rank ``j`` runs on process rank ``ranks[j]``; with ``t > 1`` over its process bundles,
    ``ranks[j]`` being bundle ``j``'s: process ranks ``ranks[j] * t .. + t - 1``). Its ``meta``
    records what the batch planner (``--hexiseq-batch-plan``) reads, from the job: the domain's
    own cluster (its GPUs, devices ``j*t .. j*t+t-1`` = layout rank ``j``), the job's model and
    training options."""
    t = job.tensor_model_parallel_size
    ranks = tuple(k // t for k in domain_process_ranks(job)[domain][::t])
    order = sorted(range(len(ranks)), key=lambda j: ranks[j])
    layout = renumber(job.domains[domain].layout, order)
    meta = {
        **layout.meta,
        CLUSTER_SPEC_KEY: domain_cluster(job, domain),
        MODEL_SPEC_KEY: dict(job.model),
        "options": dict(job.options),
    }
    return replace(layout, meta=meta), tuple(sorted(ranks))


def domain_cluster(job: JobPlan, domain: int) -> dict[str, Any]:
    """The cluster spec of one domain's GPUs: the job's nodes, each with as many GPUs as the
    domain has there (nodes in file order, so device ``j`` is the domain's ``j``-th GPU in cluster
    order, which is the renumbered layout's rank order)."""
    data = cluster_to_dict(job.cluster_spec)
    mine = {job.cluster_spec.devices[r].node for r in job.domains[domain].ranks}
    count = {
        n: sum(job.cluster_spec.devices[r].node == n for r in job.domains[domain].ranks)
        for n in mine
    }
    data["nodes"] = [
        {**node, "count": count[node["name"]]} for node in data["nodes"] if node["name"] in mine
    ]
    data["name"] = f"{data.get('name', 'cluster')}-domain{domain}"
    return data


def job_place(job: JobPlan, process_rank: int) -> JobPlace:
    """The domain, local rank and share of process rank ``process_rank`` (pure)."""
    if not 0 <= process_rank < len(job.run_ranks):
        raise HexiSeqError(
            f"process rank {process_rank} is outside the job's {len(job.run_ranks)} ranks"
        )
    where = job.locate(job.run_ranks[process_rank])
    t = job.tensor_model_parallel_size
    _, ranks = domain_layout(job, where.domain)
    return JobPlace(
        domain=where.domain,
        local_rank=ranks.index(process_rank // t),
        micro_batches=job.domains[where.domain].micro_batches,
        total_micro_batches=sum(d.micro_batches for d in job.domains),
        samples=job.sample_range(where.domain),
        tp_rank=process_rank % t,
    )


def check_job_run(
    job: JobPlan,
    run: RunShape,
    *,
    global_batch_size: int | None,
    micro_batch_size: int | None,
    source: str = "job",
) -> None:
    """Fail with one clear message if Megatron's run cannot execute ``job``. Pure; no processes.

    ``global_batch_size`` / ``micro_batch_size``: Megatron's ``--global-batch-size`` /
    ``--micro-batch-size`` (None: not checked, e.g. the CPU driver, which takes them from the job).
    """
    W = len(job.run_ranks)
    if run.cp_comm_type != CP_COMM_TYPE:
        raise HexiSeqError(
            f"--hexiseq-job needs --cp-comm-type {CP_COMM_TYPE} (for every layer), "
            f"got '{run.cp_comm_type}'"
        )
    if run.pipeline_model_parallel_size != 1:
        raise HexiSeqError(
            "--hexiseq-job runs a different number of micro-batches on each domain, which "
            "Megatron's pipeline schedules cannot (every stage passes every micro-batch on); use "
            "--pipeline-model-parallel-size 1"
        )
    t = job.tensor_model_parallel_size
    if run.tensor_model_parallel_size != t:
        planned = "every GPU as one rank" if t == 1 else f"TP bundles of {t} GPUs"
        raise HexiSeqError(
            f"{source} is planned over {planned} but --tensor-model-parallel-size is "
            f"{run.tensor_model_parallel_size}; set --tensor-model-parallel-size {t}"
        )
    if run.world_size != W:
        raise HexiSeqError(
            f"{source} runs on {W} GPUs but the run has {run.world_size} processes; launch "
            f"{W} (process k on cluster rank run_ranks[k]: 'megatron-hexiseq' SLURM script)"
        )
    if run.context_parallel_size != W // t:
        every = f"all {W} ranks" if t == 1 else f"all {W // t} bundles (one per TP rank)"
        raise HexiSeqError(
            f"with --hexiseq-job Megatron sees one context-parallel group of {every} "
            f"(data-parallel size 1); set --context-parallel-size {W // t} "
            f"(got {run.context_parallel_size})"
        )
    if global_batch_size is not None and global_batch_size != job.global_batch:
        raise HexiSeqError(
            f"{source} splits a global batch of {job.global_batch} sequences but "
            f"--global-batch-size is {global_batch_size}; set --global-batch-size {job.global_batch}"
        )
    if micro_batch_size is not None and micro_batch_size != job.micro_batch_size:
        raise HexiSeqError(
            f"{source} runs micro-batches of {job.micro_batch_size} sequences but "
            f"--micro-batch-size is {micro_batch_size}; set --micro-batch-size "
            f"{job.micro_batch_size}"
        )
    for d, dom in enumerate(job.domains):  # each domain as a one-layout run of its own size
        alone = replace(run, world_size=dom.size, context_parallel_size=dom.size // t)
        check_run(dom.layout, alone, source=f"{source} domain {d}")


def build_job_runtime(
    job: JobPlan,
    run: RunShape,
    *,
    global_batch_size: int | None = None,
    micro_batch_size: int | None = None,
    kernel: str = "auto",
    comm_chunks: int = 1,
    allow_mismatch: bool = False,
    source: str = "job",
    timeout: timedelta | None = None,
    nccl_cfgs: dict[str, dict[str, Any]] | None = None,
    fp32_grad_wire: bool = False,
    tp_group: dist.ProcessGroup | None = None,
) -> tuple[HexiSeqRuntime, JobPlace]:
    """Check the run, prove the kernel, build every domain's groups; this process's runtime and
    place. Collective over the default group (every process once, after Megatron's
    ``initialize_model_parallel``); the options are :func:`runtime.build_runtime`'s
    (``tp_group``: Megatron's TP group of this process, with ``t > 1``: checked to sit on one
    host)."""
    check_job_run(
        job,
        run,
        global_batch_size=global_batch_size,
        micro_batch_size=micro_batch_size,
        source=source,
    )
    if dist.get_world_size() != run.world_size:
        raise HexiSeqError(
            f"{dist.get_world_size()} processes joined but the run expects "
            f"{run.world_size}; check WORLD_SIZE and the launcher"
        )
    me = dist.get_rank()
    place = job_place(job, me)
    layouts = [domain_layout(job, d)[0] for d in range(len(job.domains))]
    # every domain's groups, one per TP rank, domain by domain (one order on every process)
    per_tp = [(layouts[d], ranks) for d in range(len(layouts)) for ranks in domain_groups(job, d)]
    names: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(names, local_device_name())
    for d, layout in enumerate(layouts):
        groups_d = domain_groups(job, d)
        for problem in check_devices(layout, groups_d, names, allow_mismatch=allow_mismatch):
            if me == 0:
                warnings.warn(f"hexiseq: {problem} (--hexiseq-allow-mismatch)", stacklevel=2)
    if tp_group is not None:
        check_tp_group_hosts(tp_group, allow_mismatch=allow_mismatch)
    device = runtime_device()
    concrete = prove_kernel(kernel, run, device)
    nccl = dist.get_backend() == "nccl"
    groups = build_hexiseq_groups(
        [layout for layout, _ in per_tp],
        domains=[ranks for _, ranks in per_tp],
        device=device,
        timeout=timeout,
        pg_options=hexiseq_pg_options(nccl_cfgs or {}) if nccl else None,
    )
    assert groups.rank == place.local_rank, (groups.rank, place)
    runtime = HexiSeqRuntime(
        layout=layouts[place.domain],
        groups=groups,
        kernel=concrete,
        comm_chunks=comm_chunks,
        fp32_grad_wire=fp32_grad_wire,
    )
    return runtime, place
