"""Symmetric baselines as Layouts, scored by the same cost model as the planner.

Every baseline is built on the canonical cluster (``planner.canonical``: nodes sorted by hardware,
so a baseline does not depend on the order of the cluster file, and head-parallel groups that span
nodes pack nodes of one type) and renumbered for the file's cluster. Each is at its best
configuration: every head-parallel size ``hp`` that divides both the heads and the world is listed.

- ``ring``: every rank its own group with all heads; Megatron's 2xCP zig-zag token split
  (rank i holds chunks i and 2W-1-i; near-even chunks when ``S`` is not a multiple of 2W).
  Megatron: ``--cp-comm-type p2p``.
- ``ulysses``: one group of all ranks, even contiguous tokens, even heads. Needs ``H % W == 0``
  (else infeasible, ``iteration_time_s: null``); K/V heads are replicated ``W/G`` times when
  ``G < W`` (GQA), noted in ``config``. Megatron: ``--cp-comm-type a2a``.
- ``usp``: every factorisation ``HP*CP = W`` with ``1 < HP < W`` and ``H % HP == 0``; groups of
  ``HP`` consecutive canonical ranks (inside a node, or spanning nodes with the all-to-all over the
  network: ``spans_nodes``); zig-zag across the CP groups (group j holds chunks j and 2CP-1-j), even
  tokens and heads inside each group (Fang & Zhao, USP).

Megatron's hierarchical CP (``--cp-comm-type a2a+p2p --hierarchical-context-parallel-sizes HP CP``)
is the ``usp`` row, not a row of its own. Its A2A groups are HP consecutive CP ranks
(``parallel_state.create_hierarchical_groups``, level 0), each rank holds Megatron's rank-level 2xW
zig-zag chunks i and 2W-1-i (``get_batch_on_this_cp_rank``), and Transformer Engine's A2A
reorders the group's chunks into two contiguous blocks before the P2P ring
(``flash_attn_a2a_communicate``), so each A2A group holds exactly USP's chunks j and 2CP-1-j. Only
the split of those chunks among the group's members differs, and nothing modelled depends on it
(A2A bytes depend on token counts, attention and K/V on the group's segments): the two rows came
out identical to the last bit. What differs in Transformer Engine's ring is that every step
forwards the whole K/V block (no trim of causally hidden tokens); the group holding the first and
last chunk needs every token anyway and sets the pace, so that is not faster than USP here. When
``G % HP == 0`` (TE splits the K/V heads over the A2A group) the ``usp`` config names the Megatron
flags that run it (``megatron``).

Every baseline is a valid Layout; ``evaluate_baselines`` scores each with ``costmodel.estimate``
and returns records ``{name, config, iteration_time_s, tokens_per_s[, reason]}``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from megatron_hexiseq import costmodel
from megatron_hexiseq.cluster import Cluster
from megatron_hexiseq.costmodel import Estimate
from megatron_hexiseq.layout import Layout, split_evenly
from megatron_hexiseq.model import ModelSpec
from megatron_hexiseq.planner.build import build_layout, hosts_and_gpus
from megatron_hexiseq.planner.canonical import canonical_cluster, to_original
from megatron_hexiseq.run_config import TrainOptions


@dataclass(frozen=True)
class Baseline:
    """One named configuration (a baseline, or a heuristic of ``planner.heuristics``); ``layout`` is
    None when it cannot be built (``reason`` says why)."""

    name: str
    config: dict[str, Any]
    layout: Layout | None
    reason: str = ""

    @property
    def label(self) -> str:
        extra = ",".join(f"{k}={self.config[k]}" for k in ("k", "hp", "cp") if k in self.config)
        return f"{self.name}({extra})" if extra else self.name


def even_in_groups(
    cluster: Cluster,
    model: ModelSpec,
    seq_length: int,
    groups: list[list[int]],
    group_tokens: list[int],
    blocks: list[list[int]] | None = None,
) -> Layout:
    """Near-equal tokens and heads inside every group; the groups' tokens (and the blocks of the
    sequence, :func:`planner.build.build_layout`) as given. Shared by the baselines and heuristics."""
    W, H = cluster.world_size, model.num_attention_heads
    rank_tokens, rank_heads = [0] * W, [0] * W
    for g, t in zip(groups, group_tokens):
        for r, n, h in zip(g, split_evenly(t, len(g)), split_evenly(H, len(g))):
            rank_tokens[r], rank_heads[r] = n, h
    hosts, gpus = hosts_and_gpus(cluster)
    return build_layout(
        seq_length=seq_length,
        num_attention_heads=H,
        num_query_groups=model.num_query_groups,
        groups=groups,
        rank_tokens=rank_tokens,
        rank_heads=rank_heads,
        hosts=hosts,
        gpus=gpus,
        blocks=blocks,
    )


def symmetric_layout(cluster: Cluster, model: ModelSpec, seq_length: int, hp: int) -> Layout:
    """Groups of ``hp`` consecutive ranks of ``cluster``, near-equal tokens per rank, zig-zag across
    groups (group j holds chunks j and 2CP-1-j), near-equal heads inside each group."""
    groups = [list(range(i, i + hp)) for i in range(0, cluster.world_size, hp)]
    return even_in_groups(cluster, model, seq_length, groups, split_evenly(seq_length, len(groups)))


def _spans_nodes(cluster: Cluster, hp: int) -> bool:
    return any(
        not cluster.same_node(start, r)
        for start in range(0, cluster.world_size, hp)
        for r in range(start, start + hp)
    )


def head_parallel_sizes(world: int, heads: int) -> list[int]:
    """Every hp with 1 < hp < world that divides both the world and the heads."""
    return [hp for hp in range(2, world) if world % hp == 0 and heads % hp == 0]


def baseline_layouts(cluster: Cluster, model: ModelSpec, seq_length: int) -> list[Baseline]:
    """Every symmetric baseline configuration for this cluster and model (see module docstring),
    built on the canonical cluster and numbered for ``cluster``."""
    canon, order = canonical_cluster(cluster)
    W, H, G = cluster.world_size, model.num_attention_heads, model.num_query_groups

    def build(hp: int) -> Layout:
        return to_original(symmetric_layout(canon, model, seq_length, hp), order)

    short = f"seq_length {seq_length} < {W} ranks" if seq_length < W else ""
    ring_cfg = {"hp": 1, "cp": W, "segments": "zigzag-2xcp", "megatron": "--cp-comm-type p2p"}
    out = [
        Baseline("ring", ring_cfg, None, short) if short else Baseline("ring", ring_cfg, build(1))
    ]
    ulysses_cfg: dict[str, Any] = {
        "hp": W,
        "cp": 1,
        "kv_replication": max(1, W // G),
        "megatron": "--cp-comm-type a2a" if G % W == 0 else None,
    }
    if short:
        out.append(Baseline("ulysses", ulysses_cfg, None, short))
    elif H % W:
        out.append(
            Baseline("ulysses", ulysses_cfg, None, f"{H} heads do not divide over {W} ranks")
        )
    else:
        out.append(Baseline("ulysses", ulysses_cfg, build(W)))
    if short:
        return out
    for hp in head_parallel_sizes(W, H):
        cp = W // hp
        cfg = {
            "hp": hp,
            "cp": cp,
            "kv_replication": max(1, hp // G),
            "spans_nodes": _spans_nodes(canon, hp),
            "megatron": (
                f"--cp-comm-type a2a+p2p --hierarchical-context-parallel-sizes {hp} {cp}"
                if G % hp == 0
                else None
            ),
        }
        out.append(Baseline("usp", cfg, build(hp)))
    return out


def evaluate_baselines(
    baselines: list[Baseline],
    scores: Sequence[tuple[dict[str, Any], Callable[[Layout], Estimate]]],
    fits: Sequence[Callable[[Layout], bool]] | None = None,
) -> list[dict[str, Any]]:
    """Score each baseline in the first memory mode where it fits (``scores``: (mode, score) pairs in
    order of modelled overhead, e.g. distributed optimizer before fsdp before recompute; a baseline's
    first feasible mode is its best). ``fits[i]``: a cheap necessary condition of fitting in mode i
    (``costmodel.memory_floor_fits``); a mode it rules out is skipped unless it is the last. JSON-ready
    records in input order; the mode used is in ``config``.
    """
    records = []
    for b in baselines:
        rec: dict[str, Any] = {
            "name": b.name,
            "config": dict(b.config),
            "iteration_time_s": None,
            "tokens_per_s": None,
        }
        if b.layout is None:
            rec["reason"] = b.reason
            records.append(rec)
            continue
        for i, (mode, score) in enumerate(scores):
            if fits is not None and i < len(scores) - 1 and not fits[i](b.layout):
                continue
            est = score(b.layout)
            if est.feasible:
                rec["config"].update(mode)
                rec["iteration_time_s"] = est.iteration_time_s
                rec["tokens_per_s"] = est.tokens_per_s
                break
            problems = est.memory_problems()
            rec["reason"] = "out of memory: " + (problems[0] if problems else "infeasible")
        else:
            rec["config"].update(scores[-1][0] if scores else {})
        if rec["iteration_time_s"] is not None:
            rec.pop("reason", None)
        records.append(rec)
    return records


def best_baseline(records: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The fastest feasible record (ties: first listed), or None: the one "best symmetric baseline" rule."""
    feasible = [r for r in records if r["iteration_time_s"] is not None]
    return min(feasible, key=lambda r: r["iteration_time_s"]) if feasible else None


def best_symmetric(
    cluster: Cluster, model: ModelSpec, seq_length: int, options: Sequence[TrainOptions]
) -> tuple[Baseline, dict[str, Any]] | None:
    """The best symmetric baseline as ``plan`` picks it: every baseline scored in the first of
    ``options`` (memory modes in order of overhead) where it fits, the fastest record wins (ties: first
    listed). Returns (baseline, its record) or None when none fits."""
    baselines = baseline_layouts(cluster, model, seq_length)

    def scorer(o: TrainOptions) -> Callable[[Layout], Estimate]:
        return lambda layout: costmodel.estimate(layout, cluster, model, o)

    records = evaluate_baselines(
        baselines,
        [({"memory_mode": o.memory_mode, "recompute": o.recompute}, scorer(o)) for o in options],
    )
    best = best_baseline(records)
    return None if best is None else next((b, r) for b, r in zip(baselines, records) if r is best)
