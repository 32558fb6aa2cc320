"""``megatron-hexiseq varlen``: packed documents: per-micro-batch layouts, or whole global batches
scheduled over domains, against what a Megatron user has."""

from __future__ import annotations

import argparse

from megatron_hexiseq.commands import describe
from megatron_hexiseq.errors import HexiSeqError, check_positive_int, short
from megatron_hexiseq.io import atomic_path, check_outputs, write_json_atomic
from megatron_hexiseq.progress import waiting

EXAMPLES = """examples:
  megatron-hexiseq varlen --cluster examples/clusters/h100-a100-l40s-32.yaml --model llama3-8b \\
      --doc-lengths ../shared/data/doc_lengths_prolong.json --tokens-per-batch 65536 \\
      --global-batch-tokens 1048576 --batches 2 --seed 0 -o varlen.json
  megatron-hexiseq varlen --job job.json --doc-lengths ../shared/data/doc_lengths_prolong.json \\
      -o varlen.json                     # the job's domains, sequence length and global batch
  megatron-hexiseq varlen --cluster C.yaml --model llama3-8b --doc-lengths L.json \\
      --tokens-per-batch 262144 --batches 8 -o varlen.json --plot varlen.png   # one micro-batch

With --global-batch-tokens N (or --job): every step packs N tokens of documents into samples of
--tokens-per-batch tokens (shuffled with --seed; a document cut at a sample boundary is two) and
prices, by the document-masked cost model, each scheme on the whole cluster: hexiseq-global (the
step's documents scheduled over domains, each micro-batch planned in its domain), megatron-cp-dp
(every CP size), megatron-hybrid-cp (Megatron's BalancedCPScheduler), speed-aware-packing,
fast-only, and megatron-thd-cp as an appendix; the step is the slowest domain. --batches is then
the number of steps. Without it, --batches micro-batches of --tokens-per-batch tokens are priced
per scheme on one domain of every GPU (hexiseq-batch, hexiseq-fixed, megatron-thd-cp, dynamic-cp,
per-document). out.json holds every scheme's figures and, per micro-batch, each rank's cluster
rank, domain, group, segments and heads (docs/varlen.md).
"""


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "varlen",
        help="packed documents: per-micro-batch or global-batch plans against the baselines",
        description=describe(__doc__),
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--cluster", metavar="C.yaml", help="cluster spec YAML (or the --job's)")
    m = p.add_mutually_exclusive_group()
    m.add_argument("--model", metavar="NAME", help="model preset (llama3-8b, gpt-7b, ...)")
    m.add_argument("--model-config", metavar="M.yaml", help="model spec YAML")
    p.add_argument(
        "--doc-lengths", required=True, metavar="L.json", help="JSON list of document lengths"
    )
    p.add_argument(
        "--tokens-per-batch",
        type=int,
        metavar="N",
        help="tokens per micro-batch (with --global-batch-tokens: per loader sample)",
    )
    p.add_argument(
        "--global-batch-tokens",
        type=int,
        metavar="N",
        help="tokens per step: schedule whole global batches over domains",
    )
    p.add_argument("--job", metavar="job.json", help="a job file: its domains run hexiseq-global")
    p.add_argument(
        "--tensor-model-parallel-size",
        type=int,
        default=1,
        metavar="T",
        help="with --global-batch-tokens: every scheme on TP bundles of T GPUs of a node "
        "(Megatron's tensor + sequence parallelism inside; default 1)",
    )
    p.add_argument(
        "--batches",
        type=int,
        default=None,
        metavar="K",
        help="micro-batches, or steps (default 8 / 2)",
    )
    p.add_argument("--seed", type=int, default=0, metavar="S", help="packing seed (default 0)")
    p.add_argument("-o", "--output", required=True, metavar="out.json", help="result file")
    p.add_argument(
        "--plot", metavar="out.png", help="each rank's time per scheme (per micro-batch)"
    )
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from megatron_hexiseq.cluster import load_cluster
    from megatron_hexiseq.model import get_model
    from megatron_hexiseq.varlen.batch import MAX_BATCH_TOKENS
    from megatron_hexiseq.varlen.packing import load_doc_lengths

    job = None
    if args.job:
        from megatron_hexiseq.job.spec import JobPlan

        job = JobPlan.load(args.job)
    global_mode = args.global_batch_tokens is not None or job is not None
    tokens = args.tokens_per_batch
    if tokens is None and job is not None:
        tokens = job.seq_length
    if tokens is None:
        raise HexiSeqError("give --tokens-per-batch N (or --job job.json)")
    check_positive_int("--tokens-per-batch", tokens, at_most=MAX_BATCH_TOKENS)
    batches = args.batches if args.batches is not None else (2 if global_mode else 8)
    check_positive_int("--batches", batches, at_most=100_000)
    if args.seed < 0:
        raise HexiSeqError(f"--seed must be a non-negative integer, got {short(args.seed)}")
    if args.global_batch_tokens is not None:
        check_positive_int("--global-batch-tokens", args.global_batch_tokens, at_most=1 << 40)
    tp = args.tensor_model_parallel_size
    check_positive_int("--tensor-model-parallel-size", tp, at_most=64)
    if tp > 1 and args.global_batch_tokens is None:
        raise HexiSeqError(
            "--tensor-model-parallel-size compares global batches; add --global-batch-tokens N "
            "(a --job records its own TP size)"
        )
    if global_mode and args.plot:
        raise HexiSeqError("--plot draws per-micro-batch runs; drop it with --global-batch-tokens")
    check_outputs(
        [("-o", args.output), ("--plot", args.plot)],
        inputs=[args.cluster, args.model_config, args.doc_lengths, args.job],
        figures=["--plot"],
    )
    if args.cluster:
        cluster = load_cluster(args.cluster)
    elif job is not None:
        cluster = job.cluster_spec
    else:
        raise HexiSeqError("give --cluster C.yaml (or --job job.json)")
    if args.model or args.model_config:
        model = get_model(
            args.model, config_path=args.model_config, overrides={"seq_length": tokens}
        )
    elif job is not None:
        from dataclasses import replace

        model = replace(job.model_spec, seq_length=tokens)
    else:
        raise HexiSeqError("give --model NAME or --model-config M.yaml (or --job job.json)")
    if job is not None and cluster != job.cluster_spec:
        raise HexiSeqError(
            f"--cluster {args.cluster} is not the cluster the job {args.job} was planned for; "
            "drop --cluster"
        )
    docs = load_doc_lengths(args.doc_lengths)
    if global_mode:
        from megatron_hexiseq.varlen.global_compare import compare_global

        total = args.global_batch_tokens
        if total is None:
            assert job is not None
            total = job.global_batch * job.seq_length
        with waiting("varlen", enabled=True) as say:
            result = compare_global(
                cluster, model, docs, tokens, total, batches, args.seed, job=job, progress=say,
                tensor_model_parallel_size=tp,
            )  # fmt: skip
        write_json_atomic(args.output, result)
        _print_global(result)
        print(f"wrote {args.output}")
        return 0
    from megatron_hexiseq.varlen.compare import compare, plot_rank_times

    with waiting("varlen", enabled=True) as say:
        result = compare(cluster, model, docs, tokens, batches, args.seed, progress=say)
    write_json_atomic(args.output, result)
    if args.plot:
        with atomic_path(args.plot) as tmp:
            plot_rank_times(tmp, result)
    _print_table(result)
    print(f"wrote {args.output}" + (f" and {args.plot}" if args.plot else ""))
    return 0


def _print_global(result: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    rows = result["schemes"]
    ours = rows.get("hexiseq-global")
    table = Table(
        title=f"{result['cluster']}: {result['world_size']} GPUs"
        + (
            f" in TP bundles of {tp}"
            if (tp := result.get("tensor_model_parallel_size", 1)) > 1
            else ""
        )
        + f", {result['model']}, "
        f"{result['global_batch_tokens']:,} tokens per step in {result['samples_per_step']} "
        f"samples of {result['seq_length']:,} x {result['steps_count']} steps"
    )
    for col in (
        "scheme",
        "tokens/s",
        "step s",
        "slowest/mean domain",
        "x hexiseq",
        "config",
        "fits",
    ):
        table.add_column(col, justify="left" if col in ("scheme", "config") else "right")
    for name, r in rows.items():
        cfg = ", ".join(f"{k}={v}" for k, v in r["config"].items())
        label = f"{name} (appendix)" if name == "megatron-thd-cp" else name
        table.add_row(
            label,
            f"{r['tokens_per_s']:,.0f}",
            f"{r['mean_step_s']:.4g}",
            f"{r['domain_imbalance']:.3f}",
            f"{r['mean_step_s'] / ours['mean_step_s']:.2f}" if ours else "",
            cfg,
            "yes" if r["feasible"] else "NO",
        )
    Console(width=160).print(table)
    if ours:
        print(
            f"hexiseq-global: schedule {ours['schedule_ms_max']:.3g} ms max per step, micro-batch "
            f"plans p50 {ours['plan_ms_p50']:.3g} / max {ours['plan_ms_max']:.3g} ms (CPU)"
        )


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
