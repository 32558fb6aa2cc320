"""Megatron glue: apply a saved overlap result to Megatron's args, or arrange online tuning.

``configure_from_args(args)`` is called by the plugin's ``pretrain_gpt`` entry point after
Megatron parsed its arguments and before the model and DDP are built:

* ``--hexiseq-overlap-config PATH``: load the result and set ``args.overlap_grad_reduce``,
  ``args.ddp_bucket_size`` (parameters), ``args.hexiseq_comm_chunks``,
  ``args.high_priority_stream_groups`` and, when the result has NCCL options, write
  ``PATH.nccl.yaml`` (merged over a YAML the user already passed; ours wins per group) and point
  ``args.nccl_communicator_config_path`` at it. NCCL options only act if this runs before
  ``initialize_model_parallel``; when the groups exist already it warns with the flags to pass.
* ``--hexiseq-overlap-tune``: warn when no knob can change during training (no HexiSeq
  attention). The online tuner itself belongs to the forward-step wrapper
  ``OnlineTuningStep.from_args``: it hooks the end of every training iteration (Megatron's
  ``config.finalize_model_grads_func``, which every rank of every pipeline stage passes once per
  iteration), agrees on a gloo side group (``side_group``: no CPU tensor on an NCCL group),
  drives an ``OnlineTuner`` over the knobs that can change between iterations (``comm_chunks``),
  puts the chunk count it chooses into the model's core attentions and saves the result to
  ``<args.save or .>/hexiseq_overlap.json`` (rank 0).

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
from collections.abc import Callable
from typing import Any

import torch.distributed as dist
import yaml
from megatron.core import parallel_state

from megatron_hexiseq.errors import HexiSeqError
from megatron_hexiseq.io import read_yaml, write_text_atomic
from megatron_hexiseq.overlap.knobs import Ladder, OverlapConfig, SearchSpace
from megatron_hexiseq.overlap.nccl import nccl_yaml_dict
from megatron_hexiseq.overlap.online import OnlineTuner
from megatron_hexiseq.overlap.results import TuneResult, load_result, save_result

#: Ladder of HexiSeq's chunking knob tuned online (1 = no chunking = least resources).
COMM_CHUNKS_LADDER = (1, 2, 4, 8)


def apply_config_to_args(
    config: OverlapConfig, args: argparse.Namespace, *, nccl_yaml_path: str
) -> None:
    """Set Megatron's (and the plugin's) args from ``config``; write the NCCL YAML if it has groups."""
    args.overlap_grad_reduce = config.overlap_grad_reduce
    if config.bucket_size is not None:
        if not config.overlap_grad_reduce:
            warnings.warn(
                "overlap result sets a bucket size without overlap_grad_reduce: Megatron "
                "uses one bucket then, the size has no effect",
                stacklevel=2,
            )
        args.ddp_bucket_size = config.bucket_size
        if getattr(args, "ddp_num_buckets", None) is not None:  # Megatron asserts if both are set
            warnings.warn(
                f"overlap result sets the bucket size ({config.bucket_size} parameters); "
                f"ignoring --ddp-num-buckets {args.ddp_num_buckets}",
                stacklevel=2,
            )
            args.ddp_num_buckets = None
    args.hexiseq_comm_chunks = config.comm_chunks
    groups = list(
        dict.fromkeys(
            list(getattr(args, "high_priority_stream_groups", None) or [])
            + list(config.high_priority_stream_groups)
        )
    )
    args.high_priority_stream_groups = groups
    if config.nccl:
        merged: dict[str, Any] = {}
        user = getattr(args, "nccl_communicator_config_path", None)
        if user:
            merged = dict(read_yaml(user, "NCCL communicator config") or {})
        merged.update(nccl_yaml_dict(config))
        write_text_atomic(nccl_yaml_path, yaml.safe_dump(merged, sort_keys=True))
        args.nccl_communicator_config_path = nccl_yaml_path


def _groups_exist() -> bool:
    """Whether Megatron's process groups (and so their NCCL communicators' options) exist already."""
    return bool(parallel_state.model_parallel_is_initialized())


def result_path(args: argparse.Namespace) -> str:
    """Where ``--hexiseq-overlap-tune`` saves its result."""
    return os.path.join(getattr(args, "save", None) or ".", "hexiseq_overlap.json")


def configure_from_args(args: argparse.Namespace) -> None:
    """Apply ``--hexiseq-overlap-config`` or arrange ``--hexiseq-overlap-tune`` (see module doc)."""
    path = getattr(args, "hexiseq_overlap_config", None)
    tune = bool(getattr(args, "hexiseq_overlap_tune", False))
    if path and tune:
        raise HexiSeqError(
            "use either --hexiseq-overlap-tune or --hexiseq-overlap-config, not both"
        )
    if path:
        result = load_result(path)
        apply_config_to_args(result.config, args, nccl_yaml_path=f"{path}.nccl.yaml")
        if result.config.nccl and _groups_exist():
            warnings.warn(
                f"overlap result {path}: NCCL options (min/max CTAs, high-priority streams) only "
                "take effect when Megatron creates its process groups, which already happened in "
                f"this run; pass --nccl-communicator-config-path {path}.nccl.yaml "
                f"--high-priority-stream-groups {' '.join(result.config.high_priority_stream_groups) or '<none>'} "
                "on the command line instead",
                stacklevel=2,
            )
    elif tune and not getattr(args, "hexiseq_layout", None):
        warnings.warn(
            "--hexiseq-overlap-tune: without HexiSeq attention (--hexiseq-layout) no overlap "
            "knob can change during training; tune DDP buckets offline with "
            "'megatron-hexiseq tune' and pass --hexiseq-overlap-config",
            stacklevel=2,
        )


def online_tuning_wanted(args: argparse.Namespace) -> bool:
    """``--hexiseq-overlap-tune`` with a knob that can change at run time (HexiSeq's ``comm_chunks``)."""
    return bool(
        getattr(args, "hexiseq_overlap_tune", False) and getattr(args, "hexiseq_layout", None)
    )


def side_group() -> dist.ProcessGroup | None:
    """A gloo group over every rank for the online tuner's agreement (None: a single process).

    Host tensors on a gloo group: the tuner's one small all-reduce per iteration needs no CUDA
    device and no device synchronisation, whatever backend the default group has (under NCCL a
    CPU tensor is refused). Collective: every rank of the job must call it, at the same point of
    its sequence of ``new_group`` calls (gloo connects the members when the group is created)."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return None
    return dist.new_group(backend="gloo")


def default_group() -> dist.ProcessGroup | None:
    """The default group (None: a single process): the agreement group with
    ``--disable-gloo-process-groups``. On NCCL the tuner's all-reduce then runs on the CUDA device
    (``search.collective_device``) and its result costs one device synchronisation per iteration."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return None
    return dist.group.WORLD


class _FinalizeThenTune:
    """Megatron's ``config.finalize_model_grads_func``, then the tuner's end of iteration."""

    def __init__(self, finalize: Callable[..., Any], end_of_iteration: Callable[[Any], None]):
        self.finalize, self.end_of_iteration = finalize, end_of_iteration

    def __call__(self, model: Any, *args: Any, **kwargs: Any) -> Any:
        out = self.finalize(model, *args, **kwargs)
        self.end_of_iteration(model)
        return out


class OnlineTuningStep:
    """Megatron ``forward_step_func`` wrapper that owns the online tuning state: the tuner, the
    ``comm_chunks`` it put in force, the value the model runs with, and the iteration clock.

    The decision point is the end of each training iteration, on every rank of the job, the same
    number of times: Megatron's ``config.finalize_model_grads_func``, which every schedule calls
    exactly once per ``forward_backward_func`` call that trains (never in evaluation), on every
    pipeline stage, after the last backward. (``forward_step`` itself runs a schedule-dependent
    number of times per iteration on each stage, and a non-first pipeline stage only after it
    received its activations: a collective there deadlocks the pipeline.) The wrapper's first call
    that finds ``finalize_model_grads_func`` set (Megatron's ``train()`` sets it before the first
    iteration) wraps it; ``get_config(model)`` finds the config, Megatron's ``get_model_config``
    by default.

    At the end of the first iteration ``make_group()`` builds the agreement group (a gloo side
    group over every rank, ``side_group``) and the ``OnlineTuner``; from then on the time since the
    previous end is one iteration (step time only: ``trial_from_exposed`` with y = 0), fed to the
    tuner, which may choose new ``comm_chunks``; ``apply_chunks(model, n)`` puts a changed value
    into the model chunks that ``finalize_model_grads_func`` received, before the next iteration's
    forward steps.
    """

    def __init__(
        self,
        forward_step: Callable,
        *,
        space: SearchSpace,
        apply_chunks: Callable[[Any, int], Any],
        on_done: Callable[[TuneResult], None] | None = None,
        make_group: Callable[[], dist.ProcessGroup | None] = side_group,
        get_config: Callable[[Any], Any] | None = None,
        tolerance: float = 0.05,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.forward_step, self.space, self.apply_chunks = forward_step, space, apply_chunks
        self.on_done, self.make_group, self.tolerance, self.clock = (
            on_done,
            make_group,
            tolerance,
            clock,
        )
        self._get_config = get_config
        self.installed = False
        self.tuner: OnlineTuner | None = None
        self.comm_chunks: int | None = None  # chosen by the tuner
        self.model_chunks: int | None = None  # in force in the model
        self.iteration_end_s: float | None = None

    @classmethod
    def from_args(
        cls,
        forward_step: Callable,
        args: argparse.Namespace,
        *,
        apply_chunks: Callable[[Any, int], Any],
    ) -> OnlineTuningStep:
        """The wrapper for ``--hexiseq-overlap-tune``: ``comm_chunks`` over ``COMM_CHUNKS_LADDER``,
        the result saved at ``result_path(args)`` by rank 0, agreement on a gloo side group
        (``side_group``), or on the default group when Megatron's
        ``--disable-gloo-process-groups`` says gloo is not to be used (``default_group``)."""
        space = SearchSpace(
            ladders=(Ladder(name="hexiseq_attn", knob="comm_chunks", values=COMM_CHUNKS_LADDER),)
        )
        out = result_path(args)

        def save(result: TuneResult) -> None:
            if not dist.is_initialized() or dist.get_rank() == 0:
                save_result(result, out)

        # --disable-gloo-process-groups stores False in enable_gloo_process_groups (default True)
        no_gloo = not getattr(args, "enable_gloo_process_groups", True)
        return cls(
            forward_step,
            space=space,
            apply_chunks=apply_chunks,
            on_done=save,
            make_group=default_group if no_gloo else side_group,
        )

    def _choose(self, config: OverlapConfig) -> None:
        self.comm_chunks = config.comm_chunks

    def _install(self, model: Any) -> None:
        if self._get_config is None:
            from megatron.core.utils import get_model_config

            self._get_config = get_model_config
        config = self._get_config(model)
        finalize = getattr(config, "finalize_model_grads_func", None)
        if finalize is None:  # not training yet (evaluation only): try again on the next call
            return
        if not isinstance(finalize, _FinalizeThenTune):
            config.finalize_model_grads_func = _FinalizeThenTune(finalize, self.end_of_iteration)
        self.installed = True

    def end_of_iteration(self, model: Any) -> None:
        """Every rank, once per training iteration, after its gradients are final (collective
        over the agreement group)."""
        now = self.clock()
        if self.tuner is None:
            self.tuner = OnlineTuner(
                self.space,
                self._choose,
                on_done=self.on_done,
                group=self.make_group(),
                tolerance=self.tolerance,
            )
        elif self.iteration_end_s is not None:
            step_s = now - self.iteration_end_s
            self.tuner.on_step(step_s, 0.0, [step_s] * len(self.space.ladders))
        self.iteration_end_s = now
        if self.comm_chunks is not None and self.comm_chunks != self.model_chunks:
            self.apply_chunks(model, self.comm_chunks)
            self.model_chunks = self.comm_chunks

    def __call__(self, data_iterator: Any, model: Any, *args: Any, **kwargs: Any) -> Any:
        if not self.installed:
            self._install(model)
        return self.forward_step(data_iterator, model, *args, **kwargs)
