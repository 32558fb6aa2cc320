"""Packed documents on the heterogeneous CPU testbed: per-micro-batch layouts vs the THD-style even
split vs the fixed HexiSeq layout, trained on the same packed micro-batches.

For each testbed shape: profile (calibrated with the model's own layer shapes) -> plan (the fixed
layout for one sequence) -> ``testbed.packed.compare_packed``: the structure ``plan --doc-lengths``
would choose, then three training runs on the same micro-batches packed from the document lengths
(scaled by ``--doc-scale``), ``--reset-attention-mask``: ``thd-even`` (ring structure, every document
in 2 x W zig-zag chunks), ``hexiseq-fixed`` (plan's layout), ``hexiseq-batch`` (``BatchPlanner`` per
micro-batch in the data path, groups built once). Reports measured tokens/s, the cost model's
prediction and its error, the planner's CPU time, and whether the losses agree.
Targets (issue): >= 1.2x measured over the THD-style even split, prediction error <= 15%.

    python bench/varlen_testbed.py                          # 1+2 and 1+3, 8 micro-batches each
    python bench/varlen_testbed.py --shapes 1+2 --steps 4 --seq 1024   # quick look

Writes results/bench/varlen_testbed.{json,md,png}. The testbed's speed differences come from core
sharing: run it on an otherwise idle machine (other load distorts them).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from _common import PROLONG_DOCS  # noqa: E402

from megatron_hexiseq.cluster import cluster_from_dict  # noqa: E402
from megatron_hexiseq.commands.profile import profile_testbed  # noqa: E402
from megatron_hexiseq.io import write_json_atomic, write_text_atomic  # noqa: E402
from megatron_hexiseq.model import get_model  # noqa: E402
from megatron_hexiseq.profile.measure import ProfileOptions  # noqa: E402
from megatron_hexiseq.testbed.packed import DOC_SCALE, SCHEMES, compare_packed  # noqa: E402
from megatron_hexiseq.varlen.compare import plan_fixed  # noqa: E402
from megatron_hexiseq.varlen.packing import load_doc_lengths  # noqa: E402


def bench_shape(shape: str, model, lengths, args) -> dict:
    t0 = time.perf_counter()
    spec, raw = profile_testbed(
        shape, ProfileOptions(seconds_per_test=1.0, memory_gib=4.0, model=model), quiet=True
    )
    profile_s = time.perf_counter() - t0
    cluster = cluster_from_dict(spec)
    layout, options = plan_fixed(cluster, model, model.seq_length, time_limit_s=60.0)
    rec = compare_packed(
        cluster,
        model,
        options,
        layout,
        shape,
        lengths,
        steps=args.steps,
        warmup=args.warmup,
        seed=args.seed,
        doc_scale=args.doc_scale,
    )
    rec["profile"] = spec
    rec["profile_s"] = profile_s
    return rec


def markdown(results: list[dict], meta: dict) -> str:
    lines = [
        f"# Packed documents on the heterogeneous CPU testbed ({meta['date']})",
        "",
        f"Model `{meta['model']}`, {meta['seq_length']} tokens per micro-batch, {meta['steps']} "
        f"micro-batches ({meta['warmup']} warm-up) per scheme, `{meta['docs']}` lengths x "
        f"{meta['doc_scale']:g}, seed {meta['seed']}; machine: {meta['machine']}; load average "
        f"at the start {meta['load_average_at_start'][0]:.1f}, at the end "
        f"{meta['load_average_at_end'][0]:.1f}. Flat-rate error: the same prediction with the "
        "profile's `cpu-flash` call-size curves dropped (every call at the long-block rate).",
        "",
        "| testbed | scheme | structure (groups / heads) | measured tok/s | predicted tok/s | "
        "pred. error | flat-rate error | plan ms p50 / max |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        for name, x in r["schemes"].items():
            plan = (
                ""
                if x["plan_ms_p50"] is None
                else f"{x['plan_ms_p50']:.2f} / {x['plan_ms_max']:.2f}"
            )
            lines.append(
                f"| {r['testbed']} | {name} | {x['groups']} / {x['heads']} | "
                f"{x['tokens_per_s']:.0f} | {x['predicted_tokens_per_s']:.0f} | "
                f"{100 * x['prediction_error']:+.1f}% | "
                f"{100 * x.get('prediction_error_flat', float('nan')):+.1f}% | {plan} |"
            )
    lines += [
        "",
        "| testbed | documents / micro-batch | structure chosen | speed-ups (measured) | losses agree |",
        "|---|---|---|---|---|",
    ]
    for r in results:
        ups = ", ".join(f"{k} {v:.2f}x" for k, v in r["speedups"].items())
        docs = r["documents_per_batch"]
        lines.append(
            f"| {r['testbed']} | {min(docs)}-{max(docs)} | {r['structure']['chosen']} | {ups} | "
            f"{r['losses_agree']} ({r['loss_max_rel_diff']:.1e}) |"
        )
    return "\n".join(lines) + "\n"


def plot(results: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8.5, 4))
    for i, r in enumerate(results):
        for j, name in enumerate(r["schemes"]):
            x = r["schemes"][name]
            pos = i * (len(SCHEMES) + 1) + j
            ax.bar(pos, x["tokens_per_s"], color=f"C{j}", label=name if i == 0 else None)
            ax.hlines(
                x["predicted_tokens_per_s"],
                pos - 0.4,
                pos + 0.4,
                colors="k",
                linestyles="dashed",
                label="predicted" if i == 0 and j == 0 else None,
            )
    ax.set_xticks(
        [i * (len(SCHEMES) + 1) + 1 for i in range(len(results))],
        [f"testbed {r['testbed']}" for r in results],
    )
    ax.set_ylabel("tokens/s (measured steps)")
    ax.set_title("packed documents: THD-style split vs fixed vs per-micro-batch layouts")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shapes", default="1+2,1+3")
    p.add_argument("--model-config", default="examples/models/cpu-demo.yaml")
    p.add_argument("--seq", type=int, default=2048, help="tokens per micro-batch (default 2048)")
    p.add_argument("--docs", default=PROLONG_DOCS, help="JSON list of document lengths")
    p.add_argument("--doc-scale", type=float, default=DOC_SCALE)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default="results/bench")
    args = p.parse_args()
    os.makedirs(args.out, exist_ok=True)
    model = get_model(config_path=args.model_config, overrides={"seq_length": args.seq})
    lengths = load_doc_lengths(args.docs)
    results = []
    load_at_start = os.getloadavg()
    for shape in args.shapes.split(","):
        print(f"[varlen-testbed] testbed {shape}", flush=True)
        results.append(bench_shape(shape, model, lengths, args))
    meta = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "model": model.name,
        "seq_length": args.seq,
        "steps": args.steps,
        "warmup": args.warmup,
        "seed": args.seed,
        "docs": os.path.basename(args.docs),
        "doc_scale": args.doc_scale,
        "machine": f"{os.cpu_count()} cores, {os.uname().machine}, torch {__import__('torch').__version__}",
        "load_average_at_start": load_at_start,
        "load_average_at_end": os.getloadavg(),
    }
    base = os.path.join(args.out, "varlen_testbed")
    write_json_atomic(base + ".json", {"meta": meta, "results": results})
    md = markdown(results, meta)
    write_text_atomic(base + ".md", md)
    plot(results, base + ".png")
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
