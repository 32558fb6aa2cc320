"""Layer (a), no processes: GQA through the block kernels without copies of K/V, on CPU in float64.

For head maps a rank can hold (aligned groups, an unaligned head range, heads out of K/V order, K/V
heads nobody reads, MQA) and both block kinds, ``block_forward`` / ``block_backward`` must equal
autograd attention of the same block with K/V repeated to the query heads (float64, 1e-10):
- with the native-GQA CPU kernel (``cpu-flash``) and the grouped calls of the reference;
- with the grouped calls of a non-native kernel: ``efficient`` is stood in for by the reference
  wrapped to refuse G != H, as the real op does on a GPU;
- every index tensor passed as ``kv_of_head_H`` gives the same results as its ``KVMap``, and is read
  on the host once per tensor object;
- the backward holds nothing at H heads but dq: checked by the largest tensor it creates.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import megatron_hexiseq.attention.kernels as kernels
from megatron_hexiseq.attention import kernel_ops
from megatron_hexiseq.attention.kernels import Kernel, block_backward, block_forward, kv_map

MAPS = {
    "aligned": ((0, 0, 0, 1, 1, 1), 2),
    "unaligned": ((0, 0, 1, 1, 1, 1, 2, 2), 3),
    "out of order": ((2, 0, 1, 0, 2), 3),
    "unread kv": ((1, 1, 3, 3), 4),
    "mqa": ((0, 0, 0, 0), 1),
    "mha": ((0, 1, 2), 3),
}


def _plain(q, k, v, of_head, scale, causal):
    kx, vx = k[:, :, list(of_head)], v[:, :, list(of_head)]
    s = torch.einsum("sbhd,tbhd->bhst", q, kx) * scale
    if causal:
        s = s.masked_fill(~torch.ones(s.shape[-2:], dtype=torch.bool).tril(), float("-inf"))
    lse = torch.logsumexp(s, -1)
    return torch.einsum("bhst,tbhd->sbhd", torch.exp(s - lse[..., None]), vx), lse.permute(2, 0, 1)


def _equal_heads(fn):
    def call(*args):
        q, k = (args[0], args[1]) if len(args) == 5 else (args[1], args[2])
        if q.shape[1] != k.shape[1]:
            raise RuntimeError("Expected query.size(2) == key.size(2)")
        return fn(*args)

    return call


@pytest.fixture
def emulated_efficient(monkeypatch):
    """``efficient`` on CPU: the reference, refusing G != H like the CUDA op."""
    monkeypatch.setitem(
        kernels._FORWARD, Kernel.EFFICIENT, _equal_heads(kernel_ops.reference_forward)
    )
    monkeypatch.setitem(
        kernels._BACKWARD, Kernel.EFFICIENT, _equal_heads(kernel_ops.reference_backward)
    )


@pytest.mark.parametrize("name", list(MAPS))
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("kernel", [Kernel.CPU_FLASH, Kernel.REFERENCE, Kernel.EFFICIENT])
def test_gqa_blocks_match_repeated_kv(emulated_efficient, kernel, causal, name) -> None:
    of_head, G = MAPS[name]
    H, S, B, D = len(of_head), 7, 2, 8
    T = S if causal else 11
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(S, B, H, D, generator=gen, dtype=torch.float64, requires_grad=True)
    k, v = (
        torch.randn(T, B, G, D, generator=gen, dtype=torch.float64, requires_grad=True)
        for _ in "kv"
    )
    dout = torch.randn(S, B, H, D, generator=gen, dtype=torch.float64)
    want_out, want_lse = _plain(q, k, v, of_head, 0.3, causal)
    want_out.backward(dout)
    for kv_of_head in (kv_map(of_head, G), torch.tensor(of_head)):
        kw = dict(causal=causal, kv_of_head_H=kv_of_head, scale=0.3, kernel=kernel)
        out, lse = block_forward(q.detach(), k.detach(), v.detach(), **kw)
        grads = block_backward(
            dout, q.detach(), k.detach(), v.detach(), want_out.detach(), want_lse.detach(), **kw
        )
        for got, want in zip(
            (out, lse, *grads), (want_out, want_lse, q.grad, k.grad, v.grad), strict=True
        ):
            assert got.shape == want.shape
            torch.testing.assert_close(got, want.detach(), rtol=1e-10, atol=1e-10)


def test_index_tensor_read_once_per_object(monkeypatch) -> None:
    reads = []
    real = torch.Tensor.tolist

    def counting(self):
        reads.append(self.shape)
        return real(self)

    monkeypatch.setattr(torch.Tensor, "tolist", counting)
    ix = torch.tensor([0, 0, 1, 1])
    q = torch.randn(5, 1, 4, 8)
    k = torch.randn(5, 1, 2, 8)
    for _ in range(3):
        block_forward(q, k, k, causal=True, kv_of_head_H=ix, scale=0.3, kernel=Kernel.CPU_FLASH)
    assert len(reads) == 1


class _Largest(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.numel = max(self.numel, t.numel())
        return out


@pytest.mark.parametrize("kernel", [Kernel.CPU_FLASH, Kernel.EFFICIENT])
def test_backward_keeps_kv_at_its_heads(emulated_efficient, kernel) -> None:
    """A full block with T = 4 S and H / G = 8: before, dK/dV were expanded to H heads (8x K/V)."""
    S, T, B, H, G, D = 8, 32, 1, 8, 1, 4
    q, dout = torch.randn(S, B, H, D), torch.randn(S, B, H, D)
    k, v = torch.randn(T, B, G, D), torch.randn(T, B, G, D)
    kw = dict(causal=False, kv_of_head_H=kv_map((0,) * H, G), scale=0.5, kernel=kernel)
    out, lse = block_forward(q, k, v, **kw)
    rec = _Largest()
    with rec:
        block_backward(dout, q, k, v, out, lse, **kw)
    assert rec.numel <= max(S * B * H * D, T * B * G * D)  # dq or one K/V-sized tensor
    assert rec.numel < T * B * H * D
