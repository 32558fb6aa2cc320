"""A job plan on the heterogeneous CPU testbed: train the job, one HexiSeq domain over every rank
and equal-share data parallelism, measure each, compare with its prediction, check the losses.

``python -m megatron_hexiseq.testbed.job_demo --job J.json --testbed 1+3`` (``JOB=1
./scripts/demo.sh`` runs ``profile`` and ``plan --global-batch B`` first to make J). The job
file records its model, its prediction and its alternatives (``JobPlan.alternative``): the runs
are the job itself, ``hexiseq-one-domain`` (the single-sequence plan over every rank, all of the
global batch through it) and ``megatron-cp-dp`` (stock Megatron's symmetric CP x HP replicas with
equal shares of the global batch), each planned and priced by the same planner and cost model.
An alternative the job does not record, or records as infeasible, is left out with a note.

Every run trains the job's model with the CPU job driver (``testbed/job_train.py``: Megatron's
GPT, Megatron DDP over every rank, AdamW) from the same weights on the same global batches, its
ranks pinned to the testbed's cores (process ``k`` on cluster rank ``run_ranks[k]``'s core), so
the per-token losses of the three runs must agree to floating-point reordering (relative 1e-4
at every step, as the layout demo). Measured throughput = the global batch's tokens / the median
over the measured steps of the slowest rank's step time; prediction error = predicted step time
/ measured - 1. The speed-up is the job's throughput over the faster of the other two.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import warnings
from dataclasses import dataclass
from typing import Any

from megatron_hexiseq.errors import HexiSeqError, run_user_command
from megatron_hexiseq.io import atomic_path, check_outputs, write_json_atomic, write_text_atomic
from megatron_hexiseq.job import JobPlan
from megatron_hexiseq.progress import waiting
from megatron_hexiseq.testbed.demo import LOSS_RTOL, NOT_INSTALLED_WARNING
from megatron_hexiseq.testbed.pinning import TestbedShape, cpu_sets
from megatron_hexiseq.testbed.spawn import run_ranks

#: (label, alternative name) of the runs besides the job itself
BASELINES = (("one HexiSeq domain", "hexiseq-one-domain"), ("equal-share DP", "megatron-cp-dp"))


@dataclass(frozen=True, kw_only=True)
class JobRun:
    """One training run of a job on the testbed."""

    name: str
    job: JobPlan
    losses: list[float]
    step_times_s: list[list[float]]  # [rank][step]
    warmup: int

    @property
    def measured_step_s(self) -> float:
        """Median over the measured steps of the slowest rank's step time."""
        steps = range(self.warmup, len(self.losses))
        return statistics.median(max(t[s] for t in self.step_times_s) for s in steps)

    @property
    def tokens_per_step(self) -> int:
        return self.job.global_batch * self.job.seq_length

    @property
    def predicted_step_s(self) -> float | None:
        value = (self.job.predicted or {}).get("step_time_s")
        return float(value) if value else None

    def to_dict(self) -> dict[str, Any]:
        predicted = self.predicted_step_s
        return {
            "name": self.name,
            "losses": self.losses,
            "step_times_s": self.step_times_s,
            "measured_step_s": self.measured_step_s,
            "tokens_per_s": self.tokens_per_step / self.measured_step_s,
            "predicted_step_s": predicted,
            "predicted_tokens_per_s": None
            if predicted is None
            else self.tokens_per_step / predicted,
            "prediction_error": None if predicted is None else predicted / self.measured_step_s - 1,
            "domains": [
                {
                    "ranks": list(d.ranks),
                    "micro_batches": d.micro_batches,
                    "tokens_per_rank": [r.num_tokens for r in d.layout.ranks],
                    "heads_per_rank": [len(r.heads) for r in d.layout.ranks],
                    "groups": [list(g.ranks) for g in d.layout.groups],
                }
                for d in self.job.domains
            ],
        }


def train_job_on_testbed(
    job: JobPlan, shape: str, *, steps: int, kernel: str = "auto"
) -> tuple[list[float], list[list[float]]]:
    """Train ``job`` on pinned testbed ranks: (losses, step times per rank)."""
    from megatron_hexiseq.megatron.job_runtime import check_job_run  # torch: seconds
    from megatron_hexiseq.testbed.job_train import JobTrainConfig, train_job_rank

    tb = TestbedShape.parse(shape)
    if job.cluster_spec.world_size != tb.world_size:
        raise HexiSeqError(
            f"the job's cluster has {job.cluster_spec.world_size} ranks but testbed {shape} has "
            f"{tb.world_size}; give the --testbed it was profiled on"
        )
    cfg = JobTrainConfig(
        model=job.model_spec, job=job, steps=steps, kernel=kernel, bucket_size=None, lr=1e-3
    )
    check_job_run(job, cfg.run_shape(), global_batch_size=None, micro_batch_size=None)
    cores = cpu_sets(tb)
    results = run_ranks(
        train_job_rank, len(job.run_ranks), cfg, cpu_sets=[cores[r] for r in job.run_ranks]
    )
    return results[0].losses, [r.step_times_s for r in results]


def compare_jobs(
    job: JobPlan, shape: str, *, steps: int, warmup: int, kernel: str = "auto"
) -> dict[str, Any]:
    """Train the job and its recorded baselines; return the comparison record."""
    plans = [("job", job)]
    notes = []
    for label, name in BASELINES:
        try:
            plans.append((label, job.alternative(name)))
        except HexiSeqError as e:
            notes.append(f"{label} left out: {e}")
    runs = []
    for label, plan in plans:
        losses, times = train_job_on_testbed(plan, shape, steps=steps, kernel=kernel)
        runs.append(JobRun(name=label, job=plan, losses=losses, step_times_s=times, warmup=warmup))
    first = runs[0]
    worst = max(
        (abs(a - b) / max(abs(a), 1e-12) for r in runs[1:] for a, b in zip(first.losses, r.losses)),
        default=0.0,
    )
    rec: dict[str, Any] = {
        "testbed": shape,
        "model": job.model_spec.name,
        "seq_length": job.seq_length,
        "global_batch": job.global_batch,
        "steps": steps,
        "warmup": warmup,
        "kernel": kernel,
        "runs": [r.to_dict() for r in runs],
        "notes": notes,
        "loss_max_rel_diff": worst,
        "losses_agree": worst <= LOSS_RTOL,
    }
    if len(runs) > 1:
        best = min(runs[1:], key=lambda r: r.measured_step_s)
        rec["best_baseline"] = best.name
        rec["speedup_measured"] = best.measured_step_s / first.measured_step_s
        predicted = [r.predicted_step_s for r in runs]
        known = [p for p in predicted if p is not None]
        if len(known) == len(predicted):
            rec["speedup_predicted"] = min(known[1:]) / known[0]
    return rec


def markdown_table(rec: dict[str, Any]) -> str:
    """The comparison as a markdown table (README, docs, the bench's .md)."""
    lines = [
        f"CPU testbed {rec['testbed']}: {rec['model']}, {rec['seq_length']} tokens x "
        f"{rec['global_batch']} sequences per step, {rec['steps']} steps ({rec['warmup']} warm-up)",
        "",
        "| run | domains (ranks: micro-batches) | measured tok/s | predicted tok/s | pred. error | final loss |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for r in rec["runs"]:
        doms = ", ".join(
            f"{'+'.join(map(str, d['ranks']))}: {d['micro_batches']}" for d in r["domains"]
        )
        pred = r["predicted_tokens_per_s"]
        err = r["prediction_error"]
        lines.append(
            f"| {r['name']} | {doms} | {r['tokens_per_s']:.0f} | "
            f"{'-' if pred is None else f'{pred:.0f}'} | "
            f"{'-' if err is None else f'{100 * err:+.1f}%'} | {r['losses'][-1]:.6f} |"
        )
    lines.append("")
    if "speedup_measured" in rec:
        pred = rec.get("speedup_predicted")
        lines.append(
            f"Job over the faster baseline ({rec['best_baseline']}): **{rec['speedup_measured']:.2f}x** "
            f"measured, {'-' if pred is None else f'{pred:.2f}x'} predicted; losses agree: "
            f"{rec['losses_agree']} (max relative difference {rec['loss_max_rel_diff']:.1e})."
        )
    lines += [f"- {n}" for n in rec["notes"]]
    return "\n".join(lines) + "\n"


def plot(rec: dict[str, Any], path: str) -> None:
    """Left: measured and predicted tokens/s of each run. Right: the loss curves (must coincide)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    names = [r["name"] for r in rec["runs"]]
    x = range(len(names))
    ax1.bar([i - 0.2 for i in x], [r["tokens_per_s"] for r in rec["runs"]], 0.4, label="measured")
    ax1.bar(
        [i + 0.2 for i in x],
        [r["predicted_tokens_per_s"] or 0 for r in rec["runs"]],
        0.4,
        label="predicted",
        color="0.7",
    )
    ax1.set_xticks(list(x), names, fontsize=8)
    ax1.set_ylabel("tokens / s")
    title = f"testbed {rec['testbed']}, {rec['global_batch']} x {rec['seq_length']} tokens per step"
    if "speedup_measured" in rec:
        title += f"\njob {rec['speedup_measured']:.2f}x over {rec['best_baseline']}"
    ax1.set_title(title, fontsize=9)
    ax1.legend(fontsize=8)
    for i, r in enumerate(rec["runs"]):
        ax2.plot(r["losses"], label=r["name"], linestyle=("-", "--", ":")[i % 3])
    ax2.set_xlabel("step")
    ax2.set_ylabel("per-token loss")
    ax2.set_title("loss curves (must coincide)", fontsize=9)
    ax2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    from megatron_hexiseq.errors import OneLineParser

    p = OneLineParser(
        prog="python -m megatron_hexiseq.testbed.job_demo", description=__doc__.splitlines()[0]
    )
    p.add_argument(
        "--job", required=True, help="job file (from 'megatron-hexiseq plan --global-batch B')"
    )
    p.add_argument("--testbed", required=True, help="testbed shape of the profile, e.g. 1+3")
    p.add_argument("--steps", type=int, default=12, help="training steps per run (default 12)")
    p.add_argument("--warmup", type=int, default=2, help="steps left out of the timing (default 2)")
    p.add_argument("--kernel", default="auto", choices=("auto", "reference"))
    p.add_argument("-o", "--output", default="results/job_demo.json", help="comparison JSON")
    p.add_argument("--markdown", default=None, help="also write the table here (.md)")
    p.add_argument("--plot", default="results/job_demo.png", help="figure; '' for none")
    args = p.parse_args(argv)
    return run_user_command(lambda: _run(args))


def _run(args: argparse.Namespace) -> int:
    if not 0 <= args.warmup < args.steps <= 100_000:
        raise HexiSeqError(
            f"--steps ({args.steps}) must exceed --warmup ({args.warmup}) >= 0 (and be at most 100000)"
        )
    plot_path = args.plot or None
    check_outputs(
        [("-o", args.output), ("--markdown", args.markdown), ("--plot", plot_path)],
        inputs=[args.job],
        figures=["--plot"],
    )
    job = JobPlan.load(args.job)
    cpu_sets(TestbedShape.parse(args.testbed))  # the cores exist
    warnings.filterwarnings("ignore", message=NOT_INSTALLED_WARNING, category=UserWarning)
    with waiting(f"training the job and its baselines on testbed {args.testbed}"):
        rec = compare_jobs(
            job, args.testbed, steps=args.steps, warmup=args.warmup, kernel=args.kernel
        )
    if plot_path:
        with atomic_path(plot_path) as tmp:
            plot(rec, tmp)
    write_json_atomic(args.output, rec)
    table = markdown_table(rec)
    if args.markdown:
        write_text_atomic(args.markdown, table)
    print(table, end="")
    print(f"wrote {args.output}" + (f" and {plot_path}" if plot_path else ""))
    return 0 if rec["losses_agree"] else 1


if __name__ == "__main__":
    sys.exit(main())
