"""Megatron glue: apply a saved overlap result to Megatron's args, or arrange online tuning.

``configure_from_args(args)`` is called by the plugin's ``pretrain_gpt`` entry point after
Megatron parsed its arguments and before the model and DDP are built:

* ``--hexiseq-overlap-config PATH``: load the result and set ``args.overlap_grad_reduce``,
  ``args.ddp_bucket_size`` (parameters), ``args.hexiseq_comm_chunks``,
  ``args.high_priority_stream_groups`` and, when the result has NCCL options, write
  ``PATH.nccl.yaml`` (merged over a YAML the user already passed; ours wins per group) and point
  ``args.nccl_communicator_config_path`` at it. NCCL options only act if this runs before
  ``initialize_model_parallel``; when the groups exist already it warns with the flags to pass.
* ``--hexiseq-overlap-tune``: attach an ``OnlineTuner`` as ``args.hexiseq_overlap_tuner`` over the
  knobs that can change between iterations (``comm_chunks`` when HexiSeq attention is on) and
  save its result to ``<args.save or .>/hexiseq_overlap.json`` (rank 0). The training loop feeds
  it through ``wrap_forward_step`` (Megatron calls ``forward_step_func`` once per micro-batch; the
  wrapper times iterations between the first micro-batches of consecutive iterations).

Not possible through seams (docs/overlap.md): Megatron's ``train()`` builds DDP buckets and NCCL
communicators once, so bucket size and CTAs are tuned offline (``megatron-hexiseq tune``) or by
consecutive launches with ``--hexiseq-overlap-config``; the GPU loop exposes no per-bucket wait
through a seam, so online trials there see the step time only (``trial_from_exposed`` with y = 0:
hill-climbing in Lagom's order).
"""
from __future__ import annotations

import argparse
import os
import time
import warnings
from typing import Any, Callable

from megatron_hexiseq.errors import HexiSeqError
from megatron_hexiseq.io import read_yaml, write_text_atomic
from megatron_hexiseq.overlap.knobs import Ladder, OverlapConfig, SearchSpace
from megatron_hexiseq.overlap.nccl import nccl_yaml_dict
from megatron_hexiseq.overlap.online import OnlineTuner
from megatron_hexiseq.overlap.results import TuneResult, load_result, save_result

#: Ladder of HexiSeq's chunking knob tuned online (1 = no chunking = least resources).
COMM_CHUNKS_LADDER = (1, 2, 4, 8)


def apply_config_to_args(config: OverlapConfig, args: argparse.Namespace, *, nccl_yaml_path: str) -> None:
    """Set Megatron's (and the plugin's) args from ``config``; write the NCCL YAML if it has groups."""
    args.overlap_grad_reduce = config.overlap_grad_reduce
    if config.bucket_size is not None:
        if not config.overlap_grad_reduce:
            warnings.warn("overlap result sets a bucket size without overlap_grad_reduce: Megatron "
                          "uses one bucket then, the size has no effect")
        args.ddp_bucket_size = config.bucket_size
        if getattr(args, "ddp_num_buckets", None) is not None:  # Megatron asserts if both are set
            warnings.warn(f"overlap result sets the bucket size ({config.bucket_size} parameters); "
                          f"ignoring --ddp-num-buckets {args.ddp_num_buckets}")
            args.ddp_num_buckets = None
    args.hexiseq_comm_chunks = config.comm_chunks
    groups = list(dict.fromkeys(list(getattr(args, "high_priority_stream_groups", None) or [])
                                + list(config.high_priority_stream_groups)))
    args.high_priority_stream_groups = groups
    if config.nccl:
        merged: dict[str, Any] = {}
        user = getattr(args, "nccl_communicator_config_path", None)
        if user:
            merged = dict(read_yaml(user, "NCCL communicator config") or {})
        merged.update(nccl_yaml_dict(config))
        import yaml

        write_text_atomic(nccl_yaml_path, yaml.safe_dump(merged, sort_keys=True))
        args.nccl_communicator_config_path = nccl_yaml_path


def _groups_exist() -> bool:
    """Whether Megatron's process groups (and so their NCCL communicators' options) exist already."""
    try:
        from megatron.core import parallel_state
    except ImportError:
        return False
    return bool(parallel_state.model_parallel_is_initialized())


def result_path(args: argparse.Namespace) -> str:
    """Where ``--hexiseq-overlap-tune`` saves its result."""
    return os.path.join(getattr(args, "save", None) or ".", "hexiseq_overlap.json")


def configure_from_args(args: argparse.Namespace) -> None:
    """Apply ``--hexiseq-overlap-config`` or arrange ``--hexiseq-overlap-tune`` (see module doc)."""
    path = getattr(args, "hexiseq_overlap_config", None)
    tune = bool(getattr(args, "hexiseq_overlap_tune", False))
    if path and tune:
        raise HexiSeqError("use either --hexiseq-overlap-tune or --hexiseq-overlap-config, not both")
    if path:
        result = load_result(path)
        apply_config_to_args(result.config, args, nccl_yaml_path=f"{path}.nccl.yaml")
        if result.config.nccl and _groups_exist():
            warnings.warn(f"overlap result {path}: NCCL options (min/max CTAs, high-priority streams) only "
                          "take effect when Megatron creates its process groups, which already happened in "
                          f"this run; pass --nccl-communicator-config-path {path}.nccl.yaml "
                          f"--high-priority-stream-groups {' '.join(result.config.high_priority_stream_groups) or '<none>'} "
                          "on the command line instead")
    elif tune:
        args.hexiseq_overlap_tuner = make_online_tuner(args)


def make_online_tuner(args: argparse.Namespace, *, group="world") -> OnlineTuner | None:
    """The online tuner for ``args`` (None, with a warning, when no knob can change at run time)."""
    if not getattr(args, "hexiseq_layout", None):
        warnings.warn("--hexiseq-overlap-tune: without HexiSeq attention (--hexiseq-layout) no overlap "
                      "knob can change during training; tune DDP buckets offline with "
                      "'megatron-hexiseq tune' and pass --hexiseq-overlap-config")
        return None
    space = SearchSpace(ladders=(Ladder(name="hexiseq_attn", knob="comm_chunks", values=COMM_CHUNKS_LADDER),))
    out = result_path(args)

    def apply(config: OverlapConfig) -> None:
        args.hexiseq_comm_chunks = config.comm_chunks

    def save(result: TuneResult) -> None:
        import torch.distributed as dist

        if not dist.is_initialized() or dist.get_rank() == 0:
            save_result(result, out)

    return OnlineTuner(space, apply, on_done=save, group=group, tolerance=0.05)


def wrap_forward_step(forward_step: Callable, tuner: OnlineTuner, num_microbatches: int) -> Callable:
    """Megatron ``forward_step_func`` that also times iterations for ``tuner`` (step time only)."""
    state = {"calls": 0, "t": None}

    def wrapped(*a: Any, **kw: Any) -> Any:
        if state["calls"] % num_microbatches == 0:
            now = time.perf_counter()
            if state["t"] is not None:
                step_s = now - state["t"]
                tuner.on_step(step_s, 0.0, [step_s] * len(tuner.space.ladders))
            state["t"] = now
        state["calls"] += 1
        return forward_step(*a, **kw)

    return wrapped
