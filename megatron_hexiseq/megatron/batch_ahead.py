"""Packed micro-batches prepared ahead, off the training thread: ``get_batch`` only copies.

With packed documents (``--reset-attention-mask``, or THD batches) everything a rank needs from a
micro-batch except the copy is computed from the data loader's CPU batch in a background thread,
up to ``depth`` micro-batches (one step) ahead of the training thread (``Preparer``):

1. the document boundaries: from the CPU tokens by Megatron's EOD rule (numpy) or from the CPU
   ``cu_seqlens`` of a THD batch; nothing is read from the device;
2. the micro-batch's ``BatchPlan`` (``batch_layout.MicroBatchLayout.prepare``): the layout (the
   provider's, or the job's own), this rank's positions and RoPE positions and their pinned host
   index;
3. with per-micro-batch layouts, the agreement check of the layout's digest over the domain
   (``agreement.check_agreement`` on a gloo side group): a mismatch is one error, before the
   micro-batch runs;
4. this rank's slices of every ``[b, S]`` batch tensor, gathered on the host into pinned memory.

``AheadBatches`` replaces ``pretrain_gpt.get_batch_on_this_tp_rank`` (HexiSeq runs have TP = 1). It
takes the next prepared micro-batch, makes its boundaries and plan current (the slots the core
attention and RoPE read in the forward) and copies the slices to the device without blocking;
Megatron's ``get_batch`` then calls the slicer (``batch.LayoutBatchSlicer``), which passes the
already-sliced batch through. The training thread's time inside it (waiting for the planner, the
copies) is recorded per micro-batch (``exposed_s``): the exposed host time of packed documents.

The data iterator: a ``RerunDataIterator`` (Megatron's replay wrapper) keeps wrapping the stream,
with the planner inserted below it (its ``iterable``), so a replayed step replays prepared
micro-batches; any other iterator is wrapped directly. The planner thread is the only reader of the
wrapped stream; its errors reach the training thread at the next ``get_batch`` (one line for a
``HexiSeqError``).
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import Tensor

from megatron_hexiseq.attention.documents import DocumentBounds
from megatron_hexiseq.errors import HexiSeqError
from megatron_hexiseq.megatron.agreement import check_agreement
from megatron_hexiseq.megatron.batch_layout import BatchPlan, MicroBatchLayout
from megatron_hexiseq.megatron.documents import MicroBatchDocuments, eod_boundaries

# keys of Megatron's batch dict that are per-token [b, S] tensors (sliced); the rest is dropped
TOKEN_KEYS = ("tokens", "labels", "loss_mask", "position_ids")
# the batch dict get_batch_on_this_tp_rank returns, in Megatron's order (attention_mask: None, the
# dense mask is never built for HexiSeq runs)
BATCH_KEYS = ("tokens", "labels", "loss_mask", "attention_mask", "position_ids")


@dataclass(frozen=True)
class Prepared:
    """One micro-batch, ready for this rank: its slices on the host, boundaries and plan."""

    tensors: dict[str, Tensor]  # [b, s_r] each, pinned where CUDA is
    bounds: DocumentBounds | None
    plan: BatchPlan
    index: int  # the micro-batch's number on this rank (0, 1, ...)


def host_bounds(
    batch: Mapping[str, Any], documents: MicroBatchDocuments, reset_attention_mask: bool
) -> DocumentBounds | None:
    """The micro-batch's document boundaries from its CPU batch: THD ``cu_seqlens_padded`` (else
    ``cu_seqlens``), else the EOD tokens with ``--reset-attention-mask``, else none."""
    cu = batch.get("cu_seqlens_padded")
    if cu is None:
        cu = batch.get("cu_seqlens")
    if cu is not None:
        values = [int(x) for x in _host(cu).reshape(-1).tolist() if int(x) >= 0]
        while len(values) > 1 and values[-1] == values[-2]:
            values.pop()  # trailing repeats pad a fixed-size cu_seqlens
        return documents.update(values, batch=1)
    if not reset_attention_mask:
        return None
    tokens = batch.get("tokens")
    if tokens is None:
        raise HexiSeqError(
            "--reset-attention-mask with HexiSeq needs the batch's tokens on every rank that "
            "computes attention (pipeline parallelism is not supported)"
        )
    if documents.eod_token is None:
        raise HexiSeqError(
            "--reset-attention-mask needs the tokenizer's EOD token id to find documents; "
            "use a tokenizer that defines one"
        )
    host = _host(tokens)
    if host.dim() != 2 or host.shape[1] != documents.seq_length:
        raise HexiSeqError(
            f"batch tokens have shape {tuple(host.shape)}; expected [b, {documents.seq_length}]"
        )
    return documents.update(eod_boundaries(host, documents.eod_token), batch=host.shape[0])


def _host(x: Any) -> Tensor:
    """A CPU tensor of ``x`` (the data loader's batches are on the host already)."""
    t = x if isinstance(x, Tensor) else torch.as_tensor(np.asarray(x))
    return t if t.device.type == "cpu" else t.cpu()


class Preparer:
    """CPU batch -> ``Prepared`` (module docstring, steps 1-4), in the planning thread.

    ``documents``: a private ``MicroBatchDocuments`` (its ``bounds`` is this thread's scratch; the
    training thread's slot is set by ``AheadBatches``); ``layout``: the per-micro-batch (or fixed)
    layout slot; ``side_group``: the domain's gloo group for the agreement check (None: no check,
    e.g. a fixed layout or a domain of one rank)."""

    def __init__(
        self,
        documents: MicroBatchDocuments,
        layout: MicroBatchLayout,
        *,
        reset_attention_mask: bool,
        side_group: dist.ProcessGroup | None = None,
        pin: bool | None = None,
    ) -> None:
        self.documents = documents
        self.layout = layout
        self.reset_attention_mask = reset_attention_mask
        self.side_group = side_group
        self.pin = torch.cuda.is_available() if pin is None else pin
        self.count = 0

    def __call__(self, batch: Mapping[str, Any]) -> Prepared:
        from megatron_hexiseq.varlen.digest import layout_digest

        bounds = host_bounds(batch, self.documents, self.reset_attention_mask)
        plan = self.layout.prepare(bounds)
        index = self.count
        self.count += 1
        if self.side_group is not None and not self.layout.fixed:
            cuts = sorted(set().union(*bounds.samples)) if bounds is not None else []
            check_agreement(
                [layout_digest(plan.layout, cuts)],
                self.side_group,
                names=[f"micro-batch {index}"],
            )
        plan.host_index()  # the pinned index, built here rather than in the training thread
        gather = torch.as_tensor(np.asarray(plan.positions, dtype=np.int64))
        tensors: dict[str, Tensor] = {}
        S = self.layout.seq_length
        for key in TOKEN_KEYS:
            val = batch.get(key)
            if val is None:
                continue
            host = _host(val)
            if host.dim() != 2 or host.shape[1] != S:
                raise HexiSeqError(
                    f"batch '{key}' has shape {tuple(host.shape)}; expected the full sequence "
                    f"of {S} tokens in dimension 1 (is --seq-length the layout's?)"
                )
            part = host.index_select(1, gather)
            tensors[key] = part.pin_memory() if self.pin else part
        return Prepared(tensors, bounds, plan, index)


class _Ahead:
    """A background thread turning an iterator's CPU batches into ``Prepared`` ones, at most
    ``depth`` ahead (a bounded queue)."""

    _END = object()

    def __init__(
        self, source: Iterator[Any], prepare: Callable[[Any], Prepared], depth: int
    ) -> None:
        self.source, self.prepare = source, prepare
        self.queue: queue.Queue = queue.Queue(maxsize=max(1, depth))
        self.done = False
        self.thread = threading.Thread(target=self._run, name="hexiseq-plan-ahead", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            for batch in self.source:
                self.queue.put(("ok", self.prepare(batch)))
            self.queue.put(("end", None))
        except BaseException as e:  # handed to the training thread, raised there
            self.queue.put(("error", e))

    def __iter__(self) -> _Ahead:
        return self

    def __next__(self) -> Prepared:
        if self.done:
            raise StopIteration
        kind, item = self.queue.get()
        if kind == "ok":
            return item
        self.done = True
        if kind == "end":
            raise StopIteration
        raise item


class AheadBatches:
    """``get_batch_on_this_tp_rank`` for HexiSeq runs with packed documents (module docstring)."""

    def __init__(
        self,
        preparer: Callable[[Any], Prepared],
        documents: MicroBatchDocuments,
        layout: MicroBatchLayout,
        *,
        depth: int,
        device: torch.device,
    ) -> None:
        self.preparer, self.documents, self.layout = preparer, documents, layout
        self.depth, self.device = depth, device
        self._streams: dict[int, tuple[Any, Any]] = {}
        self.exposed_s: list[float] = []  # per micro-batch: wait + copies, training thread
        self.current: Prepared | None = None

    def _stream(self, data_iterator: Any) -> Any:
        """What to call ``next`` on for ``data_iterator``, its stream planned ahead (module
        docstring: below a ``RerunDataIterator``, else around the iterator)."""
        got = self._streams.get(id(data_iterator))
        if got is not None and got[0] is data_iterator:
            return got[1]
        inner = getattr(data_iterator, "iterable", None)
        if inner is not None and hasattr(data_iterator, "rewind"):  # RerunDataIterator
            data_iterator.iterable = _Ahead(iter(inner), self.preparer, self.depth)
            target = data_iterator
        else:
            target = _Ahead(iter(data_iterator), self.preparer, self.depth)
        self._streams[id(data_iterator)] = (data_iterator, target)
        return target

    def __call__(self, data_iterator: Any, mtp_on_this_rank: bool = False) -> dict[str, Any]:
        if data_iterator is None:
            raise HexiSeqError(
                "HexiSeq's prepared batches need the data iterator on every rank (TP = 1)"
            )
        t0 = time.perf_counter()
        item = next(self._stream(data_iterator))
        if not isinstance(item, Prepared):
            raise HexiSeqError(
                "the data iterator yielded a batch that was not prepared by HexiSeq's planner "
                "(another wrapper replaced its stream); report this with the Megatron version"
            )
        self.current = item
        self.documents.bounds = item.bounds
        self.layout.plan = item.plan
        out: dict[str, Any] = {}
        for key in BATCH_KEYS:  # Megatron's order: get_batch returns the values in it
            val = item.tensors.get(key)
            out[key] = None if val is None else val.to(self.device, non_blocking=True)
        item.plan.indices(self.device)  # RoPE's index: the same non-blocking copy, now
        self.exposed_s.append(time.perf_counter() - t0)
        for key in ("cu_seqlens", "max_seqlen", "local_cp_size"):
            out[key] = None  # the boundaries are in the plan: get_batch takes the SBHD branch
        return out


def side_group(
    cp_group: dist.ProcessGroup | None, domains: Sequence[Sequence[int]] | None = None
) -> dist.ProcessGroup | None:
    """A gloo group of this rank's domain for the agreement checks: ``domains`` (process ranks,
    ascending; a job's) or Megatron's CP domains. Every rank creates every domain's, in the same
    order (``new_group`` is collective). None for a domain of one rank. Collective over the
    default group."""
    from megatron_hexiseq.megatron.runtime import cp_domains

    mine = None
    for domain in domains if domains is not None else cp_domains(cp_group):
        group = dist.new_group(list(domain), backend="gloo")
        if dist.get_rank() in domain and len(domain) > 1:
            mine = group
    return mine


def ahead_batches(
    documents: MicroBatchDocuments,
    layout: MicroBatchLayout,
    *,
    reset_attention_mask: bool,
    cp_group: dist.ProcessGroup | None,
    depth: int,
    device: torch.device,
    domains: Sequence[Sequence[int]] | None = None,
) -> AheadBatches:
    """The ``get_batch_on_this_tp_rank`` replacement of a HexiSeq run (module docstring); with
    per-micro-batch layouts it creates the domains' gloo side groups (collective; ``domains``:
    a job's, as process ranks, else Megatron's CP domains)."""
    from copy import copy

    group = None if layout.fixed else side_group(cp_group, domains)
    scratch = copy(documents)  # the planning thread's own boundaries slot
    preparer = Preparer(
        scratch, layout, reset_attention_mask=reset_attention_mask, side_group=group
    )
    return AheadBatches(preparer, documents, layout, depth=depth, device=device)


def micro_batches_per_step(default: int = 2) -> int:
    """Megatron's micro-batches per step (the planning depth: one step ahead), else ``default``."""
    try:
        from megatron.core.num_microbatches_calculator import get_num_microbatches

        return max(1, int(get_num_microbatches()))
    except (ImportError, AssertionError, AttributeError, TypeError):
        return default
