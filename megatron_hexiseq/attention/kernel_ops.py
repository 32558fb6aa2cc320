"""The single-call attention kernels behind ``kernels.py``: PyTorch's aten ops and the reference.

Legend: B = micro-batch, H = query heads of the call, G = K/V heads of the call, S = query tokens,
T = key tokens, D = head dim. Every kernel here takes ``[B, H, S, D]`` query views and ``[B, G, T, D]``
K/V views (last dim contiguous, any other strides) and returns

- forward ``(q, k, v, causal, scale) -> out [B, H, S, D], lse [B, H, S]`` (``out`` in the input
  dtype for the fused kernels, the accumulation dtype for the reference; ``lse`` float32 or wider);
- backward ``(dout, q, k, v, out, lse, causal, scale) -> dq [B, H, S, D], dk, dv [B, G, T, D]``,
  a recompute with the FINAL ``out`` and ``lse`` of the rows (input dtype for the fused kernels).

``NATIVE_GQA`` names the kernels that take G < H themselves (query head h reads K/V head
``h // (H / G)``, dK/dV come back with G heads); the others are only called with G == H
(``kernels.py`` groups the query heads for them). The aten signatures are those of torch 2.13 and
were exercised on an H200 with torch 2.11 (``bench/gpu_kernel_rates.py``):

- ``flash``: ``aten._scaled_dot_product_flash_attention`` / ``_backward`` (native GQA);
- ``cudnn``: ``aten._scaled_dot_product_cudnn_attention`` / ``_backward`` (native GQA; LSE as
  ``[B, H, S, 1]``; no key block of length 1, which goes to ``flash``);
- ``efficient``: ``aten._scaled_dot_product_efficient_attention`` / ``_backward`` (refuses G < H;
  pads its LSE rows to a multiple of 32);
- ``cpu-flash``: ``aten._scaled_dot_product_flash_attention_for_cpu`` / ``_backward`` (native GQA);
- ``reference``: matmul + softmax in the accumulation dtype, any device: the oracle. It
  materialises ``[B, H, S, T]`` scores; never use it at long context.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulation dtype for outputs/LSE/gradients: at least float32."""
    return torch.promote_types(dtype, torch.float32)


# ---- reference (the oracle) -------------------------------------------------------------------
def _reference_scores(q_BHSD: Tensor, k_BHTD: Tensor, causal: bool, scale: float) -> Tensor:
    acc = acc_dtype(q_BHSD.dtype)
    s_BHST = torch.matmul(q_BHSD.to(acc), k_BHTD.to(acc).transpose(-1, -2)) * scale
    if causal:
        S = s_BHST.shape[-1]
        s_BHST = s_BHST.masked_fill(
            ~torch.ones(S, S, dtype=torch.bool, device=s_BHST.device).tril(), float("-inf")
        )
    return s_BHST


def reference_forward(
    q_BHSD: Tensor, k_BHTD: Tensor, v_BHTD: Tensor, causal: bool, scale: float
) -> tuple[Tensor, Tensor]:
    s_BHST = _reference_scores(q_BHSD, k_BHTD, causal, scale)
    lse_BHS = torch.logsumexp(s_BHST, dim=-1)
    out_BHSD = torch.matmul(torch.exp(s_BHST - lse_BHS[..., None]), v_BHTD.to(s_BHST.dtype))
    return out_BHSD, lse_BHS


def reference_backward(
    do_BHSD: Tensor,
    q_BHSD: Tensor,
    k_BHTD: Tensor,
    v_BHTD: Tensor,
    o_BHSD: Tensor,
    lse_BHS: Tensor,
    causal: bool,
    scale: float,
) -> tuple[Tensor, Tensor, Tensor]:
    acc = acc_dtype(q_BHSD.dtype)
    do_BHSD, v_BHTD = do_BHSD.to(acc), v_BHTD.to(acc)
    delta_BHS = (do_BHSD * o_BHSD.to(acc)).sum(-1)
    p_BHST = torch.exp(
        _reference_scores(q_BHSD, k_BHTD, causal, scale) - lse_BHS.to(acc)[..., None]
    )
    dv = torch.matmul(p_BHST.transpose(-1, -2), do_BHSD)
    ds_BHST = p_BHST * (torch.matmul(do_BHSD, v_BHTD.transpose(-1, -2)) - delta_BHS[..., None])
    dq = torch.matmul(ds_BHST, k_BHTD.to(acc)) * scale
    dk = torch.matmul(ds_BHST.transpose(-1, -2), q_BHSD.to(acc)) * scale
    return dq, dk, dv


# ---- PyTorch CPU flash ------------------------------------------------------------------------
def cpu_forward(
    q_BHSD: Tensor, k_BGTD: Tensor, v_BGTD: Tensor, causal: bool, scale: float
) -> tuple[Tensor, Tensor]:
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q_BHSD.contiguous(), k_BGTD.contiguous(), v_BGTD.contiguous(), 0.0, causal, scale=scale
    )
    return out, lse.to(acc_dtype(q_BHSD.dtype))


def cpu_backward(
    do_BHSD: Tensor,
    q_BHSD: Tensor,
    k_BGTD: Tensor,
    v_BGTD: Tensor,
    o_BHSD: Tensor,
    lse_BHS: Tensor,
    causal: bool,
    scale: float,
) -> tuple[Tensor, Tensor, Tensor]:
    dt = q_BHSD.dtype
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        do_BHSD.to(dt).contiguous(),
        q_BHSD.contiguous(),
        k_BGTD.contiguous(),
        v_BGTD.contiguous(),
        o_BHSD.to(dt).contiguous(),
        lse_BHS.to(acc_dtype(dt)).contiguous(),
        0.0,
        causal,
        scale=scale,
    )


# ---- PyTorch CUDA flash -----------------------------------------------------------------------
def flash_forward(
    q_BHSD: Tensor, k_BGTD: Tensor, v_BGTD: Tensor, causal: bool, scale: float
) -> tuple[Tensor, Tensor]:
    out, lse, *_ = torch.ops.aten._scaled_dot_product_flash_attention(
        q_BHSD, k_BGTD, v_BGTD, 0.0, causal, False, scale=scale
    )
    return out, lse


def flash_backward(
    do_BHSD: Tensor,
    q_BHSD: Tensor,
    k_BGTD: Tensor,
    v_BGTD: Tensor,
    o_BHSD: Tensor,
    lse_BHS: Tensor,
    causal: bool,
    scale: float,
) -> tuple[Tensor, Tensor, Tensor]:
    dt = q_BHSD.dtype
    # dense (non-varlen) call: cum_seq_q/k undefined (None), no dropout so the RNG state is unused
    rng = torch.empty(2, dtype=torch.int64, device=q_BHSD.device)
    return torch.ops.aten._scaled_dot_product_flash_attention_backward(
        do_BHSD.to(dt),
        q_BHSD,
        k_BGTD,
        v_BGTD,
        o_BHSD.to(dt),
        lse_BHS.float().contiguous(),
        None,
        None,
        q_BHSD.shape[2],
        k_BGTD.shape[2],
        0.0,
        causal,
        rng,
        rng[:1],
        scale=scale,
    )


# ---- PyTorch cuDNN ----------------------------------------------------------------------------
def cudnn_forward(
    q_BHSD: Tensor, k_BGTD: Tensor, v_BGTD: Tensor, causal: bool, scale: float
) -> tuple[Tensor, Tensor]:
    if k_BGTD.shape[2] < 2:  # cuDNN SDPA refuses a key/value sequence of length 1
        return flash_forward(q_BHSD, k_BGTD, v_BGTD, causal, scale)
    res = torch.ops.aten._scaled_dot_product_cudnn_attention(
        q_BHSD, k_BGTD, v_BGTD, None, True, 0.0, causal, False, scale=scale
    )
    return res[0], res[1].reshape(res[1].shape[:3])  # LSE [B, H, S, 1] -> [B, H, S]


def cudnn_backward(
    do_BHSD: Tensor,
    q_BHSD: Tensor,
    k_BGTD: Tensor,
    v_BGTD: Tensor,
    o_BHSD: Tensor,
    lse_BHS: Tensor,
    causal: bool,
    scale: float,
) -> tuple[Tensor, Tensor, Tensor]:
    """cuDNN caches its execution graph by the sizes and strides of q, k and v only, so ``out`` and
    ``dout`` must always come with q's strides (``kernels.py`` passes views of [S, B, H, D]-contiguous
    tensors sliced alike); the LSE goes in as a fresh contiguous ``[B, H, S, 1]``."""
    if k_BGTD.shape[2] < 2:
        return flash_backward(do_BHSD, q_BHSD, k_BGTD, v_BGTD, o_BHSD, lse_BHS, causal, scale)
    dt = q_BHSD.dtype
    B, H, S, _ = q_BHSD.shape
    T = k_BGTD.shape[2]
    # no dropout: the philox seed/offset are unused; a dense call passes undefined (None)
    # cum_seq_q/k and attn_bias, as the forward returns them (a defined cum_seq means packed input)
    philox = torch.empty((), dtype=torch.int64, device=q_BHSD.device)
    return torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
        do_BHSD.to(dt),
        q_BHSD,
        k_BGTD,
        v_BGTD,
        o_BHSD.to(dt),
        lse_BHS.float().reshape(B, H, S, 1).contiguous(),
        philox,
        philox,
        None,
        None,
        None,
        S,
        T,
        0.0,
        causal,
        scale=scale,
    )


# ---- PyTorch CUDA memory-efficient --------------------------------------------------------------
def bshd_contiguous(x_BHSD: Tensor) -> Tensor:
    """A [B, H, S, D] view of a [B, S, H, D]-contiguous tensor (no copy when it already is one).

    The memory-efficient backward reads ``out`` as [B, S, H, D]-contiguous whatever its strides say
    (the CUTLASS kernel computes ``o_strideM() = head_dim_value * num_heads``): a per-head slice or
    a micro-batch of B > 1 in [S, B, H, D] order is read at wrong rows, which corrupts the rowsum
    ``dO . O`` and so dQ and dK (dV stays right). Seen on an H200: normwise error 0.2-1.0 for
    strided GQA calls in bf16/fp16. ``grad_out`` gets the same layout."""
    x_BSHD = x_BHSD.transpose(1, 2)
    return x_BHSD if x_BSHD.is_contiguous() else x_BSHD.contiguous().transpose(1, 2)


def efficient_forward(
    q_BHSD: Tensor, k_BHTD: Tensor, v_BHTD: Tensor, causal: bool, scale: float
) -> tuple[Tensor, Tensor]:
    out, lse, _, _ = torch.ops.aten._scaled_dot_product_efficient_attention(
        q_BHSD, k_BHTD, v_BHTD, None, True, 0.0, causal, scale=scale
    )
    return out, lse[..., : q_BHSD.shape[2]]  # the kernel pads the LSE rows to a multiple of 32


def efficient_backward(
    do_BHSD: Tensor,
    q_BHSD: Tensor,
    k_BHTD: Tensor,
    v_BHTD: Tensor,
    o_BHSD: Tensor,
    lse_BHS: Tensor,
    causal: bool,
    scale: float,
) -> tuple[Tensor, Tensor, Tensor]:
    dt = q_BHSD.dtype
    S = q_BHSD.shape[2]
    lse_pad = lse_BHS.new_full((*lse_BHS.shape[:2], 32 * math.ceil(S / 32)), float("inf"))
    lse_pad[..., :S] = lse_BHS
    seed = torch.empty((), dtype=torch.int64, device=q_BHSD.device)
    dq, dk, dv, _ = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
        bshd_contiguous(do_BHSD.to(dt)),
        q_BHSD,
        k_BHTD,
        v_BHTD,
        None,
        bshd_contiguous(o_BHSD.to(dt)),
        lse_pad,
        seed,
        seed,
        0.0,
        [True, True, True, False],
        causal,
        scale=scale,
    )
    return dq, dk, dv
