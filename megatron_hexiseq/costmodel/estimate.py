"""``estimate``: modelled iteration time and memory of a layout on a cluster.

Per rank (all layers, one iteration = one micro-batch of ``b`` sequences, forward + backward):

- ``linear_s``    = b * tokens_r * train_flops(linear_flops_per_token) / flops_per_s + ``overhead_s``
                    (the device's fixed ``step_overhead_s`` per iteration: optimizer, framework)
- ``attention_s`` = b * causal_pairs(group segments, [0, S)) * heads_r
                    * train_flops(attention_flops_per_pair_head) / attention_flops_per_s
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

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from megatron_hexiseq.cluster import Cluster
from megatron_hexiseq.costmodel.comm import alltoall_time_s
from megatron_hexiseq.costmodel.exchange import kv_exchange_forward
from megatron_hexiseq.costmodel.formulas import (
    BF16_BYTES,
    a2a_buffer_bytes_per_token,
    activation_bytes_per_token,
    attention_bytes_per_group_token,
    attention_s_per_pair_head,
    causal_pairs,
    kv_block_bytes_per_token,
    linear_s_per_token,
    static_memory_bytes,
)
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
    per_rank: tuple[RankEstimate, ...]
    feasible: bool
    capacity_fraction: float = 0.95
    options: TrainOptions = field(default_factory=TrainOptions)

    @property
    def bottleneck_rank(self) -> int:
        """The rank whose time is the iteration time (lowest index on ties)."""
        return max(self.per_rank, key=lambda r: (r.time_s, -r.rank)).rank

    def memory_problems(self) -> list[str]:
        """One line per rank over capacity, e.g. ``rank 5 (L40S-48GB) needs 51.2 GiB > 45.6 GiB (95% of 48 GiB)``."""
        return [
            f"rank {r.rank} ({r.gpu}) needs {r.memory_bytes / GIB:.1f} GiB > {r.capacity_bytes / GIB:.1f} GiB "
            f"({self.capacity_fraction * 100:g}% of {r.device_memory_gib:g} GiB)"
            for r in self.per_rank if not r.fits
        ]

    def to_predicted(self) -> dict[str, Any]:
        """The layout JSON's ``predicted`` block."""
        return {
            "iteration_time_s": _sig(self.iteration_time_s),
            "tokens_per_s": _sig(self.tokens_per_s),
            "feasible": self.feasible,
            "per_rank": [{"rank": r.rank, "time_s": _sig(r.time_s), "memory_gib": round(r.memory_bytes / GIB, 4)}
                         for r in self.per_rank],
        }


def estimate(layout: Layout, cluster: Cluster, model: ModelSpec, options: TrainOptions = TrainOptions()) -> Estimate:
    """Model one training iteration of ``layout`` (rank r on ``cluster.devices[r]``)."""
    check_matches(layout, cluster, model)
    b, L = options.micro_batch_size, model.num_layers
    passes_fwd = 2 if options.recompute else 1
    static = static_memory_bytes(model, options, options.data_parallel_size * layout.world_size)
    act_per_token = activation_bytes_per_token(model, options)
    exchange = kv_exchange_forward(layout, cluster, model, b)

    tokens = [r.num_tokens for r in layout.ranks]
    kv_count = [len(layout.kv_heads(r.rank)) for r in layout.ranks]
    group_pairs: dict[int, int] = {}
    group_a2a_s: dict[int, float] = {}
    group_tokens_of: dict[int, int] = {}
    a2a_memo: dict[tuple, float] = {}  # groups of one structure (devices, tokens, heads) cost the same
    for g in layout.groups:
        group_pairs[g.id] = causal_pairs(layout.group_segments(g.id), [(0, layout.seq_length)])
        group_tokens_of[g.id] = sum(tokens[r] for r in g.ranks)
        key = (tuple(cluster.devices[r].gpu.name for r in g.ranks), _node_pattern(cluster, g.ranks),
               tuple((cluster.devices[r].nvlink_GBps, cluster.devices[r].network_GBps) for r in g.ranks),
               tuple(tokens[r] for r in g.ranks), tuple(len(layout.ranks[r].heads) for r in g.ranks),
               tuple(kv_count[r] for r in g.ranks))
        if key not in a2a_memo:
            a2a_memo[key] = _a2a_layer_s(layout, cluster, model, g.ranks, b)
        group_a2a_s[g.id] = (passes_fwd + 1) * L * a2a_memo[key]
        if len(g.ranks) > 1:  # fixed cost per collective: 4 per layer and pass, the slowest member's
            group_a2a_s[g.id] += (passes_fwd + 1) * L * 4 * max(cluster.devices[r].collective_latency_s
                                                                for r in g.ranks)

    per_rank = []
    rate: dict[object, tuple[float, float]] = {}  # per GPU type: (linear s per token, attention s per pair-head)
    att_mem: dict[tuple[int, int], int] = {}
    a2a_buf, kv_block = a2a_buffer_bytes_per_token(model), kv_block_bytes_per_token(model)
    for plan in layout.ranks:
        dev = cluster.devices[plan.rank]
        heads, kv = len(plan.heads), kv_count[plan.rank]
        group_tokens = group_tokens_of[plan.group]
        overhead_s = dev.step_overhead_s
        if dev.gpu not in rate:
            rate[dev.gpu] = (linear_s_per_token(model, dev, options), attention_s_per_pair_head(model, dev, options))
        lin_rate, att_rate = rate[dev.gpu]
        if (heads, kv) not in att_mem:
            att_mem[(heads, kv)] = attention_bytes_per_group_token(model, options, heads, kv)
        linear_s = tokens[plan.rank] * lin_rate + overhead_s
        attention_s = group_pairs[plan.group] * heads * att_rate
        a2a_s = group_a2a_s[plan.group]
        kv_latency_s = (passes_fwd + 2) * L * exchange.rounds[plan.rank] * dev.p2p_latency_s
        kv_s = (passes_fwd + 2) * exchange.comm_s[plan.rank] + kv_latency_s
        kv_exposed_s = (passes_fwd + 2) * exchange.exposed_s[plan.rank] + kv_latency_s
        compute_s = linear_s + attention_s
        exposed_s = a2a_s + kv_exposed_s
        mem = {
            "mem_static": static,
            "mem_activations": b * tokens[plan.rank] * act_per_token,
            "mem_attention": b * group_tokens * att_mem[(heads, kv)],
            "mem_comm": b * tokens[plan.rank] * a2a_buf + 4 * b * exchange.max_block_tokens[plan.rank] * kv * kv_block,
        }
        memory = sum(mem.values())
        per_rank.append(RankEstimate(
            rank=plan.rank, gpu=dev.gpu.name, node=dev.node, tokens=tokens[plan.rank], heads=heads,
            compute_s=compute_s, comm_s=a2a_s + kv_s, exposed_comm_s=exposed_s, time_s=compute_s + exposed_s,
            memory_bytes=memory, capacity_bytes=int(options.capacity_fraction * dev.memory_bytes),
            device_memory_gib=dev.memory_gib,
            breakdown={"linear_s": linear_s, "overhead_s": overhead_s, "attention_s": attention_s, "a2a_s": a2a_s,
                       "kv_exchange_s": kv_s, "kv_exposed_s": kv_exposed_s, "kv_latency_s": kv_latency_s, **mem},
        ))
    # Bulk-synchronous phases: each layer's attention (head all-to-all, K/V exchange) synchronises
    # the whole CP domain, the linear work between two attentions does not. So the iteration is the
    # slowest linear phase plus the slowest attention phase, not the slowest rank's sum: a rank
    # heavy in linear work and another heavy in attention do not hide each other's time.
    iteration = (max(r.breakdown["linear_s"] for r in per_rank)
                 + max(r.time_s - r.breakdown["linear_s"] for r in per_rank))
    batch_tokens = layout.seq_length * b * options.data_parallel_size
    return Estimate(iteration_time_s=iteration, tokens_per_s=batch_tokens / iteration if iteration > 0 else 0.0,
                    per_rank=tuple(per_rank), feasible=all(r.fits for r in per_rank),
                    capacity_fraction=options.capacity_fraction, options=options)


def memory_floor_fits(layout: Layout, cluster: Cluster, model: ModelSpec, options: TrainOptions = TrainOptions()
                      ) -> bool:
    """False when some rank cannot fit even without its communication buffers (static memory,
    its tokens' activations and the attention core of its group's tokens): a necessary condition of
    ``estimate(...).feasible``, without the K/V exchange simulation (callers skip a memory mode)."""
    b = options.micro_batch_size
    static = static_memory_bytes(model, options, options.data_parallel_size * layout.world_size)
    act = activation_bytes_per_token(model, options)
    group_tokens = {g.id: layout.group_num_tokens(g.id) for g in layout.groups}
    for plan in layout.ranks:
        dev = cluster.devices[plan.rank]
        need = (static + b * plan.num_tokens * act + b * group_tokens[plan.group]
                * attention_bytes_per_group_token(model, options, len(plan.heads), len(layout.kv_heads(plan.rank))))
        if need > int(options.capacity_fraction * dev.memory_bytes):
            return False
    return True


def _node_pattern(cluster: Cluster, ranks: tuple[int, ...]) -> tuple[int, ...]:
    """Which members share a node, as first-occurrence indices ((0, 0, 1, 1): two nodes of two)."""
    seen: dict[str, int] = {}
    return tuple(seen.setdefault(cluster.devices[r].node, len(seen)) for r in ranks)


def _a2a_layer_s(layout: Layout, cluster: Cluster, model: ModelSpec, ranks: tuple[int, ...], b: int) -> float:
    """One layer's forward head all-to-alls of a group: q, k, v in, attention output back.

    Bytes from member i to member j: q ``tokens_i * heads_j * d * 2``, k and v each
    ``tokens_i * kv_heads_j * d * 2``, output ``tokens_j * heads_i * d * 2`` (times b). Four
    collectives one after another. Backward runs the duals (same matrices transposed), which take
    the same time in this model.
    """
    if len(ranks) == 1:
        return 0.0
    unit = b * model.kv_channels * BF16_BYTES
    tok = [layout.ranks[r].num_tokens for r in ranks]
    hq = [len(layout.ranks[r].heads) for r in ranks]
    hkv = [len(layout.kv_heads(r)) for r in ranks]
    q = [[unit * ti * hj for hj in hq] for ti in tok]
    kv = [[unit * ti * hj for hj in hkv] for ti in tok]
    out = [[unit * tj * hi for tj in tok] for hi in hq]
    return (alltoall_time_s(q, ranks, cluster) + 2 * alltoall_time_s(kv, ranks, cluster)
            + alltoall_time_s(out, ranks, cluster))


def _sig(x: float) -> float:
    """Round to 9 significant digits for JSON."""
    return float(f"{x:.9g}")
