"""``megatron-hexiseq show``: print a layout (per-rank table, baselines, planner status)."""
from __future__ import annotations

import argparse
import sys

from megatron_hexiseq.commands import describe

EXAMPLES = """examples:
  megatron-hexiseq show layout.json
  megatron-hexiseq show layout.json --format json
"""


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("show", help="print a layout", description=describe(__doc__), epilog=EXAMPLES,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("layout", help="layout JSON file")
    p.add_argument("--format", choices=("human", "json"), default="human", help="what to print (default human)")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from megatron_hexiseq.layout import Layout
    from megatron_hexiseq.planner.report import print_layout

    layout = Layout.load(args.layout)
    if args.format == "json":
        sys.stdout.write(layout.to_json())
    else:
        print_layout(layout)
    return 0
