"""Every global-batch scheme on the same steps: what ``megatron-hexiseq varlen --global-batch-tokens``
reports.

``compare_global`` packs ``steps`` global batches of ``samples = G // S`` loader samples of ``S``
tokens (``packing.pack_batches``, shuffled with ``seed``; a document cut at a sample boundary is
two units) and runs each scheme of ``global_schemes`` on each step, on the whole cluster. Every
stock configuration a user could pick is tried and the best (lowest mean step) reported, within
``tokens_per_gpu`` (``TOKENS_PER_GPU``: 4K-32K tokens per GPU per micro-batch, the long-context
regime): ``megatron-cp-dp`` at every CP size Megatron accepts (``cp_sizes``),
``megatron-hybrid-cp`` at ``max_seqlen_per_rank`` in ``HYBRID_TOKENS``, ``speed-aware-packing`` at
every CP size, ``fast-only`` the best of the three on the fastest GPU type alone. ``megatron-thd-cp`` (one ring over every GPU) is an appendix row.

``hexiseq-global`` runs on the job's domains (``--job``) or, without one, on the best of the
candidate domain sets (``hexiseq_candidates``): equal mixed data-parallel replicas and domains of
one GPU type, of every size ``n`` with ``S / n`` tokens per GPU in ``tokens_per_gpu``, and domains
of one GPU type each at its own size (``fit_blocks``: the fewest GPUs of the type that hold a
sample, and twice that); each planned in the memory mode ``plan`` picks and, as a second
candidate, in a recompute mode (more tokens fit a micro-batch: long documents can go to more
domains); each kind of domain gets ``plan``'s layout for ``S`` tokens on its GPUs and
the structure ``plan --doc-lengths`` would choose (``structure.choose_structure``), and micro-batch
counts by speed (``domains.speed_shares``). The candidate is chosen on ``CHOICE_STEPS`` global
batches packed with ``CHOICE_SEED`` (not the compared steps').
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

import numpy as np

from megatron_hexiseq.cluster import Cluster
from megatron_hexiseq.errors import HexiSeqError
from megatron_hexiseq.job.spec import JobPlan
from megatron_hexiseq.layout import Layout
from megatron_hexiseq.model import ModelSpec
from megatron_hexiseq.run_config import TrainOptions, modes_to_try
from megatron_hexiseq.varlen.compare import FORMAT, VERSION, plan_fixed, rank_records
from megatron_hexiseq.varlen.domains import (
    Domain,
    domain_options,
    fastest_type_ranks,
    replica_blocks,
    speed_shares,
    sub_cluster,
    typed_blocks,
)
from megatron_hexiseq.varlen.global_planner import GlobalPlanner, _signature, retarget
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
from megatron_hexiseq.varlen.structure import choose_structure

SCHEMES = (
    "hexiseq-global",
    "megatron-cp-dp",
    "megatron-hybrid-cp",
    "speed-aware-packing",
    "fast-only",
)
BASELINES = SCHEMES[1:]
APPENDIX = ("megatron-thd-cp",)
TOKENS_PER_GPU = (4096, 32768)  # tokens per GPU per micro-batch of every configuration tried
HYBRID_TOKENS = (4096, 8192, 16384, 32768)
CHOICE_SEED = 1_000_003
CHOICE_STEPS = 2  # global batches the domain set is chosen on
STRUCTURE_BATCHES = 4


def global_batches(
    doc_lengths: Sequence[int], seq_length: int, samples: int, steps: int, seed: int
) -> list[list[list[int]]]:
    """``steps`` global batches of ``samples`` loader samples of ``seq_length`` tokens each."""
    packed = pack_batches(doc_lengths, seq_length, samples * steps, seed)
    return [packed[i * samples : (i + 1) * samples] for i in range(steps)]


def units_of(samples: Sequence[Sequence[int]]) -> list[int]:
    """The units of a global batch: every sample's documents, loader order."""
    return [int(x) for s in samples for x in s]


def modes_for(model: ModelSpec) -> list[TrainOptions]:
    """The memory modes the baselines try, in order of overhead."""
    base = TrainOptions.for_model(model)
    return [replace(base, memory_mode=m, recompute=r) for m, r in modes_to_try("auto", False)]


# ---- HexiSeq domains ------------------------------------------------------------------------
def domains_from_job(job: JobPlan) -> list[Domain]:
    """The job file's domains, each on its sub-cluster, with the job's options."""
    cluster = job.cluster_spec
    opts = job.train_options
    return [
        Domain(
            index=i,
            ranks=d.ranks,
            micro_batches=d.micro_batches,
            structure=d.layout,
            cluster=sub_cluster(cluster, d.ranks, name=f"{cluster.name}:domain{i}"),
            options=domain_options(opts, cluster, job.run_ranks, d.size),
        )
        for i, d in enumerate(job.domains)
    ]


def _rehost(layout: Layout, cluster: Cluster) -> Layout:
    """``layout`` (a layout of a cluster like ``cluster``) with ``cluster``'s hosts and GPUs."""
    like = replace(
        layout,
        ranks=tuple(
            replace(r, host=d.node, gpu=d.gpu.name) for r, d in zip(layout.ranks, cluster.devices)
        ),
        meta={},
    )
    return retarget(layout, like)


def _kind(cluster: Cluster, model: ModelSpec, ranks: Sequence[int]) -> tuple:
    """What a block's plan depends on: its GPUs, links and node pattern (``_signature``)."""
    sub = sub_cluster(cluster, ranks)
    probe = Domain(
        index=0,
        ranks=tuple(ranks),
        micro_batches=1,
        structure=_trivial(sub, model),
        cluster=sub,
        options=TrainOptions.for_model(model),
    )
    return _signature(probe)[0]


def _plan_block(
    cluster: Cluster,
    model: ModelSpec,
    ranks: Sequence[int],
    seq_length: int,
    run: Sequence[int],
    time_limit_s: float,
    cache: dict,
    recompute: bool = False,
) -> tuple[Layout, TrainOptions]:
    """``plan``'s layout (and options) for ``seq_length`` tokens on the block ``ranks`` of a run
    on ``run`` (the optimizer sharded over the whole run), once per kind of block (``cache``);
    a ``HexiSeqError`` when it does not fit (cached too). ``recompute``: recompute modes only."""
    key = (_kind(cluster, model, ranks), len(run), seq_length, recompute)
    if key not in cache:
        base = domain_options(TrainOptions.for_model(model), cluster, run, len(ranks))
        try:
            cache[key] = plan_fixed(
                sub_cluster(cluster, ranks),
                model,
                seq_length,
                time_limit_s,
                options=base,
                recompute=recompute,
            )
        except HexiSeqError as e:
            cache[key] = e
    got = cache[key]
    if isinstance(got, HexiSeqError):
        raise got
    return got


def plan_domains(
    cluster: Cluster,
    model: ModelSpec,
    blocks: Sequence[Sequence[int]],
    seq_length: int,
    samples: int,
    doc_lengths: Sequence[int],
    *,
    time_limit_s: float = 60.0,
    cache: dict | None = None,
    recompute: bool = False,
) -> list[Domain]:
    """Domains on ``blocks`` (cluster ranks each): every kind of block planned once (``plan``'s
    layout for ``seq_length`` tokens, then the structure chosen for the lengths), micro-batch
    counts by speed (``speed_shares`` of ``samples``). ``cache``: plans kept between calls;
    ``recompute``: plan in the recompute modes only (more tokens fit a domain's micro-batch)."""
    run = sorted(r for b in blocks for r in b)
    cache = {} if cache is None else cache
    chosen: dict[tuple, tuple[Layout, TrainOptions, int]] = {}
    domains = []
    for i, b in enumerate(blocks):
        sub = sub_cluster(cluster, b, name=f"{cluster.name}:domain{i}")
        key = _kind(cluster, model, b)
        if key not in chosen:
            lay, opt = _plan_block(
                cluster, model, b, seq_length, run, time_limit_s, cache, recompute
            )
            m = replace(model, seq_length=seq_length)
            structure, _ = choose_structure(
                lay, sub, m, opt, doc_lengths, batches=STRUCTURE_BATCHES
            )
            dom = Domain(
                index=i,
                ranks=tuple(b),
                micro_batches=1,
                structure=structure,
                cluster=sub,
                options=domain_options(opt, cluster, run, len(b)),
            )
            chosen[key] = (structure, opt, efficiency(dom, model, doc_lengths, seq_length))
        structure, opt, eff = chosen[key]
        domains.append(
            Domain(
                index=i,
                ranks=tuple(b),
                micro_batches=1,
                structure=_rehost(structure, sub),
                cluster=sub,
                options=domain_options(opt, cluster, run, len(b)),
                efficiency_1024=eff,
            )
        )
    costs = GlobalPlanner(domains, model).costs
    pairs_per_token = _pairs_per_token(doc_lengths, seq_length)
    speeds = [
        1.0 / c.cost_as(seq_length, int(seq_length * pairs_per_token)) if c.capacity else 0.0
        for c in costs
    ]
    counts = speed_shares(samples, speeds)
    return [replace(d, micro_batches=m) for d, m in zip(domains, counts)]


def efficiency(
    domain: Domain, model: ModelSpec, doc_lengths: Sequence[int], seq_length: int
) -> int:
    """``Domain.efficiency_1024``: the mean iteration of the domain's planned micro-batches
    (``BatchPlanner`` on its structure, priced by ``estimate_documents``) over their perfectly
    divided work (``domain_costs``' integer table), in 1/1024, on ``STRUCTURE_BATCHES``
    micro-batches of ``seq_length`` tokens packed from the lengths with ``STRUCTURE_SEED`` (the
    structure choice's own sample, not the compared steps'); within [1/2, 4]."""
    from megatron_hexiseq.costmodel.documents import estimate_documents
    from megatron_hexiseq.varlen.global_batch import ATTO, domain_costs
    from megatron_hexiseq.varlen.structure import STRUCTURE_SEED

    planner = GlobalPlanner([domain], model).planner(0)
    table = domain_costs(planner)
    planned, divided = 0.0, 0
    for docs in pack_batches(doc_lengths, seq_length, STRUCTURE_BATCHES, STRUCTURE_SEED):
        a = planner.plan(docs)
        m = replace(model, seq_length=a.layout.seq_length)
        est = estimate_documents(a.layout, domain.cluster, m, domain.options, a.cu_seqlens)
        planned += est.iteration_time_s
        pairs = sum(x * (x + 1) // 2 for x in docs)
        divided += table.cost_as(sum(docs), pairs) + table.batch_as
    ratio = planned * ATTO / max(divided, 1)
    return int(round(1024 * min(4.0, max(0.5, ratio))))


def fit_blocks(
    cluster: Cluster,
    model: ModelSpec,
    seq_length: int,
    tokens_per_gpu: tuple[int, int],
    time_limit_s: float,
    cache: dict,
    scale: int = 1,
) -> tuple[str, list[list[int]]] | None:
    """Domains of one GPU type each, every type at its own size: the smallest power of two whose
    GPUs hold a ``seq_length``-token sample in memory (``plan`` finds a layout) with at most
    ``tokens_per_gpu[1]`` tokens per GPU, times ``scale``. None when some type has no such size
    (or ``scale`` leaves fewer than ``tokens_per_gpu[0]`` tokens per GPU)."""
    from megatron_hexiseq.planner.canonical import canonical_order

    lo, hi = tokens_per_gpu
    by_type: dict[str, list[int]] = {}
    for r in canonical_order(cluster):
        by_type.setdefault(cluster.devices[r].gpu.name, []).append(r)
    run = list(range(cluster.world_size))
    sizes: dict[str, int] = {}
    for t, ranks in by_type.items():
        n = 1
        while n <= len(ranks):
            if len(ranks) % n == 0 and seq_length // n <= hi:
                try:
                    _plan_block(cluster, model, ranks[:n], seq_length, run, time_limit_s, cache)
                except HexiSeqError:
                    n *= 2
                    continue
                break
            n *= 2
        n *= scale
        if n > len(ranks) or len(ranks) % n or seq_length // n < lo:
            return None
        sizes[t] = n
    blocks = [
        ranks[i : i + sizes[t]]
        for t, ranks in by_type.items()
        for i in range(0, len(ranks), sizes[t])
    ]
    name = "typed-fit(" + ", ".join(f"{t.split('-')[0]}:{n}" for t, n in sizes.items()) + ")"
    return name, blocks


def _pairs_per_token(doc_lengths: Sequence[int], seq_length: int) -> float:
    """Mean document-masked pairs per token of samples packed from the lengths (cut at S)."""
    x = np.minimum(np.asarray(doc_lengths, dtype=np.float64), seq_length)
    return float((x * (x + 1) / 2).sum() / x.sum())


def _trivial(sub: Cluster, model: ModelSpec) -> Layout:
    from megatron_hexiseq.varlen.schemes import ring_layout

    n = sub.world_size
    return ring_layout(sub, replace(model, seq_length=n), n, [[(j, j + 1)] for j in range(n)])


def hexiseq_candidates(
    cluster: Cluster,
    seq_length: int,
    samples: int,
    tokens_per_gpu: tuple[int, int] = TOKENS_PER_GPU,
) -> list[tuple[str, list[list[int]]]]:
    """Candidate domain sets (module docstring): (name, blocks of cluster ranks)."""
    W = cluster.world_size
    types = {d.gpu.name for d in cluster.devices}
    out: list[tuple[str, list[list[int]]]] = []
    n = 1
    while n <= W:
        per_gpu = seq_length // n
        if W % n == 0 and tokens_per_gpu[0] <= per_gpu <= tokens_per_gpu[1] and W // n <= samples:
            rep = replica_blocks(cluster, W // n)
            if rep is not None:
                out.append((f"replicas(n={n})", rep))
            if len(types) > 1:
                typed = typed_blocks(cluster, n)
                if typed is not None and len(typed) <= samples:
                    out.append((f"typed(n={n})", typed))
        n *= 2
    return out


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
) -> dict[str, Any]:
    """The ``out.json`` document of ``varlen --global-batch-tokens`` (module docstring)."""
    say = progress or (lambda message: None)
    samples = global_batch_tokens // seq_length
    if samples < 1:
        raise HexiSeqError(
            f"--global-batch-tokens {global_batch_tokens:,} is less than one sample of "
            f"{seq_length:,} tokens"
        )
    m = replace(model, seq_length=seq_length)
    batches = global_batches(doc_lengths, seq_length, samples, steps, seed)
    pricer = Pricer(cluster, m)
    modes = modes_for(m)
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
        for t in [t for t in HYBRID_TOKENS if t <= seq_length and lo <= t <= hi]:
            out.append(({"scheme": "megatron-hybrid-cp", "max_seqlen_per_rank": t},
                        lambda b, t=t: hybrid_cp_step(pricer, units_of(b), t, modes, ranks)))  # fmt: skip
        c = 1
        while c <= min(n, max_cp):
            if n % c == 0 and in_range(c):
                out.append(({"scheme": "speed-aware-packing", "cp": c},
                            lambda b, c=c: speed_aware_step(pricer, units_of(b), samples, c, modes, ranks)))  # fmt: skip
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
        chosen, cands = _choose_domains(
            cluster, m, doc_lengths, seq_length, samples, job, pricer, time_limit_s, say,
            tokens_per_gpu,
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
        "world_size": cluster.world_size,
        "model": model.name,
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


def _choose_domains(
    cluster, model, doc_lengths, S, samples, job, pricer, time_limit_s, say, tokens_per_gpu
):
    if job is not None:
        if job.seq_length != S:
            raise HexiSeqError(
                f"the job is planned for {job.seq_length:,}-token sequences but the samples have "
                f"{S:,}; use --tokens-per-batch {job.seq_length}"
            )
        doms = domains_from_job(job)
        return ("job", GlobalPlanner(doms, model)), [{"name": "job", "domains": len(doms)}]
    probes = [
        units_of(b) for b in global_batches(doc_lengths, S, samples, CHOICE_STEPS, CHOICE_SEED)
    ]
    best = None
    rows: list[dict[str, Any]] = []
    cache: dict = {}
    candidates = hexiseq_candidates(cluster, S, samples, tokens_per_gpu)
    if len({d.gpu.name for d in cluster.devices}) > 1:
        for scale in (1, 2):
            fit = fit_blocks(cluster, model, S, tokens_per_gpu, time_limit_s, cache, scale)
            if fit is not None and len(fit[1]) <= samples:
                if all(fit[1] != blocks for _, blocks in candidates):  # not a typed(n) already
                    candidates.append(fit)
    for (name, blocks), recompute in [(c, r) for c in candidates for r in (False, True)]:
        label = name + ("+recompute" if recompute else "")
        say(f"hexiseq-global: {label}")
        try:
            doms = plan_domains(
                cluster, model, blocks, S, samples, doc_lengths, time_limit_s=time_limit_s,
                cache=cache, recompute=recompute,
            )  # fmt: skip
            gp = GlobalPlanner(doms, model)
            got = [hexiseq_step(gp, pricer, probe, {}) for probe in probes]
        except HexiSeqError as e:
            rows.append({"name": label, "reason": str(e)})
            continue
        step = float(np.mean([g.step_s for g in got]))
        feasible = all(g.feasible for g in got)
        rows.append(
            {"name": label, "step_s": _sig(step), "feasible": feasible, "domains": len(doms)}
        )
        if best is None or (not feasible, step) < (not best[0], best[1]):
            best = (feasible, step, label, gp)
    if best is None:
        return None, rows
    return (best[2], best[3]), rows


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
