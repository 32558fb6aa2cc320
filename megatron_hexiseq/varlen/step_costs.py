"""The per-step fixed costs every global-batch scheme pays on top of its slowest domain.

A step ends with one gradient reduction over every rank of the run (all hold the whole model) and
the optimizer step (``costmodel.step.step_fixed``: the distributed optimizer's reduce-scatter and
all-gather over the ring of every run rank at its slowest link, Adam at the slowest rank's memory
bandwidth; a measured ``step_overhead_ms``, the CPU testbed's, instead of both). Megatron-FSDP's
per-layer collectives are per micro-batch: ``estimate_documents`` prices them in every micro-batch,
over the run's shard group (``domains.domain_options``). ``step_fixed_s`` is the one place the
whole-cluster comparison reads the step's costs. Without ``overlap_grad_sync`` the reduction is
all exposed; with it, no window is assumed (the comparison charges it in full: every scheme on the
same ranks pays the same, so the speed-ups between them are not moved by it beyond that constant).
"""

from __future__ import annotations

from collections.abc import Sequence

from megatron_hexiseq.cluster import Cluster
from megatron_hexiseq.costmodel.step import grad_sync_exposed_s, step_fixed
from megatron_hexiseq.model import ModelSpec
from megatron_hexiseq.run_config import TrainOptions


def step_fixed_s(
    cluster: Cluster, model: ModelSpec, options: TrainOptions, run_ranks: Sequence[int]
) -> float:
    """Seconds per step outside the micro-batches of the run on ``run_ranks`` (module docstring).
    A measured step overhead is already in every priced micro-batch (``estimate_documents`` adds
    it to each iteration; the schemes keep one per step and each further micro-batch's
    ``micro_batch_overhead_ms``: ``costmodel.step.step_once_s``), so it is not added again here."""
    fixed = step_fixed(cluster, [run_ranks], model, options)
    if fixed.measured:
        return 0.0
    return grad_sync_exposed_s(fixed.sync, options, 0.0, 0.0) + fixed.optimizer_s
