"""Pricing domains and jobs in the job model: one micro-batch of a domain by ``costmodel.estimate``,
the step by ``costmodel.step`` (docs/job.md, "The job model").

``Evaluator`` holds one problem (cluster, model, sequence length, global batch, training options)
and caches what it has priced by domain **shape** (``job.domains``): the single-sequence planner
(:meth:`Evaluator.hexiseq`) or a symmetric layout (:meth:`Evaluator.symmetric`) runs once per
shape, memory mode and shard group, whatever the number of domains of that shape. Every domain
runs under the job's options: the optimizer shards over every rank of the job
(``TrainOptions.shard_group_size``) and Megatron-FSDP's rings cross the whole job
(``shard_group_GBps``).

**TP bundles.** With ``options.tensor_model_parallel_size = t > 1`` the evaluator works on the
**bundle problem** (``costmodel.tp.bundle_setting``): one device per TP bundle of ``t`` GPUs of a
node (bundle ``b`` is cluster ranks ``b*t .. b*t+t-1``), one TP rank's model, the options with
``t``. Its ranks, domains, shapes, layouts and step are the bundle problem's: a job over bundles is
priced as the job of the bundle problem, exactly as ``estimate`` prices a layout over bundles
(``costmodel.tp``): every TP rank of a bundle does the same work at the same time, so one TP rank's
micro-batch is the bundle's, and the step's fixed costs are those of one TP rank's shard group
(``W / t`` ranks, ``P / t`` parameters each, its ring over the TP-rank-``i`` GPUs of every node).
Layouts are planned there and their segment boundaries rounded to multiples of ``t``
(``planner.tp.round_segments``: sequence parallelism splits a bundle's tokens evenly over its
GPUs); :meth:`Evaluator.layout_of` and :meth:`Evaluator.cluster_ranks` turn them into the job
file's layouts over bundles and cluster ranks. ``t = 1``: the bundle problem is the problem.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any, NamedTuple

from megatron_hexiseq import costmodel
from megatron_hexiseq.cluster import Cluster
from megatron_hexiseq.costmodel.formulas import (
    attention_flops_per_pair_head,
    causal_pairs,
    linear_flops_per_token,
    train_flops,
)
from megatron_hexiseq.costmodel.rates import attention_rate
from megatron_hexiseq.costmodel.step import (
    StepFixed,
    forward_fraction,
    grad_sync_exposed_s,
    micro_batch_overhead_s,
    ring_bus_GBps,
    step_fixed,
)
from megatron_hexiseq.costmodel.tp import bundle_setting
from megatron_hexiseq.errors import HexiSeqError
from megatron_hexiseq.job.domains import NodeIndex, Shape, move_layout, sub_cluster
from megatron_hexiseq.job.shares import DomainTime, busy_s, equal_shares, min_max_shares
from megatron_hexiseq.job.spec import JobPlan
from megatron_hexiseq.layout import Layout
from megatron_hexiseq.model import ModelSpec
from megatron_hexiseq.planner.baselines import symmetric_layout
from megatron_hexiseq.planner.build import with_fields
from megatron_hexiseq.planner.candidate import Deadline
from megatron_hexiseq.planner.feasibility import may_fit
from megatron_hexiseq.planner.plan import plan
from megatron_hexiseq.planner.tp import iteration_lower_bound, round_segments
from megatron_hexiseq.run_config import TrainOptions, options_record

Progress = Callable[[str], None]
MIN_PLAN_S = 1.0  # the least time limit a domain's plan gets once the job's has passed


class DomainEval(NamedTuple):
    """One micro-batch of a domain shape under one set of options."""

    layout: Layout | None  # on the shape's first sub-cluster; None: infeasible
    micro_batch_s: float  # estimate's iteration less the per-iteration step overhead
    forward_s: float  # linear work of a forward: what the parameter gather hides behind
    backward_s: float  # linear work of a backward (and recompute)
    label: str  # "hexiseq" (the planner's choice: planner.winner) or a symmetric config
    reason: str = ""  # why infeasible

    @property
    def feasible(self) -> bool:
        return self.layout is not None


def domain_eval(
    layout: Layout, cluster: Cluster, model: ModelSpec, options: TrainOptions, label: str
) -> DomainEval:
    """Price one micro-batch of ``layout`` on its sub-cluster: the iteration of ``estimate`` with
    the step overhead taken out but its per-micro-batch part (the step pays the rest once:
    ``StepFixed.once_s``) and the linear work of each pass."""
    est = costmodel.estimate(layout, cluster, model, options)
    if not est.feasible:
        problems = est.memory_problems()
        return DomainEval(None, math.inf, 0.0, 0.0, label, problems[0] if problems else "")
    lin = est.columns.values["linear_s"]
    overhead = est.columns.values["overhead_s"]
    fsdp = est.columns.values["fsdp_exposed_s"]
    rest = est.columns.values["time_s"] - lin
    work = float((lin - overhead - fsdp).max())
    fwd = forward_fraction(options) * work
    micro = float((lin - overhead).max()) + micro_batch_overhead_s(cluster.devices)
    micro += float(rest.max())
    return DomainEval(layout, micro, fwd, work - fwd, label)


class Priced(NamedTuple):
    """A job in the model: its domains (cluster ranks, rank order), their shares and step."""

    options: TrainOptions
    domains: tuple[tuple[int, ...], ...]
    evals: tuple[DomainEval, ...]
    shares: tuple[int, ...]
    times: tuple[DomainTime, ...]
    fixed: StepFixed
    step_s: float


class Evaluator:
    """One job problem and its caches (module docstring)."""

    def __init__(
        self,
        cluster: Cluster,
        model: ModelSpec,
        seq_length: int,
        micro_batches: int,
        options: TrainOptions,
        *,
        deadline: Deadline,
        progress: Progress | None = None,
    ) -> None:
        self.tp = options.tensor_model_parallel_size
        self.job_cluster, self.job_model = cluster, model  # the real ones (file, records)
        # what is planned and priced: the bundle problem (t = 1: the cluster and model themselves)
        self.cluster, self.model, tp_options = bundle_setting(cluster, model, options, self.tp)
        self.seq_length = seq_length
        self.micro_batches = micro_batches  # per step, all domains together
        self.base = replace(tp_options, data_parallel_size=1)
        self.index = NodeIndex(self.cluster)
        self.deadline = deadline
        self.say = progress or (lambda message: None)
        self._subs: dict[Shape, Cluster] = {}
        self._evals: dict[tuple[Any, ...], DomainEval] = {}
        self._ideal: dict[tuple[Any, ...], float] = {}
        self._fixed: dict[tuple[tuple[tuple[int, ...], ...], TrainOptions], StepFixed] = {}
        self.plans_run = 0

    # ---- options -------------------------------------------------------------------------
    def options(self, union: Sequence[int], memory_mode: str, recompute: bool) -> TrainOptions:
        """The job's options when the ranks ``union`` take part: the optimizer (under ``fsdp`` also
        the parameters and gradients) shards over all of them, Megatron's ``dp_cp``, whose ring
        sets the pace of Megatron-FSDP's per-micro-batch collectives."""
        bus = ring_bus_GBps(self.cluster, union)
        return replace(
            self.base,
            memory_mode=memory_mode,
            recompute=recompute,
            shard_group_size=len(union),
            shard_group_GBps=bus if math.isfinite(bus) else 0.0,
        )

    # ---- domains -------------------------------------------------------------------------
    def sub(self, ranks: Sequence[int]) -> tuple[Shape, Cluster]:
        """The shape of a domain and the sub-cluster its shape is planned on (the first domain
        of that shape met)."""
        shape = self.index.shape(ranks)
        if shape not in self._subs:
            self._subs[shape] = sub_cluster(self.cluster, ranks, f"{self.cluster.name}/domain")
        return shape, self._subs[shape]

    def hexiseq(self, ranks: Sequence[int], options: TrainOptions) -> DomainEval:
        """The single-sequence planner's layout of the domain (``planner.plan`` on its
        sub-cluster, in the options' memory mode), once per shape and options."""
        shape, sub = self.sub(ranks)
        key = ("hexiseq", shape, options)
        if key not in self._evals:
            self._evals[key] = self._plan(sub, options)
        return self._evals[key]

    def _plan(self, sub: Cluster, options: TrainOptions) -> DomainEval:
        if self.seq_length < sub.world_size:
            return DomainEval(None, math.inf, 0.0, 0.0, "hexiseq", "fewer tokens than GPUs")
        if not may_fit(sub, self.model, self.seq_length, options):
            return DomainEval(None, math.inf, 0.0, 0.0, "hexiseq", "does not fit")
        left = self.deadline.at - time.perf_counter()
        try:
            layout = plan(
                sub,
                self.model,
                self.seq_length,
                options,
                modes=[(options.memory_mode, options.recompute)],
                time_limit_s=max(MIN_PLAN_S, left),
                reproducible=True,
            )
        except HexiSeqError as e:
            return DomainEval(None, math.inf, 0.0, 0.0, "hexiseq", str(e))
        self.plans_run += 1
        winner = layout.planner.get("winner", {})
        try:  # a multiple of t tokens per bundle (t = 1: the layout itself)
            layout = round_segments(layout, self.tp)
        except HexiSeqError as e:
            return DomainEval(None, math.inf, 0.0, 0.0, "hexiseq", str(e))
        small = with_fields(
            layout,
            baselines=(),
            planner={"winner": winner, "status": layout.planner.get("status")},
        )
        return domain_eval(small, sub, self.model, options, str(winner.get("name", "hexiseq")))

    def symmetric(self, ranks: Sequence[int], options: TrainOptions, hp: int) -> DomainEval:
        """A symmetric layout of the domain: groups of ``hp`` consecutive ranks, even tokens
        (zig-zag across groups) and heads (``planner.baselines.symmetric_layout``: ring for
        ``hp = 1``, Ulysses for ``hp`` = the domain, USP between)."""
        shape, sub = self.sub(ranks)
        key = ("symmetric", shape, options, hp)
        if key not in self._evals:
            self._evals[key] = self._symmetric(sub, options, hp)
        return self._evals[key]

    def _symmetric(self, sub: Cluster, options: TrainOptions, hp: int) -> DomainEval:
        W = sub.world_size
        label = _symmetric_label(hp, W)
        if self.seq_length < W or self.model.num_attention_heads % hp or W % hp:
            return DomainEval(None, math.inf, 0.0, 0.0, label, "no such layout")
        if not may_fit(sub, self.model, self.seq_length, options):
            return DomainEval(None, math.inf, 0.0, 0.0, label, "does not fit")
        lay = symmetric_layout(sub, self.model, self.seq_length, hp)
        if any(r.num_tokens % self.tp for r in lay.ranks):
            # Megatron's sequence parallelism splits each bundle's tokens evenly over its t GPUs
            why = f"tokens per bundle not a multiple of {self.tp}"
            return DomainEval(None, math.inf, 0.0, 0.0, label, why)
        ev = domain_eval(lay, sub, self.model, options, label)
        if ev.layout is not None:
            est = costmodel.estimate(lay, sub, self.model, options)
            meta = {"chosen": label, "options": options_record(options, [options])}
            ev = ev._replace(layout=with_fields(lay, predicted=est.to_predicted(), meta=meta))
        return ev

    def layout_of(self, ranks: Sequence[int], ev: DomainEval) -> Layout:
        """``ev``'s layout for the domain ``ranks`` (hosts renamed from its shape's first
        domain); with ``t > 1`` a layout over TP bundles of the real cluster."""
        assert ev.layout is not None
        layout = move_layout(ev.layout, sub_cluster(self.cluster, ranks, "domain"))
        if self.tp == 1:
            return layout
        return replace(
            layout,
            tensor_model_parallel_size=self.tp,
            meta={**layout.meta, "model": self.job_model.name},
        )

    def cluster_ranks(self, ranks: Sequence[int]) -> tuple[int, ...]:
        """A domain's cluster ranks: bundle ``b`` is ranks ``b*t .. b*t+t-1``, bundle by bundle."""
        t = self.tp
        return tuple(b * t + i for b in ranks for i in range(t))

    def ideal_step_s(self, union: Sequence[int], options: TrainOptions) -> float:
        """A lower bound of the step of any job on the ranks ``union`` in ``options``' mode: every
        micro-batch's linear and attention work at the ranks' summed rates (each GPU at the faster
        of its matmul rate and its kernel's best attention rate), no communication, no fixed
        costs. A mode whose bound is no better than a job already found is not tried."""
        key = (tuple(sorted(union)), options.recompute, options.micro_batch_size)
        if key not in self._ideal:
            S, b = self.seq_length, options.micro_batch_size
            flops = b * S * train_flops(linear_flops_per_token(self.model), options)
            pairs = causal_pairs([(0, S)], [(0, S)]) * self.model.num_attention_heads
            flops += b * pairs * train_flops(attention_flops_per_pair_head(self.model), options)
            rate = 0.0
            for r in union:
                d = self.cluster.devices[r]
                att = attention_rate(d.gpu, self.model.kv_channels, options.attention_kernel)
                top = max((f for _, f in att.causal or ()), default=1.0)
                rate += max(d.flops_per_s, att.flops_per_s * max(1.0, top))
            self._ideal[key] = self.micro_batches * flops / rate
        return self._ideal[key]

    def iteration_bound_s(self, ranks: Sequence[int], options: TrainOptions) -> float:
        """A lower bound of one micro-batch of any HexiSeq layout over every GPU of the domain
        ``ranks`` (``planner.tp.iteration_lower_bound`` on its sub-cluster: memory-capped linear
        work, attention at the summed rates, Megatron-FSDP's exposed gathers); infinite when no
        such layout fits. Once per shape and options."""
        shape, sub = self.sub(ranks)
        key = ("bound", shape, options)
        if key not in self._ideal:
            bound = iteration_lower_bound(sub, self.model, self.seq_length, [options])
            self._ideal[key] = math.inf if bound is None else bound
        return self._ideal[key]

    # ---- jobs ----------------------------------------------------------------------------
    def fixed(self, domains: Sequence[Sequence[int]], options: TrainOptions) -> StepFixed:
        """The step's fixed costs of a job of these domains (``costmodel.step.step_fixed``)."""
        key = (tuple(sorted(tuple(d) for d in domains)), options)
        if key not in self._fixed:
            self._fixed[key] = step_fixed(self.cluster, key[0], self.model, options)
        return self._fixed[key]

    def times(
        self,
        domains: Sequence[Sequence[int]],
        options: TrainOptions,
        evals: Sequence[DomainEval],
    ) -> list[DomainTime]:
        """Each domain's micro-batch and its exposed gradient reduction once per step, in a job
        of ``domains``."""
        sync = self.fixed(domains, options).sync
        return [
            DomainTime(
                ev.micro_batch_s, grad_sync_exposed_s(sync, options, ev.forward_s, ev.backward_s)
            )
            for ev in evals
        ]

    def price(
        self,
        options: TrainOptions,
        domains: Sequence[tuple[int, ...]],
        evals: Sequence[DomainEval],
        shares: Sequence[int] | None = None,
    ) -> Priced | None:
        """The job of these domains (every one feasible): min-max shares unless ``shares`` are
        given (stock Megatron's equal ones); under ``fsdp`` equal shares (every rank joins each
        micro-batch's collectives: the job runtime refuses other counts). None if infeasible."""
        if any(not ev.feasible for ev in evals) or len(domains) > self.micro_batches:
            return None
        if shares is None and options.memory_mode == "fsdp":
            shares = equal_shares(len(domains), self.micro_batches)
            if shares is None:
                return None
        fixed = self.fixed(domains, options)
        times = self.times(domains, options, evals)
        got = tuple(shares) if shares is not None else min_max_shares(times, self.micro_batches)
        step = busy_s(times, got) + fixed.once_s
        return Priced(options, tuple(domains), tuple(evals), got, tuple(times), fixed, step)


def _symmetric_label(hp: int, world: int) -> str:
    if hp == 1:
        return "ring"
    return "ulysses" if hp == world else f"usp(hp={hp})"


def price_plan(
    layouts: Sequence[Layout],
    domains: Sequence[Sequence[int]],
    shares: Sequence[int],
    cluster: Cluster,
    model: ModelSpec,
    options: TrainOptions,
) -> Priced:
    """A job as a file records it, priced again: each domain's layout on its sub-cluster under
    the job's options, its recorded micro-batches, the step's fixed costs of its domains
    (``simulate`` and ``validate`` of a job file; a test checks it equals the planner's figure)."""
    evals = [  # estimate prices a layout over TP bundles on its bundle problem itself
        domain_eval(lay, sub_cluster(cluster, ranks, f"{cluster.name}/domain"), model, options, "")
        for lay, ranks in zip(layouts, domains)
    ]
    fixed = step_fixed(*bundle_problem_of_job(cluster, domains, model, options))
    times = [
        DomainTime(
            e.micro_batch_s, grad_sync_exposed_s(fixed.sync, options, e.forward_s, e.backward_s)
        )
        for e in evals
    ]
    step = busy_s(times, shares) + fixed.once_s if all(e.feasible for e in evals) else math.inf
    return Priced(
        options,
        tuple(tuple(d) for d in domains),
        tuple(evals),
        tuple(shares),
        tuple(times),
        fixed,
        step,
    )


def bundle_problem_of_job(
    cluster: Cluster,
    domains: Sequence[Sequence[int]],
    model: ModelSpec,
    options: TrainOptions,
) -> tuple[Cluster, list[tuple[int, ...]], ModelSpec, TrainOptions]:
    """``(cluster, domains, model, options)`` of the job's step as the bundle problem prices it:
    with ``t = options.tensor_model_parallel_size > 1`` one device per TP bundle of the job's GPUs
    (``costmodel.tp.bundle_setting`` on the GPUs the job uses, bundles by their lowest cluster
    rank as ``JobPlan.run_ranks`` orders them), each domain its bundles' devices, one TP rank's
    model; ``t = 1``: the arguments themselves."""
    t = options.tensor_model_parallel_size
    if t == 1:
        return cluster, [tuple(d) for d in domains], model, options
    bundles = [tuple(d[j : j + t]) for d in domains for j in range(0, len(d), t)]
    order = sorted(bundles, key=min)
    used = sub_cluster(cluster, [r for b in order for r in b], f"{cluster.name}/job")
    b_cluster, b_model, b_options = bundle_setting(used, model, options, t)
    index = {b: i for i, b in enumerate(order)}
    b_domains = [tuple(index[tuple(d[j : j + t])] for j in range(0, len(d), t)) for d in domains]
    return b_cluster, b_domains, b_model, b_options


def price_job(job: JobPlan) -> Priced:
    """:func:`price_plan` of a ``JobPlan`` (its cluster, model and options as recorded)."""
    return price_plan(
        [d.layout for d in job.domains],
        [d.ranks for d in job.domains],
        [d.micro_batches for d in job.domains],
        job.cluster_spec,
        job.model_spec,
        job.train_options,
    )


def simulate_job(job: JobPlan) -> list[dict[str, Any]]:
    """The job and each feasible alternative priced again from the file (``simulate`` of a job
    file): name, step, tokens/s, whether every domain fits, the step the file records."""
    rows = []
    tokens = job.global_batch * job.seq_length
    named = [("job", job)] + [
        (n, job.alternative(n)) for n in job.alternative_names() if _runs(job, n)
    ]
    for name, j in named:
        p = price_job(j)
        feasible = all(e.feasible for e in p.evals)
        recorded = (j.predicted or {}).get("step_time_s")
        rows.append(
            {
                "name": name,
                "step_time_s": p.step_s if feasible else None,
                "tokens_per_s": tokens / p.step_s if feasible else 0.0,
                "feasible": feasible,
                "recorded_step_time_s": recorded,
                "domains": len(j.domains),
                "memory_problems": [
                    f"domain {d}: {e.reason}" for d, e in enumerate(p.evals) if not e.feasible
                ],
            }
        )
    return rows


def _runs(job: JobPlan, name: str) -> bool:
    alt = next(a for a in job.alternatives if a["name"] == name)
    return bool(alt.get("feasible")) and bool(alt.get("domains"))
