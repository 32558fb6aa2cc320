"""The kernel calls of a packed micro-batch's attention, as the runtime makes them, and their price.

The runtime runs a block's document windows (``attention.documents``: per (group, document) one
square causal local window; per query piece and earlier group of its document one unmasked
received window) one kernel call each on CPU and with every kernel but ``flash``/``cudnn``, which
run a block's windows as one variable-length call (``attention.varlen.uses_varlen``; a micro-batch
of one document is priced as ``estimate`` prices the runtime without documents: one call per
window). Each call runs at ``rates.call_fraction`` of its kernel's curve (causal for local, full
for received) at its pair-heads (pairs x the rank's heads x micro-batch); a rank's attention time
is its pairs at the long-block rate times its calls' slowdown, local and received apart (each
received block's own slowdown scales its round in the pipeline, at the kernel's long-block rate,
as in ``estimate``). A flat rate without curves prices every pair alike. The CPU testbed's
``cpu-flash`` curves come from ``profile --testbed``; with them a THD-style split (tens of small
windows per layer) is no longer priced at the long-block rate.

``costmodel.documents.estimate_documents`` uses these for its attention time and, per received
block, for the compute of its round in the pipeline.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from megatron_hexiseq import kernel_rules
from megatron_hexiseq.costmodel.pieces import Pieces, expand_cells
from megatron_hexiseq.costmodel.rates import ClusterRates, call_fraction
from megatron_hexiseq.layout import Layout

MAX_WINDOWS = 1_000_000  # (query piece, earlier group) pairs enumerated as windows; above: spread
VARLEN_KERNELS = kernel_rules.VARLEN_KERNELS  # one variable-length call per block (varlen.py)


class DocumentCalls(NamedTuple):
    """The attention kernel calls of one micro-batch's blocks, as the runtime's windows
    (``attention.documents.local_windows`` / ``block_windows``) cut them: per entry ``windows``
    windows (1 when enumerated) of ``pairs`` document-masked query-key pairs each (one sequence and
    head), of ``group`` (the querying group) reading ``source``'s keys (the group itself for a local
    window; -1: not enumerated), ``causal`` for a local square window. ``exact`` is False when the
    received windows were too many to enumerate (``MAX_WINDOWS``): each query piece then has one
    entry of ``m`` windows sharing its cross pairs evenly (m = the groups it reads; the pairs of
    every group stay exact, as ``pairs x windows`` sums)."""

    group: np.ndarray
    source: np.ndarray
    pairs: np.ndarray  # float64: one window's pairs (exact integers when enumerated)
    windows: np.ndarray
    causal: np.ndarray
    exact: bool


def _join(pieces: Pieces, pg: np.ndarray) -> tuple[np.ndarray, ...]:
    """Touching pieces of one group inside one document joined (the runtime's runs): group, doc,
    start, length (position order)."""
    new = np.ones(pg.size, dtype=bool)
    new[1:] = (pg[1:] != pg[:-1]) | (pieces.doc[1:] != pieces.doc[:-1])
    idx = np.cumsum(new) - 1
    length = np.bincount(idx, weights=pieces.end - pieces.start).astype(np.int64)
    return pg[new], pieces.doc[new], pieces.start[new], length


def document_calls(pieces: Pieces, pg: np.ndarray, n: int, cu: np.ndarray) -> DocumentCalls:
    """Every window of the micro-batch (``DocumentCalls``). Local: one causal window per (group,
    document) of the group's ``l`` tokens there, ``l (l + 1) / 2`` pairs. Received: a joined query
    piece of group g in document D reads, from each other group s holding earlier tokens of D, the
    ``K`` tokens of s in D before it (``l x K`` pairs); neighbouring pieces of g in D with the same
    ``K`` share one window (no token of s between them)."""
    g, doc, start, length = _join(pieces, pg)
    N = int(cu[-1])
    cell = doc * n + g
    cells, inv = np.unique(cell, return_inverse=True)
    held = np.rint(np.bincount(inv, weights=length, minlength=cells.size)).astype(np.int64)
    loc_g, loc_pairs = cells % n, (held * (held + 1)) >> 1
    first = np.full(cells.size, N, dtype=np.int64)
    np.minimum.at(first, inv, start)
    # cells by (document, first position): the groups a piece reads are a prefix of its document's
    order_c = np.lexsort((first, cells // n))
    c_doc, c_first = (cells // n)[order_c], first[order_c]
    key_c = c_doc * (N + 1) + c_first
    lo = np.searchsorted(c_doc, doc, side="left")
    hi = np.searchsorted(key_c, doc * (N + 1) + start, side="left")
    own_before = (first[inv] < start).astype(np.int64)
    m = hi - lo - own_before  # other groups read by each piece
    total = int((hi - lo).sum())
    loc = (loc_g, loc_g, loc_pairs, np.ones(loc_g.size, dtype=bool))
    # tokens of every group in its document before a position: pieces by (cell, start), cumulative
    order_p = np.lexsort((start, inv))
    key_p = inv[order_p] * (N + 1) + start[order_p]
    csum = np.concatenate(([0], np.cumsum(length[order_p])))
    cell_base = csum[np.searchsorted(inv[order_p], np.arange(cells.size), side="left")]
    if total <= MAX_WINDOWS:
        i = np.repeat(np.arange(g.size), hi - lo)
        c = order_c[lo[i] + np.arange(total) - np.repeat(np.cumsum(hi - lo) - (hi - lo), hi - lo)]
        keep = cells[c] % n != g[i]
        i, c = i[keep], c[keep]
        K = csum[np.searchsorted(key_p, c * (N + 1) + start[i], side="left")] - cell_base[c]
        s = cells[c] % n
        # one window per run of (group, source, document, K): sum the rows, pairs = rows x K
        o = np.lexsort((K, doc[i], s, g[i]))
        cols = np.stack([g[i][o], s[o], doc[i][o], K[o]])
        brk = np.ones(o.size, dtype=bool)
        brk[1:] = (cols[:, 1:] != cols[:, :-1]).any(axis=0)
        w = np.cumsum(brk) - 1
        rows = np.bincount(w, weights=length[i][o]).astype(np.int64) if o.size else np.zeros(0)
        rg, rs, rK = cols[0][brk], cols[1][brk], cols[3][brk]
        rpairs = np.asarray(rows, dtype=np.int64) * rK
        rcount = np.ones(rg.size, dtype=np.int64)
        exact = True
    else:  # spread each piece's cross pairs over the m groups it reads: one entry of m windows
        own_tok = csum[np.searchsorted(key_p, inv * (N + 1) + start, side="left")] - cell_base[inv]
        cross = length * (start - cu[doc] - own_tok)
        has = m > 0
        rg, rs, rcount = g[has], np.full(int(has.sum()), -1, dtype=np.int64), m[has]
        rpairs = cross[has] / rcount
        exact = False
    return DocumentCalls(
        group=np.concatenate([loc[0], rg]).astype(np.int64),
        source=np.concatenate([loc[1], rs]).astype(np.int64),
        pairs=np.concatenate([loc[2], rpairs]).astype(np.float64),
        windows=np.concatenate([np.ones(loc_g.size, dtype=np.int64), rcount]).astype(np.int64),
        causal=np.concatenate([loc[3], np.zeros(rg.size, dtype=bool)]),
        exact=exact,
    )


def rank_kernel_calls(
    calls: DocumentCalls, n: int, group_of_rank: np.ndarray, one_call_per_block: np.ndarray
) -> np.ndarray:
    """Per rank, its kernel calls in one layer and pass (its group's, ``n`` groups): one per window,
    or, for ranks in ``one_call_per_block`` (a variable-length kernel), one per block: its group's
    own window and one per source group it reads (without enumeration, the windows' count as an
    upper bound)."""
    per_window = np.rint(np.bincount(calls.group, weights=calls.windows, minlength=n)).astype(
        np.int64
    )
    per_block = per_window
    if calls.exact:
        blocks = np.unique(calls.group * (n + 1) + (calls.source + 1)) // (n + 1)
        per_block = np.bincount(blocks, minlength=n).astype(np.int64)
    return np.where(one_call_per_block, per_block[group_of_rank], per_window[group_of_rank])


def call_slowdown(
    calls: DocumentCalls,
    layout: Layout,
    heads: np.ndarray,
    rates: ClusterRates,
    b: int,
    one_call_per_block: np.ndarray,
) -> tuple[np.ndarray, np.ndarray, BlockSlowdown | None]:
    """Per rank: (local, received) attention time at the achieved rates of its calls over that time
    at the long-block rate (1.0 where the rank has none, or a flat rate). A call's rate is
    ``call_fraction`` of its curve (causal: local window, full: received) at its pair-heads
    (``pairs x heads x b``). Ranks in ``one_call_per_block`` run a block's windows as one
    variable-length call (``attention.varlen.uses_varlen``): the call is the block's pairs. Third:
    the same per received block (None when the windows were not enumerated)."""
    W = layout.world_size
    cell, r, _ = expand_cells(calls.group, layout)
    work = calls.pairs * calls.windows  # pairs of each entry's windows together
    pairs = calls.pairs[cell]
    if calls.exact:
        block = calls.group * (int(calls.source.max(initial=0)) + 2) + calls.source + 1
        _, binv = np.unique(block, return_inverse=True)
        block_pairs = np.bincount(binv, weights=work)[binv]
    else:  # received blocks unknown: a group's cross pairs over as many blocks as its pieces'
        # most sources (the local block is one call either way)
        loc = calls.causal
        g_loc = np.bincount(calls.group[loc], weights=work[loc])
        g_cross = np.bincount(calls.group[~loc], weights=work[~loc], minlength=g_loc.size)
        g_blocks = np.ones(g_loc.size, dtype=np.int64)
        np.maximum.at(g_blocks, calls.group[~loc], calls.windows[~loc])
        block_pairs = np.where(loc, g_loc[calls.group], (g_cross / g_blocks)[calls.group])
    work = work[cell]
    call = np.where(one_call_per_block[r], block_pairs[cell], pairs) * heads[r] * b
    frac = np.ones(r.size)
    causal = calls.causal[cell]
    for rate, where in rates.groups:
        sel = where[r]
        for mask, curve in ((causal, rate.causal), (~causal, rate.full)):
            pick = sel & mask
            if curve is not None and pick.any():
                frac[pick] = call_fraction(curve, call[pick])
    slow = work / frac
    out = []
    for mask in (causal, ~causal):
        ideal = np.bincount(r[mask], weights=work[mask], minlength=W)
        actual = np.bincount(r[mask], weights=slow[mask], minlength=W)
        out.append(np.where(ideal > 0, actual / np.where(ideal > 0, ideal, 1.0), 1.0))
    by_source = None
    if calls.exact:  # per (receiver rank, source group): the slowdown of that block's calls
        recv = ~causal
        key = r[recv] * (int(calls.source.max(initial=0)) + 1) + calls.source[cell][recv]
        keys, kinv = np.unique(key, return_inverse=True)
        ideal = np.bincount(kinv, weights=work[recv], minlength=keys.size)
        actual = np.bincount(kinv, weights=slow[recv], minlength=keys.size)
        by_source = BlockSlowdown(keys, int(calls.source.max(initial=0)) + 1, actual / ideal)
    return out[0], out[1], by_source


class BlockSlowdown(NamedTuple):
    """Slowdown of each received block's calls, keyed ``rank * stride + source group`` (sorted)."""

    keys: np.ndarray
    stride: int
    factor: np.ndarray

    def lookup(self, rank: np.ndarray, source: np.ndarray, default: np.ndarray) -> np.ndarray:
        """The factor of each (rank, source) block; ``default`` where the block has no call."""
        key = rank * self.stride + source
        at = np.minimum(np.searchsorted(self.keys, key), max(self.keys.size - 1, 0))
        hit = (self.keys[at] == key) if self.keys.size else np.zeros(key.size, dtype=bool)
        return np.where(hit, self.factor[at] if self.keys.size else 0.0, default)
