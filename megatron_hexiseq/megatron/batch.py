"""Batch slicing by layout: the replacement for Megatron's ``get_batch_on_this_cp_rank``.

Megatron views the sequence as 2 x CP equal chunks and keeps chunks ``cp_rank`` and
``2*cp - cp_rank - 1``. Under a HexiSeq layout a rank keeps its own segments instead (uneven,
possibly non-contiguous), concatenated in segment order, which is the token order the attention
and RoPE expect.

Shapes: ``tokens/labels/loss_mask/position_ids [b, S] -> [b, s_r]``;
``attention_mask [b, 1, S, S] -> [b, 1, s_r, S]`` (query rows only, as Megatron does).

With per-micro-batch layouts (``batch_layout.MicroBatchLayout``) the segments change every
micro-batch: the slicer records the boundaries, asks the slot for the micro-batch's plan and
gathers this rank's positions with one ``index_select`` per tensor, from the plan's device index
(one host-to-device copy per micro-batch, shared with RoPE; no host sync).

In a Megatron run the plugin prepares every micro-batch ahead instead (``batch_ahead``: boundaries
from the CPU batch, the plan and this rank's slices built in a planning thread, copied without
blocking by the replaced ``get_batch_on_this_tp_rank``): the slicer is then built with
``prepared=True`` and passes the sliced batch through (its ``thd`` is not reached: the prepared
batch carries no ``cu_seqlens``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TypeVar, cast

import torch
import torch.distributed as dist

from megatron_hexiseq.errors import HexiSeqError
from megatron_hexiseq.megatron.batch_layout import BatchPlan, MicroBatchLayout
from megatron_hexiseq.megatron.documents import MicroBatchDocuments

Segment = tuple[int, int]
BatchValue = TypeVar("BatchValue", bound=torch.Tensor | None)  # a batch's values keep their type


def slice_sequence(x: torch.Tensor, segments: Sequence[Segment], *, dim: int = 1) -> torch.Tensor:
    """Keep ``segments`` of dimension ``dim`` of ``x``, concatenated in order."""
    parts = [x.narrow(dim, s, e - s) for s, e in segments]
    if len(parts) == 1:
        return parts[0].contiguous()
    if not parts:
        return x.narrow(dim, 0, 0).contiguous()
    return torch.cat(parts, dim=dim)


def slice_batch(
    batch: Mapping[str, BatchValue],
    *,
    segments: Sequence[Segment],
    seq_length: int,
    plan: BatchPlan | None = None,
) -> dict[str, BatchValue]:
    """Slice every tensor of a Megatron batch dict to this rank's segments (None entries kept);
    with ``plan`` (a per-micro-batch layout) gather the plan's positions instead.

    Sequence dimension: 2 for ``attention_mask``, 1 for everything else (Megatron's convention).
    """
    out: dict[str, BatchValue] = {}
    for key, val in batch.items():
        if val is None or not isinstance(val, torch.Tensor):
            out[key] = val
            continue
        dim = 2 if key == "attention_mask" else 1
        if val.dim() <= dim or val.size(dim) != seq_length:
            raise HexiSeqError(
                f"batch '{key}' has shape {tuple(val.shape)}; expected the full sequence "
                f"of {seq_length} tokens in dimension {dim} (is --seq-length the layout's?)"
            )
        if plan is None:
            out[key] = cast(BatchValue, slice_sequence(val, segments, dim=dim))
        else:
            out[key] = cast(BatchValue, val.index_select(dim, plan.indices(val.device)[0]))
    return out


class LayoutBatchSlicer:
    """Callable with ``get_batch_on_this_cp_rank``'s signature, bound to one rank's segments.

    ``pretrain_gpt.get_batch_on_this_cp_rank = LayoutBatchSlicer(segments, seq_length)``. With
    ``documents`` (``--reset-attention-mask``) it first records the micro-batch's document
    boundaries from the EOD tokens of the whole batch (the same on every CP rank). ``thd`` replaces
    ``pretrain_gpt.get_thd_batch_on_this_cp_rank``: it records ``cu_seqlens_padded`` (else
    ``cu_seqlens``) as the boundaries and slices like the SBHD path (no ``PackedSeqParams``).
    With ``batch_layout`` (per-micro-batch layouts) it then sets the micro-batch's plan from those
    boundaries and gathers the plan's positions instead of ``segments``.
    """

    def __init__(
        self,
        segments: Sequence[Segment],
        seq_length: int,
        documents: MicroBatchDocuments | None = None,
        *,
        reset_attention_mask: bool = False,
        batch_layout: MicroBatchLayout | None = None,
        prepared: bool = False,
    ) -> None:
        self.segments = tuple((int(s), int(e)) for s, e in segments)
        self.seq_length = seq_length
        self.documents = documents
        self.reset_attention_mask = reset_attention_mask
        self.batch_layout = batch_layout
        self.prepared = prepared  # batches arrive sliced (batch_ahead.AheadBatches): pass through

    def _slice(self, batch: Mapping[str, BatchValue]) -> dict[str, BatchValue]:
        plan = None
        if self.batch_layout is not None:
            bounds = self.documents.bounds if self.documents is not None else None
            plan = self.batch_layout.update(bounds)
        return slice_batch(batch, segments=self.segments, seq_length=self.seq_length, plan=plan)

    def __call__(
        self, batch: Mapping[str, BatchValue], cp_group: dist.ProcessGroup | None = None
    ) -> dict[str, BatchValue]:
        if self.prepared:
            return self._passed(batch)
        if self.documents is not None:
            if self.reset_attention_mask:
                tokens = batch.get("tokens")
                if tokens is None:
                    raise HexiSeqError(
                        "--reset-attention-mask with HexiSeq needs the batch's tokens on every "
                        "rank that computes attention (pipeline parallelism is not supported)"
                    )
                self.documents.update_from_tokens(tokens)
            else:
                self.documents.bounds = None
        return self._slice(batch)

    def _passed(self, batch: Mapping[str, BatchValue]) -> dict[str, BatchValue]:
        """A batch ``AheadBatches`` already sliced to this rank's plan: checked, returned."""
        assert self.batch_layout is not None
        n = self.batch_layout.current().num_tokens
        for key, val in batch.items():
            if isinstance(val, torch.Tensor) and (val.dim() < 2 or val.size(1) != n):
                raise HexiSeqError(
                    f"batch '{key}' has shape {tuple(val.shape)}; expected this rank's {n} tokens "
                    "in dimension 1 (the batch did not come from HexiSeq's prepared batches)"
                )
        return dict(batch)

    def thd(
        self,
        batch: Mapping[str, BatchValue],
        cu_seqlens: torch.Tensor,
        cu_seqlens_padded: torch.Tensor | None,
        max_seqlen: torch.Tensor | None = None,
        cp_size: int | None = None,
        cp_rank: int | None = None,
    ) -> tuple[dict[str, BatchValue], None]:
        """``get_thd_batch_on_this_cp_rank``'s signature: my slice and no ``PackedSeqParams``."""
        if self.documents is None:
            raise HexiSeqError("packed (THD) batches need the HexiSeq document runtime")
        bounds = cu_seqlens_padded if cu_seqlens_padded is not None else cu_seqlens
        values = [int(x) for x in bounds.reshape(-1).tolist() if int(x) >= 0]
        while len(values) > 1 and values[-1] == values[-2]:
            values.pop()  # trailing repeats pad a fixed-size cu_seqlens
        self.documents.update(values, batch=1)
        return self._slice(batch), None

    def __repr__(self) -> str:
        return f"LayoutBatchSlicer(segments={list(self.segments)}, seq_length={self.seq_length})"
