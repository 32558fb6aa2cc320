"""TP bundles vs TP = 1 in the project's own cost model: 30-70B models at 128K-1M tokens on mixed
clusters of 64-1024 GPUs, TP 1 / 2 / 4 / 8 side by side and ``--tensor-model-parallel-size auto``.

Every figure is ``estimate``'s (predicted, not measured), with Megatron-FSDP's per-layer parameter
gathers and gradient reduce-scatters priced (``costmodel/step.py``: a 70B model at TP = 1 only fits
with FSDP, whose collectives cross the network every micro-batch). Each TP size is planned by
``planner.tp.plan_tp`` in every memory mode ``--memory-mode auto`` tries (distributed optimizer,
FSDP, each with and without recompute); a size whose heads, FFN or nodes it cannot split, or that
fits no mode, is "-". Clusters: ``planner_suite.random_case`` (2-4 of H100 / A100 / A800 / L40S in
random shares, 8 GPUs per node, equal or speed-matched network, node list shuffled), one per
(size, seed); models llama3-70b, codellama-34b (the 30B-class preset) and, as a control that
often fits at TP = 1 without FSDP, llama3-8b, each on its own draw; the sequence drawn from
128K-1M with 2K-32K tokens per GPU (1M at 1024 GPUs: 1K per GPU, 8K per bundle of 8). "speed-up" = the best TP = 1 plan's iteration time over
the best plan of any TP size (and over ``auto``'s); "fits w/o FSDP" = TP = 1 has a
distributed-optimizer plan, where the target is that ``auto`` is never slower than TP = 1.

    python bench/tp_suite.py                 # ~15 cases, writes results/bench/tp_suite.{json,md,png}
    python bench/tp_suite.py --quick         # 4 cases
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time

from _common import write_outputs
from planner_suite import SEQS, random_case

from megatron_hexiseq import costmodel
from megatron_hexiseq.cluster import cluster_from_dict
from megatron_hexiseq.errors import HexiSeqError
from megatron_hexiseq.model import get_model
from megatron_hexiseq.planner.tp import plan_tp
from megatron_hexiseq.run_config import AUTO_MODES, TrainOptions, options_from_record

MODELS = ("llama3-70b", "codellama-34b", "llama3-8b")  # llama3-8b: the control (fits at TP = 1)
SIZES = (64, 64, 128, 128, 256, 256, 512, 1024)
TP_SIZES = (1, 2, 4, 8)


def make_case(rng: random.Random, world: int, model: str, name: str) -> dict:
    """A mixed cluster of ``world`` GPUs (``planner_suite.random_case``) for ``model``, with a
    sequence of 2K-32K tokens per GPU (1M at 1024 GPUs: 1K per GPU, 8K per bundle of 8)."""
    case = random_case(rng, world, name)
    realistic = [s for s in SEQS if 2048 * world <= s <= 32768 * world]
    return case | {"model": model, "seq_length": rng.choice(realistic or [max(SEQS)])}


def plan_row(case: dict) -> dict:
    """Plans of every TP size and auto for one case, as a JSON row."""
    cluster = cluster_from_dict(case["spec"])
    model = get_model(case["model"], overrides={"seq_length": case["seq_length"]})
    seq = case["seq_length"]
    row = {k: case[k] for k in ("label", "model", "seq_length")} | {"gpus": cluster.world_size}
    options = TrainOptions()
    for t in (*TP_SIZES, "auto"):
        t0 = time.process_time()
        try:
            lay = plan_tp(
                cluster, model, seq, options, tensor_model_parallel_size=t, modes=AUTO_MODES
            )
        except HexiSeqError as e:
            row[f"tp{t}"] = {"feasible": False, "why": str(e)[:160]}
            continue
        cpu = time.process_time() - t0
        opts = options_from_record(lay.meta["options"], options)
        est = costmodel.estimate(lay, cluster, model, opts)
        fsdp = max(est.values("fsdp_exposed_s"))
        row[f"tp{t}"] = {
            "feasible": True,
            "tp": lay.tensor_model_parallel_size,
            "iteration_time_s": est.iteration_time_s,
            "tokens_per_s": est.tokens_per_s,
            "mode": opts.memory_mode + ("+recompute" if opts.recompute else ""),
            "fsdp_exposed_s": fsdp,
            "cpu_s": round(cpu, 3),
            "winner": lay.planner.get("winner", {}).get("name"),
        }
    times = {t: row[f"tp{t}"]["iteration_time_s"] for t in TP_SIZES if row[f"tp{t}"]["feasible"]}
    one = row["tp1"]
    row["best_tp"] = min(times, key=times.get) if times else None
    row["tp1_without_fsdp"] = bool(one["feasible"] and one["mode"].startswith("distributed"))
    if one["feasible"] and times:
        row["speedup_best"] = one["iteration_time_s"] / min(times.values())
        if row["tpauto"]["feasible"]:
            row["speedup_auto"] = one["iteration_time_s"] / row["tpauto"]["iteration_time_s"]
    return row


def cases(seed: int, quick: bool) -> list[dict]:
    rng = random.Random(seed)
    sizes = SIZES[:2] if quick else SIZES
    return [make_case(rng, w, m, f"tp-{i}-{m}") for i, w in enumerate(sizes) for m in MODELS]


def _fmt(cell: dict) -> str:
    if not cell["feasible"]:
        return "-"
    return f"{cell['iteration_time_s']:.2f} ({cell['mode'].replace('distributed_optimizer', 'do')})"


def write(rows: list[dict], out: str, seed: int) -> str:
    seventy = [
        r["speedup_auto"] for r in rows if r["model"] == "llama3-70b" and "speedup_auto" in r
    ]
    no_fsdp = [r for r in rows if r["tp1_without_fsdp"]]
    worse = [
        r["label"]
        for r in no_fsdp
        if r["tpauto"]["feasible"]
        and r["tpauto"]["iteration_time_s"] > r["tp1"]["iteration_time_s"] * (1 + 1e-9)
    ]
    lines = [
        "| case | model | seq | GPUs | tokens/GPU | TP 1 s (mode) | TP 2 | TP 4 | TP 8 | auto: t, s "
        "| auto CPU s | speed-up best / auto over TP 1 |",
        "|---|---|---:|---:|---:|---|---|---|---|---|---:|---|",
    ]
    for r in rows:
        a = r["tpauto"]
        auto = f"{a['tp']}, {a['iteration_time_s']:.2f}" if a["feasible"] else "-"
        sp = (
            f"{r['speedup_best']:.2f}x / {r['speedup_auto']:.2f}x"
            if "speedup_auto" in r
            else ("TP 1 fits no mode" if not r["tp1"]["feasible"] else "-")
        )
        lines.append(
            f"| {r['label']} | {r['model']} | {r['seq_length'] // 1024}K | {r['gpus']} | "
            f"{r['seq_length'] // r['gpus']} | "
            + " | ".join(_fmt(r[f"tp{t}"]) for t in TP_SIZES)
            + f" | {auto} | {a.get('cpu_s', '-')} | {sp} |"
        )
    summary = {
        "llama3_70b_median_speedup_auto": statistics.median(seventy) if seventy else None,
        "llama3_70b_cases": len(seventy),
        "llama3_70b_by_tokens_per_gpu": {
            str(k): [
                round(r["speedup_auto"], 3)
                for r in rows
                if r["model"] == "llama3-70b"
                and "speedup_auto" in r
                and r["seq_length"] // r["gpus"] == k
            ]
            for k in sorted({r["seq_length"] // r["gpus"] for r in rows})
        },
        "auto_missed_best_tp": [
            {
                "case": f"{r['label']} {r['model']}",
                "auto_tp": r["tpauto"]["tp"],
                "best_tp": r["best_tp"],
                "loss": r["tpauto"]["iteration_time_s"]
                / r[f"tp{r['best_tp']}"]["iteration_time_s"],
            }
            for r in rows
            if r["tpauto"]["feasible"]
            and r["tpauto"]["iteration_time_s"]
            > r[f"tp{r['best_tp']}"]["iteration_time_s"] * (1 + 1e-9)
        ],
        "tp1_fits_without_fsdp": len(no_fsdp),
        "auto_slower_than_tp1_there": worse,
    }
    lines += [
        "",
        f"llama3-70b: median speed-up of auto over the best TP = 1 plan "
        f"{summary['llama3_70b_median_speedup_auto'] or 0:.2f}x over {len(seventy)} cases "
        f"(where TP = 1 fits at all); cases where TP = 1 fits without FSDP: {len(no_fsdp)}, "
        f"auto slower than TP = 1 there: {len(worse)}.",
        f"auto's t slower than the best t of the four: {len(summary['auto_missed_best_tp'])} "
        "cases ("
        + ", ".join(
            f"{m['case']}: t={m['auto_tp']} vs {m['best_tp']}, {m['loss']:.3f}x"
            for m in summary["auto_missed_best_tp"]
        )
        + ").",
        "llama3-70b speed-ups by tokens per GPU: "
        + "; ".join(
            f"{k}: {', '.join(f'{x:.2f}x' for x in v)}"
            for k, v in summary["llama3_70b_by_tokens_per_gpu"].items()
            if v
        ),
    ]
    table = "\n".join(lines)

    def plot(ax) -> None:
        for i, model in enumerate(MODELS):
            pts = [
                (r["seq_length"] / r["gpus"], r["speedup_auto"])
                for r in rows
                if r["model"] == model and "speedup_auto" in r
            ]
            ax.scatter(
                [p[0] * (1 + 0.06 * i) for p in pts],
                [p[1] for p in pts],
                label=model,
                marker="o^s"[i],
            )
        ax.axhline(1.0, color="k", lw=1)
        ax.axhline(1.5, color="k", lw=1, ls=":")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("tokens per GPU (sequence / GPUs)")
        ax.set_ylabel("auto's speed-up over the best TP = 1 plan")
        ax.legend()

    write_outputs(
        out,
        "tp_suite",
        data={"summary": summary, "rows": rows, "seed": seed},
        title=f"TP bundles vs TP = 1 (predicted, seed {seed})",
        table=table,
        plot=plot,
    )
    return table


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seed", type=int, default=4242)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default="results/bench")
    args = ap.parse_args(argv)
    rows = []
    for case in cases(args.seed, args.quick):
        row = plan_row(case)
        rows.append(row)
        print(
            f"  {row['label']:30s} {row['model']:14s} {row['seq_length'] // 1024:5d}K: "
            + " ".join(_fmt(row[f"tp{t}"]) for t in TP_SIZES)
            + f" auto t={row['tpauto'].get('tp')}",
            flush=True,
        )
    print(write(rows, args.out, args.seed))
    return 0


if __name__ == "__main__":
    sys.exit(main())
