"""``megatron-hexiseq varlen``: packed documents: per-micro-batch layouts against the baselines."""

from __future__ import annotations

import argparse

from megatron_hexiseq.commands import describe
from megatron_hexiseq.errors import HexiSeqError, check_positive_int, short
from megatron_hexiseq.io import atomic_path, check_outputs, write_json_atomic
from megatron_hexiseq.progress import waiting

EXAMPLES = """examples:
  megatron-hexiseq varlen --cluster examples/clusters/h100-a100-l40s-32.yaml --model llama3-8b \\
      --doc-lengths ../shared/data/doc_lengths_prolong.json --tokens-per-batch 262144 \\
      --batches 8 --seed 0 -o varlen.json --plot varlen.png

Packs --batches micro-batches of --tokens-per-batch tokens from the document lengths (shuffled with
--seed; the last document of a micro-batch is cut and its rest starts the next), and prices, by the
document-masked cost model, each scheme's assignment of each micro-batch: hexiseq-batch (the
per-micro-batch planner on the structure chosen for the lengths), hexiseq-fixed (plan's layout,
document-masked), megatron-thd-cp, dynamic-cp and per-document (docs/varlen.md). out.json holds
each scheme's mean / p90 step, imbalance, K/V bytes, the planner's time per micro-batch, and every
micro-batch's document lengths and assignments (each rank's segments and heads).
"""


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "varlen",
        help="packed documents: per-micro-batch layouts against the baselines",
        description=describe(__doc__),
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--cluster", required=True, metavar="C.yaml", help="cluster spec YAML")
    m = p.add_mutually_exclusive_group(required=True)
    m.add_argument("--model", metavar="NAME", help="model preset (llama3-8b, gpt-7b, ...)")
    m.add_argument("--model-config", metavar="M.yaml", help="model spec YAML")
    p.add_argument(
        "--doc-lengths", required=True, metavar="L.json", help="JSON list of document lengths"
    )
    p.add_argument(
        "--tokens-per-batch", required=True, type=int, metavar="N", help="tokens per micro-batch"
    )
    p.add_argument("--batches", type=int, default=8, metavar="K", help="micro-batches (default 8)")
    p.add_argument("--seed", type=int, default=0, metavar="S", help="packing seed (default 0)")
    p.add_argument("-o", "--output", required=True, metavar="out.json", help="result file")
    p.add_argument("--plot", metavar="out.png", help="each rank's time per scheme")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from megatron_hexiseq.cluster import load_cluster
    from megatron_hexiseq.model import get_model
    from megatron_hexiseq.varlen.batch import MAX_BATCH_TOKENS
    from megatron_hexiseq.varlen.compare import compare, plot_rank_times
    from megatron_hexiseq.varlen.packing import load_doc_lengths

    check_positive_int("--tokens-per-batch", args.tokens_per_batch, at_most=MAX_BATCH_TOKENS)
    check_positive_int("--batches", args.batches, at_most=100_000)
    if args.seed < 0:
        raise HexiSeqError(f"--seed must be a non-negative integer, got {short(args.seed)}")
    check_outputs(
        [("-o", args.output), ("--plot", args.plot)],
        inputs=[args.cluster, args.model_config, args.doc_lengths],
        figures=["--plot"],
    )
    cluster = load_cluster(args.cluster)
    model = get_model(
        args.model, config_path=args.model_config, overrides={"seq_length": args.tokens_per_batch}
    )
    docs = load_doc_lengths(args.doc_lengths)
    with waiting("varlen", enabled=True) as say:
        result = compare(
            cluster, model, docs, args.tokens_per_batch, args.batches, args.seed, progress=say
        )
    write_json_atomic(args.output, result)
    if args.plot:
        with atomic_path(args.plot) as tmp:
            plot_rank_times(tmp, result)
    _print_table(result)
    print(f"wrote {args.output}" + (f" and {args.plot}" if args.plot else ""))
    return 0


def _print_table(result: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    rows = result["schemes"]
    best = rows["hexiseq-batch"]["mean_step_s"]
    table = Table(
        title=f"{result['cluster']}: {result['world_size']} GPUs, {result['model']}, "
        f"{result['tokens_per_batch']:,} tokens x {result['batches_count']} micro-batches "
        f"(structure {result['structure']['chosen']})"
    )
    for col in ("scheme", "mean step s", "p90 s", "imbalance", "K/V GB", "x batch", "fits"):
        table.add_column(
            col, justify="left" if col == "scheme" else "right", no_wrap=col == "scheme"
        )
    for name, r in rows.items():
        table.add_row(
            name,
            f"{r['mean_step_s']:.4g}",
            f"{r['p90_step_s']:.4g}",
            f"{r['imbalance']:.2f}",
            f"{r['kv_bytes'] / 1e9:.3g}",
            f"{r['mean_step_s'] / best:.2f}",
            "yes" if r["feasible"] else "NO",
        )
    Console().print(table)
    b = rows["hexiseq-batch"]
    print(
        f"hexiseq-batch planning: p50 {b['plan_ms_p50']:.3g} ms, max {b['plan_ms_max']:.3g} ms per micro-batch"
    )
