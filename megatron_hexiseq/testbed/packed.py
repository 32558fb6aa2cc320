"""Packed documents on the CPU testbed: per-micro-batch layouts vs the THD-style even split vs the
fixed HexiSeq layout, trained on the same packed micro-batches.

Three schemes, each a real training run of the CPU driver (``testbed/train.py``, the Megatron
boundary's slicer reading the documents from EOD tokens, ``--reset-attention-mask``):

- ``thd-even``: what Megatron's THD path does with CP: one rank per group holding every head (a
  ring structure), every document cut into ``2 x W`` near-equal chunks, rank i holding chunks i and
  ``2W - 1 - i`` (``varlen.schemes.zigzag_docs``), a new layout every micro-batch. It runs on this
  project's runtime, so its exchange is pruned to what the documents need (Transformer Engine's
  ring sends every block: the baseline here is stronger than THD + CP itself).
- ``hexiseq-fixed``: ``plan``'s layout (for one long sequence) for every micro-batch, document-masked.
- ``hexiseq-batch``: ``varlen.batch.BatchPlanner`` on the structure ``plan --doc-lengths`` chooses
  (``varlen.structure.choose_structure``), called by every rank for every micro-batch in the data
  path (``TrainConfig.batch_layouts``; its CPU time is reported), on groups built once.

Every scheme is priced per micro-batch by ``costmodel.documents.estimate_documents`` (the pruned
exchange the runtime runs) with the profiled cluster; measured throughput = tokens of the measured
steps / their summed wall time (the slowest rank's step), prediction error = summed predicted /
summed measured - 1 (``prediction_error_flat``: the same with the profile's call-size curves
dropped, every call at the long-block rate). Attention is exact, so the three runs' losses must agree (relative 1e-4).

Document lengths: the testbed's micro-batches are short (2K tokens), so the list's lengths are
scaled by ``doc_scale`` (default 1/16: a 2K micro-batch holds the documents of a 32K one) before
packing (``varlen.packing.pack_batches``: shuffled with the seed, the last document cut and carried).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import numpy as np

from megatron_hexiseq.cluster import Cluster, cluster_from_dict, cluster_to_dict
from megatron_hexiseq.costmodel.documents import estimate_documents
from megatron_hexiseq.costmodel.pieces import cu_from_lengths
from megatron_hexiseq.errors import HexiSeqError
from megatron_hexiseq.layout import Layout
from megatron_hexiseq.megatron.runtime import check_run
from megatron_hexiseq.model import ModelSpec
from megatron_hexiseq.run_config import TrainOptions
from megatron_hexiseq.testbed.pinning import TestbedShape, cpu_sets
from megatron_hexiseq.testbed.spawn import run_ranks
from megatron_hexiseq.testbed.train import TrainConfig, run_shape, train_rank
from megatron_hexiseq.varlen.assignment import fill_empty
from megatron_hexiseq.varlen.batch import BatchPlanner
from megatron_hexiseq.varlen.packing import pack_batches
from megatron_hexiseq.varlen.schemes import ring_layout, zigzag_docs
from megatron_hexiseq.varlen.structure import choose_structure

SCHEMES = ("thd-even", "hexiseq-fixed", "hexiseq-batch")
LOSS_RTOL = 1e-4
DOC_SCALE = 1 / 16


class PlannedLayouts:
    """``TrainConfig.batch_layouts`` from a ``BatchPlanner``: document lengths -> its layout."""

    def __init__(self, planner: BatchPlanner) -> None:
        self.planner = planner

    def __call__(self, lengths: tuple[int, ...]) -> Layout:
        return self.planner.plan(lengths).layout


class EvenSplitLayouts:
    """``TrainConfig.batch_layouts`` of the THD-style even split on a ring ``structure``."""

    def __init__(self, structure: Layout) -> None:
        self.structure = structure

    def __call__(self, lengths: tuple[int, ...]) -> Layout:
        return even_split(self.structure, lengths)


def ring_structure(cluster: Cluster, model: ModelSpec, seq_length: int) -> Layout:
    """One rank per group, every head on every rank (Megatron's CP), the sequence zig-zagged."""
    W = cluster.world_size
    return ring_layout(
        cluster, model, seq_length, zigzag_docs(np.array([0, seq_length]), list(range(W)), W)
    )


def even_split(structure: Layout, lengths: Sequence[int]) -> Layout:
    """Every document in ``2 x W`` chunks, zig-zag over the ranks (a rank without a token takes
    one from the fullest: Megatron's attention layer needs one)."""
    W = structure.world_size
    segments = zigzag_docs(np.asarray(cu_from_lengths(lengths)), list(range(W)), W)
    fill_empty(segments)
    return replace(
        structure,
        ranks=tuple(replace(r, segments=tuple(s)) for r, s in zip(structure.ranks, segments)),
    )


def packed_batches(
    doc_lengths: Sequence[int], seq_length: int, count: int, seed: int, doc_scale: float
) -> tuple[tuple[int, ...], ...]:
    """``count`` micro-batches of ``seq_length`` tokens packed from the scaled lengths."""
    if not 0 < doc_scale <= 1:
        raise HexiSeqError(f"--doc-scale must be in (0, 1], got {doc_scale}")
    scaled = [max(1, round(x * doc_scale)) for x in doc_lengths]
    return tuple(tuple(b) for b in pack_batches(scaled, seq_length, count, seed))


def _run(
    name: str,
    cfg: TrainConfig,
    shape: str,
    layouts: list[Layout],
    cluster: Cluster,
    model: ModelSpec,
    options: TrainOptions,
    warmup: int,
) -> dict[str, Any]:
    """Train ``cfg`` on the pinned testbed; price every step's layout; the run's record."""
    tb = TestbedShape.parse(shape)
    results = run_ranks(train_rank, tb.world_size, cfg, cpu_sets=cpu_sets(tb))
    S = cfg.layout.seq_length
    m = replace(model, seq_length=S)
    measured = [max(r.step_times_s[s] for r in results) for s in range(cfg.steps)]
    predicted, per_rank, flat = [], [], []
    spec = cluster_to_dict(cluster)
    for gpu in spec["gpus"].values():
        gpu.pop("attention_curves", None)
    flat_cluster = cluster_from_dict(spec)  # the long-block rate for every call: no call costs
    for step, lay in enumerate(layouts):
        cu = cu_from_lengths(cfg.doc_lengths(step) or (S,))
        est = estimate_documents(lay, cluster, m, options, cu)
        predicted.append(est.iteration_time_s)
        flat.append(estimate_documents(lay, flat_cluster, m, options, cu).iteration_time_s)
        per_rank.append(
            {"linear_s": est.linear_s.tolist(), "attention_s": (est.time_s - est.linear_s).tolist()}
        )
    keep = range(warmup, cfg.steps)
    meas_s = sum(measured[s] for s in keep)
    pred_s = sum(predicted[s] for s in keep)
    plan_ms = [1e3 * t for t in results[0].plan_times_s or []]
    return {
        "name": name,
        "losses": results[0].losses,
        "step_times_s": [r.step_times_s for r in results],
        "measured_step_s": measured,
        "predicted_step_s": predicted,
        "predicted_per_rank": per_rank,
        "tokens_per_s": S * len(keep) / meas_s,
        "predicted_tokens_per_s": S * len(keep) / pred_s,
        "prediction_error": pred_s / meas_s - 1.0,
        "prediction_error_flat": sum(flat[s] for s in keep) / meas_s - 1.0,
        "step_errors": [predicted[s] / measured[s] - 1.0 for s in keep],
        "per_rank_tokens": [[r.num_tokens for r in lay.ranks] for lay in layouts],
        "heads": [len(r.heads) for r in layouts[0].ranks],
        "groups": [list(g.ranks) for g in layouts[0].groups],
        "plan_ms_p50": float(np.median(plan_ms)) if plan_ms else None,
        "plan_ms_max": max(plan_ms) if plan_ms else None,
    }


def compare_packed(
    cluster: Cluster,
    model: ModelSpec,
    options: TrainOptions,
    layout: Layout,
    shape: str,
    doc_lengths: Sequence[int],
    *,
    steps: int,
    warmup: int,
    seed: int = 0,
    doc_scale: float = DOC_SCALE,
    kernel: str = "auto",
    schemes: Sequence[str] = SCHEMES,
) -> dict[str, Any]:
    """Train every scheme on the same packed micro-batches; the comparison record (module
    docstring). ``layout``: ``plan``'s layout of ``cluster`` for the micro-batch length."""
    S = layout.seq_length
    m = replace(model, seq_length=S)
    batches = packed_batches(doc_lengths, S, steps, seed, doc_scale)
    scaled = [max(1, round(x * doc_scale)) for x in doc_lengths]
    structure, record = choose_structure(layout, cluster, m, options, scaled)
    planner = BatchPlanner(structure, cluster, m, options)
    ring = ring_structure(cluster, m, S)
    base = TrainConfig(
        model=m, layout=layout, steps=steps, kernel=kernel, bucket_size=None, documents=batches
    )
    runs: dict[str, tuple[TrainConfig, list[Layout]]] = {
        "thd-even": (
            replace(base, layout=ring, batch_layouts=EvenSplitLayouts(ring)),
            [even_split(ring, b) for b in batches],
        ),
        "hexiseq-fixed": (base, [layout] * steps),
        "hexiseq-batch": (
            replace(base, layout=structure, batch_layouts=PlannedLayouts(planner)),
            [planner.plan(b).layout for b in batches],
        ),
    }
    for name in schemes:  # Megatron's start-up checks on every layout, before any process starts
        cfg, layouts = runs[name]
        for lay in {id(x): x for x in [cfg.layout, *layouts]}.values():
            check_run(lay, run_shape(cfg))
    out = {
        name: _run(name, runs[name][0], shape, runs[name][1], cluster, m, options, warmup)
        for name in schemes  # the order given
    }
    ref = out[schemes[0]]["losses"]
    worst = max(
        abs(a - b) / max(abs(a), 1e-12) for r in out.values() for a, b in zip(ref, r["losses"])
    )
    speedups = {  # the HexiSeq schemes over the baselines, measured
        f"{name}/{base_name}": out[name]["tokens_per_s"] / out[base_name]["tokens_per_s"]
        for name, base_name in (
            ("hexiseq-batch", "thd-even"),
            ("hexiseq-batch", "hexiseq-fixed"),
            ("hexiseq-fixed", "thd-even"),
        )
        if name in out and base_name in out
    }
    return {
        "testbed": shape,
        "cluster": cluster.name,
        "model": model.name,
        "seq_length": S,
        "steps": steps,
        "warmup": warmup,
        "kernel": kernel,
        "seed": seed,
        "doc_scale": doc_scale,
        "documents_per_batch": [len(b) for b in batches],
        "doc_lengths": [list(b) for b in batches],
        "structure": record,
        "schemes": out,
        "speedups": speedups,
        "loss_max_rel_diff": worst,
        "losses_agree": worst <= LOSS_RTOL,
    }


def print_packed_table(rec: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(
        title=f"CPU testbed {rec['testbed']}, packed documents: {rec['model']}, "
        f"{rec['seq_length']} tokens per micro-batch, {rec['steps']} micro-batches "
        f"({rec['warmup']} warm-up), structure {rec['structure']['chosen']}"
    )
    for col in (
        "scheme",
        "heads/rank",
        "measured tok/s",
        "predicted tok/s",
        "pred. error",
        "plan ms p50/max",
        "final loss",
    ):
        t.add_column(col, justify="left" if col == "scheme" else "right")
    for name, r in rec["schemes"].items():
        plan = "" if r["plan_ms_p50"] is None else f"{r['plan_ms_p50']:.2f}/{r['plan_ms_max']:.2f}"
        t.add_row(
            name,
            ",".join(map(str, r["heads"])),
            f"{r['tokens_per_s']:.0f}",
            f"{r['predicted_tokens_per_s']:.0f}",
            f"{100 * r['prediction_error']:+.1f}%",
            plan,
            f"{r['losses'][-1]:.6f}",
        )
    con = Console(width=130)
    con.print(t)
    ups = ", ".join(f"{k} {v:.2f}x" for k, v in rec["speedups"].items())
    con.print(
        f"measured speed-ups: {ups}; losses agree: {rec['losses_agree']} "
        f"(max rel diff {rec['loss_max_rel_diff']:.1e})"
    )


def plot_packed(rec: dict[str, Any], path: str) -> None:
    """Left: measured and predicted seconds per micro-batch for every scheme. Right: the losses."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    for i, (name, r) in enumerate(rec["schemes"].items()):
        steps = range(len(r["measured_step_s"]))
        ax1.plot(steps, r["measured_step_s"], f"C{i}-", label=f"{name} measured")
        ax1.plot(steps, r["predicted_step_s"], f"C{i}:", label=f"{name} predicted")
        ax2.plot(r["losses"], f"C{i}", linestyle=("-", "--", ":")[i % 3], label=name)
    ax1.axvline(rec["warmup"] - 0.5, color="0.7", lw=0.8)
    ax1.set_xlabel("micro-batch (step)")
    ax1.set_ylabel("seconds (slowest rank)")
    ups = "\n".join(f"{k} {v:.2f}x" for k, v in rec["speedups"].items())
    ax1.set_title(f"testbed {rec['testbed']}, measured speed-ups:\n{ups}", fontsize=8)
    ax1.legend(fontsize=7)
    ax2.set_xlabel("step")
    ax2.set_ylabel("per-token loss")
    ax2.set_title("loss curves (must coincide)")
    ax2.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
