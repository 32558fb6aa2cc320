"""What every benchmark does at the end: write ``NAME.json``, ``NAME.md`` and ``NAME.png`` into the
output folder (atomically, so an interrupted run leaves no half-written result)."""

from __future__ import annotations

import os
import random
import sys
from collections.abc import Callable
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from megatron_hexiseq.io import write_json_atomic, write_text_atomic  # noqa: E402

# ProLong's document lengths, in the shared folder beside the checkout (the packed-document benches);
# HEXISEQ_PROLONG_DOCS points elsewhere (a worktree whose parent has no shared/ folder)
PROLONG_DOCS = os.environ.get("HEXISEQ_PROLONG_DOCS") or os.path.join(
    os.path.dirname(os.path.abspath(__file__)),
    "..",
    "..",
    "shared",
    "data",
    "doc_lengths_prolong.json",
)


def prolong_lengths() -> list[int]:
    """ProLong's document lengths (``PROLONG_DOCS``)."""
    import json

    with open(PROLONG_DOCS) as f:
        return [int(x) for x in json.load(f)]


def pack(lengths: list[int], S: int, rng: random.Random) -> list[int]:
    """Boundaries ``[0, ..., S]`` of one micro-batch packed from shuffled documents."""
    bounds, pos = [0], 0
    while pos < S:
        pos = min(S, pos + lengths[rng.randrange(len(lengths))])
        bounds.append(pos)
    return bounds


def heavy_tailed(rng: random.Random, n: int) -> list[int]:
    """``n`` document lengths: log-normal body (median ~2K), 10% Pareto tail above 16K."""
    out = []
    for _ in range(n):
        x = rng.lognormvariate(7.6, 0.8)  # median ~2K
        if rng.random() < 0.1:
            x = 16384 * rng.paretovariate(1.1)
        out.append(int(min(max(x, 16), 1 << 20)))
    return out


def document_lengths() -> tuple[str, list[int]]:
    """ProLong's lengths where the shared data folder is beside the checkout, else a seeded
    heavy-tailed draw (a GPU machine may hold the checkout only): (name, lengths)."""
    if os.path.isfile(PROLONG_DOCS):
        return "prolong", prolong_lengths()
    return "heavy-tail seed 1", heavy_tailed(random.Random(1), 4096)


def in_fresh_process(target: Callable[..., None], *args: Any) -> Any:
    """Run ``target(*args, queue)`` in a new (spawned) process and return what it put on the queue:
    every measurement starts without another's caches, and its peak memory is its own. A process
    that dies before reporting (an exception in the planner: its traceback is printed above) stops
    the bench with one line instead of leaving it waiting on the queue for ever."""
    import multiprocessing as mp
    import queue

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=target, args=(*args, q))
    p.start()
    while True:
        try:
            out = q.get(timeout=1.0)
            break
        except queue.Empty:
            if not p.is_alive():
                try:  # it may have reported just before it exited
                    out = q.get(timeout=1.0)
                    break
                except queue.Empty:
                    raise SystemExit(
                        f"the measured process exited with code {p.exitcode} before reporting "
                        f"({getattr(target, '__name__', target)}; its error is printed above)"
                    ) from None
    p.join()
    return out


def write_outputs(
    out: str,
    name: str,
    *,
    data: Any,
    title: str,
    table: str,
    plot: Callable[[Any], None] | None = None,
    figsize: tuple[float, float] = (7, 4),
) -> None:
    """JSON of ``data``, markdown ``# title`` + ``table``, and a PNG drawn by ``plot(ax)`` if given."""
    os.makedirs(out, exist_ok=True)
    write_json_atomic(os.path.join(out, f"{name}.json"), data)
    write_text_atomic(os.path.join(out, f"{name}.md"), f"# {title}\n\n{table}\n")
    if plot is None:
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=figsize)
    plot(ax)
    fig.tight_layout()
    fig.savefig(os.path.join(out, f"{name}.png"), dpi=100)
    plt.close(fig)
