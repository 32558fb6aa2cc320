"""Offline tuning on the CPU testbed: the priority search over real gloo training iterations.

``tune_offline(spec)`` spawns ``spec.world_size`` gloo ranks (``testing.run_ranks``); each builds
the testbed GPT, the DDP ladder (``knobs.ddp_ladder``) and runs ``distributed_priority_search``
over the default group, so every rank trains with the same configuration on every trial. Level 0
of the ladder is Megatron's default (no overlap), so the first trial measures the default.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch.distributed as dist

from megatron_hexiseq.overlap.knobs import SearchSpace, ddp_ladder
from megatron_hexiseq.overlap.results import TuneResult
from megatron_hexiseq.overlap.search import distributed_priority_search
from megatron_hexiseq.overlap.testbed import Testbed, TestbedConfig
from megatron_hexiseq.testing import run_ranks


@dataclass(frozen=True, kw_only=True)
class OfflineTuneSpec:
    testbed: TestbedConfig = field(default_factory=TestbedConfig)
    world_size: int = 2
    min_bucket_params: int = 100_000
    bucket_factor: int = 2
    gallop: bool = True
    tolerance: float = 0.05


def testbed_space(tb: Testbed, spec: OfflineTuneSpec) -> SearchSpace:
    return SearchSpace(ladders=(ddp_ladder(tb.count_params(), min_bucket_params=spec.min_bucket_params,
                                           factor=spec.bucket_factor),))


def _tune_rank(rank: int, world_size: int, spec: OfflineTuneSpec) -> TuneResult:
    group = dist.group.WORLD
    tb = Testbed(spec.testbed, group)
    space = testbed_space(tb, spec)

    def measure(levels):
        return tb.measure(space.config_at(levels)).trial(spec.testbed.hidden_tol)

    result = distributed_priority_search(space.num_levels, measure, group=group, gallop=spec.gallop,
                                         tolerance=spec.tolerance)
    setup = {"mode": "offline-cpu", "world_size": world_size, "num_params": tb.count_params(),
             "model": dataclasses.asdict(spec.testbed.model), "warmup_steps": spec.testbed.warmup_steps,
             "measure_steps": spec.testbed.measure_steps, "gallop": spec.gallop, "tolerance": spec.tolerance,
             "grid_size": len(list(space.grid()))}
    return TuneResult.from_search(space, result, default_z_us=result.history[0].trial.z_us,
                                  tuned_z_us=result.trial.z_us, setup=setup)


def tune_offline(spec: OfflineTuneSpec) -> TuneResult:
    """Run the search on ``spec.world_size`` gloo ranks; every rank agrees, rank 0's copy returned."""
    return run_ranks(_tune_rank, spec.world_size, spec)[0]
