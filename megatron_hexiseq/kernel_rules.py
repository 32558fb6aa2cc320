"""Which CUDA attention kernel takes which inputs, and which one ``auto`` picks: one rule for the
runtime (``attention/kernels.py``, from the live device) and the cost model (``costmodel/rates.py``,
from a GPU type's compute capability). No torch import: the planner uses it too.

The conditions are PyTorch 2.13's (``aten/src/ATen/native/transformers/cuda/sdp_utils.cpp``), for
training (forward and backward):
- flash: bf16/fp16, head dim a multiple of 8 and at most 256, compute capability 8.0-12.1, but not
  head dims 193-224 on sm 8.6/8.9/12.x (no backward there);
- cudnn: bf16/fp16, head dim a multiple of 8 and at most 128, cuDNN >= 9, compute capability
  8.0-12.1 (conservative: newer cuDNN takes 256 forward-only on sm 9.0/10.x);
- efficient: fp32/bf16/fp16, head dim a multiple of 8 (4 in fp32).
``auto``: cuDNN on compute capability 9.x where it applies (and cuDNN > 9.15, the version from which
torch prefers it; not in deterministic mode), else flash, else efficient. Measured on an H200
(docs/measured/h200-2026-12-04): cuDNN fwd+bwd 546 TFLOP/s at 32K tokens against flash's 324.

Packed documents (``VARLEN_KERNELS``): with ``flash`` or ``cudnn`` every block of a packed
micro-batch runs as PyTorch's variable-length flash call (``aten._flash_attention_forward``), one
call per block, never a dense call per document window. For ``cudnn`` that is a different kernel on
purpose: cuDNN builds an execution graph per distinct (q, k, v) shape and stride and keeps it for
the life of the process, and the window shapes of packed micro-batches change with every
micro-batch, so dense cuDNN calls would build graphs without end; flash's variable-length kernel
has no per-shape state. ``cudnn_takes`` implies ``flash_takes`` for every input, so the call
applies wherever cuDNN did.

``dtype`` is the short name: ``"bf16"``, ``"fp16"``, ``"fp32"``.
"""

from __future__ import annotations

CUDNN_MAX_HEAD_DIM = 128
CUDNN_PREFERRED_FROM = 91501  # torch prefers cuDNN SDPA only above 9.15 (seq len % 128 != 0 fix)

Capability = tuple[int, int]

VARLEN_KERNELS = ("flash", "cudnn")
"""Block kernels whose packed-document blocks run as one variable-length flash call per block."""


def capability_of(cc: float) -> Capability:
    """``8.9`` -> ``(8, 9)`` (a cluster spec's compute capability)."""
    major = int(cc)
    return major, round((cc - major) * 10)


def _half(dtype: str) -> bool:
    return dtype in ("bf16", "fp16")


def flash_takes(cc: Capability, dtype: str, head_dim: int) -> bool:
    """PyTorch's CUDA flash kernel, training."""
    if not _half(dtype) or head_dim % 8 or head_dim > 256 or not (8, 0) <= cc <= (12, 1):
        return False
    consumer = (8, 6) <= cc <= (8, 9) or cc[0] == 12
    return not (consumer and 192 < head_dim <= 224)


def cudnn_takes(cc: Capability, dtype: str, head_dim: int, cudnn_version: int) -> bool:
    """PyTorch's cuDNN attention, training (conservative)."""
    if not _half(dtype) or head_dim % 8 or head_dim > CUDNN_MAX_HEAD_DIM:
        return False
    return cudnn_version >= 90000 and (8, 0) <= cc <= (12, 1)


def efficient_takes(dtype: str, head_dim: int) -> bool:
    """PyTorch's memory-efficient kernel (its GEMM alignment)."""
    if dtype not in ("bf16", "fp16", "fp32"):
        return False
    return head_dim > 0 and head_dim % (8 if _half(dtype) else 4) == 0


def cudnn_preferred(
    cc: Capability, dtype: str, head_dim: int, cudnn_version: int, deterministic: bool = False
) -> bool:
    """Does ``auto`` pick cuDNN here?"""
    return (
        cc[0] == 9
        and cudnn_version >= CUDNN_PREFERRED_FROM
        and not deterministic
        and cudnn_takes(cc, dtype, head_dim, cudnn_version)
    )


def auto_kernel(
    cc: Capability, dtype: str, head_dim: int, cudnn_version: int, deterministic: bool = False
) -> str:
    """The kernel ``auto`` runs on a CUDA device: ``cudnn``, ``flash`` or ``efficient``."""
    if cudnn_preferred(cc, dtype, head_dim, cudnn_version, deterministic):
        return "cudnn"
    return "flash" if flash_takes(cc, dtype, head_dim) else "efficient"


def packed_kernel(kernel: str) -> str:
    """The kernel that runs a packed-document block when the block kernel is ``kernel``: ``flash``
    (its variable-length call) for ``flash`` and ``cudnn``, else ``kernel`` itself (one call per
    document window)."""
    return "flash" if kernel in VARLEN_KERNELS else kernel
