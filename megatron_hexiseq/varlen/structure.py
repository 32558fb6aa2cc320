"""A process structure (A2A groups and heads) chosen for a document-length distribution.

``plan`` chooses groups and heads for one long sequence. With packed documents what matters is how
well the per-micro-batch planner does on that structure, so ``choose_structure`` scores every
structure ``plan`` itself considers and can rebuild (its own layout, the symmetric baselines, the
heuristics) by the mean document-masked iteration time of ``BatchPlanner``'s assignments over
micro-batches packed from the distribution (``packing.pack_batches``, seed ``STRUCTURE_SEED``
unless given), each priced by ``costmodel.documents.estimate_documents``. The fastest feasible one
wins (ties: the planner's own, then in listed order). A candidate equal to an earlier one (groups,
heads, hosts, GPUs and segments) takes its scores without being planned again. With a ``Deadline``
(``plan --time-limit``) the planner's own layout is always scored and the others only while the
deadline has not passed; the record lists the rest as not scored and says ``time_limit_reached``.
``prepare`` turns each candidate into the layout that would be run (``plan
--tensor-model-parallel-size``: segments rounded to whole TP bundles); a candidate it refuses is
recorded with the reason and not scored, so the chosen structure is always one that can run.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import numpy as np

from megatron_hexiseq.cluster import Cluster
from megatron_hexiseq.costmodel.documents import estimate_documents
from megatron_hexiseq.errors import HexiSeqError
from megatron_hexiseq.layout import Layout
from megatron_hexiseq.model import ModelSpec
from megatron_hexiseq.planner.baselines import baseline_layouts
from megatron_hexiseq.planner.candidate import Deadline
from megatron_hexiseq.planner.heuristics import heuristic_layouts
from megatron_hexiseq.run_config import TrainOptions
from megatron_hexiseq.varlen.batch import BatchPlanner
from megatron_hexiseq.varlen.packing import pack_batches

STRUCTURE_BATCHES = 8  # micro-batches each candidate structure is scored on
STRUCTURE_SEED = (
    1_000_003  # their packing seed (not the benches' seeds: no tuning to those batches)
)


def score_structure(
    structure: Layout,
    cluster: Cluster,
    model: ModelSpec,
    options: TrainOptions,
    batches: Sequence[Sequence[int]],
) -> tuple[float, bool]:
    """(mean iteration seconds, every batch feasible) of ``BatchPlanner`` on ``structure``."""
    planner = BatchPlanner(structure, cluster, model, options)
    times, feasible = [], True
    for docs in batches:
        a = planner.plan(docs)
        m = replace(model, seq_length=a.layout.seq_length)
        est = estimate_documents(a.layout, cluster, m, options, a.cu_seqlens, packed=True)
        times.append(est.iteration_time_s)
        feasible &= est.feasible
    return float(np.mean(times)), feasible


def choose_structure(
    planned: Layout,
    cluster: Cluster,
    model: ModelSpec,
    options: TrainOptions,
    doc_lengths: Sequence[int],
    *,
    batches: int = STRUCTURE_BATCHES,
    seed: int = STRUCTURE_SEED,
    deadline: Deadline | None = None,
    prepare: Callable[[Layout], Layout] | None = None,
) -> tuple[Layout, dict[str, Any]]:
    """The candidate structure with the fastest mean per-batch plan (module docstring), as a layout
    of ``planned.seq_length`` tokens, and the record of the choice (``planner.documents``).
    ``deadline``: candidates after the planner's own are scored only before it passes."""
    N = planned.seq_length
    sample = pack_batches(doc_lengths, N, batches, seed)
    candidates: list[tuple[str, Layout]] = [("hexiseq", planned)]
    for b in baseline_layouts(cluster, model, N) + heuristic_layouts(cluster, model, N):
        if b.layout is not None:
            candidates.append((b.label, b.layout))
    rows: list[dict[str, Any]] = []  # one per candidate, in order
    refused: list[dict[str, Any]] = []  # candidates ``prepare`` refused (listed after the rest)
    scored: dict[tuple, dict[str, Any]] = {}  # a layout's scores, by _same_key
    if prepare is not None:
        ready: list[tuple[str, Layout]] = []
        for name, lay in candidates:
            try:
                ready.append((name, prepare(lay)))
            except HexiSeqError as e:  # e.g. a bundle left without tokens by the rounding
                refused.append({"name": name, "mean_step_s": None, "reason": str(e)})
        candidates = ready
        if not candidates:
            raise HexiSeqError(f"no candidate structure can run: {refused[0]['reason']}")
    for i, (name, lay) in enumerate(candidates):
        key = _same_key(lay)
        if key in scored:
            rows.append({"name": name, **scored[key]})
            continue
        if i and deadline is not None and deadline.passed():
            rows.append({"name": name, "mean_step_s": None, "reason": "not scored: time limit"})
            continue
        try:
            mean_s, feasible = score_structure(lay, cluster, model, options, sample)
            scored[key] = {"mean_step_s": _sig(mean_s), "feasible": feasible}
        except HexiSeqError as e:  # a structure whose groups cannot hold a micro-batch
            scored[key] = {"mean_step_s": None, "reason": str(e)}
        rows.append({"name": name, **scored[key]})
    ok = [(r["mean_step_s"], i) for i, r in enumerate(rows) if r.get("feasible")]
    if not ok:
        raise HexiSeqError(
            "no candidate structure fits the packed micro-batches in memory; use fewer tokens per "
            "batch or a memory mode with less per GPU (--memory-mode fsdp, --recompute)"
        )
    _, best = min(ok)
    name, chosen = candidates[best]
    record = {
        "batches": batches,
        "seed": seed,
        "tokens_per_batch": N,
        "documents": len(doc_lengths),
        "chosen": name,
        "candidates": rows + refused,
        "time_limit_reached": deadline is not None and deadline.reached,
    }
    return chosen, record


def _same_key(layout: Layout) -> tuple:
    """What ``score_structure`` depends on in a layout: its groups, and each rank's group, heads,
    host, GPU and segments (the structure's own layout competes with each plan)."""
    return (
        layout.seq_length,
        tuple(g.ranks for g in layout.groups),
        tuple((r.group, tuple(r.heads), r.host, r.gpu, tuple(r.segments)) for r in layout.ranks),
    )


def _sig(x: float) -> float:
    return float(f"{x:.9g}")
