"""The planner's linear surrogate of the cost model: integer coefficients that CP-SAT can use.

The final score of every candidate is ``costmodel.estimate``; this surrogate is only how the
planner *searches*. It keeps the parts of the cost model that decide a good split and makes them
linear in the decision variables once a group's token count ``T_g`` is fixed:

Units: tokens are counted in **units** of ``unit`` tokens (the granularity: the largest power of
two dividing ``seq_length`` that is at most ``seq_length / (64 * world_size)``, at least 1, so
every rank's share is resolved to within ~1/64 of an even share); time is **integer nanoseconds**
(µs would round away the per-unit cost of small models at thousands of GPUs).

For rank ``r`` holding ``t_r`` units and ``h_r`` of ``H`` query heads in group ``g`` (``T_g``
units; ``N`` units in the whole sequence; ``b`` = micro-batch size multiplies every term), two
phases, as ``costmodel.estimate`` (bulk-synchronous: every layer's attention synchronises the CP
domain, the linear work between two attentions does not)::

    linear_r    = t_r * l_r                                   (linear phase)
    attention_r = t_r * s_r  +  h_r * beta_r(T_g)             (attention phase: A2A, attention, K/V ring)
    objective   = Z_lin + Z_att,  Z_lin >= linear_r,  Z_att >= attention_r   for every rank r
    l_r         = unit * k_lin * linear_flops_per_token / F_r
    s_r         = unit * [|g|>1] a2a_bytes_per_token / bw_g
    beta_r(T)   = max(T * b_r, (N - T) * c_r)  +  T * e_r                (attention vs K/V ring, overlapped;
                  the mirrored arrangement over the whole sequence: ``planner.coef`` has the
                  position-aware terms for other places, and the K/V fan-out)
    b_r         = unit * k_att * attention_flops_per_pair_head * (S+1)/2 / F^att_r
    c_r         = unit * kv_bytes_per_token_per_head / bw_r              [more than one group]
                  (bw_r: harmonic mean of min(own, sender) network bandwidth, ``effective_ring_bw``)
    e_r         = unit * a2a_bytes_per_token / H / bw_g                  [|g|>1]

``bw_g`` is NVLink when the group sits inside one node, the network when it spans nodes.

- Linear work is proportional to the rank's own tokens (cost model, linear term).
- With the mirrored head+tail arrangement (``planner.build``) a group's causal pairs are
  ``T_g*unit*(S+1)/2``, and every member computes them for its own heads.
- A2A bytes per token: Q, K, V and the output, once per forward pass and once in backward
  (``passes = 2``, 3 with recompute): ``layers * passes * (2H + 2G) * d * 2`` bytes (bf16). The rank's
  own share is bounded linearly by ``t_r * bytes`` (send) plus ``T_g * h_r/H * bytes`` (receive).
- K/V from other groups (the cost model's sub-ring exchange): ``kv_block_bytes_per_token * layers *
  (forward passes + 2) * G/H`` bytes per token and query head (forward K/V, backward K/V again and
  dK/dV back), over the network (NVLink when the whole cluster is one node), pipelined behind the
  attention compute (hence the max). Causally hidden tokens are counted (an upper bound).
- ``k_lin``/``k_att`` calibrate the FLOP terms against ``estimate`` on one probe layout (one group,
  rank 0 holding all heads), so recompute and the cost model's own constants carry over.

Memory: ``t_r * mt_r + h_r * T_g * mh_r <= free_r`` (bytes) with ``free_r = capacity_fraction * memory
- static`` (``costmodel.static_memory_bytes``), ``mt_r = unit * activation_bytes_per_token`` and
``mh_r = unit * attention_bytes_per_group_token(H, G) / H`` (the attention core kept per group token
and head); terms the surrogate misses (buffers, K/V blocks) are caught by ``estimate`` and fed back
by lowering ``free_r``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from functools import cached_property
from typing import TYPE_CHECKING, NamedTuple

from megatron_hexiseq import costmodel
from megatron_hexiseq.cluster import Cluster
from megatron_hexiseq.layout import split_evenly
from megatron_hexiseq.model import ModelSpec
from megatron_hexiseq.planner.build import build_layout, hosts_and_gpus
from megatron_hexiseq.run_config import TrainOptions

if TYPE_CHECKING:
    from megatron_hexiseq.planner.coef import GroupCoef

BYTES_PER_ELEMENT = 2  # bf16 activations


class RankCoefs(NamedTuple):
    """One rank's surrogate coefficients in a group, integer ns (``Surrogate.rank_coef_ns``)."""

    lin: int  # l_r: the linear phase per own unit
    s: int  # s_r: A2A per own unit (attention phase)
    b: int  # b_r: attention per head per unit, whole sequence
    c: int  # c_r: K/V per head per visible unit
    e: int  # e_r: A2A per head per group unit


@dataclass(frozen=True)
class DeviceCoef:
    """Per-device surrogate coefficients (floats, seconds); turned into integer ns per group."""

    lin_s: float  # linear-layer seconds per unit
    att_s: float  # attention seconds per head per group unit (b_r)
    a2a_tok_s: float  # A2A seconds per unit of own tokens over NVLink (inside a group of >1)
    a2a_head_s: float  # A2A seconds per head per group unit over NVLink (e_r)
    net_over_nv: float  # NVLink / network bandwidth: the A2A slowdown of a group spanning nodes
    kv_s: float  # K/V ring seconds per head per unit of other groups' tokens (c_r)
    free_bytes: int  # usable memory minus parameters/gradients/optimizer states
    mem_tok_bytes: int  # activation bytes per own token unit
    mem_head_bytes: int  # attention-core bytes per head per group token unit

    @property
    def cap_units(self) -> int:
        """Token units that fit with no heads."""
        return max(0, self.free_bytes // self.mem_tok_bytes) if self.mem_tok_bytes else 1 << 40


@dataclass(frozen=True)
class Surrogate:
    """Everything the planner stages need about the cluster, in integer-friendly form."""

    seq_length: int
    unit: int
    num_units: int
    heads: int
    devices: tuple[DeviceCoef, ...]
    k_lin: float = 1.0
    k_att: float = 1.0

    @cached_property
    def device_kinds(self) -> list[int]:
        """Per rank, the index of its device coefficients among the distinct ones (equal devices,
        equal index)."""
        kind: dict[DeviceCoef, int] = {}
        return [kind.setdefault(d, len(kind)) for d in self.devices]

    @cached_property
    def group_coefs(self) -> dict[tuple[tuple[int, ...], bool, bool], GroupCoef]:
        """``stage1_groups.base_coefs``' memo for this surrogate: the group coefficients built so
        far, shared by every grouping Stage I scores (a scaled or lowered surrogate starts empty),
        by (each member's ``device_kinds`` index, spans nodes, more than one group)."""
        return {}

    def rank_coef_ns(
        self, r: int, group_size: int, num_groups: int, spans_nodes: bool = False
    ) -> RankCoefs:
        """Rank r's coefficients in integer ns inside a group of ``group_size`` of
        ``num_groups``: l_r the linear phase per own unit, s_r the A2A per own unit (attention phase)."""
        d = self.devices[r]
        slow = d.net_over_nv if spans_nodes else 1.0
        s = d.a2a_tok_s * slow if group_size > 1 else 0.0
        c = d.kv_s if num_groups > 1 else 0.0
        e = d.a2a_head_s * slow if group_size > 1 else 0.0
        return RankCoefs(_ns(d.lin_s), _ns(s), _ns(d.att_s), _ns(c), _ns(e))

    def scaled(
        self, factors: Sequence[float], kv_factors: Sequence[float] | None = None
    ) -> Surrogate:
        """Every time coefficient of device r multiplied by ``factors[r]`` (feedback from ``estimate``),
        the K/V ring coefficient ``kv_s`` by ``kv_factors[r]`` when given (calibrated on its own)."""
        kv = factors if kv_factors is None else kv_factors
        made: dict[tuple[DeviceCoef, float, float], DeviceCoef] = {}  # equal inputs, one object
        for key in zip(self.devices, factors, kv):
            if key not in made:
                d, f, fk = key
                made[key] = replace(
                    d,
                    lin_s=d.lin_s * f,
                    att_s=d.att_s * f,
                    a2a_tok_s=d.a2a_tok_s * f,
                    a2a_head_s=d.a2a_head_s * f,
                    kv_s=d.kv_s * fk,
                )
        return replace(self, devices=tuple(made[key] for key in zip(self.devices, factors, kv)))

    def with_free(self, free: Sequence[int]) -> Surrogate:
        return replace(
            self, devices=tuple(replace(d, free_bytes=int(f)) for d, f in zip(self.devices, free))
        )


def _ns(seconds: float) -> int:
    """Seconds -> integer ns, at least 1 for a positive cost so no term vanishes."""
    if seconds <= 0:
        return 0
    return max(1, round(seconds * 1e9))


def granularity(seq_length: int, world_size: int) -> int:
    """Tokens per unit: largest power of two dividing S with unit <= S / (64 * W); at least 1."""
    limit = max(1, seq_length // (64 * world_size))
    unit = 1
    while seq_length % (unit * 2) == 0 and unit * 2 <= limit:
        unit *= 2
    return unit


def a2a_bytes_per_token(model: ModelSpec, recompute: bool = False) -> int:
    """All-to-all bytes per token, all layers: Q, K, V, out per forward pass, and the backward duals."""
    H, G, d = model.num_attention_heads, model.num_query_groups, model.kv_channels
    passes = 3 if recompute else 2
    return model.num_layers * passes * (2 * H + 2 * G) * d * BYTES_PER_ELEMENT


def kv_bytes_per_token_per_head(model: ModelSpec, recompute: bool = False) -> float:
    """K/V exchange bytes per token per *query* head, all layers: (forward passes + 2) x K and V of a kv head."""
    H, G, d = model.num_attention_heads, model.num_query_groups, model.kv_channels
    passes = (2 if recompute else 1) + 2
    return model.num_layers * passes * 2 * d * BYTES_PER_ELEMENT * G / H


def effective_ring_bw(own_bw: float, ring_bws: Sequence[float]) -> float:
    """K/V-exchange bandwidth of a rank (bytes/s): a transfer runs at the slower end of its link, and
    the rank receives from every other group, so the rate is the harmonic mean over the cluster's
    devices of ``min(own, sender)`` (senders weighted equally: their tokens are not known yet). With
    one slow GPU type on the network the fast ranks' exchange slows too (the cost model's rounds:
    ``costmodel.exchange``); the own bandwidth alone made the slow type look twice as slow as the rest
    and hid the cost of more heads per fast rank (4096-GPU planner_scale: groups of 4 H100s)."""
    counts: dict[float, int] = {}
    for bw in ring_bws:
        counts[bw] = counts.get(bw, 0) + 1
    total = sum(counts.values())
    return total / sum(k / min(own_bw, bw) for bw, k in counts.items())


def build_surrogate(
    cluster: Cluster,
    model: ModelSpec,
    options: TrainOptions,
    seq_length: int,
    *,
    k_lin: float = 1.0,
    k_att: float = 1.0,
) -> Surrogate:
    """Surrogate coefficients for every device (see module docstring for the formulas)."""

    W, H = cluster.world_size, model.num_attention_heads
    unit = granularity(seq_length, W)
    lin_flops = costmodel.linear_flops_per_token(model)
    att_flops = costmodel.attention_flops_per_pair_head(model)
    recompute = options.recompute
    b = options.micro_batch_size
    a2a_b = b * a2a_bytes_per_token(model, recompute)
    kv_b = b * kv_bytes_per_token_per_head(model, recompute)
    domain = options.shard_ranks(W)
    static = costmodel.static_memory_bytes(model, options, domain)
    act = b * costmodel.activation_bytes_per_token(model, options)
    G = model.num_query_groups
    att_mem = (
        b * costmodel.attention_bytes_per_group_token(model, options, H, G) / H
    )  # per head, kv shared
    frac = options.capacity_fraction
    multi_node = len({d.node for d in cluster.devices}) > 1
    ring_bws = [(d.network_GBps if multi_node else d.nvlink_GBps) * 1e9 for d in cluster.devices]
    devs = []
    for dev, own_bw in zip(cluster.devices, ring_bws):
        nv = dev.nvlink_GBps * 1e9
        ring_bw = effective_ring_bw(own_bw, ring_bws)
        att_fps = dev.attention_flops_per_s
        free = frac * dev.memory_bytes - static
        devs.append(
            DeviceCoef(
                lin_s=unit * b * k_lin * lin_flops / dev.flops_per_s,
                att_s=unit * b * k_att * att_flops * (seq_length + 1) / 2 / att_fps,
                a2a_tok_s=unit * a2a_b / nv,
                a2a_head_s=unit * a2a_b / H / nv,
                net_over_nv=dev.nvlink_GBps / dev.network_GBps,
                kv_s=unit * kv_b / ring_bw,
                free_bytes=max(0, math.floor(free)),
                mem_tok_bytes=act * unit,
                mem_head_bytes=math.ceil(att_mem * unit),
            )
        )
    return Surrogate(
        seq_length=seq_length,
        unit=unit,
        num_units=seq_length // unit,
        heads=H,
        devices=tuple(devs),
        k_lin=k_lin,
        k_att=k_att,
    )


def calibrate(
    cluster: Cluster, model: ModelSpec, options: TrainOptions, seq_length: int
) -> tuple[float, float]:
    """Fit (k_lin, k_att) so the surrogate's FLOP terms match ``estimate``'s per-rank compute_s.

    Probe: one group per node (one group of all ranks when some node has a single GPU), even tokens,
    the first rank of each group holding every head. Ranks without heads do linear work only
    (-> k_lin, median); the head holders add their group's attention (-> k_att, median). Falls back
    to 1.0 when the probe cannot separate the terms (one rank) or gives a non-positive factor.
    """
    W, H = cluster.world_size, model.num_attention_heads
    if W < 2 or seq_length < W:
        return 1.0, 1.0
    blocks: dict[str, list[int]] = {}
    for d in cluster.devices:
        blocks.setdefault(d.node, []).append(d.index)
    groups = list(blocks.values())
    if any(len(g) < 2 for g in groups):
        groups = [list(range(W))]
    hosts, gpus = hosts_and_gpus(cluster)
    tokens = split_evenly(seq_length, W)
    heads = [0] * W
    for g in groups:
        heads[g[0]] = H
    probe = build_layout(
        seq_length=seq_length,
        num_attention_heads=H,
        num_query_groups=model.num_query_groups,
        groups=groups,
        rank_tokens=tokens,
        rank_heads=heads,
        hosts=hosts,
        gpus=gpus,
    )
    est = costmodel.estimate(probe, cluster, model, options)
    b = options.micro_batch_size
    lin = costmodel.linear_flops_per_token(model) * b
    k_lins = sorted(
        est.per_rank[r].compute_s * cluster.devices[r].flops_per_s / (tokens[r] * lin)
        for r in range(W)
        if heads[r] == 0 and tokens[r] > 0
    )
    k_lin = k_lins[len(k_lins) // 2]
    k_atts = []
    for g in groups:
        r = g[0]
        dev = cluster.devices[r]
        att_fps = dev.attention_flops_per_s
        att_s = est.per_rank[r].compute_s - k_lin * tokens[r] * lin / dev.flops_per_s
        pairs = costmodel.causal_pairs(
            probe.group_segments(probe.ranks[r].group), [(0, seq_length)]
        )
        k_atts.append(
            att_s * att_fps / (b * pairs * H * costmodel.attention_flops_per_pair_head(model))
        )
    k_atts.sort()
    k_att = k_atts[len(k_atts) // 2]
    k_lin = k_lin if k_lin > 0 and math.isfinite(k_lin) else 1.0
    k_att = k_att if k_att > 0 and math.isfinite(k_att) else 1.0
    return k_lin, k_att
