"""FLOP and byte formulas: integers, per token or per (query, key) pair, with their sources.

Notation (``ModelSpec`` fields): h hidden_size, a num_attention_heads, g num_query_groups,
d kv_channels, f ffn_hidden_size, V vocab_size, L num_layers, m = 2 with SwiGLU else 1,
b micro_batch_size. BF16 activations: 2 bytes per element. docs/cost_model.md derives each one.
"""

from __future__ import annotations

from collections.abc import Sequence

from megatron_hexiseq.cluster import Device
from megatron_hexiseq.costmodel.rates import attention_rate
from megatron_hexiseq.errors import HexiSeqError
from megatron_hexiseq.model import ModelSpec
from megatron_hexiseq.run_config import TrainOptions

BF16_BYTES = 2
FP32_BYTES = 4

Segment = tuple[int, int]


# ---- FLOPs (Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters
# Using Megatron-LM", Sec. 5.1: 2 FLOPs per multiply-add, backward = 2x forward) ------------------
def causal_pairs(q_segments: Sequence[Segment], k_segments: Sequence[Segment]) -> int:
    """Number of (q, k) position pairs with q in ``q_segments``, k in ``k_segments`` and k <= q.

    Closed form per segment pair: for q in [qs, qe) and k in [ks, ke), a query q sees
    ``clamp(q - ks + 1, 0, ke - ks)`` keys; queries in [ks, ke) form an arithmetic series, those
    at or past ``ke`` see all ``ke - ks`` keys. O(#q_segments * #k_segments). Segments inside each
    list must not overlap (a layout's never do).
    """
    total = 0
    for qs, qe in q_segments:
        for ks, ke in k_segments:
            # queries in [max(qs, ks), min(qe, ke)) see q - ks + 1 keys: series x..y
            a, c = max(qs, ks), min(qe, ke)
            if a < c:
                x, y = a - ks + 1, c - ks
                total += (x + y) * (c - a) // 2
            # queries at or past ke see the whole key segment
            a = max(qs, ke)
            if a < qe:
                total += (qe - a) * (ke - ks)
    return total


def linear_flops_per_token(model: ModelSpec) -> int:
    """Forward + backward FLOPs of all non-attention-score work per token, all layers + logits.

    Per layer forward: ``2 * (h*(a+2g)*d + a*d*h + h*f*m + f*h)`` (QKV, projection, MLP); the output
    layer adds ``2*h*V``. Forward + backward = 3x forward. Norms, biases, activations and RoPE are
    elementwise and left out (as in Narayanan et al.). Full recompute adds a forward: see
    :func:`train_flops`. For GPT (a*d = h, g = a, f = 4h) this is Narayanan's
    ``72*L*h^2*(1 + V/(12*h*L))`` per token without the attention term.
    """
    h, a, g, d, f = (
        model.hidden_size,
        model.num_attention_heads,
        model.num_query_groups,
        model.kv_channels,
        model.ffn_hidden_size,
    )
    m = 2 if model.swiglu else 1
    layer_macs = h * (a + 2 * g) * d + a * d * h + h * f * m + f * h
    forward = 2 * (model.num_layers * layer_macs + h * model.vocab_size)
    return 3 * forward


def attention_flops_per_pair_head(model: ModelSpec) -> int:
    """Forward + backward FLOPs per visible (q, k) pair per query head, summed over all layers.

    Forward: ``Q K^T`` and ``P V`` are 2*d FLOPs each -> 4*d; backward counted as 2x forward (the
    convention of Narayanan et al.; FlashAttention's backward also recomputes ``Q K^T``, 2.5x, which
    the calibrated efficiency absorbs) -> ``12 * d * L``.
    """
    return 12 * model.kv_channels * model.num_layers


def train_flops(flops_fwd_bwd: int, options: TrainOptions) -> int:
    """Forward + backward FLOPs -> FLOPs actually executed: full recompute runs one more forward (x4/3)."""
    assert flops_fwd_bwd % 3 == 0, "fwd+bwd FLOPs are 3x a forward"
    return flops_fwd_bwd * (4 if options.recompute else 3) // 3


# ---- memory -------------------------------------------------------------------------------------
def static_memory_bytes(model: ModelSpec, options: TrainOptions, domain_size: int) -> int:
    """Parameters + gradients + optimizer state per rank, bytes.

    ``distributed_optimizer`` (Megatron's distributed optimizer = ZeRO-1 with fp32 grad buffers):
    bf16 params 2 B + fp32 main grads 4 B replicated, fp32 master params + Adam m + v = 12 B sharded
    over ``domain_size`` (= DP x CP ranks): ``6*P + ceil(12*P / domain)``.
    ``fsdp`` (ZeRO-3): all 18 B/param sharded, ``ceil(18*P / domain)``, plus Megatron-FSDP's
    working buffers (:func:`fsdp_buffer_bytes`). (The modes and their flags: ``run_config``.)
    """
    if domain_size <= 0:
        raise HexiSeqError(f"domain_size must be positive, got {domain_size}")
    p = model.num_parameters
    if options.memory_mode == "fsdp":
        return -(-18 * p // domain_size) + fsdp_buffer_bytes(model)
    return 6 * p + -(-12 * p // domain_size)


def fsdp_buffer_bytes(model: ModelSpec) -> int:
    """Megatron-FSDP's working buffers on top of its shards: two ``TransformerLayer`` units in
    flight (the one computing and the one prefetched or being reduced), each with its gathered bf16
    parameters and unsharded fp32 gradients (6 bytes per parameter), and the embedding or output
    layer, gathered one at a time outside the units (6 bytes per parameter of ``V x h``)."""
    unit = BF16_BYTES + FP32_BYTES
    return 2 * unit * model.layer_parameters + unit * model.vocab_size * model.hidden_size


def layer_activation_bytes_per_token(model: ModelSpec, sequence_parallel: int = 1) -> int:
    """Bytes one layer keeps for backward per token of the rank's own shard (Korthikanti et al. 2022,
    "Reducing Activation Recomputation in Large Transformer Models", Sec. 4.1, with dropout off and the
    attention core moved to :func:`attention_bytes_per_group_token`).

    ``2 * (2h [two norm inputs] + h [QKV input] + a*d [projection input] + h [fc1 input]
    + f*m [fc1 output] + f [fc2 input])``. For GPT this is 26h; adding the attention core's 8h
    (q, k, v and the FlashAttention output) gives Korthikanti's 34h, whose 2h of dropout masks we
    drop (no dropout) and whose softmax-output role the kept FlashAttention output takes.

    With tensor parallelism ``model`` is one TP rank's (``costmodel.tp.rank_model``: a, f already
    divided by t) and ``sequence_parallel = t`` divides the 4h hidden-size terms, which sequence
    parallelism keeps split along the sequence (the QKV and fc1 inputs are saved sharded and
    gathered again in backward): Korthikanti's Sec. 4.2.2, every term divided by t.
    """
    h, a, d, f = (
        model.hidden_size,
        model.num_attention_heads,
        model.kv_channels,
        model.ffn_hidden_size,
    )
    m = 2 if model.swiglu else 1
    return BF16_BYTES * (-(-4 * h // sequence_parallel) + a * d + f * m + f)


def output_bytes_per_token(model: ModelSpec, sequence_parallel: int = 1) -> int:
    """Final norm input + output-layer input (bf16) + logits at the loss: bf16 logits and the fp32
    softmax Megatron's cross entropy keeps (``2h + 2h + 2V + 4V``; with sequence parallelism the
    two hidden-size inputs are split along the sequence, ``4h / t``, and V is one TP rank's)."""
    hidden = -(-2 * model.hidden_size // sequence_parallel)
    return BF16_BYTES * hidden + (BF16_BYTES + FP32_BYTES) * model.vocab_size


def activation_bytes_per_token(model: ModelSpec, options: TrainOptions) -> int:
    """Activation bytes per token of this rank's own shard (one micro-batch sequence), whole model.

    No recompute: ``L * layer + output + layer`` (every layer's saved tensors, the loss, and one
    layer's worth of gradients while its backward runs). Full recompute: ``L * 2h`` (each layer's
    input) ``+ layer`` (the layer being recomputed) ``+ output + layer``.
    The attention core (group tokens x this rank's heads) is in :func:`attention_bytes_per_group_token`.

    With tensor parallelism (``options.tensor_model_parallel_size`` t > 1, ``model`` one TP rank's)
    sequence parallelism divides the hidden-size terms by t (each layer's input with recompute too),
    and the all-gathered input of the linear being computed adds ``2h`` (bf16, one at a time:
    Megatron's global memory buffer).
    """
    t = options.tensor_model_parallel_size
    layer = layer_activation_bytes_per_token(model, t)
    layer_input = BF16_BYTES * -(-model.hidden_size // t)
    stack = model.num_layers * (layer_input if options.recompute else layer)
    recomputed = layer if options.recompute else 0
    gathered = BF16_BYTES * model.hidden_size if t > 1 else 0
    return stack + recomputed + output_bytes_per_token(model, t) + layer + gathered


def attention_bytes_per_group_token(
    model: ModelSpec, options: TrainOptions, heads: int, kv_heads: int
) -> int:
    """Attention-core bytes per token of the rank's A2A group (after the head all-to-all).

    Per layer: q and out (bf16) + LSE (fp32) per query head, k and v per kv head:
    ``heads*(4d + 4) + kv_heads*4d``. Kept for all L layers (one with full recompute), plus the
    transient tensors of one layer's attention backward
    (:func:`attention_backward_bytes_per_group_token`).
    """
    d = model.kv_channels
    per_layer = heads * (2 * BF16_BYTES * d + FP32_BYTES) + kv_heads * 2 * BF16_BYTES * d
    kept = 1 if options.recompute else model.num_layers
    return kept * per_layer + attention_backward_bytes_per_group_token(model, heads, kv_heads)


def attention_backward_bytes_per_group_token(model: ModelSpec, heads: int, kv_heads: int) -> int:
    """Transient bytes per group token while one layer's attention backward runs (H = ``heads``,
    G = ``kv_heads``, every query row of the group in one kernel call at a time):

    - dout (bf16) ``2Hd``;
    - ``subring_backward``'s float32 accumulators: dq ``4Hd``, dK/dV ``8Gd`` and their stacked copy
      ``8Gd``;
    - the query side of a kernel call: FlashAttention-2's ``mha_bwd`` (PyTorch's flash op; counted
      alike for cuDNN) keeps a float32 dq accumulator ``4Hd`` and ``softmax_d`` ``4H`` next to its dq
      (bf16) ``2Hd``, which ``block_backward`` then copies to float32 ``4Hd`` (the accumulator is
      gone by then): ``6Hd + 4H``.

    Total ``12Hd + 4H + 16Gd``, an upper bound over the backward's phases (the local causal block's
    key side, ``12Gd`` and with GQA ``4Hd``, is live before the accumulators are stacked). The
    key side of a received block is :func:`attention_backward_bytes_per_block_token`. The
    forward's transients (float32 out and LSE, a block's out, the merge) are smaller.
    """
    d = model.kv_channels
    dout = BF16_BYTES * heads * d
    accumulators = FP32_BYTES * (heads * d + 4 * kv_heads * d)
    query_side = FP32_BYTES * (heads * d + heads) + BF16_BYTES * heads * d
    return dout + accumulators + query_side


def attention_backward_bytes_per_block_token(model: ModelSpec, heads: int, kv_heads: int) -> int:
    """Transient bytes per token of a received K/V block during its backward (its key side; the
    query rows are the group's tokens above): the block's float32 dK/dV accumulator ``8Gd``, the
    kernel's dk/dv (bf16) ``4Gd`` and their float32 copies ``8Gd``; with GQA (G < H) also dK/dV
    expanded to the H query heads inside FlashAttention-2's backward (bf16, ``4Hd``) — what is left
    of the K/V expansion now that the runtime keeps K/V at G heads. ``20Gd`` (``+ 4Hd`` with GQA).
    (The wire copy of the block's dK/dV is one of the exchange's double buffers.)"""
    d = model.kv_channels
    per = (2 * FP32_BYTES + BF16_BYTES) * 2 * kv_heads * d
    return per + (2 * BF16_BYTES * heads * d if kv_heads < heads else 0)


def a2a_buffer_bytes_per_token(model: ModelSpec) -> int:
    """Head all-to-all send buffer per own token: q, k, v of all heads before the exchange (bf16)."""
    return BF16_BYTES * (model.num_attention_heads + 2 * model.num_query_groups) * model.kv_channels


def kv_block_bytes_per_token(model: ModelSpec) -> int:
    """K and V (bf16) of one kv head per token: ``4d`` bytes (the unit of the cross-group exchange)."""
    return 2 * BF16_BYTES * model.kv_channels


# ---- tensor parallelism (Megatron's sequence parallelism inside a TP bundle) -----------------
# Per layer and forward pass, sequence parallelism runs 4 collectives of a [s_r, b, h] activation over
# the bundle's t GPUs (megatron/core/tensor_parallel/layers.py, core_v0.16.1): all-gather before the
# QKV and fc1 column-parallel linears, reduce-scatter after the projection and fc2 row-parallel ones.
# Backward runs their 4 duals on the critical path (the all-gathers of the saved sharded inputs for
# the weight gradients are posted asynchronously before the input-gradient GEMM and hidden behind
# it); full recompute repeats the forward's 4. Once per iteration: the embedding's reduce-scatter and
# the output layer's all-gather, and their duals (4).
TP_COLLECTIVES_PER_LAYER_PASS = 4
TP_COLLECTIVES_OUTSIDE_LAYERS = 4


def tp_collective_bytes_per_token(model: ModelSpec, tp: int) -> float:
    """Bytes each GPU of a bundle sends per bundle token in one sequence-parallel all-gather or
    reduce-scatter of a bf16 hidden-size activation: its share ``2h / t`` to each of the other
    ``t - 1`` GPUs (``2h (t - 1) / t``; the ring algorithm sends the same)."""
    return BF16_BYTES * model.hidden_size * (tp - 1) / tp


def tp_collective_s_per_token(model: ModelSpec, device: Device, options: TrainOptions) -> float:
    """Seconds of sequence-parallel collectives per bundle token per iteration on one GPU of the
    bundle (0 without TP): ``(4 (forward passes + 1) L + 4)`` collectives of
    :func:`tp_collective_bytes_per_token` each, serialised on the GPU's NVLink port (the link model
    of ``costmodel/comm.py``: inside a node every message runs at the NVLink bandwidth, a port's
    messages one after another), not overlapped with compute (Megatron overlaps them only with
    ``--tp-comm-overlap``, Transformer Engine's userbuffers). The vocabulary-parallel cross entropy's
    all-reduces (3 floats per token) are left out."""
    tp = options.tensor_model_parallel_size
    if tp == 1:
        return 0.0
    passes = (2 if options.recompute else 1) + 1
    count = (
        TP_COLLECTIVES_PER_LAYER_PASS * passes * model.num_layers + TP_COLLECTIVES_OUTSIDE_LAYERS
    )
    return (
        options.micro_batch_size
        * count
        * tp_collective_bytes_per_token(model, tp)
        / (device.nvlink_GBps * 1e9)
    )


# ---- per-device coefficients (what the planner linearises) -----------------------------------
def linear_s_per_token(model: ModelSpec, device: Device, options: TrainOptions) -> float:
    """Seconds of linear-layer work per own token per iteration on ``device`` (x micro-batch); with
    tensor parallelism one TP rank's FLOPs (``model`` is the rank's) plus the sequence-parallel
    collectives (:func:`tp_collective_s_per_token`), which sit between the linears."""
    flops_s = (
        options.micro_batch_size
        * train_flops(linear_flops_per_token(model), options)
        / device.flops_per_s
    )
    if options.tensor_model_parallel_size == 1:
        return flops_s
    return flops_s + tp_collective_s_per_token(model, device, options)


def attention_s_per_pair_head(
    model: ModelSpec, device: Device, options: TrainOptions, packed: bool = False
) -> float:
    """Seconds of attention per visible (q, k) pair per query head per iteration on ``device``, at
    the long-block rate of the kernel the options choose (``rates.attention_rate``; ``packed``: the
    kernel a packed-document block runs); ``estimate`` scales it by the achieved fraction of the
    rank's actual calls."""
    rate = attention_rate(device.gpu, model.kv_channels, options.attention_kernel, packed)
    return (
        options.micro_batch_size
        * train_flops(attention_flops_per_pair_head(model), options)
        / rate.flops_per_s
    )
