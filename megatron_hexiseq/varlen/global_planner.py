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

from megatron_hexiseq.costmodel.documents import DocumentEstimate, estimate_documents
from megatron_hexiseq.costmodel.pieces import cu_from_lengths
from megatron_hexiseq.errors import HexiSeqError
from megatron_hexiseq.layout import Layout
from megatron_hexiseq.model import ModelSpec
from megatron_hexiseq.run_config import TrainOptions
from megatron_hexiseq.varlen.assignment import BatchAssignment, fill_empty
from megatron_hexiseq.varlen.batch import BatchPlanner
from megatron_hexiseq.varlen.domains import Domain
from megatron_hexiseq.varlen.global_batch import (
    DomainCosts,
    GlobalSchedule,
    LongUnit,
    as_of,
    domain_costs,
    schedule_global,
)
from megatron_hexiseq.varlen.schemes import zigzag_docs

MODES = ("batch", "zigzag")
PROBE_POINTS = 8  # a long-unit point at every 1/8 of the longest unit a micro-batch may hold
PROBE_FILLERS = 64  # a probe's other documents have 1/64 of that length
PROBE_GRAIN_AS = 10**12  # probes are kept in whole microseconds (below)
PROBES = (
    True  # the default of ``GlobalPlanner(probes=...)`` (``bench/varlen_suite.py --no-probes``)
)
_TABLES: dict[tuple, DomainCosts] = {}  # cost tables by (domain kind, model, mode, probes)
_TABLES_KEPT = 512


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


def _work(table: DomainCosts, docs: Sequence[int], unit_as: int) -> int:
    """A probe's divided work by ``table``, with ``unit_as`` per document."""
    return table.cost_as(sum(docs), sum(x * (x + 1) // 2 for x in docs)) + unit_as * len(docs)


def in_lockstep(options: Sequence[TrainOptions], domains: int) -> bool:
    """A run of ``domains`` domains (under ``options``, one or one per domain) runs micro-batch
    ``k`` of every domain together: Megatron-FSDP's per-layer gathers span every rank of the run
    (``global_schemes.lockstep_s`` prices such a step)."""
    return domains > 1 and any(o.memory_mode == "fsdp" for o in options)


def price_micro_batch(
    domain: Domain, model: ModelSpec, layout: Layout, cu: Sequence[int], exchange: str
) -> DocumentEstimate:
    """A micro-batch on ``domain`` by ``estimate_documents`` (``model.seq_length``: its tokens):
    ``exchange`` "pruned" is HexiSeq's packed path (its packed kernel), "te-ring" Transformer
    Engine's THD ring."""
    return estimate_documents(
        layout,
        domain.cluster,
        model,
        domain.options,
        tuple(cu),
        exchange=exchange,
        packed=exchange == "pruned",
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
    ``model``: the model; its ``seq_length`` is the samples' (the longest unit), which the
    probes measure up to (each bin has its own length). ``probes``: measure the tables'
    ``floor_as`` and ``long_unit`` (``_probe``); without, the divided work alone."""

    def __init__(
        self,
        domains: Sequence[Domain],
        model: ModelSpec,
        *,
        mode: str = "batch",
        probes: bool | None = None,
    ) -> None:
        if mode not in MODES:
            raise HexiSeqError(f"unknown global planner mode {mode!r}; use one of {MODES}")
        if not domains:
            raise HexiSeqError("a global planner needs at least one domain")
        self.domains = list(domains)
        self.model, self.mode = model, mode
        self.probes = PROBES if probes is None else probes
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
            # the probes cost nine planned and priced micro-batches: kept between planners
            # (``_TABLES``) for domains of the same kind, model and mode
            shared = (key, self.model, self.mode, self.probes)
            if shared not in _TABLES:
                table = domain_costs(
                    self.planner(d),
                    even=self.mode == "zigzag",
                    efficiency_1024=self.domains[d].efficiency_1024,
                )
                if self.probes:
                    table = self._probe(d, table)
                if len(_TABLES) >= _TABLES_KEPT:
                    _TABLES.clear()
                _TABLES[shared] = table
            self._costs[key] = _TABLES[shared]
        return self._costs[key]

    def _probe(self, d: int, table: DomainCosts) -> DomainCosts:
        """``table`` with ``floor_as`` and ``long_unit`` measured on probe micro-batches of
        domain ``d``, planned as its micro-batches are (``plan_lengths``) and priced by the
        cost model (``price``). ``L``: the most tokens a micro-batch of several units may hold
        (its ``fill``, below its capacity; a lighter memory mode can put it below a sample) or a
        sample (the model's ``seq_length``); fillers have ``L / PROBE_FILLERS`` tokens.

        - ``floor_as``: a micro-batch of the fewest fillers that give every rank a token, beyond
          the fixed costs (what no micro-batch hides: Megatron-FSDP's gathers, latencies), or
          the least of the probes below if one is shorter.
        - ``unit_as``: ``L`` tokens of fillers alone, their time beyond the larger of the floor
          and their divided work, per filler (what each document adds: the kernel calls and
          windows of packed documents; 0 when none).
        - ``long_unit``: at every ``L / PROBE_POINTS``, one unit of that length and fillers up to
          ``L`` tokens: its time beyond the larger of the floor and its divided work with its
          documents' ``unit_as`` (what a micro-batch of that work costs without a long unit; 0
          when none; non-decreasing). A long document spread over the domain's groups exposes
          its K/V exchange, or one group holds it and paces the micro-batch; the divided work
          sees neither (docs/varlen.md, "Probes")."""
        dom = self.domains[d]
        top = min(table.fill_tokens, self.model.seq_length)  # what a micro-batch of units holds
        filler = max(1, top // PROBE_FILLERS)
        if top < max(dom.size, PROBE_FILLERS):  # holds (next to) nothing in this memory mode
            return table
        few = [filler] * max(1, -(-dom.size // filler))
        probes: list[tuple[int, list[int]]] = []
        for j in range(1, PROBE_POINTS + 1):
            length = top * j // PROBE_POINTS
            docs = [length] + [filler] * ((top - length) // filler)
            if length >= 1 and sum(docs) >= dom.size and (not probes or length > probes[-1][0]):
                probes.append((length, docs))
        flat = [filler] * (top // filler)  # fillers alone: what each document adds
        real = [self._probe_as(d, docs) - table.batch_as for _, docs in probes]
        real_flat = self._probe_as(d, flat) - table.batch_as
        floor = max(0, min([self._probe_as(d, few) - table.batch_as, real_flat, *real]))
        unit = max(0, real_flat - max(floor, _work(table, flat, 0))) // len(flat)
        table = table._replace(floor_as=floor, unit_as=unit)
        points: list[LongUnit] = []
        for (length, docs), r in zip(probes, real):
            last = points[-1].extra_as if points else 0
            points.append(LongUnit(length, max(last, r - max(floor, _work(table, docs, unit)))))
        return table._replace(long_unit=tuple(points))

    def _probe_as(self, d: int, docs: list[int]) -> int:
        """A probe micro-batch's price in whole microseconds (as attoseconds). The probes are
        floats (the batch planner's and the cost model's), so two CPUs may round one
        differently in the last bit; kept to a microsecond, a table differs between ranks only
        when a probe lies within that bit of a microsecond boundary, and the per-step schedule
        digest (``megatron.global_ahead``) turns any such difference into one error before a
        collective is posted."""
        real = as_of(self.price(d, self.plan_lengths(d, docs)))
        return real // PROBE_GRAIN_AS * PROBE_GRAIN_AS

    def price(self, d: int, a: BatchAssignment) -> float:
        """Micro-batch ``a``'s iteration on domain ``d`` by the cost model: the exchange the
        mode runs (HexiSeq's pruned K/V blocks with the packed kernel, or Transformer Engine's
        THD ring)."""
        exchange = "te-ring" if self.mode == "zigzag" else "pruned"
        model = replace(self.model, seq_length=a.layout.seq_length)
        return price_micro_batch(
            self.domains[d], model, a.layout, a.cu_seqlens, exchange
        ).iteration_time_s

    def schedule(self, lengths: Sequence[int]) -> GlobalSchedule:
        """The bins of one global batch (``global_batch.schedule_global``)."""
        return schedule_global(
            lengths, self.costs, self.micro_batches, self.min_tokens, lockstep=self.lockstep
        )

    @property
    def lockstep(self) -> bool:
        """The domains run micro-batch ``k`` together (:func:`in_lockstep`)."""
        return in_lockstep([d.options for d in self.domains], len(self.domains))

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
