"""``--hexiseq-job`` inside Megatron-LM's ``pretrain``: the job's start-up, and the training loop's
two seams a job needs (also the parameter check's).

``plugin.setup`` calls :func:`setup_job` for a job (instead of building one layout's runtime) and
:func:`install_training_seams` for every HexiSeq run that needs them. Both seams are names that
``megatron.training.training`` (Megatron-LM ``core_v0.16.1``) calls after the model is built,
replaced on that module as ``pretrain_gpt.get_batch_on_this_cp_rank`` is on its own:

- ``get_forward_backward_func`` (``train()`` and ``evaluate()`` call it once each, then call the
  schedule once per step with ``num_microbatches=get_num_microbatches()``, the job's total number
  of micro-batches): :class:`ScheduleGetter` returns the stock schedule wrapped in
  :class:`HexiSeqSchedule`, which runs this rank's domain's ``micro_batches`` instead (Megatron's
  own no-pipelining schedule then accumulates them under ``no_sync``, runs the last one with the
  gradient reduction, and calls ``finalize_model_grads`` with this rank's token count, which it
  all-reduces over ``dp_cp`` = every rank: one gradient reduction per step over every rank, after
  every domain's last backward, divided by the global batch's token count); and, with
  ``--hexiseq-check-params N``, checks the parameters after every N-th training step;
- ``build_pretraining_data_loader``: :class:`~megatron_hexiseq.megatron.job_data.JobDataLoaders`,
  this domain's share of every step's global batch.

Megatron's precedent for different micro-batch counts per rank in one step is its hybrid context
parallelism (``pipeline_parallel/hybrid_cp_schedule.py``): every rank runs its own number of
sub-samples between the same ``no_sync`` and ``finalize_model_grads``; a job does the same with
counts fixed per domain, so it needs neither its per-group barrier nor its data re-routing.
"""

from __future__ import annotations

import argparse
import warnings
from collections.abc import Callable
from datetime import timedelta
from types import ModuleType
from typing import Any

from megatron_hexiseq.errors import HexiSeqError
from megatron_hexiseq.job import JobPlan
from megatron_hexiseq.megatron.args import HexiSeqArgs
from megatron_hexiseq.megatron.job_data import JobDataLoaders
from megatron_hexiseq.megatron.job_runtime import JobPlace, build_job_runtime
from megatron_hexiseq.megatron.params_check import ParamsCheck, megatron_replica_groups
from megatron_hexiseq.megatron.runtime import HexiSeqRuntime, RunShape, nccl_comm_cfgs


def runtime_options(args: argparse.Namespace, hs: HexiSeqArgs) -> dict[str, Any]:
    """The keywords ``build_runtime`` and ``build_job_runtime`` take from Megatron's args."""
    minutes = getattr(args, "distributed_timeout_minutes", None)
    return {
        "kernel": hs.kernel,
        "comm_chunks": hs.comm_chunks,
        "allow_mismatch": hs.allow_mismatch,
        "timeout": timedelta(minutes=minutes) if minutes else None,
        "nccl_cfgs": nccl_comm_cfgs(
            getattr(args, "nccl_communicator_config_path", None),
            getattr(args, "high_priority_stream_groups", None) or (),
        ),
        "fp32_grad_wire": hs.fp32_grad_wire,
    }


FSDP_FLAGS = (
    ("--use-megatron-fsdp", "use_megatron_fsdp"),
    ("--use-torch-fsdp2", "use_torch_fsdp2"),
)


def check_job_args(args: argparse.Namespace, job: JobPlan | None = None) -> None:
    """Megatron features that assume every rank runs the same micro-batches: one line each.

    FSDP (``--use-megatron-fsdp``, ``--use-torch-fsdp2``) gathers every layer's parameters and
    reduce-scatters its gradients in every micro-batch over its shard group, ``dp_cp`` = every rank
    of a job: domains that run different numbers of micro-batches would stop joining those
    collectives at different points (a hang), so such a job is refused; with equal counts every
    rank joins them in lockstep and the job runs (slower than a per-domain shard group would)."""
    fsdp = [f for f, attr in FSDP_FLAGS if getattr(args, attr, False)]
    counts = sorted({d.micro_batches for d in job.domains}) if job is not None else []
    if fsdp and len(counts) > 1:
        raise HexiSeqError(
            f"{fsdp[0]} gathers parameters in every micro-batch over every rank, and this job's "
            f"domains run {'/'.join(map(str, counts))} micro-batches per step: they cannot join "
            "the same gathers; use the distributed optimizer (plan with --memory-mode "
            "distributed_optimizer) or a job with equal micro-batch counts"
        )
    kind = getattr(args, "dataloader_type", "single") or "single"
    if kind != "single":
        raise HexiSeqError(
            f"--dataloader-type {kind}: a job splits each step's global batch by its domains in "
            "Megatron's 'single' order (megatron/job_data.py); use --dataloader-type single"
        )
    refused = (
        (
            "rampup_batch_size",
            "--rampup-batch-size",
            "changes the global batch a job's shares are planned for",
        ),
        (
            "hybrid_context_parallel",
            "--hybrid-context-parallel",
            "re-routes sequences between ranks; a job's domains take fixed shares",
        ),
        (
            "full_validation",
            "--full-validation",
            "reads the validation set in its own data-parallel order",
        ),
        (
            "num_experts",
            "--num-experts (MoE)",
            "all-reduces its routers' load-balancing statistics over Megatron's context-parallel "
            "group in every micro-batch, and that group is every rank of a job",
        ),
    )
    for attr, flag, why in refused:
        if getattr(args, attr, None):
            raise HexiSeqError(f"{flag} {why}; drop it with --hexiseq-job")


def setup_job(
    args: argparse.Namespace, hs: HexiSeqArgs
) -> tuple[HexiSeqRuntime, JobPlace, JobPlan]:
    """Load ``--hexiseq-job``, check Megatron's flags against it, build this process's runtime
    (collective over the default group)."""
    from megatron.core import parallel_state as mpu

    assert hs.job is not None
    job = JobPlan.load(hs.job)
    check_job_args(args, job)
    tp = getattr(args, "tensor_model_parallel_size", 1) or 1
    runtime, place = build_job_runtime(
        job,
        RunShape.from_megatron_args(args),
        global_batch_size=getattr(args, "global_batch_size", None),
        micro_batch_size=getattr(args, "micro_batch_size", None),
        source=f"job {hs.job}",
        tp_group=mpu.get_tensor_model_parallel_group() if tp > 1 else None,
        **runtime_options(args, hs),
    )
    return runtime, place, job


class HexiSeqSchedule:
    """Megatron's ``forward_backward_func`` for this rank (keyword arguments, as Megatron calls
    it): ``micro_batches`` instead of the job's ``total_micro_batches`` (None: the count Megatron
    asks for), then ``params_check.after_step(model)`` after a training step."""

    def __init__(
        self,
        schedule: Callable[..., Any],
        *,
        micro_batches: int | None = None,
        total_micro_batches: int | None = None,
        params_check: ParamsCheck | None = None,
    ) -> None:
        self.schedule = schedule
        self.micro_batches = micro_batches
        self.total_micro_batches = total_micro_batches
        self.params_check = params_check

    def __call__(self, **kwargs: Any) -> Any:
        if self.micro_batches is not None:
            asked = kwargs["num_microbatches"]
            if asked != self.total_micro_batches:
                raise HexiSeqError(
                    f"Megatron runs {asked} micro-batches per step but the job's global batch has "
                    f"{self.total_micro_batches} (--global-batch-size / --micro-batch-size must be "
                    "the job's)"
                )
            kwargs["num_microbatches"] = self.micro_batches
        out = self.schedule(**kwargs)
        if self.params_check is not None and not kwargs.get("forward_only", False):
            self.params_check.after_step(kwargs["model"])
        return out


class ScheduleGetter:
    """Stands for ``get_forward_backward_func``: the stock schedule in a :class:`HexiSeqSchedule`."""

    def __init__(self, stock: Callable[..., Any], **schedule_options: Any) -> None:
        self.stock = stock
        self.schedule_options = schedule_options

    def __call__(self, *args: Any, **kwargs: Any) -> HexiSeqSchedule:
        return HexiSeqSchedule(self.stock(*args, **kwargs), **self.schedule_options)


def install_training_seams(
    training: ModuleType,
    args: argparse.Namespace,
    hs: HexiSeqArgs,
    *,
    place: JobPlace | None = None,
    job: JobPlan | None = None,
) -> None:
    """Replace ``training.get_forward_backward_func`` (a job, or ``--hexiseq-check-params N``) and
    ``training.build_pretraining_data_loader`` (a job) as the module docstring says."""
    check = None
    if hs.check_params:
        if any(getattr(args, attr, False) for _, attr in FSDP_FLAGS):
            warnings.warn(
                "hexiseq: --hexiseq-check-params has no effect with FSDP: each parameter is stored "
                "once, on one rank (checked at start-up, before sharding)",
                stacklevel=2,
            )
        else:
            check = ParamsCheck(hs.check_params, megatron_replica_groups)
    if place is None and check is None:
        return
    stock = training.get_forward_backward_func
    if isinstance(stock, ScheduleGetter):  # set up again in this process: wrap the stock once
        stock = stock.stock
    training.get_forward_backward_func = ScheduleGetter(  # type: ignore[attr-defined]
        stock,
        micro_batches=None if place is None else place.micro_batches,
        total_micro_batches=None if place is None else place.total_micro_batches,
        params_check=check,
    )
    if place is not None:
        assert job is not None
        training.build_pretraining_data_loader = JobDataLoaders(  # type: ignore[attr-defined]
            samples=place.samples,
            global_batch=job.global_batch,
            micro_batch_size=job.micro_batch_size,
            get_args=lambda: args,
        )
