"""Packed documents as pieces: a layout's segments cut at the document boundaries, and their pairs.

A micro-batch of packed documents has boundaries ``cu_seqlens = [0, b1, ..., N]`` in global token
positions. Attention is causal inside each document and nothing crosses a boundary: a query at
position q of a document starting at d0 sees ``q - d0 + 1`` keys. Closed form per piece ``[a, b)``
of one document: ``(a - d0 + 1 + b - d0) * (b - a) / 2`` pairs. The pricing of a whole micro-batch
is ``costmodel.documents``; its kernel calls ``costmodel.document_calls``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from megatron_hexiseq.errors import HexiSeqError
from megatron_hexiseq.layout import Layout


def check_cu_seqlens(cu_seqlens: Sequence[int], length: int) -> np.ndarray:
    """``[0, b1, ..., length]`` strictly increasing integers -> int64 array, else one HexiSeqError."""
    cu = np.asarray(cu_seqlens)
    if cu.ndim != 1 or cu.size < 2 or not np.issubdtype(cu.dtype, np.integer):
        raise HexiSeqError(
            f"cu_seqlens must be a list of at least two integers [0, ..., {length}], got {list(cu_seqlens)[:8]}"
        )
    cu = cu.astype(np.int64)
    if cu[0] != 0 or cu[-1] != length:
        raise HexiSeqError(
            f"cu_seqlens must start at 0 and end at the micro-batch length {length}, got "
            f"[{cu[0]}, ..., {cu[-1]}]"
        )
    bad = np.nonzero(np.diff(cu) <= 0)[0]
    if bad.size:
        i = int(bad[0])
        raise HexiSeqError(
            f"cu_seqlens must be strictly increasing: entry {i + 1} ({cu[i + 1]}) follows {cu[i]}"
        )
    return cu


def cu_from_lengths(doc_lengths: Sequence[int]) -> tuple[int, ...]:
    """Document lengths in packing order -> ``cu_seqlens``."""
    return (0, *(int(x) for x in np.cumsum(np.asarray(doc_lengths, dtype=np.int64))))


@dataclass(frozen=True)
class Pieces:
    """A layout's segments cut at document boundaries, in position order: piece i is tokens
    ``[start[i], end[i])`` of document ``doc[i]`` on layout rank ``rank[i]`` (int64 arrays)."""

    start: np.ndarray
    end: np.ndarray
    rank: np.ndarray
    doc: np.ndarray


def document_pieces(layout: Layout, cu: np.ndarray) -> Pieces:
    """Every rank's segments cut at the document boundaries ``cu``, sorted by position."""
    seg = [(s, e, p.rank) for p in layout.ranks for s, e in p.segments]
    arr = np.array(seg, dtype=np.int64).reshape(-1, 3)
    arr = arr[np.argsort(arr[:, 0], kind="stable")]
    s, e, r = arr[:, 0], arr[:, 1], arr[:, 2]
    d0 = np.searchsorted(cu, s, side="right") - 1
    d1 = np.searchsorted(cu, e - 1, side="right") - 1
    count = d1 - d0 + 1
    idx = np.repeat(np.arange(s.size), count)
    first = np.repeat(np.cumsum(count) - count, count)
    doc = d0[idx] + np.arange(idx.size) - first
    return Pieces(
        start=np.maximum(s[idx], cu[doc]),
        end=np.minimum(e[idx], cu[doc + 1]),
        rank=r[idx],
        doc=doc,
    )


def piece_pairs(start: np.ndarray, end: np.ndarray, doc_start: np.ndarray) -> np.ndarray:
    """Document-masked query-key pairs of query pieces ``[start, end)`` inside documents starting at
    ``doc_start``, against every key of their document: ``sum_q (q - d0 + 1)``."""
    return ((start - doc_start + 1 + end - doc_start) * (end - start)) >> 1


def document_pairs(segments: Sequence[tuple[int, int]], cu_seqlens: Sequence[int]) -> int:
    """Pairs (q, k) with q in ``segments``, k <= q in q's own document (scalar form, for checks)."""
    cu = np.asarray(cu_seqlens, dtype=np.int64)
    total = 0
    for s, e in segments:
        d = int(np.searchsorted(cu, s, side="right")) - 1
        while s < e:
            stop = min(e, int(cu[d + 1]))
            total += (s - int(cu[d]) + 1 + stop - int(cu[d])) * (stop - s) // 2
            s, d = stop, d + 1
    return total


def own_group_pairs(pieces: Pieces, group: np.ndarray, cu: np.ndarray) -> np.ndarray:
    """Per piece: its pairs with keys of the same group (own-group round 0): ``l * C + l(l+1)/2``,
    C = the group's tokens earlier in the same document."""
    length = pieces.end - pieces.start
    order = np.lexsort((pieces.start, group, pieces.doc))
    key = pieces.doc[order] * (int(group.max()) + 1) + group[order]
    csum = np.cumsum(length[order]) - length[order]
    run_start = np.ones(key.size, dtype=bool)
    run_start[1:] = key[1:] != key[:-1]
    base = np.maximum.accumulate(np.where(run_start, csum, 0))
    earlier = np.empty_like(length)
    earlier[order] = csum - base
    return length * earlier + ((length * (length + 1)) >> 1)


def expand_cells(
    groups_of_cell: np.ndarray, layout: Layout
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per cell, one entry per member of its receiving group: (cell index, member rank, member
    position in its group)."""
    sizes = np.array([len(g.ranks) for g in layout.groups])
    members = np.array([r for g in layout.groups for r in g.ranks])
    starts = np.cumsum(sizes) - sizes
    count = sizes[groups_of_cell]
    cell = np.repeat(np.arange(groups_of_cell.size), count)
    pos = np.arange(cell.size) - np.repeat(np.cumsum(count) - count, count)
    return cell, members[starts[groups_of_cell][cell] + pos], pos
