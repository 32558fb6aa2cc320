"""Peer tables of the HexiSeq attention runtime, computed from a Layout alone (no processes).

Every rank computes the same tables from the same layout, so no communication is needed to agree.

Vocabulary. A group's *sequence* is its members' tokens in position order (the runtime's own
order: queries and keys of the local block are then causally aligned, one square causal call). After the head all-to-all,
rank r holds, for its query heads ``H_r``, the queries of its whole group sequence, and for its K/V
heads ``K_r`` (the query groups its heads read) the keys/values of the whole group sequence.
Every group holds every query head, so every K/V head has at least one *holder* in every group.

Sub-ring rounds. With n groups (in ``layout.groups`` order), round t = 1..n-1 sends K/V from group
``(g - t) mod n`` to group g (a ring over groups). Receiver r of group g needs, from source group s,
the K/V heads ``K_r`` for the tokens of s that are causally visible to some query of g: positions
``<= max position of g`` (a *trim*; hidden tokens are neither sent nor computed). For each (r, head)
one holder in s is chosen: the holder with the least load (tokens x heads) so far in that round,
lowest rank on ties, receivers and heads visited in ascending order — deterministic and balanced.
All heads a holder sends to one receiver in one step travel as one message ``[2, T, B, h, D]``.

Mask-free blocks. The tokens of a received block are position-sorted and belong to another group,
so no key position lies inside a *query run* (a run of consecutive positions of my group sequence):
every query of a run sees the same prefix of the block, the keys with smaller positions. A block is
therefore computed as unmasked calls ``(row_lo, row_hi, keys)``: rows ``[row_lo, row_hi)`` of my group
sequence against the first ``keys`` keys of the block; consecutive runs with the same prefix share
one call, runs that see nothing are skipped. No ``[S, T]`` mask exists anywhere.

Documents. ``documents.document_schedule`` reuses ``build_transfers``/``build_schedule`` with a
``needed`` rule (only tokens some later token of the same document needs) and ``Window`` calls.

Chunks. ``comm_chunks = c`` splits every round's trimmed tokens into up to c contiguous pieces of
near-equal length (an empty piece is dropped); each piece is one *step*: one batch of P2P posted
before the previous step's block is computed, and one (q, kv) block computed. Step index =
``(t - 1) * c + j``. ``c = 1`` means one message per (holder, receiver) per round.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cached_property
from typing import NamedTuple

from megatron_hexiseq.layout import Layout, split_evenly

# (start, end, position of start): a contiguous run of a group sequence's local indices [start, end)
# holding global positions [pos, pos + end - start).
Run = tuple[int, int, int]


def runs_num_tokens(runs: tuple[Run, ...]) -> int:
    return sum(e - s for s, e, _ in runs)


def runs_positions(runs: tuple[Run, ...]) -> list[int]:
    return [p + i for s, e, p in runs for i in range(e - s)]


def group_pieces(layout: Layout, group_id: int) -> tuple[tuple[int, int, int, int], ...]:
    """The group sequence in position order, as pieces ``(member rank, start, end, offset)``.

    ``[start, end)`` indexes the member's own tokens (segment order), ``offset`` is where the piece
    starts in the group sequence. (A rank's segments are sorted, so its tokens are in position order;
    the group sequence interleaves the members' segments by position.)
    """
    segs = []
    for r in layout.group(group_id).ranks:
        local = 0
        for s, e in layout.ranks[r].segments:
            segs.append((s, e, r, local))
            local += e - s
    segs.sort()
    out, off = [], 0
    for s, e, r, local in segs:
        out.append((r, local, local + e - s, off))
        off += e - s
    return tuple(out)


def group_runs(layout: Layout, group_id: int) -> tuple[Run, ...]:
    """The group sequence (position order) as runs; touching segments merge into one run."""
    runs: list[Run] = []
    off = 0
    for s, e in sorted(layout.group_segments(group_id)):
        if runs and runs[-1][2] + runs[-1][1] - runs[-1][0] == s:
            a, _, p = runs[-1]
            runs[-1] = (a, off + e - s, p)
        else:
            runs.append((off, off + e - s, s))
        off += e - s
    return tuple(runs)


def count_below(runs: tuple[Run, ...], pos: int) -> int:
    """Number of tokens of ``runs`` with position < pos (runs in position order: a prefix)."""
    return sum(min(max(pos - p, 0), e - s) for s, e, p in runs)


def trim_runs(runs: tuple[Run, ...], max_pos: int) -> tuple[Run, ...]:
    """Keep the tokens with position <= max_pos (each run is increasing, so a prefix of it)."""
    out = []
    for s, e, p in runs:
        keep = min(e - s, max_pos + 1 - p)
        if keep > 0:
            out.append((s, s + keep, p))
    return tuple(out)


def split_runs(runs: tuple[Run, ...], parts: int) -> list[tuple[Run, ...]]:
    """Split runs into up to ``parts`` contiguous pieces of near-equal token count (no empty piece)."""
    sizes = [n for n in split_evenly(runs_num_tokens(runs), parts) if n > 0]
    pieces: list[tuple[Run, ...]] = []
    queue = list(runs)
    for size in sizes:
        need, cur = size, list[Run]()
        while need:
            s, e, p = queue.pop(0)
            take = min(need, e - s)
            cur.append((s, s + take, p))
            if take < e - s:
                queue.insert(0, (s + take, e, p + take))
            need -= take
        pieces.append(tuple(cur))
    return pieces


@dataclass(frozen=True)
class KVTransfer:
    """One message of one step: holder ``src`` sends K/V heads to receiver ``dst`` (layout ranks).

    ``src_heads``: indices into src's K/V-head list; ``dst_heads``: the same heads as indices into
    dst's K/V-head list; ``runs``: tokens of src's group sequence (local indices + positions).
    Backward sends ``[2, T, B, len(dst_heads), D]`` of dK/dV back along the reverse direction.
    """

    step: int
    src: int
    dst: int
    src_heads: tuple[int, ...]
    dst_heads: tuple[int, ...]
    runs: tuple[Run, ...]

    @property
    def num_tokens(self) -> int:
        return runs_num_tokens(self.runs)


# (row_lo, row_hi, keys): rows [row_lo, row_hi) of the group sequence see the first `keys` keys of a block
Call = tuple[int, int, int]


class Window(NamedTuple):
    """One kernel call of a document-masked block (``documents.py``): rows ``[row_lo, row_hi)`` of
    the group sequence against keys ``[key_lo, key_hi)`` of the block, for micro-batch sample
    ``sample`` (``None``: every sample, their boundaries are the same). A local-block window is
    square and causal (``key_lo, key_hi == row_lo, row_hi``); a received-block window is unmasked."""

    sample: int | None
    row_lo: int
    row_hi: int
    key_lo: int
    key_hi: int


@dataclass(frozen=True)
class RankStep:
    """What one rank does in one step: its sends as holder, its receives (and block) as receiver."""

    step: int
    sends: tuple[KVTransfer, ...]
    recvs: tuple[KVTransfer, ...]
    calls: tuple[Call, ...]  # the received block's unmasked calls (empty when I receive nothing)
    windows: tuple[Window, ...] | None = None  # with document boundaries: the calls instead

    @property
    def computes(self) -> bool:
        return bool(self.recvs)

    @property
    def k_runs(self) -> tuple[Run, ...]:
        return self.recvs[0].runs if self.recvs else ()


@dataclass(frozen=True)
class RankSchedule:
    """Everything rank ``rank`` needs to run attention for one layout and ``comm_chunks``."""

    rank: int
    group_ranks: tuple[int, ...]  # layout ranks of my A2A group, ascending
    heads: tuple[int, ...]  # my query heads H_r (global indices)
    kv_heads: tuple[int, ...]  # my K/V heads K_r (global query-group indices)
    kv_of_head: tuple[int, ...]  # for each of my query heads, index into kv_heads
    q_runs: tuple[Run, ...]  # my group sequence (= my queries and my own K/V after A2A)
    steps: tuple[RankStep, ...]  # only steps where I send or receive, in global step order
    num_steps: int  # global number of steps (tags of backward dK/dV offset by it)
    local_windows: tuple[Window, ...] | None = (
        None  # with documents: the local block's causal calls
    )

    def step_at(self, step: int) -> RankStep | None:
        """My part in global step ``step``, or None when I neither send nor receive in it."""
        return self._by_step.get(step)

    @cached_property
    def _by_step(self) -> dict[int, RankStep]:
        return {s.step: s for s in self.steps}


def kv_of_head(
    layout: Layout, heads: tuple[int, ...], kv_heads: tuple[int, ...]
) -> tuple[int, ...]:
    hpg = layout.heads_per_query_group
    return tuple(kv_heads.index(h // hpg) for h in heads)


# (source group id, destination group id, source group runs) -> the runs the destination needs
Needed = Callable[[int, int, tuple[Run, ...]], tuple[Run, ...]]


def build_transfers(
    layout: Layout, comm_chunks: int = 1, needed: Needed | None = None
) -> tuple[tuple[KVTransfer, ...], int]:
    """All K/V transfers of all steps (sorted by step, dst, src) and the number of steps.

    ``needed`` chooses the source tokens a destination group receives; by default the trim (every
    source token before the destination's last position); ``documents.py`` passes its pruning."""
    if comm_chunks < 1:
        raise ValueError(f"comm_chunks must be >= 1, got {comm_chunks}")
    groups = layout.groups
    n = len(groups)
    kv = {r.rank: layout.kv_heads(r.rank) for r in layout.ranks}
    max_pos = {g.id: max(e for s, e in layout.group_segments(g.id)) - 1 for g in groups}
    transfers: list[KVTransfer] = []
    for t in range(1, n):
        for gi, g in enumerate(groups):
            src_group = groups[(gi - t) % n]
            src_runs = group_runs(layout, src_group.id)
            if needed is None:
                runs = trim_runs(src_runs, max_pos[g.id])
            else:
                runs = needed(src_group.id, g.id, src_runs)
            if not runs:
                continue  # every token of the source group is in the future of group g
            tokens = runs_num_tokens(runs)
            load = {j: 0 for j in src_group.ranks}
            chosen: dict[tuple[int, int], list[int]] = {}  # (src, dst) -> kv heads
            for r in g.ranks:
                for k in kv[r]:
                    holders = [j for j in src_group.ranks if k in kv[j]]
                    j = min(holders, key=lambda x: (load[x], x))
                    load[j] += tokens
                    chosen.setdefault((j, r), []).append(k)
            for c, piece in enumerate(split_runs(runs, comm_chunks)):
                step = (t - 1) * comm_chunks + c
                for (j, r), ks in sorted(chosen.items(), key=lambda x: (x[0][1], x[0][0])):
                    transfers.append(
                        KVTransfer(
                            step=step,
                            src=j,
                            dst=r,
                            src_heads=tuple(kv[j].index(k) for k in ks),
                            dst_heads=tuple(kv[r].index(k) for k in ks),
                            runs=piece,
                        )
                    )
    transfers.sort(key=lambda x: (x.step, x.dst, x.src))
    return tuple(transfers), (n - 1) * comm_chunks


def block_calls(q_runs: tuple[Run, ...], k_runs: tuple[Run, ...]) -> tuple[Call, ...]:
    """The unmasked calls of one received block (see "Mask-free blocks" above).

    ``q_runs``: my group sequence; ``k_runs``: the block's tokens (another group's, position-sorted).
    """
    calls: list[Call] = []
    for s, e, p in q_runs:
        keys = count_below(k_runs, p)
        if not keys:
            continue
        if calls and calls[-1][1] == s and calls[-1][2] == keys:
            calls[-1] = (calls[-1][0], e, keys)
        else:
            calls.append((s, e, keys))
    return tuple(calls)


def build_schedule(
    layout: Layout,
    rank: int,
    comm_chunks: int = 1,
    *,
    needed: Needed | None = None,
    windows: Callable[[tuple[Run, ...], tuple[Run, ...]], tuple[Window, ...]] | None = None,
    local_windows: tuple[Window, ...] | None = None,
) -> RankSchedule:
    """The schedule of one rank (see the module docstring). With document boundaries
    (``documents.document_schedule``) ``needed`` prunes the transfers, ``windows(q_runs, k_runs)``
    gives a received block's calls and ``local_windows`` the local block's."""
    transfers, num_steps = build_transfers(layout, comm_chunks, needed)
    plan = layout.ranks[rank]
    group = layout.group(plan.group)
    q_runs = group_runs(layout, group.id)
    mine: dict[int, tuple[list[KVTransfer], list[KVTransfer]]] = {}
    for x in transfers:  # sorted by (step, dst, src)
        if rank in (x.src, x.dst):
            sends, recvs = mine.setdefault(x.step, ([], []))
            (sends if x.src == rank else recvs).append(x)
    steps = []
    for step, (sends, recvs) in sorted(mine.items()):
        if windows is None:
            calls, wins = (block_calls(q_runs, recvs[0].runs) if recvs else ()), None
        else:
            calls, wins = (), (windows(q_runs, recvs[0].runs) if recvs else ())
        steps.append(
            RankStep(step=step, sends=tuple(sends), recvs=tuple(recvs), calls=calls, windows=wins)
        )
    kv_heads = layout.kv_heads(rank)
    return RankSchedule(
        rank=rank,
        group_ranks=group.ranks,
        heads=plan.heads,
        kv_heads=kv_heads,
        kv_of_head=kv_of_head(layout, plan.heads, kv_heads),
        q_runs=q_runs,
        steps=tuple(steps),
        num_steps=num_steps,
        local_windows=local_windows,
    )
