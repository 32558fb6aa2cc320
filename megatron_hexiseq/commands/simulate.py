"""``megatron-hexiseq simulate``: evaluate layouts and/or the baselines with the cost model."""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace

from megatron_hexiseq.errors import HexiSeqError
from megatron_hexiseq.planner.inputs import add_problem_args, load_problem, output_folder_exists

EXAMPLES = """examples:
  megatron-hexiseq simulate --cluster examples/clusters/mixed-h100-a100.yaml --model gpt-7b \\
      --layout layout.json --baselines --plot sim.png
  megatron-hexiseq simulate --cluster examples/clusters/four-types-64.yaml --model llama3-70b \\
      --seq-length 262144 --recompute --baselines --format json
"""


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("simulate", help="evaluate layouts and baselines with the cost model", description=__doc__,
                       epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_problem_args(p, seq_required=False)
    p.add_argument("--layout", action="append", default=[], metavar="L.json", help="layout to evaluate (repeatable)")
    p.add_argument("--baselines", action="store_true", help="also evaluate every baseline (ring, ulysses, usp for every hp; usp is Megatron's a2a+p2p)")
    p.add_argument("--plot", metavar="out.png", help="per-rank compute / exposed comm / idle and memory vs capacity")
    p.add_argument("--format", choices=("human", "json"), default="human", help="what to print (default human)")
    p.epilog = EXAMPLES + "\nWith --memory-mode auto (default) and a --layout, the layout's planned memory mode is used.\n"
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from megatron_hexiseq.commands.validate import check_against_cluster
    from megatron_hexiseq.layout import Layout
    from megatron_hexiseq.planner.simulate import simulate
    from megatron_hexiseq.planner.report import estimate_table, make_console, plot_estimates

    if not args.layout and not args.baselines:
        raise HexiSeqError("nothing to simulate: give --layout L.json and/or --baselines")
    if args.plot:
        output_folder_exists(args.plot)
    layouts = [(path, Layout.load(path)) for path in args.layout]
    seqs = {lay.seq_length for _, lay in layouts}
    if args.seq_length is None and len(seqs) > 1:
        raise HexiSeqError(f"the layouts have different seq_length {sorted(seqs)}; give --seq-length")
    seq = args.seq_length if args.seq_length is not None else (seqs.pop() if seqs else None)
    prob = load_problem(args, seq_length=seq)
    for path, lay in layouts:
        check_against_cluster(lay, prob.cluster)
        if lay.seq_length != prob.seq_length:
            raise HexiSeqError(f"layout {path} is planned for seq_length {lay.seq_length}, not {prob.seq_length}")
        if lay.num_attention_heads != prob.model.num_attention_heads:
            raise HexiSeqError(f"layout {path} has {lay.num_attention_heads} heads but model {prob.model.name!r} "
                               f"has {prob.model.num_attention_heads}")
    options = prob.options
    planned = [lay.meta.get("options") for _, lay in layouts if lay.meta.get("options")]
    if args.memory_mode == "auto" and planned:
        # auto: evaluate under the memory mode the (first) layout was planned for
        options = replace(options, memory_mode=planned[0]["memory_mode"],
                          recompute=bool(planned[0]["recompute"]) or bool(args.recompute))
    rows = simulate(prob.cluster, prob.model, options, layouts, baselines=args.baselines)
    if args.format == "json":
        sys.stdout.write(json.dumps([r.summary() for r in rows], indent=2) + "\n")
    else:
        console = make_console()
        for r in rows:
            if r.estimate is None:
                console.print(f"{r.name}: infeasible ({r.reason})")
            else:
                console.print(estimate_table(r.name, r.layout, r.estimate))
    if args.plot:
        plot_estimates(args.plot, [(r.name, r.estimate) for r in rows if r.estimate is not None])
        if args.format != "json":
            print(f"wrote {args.plot}")
    return 0
