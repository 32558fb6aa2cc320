"""The one error type for anything a user can cause, and the short form of values in messages.

Its message says what is wrong and what to do next; the CLI prints it on one line and exits 2.
Internal invariants use ``assert`` instead.
"""
from __future__ import annotations

import reprlib
from typing import Any

_SHORT = reprlib.Repr()
_SHORT.maxlevel, _SHORT.maxstring, _SHORT.maxother = 2, 60, 60
_SHORT.maxlist = _SHORT.maxtuple = _SHORT.maxdict = _SHORT.maxset = 4


class HexiSeqError(ValueError):
    """A user-caused problem: bad spec, bad layout, infeasible request."""


def short(value: Any) -> str:
    """``repr(value)`` cut short (nesting, lengths, long strings), built without ever forming the
    full repr: a value from a hostile file (YAML aliases, huge numbers) stays a short message."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 200:
        return f"<an integer of {len(str(value)) if value.bit_length() < 10_000 else 'thousands of'} digits>"
    text = _SHORT.repr(value)
    return text if len(text) <= 120 else text[:117] + "..."
