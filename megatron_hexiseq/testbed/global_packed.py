"""Global batches on the CPU testbed: HexiSeq's global-batch scheduling over two domains against
the stock schemes that run here, trained on the same steps (``global_train``).

Every scheme trains the same global batches (``samples`` loader samples of ``S`` tokens per step,
packed from the scaled lengths; a document cut at a sample boundary is two units) from the same
weights, on the same testbed shape; attention is exact, so the losses must agree (``LOSS_RTOL``):

- ``hexiseq-global``: two domains (Megatron's data-parallel replicas of half the ranks each), the
  structure ``plan --doc-lengths`` chooses for replica 0, each domain's planning efficiency
  measured (``domain_choice.efficiency``), micro-batch counts by speed (``domains.speed_shares``), ``varlen.global_planner.GlobalPlanner``: units to (domain,
  micro-batch) bins by integer cost, each bin ``BatchPlanner``-planned in its domain.
- ``megatron-cp-dp`` (``cp`` = c): CP rings of c consecutive ranks, DP = W / c, sample i to replica
  i mod DP, every document in 2c zig-zag chunks (on this project's runtime, so the K/V exchange is
  pruned: stronger than Transformer Engine's ring).
- ``speed-aware-packing`` (c): whole units onto the same rings by predicted speed (the global
  scheduler with zig-zag cost tables).
- ``fast-only``: the fastest rank alone (its own pinned core), every sample in turn.

Megatron's hybrid CP does not run here: its per-sub-sample CP groups and barriers are not in the
CPU driver (it is compared in the cost model, ``varlen.global_compare``).

Measured throughput: the measured steps' tokens / their summed wall time (the slowest rank's
step); predicted: every micro-batch priced by ``estimate_documents`` on its domain's GPUs (the
profiled cluster), a domain's micro-batches summed, the testbed's measured step overhead paid once
per step, the step the slowest domain; error = summed predicted / summed measured - 1. Exposed
planning: the training thread's wait for the planning thread plus its copies, per micro-batch
(``GlobalTrainResult.exposed_s``); planning CPU: the planning thread's CPU time per micro-batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import numpy as np

from megatron_hexiseq.cluster import Cluster
from megatron_hexiseq.costmodel.documents import estimate_documents
from megatron_hexiseq.errors import HexiSeqError
from megatron_hexiseq.layout import Layout
from megatron_hexiseq.model import ModelSpec
from megatron_hexiseq.run_config import TrainOptions
from megatron_hexiseq.testbed.global_train import GlobalTrainConfig, train_global_rank
from megatron_hexiseq.testbed.pinning import TestbedShape, cpu_sets
from megatron_hexiseq.testbed.spawn import run_ranks
from megatron_hexiseq.varlen.compare import plan_fixed
from megatron_hexiseq.varlen.domain_choice import efficiency
from megatron_hexiseq.varlen.domains import Domain, domain_options, speed_shares, sub_cluster
from megatron_hexiseq.varlen.global_compare import global_batches, units_of
from megatron_hexiseq.varlen.global_planner import GlobalPlanner, retarget
from megatron_hexiseq.varlen.schemes import ring_layout
from megatron_hexiseq.varlen.structure import choose_structure

LOSS_RTOL = 1e-4
DOC_SCALE = 1 / 16


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


def schemes_for(
    cluster: Cluster,
    model: ModelSpec,
    options: TrainOptions,
    samples: Sequence[Sequence[Sequence[int]]],
    doc_lengths: Sequence[int],
    *,
    cp: Sequence[int] = (1, 2),
) -> dict[str, tuple[Layout, int, Any, list[Domain]]]:
    """name -> (structure, replicas, scheme, domains) of every scheme on the whole testbed
    (``fast-only`` is separate: another shape)."""
    W, S = cluster.world_size, sum(samples[0][0])
    per_step = len(samples[0])
    m = replace(model, seq_length=S)
    out: dict[str, tuple[Layout, int, Any, list[Domain]]] = {}
    # hexiseq-global: two replicas, the structure chosen for replica 0, counts by speed
    half = _blocks(W, W // 2)
    sub0 = sub_cluster(cluster, half[0])
    lay, opt = plan_fixed(sub0, m, S, time_limit_s=30.0)
    structure, _ = choose_structure(lay, sub0, m, opt, doc_lengths)
    doms = _domains(cluster, half, structure, opt, [1, 1])
    doms = [replace(d, efficiency_1024=efficiency(d, m, doc_lengths, S)) for d in doms]
    costs = GlobalPlanner(doms, m).costs
    ppt = sum(x * (x + 1) / 2 for s in samples[0] for x in s) / sum(sum(s) for s in samples[0])
    speeds = [1.0 / c.cost_as(S, int(S * ppt)) for c in costs]
    doms = [replace(d, micro_batches=k) for d, k in zip(doms, speed_shares(per_step, speeds))]
    out["hexiseq-global"] = (structure, 2, PlannedScheme(GlobalPlanner(doms, m), structure), doms)
    units_per_sample = [[len(s) for s in step] for step in samples]
    for c in cp:
        if W % c:
            continue
        blocks = _blocks(W, c)
        ring = _ring_structure(cluster, m, blocks[0])
        D = len(blocks)
        if per_step % D == 0:
            doms = _domains(cluster, blocks, ring, options, [per_step // D] * D)
            out[f"megatron-cp-dp(cp={c})"] = (
                ring,
                D,
                SampleOrder(GlobalPlanner(doms, m, mode="zigzag"), ring, units_per_sample),
                doms,
            )
        doms = _domains(cluster, blocks, ring, options, [-(-per_step // D)] * D)
        out[f"speed-aware-packing(cp={c})"] = (
            ring,
            D,
            PlannedScheme(GlobalPlanner(doms, m, mode="zigzag"), ring),
            doms,
        )
    return out


def predict_steps(
    result_bins: Sequence[Sequence[Sequence[Sequence[int]]]],
    layouts: Sequence[Sequence[Sequence[Layout]]],
    batches: Sequence[Sequence[int]],
    domains: Sequence[Domain],
    model: ModelSpec,
    exchange: str,
) -> list[float]:
    """Per step: the slowest domain's priced micro-batches (``estimate_documents`` on its GPUs),
    the measured step overhead once per step (every priced micro-batch carries it)."""
    out = []
    for step, units in enumerate(batches):
        busy = []
        for d, dom in enumerate(domains):
            total, n = 0.0, 0
            for ids, lay in zip(result_bins[d][step], layouts[d][step]):
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
                total += est.iteration_time_s
                n += 1
            overhead = max(x.step_overhead_s for x in dom.cluster.devices)
            busy.append(total - max(0, n - 1) * overhead)
        out.append(max(busy))
    return out


def run_scheme(
    name: str,
    structure: Layout,
    replicas: int,
    scheme: Any,
    domains: Sequence[Domain],
    batches: Sequence[Sequence[int]],
    model: ModelSpec,
    shape: str,
    warmup: int,
    kernel: str,
) -> dict[str, Any]:
    """Train one scheme on the pinned testbed; its measured and predicted record."""
    cfg = GlobalTrainConfig(
        model=model,
        structure=structure,
        replicas=replicas,
        batches=tuple(tuple(int(x) for x in b) for b in batches),
        scheme=scheme,
        kernel=kernel,
    )
    tb = TestbedShape.parse(shape)
    W = structure.world_size
    results = run_ranks(train_global_rank, W * replicas, cfg, cpu_sets=cpu_sets(tb))
    steps = len(batches)
    measured = [max(r.step_times_s[s] for r in results) for s in range(steps)]
    bins = [[results[d * W].bins[s] for s in range(steps)] for d in range(replicas)]
    lays = [[results[d * W].layouts[s] for s in range(steps)] for d in range(replicas)]
    exchange = "pruned"
    predicted = predict_steps(bins, lays, batches, domains, model, exchange)
    keep = range(warmup, steps)
    tokens = sum(sum(batches[s]) for s in keep)
    meas, pred = sum(measured[s] for s in keep), sum(predicted[s] for s in keep)
    mb = sum(len(results[d * W].layouts[s]) for d in range(replicas) for s in keep)
    # the measured steps' micro-batches (the warm-up's are left out: the first waits for the
    # planner's first step)
    exposed = [x for r in results for x in r.exposed_s[sum(len(b) for b in r.bins[:warmup]) :]]
    return {
        "name": name,
        "losses": results[0].losses,
        "measured_step_s": measured,
        "predicted_step_s": predicted,
        "tokens_per_s": tokens / meas,
        "predicted_tokens_per_s": tokens / pred,
        "prediction_error": pred / meas - 1.0,
        "domains": [list(d.ranks) for d in domains],
        "micro_batches": [len(bins[d][0]) for d in range(replicas)],
        "domain_tokens": [
            [sum(int(batches[s][u]) for b in bins[d][s] for u in b) for s in range(steps)]
            for d in range(replicas)
        ],
        "exposed_ms_p50": 1e3 * float(np.median(exposed)),
        "exposed_ms_max": 1e3 * float(np.max(exposed)),
        "plan_cpu_ms_per_micro_batch": 1e3
        * float(
            sum(sum(r.plan_cpu_s[warmup:]) for r in results) / len(results) / max(1, mb / replicas)
        ),
    }


def compare_global_testbed(
    cluster: Cluster,
    model: ModelSpec,
    shape: str,
    doc_lengths: Sequence[int],
    *,
    seq_length: int,
    samples: int,
    steps: int,
    warmup: int,
    seed: int = 0,
    doc_scale: float = DOC_SCALE,
    kernel: str = "auto",
    only: Sequence[str] | None = None,
) -> dict[str, Any]:
    """Every scheme on the same global batches (module docstring); the comparison record."""
    if not 0 < doc_scale <= 1:
        raise HexiSeqError(f"--doc-scale must be in (0, 1], got {doc_scale}")
    scaled = [max(1, round(x * doc_scale)) for x in doc_lengths]
    packed = global_batches(scaled, seq_length, samples, steps, seed)
    batches = [units_of(b) for b in packed]
    options = TrainOptions.for_model(model)
    schemes = schemes_for(cluster, model, options, packed, scaled)
    out: dict[str, Any] = {}
    for name, (structure, replicas, scheme, doms) in schemes.items():
        if only and not any(name.startswith(o) for o in only):
            continue
        out[name] = run_scheme(
            name, structure, replicas, scheme, doms, batches, model, shape, warmup, kernel
        )
    if not only or "fast-only" in only:
        out["fast-only"] = _fast_only(
            cluster, model, options, packed, batches, shape, warmup, kernel
        )
    ref = next(iter(out.values()))["losses"]
    worst = max(
        abs(a - b) / max(abs(a), 1e-12) for r in out.values() for a, b in zip(ref, r["losses"])
    )
    best_base = max(
        (k for k in out if k != "hexiseq-global"),
        key=lambda k: out[k]["tokens_per_s"],
        default=None,
    )
    return {
        "testbed": shape,
        "cluster": cluster.name,
        "model": model.name,
        "seq_length": seq_length,
        "samples_per_step": samples,
        "steps": steps,
        "warmup": warmup,
        "seed": seed,
        "doc_scale": doc_scale,
        "kernel": kernel,
        "units_per_step": [len(b) for b in batches],
        "schemes": out,
        "best_baseline": best_base,
        "speedup_over_best": (
            out["hexiseq-global"]["tokens_per_s"] / out[best_base]["tokens_per_s"]
            if best_base and "hexiseq-global" in out
            else None
        ),
        "loss_max_rel_diff": worst,
        "losses_agree": worst <= LOSS_RTOL,
    }


def _fast_only(cluster, model, options, packed, batches, shape, warmup, kernel) -> dict[str, Any]:
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
    cfg_shape = "1"
    rec = run_scheme("fast-only", ring, 1, scheme, doms, batches, model, cfg_shape, warmup, kernel)
    rec["rank"] = first
    return rec
