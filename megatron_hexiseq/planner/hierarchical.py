"""The planner: Stage I (groups) -> Stage II (split between groups) -> Stage III (per rank), scored by ``estimate``.

``plan(cluster, model, seq_length, options)`` returns a complete Layout (``predicted``,
``baselines``, ``planner``, ``meta``). The surrogate (``planner.surrogate``) is how the stages
search; the final choice is the fastest *feasible* candidate by ``costmodel.estimate`` among the
planner's candidates AND every baseline, so the result is never worse than the best baseline.

Memory feedback: when ``estimate`` finds a rank over capacity (terms the surrogate does not model),
that rank's token cap is lowered by the overflow and the stages run again (at most 4 rounds).

Memory modes (``--memory-mode auto``): distributed optimizer, fsdp, distributed optimizer +
recompute, fsdp + recompute, in order of modelled overhead (a mode whose free memory cannot hold the
activations is skipped). Each baseline is scored in the first mode where it fits (its best); the
planner runs in the first mode where it finds a feasible layout, and also in the best baseline's mode
when that baseline is faster. An explicit mode or ``--recompute`` pins the choice. The chosen mode is
in ``meta.options`` with the Megatron flags it maps to (``megatron_flags``).
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace
from typing import Any, Callable, Sequence

from megatron_hexiseq.errors import HexiSeqError
from megatron_hexiseq.layout import Layout
from megatron_hexiseq.planner.baselines import baseline_layouts, best_baseline, evaluate_baselines, hosts_and_gpus
from megatron_hexiseq.planner.build import build_layout, with_fields
from megatron_hexiseq.planner.stage1_groups import Grouping, candidate_groupings, score_grouping
from megatron_hexiseq.planner.stage2_split import GroupCoef, Split
from megatron_hexiseq.planner.stage3_refine import floors, integer_split, refine_group
from megatron_hexiseq.planner.surrogate import Surrogate, build_surrogate, calibrate

MEMORY_FLAGS = {
    "distributed_optimizer": ["--use-distributed-optimizer"],
    # Megatron-FSDP's required set (megatron/core/distributed/fsdp README, "Required Configurations")
    "fsdp": ["--use-megatron-fsdp", "--data-parallel-sharding-strategy", "optim_grads_params",
             "--no-gradient-accumulation-fusion", "--use-distributed-optimizer", "--ckpt-format", "fsdp_dtensor"],
}
RECOMPUTE_FLAGS = ["--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"]
FEEDBACK_GROUPINGS = 2
# time-feedback schemes, each its own track of rounds from round 0 ("one": one factor per rank;
# "kv": the K/V ring calibrated apart; see feedback_factors)
FEEDBACK_SCHEMES = ("one", "kv")
AUTO_MODES = (("distributed_optimizer", False), ("fsdp", False), ("distributed_optimizer", True), ("fsdp", True))


def megatron_flags(options: Any) -> list[str]:
    """Megatron-LM flags that realise a memory mode (see docs/planner.md)."""
    return MEMORY_FLAGS[options.memory_mode] + (RECOMPUTE_FLAGS if options.recompute else [])


@dataclass(frozen=True)
class Candidate:
    """A planner layout with its estimate and how it was found."""

    layout: Layout
    estimate: Any
    info: dict[str, Any]


def solve_grouping(sur: Surrogate, grouping: Grouping, coefs: list[GroupCoef], split: Split,
                   time_limit_s: float) -> tuple[list[int], list[int], dict[str, Any]]:
    """Stage III on every group; per-rank (tokens, heads) indexed by rank, and solver info."""
    W = sum(len(g) for g in grouping)
    tokens, heads = [0] * W, [0] * W
    statuses: dict[str, int] = {}
    z_ns = 0
    per_group_limit = max(0.05, time_limit_s / max(1, len(set(zip(coefs, split.units)))))
    repaired = integer_split(list(coefs), sur.num_units, per_group_limit)
    if repaired is None:
        return [], [], {"status": "INFEASIBLE"}
    units = repaired[1]
    lin_floor, att_floor = floors(repaired[0])
    lin_ns = att_ns = 0
    for members, coef, T in zip(grouping, coefs, units):
        # the other groups' phase maxima (Stage II's continuous L and A) are the group's floors
        sol = refine_group(coef, T, per_group_limit, lin_floor, att_floor)
        statuses[sol.status] = statuses.get(sol.status, 0) + 1
        if sol.status == "INFEASIBLE":
            return [], [], {"status": "INFEASIBLE"}
        for r, t, h in zip(members, sol.tokens, sol.heads):
            tokens[r], heads[r] = t * sur.unit, h
        lin_ns, att_ns = max(lin_ns, sol.lin_ns), max(att_ns, sol.att_ns)
    # the phase objective over the whole domain: slowest linear phase + slowest attention phase
    z_ns = lin_ns + att_ns
    status = "OPTIMAL" if set(statuses) == {"OPTIMAL"} else "FEASIBLE"
    # bound: Stage II's continuous value of this grouping (the relaxation over every split, tokens
    # and heads; a near-bound: its linear-phase search is numerical). exact.py proves the optimum.
    lower = min(math.floor(split.z_relaxed_ns), z_ns)
    return tokens, heads, {"status": status, "group_statuses": statuses, "stage2_units": units,
                           "surrogate_time_s": z_ns * 1e-9,
                           "surrogate_bound_s": lower * 1e-9,
                           "surrogate_gap": (z_ns - lower) / z_ns if z_ns else 0.0}


def planner_candidates(cluster: Any, model: Any, seq_length: int, options: Any, score: Callable[[Layout], Any],
                       *, time_limit_s: float, method: str = "hierarchical", top_k: int = 3,
                       feedback_rounds: int = 2, feedback_schemes: Sequence[str] = FEEDBACK_SCHEMES) -> list[Candidate]:
    """Stages I-III with memory and time feedback; every candidate scored by ``score``.

    Round 0 solves the ``top_k`` groupings of Stage I; time-feedback rounds re-split the
    ``FEEDBACK_GROUPINGS`` that did best by the cost model.

    Memory feedback: ranks ``estimate`` finds over capacity get their free memory lowered by the
    overflow. Time feedback: each rank's time coefficients are scaled by (estimated time / surrogate
    time) of the round's best candidate, so terms the surrogate leaves out (K/V fan-out between groups
    of different sizes, causal visibility, collective A2A) steer the next round. Two tracks of
    ``feedback_rounds`` rounds each start from round 0 (``feedback_schemes``): one factor per rank,
    and the K/V ring calibrated apart (``feedback_factors``); they win on different instances, and
    the cost model picks among all candidates. Empty when nothing fits.
    """
    k_lin, k_att = calibrate(cluster, model, options, seq_length)
    sur0 = build_surrogate(cluster, model, options, seq_length, k_lin=k_lin, k_att=k_att)
    hosts, gpus = hosts_and_gpus(cluster)
    out: list[Candidate] = []
    node_of = [d.node for d in cluster.devices]
    last_round = 4 + feedback_rounds

    def rounds(sur: Surrogate, groupings: list, round_: int, memory_rounds: int, feedback_left: int,
               scheme: str | None) -> tuple | None:
        """Rounds from ``round_`` on; ``scheme=None`` stops at the first time feedback and returns the
        state to fork from: (surrogate, groupings, best candidate, its SurrogateTimes, next round,
        memory rounds, feedback rounds left)."""
        while round_ < last_round:
            if not groupings:  # Stage I; time-feedback rounds re-split the same groupings
                groupings = candidate_groupings(cluster, sur, top_k=top_k, fixed_size="node" if method == "node" else None)
            else:
                rescored = [(g, *score_grouping(sur, g, node_of)) for g, _, _ in groupings]
                groupings = [(g, c, sp) for g, c, sp in rescored if sp is not None]
            over: dict[int, int] = {}
            new: list[tuple[Candidate, SurrogateTimes]] = []
            for grouping, coefs, split in groupings:
                tokens, heads, info = solve_grouping(sur, grouping, coefs, split, time_limit_s / max(1, len(groupings)))
                if info["status"] == "INFEASIBLE":
                    continue
                layout = build_layout(seq_length=seq_length, num_attention_heads=model.num_attention_heads,
                                      num_query_groups=model.num_query_groups, groups=[list(g) for g in grouping],
                                      rank_tokens=tokens, rank_heads=heads, hosts=hosts, gpus=gpus)
                est = score(layout)
                info.update(group_sizes=[len(g) for g in grouping], stage2_continuous_units=list(split.units),
                            stage2_relaxed_s=split.z_relaxed_ns * 1e-9, round=round_, feedback=scheme,
                            granularity_tokens=sur.unit, k_lin=k_lin, k_att=k_att)
                cand = Candidate(layout, est, info)
                out.append(cand)
                new.append((cand, _surrogate_times(sur, grouping, coefs, tokens, heads)))
                if not est.feasible:
                    for pr in est.per_rank:
                        if pr.memory_bytes > pr.capacity_bytes:
                            over[pr.rank] = max(over.get(pr.rank, 0), pr.memory_bytes - pr.capacity_bytes)
            round_ += 1
            feasible = [(c, st) for c, st in new if c.estimate.feasible]
            if not feasible:
                if not over or memory_rounds == 4:
                    return None
                memory_rounds += 1
                sur = _lower_free(sur, over)
                groupings = []  # memory changed: form groups again
                continue
            if feedback_left == 0:
                return None
            feedback_left -= 1
            best, st = min(feasible, key=lambda x: x[0].estimate.iteration_time_s)
            # feedback rounds refine the groupings that did best by the cost model; one that was faster
            # but over memory stays in, with the memory feedback applied
            by_time = sorted(new, key=lambda x: x[0].estimate.iteration_time_s)
            keep = [c.info["group_sizes"] for c, _ in by_time[:FEEDBACK_GROUPINGS]]
            groupings = [x for x in groupings if [len(g) for g in x[0]] in keep] or groupings
            if any(not c.estimate.feasible for c, _ in by_time[:FEEDBACK_GROUPINGS]) and over:
                sur = _lower_free(sur, over)
            if scheme is None:
                return sur, groupings, best, st, round_, memory_rounds, feedback_left
            sur = sur.scaled(*feedback_factors(sur, best.layout, best.estimate, st, separate_kv=scheme == "kv"))
        return None

    fork = rounds(sur0, [], 0, 0, feedback_rounds, None)
    if fork is not None:  # one track of time-feedback rounds per scheme, from the same round-0 state
        sur, groupings, best, st, round_, memory_rounds, left = fork
        tracks: dict[Surrogate, str] = {}  # a track whose surrogate equals another's would repeat it
        for scheme in feedback_schemes:
            fed = sur.scaled(*feedback_factors(sur, best.layout, best.estimate, st, separate_kv=scheme == "kv"))
            tracks.setdefault(fed, scheme)
        for fed, scheme in tracks.items():
            rounds(fed, list(groupings), round_, memory_rounds, left, scheme)
    return out


def _lower_free(sur: Surrogate, over: dict[int, int]) -> Surrogate:
    """Memory feedback: each over-capacity rank's free memory lowered by its overflow (and one unit)."""
    free = [d.free_bytes for d in sur.devices]
    for r, extra in over.items():
        free[r] = max(0, free[r] - extra - sur.devices[r].mem_tok_bytes)
    return sur.with_free(free)


@dataclass(frozen=True)
class SurrogateTimes:
    """Surrogate seconds per rank of a solved grouping (lists indexed by rank).

    ``total``: l_r t_r + s_r t_r + h_r beta_r(T_g); ``kv``: the K/V ring term h_r (N - T_g) c_r (the
    transfer); ``kv_exposed``: the part of it not hidden behind attention, h_r max(0, (N - T_g) c_r - T_g b_r).
    """

    total: list[float]
    kv: list[float]
    kv_exposed: list[float]


def _surrogate_times(sur: Surrogate, grouping: Grouping, coefs: list[GroupCoef],
                     tokens: Sequence[int], heads: Sequence[int]) -> SurrogateTimes:
    """Surrogate seconds per rank of a solved grouping (``tokens`` per rank), with its K/V ring term apart."""
    W = len(tokens)
    total, kv, exposed = [0.0] * W, [0.0] * W, [0.0] * W
    for members, co in zip(grouping, coefs):
        T = sum(tokens[r] for r in members) // sur.unit
        ring = co.num_units - T
        for k, r in enumerate(members):
            total[r] = (tokens[r] // sur.unit * (co.a[k] + co.s_(k)) + heads[r] * co.beta(k, T)) * 1e-9
            kv[r] = heads[r] * ring * co.c[k] * 1e-9
            exposed[r] = heads[r] * max(0, ring * co.c[k] - T * co.b[k]) * 1e-9
    return SurrogateTimes(total, kv, exposed)


def feedback_factors(sur: Surrogate, layout: Layout, est: Any, st: SurrogateTimes,
                     separate_kv: bool = True) -> tuple[list[float], list[float]]:
    """Time feedback: per-rank factors for (every other time coefficient, the K/V ring coefficient c_r).

    ``separate_kv=False``: one factor for all of a rank's coefficients, ``estimate``'s time over the
    surrogate's. ``separate_kv=True``: K/V gets ``estimate``'s transfer time (``kv_exchange_s``: only
    causally visible K/V is sent) over the surrogate's ring term h_r (N - T_g) c_r (an upper bound
    that counts hidden tokens; ranks without heads or without a ring take the other factor), the rest
    ``estimate``'s time without its exposed K/V over the surrogate's time without its exposed ring.
    Each clipped to [0.25, 4] and averaged per class of (device coefficients, tokens, heads), so
    identical groups stay identical and Stage II/III keep sharing their work across them (thousands
    of GPUs, few classes).
    """
    raw: list[float] = []
    raw_kv: list[float | None] = []
    for p, s, s_kv, s_exp in zip(est.per_rank, st.total, st.kv, st.kv_exposed):
        if not separate_kv:
            raw.append(min(4.0, max(0.25, p.time_s / s)) if s > 0 else 1.0)
            raw_kv.append(None)
            continue
        rest = s - s_exp
        raw.append(min(4.0, max(0.25, (p.time_s - p.breakdown["kv_exposed_s"]) / rest)) if rest > 0 else 1.0)
        raw_kv.append(min(4.0, max(0.25, p.breakdown["kv_exchange_s"] / s_kv)) if s_kv > 0 else None)
    classes: dict[tuple, list[int]] = {}
    for r, (dev, lay_r) in enumerate(zip(sur.devices, layout.ranks)):
        classes.setdefault((dev, lay_r.num_tokens, len(lay_r.heads)), []).append(r)
    factors, kv_factors = [1.0] * len(raw), [1.0] * len(raw)
    for members in classes.values():
        mean = round(sum(raw[r] for r in members) / len(members), 3)
        kvs = [raw_kv[r] for r in members if raw_kv[r] is not None]
        mean_kv = round(sum(kvs) / len(kvs), 3) if kvs else mean
        for r in members:
            factors[r], kv_factors[r] = mean, mean_kv
    return factors, kv_factors


def plan(cluster: Any, model: Any, seq_length: int, options: Any, *,
         modes: Sequence[tuple[str, bool]] | None = None, time_limit_s: float = 10.0,
         method: str = "hierarchical", reproducible: bool = False) -> Layout:
    """The full planner. ``modes``: (memory_mode, recompute) pairs tried in order until one is
    feasible (default: ``options``' own mode only); ``inputs.load_problem`` builds it from the flags.

    ``method``: "hierarchical" (Stages I-III), "node" (one group per node: the first planner) or
    "exact" (one CP-SAT model over all decisions; clusters of at most 16 GPUs).
    ``reproducible``: write 0 for wall-clock fields so the same inputs give a byte-identical file.
    """
    from megatron_hexiseq import costmodel

    if seq_length < cluster.world_size:
        raise HexiSeqError(f"seq_length {seq_length} is shorter than the {cluster.world_size} GPUs; every rank needs "
                           "at least one token (Megatron cannot run an empty shard): use a longer --seq-length "
                           "or fewer GPUs")
    t0 = time.perf_counter()
    modes = list(modes) if modes else [(options.memory_mode, options.recompute)]
    tried = [replace(options, memory_mode=m, recompute=r) for m, r in modes]
    usable = [o for o in tried if _may_fit(cluster, model, seq_length, o)]  # others cannot fit any layout

    def scorer(o: Any) -> Callable[[Layout], Any]:
        return lambda layout: costmodel.estimate(layout, cluster, model, o)

    def mode_of(o: Any) -> dict[str, Any]:
        return {"memory_mode": o.memory_mode, "recompute": o.recompute}

    # baselines, each in its first feasible memory mode
    t_base = time.perf_counter()
    baselines = baseline_layouts(cluster, model, seq_length)
    records = evaluate_baselines(baselines, [(mode_of(o), scorer(o)) for o in usable])
    baselines_s = time.perf_counter() - t_base
    best_b = best_baseline(records)

    # the planner: the first mode with a feasible candidate; also the best baseline's mode if that beats it
    t_stages = time.perf_counter()
    ran: dict[tuple, list[Candidate]] = {}

    def run_mode(o: Any) -> Candidate | None:
        key = (o.memory_mode, o.recompute)
        if key not in ran:
            if method == "exact":
                from megatron_hexiseq.planner.exact import exact_candidates

                ran[key] = exact_candidates(cluster, model, seq_length, o, scorer(o), time_limit_s=time_limit_s)
            else:
                ran[key] = planner_candidates(cluster, model, seq_length, o, scorer(o),
                                              time_limit_s=time_limit_s, method=method)
        feasible = [c for c in ran[key] if c.estimate.feasible]
        return min(feasible, key=lambda c: c.estimate.iteration_time_s, default=None)

    best_c, best_o = None, None
    for o in usable:
        best_c = run_mode(o)
        if best_c is not None:
            best_o = o
            break
    if best_b is not None and (best_c is None or best_b["iteration_time_s"] < best_c.estimate.iteration_time_s):
        o_b = next(o for o in usable if mode_of(o) == {k: best_b["config"][k] for k in ("memory_mode", "recompute")})
        c_b = run_mode(o_b)
        if c_b is not None and (best_c is None or c_b.estimate.iteration_time_s < best_c.estimate.iteration_time_s):
            best_c, best_o = c_b, o_b
    stages_s = time.perf_counter() - t_stages
    if best_c is None and best_b is None:
        raise HexiSeqError(explain_infeasible(cluster, model, seq_length, tried))

    if best_c is not None and (best_b is None or best_c.estimate.iteration_time_s <= best_b["iteration_time_s"]):
        chosen, layout, est, info, opts = "hexiseq", best_c.layout, best_c.estimate, dict(best_c.info), best_o
    else:
        b = next(b for b in baselines if b.layout is not None and b.name == best_b["name"]
                 and all(b.config[k] == v for k, v in best_b["config"].items() if k in b.config))
        opts = next(o for o in usable if mode_of(o) == {k: best_b["config"][k] for k in ("memory_mode", "recompute")})
        chosen, layout, est = b.label, b.layout, scorer(opts)(b.layout)
        info = dict(best_c.info) if best_c else {"status": "NO_PLANNER_SOLUTION"}
        info["note"] = f"baseline {b.label} is faster than the planner's best candidate by the cost model"
    solve_s = 0.0 if reproducible else round(time.perf_counter() - t0, 4)
    planner = {"method": method, "solve_time_s": solve_s, "status": info.pop("status"),
               "bound": info.pop("surrogate_bound_s", None), "gap": info.pop("surrogate_gap", None),
               "stages_time_s": 0.0 if reproducible else round(stages_s, 4),
               "baselines_time_s": 0.0 if reproducible else round(baselines_s, 4),
               "candidates_evaluated": sum(len(v) for v in ran.values()), "stages": info}
    meta = {"cluster": cluster.name, "model": model.name, "chosen": chosen,
            "options": {"micro_batch_size": opts.micro_batch_size, "recompute": opts.recompute,
                        "memory_mode": opts.memory_mode, "data_parallel_size": opts.data_parallel_size,
                        "capacity_fraction": opts.capacity_fraction,
                        "memory_modes_tried": [f"{o.memory_mode}{'+recompute' if o.recompute else ''}" for o in tried],
                        "megatron_flags": megatron_flags(opts)}}
    return with_fields(layout, predicted=est.to_predicted(), baselines=tuple(records), planner=planner, meta=meta)


def _may_fit(cluster: Any, model: Any, seq_length: int, options: Any) -> bool:
    """Necessary condition: the devices' free memory (after static) holds every token's activations."""
    from megatron_hexiseq import costmodel

    static = costmodel.static_memory_bytes(model, options, cluster.world_size * options.data_parallel_size)
    act = options.micro_batch_size * costmodel.activation_bytes_per_token(model, options)
    free = sum(max(0.0, options.capacity_fraction * d.memory_bytes - static) for d in cluster.devices)
    return free >= seq_length * act


def explain_infeasible(cluster: Any, model: Any, seq_length: int, tried: list[Any]) -> str:
    """One line: which GPU type runs out of memory, by how much, and what would help."""
    from megatron_hexiseq import costmodel

    opts = tried[-1]  # the most memory-frugal mode tried
    W = cluster.world_size
    static = costmodel.static_memory_bytes(model, opts, W * opts.data_parallel_size)
    act = max(1, costmodel.activation_bytes_per_token(model, opts))
    usable = [opts.capacity_fraction * d.memory_bytes for d in cluster.devices]
    free = [max(0.0, u - static) for u in usable]
    gib = 2.0 ** 30
    modes = ", ".join(f"{o.memory_mode}{'+recompute' if o.recompute else ''}" for o in tried)
    helps = ["more GPUs"]
    if not any(o.recompute for o in tried):
        helps.append("--recompute")
    if not any(o.memory_mode == "fsdp" for o in tried):
        helps.append("--memory-mode fsdp")
    helps.append("a shorter --seq-length")
    worst: tuple[float, str, float] = (0.0, "", 0.0)
    if any(f == 0 for f in free):
        helps = [h for h in helps if h in ("more GPUs", "--memory-mode fsdp")]  # tokens are not the problem
        for d, u in zip(cluster.devices, usable):
            short = static - u
            if short > worst[0]:
                worst = (short, d.gpu.name, u)
        if worst[1]:
            return (f"{model.name} does not fit ({modes}): each {worst[1]} needs {static / gib:.1f} GiB for parameters, "
                    f"gradients and optimizer states before any tokens but has {worst[2] / gib:.1f} GiB usable "
                    f"({opts.capacity_fraction:.0%} of capacity), short by {worst[0] / gib:.1f} GiB; try {', '.join(helps)}")
    total_free = sum(free)
    for d, u, f in zip(cluster.devices, usable, free):
        need = static + seq_length * act * (f / total_free if total_free else 1 / W)
        if need - u > worst[0]:
            worst = (need - u, d.gpu.name, u)
    if worst[1]:
        return (f"seq_length {seq_length} does not fit in memory under any layout ({modes}): even with tokens spread by "
                f"free memory each {worst[1]} needs {(worst[0] + worst[2]) / gib:.1f} GiB but has {worst[2] / gib:.1f} GiB "
                f"usable ({opts.capacity_fraction:.0%} of capacity), short by {worst[0] / gib:.1f} GiB; try {', '.join(helps)}")
    return (f"seq_length {seq_length} does not fit in memory under any layout ({modes}): the attention working set "
            f"and buffers exceed capacity on some GPUs; try {', '.join(helps)}")
