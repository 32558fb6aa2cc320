"""Plain even zig-zag ring attention (Megatron CP / ring-flash-attention's zigzag): a baseline.

Legend: c = chunk length (S / 2W), rank i holds chunks i and 2W-1-i (``[2c, B, ., D]``), H / G =
query / K/V heads, D = head dim; ``kv2`` stacks K and V (one message).

Forward: step 0 is the local causal block; at step t rank i holds the K/V of rank j = (i - t) mod W
(passed along the ring, next step posted before the current block is computed). If j < i all my
queries see j's first chunk (full block); if j > i my second chunk sees all of j's K/V (full block).
Backward: the K/V go round again, and a dK/dV accumulator travels with them (each rank adds its
contribution for the K/V it holds); after W hops it is back at its owner.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup

from megatron_hexiseq.attention.comm import post_p2p, wait_all
from megatron_hexiseq.attention.kernels import (
    Kernel,
    KVMap,
    acc_dtype,
    block_backward,
    block_forward,
    kv_map,
    merge_into,
    resolve_kernel,
)


def _ring_peers(group: ProcessGroup) -> tuple[int, int, int, int]:
    W, i = dist.get_world_size(group), dist.get_rank(group)
    nxt = dist.get_global_rank(group, (i + 1) % W)
    prv = dist.get_global_rank(group, (i - 1) % W)
    return W, i, nxt, prv


def _blocks(i: int, j: int, c: int) -> tuple[slice, slice]:
    """(query rows, key rows) of the full block rank i computes with rank j's K/V."""
    return (slice(None), slice(0, c)) if j < i else (slice(c, 2 * c), slice(None))


def ring_forward(
    q: Tensor, k: Tensor, v: Tensor, group: ProcessGroup, scale: float, kernel: Kernel
) -> tuple[Tensor, Tensor]:
    """Forward of this rank's two chunks: ``out [2c, B, H, D]``, ``lse [2c, B, H]`` (accumulation dtype)."""
    W, i, nxt, prv = _ring_peers(group)
    c = q.shape[0] // 2
    gqa_H = _gqa_index(q, k)
    kv2_cur = torch.stack([k, v])
    kv2_next = torch.empty_like(kv2_cur)
    works = post_p2p([(nxt, kv2_cur)], [(prv, kv2_next)], group=group, tag=1) if W > 1 else []
    out, lse = block_forward(q, k, v, causal=True, kv_of_head_H=gqa_H, scale=scale, kernel=kernel)
    out, lse = out.to(acc_dtype(q.dtype)), lse.to(acc_dtype(q.dtype))
    for t in range(1, W):
        wait_all(works)
        kv2_cur, kv2_next = kv2_next, torch.empty_like(kv2_next)
        works = (
            post_p2p([(nxt, kv2_cur)], [(prv, kv2_next)], group=group, tag=t + 1)
            if t + 1 < W
            else []
        )
        rows, cols = _blocks(i, (i - t) % W, c)
        blk_out, blk_lse = block_forward(
            q[rows],
            kv2_cur[0][cols],
            kv2_cur[1][cols],
            causal=False,
            kv_of_head_H=gqa_H,
            scale=scale,
            kernel=kernel,
        )
        out[rows], lse[rows] = merge_into(out[rows], lse[rows], blk_out, blk_lse)
    return out, lse


def ring_backward(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    group: ProcessGroup,
    scale: float,
    kernel: Kernel,
) -> tuple[Tensor, Tensor, Tensor]:
    """Backward of this rank's two chunks: ``dq [2c, B, H, D]``, ``dk, dv [2c, B, G, D]``."""
    W, i, nxt, prv = _ring_peers(group)
    c = q.shape[0] // 2
    gqa_H = _gqa_index(q, k)
    kv2_cur = torch.stack([k, v])
    kv2_next = torch.empty_like(kv2_cur)
    kv_works = post_p2p([(nxt, kv2_cur)], [(prv, kv2_next)], group=group, tag=1) if W > 1 else []
    dq, dk, dv = block_backward(
        dout, q, k, v, out, lse, causal=True, kv_of_head_H=gqa_H, scale=scale, kernel=kernel
    )
    dkv2 = torch.stack([dk, dv])  # the accumulator for the K/V I hold now (my own)
    dkv2_next = torch.empty_like(dkv2)
    for t in range(1, W):
        d_works = post_p2p([(nxt, dkv2)], [(prv, dkv2_next)], group=group, tag=W + t)
        wait_all(kv_works)
        kv2_cur, kv2_next = kv2_next, torch.empty_like(kv2_next)
        kv_works = (
            post_p2p([(nxt, kv2_cur)], [(prv, kv2_next)], group=group, tag=t + 1)
            if t + 1 < W
            else []
        )
        rows, cols = _blocks(i, (i - t) % W, c)
        gq, gk, gv = block_backward(
            dout[rows],
            q[rows],
            kv2_cur[0][cols],
            kv2_cur[1][cols],
            out[rows],
            lse[rows],
            causal=False,
            kv_of_head_H=gqa_H,
            scale=scale,
            kernel=kernel,
        )
        dq[rows] += gq
        wait_all(d_works)
        dkv2, dkv2_next = dkv2_next, torch.empty_like(dkv2_next)
        dkv2[0][cols] += gk
        dkv2[1][cols] += gv
    if W > 1:  # the accumulator of my own K/V is one hop away
        wait_all(post_p2p([(nxt, dkv2)], [(prv, dkv2_next)], group=group, tag=2 * W))
        dkv2 = dkv2_next
    return dq, dkv2[0], dkv2[1]


def _gqa_index(q: Tensor, k: Tensor) -> KVMap:
    """Query head h reads K/V head h // (H / G) (a host-side map: no index tensor, no copy)."""
    H, G = q.shape[2], k.shape[2]
    return kv_map(tuple(h // (H // G) for h in range(H)), G)


class _RingAttention(torch.autograd.Function):
    """forward q [2c,B,H,D], k/v [2c,B,G,D] -> [2c,B,H,D]; backward the same shapes."""

    @staticmethod
    def forward(ctx, q, k, v, group, scale, kernel):
        out, lse = ring_forward(q, k, v, group, scale, kernel)
        final = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out if kernel is Kernel.REFERENCE else final, lse)
        ctx.args = (group, scale, kernel)
        return final

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        dq, dk, dv = ring_backward(dout, q, k, v, out, lse, *ctx.args)
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None


def ring_attn_func(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    group: ProcessGroup,
    softmax_scale: float | None = None,
    kernel: str | Kernel = Kernel.AUTO,
) -> Tensor:
    """Even zig-zag ring: ``q [2c, B, H, D]``, ``k, v [2c, B, G, D]`` -> ``[2c, B, H * D]``."""
    scale = softmax_scale if softmax_scale is not None else q.shape[3] ** -0.5
    concrete = resolve_kernel(kernel, device=q.device, dtype=q.dtype, head_dim=q.shape[3])
    out = _RingAttention.apply(q, k, v, group, scale, concrete)
    return out.reshape(out.shape[0], out.shape[1], -1)
