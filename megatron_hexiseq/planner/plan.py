"""``plan()``: the planner's entry point; runs the candidate families and makes the final choice.

``plan(cluster, model, seq_length, options)`` returns a complete Layout (``predicted``,
``baselines``, ``planner``, ``meta``). Every candidate — the symmetric baselines
(``planner.baselines``), the heuristics (``planner.heuristics``) and the planner's own
(``planner.hierarchical`` or ``planner.exact``) — is a Layout of the canonical cluster
(``planner.canonical``: the result does not depend on the order of the cluster file) scored by
``costmodel.estimate``; the result is the fastest *feasible* one, so it is never worse than any
baseline or heuristic. ``planner.winner`` names it (family and name), ``planner.heuristics`` lists
the heuristics' records as ``baselines`` lists the baselines'.

Memory modes (``run_config``; ``planner.feasibility`` skips those that cannot fit at all): each
baseline and heuristic is scored in the first mode of ``modes`` where it fits (its best); the
planner runs in the first mode where it finds a feasible layout, starting at the first mode where
some baseline or heuristic fits, then in the cheaper modes before that one (from its Stage I
groupings, without memory feedback: an uneven layout can fit a mode no symmetric one fits), and
also in the mode of the best baseline or heuristic when that one is faster. The chosen mode is in
``meta.options`` (``run_config.options_record``) with the Megatron flags it maps to.
"""

from __future__ import annotations

import gc
import math
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import replace
from typing import Any, NamedTuple

from megatron_hexiseq import costmodel
from megatron_hexiseq.cluster import Cluster
from megatron_hexiseq.costmodel import Estimate
from megatron_hexiseq.errors import HexiSeqError
from megatron_hexiseq.layout import Group, Layout, RankPlan
from megatron_hexiseq.model import ModelSpec
from megatron_hexiseq.planner.baselines import baseline_layouts, best_baseline, evaluate_baselines
from megatron_hexiseq.planner.build import with_fields
from megatron_hexiseq.planner.candidate import Candidate, Deadline, fastest_feasible
from megatron_hexiseq.planner.canonical import canonical_cluster, to_original
from megatron_hexiseq.planner.exact import MAX_EXACT_GPUS, exact_candidates
from megatron_hexiseq.planner.feasibility import explain_infeasible, may_fit
from megatron_hexiseq.planner.heuristics import heuristic_layouts
from megatron_hexiseq.planner.hierarchical import MEMORY_FEEDBACK_ROUNDS, planner_candidates
from megatron_hexiseq.planner.stage1_groups import Scored
from megatron_hexiseq.run_config import TrainOptions, mode_label, options_record

METHODS = ("hierarchical", "node", "exact")
DEFAULT_TIME_LIMIT_S = 120.0
GAP_MEANING = (
    "bound: a lower bound, in the planner's surrogate model, of every split of tokens and heads among "
    "the planner's chosen groups in their chosen arrangement (every group keeps at least one token unit "
    "per rank); gap = (surrogate time of the planner's layout - bound) / surrogate time. It says how much "
    "rounding to whole tokens and heads cost; it bounds neither other groupings nor the cost model's time"
)
RELAXED_MEANING = (
    "; with the chosen arrangement's {blocks} prefix blocks the bound is a relaxation's (each block's "
    "most units taken at the earliest start any split gives it), so the gap can read larger than the "
    "rounding alone"
)
NO_BOUND_MEANING = (
    "bound: none: the planner's chosen arrangement has {blocks} prefix blocks, which Stage II splits "
    "greedily, so its figure ({figure:.6g} s, in stages.unproven_bound_s) is not a proven lower bound "
    "(docs/planner.md, 'Known gap: two or more prefix blocks')"
)
Progress = Callable[[str], None]
GC_GEN0 = 20_000  # the collector's first-generation threshold while plan() runs (Python's: 700)


def _check_args(cluster: Cluster, seq_length: int, time_limit_s: float, method: str) -> None:
    if method not in METHODS:
        raise HexiSeqError(f"unknown planner method {method!r}; use one of {', '.join(METHODS)}")
    if (
        not isinstance(time_limit_s, (int, float))
        or isinstance(time_limit_s, bool)
        or not math.isfinite(time_limit_s)
        or time_limit_s <= 0
    ):
        raise HexiSeqError(
            f"the time limit must be a positive number of seconds, got {time_limit_s!r}"
        )
    if method == "exact" and cluster.world_size > MAX_EXACT_GPUS:
        raise HexiSeqError(
            f"method exact handles at most {MAX_EXACT_GPUS} GPUs, the cluster has "
            f"{cluster.world_size}; use the default hierarchical planner"
        )
    if seq_length < cluster.world_size:
        raise HexiSeqError(
            f"seq_length {seq_length} is shorter than the {cluster.world_size} GPUs; every rank needs "
            "at least one token (Megatron cannot run an empty shard): use a longer --seq-length "
            "or fewer GPUs"
        )


class Finalist(NamedTuple):
    """A family's best layout in the final choice (the fastest wins; ties by ``tie``)."""

    time_s: float  # its iteration time by ``estimate``
    tie: int  # 0 the planner's own, 1 a heuristic, 2 a baseline
    family: str  # the method, "heuristic" or "baseline"
    label: str  # "hexiseq" or the heuristic's / baseline's label
    layout: Layout
    options: TrainOptions


def plan(
    cluster: Cluster,
    model: ModelSpec,
    seq_length: int,
    options: TrainOptions,
    *,
    modes: Sequence[tuple[str, bool]] | None = None,
    time_limit_s: float = DEFAULT_TIME_LIMIT_S,
    method: str = "hierarchical",
    reproducible: bool = False,
    progress: Progress | None = None,
) -> Layout:
    """The full planner. ``modes``: (memory_mode, recompute) pairs tried in order until one is
    feasible (default: ``options``' own mode only); ``commands.inputs.load_problem`` builds it from the flags.

    ``method``: "hierarchical" (Stages I-III), "node" (one group per node: the first planner) or
    "exact" (one CP-SAT model over all decisions; clusters of at most 16 GPUs).
    ``time_limit_s``: wall-clock cap on the search (``Deadline``): the baselines and the first round
    of the stages always run; once the cap has passed no further round, grouping or memory mode is
    started and the best layout found so far is returned (``planner.time_limit_reached``). CP-SAT
    solves have fixed deterministic limits, so a plan that ends within the cap does not depend on
    the machine's speed or load.
    ``reproducible``: write 0 for wall-clock fields so the same inputs give a byte-identical file.
    ``progress``: called with short stage messages ("memory mode fsdp", "baselines: 9 scored", ...)
    so a caller can show progress on long plans.
    """
    _check_args(cluster, seq_length, time_limit_s, method)
    with _fewer_collections():
        return _plan(
            cluster, model, seq_length, options, modes, time_limit_s, method, reproducible, progress
        )


@contextmanager
def _fewer_collections() -> Iterator[None]:
    """Fewer, cheaper garbage collections while ``plan`` runs, restored when it returns.

    The search allocates many small objects that live on in its caches, so Python ran ~130
    collections per 128-GPU plan, the full ones walking every object that existed before the plan
    (imported modules, the caller's data: ~60K in a bare process, far more inside a training job):
    ~15% of its CPU time (0.08 of 0.47 s). ``gc.freeze`` keeps those old objects out of the scans
    and a larger first-generation threshold (``GC_GEN0``) makes collections rarer; new cyclic
    garbage is still collected. Nothing changes when the caller froze objects itself or disabled
    the collector."""
    if gc.get_freeze_count() or not gc.isenabled():
        yield
        return
    threshold = gc.get_threshold()
    gc.freeze()
    gc.set_threshold(max(GC_GEN0, threshold[0]), *threshold[1:])
    try:
        yield
    finally:
        gc.set_threshold(*threshold)
        gc.unfreeze()


def _plan(
    cluster: Cluster,
    model: ModelSpec,
    seq_length: int,
    options: TrainOptions,
    modes: Sequence[tuple[str, bool]] | None,
    time_limit_s: float,
    method: str,
    reproducible: bool,
    progress: Progress | None,
) -> Layout:
    say = progress or (lambda message: None)
    t0 = time.perf_counter()
    deadline = Deadline(time_limit_s)
    file_cluster = cluster
    cluster, order = canonical_cluster(cluster)  # every candidate is built on the canonical cluster
    modes = list(modes) if modes else [(options.memory_mode, options.recompute)]
    tried = [replace(options, memory_mode=m, recompute=r) for m, r in modes]
    usable = [
        o for o in tried if may_fit(cluster, model, seq_length, o)
    ]  # others cannot fit any layout

    # feedback rounds often rebuild a layout already scored: by (options, groups, ranks)
    scored: dict[tuple[TrainOptions, tuple[Group, ...], tuple[RankPlan, ...]], Estimate] = {}

    def scorer(o: TrainOptions) -> Callable[[Layout], Estimate]:
        def score(layout: Layout) -> Estimate:
            key = (o, layout.groups, layout.ranks)
            if key not in scored:
                scored[key] = costmodel.estimate(layout, cluster, model, o)
            return scored[key]

        return score

    def mode_of(o: TrainOptions) -> dict[str, Any]:
        return {"memory_mode": o.memory_mode, "recompute": o.recompute}

    def options_of(record: dict[str, Any]) -> TrainOptions:
        return next(
            o
            for o in usable
            if mode_of(o) == {k: record["config"][k] for k in ("memory_mode", "recompute")}
        )

    # baselines and heuristics, each in its first feasible memory mode
    t_base = time.perf_counter()
    scores = [(mode_of(o), scorer(o)) for o in usable]
    fits = [
        lambda layout, o=o: costmodel.memory_floor_fits(layout, cluster, model, o) for o in usable
    ]
    baselines = baseline_layouts(cluster, model, seq_length)
    records = evaluate_baselines(baselines, scores, fits)
    heuristics = heuristic_layouts(cluster, model, seq_length)
    heur_records = evaluate_baselines(heuristics, scores, fits)
    baselines_s = time.perf_counter() - t_base
    best_b, best_h = best_baseline(records), best_baseline(heur_records)
    say(
        f"baselines: {len(records)} scored, best {best_b['name'] if best_b else 'none fits'}; "
        f"heuristics: {len(heur_records)} scored"
    )
    fixed = [(r, fam) for r, fam in ((best_h, "heuristic"), (best_b, "baseline")) if r is not None]
    best_fixed = min(fixed, key=lambda x: x[0]["iteration_time_s"], default=(None, None))[0]

    # the planner: the first mode with a feasible candidate; also the mode of the best baseline or
    # heuristic if that beats it
    t_stages = time.perf_counter()
    ran: dict[tuple[str, bool], list[Candidate]] = {}
    stage_one_found: list[Scored] = []  # Stage I's pairs of the first mode planned

    def run_mode(o: TrainOptions, seeded: bool = False) -> Candidate | None:
        """The fastest feasible candidate of the planner in mode ``o`` (run once per mode);
        ``seeded``: from ``stage_one_found``, without memory feedback (the modes before ``first``)."""
        key = (o.memory_mode, o.recompute)
        if key not in ran:
            say(f"memory mode {mode_label(o)}")
            if method == "exact":
                ran[key] = exact_candidates(
                    cluster, model, seq_length, o, scorer(o), deadline=deadline
                )
            else:
                ran[key] = planner_candidates(
                    cluster,
                    model,
                    seq_length,
                    o,
                    scorer(o),
                    deadline=deadline,
                    method=method,
                    progress=say,
                    seed_groupings=stage_one_found if seeded else None,
                    memory_feedback_rounds=0 if seeded else MEMORY_FEEDBACK_ROUNDS,
                    stage_one_found=None if seeded else stage_one_found,
                )
        return fastest_feasible(ran[key])

    best_c, best_o = None, None
    # start in the first mode where some baseline or heuristic fits: when none fits an earlier mode,
    # memory is tight there and the planner would spend its rounds on memory feedback
    fitted = {
        (r["config"]["memory_mode"], r["config"]["recompute"])
        for r in records + heur_records
        if r["iteration_time_s"] is not None
    }
    first = next((i for i, o in enumerate(usable) if (o.memory_mode, o.recompute) in fitted), 0)
    for o in usable[first:]:
        best_c = run_mode(o)
        if best_c is not None:
            best_o = o
            break
    # the modes before `first` (cheaper ones: no recompute, or no per-layer gathers) that no
    # baseline or heuristic fits: an uneven layout can still fit them, putting the tokens where the
    # memory is. Each is planned from the groupings Stage I found above and given up when its first
    # round does not fit (no memory feedback: the rounds that starting at `first` saves)
    if stage_one_found:
        for o in usable[:first]:
            if deadline.passed():
                break
            c = run_mode(o, seeded=True)
            if c is not None and (
                best_c is None or c.estimate.iteration_time_s < best_c.estimate.iteration_time_s
            ):
                best_c, best_o = c, o
    if (
        best_fixed is not None
        and (best_c is None or best_fixed["iteration_time_s"] < best_c.estimate.iteration_time_s)
        and not deadline.passed()
    ):
        o_b = options_of(best_fixed)
        c_b = run_mode(o_b)
        if c_b is not None and (
            best_c is None or c_b.estimate.iteration_time_s < best_c.estimate.iteration_time_s
        ):
            best_c, best_o = c_b, o_b
    stages_s = time.perf_counter() - t_stages
    if best_c is None and best_fixed is None:
        raise HexiSeqError(explain_infeasible(cluster, model, seq_length, tried))

    # the final choice: the fastest of every candidate (ties: the planner's own, then a heuristic)
    finalists: list[Finalist] = []
    if best_c is not None:
        assert best_o is not None  # set together with best_c above
        finalists.append(
            Finalist(best_c.estimate.iteration_time_s, 0, method, "hexiseq", best_c.layout, best_o)
        )
    for rank, (rec, fam, named) in enumerate(
        ((best_h, "heuristic", heuristics), (best_b, "baseline", baselines)), 1
    ):
        if rec is not None:
            b = next(
                b
                for b, r in zip(named, heur_records if fam == "heuristic" else records)
                if r is rec
            )
            assert b.layout is not None  # a record with an iteration time was scored on b.layout
            finalists.append(
                Finalist(rec["iteration_time_s"], rank, fam, b.label, b.layout, options_of(rec))
            )
    _, _, family, chosen, layout, opts = min(finalists, key=lambda x: (x.time_s, x.tie))
    info = dict(best_c.info) if best_c else {"status": "NO_PLANNER_SOLUTION"}
    if chosen != "hexiseq":
        info["note"] = (
            f"{family} {chosen} is faster than the planner's best candidate by the cost model"
        )
    layout = to_original(layout, order)
    est = costmodel.estimate(
        layout, file_cluster, model, opts
    )  # the emitted layout, on the file's cluster
    say(f"chosen: {chosen}")
    solve_s = 0.0 if reproducible else round(time.perf_counter() - t0, 4)
    planner = {
        "method": method,
        "solve_time_s": solve_s,
        "status": info.pop("status"),
        "winner": {
            "family": family,
            "name": chosen,
            "iteration_time_s": _sig(est.iteration_time_s),
        },
        "planner_best_s": None if best_c is None else _sig(best_c.estimate.iteration_time_s),
        "bound": info.pop("surrogate_bound_s", None),
        "gap": info.pop("surrogate_gap", None),
        "gap_meaning": gap_meaning(info) if best_c is not None else None,
        "stages_time_s": 0.0 if reproducible else round(stages_s, 4),
        "baselines_time_s": 0.0 if reproducible else round(baselines_s, 4),
        "candidates_evaluated": sum(len(v) for v in ran.values()),
        "time_limit_s": time_limit_s,
        "time_limit_reached": deadline.reached,
        "heuristics": heur_records,
        "stages": info,
    }
    meta = {
        "cluster": file_cluster.name,
        "model": model.name,
        "chosen": chosen,
        "options": options_record(opts, tried),
    }
    return with_fields(
        layout, predicted=est.to_predicted(), baselines=tuple(records), planner=planner, meta=meta
    )


def gap_meaning(info: dict[str, Any]) -> str:
    """What ``planner.bound`` and ``planner.gap`` mean for the planner's best candidate: the proven
    bound's sentence (with the relaxation's when the arrangement has two or more prefix blocks), or
    why there is none (``hierarchical.solve_grouping``, ``hierarchical.prove_bound``)."""
    if "unproven_bound_s" in info:
        return NO_BOUND_MEANING.format(
            blocks=info["prefix_blocks"], figure=info["unproven_bound_s"]
        )
    if info.get("bound_relaxed"):
        return GAP_MEANING + RELAXED_MEANING.format(blocks=info["prefix_blocks"])
    return GAP_MEANING


def _sig(x: float) -> float:
    """Round to 9 significant digits for JSON (as the ``predicted`` block)."""
    return float(f"{x:.9g}")
