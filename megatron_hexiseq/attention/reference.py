"""Single-device causal attention (GQA/MQA): the numerical oracle of every test.

Legend: S = full sequence, B = micro-batch, H = query heads, G = K/V heads, D = head dim.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor


def reference_attention(
    q_full: Tensor,
    k_full: Tensor,
    v_full: Tensor,
    softmax_scale: float | None = None,
    cu_seqlens: Sequence[int] | Sequence[Sequence[int]] | None = None,
) -> Tensor:
    """``q [S, B, H, D]``, ``k, v [S, B, G, D]`` -> ``[S, B, H * D]``: causal softmax attention.

    Plain autograd ops (matmul, mask, softmax) in the input dtype; query head h reads K/V head
    ``h // (H / G)``. ``cu_seqlens``: document boundaries ``[0, ..., S]`` (one list, or one per
    sample); a query then sees only keys of its own document (a dense ``[B, S, S]`` mask: the oracle).
    """
    S, B, H, D = q_full.shape
    G = k_full.shape[2]
    if H % G:
        raise ValueError(f"query heads {H} must be a multiple of K/V heads {G}")
    scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(D)
    q_BHSD = q_full.permute(1, 2, 0, 3)
    k_BHSD = k_full.repeat_interleave(H // G, dim=2).permute(1, 2, 0, 3)
    v_BHSD = v_full.repeat_interleave(H // G, dim=2).permute(1, 2, 0, 3)
    s_BHSS = torch.matmul(q_BHSD, k_BHSD.transpose(-1, -2)) * scale
    mask_BHSS = torch.ones(S, S, dtype=torch.bool, device=q_full.device).tril()[None, None]
    if cu_seqlens is not None:
        if isinstance(cu_seqlens[0], Sequence):
            lists = [[int(x) for x in cu_seqlens[b]] for b in range(B)]  # type: ignore[union-attr]
        else:
            lists = [[int(x) for x in cu_seqlens]] * B  # type: ignore[arg-type]
        doc_BS = torch.stack([_document_ids(b, S) for b in lists]).to(q_full.device)
        mask_BHSS = mask_BHSS & (doc_BS[:, None, :, None] == doc_BS[:, None, None, :])
    p_BHSS = torch.softmax(s_BHSS.masked_fill(~mask_BHSS, float("-inf")), dim=-1)
    out_BHSD = torch.matmul(p_BHSS, v_BHSD)
    return out_BHSD.permute(2, 0, 1, 3).reshape(S, B, H * D)


def _document_ids(bounds: list[int], S: int) -> Tensor:
    """``[S]``: the index of the document each position belongs to."""
    assert bounds[0] == 0 and bounds[-1] == S, (bounds, S)
    ids = torch.zeros(S, dtype=torch.long)
    for i, b in enumerate(bounds[1:-1], start=1):
        ids[b:] = i
    return ids
