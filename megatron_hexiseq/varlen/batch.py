"""The per-micro-batch planner: document-aware token assignments over a fixed process structure.

The job keeps its structure (``plan``'s A2A groups and each rank's query heads). For every micro-batch,
given its document lengths in packing order, ``BatchPlanner.plan`` assigns the tokens to ranks:

- **Group costs.** Inside a group tokens are split by linear speed, so the group's linear phase is
  ``T_g / c_g`` (``c_g = sum 1 / linear_s_per_token``); its attention phase is ``P_g alpha_g``
  (``alpha_g`` = the slowest member's heads x ``attention_s_per_pair_head``) plus the head
  all-to-all (``a_g`` per group token) and its fixed cost. The iteration is the slowest linear
  phase plus the slowest attention phase (``costmodel.estimate``), so the two are kept apart.
  Rates come from ``costmodel.formulas`` (the calibrated cluster).
- **Targets** ``Lin*``, ``Att*``: both phases with perfectly divisible work.
- **Documents, longest first.** Whole into the group where the iteration grows least, kept whole
  when that growth is within ``SLACK`` of ``Lin* + Att*`` (no K/V crosses groups); otherwise split
  over the fewest groups with room below the slowest phases so far (all groups, water-filled,
  when none has enough), as mirrored head + tail pieces (pairs ``x (l + 1) / 2`` for ``x`` tokens)
  or consecutive pieces (less K/V), whichever grows the iteration less counting each receiving
  group's K/V time its cross attention cannot hide; whole again if the split is not cheaper.
  Documents below ``SMALL`` of a target go by a heap to the group with the lowest linear phase.
- **Many documents.** Past ``MAX_UNITS`` documents, runs of short ones are placed as bundles, whole
  (``placement_units``: each bundle's loads are exactly its documents' sums).
- **Memory.** A group takes at most ``M_g`` tokens (its tightest member's usable memory less static
  memory over its share of activations and all-to-all buffer plus the group's attention core;
  ``MEMORY_MARGIN`` leaves room for the K/V buffers).
- **Members.** The group's pieces in position order are cut into consecutive member runs in rank
  order (tokens by linear speed, at least one each; ``assignment.fill_empty`` for the rest).
- **The structure's own layout** is returned instead when ``predict`` rates it faster. ``predict``
  prices attention as ``estimate_documents`` does (the runtime's kernel calls at their achieved rates,
  ``document_calls`` / ``call_slowdown``) and the K/V pipeline by exact blocks without its buffer
  limit: on the suite's 72 (own, structure) pairs within 9% of ``estimate_documents`` (most within
  1%), 20% at worst on random small clusters. When the two figures are within ``EXACT_MARGIN``
  both are priced by ``estimate_documents`` (2-8 ms each at 128-1024 GPUs), which decides.

Deterministic (stable sorts, no randomness, no clock, no communication): every rank computes the
same assignment from the same document lengths. docs/varlen.md.
"""

from __future__ import annotations

import gc
import heapq
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from megatron_hexiseq.cluster import Cluster
from megatron_hexiseq.costmodel.comm import cluster_arrays
from megatron_hexiseq.costmodel.document_calls import (
    VARLEN_KERNELS,
    call_slowdown,
    document_calls,
    rank_kernel_calls,
)
from megatron_hexiseq.costmodel.documents import (
    GroupPorts,
    cross_rounds,
    estimate_documents,
)
from megatron_hexiseq.costmodel.estimate import _a2a_layer_s
from megatron_hexiseq.costmodel.exchange import fan_units
from megatron_hexiseq.costmodel.formulas import (
    a2a_buffer_bytes_per_token,
    activation_bytes_per_token,
    attention_bytes_per_group_token,
    attention_s_per_pair_head,
    kv_block_bytes_per_token,
    linear_s_per_token,
    static_memory_bytes,
)
from megatron_hexiseq.costmodel.pieces import (
    Pieces,
    document_pieces,
    expand_cells,
    own_group_pairs,
    piece_pairs,
)
from megatron_hexiseq.costmodel.rates import cluster_rates
from megatron_hexiseq.errors import HexiSeqError
from megatron_hexiseq.layout import Layout, Segment, check_matches, make_layout
from megatron_hexiseq.model import ModelSpec
from megatron_hexiseq.run_config import TrainOptions
from megatron_hexiseq.varlen.assignment import (
    BatchAssignment,
    fill_empty,
    round_shares,
    same_structure,
)

__all__ = ["BatchAssignment", "BatchPlanner", "fill_empty", "same_structure"]

SLACK = 0.05  # a document stays whole when its group ends within Lambda * (1 + SLACK)
SMALL = 0.02  # documents costing less than this share of Lambda go by the heap
MEMORY_MARGIN = 0.9  # share of a group's free memory its tokens may take (the rest: K/V buffers)
WATER_FILL_STEPS = 32  # bisection steps of a level (then whole tokens by largest remainders)
A2A_PROBE_TOKENS = 1 << 20  # the all-to-all of this many group tokens gives its cost per token
EXACT_MARGIN = 0.15  # own and structure's layouts predicted this close: estimate_documents decides
MAX_UNITS = 4096  # documents placed one by one; with more, short ones are bundled (placement_units)
MAX_BATCH_TOKENS = 2**31 - 1  # a layout's largest seq_length (schema/layout.schema.json)


def placement_units(cu: np.ndarray) -> np.ndarray:
    """The units ``BatchPlanner.plan`` places, as indices into the document boundaries ``cu``
    (strictly increasing, 0 to D): unit i is documents ``[units[i], units[i + 1])``.

    Up to ``MAX_UNITS`` documents every document is a unit. With more (SFT-style data, thousands of
    short conversations), documents shorter than ``B = ceil(N / MAX_UNITS)`` tokens are bundled
    with their neighbours in packing order whose start lies in the same B-token window of the
    micro-batch (a longer document ends a bundle): at most ``3 MAX_UNITS + 1`` units, each bundle
    under 2B tokens. A bundle is placed whole, never split, and costs exactly its documents' sums
    (tokens; pairs ``l (l + 1) / 2`` each): a document placed whole costs the same in any group
    whatever lies beside it, so only the placement's granularity changes."""
    D = cu.size - 1
    if D <= MAX_UNITS:
        return np.arange(D + 1)
    B = -(-int(cu[-1]) // MAX_UNITS)
    short = np.diff(cu) < B
    window = cu[:-1] // B
    new = np.ones(D, dtype=bool)
    new[1:] = ~short[1:] | ~short[:-1] | (window[1:] != window[:-1])
    return np.append(np.flatnonzero(new), D)


@dataclass
class _State:
    """Per group, while one micro-batch is planned: phase loads (seconds), tokens, pieces, and the
    normalised costs (phase target = 1): ``u`` per token (linear), ``v`` per token (all-to-all) and
    ``w`` per pair (attention)."""

    lin: np.ndarray
    att: np.ndarray
    tokens: np.ndarray
    pieces: list[list[Segment]]
    u: np.ndarray
    v: np.ndarray
    w: np.ndarray
    lin_target: float
    att_target: float

    def score(self) -> np.ndarray:
        """Per group, the larger of its two phases as a share of its target."""
        return np.maximum(self.lin / self.lin_target, self.att / self.att_target)

    def add(
        self,
        g: int,
        segs: list[Segment],
        tokens: int,
        pairs: float,
        bp: BatchPlanner,
        extra_s: float = 0.0,
    ) -> None:
        self.lin[g] += tokens * bp.linear_per_token[g]
        self.att[g] += tokens * bp.a2a[g] + pairs * bp.alpha[g] + extra_s
        self.tokens[g] += tokens
        self.pieces[g].extend(segs)


class BatchPlanner:
    """Plans micro-batches over the structure of ``structure`` (a layout of ``cluster``; its segments
    and sequence length are ignored). Build once per job, call ``plan`` per micro-batch."""

    def __init__(
        self, structure: Layout, cluster: Cluster, model: ModelSpec, options: TrainOptions
    ) -> None:
        check_matches(structure, cluster, None)
        if (structure.num_attention_heads, structure.num_query_groups) != (
            model.num_attention_heads,
            model.num_query_groups,
        ):
            raise HexiSeqError(
                f"the structure has {structure.num_attention_heads} heads in "
                f"{structure.num_query_groups} query groups but model {model.name!r} has "
                f"{model.num_attention_heads} in {model.num_query_groups}"
            )
        self.structure, self.cluster, self.model, self.options = structure, cluster, model, options
        W, b, L = structure.world_size, options.micro_batch_size, model.num_layers
        devs = cluster.devices
        lin = np.array([linear_s_per_token(model, d, options) for d in devs])
        # a planned micro-batch runs the packed path (subring: a batch layout always does), so
        # its blocks run the kernel's variable-length call (rates.attention_rate, ``packed``)
        att = np.array([attention_s_per_pair_head(model, d, options, packed=True) for d in devs])
        heads = np.array([len(r.heads) for r in structure.ranks])
        hpg = structure.heads_per_query_group
        kv = [len({h // hpg for h in r.heads}) for r in structure.ranks]
        self.groups = [g.ranks for g in structure.groups]
        n = len(self.groups)
        self.shares = [1.0 / lin[list(g)] / (1.0 / lin[list(g)]).sum() for g in self.groups]
        c = np.array([(1.0 / lin[list(g)]).sum() for g in self.groups])
        self.alpha = np.array([float((heads[list(g)] * att[list(g)]).max()) for g in self.groups])
        passes = 3 if options.recompute else 2
        a2a, fixed = np.zeros(n), np.zeros(n)
        for i, g in enumerate(self.groups):
            if len(g) > 1:
                tok = round_shares(A2A_PROBE_TOKENS, self.shares[i])
                layer = _a2a_layer_s(
                    cluster, model, g, b, tok, [int(heads[r]) for r in g], [kv[r] for r in g]
                )
                a2a[i] = passes * L * layer / A2A_PROBE_TOKENS
                fixed[i] = passes * L * 4 * max(devs[r].collective_latency_s for r in g)
        self.a2a, self.fixed = a2a, fixed
        # K/V of one received token for every member's K/V heads, all passes, over the network
        steps = (2 if options.recompute else 1) + 2
        kv_token = kv_block_bytes_per_token(model) * L * b * steps
        self.kv_per_token = np.array(
            [max(kv[r] * kv_token / (devs[r].network_GBps * 1e9) for r in g) for g in self.groups]
        )
        self.linear_per_token = 1.0 / c
        self.overhead = np.array([max(devs[r].step_overhead_s for r in g) for g in self.groups])
        # memory: the most tokens each group can hold
        static = static_memory_bytes(model, options, options.data_parallel_size * W)
        act = b * (activation_bytes_per_token(model, options) + a2a_buffer_bytes_per_token(model))
        cap = np.zeros(n)
        for i, g in enumerate(self.groups):
            free = [
                MEMORY_MARGIN * (options.capacity_fraction * devs[r].memory_bytes - static)
                for r in g
            ]
            per = [
                share * act
                + b * attention_bytes_per_group_token(model, options, int(heads[r]), kv[r])
                for r, share in zip(g, self.shares[i])
            ]
            cap[i] = max(0.0, min(f / p for f, p in zip(free, per)))
        self.cap = np.floor(cap)
        self.group_index = np.zeros(W, dtype=np.int64)
        for i, g in enumerate(self.groups):
            self.group_index[list(g)] = i
        self.rank_linear_s = lin
        self._init_predict(structure, cluster, model, options, heads * att, kv_token)
        self.rank_overhead_s = np.array([d.step_overhead_s for d in devs])
        # each kernel call of a packed micro-batch, every layer and pass (estimate_documents')
        self.rank_call_s = passes * L * np.array([d.window_overhead_s for d in devs])
        self.heads = [r.heads for r in structure.ranks]
        self.hosts = [r.host for r in structure.ranks]
        self.gpus = [r.gpu for r in structure.ranks]

    def _init_predict(
        self,
        structure: Layout,
        cluster: Cluster,
        model: ModelSpec,
        options: TrainOptions,
        rank_attention_s: np.ndarray,
        kv_token_bytes: float,
    ) -> None:
        """What ``predict`` reads: per rank its seconds per pair at the long-block rate, its attention
        kernel's rates (``rates.cluster_rates``) and whether it runs a block as one variable-length
        call; per group its members, node (-1: several) and slowest ports; the K/V heads of every
        member (a group's signature, for the fan-out of a received block)."""
        hpg = structure.heads_per_query_group
        kv_of = [tuple(sorted({h // hpg for h in r.heads})) for r in structure.ranks]
        self.rank_heads = np.array([len(r.heads) for r in structure.ranks])
        self.kv_heads = np.array([len(k) for k in kv_of])
        self.rank_attention_s = rank_attention_s
        self.rates = cluster_rates(
            cluster, model.kv_channels, options.attention_kernel, packed=True
        )
        self.varlen_rank = np.array([k in VARLEN_KERNELS for k in self.rates.kernels])
        self.arrays = cluster_arrays(cluster)
        self.ports = GroupPorts.of(structure, self.arrays)
        self.sizes = np.array([len(g) for g in self.groups])
        sig_of = [tuple(kv_of[r] for r in g) for g in self.groups]
        self.sigs = sorted(set(sig_of))
        index = {sig: i for i, sig in enumerate(self.sigs)}
        self.sig_id = np.array([index[sig] for sig in sig_of])
        self.fans: dict[tuple[int, int], np.ndarray] = {}
        self.kv_token_bytes = kv_token_bytes  # one K/V head of one token, every layer and pass
        steps = ((2 if options.recompute else 1) + 2) * model.num_layers
        self.rank_latency_s = steps * np.array([d.p2p_latency_s for d in cluster.devices])

    def _fan(self, sender: int, receiver: int) -> np.ndarray:
        """K/V head blocks each member position of a ``receiver``-signature group waits for per
        received token from a ``sender``-signature group (``exchange.fan_units``), memoised."""
        key = (sender, receiver)
        if key not in self.fans:
            kmax = int(self.sizes.max())
            fan = np.zeros(kmax)
            got = fan_units(self.sigs[sender], self.sigs[receiver])
            fan[: len(got)] = got
            self.fans[key] = fan
        return self.fans[key]

    # ---- one micro-batch -------------------------------------------------------------------
    def plan(self, doc_lengths: Sequence[int], *, or_structure: bool = True) -> BatchAssignment:
        """The assignment of one micro-batch whose documents (in packing order) have these lengths.
        ``or_structure``: when the structure's own layout has the micro-batch's length, return it
        instead if ``predict`` rates it faster.

        The garbage collector is paused while it runs (and restored): a collection triggered by
        its short-lived tuples would scan every object of the caller (a data loader holds many)
        and cost several times the plan; nothing it allocates forms cycles."""
        enabled = gc.isenabled()
        gc.disable()
        try:
            return self._plan(doc_lengths, or_structure)
        finally:
            if enabled:
                gc.enable()

    def _micro_batch(self, doc_lengths: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
        """(``cu_seqlens``, lengths) as int64 arrays, else one HexiSeqError: every length a
        positive integer, the micro-batch at least one token per rank and at most a layout's
        ``MAX_BATCH_TOKENS``."""
        try:
            lengths = np.asarray(doc_lengths, dtype=np.int64)
        except (OverflowError, TypeError, ValueError):
            lengths = np.zeros((0, 0), dtype=np.int64)
        if lengths.ndim != 1 or lengths.size == 0:
            raise HexiSeqError(
                "document lengths must be a non-empty list of integers below 2^63 (tokens)"
            )
        if (lengths <= 0).any():
            raise HexiSeqError("every document length must be a positive number of tokens")
        if (  # in this order: the sum of up to 2^31 lengths below 2^31 fits in int64
            lengths.size > MAX_BATCH_TOKENS
            or int(lengths.max()) > MAX_BATCH_TOKENS
            or int(lengths.sum()) > MAX_BATCH_TOKENS
        ):
            raise HexiSeqError(
                f"the micro-batch has more than {MAX_BATCH_TOKENS:,} tokens, the most a layout "
                "holds; use fewer tokens per batch"
            )
        N, W = int(lengths.sum()), self.structure.world_size
        if N < W:
            raise HexiSeqError(
                f"the micro-batch has {N} tokens for {W} ranks; every rank needs at least one"
            )
        cu = np.zeros(lengths.size + 1, dtype=np.int64)
        np.cumsum(lengths, out=cu[1:])
        return cu, lengths

    def _plan(self, doc_lengths: Sequence[int], or_structure: bool) -> BatchAssignment:
        cu, lengths = self._micro_batch(doc_lengths)
        N, n = int(cu[-1]), len(self.groups)
        pairs = lengths * (lengths + 1) // 2
        # the two phase targets: every group's linear and attention phase with perfectly divisible work
        c = 1.0 / self.linear_per_token
        lin_target = (N + float((self.overhead * c).sum())) / float(c.sum())
        even = c * (lin_target - self.overhead)  # tokens per group at the linear target
        att_target = (
            float(pairs.sum()) + float(((even * self.a2a + self.fixed) / self.alpha).sum())
        ) / float((1.0 / self.alpha).sum())
        state = _State(
            lin=self.overhead.copy(),
            att=self.fixed.copy(),
            tokens=np.zeros(n),
            pieces=[[] for _ in range(n)],
            u=self.linear_per_token / lin_target,  # normalised cost per token / per pair
            v=self.a2a / att_target,
            w=self.alpha / att_target,
            lin_target=lin_target,
            att_target=att_target,
        )
        units = placement_units(cu)
        u_start, u_len = cu[units[:-1]], np.diff(cu[units])
        u_pairs = np.add.reduceat(pairs, units[:-1])
        bundle = np.diff(units) > 1  # several documents: placed whole, never split
        # units by cost at the fastest rates, highest first; one document's cost grows with its
        # length, so without bundles this is the longest-first order. Small units (cost below
        # SMALL of a target) are the tail
        cost = u_len * float(self.linear_per_token.min()) + u_pairs * float(self.alpha.min())
        order = np.argsort(-cost, kind="stable")
        n_large = int(np.count_nonzero(cost >= SMALL * min(lin_target, att_target)))
        for d in order[:n_large].tolist():
            l_d, start, p_d = int(u_len[d]), int(u_start[d]), int(u_pairs[d])
            lin_max = max(lin_target, float(state.lin.max()))
            att_max = max(att_target, float(state.att.max()))
            lin_new = state.lin + l_d * self.linear_per_token
            att_new = state.att + l_d * self.a2a + p_d * self.alpha
            grow = np.maximum(lin_new - lin_max, 0) + np.maximum(att_new - att_max, 0)
            key = grow + 1e-6 * (lin_new + att_new)  # ties: the least loaded
            key = np.where(state.tokens + l_d <= self.cap, key, np.inf)
            best = int(np.argmin(key))
            if grow[best] <= SLACK * (lin_target + att_target) or l_d < 2:
                state.add(best, [(start, start + l_d)], l_d, p_d, self)
                continue
            split = None if bundle[d] else self._split(state, l_d, start)
            if split is None or split[0] >= grow[best]:
                if not np.isfinite(key[best]):
                    raise HexiSeqError(
                        f"a document of {l_d} tokens does not fit in the cluster's memory; use "
                        "fewer tokens per batch"
                    )
                state.add(best, [(start, start + l_d)], l_d, p_d, self)
                continue
            for g, segs, share, pairs_g, penalty in split[1]:
                state.add(g, segs, share, pairs_g, self, extra_s=penalty)
        if n_large < order.size:
            self._place_small(state, order[n_large:], u_len, u_start, u_pairs)
        segments = self._members(state.pieces)
        fill_empty(segments)
        lay = make_layout(
            seq_length=N,
            num_attention_heads=self.structure.num_attention_heads,
            num_query_groups=self.structure.num_query_groups,
            groups=self.groups,
            segments=segments,
            heads=self.heads,
            hosts=self.hosts,
            gpus=self.gpus,
        )
        mine = self.predict(lay, cu)
        if or_structure and self.structure.seq_length == N:  # the structure's layout fits it
            theirs = self.predict(self.structure, cu)
            if abs(theirs - mine) <= EXACT_MARGIN * min(theirs, mine):  # too close: price both
                model = replace(self.model, seq_length=N)
                cu_t = tuple(cu.tolist())
                exact = [
                    estimate_documents(
                        x, self.cluster, model, self.options, cu_t, packed=True
                    ).iteration_time_s
                    for x in (lay, self.structure)
                ]
                if exact[1] < exact[0]:
                    lay, mine = self.structure, theirs
            elif theirs < mine:
                lay, mine = self.structure, theirs
        return BatchAssignment(layout=lay, cu_seqlens=tuple(cu.tolist()), predicted_s=mine)

    def predict(self, layout: Layout, cu: np.ndarray) -> float:
        """The planner's estimate of an assignment's iteration: the slowest rank's linear phase plus
        the slowest group's attention phase. A member's attention is ``estimate_documents``'s: its
        group's own-group and received pairs x its heads x its long-block seconds per pair-head,
        each scaled by the slowdown of the kernel calls the runtime makes for them
        (``document_calls`` / ``call_slowdown``: per (group, document) one causal local window, per
        query piece and earlier group one full received window, one variable-length call per block
        with flash / cuDNN) and, with several documents, the cluster's ``window_overhead_us`` per
        call; the group's phase is its slowest member's, plus the all-to-all, the fixed cost and
        the received K/V time its cross-group attention cannot hide (as ``_split`` charges it, the
        cross attention at its achieved rate). Core contention (``shared_core`` nodes, the CPU
        testbed) is left to ``estimate_documents``, which decides close calls (``EXACT_MARGIN``).
        O(pieces + calls x group size), so a plan can be checked against the structure's own
        layout."""
        W, n = self.structure.world_size, len(self.groups)
        pieces = document_pieces(layout, cu)
        gi = self.group_index
        pg = gi[pieces.rank]
        length = pieces.end - pieces.start
        tokens = np.bincount(pieces.rank, weights=length, minlength=W)
        g_tokens = np.bincount(gi, weights=tokens, minlength=n)
        g_pairs = np.bincount(
            pg, weights=piece_pairs(pieces.start, pieces.end, cu[pieces.doc]), minlength=n
        )
        own = np.bincount(pg, weights=own_group_pairs(pieces, pg, cu), minlength=n)
        key = pieces.doc * n + pg
        cells, inv = np.unique(key, return_inverse=True)
        last_end = np.zeros(cells.size, dtype=np.int64)
        np.maximum.at(last_end, inv, pieces.end)
        held = np.bincount(inv, weights=length, minlength=cells.size)
        recv = np.bincount(cells % n, weights=last_end - cu[cells // n] - held, minlength=n)
        cross = g_pairs - own
        slow_local, slow_cross = np.ones(W), np.ones(W)
        call_s = np.zeros(W)
        packed_calls = cu.size > 2 and bool(self.rank_call_s.any())
        if self.rates.groups or packed_calls:
            calls = document_calls(pieces, pg, n, cu)
            one_call = self.varlen_rank & (cu.size > 2)
            if self.rates.groups:
                slow_local, slow_cross, _ = call_slowdown(
                    calls,
                    layout,
                    self.rank_heads,
                    self.rates,
                    self.options.micro_batch_size,
                    one_call,
                )
            if packed_calls:
                call_s = rank_kernel_calls(calls, n, gi, one_call) * self.rank_call_s
        local_s = own[gi] * slow_local * self.rank_attention_s + call_s  # per rank, every pass
        cross_s = cross[gi] * slow_cross * self.rank_attention_s
        exposed = np.zeros(W)
        if n > 1:
            exposed = self._exposed(pieces, cells, local_s, cross_s, slow_cross, recv)
        att = local_s + cross_s + exposed + (g_tokens * self.a2a + self.fixed)[gi]
        lin = tokens * self.rank_linear_s + self.rank_overhead_s
        return float(lin.max() + att.max())

    def _exposed(
        self,
        pieces: Pieces,
        cells: np.ndarray,
        local_s: np.ndarray,
        cross_s: np.ndarray,
        slow_cross: np.ndarray,
        recv: np.ndarray,
    ) -> np.ndarray:
        """Per rank, the K/V time its attention cannot hide, every pass, and the exchange steps'
        latency. Blocks as ``estimate_documents`` prices them: one per (receiving group, source
        group) with a shared document, its visible tokens and pairs exact (``cross_rounds``), in
        the sub-ring order ``(g - s) mod n``, over the source group's slowest port or NVLink (the
        receiver's own), times the fan-out of K/V heads; each block's compute at the rank's
        received-call slowdown. The pipeline without its buffer limit: block k's compute starts
        once its keys have arrived (transfers in order on one link) and the earlier blocks are
        computed, so the exposed time is ``max_k (arrival_k - local - compute of blocks < k)``.
        When the blocks are too many to enumerate, one group's received tokens in equal blocks."""
        n, gi = len(self.groups), self.group_index
        blocks = cross_rounds(pieces, gi)
        if blocks is None:  # equal blocks, one per other group met (at most n - 1), own port
            met = np.bincount(
                cells % n, weights=np.bincount(cells // n)[cells // n] - 1, minlength=n
            )
            per = np.maximum(np.minimum(n - 1, met), 1)[gi]
            port = np.minimum(self.arrays.net, self.arrays.nv)
            comm = recv[gi] * self.kv_token_bytes * self.kv_heads / port
            wait = np.maximum(comm / per - local_s, comm - local_s - cross_s * (per - 1) / per)
            return np.maximum(wait, 0) + np.where(recv[gi] > 0, per, 0) * self.rank_latency_s
        rg, sg, vis, pairs = blocks
        b, r, pos = expand_cells(rg, self.structure)
        s_of, keep = sg[b], self.rank_heads[r] > 0
        b, r, pos, s_of = b[keep], r[keep], pos[keep], s_of[keep]
        order = np.lexsort(((gi[r] - s_of) % n, r))
        b, r, pos, s_of = b[order], r[order], pos[order], s_of[order]
        link = self.ports.link(s_of, r, self.arrays)
        fan = np.ones(b.size)
        sid_s, sid_r = self.sig_id[s_of], self.sig_id[gi[r]]
        for a, c in set(zip(sid_s.tolist(), sid_r.tolist())):
            at = (sid_s == a) & (sid_r == c)
            fan[at] = self._fan(a, c)[pos[at]]
        comm = vis[b] * self.kv_token_bytes * fan / link
        comp = pairs[b] * self.rank_attention_s[r] * slow_cross[r]
        first = np.searchsorted(r, r, side="left")
        arrived = np.cumsum(comm)
        arrived -= (arrived - comm)[first]
        before = np.cumsum(comp) - comp
        before -= before[first]
        wait = arrived - local_s[r] - before
        W = self.structure.world_size
        exposed = np.zeros(W)
        np.maximum.at(exposed, r, wait)
        rounds = np.bincount(r, minlength=W)
        return exposed + rounds * self.rank_latency_s

    def proportional(self, doc_lengths: Sequence[int]) -> BatchAssignment:
        """The per-document split: every document in mirrored pieces over every group, each
        group's share by its speed (``1 / rho_g``, as for the target level), members by speed.
        Balanced whatever the documents, at the price of every group needing every document's K/V."""
        cu, lengths = self._micro_batch(doc_lengths)
        N, n = int(cu[-1]), len(self.groups)
        kappa = float((lengths * (lengths + 1) // 2).sum()) / N
        weight = 1.0 / (self.linear_per_token + self.a2a + kappa * self.alpha)
        pieces: list[list[Segment]] = [[] for _ in range(n)]
        for d in range(lengths.size):
            front, back = int(cu[d]), int(cu[d + 1])
            for g, share in enumerate(round_shares(int(lengths[d]), weight)):
                head, tail = share // 2, share - share // 2
                if head:
                    pieces[g].append((front, front + head))
                if tail:
                    pieces[g].append((back - tail, back))
                front, back = front + head, back - tail
        segments = self._members(pieces)
        fill_empty(segments)
        lay = make_layout(
            seq_length=N,
            num_attention_heads=self.structure.num_attention_heads,
            num_query_groups=self.structure.num_query_groups,
            groups=self.groups,
            segments=segments,
            heads=self.heads,
            hosts=self.hosts,
            gpus=self.gpus,
        )
        return BatchAssignment(layout=lay, cu_seqlens=tuple(cu.tolist()))

    def _place_small(
        self,
        state: _State,
        units: np.ndarray,
        lengths: np.ndarray,
        starts: np.ndarray,
        pairs: np.ndarray,
    ) -> None:
        """Small units (``units``, most costly first; ``placement_units``), each whole to the group with the lowest
        linear phase (lowest index on ties) that has room for it; a group without room for one
        leaves the heap for the rest. Small documents are mostly linear work: where the attention
        phase has slack adding them does not lengthen the iteration.

        One heap operation per document on Python floats (the same float operations as
        ``_State.add``): 65,536 one-token documents cost about 0.1 s of one CPU thread. The
        attention loads are summed per group at the end (nothing reads them in between)."""
        lin, per = state.lin.tolist(), self.linear_per_token.tolist()
        tokens, cap = state.tokens.tolist(), self.cap.tolist()
        pieces = state.pieces
        heap = [(lin[g], g) for g in range(len(lin))]
        heapq.heapify(heap)
        group_of = np.empty(units.size, dtype=np.int64)
        for i, (l_d, start) in enumerate(zip(lengths[units].tolist(), starts[units].tolist())):
            while heap and tokens[heap[0][1]] + l_d > cap[heap[0][1]]:
                heapq.heappop(heap)
            if not heap:
                raise HexiSeqError(
                    "the micro-batch does not fit in the cluster's memory; use fewer tokens per batch"
                )
            g = heap[0][1]
            lin[g] = lin[g] + l_d * per[g]
            tokens[g] += l_d
            got = pieces[g]
            if got and got[-1][1] == start:  # touching the group's previous piece: one segment
                got[-1] = (got[-1][0], start + l_d)
            else:
                got.append((start, start + l_d))
            heapq.heapreplace(heap, (lin[g], g))
            group_of[i] = g
        n = len(lin)
        state.lin[:], state.tokens[:] = lin, tokens
        state.att += np.bincount(group_of, weights=lengths[units], minlength=n) * self.a2a
        state.att += np.bincount(group_of, weights=pairs[units], minlength=n) * self.alpha

    def _split(self, state: _State, l_d: int, start: int):
        """Mirrored pieces of a long document over the fewest groups that take it without
        lengthening either phase (all groups, water-filled to one relative growth, when none can),
        with each
        receiving group's K/V time its attention cannot hide. Returns (growth of the iteration,
        [(group, segments, tokens, K/V seconds)]) or None when it does not fit in memory."""
        u = state.u  # normalised linear cost per token
        q = (
            state.v + state.w * (l_d + 1) / 2
        )  # normalised attention cost per token of a mirrored share
        # each group's phases below the slowest ones so far (<= 0, in shares of the targets): a
        # share that keeps both below them does not lengthen the iteration
        lin_max = max(state.lin_target, float(state.lin.max()))
        att_max = max(state.att_target, float(state.att.max()))
        a = (state.lin - lin_max) / state.lin_target
        b = (state.att - att_max) / state.att_target
        room = np.maximum(self.cap - state.tokens, 0)
        free = np.minimum(np.maximum(np.minimum(-a / u, -b / q), 0), room)
        order = np.lexsort((np.arange(free.size), -free))  # the most free room first
        k = int(np.searchsorted(np.cumsum(free[order]), l_d)) + 1
        chosen = np.sort(order[: min(k, free.size)])
        x = _water_fill(a[chosen], u[chosen], b[chosen], q[chosen], room[chosen], l_d)
        if x.sum() < l_d:
            return None
        keep = x > 0
        chosen, x = chosen[keep], x[keep]
        mirrored = self._pieces_cost(state, chosen, x, l_d, start, mirrored=True)
        # contiguous pieces send less K/V (a piece receives only what comes before it) but put
        # more pairs on later pieces: the groups with the most attention room go last
        later = np.lexsort((chosen, -b[chosen]))
        contiguous = self._pieces_cost(state, chosen[later], x[later], l_d, start, mirrored=False)
        return min(mirrored, contiguous, key=lambda c: c[0])

    def _pieces_cost(
        self,
        state: _State,
        groups: np.ndarray,
        x: np.ndarray,
        l_d: int,
        start: int,
        *,
        mirrored: bool,
    ) -> tuple[float, list[tuple[int, list[Segment], int, float, float]]]:
        """(growth of the iteration, [(group, segments, tokens, pairs, K/V seconds)]) of giving
        ``x[j]`` tokens of a document to ``groups[j]``: mirrored head + tail pieces (pairs
        ``x (l + 1) / 2`` each, nearly the whole document received), or consecutive pieces in
        order (a piece at offset o receives o tokens and has ``x (2 o + x + 1) / 2`` pairs)."""
        xf = x.astype(np.float64)
        if mirrored:
            pairs = xf * (l_d + 1) / 2
            recv = l_d - xf
            cross = pairs - xf * (xf + 1) / 2
        else:
            offset = np.cumsum(xf) - xf
            pairs = xf * (2 * offset + xf + 1) / 2
            recv = offset
            cross = xf * offset
        penalty = np.maximum(recv * self.kv_per_token[groups] - cross * self.alpha[groups], 0)
        lin, att = state.lin.copy(), state.att.copy()
        lin[groups] += xf * self.linear_per_token[groups]
        att[groups] += xf * self.a2a[groups] + pairs * self.alpha[groups] + penalty
        lin_max = max(state.lin_target, float(state.lin.max()))
        att_max = max(state.att_target, float(state.att.max()))
        grow = max(float(lin.max()) - lin_max, 0) + max(float(att.max()) - att_max, 0)
        out = []
        front, back = start, start + l_d
        for j, (g, share) in enumerate(zip(groups.tolist(), x.tolist())):
            if mirrored:
                head, tail = share // 2, share - share // 2
                segs = [(front, front + head)] if head else []
                segs.append((back - tail, back))
                front, back = front + head, back - tail
            else:
                segs = [(front, front + share)]
                front += share
            out.append((g, segs, share, float(pairs[j]), float(penalty[j])))
        return grow, out

    def _members(self, pieces: list[list[Segment]]) -> list[list[Segment]]:
        """Each group's pieces (position order) cut into consecutive member runs by speed."""
        W = self.structure.world_size
        out: list[list[Segment]] = [[] for _ in range(W)]
        for g, members in enumerate(self.groups):
            segs = sorted(pieces[g])
            total = sum(e - s for s, e in segs)
            counts = round_shares(total, self.shares[g], at_least_one=total >= len(members))
            i, pos = 0, segs[0][0] if segs else 0
            for r, want in zip(members, counts):
                while want > 0:
                    s, e = segs[i]
                    take = min(want, e - pos)
                    if out[r] and out[r][-1][1] == pos:
                        out[r][-1] = (out[r][-1][0], pos + take)
                    else:
                        out[r].append((pos, pos + take))
                    want -= take
                    pos += take
                    if pos == e and i + 1 < len(segs):
                        i += 1
                        pos = segs[i][0]
        return out


def _water_fill(
    a: np.ndarray, u: np.ndarray, b: np.ndarray, q: np.ndarray, room: np.ndarray, total: int
) -> np.ndarray:
    """Integer shares x (sum ``total`` where room allows) that raise every chosen group's score
    ``max(a + x u, b + x q)`` to one level, each x within ``room``: bisection on the level, then
    largest remainders."""

    def shares(level: float) -> np.ndarray:
        return np.minimum(np.maximum(np.minimum((level - a) / u, (level - b) / q), 0), room)

    lo, hi = float(np.minimum(a, b).min()), float(np.maximum(a + room * u, b + room * q).max())
    for _ in range(WATER_FILL_STEPS):
        mid = (lo + hi) / 2
        if shares(mid).sum() < total:
            lo = mid
        else:
            hi = mid
    raw = shares(hi)
    x = np.minimum(np.floor(raw), room).astype(np.int64)
    left = total - int(x.sum())
    order = np.lexsort((np.arange(x.size), -(raw - x)))
    order = order[room[order] - x[order] > 0][: max(left, 0)]
    x[order] += 1
    while x.sum() < total and (room - x > 0).any():  # rounding left tokens: the most room first
        j = int(np.argmax(room - x))
        x[j] += min(total - int(x.sum()), int(room[j] - x[j]))
    return x
