"""Process groups and peer tables of one layout, built once at the boundary and passed explicitly.

``build_hexiseq_groups(layout, domains=..., cp_groups=..., cp_group=..., device=..., timeout=...,
pg_options=...)`` is collective over the default group: every process calls it with the same
arguments. It creates (``dist.new_group``, same order on all processes) one CP group per domain
(unless ``cp_groups`` are given, or every process passes its own domain's ``cp_group``, e.g.
Megatron's: then no second communicator over the same ranks exists) and one A2A group per (domain,
layout group) with more than one rank, each with the given
``timeout`` and backend options (``pg_options(kind)``, kind ``"cp"`` or ``"a2a"``; Megatron's NCCL
options at the Megatron boundary). Then every process warms up each group it belongs to with one
collective in which all members take part (CP group first, then its A2A group; the same order on
every process), so no lazily created communicator waits for a member that never posts to it (a rank
with no heads takes no part in the sub-ring exchange). A *domain* is one copy of the layout: the
global ranks of layout ranks 0..W-1 (Megatron: one data-parallel replica's CP group). A job gives
one layout per domain (domains of different sizes and layouts, ``megatron/job_runtime.py``); the
groups of every domain are still created by every process, in domain order.

Global ranks of a domain must be ascending in layout-rank order, so that the group rank torch assigns
(position among the sorted global ranks) equals the layout rank, in the CP group and in A2A groups.

``HexiSeqGroups.index(ix, device)`` returns index tensors built once per layout and device, so the
hot path never copies index lists from host to device after the first call.

Per-micro-batch layouts. The groups are created once, from the job's layout; a micro-batch may run
another layout of the same *structure* (the same groups, and every rank in the same group with the
same query heads, hosts and GPUs; any segments, several runs per rank, a rank may hold no tokens):
``groups.with_layout(batch_layout)`` returns a view with the same process groups and that layout. It
creates no group and runs no collective: the A2A groups and the CP group (the sub-ring's P2P) depend
on the structure only, and every schedule is a pure function of (layout, boundaries, comm_chunks),
derived identically on every rank. Views are cached (the last few layouts) so every layer of a
micro-batch reuses one view, its schedules and its packed index tensors; head-subset index tensors
depend on the heads only and are shared with the job's groups (no new host-to-device copy).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup

from megatron_hexiseq.attention.comm import warm_up
from megatron_hexiseq.attention.documents import DocumentBounds, document_schedule
from megatron_hexiseq.attention.peers import RankSchedule, build_schedule
from megatron_hexiseq.errors import HexiSeqError
from megatron_hexiseq.layout import Layout

DOCUMENT_SCHEDULES_KEPT = 4  # micro-batches whose document schedules stay cached
BATCH_LAYOUTS_KEPT = 4  # per-micro-batch layouts whose views (schedules, indices) stay cached


def structure_difference(batch: Layout, job: Layout) -> str | None:
    """The first way ``batch`` does not run on ``job``'s process groups, or None when it does
    (the same world size, heads, query groups, TP size and groups; every rank in the same group with the
    same query heads, host and GPU; segments may differ)."""
    for name in (
        "world_size",
        "num_attention_heads",
        "num_query_groups",
        "tensor_model_parallel_size",
    ):
        if getattr(batch, name) != getattr(job, name):
            return f"{name} is {getattr(batch, name)}, the job's is {getattr(job, name)}"
    if batch.groups != job.groups:
        return (
            f"its groups are {[list(g.ranks) for g in batch.groups]}, the job's "
            f"{[list(g.ranks) for g in job.groups]}"
        )
    for b, j in zip(batch.ranks, job.ranks):
        for name in ("group", "heads", "host", "gpu"):
            if getattr(b, name) != getattr(j, name):
                return (
                    f"rank {b.rank} has {name} {getattr(b, name)!r}, the job's layout "
                    f"{getattr(j, name)!r}"
                )
    return None


@dataclass(frozen=True)
class HexiSeqGroups:
    """This process's view of one layout: its layout rank, its groups, and its peer tables.

    ``schedule(comm_chunks)`` returns the (cached) ``RankSchedule``: A2A members, heads, K/V heads,
    and per sub-ring step the K/V transfers this rank sends and receives.
    """

    layout: Layout
    rank: int  # this process's layout rank (its CP rank)
    cp_group: ProcessGroup  # the ranks of this domain; group rank == layout rank
    cp_global_ranks: tuple[int, ...]  # global rank of layout rank i in this domain
    a2a_group: ProcessGroup | None  # this rank's A2A group (None when it has 1 rank)
    a2a_global_ranks: tuple[int, ...]  # global ranks of my A2A group, in layout-rank order
    _schedules: dict = field(default_factory=dict, compare=False, repr=False)
    _indices: dict = field(default_factory=dict, compare=False, repr=False)
    _documents: OrderedDict = field(default_factory=OrderedDict, compare=False, repr=False)
    _views: OrderedDict = field(default_factory=OrderedDict, compare=False, repr=False)
    _job: HexiSeqGroups | None = field(default=None, compare=False, repr=False)

    @property
    def job_layout(self) -> Layout:
        """The layout the process groups were built from (``layout`` itself unless a view)."""
        return self.layout if self._job is None else self._job.layout

    def with_layout(self, layout: Layout) -> HexiSeqGroups:
        """These process groups running ``layout``, a per-micro-batch layout of the job's
        structure (module docstring): a cached view, no collective. One ``HexiSeqError`` line
        when ``layout`` would need other groups."""
        job = self if self._job is None else self._job
        if layout is job.layout:
            return job
        views = job._views
        view = views.get(layout)
        if view is not None:
            views.move_to_end(layout)
            return view
        problem = structure_difference(layout, job.layout)
        if problem is not None:
            raise HexiSeqError(
                f"the micro-batch's layout does not fit the job's process groups: {problem}; "
                "plan per-micro-batch layouts on the job's layout (same groups and heads)"
            )
        if layout == job.layout:
            return job
        view = replace(
            job,
            layout=layout,
            _schedules={},
            _indices=job._indices,  # keyed by the index values: heads are the job's
            _documents=OrderedDict(),
            _views=views,
            _job=job,
        )
        views[layout] = view
        while len(views) > BATCH_LAYOUTS_KEPT:
            views.popitem(last=False)
        return view

    def schedule(self, comm_chunks: int = 1) -> RankSchedule:
        if comm_chunks not in self._schedules:
            self._schedules[comm_chunks] = build_schedule(self.layout, self.rank, comm_chunks)
        return self._schedules[comm_chunks]

    def document_schedule(self, bounds: DocumentBounds, comm_chunks: int = 1) -> RankSchedule:
        """The schedule for one micro-batch's document boundaries (``documents.py``), cached for
        the last few micro-batches: every layer of a micro-batch reuses it (and its index tensors)."""
        key = (bounds, comm_chunks)
        if key in self._documents:
            self._documents.move_to_end(key)
        else:
            sched = document_schedule(self.layout, self.rank, bounds, comm_chunks)
            self._documents[key] = (sched, {})
            while len(self._documents) > DOCUMENT_SCHEDULES_KEPT:
                self._documents.popitem(last=False)
        return self._documents[key][0]

    def window_cache(self, sched: RankSchedule) -> dict:
        """The packed-index cache that belongs to a document schedule (``varlen.py``)."""
        for cached, cache in self._documents.values():
            if cached is sched:
                return cache
        return {}

    def global_rank(self, layout_rank: int) -> int:
        return self.cp_global_ranks[layout_rank]

    def index(self, ix: tuple[int, ...], device: torch.device) -> Tensor:
        """``torch.tensor(ix)`` on ``device``, created once per (ix, device) for this layout."""
        key = (ix, device)
        if key not in self._indices:
            self._indices[key] = torch.tensor(ix, dtype=torch.long, device=device)
        return self._indices[key]


def build_hexiseq_groups(
    layout: Layout | Sequence[Layout],
    *,
    domains: Sequence[Sequence[int]] | None = None,
    cp_groups: Sequence[ProcessGroup] | None = None,
    cp_group: ProcessGroup | None = None,
    device: torch.device | None = None,
    timeout: timedelta | None = None,
    pg_options: Callable[[str], Any] | None = None,
) -> HexiSeqGroups:
    """Collective over the default group; see the module docstring. ``layout``: the layout every
    domain runs, or one layout per domain (a job: domains of different sizes and layouts; every
    process creates every domain's groups, in domain order). ``cp_groups``: one existing group per
    domain; ``cp_group``: this process's existing group over its own domain (every process passes
    one, or none does: a process that passes none creates every domain's CP group). ``device``:
    where the warm-up collective's tensor lives (the backend's device: CUDA for NCCL; default CPU)."""
    world, me = dist.get_world_size(), dist.get_rank()
    if domains is None:
        domains = [list(range(world))]
    domains = [tuple(int(x) for x in d) for d in domains]
    layouts = [layout] * len(domains) if isinstance(layout, Layout) else list(layout)
    if len(layouts) != len(domains):
        raise HexiSeqError(f"got {len(layouts)} layouts for {len(domains)} domains")
    for i, d in enumerate(domains):
        if len(d) != layouts[i].world_size:
            raise HexiSeqError(
                f"domain {i} has {len(d)} ranks but the layout has {layouts[i].world_size}; "
                f"use a layout planned for context-parallel size {len(d)}"
            )
        if list(d) != sorted(d) or len(set(d)) != len(d):
            raise HexiSeqError(
                f"domain {i} must list distinct global ranks in ascending order, got {list(d)}"
            )
    if cp_groups is not None and len(cp_groups) != len(domains):
        raise HexiSeqError(f"got {len(cp_groups)} cp_groups for {len(domains)} domains")
    if cp_groups is not None and cp_group is not None:
        raise HexiSeqError("give cp_groups (every domain's) or cp_group (this process's), not both")
    mine = [i for i, d in enumerate(domains) if me in d]
    if len(mine) != 1:
        raise HexiSeqError(f"global rank {me} must be in exactly one domain, found in {len(mine)}")
    dom = mine[0]
    rank = domains[dom].index(me)
    layout = layouts[dom]
    if cp_group is not None and sorted(dist.get_process_group_ranks(cp_group)) != list(
        domains[dom]
    ):
        raise HexiSeqError(
            f"global rank {me}: the given CP group holds ranks "
            f"{sorted(dist.get_process_group_ranks(cp_group))}, its domain {list(domains[dom])}"
        )

    def new_group(ranks: Sequence[int], kind: str) -> ProcessGroup:
        kwargs: dict[str, Any] = {}
        if timeout is not None:
            kwargs["timeout"] = timeout
        options = pg_options(kind) if pg_options is not None else None
        if options is not None:
            kwargs["pg_options"] = options
        return dist.new_group(list(ranks), **kwargs)

    a2a_group: ProcessGroup | None = None
    mine_cp: ProcessGroup | None = cp_group
    for i, d in enumerate(domains):  # same order of new_group calls on every process
        if cp_group is None:
            g = cp_groups[i] if cp_groups is not None else new_group(d, "cp")
            if i == dom:
                mine_cp = g
        for grp in layouts[i].groups:
            members = [d[r] for r in grp.ranks]
            if len(members) > 1:
                pg = new_group(members, "a2a")
                if i == dom and rank in grp.ranks:
                    a2a_group = pg
    assert mine_cp is not None
    if dist.get_rank(mine_cp) != rank:
        raise HexiSeqError(
            f"global rank {me} is rank {dist.get_rank(mine_cp)} of its CP group but layout "
            f"rank {rank} of its domain; pass domains in CP-rank order"
        )
    warm = device if device is not None else torch.device("cpu")
    for group in (
        mine_cp,
        a2a_group,
    ):  # every member, the same order everywhere: CP first, then A2A
        if group is not None:
            warm_up(group, warm)
    my_group = layout.group_of(rank)
    return HexiSeqGroups(
        layout=layout,
        rank=rank,
        cp_group=mine_cp,
        cp_global_ranks=tuple(domains[dom]),
        a2a_group=a2a_group,
        a2a_global_ranks=tuple(domains[dom][r] for r in my_group.ranks),
    )
