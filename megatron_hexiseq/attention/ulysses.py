"""Plain even Ulysses attention (DeepSpeed-Ulysses): the head-parallel baseline of the benchmark.

Legend: s = my tokens (S / W, contiguous: rank i holds [i*s, (i+1)*s)), S = full sequence,
W = group size, H / G = all query / K/V heads (both divisible by W), D = head dim.

    q [s, B, H, D] -> view [s, B, W, H/W, D] -> permute [W, s, B, H/W, D] -> all_to_all
      -> [W (source rank = sequence chunk), s, B, H/W, D] -> view [S, B, H/W, D]
    causal attention (torch SDPA, is_causal, GQA) on [S, B, H/W, D]
    out [S, B, H/W, D] -> view [W, s, B, H/W, D] -> all_to_all -> [W (head chunk), s, B, H/W, D]
      -> permute [s, B, W, H/W, D] -> [s, B, H * D]

Autograd: the collectives are ``uneven_all_to_all`` (even splits), attention is torch's own op.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup

from megatron_hexiseq.attention.comm import uneven_all_to_all


def _seq_to_heads(x_sBHD: Tensor, group: ProcessGroup, W: int) -> Tensor:
    """[s, B, n, D] -> [S, B, n/W, D]."""
    s, B, n, D = x_sBHD.shape
    x_WsBhD = x_sBHD.view(s, B, W, n // W, D).permute(2, 0, 1, 3, 4).contiguous()
    split = [x_WsBhD.numel() // W] * W
    y = uneven_all_to_all(x_WsBhD.view(-1), group=group, send_splits=split, recv_splits=split)
    return y.view(W * s, B, n // W, D)


def _heads_to_seq(x_SBhD: Tensor, group: ProcessGroup, W: int) -> Tensor:
    """[S, B, h, D] -> [s, B, h*W*D]."""
    S, B, h, D = x_SBhD.shape
    split = [x_SBhD.numel() // W] * W
    y = uneven_all_to_all(x_SBhD.reshape(-1), group=group, send_splits=split, recv_splits=split)
    return y.view(W, S // W, B, h, D).permute(1, 2, 0, 3, 4).reshape(S // W, B, W * h * D)


def ulysses_attn_func(
    q: Tensor, k: Tensor, v: Tensor, *, group: ProcessGroup, softmax_scale: float | None = None
) -> Tensor:
    """Even Ulysses: ``q [s, B, H, D]``, ``k, v [s, B, G, D]`` (contiguous chunk) -> ``[s, B, H * D]``."""
    W = dist.get_world_size(group)
    if q.shape[2] % W or k.shape[2] % W:
        raise ValueError(
            f"Ulysses needs heads divisible by the group size {W}: H={q.shape[2]}, G={k.shape[2]}"
        )
    q_S, k_S, v_S = (_seq_to_heads(x, group, W) for x in (q, k, v))
    out_BhSD = torch.nn.functional.scaled_dot_product_attention(
        q_S.permute(1, 2, 0, 3),
        k_S.permute(1, 2, 0, 3),
        v_S.permute(1, 2, 0, 3),
        is_causal=True,
        scale=softmax_scale,
        enable_gqa=True,
    )
    return _heads_to_seq(out_BhSD.permute(2, 0, 1, 3), group, W)
