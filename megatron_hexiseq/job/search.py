"""``plan_job``: the plan of a whole training job: domains of GPUs, each with its own layout and its
own share of the global batch (docs/job.md).

Every alternative of ``candidates.ALTERNATIVES`` and every family of the search is priced in the
job model (``job.evaluate``); the job is the fastest of all of them, alternatives included, so it
is never slower than any alternative in its own model. The alternatives are recorded in the job
file with their domains, as jobs a user can run instead (``JobPlan.alternative``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from megatron_hexiseq.cluster import Cluster, cluster_to_dict
from megatron_hexiseq.errors import HexiSeqError, check_positive_int
from megatron_hexiseq.job import candidates as cand
from megatron_hexiseq.job import record
from megatron_hexiseq.job.evaluate import Evaluator, Priced
from megatron_hexiseq.job.spec import JobPlan, domains_from_list
from megatron_hexiseq.model import ModelSpec
from megatron_hexiseq.planner.candidate import Deadline
from megatron_hexiseq.planner.plan import DEFAULT_TIME_LIMIT_S
from megatron_hexiseq.run_config import TrainOptions, mode_label, options_record

Progress = Callable[[str], None]


def plan_job(
    cluster: Cluster,
    model: ModelSpec,
    seq_length: int,
    global_batch: int,
    options: TrainOptions,
    *,
    modes: Sequence[tuple[str, bool]] | None = None,
    time_limit_s: float = DEFAULT_TIME_LIMIT_S,
    reproducible: bool = False,
    progress: Progress | None = None,
) -> JobPlan:
    """The fastest job for ``global_batch`` sequences of ``seq_length`` tokens per step.

    ``options``: the training options (micro-batch size, kernel, usable memory,
    ``overlap_grad_sync``); ``modes``: (memory_mode, recompute) pairs to try (default: the
    options' own), every candidate keeping its fastest; ``time_limit_s``: wall-clock cap (once
    passed, the families not yet started are skipped: ``planner.time_limit_reached``);
    ``reproducible``: 0 for wall-clock fields."""
    check_positive_int("global_batch", global_batch)
    mbs = options.micro_batch_size
    if global_batch % mbs:
        raise HexiSeqError(
            f"--global-batch {global_batch} is not a multiple of the micro-batch size {mbs}"
        )
    if seq_length < 1:
        raise HexiSeqError(f"seq_length must be positive, got {seq_length}")
    say = progress or (lambda message: None)
    t0, c0 = time.perf_counter(), time.process_time()
    deadline = Deadline(time_limit_s)
    modes = list(modes) if modes else [(options.memory_mode, options.recompute)]
    ev = Evaluator(
        cluster, model, seq_length, global_batch // mbs, options, deadline=deadline, progress=say
    )
    kinds = ev.index.nodes_of
    fastest = [r for r in ev.index.canonical_ranks() if ev.index.kind_of_rank(r) == 0]
    alternatives: dict[str, cand.Found] = {}
    families: dict[str, cand.Found] = {}
    steps: list[tuple[str, dict[str, cand.Found], Callable[[], cand.Found]]] = [
        ("hexiseq-one-domain", alternatives, lambda: cand.hexiseq_one_domain(ev, modes)),
        ("hexiseq-replicas", alternatives, lambda: cand.hexiseq_replicas(ev, modes)),
        (
            "megatron-cp-dp",
            alternatives,
            lambda: cand.symmetric_dp(ev, ev.index.canonical_ranks(), modes),
        ),
        ("fast-only", alternatives, lambda: cand.symmetric_dp(ev, fastest, modes)),
        ("typed-dp", alternatives, lambda: cand.typed_dp(ev, modes)),
        ("typed", families, lambda: cand.typed(ev, modes)),
        ("typed-fast-only", families, lambda: cand.typed(ev, modes, kinds=[0])),
        ("mixed", families, lambda: cand.mixed(ev, modes, _mixed_counts(kinds))),
        ("paired", families, lambda: cand.paired(ev, modes)),
    ]
    skipped = []
    for name, into, run in steps:
        if deadline.passed() and name not in ("hexiseq-one-domain", "megatron-cp-dp"):
            skipped.append(name)
            into[name] = cand.Found(None, "", "not tried: the time limit had passed")
            continue
        say(f"{name}")
        into[name] = run()
    everything = {**alternatives, **families}
    winner = min(
        (n for n in everything if everything[n].priced is not None),
        key=lambda n: (_step(everything[n].priced), n in families),
        default=None,
    )
    if winner is None:
        reasons = "; ".join(f"{n}: {alternatives[n].reason}" for n in cand.ALTERNATIVES)
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
            n, ev, alternatives[n].priced, alternatives[n].config, alternatives[n].reason
        )
        for n in cand.ALTERNATIVES
    )
    planner: dict[str, Any] = {
        "method": "job",
        "winner": {"family": winner, "config": best.config},
        "families": {
            n: {
                "step_time_s": None if f.priced is None else record.sig(f.priced.step_s),
                "config": f.config,
                **({"reason": f.reason} if f.priced is None else {}),
            }
            for n, f in everything.items()
        },
        "domain_plans": ev.plans_run,
        "solve_time_s": 0.0 if reproducible else round(time.perf_counter() - t0, 4),
        "cpu_time_s": 0.0 if reproducible else round(time.process_time() - c0, 4),
        "time_limit_s": time_limit_s,
        "time_limit_reached": deadline.reached,
        "skipped": skipped,
    }
    return build_job(
        ev, best.priced, global_batch, alternatives=alt_records, planner=planner,
        modes=[replace(options, memory_mode=m, recompute=r) for m, r in modes],
    )  # fmt: skip


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
        model=ev.model.to_dict(),
        cluster=cluster_to_dict(ev.cluster),
        options=options_record(priced.options, list(modes)),
        domains=dom,
        predicted=record.predicted(priced, ev.seq_length, ev.base.micro_batch_size),
        alternatives=tuple(alternatives),
        planner=planner,
        meta={"cluster": ev.cluster.name, "model": ev.model.name, "chosen": planner["winner"]["family"],
              "memory_mode": mode_label(priced.options)},
    )  # fmt: skip


def _step(p: Priced | None) -> float:
    assert p is not None
    return p.step_s


def _mixed_counts(nodes_of: Sequence[Sequence[str]]) -> list[int]:
    """The domain counts the ``mixed`` family deals: each kind's node count (every node of that
    kind seeds a domain, the others dealt around it) and 2 (two halves). (Equal replicas are
    ``hexiseq-replicas``; more counts cost a plan of large mixed domains each, and none won on
    the job suite.)"""
    total = sum(len(n) for n in nodes_of)
    return sorted(d for d in {len(n) for n in nodes_of} | {2} if 2 <= d <= total)
