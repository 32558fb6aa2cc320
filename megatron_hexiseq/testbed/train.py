"""A small CPU training driver: a small megatron-core GPT + Megatron DDP + AdamW over gloo.

It drives by hand what Megatron's training loop does on GPU (the loop itself does not run on CPU,
see /work/shared/MEGATRON_NOTES.md): slice each replica's batch by the layout, forward, per-token
loss sum, backward with Megatron ``DistributedDataParallel`` (``overlap_grad_reduce``, small
buckets), ``finalize_model_grads(num_tokens=...)``, ``torch.optim.AdamW`` on the gradient buffers.

Use it from any ``run_ranks`` worker::

    from megatron_hexiseq.testbed.spawn import run_ranks
    from megatron_hexiseq.testbed.train import TrainConfig, train_rank
    cfg = TrainConfig(model=model_spec, layout=layout, steps=3)  # default model: TINY_GPT
    results = run_ranks(train_rank, layout.world_size * cfg.data_parallel, cfg)
    results[0].losses, results[0].step_times_s

``train_reference(cfg)`` trains the same model (same seed, same data) in ONE process over the
unsharded sequences (every replica's batch at once, plain autograd, stock-free local attention):
the oracle the parallel run must match. World size = ``layout.world_size x data_parallel``.

The model is a :class:`~megatron_hexiseq.model.ModelSpec`, built into Megatron's config by
:func:`megatron_hexiseq.megatron.config.transformer_config` (RoPE, fp32); the layout's sequence
length is the one trained. Run description and results: :mod:`megatron_hexiseq.testbed.train_config`.

Checkpoints (``save_dir``/``save_at_step``, ``load_dir``; :mod:`megatron_hexiseq.testbed.ckpt`) are megatron-core
``torch_dist`` checkpoints that resume on any layout and world size.

Packed documents (``cfg.documents``): each micro-batch's documents end with the EOD token; the ranks
run the Megatron boundary's own path: ``LayoutBatchSlicer`` reads the boundaries from the EOD tokens
of the whole micro-batch (``--reset-attention-mask``), and with ``cfg.batch_layouts`` asks for that
micro-batch's layout (``megatron/batch_layout.py``: every step its own segments on the groups built
once from ``cfg.layout``); RoPE and the core attention follow. The oracle masks its dense attention
with the same boundaries.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import parallel_state as mpu
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.distributed.finalize_model_grads import finalize_model_grads
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules

from megatron_hexiseq.attention.documents import DocumentBounds
from megatron_hexiseq.errors import HexiSeqError
from megatron_hexiseq.layout import Layout
from megatron_hexiseq.megatron.batch import LayoutBatchSlicer, slice_batch
from megatron_hexiseq.megatron.batch_layout import MicroBatchLayout
from megatron_hexiseq.megatron.config import cpu_device_shim, transformer_config
from megatron_hexiseq.megatron.documents import MicroBatchDocuments
from megatron_hexiseq.megatron.loss import per_token_loss
from megatron_hexiseq.megatron.params_check import share_initial_parameters
from megatron_hexiseq.megatron.reference_attention import LocalCausalAttention
from megatron_hexiseq.megatron.rope import install_rope
from megatron_hexiseq.megatron.runtime import HexiSeqRuntime, RunShape, build_runtime
from megatron_hexiseq.megatron.spec import hexiseq_spec
from megatron_hexiseq.testbed import ckpt
from megatron_hexiseq.testbed.tp_cpu import (
    cpu_sequence_parallel,
    load_tp_slices,
    sequence_parallel_spec,
)
from megatron_hexiseq.testbed.train_config import TINY_GPT, TrainConfig, TrainResult

__all__ = [
    "TINY_GPT",
    "TrainConfig",
    "TrainResult",
    "StepTiming",
    "train_step",
    "make_batch",
    "ddp_and_optimizer",
    "build_gpt",
    "run_shape",
    "train_rank",
    "train_reference",
    "reference_rank",
    "train_rank_many",
    "reference_rank_many",
]


@dataclass(frozen=True)
class StepTiming:
    """Wall time of one driver step, split at the collectives."""

    local_s: float  # zero grads, forward, loss, backward, optimizer step
    sync_s: float  # finalize_model_grads (gradient reduction) + the loss/token all-reduce


def train_step(
    ddp,
    opt,
    params,
    batch: Mapping[str, torch.Tensor] | Sequence[Mapping[str, torch.Tensor]],
    *,
    report_group=None,
    before_update=None,
    before_micro_batch: Callable[[int], None] | None = None,
) -> tuple[torch.Tensor, StepTiming]:
    """One step of the driver: zero the grad buffers; forward, per-token loss sum and backward of
    each micro-batch (``batch``: one, or a list: all but the last under DDP's ``no_sync``, as
    Megatron's schedule accumulates them); ``finalize_model_grads`` (sums gradients, divides by the
    global token count) and the all-reduce of ``[loss_sum, num_tokens]`` over ``report_group``;
    ``before_update()`` if given; AdamW on the gradient buffers. ``before_micro_batch(i)`` runs
    before micro-batch ``i`` (the global-batch driver makes its plan current there). Returns the
    reduced ``report [2]``
    (global loss sum, token count) and the timing. Used by :func:`train_rank`, the job driver
    (``testbed/job_train.py``), ``profile``'s model-step measurement and the overlap bench."""
    batches = [batch] if isinstance(batch, Mapping) else list(batch)
    t0 = time.perf_counter()
    ddp.zero_grad_buffer()
    opt.zero_grad(set_to_none=True)
    loss_sum = num_tokens = torch.zeros((), dtype=torch.int)
    for i, micro in enumerate(batches):
        if before_micro_batch is not None:
            before_micro_batch(i)
        last = i == len(batches) - 1
        with contextlib.nullcontext() if last else ddp.no_sync():
            out = ddp(micro["tokens"], micro["position_ids"], None, labels=micro["labels"])
            micro_loss, micro_tokens = per_token_loss(out, micro["loss_mask"])
            micro_loss.backward()
        loss_sum, num_tokens = loss_sum + micro_loss.detach(), num_tokens + micro_tokens
    t1 = time.perf_counter()
    finalize_model_grads([ddp], num_tokens=num_tokens.clone())  # sums grads, / global tokens
    report = torch.stack([loss_sum.detach(), num_tokens.float()])
    dist.all_reduce(report, group=report_group)
    t2 = time.perf_counter()
    for p in params:
        p.grad = p.main_grad
    if before_update is not None:
        before_update()
    opt.step()
    return report, StepTiming(local_s=t1 - t0 + time.perf_counter() - t2, sync_s=t2 - t1)


def make_batch(cfg: TrainConfig, step: int, replica: int) -> dict[str, torch.Tensor]:
    """Deterministic synthetic batch of one DP replica: tokens/labels/loss_mask/position_ids [b, S].

    About 1 in 8 tokens is masked out of the loss, so per-token weighting matters. With
    ``cfg.documents`` every document of the step ends with the EOD token (no other token is EOD).
    """
    S, b = cfg.layout.seq_length, cfg.micro_batch_size
    g = torch.Generator().manual_seed(cfg.data_seed * 1_000_003 + step * 1009 + replica)
    lengths = cfg.doc_lengths(step)
    if lengths is None:
        text = torch.randint(0, cfg.model.vocab_size, (b, S + 1), generator=g)
    else:
        text = torch.randint(0, cfg.eod_token, (b, S + 1), generator=g)
        text[:, np.cumsum(lengths) - 1] = cfg.eod_token
    loss_mask = (torch.rand(b, S, generator=g) > 0.125).float()
    return {
        "tokens": text[:, :-1].contiguous(),
        "labels": text[:, 1:].contiguous(),
        "loss_mask": loss_mask,
        "position_ids": torch.arange(S).expand(b, S).contiguous(),
    }


def build_gpt(
    cfg: TrainConfig,
    *,
    runtime: HexiSeqRuntime | None = None,
    pg_collection=None,
    core_attention: type | None = None,
    documents: MicroBatchDocuments | None = None,
) -> GPTModel:
    """The ``GPTModel`` of ``cfg.model`` with the same weights on every process (seeded CPU init).

    With ``runtime`` (a ``HexiSeqRuntime``) the core attention is HexiSeq's and RoPE follows the
    layout (and the runtime's documents and per-micro-batch layouts); without it, a single-device
    causal attention (the reference; inside each document of ``documents`` when given), or the
    module class ``core_attention`` when given (``profile`` times the model without attention).
    """
    cp = cfg.layout.world_size if runtime is not None else 1
    tp = cfg.tensor_model_parallel_size if runtime is not None else 1
    sp = cfg.sequence_parallel and tp > 1
    config = transformer_config(
        cfg.model, context_parallel_size=cp, tensor_model_parallel_size=tp, sequence_parallel=sp
    )
    spec: ModuleSpec | TransformerBlockSubmodules
    spec = get_gpt_layer_local_spec(normalization=cfg.model.normalization)
    if runtime is not None:
        spec = hexiseq_spec(spec, runtime)
        if sp:  # a norm that takes sequence parallelism on CPU (testbed/tp_cpu.py)
            assert isinstance(spec, ModuleSpec)
            spec = sequence_parallel_spec(spec, cfg.model.num_layers)
    else:
        spec.submodules.self_attention.submodules.core_attention = ModuleSpec(
            module=core_attention or LocalCausalAttention,
            params={} if documents is None else {"documents": documents},
        )
    torch.manual_seed(cfg.seed)
    model = GPTModel(
        config=config,
        transformer_layer_spec=spec,
        vocab_size=cfg.model.vocab_size,
        max_sequence_length=cfg.layout.seq_length,
        pre_process=True,
        post_process=True,
        share_embeddings_and_output_weights=False,
        position_embedding_type="rope",
        pg_collection=pg_collection,
    )
    if runtime is not None:
        positions = [p for s, e in runtime.segments for p in range(s, e)]
        install_rope(model, positions, runtime.documents, runtime.batch_layout)
        if cfg.init_params is not None:
            rank = mpu.get_tensor_model_parallel_rank()
            load_tp_slices(model, cfg.init_params, rank, tp, gated_linear_unit=cfg.model.swiglu)
    return model


def _packed_runtime(
    cfg: TrainConfig, runtime: HexiSeqRuntime, plan_times: list[float]
) -> HexiSeqRuntime:
    """The runtime with the documents slot and, with ``cfg.batch_layouts``, the per-micro-batch
    layout slot (its provider timed: thread CPU time per call into ``plan_times``)."""
    docs = MicroBatchDocuments(
        seq_length=cfg.layout.seq_length,
        eod_token=cfg.eod_token,
        reset_position_ids=cfg.reset_position_ids,
        required=True,
    )
    batch_layout = None
    source = cfg.batch_layouts
    if source is not None:

        def provider(bounds: DocumentBounds | None) -> Layout:
            assert bounds is not None and bounds.shared, "one sample per micro-batch"
            t0 = time.thread_time()
            layout = source(tuple(np.diff(bounds.samples[0]).tolist()))
            plan_times.append(time.thread_time() - t0)
            return layout

        tp = cfg.tensor_model_parallel_size
        batch_layout = MicroBatchLayout(
            runtime.groups,
            provider,
            reset_position_ids=cfg.reset_position_ids,
            tokens_multiple_of=tp if cfg.sequence_parallel else 1,
        )
    return replace(runtime, documents=docs, batch_layout=batch_layout)


def ddp_and_optimizer(
    model: GPTModel, *, bucket_size: int | None, overlap: bool, lr: float
) -> tuple[DistributedDataParallel, list[torch.nn.Parameter], torch.optim.AdamW]:
    """Megatron DDP over ``dp_cp`` (fp32 gradient buffers, ``bucket_size`` parameters per bucket,
    the reduction overlapped with the backward when ``overlap``), its trainable parameters, and
    AdamW over them. Per-token loss: ``model.config.calculate_per_token_loss``."""
    ddp_config = DistributedDataParallelConfig(
        overlap_grad_reduce=overlap, bucket_size=bucket_size, grad_reduce_in_fp32=True
    )
    with cpu_device_shim():
        ddp = DistributedDataParallel(model.config, ddp_config, model)
    params = [p for p in ddp.parameters() if p.requires_grad]
    return ddp, params, torch.optim.AdamW(params, lr=lr)


def run_shape(cfg: TrainConfig) -> RunShape:
    """The ``RunShape`` this driver runs (for ``runtime.check_run`` before spawning)."""
    tp = cfg.tensor_model_parallel_size
    return RunShape(
        world_size=cfg.layout.world_size * cfg.data_parallel * tp,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=1,
        context_parallel_size=cfg.layout.world_size,
        seq_length=cfg.layout.seq_length,
        num_attention_heads=cfg.model.num_attention_heads,
        num_query_groups=cfg.model.num_query_groups,
        sequence_parallel=cfg.sequence_parallel and tp > 1,
    )


def train_rank(rank: int, world_size: int, cfg: TrainConfig) -> TrainResult:
    """``run_ranks`` worker: train ``cfg.steps`` steps on ``layout.world_size x data_parallel``
    ranks (x ``tensor_model_parallel_size``: TP bundles, Megatron's sequence parallelism inside,
    its CPU stand-ins from ``testbed/tp_cpu.py``)."""
    W, tp = cfg.layout.world_size, cfg.tensor_model_parallel_size
    if world_size != W * cfg.data_parallel * tp:
        raise HexiSeqError(
            f"train_rank needs layout ranks x data_parallel x TP = {W} x {cfg.data_parallel} x "
            f"{tp} = {W * cfg.data_parallel * tp} processes, got {world_size}"
        )
    mpu.initialize_model_parallel(tensor_model_parallel_size=tp, context_parallel_size=W)
    try:
        with cpu_sequence_parallel() if tp > 1 else contextlib.nullcontext():
            return _train_rank(rank, cfg)
    finally:
        mpu.destroy_model_parallel()


def _train_rank(rank: int, cfg: TrainConfig) -> TrainResult:
    """Body of ``train_rank`` (model-parallel state initialised). With TP the first t global ranks
    (data-parallel replica 0, layout rank 0: one rank per TP rank) return gradients and parameters."""
    tp = cfg.tensor_model_parallel_size
    # another model / length / data is refused before anything is built
    resume_from = ckpt.check_checkpoint(cfg) if cfg.load_dir is not None else None
    runtime = build_runtime(
        cfg.layout,
        run_shape(cfg),
        cp_group=mpu.get_context_parallel_group(),
        kernel=cfg.kernel,
        comm_chunks=cfg.comm_chunks,
        tp_group=mpu.get_tensor_model_parallel_group() if tp > 1 else None,
    )
    plan_times: list[float] = []
    slicer = None
    if cfg.documents is not None:
        runtime = _packed_runtime(cfg, runtime, plan_times)
        slicer = LayoutBatchSlicer(
            runtime.segments,
            cfg.layout.seq_length,
            runtime.documents,
            reset_attention_mask=True,
            batch_layout=runtime.batch_layout,
        )
    model = build_gpt(cfg, runtime=runtime)
    dp_cp = mpu.get_data_parallel_group(with_context_parallel=True)
    share_initial_parameters(model, (dp_cp, None))  # as the plugin's model provider does
    ddp, params, opt = ddp_and_optimizer(
        model, bucket_size=cfg.bucket_size, overlap=cfg.overlap_grad_reduce, lr=cfg.lr
    )
    replica = mpu.get_data_parallel_rank()
    losses, times = [], []
    kept_grads: dict[str, dict[str, torch.Tensor]] = {}  # "grads" once keep_grads ran
    resumed: dict[str, dict] | None = None
    keep = cfg.return_params and rank < tp
    start = 0
    if resume_from is not None:
        start = ckpt.load_checkpoint(resume_from, model, opt, dp_cp_group=dp_cp)
        resumed = ckpt.snapshot(model, opt) if keep else None

    def keep_grads() -> None:
        kept_grads["grads"] = {n: p.main_grad.detach().clone() for n, p in model.named_parameters()}

    for step in range(start, cfg.steps):
        t_start = time.perf_counter()
        if slicer is not None:  # the Megatron boundary's slicer: documents, batch layout
            batch = slicer(make_batch(cfg, step, replica))
        else:
            batch = slice_batch(
                make_batch(cfg, step, replica),
                segments=runtime.segments,
                seq_length=cfg.layout.seq_length,
            )
        want = step == 0 and cfg.return_grads and rank < tp
        report, _ = train_step(
            ddp,
            opt,
            params,
            batch,
            report_group=dp_cp,
            before_update=keep_grads if want else None,
        )
        times.append(time.perf_counter() - t_start)
        losses.append(float(report[0] / report[1]))
        if cfg.save_dir is not None and step + 1 == cfg.save_at_step:
            ckpt.save_checkpoint(cfg, model, opt, step + 1, dp_cp_group=dp_cp)
    final = ckpt.snapshot(model, opt) if keep else {}
    return TrainResult(
        losses,
        times,
        kept_grads.get("grads"),
        final.get("params"),
        start_step=start,
        opt_state=final.get("opt_state"),
        resumed=resumed,
        plan_times_s=plan_times if cfg.batch_layouts is not None else None,
    )


def train_reference(
    cfg: TrainConfig, global_batch: Callable[[int], dict[str, torch.Tensor]] | None = None
) -> TrainResult:
    """The single-process oracle: same weights and data, every replica's batch at once, full sequence.

    ``global_batch(step)``: the step's whole batch ``[B, S]`` (default: every replica's
    ``make_batch``, concatenated; the job driver gives its global batches).
    Needs a default process group of size 1 (call it inside ``run_ranks(..., 1)``) because
    megatron-core modules read their (trivial) tensor-parallel group.
    """
    mpu.initialize_model_parallel(tensor_model_parallel_size=1, context_parallel_size=1)
    try:
        with cpu_device_shim():  # stock RoPE moves its frequencies to torch.cuda.current_device()
            return _train_reference(cfg, global_batch)
    finally:
        mpu.destroy_model_parallel()


def _train_reference(
    cfg: TrainConfig, global_batch: Callable[[int], dict[str, torch.Tensor]] | None
) -> TrainResult:
    """Body of ``train_reference`` (model-parallel state initialised, CUDA shim active)."""
    docs = None
    if cfg.documents is not None:
        docs = MicroBatchDocuments(
            seq_length=cfg.layout.seq_length,
            eod_token=cfg.eod_token,
            reset_position_ids=False,
            required=True,
        )
    model = build_gpt(cfg, documents=docs)
    initial = (
        {n: p.detach().clone() for n, p in model.named_parameters()} if cfg.return_params else None
    )
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr)
    losses, times, grads = [], [], None
    for step in range(cfg.steps):
        start = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        if global_batch is not None:
            batch = global_batch(step)
        else:
            parts = [make_batch(cfg, step, r) for r in range(cfg.data_parallel)]
            batch = {k: torch.cat([p[k] for p in parts]) for k in parts[0]}
        if docs is not None:
            docs.update_from_tokens(batch["tokens"])  # Megatron's EOD rule, every sample
        out = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
        loss_sum, num_tokens = per_token_loss(out, batch["loss_mask"])
        (loss_sum / num_tokens).backward()
        if step == 0 and cfg.return_grads:
            grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
        opt.step()
        times.append(time.perf_counter() - start)
        losses.append(float(loss_sum.detach() / num_tokens))
    final = (
        {n: p.detach().clone() for n, p in model.named_parameters()} if cfg.return_params else None
    )
    return TrainResult(losses, times, grads, final, initial)


def reference_rank(rank: int, world_size: int, cfg: TrainConfig) -> TrainResult:
    """``run_ranks(reference_rank, 1, cfg)``: ``train_reference`` in a fresh process."""
    if world_size != 1:
        raise HexiSeqError(f"reference_rank runs in one process, got {world_size}")
    return train_reference(cfg)


def train_rank_many(rank: int, world_size: int, cfgs: list[TrainConfig]) -> list[TrainResult]:
    """Several runs in one spawn (each ``cfg`` needs the same world size): cheaper tests/benches."""
    return [train_rank(rank, world_size, cfg) for cfg in cfgs]


def reference_rank_many(rank: int, world_size: int, cfgs: list[TrainConfig]) -> list[TrainResult]:
    """``train_reference`` for several configs in one single-process spawn."""
    if world_size != 1:
        raise HexiSeqError(f"reference_rank_many runs in one process, got {world_size}")
    return [train_reference(cfg) for cfg in cfgs]
