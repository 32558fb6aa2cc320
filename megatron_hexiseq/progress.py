"""Progress where a person waits: a ``rich`` spinner with the elapsed time, on stderr, only when
stderr is a terminal (tests, pipes, CI logs and ``--format json`` output stay clean)."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator


def on_terminal() -> bool:
    return sys.stderr.isatty()


@contextlib.contextmanager
def waiting(message: str, *, enabled: bool = True) -> Iterator[Callable[[str], None]]:
    """``with waiting("planning") as say: ... say("stage II")``: a spinner, elapsed time and the
    latest message while the block runs; a no-op off a terminal or with ``enabled=False``."""
    if not (enabled and on_terminal()):
        yield lambda _msg: None
        return
    from rich.console import Console
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    with Progress(
        SpinnerColumn(),
        TextColumn("{task.description}"),
        TimeElapsedColumn(),
        console=Console(stderr=True),
        transient=True,
    ) as bar:
        task = bar.add_task(message, total=None)
        yield lambda msg: bar.update(task, description=f"{message}: {msg}")
