"""Block attention kernels with log-sum-exp in and out, chosen by device and dtype.

Legend: S = query tokens of the block, T = key tokens of the block, B = micro-batch, H = query
heads of this rank, G = K/V heads of this rank, D = head dim. ``kv_of_head_H[h]`` is the index (into
the G K/V heads) that query head h reads (GQA/MQA; ``None`` when query head h reads K/V head h).

The block schedule (``peers.py``) only ever asks for two kinds of block, so no mask exists here:
- *causal*: queries and keys are the same position-sorted tokens (a square block; key j is visible
  to query i iff j <= i). Top-left and bottom-right causal alignment coincide on a square block.
- *full*: every key is visible to every query (no mask; any S and T, T >= 1).

Forward returns the block's ``out [S, B, H, D]`` (the kernel's dtype: the input dtype for the fused
kernels, the accumulation dtype for the reference) and ``lse [S, B, H]`` (float32 or wider). The
backward is a recompute with the FINAL merged ``out`` and ``lse`` (``dS = P * (dP - rowsum(dO * O))``,
``P = exp(S - LSE_final)``), as ring-flash-attention does with flash-attn; it returns ``dq [S, B, H, D]``,
``dk, dv [T, B, G, D]`` in the accumulation dtype.

Kernels (``Kernel``; ``resolve_kernel`` turns ``auto`` into a concrete one):
- ``reference``: matmul + softmax in pure PyTorch in the accumulation dtype, any device: the oracle.
  It materialises ``[B, H, S, T]`` scores; never use it at long context.
- ``flash``: PyTorch's CUDA flash kernel (``aten._scaled_dot_product_flash_attention`` and its
  ``_backward``); bf16/fp16, head dim a multiple of 8 and at most 256, compute capability >= 8.0.
- ``efficient``: PyTorch's CUDA memory-efficient kernel (``aten._scaled_dot_product_efficient_attention``
  and its ``_backward``); fp32/bf16/fp16, where flash does not apply.
- ``cpu-flash``: PyTorch's CPU flash kernel (``aten._scaled_dot_product_flash_attention_for_cpu`` and
  its ``_backward``); any floating dtype on CPU.
- ``flash-attn``: the optional ``flash_attn`` package (``_flash_attn_forward`` / ``_flash_attn_backward``,
  signatures read at call time because they changed between 2.5 and 2.7); chosen only explicitly.
- ``auto``: ``cpu-flash`` on CPU; on CUDA ``flash`` where it applies, else ``efficient``; fp64 on CUDA
  takes ``reference``. ``check_kernel`` (run at start-up by ``build_runtime``) proves the choice on the
  real device and dtype.
All fused kernels are O(S * D) in memory: no score tensor.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable
from enum import Enum
from typing import Any

import torch
from torch import Tensor

from megatron_hexiseq.errors import HexiSeqError


class Kernel(str, Enum):  # noqa: UP042 (StrEnum changes str() of a member)
    """Block kernels; the value is the ``--hexiseq-kernel`` name."""

    AUTO = "auto"
    REFERENCE = "reference"
    FLASH = "flash"
    EFFICIENT = "efficient"
    CPU_FLASH = "cpu-flash"
    FLASH_ATTN = "flash-attn"


KERNELS = tuple(k.value for k in Kernel)
_ALIASES = {"sdpa": Kernel.AUTO}  # the name of the CPU fused kernel before the CUDA kernels existed


def parse_kernel(name: str | Kernel) -> Kernel:
    """``"flash"`` -> ``Kernel.FLASH``; unknown names are a one-line error."""
    if isinstance(name, Kernel):
        return name
    if name in _ALIASES:
        return _ALIASES[name]
    try:
        return Kernel(name)
    except ValueError:
        raise HexiSeqError(
            f"unknown attention kernel {name!r}; choose one of {', '.join(KERNELS)}"
        ) from None


def flash_applies(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    """Would PyTorch's CUDA flash kernel take these inputs (dtype, head dim, GPU generation)?"""
    if device.type != "cuda" or dtype not in (torch.float16, torch.bfloat16):
        return False
    if head_dim % 8 or head_dim > 256:
        return False
    return torch.cuda.get_device_capability(device) >= (8, 0)


def resolve_kernel(
    kernel: str | Kernel, *, device: torch.device, dtype: torch.dtype, head_dim: int
) -> Kernel:
    """A concrete kernel for this device, dtype and head dim (``auto`` chooses; others are checked)."""
    k = parse_kernel(kernel)
    if k is Kernel.AUTO:
        if device.type == "cpu":
            return Kernel.CPU_FLASH
        if device.type == "cuda" and dtype != torch.float64:
            return Kernel.FLASH if flash_applies(device, dtype, head_dim) else Kernel.EFFICIENT
        return Kernel.REFERENCE
    if k is Kernel.CPU_FLASH and device.type != "cpu":
        raise HexiSeqError(
            f"attention kernel 'cpu-flash' runs on CPU tensors, got {device.type}; use --hexiseq-kernel auto"
        )
    if k in (Kernel.FLASH, Kernel.EFFICIENT, Kernel.FLASH_ATTN) and device.type != "cuda":
        raise HexiSeqError(
            f"attention kernel '{k.value}' runs on CUDA tensors, got {device.type}; "
            "use --hexiseq-kernel auto"
        )
    if k is Kernel.FLASH and not flash_applies(device, dtype, head_dim):
        raise HexiSeqError(
            f"attention kernel 'flash' needs bf16/fp16, head dim a multiple of 8 up to 256 and a GPU "
            f"of compute capability >= 8.0 (got {dtype}, head dim {head_dim}); use 'efficient' or 'auto'"
        )
    return k


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulation dtype for outputs/LSE/gradients: at least float32."""
    return torch.promote_types(dtype, torch.float32)


def _expand_kv(x_TBGD: Tensor, kv_of_head_H: Tensor | None) -> Tensor:
    """[T, B, G, D] -> [B, H, T, D] (GQA heads repeated for the query heads that read them)."""
    if kv_of_head_H is not None:
        x_TBGD = x_TBGD.index_select(2, kv_of_head_H)
    return x_TBGD.permute(1, 2, 0, 3)


def _reduce_kv(dx_BHTD: Tensor, kv_of_head_H: Tensor | None, num_kv: int) -> Tensor:
    """[B, H, T, D] -> [T, B, G, D]: sum the gradients of query heads that share a K/V head."""
    dx_TBHD = dx_BHTD.permute(2, 0, 1, 3)
    if kv_of_head_H is None:
        return dx_TBHD
    T, B, _, D = dx_TBHD.shape
    out = dx_TBHD.new_zeros(T, B, num_kv, D)
    return out.index_add_(2, kv_of_head_H, dx_TBHD)


# ---- dispatch ---------------------------------------------------------------------------------
def block_forward(
    q_SBHD: Tensor,
    k_TBGD: Tensor,
    v_TBGD: Tensor,
    *,
    causal: bool,
    kv_of_head_H: Tensor | None,
    scale: float,
    kernel: Kernel,
) -> tuple[Tensor, Tensor]:
    """Attention of one (query block, key block) pair: ``out [S, B, H, D]``, ``lse [S, B, H]`` (see top)."""
    if causal and q_SBHD.shape[0] != k_TBGD.shape[0]:
        raise AssertionError("a causal block pairs the same tokens as queries and keys")
    q_BHSD = q_SBHD.permute(1, 2, 0, 3)
    k_BHTD, v_BHTD = _expand_kv(k_TBGD, kv_of_head_H), _expand_kv(v_TBGD, kv_of_head_H)
    out_BHSD, lse_BHS = _FORWARD[kernel](q_BHSD, k_BHTD, v_BHTD, causal, scale)
    return out_BHSD.permute(2, 0, 1, 3), lse_BHS.permute(2, 0, 1)


def block_backward(
    dout_SBHD: Tensor,
    q_SBHD: Tensor,
    k_TBGD: Tensor,
    v_TBGD: Tensor,
    out_SBHD: Tensor,
    lse_SBH: Tensor,
    *,
    causal: bool,
    kv_of_head_H: Tensor | None,
    scale: float,
    kernel: Kernel,
) -> tuple[Tensor, Tensor, Tensor]:
    """Recompute backward of one block with the FINAL ``out`` (input dtype for the fused kernels)
    and ``lse``: ``dq [S, B, H, D]``, ``dk, dv [T, B, G, D]`` in the accumulation dtype."""
    acc = acc_dtype(q_SBHD.dtype)
    num_kv = k_TBGD.shape[2]
    q_BHSD = q_SBHD.permute(1, 2, 0, 3)
    k_BHTD, v_BHTD = _expand_kv(k_TBGD, kv_of_head_H), _expand_kv(v_TBGD, kv_of_head_H)
    do_BHSD, o_BHSD = dout_SBHD.permute(1, 2, 0, 3), out_SBHD.permute(1, 2, 0, 3)
    lse_BHS = lse_SBH.permute(1, 2, 0).to(acc).contiguous()
    dq, dk, dv = _BACKWARD[kernel](do_BHSD, q_BHSD, k_BHTD, v_BHTD, o_BHSD, lse_BHS, causal, scale)
    return (
        dq.permute(2, 0, 1, 3).to(acc),
        _reduce_kv(dk.to(acc), kv_of_head_H, num_kv),
        _reduce_kv(dv.to(acc), kv_of_head_H, num_kv),
    )


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


def _reference_forward(
    q_BHSD: Tensor, k_BHTD: Tensor, v_BHTD: Tensor, causal: bool, scale: float
) -> tuple[Tensor, Tensor]:
    s_BHST = _reference_scores(q_BHSD, k_BHTD, causal, scale)
    lse_BHS = torch.logsumexp(s_BHST, dim=-1)
    out_BHSD = torch.matmul(torch.exp(s_BHST - lse_BHS[..., None]), v_BHTD.to(s_BHST.dtype))
    return out_BHSD, lse_BHS


def _reference_backward(
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
def _cpu_forward(
    q_BHSD: Tensor, k_BHTD: Tensor, v_BHTD: Tensor, causal: bool, scale: float
) -> tuple[Tensor, Tensor]:
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q_BHSD.contiguous(), k_BHTD.contiguous(), v_BHTD.contiguous(), 0.0, causal, scale=scale
    )
    return out, lse.to(acc_dtype(q_BHSD.dtype))


def _cpu_backward(
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
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        do_BHSD.to(dt).contiguous(),
        q_BHSD.contiguous(),
        k_BHTD.contiguous(),
        v_BHTD.contiguous(),
        o_BHSD.to(dt).contiguous(),
        lse_BHS.to(acc_dtype(dt)),
        0.0,
        causal,
        scale=scale,
    )


# ---- PyTorch CUDA flash -----------------------------------------------------------------------
def _flash_forward(
    q_BHSD: Tensor, k_BHTD: Tensor, v_BHTD: Tensor, causal: bool, scale: float
) -> tuple[Tensor, Tensor]:
    out, lse, *_ = torch.ops.aten._scaled_dot_product_flash_attention(
        q_BHSD, k_BHTD, v_BHTD, 0.0, causal, False, scale=scale
    )
    return out, lse


def _flash_backward(
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
    # dense (non-varlen) call: cum_seq_q/k undefined (None), no dropout so the RNG state is unused
    rng = torch.empty(2, dtype=torch.int64, device=q_BHSD.device)
    return torch.ops.aten._scaled_dot_product_flash_attention_backward(
        do_BHSD.to(dt),
        q_BHSD,
        k_BHTD,
        v_BHTD,
        o_BHSD.to(dt),
        lse_BHS,
        None,
        None,
        q_BHSD.shape[2],
        k_BHTD.shape[2],
        0.0,
        causal,
        rng,
        rng[:1],
        scale=scale,
    )


# ---- PyTorch CUDA memory-efficient --------------------------------------------------------------
def _efficient_forward(
    q_BHSD: Tensor, k_BHTD: Tensor, v_BHTD: Tensor, causal: bool, scale: float
) -> tuple[Tensor, Tensor]:
    out, lse, _, _ = torch.ops.aten._scaled_dot_product_efficient_attention(
        q_BHSD, k_BHTD, v_BHTD, None, True, 0.0, causal, scale=scale
    )
    return out, lse[..., : q_BHSD.shape[2]]  # the kernel pads the LSE rows to a multiple of 32


def _efficient_backward(
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
        do_BHSD.to(dt),
        q_BHSD,
        k_BHTD,
        v_BHTD,
        None,
        o_BHSD.to(dt),
        lse_pad,
        seed,
        seed,
        0.0,
        [True, True, True, False],
        causal,
        scale=scale,
    )
    return dq, dk, dv


# ---- flash-attn (optional package) --------------------------------------------------------------
def _flash_attn_call(fn: Callable[..., Any], positional: dict[str, Any], **options: Any) -> Any:
    """Call a flash_attn private function with the keywords its installed version accepts."""
    params = inspect.signature(fn).parameters
    kw = dict(positional)
    if "window_size" in params:
        kw["window_size"] = (-1, -1)
    else:
        kw.update(window_size_left=-1, window_size_right=-1)
    for name, value in options.items():
        if name in params:
            kw[name] = value
    return fn(**{k: v for k, v in kw.items() if k in params})


def _flash_attn_forward(
    q_BHSD: Tensor, k_BHTD: Tensor, v_BHTD: Tensor, causal: bool, scale: float
) -> tuple[Tensor, Tensor]:
    from flash_attn.flash_attn_interface import _flash_attn_forward as fwd

    q, k, v = (
        x.transpose(1, 2) for x in (q_BHSD, k_BHTD, v_BHTD)
    )  # [B, S, H, D], last dim contiguous
    res = _flash_attn_call(
        fwd,
        dict(q=q, k=k, v=v, dropout_p=0.0, softmax_scale=scale, causal=causal),
        softcap=0.0,
        alibi_slopes=None,
        return_softmax=False,
    )
    out, lse = (res[0], res[1]) if len(res) == 4 else (res[0], res[5])  # 2.6+: 4 results; 2.5: 8
    return out.transpose(1, 2), lse


def _flash_attn_backward(
    do_BHSD: Tensor,
    q_BHSD: Tensor,
    k_BHTD: Tensor,
    v_BHTD: Tensor,
    o_BHSD: Tensor,
    lse_BHS: Tensor,
    causal: bool,
    scale: float,
) -> tuple[Tensor, Tensor, Tensor]:
    from flash_attn.flash_attn_interface import _flash_attn_backward as bwd

    dt = q_BHSD.dtype
    q, k, v = (x.transpose(1, 2) for x in (q_BHSD, k_BHTD, v_BHTD))
    do, o = do_BHSD.to(dt).transpose(1, 2).contiguous(), o_BHSD.to(dt).transpose(1, 2).contiguous()
    dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
    _flash_attn_call(
        bwd,
        dict(
            dout=do,
            q=q,
            k=k,
            v=v,
            out=o,
            softmax_lse=lse_BHS,
            dq=dq,
            dk=dk,
            dv=dv,
            dropout_p=0.0,
            softmax_scale=scale,
            causal=causal,
        ),
        softcap=0.0,
        alibi_slopes=None,
        deterministic=False,
        rng_state=None,
    )
    return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)


_FORWARD = {
    Kernel.REFERENCE: _reference_forward,
    Kernel.CPU_FLASH: _cpu_forward,
    Kernel.FLASH: _flash_forward,
    Kernel.EFFICIENT: _efficient_forward,
    Kernel.FLASH_ATTN: _flash_attn_forward,
}
_BACKWARD = {
    Kernel.REFERENCE: _reference_backward,
    Kernel.CPU_FLASH: _cpu_backward,
    Kernel.FLASH: _flash_backward,
    Kernel.EFFICIENT: _efficient_backward,
    Kernel.FLASH_ATTN: _flash_attn_backward,
}


# ---- merge ------------------------------------------------------------------------------------
def merge_into(
    out_SBHD: Tensor, lse_SBH: Tensor, blk_out_SBHD: Tensor, blk_lse_SBH: Tensor
) -> tuple[Tensor, Tensor]:
    """Merge a block's (out, lse) into the running (out, lse), both with finite LSE (every block the
    schedule computes has at least one visible key per row). Returns the new (out, lse) in the
    running tensors' dtype."""
    new_lse = torch.logaddexp(lse_SBH, blk_lse_SBH.to(lse_SBH.dtype))
    out = (
        out_SBHD * torch.exp(lse_SBH - new_lse)[..., None]
        + blk_out_SBHD.to(out_SBHD.dtype)
        * torch.exp(blk_lse_SBH.to(lse_SBH.dtype) - new_lse)[..., None]
    )
    return out, new_lse
