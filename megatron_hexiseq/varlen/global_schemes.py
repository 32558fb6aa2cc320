"""A step of the global batch under each scheme, priced by one cost model.

Every scheme gets the same global batch: the loader's samples of ``S`` tokens (documents in loader
order, a document cut at a sample boundary becoming two units, ``packing.pack_batches``) and runs
them on the same cluster. A domain runs its micro-batches one after the other; the step is the
slowest domain plus the step's fixed costs (``step_costs.step_fixed_s``); whole-cluster tokens/s =
global batch tokens / step. Each micro-batch is priced by ``costmodel.documents.estimate_documents``
on its domain's GPUs (``domains.sub_cluster``).

- ``hexiseq-global`` (``hexiseq_step``): ``GlobalPlanner`` over HexiSeq domains: units to
  (domain, micro-batch) bins by integer cost, each bin ``BatchPlanner``-planned in its domain,
  pruned sub-ring exchange.
- ``megatron-cp-dp`` (``cp_dp_step``): stock Megatron: CP size ``c``, DP = W / c replicas of ``c``
  consecutive GPUs (canonical node order), sample ``i`` to replica ``i mod DP`` (Megatron's
  sampler), every document of a sample in ``2 c`` zig-zag THD chunks, Transformer Engine's ring
  (``te-ring``). Needs ``S % 2c == 0`` and the samples divisible by DP.
- ``megatron-hybrid-cp`` (``hybrid_cp_step``): Megatron's own ``BalancedCPScheduler``
  (``megatron.core.pipeline_parallel.hybrid_cp_schedule``) on the units of the global batch over the
  W GPUs (its dp x cp ranks = the canonical order): each unit on ``gpus_needed`` consecutive GPUs
  (its CP size: the power of two that keeps it within ``max_seqlen_per_rank`` tokens per GPU), run
  as its own forward and backward (THD zig-zag, TE's ring); a GPU runs its units of a schedule
  group one after the other, groups end at a barrier: step = sum over groups of the busiest GPU.
- ``speed-aware-packing`` (``speed_aware_step``): whole units onto stock symmetric CP groups of
  size ``c`` (the same grid as ``megatron-cp-dp``, the same micro-batch count per group) by
  predicted speed: the global scheduler with each group's zig-zag cost table, THD zig-zag inside.
- ``megatron-thd-cp`` (``thd_step``, appendix only): one CP ring over every GPU, every sample
  zig-zagged over all of them.

Baselines run in the first memory mode (of ``modes``, in order of overhead) where their largest
micro-batch fits, as ``plan`` scores its baselines; HexiSeq domains in the options they were planned
with. Megatron pads each THD document to a multiple of ``2 c``; that padding is not counted (in the
baselines' favour).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any, NamedTuple

import numpy as np

from megatron_hexiseq.cluster import Cluster
from megatron_hexiseq.costmodel.documents import DocumentEstimate, estimate_documents
from megatron_hexiseq.costmodel.pieces import cu_from_lengths
from megatron_hexiseq.costmodel.step import step_once_s
from megatron_hexiseq.errors import HexiSeqError
from megatron_hexiseq.layout import Layout
from megatron_hexiseq.model import ModelSpec
from megatron_hexiseq.planner.canonical import canonical_order
from megatron_hexiseq.run_config import TrainOptions
from megatron_hexiseq.varlen.assignment import fill_empty
from megatron_hexiseq.varlen.domains import Domain, cp_groups, domain_options, sub_cluster
from megatron_hexiseq.varlen.global_planner import GlobalPlanner, in_lockstep, price_micro_batch
from megatron_hexiseq.varlen.schemes import ring_layout, zigzag_docs
from megatron_hexiseq.varlen.step_costs import step_fixed_s

THD_SAMPLES = 4  # megatron-thd-cp (appendix): samples priced, the step scaled from their mean


class MicroBatchRun(NamedTuple):
    """One micro-batch of a step: where it ran (domain index, its micro-batch index, the cluster
    ranks of the domain's local ranks), its layout over those ranks, boundaries and price."""

    domain: int
    micro_batch: int
    ranks: tuple[int, ...]
    layout: Layout
    cu_seqlens: tuple[int, ...]
    estimate: DocumentEstimate


class SchemeStep(NamedTuple):
    """One scheme on one global batch: per domain its busy seconds, the step, whether every
    micro-batch fits, the micro-batches, and the planner's CPU seconds (schedule; per bin)."""

    scheme: str
    config: dict[str, Any]
    domain_s: tuple[float, ...]
    step_s: float
    feasible: bool
    runs: tuple[MicroBatchRun, ...]
    schedule_s: float = 0.0
    plan_s: tuple[float, ...] = ()


class Pricer:
    """Prices micro-batches on sub-clusters of one cluster (memoised sub-clusters and rings)."""

    def __init__(self, cluster: Cluster, model: ModelSpec) -> None:
        self.cluster, self.model = cluster, model
        self._subs: dict[tuple[int, ...], Cluster] = {}
        self._memo: dict[tuple, DocumentEstimate] = {}
        self._models: dict[int, ModelSpec] = {}

    def model_at(self, tokens: int) -> ModelSpec:
        """The model with ``seq_length = tokens`` (memoised: a ModelSpec validates itself)."""
        if tokens not in self._models:
            self._models[tokens] = replace(self.model, seq_length=tokens)
        return self._models[tokens]

    def sub(self, ranks: Sequence[int]) -> Cluster:
        key = tuple(ranks)
        if key not in self._subs:
            self._subs[key] = sub_cluster(self.cluster, key)
        return self._subs[key]

    def ring(
        self,
        ranks: Sequence[int],
        docs: Sequence[int],
        options: TrainOptions,
        *,
        memo: bool = False,
    ) -> tuple[Layout, tuple[int, ...], DocumentEstimate]:
        """Documents ``docs`` THD zig-zag over the CP ring ``ranks`` (TE's ring exchange).
        ``memo``: reuse the price of the same documents on GPUs of the same kinds and nodes."""
        sub = self.sub(ranks)
        cu = np.asarray(cu_from_lengths(docs), dtype=np.int64)
        N, c = int(cu[-1]), len(ranks)
        m = self.model_at(N)
        segs = zigzag_docs(cu, list(range(c)), c)
        fill_empty(segs)
        lay = ring_layout(sub, m, N, segs)
        cu_t = tuple(cu.tolist())
        key = None
        if memo:
            first: dict[str, int] = {}
            kinds = tuple(
                (d.gpu.name, first.setdefault(d.node, j)) for j, d in enumerate(sub.devices)
            )
            key = (kinds, cu_t, options)
            if key in self._memo:
                return lay, cu_t, self._memo[key]
        est = estimate_documents(lay, sub, m, options, cu_t, exchange="te-ring")
        if key is not None:
            self._memo[key] = est
        return lay, cu_t, est

    def bin(
        self, domain: Domain, layout: Layout, cu: tuple[int, ...], exchange: str
    ) -> DocumentEstimate:
        return price_micro_batch(domain, self.model_at(layout.seq_length), layout, cu, exchange)


def _finish(
    name: str,
    config: dict[str, Any],
    cluster: Cluster,
    model: ModelSpec,
    options: TrainOptions,
    runs: list[MicroBatchRun],
    domains: int,
    run_ranks: Sequence[int],
    domain_s: Sequence[float] | None = None,
    **extra: Any,
) -> SchemeStep:
    busy_s = None
    if domain_s is None:
        # every priced micro-batch carries the measured step overhead (the CPU testbed's; 0 on
        # GPUs), a step pays it once: a further micro-batch keeps only its per-micro-batch part
        once = step_once_s([cluster.devices[g] for g in run_ranks])
        busy = [0.0] * domains
        counts = [0] * domains
        for r in runs:
            busy[r.domain] += r.estimate.iteration_time_s
            counts[r.domain] += 1
        domain_s = [b - max(0, k - 1) * once for b, k in zip(busy, counts)]
        if in_lockstep([options], domains):
            busy_s = lockstep_s(runs, domains) - max(0, max(counts) - 1) * once
    if busy_s is None:
        busy_s = max(domain_s)
    step = busy_s + step_fixed_s(cluster, model, options, run_ranks)
    return SchemeStep(
        scheme=name,
        config=config,
        domain_s=tuple(float(x) for x in domain_s),
        step_s=float(step),
        feasible=all(r.estimate.feasible for r in runs),
        runs=tuple(runs),
        **extra,
    )


def lockstep_s(runs: Sequence[MicroBatchRun], domains: int) -> float:
    """The busy part of a Megatron-FSDP step: every rank of the run joins each micro-batch's
    per-layer gathers and reduce-scatters (the shard group is every rank), so micro-batch ``k`` of
    every domain runs in lockstep and lasts as long as the slowest of them; the step is their sum
    (docs/job.md, "Megatron-FSDP runs equal shares"). Domains with different micro-batch counts
    would stop joining those collectives at different points: refused, as the runtime refuses
    such a job."""
    counts = [0] * domains
    slots: dict[int, float] = {}
    for r in runs:
        counts[r.domain] += 1
        slots[r.micro_batch] = max(slots.get(r.micro_batch, 0.0), r.estimate.iteration_time_s)
    if len(set(counts)) > 1:
        raise HexiSeqError(
            f"Megatron-FSDP gathers parameters in every micro-batch over every rank, and these "
            f"domains run {'/'.join(map(str, sorted(set(counts))))} micro-batches per step: give "
            "every domain the same count, or use the distributed optimizer"
        )
    return sum(slots.values())


def first_fit(modes: Sequence[TrainOptions], fits: Callable[[TrainOptions], bool]) -> TrainOptions:
    """The first of ``modes`` in which ``fits``; the last one when none does."""
    for o in modes:
        if fits(o):
            return o
    return modes[-1]


# ---- HexiSeq ------------------------------------------------------------------------------
def hexiseq_step(
    planner: GlobalPlanner, pricer: Pricer, units: Sequence[int], config: dict[str, Any]
) -> SchemeStep:
    """``hexiseq-global`` on one global batch: the schedule (CPU time), every bin planned (CPU
    time each) and priced."""
    t0 = time.thread_time()
    sched = planner.schedule(units)
    schedule_s = time.thread_time() - t0
    runs, plan_s = [], []
    for d, dom in enumerate(planner.domains):
        for k in range(dom.micro_batches):
            t0 = time.thread_time()
            a = planner.plan_bin(sched, units, d, k)
            plan_s.append(time.thread_time() - t0)
            est = pricer.bin(dom, a.layout, a.cu_seqlens, "pruned")
            runs.append(MicroBatchRun(d, k, dom.ranks, a.layout, a.cu_seqlens, est))
    ranks = sorted(r for dom in planner.domains for r in dom.ranks)
    return _finish(
        "hexiseq-global",
        config,
        pricer.cluster,
        pricer.model,
        planner.domains[0].options,
        runs,
        len(planner.domains),
        ranks,
        schedule_s=schedule_s,
        plan_s=tuple(plan_s),
    )


# ---- stock Megatron ------------------------------------------------------------------------
def cp_sizes(world: int, seq_length: int, samples: int, max_cp: int | None = None) -> list[int]:
    """Megatron's possible CP sizes: powers of two dividing the GPUs with ``S % 2c == 0`` and the
    samples divisible by DP = W / c; at most ``max_cp``."""
    out = []
    c = 1
    while c <= world and (max_cp is None or c <= max_cp):
        if world % c == 0 and seq_length % (2 * c) == 0 and samples % (world // c) == 0:
            out.append(c)
        c *= 2
    return out


def cp_dp_step(
    pricer: Pricer,
    samples: Sequence[Sequence[int]],
    c: int,
    modes: Sequence[TrainOptions],
    ranks: Sequence[int] | None = None,
) -> SchemeStep:
    """``megatron-cp-dp`` with CP size ``c`` on ``ranks`` (default: the whole cluster)."""
    cluster = pricer.cluster
    groups = _cp_groups(pricer, c, ranks)
    D = len(groups)
    run_ranks = sorted(r for g in groups for r in g)
    opts = [domain_options(o, cluster, run_ranks, c) for o in modes]

    def fits(o: TrainOptions) -> bool:
        return all(
            pricer.ring(g, samples[0], o, memo=True)[2].feasible for g in _kinds(pricer, groups)
        )

    o = first_fit(opts, fits)
    runs = []
    for i, docs in enumerate(samples):
        g = groups[i % D]
        lay, cu, est = pricer.ring(g, docs, o)
        runs.append(MicroBatchRun(i % D, i // D, tuple(g), lay, cu, est))
    return _finish(
        "megatron-cp-dp",
        {"cp": c, "dp": D, **_mode(o)},
        cluster,
        pricer.model,
        o,
        runs,
        D,
        run_ranks,
    )


def speed_aware_step(
    pricer: Pricer,
    units: Sequence[int],
    samples: int,
    c: int,
    modes: Sequence[TrainOptions],
    ranks: Sequence[int] | None = None,
    micro_batches: int | None = None,
) -> SchemeStep:
    """``speed-aware-packing`` with CP groups of size ``c``: the global scheduler with zig-zag cost
    tables over the stock grid, ``micro_batches`` per group (default ``ceil(samples / DP)``, the
    stock grid's; fewer hold more tokens each)."""
    cluster = pricer.cluster
    groups = _cp_groups(pricer, c, ranks)
    D = len(groups)
    m = micro_batches or -(-samples // D)
    run_ranks = sorted(r for g in groups for r in g)
    last: Exception | None = None
    for o in modes:
        opt = domain_options(o, cluster, run_ranks, c)

        domains = [
            Domain(
                index=i,
                ranks=tuple(g),
                micro_batches=m,
                structure=_ring_structure(pricer, g),
                cluster=pricer.sub(g),
                options=opt,
            )
            for i, g in enumerate(groups)
        ]
        planner = GlobalPlanner(domains, pricer.model, mode="zigzag")
        try:
            t0 = time.thread_time()
            sched = planner.schedule(units)
            schedule_s = time.thread_time() - t0
        except HexiSeqError as e:  # a unit fits no group's memory in this mode
            last = e
            continue
        runs = []
        for d, dom in enumerate(domains):
            for k in range(m):
                a = planner.plan_bin(sched, units, d, k)
                est = pricer.bin(dom, a.layout, a.cu_seqlens, "te-ring")
                runs.append(MicroBatchRun(d, k, dom.ranks, a.layout, a.cu_seqlens, est))
        step = _finish(
            "speed-aware-packing",
            {"cp": c, "dp": D, "micro_batches": m, **_mode(opt)},
            cluster,
            pricer.model,
            opt,
            runs,
            D,
            run_ranks,
            schedule_s=schedule_s,
        )
        if step.feasible or o is modes[-1]:
            return step
    raise HexiSeqError(f"speed-aware-packing with CP {c}: {last}")


def _ring_structure(pricer: Pricer, ranks: Sequence[int]) -> Layout:
    """One rank per group, every head: a CP ring over ``ranks`` (local numbering)."""
    sub = pricer.sub(ranks)
    n = len(ranks)
    m = replace(pricer.model, seq_length=max(n, 1))
    return ring_layout(sub, m, n, [[(j, j + 1)] for j in range(n)])


class _Size:
    """What ``BalancedCPScheduler`` reads of its ``dp_cp_group``: its size."""

    def __init__(self, n: int) -> None:
        self.n = n

    def size(self) -> int:
        return self.n


def hybrid_cp_step(
    pricer: Pricer,
    units: Sequence[int],
    max_seqlen_per_rank: int,
    modes: Sequence[TrainOptions],
    ranks: Sequence[int] | None = None,
) -> SchemeStep:
    """``megatron-hybrid-cp``: Megatron's ``BalancedCPScheduler`` on the units (module docstring)."""
    from megatron.core.pipeline_parallel.hybrid_cp_schedule import BalancedCPScheduler

    cluster = pricer.cluster
    if ranks is None:
        gpus = canonical_order(cluster)
    else:
        gpus = [ranks[i] for i in canonical_order(pricer.sub(ranks))]
    W = len(gpus)
    sched = BalancedCPScheduler(max_seq_len_per_rank=max_seqlen_per_rank, dp_cp_group=_Size(W))
    try:
        _, id_groups = sched.get_groups_and_subsamples(
            [(i, int(x)) for i, x in enumerate(units)], None
        )
    except (AssertionError, IndexError, ValueError) as e:
        raise HexiSeqError(
            f"Megatron's BalancedCPScheduler failed at max_seqlen_per_rank {max_seqlen_per_rank}: {e}"
        ) from None
    run_ranks = sorted(gpus)
    longest = max(units)
    k_long = sched.gpus_needed(longest)
    if k_long > W:
        raise HexiSeqError(f"a unit of {longest} tokens needs {k_long} GPUs, more than {W}")
    opts = [domain_options(o, cluster, run_ranks, 1) for o in modes]
    o = first_fit(
        opts,
        lambda o: pricer.ring(gpus[:k_long], [longest], o, memo=True)[2].feasible,
    )
    runs: list[MicroBatchRun] = []
    # every unit is a forward and backward carrying the measured step overhead (the CPU
    # testbed's; 0 on GPUs): the step pays it once, each unit only its per-micro-batch part
    once = step_once_s([cluster.devices[g] for g in run_ranks])
    step = once
    for j, per_gpu in enumerate(id_groups):
        members: dict[int, list[int]] = {}
        for g, ids in enumerate(per_gpu):
            for u in ids:
                members.setdefault(int(u), []).append(g)
        busy = np.zeros(W)
        for u, gs in sorted(members.items()):
            rr = tuple(gpus[g] for g in gs)
            lay, cu, est = pricer.ring(rr, [int(units[u])], o, memo=True)
            busy[gs] += est.iteration_time_s - once
            runs.append(MicroBatchRun(j, u, rr, lay, cu, est))
        step += float(busy.max())
    groups = len(id_groups)
    out = _finish(
        "megatron-hybrid-cp",
        {"max_seqlen_per_rank": max_seqlen_per_rank, "groups": groups, **_mode(o)},
        cluster,
        pricer.model,
        o,
        runs,
        1,
        run_ranks,
        domain_s=[step],
    )
    return out


def thd_step(
    pricer: Pricer, samples: Sequence[Sequence[int]], modes: Sequence[TrainOptions]
) -> SchemeStep:
    """``megatron-thd-cp`` (appendix): one ring over every GPU, every sample zig-zagged over all;
    the first ``THD_SAMPLES`` samples priced, the step = their mean x the samples."""
    order = canonical_order(pricer.cluster)
    W = len(order)
    opts = [domain_options(o, pricer.cluster, order, W) for o in modes]
    o = first_fit(opts, lambda o: pricer.ring(order, samples[0], o)[2].feasible)
    runs = []
    for i, docs in enumerate(samples[:THD_SAMPLES]):
        lay, cu, est = pricer.ring(order, docs, o)
        runs.append(MicroBatchRun(0, i, tuple(order), lay, cu, est))
    mean = float(np.mean([r.estimate.iteration_time_s for r in runs]))
    # every sample a micro-batch carrying the measured step overhead: the step pays it once
    once = step_once_s([pricer.cluster.devices[g] for g in order])
    return _finish(
        "megatron-thd-cp",
        {"cp": W, "priced_samples": len(runs), **_mode(o)},
        pricer.cluster,
        pricer.model,
        o,
        runs,
        1,
        order,
        domain_s=[mean * len(samples) - (len(samples) - 1) * once],
    )


def _cp_groups(pricer: Pricer, c: int, ranks: Sequence[int] | None) -> list[list[int]]:
    """CP groups of size ``c`` over ``ranks`` (default: every GPU), as cluster ranks."""
    if ranks is None:
        return cp_groups(pricer.cluster, c)
    return [[ranks[i] for i in g] for g in cp_groups(pricer.sub(ranks), c)]


def _kinds(pricer: Pricer, groups: Sequence[Sequence[int]]) -> list[Sequence[int]]:
    """One group per kind (GPU types and node pattern), for memory checks."""
    seen, out = set(), []
    for g in groups:
        sub = pricer.sub(g)
        first: dict[str, int] = {}
        key = tuple((d.gpu.name, first.setdefault(d.node, j)) for j, d in enumerate(sub.devices))
        if key not in seen:
            seen.add(key)
            out.append(g)
    return out


def _mode(o: TrainOptions) -> dict[str, Any]:
    return {"memory_mode": o.memory_mode, "recompute": o.recompute}
