"""The overlap knobs, one configuration of them, and the search space the tuner walks.

Knobs:

* Megatron DDP: ``overlap_grad_reduce`` and ``bucket_size`` (a number of PARAMETERS per gradient
  bucket; ``None`` means one bucket, Megatron's behaviour without ``--overlap-grad-reduce``);
* HexiSeq attention: ``comm_chunks`` (how finely the head all-to-all / sub-ring K/V exchange is
  split and overlapped with attention compute; integer >= 1);
* NCCL (GPU only): per-group ``min_ctas``/``max_ctas``/``cga_cluster_size``/
  ``is_high_priority_stream`` (Megatron's ``--nccl-communicator-config-path`` YAML) and
  ``--high-priority-stream-groups``.

The search does not see these fields: it sees one *ladder* per communication, an ordered tuple of
settings from the least resources taken from the overlapped computation (level 0) to the most.
``SearchSpace.config_at(levels)`` turns a level vector into an ``OverlapConfig``.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from megatron_hexiseq.errors import HexiSeqError

#: Process-group names Megatron's ``initialize_model_parallel`` looks up in the NCCL YAML
#: (``megatron/core/parallel_state.py`` at core_v0.16.1, calls of ``get_nccl_options``).
MEGATRON_NCCL_GROUPS = (
    "dp",
    "dp_cp",
    "intra_dp_cp",
    "cp",
    "hcp",
    "mp",
    "tp",
    "pp",
    "embd",
    "pos_embd",
    "tp_dp_cp",
    "tp_dp",
    "tp_cp",
    "ep",
    "ep_tp",
    "tp_ep_mp",
    "tp_ep_pp",
    "ep_dp",
    "intra_ep_dp",
    "inter_ep_dp",
    "intra_dist_opt_instance",
)

#: NCCL accepts at most this many CTAs (channels) per communicator (NCCL_MAX_CTAS range).
MAX_NCCL_CTAS = 64


@dataclass(frozen=True, kw_only=True)
class NcclGroupOptions:
    """NCCL communicator options of one Megatron process group (one YAML entry)."""

    group: str
    min_ctas: int | None = None
    max_ctas: int | None = None
    cga_cluster_size: int | None = None
    is_high_priority_stream: bool = False

    def __post_init__(self) -> None:
        if self.group not in MEGATRON_NCCL_GROUPS:
            raise HexiSeqError(
                f"NCCL group '{self.group}' is not a Megatron process group; "
                f"use one of {', '.join(MEGATRON_NCCL_GROUPS)}"
            )
        for name in ("min_ctas", "max_ctas"):
            value = getattr(self, name)
            if value is not None and not 1 <= value <= MAX_NCCL_CTAS:
                raise HexiSeqError(
                    f"NCCL group '{self.group}': {name}={value} is outside 1..{MAX_NCCL_CTAS}"
                )
        if (
            self.min_ctas is not None
            and self.max_ctas is not None
            and self.min_ctas > self.max_ctas
        ):
            raise HexiSeqError(
                f"NCCL group '{self.group}': min_ctas={self.min_ctas} > max_ctas={self.max_ctas}"
            )
        if self.cga_cluster_size is not None and not 0 <= self.cga_cluster_size <= 8:
            raise HexiSeqError(
                f"NCCL group '{self.group}': cga_cluster_size={self.cga_cluster_size} "
                "is outside 0..8"
            )


@dataclass(frozen=True, kw_only=True)
class OverlapConfig:
    """One setting of every overlap knob. Defaults are Megatron's defaults.

    ``bucket_size`` is in parameters; ``None`` lets Megatron pick (one bucket without overlap,
    ``max(40M, 1M * dp)`` with it).
    """

    overlap_grad_reduce: bool = False
    bucket_size: int | None = None
    comm_chunks: int = 1
    nccl: tuple[NcclGroupOptions, ...] = ()

    def __post_init__(self) -> None:
        if self.bucket_size is not None and self.bucket_size < 1:
            raise HexiSeqError(
                f"bucket_size must be a positive number of parameters, got {self.bucket_size}"
            )
        if self.comm_chunks < 1:
            raise HexiSeqError(f"comm_chunks must be an integer >= 1, got {self.comm_chunks}")
        names = [g.group for g in self.nccl]
        if len(set(names)) != len(names):
            raise HexiSeqError(f"NCCL options name a group twice: {names}")

    @property
    def high_priority_stream_groups(self) -> tuple[str, ...]:
        """Groups whose NCCL stream is high priority (Megatron's ``--high-priority-stream-groups``)."""
        return tuple(g.group for g in self.nccl if g.is_high_priority_stream)

    def with_nccl(self, options: NcclGroupOptions) -> OverlapConfig:
        """A copy with ``options`` replacing (or adding) the entry of its group."""
        rest = tuple(g for g in self.nccl if g.group != options.group)
        return dataclasses.replace(
            self, nccl=tuple(sorted(rest + (options,), key=lambda g: g.group))
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "overlap_grad_reduce": self.overlap_grad_reduce,
            "bucket_size": self.bucket_size,
            "comm_chunks": self.comm_chunks,
            "nccl": [dataclasses.asdict(g) for g in self.nccl],
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> OverlapConfig:
        known = {"overlap_grad_reduce", "bucket_size", "comm_chunks", "nccl"}
        unknown = set(d) - known
        if unknown:
            raise HexiSeqError(f"unknown overlap knob(s) {sorted(unknown)}; known: {sorted(known)}")
        nccl = tuple(NcclGroupOptions(**g) for g in d.get("nccl", ()))
        return cls(
            overlap_grad_reduce=bool(d.get("overlap_grad_reduce", False)),
            bucket_size=d.get("bucket_size"),
            comm_chunks=int(d.get("comm_chunks", 1)),
            nccl=nccl,
        )

    def label(self) -> str:
        """Short human label, e.g. ``overlap b=262144 chunks=2``."""
        ddp = (
            "no-overlap"
            if not self.overlap_grad_reduce
            else f"overlap b={self.bucket_size or 'default'}"
        )
        extra = "".join(
            f" {g.group}:ctas={g.min_ctas}-{g.max_ctas}{'!' if g.is_high_priority_stream else ''}"
            for g in self.nccl
        )
        return f"{ddp} chunks={self.comm_chunks}{extra}"


@dataclass(frozen=True, kw_only=True)
class Ladder:
    """The settings of one communication, from least to most resources taken from compute.

    ``knob`` says what a value sets:
    ``"ddp"``: value ``(overlap_grad_reduce, bucket_size)``;
    ``"comm_chunks"``: value an integer >= 1;
    ``"nccl_ctas:<group>"``: value a CTA count, sets ``min_ctas = max_ctas``;
    ``"nccl_priority:<group>"``: value a bool, sets ``is_high_priority_stream``.
    """

    name: str
    knob: str
    values: tuple[Any, ...]

    def __post_init__(self) -> None:
        if not self.values:
            raise HexiSeqError(f"ladder '{self.name}' has no values")
        kind = self.knob.split(":", 1)[0]
        if kind not in ("ddp", "comm_chunks", "nccl_ctas", "nccl_priority"):
            raise HexiSeqError(f"ladder '{self.name}': unknown knob '{self.knob}'")

    def apply(self, config: OverlapConfig, level: int) -> OverlapConfig:
        """``config`` with this ladder's knob set to ``values[level]``."""
        value = self.values[level]
        kind, _, group = self.knob.partition(":")
        if kind == "ddp":
            overlap, bucket = value
            return dataclasses.replace(
                config, overlap_grad_reduce=bool(overlap), bucket_size=bucket
            )
        if kind == "comm_chunks":
            return dataclasses.replace(config, comm_chunks=int(value))
        old = next((g for g in config.nccl if g.group == group), NcclGroupOptions(group=group))
        if kind == "nccl_ctas":
            return config.with_nccl(
                dataclasses.replace(old, min_ctas=int(value), max_ctas=int(value))
            )
        return config.with_nccl(dataclasses.replace(old, is_high_priority_stream=bool(value)))


@dataclass(frozen=True, kw_only=True)
class SearchSpace:
    """A base configuration plus one ladder per communication; levels index the ladders."""

    ladders: tuple[Ladder, ...]
    base: OverlapConfig = field(default_factory=OverlapConfig)

    @property
    def num_levels(self) -> tuple[int, ...]:
        return tuple(len(lv.values) for lv in self.ladders)

    def config_at(self, levels: tuple[int, ...]) -> OverlapConfig:
        assert len(levels) == len(self.ladders), (levels, self.ladders)
        config = self.base
        for ladder, level in zip(self.ladders, levels):
            config = ladder.apply(config, level)
        return config

    def grid(self) -> Iterator[tuple[int, ...]]:
        """Every level vector (the exhaustive baseline the benchmark compares against)."""
        return itertools.product(*(range(n) for n in self.num_levels))


def ddp_ladder(num_params: int, *, min_bucket_params: int = 50_000, factor: int = 2) -> Ladder:
    """DDP gradient-reduce ladder: no overlap, then overlap with ever smaller buckets.

    Level 0 (no overlap: Megatron's default; the all-reduce runs after backward and takes nothing
    from it) is the least resources; level 1 is overlap with ``num_params // factor`` parameters
    per bucket, and each next level divides the bucket by ``factor`` (more, smaller all-reduces
    running concurrently with backward) down to ``min_bucket_params``. Overlap with one bucket
    (Megatron's 40M default holding a small model whole) is left out: its only all-reduce starts
    when backward ends, so it takes the same (no) resources as level 0 and would stall the
    search on a plateau.
    """
    if num_params < 1 or factor < 2:
        raise HexiSeqError(
            f"ddp_ladder needs num_params >= 1 and factor >= 2 (got {num_params}, {factor})"
        )
    values: list[tuple[bool, int | None]] = [(False, None)]
    bucket = num_params // factor
    while bucket >= min_bucket_params:
        values.append((True, bucket))
        bucket //= factor
    return Ladder(name="dp_grad_reduce", knob="ddp", values=tuple(values))
