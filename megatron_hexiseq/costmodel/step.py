"""The fixed costs of a training step: gradient reduction, Megatron-FSDP's collectives, the
optimizer step. Pure functions over specs; seconds as floats, bytes as integers.

A step runs ``m_d`` micro-batches on every domain of a job (``estimate`` prices one micro-batch of
one domain) and ends with what every rank does once, whatever the tokens
(docs/cost_model.md, "The step's fixed costs"):

- **gradient reduction** (``memory_mode`` ``distributed_optimizer``): a reduce-scatter of the
  fp32 gradients (:data:`GRAD_BYTES` per parameter) and an all-gather of the bf16 parameters
  (:data:`PARAM_BYTES`) over every rank of the job (all hold the whole model), each a ring
  collective (:func:`ring_collective_s`) at the bus bandwidth of the slowest link the ring crosses
  (:func:`ring_bus_GBps`). With ``overlap_grad_sync`` (``--overlap-grad-reduce
  --overlap-param-gather``) each runs bucket by bucket behind the compute
  (:func:`grad_sync_exposed_s`);
- **Megatron-FSDP** (``memory_mode`` ``fsdp``): every micro-batch gathers each layer's parameters
  in its forward and again in its backward and reduce-scatters its gradients, inside the shard
  group (:func:`fsdp_comm`); prefetched layer by layer, so only what the compute cannot cover is
  exposed (:func:`fsdp_exposed_s`). ``estimate`` adds it to each micro-batch; nothing is left
  for the step. In a job the shard group is every rank (Megatron's ``dp_cp``), every rank must
  join each of these collectives, so every domain runs the same number of micro-batches (the
  job runtime refuses other counts) and they go in lockstep;
- **the optimizer step**: Adam over the rank's shard, memory-bound (:func:`optimizer_s`).

Overlap rule (:func:`overlapped_s`): ``chunks`` equal pieces of communication, each ready when the
compute has done its share and sent one after another, behind ``compute_s`` of compute: exposed
``max(comm / chunks, comm - (chunks - 1) / chunks * compute)``. Communication hides only behind
the linear (matmul) work of the pass it overlaps: during attention the network ports carry the
K/V exchange.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from megatron_hexiseq.cluster import Cluster, Device
from megatron_hexiseq.costmodel.comm import cluster_arrays
from megatron_hexiseq.model import ModelSpec
from megatron_hexiseq.run_config import TrainOptions

GRAD_BYTES = 4
"""fp32 gradients: with ``--bf16`` Megatron sets ``accumulate_allreduce_grads_in_fp32``
(megatron/training/arguments.py), so DDP's gradient buffer and its reduce-scatter are fp32
(``grad_reduce_in_fp32``), Megatron-FSDP's too (its ``grad_reduce_in_fp32``)."""
PARAM_BYTES = 2
"""bf16 parameters: what the distributed optimizer and Megatron-FSDP all-gather."""
ADAM_BYTES_PER_PARAM = 34
"""Bytes the optimizer step moves per parameter of the rank's shard: the fp32 gradient read by the
gradient-norm clip (4) and by Adam (4); Adam reads and writes the fp32 master parameter, m and v
(3 x 8; Kingma & Ba 2015, Megatron's fused Adam over the distributed optimizer's shard), and the
bf16 parameter is written back (2)."""
BUCKET_PARAMS_MIN = 40_000_000
BUCKET_PARAMS_PER_RANK = 1_000_000
"""Megatron's default DDP bucket: ``max(40M, 1M x dp size)`` parameters
(megatron/core/distributed/distributed_data_parallel.py)."""


def ring_bus_GBps(cluster: Cluster, ranks: Sequence[int] | None = None, replicas: int = 1) -> float:
    """Bus bandwidth (GB/s) of NCCL's rings over devices ``ranks`` (default: all) of ``cluster``.

    NCCL runs one ring per channel, a channel per NIC (nccl-tests' PERFORMANCE.md: an all-gather
    or reduce-scatter of ``M`` bytes over ``n`` ranks moves ``(n - 1) / n * M`` through every
    link of the ring, its bus bandwidth). Inside a node a ring hop is NVLink; between nodes a
    node's traffic leaves through the NICs of its ``g`` GPUs in the group, ``g x network_GBps``
    together. So the ring runs at the slowest of: the smallest NVLink bandwidth (when some node
    holds two or more of the ranks) and, when the ranks span nodes (or ``replicas`` > 1 copies of
    the cluster take part), each node's ``g x network_GBps``. A single rank: infinite (nothing
    to move)."""
    members = range(cluster.world_size) if ranks is None else ranks
    count: dict[str, int] = {}
    nvlink: dict[str, float] = {}
    network: dict[str, float] = {}
    for r in members:
        d = cluster.devices[r]
        count[d.node] = count.get(d.node, 0) + 1
        nvlink[d.node] = min(nvlink.get(d.node, math.inf), d.nvlink_GBps)
        network[d.node] = min(network.get(d.node, math.inf), d.network_GBps)
    bus = math.inf
    if any(c > 1 for c in count.values()):
        bus = min(nvlink[n] for n, c in count.items() if c > 1)
    if len(count) > 1 or replicas > 1:
        bus = min(bus, min(c * network[n] for n, c in count.items()))
    return bus


def ring_collective_s(total_bytes: int, ranks_n: int, bus_GBps: float) -> float:
    """Seconds of an all-gather (or reduce-scatter) whose full result is ``total_bytes``, over
    ``ranks_n`` ranks in a ring at ``bus_GBps``: ``(n - 1) / n * bytes / bus``."""
    if ranks_n <= 1 or total_bytes == 0:
        return 0.0
    return (ranks_n - 1) / ranks_n * total_bytes / (bus_GBps * 1e9)


def overlapped_s(comm_s: float, compute_s: Any, chunks: int) -> Any:
    """Exposed seconds of ``comm_s`` sent in ``chunks`` equal pieces behind ``compute_s``: piece
    ``i`` is ready when the compute has done ``(i + 1) / chunks`` of its work and the pieces go
    one after another, so the last piece ends ``max(comm / chunks, comm - (chunks - 1) / chunks *
    compute)`` after the compute (the first term: the last piece always follows the compute; the
    second: a communication-bound pipeline). Works on numpy arrays of ``compute_s`` too."""
    if comm_s == 0:
        return 0.0 * compute_s
    return np.maximum(comm_s / chunks, comm_s - (chunks - 1) / chunks * compute_s)


def forward_fraction(options: TrainOptions) -> float:
    """The forward's share of a micro-batch's linear work: 1/3 (backward = 2 x forward), 1/4 with
    full recompute (one more forward, run inside the backward)."""
    return 0.25 if options.recompute else 1 / 3


class GradSync(NamedTuple):
    """The step's gradient reduction (whole collectives, seconds)."""

    reduce_scatter_s: float  # fp32 gradients
    all_gather_s: float  # bf16 parameters (fsdp: the all-reduce's second half, fp32 gradients)
    buckets: int  # DDP buckets each collective is cut into


def grad_buckets(model: ModelSpec, ranks_n: int) -> int:
    """DDP buckets of the model's parameters with Megatron's default bucket size."""
    bucket = max(BUCKET_PARAMS_MIN, BUCKET_PARAMS_PER_RANK * ranks_n)
    return max(1, -(-model.num_parameters // bucket))


def grad_sync(model: ModelSpec, options: TrainOptions, ranks_n: int, bus_GBps: float) -> GradSync:
    """The distributed optimizer's reduce-scatter of the fp32 gradients and all-gather of the bf16
    parameters over ``ranks_n`` ranks at ``bus_GBps`` (nothing under ``fsdp``, which reduces and
    gathers every micro-batch, :func:`fsdp_comm`)."""
    if options.memory_mode == "fsdp":
        return GradSync(0.0, 0.0, 1)
    p = model.num_parameters
    return GradSync(
        ring_collective_s(GRAD_BYTES * p, ranks_n, bus_GBps),
        ring_collective_s(PARAM_BYTES * p, ranks_n, bus_GBps),
        grad_buckets(model, ranks_n),
    )


def grad_sync_exposed_s(
    sync: GradSync, options: TrainOptions, first_forward_s: float, last_backward_s: float
) -> float:
    """Seconds of the gradient reduction a domain waits for: all of it without
    ``overlap_grad_sync``; with it, the parameter all-gather bucket by bucket behind the step's
    first forward and the reduce-scatter behind its last backward (:func:`overlapped_s`, the
    windows being that pass's linear work)."""
    if not options.overlap_grad_sync:
        return sync.reduce_scatter_s + sync.all_gather_s
    return float(
        overlapped_s(sync.all_gather_s, first_forward_s, sync.buckets)
        + overlapped_s(sync.reduce_scatter_s, last_backward_s, sync.buckets)
    )


def optimizer_bytes(model: ModelSpec, options: TrainOptions, ranks_n: int) -> int:
    """Bytes one rank's optimizer step moves: :data:`ADAM_BYTES_PER_PARAM` over its shard of
    ``ceil(P / ranks)`` parameters, plus zeroing its fp32 gradients for the next step (the whole
    buffer under the distributed optimizer, which keeps gradients unsharded; the shard under
    ``fsdp``)."""
    p = model.num_parameters
    shard = -(-p // ranks_n)
    zeroed = shard if options.memory_mode == "fsdp" else p
    return ADAM_BYTES_PER_PARAM * shard + GRAD_BYTES * zeroed


def optimizer_s(model: ModelSpec, options: TrainOptions, ranks_n: int, hbm_Bps: float) -> float:
    """Seconds of one rank's optimizer step at its device memory bandwidth (0.0 when unknown)."""
    if hbm_Bps <= 0:
        return 0.0
    return optimizer_bytes(model, options, ranks_n) / hbm_Bps


class FsdpComm(NamedTuple):
    """Megatron-FSDP's communication in one micro-batch, whole collectives (seconds)."""

    forward_s: float  # every layer's parameters gathered (bf16)
    backward_s: float  # gathered again, and the gradients reduce-scattered (fp32)


def fsdp_comm(model: ModelSpec, ranks_n: int, bus_GBps: float) -> FsdpComm:
    """Megatron-FSDP (``optim_grads_params``) per micro-batch: each ``TransformerLayer`` unit's
    parameters are all-gathered before its forward and again before its backward (released after
    the forward), and its gradients reduce-scattered after every backward
    (``grad_reduce_every_bprop``); the recomputed forward runs on the backward's gather
    (megatron/core/distributed/fsdp/src/megatron_fsdp/megatron_fsdp.py)."""
    p = model.num_parameters
    gather = ring_collective_s(PARAM_BYTES * p, ranks_n, bus_GBps)
    reduce = ring_collective_s(GRAD_BYTES * p, ranks_n, bus_GBps)
    return FsdpComm(gather, gather + reduce)


def fsdp_exposed_s(
    comm: FsdpComm, options: TrainOptions, linear_s: np.ndarray, layers: int
) -> np.ndarray:
    """Per rank, the seconds of a micro-batch's FSDP collectives that its linear work
    (``linear_s``, without fixed costs) does not cover: prefetched one layer ahead, one piece per
    layer, in the forward and in the backward (:func:`overlapped_s`)."""
    fwd = forward_fraction(options) * linear_s
    return overlapped_s(comm.forward_s, fwd, layers) + overlapped_s(
        comm.backward_s, linear_s - fwd, layers
    )


def shard_bus_GBps(cluster: Cluster, options: TrainOptions) -> float:
    """Bus bandwidth of the ring over the optimizer's shard group: ``options.shard_group_GBps``
    when set (a job's group spans other domains), else the ring over the whole cluster and its
    data-parallel copies (:func:`ring_bus_GBps`), once per cluster."""
    if options.shard_group_GBps:
        return options.shard_group_GBps
    memo = cluster_arrays(cluster).memo.setdefault("ring_bus_GBps", {})
    if options.data_parallel_size not in memo:
        memo[options.data_parallel_size] = ring_bus_GBps(
            cluster, replicas=options.data_parallel_size
        )
    return memo[options.data_parallel_size]


def fsdp_rank_exposed_s(
    cluster: Cluster, model: ModelSpec, options: TrainOptions, linear_work_s: np.ndarray
) -> np.ndarray:
    """Per rank of a layout over all of ``cluster``, Megatron-FSDP's exposed seconds in one
    micro-batch (:func:`fsdp_exposed_s` over the shard group, ``options.shard_ranks``): zeros
    unless ``memory_mode`` is ``fsdp``. ``linear_work_s``: each rank's linear work without fixed
    costs. What ``estimate`` and ``estimate_documents`` add to each rank's linear phase."""
    if options.memory_mode != "fsdp":
        return np.zeros(len(linear_work_s))
    comm = fsdp_comm(
        model, options.shard_ranks(cluster.world_size), shard_bus_GBps(cluster, options)
    )
    return fsdp_exposed_s(comm, options, linear_work_s, model.num_layers)


class StepFixed(NamedTuple):
    """What a job's step costs once, whatever its micro-batches, over the job's ranks."""

    ranks: int  # every rank of the job
    bus_GBps: float  # of the ring over them
    sync: GradSync
    optimizer_s: float  # the slowest rank's
    overhead_s: float  # measured step overhead (the CPU testbed), else 0
    # the part of overhead_s every micro-batch pays (the largest rank's measured
    # micro_batch_overhead_ms): priced in each micro-batch, so the step adds the rest once
    micro_batch_overhead_s: float = 0.0

    @property
    def measured(self) -> bool:
        """The cluster's step overhead was measured (it holds the reduction and the optimizer)."""
        return self.overhead_s > 0

    @property
    def once_s(self) -> float:
        """What the step pays once beside its micro-batches (each of which carries
        ``micro_batch_overhead_s``): the optimizer and the rest of the measured overhead."""
        return self.optimizer_s + self.overhead_s - self.micro_batch_overhead_s


def micro_batch_overhead_s(devices: Sequence[Device]) -> float:
    """The largest measured ``micro_batch_overhead_ms`` of ``devices``: what each micro-batch of
    theirs pays of the step overhead (0 on GPUs)."""
    return max(d.micro_batch_overhead_s for d in devices)


def step_once_s(devices: Sequence[Device]) -> float:
    """Of the step overhead a priced micro-batch carries (``estimate``, ``estimate_documents``:
    the largest ``step_overhead_ms`` of its ranks), what a step pays only once: a further
    micro-batch pays just its ``micro_batch_overhead_ms``. 0 where nothing was measured (GPUs)."""
    return max(d.step_overhead_s for d in devices) - micro_batch_overhead_s(devices)


def step_fixed(
    cluster: Cluster,
    domains: Sequence[Sequence[int]],
    model: ModelSpec,
    options: TrainOptions,
) -> StepFixed:
    """The step's fixed costs of a job whose domains are the devices ``domains`` of ``cluster``.

    A cluster whose devices carry a measured ``step_overhead_ms`` (``profile --testbed``) pays that
    once per step, the largest of its ranks': it was measured around the whole step's gradient
    reduction and optimizer, so neither is priced again. Otherwise the gradient reduction
    (:func:`grad_sync`) and the optimizer step of the slowest rank's memory (:func:`optimizer_s`;
    devices without an ``hbm_GBps`` figure are not priced). Both memory modes shard the optimizer
    over every rank of the job (Megatron's ``dp_cp``), the reduction's ring over them
    (:func:`ring_bus_GBps`)."""
    ranks = [r for d in domains for r in d]
    n = len(ranks)
    devs = cluster.devices
    bus = ring_bus_GBps(cluster, ranks)
    overhead = max(devs[r].step_overhead_s for r in ranks)
    if overhead > 0:
        per_micro = micro_batch_overhead_s([devs[r] for r in ranks])
        return StepFixed(n, bus, GradSync(0.0, 0.0, 1), 0.0, overhead, per_micro)
    opt = max(optimizer_s(model, options, n, devs[r].hbm_Bps) for r in ranks)
    return StepFixed(n, bus, grad_sync(model, options, n, bus), opt, 0.0)


def step_time_s(
    micro_batch_s: Sequence[float],
    offsets_s: Sequence[float],
    shares: Sequence[int],
    fixed: StepFixed,
) -> float:
    """A job's step: the slowest domain's ``m_d x`` its micro-batch time plus its exposed
    gradient reduction (``offsets_s``, :func:`grad_sync_exposed_s`), then the optimizer and the
    measured overhead (``StepFixed.once_s``: the micro-batch times carry its per-micro-batch
    part)."""
    busy = max(m * t + x for t, x, m in zip(micro_batch_s, offsets_s, shares))
    return busy + fixed.once_s
