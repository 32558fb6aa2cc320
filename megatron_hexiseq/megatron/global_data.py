"""A step's global batch in a Megatron run: read by every rank, cut into documents, scheduled.

With ``--hexiseq-global-batch`` every rank reads the whole global batch of every step (no
sampler split): Megatron's ``single`` order from ``consumed_samples`` (``job_data.JobBatchSampler``
over the whole batch, ``samples = [0, B)``), so step ``t`` is the samples
``[c + t B, c + (t + 1) B)`` on every rank: the same indices everywhere, each sample of the run
once, and a resumed run (Megatron restores ``consumed_train_samples``) continues where the
interrupted one stopped. :func:`read_steps` turns that stream (``B / b`` loader batches of
``b`` samples per step) into :class:`GlobalStep` s:

1. the step's ``[B, S]`` host tensors (``tokens``, ``labels``, ``loss_mask``, ``position_ids``);
2. its **units** (:class:`StepUnits`): every sample cut at its EOD tokens by Megatron's rule
   (``documents.eod_boundaries``: a document ends after each EOD; a document cut at a sample
   boundary is two units, as Megatron's dataset cuts it), in loader order;
3. the **schedule**: ``scheme.schedule(step, lengths)`` -> ``bins[d][k]``, the unit indices of
   domain ``d``'s micro-batch ``k``. With :class:`PlannedScheme` it is
   ``varlen.global_planner.GlobalPlanner``'s integer schedule, identical on every rank (integers
   only; ``megatron.global_ahead`` checks it anyway).

Each unit keeps its tokens, labels, loss mask and position ids (:meth:`StepUnits.flat`: where a
bin's tokens sit in the step's flattened batch), so a micro-batch built from a bin trains exactly
the tokens those documents held in their samples, wherever they run.

**Domains** (:func:`replica_domains`, :func:`job_domains`): a job's domains (each its layout
renumbered to ascending process ranks, ``job_runtime.domain_layout``), or the data-parallel
replicas of ``--hexiseq-layout`` (Megatron's CP groups, one ``Domain`` each, all on the layout's
structure). Each domain's cluster, model and options are those ``plan`` (or the job) records in its
layout (``batch_layout.planner_inputs``), as for ``--hexiseq-batch-plan``.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import replace
from typing import Any, NamedTuple, Protocol

import numpy as np
import torch
from torch import Tensor

from megatron_hexiseq.errors import HexiSeqError
from megatron_hexiseq.job import JobPlan
from megatron_hexiseq.layout import Layout
from megatron_hexiseq.megatron.batch_layout import bundle_planner_inputs, planner_inputs
from megatron_hexiseq.megatron.documents import eod_boundaries
from megatron_hexiseq.megatron.job_runtime import domain_layout, domain_process_ranks
from megatron_hexiseq.varlen.domains import Domain
from megatron_hexiseq.varlen.global_planner import GlobalPlanner

# per-token [b, S] keys of Megatron's GPT batch that a unit carries (the rest is dropped)
UNIT_KEYS = ("tokens", "labels", "loss_mask", "position_ids")

Bins = Sequence[Sequence[Sequence[int]]]  # bins[d][k]: unit indices of domain d's micro-batch k


class StepUnits(NamedTuple):
    """The documents of a step's samples, in loader order: unit ``u`` is tokens
    ``[start[u], start[u] + length[u])`` of sample ``sample[u]`` (0..B-1) of the step."""

    sample: tuple[int, ...]
    start: tuple[int, ...]
    length: tuple[int, ...]
    seq_length: int  # S: tokens per sample

    def flat(self, ids: Sequence[int]) -> np.ndarray:
        """Where the tokens of units ``ids`` (in that order) sit in the step's batch flattened to
        ``[B * S]`` (int64): the micro-batch of those units, token by token."""
        if not ids:
            return np.zeros(0, dtype=np.int64)
        S = self.seq_length
        first = np.array([self.sample[u] * S + self.start[u] for u in ids], dtype=np.int64)
        lens = np.array([self.length[u] for u in ids], dtype=np.int64)
        offsets = np.arange(int(lens.sum()), dtype=np.int64) - np.repeat(
            np.cumsum(lens) - lens, lens
        )
        return np.repeat(first, lens) + offsets


def step_units(tokens_BS: Tensor | np.ndarray, eod_token: int) -> StepUnits:
    """The units of a step from its ``[B, S]`` host tokens (Megatron's EOD rule per sample)."""
    sample, start, length = [], [], []
    cuts = eod_boundaries(tokens_BS, eod_token)
    for i, c in enumerate(cuts):
        for a, b in zip(c[:-1], c[1:]):
            sample.append(i)
            start.append(a)
            length.append(b - a)
    return StepUnits(tuple(sample), tuple(start), tuple(length), int(tokens_BS.shape[1]))


class GlobalStep(NamedTuple):
    """One step's global batch on this rank: ``batch`` (``[B, S]`` host tensors of ``UNIT_KEYS``
    that the loader gave), its units and every domain's bins (``bins[d][k]``: unit indices)."""

    number: int  # the step's number in its stream (0, 1, ...)
    batch: dict[str, Tensor]
    units: StepUnits
    bins: tuple[tuple[tuple[int, ...], ...], ...]


class GlobalScheme(Protocol):
    """How a step's units become micro-batches: ``schedule(step, lengths)`` -> ``bins[d][k]``
    (unit indices; the same on every rank), ``layout(d, lengths)``: the layout of domain ``d``'s
    micro-batch of documents ``lengths`` in its structure (every rank of the domain alike)."""

    def schedule(self, step: int, lengths: Sequence[int]) -> Bins: ...

    def layout(self, domain: int, lengths: Sequence[int]) -> Layout: ...


class PlannedScheme:
    """The ``GlobalScheme`` of a ``GlobalPlanner``: its integer schedule, and each micro-batch
    ``BatchPlanner``-planned in its domain (moved onto the domain's structure's hosts)."""

    def __init__(self, planner: GlobalPlanner, tensor_model_parallel_size: int = 1) -> None:
        self.planner = planner
        self.tensor_model_parallel_size = tensor_model_parallel_size

    def schedule(self, step: int, lengths: Sequence[int]) -> Bins:
        return self.planner.schedule(lengths).bins

    def layout(self, domain: int, lengths: Sequence[int]) -> Layout:
        """The micro-batch's layout; with TP bundles of t (the planner plans the bundle problem)
        a layout over bundles, its boundaries rounded to multiples of t as ``plan`` rounds them
        (``planner.tp.round_segments``; the micro-batch's length is one already)."""
        layout = self.planner.plan_lengths(domain, lengths).layout
        t = self.tensor_model_parallel_size
        if t == 1:
            return layout
        from megatron_hexiseq.planner.tp import round_segments

        return replace(round_segments(layout, t), tensor_model_parallel_size=t)


def read_steps(
    batches: Iterator[Mapping[str, Any]], *, chunks: int, eod_token: int, scheme: GlobalScheme
) -> Iterator[GlobalStep]:
    """The stream of loader batches (``chunks`` of them per step, ``[b, S]`` each) as steps
    (module docstring); ends with the stream (a partial step is an error: the sampler never
    yields one)."""
    index = 0
    while True:
        parts = []
        for batch in batches:
            parts.append(batch)
            if len(parts) == chunks:
                break
        if not parts:
            return
        if len(parts) < chunks:
            raise HexiSeqError(
                f"the data loader ended inside a global batch ({len(parts)} of {chunks} "
                "micro-batches of samples); it must yield whole global batches"
            )
        batch = {k: _stack([_host(p[k]) for p in parts]) for k in UNIT_KEYS if k in parts[0]}
        if "tokens" not in batch:
            raise HexiSeqError("--hexiseq-global-batch needs the batch's tokens (no 'tokens' key)")
        units = step_units(batch["tokens"], eod_token)
        bins = scheme.schedule(index, units.length)
        yield GlobalStep(index, batch, units, tuple(tuple(tuple(b) for b in d) for d in bins))
        index += 1


def _host(x: Any) -> Tensor:
    t = x if isinstance(x, Tensor) else torch.as_tensor(np.asarray(x))
    return t if t.device.type == "cpu" else t.cpu()


def _stack(parts: list[Tensor]) -> Tensor:
    shapes = {tuple(p.shape[1:]) for p in parts}
    if any(p.dim() != 2 for p in parts) or len(shapes) != 1:
        raise HexiSeqError(
            f"the loader's batches have shapes {sorted(tuple(p.shape) for p in parts)}; "
            "expected [b, S] for every per-token key"
        )
    return torch.cat(parts, dim=0)


def _domain(
    index: int, bundles: Sequence[int], micro_batches: int, layout: Layout, source: str
) -> Domain:
    """Domain ``index`` running ``layout`` on ``bundles`` (its layout ranks' cluster ranks; with
    TP bundles of t GPUs, bundle ids), priced and planned on the cluster, model and options
    recorded in ``layout``: with t > 1 on its bundle problem (``costmodel.tp.bundle_setting``:
    one device per bundle, one TP rank's model), as ``--hexiseq-batch-plan`` plans."""
    structure, cluster, _, options = bundle_planner_inputs(
        layout, source, flag="--hexiseq-global-batch"
    )
    return Domain(
        index=index,
        ranks=tuple(bundles),
        micro_batches=micro_batches,
        structure=structure,
        cluster=cluster,
        options=options,
    )


def replica_domains(
    layout: Layout, replicas: Sequence[Sequence[int]], micro_batches: int, source: str
) -> list[Domain]:
    """The data-parallel replicas of ``layout`` as domains: replica ``i`` on process ranks
    ``replicas[i]`` (Megatron's tensor x context-parallel groups, ascending: with TP bundles of
    t, bundle ``j`` of a replica is its process ranks ``j*t .. j*t+t-1``), ``micro_batches`` each,
    all priced and planned on the layout's recorded cluster, model and options."""
    t = layout.tensor_model_parallel_size
    return [
        _domain(i, [k // t for k in r[::t]], micro_batches, layout, source)
        for i, r in enumerate(replicas)
    ]


def job_domains(job: JobPlan, source: str = "job") -> list[Domain]:
    """A job's domains: each its layout renumbered to ascending process ranks (what its ranks
    run; with TP bundles, process bundles), its micro-batch count, the cluster of its GPUs and
    the job's model and options."""
    out = []
    for d, dom in enumerate(job.domains):
        layout, ranks = domain_layout(job, d)
        out.append(_domain(d, ranks, dom.micro_batches, layout, f"{source} domain {d}"))
    t = job.tensor_model_parallel_size
    assert [tuple(sorted(r))[::t] for r in domain_process_ranks(job)] == [
        tuple(b * t for b in d.ranks) for d in out
    ]
    return out


def domain_side_ranks(
    domains: Sequence[Domain], tensor_model_parallel_size: int
) -> list[list[int]]:
    """Each domain's process ranks (every GPU of its bundles), what its agreement checks span."""
    t = tensor_model_parallel_size
    return [[b * t + i for b in d.ranks for i in range(t)] for d in domains]


def planned_scheme(domains: Sequence[Domain], layout: Layout, source: str) -> PlannedScheme:
    """The ``GlobalPlanner`` scheme of ``domains`` with the model recorded in ``layout``; with TP
    bundles (the domains are bundle problems: their options carry t) one TP rank's model."""
    _, model, _ = planner_inputs(layout, source, flag="--hexiseq-global-batch")
    t = domains[0].options.tensor_model_parallel_size
    if any(d.options.tensor_model_parallel_size != t for d in domains):
        raise HexiSeqError(f"{source}: the domains are planned for different TP sizes")
    if t > 1:
        from megatron_hexiseq.costmodel.tp import rank_model

        model = rank_model(model, t)
    return PlannedScheme(GlobalPlanner(domains, model), tensor_model_parallel_size=t)
