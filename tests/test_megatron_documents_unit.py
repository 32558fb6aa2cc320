"""Layer (a): the Megatron side of packed documents, no processes (megatron-core wheel only).

- ``eod_boundaries`` follows Megatron's own rule: the per-document positions it implies equal the
  ``position_ids`` that megatron-core's ``_get_ltor_masks_and_position_ids`` resets, and the dense
  mask it builds is exactly "same document and causal" for these boundaries;
- ``LayoutRotaryEmbedding`` with ``--reset-position-ids`` returns, for every rank of an uneven
  layout, stock RoPE's float32 angles at each token's position inside its document (and global
  positions without the flag, or with per-sample boundaries);
- the slicer records the boundaries of the whole batch before slicing, and its THD seam records
  ``cu_seqlens_padded`` (trailing padding dropped) and returns no ``PackedSeqParams``;
- ``--reset-attention-mask`` with pipeline parallelism is one clear error; a required but missing
  boundary list is one clear error.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from megatron_hexiseq.errors import HexiSeqError
from megatron_hexiseq.layout import make_layout
from megatron_hexiseq.megatron.batch import LayoutBatchSlicer
from megatron_hexiseq.megatron.documents import (
    MicroBatchDocuments,
    eod_boundaries,
    positions_in_documents,
)

S, EOD = 48, 99
LAYOUT = make_layout(
    seq_length=S,
    num_attention_heads=4,
    num_query_groups=2,
    group_sizes=[2, 1],
    segments=[[(0, 6), (30, 40)], [(6, 18)], [(18, 30), (40, 48)]],
    heads=[[0, 1], [2, 3], [0, 1, 2, 3]],
)


def _tokens() -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 90, (3, S), generator=g)
    for b, where in enumerate(([5, 6, 17, 47], [0, 29, 30, 31], [])):
        tokens[b, where] = EOD
    return tokens


def test_eod_boundaries_follow_megatrons_rule() -> None:
    from megatron.core.datasets.gpt_dataset import _get_ltor_masks_and_position_ids

    tokens = _tokens()
    bounds = eod_boundaries(tokens, EOD)
    assert bounds == [[0, 6, 7, 18, S], [0, 1, 30, 31, 32, S], [0, S]]
    for b in range(3):
        mask, _, position_ids = _get_ltor_masks_and_position_ids(
            tokens[b], EOD, True, True, True, True
        )
        assert position_ids.tolist() == positions_in_documents(range(S), tuple(bounds[b]))
        doc = torch.tensor([sum(p >= x for x in bounds[b][1:-1]) for p in range(S)])
        visible = (doc[:, None] == doc[None, :]) & torch.ones(S, S, dtype=torch.bool).tril()
        assert torch.equal(~mask[0], visible)  # Megatron's mask: True = masked out


def _rope(documents: MicroBatchDocuments | None, positions: list[int]):
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    from megatron_hexiseq.megatron.config import cpu_device_shim
    from megatron_hexiseq.megatron.rope import install_rope

    stock = RotaryEmbedding(
        kv_channels=16,
        rotary_percent=1.0,
        use_cpu_initialization=True,
        cp_group=SimpleNamespace(size=lambda: 1),
    )
    with cpu_device_shim():
        full = stock.get_emb(S)  # [S, 1, 1, 16] at positions 0..S-1
    holder = torch.nn.Module()
    holder.rotary_pos_emb = stock
    install_rope(holder, positions, documents)
    return holder.rotary_pos_emb, full


@pytest.mark.parametrize("reset_position_ids", [True, False])
def test_rope_restarts_in_each_document(reset_position_ids: bool) -> None:
    bounds = [0, 6, 7, 18, 33, S]
    for r in LAYOUT.ranks:
        docs = MicroBatchDocuments(
            seq_length=S, eod_token=EOD, reset_position_ids=reset_position_ids, required=True
        )
        rope, full = _rope(docs, r.positions())
        docs.update(bounds, batch=1)
        got = rope(rope.get_rotary_seq_len())
        want_pos = (
            positions_in_documents(r.positions(), tuple(bounds))
            if reset_position_ids
            else r.positions()
        )
        assert got.dtype == torch.float32
        torch.testing.assert_close(got, full[want_pos], rtol=0, atol=0)
        docs.update([[0, 6, S], [0, 9, S]], batch=2)  # per-sample boundaries: global positions
        torch.testing.assert_close(rope(0), full[r.positions()], rtol=0, atol=0)


def test_slicer_records_documents_then_slices() -> None:
    docs = MicroBatchDocuments(seq_length=S, eod_token=EOD, reset_position_ids=True, required=True)
    seg = LAYOUT.ranks[0].segments
    slicer = LayoutBatchSlicer(seg, S, docs, reset_attention_mask=True)
    tokens = _tokens()
    out = slicer({"tokens": tokens, "labels": tokens, "attention_mask": None})
    assert out["tokens"].shape == (3, LAYOUT.ranks[0].num_tokens)
    assert docs.current().samples == tuple(tuple(b) for b in eod_boundaries(tokens, EOD))
    with pytest.raises(HexiSeqError, match="needs the batch's tokens"):
        slicer({"labels": tokens})
    # THD: cu_seqlens_padded wins, trailing repeats of a fixed-size tensor are dropped
    thd, params = slicer.thd(
        {"tokens": tokens[:1]},
        torch.tensor([0, 10, 40, S]),
        torch.tensor([0, 12, 40, S, S, S], dtype=torch.int32),
        torch.tensor([30]),
    )
    assert params is None and thd["tokens"].shape == (1, LAYOUT.ranks[0].num_tokens)
    assert docs.current().samples == ((0, 12, 40, S),)
    with pytest.raises(HexiSeqError, match="not strictly increasing"):
        slicer.thd({"tokens": tokens[:1]}, torch.tensor([0, 20, 10, S]), None)


def test_documents_errors() -> None:
    from megatron_hexiseq.megatron.plugin import micro_batch_documents

    args = SimpleNamespace(reset_attention_mask=True, pipeline_model_parallel_size=2)
    with pytest.raises(HexiSeqError, match="does not support pipeline parallelism"):
        micro_batch_documents(args, S)
    docs = MicroBatchDocuments(
        seq_length=S, eod_token=None, reset_position_ids=False, required=True
    )
    with pytest.raises(HexiSeqError, match="no document boundaries were recorded"):
        docs.current()
    with pytest.raises(HexiSeqError, match="needs the tokenizer's EOD token id"):
        docs.update_from_tokens(_tokens())
