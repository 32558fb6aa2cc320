"""The per-step fixed costs every global-batch scheme pays on top of its slowest domain.

A step ends with one gradient reduction over every rank of the run (all hold the whole model), the
optimizer step and, with Megatron-FSDP, per-layer parameter gathers: costs that do not depend on
how the documents were scheduled. ``step_fixed_s`` is the one place the whole-cluster comparison
reads them. The job planner's model of these terms is not in this tree yet: until it is,
``step_fixed_s`` returns 0, so every scheme's step is its slowest domain and the speed-ups between
schemes on the same GPUs are upper bounds (a shared constant only shrinks them); ``fast-only``
runs on fewer GPUs, whose gradient reduction would be cheaper.
"""

from __future__ import annotations

from collections.abc import Sequence

from megatron_hexiseq.cluster import Cluster
from megatron_hexiseq.model import ModelSpec
from megatron_hexiseq.run_config import TrainOptions


def step_fixed_s(
    cluster: Cluster, model: ModelSpec, options: TrainOptions, run_ranks: Sequence[int]
) -> float:
    """Seconds per step outside the micro-batches of the run on ``run_ranks`` (module docstring)."""
    return 0.0
