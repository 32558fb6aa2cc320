"""Online tuning inside a training loop: one search trial every few iterations, then monitoring.

``OnlineTuner.on_step(step_s, compute_s, exposed_s)`` is called once per training iteration by
every rank of ``group``, the same number of times on every rank. Its first act is one all-reduce
(MAX) of that iteration's times over the group (a synchronous step is as slow as its slowest
rank), so every rank holds the same numbers and takes every decision below identically, with no
other collective: ``search.search_steps`` runs on every rank; after a configuration is applied it
skips ``settle_steps`` iterations, collects ``steps_per_trial``, turns their medians into a
``Trial`` (``search.trial_from_exposed``) and picks the next levels, which ``apply(config)`` puts
in force (only knobs that can change between iterations: HexiSeq's ``comm_chunks``; DDP buckets
and NCCL communicators are built once, see docs/overlap.md). When the search ends the best
configuration is applied, ``on_done(result)`` is called (it saves the result file), and a
``DriftMonitor`` watches step time and exposed share; when it fires (on every rank at once: it
sees the same numbers) the search starts again from minimal resources.

The all-reduce's tensor lives where the group's backend wants it (``search.collective_device``):
the Megatron glue passes a gloo side group, so it is a host tensor and needs no device sync.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Generator, Sequence

import torch.distributed as dist

from megatron_hexiseq.overlap.knobs import OverlapConfig, SearchSpace
from megatron_hexiseq.overlap.monitor import DriftMonitor
from megatron_hexiseq.overlap.results import TuneResult
from megatron_hexiseq.overlap.search import (
    Levels,
    SearchResult,
    Trial,
    max_over_ranks,
    search_steps,
    trial_from_exposed,
)


class OnlineTuner:
    """Step-driven Lagom search, replicated on every rank of ``group`` (None: a single process)."""

    def __init__(
        self,
        space: SearchSpace,
        apply: Callable[[OverlapConfig], None],
        *,
        on_done: Callable[[TuneResult], None] | None = None,
        settle_steps: int = 1,
        steps_per_trial: int = 4,
        hidden_tol: float = 0.02,
        gallop: bool = True,
        tolerance: float = 0.0,
        monitor: DriftMonitor | None = None,
        group: dist.ProcessGroup | str | None = None,
    ) -> None:
        if steps_per_trial < 1 or settle_steps < 0:
            raise ValueError(
                f"steps_per_trial must be >= 1 and settle_steps >= 0, got "
                f"{steps_per_trial}, {settle_steps}"
            )
        self.space, self.apply, self.on_done = space, apply, on_done
        self.settle_steps, self.steps_per_trial, self.hidden_tol = (
            settle_steps,
            steps_per_trial,
            hidden_tol,
        )
        self.gallop, self.tolerance, self._group = gallop, tolerance, group
        self.monitor = monitor or DriftMonitor()
        self.results: list[TuneResult] = []
        self._samples: list[tuple[float, tuple[float, ...], float]] = []
        self._skip = 0
        self._gen: Generator[Levels, Trial, SearchResult] | None = None
        self._levels: Levels | None = None
        self._start()

    @property
    def group(self) -> dist.ProcessGroup | None:
        """The agreement group; ``"world"`` resolves to the default group once it exists (the tuner
        may be built before ``init_process_group``; until then every rank proposes level 0 alike)."""
        if self._group == "world":
            return dist.group.WORLD if dist.is_available() and dist.is_initialized() else None
        if isinstance(self._group, str):
            raise ValueError(f'group must be a ProcessGroup, "world" or None, got {self._group!r}')
        return self._group

    @property
    def tuning(self) -> bool:
        return self._levels is not None

    def _start(self) -> None:
        self._gen = search_steps(
            self.space.num_levels, gallop=self.gallop, tolerance=self.tolerance
        )
        self._set(next(self._gen))

    def _set(self, levels: Levels | None) -> None:
        self._levels, self._samples, self._skip = levels, [], self.settle_steps
        if levels is not None:
            self.apply(self.space.config_at(levels))

    def on_step(self, step_s: float, compute_s: float, exposed_s: Sequence[float]) -> None:
        """Record one iteration: its time, its computation time and each communication's wait (s).

        Collective over ``group``: every rank calls it once per iteration."""
        values = (step_s, compute_s, *exposed_s)
        if self.group is not None:
            values = max_over_ranks(values, self.group)
        step_s, compute_s, exposed_s = values[0], values[1], values[2:]
        if not self.tuning:
            if self.monitor.observe(step_s, float(sum(exposed_s))):
                self._start()
            return
        if self._skip > 0:
            self._skip -= 1
            return
        self._samples.append((compute_s * 1e6, tuple(e * 1e6 for e in exposed_s), step_s * 1e6))
        if len(self._samples) < self.steps_per_trial:
            return
        n = len(self.space.ladders)
        y = statistics.median(s[0] for s in self._samples)
        exposed = [statistics.median(s[1][j] for s in self._samples) for j in range(n)]
        z = statistics.median(s[2] for s in self._samples)
        self._advance(trial_from_exposed(y, exposed, z, hidden_tol=self.hidden_tol))

    def _advance(self, trial: Trial) -> None:
        assert self._gen is not None
        try:
            self._set(self._gen.send(trial))
            return
        except StopIteration as stop:
            result: SearchResult = stop.value
        tuned = TuneResult.from_search(
            self.space,
            result,
            tuned_z_us=result.trial.z_us,
            setup={"mode": "online", "start_z_us": result.history[0].trial.z_us},
        )
        self.results.append(tuned)
        self._set(None)
        self.apply(tuned.config)
        self.monitor.tuned()
        if self.on_done is not None:
            self.on_done(tuned)
