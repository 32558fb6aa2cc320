"""GPU acceptance check of HexiSeq on ONE GPU: one JSON + markdown, a pass/fail table last.

Run by ``scripts/gpu_check.sh`` (``python -m gpu_check`` with ``scripts/`` on the path);
``docs/gpu.md`` says what each figure means. Parts, in the order they run (the two that have not
yet run on a GPU first):

1. efficient: the ``efficient`` kernel (its GQA calls per query head on strided views, whose
   backward once read ``out`` at the wrong rows) over simulated ranks vs float64 (``sim.py``); on
   CPU its stand-in, ``reference``, which makes the same per-head calls.
2. documents: packed documents on random layouts with unaligned head ranges (``packed.py``).
3. batch_layouts: per-micro-batch layouts on one job layout's groups (``packed.py``).
4. ranks: every other kernel that resolves here over simulated ranks vs float64 (``sim.py``).
5. pytest: the GPU test files and their CPU twins, in a subprocess (``parts.py``).
6. megatron: a megatron-core GPT, HexiSeq vs stock Megatron, each layer's attention output and every
   gradient, bf16, also with packed documents (``megatron_gpt.py``).
7. memory: attention memory linear in S, the packed path within 10% of the dense one (``parts.py``).
8. throughput: tokens/s vs torch SDPA, target >= 0.9x (``parts.py``).
Every part also has a document case, so ``--self-test`` (every part again under each break of
``breaks.py``) fails unless every part catches every break.

    python -m gpu_check --out results/gpu_check [--self-test]           # on a GPU
    python -m gpu_check --device cpu --quick --self-test --out /tmp/g    # anywhere

Bad arguments and an output folder that cannot be written are one ``error:`` line on stderr and
exit code 2, before anything runs.
"""

from __future__ import annotations

import math
import os
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from megatron_hexiseq.attention.kernels import Kernel
from megatron_hexiseq.errors import HexiSeqError, OneLineParser, run_user_command
from megatron_hexiseq.io import check_outputs, write_json_atomic, write_text_atomic

from .breaks import BREAKS, broken_attention
from .megatron_gpt import check_megatron
from .packed import check_batch_layouts, check_documents
from .parts import check_memory, check_pytest, check_throughput, init_world
from .sim import check_ranks

PARTS = (
    "efficient",
    "documents",
    "batch_layouts",
    "ranks",
    "pytest",
    "megatron",
    "memory",
    "throughput",
)
DEFAULT_BUDGET_S = 330.0


# ---- arguments ------------------------------------------------------------------------------------
def _budget(text: str) -> float:
    """``--budget-s``: a finite number of seconds above 0."""
    try:
        value = float(text)
    except ValueError:
        raise HexiSeqError(f"--budget-s must be a number of seconds, got {text[:40]!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise HexiSeqError(
            f"--budget-s must be a finite number of seconds above 0, got {text[:40]}"
        )
    return value


def parse_parts(text: str) -> list[str]:
    """``--parts``: comma-separated names of ``PARTS`` (at least one; repeats kept once)."""
    names = [x.strip() for x in text.split(",") if x.strip()]
    if not names:
        raise HexiSeqError(f"--parts names no part; choose one or more of {', '.join(PARTS)}")
    bad = [x for x in names if x not in PARTS]
    if bad:
        raise HexiSeqError(f"unknown part(s) {bad[:5]}; choose from {', '.join(PARTS)}")
    return list(dict.fromkeys(names))


def _parser() -> OneLineParser:
    p = OneLineParser(prog="gpu_check", description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    p.add_argument("--quick", action="store_true", help="toy sizes (a smoke test of this script)")
    p.add_argument(
        "--self-test", action="store_true", help="also run every part with attention broken"
    )
    p.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated subset of {PARTS}")
    p.add_argument("--out", default="results/gpu_check")
    p.add_argument(
        "--budget-s",
        default=str(DEFAULT_BUDGET_S),
        help="start no part (or break) after this many seconds; it fails as not run",
    )
    return p


def prepare(argv: list[str] | None) -> tuple[Any, list[str], float, torch.device]:
    """Parsed arguments, parts, budget and device; every user error is a ``HexiSeqError``."""
    a = _parser().parse_args(argv)
    parts, budget = parse_parts(a.parts), _budget(a.budget_s)
    if a.device == "cuda" and not torch.cuda.is_available():
        raise HexiSeqError("no CUDA GPU visible to torch; use --device cpu for the CPU stand-ins")
    try:
        os.makedirs(a.out, exist_ok=True)
    except OSError as e:
        raise HexiSeqError(
            f"cannot create the output folder {a.out[:200]} ({e.strerror}); set GPU_CHECK_OUT "
            "(or --out) to a writable folder"
        ) from None
    check_outputs([("--out", os.path.join(a.out, "gpu_check.json"))])
    device = torch.device(a.device)
    if device.type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    return a, parts, budget, device


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


def runners(
    device: torch.device, quick: bool, out: str, kind: str | None
) -> dict[str, Callable[[], dict[str, Any]]]:
    stop = kind is not None
    efficient = Kernel.EFFICIENT if device.type == "cuda" else Kernel.REFERENCE
    return {
        "efficient": lambda: check_ranks(device, quick, kernels=[efficient], stop_early=stop),
        "documents": lambda: check_documents(device, quick, stop_early=stop),
        "batch_layouts": lambda: check_batch_layouts(device, quick, stop_early=stop),
        "ranks": lambda: check_ranks(device, quick, exclude=(efficient,), stop_early=stop),
        "pytest": lambda: check_pytest(out, kind, quick),
        "megatron": lambda: check_megatron(
            device, quick, stop_early=stop, init_world=lambda: init_world(device)
        ),
        "memory": lambda: check_memory(device, quick, stop_early=stop),
        "throughput": lambda: check_throughput(device, quick, stop_early=stop),
    }


def key_figures(name: str, res: dict[str, Any]) -> str:
    """One short line of the figures that matter."""
    if "error" in res:
        return f"error: {res['error'][:160]}"
    if name in ("efficient", "documents", "batch_layouts", "ranks"):
        worst = max(res.get("worst_normwise_error", {"-": 0}).values())
        return (
            f"{res.get('cases')} cases ({res.get('cases_with_documents')} with documents, "
            f"{res.get('cases_with_unaligned_heads')} with unaligned heads), kernels "
            f"{','.join(res.get('kernels', []))}, worst normwise error {worst:.2g}" + _fails(res)
        )
    if name == "pytest":
        return res["summary"]
    if name == "megatron":
        bits = []
        for spec in ("local_documents", "local", "transformer_engine"):
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
    worst = max(
        (
            e
            for case in ("dense", "documents")
            for e in gate.get(case, {}).get("errors", {}).values()
        ),
        default=0.0,
    )
    text = f"2-rank proofs at {gate.get('S')} (dense, documents): worst {worst:.2g}"
    if name == "memory" and "growth_per_doubling" in res:
        peaks = {f"{r['block']}@{r['S'] // 1024}K": r["peak_extra_mib"] for r in res["rows"]}
        text += (
            f"; peak MiB {peaks}; growth per doubling {res['growth_per_doubling']}; packed over "
            f"dense {res['packed_over_dense']} (at most 1.1)"
        )
    if name == "throughput" and "hexiseq_over_sdpa" in res:
        tps = res["tokens_per_s"]
        text += (
            f"; {res['kernel']} {tps['hexiseq']} vs SDPA {tps['sdpa']} tokens/s: "
            f"{res['hexiseq_over_sdpa']}x (target 0.9x); with {res['documents']} documents "
            f"{tps['hexiseq_documents']}"
        )
    if "skipped" in res:
        text += f"; {res['skipped']}"
    return text


def _fails(res: dict[str, Any]) -> str:
    return f"; FAILED: {res['failures'][0]}" if res.get("failures") else ""


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


def run(a: Any, parts: list[str], budget_s: float, device: torch.device) -> int:
    """Every part (then every break x part with ``--self-test``); exit code 0 if all passed."""
    init_world(device)
    started = time.perf_counter()
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
        write_json_atomic(os.path.join(a.out, "gpu_check.json"), result)
        write_text_atomic(os.path.join(a.out, "gpu_check.md"), f"# {title}\n\n{table}\n")
        return table

    def timed(name: str, fn: Callable[[], dict[str, Any]], kind: str | None) -> dict[str, Any]:
        if time.perf_counter() - started > budget_s:
            return {"pass": False, "error": f"not run: the {budget_s:g} s budget is spent"}
        with broken_attention(kind):
            return run_part(name, fn)

    fns = runners(device, a.quick, a.out, None)
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
            fns = runners(device, a.quick, a.out, kind)
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
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> None:
    """User errors (arguments, output folder, no GPU): one ``error:`` line on stderr, exit 2; an
    interrupt (or the script's timeout): ``error: interrupted``, exit 130, the results so far kept."""
    sys.exit(run_user_command(lambda: run(*prepare(argv))))
