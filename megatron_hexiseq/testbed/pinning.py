"""The heterogeneous CPU testbed: real speed differences from core sharing.

A testbed *shape* says how many ranks share each core, e.g. ``"1+2"``: rank 0 alone on the first
core, ranks 1 and 2 sharing the second. Ranks that share a core each get about half of it, so the
shape gives genuine 2:1 compute differences under gloo — not a simulation. Each core is one
logical "node" of the cluster spec (``<host>-c<core>``), so ranks that share a core can form one
A2A group, and the planner sees the same structure it sees on GPUs.

Pure functions here; :func:`megatron_hexiseq.testbed.spawn.run_ranks` does the pinning
(``os.sched_setaffinity``) in each spawned rank.
"""

from __future__ import annotations

import os
import re
import socket
from dataclasses import dataclass

from megatron_hexiseq.errors import HexiSeqError, short

MAX_TESTBED_RANKS = 64  # as many as `tune --world-size` (docs/operability.md, "Documented maxima")


@dataclass(frozen=True, kw_only=True)
class TestbedShape:
    """Ranks per core, in core order; ranks are numbered core by core."""

    __test__ = False  # not a pytest class

    ranks_per_core: tuple[int, ...]

    @classmethod
    def parse(cls, text: str) -> TestbedShape:
        """``"1+2"`` -> ranks per core; at most :data:`MAX_TESTBED_RANKS` ranks in all (each rank
        is an interpreter with its own model copy), checked before any number is converted."""
        parts = text.replace(",", "+").split("+")
        if len(text) > 400 or not all(re.fullmatch(r"[0-9]{1,4}", p.strip()) for p in parts):
            raise HexiSeqError(f"testbed shape {short(text)} must look like '1+2' (ranks per core)")
        counts = tuple(int(p) for p in parts)
        if any(c <= 0 for c in counts):
            raise HexiSeqError(f"testbed shape {short(text)}: every core needs at least one rank")
        if sum(counts) > MAX_TESTBED_RANKS:
            raise HexiSeqError(
                f"testbed shape {short(text)} has {sum(counts)} ranks; the CPU testbed runs at most "
                f"{MAX_TESTBED_RANKS} (one interpreter each)"
            )
        return cls(ranks_per_core=counts)

    @property
    def world_size(self) -> int:
        return sum(self.ranks_per_core)

    def __str__(self) -> str:
        return "+".join(str(c) for c in self.ranks_per_core)


def available_cores() -> list[int]:
    """Cores this process may run on, ascending."""
    return sorted(os.sched_getaffinity(0))


def cpu_sets(shape: TestbedShape, cores: list[int] | None = None) -> list[list[int]]:
    """The core set of each rank: ranks of core slot i are pinned to ``cores[i]``.

    >>> cpu_sets(TestbedShape.parse("1+2"), [0, 1])
    [[0], [1], [1]]
    """
    cores = available_cores() if cores is None else list(cores)
    if len(shape.ranks_per_core) > len(cores):
        raise HexiSeqError(
            f"testbed shape {shape} needs {len(shape.ranks_per_core)} cores but only {len(cores)} "
            f"are available ({cores}); use a shape with fewer '+' parts"
        )
    return [[cores[i]] for i, n in enumerate(shape.ranks_per_core) for _ in range(n)]


def node_names(
    shape: TestbedShape, cores: list[int] | None = None, host: str | None = None
) -> list[str]:
    """Logical node name of each rank (one node per core): ``<host>-c<core>``."""
    host = host or socket.gethostname()
    return [f"{host}-c{cs[0]}" for cs in cpu_sets(shape, cores)]
