"""HexiSeq's domain sets for a global batch: which GPUs form each domain, and each domain planned.

A candidate domain set is a list of blocks of cluster ranks (``hexiseq_candidates``: equal mixed
data-parallel replicas and domains of one GPU type, of every size ``n`` with ``S / n`` tokens per
GPU in range; ``fit_blocks``: domains of one GPU type each at its own size, the fewest GPUs of the
type that hold a sample; with ``grids``, Megatron's CP groups and one domain per type, which
``global_compare`` always adds). ``plan_domains`` turns blocks into ``Domain``s: each kind of block gets
``plan``'s layout for ``S`` tokens on its GPUs, the structure ``plan --doc-lengths`` would choose
(``structure.choose_structure``) and its measured planning efficiency (``efficiency``); micro-batch
counts by speed (``domains.speed_shares``), equal under Megatron-FSDP.
``global_compare.choose_domains`` prices the candidates and keeps the fastest.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import NamedTuple

import numpy as np

from megatron_hexiseq.cluster import Cluster
from megatron_hexiseq.errors import HexiSeqError
from megatron_hexiseq.job.spec import JobPlan
from megatron_hexiseq.layout import Layout
from megatron_hexiseq.model import ModelSpec
from megatron_hexiseq.planner.canonical import canonical_order
from megatron_hexiseq.run_config import TrainOptions, modes_to_try
from megatron_hexiseq.varlen.compare import plan_fixed
from megatron_hexiseq.varlen.domains import (
    Domain,
    cp_groups,
    domain_options,
    replica_blocks,
    speed_shares,
    sub_cluster,
    typed_blocks,
)
from megatron_hexiseq.varlen.global_planner import GlobalPlanner, _signature, retarget
from megatron_hexiseq.varlen.packing import pack_batches
from megatron_hexiseq.varlen.structure import choose_structure

TOKENS_PER_GPU = (4096, 32768)  # tokens per GPU per micro-batch of every configuration tried
Modes = tuple[tuple[str, bool], ...]  # (memory mode, recompute) pairs, tried in order
AUTO: Modes = modes_to_try("auto", False)  # every mode, in order of overhead (``plan``'s auto)
RECOMPUTE: Modes = modes_to_try("auto", True)  # the recompute modes only
STRUCTURE_BATCHES = 4


def regime(tokens_per_gpu: tuple[int, int], seq_length: int, world: int) -> tuple[int, int]:
    """``tokens_per_gpu``, or every size from a sample over all ``world`` GPUs to a sample on one
    where no size in it is possible: a sample shorter than its lower bound (the CPU testbed's 2K)
    or longer than its upper bound spread over every GPU."""
    lo, hi = tokens_per_gpu
    fewest = -(-seq_length // world)
    if seq_length >= lo and fewest <= hi:
        return lo, hi
    return fewest, seq_length


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


def base_options(model: ModelSpec, tensor_model_parallel_size: int = 1) -> TrainOptions:
    """The options every domain and scheme starts from: the model's micro-batch size, and t on a
    bundle problem (its TP collectives and activations as Megatron's TP divides them)."""
    return TrainOptions.for_model(model, tensor_model_parallel_size=tensor_model_parallel_size)


def _plan_block(
    cluster: Cluster,
    model: ModelSpec,
    ranks: Sequence[int],
    seq_length: int,
    run: Sequence[int],
    time_limit_s: float,
    cache: dict,
    modes: Modes = AUTO,
    tensor_model_parallel_size: int = 1,
) -> tuple[Layout, TrainOptions]:
    """``plan``'s layout (and options) for ``seq_length`` tokens on the block ``ranks`` of a run
    on ``run`` (the optimizer sharded over the whole run), once per kind of block (``cache``);
    a ``HexiSeqError`` when it does not fit (cached too). ``modes``: the (memory mode, recompute)
    pairs ``plan`` tries, in order. ``tensor_model_parallel_size``: t of a bundle problem
    (``cluster`` one device per TP bundle, ``model`` one TP rank's: ``compare_global``)."""
    t = tensor_model_parallel_size
    key = (_kind(cluster, model, ranks), len(run), seq_length, tuple(modes), t)
    if key not in cache:
        base = domain_options(base_options(model, t), cluster, run, len(ranks))
        try:
            cache[key] = plan_fixed(
                sub_cluster(cluster, ranks),
                model,
                seq_length,
                time_limit_s,
                options=base,
                modes=modes,
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
    modes: Modes = AUTO,
    one_structure: bool = False,
    tensor_model_parallel_size: int = 1,
) -> list[Domain]:
    """Domains on ``blocks`` (cluster ranks each): every kind of block planned once (``plan``'s
    layout for ``seq_length`` tokens, then the structure chosen for the lengths), micro-batch
    counts by speed (``speed_shares`` of ``samples``); when a domain runs Megatron-FSDP, the same
    ``ceil(samples / domains)`` for all: its gathers run every micro-batch over every rank, in
    lockstep (``global_schemes.lockstep_s``). A run has one memory mode: when kinds choose
    different ones, every kind is planned again in the heaviest of them (the latest in
    ``modes``). ``cache``: plans kept between calls;
    ``modes``: the memory modes ``plan`` tries (``RECOMPUTE``: the recompute modes only, more
    tokens fit a domain's micro-batch); ``one_structure``: every block runs the first block's
    structure and options (blocks of one size: Megatron's data-parallel replicas of one layout,
    the CPU testbed's driver), each kind still with its own efficiency.
    ``tensor_model_parallel_size``: t of a bundle problem (``_plan_block``)."""
    if one_structure and len({len(b) for b in blocks}) > 1:
        raise HexiSeqError(
            f"one structure for every domain needs blocks of one size, got sizes "
            f"{sorted({len(b) for b in blocks})}"
        )
    run = sorted(r for b in blocks for r in b)
    cache = {} if cache is None else cache
    chosen: dict[tuple, tuple[Layout, TrainOptions, int]] = {}
    domains: list[Domain] = []
    first: tuple[Layout, TrainOptions] | None = None
    for i, b in enumerate(blocks):
        sub = sub_cluster(cluster, b, name=f"{cluster.name}:domain{i}")
        key = _kind(cluster, model, b)
        if key not in chosen:
            if one_structure and first is not None:  # the first block's, on these GPUs
                structure, opt = _rehost(first[0], sub), first[1]
            else:
                lay, opt = _plan_block(
                    cluster, model, b, seq_length, run, time_limit_s, cache, modes,
                    tensor_model_parallel_size,
                )  # fmt: skip
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
            first = first or (structure, opt)
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
    chosen_modes = {(d.options.memory_mode, d.options.recompute) for d in domains}
    if len(chosen_modes) > 1:  # a run has one memory mode: every kind in the heaviest chosen
        heaviest = max(chosen_modes, key=lambda m: modes.index(m) if m in modes else len(modes))
        return plan_domains(
            cluster, model, blocks, seq_length, samples, doc_lengths, time_limit_s=time_limit_s,
            cache=cache, modes=(heaviest,), one_structure=one_structure,
            tensor_model_parallel_size=tensor_model_parallel_size,
        )  # fmt: skip
    return _counted(domains, model, samples, doc_lengths, seq_length)


def _counted(
    domains: list[Domain],
    model: ModelSpec,
    samples: int,
    doc_lengths: Sequence[int],
    seq_length: int,
    planner: GlobalPlanner | None = None,
) -> list[Domain]:
    """``domains`` with their micro-batch counts: by speed (``speed_shares`` of ``samples``, a
    sample's micro-batch at least the table's floor); in lockstep (Megatron-FSDP:
    ``GlobalPlanner.lockstep``) the same ``ceil(samples / domains)`` for all. ``planner``: the
    domains' planner when the caller has built it."""
    gp = GlobalPlanner(domains, model) if planner is None else planner
    costs = gp.costs
    pairs_per_token = _pairs_per_token(doc_lengths, seq_length)
    speeds = [  # a sample's micro-batch at least the floor (e.g. Megatron-FSDP's gathers)
        1.0 / max(c.floor_as, c.cost_as(seq_length, int(seq_length * pairs_per_token)))
        if c.capacity
        else 0.0
        for c in costs
    ]
    if gp.lockstep or len(domains) == 1:  # equal counts (one domain: all of them)
        counts = [-(-samples // len(domains))] * len(domains)
    else:
        counts = speed_shares(samples, speeds)
    return [replace(d, micro_batches=m) for d, m in zip(domains, counts)]


class ModeVariant(NamedTuple):
    """Planned domains in another memory mode (``other_modes``): the label suffix, the domains
    with their counts, and whether the mode is lighter than the planned one."""

    suffix: str
    domains: list[Domain]
    lighter: bool


def other_modes(
    domains: list[Domain],
    model: ModelSpec,
    samples: int,
    doc_lengths: Sequence[int],
    seq_length: int,
    modes: Modes = AUTO,
) -> list[ModeVariant]:
    """``domains`` (planned by ``plan_domains`` in one mode of ``modes``) again in every other
    mode of ``modes`` where each domain's micro-batch still holds a token per GPU, labelled
    ``+mode:<mode>``, with their counts (``_counted``), in the order of ``modes``.

    - A **lighter** mode (less overhead, fewer tokens per micro-batch): ``plan`` picks a domain's
      mode for a whole ``S``-token sample on its GPUs, and one kind that needs recompute puts the
      run in recompute; but a packed micro-batch need not hold a sample: the scheduler gives long
      units to the domains that hold them and fills each micro-batch up to its capacity in that
      mode (``DomainCosts.capacity``), as speed-aware packing does on the stock grid.
    - A **heavier** mode holds more tokens per micro-batch, so the step can run fewer
      micro-batches, each paying its fixed costs and floor once (``global_compare``'s count
      variants price it with fewer only).

    A step whose units fit nowhere is refused when it is priced (the candidate's row says why)."""
    mode = (domains[0].options.memory_mode, domains[0].options.recompute)
    if mode not in modes:
        return []
    out: list[ModeVariant] = []
    for m, r in modes:
        if (m, r) == mode:
            continue
        other = [
            replace(d, options=replace(d.options, memory_mode=m, recompute=r)) for d in domains
        ]
        try:
            gp = GlobalPlanner(other, model)
        except HexiSeqError:  # a probe micro-batch does not plan in this mode's memory
            continue
        if any(c.capacity < d.size for c, d in zip(gp.costs, other)):
            continue
        name = m + ("+recompute" if r else "")
        counted = _counted(other, model, samples, doc_lengths, seq_length, gp)
        out.append(ModeVariant(f"+mode:{name}", counted, modes.index((m, r)) < modes.index(mode)))
    return out


def efficiency(
    domain: Domain, model: ModelSpec, doc_lengths: Sequence[int], seq_length: int
) -> int:
    """``Domain.efficiency_1024``: the mean iteration of the domain's planned micro-batches
    (``BatchPlanner`` on its structure, priced by ``GlobalPlanner.price``) over their cost by the
    domain's integer table (``DomainCosts.bin_as``: fixed costs plus the larger of the floor and
    the divided work with what the longest unit adds), in 1/1024, on ``STRUCTURE_BATCHES``
    micro-batches of ``seq_length`` tokens packed from the lengths with ``STRUCTURE_SEED`` (the
    structure choice's own sample, not the compared steps'); within [1/2, 4]."""
    from megatron_hexiseq.varlen.global_batch import ATTO
    from megatron_hexiseq.varlen.structure import STRUCTURE_SEED

    gp = GlobalPlanner([domain], model)
    planner, table = gp.planner(0), gp.costs[0]
    planned, divided = 0.0, 0
    for docs in pack_batches(doc_lengths, seq_length, STRUCTURE_BATCHES, STRUCTURE_SEED):
        planned += gp.price(0, planner.plan(docs))
        divided += table.bin_as(docs) + table.step_as
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
    modes: Modes = AUTO,
    tensor_model_parallel_size: int = 1,
) -> tuple[str, list[list[int]]] | None:
    """Domains of one GPU type each, every type at its own size: the smallest power of two whose
    GPUs hold a ``seq_length``-token sample in memory (``plan`` finds a layout) with at most
    ``tokens_per_gpu[1]`` tokens per GPU, times ``scale``. None when some type has no such size
    (or ``scale`` leaves fewer than ``tokens_per_gpu[0]`` tokens per GPU)."""
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
                    _plan_block(
                        cluster, model, ranks[:n], seq_length, run, time_limit_s, cache, modes,
                        tensor_model_parallel_size,
                    )  # fmt: skip
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
    *,
    grids: bool = False,
) -> list[tuple[str, list[list[int]]]]:
    """Candidate domain sets (module docstring): (name, blocks of cluster ranks). ``grids``: the
    stock schemes' domain sets too: Megatron's CP groups of every size ``c`` (``cp_groups``, with
    ``S / c`` tokens per GPU in range) and one domain per GPU type. A set found twice is kept once,
    its names joined by `` = ``."""
    W = cluster.world_size
    by_type: dict[str, list[int]] = {}
    for r in canonical_order(cluster):
        by_type.setdefault(cluster.devices[r].gpu.name, []).append(r)
    out: list[tuple[str, list[list[int]]]] = []
    n = 1
    while n <= W:
        per_gpu = seq_length // n
        if W % n == 0 and tokens_per_gpu[0] <= per_gpu <= tokens_per_gpu[1] and W // n <= samples:
            rep = replica_blocks(cluster, W // n)
            if rep is not None:
                out.append((f"replicas(n={n})", rep))
            if len(by_type) > 1:
                typed = typed_blocks(cluster, n)
                if typed is not None and len(typed) <= samples:
                    out.append((f"typed(n={n})", typed))
            if grids:
                out.append((f"cp-groups(c={n})", cp_groups(cluster, n)))
        n *= 2
    if grids and 1 < len(by_type) <= samples:
        out.append(("per-type", list(by_type.values())))
    return _once(out)


def domain_candidates(
    cluster: Cluster,
    model: ModelSpec,
    seq_length: int,
    samples: int,
    tokens_per_gpu: tuple[int, int],
    time_limit_s: float,
    cache: dict,
    *,
    modes: Modes = AUTO,
    grids: bool = False,
    tensor_model_parallel_size: int = 1,
) -> list[tuple[str, list[list[int]]]]:
    """``hexiseq_candidates`` and, on a mixed cluster, ``fit_blocks`` at scales 1 and 2 (planned
    in ``modes``; ``cache`` as ``plan_domains``')."""
    out = hexiseq_candidates(cluster, seq_length, samples, tokens_per_gpu, grids=grids)
    if len({d.gpu.name for d in cluster.devices}) > 1:
        for scale in (1, 2):
            fit = fit_blocks(
                cluster, model, seq_length, tokens_per_gpu, time_limit_s, cache, scale, modes,
                tensor_model_parallel_size,
            )  # fmt: skip
            if fit is not None and len(fit[1]) <= samples:
                if all(fit[1] != blocks for _, blocks in out):  # not a typed(n) already
                    out.append(fit)
    return out


def _once(sets: list[tuple[str, list[list[int]]]]) -> list[tuple[str, list[list[int]]]]:
    """Each domain set once (first place), its names joined."""
    out: list[tuple[str, list[list[int]]]] = []
    for name, blocks in sets:
        j = next((j for j, (_, b) in enumerate(out) if b == blocks), None)
        if j is None:
            out.append((name, blocks))
        else:
            out[j] = (f"{out[j][0]} = {name}", blocks)
    return out
