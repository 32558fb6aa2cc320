"""The HexiSeq paper's simulated settings, planned and scored with our cost model.

Settings: 32 GPUs of three types (8 H100 + 8 H100 + 8 A100 + 8 L40S nodes,
``examples/clusters/h100-a100-l40s-32.yaml``), 64 and 128 GPUs of four types (H100, A100, A800,
L40S in equal shares of 8-GPU nodes), models gpt-13b and llama3-70b, sequences 128K to 1M tokens;
plus the FLOP-comparable pairs 48 H100 + 8 A100 vs 152 A100 and 52 H100 + 4 A100 + 8 A800 vs
168 A100 (the homogeneous side is scored by its best baseline: on identical GPUs the planner and
Ulysses/USP coincide).

Hardware numbers are the catalog's (``megatron_hexiseq.cluster.GPU_CATALOG``: achieved matmul and
attention rates per GPU and kernel, the kernel ``auto`` picks, docs/specs.md "Achieved rates";
memory, NVLink one direction: H100 450, A100 300, A800 200, L40S PCIe 32 GB/s)
and 25 GB/s per GPU between nodes (12.5 GB/s for L40S nodes). Memory mode: auto (distributed
optimizer, then fsdp, then each with recompute). ``speedup`` = strongest feasible baseline's
iteration time / planned iteration time. A setting no baseline fits is reported as such (the
planner's layout may still fit).

Writes results/bench/sim_suite.{json,md,png} and prints the table.
    python bench/sim_suite.py          # every setting
    python bench/sim_suite.py --smoke  # 32 GPUs, gpt-13b, 128K only
"""

from __future__ import annotations

import argparse
import sys
import time

from _common import write_outputs

FOUR = (("H100-SXM-80GB", 25), ("A100-SXM-80GB", 25), ("A800-80GB", 25), ("L40S-48GB", 12.5))


def four_types(world: int) -> dict:
    nodes = world // 8
    return {
        "name": f"four-types-{world}",
        "nodes": [
            {
                "name": f"n{i}",
                "gpu": FOUR[i * 4 // nodes][0],
                "count": 8,
                "network_GBps": FOUR[i * 4 // nodes][1],
            }
            for i in range(nodes)
        ],
    }


def three_types_32() -> dict:
    return {
        "name": "h100-a100-l40s-32",
        "nodes": [
            {"name": "h0", "gpu": "H100-SXM-80GB", "count": 8, "network_GBps": 25},
            {"name": "h1", "gpu": "H100-SXM-80GB", "count": 8, "network_GBps": 25},
            {"name": "a0", "gpu": "A100-SXM-80GB", "count": 8, "network_GBps": 25},
            {"name": "l0", "gpu": "L40S-48GB", "count": 8, "network_GBps": 12.5},
        ],
    }


def mix(name: str, parts: list[tuple[str, int]]) -> dict:
    """Nodes of up to 8 GPUs of each type, in the order given."""
    nodes = []
    for gpu, count in parts:
        while count > 0:
            k = min(8, count)
            nodes.append({"name": f"n{len(nodes)}", "gpu": gpu, "count": k, "network_GBps": 25})
            count -= k
    return {"name": name, "nodes": nodes}


def settings(smoke: bool) -> list[tuple[str, dict, str, int]]:
    seqs = (131072,) if smoke else (131072, 262144, 524288, 1048576)
    models = ("gpt-13b",) if smoke else ("gpt-13b", "llama3-70b")
    clusters = [("32 GPUs, 3 types", three_types_32())]
    if not smoke:
        clusters += [("64 GPUs, 4 types", four_types(64)), ("128 GPUs, 4 types", four_types(128))]
    return [(label, spec, m, s) for label, spec in clusters for m in models for s in seqs]


def run_one(spec: dict, model_name: str, seq: int, time_limit: float) -> dict:
    from megatron_hexiseq.cluster import cluster_from_dict
    from megatron_hexiseq.errors import HexiSeqError
    from megatron_hexiseq.model import get_model
    from megatron_hexiseq.planner.baselines import best_baseline
    from megatron_hexiseq.planner.plan import plan
    from megatron_hexiseq.run_config import AUTO_MODES, TrainOptions

    cl = cluster_from_dict(spec)
    m = get_model(model_name, overrides={"seq_length": seq})
    t0 = time.perf_counter()
    try:
        lay = plan(cl, m, seq, TrainOptions(), modes=AUTO_MODES, time_limit_s=time_limit)
    except HexiSeqError as e:
        return {
            "gpus": cl.world_size,
            "model": model_name,
            "seq_length": seq,
            "plan_s": None,
            "best_baseline": None,
            "baseline_s": None,
            "speedup": None,
            "note": str(e)[:160],
            "solve_s": round(time.perf_counter() - t0, 2),
        }
    best = best_baseline(list(lay.baselines))
    o = lay.meta["options"]
    return {
        "gpus": cl.world_size,
        "model": model_name,
        "seq_length": seq,
        "plan_s": lay.predicted["iteration_time_s"],
        "tokens_per_s": lay.predicted["tokens_per_s"],
        "best_baseline": None if best is None else f"{best['name']}(hp={best['config'].get('hp')})",
        "baseline_s": None if best is None else best["iteration_time_s"],
        "baseline_tokens_per_s": None if best is None else best["tokens_per_s"],
        "speedup": None
        if best is None
        else best["iteration_time_s"] / lay.predicted["iteration_time_s"],
        "mode": o["memory_mode"] + ("+recompute" if o["recompute"] else ""),
        "chosen": lay.meta["chosen"],
        "groups": sorted({len(g.ranks) for g in lay.groups}),
        "solve_s": round(time.perf_counter() - t0, 2),
    }


def flop_pairs(smoke: bool) -> list[tuple[str, dict, dict]]:
    if smoke:
        return []
    return [
        (
            "48 H100 + 8 A100 vs 152 A100",
            mix("48h100-8a100", [("H100-SXM-80GB", 48), ("A100-SXM-80GB", 8)]),
            mix("152a100", [("A100-SXM-80GB", 152)]),
        ),
        (
            "52 H100 + 4 A100 + 8 A800 vs 168 A100",
            mix(
                "52h100-4a100-8a800",
                [("H100-SXM-80GB", 52), ("A100-SXM-80GB", 4), ("A800-80GB", 8)],
            ),
            mix("168a100", [("A100-SXM-80GB", 168)]),
        ),
    ]


def write(rows: list[dict], pairs: list[dict], out: str) -> str:
    sp = [r["speedup"] for r in rows if r.get("speedup")]
    summary = {
        "settings": len(rows),
        "with_baseline": len(sp),
        "mean_speedup": sum(sp) / len(sp) if sp else None,
        "max_speedup": max(sp, default=None),
        "min_speedup": min(sp, default=None),
    }

    def fmt(x, p=3):
        return "-" if x is None else f"{x:.{p}f}"

    lines = [
        "| setting | model | seq | planned s | best baseline | baseline s | speedup | mode | groups | solve s |",
        "|---|---|---:|---:|---|---:|---:|---|---|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['label']} | {r['model']} | {r['seq_length']} | {fmt(r['plan_s'])} | {r.get('best_baseline') or 'none fits'} | "
            f"{fmt(r['baseline_s'])} | {fmt(r['speedup'], 2)} | {r.get('mode', r.get('note', ''))} | "
            f"{r.get('groups', '-')} | {r['solve_s']} |"
        )
    lines.append("")
    lines.append(
        f"speedup over the strongest baseline: mean {fmt(summary['mean_speedup'], 2)}x, "
        f"max {fmt(summary['max_speedup'], 2)}x, min {fmt(summary['min_speedup'], 2)}x "
        f"over {summary['with_baseline']} settings with a feasible baseline"
    )
    if pairs:
        lines += [
            "",
            "| FLOP-comparable pair | model | seq | hetero planned tokens/s | homogeneous best baseline tokens/s | ratio |",
            "|---|---|---:|---:|---:|---:|",
        ]
        for p in pairs:
            lines.append(
                f"| {p['label']} | {p['model']} | {p['seq_length']} | {fmt(p['hetero_tokens_per_s'], 0)} | "
                f"{fmt(p['homo_tokens_per_s'], 0)} ({p['homo_baseline']}) | {fmt(p['ratio'], 3)} |"
            )
    table = "\n".join(lines)

    def plot(ax) -> None:
        ax.bar(range(len(rows)), [r.get("speedup") or 0 for r in rows])
        ax.axhline(1.0, color="k", lw=1)
        ax.set_xticks(range(len(rows)))
        ax.set_xticklabels(
            [f"{r['gpus']}/{r['model'].split('-')[-1]}/{r['seq_length'] // 1024}K" for r in rows],
            rotation=60,
            fontsize=7,
        )
        ax.set_ylabel("speedup over strongest baseline")

    write_outputs(
        out,
        "sim_suite",
        data={"summary": summary, "rows": rows, "flop_pairs": pairs},
        title="Simulation suite (cost model)",
        table=table,
        plot=plot,
        figsize=(10, 4),
    )
    return table


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--time-limit", type=float, default=600.0, help="plan()'s wall-clock cap (s)")
    ap.add_argument("--out", default="results/bench")
    args = ap.parse_args(argv)
    rows = []
    for label, spec, model, seq in settings(args.smoke):
        r = run_one(spec, model, seq, args.time_limit)
        r["label"] = label
        rows.append(r)
        print(
            f"  {label:18s} {model:10s} {seq:8d}: speedup {r['speedup'] and round(r['speedup'], 3)} "
            f"({r['solve_s']} s)",
            flush=True,
        )
    pairs = []
    for label, hetero, homo in flop_pairs(args.smoke):
        for model, seq in (("gpt-13b", 262144), ("llama3-70b", 524288)):
            h, o = (
                run_one(hetero, model, seq, args.time_limit),
                run_one(homo, model, seq, args.time_limit),
            )
            ratio = (
                (h.get("tokens_per_s") or 0) / o["baseline_tokens_per_s"]
                if o.get("baseline_tokens_per_s")
                else None
            )
            pairs.append(
                {
                    "label": label,
                    "model": model,
                    "seq_length": seq,
                    "hetero_tokens_per_s": h.get("tokens_per_s"),
                    "homo_tokens_per_s": o.get("baseline_tokens_per_s"),
                    "homo_baseline": o.get("best_baseline"),
                    "homo_planned_tokens_per_s": o.get("tokens_per_s"),
                    "ratio": ratio,
                }
            )
            print(f"  {label}: {model} ratio {ratio}", flush=True)
    print(write(rows, pairs, args.out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
