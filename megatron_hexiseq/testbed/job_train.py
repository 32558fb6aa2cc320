"""The CPU training driver for a job: domains with their own layouts and micro-batch counts.

A job (:class:`~megatron_hexiseq.job.JobPlan`) on gloo ranks, driven by hand as Megatron-LM's
training loop drives ``--hexiseq-job`` (``megatron/job_plugin.py``):

- Megatron's grid: ``initialize_model_parallel(context_parallel_size=world)``, data-parallel size
  1, so ``dp_cp`` is every rank: DDP reduces the gradients over every rank, the per-token loss
  divides by the global batch's token count; a job over TP bundles of ``t``:
  ``tensor_model_parallel_size=t``, ``context_parallel_size=world / t`` (``dp_cp`` of each TP rank
  its TP-rank peers), Megatron's sequence parallelism inside each bundle with the CPU stand-ins of
  ``testbed/tp_cpu.py``, and the model started from TP = 1 weights (``init_params``, each TP rank
  its Megatron shard) so that a single process can be the oracle;
- ``megatron.job_runtime.build_job_runtime``: this rank's domain and local rank, every domain's
  groups (created in one order on every rank), the domain's layout for RoPE and the slicer;
- the first rank's weights on every rank (``params_check.share_initial_parameters``);
- data: :class:`SampleData` stands for the dataset (sample ``i`` is a deterministic sequence of
  ``seq_length + 1`` tokens and a loss mask with ~1/8 of the tokens out, from ``data_seed`` and
  ``i``), read through ``megatron.job_data.JobBatchSampler``, the sampler the Megatron path
  installs: each step the domain's ``micro_batches`` micro-batches, the same on every rank of the
  domain;
- each step ``train_step`` with the domain's micro-batches (all but the last under DDP's
  ``no_sync``; the last launches the overlapped reduction, which completes once every domain's
  last backward posted it), ``finalize_model_grads(num_tokens=this rank's tokens)``, AdamW.

``job_reference_rank`` is the oracle: one process, the same weights, each step's whole global batch
at once (``train.train_reference``). Checkpoints are the plain driver's (``testbed/ckpt.py``):
a job's checkpoint resumes under another job with the same global batch (the data position is
the consumed samples), or under a plain layout (``train.train_rank``).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from megatron.core import parallel_state as mpu

from megatron_hexiseq.errors import HexiSeqError
from megatron_hexiseq.job import JobPlan
from megatron_hexiseq.layout import Layout
from megatron_hexiseq.megatron.batch import slice_batch
from megatron_hexiseq.megatron.checkpoint import RunRecord
from megatron_hexiseq.megatron.job_data import JobBatchSampler
from megatron_hexiseq.megatron.job_runtime import build_job_runtime
from megatron_hexiseq.megatron.params_check import broadcast_parameters, check_same_parameters
from megatron_hexiseq.megatron.runtime import RunShape
from megatron_hexiseq.model import ModelSpec
from megatron_hexiseq.testbed import ckpt
from megatron_hexiseq.testbed.tp_cpu import cpu_sequence_parallel
from megatron_hexiseq.testbed.train import (
    build_gpt,
    ddp_and_optimizer,
    train_reference,
    train_step,
)
from megatron_hexiseq.testbed.train_config import TINY_GPT, TrainConfig, TrainResult


@dataclass(frozen=True, kw_only=True)
class JobTrainConfig:
    """One training run of a job: the job, the optimizer, the data, DDP knobs, test hooks."""

    model: ModelSpec = TINY_GPT
    job: JobPlan
    steps: int = 3
    lr: float = 1e-3
    seed: int = 1234
    data_seed: int = 99
    bucket_size: int | None = 2_000
    overlap_grad_reduce: bool = True
    kernel: str = "reference"
    comm_chunks: int = 1
    return_grads: bool = False  # rank 0 returns step 0's reduced gradients
    return_params: bool = False  # rank 0 returns the parameters (and AdamW's state) at the end
    save_dir: str | None = None
    save_at_step: int | None = None
    load_dir: str | None = None
    broadcast_params: bool = True  # the first rank's weights everywhere (False: tests only)
    perturb_rank: int | None = None  # this rank's first weight moves one ULP before the broadcast
    # TP = 1 weights (the reference's initial_params): each TP rank starts from its shard
    init_params: Mapping[str, torch.Tensor] | None = field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if (self.save_dir is None) != (self.save_at_step is None):
            raise HexiSeqError("JobTrainConfig: give save_dir and save_at_step together")
        if self.save_at_step is not None and not 1 <= self.save_at_step <= self.steps:
            raise HexiSeqError(
                f"JobTrainConfig: save_at_step must be in 1..steps={self.steps}, got {self.save_at_step}"
            )

    @property
    def world_size(self) -> int:
        return len(self.job.run_ranks)

    @property
    def tp(self) -> int:
        return self.job.tensor_model_parallel_size

    def domain_config(self, layout: Layout) -> TrainConfig:
        """The plain driver's config of one domain (model building and checkpoint files)."""
        return TrainConfig(
            model=self.model,
            layout=layout,
            micro_batch_size=self.job.micro_batch_size,
            steps=self.steps,
            lr=self.lr,
            seed=self.seed,
            data_seed=self.data_seed,
            bucket_size=self.bucket_size,
            overlap_grad_reduce=self.overlap_grad_reduce,
            kernel=self.kernel,
            comm_chunks=self.comm_chunks,
            save_dir=self.save_dir,
            save_at_step=self.save_at_step,
            load_dir=self.load_dir,
            tensor_model_parallel_size=self.tp,
            init_params=self.init_params,
        )

    def run_shape(self) -> RunShape:
        """Megatron's view of the job's run: one context-parallel group of every bundle per TP
        rank (t = 1: of every rank)."""
        W, t = self.world_size, self.tp
        return RunShape(
            world_size=W,
            tensor_model_parallel_size=t,
            pipeline_model_parallel_size=1,
            context_parallel_size=W // t,
            seq_length=self.job.seq_length,
            num_attention_heads=self.model.num_attention_heads,
            num_query_groups=self.model.num_query_groups,
            sequence_parallel=t > 1,
        )

    def run_record(self) -> RunRecord:
        """The checkpoint record of the job's run (TP = t, CP = world / t, DP = 1)."""
        base = ckpt.run_record(self.domain_config(self.job.domains[0].layout)).to_dict()
        W, t = self.world_size, self.tp
        return RunRecord.from_dict(
            base
            | {
                "world_size": W,
                "context_parallel_size": W // t,
                "data_parallel_size": 1,
                "tensor_model_parallel_size": t,
            }
        )


class SampleData:
    """The synthetic dataset: sample ``i`` is a deterministic function of ``data_seed`` and ``i``."""

    def __init__(self, model: ModelSpec, seq_length: int, data_seed: int) -> None:
        self.vocab_size = model.vocab_size
        self.seq_length = seq_length
        self.data_seed = data_seed

    def sample(self, index: int) -> dict[str, torch.Tensor]:
        S = self.seq_length
        g = torch.Generator().manual_seed(self.data_seed * 1_000_003 + index * 7919 + 17)
        text = torch.randint(0, self.vocab_size, (S + 1,), generator=g)
        return {
            "tokens": text[:-1],
            "labels": text[1:],
            "loss_mask": (torch.rand(S, generator=g) > 0.125).float(),
            "position_ids": torch.arange(S),
        }

    def batch(self, indices: list[int] | range) -> dict[str, torch.Tensor]:
        """Samples ``indices`` stacked: ``[len(indices), S]`` per key."""
        parts = [self.sample(i) for i in indices]
        return {k: torch.stack([p[k] for p in parts]) for k in parts[0]}


def train_job_rank(rank: int, world_size: int, cfg: JobTrainConfig) -> TrainResult:
    """``run_ranks`` worker: train ``cfg.steps`` steps of ``cfg.job`` on its run ranks."""
    if world_size != cfg.world_size:
        raise HexiSeqError(f"the job runs on {cfg.world_size} ranks, got {world_size} processes")
    t = cfg.tp
    mpu.initialize_model_parallel(
        tensor_model_parallel_size=t, context_parallel_size=world_size // t
    )
    try:
        with cpu_sequence_parallel() if t > 1 else contextlib.nullcontext():
            return _train_job_rank(rank, cfg)
    finally:
        mpu.destroy_model_parallel()


def _train_job_rank(rank: int, cfg: JobTrainConfig) -> TrainResult:
    """Body of :func:`train_job_rank` (model-parallel state initialised). With TP the first t
    process ranks (one bundle: each TP rank once) return gradients and parameters."""
    job, t = cfg.job, cfg.tp
    record = cfg.run_record()
    domain_cfg = cfg.domain_config(job.domains[0].layout)
    resume_from = ckpt.check_checkpoint(domain_cfg, record=record) if cfg.load_dir else None
    runtime, place = build_job_runtime(
        job,
        cfg.run_shape(),
        kernel=cfg.kernel,
        comm_chunks=cfg.comm_chunks,
        tp_group=mpu.get_tensor_model_parallel_group() if t > 1 else None,
    )
    model = build_gpt(cfg.domain_config(runtime.layout), runtime=runtime)
    # every rank (t = 1), or the TP-rank peers of every bundle
    dp_cp = mpu.get_data_parallel_group(with_context_parallel=True)
    if cfg.perturb_rank == rank:
        with torch.no_grad():
            w = next(model.parameters()).view(-1)
            w[0] = torch.nextafter(w[0], torch.tensor(float("inf")))
    if cfg.broadcast_params:
        broadcast_parameters(model, group=dp_cp)
    check_same_parameters(model, group=dp_cp, when="at start-up")
    ddp, params, opt = ddp_and_optimizer(
        model, bucket_size=cfg.bucket_size, overlap=cfg.overlap_grad_reduce, lr=cfg.lr
    )
    start, consumed = 0, 0
    keep = cfg.return_params and rank < t
    resumed = None
    if resume_from is not None:
        start = ckpt.load_checkpoint(resume_from, model, opt, dp_cp_group=dp_cp)
        consumed = consumed_samples(resume_from, start, job)
        resumed = ckpt.snapshot(model, opt) if keep else None
    sampler = JobBatchSampler(
        total_samples=consumed + (cfg.steps - start) * job.global_batch,
        consumed_samples=consumed,
        micro_batch_size=job.micro_batch_size,
        global_batch=job.global_batch,
        samples=place.samples,
    )
    data = SampleData(cfg.model, job.seq_length, cfg.data_seed)
    indices = iter(sampler)
    kept: dict[str, dict[str, torch.Tensor]] = {}
    losses, times = [], []
    for step in range(start, cfg.steps):
        t0 = time.perf_counter()
        micro = [
            slice_batch(
                data.batch(next(indices)),
                segments=runtime.segments,
                seq_length=job.seq_length,
            )
            for _ in range(place.micro_batches)
        ]
        want = step == 0 and cfg.return_grads and rank < t
        report, _ = train_step(
            ddp,
            opt,
            params,
            micro,
            report_group=dp_cp,
            before_update=(lambda: kept.update(grads=_main_grads(model))) if want else None,
        )
        times.append(time.perf_counter() - t0)
        losses.append(float(report[0] / report[1]))
        if cfg.save_dir is not None and step + 1 == cfg.save_at_step:
            ckpt.save_checkpoint(
                domain_cfg,
                model,
                opt,
                step + 1,
                dp_cp_group=dp_cp,
                record=record,
                consumed_samples=consumed + (step + 1 - start) * job.global_batch,
            )
    final = ckpt.snapshot(model, opt) if keep else {}
    return TrainResult(
        losses,
        times,
        kept.get("grads"),
        final.get("params"),
        start_step=start,
        opt_state=final.get("opt_state"),
        resumed=resumed,
    )


def _main_grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The reduced gradients (Megatron DDP's ``main_grad`` views of its gradient buffers)."""
    return {
        n: p.main_grad.detach().clone()  # type: ignore[attr-defined]
        for n, p in model.named_parameters()
    }


def consumed_samples(folder: str, steps_done: int, job: JobPlan) -> int:
    """The data position a checkpoint resumes at: its consumed samples, or (a plain driver's
    checkpoint) its steps x this job's global batch."""
    from megatron.core import dist_checkpointing

    with ckpt.checkpoint_shim():
        data = dist_checkpointing.load_common_state_dict(folder)["data"]
    consumed = data.get("consumed_samples")
    return int(consumed) if consumed is not None else steps_done * job.global_batch


def job_reference_rank(rank: int, world_size: int, cfg: JobTrainConfig) -> TrainResult:
    """``run_ranks(job_reference_rank, 1, cfg)``: one process, each step's whole global batch."""
    if world_size != 1:
        raise HexiSeqError(f"job_reference_rank runs in one process, got {world_size}")
    job = cfg.job
    data = SampleData(cfg.model, job.seq_length, cfg.data_seed)
    B = job.global_batch

    def global_batch(step: int) -> dict[str, torch.Tensor]:
        return data.batch(range(step * B, (step + 1) * B))

    base = cfg.domain_config(job.domains[0].layout)
    return train_reference(
        TrainConfig(
            model=base.model,
            layout=base.layout,
            steps=cfg.steps,
            lr=cfg.lr,
            seed=cfg.seed,
            data_seed=cfg.data_seed,
            return_grads=cfg.return_grads,
            return_params=cfg.return_params,
            tensor_model_parallel_size=base.tensor_model_parallel_size,  # the model is TP = 1
        ),
        global_batch,
    )


def train_job_rank_many(
    rank: int, world_size: int, cfgs: list[JobTrainConfig]
) -> list[TrainResult | str]:
    """Several job runs in one spawn; a run that stops with a ``HexiSeqError`` gives its message
    (every rank raises the same one: the runs after it still line up)."""
    out: list[TrainResult | str] = []
    for cfg in cfgs:
        try:
            out.append(train_job_rank(rank, world_size, cfg))
        except HexiSeqError as e:
            out.append(str(e))
            dist.barrier()
    return out
