"""``GlobalPlanner``: each step's global batch scheduled over domains, each bin laid out inside its
domain.

Two steps per global batch (docs/varlen.md, "Global-batch scheduling"):

1. ``schedule(lengths)``: the units (documents of the loader's samples, loader order) to
   (domain, micro-batch) bins by the domains' integer cost tables (``global_batch``): every rank of
   the run computes it, in well under a step (a 16M-token batch over 1024 GPUs: docs/varlen.md).
2. ``plan_bin(schedule, lengths, d, k)``: micro-batch ``k`` of domain ``d`` as a ``BatchAssignment``
   on the domain's structure: ``BatchPlanner.plan`` (``mode="batch"``) or, for the stock
   baselines on CP rings, every document in ``2 c`` zig-zag THD chunks (``mode="zigzag"``). Only
   the ranks of domain ``d`` need it.

Domains whose GPUs, links and structure are the same (replicas) share one ``BatchPlanner`` and one
cost table (``_signature``); a plan is moved onto a domain's own hosts by ``retarget``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import numpy as np

from megatron_hexiseq.costmodel.pieces import cu_from_lengths
from megatron_hexiseq.errors import HexiSeqError
from megatron_hexiseq.layout import Layout
from megatron_hexiseq.model import ModelSpec
from megatron_hexiseq.varlen.assignment import BatchAssignment, fill_empty
from megatron_hexiseq.varlen.batch import BatchPlanner
from megatron_hexiseq.varlen.domains import Domain
from megatron_hexiseq.varlen.global_batch import (
    DomainCosts,
    GlobalSchedule,
    domain_costs,
    schedule_global,
)
from megatron_hexiseq.varlen.schemes import zigzag_docs

MODES = ("batch", "zigzag")


def _signature(domain: Domain) -> tuple:
    """What a domain's planner depends on: per local rank its GPU and links and which earlier
    rank shares its node; the structure's groups and heads; the training options."""
    devs = domain.cluster.devices
    first: dict[str, int] = {}
    ranks = []
    for j, d in enumerate(devs):
        first.setdefault(d.node, j)
        ranks.append(
            (d.gpu, d.nvlink_GBps, d.network_GBps, d.memory_gib, d.shared_core, first[d.node])
        )
    s = domain.structure
    return (
        tuple(ranks),
        tuple(g.ranks for g in s.groups),
        tuple((r.group, r.heads) for r in s.ranks),
        domain.options,
        domain.efficiency_1024,
    )


def retarget(layout: Layout, like: Layout) -> Layout:
    """``layout`` with the hosts and GPU names of ``like`` (same structure, another replica)."""
    if all((a.host, a.gpu) == (b.host, b.gpu) for a, b in zip(layout.ranks, like.ranks)):
        return layout
    return replace(
        layout,
        ranks=tuple(replace(a, host=b.host, gpu=b.gpu) for a, b in zip(layout.ranks, like.ranks)),
        meta={},
    )


class GlobalPlanner:
    """Schedules global batches over ``domains`` and plans their micro-batches (module docstring).
    ``model``: the model (its ``seq_length`` is ignored: each bin has its own)."""

    def __init__(self, domains: Sequence[Domain], model: ModelSpec, *, mode: str = "batch") -> None:
        if mode not in MODES:
            raise HexiSeqError(f"unknown global planner mode {mode!r}; use one of {MODES}")
        if not domains:
            raise HexiSeqError("a global planner needs at least one domain")
        self.domains = list(domains)
        self.model, self.mode = model, mode
        self._sig = [_signature(d) for d in self.domains]
        self._planners: dict[tuple, BatchPlanner] = {}
        self._costs: dict[tuple, DomainCosts] = {}
        self.costs = [self._cost(d) for d in range(len(self.domains))]
        self.micro_batches = [d.micro_batches for d in self.domains]
        self.min_tokens = [d.size for d in self.domains]

    def planner(self, d: int) -> BatchPlanner:
        """The batch planner of domain ``d``'s kind (shared by its replicas; its hosts are the
        first replica's: ``plan_bin`` retargets)."""
        key = self._sig[d]
        if key not in self._planners:
            dom = self.domains[d]
            self._planners[key] = BatchPlanner(dom.structure, dom.cluster, self.model, dom.options)
        return self._planners[key]

    def _cost(self, d: int) -> DomainCosts:
        key = self._sig[d]
        if key not in self._costs:
            self._costs[key] = domain_costs(
                self.planner(d),
                even=self.mode == "zigzag",
                efficiency_1024=self.domains[d].efficiency_1024,
            )
        return self._costs[key]

    def schedule(self, lengths: Sequence[int]) -> GlobalSchedule:
        """The bins of one global batch (``global_batch.schedule_global``)."""
        return schedule_global(lengths, self.costs, self.micro_batches, self.min_tokens)

    def bin_lengths(
        self, schedule: GlobalSchedule, lengths: Sequence[int], d: int, k: int
    ) -> list[int]:
        return [int(lengths[u]) for u in schedule.bins[d][k]]

    def plan_bin(
        self, schedule: GlobalSchedule, lengths: Sequence[int], d: int, k: int
    ) -> BatchAssignment:
        """Micro-batch ``k`` of domain ``d``: its documents (loader order) laid out on the
        domain's structure."""
        docs = self.bin_lengths(schedule, lengths, d, k)
        return self.plan_lengths(d, docs)

    def plan_lengths(self, d: int, docs: Sequence[int]) -> BatchAssignment:
        """A micro-batch of these document lengths on domain ``d``."""
        dom = self.domains[d]
        if sum(docs) < dom.size:
            raise HexiSeqError(
                f"domain {d}'s micro-batch has {sum(docs)} tokens for {dom.size} GPUs; every GPU "
                "needs at least one (more documents per step, or fewer micro-batches)"
            )
        if self.mode == "zigzag":
            cu = np.asarray(cu_from_lengths(docs), dtype=np.int64)
            segs = zigzag_docs(cu, list(range(dom.size)), dom.size)
            fill_empty(segs)
            s = dom.structure
            lay = replace(
                s,
                seq_length=int(cu[-1]),
                ranks=tuple(replace(r, segments=tuple(x)) for r, x in zip(s.ranks, segs)),
                meta={},
            )
            return BatchAssignment(layout=lay, cu_seqlens=tuple(cu.tolist()))
        a = self.planner(d).plan(docs)
        lay = retarget(a.layout, dom.structure)
        if lay is a.layout:
            return a
        return BatchAssignment(layout=lay, cu_seqlens=a.cu_seqlens, predicted_s=a.predicted_s)
