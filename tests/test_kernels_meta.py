"""Layer (a), no processes: the CUDA kernel paths on the ``meta`` device, and kernel choice.

PyTorch's CUDA attention ops (flash, memory-efficient, cuDNN) have meta implementations, so their
calls run here without a GPU: every aten kernel call of ``block_forward`` / ``block_backward`` is
recorded and bound to its torch 2.13 schema, and the test checks, for every CUDA kernel, dtype,
block kind and head map (aligned GQA, an unaligned head range, heads out of order):

- argument order and values: ``is_causal``, ``dropout_p = 0``, ``scale``; what the backward gets
  (grad_out and out in the input dtype with q's strides, [B, S, H, D]-contiguous for efficient; the LSE float32 in the layout the op wants:
  ``[B, H, S]`` flash, ``[B, H, S, 1]`` contiguous cuDNN, padded to a multiple of 32 efficient;
  undefined cum_seq for cuDNN's dense call); a contiguous last dim for every tensor;
- K/V stay at their head count: native-GQA kernels get fewer K/V heads than query heads, the
  efficient kernel (which refuses G < H on a GPU) equal counts, and no tensor on the path is as large
  as K/V expanded to the query heads;
- result shapes and dtypes: ``out [S, B, H, D]`` input dtype, ``lse [S, B, H]`` float32,
  ``dq [S, B, H, D]``, ``dk, dv [T, B, G, D]`` float32.
``resolve_kernel`` is checked against GPU properties set by hand (H200, A100, L40S).
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import megatron_hexiseq.attention.kernels as kernels
from megatron_hexiseq.attention.kernels import (
    Kernel,
    block_backward,
    block_forward,
    kv_map,
    resolve_kernel,
)
from megatron_hexiseq.errors import HexiSeqError

META = torch.device("meta")
ATTN_OPS = {
    "aten::_scaled_dot_product_flash_attention",
    "aten::_scaled_dot_product_flash_attention_backward",
    "aten::_scaled_dot_product_efficient_attention",
    "aten::_scaled_dot_product_efficient_attention_backward",
    "aten::_scaled_dot_product_cudnn_attention",
    "aten::_scaled_dot_product_cudnn_attention_backward",
}
OPS_OF = {
    Kernel.FLASH: "flash_attention",
    Kernel.EFFICIENT: "efficient_attention",
    Kernel.CUDNN: "cudnn_attention",
}
MAPS = {
    "aligned 8/2": ((0, 0, 0, 0, 1, 1, 1, 1), 2),
    "unaligned range": ((0, 0, 1, 1, 1, 1, 2, 2), 3),
    "out of order": ((1, 0, 1, 0, 2, 2, 2, 2), 3),
}
CASES = [
    (Kernel.FLASH, torch.bfloat16),
    (Kernel.FLASH, torch.float16),
    (Kernel.CUDNN, torch.bfloat16),
    (Kernel.CUDNN, torch.float16),
    (Kernel.EFFICIENT, torch.bfloat16),
    (Kernel.EFFICIENT, torch.float16),
    (Kernel.EFFICIENT, torch.float32),
]


class _Calls(TorchDispatchMode):
    """Records every op: its name, arguments bound to schema names, and the largest output."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, dict]] = []
        self.max_numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        bound = {a.name: a.default_value for a in func._schema.arguments if a.has_default_value()}
        bound.update({a.name: v for a, v in zip(func._schema.arguments, args)})
        bound.update(kwargs)  # the dispatcher drops arguments equal to their default
        self.calls.append((func._schema.name, bound))
        out = func(*args, **kwargs)
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.max_numel = max(self.max_numel, t.numel())
        return out


def _run(kernel: Kernel, dtype: torch.dtype, of_head, G: int, causal: bool):
    S, B, D = 24, 2, 16
    T = S if causal else 40
    H = len(of_head)
    q = torch.empty(S, B, H, D, dtype=dtype, device=META)
    k, v = (torch.empty(T, B, G, D, dtype=dtype, device=META) for _ in "kv")
    dout = torch.empty(S, B, H, D, dtype=dtype, device=META)
    kw = dict(causal=causal, kv_of_head_H=kv_map(of_head, G), scale=0.125, kernel=kernel)
    rec = _Calls()
    with rec:
        out, lse = block_forward(q, k, v, **kw)
        grads = block_backward(dout, q, k, v, out, lse, **kw)
    return (S, T, B, H, G, D), (out, lse, *grads), rec


@pytest.mark.parametrize("name", list(MAPS))
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("kernel,dtype", CASES)
def test_cuda_kernel_calls_on_meta(kernel: Kernel, dtype: torch.dtype, causal: bool, name: str):
    of_head, G = MAPS[name]
    (S, T, B, H, G, D), (out, lse, dq, dk, dv), rec = _run(kernel, dtype, of_head, G, causal)
    # results
    assert (out.shape, out.dtype) == ((S, B, H, D), dtype)
    assert (lse.shape, lse.dtype) == ((S, B, H), torch.float32)
    assert (dq.shape, dq.dtype) == ((S, B, H, D), torch.float32)
    for g in (dk, dv):
        assert (g.shape, g.dtype) == ((T, B, G, D), torch.float32)
    # the kernel calls
    calls = [(n, a) for n, a in rec.calls if n in ATTN_OPS]
    assert calls and all(OPS_OF[kernel] in n for n, _ in calls), [n for n, _ in calls]
    fwd = [a for n, a in calls if not n.endswith("_backward")]
    bwd = [a for n, a in calls if n.endswith("_backward")]
    assert len(fwd) == len(bwd)
    for a in fwd + bwd:
        assert a["is_causal"] is causal and a["dropout_p"] == 0.0 and a["scale"] == 0.125
        q, k, v = a["query"], a["key"], a["value"]
        assert all(x.stride(-1) == 1 for x in (q, k, v))
        assert q.dtype == k.dtype == v.dtype == dtype
        assert k.shape[2] == v.shape[2] == T and q.shape[2] == S
        if kernel is Kernel.EFFICIENT:
            assert k.shape[1] == q.shape[1]  # the op refuses G < H on a GPU
        else:
            assert q.shape[1] % k.shape[1] == 0
        assert k.shape[1] <= G  # never K/V expanded to the query heads
    for a in bwd:
        q = a["query"]
        grad = a.get("grad_out", a.get("grad_out_"))
        for x in (grad, a["out"]):
            assert x.dtype == dtype and x.shape == q.shape
            if kernel is Kernel.EFFICIENT:
                # its CUTLASS backward reads out as [B, S, H, D]-contiguous whatever the strides
                # (o_strideM() = head_dim * num_heads): a strided head slice or B > 1 in [S, B, H, D]
                # order gave dQ/dK errors of 0.2-1.0 on an H200
                assert x.transpose(1, 2).is_contiguous()
            else:
                assert x.stride() == q.stride()
        lse_in = a["logsumexp"]
        assert lse_in.dtype == torch.float32 and lse_in.is_contiguous()
        Bq, Hq, Sq, _ = q.shape
        if kernel is Kernel.CUDNN:
            assert lse_in.shape == (Bq, Hq, Sq, 1)
            assert a["cum_seq_q"] is None and a["cum_seq_k"] is None  # dense, not packed
            assert (a["max_q"], a["max_k"]) == (Sq, T)
        elif kernel is Kernel.EFFICIENT:
            assert lse_in.shape == (Bq, Hq, 32 * -(-Sq // 32))
        else:
            assert lse_in.shape == (Bq, Hq, Sq) and (a["max_q"], a["max_k"]) == (Sq, T)
    if MAPS[name] == MAPS["aligned 8/2"] and kernel is not Kernel.EFFICIENT:
        assert len(fwd) == 1  # one call with native GQA
    if not causal:  # T > S: nothing on the path as large as K/V at H heads
        assert rec.max_numel < B * H * T * D


def test_cudnn_key_block_of_one_token_goes_to_flash():
    q = torch.empty(5, 1, 4, 16, dtype=torch.bfloat16, device=META)
    k = torch.empty(1, 1, 2, 16, dtype=torch.bfloat16, device=META)
    rec = _Calls()
    kw = dict(causal=False, kv_of_head_H=kv_map((0, 0, 1, 1), 2), scale=0.25, kernel=Kernel.CUDNN)
    with rec:
        out, lse = block_forward(q, k, k, **kw)
        block_backward(q, q, k, k, out, lse, **kw)
    names = [n for n, _ in rec.calls if n in ATTN_OPS]
    assert names and all("flash_attention" in n for n in names)


def test_kv_map_segments() -> None:
    m = kv_map((0, 0, 0, 0, 1, 1, 1, 1), 2)
    assert m.single and m.order is None
    m = kv_map((0, 0, 1, 1, 1, 1, 2, 2), 3)  # query heads 2..9 of 16 with 4 per K/V head
    assert [tuple(s) for s in m.segments] == [(0, 2, 0, 1), (2, 6, 1, 2), (6, 8, 2, 3)]
    m = kv_map((0, 0, 1, 1, 2, 2), 3)
    assert [tuple(s) for s in m.segments] == [(0, 6, 0, 3)] and m.single
    m = kv_map((2, 0, 1, 0), 3)
    assert m.order == (1, 3, 2, 0)
    assert [tuple(s) for s in m.segments] == [(0, 2, 0, 1), (2, 4, 1, 3)]
    m = kv_map((1, 1, 3, 3), 4)  # K/V heads 0 and 2 read by nobody
    assert [tuple(s) for s in m.segments] == [(0, 2, 1, 2), (2, 4, 3, 4)] and not m.single


# ---- kernel choice ------------------------------------------------------------------------------
GPUS = {"H200": (9, 0), "A100": (8, 0), "L40S": (8, 9), "RTX 3090": (8, 6)}


def _gpu(monkeypatch, name: str, cudnn: int = 91900) -> torch.device:
    monkeypatch.setattr(kernels, "_capability", lambda device: GPUS[name])
    monkeypatch.setattr(kernels, "_cudnn_version", lambda: cudnn)
    return torch.device("cuda")


@pytest.mark.parametrize(
    "gpu,dtype,head_dim,want",
    [
        ("H200", torch.bfloat16, 128, Kernel.CUDNN),
        ("H200", torch.float16, 64, Kernel.CUDNN),
        ("H200", torch.bfloat16, 256, Kernel.FLASH),  # beyond cuDNN's backward limit
        ("H200", torch.float32, 128, Kernel.EFFICIENT),
        ("A100", torch.bfloat16, 128, Kernel.FLASH),
        ("L40S", torch.bfloat16, 128, Kernel.FLASH),
        ("L40S", torch.bfloat16, 192, Kernel.FLASH),
        ("L40S", torch.bfloat16, 200, Kernel.EFFICIENT),  # flash's backward refuses 193-224
        ("L40S", torch.bfloat16, 224, Kernel.EFFICIENT),
        ("RTX 3090", torch.float16, 208, Kernel.EFFICIENT),
        ("L40S", torch.bfloat16, 232, Kernel.FLASH),
        ("A100", torch.bfloat16, 200, Kernel.FLASH),
    ],
)
def test_auto_kernel_by_gpu(monkeypatch, gpu, dtype, head_dim, want) -> None:
    dev = _gpu(monkeypatch, gpu)
    assert resolve_kernel("auto", device=dev, dtype=dtype, head_dim=head_dim) is want


def test_auto_takes_cudnn_only_where_torch_prefers_it(monkeypatch) -> None:
    dev = _gpu(monkeypatch, "H200", cudnn=91400)  # before the seq-len % 128 fix
    assert resolve_kernel("auto", device=dev, dtype=torch.bfloat16, head_dim=128) is Kernel.FLASH
    dev = _gpu(monkeypatch, "H200")
    monkeypatch.setattr(torch, "are_deterministic_algorithms_enabled", lambda: True)
    assert resolve_kernel("auto", device=dev, dtype=torch.bfloat16, head_dim=128) is Kernel.FLASH


def test_explicit_kernels_refused_in_one_line(monkeypatch) -> None:
    dev = _gpu(monkeypatch, "L40S")
    with pytest.raises(HexiSeqError, match="'flash' needs .*not 193-224"):
        resolve_kernel("flash", device=dev, dtype=torch.bfloat16, head_dim=200)
    assert resolve_kernel("cudnn", device=dev, dtype=torch.bfloat16, head_dim=64) is Kernel.CUDNN
    with pytest.raises(HexiSeqError, match="'cudnn' needs .* up to 128"):
        resolve_kernel("cudnn", device=dev, dtype=torch.bfloat16, head_dim=136)
    with pytest.raises(HexiSeqError, match="'cudnn' runs on CUDA tensors"):
        resolve_kernel("cudnn", device=torch.device("cpu"), dtype=torch.bfloat16, head_dim=64)
    dev = _gpu(monkeypatch, "H200", cudnn=8900)
    with pytest.raises(HexiSeqError, match="cuDNN >= 9"):
        resolve_kernel("cudnn", device=dev, dtype=torch.bfloat16, head_dim=64)


def test_megatron_flag_accepts_every_kernel() -> None:
    from megatron_hexiseq.megatron.args import KERNELS

    assert set(KERNELS) == {k.value for k in Kernel} | {"sdpa"}


def test_cudnn_backward_gets_one_layout_for_q_out_and_dout() -> None:
    """cuDNN caches its backward plan by q/k/v strides only: out and dout must come with q's
    strides even when the caller's dout is laid out differently (here [B, S, H, D] in memory)."""
    S, B, H, G, D = 24, 2, 4, 2, 16
    q = torch.empty(S, B, H, D, dtype=torch.bfloat16, device=META)
    k = torch.empty(S, B, G, D, dtype=torch.bfloat16, device=META)
    dout = torch.empty(B, S, H, D, dtype=torch.bfloat16, device=META).transpose(0, 1)
    kw = dict(causal=True, kv_of_head_H=kv_map((0, 0, 1, 1), G), scale=0.25, kernel=Kernel.CUDNN)
    out, lse = block_forward(q, k, k, **kw)
    rec = _Calls()
    with rec:
        block_backward(dout, q, k, k, out, lse, **kw)
    (a,) = [a for n, a in rec.calls if n == "aten::_scaled_dot_product_cudnn_attention_backward"]
    assert a["grad_out"].stride() == a["out"].stride() == a["query"].stride()
