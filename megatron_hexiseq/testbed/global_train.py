"""Global-batch training on the CPU testbed: each step's documents scheduled over domains.

The driver of ``testbed/train.py`` (a megatron-core GPT, Megatron DDP, ``finalize_model_grads``,
AdamW over gloo) with a global batch per step instead of one micro-batch per replica:

- **Domains** are Megatron's data-parallel replicas of one structure (``cfg.structure``, replica 0's
  hosts): process rank ``replica * W + j`` is local rank ``j`` of domain ``replica``. The groups are
  built once from the structure; every micro-batch runs its own layout on them.
- **The step's units** (``cfg.batches[step]``: document lengths in loader order) are scheduled by
  ``cfg.scheme`` (``schedule(units) -> bins[d][k]``: unit indices; ``layout(d, lengths)``: the
  micro-batch's layout in the structure's hosts), every rank computing the same schedule.
- **Each rank reads exactly its documents** (the decision: no all-to-all of tokens): a unit's tokens
  are a deterministic function of (data seed, step, unit) (``unit_tensors``; the last token is EOD),
  so a rank builds its micro-batches from its domain's bins alone.
- **Planned ahead, off the training thread**: a planning thread, up to ``cfg.depth`` steps ahead,
  schedules the step, reads its domain's units, and runs the library's per-step preparation
  (``megatron.global_ahead.StepPreparer``, what a Megatron run with ``--hexiseq-global-batch``
  executes): checks that every rank holds the same schedule (its digest, one all-reduce on a
  gloo side group of all ranks), plans its domain's micro-batches, builds their ``BatchPlan``s
  and this rank's token slices, and checks once per micro-batch that the domain's ranks hold the
  same layout (one all-reduce of the step's digests on the domain's gloo side group). The
  training thread only takes each micro-batch, makes its boundaries and plan current and runs it;
  its time to do so (the wait and the copies) is each micro-batch's exposed host time.
- **Gradient accumulation**: a domain's micro-batches run one after another (DDP ``no_sync`` for all
  but the last), ``finalize_model_grads`` divides by the global batch's loss tokens, one AdamW step.

``train_global_rank`` is the ``run_ranks`` worker; ``train_global_reference`` the single-process
oracle (the same weights and units, each unit alone with causal attention).
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch
from megatron.core import parallel_state as mpu

from megatron_hexiseq.errors import HexiSeqError
from megatron_hexiseq.layout import Layout
from megatron_hexiseq.megatron.batch_ahead import Prepared
from megatron_hexiseq.megatron.batch_layout import MicroBatchLayout
from megatron_hexiseq.megatron.config import cpu_device_shim
from megatron_hexiseq.megatron.documents import MicroBatchDocuments
from megatron_hexiseq.megatron.global_ahead import (
    StepPreparer,
    global_slot,
    replica_ranks,
    side_groups,
)
from megatron_hexiseq.megatron.global_data import GlobalStep, StepUnits
from megatron_hexiseq.megatron.loss import per_token_loss
from megatron_hexiseq.megatron.runtime import build_runtime
from megatron_hexiseq.model import ModelSpec
from megatron_hexiseq.testbed.tp_cpu import cpu_sequence_parallel
from megatron_hexiseq.testbed.train import build_gpt, ddp_and_optimizer, run_shape, train_step
from megatron_hexiseq.testbed.train_config import TINY_GPT, TrainConfig


@dataclass(frozen=True, kw_only=True)
class GlobalTrainConfig:
    """One global-batch training run (module docstring). ``scheme``: picklable, with
    ``schedule(step, units) -> bins`` and ``layout(domain, lengths) -> Layout``."""

    model: ModelSpec = TINY_GPT
    structure: Layout
    replicas: int
    batches: tuple[tuple[int, ...], ...]
    scheme: Any
    lr: float = 1e-3
    seed: int = 1234
    data_seed: int = 99
    kernel: str = "auto"
    bucket_size: int | None = None
    overlap_grad_reduce: bool = True
    reset_position_ids: bool = False
    depth: int = 2  # steps the planning thread may run ahead
    return_grads: bool = False  # rank 0: the gradients of step 0 (for equivalence tests)
    # TP bundles of t (``structure`` over bundles), Megatron's sequence parallelism inside with the
    # CPU stand-ins of testbed/tp_cpu.py; init_params: TP = 1 weights (each TP rank its shard)
    tensor_model_parallel_size: int = 1
    init_params: Mapping[str, torch.Tensor] | None = field(default=None, compare=False, repr=False)

    @property
    def steps(self) -> int:
        return len(self.batches)

    @property
    def eod_token(self) -> int:
        return self.model.vocab_size - 1

    def train_config(self) -> TrainConfig:
        """The per-micro-batch driver's config with the same model and weights (``build_gpt``)."""
        return TrainConfig(
            model=self.model,
            layout=self.structure,
            seed=self.seed,
            data_parallel=self.replicas,
            tensor_model_parallel_size=self.tensor_model_parallel_size,
            init_params=self.init_params,
        )


@dataclass(frozen=True)
class GlobalTrainResult:
    """Per rank: the global per-token loss and wall time of each step; per micro-batch of its
    domain the exposed host time; per step the planning thread's CPU seconds (schedule, layouts,
    plans, slices, agreement checks; not the reading of the units' tokens); its domain's
    micro-batches (unit indices, layouts); step 0's gradients when asked (process ranks 0..t-1:
    replica 0's bundle 0, one per TP rank); the reference's initial weights."""

    losses: list[float]
    step_times_s: list[float]
    exposed_s: list[float]
    plan_cpu_s: list[float]
    bins: list[list[tuple[int, ...]]] = field(default_factory=list)
    layouts: list[list[Layout]] = field(default_factory=list)
    grads: dict[str, torch.Tensor] | None = None
    initial_params: dict[str, torch.Tensor] | None = None


def unit_tensors(
    cfg: GlobalTrainConfig, step: int, unit: int, length: int
) -> dict[str, torch.Tensor]:
    """Unit ``unit`` of step ``step``: ``tokens / labels / loss_mask`` ``[length]``, the same on
    every rank (the last token is EOD; about 1 in 8 tokens out of the loss)."""
    g = torch.Generator().manual_seed(cfg.data_seed * 1_000_003 + step * 100_003 + unit)
    text = torch.randint(0, cfg.eod_token, (length + 1,), generator=g)
    text[length - 1] = cfg.eod_token
    mask = (torch.rand(length, generator=g) > 0.125).float()
    return {"tokens": text[:-1], "labels": text[1:], "loss_mask": mask}


class _Planner:
    """The planning thread of one rank (module docstring): the library's per-step preparation
    (``megatron.global_ahead.StepPreparer``, what a Megatron run executes) on a step whose batch
    holds only this domain's units (each rank reads exactly its documents)."""

    def __init__(
        self, cfg: GlobalTrainConfig, slot: MicroBatchLayout, domain: int, world_side, domain_side
    ) -> None:
        self.cfg, self.domain = cfg, domain
        self.world_side, self.domain_side = world_side, domain_side
        self.prepare = StepPreparer(cfg.scheme, domain, slot, pin=False)
        self.queue: queue.Queue = queue.Queue(maxsize=max(1, cfg.depth))
        self.thread = threading.Thread(target=self._run, name="hexiseq-global-plan", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            for step, units in enumerate(self.cfg.batches):
                self.queue.put(("ok", self._step(step, units)))
        except BaseException as e:  # raised in the training thread
            self.queue.put(("error", e))

    def _step(
        self, step: int, units: Sequence[int]
    ) -> tuple[list[Prepared], list[tuple[int, ...]], float]:
        t0 = time.thread_time()
        bins = tuple(tuple(tuple(b) for b in d) for d in self.cfg.scheme.schedule(step, units))
        mine = list(bins[self.domain])
        t1 = time.thread_time()  # reading the units' tokens: the data loader's work, not planning
        batch, where = _domain_batch(self.cfg, step, units, [u for b in mine for u in b])
        data_s = time.thread_time() - t1
        got = GlobalStep(step, batch, where, bins)
        items = self.prepare(got, self.world_side, self.domain_side)
        return list(items), mine, time.thread_time() - t0 - data_s

    def next(self) -> tuple[list[Prepared], list[tuple[int, ...]], float]:
        kind, item = self.queue.get()
        if kind == "error":
            raise item
        return item


def _domain_batch(
    cfg: GlobalTrainConfig, step: int, units: Sequence[int], ids: Sequence[int]
) -> tuple[dict[str, torch.Tensor], StepUnits]:
    """The step's units as one ``[1, sum(units)]`` sample in loader order, with only units
    ``ids`` read (``unit_tensors``; the others stay zero: no rank reads another domain's
    documents), and where every unit sits in it."""
    starts = [0, *np.cumsum(units).tolist()]
    total = starts[-1]
    batch = {
        "tokens": torch.zeros(1, total, dtype=torch.long),
        "labels": torch.zeros(1, total, dtype=torch.long),
        "loss_mask": torch.zeros(1, total),
        "position_ids": torch.zeros(1, total, dtype=torch.long),
    }
    for u in ids:
        a, b = starts[u], starts[u + 1]
        for key, value in unit_tensors(cfg, step, u, b - a).items():
            batch[key][0, a:b] = value
        batch["position_ids"][0, a:b] = torch.arange(b - a)
    n = len(units)
    where = StepUnits((0,) * n, tuple(starts[:-1]), tuple(int(x) for x in units), total)
    return batch, where


def train_global_rank(rank: int, world_size: int, cfg: GlobalTrainConfig) -> GlobalTrainResult:
    """``run_ranks`` worker: ``cfg.steps`` global-batch steps on ``replicas x W`` ranks (x t:
    TP bundles, Megatron's grid: process rank ``tp + t (j + W replica)``)."""
    W, t = cfg.structure.world_size, cfg.tensor_model_parallel_size
    if world_size != W * cfg.replicas * t:
        raise HexiSeqError(
            f"train_global_rank needs {W} x {cfg.replicas} x {t} = {W * cfg.replicas * t} "
            f"processes, got {world_size}"
        )
    mpu.initialize_model_parallel(tensor_model_parallel_size=t, context_parallel_size=W)
    try:
        with cpu_sequence_parallel() if t > 1 else contextlib.nullcontext():
            return _train_global_rank(rank, cfg)
    finally:
        mpu.destroy_model_parallel()


def _train_global_rank(rank: int, cfg: GlobalTrainConfig) -> GlobalTrainResult:
    """Body of ``train_global_rank`` (model-parallel state initialised)."""
    W, t = cfg.structure.world_size, cfg.tensor_model_parallel_size
    runtime = build_runtime(
        cfg.structure,
        run_shape(cfg.train_config()),
        cp_group=mpu.get_context_parallel_group(),
        kernel=cfg.kernel,
        tp_group=mpu.get_tensor_model_parallel_group() if t > 1 else None,
    )
    documents = MicroBatchDocuments(
        seq_length=cfg.structure.seq_length,
        eod_token=cfg.eod_token,
        reset_position_ids=cfg.reset_position_ids,
        required=True,
    )
    slot = global_slot(
        runtime.groups, reset_position_ids=cfg.reset_position_ids, tokens_multiple_of=t
    )
    runtime = replace(runtime, documents=documents, batch_layout=slot)
    model = build_gpt(cfg.train_config(), runtime=runtime)
    ddp, params, opt = ddp_and_optimizer(
        model, bucket_size=cfg.bucket_size, overlap=cfg.overlap_grad_reduce, lr=cfg.lr
    )
    size = W * t  # a replica's process ranks (its bundles' GPUs), consecutive
    replicas = [list(range(d * size, (d + 1) * size)) for d in range(cfg.replicas)]
    # what a Megatron run computes (global_ahead.run_global_batches)
    assert replica_ranks(mpu.get_context_parallel_group(), t) == replicas
    world_side, domain_side = side_groups(replicas)
    planner = _Planner(cfg, slot, rank // size, world_side, domain_side)
    device = torch.device("cpu")
    losses, times, exposed, cpu, all_bins, all_layouts = [], [], [], [], [], []
    kept: dict[str, dict[str, torch.Tensor]] = {}
    for step in range(cfg.steps):
        t_start = time.perf_counter()
        items, mine, plan_s = planner.next()
        waited = time.perf_counter() - t_start
        batches = [
            {key: v.to(device, non_blocking=True) for key, v in item.tensors.items()}
            for item in items
        ]

        def activate(k: int, items=items, waited=waited) -> None:
            """Micro-batch k's boundaries and plan become current (the core attention and
            RoPE read them); its index goes to the device: the exposed host time."""
            t0 = time.perf_counter()
            documents.bounds = items[k].bounds
            slot.plan = items[k].plan
            items[k].plan.indices(device)
            exposed.append((waited if k == 0 else 0.0) + time.perf_counter() - t0)

        def keep_grads() -> None:
            kept["grads"] = {n: p.main_grad.detach().clone() for n, p in model.named_parameters()}

        want = step == 0 and cfg.return_grads and rank < t
        report, _ = train_step(
            ddp,
            opt,
            params,
            batches,
            before_micro_batch=activate,
            before_update=keep_grads if want else None,
        )
        times.append(time.perf_counter() - t_start)
        losses.append(float(report[0] / report[1]))
        cpu.append(plan_s)
        all_bins.append(mine)
        all_layouts.append([item.plan.layout for item in items])
    return GlobalTrainResult(losses, times, exposed, cpu, all_bins, all_layouts, kept.get("grads"))


def train_global_reference(rank: int, world_size: int, cfg: GlobalTrainConfig) -> GlobalTrainResult:
    """The single-process oracle (``run_ranks(train_global_reference, 1, cfg)``): every unit of
    every step alone, causal attention, loss summed over the global batch / its loss tokens."""
    if world_size != 1:
        raise HexiSeqError(f"train_global_reference runs in one process, got {world_size}")
    mpu.initialize_model_parallel(tensor_model_parallel_size=1, context_parallel_size=1)
    try:
        with cpu_device_shim():
            model = build_gpt(cfg.train_config())
            initial = {n: q.detach().clone() for n, q in model.named_parameters()}
            opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
            losses, times, grads = [], [], None
            for step, units in enumerate(cfg.batches):
                t0 = time.perf_counter()
                opt.zero_grad(set_to_none=True)
                parts = [unit_tensors(cfg, step, u, n) for u, n in enumerate(units)]
                total = sum(float(p["loss_mask"].sum()) for p in parts)
                loss_all = 0.0
                for p in parts:
                    n = p["tokens"].numel()
                    out = model(
                        p["tokens"][None], torch.arange(n)[None], None, labels=p["labels"][None]
                    )
                    loss_sum, _ = per_token_loss(out, p["loss_mask"][None])
                    (loss_sum / total).backward()
                    loss_all += float(loss_sum.detach())
                if step == 0 and cfg.return_grads:
                    grads = {n: q.grad.detach().clone() for n, q in model.named_parameters()}
                opt.step()
                losses.append(loss_all / total)
                times.append(time.perf_counter() - t0)
        return GlobalTrainResult(losses, times, [], [], grads=grads, initial_params=initial)
    finally:
        mpu.destroy_model_parallel()
