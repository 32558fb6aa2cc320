"""Lose a GPU, keep training, get it back: a 4 -> 3 -> 4 resume chain on the CPU testbed.

A small CPU cluster spec (2 nodes x 2 devices of two speeds) and the tiny Megatron GPT of the CPU
driver; the real planner plans the 4-GPU layout and, with ``--exclude cpu1:0``, the 3-GPU one.

1. uninterrupted: 4 ranks, ``--steps`` steps;
2. 4 ranks for the first third of the steps, checkpoint (torch_dist);
3. the GPU is lost: 3 ranks resume that checkpoint for the second third, checkpoint again;
4. the GPU is back: 4 ranks resume for the last third.
No step of the chain converts anything: each run loads what the previous world size saved. Reports
every step's loss of the chain against the uninterrupted run (relative difference, and the fp32
two-orderings bound of tests/test_megatron_gpt.py), the final parameters and AdamW state against
the uninterrupted run's, the checkpoint sizes, and the CPU and wall time of each phase (process
start-up included; the machine may be shared: wall times are noisy, CPU times less so).

    python bench/elastic_resume.py                     # 12 steps, 128 tokens
    python bench/elastic_resume.py --steps 6 --seq 48  # the test's scale

Writes results/bench/elastic_resume.{json,md,png}.
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import tempfile
import time
from dataclasses import replace

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch  # noqa: E402
from _common import write_outputs  # noqa: E402

from megatron_hexiseq.cluster import cluster_from_dict  # noqa: E402
from megatron_hexiseq.costmodel import TrainOptions  # noqa: E402
from megatron_hexiseq.elastic import diff_layouts, exclude, parse_exclusions, record_exclusions  # noqa: E402
from megatron_hexiseq.planner.plan import plan  # noqa: E402
from megatron_hexiseq.testbed.spawn import run_ranks  # noqa: E402
from megatron_hexiseq.testbed.train import TINY_GPT, TrainConfig, train_rank  # noqa: E402

CLUSTER = {
    "name": "cpu-testbed-2x2",
    "gpus": {
        "FAST-CPU": {"bf16_tflops": 0.2, "memory_gib": 8, "nvlink_GBps": 5, "efficiency": 1.0},
        "SLOW-CPU": {"bf16_tflops": 0.1, "memory_gib": 8, "nvlink_GBps": 5, "efficiency": 1.0},
    },
    "nodes": [
        {"name": "cpu0", "gpu": "FAST-CPU", "count": 2, "network_GBps": 1},
        {"name": "cpu1", "gpu": "SLOW-CPU", "count": 2, "network_GBps": 1},
    ],
}
LOST = "cpu1:0"
FP32_U = 2.0**-24


def layouts(seq: int):
    """The planner's 4-GPU layout and its layout for the 3 GPUs left without ``LOST``."""
    model = replace(TINY_GPT, seq_length=seq)
    cluster = cluster_from_dict(CLUSTER)
    full = plan(cluster, model, seq, TrainOptions(), time_limit_s=2, reproducible=True)
    kept = exclude(cluster, parse_exclusions(LOST))
    left = plan(kept.cluster, model, seq, TrainOptions(), time_limit_s=2, reproducible=True)
    return full, record_exclusions(left, kept)


def timed(fn, *args, **kwargs):
    """(result, wall s, CPU s of the child processes)."""
    cpu0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    out = fn(*args, **kwargs)
    cpu1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (
        out,
        time.perf_counter() - t0,
        (cpu1.ru_utime + cpu1.ru_stime) - (cpu0.ru_utime + cpu0.ru_stime),
    )


def folder_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(path) for f in files)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.linalg.vector_norm(a - b) / torch.linalg.vector_norm(b))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--steps", type=int, default=12, help="steps in all (a multiple of 3; default 12)"
    )
    p.add_argument("--seq", type=int, default=128, help="tokens per sequence (default 128)")
    p.add_argument("--out", default="results/bench")
    args = p.parse_args()
    if args.steps < 3 or args.steps % 3:
        p.error("--steps must be a positive multiple of 3")
    third = args.steps // 3
    l4, l3 = layouts(args.seq)
    diff = diff_layouts(l4, l3)
    base = dict(steps=args.steps, return_params=True)
    phases = {}
    with tempfile.TemporaryDirectory(prefix="elastic-resume-") as tmp:
        c1, c2 = os.path.join(tmp, "after-4"), os.path.join(tmp, "after-3")
        os.makedirs(c1)
        os.makedirs(c2)
        full, phases["uninterrupted, 4 ranks"] = _run(4, TrainConfig(layout=l4, **base))
        first, phases[f"4 ranks, steps 1-{third}, save"] = _run(
            4, TrainConfig(layout=l4, **{**base, "steps": third}, save_dir=c1, save_at_step=third)
        )
        second, phases[f"3 ranks, resume, steps {third + 1}-{2 * third}, save"] = _run(
            3,
            TrainConfig(
                layout=l3,
                **{**base, "steps": 2 * third},
                load_dir=c1,
                save_dir=c2,
                save_at_step=2 * third,
            ),
        )
        last, phases[f"4 ranks, resume, steps {2 * third + 1}-{args.steps}"] = _run(
            4, TrainConfig(layout=l4, **base, load_dir=c2)
        )
        sizes = {"after 4 ranks": folder_bytes(c1), "after 3 ranks": folder_bytes(c2)}
    chain = first.losses + second.losses + last.losses
    n = args.seq  # tokens of the global batch (micro batch 1, DP 1)
    gamma = n * FP32_U / (1 - n * FP32_U)
    tol = 2 * gamma * (TINY_GPT.num_layers + 1)
    rel_loss = [abs(a - b) / b for a, b in zip(chain, full.losses)]
    exact = all(
        torch.equal(after.resumed["params"][k], before.params[k])
        and all(
            torch.equal(after.resumed["opt_state"][k][s], before.opt_state[k][s])
            for s in before.opt_state[k]
        )
        for before, after in ((first, second), (second, last))
        for k in before.params
    )
    final = {
        "params_rel_norm_max": max(rel(last.params[k], full.params[k]) for k in full.params),
        "exp_avg_rel_norm_max": max(
            rel(last.opt_state[k]["exp_avg"], full.opt_state[k]["exp_avg"]) for k in full.params
        ),
        "exp_avg_sq_rel_norm_max": max(
            rel(last.opt_state[k]["exp_avg_sq"], full.opt_state[k]["exp_avg_sq"])
            for k in full.params
        ),
        "steps_equal": all(
            float(last.opt_state[k]["step"]) == float(full.opt_state[k]["step"]) == args.steps
            for k in full.params
        ),
    }
    data = {
        "steps": args.steps,
        "seq_length": args.seq,
        "lost": LOST,
        "layout_changes": diff.to_dict(),
        "losses": {"uninterrupted": full.losses, "chain": chain},
        "relative_loss_difference": rel_loss,
        "fp32_bound": tol,
        "restored_exactly": exact,
        "final": final,
        "checkpoint_bytes": sizes,
        "phases": phases,
        "layouts": {"4": l4.to_dict(), "3": l3.to_dict()},
    }
    rows = ["| phase | wall s | CPU s (all ranks) | median step wall s |", "|---|---|---|---|"]
    rows += [
        f"| {name} | {ph['wall_s']:.1f} | {ph['cpu_s']:.1f} | {ph['median_step_s']:.4f} |"
        for name, ph in phases.items()
    ]
    table = "\n".join(
        [
            f"{args.steps} steps, {args.seq} tokens, tiny GPT (4 layers); lost {LOST} after step {third}, back after "
            f"step {2 * third}.",
            "",
            *[f"- {line}" for line in diff.lines()],
            "",
            f"- restored exactly after each resume (parameters and AdamW state, torch.equal): {exact}",
            f"- largest relative loss difference of the chain vs the uninterrupted run: {max(rel_loss):.2e} "
            f"(fp32 two-orderings bound {tol:.1e})",
            f"- final parameters vs uninterrupted, worst relative norm: {final['params_rel_norm_max']:.2e}; "
            f"exp_avg {final['exp_avg_rel_norm_max']:.2e}; exp_avg_sq {final['exp_avg_sq_rel_norm_max']:.2e}; "
            f"step counts equal: {final['steps_equal']}",
            f"- checkpoint size: {', '.join(f'{k} {v / 1024:.0f} KiB' for k, v in sizes.items())}",
            "",
            *rows,
        ]
    )

    def draw(ax):
        steps = list(range(1, args.steps + 1))
        ax.plot(steps, full.losses, "-", color="black", label="uninterrupted, 4 ranks")
        spans = (
            (first, 0, "4 ranks", "o"),
            (second, third, "3 ranks (lost " + LOST + ")", "s"),
            (last, 2 * third, "4 ranks (GPU back)", "^"),
        )
        for res, start, label, marker in spans:
            ax.plot(
                steps[start : start + len(res.losses)],
                res.losses,
                marker,
                linestyle="none",
                label=label,
            )
        for x in (third + 0.5, 2 * third + 0.5):
            ax.axvline(x, color="grey", linestyle=":", linewidth=1)
        ax.set_xlabel("step")
        ax.set_ylabel("per-token loss")
        ax.set_title(
            f"resume on another world size: worst relative loss difference {max(rel_loss):.1e}"
        )
        ax.legend()

    write_outputs(
        args.out,
        "elastic_resume",
        data=data,
        title="Elastic resume on the CPU testbed: 4 -> 3 -> 4 ranks",
        table=table,
        plot=draw,
    )
    print(table)
    print(f"wrote {args.out}/elastic_resume.{{json,md,png}}")
    return 0


def _run(world: int, cfg: TrainConfig):
    results, wall, cpu = timed(run_ranks, train_rank, world, cfg, timeout_s=1800)
    steps = sorted(results[0].step_times_s)
    return results[0], {
        "world_size": world,
        "wall_s": wall,
        "cpu_s": cpu,
        "median_step_s": steps[len(steps) // 2] if steps else 0.0,
    }


if __name__ == "__main__":
    sys.exit(main())
