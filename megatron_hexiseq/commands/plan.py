"""``megatron-hexiseq plan``: plan a layout for a cluster and model (hierarchical CP-SAT planner)."""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import replace

from megatron_hexiseq.cluster import cluster_to_dict
from megatron_hexiseq.commands import describe
from megatron_hexiseq.commands.inputs import (
    CLUSTER_SPEC_KEY,
    MODEL_SPEC_KEY,
    Problem,
    add_problem_args,
    load_problem,
)
from megatron_hexiseq.elastic import record_exclusions
from megatron_hexiseq.errors import HexiSeqError, check_positive_int
from megatron_hexiseq.io import check_outputs
from megatron_hexiseq.layout import Layout
from megatron_hexiseq.progress import waiting

EXAMPLES = """examples:
  megatron-hexiseq plan --cluster examples/clusters/mixed-h100-a100.yaml --model gpt-7b \\
      --seq-length 131072 -o layout.json
  megatron-hexiseq plan --cluster examples/clusters/four-types-64.yaml --model llama3-70b \\
      --seq-length 524288 --recompute --memory-mode fsdp --time-limit 30 -o layout.json --format json
  # for a SLURM allocation: the cluster's nodes (file order) take these host names
  megatron-hexiseq plan --cluster examples/clusters/mixed-h100-a100.yaml --hosts 'gpu[01-02]' \\
      --model-config examples/models/llama3-8b-128k.yaml -o layout.json
  # a GPU or a node was lost: plan for the rest (GPU 3 of gpu01, all of gpu02)
  megatron-hexiseq plan --cluster examples/clusters/mixed-h100-a100.yaml --hosts 'gpu[01-02]' \
      --model gpt-7b --seq-length 131072 --exclude gpu01:3 -o layout2.json
  megatron-hexiseq show layout2.json --previous layout.json   # what changed, can it resume
  # the whole job: 64 sequences per step, domains of GPUs with their own layouts and shares
  megatron-hexiseq plan --cluster examples/clusters/mixed-h100-a100.yaml --model gpt-7b \\
      --seq-length 32768 --global-batch 64 -o job.json --plot job.png
  # the same over TP bundles: the job and stock Megatron each at their best TP size
  megatron-hexiseq plan --cluster examples/clusters/four-types-64.yaml --model gpt-13b \\
      --seq-length 131072 --global-batch 32 --memory-mode auto --tensor-model-parallel-size auto \\
      -o job.json

The layout records the cluster and model specs it was planned for (meta), so 'simulate --layout'
and 'validate' need nothing else. With --data-parallel-size D the predicted tokens/s are those of
D copies of the cluster (each running this layout on its own sequences).

With --global-batch B, plan writes a job file instead (docs/job.md): the cluster's GPUs in
domains, each with its own layout and its share of the B sequences per step, the step's fixed
costs priced (gradient reduction, optimizer), and every alternative (stock Megatron TP x CP x DP,
the fastest GPU type alone, one replica set per GPU type, one HexiSeq domain over all, equal mixed
replicas) recorded beside it. 'show', 'validate' and 'simulate --layout' read job files too.
"""
METHODS = ("hierarchical", "node", "exact")
MAX_TIME_LIMIT_S = 7 * 24 * 3600.0
MAX_GLOBAL_BATCH = 1 << 20  # sequences per step
DEFAULT_TIME_LIMIT_S = 120.0  # planner.plan.DEFAULT_TIME_LIMIT_S (not imported: --help stays fast)


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "plan",
        help="plan uneven context/head parallelism for a cluster and model",
        description=describe(__doc__),
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_problem_args(p)
    p.add_argument(
        "--exclude",
        metavar="HOST[:LOCAL_RANK],...",
        default=None,
        help="plan without these devices: HOST drops a whole node, HOST:LOCAL_RANK one GPU (its index "
        "on that node); HOST names a node of the cluster (after --hosts). A node keeps its place "
        "with fewer GPUs; the layout records which GPU indices are left (meta.gpu_indices)",
    )
    p.add_argument(
        "-o",
        "--output",
        required=True,
        metavar="layout.json",
        help="layout file to write (atomically)",
    )
    p.add_argument(
        "--time-limit",
        type=float,
        default=DEFAULT_TIME_LIMIT_S,
        metavar="S",
        help="stop searching after S seconds of wall-clock time (default %(default)g) and keep the best "
        "layout found so far; the baselines and the first planner round always run, and the "
        "layout's planner.time_limit_reached says whether the cap cut the search. CP-SAT solves "
        "have fixed deterministic limits, so a plan that ends within S is the same on any machine",
    )
    p.add_argument(
        "--method",
        choices=METHODS,
        default="hierarchical",
        help="hierarchical (default): stages I-III; node: one group per node; exact: one CP-SAT "
        "model over all decisions (<= 16 GPUs)",
    )
    p.add_argument(
        "--doc-lengths",
        metavar="L.json",
        default=None,
        help="a JSON list of document lengths (tokens) the job packs into its sequences: choose the "
        "groups and heads for the per-micro-batch plans of packed documents (docs/varlen.md) instead "
        "of for one long sequence; planner.documents records the candidates' mean step times",
    )
    p.add_argument(
        "--global-batch",
        type=int,
        default=None,
        metavar="B",
        help="plan the whole job: B sequences per training step over every GPU, in domains with "
        "their own layouts and shares; -o writes a job file (docs/job.md)",
    )
    p.add_argument(
        "--no-overlap-grad-sync",
        action="store_true",
        help="with --global-batch: the run does not pass --overlap-grad-reduce "
        "--overlap-param-gather (the gradient reduction is priced fully exposed)",
    )
    p.add_argument(
        "--plot",
        metavar="job.png",
        default=None,
        help="with --global-batch: draw the domains (GPUs coloured by domain, each domain's "
        "busy/idle bar) (.png, .pdf, .svg, ...)",
    )
    p.add_argument(
        "--tensor-model-parallel-size",
        default="1",
        metavar="T|auto",
        help="plan over TP bundles of T GPUs of one node (Megatron's tensor + sequence parallelism "
        "inside each bundle; T divides the heads and every node's GPU count), or auto: the planner "
        "picks one T for the job (planner.tensor_parallel records each T considered). With "
        "--global-batch: the job's T, and auto also prices every alternative at each T (1, 2, 4, 8) "
        "and keeps its best. Default 1",
    )
    p.add_argument(
        "--reproducible",
        action="store_true",
        help="write 0 for wall-clock fields so the same inputs give a byte-identical file",
    )
    p.add_argument(
        "--format", choices=("human", "json"), default="human", help="what to print (default human)"
    )
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    # planner modules import lazily: ortools/numpy/rich cost ~0.6 s CPU, and `megatron-hexiseq --help`
    # (every command's parser) takes ~0.1 s CPU without them
    from megatron_hexiseq.planner.report import print_layout
    from megatron_hexiseq.planner.tp import plan_tp

    if not (math.isfinite(args.time_limit) and 0 < args.time_limit <= MAX_TIME_LIMIT_S):
        raise HexiSeqError(
            f"--time-limit must be positive (a finite number of seconds, at most {MAX_TIME_LIMIT_S:g}), "
            f"got {args.time_limit}"
        )
    if args.global_batch is not None or args.plot or args.no_overlap_grad_sync:
        return _run_job(args)
    tp = _tp_size(args.tensor_model_parallel_size)
    check_outputs([("-o", args.output)], inputs=[args.cluster, args.model_config, args.doc_lengths])
    prob = load_problem(args)
    docs = None
    if args.doc_lengths is not None:
        from megatron_hexiseq.varlen.packing import load_doc_lengths

        docs = load_doc_lengths(args.doc_lengths)
    if args.method == "exact" and prob.cluster.world_size > 16:
        raise HexiSeqError(
            f"--method exact handles at most 16 GPUs, the cluster has {prob.cluster.world_size}; "
            "use the default hierarchical planner"
        )
    started = time.perf_counter()  # --time-limit bounds the plan and the structure choice together
    with waiting(
        f"planning {prob.cluster.world_size} GPUs, {prob.seq_length:,} tokens",
        enabled=args.format != "json",
    ) as say:
        layout = plan_tp(
            prob.cluster,
            prob.model,
            prob.seq_length,
            prob.options,
            tensor_model_parallel_size=tp,
            modes=prob.modes,
            time_limit_s=args.time_limit,
            method=args.method,
            reproducible=args.reproducible,
            progress=say,
        )
        if docs is not None:
            say("choosing the structure for the document lengths")
            left_s = args.time_limit - (time.perf_counter() - started)
            layout = _for_documents(layout, prob, docs, left_s)
    layout = replace(
        layout,
        meta={
            **layout.meta,
            CLUSTER_SPEC_KEY: cluster_to_dict(prob.cluster),
            MODEL_SPEC_KEY: prob.model.to_dict(),
        },
    )
    if prob.survivors is not None:
        layout = record_exclusions(layout, prob.survivors)
    layout.save(args.output)
    if args.format == "json":
        sys.stdout.write(json.dumps(layout.to_dict(), indent=2) + "\n")
    else:
        print_layout(layout)
        if prob.survivors is not None:
            print(
                f"excluded: {', '.join(map(str, prob.survivors.excluded))}; planned for the "
                f"{prob.cluster.world_size} GPUs left"
            )
        if prob.options.data_parallel_size > 1:
            print(
                f"--data-parallel-size {prob.options.data_parallel_size}: tokens/s above are those of "
                f"{prob.options.data_parallel_size} copies of this cluster, each running the layout"
            )
        print(f"wrote {args.output}")
    return 0


def _tp_size(value: str) -> int | str:
    """``--tensor-model-parallel-size``: a positive integer or ``auto``."""
    if value == "auto":
        return value
    if not value.isdigit() or not 1 <= int(value) <= 1024:
        raise HexiSeqError(
            f"--tensor-model-parallel-size must be an integer from 1 to 1024 or 'auto', got "
            f"{value!r}"
        )
    return int(value)


def _for_documents(layout: Layout, prob: Problem, docs: list[int], left_s: float) -> Layout:
    """``--doc-lengths``: the structure ``varlen.structure.choose_structure`` picks, with the
    planned layout's records; ``predicted`` is the chosen layout's (one long sequence, as always).
    ``left_s``: what is left of --time-limit (the planner's own layout is scored whatever it is)."""
    from megatron_hexiseq import costmodel
    from megatron_hexiseq.planner.build import with_fields
    from megatron_hexiseq.planner.candidate import Deadline
    from megatron_hexiseq.run_config import options_from_record
    from megatron_hexiseq.varlen.structure import choose_structure

    options = options_from_record(layout.meta["options"], prob.options)
    deadline = Deadline(max(left_s, 0.0))
    tp = layout.tensor_model_parallel_size
    if tp == 1:
        chosen, record = choose_structure(
            layout, prob.cluster, prob.model, options, docs, deadline=deadline
        )
    else:  # structures of the bundle problem (costmodel.tp), back as layouts over bundles
        from megatron_hexiseq.costmodel.tp import bundle_setting, over_bundles
        from megatron_hexiseq.planner.tp import round_segments

        b_cluster, b_model, b_options = bundle_setting(prob.cluster, prob.model, options, tp)
        chosen, record = choose_structure(
            over_bundles(layout),
            b_cluster,
            b_model,
            b_options,
            docs,
            deadline=deadline,
            prepare=lambda lay: round_segments(lay, tp),  # a candidate must hold whole bundles
        )
        chosen = replace(chosen, tensor_model_parallel_size=tp)
    est = costmodel.estimate(chosen, prob.cluster, prob.model, options)
    planner = {**layout.planner, "documents": record}
    planner["time_limit_reached"] = bool(planner.get("time_limit_reached")) or deadline.reached
    return with_fields(
        chosen,
        predicted=est.to_predicted(),
        baselines=layout.baselines,
        planner=planner,
        meta={**layout.meta, "chosen": record["chosen"]},
    )


def _run_job(args: argparse.Namespace) -> int:
    """``--global-batch``: plan the whole job and write a job file."""
    if args.global_batch is None:
        raise HexiSeqError(
            f"{'--plot' if args.plot else '--no-overlap-grad-sync'} goes with --global-batch B "
            "(a job plan)"
        )
    check_positive_int("--global-batch", args.global_batch, at_most=MAX_GLOBAL_BATCH)
    for flag, given in (
        ("--doc-lengths", args.doc_lengths is not None),
        ("--method " + args.method, args.method != "hierarchical"),
        ("--data-parallel-size", args.data_parallel_size != 1),
    ):
        if given:
            raise HexiSeqError(
                f"{flag} does not apply with --global-batch: a job plans every GPU of the cluster "
                "with the hierarchical planner per domain; drop it"
            )
    tp = _tp_size(args.tensor_model_parallel_size)
    outputs = [("-o", args.output)] + ([("--plot", args.plot)] if args.plot else [])
    check_outputs(
        outputs, inputs=[args.cluster, args.model_config], figures=["--plot"] if args.plot else []
    )  # --time-limit: checked by run before it calls this
    from megatron_hexiseq.job.report import print_job, save_plot
    from megatron_hexiseq.job.search import plan_job

    prob = load_problem(args)
    options = replace(prob.options, overlap_grad_sync=not args.no_overlap_grad_sync)
    with waiting(
        f"planning a job of {args.global_batch} x {prob.seq_length:,} tokens on "
        f"{prob.cluster.world_size} GPUs",
        enabled=args.format != "json",
    ) as say:
        job = plan_job(
            prob.cluster,
            prob.model,
            prob.seq_length,
            args.global_batch,
            options,
            tensor_model_parallel_size=tp,
            modes=prob.modes,
            time_limit_s=args.time_limit,
            reproducible=args.reproducible,
            progress=say,
        )
    if prob.survivors is not None:
        job = replace(job, meta={**job.meta, "excluded": [str(e) for e in prob.survivors.excluded]})
    job.save(args.output)
    if args.plot:
        save_plot(args.plot, job)
    if args.format == "json":
        sys.stdout.write(job.to_json())
    else:
        print_job(job)
        print(f"wrote {args.output}" + (f" and {args.plot}" if args.plot else ""))
    return 0
