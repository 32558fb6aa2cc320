"""Whole jobs on generated mixed clusters: the job plan against every alternative, by the job model.

Cases (``cases()``, seed 2031, reproducible): clusters of 16 to 1024 GPUs in 8-GPU nodes of 2-4
types out of H100, A100, A800, L40S (``planner_suite.cluster_spec``: shares drawn, network *equal*
25 GB/s or *speed-matched* 50 / 25 / 12.5 GB/s, node order shuffled); models gpt-7b, llama3-8b,
gpt-13b (and llama3-70b from 128 GPUs); a sequence length drawn as ``g x t``, ``g`` a domain of 8-64
GPUs and ``t`` 2K-32K tokens per GPU (16K-1M tokens: a 128K sequence on 8-16 GPUs); a global batch
of 8-512 sequences, at least one per two such domains. Memory mode auto, overlapped gradient
reduction, the attention kernel the runtime picks.

Per case, each in a fresh process (``_common.in_fresh_process``): ``plan_job``'s CPU time (one
process, ``time.process_time``: the figure on a shared machine), the winner (the family and what it
chose), the job's step and TP size and every alternative's (``job.candidates.ALTERNATIVES``), the
job's speed-up over each (alternative's step / the job's; > 1: the job is faster), the domains'
tokens per GPU. The job and every alternative are planned at ``--tensor-model-parallel-size``
(default ``auto``: each at its best TP size of 1, 2, 4, 8, TP inside the node, as people configure
stock Megatron); ``--compare-tp1`` also plans each case at TP = 1 (the suite before TP bundles);
``--exhaustive-tp`` runs the search's families at every TP size (what ``auto``'s one size for
the families loses). Medians over the cases: over the better of ``megatron-cp-dp`` / ``fast-only``
(what stock Megatron offers) and over the best of ``typed-dp`` / ``hexiseq-one-domain`` /
``hexiseq-replicas``.

The paper's testbed (8 H100 + 8 A100, gpt-7b, 16K / 32K; ``examples/clusters/mixed-h100-a100.yaml``):
HexiSeq's one-domain plan against the best symmetric layout over all 16 GPUs (ring, Ulysses, USP at
every hp, each in its best memory mode: the paper's baselines), both with the step's fixed costs, at
1 and 8 sequences per step, with the kernel the runtime picks and with FlashAttention-2 on every GPU
(``--attention-kernel flash``); the paper measured 1.08x / 1.17x.

Writes results/bench/job_suite.{json,md,png} and prints the table.
    python bench/job_suite.py                 # every case
    python bench/job_suite.py --smoke         # two small cases and the paper's testbed
    python bench/job_suite.py --only 0 3      # some cases by index
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import sys
import time
from typing import Any

from _common import in_fresh_process, write_outputs
from planner_suite import TYPES, cluster_spec, node_shares

from megatron_hexiseq.cluster import cluster_from_dict, load_cluster
from megatron_hexiseq.job.candidates import ALTERNATIVES
from megatron_hexiseq.job.evaluate import Evaluator
from megatron_hexiseq.job.search import plan_job
from megatron_hexiseq.model import get_model
from megatron_hexiseq.planner.candidate import Deadline
from megatron_hexiseq.run_config import AUTO_MODES, TrainOptions

SIZES = (16, 16, 32, 32, 64, 64, 128, 128, 128, 256, 256, 512, 1024, 1024)
MODELS = ("gpt-7b", "llama3-8b", "gpt-13b")
STOCK = ("megatron-cp-dp", "fast-only")
HEXISEQ = ("typed-dp", "hexiseq-one-domain", "hexiseq-replicas")
PAPER = {16384: 1.08, 32768: 1.17}


def random_case(rng: random.Random, world: int, name: str) -> dict:
    k = rng.choice((2, 3, 4)) if world >= 64 else rng.choice((2, 3))
    types = sorted(rng.sample(TYPES, k), key=TYPES.index)
    counts = node_shares(rng, k, world // 8)
    network = rng.choice(("equal", "matched"))
    model = rng.choice(MODELS + (("llama3-70b",) if world >= 128 else ()))
    domain = rng.choice([g for g in (8, 16, 32, 64) if g <= world])
    per_gpu = rng.choice((2048, 4096, 8192, 16384, 32768))
    seq = min(1 << 20, max(1 << 14, domain * per_gpu))
    batch = rng.choice([b for b in (8, 16, 32, 64, 128, 256, 512) if 2 * b >= world // domain])
    return {
        "label": f"{world} {'/'.join(t.split('-')[0] for t in types)} {network}",
        "spec": cluster_spec(name, types, counts, network, rng),
        "model": model,
        "seq_length": seq,
        "global_batch": batch,
        "gpus": world,
        "types": k,
        "network": network,
    }


def cases(seed: int = 2031) -> list[dict]:
    rng = random.Random(seed)
    return [random_case(rng, w, f"job-{i}") for i, w in enumerate(SIZES)]


def _plan(case: dict, queue: Any) -> None:
    cluster = cluster_from_dict(case["spec"])
    model = get_model(case["model"], overrides={"seq_length": case["seq_length"]})
    options = TrainOptions.for_model(model, overlap_grad_sync=True)
    c0 = time.process_time()
    job = plan_job(
        cluster,
        model,
        case["seq_length"],
        case["global_batch"],
        options,
        tensor_model_parallel_size=case["tp"],
        exhaustive=case.get("exhaustive", False),
        modes=AUTO_MODES,
        time_limit_s=600,
        reproducible=True,
    )
    cpu = time.process_time() - c0
    alt = {a["name"]: a["step_time_s"] for a in job.alternatives}
    step = job.predicted["step_time_s"]
    sizes = [len(d.ranks) for d in job.domains]
    queue.put(
        {
            "step_s": step,
            "tp": job.tensor_model_parallel_size,
            "alternatives_tp": {
                a["name"]: a.get("tensor_model_parallel_size", 1) for a in job.alternatives
            },
            "alternatives": alt,
            "speedup": {n: (s / step if s else None) for n, s in alt.items()},
            "winner": job.planner["winner"],
            "domains": len(job.domains),
            "tokens_per_gpu": round(case["seq_length"] / statistics.fmean(sizes)),
            "memory_mode": job.predicted["memory_mode"],
            "idle_fraction": job.predicted["idle_fraction"],
            "grad_sync_s": job.predicted["grad_sync_s"],
            "cpu_s": round(cpu, 2),
            "plans": job.planner["domain_plans"],
            "time_limit_reached": job.planner["time_limit_reached"],
        }
    )


def run_case(case: dict, tp: int | str, compare_tp1: bool, exhaustive: bool = False) -> dict:
    row = {
        k: case[k]
        for k in ("label", "model", "seq_length", "global_batch", "gpus", "types", "network")
    }
    row.update(in_fresh_process(_plan, case | {"tp": tp, "exhaustive": exhaustive}))
    sp = row["speedup"]
    row["over_stock"] = _over(sp, STOCK)
    row["over_hexiseq"] = _over(sp, HEXISEQ)
    if compare_tp1 and tp != 1:  # the same job planned at TP = 1 (the suite before TP bundles)
        one = in_fresh_process(_plan, case | {"tp": 1})
        row["tp1"] = {k: one[k] for k in ("step_s", "alternatives", "cpu_s")}
        row["over_tp1"] = one["step_s"] / row["step_s"]
        row["over_stock_tp1"] = _over(
            {n: (s / row["step_s"] if s else None) for n, s in one["alternatives"].items()}, STOCK
        )
    return row


def _over(speedup: dict, names: tuple[str, ...]) -> float | None:
    """The job's speed-up over the best (fastest) of ``names``: the smallest speed-up."""
    vals = [speedup[n] for n in names if speedup.get(n)]
    return min(vals) if vals else None


# ---- the paper's testbed ------------------------------------------------------------------------
def paper_rows() -> list[dict]:
    cluster = load_cluster("examples/clusters/mixed-h100-a100.yaml")
    every = list(range(cluster.world_size))
    out = []
    for kernel in ("auto", "flash"):
        for seq in (16384, 32768):
            model = get_model("gpt-7b", overrides={"seq_length": seq})
            for batch in (1, 8):
                base = TrainOptions.for_model(
                    model, overlap_grad_sync=True, attention_kernel=kernel
                )
                ev = Evaluator(cluster, model, seq, batch, base, deadline=Deadline(600))
                ranks = ev.index.canonical_ranks()
                best_sym, best_hex, sym_label = math.inf, math.inf, ""
                for mode in AUTO_MODES:
                    opts = ev.options(every, *mode)
                    for hp in (1, 2, 4, 8, 16):
                        p = ev.price(opts, [ranks], [ev.symmetric(ranks, opts, hp)])
                        if p is not None and p.step_s < best_sym:
                            best_sym, sym_label = p.step_s, f"{p.evals[0].label}, {mode[0]}"
                    p = ev.price(opts, [ranks], [ev.hexiseq(ranks, opts)])
                    if p is not None:
                        best_hex = min(best_hex, p.step_s)
                job = plan_job(
                    cluster, model, seq, batch, base, modes=AUTO_MODES, reproducible=True
                )
                speed = best_sym / best_hex
                out.append(
                    {
                        "kernel": kernel,
                        "seq_length": seq,
                        "global_batch": batch,
                        "symmetric_s": best_sym,
                        "symmetric": sym_label,
                        "hexiseq_s": best_hex,
                        "speedup": speed,
                        "paper": PAPER[seq],
                        "off_by": speed / PAPER[seq] - 1,
                        "job_speedup": best_sym / job.predicted["step_time_s"],
                        "job_winner": job.planner["winner"]["family"],
                    }
                )
                print(
                    f"paper testbed {kernel} {seq // 1024}K B={batch}: {speed:.3f}x",
                    file=sys.stderr,
                )
    return out


# ---- report --------------------------------------------------------------------------------------
def _med(xs: list[float | None]) -> float | None:
    vals = [x for x in xs if x is not None]
    return round(statistics.median(vals), 3) if vals else None


def summary(rows: list[dict]) -> dict:
    out: dict[str, Any] = {
        "cases": len(rows),
        "median_over_stock": _med([r["over_stock"] for r in rows]),
        "median_over_hexiseq": _med([r["over_hexiseq"] for r in rows]),
        "median_over": {n: _med([r["speedup"].get(n) for r in rows]) for n in ALTERNATIVES},
        "never_slower": all(
            s is None or s >= 1 - 1e-9 for r in rows for s in r["speedup"].values()
        ),
        "winners": {},
    }
    for r in rows:
        w = r["winner"]["family"]
        out["winners"][w] = out["winners"].get(w, 0) + 1
    for w in sorted({r["gpus"] for r in rows}):
        sel = [r["cpu_s"] for r in rows if r["gpus"] == w]
        out[f"cpu_s_{w}"] = {"median": _med(sel), "max": max(sel)}
    out["job_tp"] = {str(t): sum(r.get("tp", 1) == t for r in rows) for t in (1, 2, 4, 8)}
    out["alternatives_tp"] = {
        n: {str(t): sum(r.get("alternatives_tp", {}).get(n) == t and r["speedup"].get(n) is not None
                        for r in rows) for t in (1, 2, 4, 8)}
        for n in ALTERNATIVES
    }  # fmt: skip
    if any("over_tp1" in r for r in rows):
        out["median_over_tp1"] = _med([r.get("over_tp1") for r in rows])
        out["median_over_stock_tp1"] = _med([r.get("over_stock_tp1") for r in rows])
        big = [r.get("over_tp1") for r in rows if r["model"] == "llama3-70b"]
        out["llama3_70b_over_tp1"] = {"cases": len(big), "median": _med(big)}
    return out


def _f(x: float | None, fmt: str = ".2f") -> str:
    return "-" if x is None else format(x, fmt)


def write(rows: list[dict], paper: list[dict], out: str) -> str:
    s = summary(rows)
    lines = [
        "| # | cluster | model | seq | B | job (winner) | TP | step s | tok/GPU | x cp-dp | x fast-only | "
        "x typed-dp | x one-domain | x replicas | x own TP=1 plan | mode | CPU s |",
        "|---:|---|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---:|",
    ]
    for i, r in enumerate(rows):
        sp, alt_tp = r["speedup"], r.get("alternatives_tp", {})
        lines.append(
            f"| {i} | {r['label']} | {r['model']} | {r['seq_length'] // 1024}K | {r['global_batch']} | "
            f"{r['winner']['family']}: {r['winner']['config'][:60]} | {r.get('tp', 1)} | "
            f"{r['step_s']:.4g} | {r['tokens_per_gpu']} | "
            + " | ".join(
                _f(sp.get(n)) + (f" (TP {alt_tp[n]})" if sp.get(n) and alt_tp.get(n, 1) > 1 else "")
                for n in ALTERNATIVES
            )
            + f" | {_f(r.get('over_tp1'))} | {r['memory_mode']} | {r['cpu_s']} |"
        )
    cpu = ", ".join(
        f"{k[6:]} GPUs {v['median']} / {v['max']}" for k, v in s.items() if k.startswith("cpu_s_")
    )
    lines += [
        "",
        f"Medians over {s['cases']} mixed clusters: the job over the better of megatron-cp-dp / "
        f"fast-only {s['median_over_stock']}x (target 1.3), over the best of typed-dp / "
        f"hexiseq-one-domain / hexiseq-replicas {s['median_over_hexiseq']}x (target 1.05); per "
        "alternative: "
        + ", ".join(f"{n} {v}x" for n, v in s["median_over"].items())
        + f". Never slower than an alternative: {s['never_slower']}. Winners: "
        + ", ".join(f"{k} {v}" for k, v in sorted(s["winners"].items()))
        + f". Planning CPU time (median / max, one process): {cpu} (targets 10 s at 128, 60 s at 1024)."
        + f" The job's TP size: {s['job_tp']}; each alternative's: {s['alternatives_tp']}."
        + (
            f" Over the same job planned at TP = 1: median {s['median_over_tp1']}x (llama3-70b: "
            f"{s['llama3_70b_over_tp1']}); over stock Megatron at TP = 1: median "
            f"{s['median_over_stock_tp1']}x."
            if "median_over_tp1" in s
            else ""
        ),
        "",
        "The paper's testbed (8 H100 + 8 A100, gpt-7b): one HexiSeq domain over the best symmetric "
        "layout over all 16 GPUs, both with the step's fixed costs",
        "",
        "| kernel | seq | B | best symmetric | step s | HexiSeq step s | speed-up | paper | off by | job plan x symmetric (winner) |",
        "|---|---:|---:|---|---:|---:|---:|---:|---:|---|",
    ]
    for p in paper:
        lines.append(
            f"| {p['kernel']} | {p['seq_length'] // 1024}K | {p['global_batch']} | {p['symmetric']} | "
            f"{p['symmetric_s']:.4g} | {p['hexiseq_s']:.4g} | {p['speedup']:.3f}x | {p['paper']}x | "
            f"{100 * p['off_by']:+.0f}% | {p['job_speedup']:.3f}x ({p['job_winner']}) |"
        )
    table = "\n".join(lines)

    def plot(ax: Any) -> None:
        for n, color in zip(ALTERNATIVES, ("C0", "C1", "C2", "C3", "C4")):
            pts = [(r["gpus"], r["speedup"][n]) for r in rows if r["speedup"].get(n)]
            ax.scatter([g * (1 + 0.04 * ALTERNATIVES.index(n)) for g, _ in pts], [v for _, v in pts],
                       c=color, s=16, label=f"over {n}")  # fmt: skip
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.axhline(1.0, color="k", lw=1)
        ax.set_xlabel("GPUs")
        ax.set_ylabel("job plan's speed-up (job model)")
        ax.legend(fontsize=7)

    write_outputs(
        out,
        "job_suite",
        data={"summary": s, "rows": rows, "paper_testbed": paper},
        title="Whole jobs: the job plan vs the alternatives (generated mixed clusters, job model)",
        table=table,
        plot=plot,
    )
    return table


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="two small cases and the paper's testbed")
    ap.add_argument("--only", type=int, nargs="*", default=None, help="case indices to run")
    ap.add_argument("--no-paper", action="store_true", help="skip the paper's testbed")
    ap.add_argument("--out", default="results/bench", help="output folder")
    ap.add_argument(
        "--tensor-model-parallel-size",
        default="auto",
        metavar="T|auto",
        help="TP size of the job and every alternative (default auto: each its best)",
    )
    ap.add_argument(
        "--exhaustive-tp",
        action="store_true",
        help="run the search's families at every TP size (plan_job(exhaustive=True))",
    )
    ap.add_argument(
        "--compare-tp1",
        action="store_true",
        help="also plan every case at TP = 1 (the job's speed-up over its TP = 1 plan)",
    )
    args = ap.parse_args(argv)
    tp = args.tensor_model_parallel_size
    tp = tp if tp == "auto" else int(tp)
    selected = cases()
    if args.smoke:
        selected = selected[:2]
    elif args.only is not None:
        selected = [selected[i] for i in args.only]
    rows = []
    for case in selected:
        t0 = time.perf_counter()
        rows.append(run_case(case, tp, args.compare_tp1, args.exhaustive_tp))
        print(
            f"{case['label']} {case['model']} {case['seq_length'] // 1024}K B={case['global_batch']}: "
            f"{time.perf_counter() - t0:.1f} s, cpu {rows[-1]['cpu_s']} s, winner "
            f"{rows[-1]['winner']['family']}",
            file=sys.stderr,
        )
    paper = [] if args.no_paper else paper_rows()
    print(write(rows, paper, args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
