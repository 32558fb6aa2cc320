"""The tuning result file: chosen knobs, every trial measured, and how the run was set up.

JSON, written atomically, with a format version. ``--hexiseq-overlap-config PATH`` and
``megatron-hexiseq tune`` read and write it::

    {"format_version": 1, "config": {...OverlapConfig...}, "levels": [3],
     "ladders": [{"name": "dp_grad_reduce", "knob": "ddp", "values": [[false, null], ...]}],
     "trials": [{"levels": [0], "config": {...}, "y_us": .., "x_us": [..], "z_us": ..,
                 "communication": null, "decision": "start"}, ...],
     "num_trials": 5, "default_z_us": .., "tuned_z_us": .., "setup": {...}}
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from megatron_hexiseq.errors import HexiSeqError, short
from megatron_hexiseq.io import read_json, write_json_atomic
from megatron_hexiseq.overlap.knobs import Ladder, OverlapConfig, SearchSpace
from megatron_hexiseq.overlap.search import SearchResult, Step, Trial

FORMAT_VERSION = 1


@dataclass(frozen=True, kw_only=True)
class TuneResult:
    """What a tuning run chose and measured. ``setup``: free-form description of the testbed."""

    config: OverlapConfig
    levels: tuple[int, ...] = ()
    ladders: tuple[Ladder, ...] = ()
    trials: tuple[Step, ...] = ()
    default_z_us: float | None = None
    tuned_z_us: float | None = None
    setup: dict[str, Any] = field(default_factory=dict)

    @property
    def num_trials(self) -> int:
        return len(self.trials)

    @classmethod
    def from_search(cls, space: SearchSpace, result: SearchResult, **kw: Any) -> TuneResult:
        return cls(
            config=space.config_at(result.levels),
            levels=result.levels,
            ladders=space.ladders,
            trials=result.history,
            **kw,
        )

    def to_dict(self) -> dict[str, Any]:
        space = SearchSpace(ladders=self.ladders) if self.ladders else None
        return {
            "format_version": FORMAT_VERSION,
            "config": self.config.to_dict(),
            "levels": list(self.levels),
            "ladders": [
                {"name": lv.name, "knob": lv.knob, "values": [_jsonable(v) for v in lv.values]}
                for lv in self.ladders
            ],
            "trials": [
                {
                    "levels": list(s.levels),
                    "config": space.config_at(s.levels).to_dict() if space else None,
                    "y_us": s.trial.y_us,
                    "x_us": list(s.trial.x_us),
                    "z_us": s.trial.z_us,
                    "communication": s.communication,
                    "decision": s.decision,
                }
                for s in self.trials
            ],
            "num_trials": self.num_trials,
            "default_z_us": self.default_z_us,
            "tuned_z_us": self.tuned_z_us,
            "setup": self.setup,
        }

    @classmethod
    def from_dict(cls, d: Any, where: str = "overlap result") -> TuneResult:
        if not isinstance(d, dict) or "config" not in d:
            raise HexiSeqError(
                f"{where} is not an overlap tuning result (no 'config'); "
                "write one with 'megatron-hexiseq tune'"
            )
        if d.get("format_version") != FORMAT_VERSION:
            raise HexiSeqError(
                f"{where} has format_version {short(d.get('format_version'))}; this version "
                f"reads {FORMAT_VERSION}: re-run 'megatron-hexiseq tune'"
            )
        try:
            ladders = tuple(
                Ladder(
                    name=lv["name"], knob=lv["knob"], values=tuple(_tuple(v) for v in lv["values"])
                )
                for lv in d.get("ladders", ())
            )
            trials = tuple(
                Step(
                    levels=tuple(t["levels"]),
                    trial=Trial(
                        y_us=float(t["y_us"]),
                        x_us=tuple(float(x) for x in t["x_us"]),
                        z_us=float(t["z_us"]),
                    ),
                    communication=t["communication"],
                    decision=t["decision"],
                )
                for t in d.get("trials", ())
            )
            return cls(
                config=OverlapConfig.from_dict(d["config"]),
                levels=tuple(d.get("levels", ())),
                ladders=ladders,
                trials=trials,
                default_z_us=d.get("default_z_us"),
                tuned_z_us=d.get("tuned_z_us"),
                setup=dict(d.get("setup", {})),
            )
        except HexiSeqError as e:
            raise HexiSeqError(f"{where}: {e}") from None
        except (KeyError, TypeError, ValueError, AttributeError) as e:
            raise HexiSeqError(
                f"{where} is malformed ({type(e).__name__}: {short(str(e))}); "
                "re-run 'megatron-hexiseq tune'"
            ) from None


def save_result(result: TuneResult, path: str | os.PathLike) -> None:
    write_json_atomic(path, result.to_dict())


def load_result(path: str | os.PathLike) -> TuneResult:
    return TuneResult.from_dict(read_json(path, "overlap result"), f"overlap result {path}")


def _jsonable(v: Any) -> Any:
    return list(v) if isinstance(v, tuple) else v


def _tuple(v: Any) -> Any:
    return tuple(v) if isinstance(v, list) else v
