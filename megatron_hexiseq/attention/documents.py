"""Packed documents: boundaries, the pruned K/V exchange and the document-masked block windows.

A micro-batch sample holds several documents; ``cu_seqlens = [0, b1, ..., S]`` (global sequence
positions, strictly increasing) cuts it into documents ``[b_i, b_{i+1})``. Query position x sees key
position y iff ``y <= x`` and both lie in the same document. With a micro-batch of B samples the
boundaries may differ per sample (one list per sample); equal lists are treated as one shared list.

Everything here is a pure function of (layout, boundaries, comm_chunks), so every rank derives the
same exchange schedule without communicating (the boundaries are the same on every rank: each CP
rank reads the whole micro-batch before slicing it).

Vocabulary (``peers.py``): a *run* ``(start, end, pos)`` is a contiguous stretch of a group sequence
(local indices ``[start, end)``, global positions ``[pos, pos + end - start)``).

**Pruning rule.** A source token at position y, document d, is sent to destination group g iff g
holds a later token of d: ``y < last_g(d)``, the last position of g inside d. Per sample the needed
positions are therefore the intervals ``[start(d), last_g(d))``; over a micro-batch with per-sample
boundaries their union (the K/V message carries every sample, so a token needed by one sample is
sent for all). The granularity is the token: a piece is the source's runs intersected with these
intervals (contiguous key runs trimmed to the needed range), then split into ``comm_chunks`` steps
as without documents. Source groups whose needed set is empty send nothing; so every transferred
key is visible to at least one query of the destination (in some sample), and no block without a
visible pair is sent or computed. Without documents the rule reduces to today's trim (one document
``[0, S)``: ``y < last_g``).

**Windows.** The group sequence is position-sorted, so a document's tokens of my group are one
contiguous local range: the local block is one square causal window per document present
(``local_windows``). In a received block (position-sorted keys of another group, none inside a query
run), a query run cut at document boundaries meets, per document piece starting at position p in
document ``[ds, de)``, exactly the keys with positions in ``[ds, p)``: one contiguous key range, an
unmasked window (``block_windows``). Windows without keys are dropped; neighbouring windows with the
same keys and adjacent rows merge. No mask exists.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from megatron_hexiseq.attention.peers import (
    RankSchedule,
    Run,
    Window,
    build_schedule,
    group_runs,
)
from megatron_hexiseq.errors import HexiSeqError
from megatron_hexiseq.layout import Layout


@dataclass(frozen=True)
class DocumentBounds:
    """Validated document boundaries of one micro-batch.

    ``samples``: one boundary tuple ``(0, ..., S)`` per sample, or a single tuple shared by every
    sample (``shared``). Hashable: the runtime caches schedules by it.
    """

    seq_length: int
    samples: tuple[tuple[int, ...], ...]
    shared: bool

    def per_sample(self) -> list[tuple[int | None, tuple[int, ...]]]:
        """``(sample, bounds)`` pairs; sample ``None`` stands for every sample."""
        if self.shared:
            return [(None, self.samples[0])]
        return list(enumerate(self.samples))

    def for_batch(self, seq_length: int, batch: int) -> DocumentBounds:
        """Itself, after checking it fits a sequence of ``seq_length`` and a micro-batch of ``batch``."""
        if self.seq_length != seq_length:
            raise HexiSeqError(
                f"document boundaries end at {self.seq_length} but the sequence has {seq_length} "
                "tokens; derive them from this micro-batch"
            )
        if not self.shared and len(self.samples) != batch:
            raise HexiSeqError(
                f"document boundaries for {len(self.samples)} samples given to a micro-batch of "
                f"{batch}; derive them from this micro-batch"
            )
        return self

    @property
    def num_documents(self) -> int:
        return sum(len(b) - 1 for b in self.samples)


def _as_lists(cu_seqlens: Any) -> list[Any]:
    if isinstance(cu_seqlens, torch.Tensor):
        if cu_seqlens.dim() not in (1, 2):
            raise HexiSeqError(
                f"cu_seqlens must be 1-D (one list) or 2-D (one row per sample), "
                f"got shape {tuple(cu_seqlens.shape)}"
            )
        cu_seqlens = cu_seqlens.tolist()
    if not isinstance(cu_seqlens, Sequence) or isinstance(cu_seqlens, (str, bytes)):
        raise HexiSeqError(
            f"cu_seqlens must be a list of positions [0, ..., S] or one such list per sample, "
            f"got {type(cu_seqlens).__name__}"
        )
    if all(isinstance(x, Sequence) or isinstance(x, torch.Tensor) for x in cu_seqlens):
        return [x.tolist() if isinstance(x, torch.Tensor) else list(x) for x in cu_seqlens]
    return [list(cu_seqlens)]


def _check(bounds: list[Any], seq_length: int, where: str) -> tuple[int, ...]:
    fix = f"give strictly increasing positions from 0 to the sequence length {seq_length}"
    if any(isinstance(b, bool) or not isinstance(b, int) for b in bounds):
        raise HexiSeqError(f"cu_seqlens{where} must hold integer positions; {fix}")
    if len(bounds) < 2 or bounds[0] != 0 or bounds[-1] != seq_length:
        first = bounds[0] if bounds else None
        last = bounds[-1] if bounds else None
        raise HexiSeqError(
            f"cu_seqlens{where} must start at 0 and end at {seq_length}, got {len(bounds)} "
            f"entries from {first} to {last}; {fix}"
        )
    for i in range(1, len(bounds)):
        if bounds[i] <= bounds[i - 1]:
            raise HexiSeqError(
                f"cu_seqlens{where} is not strictly increasing at index {i} "
                f"({bounds[i - 1]} then {bounds[i]}); {fix} (an empty document has no boundary)"
            )
    return tuple(bounds)


def parse_cu_seqlens(cu_seqlens: Any, *, seq_length: int, batch: int) -> DocumentBounds:
    """``cu_seqlens`` (one list / 1-D tensor, or ``batch`` lists / a ``[batch, n]`` tensor) ->
    ``DocumentBounds``; a bad value is one ``HexiSeqError`` naming the sample and the entry.

    A CUDA tensor is read on the host (a sync): pass host lists on the hot path.
    """
    lists = _as_lists(cu_seqlens)
    if len(lists) == 1:
        return DocumentBounds(seq_length, (_check(lists[0], seq_length, ""),), shared=True)
    if len(lists) != batch:
        raise HexiSeqError(
            f"cu_seqlens has {len(lists)} lists for a micro-batch of {batch} samples; give one "
            "list for every sample, or a single list shared by all"
        )
    samples = tuple(_check(b, seq_length, f" of sample {i}") for i, b in enumerate(lists))
    if all(b == samples[0] for b in samples):
        return DocumentBounds(seq_length, samples[:1], shared=True)
    return DocumentBounds(seq_length, samples, shared=False)


class _Prefix:
    """Counts of a position-sorted run list's tokens below a position, by bisection."""

    def __init__(self, runs: tuple[Run, ...]) -> None:
        self.starts = [p for _, _, p in runs]
        self.lens = [e - s for s, e, _ in runs]
        self.cum = [0]
        for n in self.lens:
            self.cum.append(self.cum[-1] + n)

    def below(self, pos: int) -> int:
        """Tokens with position < pos."""
        i = bisect_right(self.starts, pos - 1) - 1
        if i < 0:
            return 0
        return self.cum[i] + min(pos - self.starts[i], self.lens[i])

    def last_before(self, pos: int) -> int:
        """The largest position < pos, or -1."""
        i = bisect_right(self.starts, pos - 1) - 1
        if i < 0:
            return -1
        return min(pos - 1, self.starts[i] + self.lens[i] - 1)


def needed_intervals(dst_runs: tuple[Run, ...], bounds: DocumentBounds) -> list[tuple[int, int]]:
    """Sorted disjoint position intervals a group with ``dst_runs`` needs from other groups: per
    document ``[start, last position of the group in it)``, united over samples."""
    dst = _Prefix(dst_runs)
    spans: list[tuple[int, int]] = []
    for _, b in bounds.per_sample():
        for ds, de in zip(b, b[1:]):
            last = dst.last_before(de)
            if last > ds:
                spans.append((ds, last))
    spans.sort()
    merged: list[tuple[int, int]] = []
    for a, e in spans:
        if merged and a <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], e))
        else:
            merged.append((a, e))
    return merged


def intersect_runs(runs: tuple[Run, ...], intervals: list[tuple[int, int]]) -> tuple[Run, ...]:
    """The tokens of ``runs`` whose positions lie in ``intervals`` (both position-sorted)."""
    out: list[Run] = []
    j = 0
    for s, e, p in runs:
        q = p + e - s
        while j < len(intervals) and intervals[j][1] <= p:
            j += 1
        k = j
        while k < len(intervals) and intervals[k][0] < q:
            a, b = max(p, intervals[k][0]), min(q, intervals[k][1])
            out.append((s + a - p, s + b - p, a))
            k += 1
    return tuple(out)


def block_windows(
    q_runs: tuple[Run, ...], k_runs: tuple[Run, ...], bounds: DocumentBounds
) -> tuple[Window, ...]:
    """The unmasked windows of one received block (module docstring)."""
    keys = _Prefix(k_runs)
    out: list[Window] = []
    for sample, b in bounds.per_sample():
        for s, e, p in q_runs:
            i, pos, end_run = bisect_right(b, p) - 1, p, p + e - s
            while pos < end_run:
                ds, de = b[i], b[i + 1]
                end = min(de, end_run)
                lo, hi = keys.below(ds), keys.below(pos)
                if hi > lo:
                    w = Window(sample, s + pos - p, s + end - p, lo, hi)
                    last = out[-1] if out else None
                    if (
                        last is not None
                        and last.sample == sample
                        and last.row_hi == w.row_lo
                        and (last.key_lo, last.key_hi) == (lo, hi)
                    ):
                        out[-1] = last._replace(row_hi=w.row_hi)
                    else:
                        out.append(w)
                pos, i = end, i + 1
    return tuple(out)


def local_windows(q_runs: tuple[Run, ...], bounds: DocumentBounds) -> tuple[Window, ...]:
    """The local block's square causal windows: one per (sample, document present in my group)."""
    mine = _Prefix(q_runs)
    out: list[Window] = []
    for sample, b in bounds.per_sample():
        for ds, de in zip(b, b[1:]):
            lo, hi = mine.below(ds), mine.below(de)
            if hi > lo:
                out.append(Window(sample, lo, hi, lo, hi))
    return tuple(out)


def document_schedule(
    layout: Layout, rank: int, bounds: DocumentBounds, comm_chunks: int = 1
) -> RankSchedule:
    """``peers.build_schedule`` with the pruning rule and document windows (module docstring)."""
    if bounds.seq_length != layout.seq_length:
        raise HexiSeqError(
            f"document boundaries end at {bounds.seq_length} but the layout's sequence has "
            f"{layout.seq_length} tokens"
        )
    intervals = {g.id: needed_intervals(group_runs(layout, g.id), bounds) for g in layout.groups}

    def needed(src: int, dst: int, src_runs: tuple[Run, ...]) -> tuple[Run, ...]:
        return intersect_runs(src_runs, intervals[dst])

    q_runs = group_runs(layout, layout.ranks[rank].group)
    return build_schedule(
        layout,
        rank,
        comm_chunks,
        needed=needed,
        windows=lambda q, k: block_windows(q, k, bounds),
        local_windows=local_windows(q_runs, bounds),
    )


def window_pairs(windows: tuple[Window, ...], batch: int, *, causal: bool) -> int:
    """(query, key) token pairs the windows compute, summed over samples (per head)."""
    total = 0
    for w in windows:
        rows, keys = w.row_hi - w.row_lo, w.key_hi - w.key_lo
        pairs = rows * (rows + 1) // 2 if causal else rows * keys
        total += pairs * (batch if w.sample is None else 1)
    return total
