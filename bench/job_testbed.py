"""A job plan on the heterogeneous CPU testbed: the job vs one HexiSeq domain vs equal-share DP.

For each case ``SHAPE:SEQ:B`` (testbed shape, tokens per sequence, sequences per step): profile
the testbed (calibrated with the model's own layer shapes) -> ``megatron-hexiseq plan --global-batch
B`` (the job planner; its file records the alternatives it priced) -> train the job,
``hexiseq-one-domain`` and ``megatron-cp-dp`` (equal shares) ``--runs`` times each, alternating,
``--steps`` steps per run, from the same weights on the same global batches
(``megatron_hexiseq.testbed.job_demo.compare_jobs``). Reports per case the median and spread of
measured tokens/s, each run's prediction error, and the job's speed-up over the faster of the
other two; the losses of all runs must agree (relative 1e-4).

Targets (issue "[Job] Run a job plan in one Megatron run"): on a case where the plan predicts a
gain, the job >= 1.15x measured over the faster baseline and |prediction error| <= 15%; on a case
where the plan is one domain over every rank, the job measures as that domain does.

    python bench/job_testbed.py                                  # 1+3:2048:12 and 1+3:2048:1, 3 runs
    python bench/job_testbed.py --cases 1+3:2048:8 --runs 1 --steps 4 --warmup 1   # functional check

Writes results/bench/job_testbed.{json,md,png}. Run it on an otherwise idle machine: the testbed's
speed differences come from core sharing, so any other load distorts them (the script records
the load average before and after).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import yaml  # noqa: E402

from megatron_hexiseq.commands.profile import profile_testbed  # noqa: E402
from megatron_hexiseq.io import write_json_atomic, write_text_atomic  # noqa: E402
from megatron_hexiseq.job import JobPlan  # noqa: E402
from megatron_hexiseq.model import get_model  # noqa: E402
from megatron_hexiseq.profile.measure import ProfileOptions  # noqa: E402
from megatron_hexiseq.testbed.job_demo import compare_jobs, markdown_table  # noqa: E402


def plan_job(cluster_spec: dict, model_config: str, seq: int, batch: int, folder: str) -> JobPlan:
    """The job planner through its CLI (``plan --global-batch``), on the profiled cluster."""
    cluster = os.path.join(folder, "cluster.yaml")
    with open(cluster, "w", encoding="utf-8") as f:
        yaml.safe_dump(cluster_spec, f, sort_keys=False)
    out = os.path.join(folder, "job.json")
    cmd = [sys.executable, "-m", "megatron_hexiseq", "plan", "--cluster", cluster]
    cmd += ["--model-config", model_config, "--seq-length", str(seq)]
    cmd += ["--global-batch", str(batch), "-o", out]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return JobPlan.load(out)


def bench_case(case: str, args: argparse.Namespace) -> dict:
    shape, seq, batch = case.split(":")
    model = get_model(config_path=args.model_config, overrides={"seq_length": int(seq)})
    spec, _ = profile_testbed(
        shape, ProfileOptions(seconds_per_test=1.0, memory_gib=4.0, model=model), quiet=True
    )
    with tempfile.TemporaryDirectory() as folder:
        job = plan_job(spec, args.model_config, int(seq), int(batch), folder)
    records = [
        compare_jobs(job, shape, steps=args.steps, warmup=args.warmup) for _ in range(args.runs)
    ]
    names = [r["name"] for r in records[0]["runs"]]
    per_run = {}
    for i, name in enumerate(names):
        tps = [rec["runs"][i]["tokens_per_s"] for rec in records]
        err = [rec["runs"][i]["prediction_error"] for rec in records]
        per_run[name] = {
            "tokens_per_s_median": statistics.median(tps),
            "tokens_per_s_min": min(tps),
            "tokens_per_s_max": max(tps),
            "predicted_tokens_per_s": records[0]["runs"][i]["predicted_tokens_per_s"],
            "prediction_error_median": None if None in err else statistics.median(err),
            "domains": records[0]["runs"][i]["domains"],
        }
    speed = [r["speedup_measured"] for r in records if "speedup_measured" in r]
    one = next((a for a in job.alternatives if a["name"] == "hexiseq-one-domain"), None)
    return {
        "case": case,
        "profile": spec,
        "job_predicted": dict(job.predicted or {}),
        "job_is_one_domain": one is not None and len(job.domains) == 1,
        "runs": records,
        "per_run": per_run,
        "speedup_median": statistics.median(speed) if speed else None,
        "speedup_min": min(speed) if speed else None,
        "speedup_max": max(speed) if speed else None,
        "speedup_predicted": records[0].get("speedup_predicted"),
        "losses_agree": all(r["losses_agree"] for r in records),
        "notes": records[0]["notes"],
    }


def markdown(results: list[dict], meta: dict) -> str:
    lines = [
        f"# A job plan on the heterogeneous CPU testbed ({meta['date']})",
        "",
        f"Model `{meta['model']}`, {meta['runs']} runs x {meta['steps']} steps ({meta['warmup']} "
        f"warm-up) per configuration; machine: {meta['machine']}; load average before "
        f"{meta['load_before']}, after {meta['load_after']}.",
        "",
        "| case (testbed:seq:B) | run | domains (ranks: micro-batches) | tok/s median [min, max] | predicted tok/s | pred. error (median) |",
        "|---|---|---|---|---:|---:|",
    ]
    for r in results:
        for name, x in r["per_run"].items():
            doms = ", ".join(
                f"{'+'.join(map(str, d['ranks']))}: {d['micro_batches']}" for d in x["domains"]
            )
            pred, err = x["predicted_tokens_per_s"], x["prediction_error_median"]
            lines.append(
                f"| {r['case']} | {name} | {doms} | {x['tokens_per_s_median']:.0f} "
                f"[{x['tokens_per_s_min']:.0f}, {x['tokens_per_s_max']:.0f}] | "
                f"{'-' if pred is None else f'{pred:.0f}'} | "
                f"{'-' if err is None else f'{100 * err:+.1f}%'} |"
            )
    lines += [
        "",
        "| case | job over the faster baseline, median [min, max] | predicted | losses agree | notes |",
        "|---|---|---|---|---|",
    ]
    for r in results:
        s = r["speedup_median"]
        sp = r["speedup_predicted"]
        lines.append(
            f"| {r['case']} | "
            + ("-" if s is None else f"{s:.3f} [{r['speedup_min']:.3f}, {r['speedup_max']:.3f}]")
            + f" | {'-' if sp is None else f'{sp:.3f}'} | {r['losses_agree']} | "
            + ("; ".join(r["notes"]) or "")
            + " |"
        )
    lines += ["", "Last run of each case:", ""]
    lines += [markdown_table(r["runs"][-1]) for r in results]
    return "\n".join(lines) + "\n"


def plot(results: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(5 * len(results), 4), squeeze=False)
    for ax, r in zip(axes[0], results):
        for j, x in enumerate(r["per_run"].values()):
            vals = [rec["runs"][j]["tokens_per_s"] for rec in r["runs"]]
            ax.bar(j, x["tokens_per_s_median"], color=f"C{j}")
            ax.scatter([j] * len(vals), vals, color="k", s=8, zorder=3)
            if x["predicted_tokens_per_s"]:
                ax.hlines(
                    x["predicted_tokens_per_s"], j - 0.4, j + 0.4, colors="k", linestyles="dashed"
                )
        ax.set_xticks(range(len(r["per_run"])), list(r["per_run"]), fontsize=8)
        ax.set_ylabel("tokens/s (median; runs as dots; predicted dashed)")
        s = r["speedup_median"]
        ax.set_title(f"{r['case']}" + ("" if s is None else f": job {s:.2f}x"), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cases", default="1+3:2048:12,1+3:2048:1", help="SHAPE:SEQ:B,...")
    p.add_argument("--model-config", default="examples/models/cpu-demo.yaml")
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--out", default="results/bench")
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    load_before = os.getloadavg()
    results = []
    for case in args.cases.split(","):
        print(f"[job_testbed] {case}", flush=True)
        results.append(bench_case(case, args))
    meta = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "model": get_model(config_path=args.model_config).name,
        "runs": args.runs,
        "steps": args.steps,
        "warmup": args.warmup,
        "machine": f"{os.cpu_count()} cores, {os.uname().machine}, torch {__import__('torch').__version__}",
        "load_before": [round(x, 2) for x in load_before],
        "load_after": [round(x, 2) for x in os.getloadavg()],
    }
    write_json_atomic(
        os.path.join(args.out, "job_testbed.json"), {"meta": meta, "results": results}
    )
    md = markdown(results, meta)
    write_text_atomic(os.path.join(args.out, "job_testbed.md"), md)
    plot(results, os.path.join(args.out, "job_testbed.png"))
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
