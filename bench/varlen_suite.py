"""Packed documents at the scope of the global batch, on generated clusters, by the cost model: HexiSeq's
global-batch scheduling against what a Megatron user has.

Cases (``cases()``, seed 2031, reproducible): clusters of 32 to 1024 GPUs in 8-GPU nodes of 2-4 types
(H100, A100, A800, L40S; ``planner_suite.cluster_spec``: node counts drawn, network *equal* or
*speed-matched*, node order shuffled) and homogeneous H100 clusters; models llama3-8b, gpt-7b and
(>= 128 GPUs) llama3-70b; loader samples of 32K-128K tokens; global batches of 16K tokens per GPU
per step, within 1M-16M tokens. Each cluster runs on two length distributions: the ProLong sample
(``../shared/data/doc_lengths_prolong.json``) and a generated heavy-tailed one (log-normal, median
2K, Pareto tail from 16K, index 1.1; its own seed per case).

Per case ``varlen.global_compare.compare_global`` (the code of ``megatron-hexiseq varlen
--global-batch-tokens``): every scheme on the same ``--steps`` global batches, every stock
configuration tried (CP sizes, hybrid CP's tokens per rank) and the best kept; tokens per GPU per
micro-batch stay within 1K-32K for the baselines and HexiSeq's domains alike. Reported: whole-cluster
tokens/s (the step = the slowest domain), hexiseq-global's speed-up over each scheme and over the
best of megatron-cp-dp / megatron-hybrid-cp / speed-aware-packing / fast-only, the slowest over the
mean domain, the schedule's and the micro-batch plans' CPU time; medians over the mixed clusters
and the homogeneous ones. ``--imbalance``: the slowest over the mean domain at DP 8 with 4
micro-batches per domain (eight equal mixed replicas). ``--schedule-time``: one thread's CPU time to
schedule a 16M-token global batch over 1024 GPUs.

Writes results/bench/varlen_suite.{json,md,png} and prints the table.
    python bench/varlen_suite.py                 # every case (tens of minutes)
    python bench/varlen_suite.py --smoke         # one small case
    python bench/varlen_suite.py --only 0 3      # some cases by index
    python bench/varlen_suite.py --only --schedule-time   # the schedule time alone
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time

from _common import PROLONG_DOCS, write_outputs
from planner_suite import TYPES, cluster_spec

from megatron_hexiseq.cluster import cluster_from_dict
from megatron_hexiseq.errors import HexiSeqError
from megatron_hexiseq.model import get_model
from megatron_hexiseq.varlen.global_compare import BASELINES, choice_steps, compare_global
from megatron_hexiseq.varlen.packing import heavy_tailed_lengths, load_doc_lengths

SIZES = (32, 64, 128, 256, 512, 1024)
SEQS = (32768, 65536, 131072)
TOKENS_PER_GPU_STEP = 16384
BEST = "best-of-4"


def cluster_case(rng: random.Random, world: int, name: str, homogeneous: bool = False) -> dict:
    nodes = world // 8
    if homogeneous:
        types, counts, network = ["H100-SXM-80GB"], [nodes], "equal"
    else:
        k = rng.choice((2, 3, 4)) if world >= 64 else rng.choice((2, 3))
        types = sorted(rng.sample(TYPES, k), key=TYPES.index)
        weights = [rng.uniform(0.5, 2.0) for _ in types]
        counts = [max(1, round(nodes * w / sum(weights))) for w in weights]
        while sum(counts) != nodes:
            j = counts.index(max(counts))
            counts[j] += 1 if sum(counts) < nodes else -1
        network = rng.choice(("equal", "matched"))
    model = rng.choice(("llama3-8b", "gpt-7b") + (("llama3-70b",) if world >= 128 else ()))
    seq = rng.choice(SEQS)
    tokens = min(16 << 20, max(1 << 20, world * TOKENS_PER_GPU_STEP))
    return {
        "label": f"{world} {'/'.join(t.split('-')[0] for t in types)} {network}",
        "spec": cluster_spec(name, types, counts, network, rng),
        "model": model,
        "seq": seq,
        "tokens": tokens - tokens % seq,
        "gpus": world,
        "homogeneous": homogeneous,
        "seed": rng.randrange(1 << 30),
    }


def cases(seed: int = 2031) -> list[dict]:
    rng = random.Random(seed)
    clusters = [cluster_case(rng, w, f"vg-{i}") for i, w in enumerate(SIZES)]
    clusters += [cluster_case(rng, w, f"vg-h{w}", homogeneous=True) for w in (64, 256)]
    return [{**c, "dist": dist} for c in clusters for dist in ("prolong", "heavy-tailed")]


def _docs(case: dict) -> list[int]:
    if case["dist"] == "prolong":
        return load_doc_lengths(PROLONG_DOCS)
    return heavy_tailed_lengths(200_000, seed=case["seed"])


def case_steps(case: dict, steps: int) -> int:
    """Global batches a case is compared on: ``steps``, or more where a step holds few samples,
    so that every case sees ``CHOICE_SAMPLES`` (64) samples at least, as the domain choice does
    (``choice_steps``): with 8 samples of 128K tokens per step and heavy-tailed lengths one long
    document decides a step (the 64-GPU case's steps ran 4.8-9 s by the same scheme)."""
    return max(steps, choice_steps(case["tokens"] // case["seq"]))


def run_case(case: dict, steps: int, tp_sizes: tuple[int, ...] = (1,)) -> dict:
    """One case compared; with several ``tp_sizes`` every scheme at its best TP size (each size
    compared on its bundle problem, ``compare_global(tensor_model_parallel_size=t)``; a size
    that does not divide the heads or a node's GPUs is skipped), its ``config`` with ``tp``."""
    cluster = cluster_from_dict(case["spec"])
    model = get_model(case["model"])
    t0 = time.process_time()
    s: dict = {}
    chosen, candidates = None, []
    for t in tp_sizes:
        try:
            res = compare_global(
                cluster, model, _docs(case), case["seq"], case["tokens"],
                case_steps(case, steps), case["seed"] % 1000, keep_assignments=False,
                tensor_model_parallel_size=t,
            )  # fmt: skip
        except HexiSeqError:  # t does not split this model or these nodes
            continue
        candidates += res["domains"].get("hexiseq-global", {}).get("candidates", [])
        for k, v in res["schemes"].items():
            v = {**v, "config": {**v["config"], "tp": t}}
            if k not in s or (not v["feasible"], v["mean_step_s"]) < (
                not s[k]["feasible"],
                s[k]["mean_step_s"],
            ):
                s[k] = v
                if k == "hexiseq-global":
                    chosen = res["domains"]["hexiseq-global"]["chosen"]
                    chosen += f" @TP{t}" if len(tp_sizes) > 1 else ""
    if "hexiseq-global" not in s:  # no HexiSeq domain set fits: reported, not compared
        row = {
            k: case[k] for k in ("label", "model", "seq", "tokens", "gpus", "homogeneous", "dist")
        }
        row["error"] = [c.get("reason", "") for c in candidates]
        return row
    ours = s["hexiseq-global"]["mean_step_s"]
    row = {
        k: case[k]
        for k in ("label", "model", "seq", "tokens", "gpus", "homogeneous", "dist", "seed")
    }
    row.update(
        {
            "tokens_per_s": {k: v["tokens_per_s"] for k, v in s.items()},
            "steps": {k: v["mean_step_s"] for k, v in s.items()},
            "compared_steps": case_steps(case, steps),
            "feasible": {k: v["feasible"] for k, v in s.items()},
            "configs": {k: v["config"] for k, v in s.items()},
            "speedup": {k: s[k]["mean_step_s"] / ours for k in s if k != "hexiseq-global"},
            "domain_imbalance": s["hexiseq-global"]["domain_imbalance"],
            "domains": chosen,
            "schedule_ms_max": s["hexiseq-global"]["schedule_ms_max"],
            "plan_ms_p50": s["hexiseq-global"]["plan_ms_p50"],
            "plan_ms_max": s["hexiseq-global"]["plan_ms_max"],
            "cpu_s": round(time.process_time() - t0, 1),
        }
    )
    present = [k for k in BASELINES if k in s and s[k]["feasible"]]
    row["best_baseline"] = min(present, key=lambda k: s[k]["mean_step_s"])
    if len(tp_sizes) > 1:  # each scheme at its own best TP size
        row["tp"] = {k: v["config"]["tp"] for k, v in s.items()}
    row["speedup"][BEST] = s[row["best_baseline"]]["mean_step_s"] / ours
    return row


def imbalance_case(steps: int) -> dict:
    """DP 8 with 4 micro-batches: eight equal mixed replicas (one H100 node + one A100 node each:
    128 GPUs), gpt-7b, 64K-token samples, 32 per step; slowest over mean domain per step."""
    from megatron_hexiseq.varlen.domain_choice import plan_domains
    from megatron_hexiseq.varlen.domains import replica_blocks
    from megatron_hexiseq.varlen.global_compare import global_batches, units_of
    from megatron_hexiseq.varlen.global_planner import GlobalPlanner
    from megatron_hexiseq.varlen.global_schemes import Pricer, hexiseq_step

    rng = random.Random(7)
    cluster = cluster_from_dict(
        cluster_spec("vg-dp8", ["H100-SXM-80GB", "A100-SXM-80GB"], [8, 8], "equal", rng)
    )
    S, samples = 65536, 32
    model = get_model("gpt-7b", overrides={"seq_length": S})
    out = {}
    for dist in ("prolong", "heavy-tailed"):
        docs = (
            load_doc_lengths(PROLONG_DOCS)
            if dist == "prolong"
            else heavy_tailed_lengths(200_000, seed=11)
        )
        doms = plan_domains(cluster, model, replica_blocks(cluster, 8), S, samples, docs)
        assert [d.micro_batches for d in doms] == [4] * 8
        gp = GlobalPlanner(doms, model)
        pricer = Pricer(cluster, model)
        ratios = []
        for b in global_batches(docs, S, samples, steps, 5):
            st = hexiseq_step(gp, pricer, units_of(b), {})
            ratios.append(max(st.domain_s) / statistics.mean(st.domain_s))
        out[dist] = {
            "per_step": [round(x, 4) for x in ratios],
            "mean": round(statistics.mean(ratios), 4),
        }
    return out


def schedule_time() -> dict:
    """One thread's CPU time (process_time) to schedule a 16M-token ProLong global batch over
    1024 GPUs (the 1024-GPU mixed case's cluster, typed domains of 8, their real cost tables)."""
    from megatron_hexiseq.varlen.domain_choice import plan_domains
    from megatron_hexiseq.varlen.domains import typed_blocks
    from megatron_hexiseq.varlen.global_compare import global_batches, units_of
    from megatron_hexiseq.varlen.global_planner import GlobalPlanner

    case = next(c for c in cases() if c["gpus"] == 1024)
    cluster = cluster_from_dict(case["spec"])
    S = 65536
    model = get_model(case["model"], overrides={"seq_length": S})
    docs = load_doc_lengths(PROLONG_DOCS)
    samples = (16 << 20) // S
    doms = plan_domains(cluster, model, typed_blocks(cluster, 8), S, samples, docs)
    gp = GlobalPlanner(doms, model)
    times = []
    for b in global_batches(docs, S, samples, 3, 1):
        u = units_of(b)
        t0 = time.process_time()
        gp.schedule(u)
        times.append(time.process_time() - t0)
    return {
        "gpus": 1024,
        "domains": len(doms),
        "units": len(u),
        "ms": [round(1e3 * t, 1) for t in times],
    }


def _med(xs: list[float]) -> float | None:
    return round(statistics.median(xs), 3) if xs else None


def summary(rows: list[dict]) -> dict:
    out: dict = {"failed": sum("error" in r for r in rows)}
    rows = [r for r in rows if "error" not in r]
    for kind, sel in (("mixed", [r for r in rows if not r["homogeneous"]]),
                      ("homogeneous", [r for r in rows if r["homogeneous"]])):  # fmt: skip
        keys = sorted({k for r in sel for k in r["speedup"]})
        out[kind] = {k: _med([r["speedup"][k] for r in sel if k in r["speedup"]]) for k in keys}
        out[kind]["cases"] = len(sel)
    out["schedule_ms_max"] = max((r["schedule_ms_max"] for r in rows), default=None)
    out["plan_ms_max"] = max((r["plan_ms_max"] for r in rows), default=None)
    return out


def _x(row: dict, k: str) -> str:
    v = row["speedup"].get(k)
    if v is None:
        return "-"
    return f"{v:.2f}" + ("" if row["feasible"].get(k, True) else "*")


def write(rows: list[dict], out: str, steps: int, extra: dict) -> str:
    s = summary(rows)
    lines = [
        "| # | case | model | S | tokens/step | dist | hexiseq domains | hexiseq tok/s | x cp-dp | "
        "x hybrid-cp | x speed-aware | x fast-only | x best (which) | x thd (appendix) | "
        "slowest/mean domain | schedule ms | plan ms p50/max |",
        "|---:|---|---|---:|---:|---|---|---:|---:|---:|---:|---:|---|---:|---:|---:|---|",
    ]
    for i, r in enumerate(rows):
        if "error" in r:
            lines.append(
                f"| {i} | {r['label']} | {r['model']} | {r['seq'] // 1024}K | "
                f"{r['tokens'] / 2**20:.0f}M | {r['dist']} | no HexiSeq domain set fits | "
                + " | ".join(["-"] * 10)
                + " |"
            )
            continue
        lines.append(
            f"| {i} | {r['label']} | {r['model']} | {r['seq'] // 1024}K | {r['tokens'] / 2**20:.0f}M | "
            f"{r['dist']} | {r['domains']} | {r['tokens_per_s']['hexiseq-global']:,.0f} | "
            f"{_x(r, 'megatron-cp-dp')} | {_x(r, 'megatron-hybrid-cp')} | "
            f"{_x(r, 'speed-aware-packing')} | {_x(r, 'fast-only')} | "
            f"{r['speedup'][BEST]:.2f} ({r['best_baseline']}"
            + (f" @TP{r['tp'][r['best_baseline']]}" if "tp" in r else "")
            + f") | {_x(r, 'megatron-thd-cp')} | "
            f"{r['domain_imbalance']:.3f} | {r['schedule_ms_max']:.3g} | "
            f"{r['plan_ms_p50']:.3g} / {r['plan_ms_max']:.3g} |"
        )
    m, h = s["mixed"], s["homogeneous"]
    if not rows:  # --only with no case: the extras alone
        lines = []
    else:
        lines += [
            "",
            f"{steps} steps per case, more where a step holds fewer than 64 samples "
            f"({', '.join(str(r.get('compared_steps', steps)) for r in rows)}); "
            "x: the scheme's mean step over hexiseq-global's (> 1: "
            "hexiseq-global faster); *: that scheme does not fit in memory in every micro-batch. "
            f"Medians, mixed clusters ({m['cases']}): over the best of the four {m.get(BEST)}x "
            f"(target 1.15), megatron-cp-dp {m.get('megatron-cp-dp')}x, megatron-hybrid-cp "
            f"{m.get('megatron-hybrid-cp')}x, speed-aware-packing {m.get('speed-aware-packing')}x, "
            f"fast-only {m.get('fast-only')}x. Homogeneous ({h['cases']}): over megatron-hybrid-cp "
            f"{h.get('megatron-hybrid-cp')}x (target 1.0), over the best {h.get(BEST)}x.",
        ]
    if not extra.get("probes", True):
        lines.append("Probes off: every scheme's tables hold the divided work alone (--no-probes).")
    if "imbalance" in extra:
        lines.append(
            "Slowest over mean domain at DP 8 x 4 micro-batches (target 1.03): "
            + ", ".join(f"{k} {v['mean']}" for k, v in extra["imbalance"].items())
        )
    if "schedule_time" in extra:
        st = extra["schedule_time"]
        lines.append(
            f"Scheduling a 16M-token global batch ({st['units']} units) over {st['gpus']} GPUs "
            f"({st['domains']} domains): {st['ms']} ms of one CPU thread (target 200)."
        )
    table = "\n".join(lines)

    def plot(ax) -> None:
        for k, color in (("megatron-cp-dp", "C0"), ("megatron-hybrid-cp", "C1"),
                         ("speed-aware-packing", "C2"), ("fast-only", "C3")):  # fmt: skip
            pts = [(r["gpus"], r["speedup"][k]) for r in rows if k in r.get("speedup", {})]
            ax.scatter([p[0] for p in pts], [p[1] for p in pts], c=color, label=f"over {k}", s=18)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.axhline(1.0, color="k", lw=1)
        ax.axhline(1.15, color="k", lw=0.6, ls="--")
        ax.set_xlabel("GPUs")
        ax.set_ylabel("hexiseq-global speed-up (cost model)")
        ax.legend(fontsize=8)

    write_outputs(
        out,
        "varlen_suite",
        data={"summary": s, "rows": rows, "steps": steps, **extra},
        title="Packed documents, global batches: hexiseq-global vs what a Megatron user has "
        "(generated clusters, cost model)",
        table=table,
        plot=plot if rows else None,  # --only with no case: the schedule time alone, no picture
    )
    return table


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="one small case")
    ap.add_argument("--only", type=int, nargs="*", default=None, help="case indices to run")
    ap.add_argument("--steps", type=int, default=2, help="global batches per case (default 2)")
    ap.add_argument("--imbalance", action="store_true", help="also the DP 8 x 4 imbalance case")
    ap.add_argument("--schedule-time", action="store_true", help="also the 1024-GPU schedule time")
    ap.add_argument(
        "--no-probes",
        action="store_true",
        help="schedule with the divided work alone (GlobalPlanner's probes off: the tables before "
        "2026-12-07), every scheme alike",
    )
    ap.add_argument(
        "--tp-sizes",
        type=int,
        nargs="+",
        default=[1],
        help="TP bundle sizes every scheme is compared at (each at its best; default 1)",
    )
    ap.add_argument("--out", default="results/bench", help="output folder")
    args = ap.parse_args(argv)
    if args.no_probes:
        from megatron_hexiseq.varlen import global_planner

        global_planner.PROBES = False
    selected = cases()
    if args.smoke:
        selected = [selected[0]]
    elif args.only is not None:
        selected = [selected[i] for i in args.only]
    steps = 1 if args.smoke else args.steps
    rows = []
    for case in selected:
        t0 = time.perf_counter()
        rows.append(run_case(case, steps, tuple(args.tp_sizes)))
        print(f"{case['label']} {case['dist']}: {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    extra: dict = {"probes": not args.no_probes, "tp_sizes": args.tp_sizes}
    if args.imbalance:
        extra["imbalance"] = imbalance_case(steps)
    if args.schedule_time:
        extra["schedule_time"] = schedule_time()
    print(write(rows, args.out, steps, extra))
    return 0


if __name__ == "__main__":
    sys.exit(main())
