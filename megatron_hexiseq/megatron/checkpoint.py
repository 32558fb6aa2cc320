"""Which Megatron checkpoints survive a new layout, and the refusals before training.

Parameters are replicated over the CP domain and reduced over DP x CP as in stock Megatron, so the
model part of a ``torch_dist`` checkpoint does not depend on the layout. What can still tie a
checkpoint to the run that wrote it (Megatron-LM / megatron-core ``core_v0.16.1``, TP = 1 as HexiSeq
requires; details and code references in docs/elastic.md):

- the model and the sequence length (Megatron compares a few model fields only after loading, with
  an assert, and never the sequence length);
- the memory mode: a distributed-optimizer (``torch_dist``) checkpoint and a Megatron-FSDP
  (``fsdp_dtensor``) one cannot be read by each other's run; a distributed-optimizer state and a
  plain optimizer state neither;
- the distributed optimizer's default ``dp_reshardable`` state is stored per gradient bucket and
  reshards over DP x CP only when every bucket holds the same parameters (Megatron asserts
  ``per_bucket_numel_unpadded`` equal after loading); the bucket size defaults to
  ``max(40M, 1M x DP x CP)`` parameters, so it changes with the world size past 40 ranks;
- with expert parallelism the RNG state is sharded by the DP x CP rank, and
  ``--data-parallel-random-init`` keeps one RNG state per DP rank;
- ``--ckpt-format torch`` (legacy) and ``torch_dcp`` and local non-persistent checkpoints are
  refused outright for HexiSeq runs.

A :class:`RunRecord` holds those facts. Megatron already pickles its ``args`` into every
checkpoint's common state, so the record of a Megatron checkpoint is derived from them
(:meth:`RunRecord.from_megatron_args`); the CPU driver stores its record under ``RECORD_KEY``.
:func:`check_before_training` (the plugin calls it at start-up, before the model is built) reads the
checkpoint ``--load`` would resume on rank 0 and raises the same one-line ``HexiSeqError`` on every rank.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

from megatron_hexiseq.errors import HexiSeqError, short

TRACKER = (
    "latest_checkpointed_iteration.txt"  # Megatron-LM's tracker file in the --save/--load folder
)
RECORD_KEY = "hexiseq_run"  # common-state key of the CPU driver's checkpoints
MODEL_FIELDS = (
    "num_layers",
    "hidden_size",
    "ffn_hidden_size",
    "num_attention_heads",
    "num_query_groups",
    "kv_channels",
    "padded_vocab_size",
    "swiglu",
    "normalization",
    "add_bias_linear",
    "untie_embeddings_and_output_weights",
    "num_experts",
    "position_embedding_type",
)
DEFAULT_BUCKET_MIN, DEFAULT_BUCKET_PER_RANK = (
    40_000_000,
    1_000_000,
)  # megatron/training/training.py get_model


@dataclass(frozen=True, kw_only=True)
class RunRecord:
    """What a checkpoint depends on: the model, the sequence length, the parallel shape and the
    memory mode (checkpoint format, optimizer and its sharding, gradient buckets)."""

    model: tuple[tuple[str, Any], ...]  # (field, value) for MODEL_FIELDS, Megatron's argument names
    seq_length: int
    world_size: int
    context_parallel_size: int
    data_parallel_size: int
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    ckpt_format: str = "torch_dist"
    use_distributed_optimizer: bool = False
    use_megatron_fsdp: bool = False
    optimizer_sharding: str | None = (
        None  # distrib_optim_sharding_type (distributed optimizer only)
    )
    bucket_size: int | None = None  # parameters per DDP bucket in effect (None: one bucket)
    num_buckets: int | None = None  # --ddp-num-buckets instead of a size
    expert_model_parallel_size: int = 1
    data_parallel_random_init: bool = False

    @property
    def dp_cp_size(self) -> int:
        """Ranks the gradients are reduced over and the distributed optimizer shards over."""
        return self.world_size // (
            self.tensor_model_parallel_size * self.pipeline_model_parallel_size
        )

    @property
    def memory_mode(self) -> str:
        if self.use_megatron_fsdp:
            return "Megatron-FSDP"
        return (
            "distributed optimizer"
            if self.use_distributed_optimizer
            else "DDP with a regular optimizer"
        )

    @property
    def planner_mode(self) -> str | None:
        """The ``megatron-hexiseq plan --memory-mode`` that produces this memory mode (None: none does)."""
        if self.use_megatron_fsdp:
            return "fsdp"
        return "distributed_optimizer" if self.use_distributed_optimizer else None

    @classmethod
    def from_megatron_args(cls, args: argparse.Namespace) -> RunRecord:
        """From Megatron-LM's parsed and validated ``args`` (a run's, or those a checkpoint holds)."""

        def get(name: str, default: Any = None) -> Any:
            return getattr(args, name, default)

        model = {name: get(name) for name in MODEL_FIELDS}
        if not get("group_query_attention", False):
            model["num_query_groups"] = get("num_attention_heads")
        tp, pp = (
            get("tensor_model_parallel_size", 1) or 1,
            get("pipeline_model_parallel_size", 1) or 1,
        )
        world = get("world_size", 1) or 1
        fmt = get("ckpt_format", "torch_dist")
        distopt = bool(get("use_distributed_optimizer", False))
        sharding = None
        if distopt:  # megatron/training/checkpointing.py _build_sharded_state_dict_metadata
            sharding = (
                "fsdp_dtensor"
                if fmt == "fsdp_dtensor"
                else "fully_reshardable"
                if get("dist_ckpt_optim_fully_reshardable", False)
                else "dp_reshardable"
            )
        size, count = None, None
        if get(
            "overlap_grad_reduce", False
        ):  # without it Megatron uses one bucket (training.py get_model)
            count = get("ddp_num_buckets")
            if count is None:
                size = get("ddp_bucket_size") or max(
                    DEFAULT_BUCKET_MIN, DEFAULT_BUCKET_PER_RANK * (world // (tp * pp))
                )
        return cls(
            model=tuple(model.items()),
            seq_length=get("seq_length"),
            world_size=world,
            context_parallel_size=get("context_parallel_size", 1) or 1,
            data_parallel_size=get("data_parallel_size", 1) or 1,
            tensor_model_parallel_size=tp,
            pipeline_model_parallel_size=pp,
            ckpt_format=fmt,
            use_distributed_optimizer=distopt,
            use_megatron_fsdp=bool(get("use_megatron_fsdp", False)),
            optimizer_sharding=sharding,
            bucket_size=size,
            num_buckets=count,
            expert_model_parallel_size=get("expert_model_parallel_size", 1) or 1,
            data_parallel_random_init=bool(get("data_parallel_random_init", False)),
        )

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["model"] = dict(self.model)
        return out

    @classmethod
    def from_dict(cls, data: object, *, source: str = "checkpoint") -> RunRecord:
        if not isinstance(data, Mapping) or not isinstance(data.get("model"), Mapping):
            raise HexiSeqError(
                f"{source}: its run record is not a mapping with a 'model' entry, got {short(data)}"
            )
        try:
            return cls(**{**data, "model": tuple((k, data["model"].get(k)) for k in MODEL_FIELDS)})
        except TypeError as e:
            raise HexiSeqError(f"{source}: cannot read its run record ({e})") from None


def _buckets(r: RunRecord) -> str:
    if r.num_buckets is not None:
        return f"{r.num_buckets} buckets (--ddp-num-buckets)"
    return (
        "one bucket (no --overlap-grad-reduce)"
        if r.bucket_size is None
        else f"{r.bucket_size:,} parameters"
    )


def _same_buckets_hint(r: RunRecord) -> str:
    if r.num_buckets is not None:
        return f"pass --ddp-num-buckets {r.num_buckets}"
    if r.bucket_size is None:
        return "drop --overlap-grad-reduce"
    return (
        f"pass --ddp-bucket-size {r.bucket_size} (an --hexiseq-overlap-config result sets it too)"
    )


def check_resume(
    saved: RunRecord,
    now: RunRecord,
    *,
    where: str = "the checkpoint",
    load_optim: bool = True,
    load_rng: bool = True,
    finetune: bool = False,
) -> None:
    """Raise a one-line HexiSeqError naming the first reason ``now`` cannot resume ``saved``.

    ``finetune`` (Megatron's ``--finetune``: weights only) checks the model alone; ``load_optim`` /
    ``load_rng`` False (``--no-load-optim`` / ``--no-load-rng``) skip the optimizer / RNG checks."""
    old, new = dict(saved.model), dict(now.model)
    for name in MODEL_FIELDS:
        if old.get(name) is not None and new.get(name) is not None and old[name] != new[name]:
            raise HexiSeqError(
                f"{where} holds a model with {name} {old[name]!r} but this run builds {new[name]!r}: "
                "resume with the model it was trained with (or train from scratch without --load)"
            )
    if finetune:
        return
    if saved.seq_length != now.seq_length:
        raise HexiSeqError(
            f"{where} was trained with --seq-length {saved.seq_length} but this run's layout is for "
            f"{now.seq_length}: re-plan the layout with --seq-length {saved.seq_length} (or pass "
            "--finetune to start a new run from its weights)"
        )
    if (saved.ckpt_format, saved.use_megatron_fsdp) != (now.ckpt_format, now.use_megatron_fsdp):
        mode = saved.planner_mode
        hint = (
            f"re-plan with --memory-mode {mode}"
            if mode
            else "run with the checkpoint's memory mode"
        )
        raise HexiSeqError(
            f"{where} is a {saved.ckpt_format} checkpoint ({saved.memory_mode}) but this run uses "
            f"--ckpt-format {now.ckpt_format} ({now.memory_mode}); neither reads the other: {hint}"
        )
    if load_optim:
        if saved.use_distributed_optimizer != now.use_distributed_optimizer:
            mode = saved.planner_mode
            hint = (
                f"re-plan with --memory-mode {mode}"
                if mode
                else "drop --use-distributed-optimizer (USE_PLANNER_FLAGS=0)"
            )
            raise HexiSeqError(
                f"{where} holds the optimizer state of a {saved.memory_mode} but this run uses a "
                f"{now.memory_mode}: {hint}, or pass --no-load-optim to start the optimizer afresh"
            )
        tp_pp = lambda r: (r.tensor_model_parallel_size, r.pipeline_model_parallel_size)  # noqa: E731
        if saved.optimizer_sharding == "dp_reshardable" and tp_pp(saved) != tp_pp(now):
            raise HexiSeqError(
                f"{where}: its distributed-optimizer state (dp_reshardable) reshards over data and "
                f"context parallel ranks only, but TP x PP changes from {tp_pp(saved)} to {tp_pp(now)}: "
                "keep --tensor/--pipeline-model-parallel-size"
            )
        if saved.optimizer_sharding == "dp_reshardable" and (
            saved.bucket_size,
            saved.num_buckets,
        ) != (now.bucket_size, now.num_buckets):
            raise HexiSeqError(
                f"{where}: its distributed-optimizer state (dp_reshardable) is stored per gradient "
                f"bucket of {_buckets(saved)} but this run's buckets hold {_buckets(now)}: "
                f"{_same_buckets_hint(saved)} (checkpoints saved with --dist-ckpt-optim-fully-reshardable "
                "do not depend on buckets)"
            )
    if load_rng and saved.dp_cp_size != now.dp_cp_size:
        if saved.expert_model_parallel_size > 1:
            raise HexiSeqError(
                f"{where}: with expert parallelism Megatron stores one RNG state per data x context "
                f"parallel rank ({saved.dp_cp_size}), this run has {now.dp_cp_size}: pass --no-load-rng"
            )
    if (
        load_rng
        and saved.data_parallel_random_init
        and saved.data_parallel_size != now.data_parallel_size
    ):
        raise HexiSeqError(
            f"{where}: --data-parallel-random-init keeps one RNG state per data-parallel rank "
            f"({saved.data_parallel_size}), this run has {now.data_parallel_size}: pass --no-load-rng"
        )


def check_options(args: argparse.Namespace) -> None:
    """Checkpoint settings a HexiSeq run refuses whatever the checkpoint (only with --save/--load)."""
    if not (getattr(args, "save", None) or getattr(args, "load", None)):
        return
    fmt = getattr(args, "ckpt_format", "torch_dist")
    if fmt == "torch":
        raise HexiSeqError(
            "--ckpt-format torch (Megatron's legacy format) is not supported with --hexiseq-layout: use "
            "--ckpt-format torch_dist (the default), whose checkpoints resume on another layout; "
            "convert old checkpoints once with --ckpt-convert-format torch_dist --ckpt-convert-save DIR"
        )
    if fmt == "torch_dcp":
        raise HexiSeqError(
            "--ckpt-format torch_dcp goes with --use-torch-fsdp2, which HexiSeq does not plan: use "
            "torch_dist (distributed optimizer) or fsdp_dtensor (--use-megatron-fsdp)"
        )
    if getattr(args, "non_persistent_ckpt_type", None) == "local":
        raise HexiSeqError(
            "--non-persistent-ckpt-type local keeps per-rank checkpoints that cannot resume on another "
            "layout: use --non-persistent-ckpt-type global"
        )


def find_checkpoint(load_dir: str, step: int | None = None) -> str | None:
    """The iteration folder Megatron-LM resumes from ``load_dir`` (its tracker file, or ``--ckpt-step``);
    None when there is none (a fresh start)."""
    if step is not None:
        folder = os.path.join(load_dir, f"iter_{step:07d}")
        return folder if os.path.isdir(folder) else None
    tracker = os.path.join(load_dir, TRACKER)
    if not os.path.isfile(tracker):
        return None
    with open(tracker, encoding="utf-8") as f:
        text = f.read().strip()
    if text == "release":
        return os.path.join(load_dir, "release")
    if not text.isdigit():
        raise HexiSeqError(
            f"{tracker} should hold an iteration number or 'release', got {short(text)}"
        )
    return os.path.join(load_dir, f"iter_{int(text):07d}")


def read_record(folder: str) -> RunRecord:
    """The run record of a checkpoint folder: ``torch_dist`` (common state) or torch DCP (``fsdp_dtensor``)."""
    from megatron.core import dist_checkpointing

    if not os.path.isdir(folder):
        raise HexiSeqError(
            f"checkpoint {folder} named by {TRACKER} does not exist; fix the tracker or the --load folder"
        )
    if dist_checkpointing.check_is_distributed_checkpoint(folder):
        common = dist_checkpointing.load_common_state_dict(folder)
    elif os.path.isfile(os.path.join(folder, ".metadata")):
        import warnings

        import torch.distributed.checkpoint as dcp

        common = {"args": None}
        with (
            warnings.catch_warnings()
        ):  # "assuming the intent is to load in a single process": it is
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(
                common, checkpoint_id=folder, no_dist=True
            )  # only the pickled args, no tensors
    elif any(name.startswith("mp_rank_") for name in os.listdir(folder)):
        raise HexiSeqError(
            f"checkpoint {folder} is in Megatron's legacy torch format, which HexiSeq runs do not "
            "resume: convert it once with --ckpt-convert-format torch_dist --ckpt-convert-save DIR"
        )
    else:
        raise HexiSeqError(
            f"{folder} is not a Megatron checkpoint (no metadata.json, .metadata or mp_rank_*)"
        )
    if RECORD_KEY in common:
        return RunRecord.from_dict(common[RECORD_KEY], source=f"checkpoint {folder}")
    if common.get("args") is not None:
        return RunRecord.from_megatron_args(common["args"])
    raise HexiSeqError(
        f"checkpoint {folder} records no arguments; it cannot be checked against this run"
    )


def on_rank0_for_all(check: Callable[[], None]) -> None:
    """Run ``check`` on global rank 0 only and raise its error on every rank (one file reader, one
    verdict). Collective over the default group when torch.distributed is initialised."""
    import torch.distributed as dist

    if not dist.is_initialized():
        check()
        return
    verdict: list[str | None] = [None]
    failure: BaseException | None = None
    if dist.get_rank() == 0:
        try:
            check()
        except (
            Exception
        ) as e:  # broadcast any failure: the other ranks must not wait in a collective
            verdict[0], failure = (
                (str(e) if isinstance(e, HexiSeqError) else f"{type(e).__name__}: {e}"),
                e,
            )
    dist.broadcast_object_list(verdict, src=0)
    if failure is not None:
        raise failure
    if verdict[0] is not None:
        raise HexiSeqError(verdict[0])


def check_before_training(args: argparse.Namespace) -> None:
    """Start-up check of a HexiSeq run: refused checkpoint settings, then, when ``--load`` names a
    checkpoint, :func:`check_resume` of its record against this run (rank 0 reads it)."""
    check_options(args)
    load = getattr(args, "load", None)
    if not load:
        return

    def check() -> None:
        folder = find_checkpoint(load, getattr(args, "ckpt_step", None))
        if folder is None:
            return
        check_resume(
            read_record(folder),
            RunRecord.from_megatron_args(args),
            where=f"checkpoint {folder}",
            load_optim=not getattr(args, "no_load_optim", False),
            load_rng=not getattr(args, "no_load_rng", False),
            finetune=bool(getattr(args, "finetune", False)),
        )

    on_rank0_for_all(check)
