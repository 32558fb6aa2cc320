"""``megatron-hexiseq plan``: plan a layout for a cluster and model (hierarchical CP-SAT planner)."""
from __future__ import annotations

import argparse
import json
import sys

from megatron_hexiseq.errors import HexiSeqError
from megatron_hexiseq.planner.inputs import add_problem_args, load_problem, output_folder_exists

EXAMPLES = """examples:
  megatron-hexiseq plan --cluster examples/clusters/mixed-h100-a100.yaml --model gpt-7b \\
      --seq-length 131072 -o layout.json
  megatron-hexiseq plan --cluster examples/clusters/four-types-64.yaml --model llama3-70b \\
      --seq-length 524288 --recompute --memory-mode fsdp --time-limit 30 -o layout.json --format json
"""
METHODS = ("hierarchical", "node", "exact")
DEFAULT_TIME_LIMIT_S = 120.0  # planner.plan.DEFAULT_TIME_LIMIT_S (not imported: --help stays fast)


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plan", help="plan uneven context/head parallelism for a cluster and model",
                       description=__doc__, epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_problem_args(p)
    p.add_argument("-o", "--output", required=True, metavar="layout.json", help="layout file to write (atomically)")
    p.add_argument("--time-limit", type=float, default=DEFAULT_TIME_LIMIT_S, metavar="S",
                   help="stop searching after S seconds of wall-clock time (default %(default)g) and keep the best "
                        "layout found so far; the baselines and the first planner round always run, and the "
                        "layout's planner.time_limit_reached says whether the cap cut the search. CP-SAT solves "
                        "have fixed deterministic limits, so a plan that ends within S is the same on any machine")
    p.add_argument("--method", choices=METHODS, default="hierarchical",
                   help="hierarchical (default): stages I-III; node: one group per node; exact: one CP-SAT "
                        "model over all decisions (<= 16 GPUs)")
    p.add_argument("--reproducible", action="store_true",
                   help="write 0 for wall-clock fields so the same inputs give a byte-identical file")
    p.add_argument("--format", choices=("human", "json"), default="human", help="what to print (default human)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from megatron_hexiseq.planner.plan import plan
    from megatron_hexiseq.planner.report import print_layout

    if args.time_limit <= 0:
        raise HexiSeqError(f"--time-limit must be positive, got {args.time_limit}")
    output_folder_exists(args.output)
    prob = load_problem(args)
    if args.method == "exact" and prob.cluster.world_size > 16:
        raise HexiSeqError(f"--method exact handles at most 16 GPUs, the cluster has {prob.cluster.world_size}; "
                           "use the default hierarchical planner")
    layout = plan(prob.cluster, prob.model, prob.seq_length, prob.options, modes=prob.modes,
                  time_limit_s=args.time_limit, method=args.method, reproducible=args.reproducible)
    layout.save(args.output)
    if args.format == "json":
        sys.stdout.write(json.dumps(layout.to_dict(), indent=2) + "\n")
    else:
        print_layout(layout)
        print(f"wrote {args.output}")
    return 0
