"""``--hexiseq-global-batch``: each rank's micro-batches of every step, prepared one step ahead.

The Megatron side of global-batch scheduling (docs/megatron.md, "Packed long-context training").
The data loader (:func:`global_data_loaders`, installed as ``build_pretraining_data_loader``)
gives every rank the whole global batch of each step; ``batch_ahead.AheadBatches`` (installed as
``get_batch_on_this_tp_rank``) drains a planning thread that, per step and off the training
thread:

1. reads the step's samples and cuts them into documents (``global_data.read_steps``: their
   boundaries from the CPU tokens, Megatron's EOD rule), schedules them over the domains
   (``GlobalScheme.schedule``: the integer schedule, the same on every rank);
2. checks that every rank of the run holds the same schedule and units (one 63-bit digest, one
   MIN all-reduce on a gloo side group of all ranks: ``agreement.check_agreement``);
3. for each micro-batch of its domain (:class:`StepPreparer`): the layout of its documents in
   the domain (``GlobalScheme.layout``: the batch planner), its ``BatchPlan``, and this rank's
   tokens, gathered from the step's batch straight into pinned host memory: **each micro-batch
   is ``[1, N]``, N = its documents' tokens** (decision: docs/megatron.md; no filler), except
   with TP bundles, whose layouts hold multiples of t tokens per bundle (sequence parallelism
   splits them evenly), so N must be a multiple of t: the micro-batch
   ends with a filler document of ``-N mod t`` zero tokens (loss mask 0, attending only to
   itself), so the run's losses and gradients are those without it;
4. checks once per micro-batch that the domain's ranks planned the same layout (the digests of
   the step's micro-batches, one all-reduce on the domain's gloo side group).

The training thread takes one ``Prepared`` micro-batch per ``get_batch`` (copies only), runs as
many as its domain's count (a job: the job's seam ``HexiSeqSchedule``; replicas: Megatron's own
count, the same for all), and the per-token loss divides by the global batch's loss tokens
(``finalize_model_grads`` sums them over ``dp_cp``, every rank).

Side groups are per stream (the training, validation and test iterators each get theirs, created
in the training thread when the stream is first read, by every rank in the same order): two
planning threads never post collectives on one group, whose order could then differ by rank.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor

from megatron_hexiseq.attention.documents import parse_cu_seqlens
from megatron_hexiseq.attention.groups import HexiSeqGroups
from megatron_hexiseq.errors import HexiSeqError
from megatron_hexiseq.job import JobPlan, SampleRange
from megatron_hexiseq.layout import Layout
from megatron_hexiseq.megatron.agreement import check_agreement
from megatron_hexiseq.megatron.batch_ahead import AheadBatches, Prepared
from megatron_hexiseq.megatron.batch_layout import MicroBatchLayout
from megatron_hexiseq.megatron.documents import MicroBatchDocuments
from megatron_hexiseq.megatron.global_data import (
    GlobalScheme,
    GlobalStep,
    domain_side_ranks,
    job_domains,
    planned_scheme,
    read_steps,
    replica_domains,
)
from megatron_hexiseq.megatron.job_data import JobDataLoaders
from megatron_hexiseq.megatron.job_runtime import JobPlace
from megatron_hexiseq.megatron.runtime import HexiSeqRuntime
from megatron_hexiseq.varlen.digest import digest_ints, layout_digest
from megatron_hexiseq.varlen.global_batch import GlobalSchedule


@dataclass(frozen=True)
class GlobalPrepared(Prepared):
    """A prepared micro-batch of a global batch: also its step, its units (the step's unit
    indices, loader order) and where each of this rank's tokens comes from in the step's batch
    (``sample * S + position``, int64 ``[s_r]``; ``B * S`` and above: a filler token)."""

    step: int = 0
    units: tuple[int, ...] = ()
    origins: Tensor | None = None


def schedule_digest(step: GlobalStep) -> int:
    """What every rank of the run must agree on for a step: its units' lengths and every
    domain's bins (``GlobalSchedule.digest``)."""
    bins = GlobalSchedule(step.bins, ()).digest()
    return digest_ints([len(step.units.length), *step.units.length, bins])


class StepPreparer:
    """One rank's micro-batches of a step (module docstring, steps 2-4), in the planning thread.
    ``slot``: the run's per-micro-batch layout slot (its groups; plans are built with
    ``plan_of``); ``domain``: this rank's domain."""

    def __init__(
        self,
        scheme: GlobalScheme,
        domain: int,
        slot: MicroBatchLayout,
        *,
        pin: bool | None = None,
    ) -> None:
        self.scheme, self.domain, self.slot = scheme, domain, slot
        self.pin = torch.cuda.is_available() if pin is None else pin

    def __call__(
        self,
        step: GlobalStep,
        world_side: dist.ProcessGroup | None,
        domain_side: dist.ProcessGroup | None,
        first_index: int = 0,
    ) -> list[GlobalPrepared]:
        if world_side is not None:
            check_agreement(
                [schedule_digest(step)], world_side, names=[f"step {step.number}: the schedule"]
            )
        if not 0 <= self.domain < len(step.bins):
            raise HexiSeqError(
                f"the schedule has {len(step.bins)} domains but this rank runs domain "
                f"{self.domain}; the scheme must give every domain its bins"
            )
        units = step.units
        multiple = self.slot.tokens_multiple_of
        # the step's batch flattened; with TP bundles followed by ``multiple - 1`` filler tokens
        # (zeros, so out of the loss) at index ``filler``
        flat = {key: v.reshape(-1) for key, v in step.batch.items()}
        filler = next(iter(flat.values())).numel()
        if multiple > 1:
            flat = {key: torch.cat([v, v.new_zeros(multiple - 1)]) for key, v in flat.items()}
        items, digests = [], []
        for k, ids in enumerate(step.bins[self.domain]):
            lengths = [units.length[u] for u in ids]
            pad = -sum(lengths) % multiple
            where = units.flat(ids)
            if pad:  # TP bundles: a filler document makes N a multiple of t
                lengths.append(pad)
                where = np.concatenate([where, np.arange(filler, filler + pad, dtype=np.int64)])
            layout = self.scheme.layout(self.domain, lengths)
            cu = [0, *np.cumsum(lengths).tolist()]
            bounds = parse_cu_seqlens(cu, seq_length=cu[-1], batch=1)
            plan = self.slot.plan_of(layout, bounds, any_length=True)
            origins = torch.from_numpy(where[np.asarray(plan.positions, dtype=np.int64)])
            tensors = {}
            for key, v in flat.items():
                part = v.index_select(0, origins).unsqueeze(0)
                tensors[key] = part.pin_memory() if self.pin else part
            plan.host_index()  # the pinned index, built here rather than in the training thread
            items.append(
                GlobalPrepared(
                    tensors, bounds, plan, first_index + k, step.number, tuple(ids), origins
                )
            )
            digests.append(layout_digest(layout, cu))
        if domain_side is not None and digests:
            check_agreement(
                digests,
                domain_side,
                names=[f"step {step.number} micro-batch {k}" for k in range(len(digests))],
            )
        return items


def side_groups(
    domains: Sequence[Sequence[int]],
) -> tuple[dist.ProcessGroup, dist.ProcessGroup | None]:
    """Gloo groups of all ranks and of this rank's domain (None for a domain of one rank); every
    rank creates all of them in the same order (collective over the default group)."""
    world = dist.new_group(list(range(dist.get_world_size())), backend="gloo")
    mine = None
    for ranks in domains:
        group = dist.new_group(sorted(ranks), backend="gloo")
        if dist.get_rank() in ranks and len(ranks) > 1:
            mine = group
    return world, mine


class GlobalStreams:
    """``AheadBatches``' stream factory (module docstring): called in the training thread when a
    data iterator is first read; creates the stream's side groups (collective) and returns the
    generator the planning thread drains. ``chunks``: loader batches per step (B / b)."""

    def __init__(
        self,
        preparer: StepPreparer,
        *,
        domains: Sequence[Sequence[int]],
        chunks: int,
        eod_token: int,
        groups: Callable[
            [Sequence[Sequence[int]]], tuple[dist.ProcessGroup | None, dist.ProcessGroup | None]
        ] = side_groups,
    ) -> None:
        self.preparer, self.domains = preparer, [list(d) for d in domains]
        self.chunks, self.eod_token, self.groups = chunks, eod_token, groups

    def __call__(self, source: Iterator[Any]) -> Iterator[Prepared]:
        world_side, domain_side = self.groups(self.domains)
        return self._items(source, world_side, domain_side)

    def _items(
        self,
        source: Iterator[Any],
        world_side: dist.ProcessGroup | None,
        domain_side: dist.ProcessGroup | None,
    ) -> Iterator[Prepared]:
        count = 0
        steps = read_steps(
            source, chunks=self.chunks, eod_token=self.eod_token, scheme=self.preparer.scheme
        )
        for step in steps:
            items = self.preparer(step, world_side, domain_side, first_index=count)
            count += len(items)
            yield from items


def _no_provider(bounds: Any) -> Layout:
    raise HexiSeqError(
        "--hexiseq-global-batch plans every micro-batch in its planning thread; this batch did "
        "not come through it (report this with the Megatron version)"
    )


def global_slot(
    groups: HexiSeqGroups, *, reset_position_ids: bool, tokens_multiple_of: int = 1
) -> MicroBatchLayout:
    """The per-micro-batch layout slot of a global-batch run (its plans come from
    :class:`StepPreparer`; a provider call is an error). ``tokens_multiple_of``: t with TP
    bundles (every bundle's tokens, so every micro-batch's: the scheme rounds its layouts as
    ``plan`` does, for sequence parallelism)."""
    return MicroBatchLayout(
        groups,
        _no_provider,
        reset_position_ids=reset_position_ids,
        tokens_multiple_of=tokens_multiple_of,
    )


def global_batches(
    scheme: GlobalScheme,
    documents: MicroBatchDocuments,
    slot: MicroBatchLayout,
    *,
    domains: Sequence[Sequence[int]],
    domain: int,
    micro_batches: int,
    chunks: int,
    device: torch.device,
) -> AheadBatches:
    """The ``get_batch_on_this_tp_rank`` of a global-batch run: ``domains`` (process ranks per
    domain, the scheme's order), this rank's ``domain`` and its ``micro_batches`` per step (the
    planning thread runs one step ahead), ``chunks`` loader batches per step."""
    if documents.eod_token is None:
        raise HexiSeqError(
            "--hexiseq-global-batch cuts samples into documents at the tokenizer's EOD token, "
            "which this tokenizer does not define; use a tokenizer with an EOD token"
        )
    streams = GlobalStreams(
        StepPreparer(scheme, domain, slot),
        domains=domains,
        chunks=chunks,
        eod_token=documents.eod_token,
    )
    return AheadBatches(None, documents, slot, depth=micro_batches, device=device, streams=streams)


def every_rank_builds_datasets(vp_stage: int | None = None) -> bool:
    """``pretrain_gpt.is_dataset_built_on_rank`` of a global-batch run with TP bundles (the
    plugin installs it): Megatron-LM builds the GPT datasets only on TP rank 0 and broadcasts
    each batch over the TP group, but here every rank reads every step's samples and prepares
    its bundle's micro-batches itself, the same on all t TP ranks (the schedule and the
    layouts are integer results, checked to agree). Pipeline parallelism is refused with
    ``--hexiseq-global-batch``, so every rank is the first and the last stage."""
    return True


def global_data_loaders(args: argparse.Namespace) -> JobDataLoaders:
    """Megatron-LM's ``build_pretraining_data_loader`` of a global-batch run: every rank reads
    every step's whole global batch (``samples = [0, B)``) in micro-batches of ``b`` samples,
    unpinned (the planning thread pins only this rank's tokens)."""
    B, b = int(args.global_batch_size), int(args.micro_batch_size)
    return JobDataLoaders(
        samples=SampleRange(0, B),
        global_batch=B,
        micro_batch_size=b,
        get_args=lambda: args,
        pin_memory=False,
    )


def replica_ranks(
    cp_group: dist.ProcessGroup | None, tensor_model_parallel_size: int
) -> list[list[int]]:
    """Every data-parallel replica's process ranks (ascending), in the same order on all ranks:
    Megatron's CP groups, or with TP bundles its tensor x context-parallel groups (a replica's
    bundles with all their TP ranks). Collective over the default group."""
    from megatron_hexiseq.megatron.runtime import cp_domains

    if tensor_model_parallel_size == 1:
        return cp_domains(cp_group)
    from megatron.core import parallel_state as mpu

    return cp_domains(mpu.get_tensor_and_context_parallel_group())


def run_global_batches(
    args: argparse.Namespace,
    runtime: HexiSeqRuntime,
    *,
    cp_group: dist.ProcessGroup | None,
    job: JobPlan | None,
    place: JobPlace | None,
    source: str,
) -> AheadBatches:
    """``global_batches`` for this run (``plugin.setup``): a job's domains and this rank's place
    in it, or the data-parallel replicas of the layout (Megatron's CP groups, with TP its tensor x
    context-parallel groups; collective over the default group), each running ``B / (b x DP)``
    micro-batches per step."""
    B, b = int(args.global_batch_size), int(args.micro_batch_size)
    if job is not None:
        assert place is not None
        domains = job_domains(job, source)
        mine, micro_batches = place.domain, place.micro_batches
    else:
        replicas = replica_ranks(cp_group, runtime.layout.tensor_model_parallel_size)
        if B % (b * len(replicas)):
            raise HexiSeqError(
                f"--global-batch-size {B} is not a whole number of micro-batches of {b} for each "
                f"of the {len(replicas)} data-parallel replicas"
            )
        micro_batches = B // (b * len(replicas))
        domains = replica_domains(runtime.layout, replicas, micro_batches, source)
        mine = next(i for i, r in enumerate(replicas) if dist.get_rank() in r)
    assert runtime.documents is not None and runtime.batch_layout is not None
    return global_batches(
        planned_scheme(domains, domains[mine].structure, source),
        runtime.documents,
        runtime.batch_layout,
        domains=domain_side_ranks(domains, domains[0].options.tensor_model_parallel_size),
        domain=mine,
        micro_batches=micro_batches,
        chunks=B // b,
        device=torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu"),
    )
