"""``HexiSeqCoreAttention``: Megatron's core-attention slot filled with HexiSeq attention.

Constructor and ``forward`` match megatron-core 0.16.1's builder/forward protocol
(``megatron/core/transformer/attention.py``: ``CoreAttentionBuilder`` / ``CoreAttention``; the
local ``DotProductAttention`` adds ``attention_dropout``). The ``HexiSeqRuntime`` (layout + groups
+ kernel) arrives as a keyword through the layer spec's ``params`` (see ``spec.py``); nothing is
read from a global.

Shapes: ``query [s_r, b, H, d]``, ``key/value [s_r, b, G, d]`` for this rank's tokens in
segment order with RoPE applied -> ``[s_r, b, H*d]``: exact causal attention of the full sequence
restricted to this rank's tokens. With tensor parallelism (t > 1) these are TP rank i's heads,
``H = H_model / t`` and ``G = G_model / t`` (1 with K/V replication), the bundle's ``s_r`` tokens
(sequence parallelism gathers them before the QKV linear), and the layout's head h is the model's
head ``i * H + h`` (``megatron_hexiseq.tensor_parallel``).
"""

from __future__ import annotations

import math
import warnings

from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.transformer_config import TransformerConfig
from torch import Tensor

from megatron_hexiseq.attention.hexiseq import hexiseq_attn_func
from megatron_hexiseq.errors import HexiSeqError
from megatron_hexiseq.megatron.args import CP_COMM_TYPE
from megatron_hexiseq.megatron.runtime import HexiSeqRuntime
from megatron_hexiseq.tensor_parallel import tp_heads


class HexiSeqCoreAttention(MegatronModule):
    """Exact causal self-attention over a HexiSeq layout (uneven tokens and heads per rank)."""

    def __init__(
        self,
        config: TransformerConfig,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection: ProcessGroupCollection | None = None,
        *,
        runtime: HexiSeqRuntime,
    ) -> None:
        super().__init__(config=config)
        layout = runtime.layout
        if attention_type != "self":
            raise HexiSeqError(
                f"HexiSeq attention supports self-attention only, got '{attention_type}'"
            )
        if attn_mask_type != AttnMaskType.causal:
            raise HexiSeqError(
                f"HexiSeq attention is causal; layer {layer_number} asks for {attn_mask_type.name}"
            )
        if cp_comm_type not in (None, CP_COMM_TYPE):
            raise HexiSeqError(
                f"layer {layer_number}: cp_comm_type is '{cp_comm_type}' but the HexiSeq "
                f"spec is in use; pass --cp-comm-type {CP_COMM_TYPE}"
            )
        tp = config.tensor_model_parallel_size
        if tp != layout.tensor_model_parallel_size:
            raise HexiSeqError(
                f"layer {layer_number}: --tensor-model-parallel-size is {tp} but the layout is "
                f"planned for TP bundles of {layout.tensor_model_parallel_size}"
            )
        # per TP rank (Megatron passes num_query_groups = t when it replicates K/V heads)
        heads = tp_heads(
            config.num_attention_heads, config.num_query_groups or config.num_attention_heads, tp
        )
        if heads != (layout.num_attention_heads, layout.num_query_groups):
            raise HexiSeqError(
                f"model has {config.num_attention_heads} heads / {config.num_query_groups} "
                f"query groups ({heads[0]} / {heads[1]} per TP rank of {tp}), layout "
                f"{layout.num_attention_heads} / {layout.num_query_groups}"
            )
        if config.window_size is not None or config.softmax_type != "vanilla":
            raise HexiSeqError(
                "HexiSeq attention supports neither sliding windows nor non-vanilla softmax"
            )
        dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        if dropout and layer_number <= 1:
            warnings.warn(
                f"hexiseq: attention dropout {dropout} has no effect (exact attention without "
                "dropout); set --attention-dropout 0 to silence this",
                stacklevel=2,
            )
        self.layer_number = max(1, layer_number)
        self.runtime = runtime
        # the overlap tuner's chunking knob; may change between iterations (plugin.set_comm_chunks)
        self.comm_chunks = runtime.comm_chunks
        head_dim = config.kv_channels
        self.softmax_scale = (
            softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(head_dim)
        )

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attention_mask: Tensor | None,
        attn_mask_type: AttnMaskType | None = None,
        attention_bias: Tensor | None = None,
        packed_seq_params: PackedSeqParams | None = None,
    ) -> Tensor:
        """``query [s_r, b, H, d]``, ``key/value [s_r, b, G, d]`` -> ``[s_r, b, H*d]``.

        ``attention_mask`` is ignored: the mask is causal over global positions by construction,
        inside each document when the runtime carries the micro-batch's document boundaries
        (``--reset-attention-mask``, THD batches: ``megatron/documents.py``). With per-micro-batch
        layouts the attention runs the micro-batch's layout on the job's groups
        (``megatron/batch_layout.py``).
        """
        if packed_seq_params is not None or attention_bias is not None:
            raise HexiSeqError(
                "HexiSeq attention supports neither packed sequences nor attention bias"
            )
        if attn_mask_type not in (None, AttnMaskType.causal):
            raise HexiSeqError(
                f"HexiSeq attention is causal, got attn_mask_type {attn_mask_type.name}"
            )
        groups = self.runtime.micro_batch_groups()
        expect = groups.layout.ranks[groups.rank].num_tokens
        assert query.size(0) == expect, (query.shape, expect)
        docs = self.runtime.documents
        cu_seqlens = None
        if docs is not None:
            cu_seqlens = docs.current() if docs.required else docs.bounds
        return hexiseq_attn_func(
            query,
            key,
            value,
            groups=groups,
            softmax_scale=self.softmax_scale,
            kernel=self.runtime.kernel,
            comm_chunks=self.comm_chunks,
            fp32_grad_wire=self.runtime.fp32_grad_wire,
            cu_seqlens=cu_seqlens,
        )
