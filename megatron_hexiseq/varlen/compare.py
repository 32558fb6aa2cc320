"""Every packed-document scheme on the same micro-batches: what ``megatron-hexiseq varlen`` reports.

``compare`` plans the job's fixed layout for the micro-batch length (``plan``, memory mode auto),
chooses the structure for the length distribution (``structure.choose_structure``), packs
``batches`` micro-batches with ``seed`` (``packing.pack_batches``) and prices each scheme's
assignment of each micro-batch with ``costmodel.documents.estimate_documents``. Per scheme:
``mean_step_s`` and ``p90_step_s`` over the micro-batches, ``imbalance`` (slowest rank's busy time
over the mean rank's, averaged over micro-batches), ``kv_bytes`` (K/V bytes received per
micro-batch, all ranks, layers and passes, averaged), ``feasible`` (every micro-batch fits in
memory); ``hexiseq-batch`` adds ``plan_ms_p50`` / ``plan_ms_max`` (the planner's CPU time per
micro-batch, one thread: ``time.thread_time``, which a loaded machine does not inflate).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import numpy as np

from megatron_hexiseq.cluster import Cluster
from megatron_hexiseq.errors import HexiSeqError
from megatron_hexiseq.layout import Layout
from megatron_hexiseq.model import ModelSpec
from megatron_hexiseq.run_config import TrainOptions, modes_to_try, options_from_record
from megatron_hexiseq.varlen.packing import pack_batches
from megatron_hexiseq.varlen.schemes import SCHEMES, SchemeRun, Schemes
from megatron_hexiseq.varlen.structure import choose_structure

FORMAT, VERSION = "megatron-hexiseq/varlen", 2


def plan_fixed(
    cluster: Cluster,
    model: ModelSpec,
    tokens: int,
    time_limit_s: float = 120.0,
    options: TrainOptions | None = None,
    recompute: bool = False,
    modes: Sequence[tuple[str, bool]] | None = None,
) -> tuple[Layout, TrainOptions]:
    """``plan``'s layout for one sequence of ``tokens`` (memory mode auto) and its options.
    ``options``: the base options (default: the model's); a domain of a larger run passes its
    run-wide sharding (``varlen.domains.domain_options``). ``recompute``: only the modes with full
    recompute (more tokens per micro-batch fit). ``modes``: the (memory mode, recompute) pairs to
    try instead, in order."""
    from megatron_hexiseq.planner.plan import plan

    if tokens < cluster.world_size:
        raise HexiSeqError(
            f"--tokens-per-batch {tokens} is below the {cluster.world_size} GPUs; every GPU needs "
            "at least one token"
        )
    m = replace(model, seq_length=tokens)
    options = options or TrainOptions.for_model(m)
    layout = plan(
        cluster,
        m,
        tokens,
        options,
        modes=modes_to_try("auto", recompute) if modes is None else modes,
        time_limit_s=time_limit_s,
        reproducible=True,
    )
    return layout, options_from_record(layout.meta["options"], options)


def compare(
    cluster: Cluster,
    model: ModelSpec,
    doc_lengths: Sequence[int],
    tokens_per_batch: int,
    batches: int,
    seed: int,
    *,
    keep_assignments: bool = True,
    progress: Callable[[str], None] | None = None,
    time_limit_s: float = 120.0,
) -> dict[str, Any]:
    """The ``out.json`` document of ``varlen`` (module docstring)."""
    say = progress or (lambda message: None)
    say("planning the fixed layout")
    fixed, options = plan_fixed(cluster, model, tokens_per_batch, time_limit_s)
    m = replace(model, seq_length=tokens_per_batch)
    say("choosing the structure for the document lengths")
    structure, record = choose_structure(fixed, cluster, m, options, doc_lengths)
    modes = [
        replace(options, memory_mode=mode, recompute=rc) for mode, rc in modes_to_try("auto", False)
    ]
    schemes = Schemes(cluster, m, options, fixed, structure, modes)
    runs: dict[str, list[SchemeRun]] = {s: [] for s in SCHEMES}
    out_batches = []
    for i, docs in enumerate(pack_batches(doc_lengths, tokens_per_batch, batches, seed)):
        say(f"micro-batch {i + 1} of {batches}")
        entry: dict[str, Any] = {"doc_lengths": list(docs), "schemes": {}}
        for s in SCHEMES:
            run = schemes.run(s, docs)
            runs[s].append(run)
            if keep_assignments:
                entry["schemes"][s] = {
                    "step_s": _sig(run.estimate.iteration_time_s),
                    "config": run.config,
                    "exchange_model": run.estimate.exchange_model,
                    "ranks": rank_records(run.layout),
                }
        out_batches.append(entry)
    return {
        "format": FORMAT,
        "version": VERSION,
        "cluster": cluster.name,
        "world_size": cluster.world_size,
        "model": model.name,
        "tokens_per_batch": tokens_per_batch,
        "batches_count": batches,
        "seed": seed,
        "options": {
            "memory_mode": options.memory_mode,
            "recompute": options.recompute,
            "micro_batch_size": options.micro_batch_size,
        },
        "structure": {
            "chosen": record["chosen"],
            "groups": [list(g.ranks) for g in structure.groups],
            "candidates": record["candidates"],
            "fixed_groups": [list(g.ranks) for g in fixed.groups],
        },
        "schemes": {s: summarize(s, runs[s]) for s in SCHEMES},
        "rank_time_s": {s: _mean_rank_times(runs[s]) for s in SCHEMES},
        "batches": out_batches if keep_assignments else [],
    }


def rank_records(layout: Layout, ranks: Sequence[int] | None = None, domain: int = 0) -> list[dict]:
    """Per rank of ``layout``: its cluster rank (``ranks[r]``, default ``r``), domain, group (named
    by its first member's cluster rank, unique in the cluster), segments and heads: enough to
    price the assignment again without knowing the structure."""
    ranks = list(range(layout.world_size)) if ranks is None else list(ranks)
    lead = {g.id: ranks[min(g.ranks)] for g in layout.groups}
    return [
        {
            "rank": ranks[p.rank],
            "domain": domain,
            "group": lead[p.group],
            "segments": [list(x) for x in p.segments],
            "heads": list(p.heads),
        }
        for p in layout.ranks
    ]


def summarize(scheme: str, runs: Sequence[SchemeRun]) -> dict[str, Any]:
    """The per-scheme fields of ``out.json``."""
    steps = np.array([r.estimate.iteration_time_s for r in runs])
    rec: dict[str, Any] = {
        "mean_step_s": _sig(float(steps.mean())),
        "p90_step_s": _sig(float(np.percentile(steps, 90))),
        "imbalance": _sig(float(np.mean([r.estimate.imbalance for r in runs]))),
        "kv_bytes": int(np.mean([r.estimate.kv_bytes for r in runs])),
        "feasible": all(r.estimate.feasible for r in runs),
    }
    if scheme == "hexiseq-batch":
        ms = np.array([r.plan_s for r in runs]) * 1e3
        rec["plan_ms_p50"] = _sig(float(np.median(ms)))
        rec["plan_ms_max"] = _sig(float(ms.max()))
    if scheme == "dynamic-cp":
        rec["cp_sizes"] = [r.config["cp"] for r in runs]
    return rec


def _mean_rank_times(runs: Sequence[SchemeRun]) -> dict[str, list[float]]:
    """Per rank, mean over the micro-batches: linear, attention, all-to-all, exposed K/V seconds."""

    def mean(name: str) -> list[float]:
        return [_sig(float(x)) for x in np.mean([getattr(r.estimate, name) for r in runs], axis=0)]

    return {k: mean(k) for k in ("linear_s", "attention_s", "a2a_s", "kv_exposed_s")}


def plot_rank_times(path: str, result: dict[str, Any]) -> None:
    """One panel per scheme: each rank's mean busy time, stacked by phase, with the mean step."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(result["schemes"])
    fig, axes = plt.subplots(len(names), 1, figsize=(10, 2.0 * len(names)), sharex=True)
    for ax, name in zip(np.atleast_1d(axes), names):
        t = result["rank_time_s"][name]
        x = np.arange(len(t["linear_s"]))
        bottom = np.zeros(x.size)
        for key, color in (
            ("linear_s", "#4c72b0"),
            ("attention_s", "#dd8452"),
            ("a2a_s", "#55a868"),
            ("kv_exposed_s", "#c44e52"),
        ):
            v = np.array(t[key])
            ax.bar(x, v, bottom=bottom, width=1.0, color=color, label=key[:-2])
            bottom += v
        step = result["schemes"][name]["mean_step_s"]
        ax.axhline(step, color="k", lw=0.8, ls="--")
        ax.set_ylabel("s")
        ax.set_title(f"{name}: mean step {step:.3g} s", fontsize=9)
    np.atleast_1d(axes)[0].legend(fontsize=7, ncol=4, loc="upper right")
    np.atleast_1d(axes)[-1].set_xlabel("rank")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _sig(x: float) -> float:
    return float(f"{x:.6g}")
