"""The record a micro-batch's token assignment travels in, and the helpers that fill it.

``BatchAssignment``: a validated ``Layout`` of the micro-batch's tokens (the job's groups, hosts,
GPUs and heads; each rank's segments in global positions) plus the document boundaries. Built by
``varlen.batch.BatchPlanner`` (and the schemes of ``varlen.schemes``), consumed by a batch slicer.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Any

import numpy as np

from megatron_hexiseq.costmodel.pieces import check_cu_seqlens
from megatron_hexiseq.errors import HexiSeqError
from megatron_hexiseq.layout import Layout, Segment


@dataclass(frozen=True, kw_only=True)
class BatchAssignment:
    """One micro-batch's token assignment: ``layout`` (seq_length = the micro-batch's tokens, the
    structure's groups and heads, each rank's segments in global positions, several runs allowed)
    and ``cu_seqlens`` (the document boundaries). Validated: the layout's rules, and the boundaries
    strictly increasing from 0 to ``layout.seq_length``. ``predicted_s``: the planner's own estimate
    of the iteration (``costmodel.documents.estimate_documents`` is the cost model's)."""

    layout: Layout
    cu_seqlens: tuple[int, ...]
    predicted_s: float = 0.0

    def __post_init__(self) -> None:
        check_cu_seqlens(self.cu_seqlens, self.layout.seq_length)

    @property
    def doc_lengths(self) -> list[int]:
        return np.diff(self.cu_seqlens).tolist()

    def rank_positions(self, rank: int) -> np.ndarray:
        """The micro-batch positions rank ``rank`` holds, in segment order (int64): what a batch
        slicer gathers (``tokens[:, positions]``) on the host, in the data loader, before the step."""
        segs = self.layout.ranks[rank].segments
        if not segs:
            return np.zeros(0, dtype=np.int64)
        return np.concatenate([np.arange(s, e, dtype=np.int64) for s, e in segs])

    def check_structure(self, structure: Layout) -> None:
        """One HexiSeqError unless this assignment runs on ``structure``'s groups and heads (the
        job's process groups are built once, from the structure)."""
        if not same_structure(self.layout, structure):
            raise HexiSeqError(
                "the micro-batch's assignment does not match the job's structure (groups, hosts, "
                "GPUs or heads differ); plan it with a BatchPlanner built on the job's layout"
            )

    def to_dict(self) -> dict[str, Any]:
        """``{cu_seqlens, ranks: [{rank, group, segments, heads}]}`` (JSON-ready)."""
        return {
            "cu_seqlens": list(self.cu_seqlens),
            "ranks": [
                {
                    "rank": r.rank,
                    "group": r.group,
                    "segments": [list(s) for s in r.segments],
                    "heads": list(r.heads),
                }
                for r in self.layout.ranks
            ],
        }


def same_structure(a: Layout, b: Layout) -> bool:
    """True when two layouts have the same groups, hosts, GPUs and heads (segments may differ)."""
    return (
        a.groups == b.groups
        and all(
            (x.group, x.heads, x.host, x.gpu) == (y.group, y.heads, y.host, y.gpu)
            for x, y in zip(a.ranks, b.ranks)
        )
        and a.world_size == b.world_size
    )


def round_shares(total: int, shares: np.ndarray, *, at_least_one: bool = False) -> list[int]:
    """``total`` split by ``shares`` into integers (largest remainders, ties to the lower index);
    with ``at_least_one`` every part gets one first."""
    k = len(shares)
    base = k if at_least_one else 0
    raw = (total - base) * np.asarray(shares) / float(np.sum(shares))
    counts = np.floor(raw).astype(np.int64)
    left = total - base - int(counts.sum())
    order = np.lexsort((np.arange(k), -(raw - counts)))
    counts[order[:left]] += 1
    return (counts + (1 if at_least_one else 0)).tolist()


def fill_empty(segments: list[list[Segment]]) -> None:
    """A rank without tokens takes the last token of the rank holding the most (lowest index on
    ties), in rank order."""
    counts = [sum(e - s for s, e in segs) for segs in segments]
    empty = [r for r, c in enumerate(counts) if c == 0]
    if not empty:
        return
    donors = [(-c, r) for r, c in enumerate(counts) if c > 1]
    heapq.heapify(donors)
    for r in empty:
        c, donor = heapq.heappop(donors)
        s, e = segments[donor][-1]
        segments[donor][-1:] = [(s, e - 1)] if e - 1 > s else []
        segments[r].append((e - 1, e))
        if -c - 1 > 1:
            heapq.heappush(donors, (c + 1, donor))
