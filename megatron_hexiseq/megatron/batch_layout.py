"""Per-micro-batch layouts at the Megatron boundary: the layout of the micro-batch being computed.

The job's process groups are built once, from the job's layout (``--hexiseq-layout``). With a
per-micro-batch layout provider (``BatchLayouts``: the micro-batch's document boundaries -> a
``Layout`` of the job's structure, e.g. a document-aware batch planner) every micro-batch gets its
own token assignment on those groups: the same A2A groups and query heads, its own segments (several
runs per rank). The provider must be deterministic: every CP rank loads the whole micro-batch,
derives the same boundaries and so the same layout, with no communication.

``MicroBatchLayout`` is the slot, the per-micro-batch counterpart of ``documents.MicroBatchDocuments``:
the batch slicer (``batch.LayoutBatchSlicer``) calls ``update(bounds)`` after recording the
boundaries and before slicing; the core attention runs on ``current().groups``
(``HexiSeqGroups.with_layout``: a cached view, no collective) and RoPE computes its angles at
``current()``'s positions. Everything a rank needs from the layout is in one frozen ``BatchPlan``:
its global positions (what the slicer gathers) and its RoPE positions (inside each document with
``--reset-position-ids`` and boundaries shared by the samples, else global), moved to the device
together in ONE host-to-device copy per micro-batch (pinned, non-blocking on CUDA: no host sync),
shared by the slicer and RoPE. The backward of a micro-batch uses what its forward captured (the
attention keeps its view, RoPE's angles are saved tensors), so schedules that interleave micro-batches
are fine.

Checked per micro-batch, one ``HexiSeqError`` line each: the structure (``with_layout``), the
sequence length, that every rank holds a token (Megatron's attention layer cannot run an empty
shard, as for the job's layout) and, with TP and sequence parallelism, a multiple of t tokens.

``--hexiseq-batch-plan``: the provider is ``PlannerLayouts``, the batch planner
(``varlen.batch.BatchPlanner``) built on the job's layout with the cluster, model and training
options ``plan`` recorded in it (``batch_planner_layouts``). With per-sample boundaries (micro-batch
> 1) it plans the union of the samples' boundaries: every cut of any sample is a document edge.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import Tensor

from megatron_hexiseq.attention.documents import DocumentBounds
from megatron_hexiseq.attention.groups import HexiSeqGroups
from megatron_hexiseq.errors import HexiSeqError
from megatron_hexiseq.layout import Layout
from megatron_hexiseq.megatron.documents import positions_in_documents
from megatron_hexiseq.megatron.tensor_parallel import check_bundle_tokens

if TYPE_CHECKING:  # annotations only: the planner imports the cost model
    from megatron_hexiseq.cluster import Cluster
    from megatron_hexiseq.model import ModelSpec
    from megatron_hexiseq.run_config import TrainOptions
    from megatron_hexiseq.varlen.batch import BatchPlanner

# where 'megatron-hexiseq plan' records the cluster and the model in a layout's meta
# (commands/inputs.py: CLUSTER_SPEC_KEY, MODEL_SPEC_KEY)
CLUSTER_SPEC_KEY, MODEL_SPEC_KEY = "cluster_spec", "model_spec"

# the micro-batch's document boundaries (None without --reset-attention-mask or THD) -> its layout
BatchLayouts = Callable[[DocumentBounds | None], Layout]


@dataclass(frozen=True)
class BatchPlan:
    """What one rank runs for one micro-batch: the layout, its groups view and its positions."""

    layout: Layout
    groups: HexiSeqGroups  # the job's process groups running ``layout``
    positions: tuple[int, ...]  # this rank's global positions, segment order (what is gathered)
    rope_positions: tuple[int, ...]  # the positions RoPE rotates by (in-document or global)
    _device: dict = field(default_factory=dict, compare=False, repr=False)
    _host: dict = field(default_factory=dict, compare=False, repr=False)

    @property
    def num_tokens(self) -> int:
        return len(self.positions)

    def host_index(self) -> Tensor:
        """``positions + rope_positions`` int64 on the host, pinned where CUDA is (built once; the
        planning thread builds it ahead, ``batch_ahead``)."""
        host = self._host.get("index")
        if host is None:
            host = torch.tensor(self.positions + self.rope_positions, dtype=torch.int64)
            if torch.cuda.is_available():
                host = host.pin_memory()  # kept alive by the cache until the plan is dropped
            self._host["index"] = host
        return host

    def indices(self, device: torch.device) -> tuple[Tensor, Tensor]:
        """``(positions [s_r], rope_positions [s_r])`` int64 on ``device``: one host-to-device copy
        per (micro-batch, device), from pinned memory without blocking (no host sync)."""
        if device not in self._device:
            both = self.host_index().to(device, non_blocking=True)
            n = self.num_tokens
            self._device[device] = (both[:n], both[n:])
        gather, rope = self._device[device]
        return gather, rope


class MicroBatchLayout:
    """The slot of the current micro-batch's ``BatchPlan`` (module docstring)."""

    def __init__(
        self,
        groups: HexiSeqGroups,
        provider: BatchLayouts,
        *,
        reset_position_ids: bool = False,
        fixed: bool = False,
        tokens_multiple_of: int = 1,
    ) -> None:
        self.groups = groups
        self.provider = provider
        self.reset_position_ids = reset_position_ids
        self.fixed = fixed  # the provider returns the job's layout: nothing to agree on
        # TP with sequence parallelism: every bundle holds a multiple of t tokens (tensor_parallel.py)
        self.tokens_multiple_of = tokens_multiple_of
        self.plan: BatchPlan | None = None

    @property
    def seq_length(self) -> int:
        return self.groups.job_layout.seq_length

    def update(self, bounds: DocumentBounds | None) -> BatchPlan:
        """Ask the provider for this micro-batch's layout, check it, and make it current."""
        self.plan = self.prepare(bounds)
        return self.plan

    def prepare(self, bounds: DocumentBounds | None) -> BatchPlan:
        """This micro-batch's checked ``BatchPlan``, without making it current (the planning
        thread of ``batch_ahead`` prepares plans ahead; the training thread sets ``plan``)."""
        return self.plan_of(self.provider(bounds), bounds)

    def plan_of(
        self, layout: Layout, bounds: DocumentBounds | None, *, any_length: bool = False
    ) -> BatchPlan:
        """The checked ``BatchPlan`` of ``layout`` for a micro-batch with ``bounds``.
        ``any_length``: the micro-batch may have another length than the job's (the CPU
        testbed's global-batch driver, whose micro-batches are bins of documents)."""
        if not isinstance(layout, Layout):
            raise HexiSeqError(
                f"the per-micro-batch layout provider returned {type(layout).__name__}, not a "
                "Layout; return a Layout of the job's groups and heads"
            )
        if layout.seq_length != self.seq_length and not any_length:
            raise HexiSeqError(
                f"the micro-batch's layout covers {layout.seq_length} tokens but the micro-batch "
                f"has {self.seq_length} (--seq-length); plan it for the whole micro-batch"
            )
        empty = [r.rank for r in layout.ranks if r.num_tokens == 0]
        if empty:
            raise HexiSeqError(
                f"the micro-batch's layout gives ranks {empty} no tokens; Megatron's attention "
                "layer cannot run an empty sequence shard: give every rank at least one token"
            )
        check_bundle_tokens(layout, self.tokens_multiple_of, what="the micro-batch's layout")
        groups = self.groups.with_layout(layout)  # the structure check, one line
        positions = tuple(layout.ranks[groups.rank].positions())
        rope = positions
        if self.reset_position_ids and bounds is not None and bounds.shared:
            rope = tuple(positions_in_documents(positions, bounds.samples[0]))
        return BatchPlan(layout, groups, positions, rope)

    def current(self) -> BatchPlan:
        if self.plan is None:
            raise HexiSeqError(
                "per-micro-batch layouts: no layout was recorded for this micro-batch (the batch "
                "did not go through the HexiSeq slicer)"
            )
        return self.plan


def fixed_layout(groups: HexiSeqGroups, *, reset_position_ids: bool = False) -> MicroBatchLayout:
    """The slot of a run with packed documents on the job's own layout: every micro-batch's plan
    is the job's layout (its positions, and RoPE positions inside each document), so documents
    take the same prepared-ahead path as per-micro-batch layouts (``batch_ahead``)."""
    job = groups.layout
    return MicroBatchLayout(
        groups, lambda bounds: job, reset_position_ids=reset_position_ids, fixed=True
    )


class PlannerLayouts:
    """``BatchLayouts`` from the batch planner (module docstring): deterministic, no communication.
    With TP bundles (``tensor_model_parallel_size`` t > 1) the planner works on the bundle problem
    (``costmodel.tp``) and each plan becomes a layout over bundles, its boundaries rounded to
    multiples of t (``planner.tp.round_segments``, as ``plan`` does)."""

    def __init__(self, planner: BatchPlanner, tensor_model_parallel_size: int = 1) -> None:
        self.planner = planner
        self.tensor_model_parallel_size = tensor_model_parallel_size

    def __call__(self, bounds: DocumentBounds | None) -> Layout:
        if bounds is None:
            raise HexiSeqError(
                "--hexiseq-batch-plan plans each micro-batch from its documents, but this one has "
                "none recorded: add --reset-attention-mask (or feed THD batches)"
            )
        cuts = sorted(set().union(*bounds.samples))
        layout = self.planner.plan(np.diff(cuts).tolist()).layout
        tp = self.tensor_model_parallel_size
        if tp == 1:
            return layout
        from megatron_hexiseq.planner.tp import round_segments

        return replace(round_segments(layout, tp), tensor_model_parallel_size=tp)


def planner_inputs(
    layout: Layout, source: str = "layout", flag: str = "--hexiseq-batch-plan"
) -> tuple[Cluster, ModelSpec, TrainOptions]:
    """The cluster, model (at the layout's length) and training options 'megatron-hexiseq plan'
    records in ``layout.meta``, which the batch planner needs (one line, naming ``flag``, if they
    are missing)."""
    from megatron_hexiseq.cluster import cluster_from_dict
    from megatron_hexiseq.model import model_from_dict
    from megatron_hexiseq.run_config import check_options_record, options_from_record

    meta = layout.meta if isinstance(layout.meta, Mapping) else {}
    missing = [k for k in (CLUSTER_SPEC_KEY, MODEL_SPEC_KEY, "options") if k not in meta]
    if missing:
        raise HexiSeqError(
            f"{flag} needs the cluster, model and options 'megatron-hexiseq plan' "
            f"records in the layout, but {source} has no meta.{', meta.'.join(missing)}; "
            "re-plan it with 'megatron-hexiseq plan'"
        )
    cluster = cluster_from_dict(meta[CLUSTER_SPEC_KEY], source=f"{source}: meta.{CLUSTER_SPEC_KEY}")
    model = model_from_dict(
        {**meta[MODEL_SPEC_KEY], "seq_length": layout.seq_length},
        source=f"{source}: meta.{MODEL_SPEC_KEY}",
    )
    options = options_from_record(check_options_record(meta["options"], source))
    return cluster, model, options


def bundle_planner_inputs(
    layout: Layout, source: str = "layout", flag: str = "--hexiseq-batch-plan"
) -> tuple[Layout, Cluster, ModelSpec, TrainOptions]:
    """What the batch planner plans ``layout``'s micro-batches on: ``planner_inputs`` and the
    layout itself, or with TP bundles (t > 1) the bundle problem (``costmodel.tp.bundle_setting``:
    one device per bundle, one TP rank's model, options with t) and the layout as a plain layout
    of it (``over_bundles``)."""
    cluster, model, options = planner_inputs(layout, source, flag)
    tp = layout.tensor_model_parallel_size
    if tp == 1:
        return layout, cluster, model, options
    from megatron_hexiseq.costmodel.tp import bundle_setting, over_bundles

    cluster, model, options = bundle_setting(cluster, model, options, tp)
    return over_bundles(layout), cluster, model, options


def batch_planner_layouts(layout: Layout, source: str = "layout") -> PlannerLayouts:
    """``--hexiseq-batch-plan``'s provider: a ``BatchPlanner`` on ``layout``'s structure with the
    cluster, model and options recorded in ``layout.meta`` (one line if they are missing); over
    TP bundles on the bundle problem (``bundle_planner_inputs``)."""
    from megatron_hexiseq.varlen.batch import BatchPlanner

    structure, cluster, model, options = bundle_planner_inputs(layout, source)
    planner = BatchPlanner(structure, cluster, model, options)
    return PlannerLayouts(planner, layout.tensor_model_parallel_size)
