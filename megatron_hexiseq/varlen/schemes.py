"""The packed-document schemes, each a per-micro-batch assignment priced by one cost model.

Every scheme turns a micro-batch (document lengths in packing order) into a ``Layout`` of the
micro-batch's tokens plus the exchange that runs it, and ``costmodel.documents.estimate_documents``
prices it (document-masked pairs, K/V bytes, memory, the same rates):

- ``hexiseq-batch``: ``BatchPlanner`` over the job's structure (groups and heads), per micro-batch.
- ``hexiseq-fixed``: the structure's own layout for the micro-batch length (``plan``'s, for one long
  sequence), unchanged whatever the documents; the runtime's pruned exchange.
- ``megatron-thd-cp``: Megatron + Transformer Engine's THD path with CP over all GPUs: one rank per
  group with every head, every document cut into ``2 x CP`` near-equal chunks, rank i holding
  chunks i and 2CP-1-i (zig-zag); TE's ring forwards every rank's whole K/V block every step
  (``exchange="te-ring"``; no document pruning). Megatron pads each document to a multiple of
  2 x CP; the padding is not counted (in the baseline's favour).
- ``dynamic-cp``: Megatron's dynamic CP: for each power-of-two CP size c dividing the GPUs, W/c CP
  groups of c consecutive GPUs (the canonical node order: groups inside a node, nodes of one type
  together), the micro-batch's documents packed whole into the groups (longest first, to the group
  with the least work ``l^2/2 + l * LINEAR_PAIRS``, GPU speeds unknown to it, as Megatron's
  scheduler), THD zig-zag and TE's ring inside each group; the best c of each micro-batch is taken
  (an oracle choice, in the baseline's favour).
- ``per-document``: the per-document split on the job's structure: every document in mirrored
  (zig-zag) pieces over every group, each group's share by its speed, members by speed
  (``BatchPlanner.proportional``), the pruned exchange. Balanced by construction (each group gets
  the same share of every document, so pairs follow tokens), but every group needs nearly every
  document's K/V: the per-document sharding of WLB-LLM / THD made speed-aware.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from megatron_hexiseq.cluster import Cluster
from megatron_hexiseq.costmodel.documents import (
    DocumentEstimate,
    estimate_documents,
)
from megatron_hexiseq.costmodel.pieces import cu_from_lengths
from megatron_hexiseq.layout import Layout, make_layout
from megatron_hexiseq.model import ModelSpec
from megatron_hexiseq.planner.canonical import canonical_order
from megatron_hexiseq.run_config import TrainOptions
from megatron_hexiseq.varlen.batch import BatchPlanner
from megatron_hexiseq.varlen.batch import fill_empty as _fill_empty

SCHEMES = ("hexiseq-batch", "hexiseq-fixed", "megatron-thd-cp", "dynamic-cp", "per-document")
LINEAR_PAIRS = 4096  # dynamic-cp's packing weight of a token's linear work, in pairs


@dataclass(frozen=True, kw_only=True)
class SchemeRun:
    """One scheme on one micro-batch: its assignment, how it was priced, and the price."""

    scheme: str
    layout: Layout
    cu_seqlens: tuple[int, ...]
    estimate: DocumentEstimate
    config: dict
    plan_s: float = 0.0


def zigzag_docs(cu: np.ndarray, ranks: Sequence[int], world: int) -> list[list[tuple[int, int]]]:
    """Each document ``[cu[d], cu[d+1])`` in ``2 c`` near-equal chunks over ``ranks`` (c of them):
    ranks[i] takes chunks i and 2c-1-i. Segments per layout rank (``world`` lists)."""
    c = len(ranks)
    out: list[list[tuple[int, int]]] = [[] for _ in range(world)]
    if cu.size < 2:
        return out
    start, length = cu[:-1, None], np.diff(cu)[:, None]
    bounds = start + (length * np.arange(2 * c + 1)[None, :]) // (2 * c)  # [docs, 2c+1]
    for i, r in enumerate(ranks):
        j = 2 * c - 1 - i
        a, b = bounds[:, i], bounds[:, i + 1]
        e, f = bounds[:, j], bounds[:, j + 1]
        segs = np.stack([a, b, e, f], axis=1).reshape(-1, 2)
        segs = segs[segs[:, 1] > segs[:, 0]]
        segs = segs[np.argsort(segs[:, 0], kind="stable")]
        # join touching chunks (chunk i and its mirror meet in the middle of a document)
        merged: list[tuple[int, int]] = []
        for s, e2 in segs.tolist():
            if merged and merged[-1][1] == s:
                merged[-1] = (merged[-1][0], e2)
            else:
                merged.append((s, e2))
        out[r] = merged
    return out


def ring_layout(cluster: Cluster, model: ModelSpec, N: int, segments) -> Layout:
    """One rank per group with every head on every rank (Megatron's CP layout), ``segments`` per
    rank."""
    W = cluster.world_size
    return make_layout(
        seq_length=N,
        num_attention_heads=model.num_attention_heads,
        num_query_groups=model.num_query_groups,
        group_sizes=[1] * W,
        segments=segments,
        heads=[list(range(model.num_attention_heads))] * W,
        hosts=[d.node for d in cluster.devices],
        gpus=[d.gpu.name for d in cluster.devices],
    )


class Schemes:
    """Builds and prices every scheme's assignment of a micro-batch on one cluster and model.

    ``fixed``: the structure's layout (``plan``'s, any sequence length: only its groups and heads
    are kept for ``hexiseq-batch``; ``hexiseq-fixed`` needs it planned for the micro-batch length).
    The HexiSeq schemes run in ``options`` (the mode ``plan`` chose); the baselines in the first of
    ``modes`` (memory modes in order of overhead) where the micro-batch fits, as ``plan`` scores its
    baselines.
    """

    def __init__(
        self,
        cluster: Cluster,
        model: ModelSpec,
        options: TrainOptions,
        fixed: Layout,
        structure: Layout | None = None,
        modes: Sequence[TrainOptions] = (),
    ) -> None:
        self.cluster, self.options, self.fixed = cluster, options, fixed
        self.modes = list(modes) or [options]
        self.model = model
        self.planner = BatchPlanner(structure or fixed, cluster, model, options)
        self.order = canonical_order(cluster)  # canonical device -> file device
        W = cluster.world_size
        self.cp_sizes = [1 << k for k in range(W.bit_length()) if W % (1 << k) == 0]

    def run(self, scheme: str, doc_lengths: Sequence[int]) -> SchemeRun:
        N = int(sum(doc_lengths))
        model = replace(self.model, seq_length=N)
        cu = np.asarray(cu_from_lengths(doc_lengths), dtype=np.int64)
        cu_t = tuple(cu.tolist())
        W = self.cluster.world_size
        if scheme == "hexiseq-batch":
            t0 = time.thread_time()  # CPU time of this thread: the figure on a shared machine
            a = self.planner.plan(doc_lengths)
            dt = time.thread_time() - t0
            est = estimate_documents(a.layout, self.cluster, model, self.options, cu_t, packed=True)
            return SchemeRun(
                scheme=scheme,
                layout=a.layout,
                cu_seqlens=cu_t,
                estimate=est,
                config={"predicted_s": a.predicted_s},
                plan_s=dt,
            )
        if scheme == "hexiseq-fixed":
            if self.fixed.seq_length != N:
                raise ValueError(f"the fixed layout is for {self.fixed.seq_length} tokens, not {N}")
            est = estimate_documents(
                self.fixed, self.cluster, model, self.options, cu_t, packed=True
            )
            return SchemeRun(
                scheme=scheme, layout=self.fixed, cu_seqlens=cu_t, estimate=est, config={}
            )
        if scheme == "per-document":
            a = self.planner.proportional(doc_lengths)
            est = estimate_documents(a.layout, self.cluster, model, self.options, cu_t, packed=True)
            return SchemeRun(
                scheme=scheme, layout=a.layout, cu_seqlens=cu_t, estimate=est, config={}
            )
        if scheme == "megatron-thd-cp":
            segs = zigzag_docs(cu, list(range(W)), W)
            _fill_empty(segs)
            lay = ring_layout(self.cluster, model, N, segs)
            est, mode = self._priced(lay, model, cu_t, "te-ring", None)
            return SchemeRun(
                scheme=scheme, layout=lay, cu_seqlens=cu_t, estimate=est, config={"cp": W, **mode}
            )
        if scheme == "dynamic-cp":
            best: SchemeRun | None = None
            for c in self.cp_sizes:
                got = self._dynamic(c, cu, model, cu_t)
                if got is None:
                    continue
                if best is None or _better(got.estimate, best.estimate):
                    best = got
            assert best is not None  # c = W always packs
            return best
        raise ValueError(f"unknown scheme {scheme!r}")

    def _dynamic(self, c: int, cu: np.ndarray, model: ModelSpec, cu_t) -> SchemeRun | None:
        W, N = self.cluster.world_size, int(cu[-1])
        k = W // c
        rings = [[self.order[i] for i in range(j * c, (j + 1) * c)] for j in range(k)]
        lengths = np.diff(cu)
        work = lengths * (lengths + 1) / 2 + lengths * LINEAR_PAIRS
        load, tokens = np.zeros(k), np.zeros(k, dtype=np.int64)
        docs_of: list[list[int]] = [[] for _ in range(k)]
        for d in np.argsort(-work, kind="stable").tolist():
            j = int(np.argmin(load))
            load[j] += work[d]
            tokens[j] += lengths[d]
            docs_of[j].append(d)
        if (tokens < c).any():
            return None  # a CP group without a token per GPU
        segs: list[list[tuple[int, int]]] = [[] for _ in range(W)]
        for j, ring in enumerate(rings):
            docs = sorted(docs_of[j])
            sub = [(int(cu[d]), int(cu[d + 1])) for d in docs]
            # zig-zag each of the group's documents over its ring
            part = zigzag_docs(
                np.array([0, *np.cumsum([e - s for s, e in sub])]), list(range(c)), c
            )
            offsets = np.cumsum([0] + [e - s for s, e in sub])
            for i, r in enumerate(ring):
                for s, e in part[i]:
                    segs[r].extend(_to_global(s, e, offsets, sub))
        for r in range(W):
            segs[r] = _merge(sorted(segs[r]))
        _fill_empty(segs)
        lay = ring_layout(self.cluster, model, N, segs)
        est, mode = self._priced(lay, model, cu_t, "te-ring", rings)
        return SchemeRun(
            scheme="dynamic-cp", layout=lay, cu_seqlens=cu_t, estimate=est, config={"cp": c, **mode}
        )

    def _priced(
        self, lay: Layout, model: ModelSpec, cu_t: tuple[int, ...], kind: str, rings
    ) -> tuple[DocumentEstimate, dict]:
        """The estimate in the first memory mode where it fits (else the last mode's)."""
        for o in self.modes:
            est = estimate_documents(
                lay,
                self.cluster,
                model,
                o,
                cu_t,
                exchange=kind,
                rings=rings,
                packed=kind == "pruned",
            )
            if est.feasible:
                break
        return est, {"memory_mode": o.memory_mode, "recompute": o.recompute}


def _better(a: DocumentEstimate, b: DocumentEstimate) -> bool:
    """Feasible first, then faster."""
    return (not a.feasible, a.iteration_time_s) < (not b.feasible, b.iteration_time_s)


def _to_global(
    s: int, e: int, offsets: np.ndarray, sub: list[tuple[int, int]]
) -> list[tuple[int, int]]:
    """A range of a CP group's concatenated documents -> global segments."""
    out = []
    d = int(np.searchsorted(offsets, s, side="right")) - 1
    while s < e:
        stop = min(e, int(offsets[d + 1]))
        g0 = sub[d][0] + s - int(offsets[d])
        out.append((g0, g0 + stop - s))
        s, d = stop, d + 1
    return out


def _merge(segs: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for s, e in segs:
        if out and out[-1][1] == s:
            out[-1] = (out[-1][0], e)
        else:
            out.append((s, e))
    return out
