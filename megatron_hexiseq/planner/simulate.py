"""Evaluate layouts and baselines with the cost model (the ``simulate`` command's library side)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from megatron_hexiseq import costmodel
from megatron_hexiseq.cluster import Cluster
from megatron_hexiseq.costmodel import Estimate
from megatron_hexiseq.layout import Layout
from megatron_hexiseq.model import ModelSpec
from megatron_hexiseq.planner.baselines import baseline_layouts
from megatron_hexiseq.run_config import TrainOptions


@dataclass(frozen=True)
class SimRow:
    name: str
    layout: Layout | None
    estimate: Estimate | None
    reason: str = ""

    def summary(self) -> dict[str, Any]:
        if self.estimate is None:
            return {
                "name": self.name,
                "feasible": False,
                "iteration_time_s": None,
                "tokens_per_s": None,
                "reason": self.reason,
            }
        e = self.estimate
        return {
            "name": self.name,
            "feasible": e.feasible,
            "iteration_time_s": e.iteration_time_s,
            "tokens_per_s": e.tokens_per_s,
            "memory_problems": e.memory_problems(),
            "per_rank": [
                {
                    "rank": p.rank,
                    "gpu": p.gpu,
                    "tokens": p.tokens,
                    "heads": p.heads,
                    "compute_s": p.compute_s,
                    "exposed_comm_s": p.exposed_comm_s,
                    "time_s": p.time_s,
                    "memory_bytes": p.memory_bytes,
                    "capacity_bytes": p.capacity_bytes,
                }
                for p in e.per_rank
            ],
        }


def simulate(
    cluster: Cluster,
    model: ModelSpec,
    options: TrainOptions,
    layouts: Sequence[tuple[str, Layout]],
    *,
    baselines: bool = False,
) -> list[SimRow]:
    """One row per layout (named by its path) and, with ``baselines``, per baseline configuration."""
    rows = [
        SimRow(name, lay, costmodel.estimate(lay, cluster, model, options)) for name, lay in layouts
    ]
    if baselines:
        seq = model.seq_length
        for b in baseline_layouts(cluster, model, seq):
            if b.layout is None:
                rows.append(SimRow(b.label, None, None, b.reason))
            else:
                rows.append(
                    SimRow(b.label, b.layout, costmodel.estimate(b.layout, cluster, model, options))
                )
    return rows
