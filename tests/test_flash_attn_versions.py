"""Layer (a), no processes: the ``flash-attn`` kernel against stand-ins of flash-attn 2.5-2.8.

flash-attn is not installed here. Each stand-in module reproduces one release's real
``flash_attn_interface._flash_attn_forward`` / ``_flash_attn_backward`` signature and results (read
from the sources at tags v2.5.0-v2.5.9, v2.6.0-v2.6.3, v2.7.0-v2.7.4, v2.8.0-v2.8.3); 2.7 and 2.8
wrap them, as the real package does, in ``torch.library.custom_op`` (whose Python signature reads
``(*args, **kwargs)``; it runs on CPU). The stand-ins compute float64 attention in flash-attn's
``[B, S, H, D]`` layout with native GQA, so ``block_forward`` / ``block_backward`` with
``Kernel.FLASH_ATTN`` must match the reference kernel to float32 rounding (flash-attn's LSE is
float32), for each version.
"""

from __future__ import annotations

import sys
import types
from typing import Optional

import pytest
import torch

from megatron_hexiseq.attention import kernel_ops
from megatron_hexiseq.attention.kernels import Kernel, block_backward, block_forward, kv_map
from megatron_hexiseq.errors import HexiSeqError


def _fwd(q, k, v, scale, causal):
    """[B, S, H, D] q, [B, T, G, D] k/v -> out [B, S, H, D], lse [B, H, S] (native GQA)."""
    r = q.shape[2] // k.shape[2]
    kx, vx = (x.repeat_interleave(r, 2).transpose(1, 2) for x in (k, v))
    out, lse = kernel_ops.reference_forward(q.transpose(1, 2), kx, vx, causal, scale)
    return out.transpose(1, 2).to(q.dtype).contiguous(), lse.float().contiguous()


def _bwd(dout, q, k, v, out, lse, dq, dk, dv, scale, causal):
    G, r = k.shape[2], q.shape[2] // k.shape[2]
    kx, vx = (x.repeat_interleave(r, 2).transpose(1, 2) for x in (k, v))
    gq, gk, gv = kernel_ops.reference_backward(
        dout.transpose(1, 2), q.transpose(1, 2), kx, vx, out.transpose(1, 2), lse, causal, scale
    )
    dq.copy_(gq.transpose(1, 2))
    B, _, T, D = gk.shape
    dk.copy_(gk.reshape(B, G, r, T, D).sum(2).transpose(1, 2))
    dv.copy_(gv.reshape(B, G, r, T, D).sum(2).transpose(1, 2))
    return torch.empty(0)


def _check_window(window):
    assert tuple(window) == (-1, -1)


# ---- 2.5.x ----------------------------------------------------------------------------------------
def fwd_25(q, k, v, dropout_p, softmax_scale, causal, window_size, alibi_slopes, return_softmax):
    assert dropout_p == 0.0 and alibi_slopes is None and return_softmax is False
    _check_window(window_size)
    out, lse = _fwd(q, k, v, softmax_scale, causal)
    return out, q, k, v, out, lse, None, torch.empty(2)


def bwd_25(
    dout,
    q,
    k,
    v,
    out,
    softmax_lse,
    dq,
    dk,
    dv,
    dropout_p,
    softmax_scale,
    causal,
    window_size,
    alibi_slopes,
    deterministic,
    rng_state=None,
):
    assert dropout_p == 0.0 and alibi_slopes is None and deterministic is False
    _check_window(window_size)
    d = _bwd(dout, q, k, v, out, softmax_lse, dq, dk, dv, softmax_scale, causal)
    return dq, dk, dv, d


# ---- 2.6.x ----------------------------------------------------------------------------------------
def fwd_26(
    q, k, v, dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, return_softmax
):
    assert softcap == 0.0
    return fwd_25(
        q, k, v, dropout_p, softmax_scale, causal, window_size, alibi_slopes, return_softmax
    )


def bwd_26(
    dout,
    q,
    k,
    v,
    out,
    softmax_lse,
    dq,
    dk,
    dv,
    dropout_p,
    softmax_scale,
    causal,
    window_size,
    softcap,
    alibi_slopes,
    deterministic,
    rng_state=None,
):
    assert softcap == 0.0
    return bwd_25(
        dout,
        q,
        k,
        v,
        out,
        softmax_lse,
        dq,
        dk,
        dv,
        dropout_p,
        softmax_scale,
        causal,
        window_size,
        alibi_slopes,
        deterministic,
        rng_state,
    )


# ---- 2.7.x / 2.8.x: torch.library custom ops ----------------------------------------------------
@torch.library.custom_op("hexiseq_test::flash_attn_forward", mutates_args=())
def fwd_27(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    dropout_p: float,
    softmax_scale: float,
    causal: bool,
    window_size_left: int,
    window_size_right: int,
    softcap: float,
    alibi_slopes: Optional[torch.Tensor],  # noqa: UP045 (custom_op reads the annotation)
    return_softmax: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    assert dropout_p == 0.0 and softcap == 0.0 and alibi_slopes is None and not return_softmax
    _check_window((window_size_left, window_size_right))
    out, lse = _fwd(q, k, v, softmax_scale, causal)
    return out, lse, torch.empty(0, dtype=q.dtype), torch.empty(2, dtype=torch.int64)


@torch.library.custom_op("hexiseq_test::flash_attn_backward", mutates_args=("dq", "dk", "dv"))
def bwd_27(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    softmax_lse: torch.Tensor,
    dq: Optional[torch.Tensor],  # noqa: UP045
    dk: Optional[torch.Tensor],  # noqa: UP045
    dv: Optional[torch.Tensor],  # noqa: UP045
    dropout_p: float,
    softmax_scale: float,
    causal: bool,
    window_size_left: int,
    window_size_right: int,
    softcap: float,
    alibi_slopes: Optional[torch.Tensor],  # noqa: UP045
    deterministic: bool,
    rng_state: Optional[torch.Tensor] = None,  # noqa: UP045
) -> torch.Tensor:
    assert dropout_p == 0.0 and softcap == 0.0 and alibi_slopes is None and not deterministic
    _check_window((window_size_left, window_size_right))
    return _bwd(dout, q, k, v, out, softmax_lse, dq, dk, dv, softmax_scale, causal)


VERSIONS = {
    "2.5.9.post1": (fwd_25, bwd_25),
    "2.6.3": (fwd_26, bwd_26),
    "2.7.4.post1": (fwd_27, bwd_27),
    "2.8.3": (fwd_27, bwd_27),
}


def _install(monkeypatch, version: str, fwd, bwd) -> None:
    pkg = types.ModuleType("flash_attn")
    pkg.__version__ = version  # type: ignore[attr-defined]
    iface = types.ModuleType("flash_attn.flash_attn_interface")
    iface._flash_attn_forward = fwd  # type: ignore[attr-defined]
    iface._flash_attn_backward = bwd  # type: ignore[attr-defined]
    pkg.flash_attn_interface = iface  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "flash_attn", pkg)
    monkeypatch.setitem(sys.modules, "flash_attn.flash_attn_interface", iface)


def test_custom_op_stand_in_hides_its_signature() -> None:
    import inspect

    params = list(inspect.signature(fwd_27).parameters)
    assert "q" not in params  # why keywords filtered by inspect.signature reach nothing


@pytest.mark.parametrize("version", list(VERSIONS))
@pytest.mark.parametrize("causal", [True, False])
def test_flash_attn_kernel_per_version(monkeypatch, version: str, causal: bool) -> None:
    _install(monkeypatch, version, *VERSIONS[version])
    gen = torch.Generator().manual_seed(1)
    S, B, H, G, D = 9, 2, 4, 2, 8
    T = S if causal else 13
    q = torch.randn(S, B, H, D, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(T, B, G, D, generator=gen, dtype=torch.float64) for _ in "kv")
    dout = torch.randn(S, B, H, D, generator=gen, dtype=torch.float64)
    m = kv_map((0, 0, 1, 1), G)
    got, want = [], []
    for kernel, res in ((Kernel.FLASH_ATTN, got), (Kernel.REFERENCE, want)):
        kw = dict(causal=causal, kv_of_head_H=m, scale=0.3, kernel=kernel)
        out, lse = block_forward(q, k, v, **kw)
        res += [out, lse, *block_backward(dout, q, k, v, out, lse, **kw)]
    for name, a, b in zip(("out", "lse", "dq", "dk", "dv"), got, want):
        assert a.shape == b.shape, name
        # flash-attn keeps the LSE in float32 (so does the stand-in): a few float32 roundings
        torch.testing.assert_close(a.double(), b.double(), rtol=1e-6, atol=1e-6, msg=name)


@pytest.mark.parametrize("version", ["2.4.3", "2.9.0", "3.0.0b1", "unknown"])
def test_unsupported_flash_attn_version_is_one_line(monkeypatch, version: str) -> None:
    from megatron_hexiseq.attention.kernels import resolve_kernel

    monkeypatch.setattr("megatron_hexiseq.attention.kernels._capability", lambda d: (9, 0))
    _install(monkeypatch, version, fwd_25, bwd_25)
    with pytest.raises(HexiSeqError, match=f"flash-attn {version} is not supported") as err:
        resolve_kernel("flash-attn", device=torch.device("cuda"), dtype=torch.bfloat16, head_dim=64)
    assert "\n" not in str(err.value)


def test_flash_attn_refuses_what_its_kernel_cannot_take(monkeypatch) -> None:
    from megatron_hexiseq.attention.kernels import resolve_kernel

    _install(monkeypatch, "2.8.3", fwd_27, bwd_27)
    cuda = torch.device("cuda")
    assert resolve_kernel("flash-attn", device=cuda, dtype=torch.float16, head_dim=64) is (
        Kernel.FLASH_ATTN
    )
    for dtype, head_dim in ((torch.float32, 64), (torch.bfloat16, 100), (torch.bfloat16, 264)):
        with pytest.raises(HexiSeqError, match="'flash-attn' needs bf16/fp16"):
            resolve_kernel("flash-attn", device=cuda, dtype=dtype, head_dim=head_dim)
