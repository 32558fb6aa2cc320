"""Every global-batch scheme on the same steps: what ``megatron-hexiseq varlen --global-batch-tokens``
reports.

``compare_global`` packs ``steps`` global batches of ``samples = G // S`` loader samples of ``S``
tokens (``packing.pack_batches``, shuffled with ``seed``; a document cut at a sample boundary is
two units) and runs each scheme of ``global_schemes`` on each step, on the whole cluster. Every
stock configuration a user could pick is tried and the best (lowest mean step) reported, within
``tokens_per_gpu`` (``TOKENS_PER_GPU``: 4K-32K tokens per GPU per micro-batch, the long-context
regime; widened by ``domain_choice.regime`` where no CP size of a sample lies in it, as for the
CPU testbed's 2K samples): ``megatron-cp-dp`` at every CP size Megatron accepts (``cp_sizes``),
``megatron-hybrid-cp`` at ``max_seqlen_per_rank`` in ``HYBRID_TOKENS``, ``speed-aware-packing`` at
every CP size (the stock grid's micro-batch count and fewer, each holding more tokens:
``fewer_counts``), ``fast-only`` the best of the three on the fastest GPU type alone. ``megatron-thd-cp`` (one ring over every GPU) is an appendix row.

``hexiseq-global`` runs on the job's domains (``--job``) or, without one, on the best of the
candidate domain sets (``domain_choice``: ``hexiseq_candidates``): equal mixed data-parallel replicas and domains of
one GPU type, of every size ``n`` with ``S / n`` tokens per GPU in ``tokens_per_gpu``, and domains
of one GPU type each at its own size (``fit_blocks``: the fewest GPUs of the type that hold a
sample, and twice that); each planned in the memory mode ``plan`` picks and, as a second
candidate, in a recompute mode (more tokens fit a micro-batch: long documents can go to more
domains), and each in the other modes where every domain still holds a token per GPU
(``other_modes``: a packed micro-batch need not hold a whole sample, and a heavier mode lets fewer
micro-batches hold the step); each kind of domain gets ``plan``'s layout for ``S`` tokens on its GPUs and
the structure ``plan --doc-lengths`` would choose (``structure.choose_structure``), and micro-batch
counts by speed (``domains.speed_shares``). The candidate is chosen on ``choice_steps`` global
batches (at least ``CHOICE_STEPS`` and ``CHOICE_SAMPLES`` samples) packed with ``CHOICE_SEED``
(not the compared steps').
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import numpy as np

from megatron_hexiseq.cluster import Cluster
from megatron_hexiseq.errors import HexiSeqError
from megatron_hexiseq.job.spec import JobPlan
from megatron_hexiseq.model import ModelSpec
from megatron_hexiseq.run_config import TrainOptions, modes_to_try
from megatron_hexiseq.varlen.compare import FORMAT, VERSION, rank_records
from megatron_hexiseq.varlen.domain_choice import (
    AUTO,
    RECOMPUTE,
    TOKENS_PER_GPU,
    Modes,
    base_options,
    domain_candidates,
    domains_from_job,
    other_modes,
    plan_domains,
    regime,
)
from megatron_hexiseq.varlen.domains import Domain, fastest_type_ranks
from megatron_hexiseq.varlen.global_planner import GlobalPlanner
from megatron_hexiseq.varlen.global_schemes import (
    Pricer,
    SchemeStep,
    cp_dp_step,
    cp_sizes,
    hexiseq_step,
    hybrid_cp_step,
    speed_aware_step,
    thd_step,
)
from megatron_hexiseq.varlen.packing import pack_batches

SCHEMES = (
    "hexiseq-global",
    "megatron-cp-dp",
    "megatron-hybrid-cp",
    "speed-aware-packing",
    "fast-only",
)
BASELINES = SCHEMES[1:]
APPENDIX = ("megatron-thd-cp",)
HYBRID_TOKENS = (4096, 8192, 16384, 32768)
CHOICE_SEED = 1_000_003
CHOICE_STEPS = 2  # global batches the domain set is chosen on, at least
CHOICE_SAMPLES = 64  # samples the domain set is chosen on, at least (``choice_steps``)
EQUAL = "+equal"  # a candidate priced with equal micro-batch counts (``_count_variants``)


def global_batches(
    doc_lengths: Sequence[int], seq_length: int, samples: int, steps: int, seed: int
) -> list[list[list[int]]]:
    """``steps`` global batches of ``samples`` loader samples of ``seq_length`` tokens each."""
    packed = pack_batches(doc_lengths, seq_length, samples * steps, seed)
    return [packed[i * samples : (i + 1) * samples] for i in range(steps)]


def units_of(samples: Sequence[Sequence[int]]) -> list[int]:
    """The units of a global batch: every sample's documents, loader order."""
    return [int(x) for s in samples for x in s]


def modes_for(model: ModelSpec, tensor_model_parallel_size: int = 1) -> list[TrainOptions]:
    """The memory modes the baselines try, in order of overhead (with t on a bundle problem)."""
    base = base_options(model, tensor_model_parallel_size)
    return [replace(base, memory_mode=m, recompute=r) for m, r in modes_to_try("auto", False)]


# ---- the comparison ---------------------------------------------------------------------------
def compare_global(
    cluster: Cluster,
    model: ModelSpec,
    doc_lengths: Sequence[int],
    seq_length: int,
    global_batch_tokens: int,
    steps: int,
    seed: int,
    *,
    job: JobPlan | None = None,
    keep_assignments: bool = True,
    progress: Callable[[str], None] | None = None,
    time_limit_s: float = 60.0,
    schemes: Sequence[str] = SCHEMES + APPENDIX,
    tokens_per_gpu: tuple[int, int] = TOKENS_PER_GPU,
    tensor_model_parallel_size: int = 1,
) -> dict[str, Any]:
    """The ``out.json`` document of ``varlen --global-batch-tokens`` (module docstring).

    ``tensor_model_parallel_size`` t > 1: every scheme on TP bundles of t GPUs, compared on the
    **bundle problem** as ``plan --tensor-model-parallel-size t`` plans (``costmodel.tp``: one
    device per bundle, one TP rank's model, options with t), so a "GPU" below is a bundle and
    ``tokens_per_gpu`` is scaled by t; step times and tokens/s are the real cluster's (every GPU of
    a bundle works in step). The filler that makes a micro-batch's tokens a multiple of t at run
    time (fewer than t tokens, docs/megatron.md) is not priced."""
    say = progress or (lambda message: None)
    t, model_name = tensor_model_parallel_size, model.name
    if t > 1:
        if job is not None:
            raise HexiSeqError(
                "--tensor-model-parallel-size with --job: the job records its own TP size; drop "
                "--tensor-model-parallel-size"
            )
        from megatron_hexiseq.costmodel.tp import bundle_cluster, rank_model

        cluster, model = bundle_cluster(cluster, t), rank_model(model, t)
        tokens_per_gpu = (tokens_per_gpu[0] * t, tokens_per_gpu[1] * t)
    samples = global_batch_tokens // seq_length
    if samples < 1:
        raise HexiSeqError(
            f"--global-batch-tokens {global_batch_tokens:,} is less than one sample of "
            f"{seq_length:,} tokens"
        )
    # a sample outside the regime's 4K-32K per GPU at every CP size would leave nothing to try
    tokens_per_gpu = regime(tokens_per_gpu, seq_length, cluster.world_size)
    m = replace(model, seq_length=seq_length)
    batches = global_batches(doc_lengths, seq_length, samples, steps, seed)
    pricer = Pricer(cluster, m)
    modes = modes_for(m, t)
    results: dict[str, list[SchemeStep]] = {}
    tried: dict[str, list[dict[str, Any]]] = {}
    domains_rec: dict[str, Any] = {}

    def best_of(
        name: str, configs: list[tuple[dict[str, Any], Callable[[list[list[int]]], SchemeStep]]]
    ) -> None:
        rows, best = [], None
        for cfg, run in configs:
            try:
                got = [run(b) for b in batches]
            except HexiSeqError as e:
                rows.append({**cfg, "reason": str(e)})
                continue
            mean = float(np.mean([g.step_s for g in got]))
            feasible = all(g.feasible for g in got)
            rows.append({**cfg, "mean_step_s": _sig(mean), "feasible": feasible})
            if best is None or (not feasible, mean) < (not best[0], best[1]):
                best = (feasible, mean, got)
        tried[name] = rows
        if best is not None:
            results[name] = best[2]

    def stock(ranks: Sequence[int] | None) -> list[tuple[dict[str, Any], Callable]]:
        n = len(ranks) if ranks is not None else cluster.world_size
        lo, hi = tokens_per_gpu
        max_cp = max(1, seq_length // lo)

        def in_range(c: int) -> bool:
            return lo <= seq_length // c <= hi

        out: list[tuple[dict[str, Any], Callable]] = []
        for c in [c for c in cp_sizes(n, seq_length, samples, max_cp) if in_range(c)]:
            out.append(({"scheme": "megatron-cp-dp", "cp": c},
                        lambda b, c=c: cp_dp_step(pricer, b, c, modes, ranks)))  # fmt: skip
        # Megatron's max_seqlen_per_rank: the regime's powers of two (a widened regime's own)
        hybrid = [t for t in HYBRID_TOKENS if t <= seq_length and lo <= t <= hi] or [
            t for t in (1 << k for k in range(hi.bit_length())) if lo <= t <= hi
        ]
        for t in hybrid:
            out.append(({"scheme": "megatron-hybrid-cp", "max_seqlen_per_rank": t},
                        lambda b, t=t: hybrid_cp_step(pricer, units_of(b), t, modes, ranks)))  # fmt: skip
        c = 1
        while c <= min(n, max_cp):
            if n % c == 0 and in_range(c):
                m = -(-samples // (n // c))  # the stock grid's count, then fewer (``fewer_counts``)
                for k in fewer_counts(m):
                    out.append(({"scheme": "speed-aware-packing", "cp": c, "micro_batches": k},
                                lambda b, c=c, k=k: speed_aware_step(pricer, units_of(b), samples, c, modes, ranks, k)))  # fmt: skip
            c *= 2
        return out

    all_stock = stock(None)
    for name in ("megatron-cp-dp", "megatron-hybrid-cp", "speed-aware-packing"):
        if name in schemes:
            say(f"{name}")
            best_of(name, [x for x in all_stock if x[0]["scheme"] == name])
    if "fast-only" in schemes:
        fast = fastest_type_ranks(cluster)
        if len(fast) < cluster.world_size:
            say("fast-only")
            best_of("fast-only", stock(fast))
            domains_rec["fast-only"] = {"ranks": fast}
    if "megatron-thd-cp" in schemes:
        say("megatron-thd-cp (appendix)")
        best_of(
            "megatron-thd-cp",
            [({"scheme": "megatron-thd-cp"}, lambda b: thd_step(pricer, b, modes))],
        )
    if "hexiseq-global" in schemes:
        say("hexiseq-global: choosing the domains")
        chosen, cands = _job_or_choice(
            cluster, m, doc_lengths, seq_length, samples, job, pricer, time_limit_s, say,
            tokens_per_gpu, t,
        )  # fmt: skip
        if chosen is None:  # no candidate domain set holds the global batch
            domains_rec["hexiseq-global"] = {"chosen": None, "candidates": cands}
        else:
            domains_rec["hexiseq-global"] = {
                "chosen": chosen[0],
                "candidates": cands,
                "domains": [
                    {
                        "ranks": list(d.ranks),
                        "micro_batches": d.micro_batches,
                        "groups": [list(g.ranks) for g in d.structure.groups],
                        "memory_mode": d.options.memory_mode,
                        "recompute": d.options.recompute,
                    }
                    for d in chosen[1].domains
                ],  # fmt: skip
            }
            say("hexiseq-global")
            results["hexiseq-global"] = [
                hexiseq_step(chosen[1], pricer, units_of(b), {"domains": chosen[0]})
                for b in batches
            ]
    out_steps = []
    if keep_assignments:
        for i, b in enumerate(batches):
            out_steps.append(
                {
                    "samples": [list(s) for s in b],
                    "schemes": {k: step_record(v[i]) for k, v in results.items()},
                }
            )
    return {
        "format": FORMAT,
        "version": VERSION,
        "mode": "global",
        "cluster": cluster.name,
        "world_size": cluster.world_size * t,
        "tensor_model_parallel_size": t,
        "model": model_name,
        "seq_length": seq_length,
        "samples_per_step": samples,
        "global_batch_tokens": samples * seq_length,
        "steps_count": steps,
        "seed": seed,
        "schemes": {k: summarize_global(k, v, samples * seq_length) for k, v in results.items()},
        "tried": tried,
        "domains": domains_rec,
        "steps": out_steps,
    }


def _job_or_choice(
    cluster, model, doc_lengths, S, samples, job, pricer, time_limit_s, say, tokens_per_gpu, tp=1
):
    """The job's domains, or the fastest candidate domain set (``choose_domains``)."""
    if job is not None:
        if job.seq_length != S:
            raise HexiSeqError(
                f"the job is planned for {job.seq_length:,}-token sequences but the samples have "
                f"{S:,}; use --tokens-per-batch {job.seq_length}"
            )
        doms = domains_from_job(job)
        return ("job", GlobalPlanner(doms, model)), [{"name": "job", "domains": len(doms)}]
    cache: dict = {}
    # Megatron's CP groups and one domain per type are candidates too (``grids``): HexiSeq's
    # layouts and scheduler on the groups speed-aware packing uses (on TP bundles the other
    # candidate sets thin out: docs/varlen.md, "Every scheme at its best TP size")
    candidates = domain_candidates(
        cluster, model, S, samples, tokens_per_gpu, time_limit_s, cache, grids=True,
        tensor_model_parallel_size=tp,
    )  # fmt: skip
    return choose_domains(
        cluster, model, doc_lengths, S, samples, pricer, candidates, time_limit_s=time_limit_s,
        say=say, cache=cache, tensor_model_parallel_size=tp,
    )  # fmt: skip


def choose_domains(
    cluster: Cluster,
    model: ModelSpec,
    doc_lengths: Sequence[int],
    seq_length: int,
    samples: int,
    pricer: Pricer,
    candidates: Sequence[tuple[str, Sequence[Sequence[int]]]],
    *,
    variants: Sequence[tuple[str, Modes]] = (("", AUTO), ("+recompute", RECOMPUTE)),
    one_structure: bool = False,
    tensor_model_parallel_size: int = 1,
    time_limit_s: float = 60.0,
    say: Callable[[str], None] | None = None,
    cache: dict | None = None,
    price: Callable[[GlobalPlanner, list[int]], tuple[float, bool]] | None = None,
    fewer: bool = True,
    steps: int | None = None,
) -> tuple[tuple[str, GlobalPlanner] | None, list[dict[str, Any]]]:
    """HexiSeq's domain set: every candidate (name, blocks of cluster ranks) in every memory-mode
    variant (label suffix, modes ``plan`` tries) planned (``plan_domains``), also in each
    other mode of the variant where every domain holds a token per GPU (``other_modes``: a
    packed micro-batch need not hold a sample in a lighter mode, and a heavier one holds more
    tokens per micro-batch, priced with fewer micro-batches only), with its micro-batch counts
    and, with ``fewer``, fewer (``_count_variants``), and priced on
    ``steps`` global batches (default ``choice_steps``) packed with ``CHOICE_SEED`` (not the
    compared steps') by the
    comparison's model: ``price(planner, units) -> (step seconds, every micro-batch fits)``
    (default: ``hexiseq_step``, whole-cluster step); the feasible one with the lowest mean step,
    else the fastest. Returns (label, its planner) or None when no candidate plans, and one row
    per try (its mean step and feasibility, or why it failed)."""
    say = say or (lambda message: None)
    if price is None:

        def price(gp: GlobalPlanner, units: list[int]) -> tuple[float, bool]:
            got = hexiseq_step(gp, pricer, units, {})
            return got.step_s, got.feasible

    cache = {} if cache is None else cache
    probes = [
        units_of(b)
        for b in global_batches(
            doc_lengths, seq_length, samples, steps or choice_steps(samples), CHOICE_SEED
        )
    ]
    best = None
    rows: list[dict[str, Any]] = []
    priced: set[tuple] = set()
    for (name, blocks), (suffix, modes) in [(c, v) for c in candidates for v in variants]:
        label = name + suffix
        say(f"hexiseq-global: {label}")
        try:
            doms = plan_domains(
                cluster, model, blocks, seq_length, samples, doc_lengths,
                time_limit_s=time_limit_s, cache=cache, modes=modes, one_structure=one_structure,
                tensor_model_parallel_size=tensor_model_parallel_size,
            )  # fmt: skip
        except HexiSeqError as e:
            rows.append({"name": label, "reason": str(e)})
            continue
        others = other_modes(doms, model, samples, doc_lengths, seq_length, modes)
        # a heavier mode is only worth its fewer micro-batches (``own_counts=False``)
        tries = [(label, doms, True)] + [(label + o.suffix, o.domains, o.lighter) for o in others]
        counted_tries = [
            v
            for lab, d, own in tries
            for v in _count_variants(
                lab, d, samples, model if fewer else None, seq_length, own_counts=own
            )
        ]
        for name_as, counted in counted_tries:
            key = _priced_as(counted)
            if key in priced:  # the same domains, modes and counts from another variant
                continue
            priced.add(key)
            try:
                gp = GlobalPlanner(counted, model)
                got = [price(gp, probe) for probe in probes]
            except HexiSeqError as e:
                rows.append({"name": name_as, "reason": str(e)})
                continue
            step = float(np.mean([g[0] for g in got]))
            feasible = all(g[1] for g in got)
            rows.append(
                {"name": name_as, "step_s": _sig(step), "feasible": feasible,
                 "domains": len(counted)}
            )  # fmt: skip
            if best is None or (not feasible, step) < (not best[0], best[1]):
                best = (feasible, step, name_as, gp)
    if best is None:
        return None, rows
    return (best[2], best[3]), rows


def choice_steps(samples: int) -> int:
    """Global batches the domain set is chosen on: ``CHOICE_STEPS``, or more where a step holds
    few samples, so the choice sees ``CHOICE_SAMPLES`` at least: with 8 samples of 128K tokens
    per step and heavy-tailed lengths one long document decides a step, and a candidate chosen
    on 2 such steps ran 0.92x of the best baseline on the compared steps (docs/varlen.md,
    "Results", case 3)."""
    return max(CHOICE_STEPS, -(-CHOICE_SAMPLES // max(1, samples)))


def _priced_as(domains: Sequence[Domain]) -> tuple:
    """What a candidate's price depends on besides the steps: each domain's ranks, structure,
    options and micro-batch count (two variants can reach the same, e.g. a candidate planned in
    recompute and its plain variant's recompute mode)."""
    return tuple(
        (d.ranks, d.micro_batches, d.options, d.efficiency_1024,
         tuple(g.ranks for g in d.structure.groups), tuple((r.group, r.heads, r.segments) for r in d.structure.ranks))
        for d in domains
    )  # fmt: skip


def fewer_counts(m: int) -> list[int]:
    """``m`` micro-batches per step, then half as many (rounded up), again, down to one: what
    speed-aware packing tries on the stock grid (a count whose micro-batches cannot hold the step
    is refused when it is scheduled)."""
    out = [m]
    while out[-1] > 1:
        out.append(_half(out[-1]))
    return out


def _half(m: int) -> int:
    """Half as many micro-batches, rounded up."""
    return -(-m // 2)


def _count_variants(
    label: str,
    domains: list[Domain],
    samples: int,
    model: ModelSpec | None = None,
    seq_length: int = 0,
    *,
    own_counts: bool = True,
) -> list[tuple[str, list[Domain]]]:
    """A candidate's micro-batch counts to price: ``plan_domains``' (by speed), and, when they
    differ, the same ``ceil(samples / domains)`` for every domain (the stock grid's, what a
    Megatron run over a layout's replicas runs; each micro-batch pays its fixed costs and floor,
    so fewer on the fast domains can win), labelled ``+equal``. With ``model``: each of those
    with every count halved (rounded up), again and again, labelled ``+mb/2``, ``+mb/4``, ...,
    while the step's ``samples x seq_length`` tokens fit the micro-batches (each at most its
    domain's ``fill`` tokens): micro-batches may hold more than a sample, and each pays its fixed
    costs and floor (Megatron-FSDP's per-layer gathers: on 256 H100s at 32K, 2 micro-batches of
    ~33K tokens per 4-GPU group ran 1.99 s, 4 of ~33K per 8-GPU domain 2.27 s). Without
    ``own_counts`` only the fewer ones (a heavier memory mode: ``other_modes``)."""
    equal = -(-samples // len(domains))
    out = [(label, domains)]
    if any(d.micro_batches != equal for d in domains):
        out.append((label + EQUAL, [replace(d, micro_batches=equal) for d in domains]))
    if model is None:
        return out if own_counts else []
    try:
        fills = [c.fill_tokens for c in GlobalPlanner(domains, model).costs]
    except HexiSeqError:  # priced (and refused) with its own counts below
        return out if own_counts else []
    fewer: list[tuple[str, list[Domain]]] = []
    for name, doms in out:
        counts, k = [d.micro_batches for d in doms], 1
        while max(counts) > 1:
            counts, k = [_half(m) for m in counts], 2 * k
            if sum(m * f for m, f in zip(counts, fills)) < samples * seq_length:
                break
            fewer.append(
                (f"{name}+mb/{k}", [replace(d, micro_batches=m) for d, m in zip(doms, counts)])
            )
    return out + fewer if own_counts else fewer


def summarize_global(name: str, steps: Sequence[SchemeStep], tokens: int) -> dict[str, Any]:
    """Per scheme: mean / p90 step, whole-cluster tokens/s, slowest over mean domain (averaged over
    steps), feasibility, the configuration, and the planner's CPU time."""
    st = np.array([s.step_s for s in steps])
    imb = [max(s.domain_s) / float(np.mean(s.domain_s)) for s in steps if len(s.domain_s) > 1]
    rec: dict[str, Any] = {
        "mean_step_s": _sig(float(st.mean())),
        "p90_step_s": _sig(float(np.percentile(st, 90))),
        "tokens_per_s": _sig(tokens / float(st.mean())),
        "domain_imbalance": _sig(float(np.mean(imb))) if imb else 1.0,
        "feasible": all(s.feasible for s in steps),
        "config": steps[0].config,
        "domains": len(steps[0].domain_s),
    }
    if name == "hexiseq-global":
        sched = np.array([s.schedule_s for s in steps]) * 1e3
        plan = np.array([x for s in steps for x in s.plan_s]) * 1e3
        rec.update(
            schedule_ms_max=_sig(float(sched.max())),
            plan_ms_p50=_sig(float(np.median(plan))),
            plan_ms_max=_sig(float(plan.max())),
        )
    return rec


def step_record(step: SchemeStep) -> dict[str, Any]:
    """One scheme's step in ``out.json``: every micro-batch with its per-rank records
    (``compare.rank_records``: cluster rank, domain, group, segments, heads)."""
    out = [
        {
            "domain": r.domain,
            "index": r.micro_batch,
            "step_s": _sig(r.estimate.iteration_time_s),
            "doc_lengths": np.diff(r.cu_seqlens).tolist(),
            "ranks": rank_records(r.layout, r.ranks, r.domain),
        }
        for r in step.runs
    ]
    return {
        "step_s": _sig(step.step_s),
        "domain_s": [_sig(x) for x in step.domain_s],
        "micro_batches": out,
    }


def _sig(x: float) -> float:
    return float(f"{x:.6g}")
