"""Symmetric baselines as Layouts, scored by the same cost model as the planner.

- ``ring``: every rank its own group with all heads; Megatron's 2xCP zig-zag token split
  (rank i holds chunks i and 2W-1-i; near-even chunks when ``S`` is not a multiple of 2W).
- ``ulysses``: one group of all ranks, even contiguous tokens, even heads. Needs ``H % W == 0``
  (else infeasible, ``iteration_time_s: null``); K/V heads are replicated ``W/G`` times when
  ``G < W`` (GQA), noted in ``config``.
- ``usp``: every (HP, CP) factorisation ``HP*CP = W`` with ``1 < HP < W``, ``H % HP == 0`` and
  every HP group of consecutive ranks inside one node; zig-zag across the CP groups, even tokens
  and heads inside each group (Fang & Zhao, USP).
- ``megatron-a2a+p2p``: Megatron's hierarchical CP (``--cp-comm-type a2a+p2p``,
  ``hierarchical_context_parallel_sizes=[HP, CP]``): same groups as USP, but each *rank* holds the
  rank-level 2xW zig-zag chunks (``get_batch_on_this_cp_rank``), so a group's tokens are not two
  contiguous chunks. Listed because its segments (and so the K/V traffic) differ from USP.

Every baseline is a valid Layout; ``evaluate_baselines`` scores each with ``costmodel.estimate``
and returns records ``{name, config, iteration_time_s, tokens_per_s[, reason]}``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Sequence

from megatron_hexiseq import costmodel
from megatron_hexiseq.cluster import Cluster
from megatron_hexiseq.costmodel import Estimate, TrainOptions
from megatron_hexiseq.layout import Group, Layout, RankPlan, split_evenly
from megatron_hexiseq.model import ModelSpec
from megatron_hexiseq.planner.build import build_layout, hosts_and_gpus


@dataclass(frozen=True)
class Baseline:
    """One baseline configuration; ``layout`` is None when it cannot be built (``reason`` says why)."""

    name: str
    config: dict[str, Any]
    layout: Layout | None
    reason: str = ""

    @property
    def label(self) -> str:
        extra = ",".join(f"{k}={v}" for k, v in self.config.items() if k in ("hp", "cp"))
        return f"{self.name}({extra})" if extra else self.name


def _symmetric(cluster: Cluster, model: ModelSpec, seq_length: int, hp: int) -> Layout:
    """Groups of ``hp`` consecutive ranks, equal tokens per rank, zig-zag across groups."""
    world = cluster.world_size
    hosts, gpus = hosts_and_gpus(cluster)
    H = model.num_attention_heads
    groups = [list(range(i, i + hp)) for i in range(0, world, hp)]
    group_tokens = split_evenly(seq_length, len(groups))
    rank_tokens, rank_heads = [0] * world, [0] * world
    for g, t in zip(groups, group_tokens):
        for r, n, h in zip(g, split_evenly(t, hp), split_evenly(H, hp)):
            rank_tokens[r], rank_heads[r] = n, h
    return build_layout(seq_length=seq_length, num_attention_heads=H, num_query_groups=model.num_query_groups,
                        groups=groups, rank_tokens=rank_tokens, rank_heads=rank_heads, hosts=hosts, gpus=gpus)


def _regroup(ring: Layout, hp: int) -> Layout:
    """Keep the ring's rank-level zig-zag segments; put ranks in groups of ``hp`` with even heads."""
    H = ring.num_attention_heads
    groups, ranks = [], []
    for gid, start in enumerate(range(0, ring.world_size, hp)):
        members = tuple(range(start, start + hp))
        groups.append(Group(id=gid, ranks=members))
        heads, h0 = split_evenly(H, hp), 0
        for r, h in zip(members, heads):
            rp = ring.ranks[r]
            ranks.append(RankPlan(rank=r, host=rp.host, gpu=rp.gpu, group=gid, segments=rp.segments,
                                  heads=tuple(range(h0, h0 + h))))
            h0 += h
    return Layout(seq_length=ring.seq_length, num_attention_heads=H, num_query_groups=ring.num_query_groups,
                  world_size=ring.world_size, groups=tuple(groups), ranks=tuple(ranks))


def _groups_inside_nodes(cluster: Cluster, hp: int) -> bool:
    return all(cluster.same_node(start, r) for start in range(0, cluster.world_size, hp)
               for r in range(start, start + hp))


def baseline_layouts(cluster: Cluster, model: ModelSpec, seq_length: int) -> list[Baseline]:
    """Every symmetric baseline configuration for this cluster and model (see module docstring)."""
    W, H, G = cluster.world_size, model.num_attention_heads, model.num_query_groups
    out = [Baseline("ring", {"hp": 1, "cp": W, "segments": "zigzag-2xcp"}, _symmetric(cluster, model, seq_length, 1))]
    ulysses_cfg = {"hp": W, "cp": 1, "kv_replication": max(1, W // G)}
    if seq_length < W:
        out.append(Baseline("ulysses", ulysses_cfg, None, f"seq_length {seq_length} < {W} ranks"))
    elif H % W:
        out.append(Baseline("ulysses", ulysses_cfg, None, f"{H} heads do not divide over {W} ranks"))
    else:
        out.append(Baseline("ulysses", ulysses_cfg, _symmetric(cluster, model, seq_length, W)))
    ring = out[0].layout
    for hp in range(2, W):
        cp = W // hp
        if W % hp or H % hp or not _groups_inside_nodes(cluster, hp) or seq_length < W:
            continue
        cfg = {"hp": hp, "cp": cp, "kv_replication": max(1, hp // G)}
        usp = _symmetric(cluster, model, seq_length, hp)
        out.append(Baseline("usp", cfg, usp))
        a2a = _regroup(ring, hp)
        if any(a.segments != b.segments for a, b in zip(a2a.ranks, usp.ranks)):
            out.append(Baseline("megatron-a2a+p2p", {**cfg, "hierarchical_context_parallel_sizes": [hp, cp]}, a2a))
    return out


def evaluate_baselines(baselines: list[Baseline], scores: Sequence[tuple[dict[str, Any], Callable[[Layout], Estimate]]]
                       ) -> list[dict[str, Any]]:
    """Score each baseline in the first memory mode where it fits (``scores``: (mode, score) pairs in
    order of modelled overhead, e.g. distributed optimizer before fsdp before recompute; a baseline's
    first feasible mode is its best). JSON-ready records in input order; the mode used is in ``config``.
    """
    records = []
    for b in baselines:
        rec: dict[str, Any] = {"name": b.name, "config": dict(b.config), "iteration_time_s": None, "tokens_per_s": None}
        if b.layout is None:
            rec["reason"] = b.reason
            records.append(rec)
            continue
        for mode, score in scores:
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


def best_symmetric(cluster: Cluster, model: ModelSpec, seq_length: int, options: Sequence[TrainOptions]
                   ) -> tuple[Baseline, dict[str, Any]] | None:
    """The best symmetric baseline as ``plan`` picks it: every baseline scored in the first of
    ``options`` (memory modes in order of overhead) where it fits, the fastest record wins (ties: first
    listed). Returns (baseline, its record) or None when none fits."""
    baselines = baseline_layouts(cluster, model, seq_length)
    records = evaluate_baselines(baselines, [
        ({"memory_mode": o.memory_mode, "recompute": o.recompute},
         lambda layout, o=o: costmodel.estimate(layout, cluster, model, o)) for o in options])
    best = best_baseline(records)
    return None if best is None else next((b, r) for b, r in zip(baselines, records) if r is best)
