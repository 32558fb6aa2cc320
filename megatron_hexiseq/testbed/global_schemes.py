"""The schemes of the CPU testbed's global-batch comparison (``global_packed``), as its driver
runs them, and their prices in the comparison's model.

A ``TestbedScheme`` is what ``global_train.train_global_rank`` runs: ``replicas`` domains of
consecutive process ranks sharing one structure, and a picklable scheme (``schedule(step,
units)``, ``layout(domain, lengths)``): ``PlannedScheme`` (a ``GlobalPlanner``'s bins) or
``SampleOrder`` (Megatron's sampler: sample i to replica i mod DP).

- ``hexiseq-global``'s domains are chosen as ``varlen`` chooses them (``choose_testbed_domains``:
  ``global_compare.choose_domains`` over ``domain_choice.domain_candidates`` with the stock grids
  and the testbed's own stock domain sets, on the choice batches, priced by ``testbed_price``):
  so its candidates include every stock scheme's domain set.
- ``megatron-cp-dp`` / ``speed-aware-packing`` at every CP size ``c`` dividing the ranks
  (``schemes_for``), ``fast-only`` on the rank alone on its core (``fast_only``).

Pricing (``predict_steps``): every micro-batch by ``estimate_documents`` on its domain's GPUs, a
domain's micro-batches summed, the testbed's measured step overhead once per step (and its
per-micro-batch part, ``micro_batch_overhead_ms``, once per micro-batch), the step the
slowest domain; a micro-batch over the declared memory (``capacity_fraction`` of the profile's
``memory_gib``) is a problem line. Every scheme is priced in the one memory mode the driver's runs
are priced in (``TrainOptions.for_model``: the distributed optimizer without recompute); the driver
neither recomputes nor shards parameters, so no other mode is emulated.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any, NamedTuple

import numpy as np

from megatron_hexiseq.cluster import Cluster
from megatron_hexiseq.costmodel.documents import estimate_documents
from megatron_hexiseq.costmodel.step import step_once_s
from megatron_hexiseq.errors import HexiSeqError
from megatron_hexiseq.layout import Layout
from megatron_hexiseq.model import ModelSpec
from megatron_hexiseq.run_config import TrainOptions
from megatron_hexiseq.testbed.pinning import TestbedShape
from megatron_hexiseq.varlen.domain_choice import domain_candidates
from megatron_hexiseq.varlen.domains import Domain, domain_options, sub_cluster
from megatron_hexiseq.varlen.global_compare import CHOICE_STEPS, EQUAL, choose_domains
from megatron_hexiseq.varlen.global_planner import GlobalPlanner, retarget
from megatron_hexiseq.varlen.global_schemes import Pricer
from megatron_hexiseq.varlen.schemes import ring_layout

MIB = 2**20


class PlannedScheme:
    """``GlobalTrainConfig.scheme`` from a ``GlobalPlanner``; layouts in ``structure``'s hosts."""

    def __init__(self, planner: GlobalPlanner, structure: Layout) -> None:
        self.planner, self.structure = planner, structure

    def schedule(self, step: int, units: Sequence[int]) -> tuple:
        return self.planner.schedule(units).bins

    def layout(self, domain: int, lengths: Sequence[int]) -> Layout:
        return retarget(self.planner.plan_lengths(domain, lengths).layout, self.structure)


class SampleOrder:
    """``megatron-cp-dp``'s scheme: ``units_per_sample[step]`` gives each sample's unit count."""

    def __init__(
        self, planner: GlobalPlanner, structure: Layout, units_per_sample: Sequence[Sequence[int]]
    ) -> None:
        self.planner, self.structure = planner, structure
        self.units_per_sample = [tuple(x) for x in units_per_sample]

    def schedule(self, step: int, units: Sequence[int]) -> tuple:
        D = len(self.planner.domains)
        bins: list[list[tuple[int, ...]]] = [[] for _ in range(D)]
        start = 0
        for i, n in enumerate(self.units_per_sample[step]):
            bins[i % D].append(tuple(range(start, start + n)))
            start += n
        return tuple(tuple(b) for b in bins)

    def layout(self, domain: int, lengths: Sequence[int]) -> Layout:
        return retarget(self.planner.plan_lengths(domain, lengths).layout, self.structure)


def _blocks(world: int, size: int) -> list[list[int]]:
    """Megatron's replicas: consecutive process ranks."""
    return [list(range(d * size, (d + 1) * size)) for d in range(world // size)]


def _ring_structure(cluster: Cluster, model: ModelSpec, ranks: Sequence[int]) -> Layout:
    sub = sub_cluster(cluster, ranks)
    n = len(ranks)
    return ring_layout(sub, replace(model, seq_length=n), n, [[(j, j + 1)] for j in range(n)])


def _domains(
    cluster: Cluster,
    blocks: Sequence[Sequence[int]],
    structure: Layout,
    options: TrainOptions,
    counts: Sequence[int],
) -> list[Domain]:
    run = sorted(r for b in blocks for r in b)
    out = []
    for i, (b, m) in enumerate(zip(blocks, counts)):
        sub = sub_cluster(cluster, b)
        like = replace(
            structure,
            ranks=tuple(
                replace(r, host=d.node, gpu=d.gpu.name)
                for r, d in zip(structure.ranks, sub.devices)
            ),
            meta={},
        )
        out.append(
            Domain(
                index=i,
                ranks=tuple(b),
                micro_batches=m,
                structure=retarget(structure, like),
                cluster=sub,
                options=domain_options(options, cluster, run, len(b)),
            )
        )
    return out


class TestbedScheme(NamedTuple):
    """A scheme as the driver runs it: the structure its ``replicas`` domains share, the
    ``GlobalTrainConfig.scheme``, its domains (cluster ranks, priced on their sub-clusters), and the
    testbed shape it runs on (``None``: the compared one)."""

    structure: Layout
    replicas: int
    scheme: Any
    domains: list[Domain]
    shape: str | None = None


def _runnable(blocks: Sequence[Sequence[int]], world: int) -> bool:
    """Whether the driver runs these domains: consecutive blocks of process ranks of one size
    (``train_global_rank``: replicas of one structure)."""
    return [list(b) for b in blocks] == _blocks(world, len(blocks[0]))


def _merged(sets: Sequence[tuple[str, Sequence[Sequence[int]]]]) -> list[tuple[str, list]]:
    """Each domain set once, as sorted blocks of sorted ranks (a set of GPUs is one domain
    whatever the order), its names joined by `` = ``."""
    out: dict[str, tuple[str, list]] = {}
    for name, blocks in sets:
        norm = sorted(sorted(int(r) for r in b) for b in blocks)
        key = str(norm)
        out[key] = (f"{out[key][0]} = {name}", norm) if key in out else (name, norm)
    return list(out.values())


def choose_testbed_domains(
    cluster: Cluster,
    model: ModelSpec,
    options: TrainOptions,
    doc_lengths: Sequence[int],
    samples: int,
    stock: Sequence[tuple[str, Sequence[Sequence[int]]]],
    *,
    time_limit_s: float = 30.0,
) -> tuple[tuple[str, GlobalPlanner] | None, list[dict[str, Any]]]:
    """``hexiseq-global``'s domains, chosen as ``varlen`` chooses them (``choose_domains``, on its
    own choice batches) among ``domain_candidates`` with the stock grids (``grids``) and the
    testbed's stock domain sets ``stock`` (name, blocks), every size allowed (a CPU sample is
    short), planned in the memory mode the driver's runs are priced in (``options``), one
    structure for all domains (the driver's replicas), priced by ``testbed_price``. Sets the driver
    cannot run are rows with that reason. ``model.seq_length``: the sample's tokens. Returns the
    choice and one row per candidate (name, blocks, mean step on the choice batches or why not)."""
    W, S = cluster.world_size, model.seq_length
    modes = ((options.memory_mode, options.recompute),)
    cache: dict = {}
    sets = _merged(
        domain_candidates(
            cluster, model, S, samples, (1, S), time_limit_s, cache, modes=modes, grids=True
        )
        + list(stock)
    )
    runnable = [(n, b) for n, b in sets if _runnable(b, W)]
    chosen, rows = choose_domains(
        cluster, model, doc_lengths, S, samples, Pricer(cluster, model), runnable,
        variants=(("", modes),), one_structure=True, time_limit_s=time_limit_s, cache=cache,
        price=testbed_price, fewer=False, steps=CHOICE_STEPS,
    )  # fmt: skip
    blocks_of = dict(sets)
    rows = [{**r, "blocks": blocks_of[r["name"].removesuffix(EQUAL)]} for r in rows]
    rows += [
        {"name": n, "blocks": b, "reason": "the driver runs replicas of one structure on "
         "consecutive process ranks (domains of one size)"}
        for n, b in sets if not _runnable(b, W)
    ]  # fmt: skip
    return chosen, rows


def testbed_price(planner: GlobalPlanner, units: list[int]) -> tuple[float, bool]:
    """One global batch of ``planner``'s domains in the comparison's model (``predict_steps``, as
    the driver runs it): the step and whether every micro-batch fits."""
    sch = PlannedScheme(planner, planner.domains[0].structure)
    bins, lays = plan_steps(sch, len(planner.domains), [units])
    steps, problems = predict_steps(bins, lays, [units], planner.domains, planner.model, "pruned")
    return steps[0], not problems


def schemes_for(
    cluster: Cluster,
    model: ModelSpec,
    options: TrainOptions,
    samples: Sequence[Sequence[Sequence[int]]],
    doc_lengths: Sequence[int],
    *,
    cp: Sequence[int] | None = None,
    time_limit_s: float = 30.0,
) -> tuple[dict[str, TestbedScheme], dict[str, Any]]:
    """Every scheme on the whole testbed (``fast-only`` is separate: another shape), and the
    record of hexiseq-global's domain choice (no ``hexiseq-global`` entry when nothing fits).
    ``cp``: the stock CP sizes (default: every power of two dividing the ranks)."""
    W, S = cluster.world_size, sum(samples[0][0])
    per_step = len(samples[0])
    m = replace(model, seq_length=S)
    cp = [c for c in (1, 2, 4, 8, 16) if W % c == 0] if cp is None else list(cp)
    out: dict[str, TestbedScheme] = {}
    stock = [(f"stock(cp={c})", _blocks(W, c)) for c in cp if W % c == 0]
    chosen, rows = choose_testbed_domains(
        cluster, m, options, doc_lengths, per_step, stock, time_limit_s=time_limit_s
    )
    choice: dict[str, Any] = {"chosen": None, "candidates": rows}
    if chosen is not None:
        label, planner = chosen
        structure = planner.domains[0].structure
        doms = planner.domains
        out["hexiseq-global"] = TestbedScheme(
            structure, len(doms), PlannedScheme(planner, structure), doms
        )
        choice["chosen"] = label
    units_per_sample = [[len(s) for s in step] for step in samples]
    for c in cp:
        if W % c:
            continue
        blocks = _blocks(W, c)
        ring = _ring_structure(cluster, m, blocks[0])
        D = len(blocks)
        if per_step % D == 0 and S % (2 * c) == 0:  # what Megatron accepts (cp_sizes)
            doms = _domains(cluster, blocks, ring, options, [per_step // D] * D)
            out[f"megatron-cp-dp(cp={c})"] = TestbedScheme(
                ring,
                D,
                SampleOrder(GlobalPlanner(doms, m, mode="zigzag"), ring, units_per_sample),
                doms,
            )
        doms = _domains(cluster, blocks, ring, options, [-(-per_step // D)] * D)
        out[f"speed-aware-packing(cp={c})"] = TestbedScheme(
            ring, D, PlannedScheme(GlobalPlanner(doms, m, mode="zigzag"), ring), doms
        )
    return out, choice


def plan_steps(
    scheme: Any, replicas: int, batches: Sequence[Sequence[int]]
) -> tuple[list[list[tuple]], list[list[list[Layout]]]]:
    """Every step's bins and layouts as the ranks compute them (``scheme.schedule`` and
    ``scheme.layout``), per domain: ``bins[d][step]``, ``layouts[d][step]``."""
    bins: list[list[tuple]] = [[] for _ in range(replicas)]
    lays: list[list[list[Layout]]] = [[] for _ in range(replicas)]
    for step, units in enumerate(batches):
        got = scheme.schedule(step, units)
        for d in range(replicas):
            bins[d].append(tuple(got[d]))
            lays[d].append([scheme.layout(d, [int(units[u]) for u in ids]) for ids in got[d]])
    return bins, lays


def predict_steps(
    result_bins: Sequence[Sequence[Sequence[Sequence[int]]]],
    layouts: Sequence[Sequence[Sequence[Layout]]],
    batches: Sequence[Sequence[int]],
    domains: Sequence[Domain],
    model: ModelSpec,
    exchange: str,
) -> tuple[list[float], list[str]]:
    """Per step: the slowest domain's priced micro-batches (``estimate_documents`` on its GPUs),
    the measured step overhead once per step (every priced micro-batch carries it; a further
    micro-batch keeps only its ``micro_batch_overhead_ms``: ``step_once_s``); and one line per
    micro-batch over the declared memory (its step, domain, ranks and largest need)."""
    out, problems = [], []
    for step, units in enumerate(batches):
        busy = []
        for d, dom in enumerate(domains):
            total, n = 0.0, 0
            for k, (ids, lay) in enumerate(zip(result_bins[d][step], layouts[d][step])):
                lengths = [int(units[u]) for u in ids]
                cu = [0, *np.cumsum(lengths).tolist()]
                local = retarget(lay, dom.structure)
                est = estimate_documents(
                    local,
                    dom.cluster,
                    replace(model, seq_length=cu[-1]),
                    dom.options,
                    cu,
                    exchange=exchange,
                )
                if not est.feasible:
                    j = int(np.argmax(est.memory_bytes - est.capacity_bytes))
                    problems.append(
                        f"step {step} micro-batch {k} ({cu[-1]} tokens) on ranks "
                        f"{list(dom.ranks)}: rank {dom.ranks[j]} needs "
                        f"{est.memory_bytes[j] / MIB:.1f} MiB > {est.capacity_bytes[j] / MIB:.1f}"
                        f" MiB ({100 * dom.options.capacity_fraction:g}% of "
                        f"{dom.cluster.devices[j].memory_gib:g} GiB)"
                    )
                total += est.iteration_time_s
                n += 1
            busy.append(total - max(0, n - 1) * step_once_s(dom.cluster.devices))
        out.append(max(busy))
    return out, problems


def price_scheme(
    sch: TestbedScheme, batches: Sequence[Sequence[int]], model: ModelSpec
) -> tuple[list[float], str | None]:
    """The scheme's predicted steps (``predict_steps`` on the bins and layouts the ranks will
    compute) and why it does not fit the declared memory (its scheduler finds no room, or a priced
    micro-batch is over capacity: the first, and how many), None when it fits."""
    try:
        bins, lays = plan_steps(sch.scheme, sch.replicas, batches)
    except HexiSeqError as e:
        return [], str(e)
    predicted, problems = predict_steps(bins, lays, batches, sch.domains, model, "pruned")
    if not problems:
        return predicted, None
    total = sum(len(b) for d in bins for b in d)
    return predicted, f"{problems[0]} ({len(problems)} of {total} micro-batches over)"


def sample_memory(cluster: Cluster, model: ModelSpec, options: TrainOptions) -> dict[str, Any]:
    """What the declared memory means here: per-rank MiB of one ``model.seq_length``-token sample
    (one document, zig-zag) on ``c`` consecutive ranks for every ``c`` dividing the ranks, the
    usable MiB per rank, and the fewest ranks that hold a sample (None: none does)."""
    W, S = cluster.world_size, model.seq_length
    pricer = Pricer(cluster, model)
    need: dict[int, float] = {}
    c = 1
    while c <= W:
        if W % c == 0:
            opts = domain_options(options, cluster, list(range(W)), c)
            _, _, est = pricer.ring(_blocks(W, c)[0], [S], opts)
            need[c] = round(float(est.memory_bytes.max()) / MIB, 1)
        c *= 2
    usable = min(d.memory_bytes for d in cluster.devices) * options.capacity_fraction / MIB
    fits = [c for c, x in need.items() if x <= usable]
    return {
        "memory_gib": min(d.memory_gib for d in cluster.devices),
        "usable_mib_per_rank": round(usable, 1),
        "sample_mib_per_rank": need,
        "min_ranks_per_sample": min(fits) if fits else None,
    }


def fast_only(
    cluster: Cluster,
    model: ModelSpec,
    options: TrainOptions,
    packed: Sequence[Sequence[Sequence[int]]],
    shape: str,
) -> TestbedScheme:
    """The fastest rank alone (its core alone: testbed shape ``1``), every sample in turn."""
    tb = TestbedShape.parse(shape)
    alone = [i for i, n in enumerate(tb.ranks_per_core) if n == 1]
    if not alone:
        raise HexiSeqError(f"testbed {shape} has no rank alone on its core for fast-only")
    first = sum(tb.ranks_per_core[: alone[0]])
    m = replace(model, seq_length=sum(packed[0][0]))
    ring = _ring_structure(cluster, m, [first])
    doms = _domains(cluster, [[first]], ring, options, [len(packed[0])])
    units_per_sample = [[len(s) for s in step] for step in packed]
    scheme = SampleOrder(GlobalPlanner(doms, m, mode="zigzag"), ring, units_per_sample)
    return TestbedScheme(ring, 1, scheme, doms, shape="1")
