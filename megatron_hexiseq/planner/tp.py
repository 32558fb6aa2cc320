"""``plan_tp``: plan a layout over TP bundles of t GPUs, or choose t (``"auto"``).

A bundle is one planning unit (``costmodel.tp``): for a given t the single-sequence planner
(``plan.plan``) runs unchanged on the bundle problem (one device per bundle, one TP rank's model,
``options.tensor_model_parallel_size = t``), and its layout becomes a layout over bundles: every
segment boundary rounded to a multiple of t (sequence parallelism splits a bundle's tokens evenly
over its t GPUs; ``round_segments``), ``tensor_model_parallel_size = t``, re-priced by ``estimate``
on the real cluster. t = 1 is ``plan`` itself, byte for byte.

``"auto"`` picks one t for the whole job among every t that splits the heads and divides every node's
GPU count (``tensor_parallel.valid_tp_sizes``; and the sequence, for sequence parallelism). Before
planning any t it computes a **lower bound** of every layout's iteration time for that t
(``iteration_lower_bound``: the slowest linear phase is at least the tokens over the summed linear
speed of the bundles, the slowest attention phase at least the pair-heads over the summed attention
speed, with the tokens each GPU's memory can hold, and Megatron-FSDP's exposed gathers, in the
cheapest memory mode that can fit). It plans the t in that order, t = 1 moved to second, skips
every t whose bound is not below the fastest plan so far (exact in the cost model: such a t has no
faster layout), and plans at most ``AUTO_MAX_PLANS`` (3) t's in all: the smallest bound's, t = 1's
(so ``auto`` is never slower than TP = 1 unless TP = 1's bound shows it cannot be faster) and the
next smallest bound's. Not exact: a fourth t whose bound is below the best plan is not planned. The
bounds leave out terms that differ between t's (how well the planner balances the two phases over
W / t bundles, the K/V exchange, the achieved attention rate of each bundle's call sizes: 5-40% of
a plan's time), so their order is not the plans' order: llama3-70b at 128K on the 64-GPU
four-types cluster has bounds 9.63 / 9.82 s at t = 8 / 4 and plans of 13.57 / 12.51 s; at 256K on
a 128-GPU H100/A100/A800 cluster the four bounds lie within 3% (13.28-13.63 s) and the plans range
from 15.33 (t = 4) to 17.98 s (t = 2). ``auto`` thus costs at most three plans, each on W / t
devices. The record (``planner.tensor_parallel``) lists each t's bound, its plan's time or why it
was skipped or infeasible.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any, NamedTuple

import numpy as np

from megatron_hexiseq import costmodel
from megatron_hexiseq.cluster import Cluster
from megatron_hexiseq.costmodel.formulas import attention_s_per_pair_head, linear_s_per_token
from megatron_hexiseq.costmodel.step import fsdp_rank_exposed_s
from megatron_hexiseq.costmodel.tp import bundle_setting
from megatron_hexiseq.errors import HexiSeqError
from megatron_hexiseq.layout import Layout
from megatron_hexiseq.model import ModelSpec
from megatron_hexiseq.planner.build import with_fields
from megatron_hexiseq.planner.plan import DEFAULT_TIME_LIMIT_S, plan
from megatron_hexiseq.run_config import TrainOptions, options_from_record
from megatron_hexiseq.tensor_parallel import check_bundle_nodes, tp_heads, valid_tp_sizes

AUTO = "auto"
# The catalog's measured attention curves reach 1.028 of their long-block rate at some call sizes
# (gpu_rates.ATTENTION_CURVES); the bound's attention term is divided by this margin so that it
# stays below estimate's time for any call mix.
ATTENTION_RATE_MARGIN = 1.05

# auto plans at most this many t's fully (those with the smallest bounds that the fastest plan so
# far does not rule out): see the module docstring.
AUTO_MAX_PLANS = 3

Progress = Callable[[str], None]


def tp_sizes(cluster: Cluster, model: ModelSpec, seq_length: int) -> list[int]:
    """The TP sizes ``auto`` considers: split the heads and FFN, divide every node's GPU count and
    the sequence, leave every bundle at least one token."""
    counts = [n.count for n in cluster.nodes]
    return [
        t
        for t in valid_tp_sizes(model.num_attention_heads, model.num_query_groups, counts)
        if model.ffn_hidden_size % t == 0
        and seq_length % t == 0
        and seq_length >= cluster.world_size  # t tokens per bundle at least
    ]


def check_tp(cluster: Cluster, model: ModelSpec, seq_length: int, tp: int) -> None:
    """One ``HexiSeqError`` line when layouts over bundles of ``tp`` GPUs cannot exist."""
    tp_heads(model.num_attention_heads, model.num_query_groups, tp)
    check_bundle_nodes([(n.name, n.count) for n in cluster.nodes], tp)
    if seq_length % tp:
        raise HexiSeqError(
            f"--seq-length {seq_length} is not a multiple of --tensor-model-parallel-size {tp}; "
            "sequence parallelism splits every bundle's tokens evenly over its GPUs"
        )


def round_segments(layout: Layout, tp: int) -> Layout:
    """``layout`` with every segment boundary rounded to the nearest multiple of ``tp`` (ties down;
    empty segments dropped): the boundaries keep their order, so the segments still partition the
    sequence, and every rank holds a multiple of ``tp`` tokens (each count moves by less than ``tp``
    per boundary). One line if a rank would be left without tokens."""
    if tp == 1:
        return layout

    def snap(x: int) -> int:
        q, r = divmod(x, tp)
        return (q + (1 if 2 * r > tp else 0)) * tp

    segments = [
        [(snap(s), snap(e)) for s, e in r.segments if snap(s) < snap(e)] for r in layout.ranks
    ]
    empty = [r.rank for r, segs in zip(layout.ranks, segments) if r.segments and not segs]
    if empty:
        raise HexiSeqError(
            f"bundles {empty} hold fewer than {tp} tokens, too few for sequence parallelism over "
            f"TP bundles of {tp}; use a longer --seq-length or fewer GPUs"
        )
    ranks = tuple(replace(r, segments=tuple(segs)) for r, segs in zip(layout.ranks, segments))
    return replace(layout, ranks=ranks)


def iteration_lower_bound(
    cluster: Cluster, model: ModelSpec, seq_length: int, options: Sequence[TrainOptions]
) -> float | None:
    """A lower bound of ``estimate``'s iteration time of every layout of this (bundle) problem, in
    the cheapest of ``options`` (memory modes) where it can fit; None when none can.

    Memory: rank r holds at most ``M_r = (usable_r - static) / activations per token`` tokens and at
    least one (``t`` with sequence parallelism), so a mode fits only if every ``M_r`` reaches that
    and ``sum M_r >= S`` (the attention core and buffers only lower ``M_r``). Linear phase: rank r
    takes ``t_r * lin_r`` with ``sum t_r = S`` and ``t_r <= M_r``, so its maximum is at least the
    smallest Z with ``sum min(M_r, Z / lin_r) >= S`` (water-filling), plus Megatron-FSDP's exposed
    collectives behind a linear work of Z (``step.fsdp_rank_exposed_s``; work plus exposed part
    only grows with the work). Attention phase: rank r takes
    ``pairs(group) * h_r * att_r`` (times its calls' slowdown, >= 1 / ``ATTENTION_RATE_MARGIN``),
    and the pair-heads of all ranks sum to ``S (S + 1) / 2 * H`` (every group holds every head), so
    its maximum is at least that over ``sum(1 / att_r)``. The iteration is the sum of the two
    phases' maxima."""
    S, H, W = seq_length, model.num_attention_heads, cluster.world_size
    types: dict[object, list] = {}  # (GPU type, memory) -> [a device of it, how many]
    for d in cluster.devices:
        types.setdefault((d.gpu, d.memory_gib), [d, 0])[1] += 1
    best = None
    for o in options:
        static = costmodel.static_memory_bytes(model, o, o.shard_ranks(W))
        act = o.micro_batch_size * costmodel.activation_bytes_per_token(model, o)
        rows = [
            _TypeRow(
                linear_s_per_token(model, d, o),
                attention_s_per_pair_head(model, d, o),
                (o.capacity_fraction * d.memory_bytes - static) // act,
                n,
            )
            for d, n in types.values()
        ]
        if (
            min(r.most for r in rows) < o.tensor_model_parallel_size
            or sum(r.most * r.devices for r in rows) < S
        ):
            continue
        attention_speed = sum(r.devices / r.att_s for r in rows)
        linear = _water_fill(S, rows)
        # Megatron-FSDP's exposed gathers: x + fsdp(x) grows with the linear work x (the exposed
        # part shrinks by less than the work grows), so the slowest rank pays at least this
        linear += float(fsdp_rank_exposed_s(cluster, model, o, np.array([linear]))[0])
        bound = linear + S * (S + 1) / 2 * H / attention_speed / ATTENTION_RATE_MARGIN
        best = bound if best is None else min(best, bound)
    return best


class _TypeRow(NamedTuple):
    """One GPU type of a bundle problem in ``iteration_lower_bound``."""

    lin_s: float  # linear seconds per token
    att_s: float  # attention seconds per pair-head
    most: float  # tokens its memory holds at most
    devices: int  # devices of the type


def _water_fill(tokens: int, rows: list[_TypeRow]) -> float:
    """The smallest Z with ``sum devices * min(most, Z / lin_s) >= tokens`` over ``rows``."""
    z, fixed, speed = 0.0, 0.0, sum(r.devices / r.lin_s for r in rows)
    for r in sorted(rows, key=lambda r: r.most * r.lin_s):  # where each type's cap binds
        z = (tokens - fixed) / speed
        if z <= r.most * r.lin_s:
            return z
        fixed += r.devices * r.most
        speed -= r.devices / r.lin_s
    return z


def plan_tp(
    cluster: Cluster,
    model: ModelSpec,
    seq_length: int,
    options: TrainOptions,
    *,
    tensor_model_parallel_size: int | str = 1,
    modes: Sequence[tuple[str, bool]] | None = None,
    time_limit_s: float = DEFAULT_TIME_LIMIT_S,
    method: str = "hierarchical",
    reproducible: bool = False,
    progress: Progress | None = None,
) -> Layout:
    """``plan`` with TP bundles of ``tensor_model_parallel_size`` GPUs, or ``"auto"`` (module
    docstring). The other arguments are ``plan``'s; the time limit covers every t planned."""
    kw: dict[str, Any] = dict(modes=modes, method=method, reproducible=reproducible)
    if tensor_model_parallel_size == 1:
        return plan(
            cluster, model, seq_length, options, time_limit_s=time_limit_s, progress=progress, **kw
        )
    say = progress or (lambda message: None)
    t0 = time.perf_counter()
    if tensor_model_parallel_size != AUTO:
        tp = tensor_model_parallel_size
        if not isinstance(tp, int) or isinstance(tp, bool) or tp < 1:
            raise HexiSeqError(
                f"--tensor-model-parallel-size must be a positive integer or 'auto', got {tp!r}"
            )
        check_tp(cluster, model, seq_length, tp)
        layout = _plan_bundles(cluster, model, seq_length, options, tp, time_limit_s, progress, kw)
        return _with_record(layout, [{"tensor_model_parallel_size": tp, "chosen": True}], t0, kw)
    sizes = tp_sizes(cluster, model, seq_length)
    if not sizes:
        raise HexiSeqError(
            f"no tensor-parallel size fits {model.name} on cluster {cluster.name!r} for "
            f"{seq_length} tokens (not even 1: every GPU needs a token)"
        )
    tried_modes = list(modes) if modes else [(options.memory_mode, options.recompute)]
    bounds: dict[int, float | None] = {}
    for tp in sizes:
        b_cluster, b_model, b_opts = bundle_setting(cluster, model, options, tp)
        mode_opts = [replace(b_opts, memory_mode=m, recompute=r) for m, r in tried_modes]
        bounds[tp] = iteration_lower_bound(b_cluster, b_model, seq_length, mode_opts)
    order = sorted((t for t in sizes if bounds[t] is not None), key=lambda t: (bounds[t], t))
    if 1 in order[1:]:  # t = 1 is planned second unless its bound rules it out
        order.remove(1)
        order.insert(1, 1)
    records: dict[int, dict[str, Any]] = {
        t: {"tensor_model_parallel_size": t, "lower_bound_s": _sig(bounds[t])} for t in sizes
    }
    best: tuple[float, int, Layout] | None = None
    planned = 0
    for tp in order:
        bound = bounds[tp]
        assert bound is not None
        rec = records[tp]
        if best is not None and bound >= best[0]:
            rec["skipped"] = "its lower bound is not below the fastest plan"
            continue
        if planned == AUTO_MAX_PLANS:
            rec["skipped"] = (
                f"auto plans at most {AUTO_MAX_PLANS} sizes: the smallest bound's, TP = 1's and "
                "the next smallest bound's"
            )
            continue
        left = time_limit_s - (time.perf_counter() - t0)
        if best is not None and left <= 0:
            rec["skipped"] = "time limit reached"
            continue
        say(f"tensor-parallel size {tp}")
        try:
            if tp == 1:
                layout = plan(
                    cluster,
                    model,
                    seq_length,
                    options,
                    time_limit_s=max(left, 1e-3),
                    progress=progress,
                    **kw,
                )
            else:
                layout = _plan_bundles(
                    cluster, model, seq_length, options, tp, max(left, 1e-3), progress, kw
                )
        except HexiSeqError as e:
            rec["infeasible"] = str(e)
            continue
        planned += 1
        time_s = costmodel.estimate(
            layout, cluster, model, _chosen_options(layout, options)
        ).iteration_time_s
        rec["iteration_time_s"] = _sig(time_s)
        if best is None or time_s < best[0]:
            best = (time_s, tp, layout)
    for t in sizes:
        if bounds[t] is None:
            records[t]["infeasible"] = "does not fit in memory in any mode tried"
    if best is None:
        raise HexiSeqError(
            f"no tensor-parallel size ({', '.join(map(str, sizes))}) gives a layout that fits: "
            + "; ".join(f"t={t}: {records[t].get('infeasible', '?')}" for t in sizes)
        )
    records[best[1]]["chosen"] = True
    return _with_record(best[2], [records[t] for t in sizes], t0, kw)


def _plan_bundles(
    cluster: Cluster,
    model: ModelSpec,
    seq_length: int,
    options: TrainOptions,
    tp: int,
    time_limit_s: float,
    progress: Progress | None,
    kw: dict[str, Any],
) -> Layout:
    """``plan`` on the bundle problem, as a layout over bundles of the real cluster."""
    b_cluster, b_model, b_opts = bundle_setting(cluster, model, options, tp)
    planned = plan(
        b_cluster, b_model, seq_length, b_opts, time_limit_s=time_limit_s, progress=progress, **kw
    )
    layout = replace(round_segments(planned, tp), tensor_model_parallel_size=tp)
    chosen = _chosen_options(layout, b_opts)
    est = costmodel.estimate(layout, cluster, model, chosen)
    planner = dict(planned.planner)
    winner = planner.get("winner")
    if isinstance(winner, dict):  # the rounded layout's time on the real cluster
        planner["winner"] = {**winner, "iteration_time_s": _sig(est.iteration_time_s)}
    return with_fields(
        layout,
        predicted=est.to_predicted(),
        planner=planner,
        meta={**planned.meta, "model": model.name},
    )


def _chosen_options(layout: Layout, base: TrainOptions) -> TrainOptions:
    """The options the layout was planned with (its ``meta.options``), t included."""
    return options_from_record(layout.meta.get("options", {}), base)


def _with_record(
    layout: Layout, records: list[dict[str, Any]], t0: float, kw: dict[str, Any]
) -> Layout:
    """``planner.tensor_parallel``: each t considered (bound, time, skipped / infeasible, chosen)
    and the whole search's wall time (0 with ``reproducible``)."""
    solve = 0.0 if kw.get("reproducible") else round(time.perf_counter() - t0, 4)
    planner = {**layout.planner, "tensor_parallel": {"sizes": records, "time_s": solve}}
    return with_fields(layout, planner=planner)


def _sig(x: float | None) -> float | None:
    return None if x is None else float(f"{x:.9g}")
