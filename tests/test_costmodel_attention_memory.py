"""Layer (a), no processes: the cost model's attention-backward memory terms against a direct count.

``attention_backward_bytes_per_group_token`` (12Hd + 4H + 16Gd) and
``attention_backward_bytes_per_block_token`` (20Gd, + 4Hd with GQA) itemise tensors of the runtime
and of the kernel. The runtime's part is counted here: ``block_backward`` with PyTorch's flash and
cuDNN ops runs on the ``meta`` device (the sizes the GPU would allocate) under ``LiveBytes``
(bench/_live_bytes.py), and its peak beyond the inputs must equal the formula's items for that call:
the kernel's dq/dk/dv in bf16 and their float32 copies. The items inside the kernel (FlashAttention-2
``mha_bwd``: float32 dq accumulator, softmax_d, dK/dV expanded to H heads with GQA) are invisible
at the dispatcher and are taken from its source; the test pins that the formulas are exactly the
measured items plus those.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

from megatron_hexiseq.attention.kernels import Kernel, block_backward, block_forward, kv_map
from megatron_hexiseq.costmodel import (
    attention_backward_bytes_per_block_token,
    attention_backward_bytes_per_group_token,
)
from megatron_hexiseq.model import ModelSpec

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "bench"))
from _live_bytes import LiveBytes  # noqa: E402

D = 16
MODEL = ModelSpec(
    name="m",
    num_layers=2,
    hidden_size=8 * D,
    num_attention_heads=8,
    num_query_groups=2,
    ffn_hidden_size=256,
    vocab_size=64,
    kv_channels=D,
    swiglu=False,
    seq_length=64,
)


def _measure(kernel: Kernel, H: int, G: int, S: int, T: int, causal: bool) -> int:
    meta = torch.device("meta")
    q = torch.empty(S, 1, H, D, dtype=torch.bfloat16, device=meta)
    k = torch.empty(T, 1, G, D, dtype=torch.bfloat16, device=meta)
    kw = dict(causal=causal, kv_of_head_H=kv_map(tuple(h * G // H for h in range(H)), G), scale=0.1)
    out, lse = block_forward(q, k, k, kernel=kernel, **kw)
    with LiveBytes(exclude=(q, k, out, lse)) as m:
        block_backward(q, q, k, k, out, lse, kernel=kernel, **kw)
    return m.peak


@pytest.mark.parametrize("kernel", [Kernel.FLASH, Kernel.CUDNN])
@pytest.mark.parametrize("H,G", [(8, 2), (8, 8), (8, 1)])
def test_block_backward_allocates_the_counted_items(kernel: Kernel, H: int, G: int) -> None:
    for S, T, causal in ((64, 64, True), (48, 80, False)):
        peak = _measure(kernel, H, G, S, T, causal)
        query_side = S * (2 + 4) * H * D  # the kernel's dq (bf16) and its float32 copy
        key_side = T * (4 + 8) * G * D  # the kernel's dk/dv (bf16) and their float32 copies
        # (the unused philox/RNG tensors of the op are freed before the float32 copies)
        assert peak == query_side + key_side, (S, T, causal)


@pytest.mark.parametrize("H,G", [(8, 2), (8, 8), (32, 8), (6, 1)])
def test_formulas_are_the_items(H: int, G: int) -> None:
    m = ModelSpec(**(MODEL.to_dict() | {"num_attention_heads": H, "num_query_groups": G}))
    d = D
    measured_query = (2 + 4) * H * d  # block_backward's dq in bf16 + float32 (measured above)
    measured_key = (4 + 8) * G * d  # block_backward's dk/dv in bf16 + float32 (measured above)
    fa2_query = 4 * H * d + 4 * H  # mha_bwd: float32 dq_accum, float32 softmax_d
    fa2_expanded = 2 * 2 * H * d if G < H else 0  # mha_bwd with GQA: dk/dv at H heads (bf16)
    dout = 2 * H * d
    subring = 4 * H * d + 2 * 4 * G * d + 2 * 4 * G * d  # dq, dk/dv float32 and their stack
    block_accumulator = 2 * 4 * G * d  # _block_backward's float32 dK/dV of the received block
    # query side: the kernel's dq accumulator is gone when block_backward copies dq to float32
    query_peak = fa2_query - 4 * H * d + measured_query
    assert attention_backward_bytes_per_group_token(m, H, G) == dout + subring + query_peak
    assert attention_backward_bytes_per_block_token(m, H, G) == (
        block_accumulator + measured_key + fa2_expanded
    )
