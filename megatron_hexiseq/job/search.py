"""``plan_job``: the plan of a whole training job: domains of GPUs, each with its own layout and its
own share of the global batch (docs/job.md).

Every alternative of ``candidates.ALTERNATIVES`` and every family of the search is priced in the
job model (``job.evaluate``); the job is the fastest of all of them, alternatives included, so it
is never slower than any alternative in its own model. The alternatives are recorded in the job
file with their domains, as jobs a user can run instead (``JobPlan.alternative``).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any, NamedTuple

from megatron_hexiseq.cluster import Cluster, cluster_to_dict
from megatron_hexiseq.errors import HexiSeqError, check_positive_int
from megatron_hexiseq.job import candidates as cand
from megatron_hexiseq.job import record
from megatron_hexiseq.job.evaluate import Evaluator, Priced
from megatron_hexiseq.job.spec import JobPlan, domains_from_list
from megatron_hexiseq.model import ModelSpec
from megatron_hexiseq.planner.candidate import Deadline
from megatron_hexiseq.planner.plan import DEFAULT_TIME_LIMIT_S
from megatron_hexiseq.planner.tp import check_tp, tp_sizes
from megatron_hexiseq.run_config import TrainOptions, mode_label, options_record

Progress = Callable[[str], None]
AUTO = "auto"
JOB_TP_SIZES = (1, 2, 4, 8)  # the TP sizes auto considers: 1 to one 8-GPU node
ALWAYS = ("hexiseq-one-domain", "megatron-cp-dp")  # run at the first size whatever the time limit


def plan_job(
    cluster: Cluster,
    model: ModelSpec,
    seq_length: int,
    global_batch: int,
    options: TrainOptions,
    *,
    tensor_model_parallel_size: int | str = 1,
    modes: Sequence[tuple[str, bool]] | None = None,
    time_limit_s: float = DEFAULT_TIME_LIMIT_S,
    reproducible: bool = False,
    progress: Progress | None = None,
    exhaustive: bool = False,
) -> JobPlan:
    """The fastest job for ``global_batch`` sequences of ``seq_length`` tokens per step.

    ``options``: the training options (micro-batch size, kernel, usable memory,
    ``overlap_grad_sync``); ``tensor_model_parallel_size``: GPUs per TP bundle, or ``"auto"``:
    every size of :func:`job_tp_sizes` (module docstring); ``modes``: (memory_mode, recompute)
    pairs to try (default: the options' own), every candidate keeping its fastest;
    ``time_limit_s``: wall-clock cap (once passed, the families not yet started are skipped:
    ``planner.time_limit_reached``); ``reproducible``: 0 for wall-clock fields; ``exhaustive``:
    with ``"auto"``, the search's families at every TP size, not only at the one whose
    alternatives were fastest."""
    check_positive_int("global_batch", global_batch)
    mbs = options.micro_batch_size
    if global_batch % mbs:
        raise HexiSeqError(
            f"--global-batch {global_batch} is not a multiple of the micro-batch size {mbs}"
        )
    if seq_length < 1:
        raise HexiSeqError(f"seq_length must be positive, got {seq_length}")
    sizes = _sizes(cluster, model, seq_length, tensor_model_parallel_size)
    say = progress or (lambda message: None)
    t0, c0 = time.perf_counter(), time.process_time()
    deadline = Deadline(time_limit_s)
    modes = list(modes) if modes else [(options.memory_mode, options.recompute)]
    evaluators = {
        t: Evaluator(
            cluster,
            model,
            seq_length,
            global_batch // mbs,
            replace(options, tensor_model_parallel_size=t),
            deadline=deadline,
            progress=say,
        )
        for t in sizes
    }
    bounds = {t: lower_bound_s(ev, modes) for t, ev in evaluators.items()}
    order = sorted(sizes, key=lambda t: (bounds[t], t))
    if 1 in order[1:]:  # as plan's auto: t = 1 second unless its bound rules it out
        order.remove(1)
        order.insert(1, 1)
    search = _Search(sizes, bounds, deadline, say)
    # the alternatives at every size (each alternative its best over the sizes), smallest bound
    # first; a size whose bound no alternative could beat is skipped
    for i, t in enumerate(order):
        ev = evaluators[t]
        if i > 0 and bounds[t] >= max(k.step_s for k in search.alternatives.values()):
            search.tp_records[t]["skipped"] = "its lower bound is not below any alternative"
            continue
        if len(sizes) > 1:
            say(f"tensor-parallel size {t}")
        for name, run in _steps(ev, modes)[: len(cand.ALTERNATIVES)]:
            search.run(name, run, ev, search.alternatives, first=i == 0)
    # the families at the size whose alternatives found the fastest job (exhaustive: at every
    # size whose bound is below the fastest job found)
    ranked = sorted(order, key=lambda t: (search.best_at[t], t))
    for t in ranked if exhaustive else ranked[:1]:
        if t != ranked[0] and bounds[t] >= search.best():
            continue
        for name, run in _steps(evaluators[t], modes)[len(cand.ALTERNATIVES) :]:
            search.run(name, run, evaluators[t], search.families, first=t == ranked[0])
    alternatives, families, skipped = search.alternatives, search.families, search.skipped
    tp_records = search.tp_records
    everything = {**alternatives, **families}
    winner = min(
        (n for n in everything if everything[n].priced is not None),
        key=lambda n: (everything[n].step_s, n in families),
        default=None,
    )
    if winner is None:
        reasons = "; ".join(f"{n}: {alternatives[n].found.reason}" for n in cand.ALTERNATIVES)
        raise HexiSeqError(
            f"no job fits {global_batch} sequences of {seq_length} tokens on cluster "
            f"{cluster.name!r} ({reasons}); try --recompute, --memory-mode auto or a shorter "
            "--seq-length"
        )
    best = everything[winner]
    assert best.priced is not None
    say(f"chosen: {winner}")
    alt_records = tuple(
        record.alternative(
            n,
            alternatives[n].ev,
            alternatives[n].priced,
            alternatives[n].found.config,
            alternatives[n].found.reason,
            tp=None if sizes == [1] else alternatives[n].ev.tp,
        )
        for n in cand.ALTERNATIVES
    )
    planner: dict[str, Any] = {
        "method": "job",
        "winner": {"family": winner, "config": best.found.config},
        "families": {
            n: {
                "step_time_s": None if f.priced is None else record.sig(f.step_s),
                "config": f.found.config,
                **({"reason": f.found.reason} if f.priced is None else {}),
            }
            for n, f in everything.items()
        },
        "domain_plans": sum(ev.plans_run for ev in evaluators.values()),
        "solve_time_s": 0.0 if reproducible else round(time.perf_counter() - t0, 4),
        "cpu_time_s": 0.0 if reproducible else round(time.process_time() - c0, 4),
        "time_limit_s": time_limit_s,
        "time_limit_reached": deadline.reached,
        "skipped": skipped,
    }
    if sizes != [1]:
        chosen = best.ev.tp
        tp_records[chosen]["chosen"] = True
        planner["tensor_parallel"] = {"sizes": [tp_records[t] for t in sizes]}
    return build_job(
        best.ev, best.priced, global_batch, alternatives=alt_records, planner=planner,
        modes=[replace(options, memory_mode=m, recompute=r) for m, r in modes],
    )  # fmt: skip


class Kept(NamedTuple):
    """The best job of a family or alternative so far and the evaluator (TP size) it is on."""

    found: cand.Found
    ev: Evaluator

    @property
    def priced(self) -> Priced | None:
        return self.found.priced

    @property
    def step_s(self) -> float:
        return math.inf if self.found.priced is None else self.found.priced.step_s


class _Search:
    """Each alternative's and family's best job over the TP sizes searched, and each size's record."""

    def __init__(
        self, sizes: list[int], bounds: dict[int, float], deadline: Deadline, say: Progress
    ) -> None:
        self.sizes = sizes
        self.deadline = deadline
        self.say = say
        self.alternatives: dict[str, Kept] = {}
        self.families: dict[str, Kept] = {}
        self.skipped: list[str] = []
        self.best_at = {t: math.inf for t in sizes}  # the fastest job found at each size
        self.tp_records: dict[int, dict[str, Any]] = {
            t: {"tensor_model_parallel_size": t, "lower_bound_s": record.sig(bounds[t])}
            for t in sizes
        }

    def best(self) -> float:
        return min(self.best_at.values())

    def run(
        self,
        name: str,
        run: Callable[[float], cand.Found],
        ev: Evaluator,
        into: dict[str, Kept],
        *,
        first: bool,
    ) -> None:
        """Run one search on ``ev``'s size and keep it if it is the fastest of its name. The
        first size's searches run as a single size's would (no ``beat``; ``ALWAYS`` whatever
        the time limit); later ones need not find what cannot beat the best so far: their own
        for an alternative, the fastest job for a family."""
        kept = into.get(name)
        beat = math.inf
        if not first:
            beat = kept.step_s if into is self.alternatives and kept else self.best()
        if self.deadline.passed() and not (first and name in ALWAYS):
            if kept is None:
                into[name] = Kept(cand.Found(None, "", "not tried: the time limit had passed"), ev)
                self.skipped.append(name)
            return
        self.say(name)
        found = run(beat)
        if self.sizes != [1]:  # what each search chose, its TP size first
            found = found._replace(config=f"TP={ev.tp}, {found.config}")
        got = Kept(found, ev)
        self.best_at[ev.tp] = min(self.best_at[ev.tp], got.step_s)
        rec = self.tp_records[ev.tp]
        rec["step_time_s"] = (
            None if math.isinf(self.best_at[ev.tp]) else record.sig(self.best_at[ev.tp])
        )
        if kept is None or got.step_s < kept.step_s:
            into[name] = got


def _steps(
    ev: Evaluator, modes: Sequence[cand.Mode]
) -> list[tuple[str, Callable[[float], cand.Found]]]:
    """The alternatives and the search's families on one evaluator (one TP size), in the order
    they run; each takes ``beat``: modes whose ideal step is no better are skipped."""
    every = ev.index.canonical_ranks()
    fastest = [r for r in every if ev.index.kind_of_rank(r) == 0]
    counts = _mixed_counts(ev.index.nodes_of)
    return [
        ("hexiseq-one-domain", lambda beat: cand.hexiseq_one_domain(ev, modes, beat)),
        ("hexiseq-replicas", lambda beat: cand.hexiseq_replicas(ev, modes, beat)),
        ("megatron-cp-dp", lambda beat: cand.symmetric_dp(ev, every, modes, beat)),
        ("fast-only", lambda beat: cand.symmetric_dp(ev, fastest, modes, beat)),
        ("typed-dp", lambda beat: cand.typed_dp(ev, modes, beat)),
        ("typed", lambda beat: cand.typed(ev, modes, beat)),
        ("typed-fast-only", lambda beat: cand.typed(ev, modes, beat, kinds=[0])),
        ("mixed", lambda beat: cand.mixed(ev, modes, counts, beat)),
        ("paired", lambda beat: cand.paired(ev, modes, beat)),
    ]


def _best_step(*kept: dict[str, Kept]) -> float:
    return min((k.step_s for d in kept for k in d.values()), default=math.inf)


def job_tp_sizes(cluster: Cluster, model: ModelSpec, seq_length: int) -> list[int]:
    """The TP sizes a job considers with ``auto``: those of ``JOB_TP_SIZES`` that split the heads
    (or replicate the K/V heads as Megatron does), the FFN and the sequence and divide every
    node's GPU count (``planner.tp.tp_sizes``)."""
    return [t for t in tp_sizes(cluster, model, seq_length) if t in JOB_TP_SIZES]


def _sizes(cluster: Cluster, model: ModelSpec, seq_length: int, tp: int | str) -> list[int]:
    """The TP sizes to plan: ``[tp]`` (checked) or every size of :func:`job_tp_sizes`."""
    if tp == AUTO:
        sizes = job_tp_sizes(cluster, model, seq_length)
        if not sizes:
            raise HexiSeqError(
                f"no tensor-parallel size fits {model.name} on cluster {cluster.name!r} for "
                f"{seq_length} tokens (not even 1: every GPU needs a token)"
            )
        return sizes
    if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
        raise HexiSeqError(
            f"--tensor-model-parallel-size must be a positive integer or 'auto', got {tp!r}"
        )
    if tp > 1:
        check_tp(cluster, model, seq_length, tp)
    return [tp]


def lower_bound_s(ev: Evaluator, modes: Sequence[cand.Mode]) -> float:
    """A lower bound of the step of every job on ``ev``'s TP size: the ideal step of all its
    GPUs (``Evaluator.ideal_step_s``) in the cheapest mode."""
    every = ev.index.canonical_ranks()
    return min(ev.ideal_step_s(every, ev.options(every, *mode)) for mode in modes)


def build_job(
    ev: Evaluator,
    priced: Priced,
    global_batch: int,
    *,
    alternatives: Sequence[dict[str, Any]],
    planner: dict[str, Any],
    modes: Sequence[TrainOptions],
) -> JobPlan:
    """The ``JobPlan`` of a priced job."""
    dom = domains_from_list(record.domains(ev, priced), where="domains")
    return JobPlan(
        global_batch=global_batch,
        seq_length=ev.seq_length,
        model=ev.job_model.to_dict(),
        cluster=cluster_to_dict(ev.job_cluster),
        options=options_record(priced.options, list(modes)),
        domains=dom,
        predicted=record.predicted(priced, ev.seq_length, ev.base.micro_batch_size),
        alternatives=tuple(alternatives),
        planner=planner,
        meta={"cluster": ev.job_cluster.name, "model": ev.job_model.name, "chosen": planner["winner"]["family"],
              "memory_mode": mode_label(priced.options)},
    )  # fmt: skip


def _mixed_counts(nodes_of: Sequence[Sequence[str]]) -> list[int]:
    """The domain counts the ``mixed`` family deals: each kind's node count (every node of that
    kind seeds a domain, the others dealt around it) and 2 (two halves). (Equal replicas are
    ``hexiseq-replicas``; more counts cost a plan of large mixed domains each, and none won on
    the job suite.)"""
    total = sum(len(n) for n in nodes_of)
    return sorted(d for d in {len(n) for n in nodes_of} | {2} if 2 <= d <= total)
