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
  schedules the step, checks that every rank holds the same schedule (its digest, one all-reduce on a
  gloo side group of all ranks), plans its domain's micro-batches, builds their ``BatchPlan``s and
  this rank's token slices, and checks once per micro-batch that the domain's ranks hold the same
  layout (one all-reduce of the step's digests on the domain's gloo side group; ``agreement``). The
  training thread only takes each micro-batch, makes its boundaries and plan current and runs it;
  its time to do so (the wait and the copies) is each micro-batch's exposed host time.
- **Gradient accumulation**: a domain's micro-batches run one after another (DDP ``no_sync`` for all
  but the last), ``finalize_model_grads`` divides by the global batch's loss tokens, one AdamW step.

``train_global_rank`` is the ``run_ranks`` worker; ``train_global_reference`` the single-process
oracle (the same weights and units, each unit alone with causal attention).
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import parallel_state as mpu
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

from megatron_hexiseq.attention.documents import parse_cu_seqlens
from megatron_hexiseq.errors import HexiSeqError
from megatron_hexiseq.layout import Layout
from megatron_hexiseq.megatron.agreement import check_agreement
from megatron_hexiseq.megatron.batch_ahead import TOKEN_KEYS, Prepared
from megatron_hexiseq.megatron.batch_layout import MicroBatchLayout
from megatron_hexiseq.megatron.config import cpu_device_shim
from megatron_hexiseq.megatron.documents import MicroBatchDocuments
from megatron_hexiseq.megatron.loss import per_token_loss
from megatron_hexiseq.megatron.runtime import RunShape, build_runtime
from megatron_hexiseq.model import ModelSpec
from megatron_hexiseq.testbed.train import build_gpt, train_step
from megatron_hexiseq.testbed.train_config import TINY_GPT, TrainConfig
from megatron_hexiseq.varlen.digest import digest_ints, layout_digest


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

    @property
    def steps(self) -> int:
        return len(self.batches)

    @property
    def eod_token(self) -> int:
        return self.model.vocab_size - 1

    def train_config(self) -> TrainConfig:
        """The per-micro-batch driver's config with the same model and weights (``build_gpt``)."""
        return TrainConfig(
            model=self.model, layout=self.structure, seed=self.seed, data_parallel=self.replicas
        )


@dataclass(frozen=True)
class GlobalTrainResult:
    """Per rank: the global per-token loss and wall time of each step; per micro-batch of its
    domain the exposed host time; per step the planning thread's CPU seconds (schedule, layouts,
    plans, slices, agreement checks; not the reading of the units' tokens); its domain's
    micro-batches (unit indices, layouts); step 0's gradients when asked (rank 0)."""

    losses: list[float]
    step_times_s: list[float]
    exposed_s: list[float]
    plan_cpu_s: list[float]
    bins: list[list[tuple[int, ...]]] = field(default_factory=list)
    layouts: list[list[Layout]] = field(default_factory=list)
    grads: dict[str, torch.Tensor] | None = None


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


def micro_batch(
    cfg: GlobalTrainConfig, step: int, units: Sequence[int], ids: Sequence[int]
) -> dict[str, torch.Tensor]:
    """The micro-batch of units ``ids`` (loader order), ``[1, N]`` tensors."""
    parts = [unit_tensors(cfg, step, u, units[u]) for u in ids]
    out = {
        k: torch.cat([p[k] for p in parts]).unsqueeze(0) for k in ("tokens", "labels", "loss_mask")
    }
    out["position_ids"] = torch.arange(out["tokens"].shape[1]).unsqueeze(0)
    return out


class _Planner:
    """The planning thread of one rank (module docstring)."""

    def __init__(
        self, cfg: GlobalTrainConfig, slot: MicroBatchLayout, domain: int, world_side, domain_side
    ) -> None:
        self.cfg, self.slot, self.domain = cfg, slot, domain
        self.world_side, self.domain_side = world_side, domain_side
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
        data_s = 0.0  # reading the units' tokens: the data loader's work, not planning
        bins = self.cfg.scheme.schedule(step, units)
        check_agreement(
            [digest_ints(_flat(bins))], self.world_side, names=[f"step {step}: the schedule"]
        )
        mine = [tuple(b) for b in bins[self.domain]]
        items, digests = [], []
        for k, ids in enumerate(mine):
            lengths = [int(units[u]) for u in ids]
            layout = self.cfg.scheme.layout(self.domain, lengths)
            cu = [0, *np.cumsum(lengths).tolist()]
            bounds = parse_cu_seqlens(cu, seq_length=cu[-1], batch=1)
            plan = self.slot.plan_of(layout, bounds, any_length=True)
            t1 = time.thread_time()
            batch = micro_batch(self.cfg, step, units, ids)
            data_s += time.thread_time() - t1
            gather = torch.as_tensor(np.asarray(plan.positions, dtype=np.int64))
            tensors = {key: batch[key].index_select(1, gather) for key in TOKEN_KEYS}
            plan.host_index()
            items.append(Prepared(tensors, bounds, plan, k))
            digests.append(layout_digest(layout, cu))
        if self.domain_side is not None:
            check_agreement(
                digests,
                self.domain_side,
                names=[f"step {step} micro-batch {k}" for k in range(len(mine))],
            )
        return items, mine, time.thread_time() - t0 - data_s

    def next(self) -> tuple[list[Prepared], list[tuple[int, ...]], float]:
        kind, item = self.queue.get()
        if kind == "error":
            raise item
        return item


def _no_provider(bounds: Any) -> Layout:
    raise HexiSeqError("the global-batch driver plans every micro-batch in its planning thread")


def _flat(bins: Sequence[Sequence[Sequence[int]]]) -> list[int]:
    out: list[int] = []
    for d in bins:
        out.append(-2)
        for b in d:
            out.append(-1)
            out.extend(int(u) for u in b)
    return out


def _side_groups(world: int, size: int) -> tuple[Any, Any]:
    """Gloo side groups of the planning thread: all ranks, and this rank's domain (every rank
    creates every group in the same order)."""
    world_side = dist.new_group(list(range(world)), backend="gloo")
    mine = None
    for d in range(world // size):
        g = dist.new_group(list(range(d * size, (d + 1) * size)), backend="gloo")
        if d == dist.get_rank() // size:
            mine = g if size > 1 else None
    return world_side, mine


def train_global_rank(rank: int, world_size: int, cfg: GlobalTrainConfig) -> GlobalTrainResult:
    """``run_ranks`` worker: ``cfg.steps`` global-batch steps on ``replicas x W`` ranks."""
    W = cfg.structure.world_size
    if world_size != W * cfg.replicas:
        raise HexiSeqError(
            f"train_global_rank needs {W} x {cfg.replicas} = {W * cfg.replicas} processes, got {world_size}"
        )
    mpu.initialize_model_parallel(tensor_model_parallel_size=1, context_parallel_size=W)
    try:
        shape = RunShape(
            world_size=world_size,
            tensor_model_parallel_size=1,
            pipeline_model_parallel_size=1,
            context_parallel_size=W,
            seq_length=cfg.structure.seq_length,
            num_attention_heads=cfg.model.num_attention_heads,
            num_query_groups=cfg.model.num_query_groups,
        )
        runtime = build_runtime(
            cfg.structure, shape, cp_group=mpu.get_context_parallel_group(), kernel=cfg.kernel
        )
        documents = MicroBatchDocuments(
            seq_length=cfg.structure.seq_length,
            eod_token=cfg.eod_token,
            reset_position_ids=cfg.reset_position_ids,
            required=True,
        )
        slot = MicroBatchLayout(
            runtime.groups, _no_provider, reset_position_ids=cfg.reset_position_ids
        )
        runtime = replace(runtime, documents=documents, batch_layout=slot)
        model = build_gpt(cfg.train_config(), runtime=runtime)
        ddp_config = DistributedDataParallelConfig(
            overlap_grad_reduce=cfg.overlap_grad_reduce,
            bucket_size=cfg.bucket_size,
            grad_reduce_in_fp32=True,
        )
        with cpu_device_shim():
            ddp = DistributedDataParallel(model.config, ddp_config, model)
        params = [p for p in ddp.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(params, lr=cfg.lr)
        world_side, domain_side = _side_groups(world_size, W)
        planner = _Planner(cfg, slot, rank // W, world_side, domain_side)
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
                kept["grads"] = {
                    n: p.main_grad.detach().clone() for n, p in model.named_parameters()
                }

            want = step == 0 and cfg.return_grads and rank == 0
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
        return GlobalTrainResult(
            losses, times, exposed, cpu, all_bins, all_layouts, kept.get("grads")
        )
    finally:
        mpu.destroy_model_parallel()


def train_global_reference(rank: int, world_size: int, cfg: GlobalTrainConfig) -> GlobalTrainResult:
    """The single-process oracle (``run_ranks(train_global_reference, 1, cfg)``): every unit of
    every step alone, causal attention, loss summed over the global batch / its loss tokens."""
    if world_size != 1:
        raise HexiSeqError(f"train_global_reference runs in one process, got {world_size}")
    mpu.initialize_model_parallel(tensor_model_parallel_size=1, context_parallel_size=1)
    try:
        with cpu_device_shim():
            model = build_gpt(cfg.train_config())
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
        return GlobalTrainResult(losses, times, [], [], grads=grads)
    finally:
        mpu.destroy_model_parallel()
