"""The analytical cost model: per-rank time and memory of a layout on a cluster.

Pure functions over frozen dataclasses. ``formulas`` holds the integer FLOP/byte formulas the
planner linearises, ``comm`` the link model (ragged all-to-all, overlapped rounds), ``exchange``
the cross-group K/V rounds, ``estimate`` the whole iteration, ``documents`` the same for one
micro-batch of packed documents (document-masked pairs, pruned K/V). Derivations and sources:
docs/cost_model.md.
"""

from megatron_hexiseq.costmodel.comm import (
    alltoall_rank_times_s,
    alltoall_time_s,
    pipelined_exposed_s,
    port_times_s,
)
from megatron_hexiseq.costmodel.documents import (
    DocumentEstimate,
    estimate_documents,
)
from megatron_hexiseq.costmodel.estimate import Estimate, RankEstimate, estimate, memory_floor_fits
from megatron_hexiseq.costmodel.exchange import fan_units, kv_exchange_forward
from megatron_hexiseq.costmodel.formulas import (
    a2a_buffer_bytes_per_token,
    activation_bytes_per_token,
    attention_backward_bytes_per_block_token,
    attention_backward_bytes_per_group_token,
    attention_bytes_per_group_token,
    attention_flops_per_pair_head,
    attention_s_per_pair_head,
    causal_pairs,
    kv_block_bytes_per_token,
    layer_activation_bytes_per_token,
    linear_flops_per_token,
    linear_s_per_token,
    output_bytes_per_token,
    static_memory_bytes,
    train_flops,
)
from megatron_hexiseq.costmodel.pieces import (
    check_cu_seqlens,
    document_pairs,
)
from megatron_hexiseq.run_config import (
    TrainOptions,
)  # what estimate() takes; defined with the memory modes

__all__ = [
    "DocumentEstimate",
    "Estimate",
    "RankEstimate",
    "TrainOptions",
    "a2a_buffer_bytes_per_token",
    "activation_bytes_per_token",
    "alltoall_rank_times_s",
    "alltoall_time_s",
    "attention_backward_bytes_per_block_token",
    "attention_backward_bytes_per_group_token",
    "attention_bytes_per_group_token",
    "attention_flops_per_pair_head",
    "attention_s_per_pair_head",
    "causal_pairs",
    "check_cu_seqlens",
    "document_pairs",
    "estimate",
    "estimate_documents",
    "fan_units",
    "kv_block_bytes_per_token",
    "kv_exchange_forward",
    "layer_activation_bytes_per_token",
    "linear_flops_per_token",
    "linear_s_per_token",
    "memory_floor_fits",
    "output_bytes_per_token",
    "pipelined_exposed_s",
    "port_times_s",
    "static_memory_bytes",
    "train_flops",
]
