"""Runtime drift monitor: when to re-tune the overlap knobs, with hysteresis.

Per training step it receives the step time and the exposed-communication time (the time the
step waited on communication). Samples are grouped in windows of ``window`` steps; each window
is summarised by its medians (robust to single slow steps): ``step_s`` and ``exposed_share =
exposed / step``. The first full window after start (or after a re-tune and ``cooldown`` windows)
becomes the baseline. A window *drifts* when

    |step_s / base_step_s - 1| > threshold   or   |exposed_share - base_share| > threshold

Hysteresis (no oscillation): a counter of drifted windows grows by one per drifted window, is
left alone by windows between ``rearm`` and ``threshold``, and only resets on a window within
``rearm`` of the baseline. A re-tune is requested when the counter reaches ``patience``; then the
monitor is silent until ``tuned()`` is called, skips ``cooldown`` windows, and takes a new
baseline, so the state it re-tuned for is the new normal and cannot trigger again by itself.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field

from megatron_hexiseq.errors import HexiSeqError


@dataclass(frozen=True, kw_only=True)
class MonitorConfig:
    window: int = 20
    threshold: float = 0.10
    rearm: float = 0.05
    patience: int = 2
    cooldown: int = 1

    def __post_init__(self) -> None:
        if self.window < 1 or self.patience < 1 or self.cooldown < 0:
            raise HexiSeqError(f"monitor needs window >= 1, patience >= 1, cooldown >= 0: {self}")
        if not 0 <= self.rearm < self.threshold:
            raise HexiSeqError(
                f"monitor needs 0 <= rearm < threshold, got rearm={self.rearm} "
                f"threshold={self.threshold}"
            )


@dataclass(frozen=True)
class WindowSummary:
    step_s: float
    exposed_share: float


@dataclass
class DriftMonitor:
    """Feed ``observe(step_s, exposed_s)`` every step; it returns True once when a re-tune is due."""

    config: MonitorConfig = field(default_factory=MonitorConfig)
    baseline: WindowSummary | None = None
    drifted_windows: int = 0
    tuning: bool = False
    triggers: int = 0
    _samples: list[tuple[float, float]] = field(default_factory=list)
    _skip: int = 0

    def observe(self, step_s: float, exposed_s: float) -> bool:
        if step_s <= 0 or exposed_s < 0:
            raise ValueError(
                f"step time must be > 0 and exposed time >= 0, got {step_s}, {exposed_s}"
            )
        if self.tuning:
            return False
        self._samples.append((step_s, min(exposed_s, step_s) / step_s))
        if len(self._samples) < self.config.window:
            return False
        summary = WindowSummary(
            statistics.median(s for s, _ in self._samples),
            statistics.median(e for _, e in self._samples),
        )
        self._samples.clear()
        if self._skip > 0:
            self._skip -= 1
            return False
        if self.baseline is None:
            self.baseline = summary
            return False
        drift = self.drift(summary)
        if drift > self.config.threshold:
            self.drifted_windows += 1
        elif drift <= self.config.rearm:
            self.drifted_windows = 0
        if self.drifted_windows >= self.config.patience:
            self.tuning, self.triggers = True, self.triggers + 1
            return True
        return False

    def drift(self, summary: WindowSummary) -> float:
        """Largest of the relative step-time change and the exposed-share change vs the baseline."""
        assert self.baseline is not None
        return max(
            abs(summary.step_s / self.baseline.step_s - 1.0),
            abs(summary.exposed_share - self.baseline.exposed_share),
        )

    def tuned(self) -> None:
        """The re-tune finished: skip ``cooldown`` windows, then take a fresh baseline."""
        self.tuning, self.baseline, self.drifted_windows = False, None, 0
        self._samples.clear()
        self._skip = self.config.cooldown
