"""The ``pytest``, ``memory`` and ``throughput`` parts of the GPU check (``check.py`` runs them).

- pytest: the GPU test files (and their CPU twins) in a subprocess, under a break when asked.
- memory: first two 2-rank proofs (2K tokens, simulated ranks) against float64, one without and
  one with packed documents; then the peak extra CUDA memory of attention fwd+bwd (bf16, H = 32,
  G = 8, D = 128) at S = 8K / 16K / 32K for the local causal block (HexiSeq on a one-rank layout),
  a received block (S queries x S keys, the kernel call the runtime makes) and the packed path (the
  one-rank layout with documents): every growth per doubling < 3 (linear: 2; S^2: 4), and the
  packed path within 10% of the dense local block at the same tokens.
- throughput: the same two proofs; then HexiSeq fwd+bwd (one-rank layout, 32K tokens, H = 32 /
  G = 8, D = 128, bf16) against ``F.scaled_dot_product_attention(is_causal=True, enable_gqa=True)``
  (both results within twice the bf16 bound of each other), 5 timed repetitions after a warm-up:
  HexiSeq >= 0.9 x SDPA's tokens/s. The packed path's tokens/s on the same tokens is reported.
On CPU the memory and throughput parts run their proofs only (CPU has no memory counters, and
its SDPA speed says nothing of a GPU).
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
import time
from typing import Any

import torch
import torch.distributed as dist

from megatron_hexiseq.attention import build_hexiseq_groups, hexiseq_attn_func
from megatron_hexiseq.attention.kernels import Kernel, block_backward, block_forward, resolve_kernel
from megatron_hexiseq.layout import Layout, make_layout

from .sim import ROOT, Grads, compare, rank_inputs, reference_grads, sim_attention

PYTEST_FILES = [
    "tests/test_attention_sim_device.py",
    "tests/test_attention_gpu.py",
    "tests/test_attention_documents.py::test_varlen_path_emulated_on_cpu",
    "tests/test_attention_documents.py::test_flash_varlen_on_cuda",
    "tests/test_attention_documents.py::test_documents_end_to_end_flash_on_cuda",
    "tests/test_attention_batch_layouts.py::test_per_batch_layouts_bf16_cpu_flash",
    "tests/test_attention_batch_layouts.py::test_per_batch_layouts_flash_on_cuda",
]
PACKED_OVER_DENSE = 1.1  # the packed path's peak over the dense local block's, at most


def init_world(device: torch.device) -> None:
    """A real process group of one (NCCL on a GPU, gloo on CPU) on a free local port."""
    if dist.is_initialized():
        return
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(
        "nccl" if device.type == "cuda" else "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=0,
        world_size=1,
    )


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def one_rank_layout(S: int, H: int, G: int) -> Layout:
    return make_layout(
        seq_length=S,
        num_attention_heads=H,
        num_query_groups=G,
        group_sizes=[1],
        segments=[[(0, S)]],
        heads=[list(range(H))],
    )


def two_rank_layout(S: int, H: int, G: int) -> Layout:
    """Two groups of one rank: rank 1's queries receive rank 0's K/V (one received block)."""
    return make_layout(
        seq_length=S,
        num_attention_heads=H,
        num_query_groups=G,
        group_sizes=[1, 1],
        segments=[[(0, 3 * S // 8)], [(3 * S // 8, S)]],
        heads=[list(range(H)), list(range(H))],
    )


def documents_of(S: int, seed: int) -> list[int]:
    """Boundaries ``[0, ..., S]`` of documents with log-normal lengths (median S / 8, at least 16
    tokens, the last one cut at S)."""
    rng, bounds = random.Random(seed), [0]
    while bounds[-1] < S:
        bounds.append(min(S, bounds[-1] + max(16, int(rng.lognormvariate(0, 1) * S / 8))))
    return bounds


def split_gates(device: torch.device, S: int, H: int, G: int, D: int) -> dict[str, Any]:
    """HexiSeq on a 2-rank split (simulated ranks, bf16) against float64 attention, without and
    with packed documents (one of them across the split): the received-block path of the shape
    the part measures (float64 scores of 2K tokens x 32 heads: 0.5 GiB a tensor)."""
    lay = two_rank_layout(S, H, G)
    q, k, v, dout = rank_inputs(
        lay, batch=1, head_dim=D, dtype=torch.bfloat16, device=device, seed=3
    )
    out: dict[str, Any] = {"S": S, "pass": True}
    for name, cu in (("dense", None), ("documents", [0, S // 8, S // 4, S // 2, 7 * S // 8, S])):
        got = sim_attention(lay, q, k, v, dout, kernel=Kernel.AUTO, comm_chunks=2, cu_seqlens=cu)
        res = compare(got, reference_grads(q, k, v, dout, cu), torch.bfloat16, device)
        out[name] = res
        out["pass"] &= res["pass"]
    return out


# ---- pytest ---------------------------------------------------------------------------------------
def check_pytest(out_dir: str, kind: str | None, quick: bool) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "gpu_check.breaks"]
    if kind is not None:
        cmd += ["-x", "--hexiseq-break", kind]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [ROOT, os.path.join(ROOT, "scripts"), env.get("PYTHONPATH", "")]
    )
    proc = subprocess.run(
        cmd + PYTEST_FILES, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240
    )
    log = os.path.join(out_dir, f"pytest{'_' + kind if kind else ''}.txt")
    with open(log, "w", encoding="utf-8") as f:
        f.write(proc.stdout + proc.stderr)
    summary = (proc.stdout.strip().splitlines() or ["(no output)"])[-1]
    res: dict[str, Any] = {"pass": proc.returncode == 0, "summary": summary, "log": log}
    if proc.returncode not in (0, 1):  # 2-5: interrupted, internal error, usage, no tests
        res["error"] = f"pytest exit code {proc.returncode}: {summary}"
    return res


# ---- memory ---------------------------------------------------------------------------------------
def check_memory(device: torch.device, quick: bool, *, stop_early: bool = False) -> dict[str, Any]:
    H, G, D = (8, 2, 16) if quick else (32, 8, 128)
    gate = split_gates(device, 256 if quick else 2048, H, G, D)
    if not gate["pass"] or device.type != "cuda":
        skipped = None if device.type == "cuda" else "CPU: no memory counters (the proofs ran)"
        return {"pass": gate["pass"], "gate": gate, **({"skipped": skipped} if skipped else {})}
    rows = []
    blocks = ("local", "received", "packed")
    for S in (1024, 2048, 4096) if quick else (8192, 16384, 32768):
        for block in blocks:
            rows.append(
                {"S": S, "block": block, "peak_extra_mib": _peak_mib(device, S, H, G, D, block)}
            )
    ratios = {}
    for block in blocks:
        pts = [r["peak_extra_mib"] for r in rows if r["block"] == block]
        ratios[block] = [round(b / a, 3) for a, b in zip(pts, pts[1:])]
    peak = {(r["S"], r["block"]): r["peak_extra_mib"] for r in rows}
    packed = {S: round(peak[S, "packed"] / peak[S, "local"], 3) for S, _ in peak}
    ok = all(r < 3.0 for rs in ratios.values() for r in rs)  # linear: 2 per doubling; S^2: 4
    ok &= all(x <= PACKED_OVER_DENSE for x in packed.values())
    return {
        "pass": ok,
        "gate": gate,
        "rows": rows,
        "growth_per_doubling": ratios,
        "packed_over_dense": packed,
    }


def _peak_mib(device: torch.device, S: int, H: int, G: int, D: int, block: str) -> float:
    bf16 = torch.bfloat16
    q = torch.randn(S, 1, H, D, device=device, dtype=bf16, requires_grad=True)
    k, v = (torch.randn(S, 1, G, D, device=device, dtype=bf16, requires_grad=True) for _ in "kv")
    dout = torch.randn(S, 1, H * D, device=device, dtype=bf16)
    groups = None
    if block != "received":
        groups = build_hexiseq_groups(one_rank_layout(S, H, G), device=device)
    cu = documents_of(S, seed=S) if block == "packed" else None
    _sync(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    if groups is not None:  # the whole runtime on one rank: its local block (packed: documents)
        hexiseq_attn_func(q, k, v, groups=groups, cu_seqlens=cu).backward(dout)
    else:  # one received block: every key visible to every query (the kernel call the runtime makes)
        kernel = resolve_kernel(Kernel.AUTO, device=device, dtype=bf16, head_dim=D)
        kv_of_head = torch.arange(H, device=device) // (H // G)
        kw = dict(causal=False, kv_of_head_H=kv_of_head, scale=D**-0.5, kernel=kernel)
        with torch.no_grad():
            out, lse = block_forward(q, k, v, **kw)
            block_backward(dout.view(S, 1, H, D), q, k, v, out, lse, **kw)
    _sync(device)
    peak = (torch.cuda.max_memory_allocated(device) - base) / 2**20
    del q, k, v, dout
    return round(peak, 1)


# ---- throughput -----------------------------------------------------------------------------------
def check_throughput(
    device: torch.device, quick: bool, *, stop_early: bool = False
) -> dict[str, Any]:
    S, H, G, D = (256, 8, 2, 16) if quick else (32768, 32, 8, 128)
    dtype = torch.bfloat16
    gate = split_gates(device, 256 if quick else 2048, H, G, D)
    if not gate["pass"]:
        return {"pass": False, "gate": gate}
    lay = one_rank_layout(S, H, G)
    init_world(device)
    groups = build_hexiseq_groups(lay, device=device)
    q, k, v, dout = rank_inputs(lay, batch=1, head_dim=D, dtype=dtype, device=device, seed=4)
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    documents = documents_of(S, seed=4)

    def hexiseq(cu: list[int] | None = None) -> torch.Tensor:
        out = hexiseq_attn_func(q, k, v, groups=groups, cu_seqlens=cu)
        out.backward(dout)
        return out

    def sdpa() -> torch.Tensor:
        out = torch.nn.functional.scaled_dot_product_attention(
            *(x.permute(1, 2, 0, 3) for x in (q, k, v)), is_causal=True, enable_gqa=True
        )
        out = out.permute(2, 0, 1, 3).reshape(S, 1, H * D)
        out.backward(dout)
        return out

    results = {}
    for name, fn in (("hexiseq", hexiseq), ("sdpa", sdpa)):
        for x in (q, k, v):
            x.grad = None
        out = fn()
        assert q.grad is not None and k.grad is not None and v.grad is not None
        results[name] = Grads(out.detach(), q.grad.clone(), k.grad.clone(), v.grad.clone())
    # both are bf16 approximations of the same attention: their difference is within two bounds
    agree = compare(results["hexiseq"], results["sdpa"], dtype, device)
    agree["bounds"] = {n: 2 * b for n, b in agree["bounds"].items()}
    agree["pass"] = all(agree["errors"][n] <= agree["bounds"][n] for n in agree["errors"])
    if not agree["pass"] or device.type != "cuda":
        extra = {} if device.type == "cuda" else {"skipped": "CPU: timing says nothing of a GPU"}
        return {"pass": agree["pass"], "gate": gate, "agreement_with_sdpa": agree, **extra}
    times = {}
    for name, fn in (
        ("hexiseq", hexiseq),
        ("sdpa", sdpa),
        ("hexiseq_documents", lambda: hexiseq(documents)),
    ):
        fn()  # warm-up
        _sync(device)
        reps = 5
        start = time.perf_counter()
        for _ in range(reps):
            fn()
        _sync(device)
        times[name] = (time.perf_counter() - start) / reps
    ratio = times["sdpa"] / times["hexiseq"]
    return {
        "pass": ratio >= 0.9,
        "gate": gate,
        "agreement_with_sdpa": agree,
        "seq_length": S,
        "documents": len(documents) - 1,
        "kernel": hexiseq_kernel(device, D),
        "ms": {n: round(1e3 * t, 2) for n, t in times.items()},
        "tokens_per_s": {n: round(S / t) for n, t in times.items()},
        "hexiseq_over_sdpa": round(ratio, 3),
        "target": 0.9,
    }


def hexiseq_kernel(device: torch.device, head_dim: int) -> str:
    return resolve_kernel(Kernel.AUTO, device=device, dtype=torch.bfloat16, head_dim=head_dim).value
