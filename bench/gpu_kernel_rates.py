"""Achieved matmul and attention rates of one GPU, per kernel and block size (JSON + markdown).

What the cost model's calibrated catalog and ``profile`` need from a real GPU, measured with CUDA
events (median of repeated calls after a warm-up, fresh random inputs, never zeros):

- ``matmul``: bf16 / fp16 GEMMs of Megatron layer shapes (tokens x hidden x ffn) and 8192^3;
  TFLOP/s = 2 M N K / time.
- ``attention``: each of PyTorch's CUDA attention kernels that runs here (``flash``, ``efficient``,
  ``cudnn``) called through the same aten ops the runtime calls, bf16 / fp16, head dim 64 / 128,
  causal (square) and full blocks, S = T from 128 to 32K tokens with H = 32 query heads, B = 1:
  forward and forward+backward TFLOP/s (causal counts half the pairs; backward 2.5x the forward's
  FLOPs, as FlashAttention's papers count).
- ``gqa``: whether each op accepts fewer K/V heads than query heads (H = 8, G = 2) and how far its
  output and gradients lie from float64 attention (normwise).
- ``varlen``: whether ``aten::_flash_attention_forward`` / ``_efficient_attention_forward`` take
  ``cu_seqlens`` (three packed documents, causal) and their error against float64.

    python bench/gpu_kernel_rates.py --out results/gpu_kernel_rates     # on a GPU
    python bench/gpu_kernel_rates.py --quick --out /tmp/r               # fewer sizes

The timing, the kernel calls and the FLOP count live in ``megatron_hexiseq/profile/kernels.py``
(``profile`` measures with the same code).
"""

from __future__ import annotations

import argparse
import math
import time
from typing import Any

import torch
from _common import write_outputs

from megatron_hexiseq.profile.kernels import (
    KERNEL_CALLS,
    attention_rates,
    measure_gemm,
)

KERNELS = KERNEL_CALLS


def measure_matmul(quick: bool) -> list[dict[str, Any]]:
    shapes = [(8192, 8192, 8192), (16384, 4096, 14336), (16384, 14336, 4096), (4096, 4096, 12288)]
    if quick:
        shapes = shapes[:2]
    rows = []
    for dtype in (torch.bfloat16, torch.float16):
        for M, K, N in shapes:
            rows.append(
                {"dtype": str(dtype).removeprefix("torch."), "M": M, "K": K, "N": N}
                | measure_gemm(dtype, M, K, N)
            )
    return rows


def measure_attention(quick: bool) -> list[dict[str, Any]]:
    H = 32
    sizes = [128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768]
    if quick:
        sizes = [256, 2048, 16384]
    rows = []
    for kname, fn in KERNELS.items():
        for dtype in (torch.bfloat16, torch.float16):
            for D in (128, 64):
                for causal in (True, False):
                    for S in sizes:
                        # the full grid on bf16 D=128; the rest at a few sizes
                        if (dtype, D) != (torch.bfloat16, 128) and S not in (512, 4096, 16384):
                            continue
                        row: dict[str, Any] = {
                            "kernel": kname,
                            "dtype": str(dtype).removeprefix("torch."),
                            "D": D,
                            "causal": causal,
                            "S": S,
                            "H": H,
                        }
                        row.update(attention_rates(fn, dtype, H, S, D, causal))
                        rows.append(row)
                        print(row, flush=True)
    return rows


def _ref(q, k, v, causal, scale):
    """float64 attention with K/V heads repeated: [B, H, S, D]."""
    r = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(r, 1), v.repeat_interleave(r, 1)
    s = (q @ k.transpose(-1, -2)) * scale
    if causal:
        S, T = s.shape[-2:]
        s = s.masked_fill(~torch.ones(S, T, dtype=torch.bool, device=s.device).tril(), -math.inf)
    return torch.softmax(s, -1) @ v


def _nw(a, b) -> float:
    return float((a.double() - b).norm() / b.norm())


def check_gqa() -> dict[str, Any]:
    out: dict[str, Any] = {}
    B, H, G, S, D = 2, 8, 2, 512, 128
    for kname, fn in KERNELS.items():
        for causal in (True, False):
            key = f"{kname}/{'causal' if causal else 'full'}"
            try:
                q = torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16)
                k, v = (torch.randn(B, G, S, D, device="cuda", dtype=torch.bfloat16) for _ in "kv")
                g = torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16)
                o = fn(q, k, v, causal, D**-0.5, None)
                dq, dk, dv = fn(q, k, v, causal, D**-0.5, g)[:3]
                qd, kd, vd = (x.double().requires_grad_() for x in (q, k, v))
                ref = _ref(qd, kd, vd, causal, D**-0.5)
                ref.backward(g.double())
                out[key] = {
                    "out": _nw(o, ref),
                    "dq": _nw(dq, qd.grad),
                    "dk": _nw(dk, kd.grad),
                    "dv": _nw(dv, vd.grad),
                    "dk_shape": list(dk.shape),
                }
            except Exception as e:  # noqa: BLE001
                out[key] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}
    return out


def check_varlen() -> dict[str, Any]:
    out: dict[str, Any] = {}
    H, G, D = 8, 2, 64
    lens = [100, 1, 411]
    total = sum(lens)
    cu = torch.tensor([0, 100, 101, 512], device="cuda", dtype=torch.int32)
    q = torch.randn(total, H, D, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(total, G, D, device="cuda", dtype=torch.bfloat16) for _ in "kv")
    g = torch.randn(total, H, D, device="cuda", dtype=torch.bfloat16)
    qd, kd, vd = (x.double().requires_grad_() for x in (q, k, v))
    parts = []
    for a, b in zip(cu.tolist(), cu.tolist()[1:]):
        parts.append(
            _ref(*(x[a:b].transpose(0, 1)[None] for x in (qd, kd, vd)), True, D**-0.5)[0].transpose(
                0, 1
            )
        )
    ref = torch.cat(parts)
    ref.backward(g.double())
    try:
        o, lse, rng, unused, _ = torch.ops.aten._flash_attention_forward(
            q, k, v, cu, cu, max(lens), max(lens), 0.0, True, False, scale=D**-0.5
        )
        dq, dk, dv = torch.ops.aten._flash_attention_backward(
            g,
            q,
            k,
            v,
            o,
            lse,
            cu,
            cu,
            max(lens),
            max(lens),
            0.0,
            True,
            rng,
            unused,
            scale=D**-0.5,
        )
        out["flash"] = {
            "out": _nw(o, ref),
            "dq": _nw(dq, qd.grad),
            "dk": _nw(dk, kd.grad),
            "dv": _nw(dv, vd.grad),
            "lse_shape": list(lse.shape),
        }
    except Exception as e:  # noqa: BLE001
        out["flash"] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}
    try:
        res = torch.ops.aten._efficient_attention_forward(
            q[None],
            k[None],
            v[None],
            None,
            cu,
            cu,
            max(lens),
            max(lens),
            0.0,
            1,
            True,
            scale=D**-0.5,
        )
        out["efficient"] = {"out": _nw(res[0][0], ref), "lse_shape": list(res[1].shape)}
    except Exception as e:  # noqa: BLE001
        out["efficient"] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"}
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--out", default="results/gpu_kernel_rates")
    a = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("gpu_kernel_rates: no CUDA GPU visible to torch")
    props = torch.cuda.get_device_properties(0)
    result: dict[str, Any] = {
        "device": props.name,
        "capability": list(torch.cuda.get_device_capability(0)),
        "sms": props.multi_processor_count,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version(),
        "schemas": {
            n: str(getattr(torch.ops.aten, n).default._schema)
            for n in (
                "_scaled_dot_product_cudnn_attention",
                "_scaled_dot_product_cudnn_attention_backward",
                "_flash_attention_forward",
                "_efficient_attention_forward",
            )
        },
    }
    for name, fn in (
        ("gqa", check_gqa),
        ("varlen", check_varlen),
        ("matmul", lambda: measure_matmul(a.quick)),
        ("attention", lambda: measure_attention(a.quick)),
    ):
        t0 = time.perf_counter()
        try:
            result[name] = fn()
        except Exception as e:  # noqa: BLE001
            result[name] = {"error": f"{type(e).__name__}: {e}"}
        print(f"{name}: {time.perf_counter() - t0:.1f} s", flush=True)
        if name in ("gqa", "varlen"):
            print(result[name], flush=True)
    lines = [
        "| kernel | dtype | D | mask | S | fwd TFLOP/s | fwd+bwd TFLOP/s |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in result.get("attention", []) if isinstance(result.get("attention"), list) else []:
        mask = "causal" if r["causal"] else "full"
        if "error" in r:
            lines.append(
                f"| {r['kernel']} | {r['dtype']} | {r['D']} | {mask} | {r['S']} | {r['error']} | |"
            )
        else:
            lines.append(
                f"| {r['kernel']} | {r['dtype']} | {r['D']} | {mask} | {r['S']} | "
                f"{r['fwd_tflops']:.0f} | {r['fwd_bwd_tflops']:.0f} |"
            )
    lines += ["", "| matmul dtype | M x K x N | TFLOP/s |", "|---|---|---|"]
    for r in result.get("matmul", []) if isinstance(result.get("matmul"), list) else []:
        lines.append(f"| {r['dtype']} | {r['M']} x {r['K']} x {r['N']} | {r['tflops']:.0f} |")
    write_outputs(
        a.out,
        "gpu_kernel_rates",
        data=result,
        title=f"Kernel rates on {props.name}",
        table="\n".join(lines),
    )
    print("\n".join(lines))


if __name__ == "__main__":
    main()
