"""Global batches on the CPU testbed: HexiSeq's global-batch scheduling against the stock schemes
that run here, trained on the same steps (``global_train``), within a declared memory.

Every scheme trains the same global batches (``samples`` loader samples of ``S`` tokens per step,
packed from the scaled lengths; a document cut at a sample boundary is two units) from the same
weights, on the same testbed shape; attention is exact, so the losses must agree (``LOSS_RTOL``).
The schemes (``global_schemes``):

- ``hexiseq-global``: the domain set ``varlen`` would choose
  (``global_schemes.choose_testbed_domains``: among candidates that include every stock scheme's domain set, by the comparison's own model on
  batches of the choice's seed), each kind of domain planned by ``plan`` and ``plan --doc-lengths``,
  micro-batch counts by speed, ``varlen.global_planner.GlobalPlanner``: units to (domain,
  micro-batch) bins by integer cost, each bin ``BatchPlanner``-planned in its domain.
- ``megatron-cp-dp`` (``cp`` = c, every c dividing the ranks that Megatron accepts): CP rings of c
  consecutive ranks, DP = W / c, sample i to replica i mod DP, every document in 2c zig-zag chunks
  (on this project's runtime, so the K/V exchange is pruned: stronger than Transformer Engine's
  ring).
- ``speed-aware-packing`` (c): whole units onto the same rings by predicted speed (the global
  scheduler with zig-zag cost tables).
- ``fast-only``: the fastest rank alone (its own pinned core), every sample in turn.

Megatron's hybrid CP does not run here: its per-sub-sample CP groups and barriers are not in the
CPU driver (it is compared in the cost model, ``varlen.global_compare``).

**Memory.** The profile's ``memory_gib`` is the declared memory of every rank. Before anything is
trained, every scheme's micro-batches on the compared steps are priced (``price_scheme``: the bins
and layouts its ranks will compute); one over ``capacity_fraction`` of that memory (or a unit its
scheduler finds no room for) makes the scheme infeasible: reported with the reason, not trained,
never the best baseline. A small declared memory emulates long-context training, where one rank
cannot hold a sample (``sample_memory``: what a sample needs on 1, 2, 4, ... ranks).

Measured throughput: the measured steps' tokens / their summed wall time (the slowest rank's
step); predicted: ``global_schemes.predict_steps`` on the bins and layouts the ranks ran; error =
summed predicted / summed measured - 1. Exposed planning: the training thread's wait for the
planning thread plus its copies, per micro-batch (``GlobalTrainResult.exposed_s``); planning CPU:
the planning thread's CPU time per micro-batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import numpy as np

from megatron_hexiseq.cluster import Cluster
from megatron_hexiseq.errors import HexiSeqError
from megatron_hexiseq.model import ModelSpec
from megatron_hexiseq.run_config import TrainOptions
from megatron_hexiseq.testbed.global_schemes import (
    TestbedScheme,
    fast_only,
    predict_steps,
    price_scheme,
    sample_memory,
    schemes_for,
)
from megatron_hexiseq.testbed.global_train import GlobalTrainConfig, train_global_rank
from megatron_hexiseq.testbed.pinning import TestbedShape, cpu_sets
from megatron_hexiseq.testbed.spawn import run_ranks
from megatron_hexiseq.varlen.global_compare import global_batches, units_of

LOSS_RTOL = 1e-4
DOC_SCALE = 1 / 16
MIB = 2**20


def run_scheme(
    name: str,
    sch: TestbedScheme,
    batches: Sequence[Sequence[int]],
    model: ModelSpec,
    shape: str,
    warmup: int,
    kernel: str,
) -> dict[str, Any]:
    """Train one scheme on the pinned testbed; its measured and predicted record."""
    structure, replicas, domains = sch.structure, sch.replicas, sch.domains
    cfg = GlobalTrainConfig(
        model=model,
        structure=structure,
        replicas=replicas,
        batches=tuple(tuple(int(x) for x in b) for b in batches),
        scheme=sch.scheme,
        kernel=kernel,
    )
    tb = TestbedShape.parse(sch.shape or shape)
    W = structure.world_size
    results = run_ranks(train_global_rank, W * replicas, cfg, cpu_sets=cpu_sets(tb))
    steps = len(batches)
    measured = [max(r.step_times_s[s] for r in results) for s in range(steps)]
    bins = [[results[d * W].bins[s] for s in range(steps)] for d in range(replicas)]
    lays = [[results[d * W].layouts[s] for s in range(steps)] for d in range(replicas)]
    predicted, _ = predict_steps(bins, lays, batches, domains, model, "pruned")
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
    train: bool = True,
) -> dict[str, Any]:
    """Every scheme on the same global batches (module docstring); the comparison record. A
    scheme that does not fit the declared memory (``price_scheme``) is reported with its reason
    and not trained; ``train=False``: none is (the choice, the predictions and the memory check
    only)."""
    if not 0 < doc_scale <= 1:
        raise HexiSeqError(f"--doc-scale must be in (0, 1], got {doc_scale}")
    scaled = [max(1, round(x * doc_scale)) for x in doc_lengths]
    packed = global_batches(scaled, seq_length, samples, steps, seed)
    batches = [units_of(b) for b in packed]
    options = TrainOptions.for_model(model)
    m = replace(model, seq_length=seq_length)
    schemes, choice = schemes_for(cluster, model, options, packed, scaled)
    schemes["fast-only"] = fast_only(cluster, model, options, packed, shape)
    out: dict[str, Any] = {}
    if "hexiseq-global" not in schemes:
        why = "; ".join(f"{r['name']}: {r['reason']}" for r in choice["candidates"])
        out["hexiseq-global"] = {
            "name": "hexiseq-global",
            "domains": None,
            "predicted_tokens_per_s": None,
            "infeasible": f"no candidate domain set plans ({why})",
        }
    tokens = sum(sum(batches[s]) for s in range(warmup, steps))
    for name, sch in schemes.items():
        if only and not any(name.startswith(o) for o in only):
            continue
        predicted, problem = price_scheme(sch, batches, m)
        if problem is not None or not train:
            out[name] = {
                "name": name,
                "domains": [list(d.ranks) for d in sch.domains],
                "predicted_tokens_per_s": tokens / sum(predicted[warmup:]) if predicted else None,
            }
            if problem is not None:
                out[name]["infeasible"] = problem
        else:
            out[name] = run_scheme(name, sch, batches, model, shape, warmup, kernel)
    trained = {k: v for k, v in out.items() if "tokens_per_s" in v}
    ref = next(iter(trained.values()))["losses"] if trained else []
    worst = max(
        (
            abs(a - b) / max(abs(a), 1e-12)
            for r in trained.values()
            for a, b in zip(ref, r["losses"])
        ),
        default=0.0,
    )
    best_base = max(
        (k for k in trained if k != "hexiseq-global"),
        key=lambda k: trained[k]["tokens_per_s"],
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
        "memory": sample_memory(cluster, m, options),
        "hexiseq_choice": choice,
        "schemes": out,
        "best_baseline": best_base,
        "speedup_over_best": (
            trained["hexiseq-global"]["tokens_per_s"] / trained[best_base]["tokens_per_s"]
            if best_base and "hexiseq-global" in trained
            else None
        ),
        "loss_max_rel_diff": worst,
        "losses_agree": worst <= LOSS_RTOL,
    }
