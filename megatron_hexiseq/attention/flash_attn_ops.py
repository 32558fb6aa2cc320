"""The optional ``flash_attn`` package (FlashAttention-2) as a block kernel, for versions 2.5-2.8.

Legend as in ``kernel_ops.py``: ``q [B, H, S, D]``, ``k, v [B, G, T, D]`` views (native GQA: query
head h reads K/V head ``h // (H / G)``); flash-attn itself takes ``[B, S, H, D]`` with a contiguous
last dim, which a transpose of these views is.

``flash_attn.flash_attn_interface._flash_attn_forward`` / ``_flash_attn_backward`` are private and
changed between releases; from 2.7 they are ``torch.library.custom_op`` objects whose Python
signature reads ``(*args, **kwargs)``, so nothing can be learnt from ``inspect.signature``. They are
called positionally, in the form of the installed ``flash_attn.__version__`` (read from the sources
at each tag):

- 2.5.x: ``fwd(q, k, v, dropout_p, softmax_scale, causal, window_size, alibi_slopes, return_softmax)
  -> (out, q, k, v, out_padded, softmax_lse, S_dmask, rng_state)``;
  ``bwd(dout, q, k, v, out, softmax_lse, dq, dk, dv, dropout_p, softmax_scale, causal, window_size,
  alibi_slopes, deterministic, rng_state=None) -> (dq, dk, dv, softmax_d)``;
- 2.6.x: as 2.5 with ``softcap`` after ``window_size`` in both;
- 2.7.x, 2.8.x: ``window_size_left, window_size_right`` instead of ``window_size``,
  ``fwd(...) -> (out, softmax_lse, S_dmask, rng_state)``, ``bwd(...)`` fills dq/dk/dv in place and
  returns ``softmax_d``.
Other versions are refused with one line by ``resolve_version``.
"""

from __future__ import annotations

import re
from typing import Any, NamedTuple

import torch
from torch import Tensor

from megatron_hexiseq.errors import HexiSeqError

SUPPORTED = ((2, 5), (2, 6), (2, 7), (2, 8))
NO_WINDOW = -1  # flash-attn's "no sliding window" on either side


class FlashAttnApi(NamedTuple):
    """The installed flash-attn's two private functions and its (major, minor) version."""

    version: tuple[int, int]
    forward: Any
    backward: Any


def parse_version(text: str) -> tuple[int, int]:
    """``"2.7.4.post1"`` -> ``(2, 7)``; anything unreadable is ``(0, 0)``."""
    m = re.match(r"(\d+)\.(\d+)", text)
    return (int(m.group(1)), int(m.group(2))) if m else (0, 0)


def resolve_version(text: str) -> tuple[int, int]:
    """The (major, minor) of a supported flash-attn version, or one ``HexiSeqError`` line."""
    version = parse_version(text)
    if version not in SUPPORTED:
        raise HexiSeqError(
            f"flash-attn {text} is not supported by --hexiseq-kernel flash-attn (2.5 to 2.8 are); "
            "install one of those or use --hexiseq-kernel auto"
        )
    return version


def load_api() -> FlashAttnApi:
    """Import the installed flash-attn (``HexiSeqError`` when missing or of another version)."""
    try:
        import flash_attn
        from flash_attn import flash_attn_interface as fa
    except ImportError as e:
        raise HexiSeqError(
            f"--hexiseq-kernel flash-attn needs the flash_attn package ({e}); "
            "install flash-attn 2.5-2.8 or use --hexiseq-kernel auto"
        ) from None
    return FlashAttnApi(
        resolve_version(getattr(flash_attn, "__version__", "unknown")),
        fa._flash_attn_forward,
        fa._flash_attn_backward,
    )


def _window(version: tuple[int, int]) -> tuple[Any, ...]:
    """The window argument(s) at their place: one tuple before 2.7, two ints from 2.7."""
    return ((NO_WINDOW, NO_WINDOW),) if version < (2, 7) else (NO_WINDOW, NO_WINDOW)


def _softcap(version: tuple[int, int]) -> tuple[float, ...]:
    return () if version < (2, 6) else (0.0,)


def flash_attn_forward(
    q_BHSD: Tensor, k_BGTD: Tensor, v_BGTD: Tensor, causal: bool, scale: float
) -> tuple[Tensor, Tensor]:
    api = load_api()
    q, k, v = (x.transpose(1, 2) for x in (q_BHSD, k_BGTD, v_BGTD))  # [B, S, H, D]
    args = (q, k, v, 0.0, scale, causal, *_window(api.version), *_softcap(api.version), None, False)
    res = api.forward(*args)  # alibi_slopes=None, return_softmax=False
    out, lse = (res[0], res[5]) if api.version < (2, 7) else (res[0], res[1])
    return out.transpose(1, 2), lse


def flash_attn_backward(
    do_BHSD: Tensor,
    q_BHSD: Tensor,
    k_BGTD: Tensor,
    v_BGTD: Tensor,
    o_BHSD: Tensor,
    lse_BHS: Tensor,
    causal: bool,
    scale: float,
) -> tuple[Tensor, Tensor, Tensor]:
    api = load_api()
    dt = q_BHSD.dtype
    q, k, v = (x.transpose(1, 2) for x in (q_BHSD, k_BGTD, v_BGTD))  # [B, S, H, D]
    do, o = (x.to(dt).transpose(1, 2) for x in (do_BHSD, o_BHSD))
    dq, dk, dv = (torch.empty(x.shape, dtype=dt, device=x.device) for x in (q, k, v))
    api.backward(
        do,
        q,
        k,
        v,
        o,
        lse_BHS.float().contiguous(),
        dq,
        dk,
        dv,
        0.0,
        scale,
        causal,
        *_window(api.version),
        *_softcap(api.version),
        None,  # alibi_slopes
        False,  # deterministic
        None,  # rng_state (no dropout)
    )
    return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)
