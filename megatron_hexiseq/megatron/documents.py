"""Packed documents at the Megatron boundary: the boundaries of the micro-batch being computed.

With ``--reset-attention-mask`` a HexiSeq run attends inside each document only. Megatron's GPT
dataset marks documents with the EOD token (``_get_ltor_masks_and_position_ids``: a document ends
*after* each EOD token, so the boundaries of a sample are ``0``, every ``i + 1`` with
``tokens[i] == eod`` and ``i + 1 < S``, and ``S``). Every CP rank loads the whole micro-batch, so
each derives the same boundaries from its tokens **before** slicing them (``batch.LayoutBatchSlicer``
calls ``MicroBatchDocuments.update_from_tokens``): no collective. The THD path (``cu_seqlens`` from
a packed dataset) records ``cu_seqlens_padded`` (else ``cu_seqlens``) the same way
(``batch.LayoutBatchSlicer.thd``) and runs the SBHD path with these boundaries.

``MicroBatchDocuments`` is the one mutable object of the integration: the slicer writes it, the core
attention (``cu_seqlens``) and the RoPE module (``--reset-position-ids``: angles from each token's
position inside its document) read it during the forward of that micro-batch. The backward reuses
what the forward captured, so pipeline schedules that interleave micro-batches are fine on the
stages that load data. The boundaries are read on the host from the data loader's CPU batch, in
the planning thread of ``batch_ahead`` (no device sync); ``update_from_tokens`` on device tokens
(a direct caller of the slicer) copies the tokens to the host first.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Sequence

import numpy as np
import torch

from megatron_hexiseq.attention.documents import DocumentBounds, parse_cu_seqlens
from megatron_hexiseq.errors import HexiSeqError


def eod_boundaries(tokens_bS: torch.Tensor | np.ndarray, eod_token: int) -> list[list[int]]:
    """Per sample ``[0, i1 + 1, ..., S]``: a document ends after each EOD token (Megatron's rule).
    Read on the host: CPU tokens (the data loader's batch) cost no device sync; device tokens are
    copied to the host first (one sync: the path ``batch_ahead`` avoids)."""
    host = tokens_bS.detach().cpu().numpy() if isinstance(tokens_bS, torch.Tensor) else tokens_bS
    b, S = host.shape
    rows, cols = np.nonzero(host[:, : S - 1] == eod_token)  # row-major: sorted by sample, then i
    cuts = np.split(cols + 1, np.searchsorted(rows, np.arange(1, b)))
    return [[0, *c.tolist(), S] for c in cuts]


class MicroBatchDocuments:
    """Document boundaries of the current micro-batch (set by the batch slicer, read by the core
    attention and by RoPE). ``bounds`` is ``None`` until the first micro-batch."""

    def __init__(
        self,
        *,
        seq_length: int,
        eod_token: int | None,
        reset_position_ids: bool,
        required: bool,
    ) -> None:
        self.seq_length = seq_length
        self.eod_token = eod_token
        self.reset_position_ids = reset_position_ids
        self.required = required  # --reset-attention-mask: attention without boundaries is an error
        self.bounds: DocumentBounds | None = None

    def update_from_tokens(self, tokens_bS: torch.Tensor) -> DocumentBounds:
        """Boundaries from the EOD tokens of the whole (unsliced) micro-batch ``[b, S]``."""
        if self.eod_token is None:
            raise HexiSeqError(
                "--reset-attention-mask needs the tokenizer's EOD token id to find documents; "
                "use a tokenizer that defines one"
            )
        if tokens_bS.dim() != 2 or tokens_bS.shape[1] != self.seq_length:
            raise HexiSeqError(
                f"batch tokens have shape {tuple(tokens_bS.shape)}; expected [b, {self.seq_length}]"
            )
        return self.update(eod_boundaries(tokens_bS, self.eod_token), batch=tokens_bS.shape[0])

    def update(self, cu_seqlens: object, *, batch: int) -> DocumentBounds:
        """Boundaries given directly (one list, or one per sample; tensors read on the host)."""
        self.bounds = parse_cu_seqlens(cu_seqlens, seq_length=self.seq_length, batch=batch)
        return self.bounds

    def current(self) -> DocumentBounds:
        if self.bounds is None:
            raise HexiSeqError(
                "--reset-attention-mask: no document boundaries were recorded for this micro-batch "
                "(the batch did not go through the HexiSeq slicer; with pipeline parallelism only "
                "the first and last stages load data, which this mode does not support yet)"
            )
        return self.bounds


def positions_in_documents(positions: Sequence[int], bounds: tuple[int, ...]) -> list[int]:
    """Each global position minus the start of its document."""
    return [p - bounds[bisect_right(bounds, p) - 1] for p in positions]
