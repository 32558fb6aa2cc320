"""Offline tuning on the CPU bench: the priority search over real gloo training iterations.

``tune_offline(spec)`` spawns ``spec.world_size`` gloo ranks (``testing.run_ranks``); each builds
the bench model (``overlap_bench``), the DDP ladder of the *user's* model (``knobs.ddp_ladder``
over its parameter count) and runs ``distributed_priority_search`` over the default group, so
every rank trains with the same configuration on every trial. Level 0 of the ladder is Megatron's
default (no overlap), so the first trial measures the default.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch.distributed as dist

from megatron_hexiseq.overlap.knobs import OverlapConfig, SearchSpace, ddp_ladder
from megatron_hexiseq.overlap.results import TuneResult
from megatron_hexiseq.overlap.search import Levels, Trial, distributed_priority_search
from megatron_hexiseq.testbed.overlap_bench import BenchConfig, Measurement, OverlapBench
from megatron_hexiseq.testbed.spawn import run_ranks

#: Without ``min_bucket_params`` the ladder halves the bucket down to 1/128 of the model (7 overlapped levels).
DEFAULT_LADDER_DEPTH = 128

#: ``measure(bench, config)``: what one trial measures (``OverlapBench.measure`` unless a test injects timings).
Measure = Callable[[OverlapBench, OverlapConfig], Measurement]


@dataclass(frozen=True, kw_only=True)
class OfflineTuneSpec:
    """``min_bucket_params``: smallest bucket tried, in the user's model's parameters
    (None: ``num_parameters // DEFAULT_LADDER_DEPTH``)."""

    bench: BenchConfig = field(default_factory=BenchConfig)
    world_size: int = 2
    min_bucket_params: int | None = None
    bucket_factor: int = 2
    gallop: bool = True
    tolerance: float = 0.05


def bench_space(spec: OfflineTuneSpec) -> SearchSpace:
    """The DDP ladder over the user's model's parameters."""
    n = spec.bench.model.target.num_parameters
    min_bucket = spec.min_bucket_params or max(1, n // DEFAULT_LADDER_DEPTH)
    return SearchSpace(
        ladders=(ddp_ladder(n, min_bucket_params=min_bucket, factor=spec.bucket_factor),)
    )


def _measure_on_bench(bench: OverlapBench, config: OverlapConfig) -> Measurement:
    return bench.measure(config)


def tune_rank(
    rank: int, world_size: int, spec: OfflineTuneSpec, measure: Measure = _measure_on_bench
) -> TuneResult:
    """One rank's part of ``tune_offline`` (collective over the default group)."""
    group = dist.group.WORLD
    if group is None:
        raise RuntimeError("tune_rank needs an initialised default process group")
    bench = OverlapBench(spec.bench, group)
    space = bench_space(spec)

    def trial(levels: Levels) -> Trial:
        return measure(bench, space.config_at(levels)).trial(spec.bench.hidden_tol)

    result = distributed_priority_search(
        space.num_levels, trial, group=group, gallop=spec.gallop, tolerance=spec.tolerance
    )
    models = spec.bench.model
    setup = {
        "mode": "offline-cpu",
        "world_size": world_size,
        "num_params": models.target.num_parameters,
        "model": models.target.to_dict(),
        "bench_model": models.bench.to_dict(),
        "bench_num_params": models.bench.num_parameters,
        "param_ratio": models.param_ratio,
        "warmup_steps": spec.bench.warmup_steps,
        "measure_steps": spec.bench.measure_steps,
        "gallop": spec.gallop,
        "tolerance": spec.tolerance,
        "grid_size": len(list(space.grid())),
    }
    return TuneResult.from_search(
        space,
        result,
        default_z_us=result.history[0].trial.z_us,
        tuned_z_us=result.trial.z_us,
        setup=setup,
    )


def tune_offline(spec: OfflineTuneSpec) -> TuneResult:
    """Run the search on ``spec.world_size`` gloo ranks; every rank agrees, rank 0's copy returned."""
    return run_ranks(tune_rank, spec.world_size, spec)[0]
