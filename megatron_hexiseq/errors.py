"""The one error type for anything a user can cause.

Its message says what is wrong and what to do next; the CLI prints it on one line and exits 2.
Internal invariants use ``assert`` instead.
"""


class HexiSeqError(ValueError):
    """A user-caused problem: bad spec, bad layout, infeasible request."""
