"""``megatron-hexiseq simulate``: evaluate layouts and/or the baselines with the cost model, or a job
file and its alternatives with the job model."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from megatron_hexiseq.commands import describe
from megatron_hexiseq.commands.inputs import (
    add_problem_args,
    layout_options,
    load_problem,
    planned_options,
    problem_from_layout,
    recorded_model,
)
from megatron_hexiseq.errors import HexiSeqError
from megatron_hexiseq.io import atomic_path, check_outputs
from megatron_hexiseq.job.spec import JobPlan, load_layout_or_job
from megatron_hexiseq.layout import Layout, check_matches
from megatron_hexiseq.progress import waiting

EXAMPLES = """examples:
  megatron-hexiseq simulate --layout layout.json --baselines --plot sim.png
      (cluster and model from the layout, as 'plan' recorded them)
  megatron-hexiseq simulate --cluster examples/clusters/four-types-64.yaml --model llama3-70b \\
      --seq-length 262144 --recompute --baselines --format json
  megatron-hexiseq simulate --layout layout.json --baselines --per-rank
  megatron-hexiseq simulate --layout job.json --plot job.png   # a job file and its alternatives

Prints one summary row per layout and baseline (iteration time, tokens/s, speed-up of the best,
memory); --per-rank adds each one's per-rank table. With --memory-mode auto (default) and a
--layout, the layout's planned memory mode is used.
"""


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "simulate",
        help="evaluate layouts and baselines with the cost model",
        description=describe(__doc__),
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_problem_args(p, seq_required=False, spec_required=False)
    p.add_argument(
        "--layout",
        action="append",
        default=[],
        metavar="L.json",
        help="layout to evaluate (repeatable)",
    )
    p.add_argument(
        "--baselines",
        action="store_true",
        help="also evaluate every baseline (ring, ulysses, usp for every hp; usp is Megatron's a2a+p2p)",
    )
    p.add_argument(
        "--plot",
        metavar="out.png",
        help="per-rank compute / exposed comm / idle and memory vs capacity "
        "(.png, .pdf, .svg, ...)",
    )
    p.add_argument(
        "--per-rank", action="store_true", help="also print each layout's per-rank table"
    )
    p.add_argument(
        "--format", choices=("human", "json"), default="human", help="what to print (default human)"
    )
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    # planner modules import lazily: ortools/numpy/rich cost ~0.6 s CPU, and `megatron-hexiseq --help`
    # (every command's parser) takes ~0.1 s CPU without them
    from megatron_hexiseq.planner.report import estimate_table, make_console, plot_estimates
    from megatron_hexiseq.planner.simulate import simulate

    if not args.layout and not args.baselines:
        raise HexiSeqError("nothing to simulate: give --layout L.json and/or --baselines")
    check_outputs(
        [("--plot", args.plot)],
        inputs=[args.cluster, args.model_config, *args.layout],
        figures=["--plot"],
    )
    loaded = [(path, load_layout_or_job(path)) for path in args.layout]
    jobs = [(path, x) for path, x in loaded if isinstance(x, JobPlan)]
    if jobs:
        return _simulate_job(args, jobs[0][0], jobs[0][1], len(loaded))
    layouts = [(path, x) for path, x in loaded if isinstance(x, Layout)]
    seqs = {lay.seq_length for _, lay in layouts}
    if args.seq_length is None and len(seqs) > 1:
        raise HexiSeqError(
            f"the layouts have different seq_length {sorted(seqs)}; give --seq-length"
        )
    seq = args.seq_length if args.seq_length is not None else (seqs.pop() if seqs else None)
    if args.cluster:
        recorded = None
        if layouts and not (args.model or args.model_config):  # --help: "default: the layout's"
            path0, layout0 = layouts[0]
            recorded = recorded_model(layout0, path0)
            if recorded is None:
                raise HexiSeqError(
                    f"layout {path0} does not record its model spec; give --model NAME "
                    "or --model-config M.yaml"
                )
        elif not (args.model or args.model_config):
            raise HexiSeqError("give --model NAME or --model-config M.yaml with --cluster")
        prob = load_problem(args, seq_length=seq, model=recorded)
    else:
        prob = problem_from_layout(args, layouts, seq)
    for path, lay in layouts:
        check_matches(lay, prob.cluster, prob.model, source=f"layout {path}")
    options = prob.options
    planned = [(path, lay) for path, lay in layouts if lay.meta.get("options") is not None]
    for path, lay in layouts:
        layout_options(lay, path)  # each record type-checked
    if args.memory_mode == "auto" and planned:
        # auto: evaluate under the options the (first) layout was planned with (validate --cluster
        # checks memory the same way); flags given on the command line still win
        options = planned_options(options, planned[0][1], planned[0][0])
        options = replace(options, recompute=options.recompute or bool(args.recompute))
        if args.micro_batch_size:
            options = replace(options, micro_batch_size=args.micro_batch_size)
        if args.data_parallel_size != 1:
            options = replace(options, data_parallel_size=args.data_parallel_size)
    elif args.attention_kernel == "auto" and planned:  # the kernel the layout was planned for
        record = layout_options(planned[0][1], planned[0][0])
        options = replace(options, attention_kernel=record.get("attention_kernel", "auto"))
    if args.attention_kernel != "auto":  # given on the command line: it wins
        options = replace(options, attention_kernel=args.attention_kernel)
    with waiting("simulating", enabled=args.format != "json"):
        rows = simulate(prob.cluster, prob.model, options, layouts, baselines=args.baselines)
    if args.format == "json":
        sys.stdout.write(json.dumps([r.summary() for r in rows], indent=2) + "\n")
    else:
        console = make_console()
        if args.per_rank:
            for r in rows:
                if r.estimate is not None:
                    assert r.layout is not None  # simulate() estimates only rows with a layout
                    console.print(estimate_table(r.name, r.layout, r.estimate))
        console.print(
            summary_table(
                rows,
                title=f"{prob.cluster.name}: {prob.cluster.world_size} GPUs, "
                f"{prob.model.name}, seq_length {prob.seq_length:,}",
            )
        )
    if args.plot:
        with atomic_path(args.plot) as tmp:
            plot_estimates(tmp, [(r.name, r.estimate) for r in rows if r.estimate is not None])
        if args.format != "json":
            print(f"wrote {args.plot}")
    return 0


def summary_table(rows: Sequence[Any], *, title: str) -> Any:
    """One row per simulated layout: iteration, tokens/s, speed-up of the fastest feasible row over
    it, the bottleneck rank and the tightest memory (used / capacity)."""
    from rich.table import Table

    from megatron_hexiseq.planner.report import _fmt_rate, _fmt_time

    feasible = [
        r.estimate.iteration_time_s for r in rows if r.estimate is not None and r.estimate.feasible
    ]
    best = min(feasible) if feasible else None
    table = Table(title=title)
    for col in (
        "layout",
        "iteration",
        "tokens/s",
        "best is faster by",
        "bottleneck rank",
        "tightest memory GiB",
    ):
        table.add_column(col, justify="left" if col == "layout" else "right")
    gib = 2.0**30
    for r in rows:
        e = r.estimate
        if e is None:
            table.add_row(r.name, "-", "-", "infeasible", "-", r.reason or "-")
            continue
        tight = max(e.per_rank, key=lambda p: p.memory_bytes / p.capacity_bytes)
        speed = f"{e.iteration_time_s / best:.2f}x" if best and e.feasible else "OUT OF MEMORY"
        table.add_row(
            r.name,
            _fmt_time(e.iteration_time_s),
            _fmt_rate(e.tokens_per_s),
            speed,
            str(e.bottleneck_rank),
            f"{tight.memory_bytes / gib:.1f} / {tight.capacity_bytes / gib:.1f} "
            f"(rank {tight.rank})",
        )
    return table


def _simulate_job(args: argparse.Namespace, path: str, job: JobPlan, files: int) -> int:
    """A job file: the job and each alternative it records, priced again by the job model (on the
    cluster, model and options the file records)."""
    from megatron_hexiseq.job.evaluate import simulate_job
    from megatron_hexiseq.job.report import save_plot
    from megatron_hexiseq.planner.report import _fmt_rate, _fmt_time, make_console

    given = [
        flag
        for flag, value in (
            ("another --layout", files > 1),
            ("--cluster", args.cluster),
            ("--hosts", args.hosts),
            ("--model", args.model),
            ("--model-config", args.model_config),
            ("--seq-length", args.seq_length is not None),
            ("--micro-batch-size", args.micro_batch_size),
            ("--recompute", args.recompute),
            ("--memory-mode", args.memory_mode != "auto"),
            ("--data-parallel-size", args.data_parallel_size != 1),
            ("--attention-kernel", args.attention_kernel != "auto"),
            ("--baselines", args.baselines),
            ("--per-rank", args.per_rank),
        )
        if value
    ]
    if given:
        raise HexiSeqError(
            f"{path} is a job file: it records its cluster, model and options, and its alternatives "
            f"are simulated with it; drop {given[0]}"
        )
    with waiting("simulating", enabled=args.format != "json"):
        rows = simulate_job(job)
    if args.format == "json":
        sys.stdout.write(json.dumps(rows, indent=2) + "\n")
    else:
        from rich.table import Table

        best = min((r["step_time_s"] for r in rows if r["feasible"]), default=None)
        table = Table(
            title=f"{path}: {job.global_batch} x {job.seq_length:,} tokens per step on "
            f"{job.cluster_spec.world_size} GPUs ({job.model_spec.name})"
        )
        for col in ("job", "domains", "step", "tokens/s", "best is faster by", "file's step"):
            table.add_column(col, justify="left" if col == "job" else "right")
        for r in rows:
            step = r["step_time_s"]
            table.add_row(
                r["name"],
                str(r["domains"]),
                _fmt_time(step),
                _fmt_rate(r["tokens_per_s"]),
                f"{step / best:.2f}x" if step and best else "OUT OF MEMORY",
                _fmt_time(r["recorded_step_time_s"]),
            )
        make_console().print(table)
    if args.plot:
        save_plot(args.plot, job)
        if args.format != "json":
            print(f"wrote {args.plot}")
    return 0
