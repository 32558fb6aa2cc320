"""64-bit digests of what ranks must agree on: a global schedule, a micro-batch's layout.

Ranks that plan the same thing independently (every rank of a domain plans each micro-batch's
layout; every rank of the run schedules the global batch) compare digests instead of trusting
determinism: a MIN and a MAX all-reduce of one integer per item tell whether all hold the same
(``megatron.agreement``). The digest is BLAKE2b over a canonical integer encoding, cut to 63 bits
so that it is a non-negative int64 (the all-reduce negates it to get the MAX from a MIN).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence

from megatron_hexiseq.layout import Layout

MASK = (1 << 63) - 1


def digest_ints(values: Iterable[int]) -> int:
    """A 63-bit digest of a sequence of integers (each a signed 64-bit-safe or larger int)."""
    h = hashlib.blake2b(digest_size=8)
    for v in values:
        v = int(v)
        h.update(v.to_bytes(16, "little", signed=True))
    return int.from_bytes(h.digest(), "little") & MASK


def layout_digest(layout: Layout, cu_seqlens: Sequence[int] = ()) -> int:
    """The digest of what a micro-batch's ranks must agree on: its length, document boundaries,
    and every rank's group, heads and segments (separated, so no two layouts collide by
    concatenation)."""

    def stream() -> Iterable[int]:
        yield layout.seq_length
        yield len(cu_seqlens)
        yield from cu_seqlens
        for r in layout.ranks:
            yield -1
            yield r.group
            yield len(r.heads)
            yield from r.heads
            yield len(r.segments)
            for s, e in r.segments:
                yield s
                yield e

    return digest_ints(stream())
