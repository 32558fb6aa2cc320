"""GPU acceptance check of HexiSeq on ONE GPU (<= 4 minutes on an H200): one JSON + markdown.

Run by ``scripts/gpu_check.sh``; ``docs/gpu.md`` says what each figure means. Five parts, each a
pass/fail with its figures:

1. ranks: HexiSeq attention over 2-6 simulated ranks on this device (one thread per rank under the
   NCCL-rule harness ``tests/nccl_sim.py``), every kernel that resolves here x {bf16, fp16} x
   ``comm_chunks`` {1, 2, 3}, B = 2, a seeded random uneven layout each, forward and backward
   against float64 attention within ``attention.kernel_check``'s normwise bounds
   (``gpu_check_sim.py``).
2. pytest: ``tests/test_attention_gpu.py`` (the CUDA kernels against float64) and
   ``tests/test_attention_sim_device.py`` (simulated ranks on this device), in a subprocess.
3. megatron: a megatron-core GPT, HexiSeq on an uneven 3-rank layout (simulated ranks) against
   stock Megatron on one device, each layer's attention output and every gradient, bf16, with the
   local and (when installed) the Transformer Engine layer spec (``gpu_check_megatron.py``).
4. memory: peak extra CUDA memory of attention fwd+bwd, bf16, H = 32, G = 8, D = 128, at
   S = 8K / 16K / 32K, for the local causal block (HexiSeq on a one-rank layout) and a received
   block (S queries x S keys): must grow like S (ratio ~2 per doubling), not S^2 (~4).
5. throughput: tokens/s of HexiSeq fwd+bwd (one-rank layout, 32K tokens, the shape of 4) against
   ``torch.nn.functional.scaled_dot_product_attention`` on the same tokens; target >= 0.9x.

Parts 4 and 5 first prove what they measure: a 2-rank split of their shape (simulated ranks, 2K
tokens) against float64 attention, and for 5 the timed HexiSeq output and gradients against
SDPA's (both bf16: within twice the bf16 bound). On CPU (``--device cpu``) parts 4 and 5
run these proofs (CPU has no memory counters, and SDPA's CPU speed says nothing about a GPU).

``--self-test`` then runs every part again with attention broken on purpose (``gpu_check_breaks``:
zeros, one received block dropped, a wrong head map); the run fails unless every part fails under
every break (each stops at its first failing case). ``--quick``: toy sizes.

    python bench/gpu_check.py --out results/gpu_check [--self-test]           # on a GPU
    python bench/gpu_check.py --device cpu --quick --self-test --out /tmp/g    # anywhere
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from _common import write_outputs
from gpu_check_breaks import BREAKS, broken_attention
from gpu_check_megatron import check_megatron
from gpu_check_sim import Grads, check_ranks, compare, rank_inputs, reference_grads, sim_attention

from megatron_hexiseq.attention import build_hexiseq_groups, hexiseq_attn_func
from megatron_hexiseq.attention.kernels import Kernel, block_backward, block_forward, resolve_kernel
from megatron_hexiseq.layout import Layout, make_layout

PARTS = ("ranks", "pytest", "megatron", "memory", "throughput")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


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


def split_gate(device: torch.device, S: int, H: int, G: int, D: int) -> dict[str, Any]:
    """HexiSeq on a 2-rank split (simulated ranks, bf16) against float64 attention: the
    received-block path of the shape parts 4 and 5 measure (float64 scores of 2K tokens x 32 heads:
    0.5 GiB a tensor)."""
    lay = two_rank_layout(S, H, G)
    q, k, v, dout = rank_inputs(
        lay, batch=1, head_dim=D, dtype=torch.bfloat16, device=device, seed=3
    )
    got = sim_attention(lay, q, k, v, dout, kernel=Kernel.AUTO, comm_chunks=2)
    return {"S": S, **compare(got, reference_grads(q, k, v, dout), torch.bfloat16, device)}


# ---- 2. pytest ------------------------------------------------------------------------------------
def check_pytest(out_dir: str, kind: str | None, quick: bool) -> dict[str, Any]:
    files = ["tests/test_attention_sim_device.py", "tests/test_attention_gpu.py"]
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "gpu_check_breaks"]
    if kind is not None:
        cmd += ["-x", "--hexiseq-break", kind]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [ROOT, os.path.join(ROOT, "bench"), env.get("PYTHONPATH", "")]
    )
    proc = subprocess.run(
        cmd + files, cwd=ROOT, env=env, capture_output=True, text=True, timeout=180
    )
    log = os.path.join(out_dir, f"pytest{'_' + kind if kind else ''}.txt")
    os.makedirs(out_dir, exist_ok=True)
    with open(log, "w", encoding="utf-8") as f:
        f.write(proc.stdout + proc.stderr)
    summary = (proc.stdout.strip().splitlines() or ["(no output)"])[-1]
    res: dict[str, Any] = {"pass": proc.returncode == 0, "summary": summary, "log": log}
    if proc.returncode not in (0, 1):  # 2-5: interrupted, internal error, usage, no tests
        res["error"] = f"pytest exit code {proc.returncode}: {summary}"
    return res


# ---- 4. memory ------------------------------------------------------------------------------------
def check_memory(device: torch.device, quick: bool, *, stop_early: bool = False) -> dict[str, Any]:
    H, G, D = (8, 2, 16) if quick else (32, 8, 128)
    gate = split_gate(device, 256 if quick else 2048, H, G, D)
    if not gate["pass"] or device.type != "cuda":
        skipped = None if device.type == "cuda" else "CPU: no memory counters (the proof ran)"
        return {"pass": gate["pass"], "gate": gate, **({"skipped": skipped} if skipped else {})}
    rows = []
    for S in (1024, 2048, 4096) if quick else (8192, 16384, 32768):
        for block in ("local", "received"):
            rows.append(
                {"S": S, "block": block, "peak_extra_mib": _peak_mib(device, S, H, G, D, block)}
            )
    ratios = {}
    for block in ("local", "received"):
        pts = [r["peak_extra_mib"] for r in rows if r["block"] == block]
        ratios[block] = [round(b / a, 3) for a, b in zip(pts, pts[1:])]
    ok = all(r < 3.0 for rs in ratios.values() for r in rs)  # linear: 2 per doubling; S^2: 4
    return {"pass": ok, "gate": gate, "rows": rows, "growth_per_doubling": ratios}


def _peak_mib(device: torch.device, S: int, H: int, G: int, D: int, block: str) -> float:
    bf16 = torch.bfloat16
    q = torch.randn(S, 1, H, D, device=device, dtype=bf16, requires_grad=True)
    k, v = (torch.randn(S, 1, G, D, device=device, dtype=bf16, requires_grad=True) for _ in "kv")
    dout = torch.randn(S, 1, H * D, device=device, dtype=bf16)
    groups = (
        build_hexiseq_groups(one_rank_layout(S, H, G), device=device) if block == "local" else None
    )
    _sync(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    if groups is not None:  # the whole runtime on one rank: its local causal block
        hexiseq_attn_func(q, k, v, groups=groups).backward(dout)
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


# ---- 5. throughput ------------------------------------------------------------------------------
def check_throughput(
    device: torch.device, quick: bool, *, stop_early: bool = False
) -> dict[str, Any]:
    S, H, G, D = (256, 8, 2, 16) if quick else (32768, 32, 8, 128)
    dtype = torch.bfloat16
    gate = split_gate(device, 256 if quick else 2048, H, G, D)
    if not gate["pass"]:
        return {"pass": False, "gate": gate}
    lay = one_rank_layout(S, H, G)
    init_world(device)
    groups = build_hexiseq_groups(lay, device=device)
    q, k, v, dout = rank_inputs(lay, batch=1, head_dim=D, dtype=dtype, device=device, seed=4)
    q, k, v = (x.requires_grad_() for x in (q, k, v))

    def hexiseq() -> torch.Tensor:
        out = hexiseq_attn_func(q, k, v, groups=groups)
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
        results[name] = Grads(out.detach(), q.grad.clone(), k.grad.clone(), v.grad.clone())
    # both are bf16 approximations of the same attention: their difference is within two bounds
    agree = compare(results["hexiseq"], results["sdpa"], dtype, device)
    agree["bounds"] = {n: 2 * b for n, b in agree["bounds"].items()}
    agree["pass"] = all(agree["errors"][n] <= agree["bounds"][n] for n in agree["errors"])
    if not agree["pass"] or device.type != "cuda":
        extra = {} if device.type == "cuda" else {"skipped": "CPU: timing says nothing of a GPU"}
        return {"pass": agree["pass"], "gate": gate, "agreement_with_sdpa": agree, **extra}
    times = {}
    for name, fn in (("hexiseq", hexiseq), ("sdpa", sdpa)):
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
        "kernel": hexiseq_kernel(device, D),
        "ms": {n: round(1e3 * t, 2) for n, t in times.items()},
        "tokens_per_s": {n: round(S / t) for n, t in times.items()},
        "hexiseq_over_sdpa": round(ratio, 3),
        "target": 0.9,
    }


def hexiseq_kernel(device: torch.device, head_dim: int) -> str:
    return resolve_kernel(Kernel.AUTO, device=device, dtype=torch.bfloat16, head_dim=head_dim).value


# ---- driver ---------------------------------------------------------------------------------------
def run_part(name: str, fn: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    start = time.perf_counter()
    try:
        res = fn()
    except Exception as e:  # report and go on with the other parts  # noqa: BLE001
        res = {
            "pass": False,
            "error": f"{type(e).__name__}: {str(e)[:500]}",
            "traceback": traceback.format_exc(limit=-6),  # for a one-shot GPU run: where it broke
        }
    res["seconds"] = round(time.perf_counter() - start, 1)
    return res


def key_figures(name: str, res: dict[str, Any]) -> str:
    """One short line of the figures that matter."""
    if "error" in res:
        return f"error: {res['error'][:160]}"
    if name == "ranks":
        worst = max(res.get("worst_normwise_error", {"-": 0}).values())
        return (
            f"{res.get('cases')} cases, kernels {','.join(res.get('kernels', []))}, "
            f"worst normwise error {worst:.2g}" + _fails(res)
        )
    if name == "pytest":
        return res["summary"]
    if name == "megatron":
        bits = []
        for spec in ("local", "transformer_engine"):
            if spec in res:
                w = res[spec]["worst"]
                bits.append(
                    f"{spec}: {res[spec]['layers']} layers + {res[spec]['gradients']} grads, worst "
                    f"{w['what']} {w['hexiseq_bf16']:.2g} (stock {w['stock_bf16']:.2g}, allowed "
                    f"{w['allowed']:.2g})"
                )
        bits += [f"{s} skipped: {why}" for s, why in res.get("skipped_specs", {}).items()]
        return "; ".join(bits)
    gate = res.get("gate", {})
    text = (
        f"2-rank proof at {gate.get('S')}: worst {max(gate.get('errors', {'-': 0}).values()):.2g}"
    )
    if name == "memory" and "growth_per_doubling" in res:
        peaks = {f"{r['block']}@{r['S'] // 1024}K": r["peak_extra_mib"] for r in res["rows"]}
        text += f"; peak MiB {peaks}; growth per doubling {res['growth_per_doubling']}"
    if name == "throughput" and "hexiseq_over_sdpa" in res:
        text += (
            f"; {res['kernel']} {res['tokens_per_s']['hexiseq']} vs SDPA "
            f"{res['tokens_per_s']['sdpa']} tokens/s: {res['hexiseq_over_sdpa']}x (target 0.9x)"
        )
    if "skipped" in res:
        text += f"; {res['skipped']}"
    return text


def _fails(res: dict[str, Any]) -> str:
    return f"; FAILED: {res['failures'][0]}" if res.get("failures") else ""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--quick", action="store_true", help="toy sizes (a smoke test of this script)")
    p.add_argument(
        "--self-test", action="store_true", help="also run every part with attention broken"
    )
    p.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated subset of {PARTS}")
    p.add_argument("--out", default="results/gpu_check")
    p.add_argument(
        "--budget-s",
        type=float,
        default=190.0,
        help="start no part (or break) after this many seconds; it fails as not run",
    )
    a = p.parse_args()
    parts = [x for x in a.parts.split(",") if x]
    bad = [x for x in parts if x not in PARTS]
    if bad:
        p.error(f"unknown part(s) {bad}; choose from {', '.join(PARTS)}")
    if a.device == "cuda" and not torch.cuda.is_available():
        print("gpu_check: no CUDA GPU visible to torch; use --device cpu for the CPU stand-ins")
        raise SystemExit(2)
    device = torch.device(a.device)
    if device.type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    init_world(device)
    started = time.perf_counter()

    def runners(kind: str | None) -> dict[str, Callable[[], dict[str, Any]]]:
        stop = kind is not None
        return {
            "ranks": lambda: check_ranks(device, a.quick, stop_early=stop),
            "pytest": lambda: check_pytest(a.out, kind, a.quick),
            "megatron": lambda: check_megatron(
                device, a.quick, stop_early=stop, init_world=lambda: init_world(device)
            ),
            "memory": lambda: check_memory(device, a.quick, stop_early=stop),
            "throughput": lambda: check_throughput(device, a.quick, stop_early=stop),
        }

    result: dict[str, Any] = {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "torch": torch.__version__,
        "quick": a.quick,
        "parts": {},
    }
    title = f"GPU check on {result['device']}"

    def save(final: bool) -> str:
        """Write what is known so far (a run stopped from outside still leaves its results)."""
        result["complete"] = final
        result["seconds"] = round(time.perf_counter() - started, 1)
        table = _table(result, parts)
        write_outputs(a.out, "gpu_check", data=result, title=title, table=table)
        return table

    def timed(name: str, fn: Callable[[], dict[str, Any]], kind: str | None) -> dict[str, Any]:
        if time.perf_counter() - started > a.budget_s:
            return {"pass": False, "error": f"not run: the {a.budget_s} s budget is spent"}
        with broken_attention(kind):
            return run_part(name, fn)

    fns = runners(None)
    for name in parts:
        result["parts"][name] = r = timed(name, fns[name], None)
        r.setdefault("seconds", 0.0)
        print(
            f"{name}: {'PASS' if r['pass'] else 'FAIL'} ({r['seconds']} s) {key_figures(name, r)}",
            flush=True,
        )
        if "traceback" in r:
            print(r["traceback"], flush=True)
        save(False)
    ok = all(result["parts"][n]["pass"] for n in parts)
    if a.self_test:
        result["self_test"] = {}
        for kind in BREAKS:
            fns = runners(kind)
            for name in parts:
                r = timed(name, fns[name], kind)
                r.setdefault("seconds", 0.0)
                r["caught"] = caught = not r["pass"] and "error" not in r
                result["self_test"][f"{kind}/{name}"] = r
                print(
                    f"self-test {kind}/{name}: {'caught' if caught else 'NOT CAUGHT'} "
                    f"({r['seconds']} s)" + ("" if caught else f" {key_figures(name, r)}"),
                    flush=True,
                )
                ok &= caught
        save(False)
    result["pass"] = ok
    table = save(True)
    print(f"\n(everything in {a.out}/gpu_check.json and .md)")
    print(f"\n# {title} ({result['seconds']} s): {'PASS' if ok else 'FAIL'}\n")
    print(table, flush=True)
    dist.destroy_process_group()
    raise SystemExit(0 if ok else 1)


def _table(result: dict[str, Any], parts: list[str]) -> str:
    lines = ["| part | pass | s | key figures |", "|---|---|---|---|"]
    for n in parts:
        if n not in result["parts"]:
            continue
        r = result["parts"][n]
        lines.append(
            f"| {n} | {'yes' if r['pass'] else 'NO'} | {r['seconds']} | {key_figures(n, r)} |"
        )
    if "self_test" in result:
        lines += ["", "| self-test: break / part | caught | s |", "|---|---|---|"]
        for key, r in result["self_test"].items():
            lines.append(f"| {key} | {'yes' if r['caught'] else 'NO'} | {r['seconds']} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
