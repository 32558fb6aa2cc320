"""How one iteration is run: ``TrainOptions``, the memory modes, their Megatron-LM flags, the
automatic mode order, and the options record a layout carries.

- ``TrainOptions``: micro-batch size, full activation recompute, memory mode, data-parallel
  replicas, usable share of device memory, the optimizer's shard group (its size and ring
  bandwidth, set for the domains of a job) and overlapped gradient reduction (what Megatron's
  flags decide).
- Memory modes (``MEMORY_MODES``): ``distributed_optimizer`` (Megatron's distributed optimizer,
  ZeRO-1) and ``fsdp`` (Megatron-FSDP, ZeRO-3). ``megatron_flags`` maps options to the flags
  that realise them, ``CHECKPOINT_FORMAT`` names each mode's checkpoint format.
- ``--memory-mode auto`` tries ``AUTO_MODES`` in order of modelled overhead: distributed
  optimizer, fsdp, distributed optimizer + recompute, fsdp + recompute; ``modes_to_try`` narrows
  that order to what the flags allow.
- ``options_record`` is what ``plan`` writes as a layout's ``meta.options`` (the shard group and
  overlap fields only when set, ``RECORD_IF_SET``); ``options_from_record`` reads one back
  (type-checked, one-line errors naming the key).

The memory checks that need the cost model's byte formulas (does a mode fit at all, and the
one-line "does not fit" message) are in ``megatron_hexiseq.planner.feasibility``: this module
sits below ``costmodel`` (which takes ``TrainOptions``), so it cannot use its formulas.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from megatron_hexiseq.errors import HexiSeqError, check_positive_int, short
from megatron_hexiseq.model import ModelSpec

MEMORY_MODES = ("distributed_optimizer", "fsdp")
MEMORY_MODE_CHOICES = ("auto", *MEMORY_MODES)
# (memory_mode, recompute) in the order --memory-mode auto tries them
AUTO_MODES = (
    ("distributed_optimizer", False),
    ("fsdp", False),
    ("distributed_optimizer", True),
    ("fsdp", True),
)
MEMORY_FLAGS = {
    "distributed_optimizer": ["--use-distributed-optimizer"],
    # Megatron-FSDP's required set (megatron/core/distributed/fsdp README, "Required Configurations")
    "fsdp": [
        "--use-megatron-fsdp",
        "--data-parallel-sharding-strategy",
        "optim_grads_params",
        "--no-gradient-accumulation-fusion",
        "--use-distributed-optimizer",
        "--ckpt-format",
        "fsdp_dtensor",
    ],
}
# --overlap-grad-reduce: each bucket's gradient reduction starts as soon as the backward has
# produced it; --overlap-param-gather: the distributed optimizer's parameter all-gather runs bucket
# by bucket under the next step's forward (megatron/core/distributed/distributed_data_parallel.py)
OVERLAP_FLAGS = ["--overlap-grad-reduce", "--overlap-param-gather"]
RECOMPUTE_FLAGS = [
    "--recompute-granularity",
    "full",
    "--recompute-method",
    "uniform",
    "--recompute-num-layers",
    "1",
]
CHECKPOINT_FORMAT = {
    "distributed_optimizer": "torch_dist with the distributed optimizer",
    "fsdp": "fsdp_dtensor with Megatron-FSDP",
}
# the fields of a layout's meta.options and their JSON types (TrainOptions' fields + what plan adds)
OPTION_FIELDS = (
    "micro_batch_size",
    "recompute",
    "memory_mode",
    "data_parallel_size",
    "capacity_fraction",
    "attention_kernel",
    "tensor_model_parallel_size",
    "shard_group_size",
    "shard_group_GBps",
    "overlap_grad_sync",
)
# written into a record only when they differ from these defaults (a single-sequence layout's record
# stays what it was before they existed)
RECORD_IF_SET = {
    "shard_group_size": 0,
    "shard_group_GBps": 0.0,
    "overlap_grad_sync": False,
    "tensor_model_parallel_size": 1,
}
_RECORD_TYPES = {
    "micro_batch_size": int,
    "recompute": bool,
    "memory_mode": str,
    "data_parallel_size": int,
    "capacity_fraction": float,
    "attention_kernel": str,
    "tensor_model_parallel_size": int,
    "shard_group_size": int,
    "shard_group_GBps": float,
    "overlap_grad_sync": bool,
    "memory_modes_tried": list,
    "megatron_flags": list,
}


@dataclass(frozen=True, kw_only=True)
class TrainOptions:
    """How one iteration is run (what Megatron's flags decide).

    ``micro_batch_size``: sequences per rank per iteration (``--micro-batch-size``; the CLI copies
    ``ModelSpec.micro_batch_size`` here unless told otherwise). ``recompute``: full activation
    recompute (``--recompute-granularity full --recompute-method uniform --recompute-num-layers 1``).
    ``memory_mode``: ``distributed_optimizer`` (``--use-distributed-optimizer``) or ``fsdp``
    (Megatron FSDP: params, grads and optimizer state sharded; flags in ``MEMORY_FLAGS``).
    ``data_parallel_size``: replicas of the layout; the optimizer shards over
    ``data_parallel_size * world_size`` ranks (Megatron's ``dp_cp`` group).
    ``capacity_fraction``: usable share of each device's memory.
    ``attention_kernel``: the block kernel the run forces (``--hexiseq-kernel``), ``auto`` for the
    runtime's choice per GPU; the cost model prices that kernel's achieved rate.
    ``tensor_model_parallel_size``: t > 1 runs Megatron's tensor + sequence parallelism inside TP
    bundles of t GPUs (``--tensor-model-parallel-size t --sequence-parallel``); the cost model then
    prices one TP rank of a bundle (``costmodel.tp``: its share of the model, the sequence-parallel
    collectives over NVLink, the activations sequence parallelism divides).
    ``shard_group_size``: ranks the optimizer state (with ``fsdp`` also the parameters and
    gradients) is sharded over, and that Megatron-FSDP's collectives span; 0 (default):
    ``data_parallel_size * world_size`` (:meth:`shard_ranks`). A job of several domains shards over
    all its ranks, more than one domain's layout holds.
    ``shard_group_GBps``: the bus bandwidth (GB/s) of a ring over that group; 0 (default): the
    ring over the layout's own cluster (``costmodel.step.ring_bus_GBps``).
    ``overlap_grad_sync``: ``--overlap-grad-reduce --overlap-param-gather`` (the step's gradient
    reduction hides behind the last backward, the parameter all-gather behind the first forward;
    ``costmodel.step``).
    """

    micro_batch_size: int = 1
    recompute: bool = False
    memory_mode: str = "distributed_optimizer"
    data_parallel_size: int = 1
    capacity_fraction: float = 0.95
    attention_kernel: str = "auto"
    tensor_model_parallel_size: int = 1
    shard_group_size: int = 0
    shard_group_GBps: float = 0.0
    overlap_grad_sync: bool = False

    def __post_init__(self) -> None:
        for name in ("micro_batch_size", "data_parallel_size", "tensor_model_parallel_size"):
            check_positive_int(name, getattr(self, name))
        if (
            not isinstance(self.shard_group_size, int)
            or isinstance(self.shard_group_size, bool)
            or self.shard_group_size < 0
        ):
            raise HexiSeqError(
                f"shard_group_size must be an integer >= 0, got {short(self.shard_group_size)}"
            )
        if (
            not isinstance(self.shard_group_GBps, (int, float))
            or isinstance(self.shard_group_GBps, bool)
            or not math.isfinite(self.shard_group_GBps)
            or self.shard_group_GBps < 0
        ):
            raise HexiSeqError(
                f"shard_group_GBps must be a number >= 0, got {short(self.shard_group_GBps)}"
            )
        if not isinstance(self.overlap_grad_sync, bool):
            raise HexiSeqError(
                f"overlap_grad_sync must be true or false, got {self.overlap_grad_sync!r}"
            )
        if self.memory_mode not in MEMORY_MODES:
            raise HexiSeqError(
                f"memory_mode must be one of {', '.join(MEMORY_MODES)}, got {self.memory_mode!r}"
            )
        if not isinstance(self.attention_kernel, str) or not self.attention_kernel:
            raise HexiSeqError(
                f"attention_kernel must be a kernel name, got {short(self.attention_kernel)}"
            )
        if not isinstance(self.recompute, bool):
            raise HexiSeqError(f"recompute must be true or false, got {self.recompute!r}")
        if not 0 < self.capacity_fraction <= 1:
            raise HexiSeqError(
                f"capacity_fraction must be in (0, 1], got {self.capacity_fraction!r}"
            )

    def shard_ranks(self, world_size: int) -> int:
        """Ranks the optimizer state is sharded over for a layout of ``world_size`` ranks:
        ``shard_group_size``, or ``data_parallel_size * world_size`` when that is 0."""
        return self.shard_group_size or self.data_parallel_size * world_size

    @classmethod
    def for_model(cls, model: ModelSpec, **kwargs: Any) -> TrainOptions:
        """Options whose micro-batch size comes from the model spec unless given."""
        return cls(**({"micro_batch_size": model.micro_batch_size} | kwargs))


def megatron_flags(options: TrainOptions) -> list[str]:
    """Megatron-LM flags that realise a memory mode (see docs/planner.md), when set the overlapped
    gradient reduction and parameter gather, and TP bundles (tensor + sequence parallelism)."""
    t = options.tensor_model_parallel_size
    tp = ["--tensor-model-parallel-size", str(t), "--sequence-parallel"] if t > 1 else []
    return (
        MEMORY_FLAGS[options.memory_mode]
        + (RECOMPUTE_FLAGS if options.recompute else [])
        + (OVERLAP_FLAGS if options.overlap_grad_sync else [])
        + tp
    )


def mode_label(options: TrainOptions) -> str:
    """``fsdp+recompute``-style name of a memory mode."""
    return f"{options.memory_mode}{'+recompute' if options.recompute else ''}"


def modes_to_try(memory_mode: str, recompute: bool) -> tuple[tuple[str, bool], ...]:
    """(memory_mode, recompute) pairs of ``AUTO_MODES`` that ``--memory-mode`` and ``--recompute``
    allow, in order: ``auto`` every mode, otherwise that mode; ``--recompute`` only recompute."""
    if memory_mode not in MEMORY_MODE_CHOICES:
        raise HexiSeqError(
            f"--memory-mode must be one of {', '.join(MEMORY_MODE_CHOICES)}, got {short(memory_mode)}"
        )
    return tuple(
        (m, r) for m, r in AUTO_MODES if memory_mode in ("auto", m) and (r or not recompute)
    )


def options_record(options: TrainOptions, tried: Sequence[TrainOptions]) -> dict[str, Any]:
    """A layout's ``meta.options``: the options it was planned with, the modes tried, the flags."""
    record: dict[str, Any] = {
        "micro_batch_size": options.micro_batch_size,
        "recompute": options.recompute,
        "memory_mode": options.memory_mode,
        "data_parallel_size": options.data_parallel_size,
        "capacity_fraction": options.capacity_fraction,
        "attention_kernel": options.attention_kernel,
    }
    for key, default in RECORD_IF_SET.items():
        if getattr(options, key) != default:
            record[key] = getattr(options, key)
    return record | {
        "memory_modes_tried": [mode_label(o) for o in tried],
        "megatron_flags": megatron_flags(options),
    }


def check_options_record(opts: Any, where: str) -> dict[str, Any]:
    """A ``meta.options`` read from a file, type-checked: a hand-edited value is a one-line error
    naming the key (``{where}: meta.options.recompute must be bool, got 'yes'``), not a traceback
    later. Returns the record as a dict (empty for ``None``)."""
    if opts is None:
        return {}
    if not isinstance(opts, Mapping):
        raise HexiSeqError(
            f"{where}: meta.options must be a mapping, got {short(opts)}; re-plan the layout"
        )
    for key, value in opts.items():
        want = _RECORD_TYPES.get(key)
        ok = want is None or (
            isinstance(value, want) and not (want is int and isinstance(value, bool))
        )
        if want is float:
            ok = (
                isinstance(value, (int, float))
                and not isinstance(value, bool)
                and math.isfinite(value)
            )
        if not ok:
            assert want is not None
            raise HexiSeqError(
                f"{where}: meta.options.{key} must be {want.__name__}, got {short(value)}; "
                "re-plan the layout or fix the value"
            )
    try:
        options_from_record(opts)
    except HexiSeqError as e:
        raise HexiSeqError(f"{where}: meta.options: {e}; re-plan the layout") from None
    return dict(opts)


def options_from_record(opts: Mapping[str, Any], base: TrainOptions | None = None) -> TrainOptions:
    """``TrainOptions`` from the ``OPTION_FIELDS`` of a ``meta.options`` record (other keys, such as
    ``megatron_flags``, are left out); fields the record lacks come from ``base``."""
    fields = {k: opts[k] for k in OPTION_FIELDS if k in opts}
    return TrainOptions(**fields) if base is None else replace(base, **fields)
