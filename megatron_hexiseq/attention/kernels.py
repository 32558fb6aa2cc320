"""Block attention kernels with log-sum-exp, their recompute backward, and the LSE merge.

Legend: S = query tokens of the block, T = key tokens of the block, B = micro-batch, H = query
heads of this rank, G = K/V heads of this rank, D = head dim. ``kv_of_head_H[h]`` is the index (into
the G K/V heads) that query head h reads (GQA/MQA). Masks come from global token positions
``q_pos_S`` / ``k_pos_T``: key t is visible to query s iff ``k_pos[t] <= q_pos[s]``.

A block is one of: *causal* (queries and keys are the same position-sorted tokens: key j visible to
query i iff j <= i, the fused kernels' ``is_causal``), *full* (every key visible to every query: no
mask), *partial* (a boolean mask), *empty* (never called: the schedule neither sends nor computes
it). The caller knows which from the layout (Python integers), so no device synchronisation is
needed to decide.

Rows with no visible key in a partial block get ``out = 0`` and ``lse = -inf``, so that merging
them changes nothing. Every query row sees at least itself in its group's local block, so the
merged LSE is always finite; the backward recomputes ``P = exp(S - LSE_final)`` per block with the
final output and LSE (``dS = P * (dP - rowsum(dO * O))``).

Kernels (explicit argument ``kernel``):
- ``"reference"``: matmul + mask + logsumexp in pure PyTorch, any dtype, any device (the oracle).
- ``"sdpa"``: PyTorch's fused flash kernel for CPU
  (``aten._scaled_dot_product_flash_attention_for_cpu`` and its ``_backward``, which take the
  final ``out``/``logsumexp``). CPU tensors only: the CUDA fused ops (efficient/flash attention
  with LSE) are not wired yet because they could not be validated without a GPU; on CUDA use
  ``"reference"`` (a clear error says so).
"""
from __future__ import annotations

import torch
from torch import Tensor

KERNELS = ("reference", "sdpa")


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulation dtype for outputs/LSE/gradients: at least float32."""
    return torch.promote_types(dtype, torch.float32)


def visible_mask(q_pos_S: Tensor, k_pos_T: Tensor) -> Tensor:
    """[S], [T] -> bool [S, T], True where the key is causally visible to the query."""
    return k_pos_T[None, :] <= q_pos_S[:, None]


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


def _check_cpu(x: Tensor) -> None:
    if x.device.type != "cpu":
        raise ValueError(f"attention kernel 'sdpa' runs on CPU tensors only (got {x.device.type}); "
                         "use kernel='reference' on this device")


# ---- forward ----------------------------------------------------------------------------------
def _causal_mask(q_SBHD: Tensor, k_TBGD: Tensor) -> Tensor:
    S, T = q_SBHD.shape[0], k_TBGD.shape[0]
    assert S == T, "a causal block pairs the same tokens as queries and keys"
    return torch.ones(S, T, dtype=torch.bool, device=q_SBHD.device).tril()


def block_forward(q_SBHD: Tensor, k_TBGD: Tensor, v_TBGD: Tensor, *, mask_ST: Tensor | None,
                  kv_of_head_H: Tensor | None, scale: float, kernel: str,
                  causal: bool = False) -> tuple[Tensor, Tensor]:
    """Attention of one (query block, key block) pair.

    Returns ``out [S, B, H, D]`` (accumulation dtype) and ``lse [S, B, H]`` (accumulation dtype);
    ``mask_ST`` None means the block is full, or causal when ``causal``.
    """
    if kernel == "reference":
        mask_ST = _causal_mask(q_SBHD, k_TBGD) if causal else mask_ST
        return _reference_forward(q_SBHD, k_TBGD, v_TBGD, mask_ST, kv_of_head_H, scale)
    if kernel == "sdpa":
        _check_cpu(q_SBHD)
        return _sdpa_forward(q_SBHD, k_TBGD, v_TBGD, mask_ST, kv_of_head_H, scale, causal)
    raise ValueError(f"unknown attention kernel {kernel!r}; choose one of {', '.join(KERNELS)}")


def _reference_forward(q_SBHD, k_TBGD, v_TBGD, mask_ST, kv_of_head_H, scale):
    acc = acc_dtype(q_SBHD.dtype)
    q_BHSD = q_SBHD.permute(1, 2, 0, 3).to(acc)
    k_BHTD = _expand_kv(k_TBGD, kv_of_head_H).to(acc)
    v_BHTD = _expand_kv(v_TBGD, kv_of_head_H).to(acc)
    s_BHST = torch.matmul(q_BHSD, k_BHTD.transpose(-1, -2)) * scale
    if mask_ST is not None:
        s_BHST = s_BHST.masked_fill(~mask_ST, float("-inf"))
    lse_BHS = torch.logsumexp(s_BHST, dim=-1)
    safe_BHS = torch.where(torch.isinf(lse_BHS), torch.zeros_like(lse_BHS), lse_BHS)
    p_BHST = torch.exp(s_BHST - safe_BHS[..., None])  # masked entries: exp(-inf) = 0
    out_BHSD = torch.matmul(p_BHST, v_BHTD)
    return out_BHSD.permute(2, 0, 1, 3), lse_BHS.permute(2, 0, 1)


def _float_mask(mask_ST: Tensor | None, like: Tensor) -> Tensor | None:
    if mask_ST is None:
        return None
    return torch.zeros(mask_ST.shape, dtype=like.dtype, device=like.device).masked_fill_(~mask_ST, float("-inf"))


def _sdpa_forward(q_SBHD, k_TBGD, v_TBGD, mask_ST, kv_of_head_H, scale, causal):
    acc = acc_dtype(q_SBHD.dtype)
    q_BHSD = q_SBHD.permute(1, 2, 0, 3).contiguous()
    k_BHTD = _expand_kv(k_TBGD, kv_of_head_H).contiguous()
    v_BHTD = _expand_kv(v_TBGD, kv_of_head_H).contiguous()
    bias_ST = _float_mask(mask_ST, q_BHSD)
    out_BHSD, lse_BHS = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q_BHSD, k_BHTD, v_BHTD, 0.0, causal, attn_mask=bias_ST, scale=scale)
    lse_BHS = lse_BHS.to(acc)
    if mask_ST is not None:  # the fused kernels report lse 0 for rows with no visible key
        lse_BHS = lse_BHS.masked_fill(~mask_ST.any(dim=1), float("-inf"))
    return out_BHSD.permute(2, 0, 1, 3).to(acc), lse_BHS.permute(2, 0, 1)


# ---- backward ---------------------------------------------------------------------------------
def block_backward(dout_SBHD: Tensor, q_SBHD: Tensor, k_TBGD: Tensor, v_TBGD: Tensor, out_SBHD: Tensor,
                   lse_SBH: Tensor, delta_SBH: Tensor, *, mask_ST: Tensor | None,
                   kv_of_head_H: Tensor | None, scale: float, kernel: str,
                   causal: bool = False) -> tuple[Tensor, Tensor, Tensor]:
    """Recompute backward of one block with the FINAL (merged) ``out`` and ``lse``.

    ``delta_SBH = rowsum(dout * out)``. Returns ``dq [S, B, H, D]``, ``dk, dv [T, B, G, D]`` in the
    accumulation dtype.
    """
    if kernel == "reference":
        mask_ST = _causal_mask(q_SBHD, k_TBGD) if causal else mask_ST
        return _reference_backward(dout_SBHD, q_SBHD, k_TBGD, v_TBGD, lse_SBH, delta_SBH, mask_ST,
                                   kv_of_head_H, scale)
    if kernel == "sdpa":
        _check_cpu(q_SBHD)
        return _sdpa_backward(dout_SBHD, q_SBHD, k_TBGD, v_TBGD, out_SBHD, lse_SBH, mask_ST,
                              kv_of_head_H, scale, causal)
    raise ValueError(f"unknown attention kernel {kernel!r}; choose one of {', '.join(KERNELS)}")


def _reference_backward(dout_SBHD, q_SBHD, k_TBGD, v_TBGD, lse_SBH, delta_SBH, mask_ST, kv_of_head_H, scale):
    acc = acc_dtype(q_SBHD.dtype)
    num_kv = k_TBGD.shape[2]
    q_BHSD = q_SBHD.permute(1, 2, 0, 3).to(acc)
    do_BHSD = dout_SBHD.permute(1, 2, 0, 3).to(acc)
    k_BHTD = _expand_kv(k_TBGD, kv_of_head_H).to(acc)
    v_BHTD = _expand_kv(v_TBGD, kv_of_head_H).to(acc)
    s_BHST = torch.matmul(q_BHSD, k_BHTD.transpose(-1, -2)) * scale
    if mask_ST is not None:
        s_BHST = s_BHST.masked_fill(~mask_ST, float("-inf"))
    p_BHST = torch.exp(s_BHST - lse_SBH.permute(1, 2, 0)[..., None])
    dv_BHTD = torch.matmul(p_BHST.transpose(-1, -2), do_BHSD)
    dp_BHST = torch.matmul(do_BHSD, v_BHTD.transpose(-1, -2))
    ds_BHST = p_BHST * (dp_BHST - delta_SBH.permute(1, 2, 0)[..., None])
    dq_BHSD = torch.matmul(ds_BHST, k_BHTD) * scale
    dk_BHTD = torch.matmul(ds_BHST.transpose(-1, -2), q_BHSD) * scale
    return (dq_BHSD.permute(2, 0, 1, 3), _reduce_kv(dk_BHTD, kv_of_head_H, num_kv),
            _reduce_kv(dv_BHTD, kv_of_head_H, num_kv))


def _sdpa_backward(dout_SBHD, q_SBHD, k_TBGD, v_TBGD, out_SBHD, lse_SBH, mask_ST, kv_of_head_H, scale, causal):
    acc = acc_dtype(q_SBHD.dtype)
    num_kv = k_TBGD.shape[2]
    q_BHSD = q_SBHD.permute(1, 2, 0, 3).contiguous()
    k_BHTD = _expand_kv(k_TBGD, kv_of_head_H).contiguous()
    v_BHTD = _expand_kv(v_TBGD, kv_of_head_H).contiguous()
    do_BHSD = dout_SBHD.permute(1, 2, 0, 3).to(q_SBHD.dtype).contiguous()
    o_BHSD = out_SBHD.permute(1, 2, 0, 3).to(q_SBHD.dtype).contiguous()
    bias_ST = _float_mask(mask_ST, q_BHSD)
    lse_BHS = lse_SBH.permute(1, 2, 0).to(acc).contiguous()
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        do_BHSD, q_BHSD, k_BHTD, v_BHTD, o_BHSD, lse_BHS, 0.0, causal, attn_mask=bias_ST, scale=scale)
    return (dq.permute(2, 0, 1, 3).to(acc), _reduce_kv(dk.to(acc), kv_of_head_H, num_kv),
            _reduce_kv(dv.to(acc), kv_of_head_H, num_kv))


# ---- merge ------------------------------------------------------------------------------------
def merge_into(out_SBHD: Tensor, lse_SBH: Tensor, blk_out_SBHD: Tensor, blk_lse_SBH: Tensor) -> tuple[Tensor, Tensor]:
    """Merge a block's (out, lse) into the running (out, lse); ``lse`` must be finite or -inf rows
    in the block only. Returns the new (out, lse)."""
    new_lse = torch.logaddexp(lse_SBH, blk_lse_SBH)
    out = out_SBHD * torch.exp(lse_SBH - new_lse)[..., None] + blk_out_SBHD * torch.exp(blk_lse_SBH - new_lse)[..., None]
    return out, new_lse
