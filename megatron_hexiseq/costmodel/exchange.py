"""Cross-group K/V exchange (HexiSeq's sub-rings), vectorised over ranks.

Round model (docs/cost_model.md, "K/V exchange"), the runtime's schedule
(``megatron_hexiseq/attention/peers.py``): groups in layout order ``G_0 .. G_{n-1}``. Round 0 is a
group's own K/V (already local after the head all-to-all). In round ``t`` group ``G_i`` receives
the K/V of group ``G_{(i-t) mod n}``: for each kv head a rank needs, from one holder of that kv
head there (least loaded so far in the round, lowest rank on ties), only the tokens at positions
<= the last query position of ``G_i`` (causally hidden tokens are neither sent nor computed; a
round with nothing visible is skipped). Transfers are double-buffered against the attention of the
previous block (:func:`megatron_hexiseq.costmodel.comm.pipelined_exposed_s`, which this
vectorises). All links of one round between two single-node groups have one bandwidth, so a
receiver's round time is ``max(its own receive, the send of each of its senders)`` in kv-head
blocks (a sender serves every receiver that picked it, one copy each).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from megatron_hexiseq.cluster import Cluster
from megatron_hexiseq.costmodel.comm import cluster_arrays
from megatron_hexiseq.costmodel.formulas import kv_block_bytes_per_token
from megatron_hexiseq.costmodel.rates import ClusterRates, cluster_rates
from megatron_hexiseq.layout import Layout
from megatron_hexiseq.model import ModelSpec

_CHUNK_ELEMENTS = 1 << 20  # rounds are batched so one batch's arrays hold about this many elements


@dataclass(frozen=True, kw_only=True)
class ExchangeForward:
    """One forward pass of the exchange over all layers, per layout rank (seconds / tokens)."""

    comm_s: tuple[float, ...]  # sum of the rounds' transfer times
    exposed_s: tuple[float, ...]  # transfer time not hidden behind attention compute
    max_block_tokens: tuple[int, ...]  # largest visible block received (sizes the buffers)
    rounds: tuple[int, ...] = ()  # rounds with something to receive, per layer (fixed-cost steps)
    slowdown: tuple[
        float, ...
    ] = ()  # attention time at the calls' achieved rates / at long-block rates


def pairs_vec(qs: np.ndarray, qe: np.ndarray, ks: np.ndarray, ke: np.ndarray) -> np.ndarray:
    """Row-wise :func:`causal_pairs`: query segments ``[..., sq]`` and key segments ``[..., sk]``
    (same leading shape) -> ``[...]``. Empty padding segments (start == end) contribute 0.
    Computed with the segment axes first (``[sq, sk, ...]``), so numpy's inner loops run over the
    long leading axes rather than a handful of segments."""
    qs, qe = _segments_first(qs)[:, None], _segments_first(qe)[:, None]
    ks, ke = _segments_first(ks)[None], _segments_first(ke)[None]
    a, c = np.maximum(qs, ks), np.minimum(qe, ke)
    n1 = np.maximum(c - a, 0)
    # queries inside the key segment: x..y, x = a-ks+1, y = c-ks (the product is >= 0: halved by a shift)
    series = ((a + c + 1 - 2 * ks) * n1) >> 1
    full = np.maximum(qe - np.maximum(qs, ke), 0) * (ke - ks)  # queries past it see all of it
    return (series + full).sum(axis=(0, 1))


def visible_vec(ks: np.ndarray, ke: np.ndarray, q_end: np.ndarray) -> np.ndarray:
    """Tokens of key segments ``[..., sk]`` at positions < ``q_end[...]`` (visible to some query)."""
    return np.maximum(np.minimum(_segments_first(ke), q_end) - _segments_first(ks), 0).sum(axis=0)


def _segments_first(x: np.ndarray) -> np.ndarray:
    """``[..., s] -> [s, ...]``, contiguous."""
    return np.ascontiguousarray(x.transpose((x.ndim - 1, *range(x.ndim - 1))))


def _merged(segments: tuple[tuple[int, int], ...]) -> list[tuple[int, int]]:
    """Segments in position order with touching ones joined."""
    out: list[tuple[int, int]] = []
    for s, e in sorted(segments):
        if out and out[-1][1] == s:
            out[-1] = (out[-1][0], e)
        else:
            out.append((s, e))
    return out


def fan_units(
    sender: tuple[tuple[int, ...], ...], receiver: tuple[tuple[int, ...], ...]
) -> list[int]:
    """Per receiver member: round time in kv-head blocks, ``max(own receive, its senders' sends)``.

    ``sender``/``receiver``: the kv heads of each member of the sending / receiving group (members
    in rank order). Sources are chosen as the runtime does (``attention/peers.py``): receivers in
    rank order, their kv heads ascending, each from the holder with the least load so far in this
    round, lowest rank on ties; a holder serves every receiver that picked it, one copy each.
    """
    load = [0] * len(sender)
    picked: list[set[int]] = []
    for kvs in receiver:
        mine = set()
        for k in kvs:
            j = min((j for j, held in enumerate(sender) if k in held), key=lambda x: (load[x], x))
            load[j] += 1
            mine.add(j)
        picked.append(mine)
    return [
        max([len(kvs)] + [load[j] for j in mine]) if kvs else 0
        for kvs, mine in zip(receiver, picked)
    ]


@lru_cache(maxsize=65536)
def _fan_units_cached(
    sender: tuple[tuple[int, ...], ...], receiver: tuple[tuple[int, ...], ...]
) -> tuple[int, ...]:
    return tuple(fan_units(sender, receiver))


def kv_exchange_forward(
    layout: Layout,
    cluster: Cluster,
    model: ModelSpec,
    micro_batch_size: int,
    *,
    kv_heads: Sequence[tuple[int, ...]] | None = None,
    rates: ClusterRates | None = None,
) -> ExchangeForward:
    """Simulate the forward exchange rounds of every rank at once (see module docstring).
    ``kv_heads[r]``: ``layout.kv_heads(r)`` when the caller has them; ``rates``: the attention rates
    of the devices (``rates.cluster_rates``; default: ``auto``'s kernels for the model's head dim).
    Every block is one kernel call per layer, priced at its achieved fraction of the rate."""
    W, groups = layout.world_size, layout.groups
    n = len(groups)
    if rates is None:
        rates = cluster_rates(cluster, model.kv_channels)
    heads = np.array([len(r.heads) for r in layout.ranks], dtype=np.float64)
    b = micro_batch_size
    if n == 1:
        p0 = np.full(W, float(causal_pairs_one(layout)))
        slow = 1.0 / rates.fraction(p0 * heads * b, "causal")
        return ExchangeForward(
            comm_s=(0.0,) * W,
            exposed_s=(0.0,) * W,
            max_block_tokens=(0,) * W,
            rounds=(0,) * W,
            slowdown=tuple(slow.tolist()),
        )
    # data: padded group segments (touching segments merged: the same positions, so the same causal
    # pairs and visible tokens, and a mirrored group of 8 ranks has 2 segments instead of 16), per-group
    # and per-rank arrays
    segs = [_merged(layout.group_segments(g.id)) for g in groups]
    width = max(len(s) for s in segs)
    QS = np.zeros((n, width), dtype=np.int64)
    QE = np.zeros((n, width), dtype=np.int64)
    for i, s in enumerate(segs):
        QS[i, : len(s)] = [a for a, _ in s]
        QE[i, : len(s)] = [e for _, e in s]
    q_end = QE.max(axis=1)
    arrays = cluster_arrays(cluster)
    node, nv, net, rate = arrays.node, arrays.nv, arrays.net, rates.flops_per_s
    members = np.array(
        [r for g in groups for r in g.ranks]
    )  # every group's ranks, group after group
    starts = np.cumsum([0] + [len(g.ranks) for g in groups[:-1]])
    lowest, highest = (
        np.minimum.reduceat(node[members], starts),
        np.maximum.reduceat(node[members], starts),
    )
    gnode = np.where(lowest == highest, lowest, -1)  # the group's node, -1 when it spans nodes
    gnv = np.minimum.reduceat(nv[members], starts)
    gnet = np.minimum.reduceat(net[members], starts)
    gi_of, pos_of = [0] * W, [0] * W
    for i, g in enumerate(groups):
        for j, r in enumerate(g.ranks):
            gi_of[r], pos_of[r] = i, j
    gi, pos = np.array(gi_of), np.array(pos_of)
    # fan-out table per (sending group structure, receiving group structure): O(#structures^2)
    # Python calls; layouts repeat a few head splits, so there are few distinct structures
    kv_of = kv_heads if kv_heads is not None else [layout.kv_heads(r) for r in range(W)]
    sig_of = [tuple(kv_of[r] for r in g.ranks) for g in groups]
    sigs = sorted(set(sig_of))
    sig_index = {s: i for i, s in enumerate(sigs)}
    sig_id = np.array([sig_index[s] for s in sig_of])
    kmax = max(len(g.ranks) for g in groups)
    fan = np.zeros((len(sigs), len(sigs), kmax))
    for a, sa in enumerate(sigs):
        for c, sc in enumerate(sigs):
            fan[a, c, : len(sc)] = _fan_units_cached(sa, sc)
    L = model.num_layers
    flops_per_pair_head = 4 * model.kv_channels * L * b  # forward only, all layers
    bytes_per_token_head = kv_block_bytes_per_token(model) * L * b
    # round 0: own group's K/V, no transfer
    p0 = pairs_vec(QS, QE, QS, QE)
    comp_end = flops_per_pair_head * p0[gi] * heads / rate
    ideal = comp_end.copy()  # attention compute at the long-block rate
    comp_end /= rates.fraction(p0[gi] * heads * b, "causal")
    comp_sum, comm_end, comm_sum = comp_end.copy(), np.zeros(W), np.zeros(W)
    curved = np.zeros(W, dtype=bool)  # ranks whose rate depends on the call size
    for _, where in rates.groups:
        curved |= where
    free0, free1 = np.zeros(W), np.zeros(W)  # when each receive buffer can be overwritten
    blocks, vmax = np.zeros(W, dtype=np.int64), np.zeros(W, dtype=np.int64)
    chunk = max(1, _CHUNK_ELEMENTS // (n * width * width + W * width))
    for t0 in range(1, n, chunk):
        # rounds t0..t1-1 at once: src[t, i] = the group G_i receives from in round t
        src = (np.arange(n)[None, :] - np.arange(t0, min(n, t0 + chunk))[:, None]) % n
        pairs_g = pairs_vec(QS[None], QE[None], QS[src], QE[src])  # [T, n]
        vis = visible_vec(QS[src], QE[src], q_end[None])[:, gi]  # [T, W]
        gp = src[:, gi]  # [T, W] sending group
        comp = flops_per_pair_head * pairs_g[:, gi] * (heads / rate)
        ideal += np.where((vis > 0) & (heads > 0), comp, 0.0).sum(axis=0)
        if curved.any():  # each of the block's calls at its own achieved fraction
            work, total = block_calls_vec(QS[None], QE[None], QS[src], QE[src])  # [T, n, w]
            work_r = work.transpose(0, 2, 1)[:, :, gi]  # [T, w, W]
            total_r = total.transpose(0, 2, 1)[:, :, gi]
            frac = rates.fraction(total_r * heads * b, "full")
            slow_pairs = (work_r / frac).sum(axis=1)  # [T, W]
            comp = np.where(curved, flops_per_pair_head * slow_pairs * (heads / rate), comp)
        link = np.where(gnode[gp] == node, np.minimum(gnv[gp], nv), np.minimum(gnet[gp], net))
        comm = bytes_per_token_head * vis * fan[sig_id[gp], sig_id[gi], pos] / link
        active = (vis > 0) & (heads > 0)
        comp, comm = np.where(active, comp, 0.0), np.where(active, comm, 0.0)
        comp_sum += comp.sum(axis=0)
        comm_sum += comm.sum(axis=0)
        vmax = np.maximum(vmax, np.where(active, vis, 0).max(axis=0))
        steps = blocks + np.cumsum(active, axis=0)  # [T, W] blocks received after each round
        odd = steps % 2 == 1  # the receive buffer of each round's block
        into0, into1 = active & ~odd, active & odd
        for k in range(
            src.shape[0]
        ):  # the double-buffered pipeline, one round at a time (in place)
            on = active[k]
            new_comm_end = np.maximum(comm_end, np.where(odd[k], free1, free0))
            new_comm_end += comm[k]
            new_comp_end = np.maximum(comp_end, new_comm_end)
            new_comp_end += comp[k]
            np.copyto(comm_end, new_comm_end, where=on)
            np.copyto(comp_end, new_comp_end, where=on)
            np.copyto(free0, comp_end, where=into0[k])
            np.copyto(free1, comp_end, where=into1[k])
        blocks = steps[-1]
    exposed = comp_end - comp_sum
    exposed = np.where(
        exposed > 1e-9 * comp_sum, exposed, 0.0
    )  # float noise of a fully hidden pipeline
    return ExchangeForward(
        comm_s=tuple(comm_sum.tolist()),
        exposed_s=tuple(exposed.tolist()),
        max_block_tokens=tuple(int(v) for v in vmax),
        rounds=tuple(int(v) for v in blocks),
        slowdown=tuple(
            np.where(ideal > 0, comp_sum / np.where(ideal > 0, ideal, 1.0), 1.0).tolist()
        ),
    )


def block_calls_vec(
    qs: np.ndarray, qe: np.ndarray, ks: np.ndarray, ke: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """The runtime's unmasked calls of received blocks (``attention.peers.block_calls``), per query
    run: receiver runs ``[..., w]`` (a group's merged segments, padded with empty ones at the end),
    the block's key segments ``[..., wk]`` (same leading shape). A run sees the keys below its first
    position; consecutive runs that see the same (non-zero) count share one call. Returns, per run,
    its pairs (``length x keys``) and the pairs of the call it belongs to (0 for a run that sees
    nothing), both ``[..., w]``."""
    keys = np.maximum(np.minimum(ke[..., None, :], qs[..., :, None]) - ks[..., None, :], 0).sum(-1)
    keys = np.where(qe > qs, keys, 0)
    work = (qe - qs) * keys
    zero = np.zeros_like(keys[..., :1])
    prev = np.concatenate([zero, keys[..., :-1]], axis=-1)
    start = (keys > 0) & (keys != prev)
    w = keys.shape[-1]
    idx = np.broadcast_to(np.arange(w), keys.shape)
    first = np.maximum.accumulate(np.where(start, idx, 0), axis=-1)  # the call's first run
    after = np.concatenate([start[..., 1:] | (keys[..., 1:] == 0), zero + 1 > 0], axis=-1)
    last = np.minimum.accumulate(np.where(after, idx, w - 1)[..., ::-1], axis=-1)[..., ::-1]
    csum = np.cumsum(work, axis=-1)
    total = np.take_along_axis(csum, last, -1) - np.take_along_axis(csum - work, first, -1)
    return work, np.where(work > 0, total, 0)


def causal_pairs_one(layout: Layout) -> int:
    """Causal pairs of the whole sequence (one group holds it all)."""
    s = layout.seq_length
    return s * (s + 1) // 2
