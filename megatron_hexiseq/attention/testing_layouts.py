"""Seeded random valid layouts for the attention tests (uneven everything, edge cases included).

``random_layout(rng, world_size)`` draws group sizes, GQA shape, token segments (uneven,
non-contiguous, possibly zero tokens for a rank) and query heads (uneven, non-divisible, possibly
zero for a rank), and returns a validated ``Layout``.

``random_batch_layout(rng, job, ...)`` draws a per-micro-batch layout of ``job``'s structure (its
groups, heads, hosts and GPUs) with new random segments: several runs per rank, ranks without
tokens, and, given document boundaries, whole documents kept inside one group (cut over its
members), as a document-aware batch planner places short documents.

``random_bounds(rng, layout)`` draws packed-document boundaries ``[0, ..., S]`` for a layout:
1-token documents, boundaries on segment edges, random cuts, sometimes one document.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import replace

from megatron_hexiseq.layout import Layout, Segment, make_layout

GQA_SHAPES = ((8, 2), (6, 3), (12, 4), (4, 1), (6, 1), (4, 4), (3, 3), (8, 8))


def _random_sizes(rng: random.Random, total: int, parts: int) -> list[int]:
    """``parts`` non-negative integers summing to ``total``."""
    cuts = sorted(rng.randint(0, total) for _ in range(parts - 1))
    return [b - a for a, b in zip([0] + cuts, cuts + [total])]


def random_layout(
    rng: random.Random,
    world_size: int,
    *,
    seq_length: int | None = None,
    group_sizes: list[int] | None = None,
    heads: tuple[int, int] | None = None,
    max_pieces: int = 3,
) -> Layout:
    """A random valid layout of ``world_size`` ranks (retries until the validator accepts it)."""
    for _ in range(1000):
        lay = _try(rng, world_size, seq_length, group_sizes, heads, max_pieces)
        if lay is not None:
            return lay
    raise AssertionError("could not draw a valid layout")


def _try(rng, world, seq_length, group_sizes, heads, max_pieces) -> Layout | None:
    if group_sizes is None:
        group_sizes, left = [], world
        while left:
            g = rng.randint(1, left)
            group_sizes.append(g)
            left -= g
    H, G = heads if heads is not None else rng.choice(GQA_SHAPES)
    S = seq_length if seq_length is not None else rng.randint(world + 2, 6 * world + 10)
    # segments: cut [0, S) into pieces, deal them to ranks at random (a rank may get none)
    n_pieces = rng.randint(world, world * max_pieces)
    cuts = sorted(rng.sample(range(1, S), min(n_pieces - 1, S - 1)))
    pieces = list(zip([0] + cuts, cuts + [S]))
    owner = [rng.randrange(world) for _ in pieces]
    segs: list[list[tuple[int, int]]] = [[] for _ in range(world)]
    for (s, e), r in zip(pieces, owner):
        if segs[r] and segs[r][-1][1] == s:
            segs[r][-1] = (segs[r][-1][0], e)  # adjacent pieces of one rank merge
        else:
            segs[r].append((s, e))
    # heads: each group partitions 0..H-1 among its members, uneven, a member may get none
    head_lists: list[list[int]] = []
    for size in group_sizes:
        perm = list(range(H))
        if rng.random() < 0.5:
            rng.shuffle(perm)  # non-contiguous head sets
        counts = _random_sizes(rng, H, size)
        start = 0
        for c in counts:
            head_lists.append(sorted(perm[start : start + c]))
            start += c
    try:
        return make_layout(
            seq_length=S,
            num_attention_heads=H,
            num_query_groups=G,
            group_sizes=group_sizes,
            segments=segs,
            heads=head_lists,
        )
    except ValueError:
        return None


def random_batch_layout(
    rng: random.Random,
    job: Layout,
    *,
    seq_length: int | None = None,
    bounds: Sequence[int] | None = None,
    min_tokens: int = 0,
) -> Layout:
    """A random valid layout with ``job``'s groups and heads and new segments (module docstring).

    ``bounds``: document boundaries ``[0, ..., S]``; about half of the documents then go whole to
    one group. ``min_tokens``: every rank holds at least this many tokens (Megatron needs 1)."""
    S = seq_length if seq_length is not None else job.seq_length
    for _ in range(1000):
        segs = _batch_segments(rng, job, S, bounds)
        if any(sum(e - s for s, e in x) < min_tokens for x in segs):
            continue
        try:
            return replace(
                job,
                seq_length=S,
                ranks=tuple(replace(r, segments=tuple(x)) for r, x in zip(job.ranks, segs)),
                predicted=None,
                baselines=(),
                planner={},
                meta={},
            )
        except ValueError:
            continue
    raise AssertionError("could not draw a valid per-batch layout")


def _batch_segments(
    rng: random.Random, job: Layout, S: int, bounds: Sequence[int] | None
) -> list[list[Segment]]:
    W = job.world_size
    docs = list(zip(bounds, bounds[1:])) if bounds is not None else [(0, S)]
    pieces: list[tuple[int, int, int]] = []  # (start, end, owner rank)
    for a, b in docs:
        if bounds is not None and rng.random() < 0.5:  # the whole document in one group
            members = rng.choice(job.groups).ranks
        else:
            members = tuple(range(W))
        n = rng.randint(1, min(b - a, 2 * len(members)))
        cuts = sorted(rng.sample(range(a + 1, b), n - 1))
        for s, e in zip([a] + cuts, cuts + [b]):
            pieces.append((s, e, rng.choice(members)))
    segs: list[list[Segment]] = [[] for _ in range(W)]
    for s, e, r in pieces:
        if segs[r] and segs[r][-1][1] == s:
            segs[r][-1] = (segs[r][-1][0], e)
        else:
            segs[r].append((s, e))
    return segs


def random_bounds(rng: random.Random, lay: Layout) -> list[int]:
    """Boundaries mixing 1-token documents, segment edges, random cuts; sometimes one document."""
    S = lay.seq_length
    kind = rng.random()
    if kind < 0.15 or S < 2:
        return [0, S]  # one document spanning every rank
    edges = sorted({e for r in lay.ranks for s, e in r.segments if 0 < e < S})
    cuts = set(rng.sample(edges, rng.randint(0, len(edges)))) if kind < 0.5 else set()
    cuts |= set(rng.sample(range(1, S), rng.randint(1, min(S - 1, 6))))
    if rng.random() < 0.4:  # a run of 1-token documents
        a = rng.randrange(1, S)
        cuts |= set(range(a, min(S, a + rng.randint(1, 4))))
    return [0, *sorted(cuts), S]
