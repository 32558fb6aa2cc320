"""``megatron-hexiseq`` command line: thin commands over library functions.

Each command lives in ``megatron_hexiseq/commands/<name>.py`` and defines
``add_parser(subparsers)`` (registering itself, with ``--help`` examples) and ``run(args) -> int``.
User mistakes raise ``HexiSeqError``: printed on one line as ``error: ...``, exit code 2.
"""
from __future__ import annotations

import argparse
import importlib
import sys

from megatron_hexiseq.errors import HexiSeqError

COMMANDS = ("plan", "show", "validate", "simulate", "profile", "tune")


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # argparse's own errors: one line, exit 2
        self.exit(2, f"error: {message} (see '{self.prog} --help')\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="megatron-hexiseq", description=__doc__.splitlines()[0],
                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True
    for name in COMMANDS:
        try:
            module = importlib.import_module(f"megatron_hexiseq.commands.{name}")
        except ModuleNotFoundError as e:
            if e.name != f"megatron_hexiseq.commands.{name}":
                raise
            continue  # command not built yet
        module.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.run(args) or 0)
    except HexiSeqError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
