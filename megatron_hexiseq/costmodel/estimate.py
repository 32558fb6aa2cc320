"""``estimate``: modelled iteration time and memory of a layout on a cluster.

Per rank (all layers, one iteration = one micro-batch of ``b`` sequences, forward + backward):

- ``linear_s``    = b * tokens_r * train_flops(linear_flops_per_token) / flops_per_s + ``overhead_s``
                    (the device's fixed ``step_overhead_s`` per iteration: optimizer, framework)
                    + ``fsdp_exposed_s`` (``fsdp`` only: Megatron-FSDP's per-layer parameter
                    gathers and gradient reduce-scatter over the shard group that the rank's linear
                    work does not hide, ``step.fsdp_exposed_s``)
- ``attention_s`` = b * causal_pairs(group segments, [0, S)) * heads_r
                    * train_flops(attention_flops_per_pair_head) / (the kernel's long-block rate)
                    * slowdown_r (its calls' time at their achieved rates over their time at the
                    long-block rate: ``rates.call_fraction``, one call per block and layer)
- ``a2a_s``       = passes * sum over q, k, v, out of alltoall_time_s(one layer) * L, the group's
                    slowest member (a collective: everyone waits); passes = 2 (fwd, bwd) or 3 (+recompute)
- ``kv_exchange_s`` / ``kv_exposed_s``: (forward passes + 2) x one forward exchange (backward moves
                    K/V again plus dK/dV back: twice the forward bytes against twice the forward compute)
- fixed costs (0 on the catalog's GPUs; ``profile`` measures them): ``a2a_s`` adds the group's largest
  ``collective_latency_s`` per collective (4 per layer and pass), ``kv_exposed_s`` adds the rank's
  ``p2p_latency_s`` per exchange step ((forward passes + 2) x rounds with something to receive x L),
  never hidden (on the CPU testbed it is scheduler time the compute cannot overlap)
- ``time_s``      = compute_s + a2a_s + kv_exposed_s (the rank's own busy time);
  ``iteration_time_s`` = max over ranks of ``linear_s`` + max over ranks of ``time_s - linear_s``:
  every layer's attention phase synchronises the CP domain (all-to-all, K/V exchange), the linear
  phase between two attentions does not (bulk-synchronous phases; equals max of ``time_s`` when
  every rank's two phases are balanced alike).

Memory: static (params/grads/optimizer) + activations of own tokens + attention core of group tokens
for the rank's heads + communication buffers. Formulas and sources: docs/cost_model.md.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, NamedTuple

import numpy as np

from megatron_hexiseq.cluster import Cluster
from megatron_hexiseq.costmodel.comm import cluster_arrays, group_links, rank_times_from_links
from megatron_hexiseq.costmodel.contention import scale_fixed_costs, shared_core_members
from megatron_hexiseq.costmodel.exchange import kv_exchange_forward
from megatron_hexiseq.costmodel.formulas import (
    BF16_BYTES,
    a2a_buffer_bytes_per_token,
    activation_bytes_per_token,
    attention_backward_bytes_per_block_token,
    attention_bytes_per_group_token,
    attention_s_per_pair_head,
    causal_pairs,
    kv_block_bytes_per_token,
    linear_s_per_token,
    static_memory_bytes,
)
from megatron_hexiseq.costmodel.rates import cluster_rates
from megatron_hexiseq.costmodel.step import fsdp_rank_exposed_s
from megatron_hexiseq.costmodel.tp import bundle_problem
from megatron_hexiseq.layout import Layout, check_matches
from megatron_hexiseq.model import ModelSpec
from megatron_hexiseq.run_config import TrainOptions

GIB = 2**30


@dataclass(frozen=True, kw_only=True)
class RankEstimate:
    """Modelled time (seconds per iteration) and memory (bytes) of one layout rank."""

    rank: int
    gpu: str
    tokens: int
    heads: int
    compute_s: float
    comm_s: float
    exposed_comm_s: float
    time_s: float
    memory_bytes: int
    capacity_bytes: int
    breakdown: Mapping[str, float]
    node: str = ""
    device_memory_gib: float = 0.0

    @property
    def fits(self) -> bool:
        return self.memory_bytes <= self.capacity_bytes


@dataclass(frozen=True, kw_only=True)
class Estimate:
    """The modelled iteration: the slowest rank sets the pace (ranks synchronise every layer)."""

    iteration_time_s: float
    tokens_per_s: float
    feasible: bool
    capacity_fraction: float = 0.95
    options: TrainOptions = field(default_factory=TrainOptions)
    columns: _Columns = field(repr=False, compare=False)

    @cached_property
    def per_rank(self) -> tuple[RankEstimate, ...]:
        """Every rank's estimate, rank r at index r (built when first read)."""
        return self.columns.ranks()

    def values(self, name: str) -> list[float]:
        """One per-rank value of every rank, rank r at index r: a ``RankEstimate`` field or a
        ``breakdown`` key ("time_s", "kv_exposed_s", ...), without building the rows."""
        return self.columns.values[name].tolist()

    @property
    def bottleneck_rank(self) -> int:
        """The rank whose time is the iteration time (lowest index on ties)."""
        return max(self.per_rank, key=lambda r: (r.time_s, -r.rank)).rank

    def memory_problems(self) -> list[str]:
        """One line per rank over capacity, e.g. ``rank 5 (L40S-48GB) needs 51.2 GiB > 45.6 GiB (95% of 48 GiB)``."""
        return [
            f"rank {r.rank} ({r.gpu}) needs {r.memory_bytes / GIB:.1f} GiB > {r.capacity_bytes / GIB:.1f} GiB "
            f"({self.capacity_fraction * 100:g}% of {r.device_memory_gib:g} GiB)"
            for r in self.per_rank
            if not r.fits
        ]

    def to_predicted(self) -> dict[str, Any]:
        """The layout JSON's ``predicted`` block."""
        return {
            "iteration_time_s": _sig(self.iteration_time_s),
            "tokens_per_s": _sig(self.tokens_per_s),
            "feasible": self.feasible,
            "per_rank": [
                {
                    "rank": r.rank,
                    "time_s": _sig(r.time_s),
                    "memory_gib": round(r.memory_bytes / GIB, 4),
                }
                for r in self.per_rank
            ],
        }


def estimate(
    layout: Layout, cluster: Cluster, model: ModelSpec, options: TrainOptions = TrainOptions()
) -> Estimate:
    """Model one training iteration of ``layout`` (rank r on ``cluster.devices[r]``; a layout over
    TP bundles is priced on its bundle problem, ``costmodel.tp``)."""
    check_matches(layout, cluster, model)
    if layout.tensor_model_parallel_size > 1:  # rank r = bundle r (every GPU of it alike)
        layout, cluster, model, options = bundle_problem(layout, cluster, model, options)
    b, L = options.micro_batch_size, model.num_layers
    passes_fwd = 2 if options.recompute else 1
    hpg = layout.heads_per_query_group
    kv_by_heads: dict[tuple[int, ...], tuple[int, ...]] = {}  # ranks repeat a few head sets
    for r in layout.ranks:
        if r.heads not in kv_by_heads:
            kv_by_heads[r.heads] = tuple(sorted({h // hpg for h in r.heads}))
    kv_of = [kv_by_heads[r.heads] for r in layout.ranks]  # layout.kv_heads of each rank
    rates = cluster_rates(cluster, model.kv_channels, options.attention_kernel)
    exchange = kv_exchange_forward(layout, cluster, model, b, kv_heads=kv_of, rates=rates)

    tokens = [r.num_tokens for r in layout.ranks]
    kv_count = [len(k) for k in kv_of]
    head_count = [len(r.heads) for r in layout.ranks]
    structures = cluster_arrays(cluster).memo.setdefault("a2a_structure", {})
    # per group, in layout order
    group_pairs: list[int] = []
    group_a2a_s: list[float] = []
    group_a2a_fixed_s: list[float] = []
    group_tokens_of: list[int] = []
    a2a_memo: dict[
        tuple, float
    ] = {}  # groups of one structure (devices, tokens, heads) cost the same
    for g in layout.groups:
        group_pairs.append(causal_pairs(layout.group_segments(g.id), [(0, layout.seq_length)]))
        tok = [tokens[r] for r in g.ranks]
        group_tokens_of.append(sum(tok))
        if (
            g.ranks not in structures
        ):  # (gpus, node pattern, bandwidths), slowest collective latency
            structures[g.ranks] = (
                (
                    tuple(cluster.devices[r].gpu.name for r in g.ranks),
                    _node_pattern(cluster, g.ranks),
                    tuple(
                        (cluster.devices[r].nvlink_GBps, cluster.devices[r].network_GBps)
                        for r in g.ranks
                    ),
                ),
                max(cluster.devices[r].collective_latency_s for r in g.ranks),
            )
        structure, latency_s = structures[g.ranks]
        hq, hkv = [head_count[r] for r in g.ranks], [kv_count[r] for r in g.ranks]
        key = (*structure, tuple(tok), tuple(hq), tuple(hkv))
        if key not in a2a_memo:
            a2a_memo[key] = _a2a_layer_s(cluster, model, g.ranks, b, tok, hq, hkv)
        a2a_s = (passes_fwd + 1) * L * a2a_memo[key]
        fixed_s = 0.0
        if (
            len(g.ranks) > 1
        ):  # fixed cost per collective: 4 per layer and pass, the slowest member's
            fixed_s = (passes_fwd + 1) * L * 4 * latency_s
            a2a_s += fixed_s
        group_a2a_s.append(a2a_s)
        group_a2a_fixed_s.append(fixed_s)

    # per rank, vectorised (every value as the scalar formula computes it: the same IEEE operations
    # in the same order, integers for the bytes)
    dev = _device_arrays(cluster)
    index = {g.id: i for i, g in enumerate(layout.groups)}
    gi = np.array([index[p.group] for p in layout.ranks])
    t = np.array(tokens, dtype=np.int64)
    heads_n = np.array(head_count, dtype=np.int64)
    lin_rate, att_rate = np.empty(len(t)), np.empty(len(t))
    for first, where in dev.types:  # per GPU type (its first device stands for it)
        lin_rate[where] = linear_s_per_token(model, cluster.devices[first], options)
        att_rate[where] = attention_s_per_pair_head(model, cluster.devices[first], options)
    steps = (passes_fwd + 2) * L  # exchange steps per round with something to receive
    g_pairs = np.array(group_pairs, dtype=np.int64)[gi]
    g_a2a = np.array(group_a2a_s)[gi]
    g_tokens = np.array(group_tokens_of, dtype=np.int64)[gi]
    linear_s = t * lin_rate + dev.overhead_s
    # Megatron-FSDP's per-layer collectives (zeros in other modes), in the linear phase
    fsdp_s = fsdp_rank_exposed_s(cluster, model, options, t * lin_rate)
    if options.memory_mode == "fsdp":
        linear_s = linear_s + fsdp_s
    # at the long-block rate, then at the achieved rate of the rank's calls (1.0 for a flat rate)
    attention_s = g_pairs * heads_n * att_rate * np.array(exchange.slowdown)
    kv_latency_s = steps * np.array(exchange.rounds, dtype=np.int64) * dev.p2p_latency_s
    if shared_core_members(cluster):  # shared cores: fixed costs paid while a sibling computes
        a2a_fixed = np.array(group_a2a_fixed_s)[gi]
        busy = attention_s + g_a2a - a2a_fixed + (passes_fwd + 2) * np.array(exchange.exposed_s)
        g_a2a, kv_latency_s = scale_fixed_costs(
            cluster, linear_s, busy, g_a2a, a2a_fixed, kv_latency_s
        )
    kv_s = (passes_fwd + 2) * np.array(exchange.comm_s) + kv_latency_s
    kv_exposed_s = (passes_fwd + 2) * np.array(exchange.exposed_s) + kv_latency_s
    compute_s = linear_s + attention_s
    exposed_s = g_a2a + kv_exposed_s
    time_s = compute_s + exposed_s
    block = np.array(exchange.max_block_tokens, dtype=np.int64)
    mem = rank_memory(model, options, layout.world_size, t, g_tokens, head_count, kv_count, block)
    mem_activations, mem_attention, mem_comm = mem.activations, mem.attention, mem.comm
    memory = mem.total
    capacity = (options.capacity_fraction * dev.memory_bytes).astype(np.int64)
    # Bulk-synchronous phases: each layer's attention (head all-to-all, K/V exchange) synchronises
    # the whole CP domain, the linear work between two attentions does not. So the iteration is the
    # slowest linear phase plus the slowest attention phase, not the slowest rank's sum: a rank
    # heavy in linear work and another heavy in attention do not hide each other's time.
    iteration = float(linear_s.max()) + float((time_s - linear_s).max())
    batch_tokens = layout.seq_length * b * options.data_parallel_size
    columns = _Columns(
        cluster=cluster,
        static=mem.static,
        values={
            "tokens": t,
            "heads": heads_n,
            "compute_s": compute_s,
            "comm_s": g_a2a + kv_s,
            "exposed_comm_s": exposed_s,
            "time_s": time_s,
            "memory_bytes": memory,
            "capacity_bytes": capacity,
            "linear_s": linear_s,
            "overhead_s": dev.overhead_s,
            "fsdp_exposed_s": fsdp_s,
            "attention_s": attention_s,
            "a2a_s": g_a2a,
            "kv_exchange_s": kv_s,
            "kv_exposed_s": kv_exposed_s,
            "kv_latency_s": kv_latency_s,
            "mem_activations": mem_activations,
            "mem_attention": mem_attention,
            "mem_comm": mem_comm,
        },
    )
    return Estimate(
        iteration_time_s=iteration,
        tokens_per_s=batch_tokens / iteration if iteration > 0 else 0.0,
        feasible=bool((memory <= capacity).all()),
        capacity_fraction=options.capacity_fraction,
        options=options,
        columns=columns,
    )


_BREAKDOWN = (
    "linear_s",
    "overhead_s",
    "fsdp_exposed_s",
    "attention_s",
    "a2a_s",
    "kv_exchange_s",
    "kv_exposed_s",
    "kv_latency_s",
)
_MEMORY_BREAKDOWN = ("mem_activations", "mem_attention", "mem_comm")


@dataclass(frozen=True)
class _Columns:
    """``estimate``'s per-rank values as arrays (rank r at index r); ``ranks()`` turns them into
    ``RankEstimate`` rows (Python floats and ints) when someone reads ``Estimate.per_rank``: most
    estimates the planner makes are read only for their iteration time."""

    cluster: Cluster
    static: int
    values: dict[str, np.ndarray]

    def ranks(self) -> tuple[RankEstimate, ...]:
        v = {k: a.tolist() for k, a in self.values.items()}
        out = []
        for r, d in enumerate(self.cluster.devices):
            breakdown: dict[str, float] = {k: v[k][r] for k in _BREAKDOWN}
            breakdown["mem_static"] = self.static
            breakdown.update((k, v[k][r]) for k in _MEMORY_BREAKDOWN)
            out.append(
                RankEstimate(
                    rank=r,
                    gpu=d.gpu.name,
                    node=d.node,
                    tokens=v["tokens"][r],
                    heads=v["heads"][r],
                    compute_s=v["compute_s"][r],
                    comm_s=v["comm_s"][r],
                    exposed_comm_s=v["exposed_comm_s"][r],
                    time_s=v["time_s"][r],
                    memory_bytes=v["memory_bytes"][r],
                    capacity_bytes=v["capacity_bytes"][r],
                    device_memory_gib=d.memory_gib,
                    breakdown=breakdown,
                )
            )
        return tuple(out)


def memory_floor_fits(
    layout: Layout, cluster: Cluster, model: ModelSpec, options: TrainOptions = TrainOptions()
) -> bool:
    """False when some rank cannot fit even without its communication buffers (static memory,
    its tokens' activations and the attention core of its group's tokens): a necessary condition of
    ``estimate(...).feasible``, without the K/V exchange simulation (callers skip a memory mode)."""
    b = options.micro_batch_size
    static = static_memory_bytes(model, options, options.shard_ranks(layout.world_size))
    act = activation_bytes_per_token(model, options)
    tokens = [r.num_tokens for r in layout.ranks]
    group_tokens = {g.id: sum(tokens[r] for r in g.ranks) for g in layout.groups}
    hpg = layout.heads_per_query_group
    per_group_token = _attention_core_bytes(
        model, options, ((len(r.heads), len({h // hpg for h in r.heads})) for r in layout.ranks)
    )
    for plan, dev, core in zip(layout.ranks, cluster.devices, per_group_token):
        need = static + b * tokens[plan.rank] * act + b * group_tokens[plan.group] * core
        if need > int(options.capacity_fraction * dev.memory_bytes):
            return False
    return True


class RankMemory(NamedTuple):
    """Each rank's modelled bytes by part (int64 arrays; ``static`` one number for every rank)."""

    static: int
    activations: np.ndarray
    attention: np.ndarray
    comm: np.ndarray

    @property
    def total(self) -> np.ndarray:
        return self.static + self.activations + self.attention + self.comm


def rank_memory(
    model: ModelSpec,
    options: TrainOptions,
    world_size: int,
    tokens: np.ndarray,
    group_tokens: np.ndarray,
    head_count: Sequence[int],
    kv_count: Sequence[int],
    max_block_tokens: np.ndarray,
) -> RankMemory:
    """Each rank's modelled memory, the one formula ``estimate`` and the document pricing share:
    static (weights, gradients, optimizer), its tokens' activations, the attention core kept per
    token of its group and the key side of its largest received block's backward, the all-to-all
    buffers and the double-buffered K/V blocks (docs/cost_model.md, "Memory")."""
    b = options.micro_batch_size
    core = np.array(
        _attention_core_bytes(model, options, zip(head_count, kv_count)), dtype=np.int64
    )
    blk_bwd = np.array(
        [
            attention_backward_bytes_per_block_token(model, hq, hk)
            for hq, hk in zip(head_count, kv_count)
        ],
        dtype=np.int64,
    )
    kv_n = np.asarray(kv_count, dtype=np.int64)
    return RankMemory(
        static=static_memory_bytes(model, options, options.shard_ranks(world_size)),
        activations=b * tokens * activation_bytes_per_token(model, options),
        attention=b * group_tokens * core + b * max_block_tokens * blk_bwd,
        comm=b * tokens * a2a_buffer_bytes_per_token(model)
        + 4 * b * max_block_tokens * kv_n * kv_block_bytes_per_token(model),
    )


def _attention_core_bytes(
    model: ModelSpec, options: TrainOptions, heads_kv: Iterable[tuple[int, int]]
) -> list[int]:
    """``attention_bytes_per_group_token`` of each rank's (heads, K/V heads), once per pair."""
    memo: dict[tuple[int, int], int] = {}
    out = []
    for key in heads_kv:
        if key not in memo:
            memo[key] = attention_bytes_per_group_token(model, options, *key)
        out.append(memo[key])
    return out


@dataclass(frozen=True)
class _DeviceArrays:
    """Per device of one cluster: step overhead s, P2P latency s, kernel-call overhead s of packed
    micro-batches, memory bytes (arrays), and the GPU types as (first device of the type, a mask
    of its devices)."""

    overhead_s: np.ndarray
    p2p_latency_s: np.ndarray
    window_overhead_s: np.ndarray
    memory_bytes: np.ndarray
    types: tuple[tuple[int, np.ndarray], ...]


def _device_arrays(cluster: Cluster) -> _DeviceArrays:
    """``_DeviceArrays`` of the cluster, once per cluster."""
    # the memo holds tables of several kinds; ClusterArrays types it dict[str, Any]
    memo: dict[str, Any] = cluster_arrays(cluster).memo
    if "device_arrays" not in memo:
        first: dict[object, int] = {}
        of = np.array([first.setdefault(d.gpu, i) for i, d in enumerate(cluster.devices)])
        memo["device_arrays"] = _DeviceArrays(
            overhead_s=np.array([d.step_overhead_s for d in cluster.devices], dtype=np.float64),
            p2p_latency_s=np.array([d.p2p_latency_s for d in cluster.devices], dtype=np.float64),
            window_overhead_s=np.array(
                [d.window_overhead_s for d in cluster.devices], dtype=np.float64
            ),
            memory_bytes=np.array([d.memory_bytes for d in cluster.devices], dtype=np.int64),
            types=tuple((i, of == i) for i in first.values()),
        )
    return memo["device_arrays"]


def _node_pattern(cluster: Cluster, ranks: tuple[int, ...]) -> tuple[int, ...]:
    """Which members share a node, as first-occurrence indices ((0, 0, 1, 1): two nodes of two)."""
    seen: dict[str, int] = {}
    return tuple(seen.setdefault(cluster.devices[r].node, len(seen)) for r in ranks)


def _a2a_layer_s(
    cluster: Cluster,
    model: ModelSpec,
    ranks: tuple[int, ...],
    b: int,
    tok: list[int],
    hq: list[int],
    hkv: list[int],
) -> float:
    """One layer's forward head all-to-alls of a group: q, k, v in, attention output back.

    Bytes from member i to member j: q ``tokens_i * heads_j * d * 2``, k and v each
    ``tokens_i * kv_heads_j * d * 2``, output ``tokens_j * heads_i * d * 2`` (times b). Four
    collectives one after another. Backward runs the duals (same matrices transposed), which take
    the same time in this model. ``tok``, ``hq``, ``hkv``: tokens, query heads and K/V heads of the
    members.
    """
    if len(ranks) == 1:
        return 0.0
    unit = b * model.kv_channels * BF16_BYTES
    t_n = np.array(tok, dtype=np.int64) * unit  # exact integers, as the byte counts
    hq_n, hkv_n = np.array(hq, dtype=np.int64), np.array(hkv, dtype=np.int64)
    same, link = group_links(cluster, ranks)

    def slowest(nbytes_nn: np.ndarray) -> float:
        return float(rank_times_from_links(nbytes_nn.astype(np.float64), same, link).max())

    return (
        slowest(np.outer(t_n, hq_n))
        + 2 * slowest(np.outer(t_n, hkv_n))
        + slowest(np.outer(hq_n, t_n))
    )


def _sig(x: float) -> float:
    """Round to 9 significant digits for JSON."""
    return float(f"{x:.9g}")
