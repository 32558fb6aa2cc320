"""Micro-batches packed from a list of document lengths, and generated heavy-tailed distributions.

Packing rule (the benches' and ``varlen``'s): documents are drawn from the list in an order shuffled
with the seed, appended to the micro-batch until it holds ``tokens_per_batch`` tokens; the last
document is cut to fit and its rest starts the next micro-batch (so no token is dropped and every
micro-batch is exactly full). The list is reused (reshuffled) when it runs out.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import numpy as np

from megatron_hexiseq.errors import HexiSeqError, is_positive_int, short, short_text
from megatron_hexiseq.io import read_json

MAX_DOC_LENGTH = 2**63 - 1  # the packing holds lengths in int64 (a longer document is cut anyway)


def load_doc_lengths(path: str | os.PathLike) -> list[int]:
    """A JSON list of positive integer document lengths of at most ``MAX_DOC_LENGTH``, else one
    HexiSeqError naming the file and the first bad entry."""
    data = read_json(path, "document lengths")
    what = f"document lengths {short_text(str(path))}"
    if not isinstance(data, list) or not data:
        raise HexiSeqError(
            f"{what} must be a non-empty JSON list of positive integers (tokens per document)"
        )
    for i, x in enumerate(data):
        if not is_positive_int(x, MAX_DOC_LENGTH):
            big = " (at most 2^63 - 1)" if is_positive_int(x) else ""
            raise HexiSeqError(
                f"{what} must be a non-empty JSON list of positive integers (tokens per "
                f"document): entry {i} is {short(x)}{big}"
            )
    return data


def pack_batches(
    doc_lengths: Sequence[int], tokens_per_batch: int, batches: int, seed: int
) -> list[list[int]]:
    """``batches`` micro-batches of exactly ``tokens_per_batch`` tokens (module docstring)."""
    if tokens_per_batch <= 0 or batches <= 0:
        raise HexiSeqError("tokens per batch and batches must be positive")
    rng = np.random.default_rng(seed)
    pool = np.asarray(doc_lengths, dtype=np.int64)
    queue: list[int] = []
    out: list[list[int]] = []
    carry = 0
    for _ in range(batches):
        batch, left = [], tokens_per_batch
        if carry:
            take = min(carry, left)
            batch.append(take)
            left -= take
            carry -= take
        while left:
            if not queue:
                queue = pool[rng.permutation(pool.size)].tolist()[::-1]
            length = queue.pop()
            take = min(length, left)
            batch.append(take)
            left -= take
            carry = length - take
        out.append(batch)
    return out


def heavy_tailed_lengths(
    count: int,
    seed: int,
    *,
    median: int = 2048,
    sigma: float = 1.0,
    alpha: float = 1.1,
    tail_from: int = 16384,
    max_length: int = 1 << 20,
) -> list[int]:
    """``count`` document lengths: log-normal (``median``, ``sigma``) with a Pareto tail of index
    ``alpha`` above ``tail_from`` (a share of the log-normal draws above it is redrawn from the
    tail), clipped to ``[64, max_length]``."""
    rng = np.random.default_rng(seed)
    x = np.exp(rng.normal(np.log(median), sigma, count))
    tail = x > tail_from
    x[tail] = tail_from * (1 + rng.pareto(alpha, int(tail.sum())))
    return np.clip(np.rint(x), 64, max_length).astype(np.int64).tolist()
