"""A candidate layout: what every candidate family (baselines, heuristics, hierarchical stages,
exact reference) hands to the final choice, scored by ``costmodel.estimate``."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

from megatron_hexiseq.costmodel import Estimate
from megatron_hexiseq.layout import Layout


@dataclass(frozen=True)
class Candidate:
    """A layout with its estimate and how it was found (``info``: solver status, bound, stages)."""

    layout: Layout
    estimate: Estimate
    info: dict[str, Any] = field(default_factory=dict)


def fastest_feasible(candidates: Sequence[Candidate]) -> Candidate | None:
    """The feasible candidate with the smallest estimated iteration time (first listed on ties)."""
    feasible = [c for c in candidates if c.estimate.feasible]
    return min(feasible, key=lambda c: c.estimate.iteration_time_s, default=None)
