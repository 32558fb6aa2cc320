"""Layer (c): GPU-only checks of the attention kernels (skipped without CUDA).

The reference block kernel on CUDA must equal the same kernel on CPU; the CPU-only fused ``sdpa``
kernel must refuse CUDA tensors with a clear error instead of running a path nobody validated.
"""
from __future__ import annotations

import pytest
import torch

from megatron_hexiseq.attention.kernels import block_backward, block_forward, visible_mask

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_reference_kernel_on_cuda_matches_cpu() -> None:
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(9, 2, 4, 8, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(7, 2, 2, 8, generator=gen, dtype=torch.float64) for _ in range(2))
    mask = visible_mask(torch.arange(3, 12), torch.arange(0, 14, 2))
    kv_of_head = torch.tensor([0, 0, 1, 1])
    kw = dict(kv_of_head_H=kv_of_head, scale=0.4, kernel="reference")
    out, lse = block_forward(q, k, v, mask_ST=mask, **kw)
    out_c, lse_c = block_forward(q.cuda(), k.cuda(), v.cuda(), mask_ST=mask.cuda(),
                                 **{**kw, "kv_of_head_H": kv_of_head.cuda()})
    torch.testing.assert_close(out_c.cpu(), out)
    torch.testing.assert_close(lse_c.cpu(), lse)
    dout = torch.randn_like(out)
    delta = (dout * out).sum(-1)
    grads = block_backward(dout, q, k, v, out, lse, delta, mask_ST=mask, **kw)
    grads_c = block_backward(dout.cuda(), q.cuda(), k.cuda(), v.cuda(), out_c, lse_c, delta.cuda(), mask_ST=mask.cuda(),
                             **{**kw, "kv_of_head_H": kv_of_head.cuda()})
    for g, gc in zip(grads, grads_c):
        torch.testing.assert_close(gc.cpu(), g)


def test_sdpa_kernel_refuses_cuda() -> None:
    x = torch.randn(4, 1, 2, 8, device="cuda")
    with pytest.raises(ValueError, match="CPU tensors only"):
        block_forward(x, x, x, mask_ST=None, causal=True, kv_of_head_H=None, scale=1.0, kernel="sdpa")
