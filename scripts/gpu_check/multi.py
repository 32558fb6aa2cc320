"""GPU acceptance check of HexiSeq on 2+ GPUs (torchrun, NCCL): ``python -m gpu_check.multi``, run by
``scripts/gpu_check_multi.sh``.

Subcommands (``docs/gpu.md`` says what each figure means):

``attention`` (one process per GPU under torchrun; gloo on CPU with ``--device cpu``):
  1. forward and backward of ``hexiseq_attn_func`` on seeded random uneven layouts of the world
     (``attention.testing_layouts``: uneven segments and heads, GQA, several A2A groups), bf16 and
     fp16, B = 2, ``comm_chunks`` 1-3, against float64 attention of the full sequence computed on
     every rank; the normwise error is global (squared norms all-reduced) and must be within
     ``attention.kernel_check``'s bounds;
  2. ``--iters`` (200) fwd+bwd iterations of one layout: CUDA memory must be steady (allocated after
     the last iteration = after iteration 10, and the peak of the second half of the iterations no
     higher than the first half's, within 1 MiB).
  Rank 0 writes ``attention.json``.
``pretrain`` (launches torchrun itself; needs 4+ GPUs, Megatron-LM's ``pretrain_gpt.py`` and
  Transformer Engine): the same small GPT (TE layer spec, bf16, RoPE, GQA, 2 data-parallel replicas
  of CP = N / 2, Megatron's mock data, seed 1234) for ``--steps`` (50) steps three times: stock
  Megatron with CP (``--cp-comm-type p2p``), stock Megatron without CP (2 GPUs; the yardstick of how
  far two correct bf16 runs drift apart) and HexiSeq (``python -m megatron_hexiseq.pretrain_gpt`` on
  an uneven layout). HexiSeq's per-step lm loss and grad norm must stay as close to stock CP as
  stock without CP does: max relative difference <= 2 x the yardstick's + 2u (u = bf16 unit
  roundoff). Writes ``pretrain.json`` and each run's log.
``report``: the pass/fail table of what is in ``--out`` (exit 1 if a part failed or is missing).

``--dry-run`` (pretrain) prints the three torchrun commands and writes the layout without running.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import shlex
import subprocess
import sys
import time
from datetime import timedelta
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from megatron_hexiseq.errors import HexiSeqError  # noqa: E402
from megatron_hexiseq.io import write_json_atomic, write_text_atomic  # noqa: E402
from megatron_hexiseq.layout import Layout, make_layout  # noqa: E402

U_BF16 = 2.0**-8


# ---- attention (under torchrun) -----------------------------------------------------------------
def attention_main(a: argparse.Namespace) -> int:
    import torch
    import torch.distributed as dist

    from megatron_hexiseq.attention import build_hexiseq_groups, hexiseq_attn_func
    from megatron_hexiseq.attention.kernel_check import (
        BACKWARD_ROUNDINGS,
        FORWARD_ROUNDINGS,
        normwise_bound,
    )
    from megatron_hexiseq.attention.reference import reference_attention
    from megatron_hexiseq.attention.testing_layouts import random_layout

    local = int(os.environ.get("LOCAL_RANK", "0"))
    if a.device == "cuda":
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
    else:
        device = torch.device("cpu")
    dist.init_process_group(
        "nccl" if device.type == "cuda" else "gloo", timeout=timedelta(seconds=a.hang_timeout)
    )
    world, me = dist.get_world_size(), dist.get_rank()
    if world < 2:
        raise HexiSeqError(
            "gpu_check_multi attention needs 2+ processes (torchrun --nproc-per-node)"
        )
    rng = random.Random(a.seed)
    D = 128 if device.type == "cuda" else 16
    cases, failures, worst = 0, [], 0.0
    start = time.perf_counter()

    def run(lay: Layout, groups, dtype, chunks: int, seed: int, check: bool) -> float:
        gen = torch.Generator().manual_seed(seed)  # the same full tensors on every rank
        S, H, G = lay.seq_length, lay.num_attention_heads, lay.num_query_groups
        q, k, v = (torch.randn(S, 2, n, D, generator=gen).to(dtype).to(device) for n in (H, G, G))
        dout = torch.randn(S, 2, H * D, generator=gen).to(dtype).to(device)
        pos = torch.tensor(lay.ranks[me].positions(), dtype=torch.long, device=device)
        ql, kl, vl = (x[pos].requires_grad_() for x in (q, k, v))
        out = hexiseq_attn_func(ql, kl, vl, groups=groups, comm_chunks=chunks)
        out.backward(dout[pos])
        if not check:
            return 0.0
        qd, kd, vd = (x.double().requires_grad_() for x in (q, k, v))
        ref = reference_attention(qd, kd, vd)
        ref.backward(dout.double())
        sq = torch.zeros(8, dtype=torch.float64, device=device)  # ||got - want||^2, ||want||^2
        for i, (g, w) in enumerate(
            zip((out, ql.grad, kl.grad, vl.grad), (ref, qd.grad, kd.grad, vd.grad))
        ):
            w = w.detach()[pos]
            sq[2 * i] = (g.double() - w).square().sum()
            sq[2 * i + 1] = w.square().sum()
        dist.all_reduce(sq)
        errs = (sq[0::2].sqrt() / sq[1::2].sqrt().clamp_min(1e-300)).tolist()
        bounds = [
            normwise_bound(
                dtype,
                roundings=FORWARD_ROUNDINGS if i == 0 else BACKWARD_ROUNDINGS,
                reduction=S,
                device=device,
            )
            for i in range(4)
        ]
        bad = [
            f"{n} {e:.3g} > {b:.3g}"
            for n, e, b in zip(("out", "dq", "dk", "dv"), errs, bounds)
            if e > b
        ]
        if bad:
            failures.append(f"world {world} S {S} {dtype} comm_chunks {chunks}: " + ", ".join(bad))
        return max(e / b for e, b in zip(errs, bounds))

    layouts = []
    for i in range(a.layouts):
        lay = random_layout(
            rng,
            world,
            seq_length=rng.randint(a.min_tokens, a.max_tokens),
            heads=rng.choice([(32, 8), (16, 4), (8, 8), (8, 1), (12, 4)]),
        )
        while not all(lay.group_num_tokens(g.id) for g in lay.groups):  # see gpu_check.sim
            lay = random_layout(rng, world, seq_length=lay.seq_length, heads=(32, 8))
        layouts.append(lay)
        groups = build_hexiseq_groups(lay, device=device)
        for dtype in (torch.bfloat16, torch.float16):
            chunks = 1 + (i + (dtype == torch.float16)) % 3
            worst = max(worst, run(lay, groups, dtype, chunks, seed=100 * i + chunks, check=True))
            cases += 1
    # steady memory over --iters iterations of the first layout
    lay = layouts[0]
    groups = build_hexiseq_groups(lay, device=device)
    cuda = device.type == "cuda"
    marks: dict[str, float] = {}
    half = max(a.iters // 2, 11)
    for it in range(1, a.iters + 1):
        run(lay, groups, torch.bfloat16, 2, seed=7, check=False)
        if cuda and it == 10:
            torch.cuda.synchronize()
            marks["allocated_10_mib"] = torch.cuda.memory_allocated() / 2**20
            torch.cuda.reset_peak_memory_stats()
        if cuda and it == half:
            torch.cuda.synchronize()
            marks["peak_11_to_half_mib"] = torch.cuda.max_memory_allocated() / 2**20
            torch.cuda.reset_peak_memory_stats()
    if cuda and a.iters > half:
        torch.cuda.synchronize()
        marks["allocated_last_mib"] = torch.cuda.memory_allocated() / 2**20
        marks["peak_half_to_last_mib"] = torch.cuda.max_memory_allocated() / 2**20
        steady = (
            abs(marks["allocated_last_mib"] - marks["allocated_10_mib"]) <= 1.0
            and marks["peak_half_to_last_mib"] <= marks["peak_11_to_half_mib"] + 1.0
        )
    else:  # CPU, or too few iterations to compare two halves
        steady = True
    flags = torch.tensor([len(failures), int(not steady)], device=device)
    dist.all_reduce(flags)
    result = {
        "pass": bool(flags.sum().item() == 0),
        "world_size": world,
        "device": torch.cuda.get_device_name(device) if cuda else "cpu",
        "cases": cases,
        "worst_error_over_bound": round(worst, 4),
        "failures_rank0": failures,
        "ranks_with_failures": int(flags[0].item()),
        "iterations": a.iters,
        "memory_mib_rank0": {k: round(v, 1) for k, v in marks.items()} or "CPU: no memory counters",
        "ranks_with_unsteady_memory": int(flags[1].item()),
        "seconds": round(time.perf_counter() - start, 1),
    }
    if me == 0:
        os.makedirs(a.out, exist_ok=True)
        write_json_atomic(os.path.join(a.out, "attention.json"), result)
        print(f"attention: {'PASS' if result['pass'] else 'FAIL'} {result}", flush=True)
    dist.destroy_process_group()
    return 0 if result["pass"] else 1


# ---- pretrain_gpt.py: stock CP, stock without CP, HexiSeq ---------------------------------------
def uneven_layout(seq_length: int, cp: int, heads: int, groups: int) -> Layout:
    """CP ranks, two A2A groups when cp >= 2 (sizes cp // 2 and the rest; one group of 1 + 1 for
    cp = 2), uneven token pieces (sizes 3, 5, 4, 6, ... x 64) dealt zigzag, uneven head splits."""
    unit = 64
    units = seq_length // unit
    if units * unit != seq_length or units < 2 * cp:
        raise HexiSeqError(f"--seq-length must be a multiple of 64 and >= {128 * cp}")
    weights = [3 + (i % 2) * 2 + (i // 2) % 2 for i in range(2 * cp)]
    sizes = [max(1, units * w // sum(weights)) for w in weights]
    sizes[-1] += units - sum(sizes)
    cuts = [0]
    for s in sizes:
        cuts.append(cuts[-1] + s * unit)
    pieces = list(zip(cuts, cuts[1:]))
    segs = [sorted([pieces[r], pieces[2 * cp - 1 - r]]) for r in range(cp)]
    segs = [[tuple(p) for p in s] for s in segs]
    group_sizes = [cp // 2, cp - cp // 2]
    head_lists: list[list[int]] = []
    for g in group_sizes:
        counts = [heads // g + (1 if i < heads % g else 0) for i in range(g)]
        if g >= 2:  # make the split uneven: move one head from the last member to the first
            counts[0] += 1
            counts[-1] -= 1
        start = 0
        for c in counts:
            head_lists.append(list(range(start, start + c)))
            start += c
    return make_layout(
        seq_length=seq_length,
        num_attention_heads=heads,
        num_query_groups=groups,
        group_sizes=group_sizes,
        segments=segs,
        heads=head_lists,
    )


def model_flags(a: argparse.Namespace) -> list[str]:
    return [
        "--num-layers", "4", "--hidden-size", "1024", "--num-attention-heads", "16",
        "--group-query-attention", "--num-query-groups", "4", "--ffn-hidden-size", "2816", "--seq-length", str(a.seq_length),
        "--max-position-embeddings", str(a.seq_length), "--position-embedding-type", "rope",
        "--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear",
        "--untie-embeddings-and-output-weights", "--attention-dropout", "0", "--hidden-dropout", "0",
        "--micro-batch-size", "1", "--global-batch-size", "2", "--train-iters", str(a.steps),
        "--lr", "1e-4", "--min-lr", "1e-4", "--lr-decay-style", "constant", "--clip-grad", "1.0",
        "--bf16", "--transformer-impl", "transformer_engine", "--tensor-model-parallel-size", "1",
        "--pipeline-model-parallel-size", "1", "--calculate-per-token-loss", "--seed", "1234",
        "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "32000",
        "--log-interval", "1", "--eval-iters", "0", "--eval-interval", str(10 * a.steps),
        "--no-create-attention-mask-in-dataloader", "--use-mcore-models",
    ]  # fmt: skip


class RunCmd:
    """One torchrun invocation: its name, world size, argv and environment additions."""

    def __init__(self, name: str, nproc: int, argv: list[str], env: dict[str, str]) -> None:
        self.name, self.nproc, self.argv, self.env = name, nproc, argv, env

    def shell(self) -> str:
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in self.env.items())
        return f"{env} {shlex.join(self.argv)}".strip()


def pretrain_commands(a: argparse.Namespace, layout_path: str) -> list[RunCmd]:
    cp = a.nproc // 2
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    stock = [os.path.join(a.megatron_lm, "pretrain_gpt.py")]
    pypath = os.pathsep.join([a.megatron_lm, ROOT, os.environ.get("PYTHONPATH", "")]).rstrip(":")
    env = {"PYTHONPATH": pypath, "CUDA_DEVICE_MAX_CONNECTIONS": "1"}
    common = model_flags(a)
    return [
        RunCmd(
            "stock_cp",
            a.nproc,
            torchrun + ["--nproc-per-node", str(a.nproc)] + stock + common
            + ["--context-parallel-size", str(cp), "--cp-comm-type", "p2p"],
            env,
        ),
        RunCmd(
            "stock_no_cp",
            2,
            torchrun + ["--nproc-per-node", "2"] + stock + common + ["--context-parallel-size", "1"],
            env,
        ),
        RunCmd(
            "hexiseq",
            a.nproc,
            torchrun + ["--nproc-per-node", str(a.nproc), "-m", "megatron_hexiseq.pretrain_gpt"]
            + common
            + ["--context-parallel-size", str(cp), "--cp-comm-type", "hexiseq",
               "--hexiseq-layout", layout_path, "--hexiseq-allow-mismatch"],
            env,
        ),
    ]  # fmt: skip


LOG_LINE = re.compile(
    r"iteration\s+(\d+)/\s*\d+\s*\|.*?lm loss:\s*([0-9.Ee+-]+).*?grad norm:\s*([0-9.Ee+-]+)"
)


def parse_log(text: str) -> dict[int, tuple[float, float]]:
    """Megatron's training log -> {iteration: (lm loss, grad norm)}."""
    out = {}
    for m in LOG_LINE.finditer(text):
        out[int(m.group(1))] = (float(m.group(2)), float(m.group(3)))
    return out


def compare_runs(runs: dict[str, dict[int, tuple[float, float]]], steps: int) -> dict[str, Any]:
    """HexiSeq vs stock CP against the yardstick stock CP vs stock without CP (module docstring)."""
    missing = [n for n, r in runs.items() if sorted(r) != list(range(1, steps + 1))]
    if missing:
        return {"pass": False, "error": f"runs without {steps} logged steps: {missing}"}

    def rel(x: str, y: str, i: int) -> float:
        return max(
            abs(runs[x][s][i] - runs[y][s][i]) / abs(runs[y][s][i]) for s in range(1, steps + 1)
        )

    res: dict[str, Any] = {"steps": steps}
    ok = True
    for i, name in ((0, "lm_loss"), (1, "grad_norm")):
        yard, hexi = rel("stock_cp", "stock_no_cp", i), rel("hexiseq", "stock_cp", i)
        allowed = 2 * yard + 2 * U_BF16
        res[name] = {
            "hexiseq_vs_stock_cp": hexi,
            "stock_cp_vs_stock_no_cp": yard,
            "allowed": allowed,
        }
        ok &= hexi <= allowed
    res["pass"] = ok
    res["final"] = {n: runs[n][steps] for n in runs}
    return res


def pretrain_main(a: argparse.Namespace) -> int:
    if a.nproc < 4 or a.nproc % 2:
        raise HexiSeqError(
            f"the pretrain part needs an even number of GPUs >= 4 (2 replicas x CP >= 2), got "
            f"{a.nproc}; run only the attention part (scripts/gpu_check_multi.sh does on 2-3 GPUs)"
        )
    if not os.path.isfile(os.path.join(a.megatron_lm, "pretrain_gpt.py")):
        raise HexiSeqError(
            f"no pretrain_gpt.py in --megatron-lm {a.megatron_lm}; set MEGATRON_LM to a "
            "Megatron-LM core_v0.16.1 checkout"
        )
    os.makedirs(a.out, exist_ok=True)
    layout = uneven_layout(a.seq_length, a.nproc // 2, 16, 4)
    layout_path = os.path.join(a.out, "pretrain_layout.json")
    layout.save(layout_path)
    cmds = pretrain_commands(a, layout_path)
    if a.dry_run:
        for c in cmds:
            print(f"# {c.name} ({c.nproc} processes)\n{c.shell()}")
        return 0
    import importlib.util

    if importlib.util.find_spec("transformer_engine") is None:
        result = {
            "pass": False,
            "error": "Transformer Engine is not installed (pip install transformer_engine[pytorch])",
        }
        write_json_atomic(os.path.join(a.out, "pretrain.json"), result)
        print(f"pretrain: FAIL {result['error']}")
        return 1
    runs, rcs = {}, {}
    for c in cmds:
        log = os.path.join(a.out, f"pretrain_{c.name}.log")
        print(f"pretrain: running {c.name} ({c.nproc} GPUs), log {log}", flush=True)
        with open(log, "w", encoding="utf-8") as f:
            try:
                rcs[c.name] = subprocess.run(
                    c.argv, cwd=ROOT, env={**os.environ, **c.env}, stdout=f,
                    stderr=subprocess.STDOUT, timeout=a.hang_timeout,
                ).returncode  # fmt: skip
            except subprocess.TimeoutExpired:
                rcs[c.name] = f"timed out after {a.hang_timeout} s"
        with open(log, encoding="utf-8", errors="replace") as f:
            runs[c.name] = parse_log(f.read())
    result = compare_runs(runs, a.steps)
    result["exit_codes"] = rcs
    if any(rc != 0 for rc in rcs.values()):
        result["pass"] = False
    write_json_atomic(os.path.join(a.out, "pretrain.json"), result)
    print(f"pretrain: {'PASS' if result['pass'] else 'FAIL'} {result}", flush=True)
    return 0 if result["pass"] else 1


# ---- report ---------------------------------------------------------------------------------------
def report_main(a: argparse.Namespace) -> int:
    lines = ["| part | pass | key figures |", "|---|---|---|"]
    ok = True
    for part in a.parts.split(","):
        path = os.path.join(a.out, f"{part}.json")
        if not os.path.isfile(path):
            lines.append(f"| {part} | NO | missing ({path}): the part did not finish |")
            ok = False
            continue
        with open(path, encoding="utf-8") as f:
            r = json.load(f)
        ok &= bool(r.get("pass"))
        if "error" in r:
            figures = r["error"]
        elif part == "attention":
            figures = (
                f"{r['world_size']} ranks, {r['cases']} cases, worst error/bound "
                f"{r['worst_error_over_bound']}, {r['iterations']} iterations, memory "
                f"{r['memory_mib_rank0']}"
            )
        else:
            figures = ", ".join(
                f"{n}: hexiseq {r[n]['hexiseq_vs_stock_cp']:.3g} vs yardstick "
                f"{r[n]['stock_cp_vs_stock_no_cp']:.3g} (allowed {r[n]['allowed']:.3g})"
                for n in ("lm_loss", "grad_norm")
            )
        lines.append(f"| {part} | {'yes' if r.get('pass') else 'NO'} | {figures} |")
    table = "\n".join(lines)
    write_text_atomic(os.path.join(a.out, "gpu_check_multi.md"), f"# Multi-GPU check\n\n{table}\n")
    print(table)
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    at = sub.add_parser("attention", help="fwd/bwd vs float64 + steady memory (under torchrun)")
    at.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    at.add_argument("--layouts", type=int, default=8)
    at.add_argument("--iters", type=int, default=200)
    at.add_argument("--min-tokens", type=int, default=512)
    at.add_argument("--max-tokens", type=int, default=2048)
    at.add_argument("--seed", type=int, default=26)
    pt = sub.add_parser("pretrain", help="pretrain_gpt.py: stock CP, stock no CP, HexiSeq")
    pt.add_argument("--nproc", type=int, required=True)
    pt.add_argument("--megatron-lm", default=os.environ.get("MEGATRON_LM", "Megatron-LM"))
    pt.add_argument("--steps", type=int, default=50)
    pt.add_argument("--seq-length", type=int, default=8192)
    pt.add_argument("--dry-run", action="store_true")
    rp = sub.add_parser("report", help="the pass/fail table of --out")
    rp.add_argument("--parts", default="attention,pretrain")
    for q in (at, pt, rp):
        q.add_argument("--out", default="results/gpu_check_multi")
        q.add_argument("--hang-timeout", type=int, default=900, help="seconds before giving up")
    a = p.parse_args(argv)
    for name in ("layouts", "iters", "steps", "nproc", "seq_length", "hang_timeout"):
        if getattr(a, name, 1) < 1:
            p.error(f"--{name.replace('_', '-')} must be a positive integer")
    try:
        return {"attention": attention_main, "pretrain": pretrain_main, "report": report_main}[
            a.cmd
        ](a)
    except HexiSeqError as e:
        print(f"gpu_check_multi: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
