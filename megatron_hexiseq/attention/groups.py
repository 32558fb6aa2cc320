"""Process groups and peer tables of one layout, built once at the boundary and passed explicitly.

``build_hexiseq_groups(layout, domains=..., cp_groups=...)`` is collective over the default group:
every process calls it with the same arguments. It creates (``dist.new_group``, same order on all
processes) one CP group per domain (unless ``cp_groups`` are given) and one A2A group per
(domain, layout group) with more than one rank. A *domain* is one copy of the layout: the global ranks
of layout ranks 0..W-1 (Megatron: one data-parallel replica's CP group).

Global ranks of a domain must be ascending in layout-rank order, so that the group rank torch assigns
(position among the sorted global ranks) equals the layout rank, in the CP group and in A2A groups.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch.distributed as dist
from torch.distributed import ProcessGroup

from megatron_hexiseq.attention.peers import RankSchedule, build_schedule
from megatron_hexiseq.errors import HexiSeqError
from megatron_hexiseq.layout import Layout


@dataclass(frozen=True)
class HexiSeqGroups:
    """This process's view of one layout: its layout rank, its groups, and its peer tables.

    ``schedule(comm_chunks)`` returns the (cached) ``RankSchedule``: A2A members, heads, K/V heads,
    and per sub-ring step the K/V transfers this rank sends and receives.
    """

    layout: Layout
    rank: int                                # this process's layout rank (its CP rank)
    cp_group: ProcessGroup                   # the ranks of this domain; group rank == layout rank
    cp_global_ranks: tuple[int, ...]         # global rank of layout rank i in this domain
    a2a_group: ProcessGroup | None           # this rank's A2A group (None when it has 1 rank)
    a2a_global_ranks: tuple[int, ...]        # global ranks of my A2A group, in layout-rank order
    _schedules: dict = field(default_factory=dict, compare=False, repr=False)

    def schedule(self, comm_chunks: int = 1) -> RankSchedule:
        if comm_chunks not in self._schedules:
            self._schedules[comm_chunks] = build_schedule(self.layout, self.rank, comm_chunks)
        return self._schedules[comm_chunks]

    def global_rank(self, layout_rank: int) -> int:
        return self.cp_global_ranks[layout_rank]


def build_hexiseq_groups(layout: Layout, *, domains: Sequence[Sequence[int]] | None = None,
                         cp_groups: Sequence[ProcessGroup] | None = None) -> HexiSeqGroups:
    """Collective over the default group; see the module docstring."""
    world, me = dist.get_world_size(), dist.get_rank()
    if domains is None:
        domains = [list(range(world))]
    domains = [tuple(int(x) for x in d) for d in domains]
    for i, d in enumerate(domains):
        if len(d) != layout.world_size:
            raise HexiSeqError(f"domain {i} has {len(d)} ranks but the layout has {layout.world_size}; "
                               f"use a layout planned for context-parallel size {len(d)}")
        if list(d) != sorted(d) or len(set(d)) != len(d):
            raise HexiSeqError(f"domain {i} must list distinct global ranks in ascending order, got {list(d)}")
    if cp_groups is not None and len(cp_groups) != len(domains):
        raise HexiSeqError(f"got {len(cp_groups)} cp_groups for {len(domains)} domains")
    mine = [i for i, d in enumerate(domains) if me in d]
    if len(mine) != 1:
        raise HexiSeqError(f"global rank {me} must be in exactly one domain, found in {len(mine)}")
    dom = mine[0]
    rank = domains[dom].index(me)

    cp_group = None
    a2a_group = None
    for i, d in enumerate(domains):  # same order of new_group calls on every process
        g = cp_groups[i] if cp_groups is not None else dist.new_group(list(d))
        if i == dom:
            cp_group = g
        for grp in layout.groups:
            members = [d[r] for r in grp.ranks]
            if len(members) > 1:
                pg = dist.new_group(members)
                if i == dom and rank in grp.ranks:
                    a2a_group = pg
    assert cp_group is not None
    if dist.get_rank(cp_group) != rank:
        raise HexiSeqError(f"global rank {me} is rank {dist.get_rank(cp_group)} of its CP group but layout "
                           f"rank {rank} of its domain; pass domains in CP-rank order")
    my_group = layout.group_of(rank)
    return HexiSeqGroups(layout=layout, rank=rank, cp_group=cp_group, cp_global_ranks=domains[dom],
                         a2a_group=a2a_group,
                         a2a_global_ranks=tuple(domains[dom][r] for r in my_group.ranks))
