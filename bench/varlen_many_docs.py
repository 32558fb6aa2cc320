"""Many short documents per micro-batch: the batch planner's and the structure choice's CPU time.

SFT-style data packs thousands of short conversations into one micro-batch; the hostile extreme is
one-token documents (65,536 of them in a 64K-token micro-batch). This bench measures, for 1K to 64K
documents per micro-batch, the process CPU time (``time.process_time``: one thread; a loaded machine
does not inflate it) of

- ``BatchPlanner.plan`` on one micro-batch (median of ``--repeats`` micro-batches), on the 16-GPU
  ``mixed-h100-a100`` cluster (structure: ``plan``'s layout, ``--time-limit 5``), the 64-GPU
  ``four-types-64`` (same) and a generated 1024-GPU cluster of four GPU types (structure: the
  ``proportional(hp=8)`` heuristic, as ``plan``'s own first round costs minutes there);
- ``varlen.structure.choose_structure`` (``plan --doc-lengths``: every candidate structure x 8
  micro-batches) on the 16-GPU cluster, without a deadline (``--structure`` to include it).

Two length distributions at a fixed micro-batch of ``tokens`` (64K at 16 and 64 GPUs, 1M at 1024):
``ones`` (every document one token: ``tokens`` documents, only at the 64K point) and ``sft`` (lengths
log-normal around ``tokens / k`` with sigma 0.8, packed to exactly ``tokens``: about k documents,
shuffled). Target: 65,536 documents in one micro-batch in <= 1 s; near-linear growth in k.

Writes results/bench/varlen_many_docs.{json,md} and prints the table.
    python bench/varlen_many_docs.py                  # planner only, 1K..64K documents
    python bench/varlen_many_docs.py --structure      # and the structure choice at 16 GPUs
    python bench/varlen_many_docs.py --quick          # 1K and 64K documents, 16 GPUs only
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time

import numpy as np
from _common import write_outputs
from planner_suite import TYPES, cluster_spec

from megatron_hexiseq.cluster import Cluster, cluster_from_dict, load_cluster
from megatron_hexiseq.layout import Layout
from megatron_hexiseq.model import ModelSpec, get_model
from megatron_hexiseq.planner.heuristics import proportional
from megatron_hexiseq.planner.plan import plan
from megatron_hexiseq.run_config import TrainOptions
from megatron_hexiseq.varlen.batch import BatchPlanner
from megatron_hexiseq.varlen.structure import choose_structure

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
COUNTS = (1024, 2048, 4096, 8192, 16384, 32768, 65536)
SEED = 2031


def big_cluster() -> Cluster:
    """1024 GPUs: 128 eight-GPU nodes of H100 / A100 / A800 / L40S, speed-matched network."""
    rng = random.Random(SEED)
    return cluster_from_dict(cluster_spec("many-docs-1024", list(TYPES), [32] * 4, "matched", rng))


def setups(quick: bool) -> list[tuple[str, Cluster, ModelSpec, Layout, TrainOptions]]:
    out = []
    names = ["mixed-h100-a100"] if quick else ["mixed-h100-a100", "four-types-64"]
    for name in names:
        cluster = load_cluster(os.path.join(ROOT, "examples", "clusters", f"{name}.yaml"))
        model = get_model("gpt-7b", overrides={"seq_length": 65536})
        options = TrainOptions.for_model(model)
        layout = plan(cluster, model, 65536, options, time_limit_s=5, reproducible=True)
        out.append((name, cluster, model, layout, options))
    if not quick:
        cluster = big_cluster()
        tokens = 1 << 20
        model = get_model("llama3-8b", overrides={"seq_length": tokens})
        layout = proportional(cluster, model, tokens, 8)
        out.append(
            ("1024 H100/A100/A800/L40S", cluster, model, layout, TrainOptions.for_model(model))
        )
    return out


def lengths(dist: str, tokens: int, k: int, seed: int) -> list[int]:
    """About ``k`` documents of exactly ``tokens`` tokens in all (module docstring); ``ones``:
    ``k`` one-token documents."""
    if dist == "ones":
        return [1] * k
    rng = np.random.default_rng(seed)
    mean = tokens / k
    x = np.maximum(1, np.rint(rng.lognormal(np.log(mean) - 0.32, 0.8, 2 * k + 16))).astype(int)
    c = np.cumsum(x)
    n = int(np.searchsorted(c, tokens))
    out = x[: n + 1].tolist()
    out[-1] -= int(c[n]) - tokens
    return [v for v in out if v > 0]


def cpu_s(fn, *args) -> float:
    """Process CPU seconds of ``fn(*args)``."""
    t0 = time.process_time()
    fn(*args)
    return time.process_time() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=os.path.join(ROOT, "results", "bench"))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--structure", action="store_true", help="also time choose_structure (16 GPUs)")
    ap.add_argument("--quick", action="store_true", help="1K and 64K documents, 16 GPUs")
    args = ap.parse_args()
    counts = (1024, 65536) if args.quick else COUNTS
    rows = []
    for name, cluster, model, layout, options in setups(args.quick):
        tokens = layout.seq_length
        planner = BatchPlanner(layout, cluster, model, options)
        points = [("sft", k) for k in counts if k <= tokens // 2] + [("ones", 65536)]
        if tokens > 65536 and not args.quick:
            points.append(("ones", tokens))
        for dist, k in points:
            times, docs_n = [], []
            for rep in range(args.repeats):
                docs = lengths(dist, tokens, k, SEED + rep)
                dt = cpu_s(planner.plan, docs)
                times.append(dt)
                docs_n.append(len(docs))
            row = {
                "cluster": name,
                "gpus": cluster.world_size,
                "groups": len(layout.groups),
                "tokens": sum(docs),
                "dist": dist,
                "documents": int(statistics.median(docs_n)),
                "plan_s": round(statistics.median(times), 4),
                "plan_s_max": round(max(times), 4),
            }
            if args.structure and cluster.world_size <= 16:
                docs = lengths(dist, tokens, k, SEED)
                dt = cpu_s(choose_structure, layout, cluster, model, options, docs)
                row["structure_s"] = round(dt, 3)
            rows.append(row)
            print(row, flush=True)
    header = (
        "| cluster | GPUs | groups | tokens | dist | documents | plan s (median) | plan s (max) |"
    )
    lines = [header, "|---|---:|---:|---:|---|---:|---:|---:|"]
    if args.structure:
        lines[0] += " structure choice s |"
        lines[1] += "---:|"
    for r in rows:
        line = (
            f"| {r['cluster']} | {r['gpus']} | {r['groups']} | {r['tokens']:,} | {r['dist']} | "
            f"{r['documents']:,} | {r['plan_s']:.3f} | {r['plan_s_max']:.3f} |"
        )
        if args.structure:
            line += f" {r['structure_s']:.2f} |" if "structure_s" in r else " |"
        lines.append(line)
    write_outputs(
        args.out,
        "varlen_many_docs",
        data={"rows": rows},
        title="Many short documents per micro-batch: planner CPU seconds",
        table="\n".join(lines),
    )
    print("\n".join(lines))


if __name__ == "__main__":
    main()
