"""One spawn helper for multi-rank CPU runs (tests layer (b), benchmarks, the CPU testbed).

``run_ranks(fn, world_size, *args)`` starts ``world_size`` fresh Python processes, initialises a
gloo default group over a file store in a temporary folder (no ports to collide), calls
``fn(rank, world_size, *args)`` in each, and returns the list of return values in rank order.

- A failure in any rank raises :class:`RanksFailed` in the caller with that rank's traceback
  (a :class:`~megatron_hexiseq.errors.HexiSeqError` raised by every failing rank is re-raised as a
  ``HexiSeqError`` naming the rank, so the CLI prints it on one line). The other ranks, usually
  blocked in a collective with the failed one, get ``FAILURE_GRACE_S`` to finish, then are killed.
- ``timeout_s`` is a deadline for the whole run: past it every rank still running is killed and
  :class:`RanksFailed` names the stuck ranks.
- Each rank runs in its own session (``start_new_session``), so a terminal's Ctrl-C reaches only
  the caller; on ``KeyboardInterrupt`` (or any exception) in the caller every rank's process
  group is killed before the exception propagates. A rank also dies with its parent
  (``PR_SET_PDEATHSIG`` on Linux).
- The temporary folder (``hexiseq-ranks-*``) is removed in every case.

``fn`` must be picklable by reference (a module-level function). The child processes are prepared
like ``multiprocessing``'s spawn start method (same ``sys.path``, working folder and main module),
so functions of test modules and of a script's ``__main__`` work.
"""

from __future__ import annotations

import ctypes
import os
import pickle
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

from megatron_hexiseq.errors import HexiSeqError

FAILURE_GRACE_S = (
    5.0  # after one rank failed, how long the others get to report before they are killed
)
_POLL_S = 0.05
_PACKAGE_PARENT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_CHILD = (
    "import sys; sys.path.insert(0, sys.argv[3]); "
    "from megatron_hexiseq.testbed.spawn import _child_main; _child_main(sys.argv[1], int(sys.argv[2]))"
)


class RanksFailed(RuntimeError):
    """One or more ranks of :func:`run_ranks` failed, or did not finish before the deadline."""


def _die_with_parent() -> None:
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass


def _child_main(folder: str, rank: int) -> None:
    """Entry point of one rank (a fresh interpreter started by :func:`run_ranks`)."""
    _die_with_parent()
    import faulthandler
    import multiprocessing.spawn
    import warnings

    # every rank of a CPU run would repeat these; nothing to act on without a GPU
    warnings.filterwarnings(
        "ignore", message=r".*(Apex|Transformer Engine).* not installed", category=UserWarning
    )

    stacks = open(os.path.join(folder, f"stack{rank}.txt"), "w")  # noqa: SIM115 (open for the process' life)
    faulthandler.register(
        signal.SIGUSR1, file=stacks, all_threads=False
    )  # the parent asks before a kill

    with open(os.path.join(folder, "prepare.pkl"), "rb") as f:
        multiprocessing.spawn.prepare(pickle.load(f))
    out = os.path.join(folder, f"rank{rank}.pkl")
    try:
        with open(os.path.join(folder, "task.pkl"), "rb") as f:
            fn, world_size, args, threads, cpu_sets = pickle.load(f)
        _run_rank(fn, rank, world_size, args, folder, threads, cpu_sets, out)
    except BaseException as e:  # a failure outside ``fn`` (unpickling, process group set-up)
        if not os.path.exists(out):
            _report_error(out, e)
        sys.exit(1)


def _run_rank(
    fn: Callable,
    rank: int,
    world_size: int,
    args: tuple,
    folder: str,
    threads: int,
    cpu_sets: Sequence[Sequence[int]] | None,
    out: str,
) -> None:
    import torch
    import torch.distributed as dist

    if cpu_sets is not None:
        os.sched_setaffinity(0, set(cpu_sets[rank]))
    torch.set_num_threads(threads)
    try:
        dist.init_process_group(
            "gloo", init_method=f"file://{folder}/store", rank=rank, world_size=world_size
        )
        result = fn(rank, world_size, *args)
        _report(out, ("ok", result))
    except (
        BaseException
    ) as e:  # reported before the group is torn down: the first to fail reports first
        _report_error(out, e)
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _report_error(path: str, e: BaseException) -> None:
    """Every failure goes to the parent with the rank's traceback and the time it happened."""
    _report(
        path,
        (
            "error",
            (
                type(e).__name__,
                str(e),
                isinstance(e, HexiSeqError),
                traceback.format_exc(),
                time.time(),
            ),
        ),
    )


def _report(path: str, record: tuple) -> None:
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        pickle.dump(record, f)
    os.replace(tmp, path)  # the parent never reads half a report


def _preparation_data() -> dict[str, Any]:
    import multiprocessing.spawn

    data = multiprocessing.spawn.get_preparation_data("hexiseq-rank")
    for key in (
        "authkey",
        "start_method",
    ):  # not picklable outside multiprocessing / not ours to set
        data.pop(key, None)
    return data


def _kill(procs: Sequence[subprocess.Popen]) -> None:
    """SIGKILL every rank's process group (each rank leads its own session), then reap."""
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
    for p in procs:
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass


def _read(folder: str, rank: int) -> tuple | None:
    path = os.path.join(folder, f"rank{rank}.pkl")
    if not os.path.exists(path):
        return None
    with open(path, "rb") as f:
        return pickle.load(f)


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    threads: int = 1,
    cpu_sets: Sequence[Sequence[int]] | None = None,
    timeout_s: float | None = None,
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; return results in rank order.

    ``cpu_sets[r]`` pins rank r to those cores (the heterogeneous CPU testbed uses this).
    ``timeout_s``: deadline in seconds for the whole run (None: none); see the module docstring.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise HexiSeqError(f"run_ranks: world_size must be a positive integer, got {world_size!r}")
    if cpu_sets is not None and len(cpu_sets) < world_size:
        raise HexiSeqError(f"run_ranks: {len(cpu_sets)} cpu_sets for {world_size} ranks")
    folder = tempfile.mkdtemp(prefix="hexiseq-ranks-")
    procs: list[subprocess.Popen] = []
    try:
        with open(os.path.join(folder, "prepare.pkl"), "wb") as f:
            pickle.dump(_preparation_data(), f)
        with open(os.path.join(folder, "task.pkl"), "wb") as f:
            pickle.dump((fn, world_size, args, threads, cpu_sets), f)
        for rank in range(world_size):
            procs.append(
                subprocess.Popen(
                    [sys.executable, "-c", _CHILD, folder, str(rank), _PACKAGE_PARENT],
                    stdin=subprocess.DEVNULL,
                    start_new_session=True,
                )
            )
        return _wait(procs, folder, world_size, timeout_s)
    finally:
        _kill(procs)
        shutil.rmtree(folder, ignore_errors=True)


def _wait(
    procs: list[subprocess.Popen], folder: str, world_size: int, timeout_s: float | None
) -> list[Any]:
    start = time.monotonic()
    deadline = None if timeout_s is None else start + timeout_s
    first_failure: float | None = None
    while True:
        codes = [p.poll() for p in procs]
        if any(c not in (None, 0) for c in codes) and first_failure is None:
            first_failure = time.monotonic()
        if all(c is not None for c in codes):
            break
        now = time.monotonic()
        if first_failure is not None and now - first_failure > FAILURE_GRACE_S:
            break
        if deadline is not None and now > deadline:
            stuck = [r for r, c in enumerate(codes) if c is None]
            where = _stacks(procs, folder, stuck)
            _kill(procs)
            raise RanksFailed(
                f"run_ranks: rank(s) {stuck} of {world_size} did not finish within {timeout_s:g} s "
                f"(deadlock or a slow rank); killed every rank. Where they were:\n{where}"
            )
        time.sleep(_POLL_S)
    results, failures, silent = [], [], []
    codes = [p.poll() for p in procs]
    for rank in range(world_size):
        record = _read(folder, rank)
        if record is None:
            how = (
                "was killed after another rank failed"
                if codes[rank] is None
                else f"exited with code {codes[rank]}"
            )
            silent.append(f"rank {rank}: {how}, without a result")
        elif record[0] == "ok":
            results.append(record[1])
        else:
            name, msg, user_error, tb, when = record[1]
            failures.append((when, rank, name, msg, user_error, tb))
    if not failures and not silent:
        return results
    failures.sort()  # the first rank to fail is the cause; the others usually lost their peer
    if failures and failures[0][4]:  # a user error: one line (the CLI prints it), naming the rank
        _, rank, _, msg, _, _ = failures[0]
        same = sum(f[3] == msg for f in failures) == world_size
        raise HexiSeqError(msg if same else f"rank {rank}: {msg}")
    raise RanksFailed(
        "\n".join(
            [f"rank {r}: {name}: {msg}\n{tb}" for _, r, name, msg, _, tb in failures] + silent
        )
    )


def _stacks(procs: Sequence[subprocess.Popen], folder: str, ranks: Sequence[int]) -> str:
    """The innermost Python frames of each rank in ``ranks`` (faulthandler, on SIGUSR1)."""
    for r in ranks:
        try:
            os.kill(procs[r].pid, signal.SIGUSR1)
        except ProcessLookupError:
            pass
    time.sleep(0.5)
    lines = []
    for r in ranks:
        try:
            with open(os.path.join(folder, f"stack{r}.txt")) as f:
                frames = [ln.strip() for ln in f if ln.strip().startswith("File ")]
        except OSError:
            frames = []
        lines.append(
            f"  rank {r}: "
            + (" <- ".join(frames[:3]) if frames else "(not yet running Python code)")
        )
    return "\n".join(lines)
