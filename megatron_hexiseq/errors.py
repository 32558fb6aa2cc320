"""The one error type for anything a user can cause, the checks every spec shares, and the wrapper
that turns a user error into one line on stderr and exit code 2.

A ``HexiSeqError``'s message says what is wrong and what to do next. Internal invariants use
``assert`` instead. ``run_user_command`` is how every entry point (the CLI, the module CLIs, the
Megatron launchers) runs its body.
"""

from __future__ import annotations

import argparse
import reprlib
import signal
import sys
from collections.abc import Callable
from typing import Any, NoReturn

MAX_OPTION_WORDS = (
    2048  # words starting with '-' on one command line (argparse is quadratic in them)
)
MAX_MESSAGE = 1000  # characters of an error line, at most (the messages themselves stay far below)
_SHORT = reprlib.Repr()
_SHORT.maxlevel, _SHORT.maxstring, _SHORT.maxother = 2, 60, 60
_SHORT.maxlist = _SHORT.maxtuple = _SHORT.maxdict = _SHORT.maxset = 4


class OneLineParser(argparse.ArgumentParser):
    """argparse with its own errors as one line and exit 2 (no usage block): every entry point's
    parser (``add_subparsers`` takes it as ``parser_class``)."""

    def parse_known_args(self, args=None, namespace=None):  # type: ignore[no-untyped-def]
        """argparse's, after refusing more than ``MAX_OPTION_WORDS`` words that start with '-'
        (its parsing takes time quadratic in them: 30,000 took 16 s of CPU)."""
        words = sys.argv[1:] if args is None else list(args)
        options = sum(1 for w in words if isinstance(w, str) and w.startswith("-"))
        if options > MAX_OPTION_WORDS:
            self.error(
                f"{options:,} words start with '-', more than the {MAX_OPTION_WORDS:,} a command "
                "line may hold"
            )
        return super().parse_known_args(words, namespace)

    def error(self, message: str) -> NoReturn:
        # argparse quotes the offending value whole ("invalid int value: '999...'"): cut it short
        self.exit(2, f"error: {short_text(message, 300)} (see '{self.prog} --help')\n")


class HexiSeqError(ValueError):
    """A user-caused problem: bad spec, bad layout, infeasible request."""


def short(value: Any) -> str:
    """``repr(value)`` cut short (nesting, lengths, long strings), built without ever forming the
    full repr: a value from a hostile file (YAML aliases, huge numbers) stays a short message."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 200:
        return f"<an integer of {len(str(value)) if value.bit_length() < 10_000 else 'thousands of'} digits>"
    text = _SHORT.repr(value)
    return text if len(text) <= 120 else text[:117] + "..."


def short_text(text: str, limit: int = 120) -> str:
    """A user's string (a path, a name, an argument) for a one-line message: unchanged when it is
    printable and at most ``limit`` characters, else with control characters escaped (``\\n``) and
    its middle cut (``head...tail``, at most ``limit`` characters). Unlike :func:`short`, no quotes."""
    if len(text) <= limit and text.isprintable():
        return text

    def escaped(part: str) -> str:
        return "".join(c if c.isprintable() else repr(c)[1:-1] for c in part)

    half = (limit - 3) // 2
    if len(text) > limit:
        return f"{escaped(text[:half])[:half]}...{escaped(text[-half:])[-half:]}"
    out = escaped(text)
    return out if len(out) <= limit else f"{out[:half]}...{out[-half:]}"


def is_positive_int(value: Any, at_most: int | None = None) -> bool:
    """An ``int`` (not a ``bool``) in ``[1, at_most]``."""
    return (
        isinstance(value, int)
        and not isinstance(value, bool)
        and 0 < value
        and (at_most is None or value <= at_most)
    )


def check_positive_int(
    name: str, value: Any, *, at_most: int | None = None, where: str = ""
) -> int:
    """``value`` if :func:`is_positive_int`, else ``HexiSeqError("{where}: {name} must be a positive
    integer, got {value}")`` (`` (at most N)`` added when it is an integer above ``at_most``)."""
    if is_positive_int(value, at_most):
        return value
    big = (
        f" (at most {at_most})"
        if at_most is not None and isinstance(value, int) and value > at_most
        else ""
    )
    prefix = f"{where}: " if where else ""
    raise HexiSeqError(f"{prefix}{name} must be a positive integer, got {short(value)}{big}")


def _one_line(error: HexiSeqError) -> str:
    """The message as one line of at most ``MAX_MESSAGE`` characters, whatever a user's value put in
    it (the values should already be cut short where the message is made: this is the last guard)."""
    return short_text(str(error), MAX_MESSAGE)


def _sigterm_as_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def run_user_command(body: Callable[[], int | None], *, interrupts: bool = True) -> int:
    """Run ``body`` as a command a person started: user errors one line + exit 2, SIGINT/SIGTERM
    ``error: interrupted`` + exit 130 (children are killed on the way out), no traceback for either.

    ``interrupts=False`` leaves the signal handlers alone (a Megatron training process: torchrun's
    SIGTERM and Megatron's own exit-signal handler keep their meaning); user errors still exit 2."""
    if not interrupts:
        try:
            return int(body() or 0)
        except HexiSeqError as e:
            print(f"error: {_one_line(e)}", file=sys.stderr)
            return 2
    previous = signal.signal(signal.SIGTERM, _sigterm_as_interrupt), signal.getsignal(signal.SIGINT)
    try:
        return int(body() or 0)
    except HexiSeqError as e:
        print(f"error: {_one_line(e)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        signal.signal(
            signal.SIGINT, signal.SIG_IGN
        )  # a second Ctrl-C must not interrupt the clean-up
        print("error: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `megatron-hexiseq show x | head`
        return 0
    finally:
        signal.signal(signal.SIGTERM, previous[0])
        signal.signal(signal.SIGINT, previous[1])
