"""A CPU stand-in for PyTorch's variable-length flash ops (test helper), so the packed-document
path of ``attention/varlen.py`` (packing, head segments, scatter, LSE merge) runs without a GPU.

``flash_forward`` / ``flash_backward`` take the arguments of ``aten._flash_attention_forward`` /
``_backward`` (torch 2.11+) in the same order and layout: packed ``q [N, h, D]``, ``k, v [M, g, D]``
(native GQA: query head i reads K/V head ``i // (h / g)``), int32 ``cu_seqlens_q/k``, Python-int
``max_q/max_k`` (checked against the lengths), LSE ``[h, N]``. They compute in float64 and return
``out``/``dq``/``dk``/``dv`` in the input dtype and the LSE in float32 (float64 for float64 inputs,
which the exact tests use). ``varlen_standin()`` makes ``attention.varlen`` run every kernel's
windows through them (``uses_varlen`` true, ``_varlen_ops`` these) inside a ``with`` block.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

import megatron_hexiseq.attention.varlen as varlen


def _lse_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def _lengths(cu: torch.Tensor, most: int) -> list[int]:
    c = cu.tolist()
    assert most == max(b - a for a, b in zip(c, c[1:])), (most, c)
    return c


def flash_forward(q, k, v, cu_q, cu_k, max_q, max_k, dropout, causal, debug, *, scale):
    """``aten._flash_attention_forward`` in float64: ``(out, lse, seed, offset, debug_mask)``."""
    assert dropout == 0.0 and q.stride(-1) == k.stride(-1) == v.stride(-1) == 1
    N, H, D = q.shape
    rep = H // k.shape[1]
    out = torch.empty(N, H, D, dtype=torch.float64)
    lse = torch.empty(H, N, dtype=torch.float64)
    cq, ck = _lengths(cu_q, max_q), _lengths(cu_k, max_k)
    for i in range(len(cq) - 1):
        qs = q[cq[i] : cq[i + 1]].double().transpose(0, 1)
        ks = k[ck[i] : ck[i + 1]].double().repeat_interleave(rep, 1).transpose(0, 1)
        vs = v[ck[i] : ck[i + 1]].double().repeat_interleave(rep, 1).transpose(0, 1)
        s = qs @ ks.transpose(-1, -2) * scale
        if causal:
            assert qs.shape[1] == ks.shape[1]
            s = s.masked_fill(~torch.ones_like(s, dtype=torch.bool).tril(), float("-inf"))
        lse[:, cq[i] : cq[i + 1]] = torch.logsumexp(s, -1)
        out[cq[i] : cq[i + 1]] = (torch.softmax(s, -1) @ vs).transpose(0, 1)
    return (
        out.to(q.dtype),
        lse.to(_lse_dtype(q.dtype)),
        torch.empty(2),
        torch.empty(()),
        torch.empty(0),
    )


def flash_backward(do, q, k, v, o, lse, cu_q, cu_k, max_q, max_k, p, causal, rng, un, *, scale):
    """``aten._flash_attention_backward`` in float64: ``(dq, dk, dv)`` in the input dtype."""
    assert p == 0.0 and lse.is_contiguous()
    N, H, D = q.shape
    G = k.shape[1]
    rep = H // G
    dq = torch.zeros(N, H, D, dtype=torch.float64)
    dk = torch.zeros(k.shape, dtype=torch.float64)
    dv = torch.zeros(v.shape, dtype=torch.float64)
    cq, ck = _lengths(cu_q, max_q), _lengths(cu_k, max_k)
    for i in range(len(cq) - 1):
        a, b, c, d = cq[i], cq[i + 1], ck[i], ck[i + 1]
        qs, dos, os_ = (x[a:b].double().transpose(0, 1) for x in (q, do, o))
        ks = k[c:d].double().repeat_interleave(rep, 1).transpose(0, 1)
        vs = v[c:d].double().repeat_interleave(rep, 1).transpose(0, 1)
        s = qs @ ks.transpose(-1, -2) * scale
        if causal:
            s = s.masked_fill(~torch.ones_like(s, dtype=torch.bool).tril(), float("-inf"))
        P = torch.exp(s - lse[:, a:b, None].double())
        dvs = P.transpose(-1, -2) @ dos
        dP = dos @ vs.transpose(-1, -2)
        dS = P * (dP - (dos * os_).sum(-1, keepdim=True))
        dq[a:b] = (dS @ ks * scale).transpose(0, 1)
        dks = (dS.transpose(-1, -2) @ qs * scale).transpose(0, 1)
        dk[c:d] = dks.reshape(d - c, G, rep, D).sum(2)
        dv[c:d] = dvs.transpose(0, 1).reshape(d - c, G, rep, D).sum(2)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


@contextlib.contextmanager
def varlen_standin() -> Iterator[None]:
    """Every kernel's document windows through the stand-in ops inside the block (restored after)."""
    saved = varlen.uses_varlen, varlen._varlen_ops
    varlen.uses_varlen = lambda kernel: True  # type: ignore[assignment]
    varlen._varlen_ops = lambda: (flash_forward, flash_backward)  # type: ignore[assignment]
    try:
        yield
    finally:
        varlen.uses_varlen, varlen._varlen_ops = saved
