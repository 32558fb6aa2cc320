"""``megatron-hexiseq show``: print a layout (per-rank table, baselines, planner status) or a job
file (domains with their busy/idle bars, the alternatives)."""

from __future__ import annotations

import argparse
import json
import sys

from megatron_hexiseq.commands import describe
from megatron_hexiseq.elastic import diff_layouts
from megatron_hexiseq.errors import HexiSeqError
from megatron_hexiseq.io import check_outputs
from megatron_hexiseq.job.spec import JobPlan, load_layout_or_job
from megatron_hexiseq.layout import Layout

EXAMPLES = """examples:
  megatron-hexiseq show layout.json
  megatron-hexiseq show layout.json --format json
  # after a re-plan (e.g. plan --exclude): ranks gone/added, predicted time, can it resume
  megatron-hexiseq show layout.json --previous old-layout.json
  megatron-hexiseq show job.json --plot job.png       # a job file: domains and alternatives
"""


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "show",
        help="print a layout",
        description=describe(__doc__),
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("layout", help="layout or job JSON file (told apart by its format)")
    p.add_argument(
        "--previous",
        metavar="old.json",
        default=None,
        help="also print what changed against this earlier layout (ranks gone and added by host:gpu, "
        "world size, predicted iteration time and tokens/s, whether its checkpoints resume)",
    )
    p.add_argument(
        "--format",
        choices=("human", "json"),
        default="human",
        help="what to print (default human; json with --previous: {layout, previous, changes})",
    )
    p.add_argument(
        "--plot",
        metavar="job.png",
        default=None,
        help="a job file only: draw its domains (GPUs coloured by domain, each domain's busy/idle "
        "bar)",
    )
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    # planner modules import lazily: ortools/numpy/rich cost ~0.6 s CPU, and `megatron-hexiseq --help`
    # (every command's parser) takes ~0.1 s CPU without them
    from megatron_hexiseq.planner.report import print_layout

    loaded = load_layout_or_job(args.layout)
    if isinstance(loaded, JobPlan):
        return _show_job(args, loaded)
    if args.plot:
        raise HexiSeqError(f"--plot draws a job file's domains; {args.layout} is a layout")
    layout = loaded
    diff = diff_layouts(Layout.load(args.previous), layout) if args.previous else None
    if args.format == "json":
        if diff is None:
            sys.stdout.write(layout.to_json())
        else:
            doc = {"layout": layout.to_dict(), "previous": args.previous, "changes": diff.to_dict()}
            sys.stdout.write(json.dumps(doc, indent=2) + "\n")
        return 0
    print_layout(layout)
    if diff is not None:
        print(f"changes against {args.previous}:")
        for line in diff.lines():
            print(f"  {line}")
    return 0


def _show_job(args: argparse.Namespace, job: JobPlan) -> int:
    from megatron_hexiseq.job.report import print_job, save_plot

    if args.previous:
        raise HexiSeqError(
            f"--previous compares two layouts; {args.layout} is a job file (compare its domains' "
            "layouts one by one)"
        )
    check_outputs([("--plot", args.plot)], inputs=[args.layout], figures=["--plot"])
    if args.plot:
        save_plot(args.plot, job)
    if args.format == "json":
        sys.stdout.write(job.to_json())
    else:
        print_job(job)
        if args.plot:
            print(f"wrote {args.plot}")
    return 0
