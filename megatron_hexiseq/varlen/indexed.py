"""Document lengths of a Megatron indexed dataset (``PREFIX.bin`` / ``PREFIX.idx``), read with
Megatron's own reader (``megatron.core.datasets.indexed_dataset.IndexedDataset``, index only: no
token is read).

A document is what Megatron's preprocessing wrote as one (``document_indices``: a run of sequences,
one per document unless sentences were split); its length is the sum of its sequences' lengths,
its EOD token included when the data was preprocessed with ``--append-eod`` (the token after which
``--reset-attention-mask`` starts the next document). Empty documents are left out. The list is
what ``plan --doc-lengths`` and ``varlen --doc-lengths`` read.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

import numpy as np

from megatron_hexiseq.errors import HexiSeqError


def indexed_doc_lengths(prefix: str | os.PathLike) -> list[int]:
    """The document lengths of the indexed dataset ``prefix`` (module docstring)."""
    prefix = os.fspath(prefix)
    for ext in (".idx", ".bin"):
        if not os.path.isfile(prefix + ext):
            raise HexiSeqError(
                f"--data-path {prefix}: {prefix + ext} does not exist; give the prefix Megatron's "
                "--data-path takes (PREFIX.bin and PREFIX.idx from tools/preprocess_data.py)"
            )
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    try:
        ds = IndexedDataset(prefix, multimodal=False, mmap=True)
        seq = np.asarray(ds.sequence_lengths, dtype=np.int64)
        docs = np.asarray(ds.document_indices, dtype=np.int64)
    except (AssertionError, ValueError, OSError, IndexError) as e:
        raise HexiSeqError(
            f"--data-path {prefix}: not a Megatron indexed dataset Megatron's reader accepts ({e})"
        ) from None
    if seq.size == 0:
        return []
    starts = docs[:-1][docs[:-1] < seq.size]
    lengths = np.add.reduceat(seq, starts) if starts.size else seq
    return [int(x) for x in lengths if x > 0]


def doc_lengths_of(prefixes: Sequence[str]) -> list[int]:
    """Every prefix's document lengths, in the order given; one line for a blend's weights."""
    out: list[int] = []
    for p in prefixes:
        try:
            float(p)
        except ValueError:
            out.extend(indexed_doc_lengths(p))
            continue
        raise HexiSeqError(
            f"--data-path: {p} looks like a blend weight; give the dataset prefixes only (every "
            "prefix's documents are written together)"
        )
    if not out:
        raise HexiSeqError("--data-path: the datasets have no non-empty document")
    return out
