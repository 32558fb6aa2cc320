"""Packed documents on generated clusters: per-micro-batch layouts against the baselines, by the cost model.

Cases (``cases()``, seed 2029, reproducible): clusters of 32 to 1024 GPUs in 8-GPU nodes of 2-4 types
(H100, A100, A800, L40S; ``planner_suite.cluster_spec``: shares drawn, network *equal* or
*speed-matched*, node order shuffled), plus homogeneous H100 clusters; models llama3-8b, gpt-7b and
(>= 128 GPUs) llama3-70b; 64K-1M tokens per micro-batch. Each cluster runs on two length
distributions: the ProLong sample (``../shared/data/doc_lengths_prolong.json``) and a generated
heavy-tailed one (log-normal, median 2K, Pareto tail from 16K, index 1.1; ``packing.heavy_tailed_lengths``,
its own seed per case), each packed with its own seed.

Per case ``varlen.compare.compare`` (the same code as ``megatron-hexiseq varlen``): plan's fixed layout,
the structure chosen for the distribution, ``--batches`` micro-batches priced per scheme. Reported:
hexiseq-batch's mean step over each scheme's (speed-up, > 1 = hexiseq-batch faster), the best of
dynamic-cp / per-document, the planner's time per micro-batch (p50 and max over micro-batches, one
thread, this shared machine), imbalance; medians over the mixed-GPU cases and the homogeneous ones.

Writes results/bench/varlen_suite.{json,md,png} and prints the table.
    python bench/varlen_suite.py                 # every case
    python bench/varlen_suite.py --smoke         # two small cases
    python bench/varlen_suite.py --only 0 3      # some cases by index
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
from megatron_hexiseq.model import get_model
from megatron_hexiseq.varlen.compare import compare
from megatron_hexiseq.varlen.packing import heavy_tailed_lengths, load_doc_lengths

SIZES = (32, 64, 128, 128, 256, 512, 1024)
TOKENS = (65536, 131072, 262144, 524288, 1048576)
BASELINES = ("hexiseq-fixed", "megatron-thd-cp", "dynamic-cp", "per-document")


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
    tokens = rng.choice(
        [t for t in TOKENS if t >= 256 * world and t <= 4096 * world] or [TOKENS[-1]]
    )
    return {
        "label": f"{world} {'/'.join(t.split('-')[0] for t in types)} {network}",
        "spec": cluster_spec(name, types, counts, network, rng),
        "model": model,
        "tokens": tokens,
        "gpus": world,
        "homogeneous": homogeneous,
        "seed": rng.randrange(1 << 30),
    }


def cases(seed: int = 2029) -> list[dict]:
    rng = random.Random(seed)
    clusters = [cluster_case(rng, w, f"vl-{i}") for i, w in enumerate(SIZES)]
    clusters += [cluster_case(rng, w, f"vl-h{w}", homogeneous=True) for w in (64, 256)]
    out = []
    for c in clusters:
        for dist in ("prolong", "heavy-tailed"):
            out.append({**c, "dist": dist})
    return out


def run_case(case: dict, batches: int) -> dict:
    cluster = cluster_from_dict(case["spec"])
    model = get_model(case["model"], overrides={"seq_length": case["tokens"]})
    if case["dist"] == "prolong":
        docs = load_doc_lengths(PROLONG_DOCS)
    else:
        docs = heavy_tailed_lengths(200_000, seed=case["seed"])
    t0 = time.process_time()
    res = compare(
        cluster, model, docs, case["tokens"], batches, case["seed"] % 1000, keep_assignments=False
    )
    s = res["schemes"]
    mine = s["hexiseq-batch"]["mean_step_s"]
    row = {k: case[k] for k in ("label", "model", "tokens", "gpus", "homogeneous", "dist", "seed")}
    row.update(
        {
            "structure": res["structure"]["chosen"],
            "groups": len(res["structure"]["groups"]),
            "batch_s": mine,
            "steps": {k: v["mean_step_s"] for k, v in s.items()},
            "feasible": {k: v["feasible"] for k, v in s.items()},
            "imbalance": {k: v["imbalance"] for k, v in s.items()},
            "kv_bytes": {k: v["kv_bytes"] for k, v in s.items()},
            "speedup": {k: s[k]["mean_step_s"] / mine for k in BASELINES},
            "plan_ms_p50": s["hexiseq-batch"]["plan_ms_p50"],
            "plan_ms_max": s["hexiseq-batch"]["plan_ms_max"],
            "dynamic_cp_sizes": s["dynamic-cp"]["cp_sizes"],
            "cpu_s": round(time.process_time() - t0, 2),
        }
    )
    row["speedup"]["best-dynamic-or-per-document"] = (
        min(s["dynamic-cp"]["mean_step_s"], s["per-document"]["mean_step_s"]) / mine
    )
    return row


def _med(xs: list[float]) -> float | None:
    return round(statistics.median(xs), 3) if xs else None


def summary(rows: list[dict]) -> dict:
    out: dict = {}
    for kind, sel in (("mixed", [r for r in rows if not r["homogeneous"]]),
                      ("homogeneous", [r for r in rows if r["homogeneous"]])):  # fmt: skip
        out[kind] = {
            k: _med([r["speedup"][k] for r in sel])
            for k in (*BASELINES, "best-dynamic-or-per-document")
        }
        out[kind]["cases"] = len(sel)
    for w in sorted({r["gpus"] for r in rows}):
        sel = [r for r in rows if r["gpus"] == w]
        out[f"plan_ms_{w}"] = {
            "p50": _med([r["plan_ms_p50"] for r in sel]),
            "max": max(r["plan_ms_max"] for r in sel),
        }
    return out


def write(rows: list[dict], out: str, batches: int) -> str:
    s = summary(rows)
    lines = [
        "| # | case | model | tokens | dist | structure | batch step s | x fixed | x THD-CP | "
        "x dynamic-CP (cp) | x per-doc | imbalance batch / fixed | plan ms p50 / max |",
        "|---:|---|---|---:|---|---|---:|---:|---:|---:|---:|---|---|",
    ]
    for i, r in enumerate(rows):
        sp, imb = r["speedup"], r["imbalance"]
        cps = sorted(set(r["dynamic_cp_sizes"]))
        flag = "" if all(r["feasible"].values()) else " (some OOM)"
        lines.append(
            f"| {i} | {r['label']}{flag} | {r['model']} | {r['tokens'] // 1024}K | {r['dist']} | "
            f"{r['structure']} | {r['batch_s']:.3g} | {sp['hexiseq-fixed']:.2f} | "
            f"{sp['megatron-thd-cp']:.2f} | {sp['dynamic-cp']:.2f} ({','.join(map(str, cps))}) | "
            f"{sp['per-document']:.2f} | {imb['hexiseq-batch']:.2f} / {imb['hexiseq-fixed']:.2f} | "
            f"{r['plan_ms_p50']:.3g} / {r['plan_ms_max']:.3g} |"
        )
    m, h = s["mixed"], s["homogeneous"]
    lines += [
        "",
        f"{batches} micro-batches per case. Medians of hexiseq-batch's speed-up (mean step of the "
        f"scheme / mean step of hexiseq-batch), mixed-GPU cases ({m['cases']}): over hexiseq-fixed "
        f"{m['hexiseq-fixed']}x, megatron-thd-cp {m['megatron-thd-cp']}x, dynamic-cp "
        f"{m['dynamic-cp']}x, per-document {m['per-document']}x, best of dynamic-cp / per-document "
        f"{m['best-dynamic-or-per-document']}x (targets 1.15 / 1.5 / 1.1 over the best). "
        f"Homogeneous H100 ({h['cases']}): fixed {h['hexiseq-fixed']}x, dynamic-cp {h['dynamic-cp']}x.",
        "Planning time per micro-batch (ms, p50 of cases / max): "
        + ", ".join(
            f"{k[8:]} GPUs {v['p50']} / {v['max']}"
            for k, v in s.items()
            if k.startswith("plan_ms_")
        )
        + " (targets 20 ms at 128, 100 ms at 1024).",
    ]
    table = "\n".join(lines)

    def plot(ax) -> None:
        for k, color in (("hexiseq-fixed", "C0"), ("dynamic-cp", "C1"), ("per-document", "C2")):
            ax.scatter([r["gpus"] * (1.05 if k == "dynamic-cp" else 1) for r in rows],
                       [r["speedup"][k] for r in rows], c=color, label=f"over {k}", s=18)  # fmt: skip
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.axhline(1.0, color="k", lw=1)
        ax.set_xlabel("GPUs")
        ax.set_ylabel("hexiseq-batch speed-up (cost model)")
        ax.legend(fontsize=8)

    write_outputs(
        out,
        "varlen_suite",
        data={"summary": s, "rows": rows, "batches": batches},
        title="Packed documents: per-micro-batch layouts vs baselines (generated clusters, cost model)",
        table=table,
        plot=plot,
    )
    return table


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="two small cases")
    ap.add_argument("--only", type=int, nargs="*", default=None, help="case indices to run")
    ap.add_argument("--batches", type=int, default=4, help="micro-batches per case (default 4)")
    ap.add_argument("--out", default="results/bench", help="output folder")
    args = ap.parse_args(argv)
    selected = cases()
    if args.smoke:
        selected = [selected[0], selected[1]]
    elif args.only is not None:
        selected = [selected[i] for i in args.only]
    rows = []
    for case in selected:
        t0 = time.perf_counter()
        rows.append(run_case(case, 2 if args.smoke else args.batches))
        print(f"{case['label']} {case['dist']}: {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    print(write(rows, args.out, 2 if args.smoke else args.batches))
    return 0


if __name__ == "__main__":
    sys.exit(main())
