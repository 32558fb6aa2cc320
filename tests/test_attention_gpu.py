"""Layer (c): GPU-only checks of the attention kernels (skipped without CUDA).

Each CUDA kernel (cudnn and flash where they apply, efficient, and flash-attn when installed) is
run on a square causal block and a non-square full block with two GQA maps (aligned: one call;
unaligned: two calls) in every dtype it takes, forward and recompute backward, against
the reference kernel in float64 on the same rounded inputs, with the normwise bounds of
``kernel_check`` (derived from the dtype's unit roundoff); ``auto`` must pass its start-up check;
and a received block's peak memory must grow linearly with the key count (no [S, T] tensor).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from megatron_hexiseq.attention.kernel_check import (
    BACKWARD_ROUNDINGS,
    FORWARD_ROUNDINGS,
    LSE_ROUNDINGS,
    check_kernel,
    normwise_bound,
    normwise_error,
)
from megatron_hexiseq.attention.kernels import (
    Kernel,
    block_backward,
    block_forward,
    cudnn_applies,
    kv_map,
)

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

CASES = [
    (Kernel.FLASH, torch.bfloat16),
    (Kernel.FLASH, torch.float16),
    (Kernel.EFFICIENT, torch.bfloat16),
    (Kernel.EFFICIENT, torch.float16),
    (Kernel.EFFICIENT, torch.float32),
]
if torch.cuda.is_available() and cudnn_applies(torch.device("cuda"), torch.bfloat16, 128):
    CASES += [(Kernel.CUDNN, torch.bfloat16), (Kernel.CUDNN, torch.float16)]
if importlib.util.find_spec("flash_attn") is not None:
    CASES += [(Kernel.FLASH_ATTN, torch.bfloat16)]
MAPS = {"aligned": (0, 0, 1, 1), "unaligned": (0, 1, 1, 1)}


def _run(kernel, q, k, v, dout, causal, dtype, of_head=MAPS["aligned"]):
    kw = dict(
        causal=causal,
        kv_of_head_H=kv_map(of_head, 2),
        scale=q.shape[-1] ** -0.5,
        kernel=kernel,
    )
    out, lse = block_forward(q, k, v, **kw)
    final = out if kernel is Kernel.REFERENCE else out.to(dtype)
    return (out, lse, *block_backward(dout, q, k, v, final, lse, **kw))


@pytest.mark.parametrize("kernel,dtype", CASES)
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("heads", list(MAPS))
def test_cuda_kernels_match_float64_reference(
    kernel: Kernel, dtype: torch.dtype, causal: bool, head_dim: int, heads: str
) -> None:
    gen = torch.Generator().manual_seed(0)
    S, T, B = 200, (200 if causal else 333), 2
    q = torch.randn(S, B, 4, head_dim, generator=gen).to(dtype).cuda()
    k, v = (torch.randn(T, B, 2, head_dim, generator=gen).to(dtype).cuda() for _ in range(2))
    dout = torch.randn(S, B, 4, head_dim, generator=gen).to(dtype).cuda()
    got = _run(kernel, q, k, v, dout, causal, dtype, MAPS[heads])
    want = _run(
        Kernel.REFERENCE,
        *(x.double() for x in (q, k, v, dout)),
        causal,
        torch.float64,
        MAPS[heads],
    )
    for name, g, w, r in zip(
        ("out", "lse", "dq", "dk", "dv"),
        got,
        want,
        (FORWARD_ROUNDINGS, LSE_ROUNDINGS, *(BACKWARD_ROUNDINGS,) * 3),
    ):
        err, bound = (
            normwise_error(g, w),
            normwise_bound(dtype, roundings=r, reduction=T, device=q.device),
        )
        assert err <= bound, (
            f"{kernel.value} {dtype} {name}: normwise error {err:.3g} > {bound:.3g}"
        )


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_auto_passes_its_start_up_check(dtype: torch.dtype) -> None:
    kernel = check_kernel("auto", device=torch.device("cuda"), dtype=dtype, head_dim=128)
    hopper = torch.cuda.get_device_capability()[0] == 9
    cudnn = (torch.backends.cudnn.version() or 0) > 91500
    half = Kernel.CUDNN if hopper and cudnn else Kernel.FLASH
    assert kernel is (Kernel.EFFICIENT if dtype == torch.float32 else half)


def test_received_block_memory_is_linear_in_keys() -> None:
    """Peak extra memory of one full block fwd+bwd at T and 4T keys: ratio ~4 (S*T would be 16)."""

    def peak(T: int) -> int:
        q = torch.randn(1024, 1, 8, 128, device="cuda", dtype=torch.bfloat16)
        k, v = (torch.randn(T, 1, 8, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        kw = dict(causal=False, kv_of_head_H=None, scale=128**-0.5, kernel=Kernel.FLASH)
        out, lse = block_forward(q, k, v, **kw)
        block_backward(torch.ones_like(q), q, k, v, out, lse, **kw)
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - base

    small, large = peak(8192), peak(32768)
    assert large / small < 6, (small, large)
