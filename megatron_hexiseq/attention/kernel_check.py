"""Start-up proof of a block kernel on the real device and dtype, and the tolerances it uses.

``check_kernel(kernel, device=..., dtype=..., head_dim=...)`` runs one tiny forward+backward of a
square causal block and of a non-square full block with the chosen kernel, each with two head maps
(GQA, four query heads on two K/V heads: aligned 2 + 2, one kernel call; and 1 + 3, two calls as an
unaligned head range makes them), and compares them with the reference kernel evaluated in float64 on the same
(already rounded) inputs. Any exception or a normwise error above the dtype's bound is one
``HexiSeqError`` line naming the kernel, device, dtype and head dim, and what to do.

Tolerances (``normwise_bound``) are normwise relative errors ``||got - want|| / ||want||`` derived
from the unit roundoff u of the dtype (``finfo.eps / 2``) and the number of roundings to that dtype
on the kernel's path; float32 accumulation inside the kernels (error ~ n * 2^-24 for a reduction of
n terms) is far below u for bf16/fp16 and is counted for float32/float64 with the reduction length:
- forward output: P rounded to the dtype before P @ V, the block output rounded, the final output
  rounded: 3 roundings;
- LSE: kept in float32, but the fused kernels' fast exp/log on reduced-precision inputs are worth
  about one rounding of the input dtype (measured on CPU: 1.2e-5 for bf16, far below u = 3.9e-3);
- gradients: delta = rowsum(dO * O) with O rounded (above), P and dS rounded before their matmuls,
  each gradient rounded once more, and dK/dV rounded for the wire: about 4 roundings, times 2 for
  the cancellation in dP - delta (both terms are O(|dO| |V|)): 8.
The bounds add a factor 2 of headroom over these counts. Measured on CPU (cpu-flash, head dims 16 and
128): bf16 out 2e-3 (bound 2.3e-2), gradients 3e-3 (bound 6.3e-2); a wrong block (a missing or extra
key) gives errors of order 1e-2 and more.
"""

from __future__ import annotations

import torch
from torch import Tensor

from megatron_hexiseq.attention.kernels import (
    Kernel,
    KVMap,
    block_backward,
    block_forward,
    kv_map,
    resolve_kernel,
)
from megatron_hexiseq.errors import HexiSeqError

FORWARD_ROUNDINGS = 3
LSE_ROUNDINGS = 1
BACKWARD_ROUNDINGS = 8


TF32_UNIT_ROUNDOFF = 2.0**-11  # 10 explicit mantissa bits


def unit_roundoff(dtype: torch.dtype, device: torch.device | None = None) -> float:
    """u of the arithmetic a kernel does in ``dtype``: float32 on CUDA counts as TF32 (the fused
    kernels may use TF32 tensor cores for float32 inputs)."""
    if dtype == torch.float32 and device is not None and device.type == "cuda":
        return TF32_UNIT_ROUNDOFF
    return torch.finfo(dtype).eps / 2


def normwise_bound(
    dtype: torch.dtype, *, roundings: int, reduction: int, device: torch.device | None = None
) -> float:
    """Normwise relative error bound of an attention result in ``dtype`` (see module docstring)."""
    acc = torch.float64 if dtype == torch.float64 else torch.float32  # accumulation is never TF32
    return 2 * (roundings * unit_roundoff(dtype, device) + reduction * unit_roundoff(acc))


def normwise_error(got: Tensor, want: Tensor) -> float:
    """``||got - want|| / ||want||`` in float64 (0 when both are zero)."""
    got, want = got.double(), want.double()
    norm = torch.linalg.vector_norm(want).item()
    diff = torch.linalg.vector_norm(got - want).item()
    return diff / norm if norm else diff


def _inputs(
    dtype: torch.dtype, device: torch.device, head_dim: int, S: int, T: int
) -> list[Tensor]:
    gen = torch.Generator().manual_seed(0)
    shapes = [
        (S, 1, 4, head_dim),
        (T, 1, 2, head_dim),
        (T, 1, 2, head_dim),
        (S, 1, 4, head_dim),
    ]  # q, k, v, dout
    return [torch.randn(*s, generator=gen).to(dtype).to(device) for s in shapes]


def _run(
    kernel: Kernel,
    q,
    k,
    v,
    dout,
    *,
    causal: bool,
    kv_of_head: KVMap,
    scale: float,
    dtype: torch.dtype,
) -> tuple[Tensor, ...]:
    out, lse = block_forward(
        q, k, v, causal=causal, kv_of_head_H=kv_of_head, scale=scale, kernel=kernel
    )
    final = out.to(dtype) if kernel is not Kernel.REFERENCE else out
    grads = block_backward(
        dout,
        q,
        k,
        v,
        final,
        lse,
        causal=causal,
        kv_of_head_H=kv_of_head,
        scale=scale,
        kernel=kernel,
    )
    return (out, lse, *grads)


def check_kernel(
    kernel: str | Kernel, *, device: torch.device, dtype: torch.dtype, head_dim: int
) -> Kernel:
    """Resolve ``kernel`` for this device/dtype and prove it on two tiny blocks; returns the concrete
    kernel or raises one ``HexiSeqError`` line."""
    concrete = resolve_kernel(kernel, device=device, dtype=dtype, head_dim=head_dim)
    where = f"attention kernel '{concrete.value}' on {device} {str(dtype).replace('torch.', '')}, head dim {head_dim}"
    hint = "choose another --hexiseq-kernel (efficient, reference) or check the GPU software stack"
    S, T = 16, 40
    scale = head_dim**-0.5
    try:
        q, k, v, dout = _inputs(dtype, device, head_dim, S, T)
        for causal, keys, kv_of_head in (
            (True, S, kv_map((0, 0, 1, 1), 2)),
            (False, T, kv_map((0, 0, 1, 1), 2)),
            (True, S, kv_map((0, 1, 1, 1), 2)),
            (False, T, kv_map((0, 1, 1, 1), 2)),
        ):
            got = _run(
                concrete,
                q,
                k[:keys],
                v[:keys],
                dout,
                causal=causal,
                kv_of_head=kv_of_head,
                scale=scale,
                dtype=dtype,
            )
            want = _run(
                Kernel.REFERENCE,
                *(x.double() for x in (q, k[:keys], v[:keys], dout)),
                causal=causal,
                kv_of_head=kv_of_head,
                scale=scale,
                dtype=torch.float64,
            )
            for name, g, w, roundings in zip(
                ("out", "lse", "dq", "dk", "dv"),
                got,
                want,
                (FORWARD_ROUNDINGS, LSE_ROUNDINGS, *(BACKWARD_ROUNDINGS,) * 3),
            ):
                bound = normwise_bound(dtype, roundings=roundings, reduction=keys, device=device)
                err = normwise_error(g, w)
                if not torch.isfinite(g).all() or err > bound:
                    raise HexiSeqError(
                        f"{where} failed its start-up check: {name} of a "
                        f"{'causal' if causal else 'full'} block is off by {err:.3g} "
                        f"(bound {bound:.3g}); {hint}"
                    )
    except HexiSeqError:
        raise
    except Exception as e:  # any kernel failure becomes one line  # noqa: BLE001
        first = str(e).strip().splitlines()[0][:300] if str(e).strip() else type(e).__name__
        raise HexiSeqError(
            f"{where} failed its start-up check ({type(e).__name__}: {first}); {hint}"
        ) from None
    return concrete
