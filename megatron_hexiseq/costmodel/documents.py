"""Document-masked pricing: a layout's per-rank time, K/V bytes and memory for one packed micro-batch.

A micro-batch of packed documents has boundaries ``cu_seqlens = [0, b1, ..., N]`` in global token
positions. Attention is causal inside each document and nothing crosses a boundary, so:

- **pairs**: a query at position q of a document starting at d0 sees ``q - d0 + 1`` keys. A group's
  query tokens (after the head all-to-all every member computes all of them for its own heads) see
  ``pairs_G = sum over the group's query tokens of (q - d0(q) + 1)``; rank r computes
  ``pairs_G * |H_r|`` (query, key, head) triples. Closed form per piece ``[a, b)`` of one document:
  ``(a - d0 + 1 + b - d0) * (b - a) / 2``.
- **pruned K/V exchange** (the [Varlen] runtime's rule): a group receives from another group only
  K/V of documents it holds a later token of: key k of group s in document D goes to group g iff
  ``k <= last position of g in D``. Per receiver rank r those tokens travel for its K/V heads
  ``K_r``: ``kv_units_r = sum over source groups s of visible(s -> g) * |K_r|`` (token x K/V head),
  ``4 d`` bytes each (K and V, bf16) per layer and sequence. A block with no visible key is neither
  sent nor computed.
- **round compute**: the pieces of one document tile it, so a query piece sees every key of an
  earlier piece of the same document: ``pairs(g <- s) = sum of l_i * l_j`` over pieces i of g and
  earlier pieces j of s in the same document.

**Kernel calls**: ``costmodel.document_calls`` (each document window one kernel call at its
achieved rate on its kernel's call-size curve); the pieces and their pairs: ``costmodel.pieces``.

**Kernel-call overhead**: with two or more documents each rank's attention also pays the cluster's
``window_overhead_us`` per kernel call, forward and backward (``DocumentEstimate.kernel_calls``);
with one document it is ``estimate``'s runtime and pays nothing extra.

Everything else is ``costmodel.estimate``'s model (linear work, head all-to-all, the sub-ring order of
rounds ``(g - s) mod n``, the double-buffered pipeline, the fan-out of K/V heads, fixed costs and
their core-contention scaling (``costmodel.contention``), memory, bulk-synchronous iteration
time); with one document ``[0, N]`` this module reproduces ``estimate`` (a test pins it). Two exchange kinds: ``"pruned"`` (HexiSeq's sub-rings with document pruning) and
``"te-ring"`` (Transformer Engine's THD ring inside each ring group: every step forwards the
neighbour's whole K/V, no pruning; its per-step compute is taken as the ring's cross pairs spread
evenly over the steps). When a layout cuts documents into so many pieces that enumerating the
pruned rounds would be slow (``MAX_PIECE_PAIRS``), the rounds are taken as uniform too (pairs and
bytes stay exact; ``DocumentEstimate.exchange_model`` says which). docs/cost_model.md, "Packed
documents".
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import NamedTuple

import numpy as np

from megatron_hexiseq.cluster import Cluster
from megatron_hexiseq.costmodel.comm import ClusterArrays, cluster_arrays
from megatron_hexiseq.costmodel.contention import scale_fixed_costs, shared_core_members
from megatron_hexiseq.costmodel.document_calls import (
    VARLEN_KERNELS,
    BlockSlowdown,
    call_slowdown,
    document_calls,
    rank_kernel_calls,
)
from megatron_hexiseq.costmodel.estimate import (
    _a2a_layer_s,
    _device_arrays,
    rank_memory,
)
from megatron_hexiseq.costmodel.exchange import fan_units
from megatron_hexiseq.costmodel.formulas import (
    attention_s_per_pair_head,
    kv_block_bytes_per_token,
    linear_s_per_token,
)
from megatron_hexiseq.costmodel.pieces import (
    Pieces,
    check_cu_seqlens,
    document_pieces,
    expand_cells,
    own_group_pairs,
    piece_pairs,
)
from megatron_hexiseq.costmodel.rates import cluster_rates
from megatron_hexiseq.costmodel.step import fsdp_rank_exposed_s
from megatron_hexiseq.errors import HexiSeqError
from megatron_hexiseq.layout import Layout, check_matches
from megatron_hexiseq.model import ModelSpec
from megatron_hexiseq.run_config import TrainOptions

MAX_PIECE_PAIRS = 4_000_000  # earlier-piece pairs enumerated exactly; above: uniform rounds

EXCHANGES = ("pruned", "te-ring")


@dataclass(frozen=True, kw_only=True)
class DocumentEstimate:
    """One micro-batch of packed documents on a layout: per-rank arrays (rank r at index r) and the
    iteration. Counts are exact integers: ``pairs`` (the rank's group's document-masked query-key
    pairs; times ``heads`` for its work), ``kv_units`` (K/V tokens x K/V heads the rank receives in one
    forward of one layer and sequence; bytes = ``kv_units * 4 d``), ``rounds`` (blocks received),
    ``kernel_calls`` (attention kernel calls of one layer and pass: document windows, or blocks
    with a variable-length kernel; 0 for one document on a cluster without call-size curves)."""

    tokens: np.ndarray
    heads: np.ndarray
    pairs: np.ndarray
    kv_units: np.ndarray
    rounds: np.ndarray
    kernel_calls: np.ndarray
    linear_s: np.ndarray
    attention_s: np.ndarray
    a2a_s: np.ndarray
    kv_exchange_s: np.ndarray
    kv_exposed_s: np.ndarray
    time_s: np.ndarray
    memory_bytes: np.ndarray
    capacity_bytes: np.ndarray
    kv_bytes: int  # every rank's received K/V bytes, whole iteration (all layers and passes)
    iteration_time_s: float
    exchange_model: str  # "rounds" (every pruned round), "uniform" or "none" (one group)

    @property
    def feasible(self) -> bool:
        return bool((self.memory_bytes <= self.capacity_bytes).all())

    @property
    def imbalance(self) -> float:
        """Slowest rank's busy time over the mean rank's."""
        mean = float(self.time_s.mean())
        return float(self.time_s.max()) / mean if mean > 0 else 1.0


def cross_rounds(
    pieces: Pieces, group_of_rank: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None:
    """Per (receiver group g, source group s != g) with a shared document: visible tokens and pairs,
    or None when the enumeration would exceed ``MAX_PIECE_PAIRS``."""
    g = group_of_rank[pieces.rank]
    length = pieces.end - pieces.start
    # join touching pieces of one group inside one document (same positions, fewer pairs)
    new = np.ones(g.size, dtype=bool)
    new[1:] = (g[1:] != g[:-1]) | (pieces.doc[1:] != pieces.doc[:-1])
    idx = np.cumsum(new) - 1
    g, doc = g[new], pieces.doc[new]
    length = np.bincount(idx, weights=length).astype(np.int64)
    first_of_doc = np.searchsorted(doc, doc, side="left")  # pieces sorted by position, so by doc
    earlier = np.arange(doc.size) - first_of_doc
    total = int(earlier.sum())
    if total > MAX_PIECE_PAIRS:
        return None
    if total == 0:
        empty = np.zeros(0, dtype=np.int64)
        return empty, empty, empty, empty
    i = np.repeat(np.arange(doc.size), earlier)
    j = (
        np.repeat(first_of_doc, earlier)
        + np.arange(total)
        - np.repeat(np.cumsum(earlier) - earlier, earlier)
    )
    keep = g[i] != g[j]
    i, j = i[keep], j[keep]
    # the last piece of its group in its document: the keys before it are what the group receives
    last = np.ones(doc.size, dtype=bool)
    key_gd = doc * (int(g.max()) + 1) + g
    order = np.lexsort((np.arange(doc.size), key_gd))
    sorted_key = key_gd[order]
    is_last_sorted = np.ones(doc.size, dtype=bool)
    is_last_sorted[:-1] = sorted_key[:-1] != sorted_key[1:]
    last[order] = is_last_sorted
    n = int(group_of_rank.max()) + 1
    cell = g[i] * n + g[j]
    cells, inv = np.unique(cell, return_inverse=True)
    pairs = np.bincount(inv, weights=length[i] * length[j], minlength=cells.size)
    vis = np.bincount(inv, weights=np.where(last[i], length[j], 0), minlength=cells.size)
    # float64 sums of integers below 2^53 are exact
    return cells // n, cells % n, np.rint(vis).astype(np.int64), np.rint(pairs).astype(np.int64)


@lru_cache(maxsize=65536)
def _fan(
    sender: tuple[tuple[int, ...], ...], receiver: tuple[tuple[int, ...], ...]
) -> tuple[int, ...]:
    return tuple(fan_units(sender, receiver))


def estimate_documents(
    layout: Layout,
    cluster: Cluster,
    model: ModelSpec,
    options: TrainOptions,
    cu_seqlens: Sequence[int],
    *,
    exchange: str = "pruned",
    rings: Sequence[Sequence[int]] | None = None,
    packed: bool | None = None,
) -> DocumentEstimate:
    """Price ``layout`` for one micro-batch with document boundaries ``cu_seqlens`` (module docstring).
    ``model.seq_length`` must equal ``layout.seq_length`` (the micro-batch's tokens). ``rings``: the
    rank rings of ``exchange="te-ring"`` (default: one ring of all ranks; every layout group must be
    one rank). ``packed``: the micro-batch runs HexiSeq's packed path, whose blocks run the kernel's
    variable-length call (``rates.attention_rate``: flash's for ``cudnn``); default: with two or
    more documents under ``pruned`` (one document is the dense path, as ``estimate`` prices it;
    ``te-ring`` is Transformer Engine's THD ring, which keeps its fused kernel). A packed run passes
    True: every micro-batch of it runs the packed path, one document included."""
    if exchange not in EXCHANGES:
        raise HexiSeqError(f"unknown exchange {exchange!r}; use one of {', '.join(EXCHANGES)}")
    check_matches(layout, cluster, model)
    cu = check_cu_seqlens(cu_seqlens, layout.seq_length)
    b, L, W = options.micro_batch_size, model.num_layers, layout.world_size
    passes_fwd = 2 if options.recompute else 1
    hpg = layout.heads_per_query_group
    groups = layout.groups
    n = len(groups)
    gindex = {grp.id: i for i, grp in enumerate(groups)}
    gi = np.array([gindex[p.group] for p in layout.ranks])
    tokens = np.array([p.num_tokens for p in layout.ranks], dtype=np.int64)
    heads = np.array([len(p.heads) for p in layout.ranks], dtype=np.int64)
    kv_of = [tuple(sorted({h // hpg for h in p.heads})) for p in layout.ranks]
    kv_n = np.array([len(k) for k in kv_of], dtype=np.int64)
    pieces = document_pieces(layout, cu)
    pg = gi[pieces.rank]
    own = piece_pairs(pieces.start, pieces.end, cu[pieces.doc])
    g_pairs = np.bincount(pg, weights=own, minlength=n)  # exact below 2^53
    g_pairs = np.rint(g_pairs).astype(np.int64)
    g_tokens = np.bincount(gi, weights=tokens, minlength=n).astype(np.int64)

    dev = _device_arrays(cluster)
    if packed is None:
        packed = cu.size > 2 and exchange == "pruned"
    lin_rate, att_rate = np.empty(W), np.empty(W)
    for first, where in dev.types:
        lin_rate[where] = linear_s_per_token(model, cluster.devices[first], options)
        att_rate[where] = attention_s_per_pair_head(model, cluster.devices[first], options, packed)
    linear_s = tokens * lin_rate + dev.overhead_s
    if options.memory_mode == "fsdp":  # Megatron-FSDP's per-layer collectives, as estimate's
        linear_s = linear_s + fsdp_rank_exposed_s(cluster, model, options, tokens * lin_rate)
    # every window a kernel call at its own achieved rate (module docstring, "Kernel calls")
    rates = cluster_rates(cluster, model.kv_channels, options.attention_kernel, packed)
    own = np.rint(np.bincount(pg, weights=own_group_pairs(pieces, pg, cu), minlength=n)).astype(
        np.int64
    )
    slow_local, slow_cross = np.ones(W), np.ones(W)
    by_block: BlockSlowdown | None = None
    kernel_calls = np.zeros(W, dtype=np.int64)
    if rates.groups or cu.size > 2:
        calls = document_calls(pieces, pg, n, cu)
        one_call = np.array([k in VARLEN_KERNELS for k in rates.kernels]) & (cu.size > 2)
        if rates.groups:
            slow_local, slow_cross, by_block = call_slowdown(
                calls, layout, heads, rates, b, one_call
            )
        kernel_calls = rank_kernel_calls(calls, n, gi, one_call)
    attention_s = (own[gi] * slow_local + (g_pairs - own)[gi] * slow_cross) * heads * att_rate
    if cu.size > 2:  # several documents: each kernel call's fixed cost, forward and backward
        attention_s = attention_s + (passes_fwd + 1) * L * kernel_calls * dev.window_overhead_s

    # head all-to-all per group (estimate's formula, its fixed cost per collective)
    a2a_g, a2a_fixed_g = np.zeros(n), np.zeros(n)
    memo: dict[tuple, float] = {}
    for i, grp in enumerate(groups):
        if len(grp.ranks) == 1:
            continue
        key = (grp.ranks, tuple(tokens[list(grp.ranks)]), tuple(heads[list(grp.ranks)]))
        if key not in memo:
            memo[key] = _a2a_layer_s(
                cluster,
                model,
                grp.ranks,
                b,
                [int(tokens[r]) for r in grp.ranks],
                [int(heads[r]) for r in grp.ranks],
                [int(kv_n[r]) for r in grp.ranks],
            )
        latency = max(cluster.devices[r].collective_latency_s for r in grp.ranks)
        a2a_g[i] = (passes_fwd + 1) * L * (memo[key] + 4 * latency)
        a2a_fixed_g[i] = (passes_fwd + 1) * L * 4 * latency
    a2a_s = a2a_g[gi]

    # K/V exchange, one forward over all layers
    if exchange == "te-ring":
        if any(len(grp.ranks) != 1 for grp in groups):
            raise HexiSeqError("the te-ring exchange needs one rank per group (hp = 1)")
        ring_list = [tuple(range(W))] if rings is None else [tuple(x) for x in rings]
        ex = _te_ring(
            layout,
            cluster,
            model,
            b,
            gi,
            tokens,
            heads,
            kv_n,
            g_pairs,
            pieces,
            pg,
            cu,
            ring_list,
            (slow_local, slow_cross),
            rates.flops_per_s,
        )
    else:
        ex = _pruned(
            layout,
            cluster,
            model,
            b,
            gi,
            heads,
            kv_of,
            kv_n,
            g_pairs,
            g_tokens,
            pieces,
            pg,
            cu,
            (slow_local, slow_cross, by_block),
            rates.flops_per_s,
        )
    comm_fwd, exposed_fwd, kv_units, rounds, max_block, model_kind = ex
    steps = (passes_fwd + 2) * L
    kv_latency_s = steps * rounds * dev.p2p_latency_s
    if shared_core_members(cluster):  # shared cores: fixed costs paid while a sibling computes
        a2a_fixed = a2a_fixed_g[gi]
        busy = attention_s + a2a_s - a2a_fixed + (passes_fwd + 2) * exposed_fwd
        a2a_s, kv_latency_s = scale_fixed_costs(
            cluster, linear_s, busy, a2a_s, a2a_fixed, kv_latency_s
        )
    kv_exchange_s = (passes_fwd + 2) * comm_fwd + kv_latency_s
    kv_exposed_s = (passes_fwd + 2) * exposed_fwd + kv_latency_s
    time_s = linear_s + attention_s + a2a_s + kv_exposed_s

    memory = rank_memory(
        model, options, W, tokens, g_tokens[gi], heads.tolist(), kv_n.tolist(), max_block
    ).total
    capacity = (options.capacity_fraction * dev.memory_bytes).astype(np.int64)
    kv_bytes = int(kv_units.sum()) * kv_block_bytes_per_token(model) * b * L * (passes_fwd + 2)
    return DocumentEstimate(
        tokens=tokens,
        heads=heads,
        pairs=g_pairs[gi],
        kv_units=kv_units,
        rounds=rounds,
        kernel_calls=kernel_calls,
        linear_s=linear_s,
        attention_s=attention_s,
        a2a_s=a2a_s,
        kv_exchange_s=kv_exchange_s,
        kv_exposed_s=kv_exposed_s,
        time_s=time_s,
        memory_bytes=memory,
        capacity_bytes=capacity,
        kv_bytes=kv_bytes,
        iteration_time_s=float(linear_s.max()) + float((time_s - linear_s).max()),
        exchange_model=model_kind,
    )


def _pipeline(
    comp0: np.ndarray, rank: np.ndarray, comp: np.ndarray, comm: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """``pipelined_exposed_s`` for every rank at once. Block 0 of rank r computes ``comp0[r]``;
    entries (``rank``, ``comp``, ``comm``) are its received blocks in round order (entries of one
    rank in order). Returns (exposed_s, comm_sum_s) per rank."""
    W = comp0.size
    comp_end, comp_sum = comp0.astype(np.float64).copy(), comp0.astype(np.float64).copy()
    comm_end, comm_sum = np.zeros(W), np.zeros(W)
    free = [np.zeros(W), np.zeros(W)]
    if rank.size:
        first = np.searchsorted(rank, rank, side="left")
        k = np.arange(rank.size) - first + 1  # block number of each entry (1, 2, ...)
        order = np.argsort(k, kind="stable")
        bounds = np.searchsorted(k[order], np.arange(1, int(k.max()) + 2))
        for step in range(int(k.max())):
            e = order[bounds[step] : bounds[step + 1]]
            r, buf = rank[e], free[(step + 1) % 2]
            ce = np.maximum(comm_end[r], buf[r]) + comm[e]
            comm_end[r] = ce
            comp_end[r] = np.maximum(comp_end[r], ce) + comp[e]
            buf[r] = comp_end[r]
        np.add.at(comp_sum, rank, comp)
        np.add.at(comm_sum, rank, comm)
    exposed = comp_end - comp_sum
    return np.where(exposed > 1e-9 * comp_sum, exposed, 0.0), comm_sum


class GroupPorts(NamedTuple):
    """Per layout group: its node (-1 when its members span several) and its slowest NVLink and
    network ports. A received block travels over the sending group's slowest port and the
    receiver's own (``estimate``'s rule): ``link``."""

    node: np.ndarray
    nv: np.ndarray
    net: np.ndarray

    @classmethod
    def of(cls, layout: Layout, arrays: ClusterArrays) -> GroupPorts:
        """The ports of ``layout``'s groups on a cluster's ``comm.cluster_arrays``."""
        members = np.array([r for g in layout.groups for r in g.ranks])
        starts = np.cumsum([0] + [len(g.ranks) for g in layout.groups[:-1]])
        lo = np.minimum.reduceat(arrays.node[members], starts)
        hi = np.maximum.reduceat(arrays.node[members], starts)
        return cls(
            node=np.where(lo == hi, lo, -1),
            nv=np.minimum.reduceat(arrays.nv[members], starts),
            net=np.minimum.reduceat(arrays.net[members], starts),
        )

    def link(self, source: np.ndarray, rank: np.ndarray, arrays: ClusterArrays) -> np.ndarray:
        """Bytes/s of a block from group ``source`` to ``rank`` (element-wise): NVLink when the
        whole sending group sits on the receiver's node, else the network."""
        return np.where(
            self.node[source] == arrays.node[rank],
            np.minimum(self.nv[source], arrays.nv[rank]),
            np.minimum(self.net[source], arrays.net[rank]),
        )


def _pruned(
    layout, cluster, model, b, gi, heads, kv_of, kv_n, g_pairs, g_tokens, pieces, pg, cu, slow, rate
):
    """HexiSeq's sub-ring exchange with document pruning (module docstring). ``slow``: per rank,
    the (local, received) call slowdowns that scale the pipeline's compute, and per received block
    its own (``BlockSlowdown``, or None: the rank's received one); ``rate``: per rank the attention
    kernel's long-block FLOP/s (``rates.cluster_rates``), as ``estimate``'s exchange uses."""
    W, n, L = layout.world_size, len(layout.groups), model.num_layers
    zeros_f, zeros_i = np.zeros(W), np.zeros(W, dtype=np.int64)
    if n == 1:
        return zeros_f, zeros_f, zeros_i, zeros_i, zeros_i, "none"
    arrays = cluster_arrays(cluster)
    flops_per_pair_head = 4 * model.kv_channels * L * b
    bytes_per_token_head = kv_block_bytes_per_token(model) * L * b
    # received tokens per group, exactly: per (document, group), the document's tokens before the
    # group's last position there, less the group's own
    key = pieces.doc * n + pg
    cells, inv = np.unique(key, return_inverse=True)
    last_end = np.zeros(cells.size, dtype=np.int64)
    np.maximum.at(last_end, inv, pieces.end)
    own_tok = np.bincount(inv, weights=pieces.end - pieces.start, minlength=cells.size)
    vis_dg = last_end - cu[cells // n] - np.rint(own_tok).astype(np.int64)
    recv_g = np.rint(np.bincount(cells % n, weights=vis_dg, minlength=n)).astype(np.int64)
    kv_units = recv_g[gi] * kv_n
    own = np.rint(np.bincount(pg, weights=own_group_pairs(pieces, pg, cu), minlength=n)).astype(
        np.int64
    )
    comp0 = flops_per_pair_head * own[gi] * heads / rate * slow[0]
    cross = cross_rounds(pieces, gi)
    ports = GroupPorts.of(layout, arrays)
    nv, net = arrays.nv, arrays.net
    if cross is not None:
        rg, sg, vis, pairs = cross
        cell, r, pos = expand_cells(rg, layout)
        sig_of = [tuple(kv_of[m] for m in g.ranks) for g in layout.groups]
        sigs = sorted(set(sig_of))
        sig_index = {s: i for i, s in enumerate(sigs)}
        sig_id = np.array([sig_index[s] for s in sig_of])
        kmax = max(len(g.ranks) for g in layout.groups)
        fan = np.zeros((len(sigs), len(sigs), kmax))
        for pair in set(zip(sig_id[sg].tolist(), sig_id[rg].tolist())):
            a, c = pair
            fan[a, c, : len(sigs[c])] = _fan(sigs[a], sigs[c])
        s_of = sg[cell]
        keep = heads[r] > 0
        cell, r, pos, s_of = cell[keep], r[keep], pos[keep], s_of[keep]
        t = (gi[r] - s_of) % n
        order = np.lexsort((t, r))
        cell, r, pos, s_of = cell[order], r[order], pos[order], s_of[order]
        link = ports.link(s_of, r, arrays)
        comm = bytes_per_token_head * vis[cell] * fan[sig_id[s_of], sig_id[gi[r]], pos] / link
        block_slow = slow[1][r] if slow[2] is None else slow[2].lookup(r, s_of, slow[1][r])
        comp = flops_per_pair_head * pairs[cell] * heads[r] / rate[r] * block_slow
        exposed, comm_sum = _pipeline(comp0, r, comp, comm)
        rounds = np.bincount(r, minlength=W).astype(np.int64)
        max_block = zeros_i.copy()
        np.maximum.at(max_block, r, vis[cell])
        return comm_sum, exposed, kv_units, rounds, max_block, "rounds"
    # uniform rounds: R_g = min(n - 1, other groups met per document); equal blocks
    doc_groups = np.bincount(cells // n, minlength=cu.size - 1)
    met = np.bincount(cells % n, weights=doc_groups[cells // n] - 1, minlength=n)
    R = np.minimum(n - 1, np.rint(met).astype(np.int64))[gi]
    R = np.where((kv_units > 0) & (heads > 0), np.maximum(R, 1), 0)
    cross_comp = flops_per_pair_head * (g_pairs - own)[gi] * heads / rate * slow[1]
    comm_total = bytes_per_token_head * kv_units / np.minimum(net, nv)
    r = np.repeat(np.arange(W), R)
    per = np.maximum(R, 1)
    exposed, comm_sum = _pipeline(comp0, r, (cross_comp / per)[r], (comm_total / per)[r])
    max_block = np.where(R > 0, -(-recv_g[gi] // per), 0)  # the mean block, rounded up
    return comm_sum, exposed, kv_units, R, max_block, "uniform"


def _te_ring(
    layout, cluster, model, b, gi, tokens, heads, kv_n, g_pairs, pieces, pg, cu, rings, slow, rate
):
    """Transformer Engine's THD ring inside each ring of ranks (module docstring); ``slow`` as
    ``_pruned``'s."""
    W, L = layout.world_size, model.num_layers
    arrays = cluster_arrays(cluster)
    flops_per_pair_head = 4 * model.kv_channels * L * b
    bytes_per_token_head = kv_block_bytes_per_token(model) * L * b
    own = np.rint(
        np.bincount(pg, weights=own_group_pairs(pieces, pg, cu), minlength=len(layout.groups))
    ).astype(np.int64)[gi]
    comp0 = flops_per_pair_head * own * heads / rate * slow[0]
    entries_r, entries_comm, entries_comp = [], [], []
    kv_units = np.zeros(W, dtype=np.int64)
    rounds = np.zeros(W, dtype=np.int64)
    max_block = np.zeros(W, dtype=np.int64)
    for ring in rings:
        ring = np.asarray(ring)
        c = ring.size
        if c == 1:
            continue
        prev = np.roll(ring, 1)  # each step a rank receives from its ring predecessor
        same = arrays.node[prev] == arrays.node[ring]
        link = np.where(
            same,
            np.minimum(arrays.nv[prev], arrays.nv[ring]),
            np.minimum(arrays.net[prev], arrays.net[ring]),
        )
        k = np.arange(1, c)
        src = ring[(np.arange(c)[:, None] - k[None, :]) % c]  # [c, c-1] original owner per step
        comm = bytes_per_token_head * tokens[src] * kv_n[ring][:, None] / link[:, None]
        comp = (
            flops_per_pair_head
            * (g_pairs[gi][ring] - own[ring])
            * heads[ring]
            / rate[ring]
            * slow[1][ring]
            / (c - 1)
        )
        entries_r.append(np.repeat(ring, c - 1))
        entries_comm.append(comm.ravel())
        entries_comp.append(np.repeat(comp, c - 1))
        kv_units[ring] = (tokens[ring].sum() - tokens[ring]) * kv_n[ring]
        rounds[ring] = c - 1
        max_block[ring] = tokens[src].max(axis=1)
    if entries_r:
        r = np.concatenate(entries_r)
        order = np.argsort(r, kind="stable")
        exposed, comm_sum = _pipeline(
            comp0,
            r[order],
            np.concatenate(entries_comp)[order],
            np.concatenate(entries_comm)[order],
        )
    else:
        exposed, comm_sum = np.zeros(W), np.zeros(W)
    return comm_sum, exposed, kv_units, rounds, max_block, "uniform"
