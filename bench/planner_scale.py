"""Planner CPU time and peak memory from 16 to 4096 GPUs (targets: <= 0.5 s at 128, <= 10 s at 1024,
<= 60 s at 4096, CPU time of ``plan()``; the machine is shared, so CPU time is the figure).

Cluster: 4 GPU types (H100-SXM-80GB, A100-SXM-80GB, A800-80GB, L40S-48GB) in equal shares of
8-GPU nodes, 25 GB/s network per GPU (12.5 for L40S). Model gpt-13b, sequence 128K tokens per 16
GPUs (capped at 4M), distributed optimizer (fsdp when it does not fit). Every size runs in a
fresh process so the peak resident memory (``ru_maxrss``) is that size's own.

Timed separately (from the layout's ``planner`` block): ``stages_s`` (Stages I-III + calibration +
feedback rounds, including the cost-model evaluations of the planner's own candidates, for the
memory mode chosen) and ``total_s`` (``plan()`` end to end: every memory mode tried and every
baseline evaluated with the cost model). Timings are wall-clock on a shared 2-core CPU: noisy;
``cpu_s`` is the process CPU time of ``plan()`` (the planner is single-threaded, CP-SAT runs one
worker), the figure to compare versions by when other jobs share the machine.

Writes results/bench/planner_scale.{json,md,png} and prints the table.
    python bench/planner_scale.py            # all sizes
    python bench/planner_scale.py --smoke    # 16 and 32 GPUs, for the test suite
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import resource
import sys
import time

from _common import in_fresh_process, write_outputs

SIZES = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096)
TYPES = (("H100-SXM-80GB", 25), ("A100-SXM-80GB", 25), ("A800-80GB", 25), ("L40S-48GB", 12.5))
TARGETS = {128: 0.5, 1024: 10.0, 4096: 60.0}


def cluster_dict(world: int) -> dict:
    nodes = world // 8
    return {
        "name": f"four-types-{world}",
        "nodes": [
            {
                "name": f"n{i:04d}",
                "gpu": TYPES[i * len(TYPES) // nodes][0],
                "count": 8,
                "network_GBps": TYPES[i * len(TYPES) // nodes][1],
            }
            for i in range(nodes)
        ],
    }


def seq_for(world: int) -> int:
    return min(131072 * max(1, world // 16), 4 << 20)


def _one(world: int, time_limit: float, queue: mp.Queue) -> None:
    from megatron_hexiseq.cluster import cluster_from_dict
    from megatron_hexiseq.model import get_model
    from megatron_hexiseq.planner.baselines import best_baseline
    from megatron_hexiseq.planner.plan import plan
    from megatron_hexiseq.run_config import AUTO_MODES, TrainOptions

    cl = cluster_from_dict(cluster_dict(world))
    seq = seq_for(world)
    m = get_model("gpt-13b", overrides={"seq_length": seq})
    t0, c0 = time.perf_counter(), time.process_time()
    lay = plan(cl, m, seq, TrainOptions(), modes=AUTO_MODES, time_limit_s=time_limit)
    total, cpu = time.perf_counter() - t0, time.process_time() - c0
    o = lay.meta["options"]
    stages = lay.planner["stages_time_s"]
    best_record = best_baseline(list(lay.baselines))
    best = None if best_record is None else best_record["iteration_time_s"]
    queue.put(
        {
            "gpus": world,
            "seq_length": seq,
            "stages_s": round(stages, 3),
            "total_s": round(total, 3),
            "cpu_s": round(cpu, 3),
            "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
            "status": lay.planner["status"],
            "chosen": lay.meta["chosen"],
            "winner": lay.planner["winner"]["family"],
            "memory_mode": o["memory_mode"],
            "group_sizes": sorted(set(len(g.ranks) for g in lay.groups)),
            "groups": len(lay.groups),
            "iteration_s": lay.predicted["iteration_time_s"],
            "speedup_vs_best_baseline": round(best / lay.predicted["iteration_time_s"], 3)
            if best
            else None,
        }
    )


def run(sizes, time_limit: float) -> list[dict]:
    rows = []
    for w in sizes:
        row = in_fresh_process(_one, w, time_limit)
        rows.append(row)
        print(
            f"  {w:5d} GPUs: stages {row['stages_s']:.2f} s, total {row['total_s']:.2f} s "
            f"(CPU {row['cpu_s']:.2f} s), "
            f"peak {row['peak_rss_mib']:.0f} MiB, {row['speedup_vs_best_baseline']}x",
            flush=True,
        )
    return rows


def write(rows: list[dict], out: str) -> str:
    lines = [
        "| GPUs | seq | stages s | total s (incl. baselines) | CPU s | target s | peak RSS MiB | groups | sizes | mode | "
        "chosen | speedup vs best baseline |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---|---|---|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['gpus']} | {r['seq_length']} | {r['stages_s']:.2f} | {r['total_s']:.2f} | {r['cpu_s']:.2f} | "
            f"{TARGETS.get(r['gpus'], '')} | {r['peak_rss_mib']:.0f} | {r['groups']} | {r['group_sizes']} | "
            f"{r['memory_mode']} | {r['chosen']} | {r['speedup_vs_best_baseline']} |"
        )
    table = "\n".join(lines)

    def plot(ax) -> None:
        ax.loglog(
            [r["gpus"] for r in rows], [r["stages_s"] for r in rows], "o-", label="stages I-III"
        )
        ax.loglog(
            [r["gpus"] for r in rows],
            [r["total_s"] for r in rows],
            "s-",
            label="plan() incl. baselines",
        )
        ax.loglog(list(TARGETS), list(TARGETS.values()), "k^", label="targets")
        ax.set_xlabel("GPUs")
        ax.set_ylabel("wall time s")
        ax.legend()

    write_outputs(
        out,
        "planner_scale",
        data={
            "rows": rows,
            "targets_s": TARGETS,
            "note": "wall clock, shared 2-core CPU (noisy); cpu_s = process CPU time of plan()",
        },
        title="Planner scale",
        table=table,
        plot=plot,
        figsize=(6, 4),
    )
    return table


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="16 and 32 GPUs only")
    ap.add_argument("--sizes", type=int, nargs="*", default=None)
    ap.add_argument("--time-limit", type=float, default=600.0, help="plan()'s wall-clock cap (s)")
    ap.add_argument("--out", default="results/bench")
    args = ap.parse_args(argv)
    sizes = args.sizes or ((16, 32) if args.smoke else SIZES)
    rows = run(sizes, args.time_limit)
    print(write(rows, args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
