"""``LocalCausalAttention``: a single-device causal core attention for the CPU oracle; and
``PassThroughAttention``, which fills the same slot with no attention at all.

Megatron's stock ``DotProductAttention`` allocates through the global memory buffer on
``torch.cuda.current_device()``, so it cannot run on a CPU-only torch. This module fills the same
core-attention slot (same constructor/forward protocol) with plain fp32-exact math, independent of
``megatron_hexiseq.attention``: the unsharded reference that ``testbed.train.train_reference`` uses.
With ``documents`` (a ``documents.MicroBatchDocuments`` slot, packed documents) the mask is also
"same document": a dense ``[b, 1, S, S]`` mask from the slot's boundaries, fine for an oracle.
``PassThroughAttention`` returns the query reshaped: a model built with it times everything *but*
attention (the CPU step calibration, ``testbed.calibrate.measure_model_step``).

Shapes: ``query [S, b, H, d]``, ``key/value [S, b, G, d]`` -> ``[S, b, H*d]``.
"""

from __future__ import annotations

import math

import torch
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from torch import Tensor

from megatron_hexiseq.megatron.documents import MicroBatchDocuments


class LocalCausalAttention(MegatronModule):
    """Causal GQA attention over the whole (unsharded) sequence with explicit matmul + softmax."""

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection=None,
        documents: MicroBatchDocuments | None = None,
    ) -> None:
        super().__init__(config=config)
        assert attn_mask_type == AttnMaskType.causal and attention_type == "self"
        self.softmax_scale = softmax_scale or 1.0 / math.sqrt(config.kv_channels)
        self.documents = documents

    def _masked(self, S: int, b: int, device: torch.device) -> Tensor:
        """``[b or 1, 1, S, S]`` True where a query must not see a key (future, other document)."""
        future = torch.ones(S, S, dtype=torch.bool, device=device).triu(1)
        if self.documents is None:
            return future
        bounds = self.documents.current().for_batch(S, b)
        rows = []
        for _, cut in bounds.per_sample():
            doc = torch.zeros(S, dtype=torch.long)
            for x in cut[1:-1]:
                doc[x:] += 1
            doc = doc.to(device)
            rows.append(future | (doc[:, None] != doc[None, :]))
        return torch.stack(rows)[:, None]

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attention_mask: Tensor | None,
        attn_mask_type: AttnMaskType | None = None,
        attention_bias: Tensor | None = None,
        packed_seq_params=None,
    ) -> Tensor:
        S, b, H, d = query.shape
        rep = H // key.size(2)
        q_BHSD = query.permute(1, 2, 0, 3)
        k_BHSD = key.repeat_interleave(rep, dim=2).permute(1, 2, 0, 3)
        v_BHSD = value.repeat_interleave(rep, dim=2).permute(1, 2, 0, 3)
        scores = torch.matmul(q_BHSD, k_BHSD.transpose(-1, -2)) * self.softmax_scale  # [b, H, S, S]
        hidden = self._masked(S, b, query.device)
        probs = torch.softmax(scores.float().masked_fill(hidden, float("-inf")), dim=-1).to(
            query.dtype
        )
        out_BHSD = torch.matmul(probs, v_BHSD)
        return out_BHSD.permute(2, 0, 1, 3).reshape(S, b, H * d)  # [S, b, H*d]


class PassThroughAttention(MegatronModule):
    """Core attention that passes the query through (``[S, b, H, d] -> [S, b, H*d]``), no attention."""

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection=None,
    ) -> None:
        super().__init__(config=config)

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attention_mask: Tensor | None,
        attn_mask_type: AttnMaskType | None = None,
        attention_bias: Tensor | None = None,
        packed_seq_params=None,
    ) -> Tensor:
        S, b, H, d = query.shape
        return query.reshape(S, b, H * d)  # [S, b, H*d]
