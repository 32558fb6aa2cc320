"""A candidate layout: what every candidate family (baselines, heuristics, hierarchical stages,
exact reference) hands to the final choice, scored by ``costmodel.estimate``."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

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


class Deadline:
    """The wall-clock cap of one plan's search (``plan(time_limit_s=...)``): candidate families check
    ``passed()`` before starting optional work (further rounds, groupings, memory modes); ``reached``
    says whether any of them stopped early. Every CP-SAT solve has its own fixed deterministic limit,
    so a plan that finishes before the cap does not depend on the machine's speed or load."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.at = time.perf_counter() + seconds
        self.reached = False

    def passed(self) -> bool:
        if time.perf_counter() >= self.at:
            self.reached = True
        return self.reached
