"""``megatron-hexiseq`` command line: thin commands over library functions.

Each command lives in ``megatron_hexiseq/commands/<name>.py`` and defines
``add_parser(subparsers)`` (registering itself, with ``--help`` examples) and ``run(args) -> int``.
User mistakes raise ``HexiSeqError``: printed on one line as ``error: ...``, exit code 2.
SIGINT (Ctrl-C) and SIGTERM: ``error: interrupted``, exit code 130, child processes killed
(``errors.run_user_command``).
"""

from __future__ import annotations

import argparse
import importlib
import sys

from megatron_hexiseq import __version__
from megatron_hexiseq.errors import OneLineParser, run_user_command

COMMANDS = ("plan", "show", "validate", "simulate", "profile", "tune", "varlen", "doc-lengths")


_Parser = OneLineParser  # the name earlier code used


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="megatron-hexiseq",
        description=__doc__.splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True
    for name in COMMANDS:
        module = importlib.import_module(f"megatron_hexiseq.commands.{name.replace('-', '_')}")
        module.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    def body() -> int:
        args = build_parser().parse_args(argv)
        return args.run(args)

    return run_user_command(body)


if __name__ == "__main__":
    sys.exit(main())
