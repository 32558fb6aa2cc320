"""One spawn helper for multi-rank CPU runs (tests layer (b), benchmarks, the CPU testbed).

``run_ranks(fn, world_size, *args)`` starts ``world_size`` fresh processes, initialises a gloo
default group over a file store in a temporary folder (no ports to collide), calls
``fn(rank, world_size, *args)`` in each, and returns the list of return values in rank order.
An exception in any rank is re-raised in the caller with that rank's traceback.
``fn`` must be a module-level function (it is pickled for the spawn start method).
"""
from __future__ import annotations

import os
import pickle
import tempfile
import traceback
from typing import Any, Callable, Sequence

import torch.multiprocessing as mp


def _entry(rank: int, fn: Callable, world_size: int, args: tuple, folder: str, threads: int,
           cpu_sets: Sequence[Sequence[int]] | None) -> None:
    import torch
    import torch.distributed as dist

    if cpu_sets is not None:
        os.sched_setaffinity(0, set(cpu_sets[rank]))
    torch.set_num_threads(threads)
    out = os.path.join(folder, f"rank{rank}.pkl")
    try:
        dist.init_process_group("gloo", init_method=f"file://{folder}/store", rank=rank, world_size=world_size)
        result = fn(rank, world_size, *args)
        with open(out, "wb") as f:
            pickle.dump(("ok", result), f)
    except BaseException as e:  # report every failure, with the rank's traceback, to the parent
        with open(out, "wb") as f:
            pickle.dump(("error", f"rank {rank}: {type(e).__name__}: {e}\n{traceback.format_exc()}"), f)
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any, threads: int = 1,
              cpu_sets: Sequence[Sequence[int]] | None = None, timeout_s: float | None = None) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; return results in rank order.

    ``cpu_sets[r]`` pins rank r to those cores (the heterogeneous CPU testbed uses this).
    """
    with tempfile.TemporaryDirectory(prefix="hexiseq-ranks-") as folder:
        ctx = mp.start_processes(_entry, args=(fn, world_size, args, folder, threads, cpu_sets),
                                 nprocs=world_size, join=False, start_method="spawn")
        failed: str | None = None
        try:
            while not ctx.join(timeout=timeout_s):
                pass
        except Exception as e:  # a rank died; prefer the rank's own report below
            failed = str(e)
        results, errors = [], []
        for r in range(world_size):
            path = os.path.join(folder, f"rank{r}.pkl")
            if not os.path.exists(path):
                errors.append(f"rank {r}: exited without a result")
                continue
            with open(path, "rb") as f:
                status, value = pickle.load(f)
            (results if status == "ok" else errors).append(value)
        if errors or failed:
            raise RuntimeError("\n".join(errors) or failed)
        return results
