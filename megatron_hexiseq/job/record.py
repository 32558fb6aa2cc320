"""A priced job as the job file records it: ``predicted``, ``domains`` and an alternative's entry
(docs/job.md, "The job file")."""

from __future__ import annotations

import math
import statistics
from typing import Any

from megatron_hexiseq.job.evaluate import Evaluator, Priced
from megatron_hexiseq.run_config import mode_label, options_record


def sig(x: float) -> float:
    """9 significant digits (as a layout's ``predicted`` block)."""
    return float(f"{x:.9g}")


def busy(priced: Priced) -> list[float]:
    """Each domain's ``m_d t_d + x_d``: its micro-batches and its exposed gradient reduction."""
    return [m * t.micro_batch_s + t.offset_s for t, m in zip(priced.times, priced.shares)]


def predicted(priced: Priced, seq_length: int, micro_batch_size: int) -> dict[str, Any]:
    """The job file's ``predicted`` block. ``grad_sync_s``: the exposed gradient reduction of the
    domain that sets the step; ``idle_fraction``: the mean over domains of the time a domain waits
    for the busiest one, over the step; ``domains``: each domain's GPUs, micro-batch, share, busy
    time. With TP bundles of ``t > 1`` (``priced`` on the bundle problem: its ranks are bundles)
    ``shard_group.ranks`` counts one TP rank's shard group (the bundles) and
    ``tensor_model_parallel_size`` is recorded."""
    tp = priced.options.tensor_model_parallel_size
    b = busy(priced)
    top = max(b)
    crit = b.index(top)
    step = priced.step_s
    sequences = sum(priced.shares) * micro_batch_size
    fixed = priced.fixed
    return {
        "step_time_s": sig(step),
        "tokens_per_s": sig(sequences * seq_length / step),
        "grad_sync_s": sig(priced.times[crit].offset_s),
        "optimizer_s": sig(fixed.optimizer_s),
        "idle_fraction": round(statistics.fmean((top - x) / step for x in b), 6),
        "overhead_s": sig(fixed.overhead_s),
        # of it, what every micro-batch pays (measured on the CPU testbed; priced in each)
        **(
            {"micro_batch_overhead_s": sig(fixed.micro_batch_overhead_s)}
            if fixed.micro_batch_overhead_s
            else {}
        ),
        "grad_reduce_s": sig(fixed.sync.reduce_scatter_s),
        "param_gather_s": sig(fixed.sync.all_gather_s),
        # one rank has no ring: no bus bandwidth (null; a job file holds finite numbers only)
        "shard_group": {
            "ranks": fixed.ranks,
            "bus_GBps": sig(fixed.bus_GBps) if math.isfinite(fixed.bus_GBps) else None,
        },
        "memory_mode": mode_label(priced.options),
        **({"tensor_model_parallel_size": tp} if tp > 1 else {}),
        "domains": [
            {
                "gpus": len(ranks) * tp,
                "micro_batches": m,
                "micro_batch_s": sig(t.micro_batch_s),
                "grad_sync_s": sig(t.offset_s),
                "busy_s": sig(x),
                "layout": ev.label,
            }
            for ranks, m, t, x, ev in zip(
                priced.domains, priced.shares, priced.times, b, priced.evals
            )
        ],
    }


def domains(ev: Evaluator, priced: Priced) -> list[dict[str, Any]]:
    """The ``domains`` list: cluster ranks (bundle by bundle with TP), micro-batches, each layout
    over its local ranks (bundles)."""
    return [
        {
            "ranks": list(ev.cluster_ranks(ranks)),
            "micro_batches": m,
            "layout": ev.layout_of(ranks, e).to_dict(),
        }
        for ranks, m, e in zip(priced.domains, priced.shares, priced.evals)
    ]


def alternative(
    name: str,
    ev: Evaluator,
    priced: Priced | None,
    config: str,
    reason: str = "",
    *,
    with_domains: bool = True,
    tp: int | None = None,
) -> dict[str, Any]:
    """An ``alternatives`` entry: its step, tokens/s, feasibility, domains and options (the
    alternative's own memory mode and TP size), ``config`` (what was chosen: sizes, layouts),
    ``reason`` when infeasible; ``tp``: its TP size, recorded as ``tensor_model_parallel_size``
    when given (a plan over several sizes)."""
    size = {} if tp is None else {"tensor_model_parallel_size": tp}
    if priced is None:
        return {
            "name": name,
            "step_time_s": None,
            "tokens_per_s": 0.0,
            "feasible": False,
            "domains": [],
            "config": config,
            "reason": reason or "nothing fits",
        }
    pred = predicted(priced, ev.seq_length, ev.base.micro_batch_size)
    return {
        "name": name,
        "step_time_s": pred["step_time_s"],
        "tokens_per_s": pred["tokens_per_s"],
        **size,
        "feasible": True,
        "domains": domains(ev, priced) if with_domains else [],
        "options": options_record(priced.options, [priced.options]),
        "config": config,
        "predicted": {k: v for k, v in pred.items() if k not in ("step_time_s", "tokens_per_s")},
    }
