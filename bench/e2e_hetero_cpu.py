"""End-to-end speed-up on the heterogeneous CPU testbed: HexiSeq vs the best symmetric layout.

For each testbed shape: profile (calibrated with the model's own layer shapes) -> plan -> train
the best symmetric layout and the HexiSeq layout ``--runs`` times each (alternating, so drift in
machine load hits both), ``--steps`` steps per run. Reports per shape the median and spread of
measured tokens/s and speed-up, and the cost model's prediction error for both layouts.
Targets: speed-up >= 1.2x, |prediction error| <= 15% for both layouts.

    python bench/e2e_hetero_cpu.py                      # shapes 1+2 and 1+3, 5 runs, 20 steps
    python bench/e2e_hetero_cpu.py --shapes 1+2 --runs 2 --steps 8   # quick look

Writes results/bench/e2e_hetero_cpu.{json,md,png}. Run it on an otherwise idle machine: the
testbed's speed differences come from core sharing, so any other load distorts them.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from megatron_hexiseq.cluster import cluster_from_dict  # noqa: E402
from megatron_hexiseq.commands.profile import profile_testbed  # noqa: E402
from megatron_hexiseq.costmodel import TrainOptions  # noqa: E402
from megatron_hexiseq.io import write_json_atomic, write_text_atomic  # noqa: E402
from megatron_hexiseq.model import get_model  # noqa: E402
from megatron_hexiseq.planner.plan import plan  # noqa: E402
from megatron_hexiseq.profile.measure import ProfileOptions  # noqa: E402
from megatron_hexiseq.testbed.demo import compare  # noqa: E402


def bench_shape(shape: str, model, runs: int, steps: int, warmup: int) -> dict:
    spec, raw = profile_testbed(
        shape, ProfileOptions(seconds_per_test=1.0, memory_gib=4.0, model=model), quiet=True
    )
    cluster = cluster_from_dict(spec)
    options = TrainOptions()
    t0 = time.perf_counter()
    layout = plan(cluster, model, model.seq_length, options)
    plan_s = time.perf_counter() - t0
    records = [
        compare(cluster, model, options, layout, shape, steps=steps, warmup=warmup)
        for _ in range(runs)
    ]
    speed = [r["speedup_measured"] for r in records]
    out = {
        "shape": shape,
        "profile": spec,
        "latency_fit": raw.get("latency_fit"),
        "model_step": [r.get("model_step") for r in raw["ranks"]],
        "plan_s": plan_s,
        "runs": records,
        "symmetric_name": records[0]["symmetric"]["name"],
        "speedup_median": statistics.median(speed),
        "speedup_min": min(speed),
        "speedup_max": max(speed),
        "speedup_predicted": records[0]["speedup_predicted"],
        "losses_agree": all(r["losses_agree"] for r in records),
    }
    for key in ("symmetric", "hexiseq"):
        tps = [r[key]["tokens_per_s"] for r in records]
        err = [r[key]["prediction_error"] for r in records]
        out[key] = {
            "tokens_per_s_median": statistics.median(tps),
            "tokens_per_s_min": min(tps),
            "tokens_per_s_max": max(tps),
            "predicted_tokens_per_s": records[0][key]["predicted_tokens_per_s"],
            "prediction_error_median": statistics.median(err),
            "per_rank_tokens": records[0][key]["per_rank_tokens"],
            "per_rank_heads": records[0][key]["per_rank_heads"],
        }
    return out


def markdown(results: list[dict], meta: dict) -> str:
    lines = [
        f"# End-to-end, heterogeneous CPU testbed ({meta['date']})",
        "",
        f"Model `{meta['model']}`, {meta['seq_length']} tokens, {meta['runs']} runs x {meta['steps']} steps "
        f"({meta['warmup']} warm-up) per layout; machine: {meta['machine']}.",
        "",
        "| testbed | layout | tokens/rank | heads/rank | tok/s median [min, max] | predicted tok/s | pred. error |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        for key in ("symmetric", "hexiseq"):
            x = r[key]
            name = r["symmetric_name"] if key == "symmetric" else "hexiseq"
            lines.append(
                f"| {r['shape']} | {name} | {x['per_rank_tokens']} | {x['per_rank_heads']} | "
                f"{x['tokens_per_s_median']:.0f} [{x['tokens_per_s_min']:.0f}, {x['tokens_per_s_max']:.0f}] | "
                f"{x['predicted_tokens_per_s']:.0f} | {100 * x['prediction_error_median']:+.1f}% |"
            )
    lines += [
        "",
        "| testbed | speed-up median [min, max] | predicted | losses agree |",
        "|---|---|---|---|",
    ]
    for r in results:
        lines.append(
            f"| {r['shape']} | {r['speedup_median']:.3f} [{r['speedup_min']:.3f}, {r['speedup_max']:.3f}] | "
            f"{r['speedup_predicted']:.3f} | {r['losses_agree']} |"
        )
    return "\n".join(lines) + "\n"


def plot(results: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8.5, 4))
    for i, r in enumerate(results):
        for j, key in enumerate(("symmetric", "hexiseq")):
            vals = [run[key]["tokens_per_s"] for run in r["runs"]]
            x = i * 3 + j
            ax.bar(x, statistics.median(vals), color=f"C{j}", label=key if i == 0 else None)
            ax.scatter([x] * len(vals), vals, color="k", s=8, zorder=3)
            ax.hlines(
                r[key]["predicted_tokens_per_s"],
                x - 0.4,
                x + 0.4,
                colors="k",
                linestyles="dashed",
                label="predicted" if i == 0 and j == 0 else None,
            )
    ax.set_xticks(
        [i * 3 + 0.5 for i in range(len(results))], [f"testbed {r['shape']}" for r in results]
    )
    ax.set_ylabel("tokens/s (median, runs as dots)")
    ax.set_title("HexiSeq vs best symmetric layout on the CPU testbed")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default="1+2,1+3")
    p.add_argument("--model-config", default="examples/models/cpu-demo.yaml")
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--out", default="results/bench")
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    model = get_model(config_path=args.model_config)
    results = []
    for shape in args.shapes.split(","):
        print(f"[e2e] testbed {shape}", flush=True)
        results.append(bench_shape(shape, model, args.runs, args.steps, args.warmup))
    meta = {
        "date": time.strftime("%Y-%m-%d"),
        "model": model.name,
        "seq_length": model.seq_length,
        "runs": args.runs,
        "steps": args.steps,
        "warmup": args.warmup,
        "machine": f"{os.cpu_count()} cores, {os.uname().machine}, torch {__import__('torch').__version__}",
        "load_average_at_end": os.getloadavg(),
    }
    write_json_atomic(
        os.path.join(args.out, "e2e_hetero_cpu.json"), {"meta": meta, "results": results}
    )
    md = markdown(results, meta)
    write_text_atomic(os.path.join(args.out, "e2e_hetero_cpu.md"), md)
    plot(results, os.path.join(args.out, "e2e_hetero_cpu.png"))
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
