"""The CPU testbed's global-batch schemes before training (layer (a): no processes).

On a profile of the ``1+3`` testbed (one rank alone on a core, three sharing the other; the
cpu-demo model, 2048-token samples): ``hexiseq-global``'s domain set is chosen among candidates that
include every stock scheme's domain set (one-rank replicas, pairs, the whole testbed, one domain
per GPU type), and on its own choice batches it is priced faster than every stock scheme on
another domain set, and within 1% of one on the same one-rank domains (both greedy schedules of
whole documents there, differing in where the last units land). With 4
GiB declared every scheme fits and the one-rank domains win; with 0.045 GiB one rank cannot hold a
sample (about 50 MiB), so the one-rank schemes and fast-only are reported infeasible with their
reason and are not trained, and hexiseq-global's choice moves to domains of several ranks.
"""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest

from megatron_hexiseq.cluster import Cluster, cluster_from_dict
from megatron_hexiseq.model import get_model
from megatron_hexiseq.run_config import TrainOptions
from megatron_hexiseq.testbed import global_packed
from megatron_hexiseq.testbed.global_packed import compare_global_testbed
from megatron_hexiseq.testbed.global_schemes import fast_only, price_scheme, schemes_for
from megatron_hexiseq.varlen.global_compare import (
    CHOICE_SEED,
    CHOICE_STEPS,
    global_batches,
    units_of,
)
from megatron_hexiseq.varlen.packing import heavy_tailed_lengths

S, SAMPLES = 2048, 8
MODEL = get_model(config_path="examples/models/cpu-demo.yaml", overrides={"seq_length": S})
# document lengths with a median of a quarter sample, some longer than a sample
DOCS = heavy_tailed_lengths(2000, seed=3, median=512)


def _gpu(tflops: float, attn: float, nvlink: float, overhead_ms: float) -> dict:
    return {
        "bf16_tflops": tflops,
        "attention_tflops": attn,
        "memory_gib": 4.0,
        "nvlink_GBps": nvlink,
        "efficiency": 1.0,
        "attention_curves": {
            "cpu-flash/causal": [[1088.0, 0.03], [16640.0, 0.25], [263168.0, 0.5], [16785408.0, 1]],
            "cpu-flash/full": [[2048.0, 0.04], [32768.0, 0.5], [524288.0, 1.0], [33554432.0, 1.3]],
        },
        "step_overhead_ms": overhead_ms,
        "collective_latency_us": 2141.2,
        "p2p_latency_us": 1610.65,
        "window_overhead_us": 197.8,
    }


# a profile of the 1+3 testbed on a 2-core VM (profile --testbed 1+3, rounded)
SPEC = {
    "name": "cpu-testbed-1+3",
    "gpus": {
        "CPU-vm-c0": _gpu(0.0963, 0.0787, 5.5, 22.8),
        "CPU-vm-c1": _gpu(0.0268, 0.0247, 3.06, 30.1),
    },
    "nodes": [
        {"name": "vm-c0", "gpu": "CPU-vm-c0", "count": 1, "nvlink_GBps": 5.5,
         "network_GBps": 7.9, "shared_core": True},
        {"name": "vm-c1", "gpu": "CPU-vm-c1", "count": 3, "nvlink_GBps": 3.06,
         "network_GBps": 7.9, "shared_core": True},
    ],
}  # fmt: skip


def _cluster(memory_gib: float, shared_faster: bool = False) -> Cluster:
    """The profile with ``memory_gib`` per rank; ``shared_faster``: the shared core's ranks
    profiled faster than the lone one (as under other load), so the canonical order starts there
    and Megatron's grid over it is not the driver's."""
    spec = copy.deepcopy(SPEC)
    for gpu in spec["gpus"].values():
        gpu["memory_gib"] = memory_gib
    if shared_faster:
        a, b = spec["gpus"]["CPU-vm-c0"], spec["gpus"]["CPU-vm-c1"]
        a["bf16_tflops"], b["bf16_tflops"] = 0.02, 0.05
    return cluster_from_dict(spec)


def _on_choice_batches(cluster: Cluster) -> tuple[dict, dict, list[list[int]]]:
    """Every scheme built on the choice batches (``CHOICE_SEED``), the choice record, the units."""
    packed = global_batches(DOCS, S, SAMPLES, CHOICE_STEPS, CHOICE_SEED)
    options = TrainOptions.for_model(MODEL)
    schemes, choice = schemes_for(cluster, MODEL, options, packed, DOCS)
    schemes["fast-only"] = fast_only(cluster, MODEL, options, packed, "1+3")
    return schemes, choice, [units_of(b) for b in packed]


@pytest.mark.parametrize("memory_gib, shared_faster", [(4.0, False), (0.045, False), (4.0, True)])
def test_hexiseq_choice_includes_the_stock_domain_sets_and_is_not_slower(
    memory_gib: float, shared_faster: bool
):
    schemes, choice, batches = _on_choice_batches(_cluster(memory_gib, shared_faster))
    rows = {str(r["blocks"]): r for r in choice["candidates"]}
    for name, sch in schemes.items():
        if name in ("hexiseq-global", "fast-only"):
            continue
        assert str([list(d.ranks) for d in sch.domains]) in rows, name  # a candidate
    assert rows[str([[0], [1, 2, 3]])]["reason"].startswith("the driver runs replicas")
    m = replace(MODEL, seq_length=S)
    priced = {k: price_scheme(v, batches, m) for k, v in schemes.items()}
    ours, problem = priced.pop("hexiseq-global")
    assert problem is None
    feasible = {k: sum(p) for k, (p, why) in priced.items() if why is None}
    chosen = schemes["hexiseq-global"].domains
    for name, theirs in feasible.items():
        if [d.ranks for d in schemes[name].domains] == [d.ranks for d in chosen]:
            # the same one-rank domains: two greedy schedules of whole documents (HexiSeq's
            # tables scaled by its measured efficiency, the stock ring's not) that differ only
            # in where the last units land
            assert sum(ours) <= 1.01 * theirs, (name, sum(ours), theirs)
        else:
            assert sum(ours) < theirs, (name, sum(ours), theirs)
    if shared_faster:
        return
    if memory_gib == 4.0:  # one rank holds a sample: every scheme fits, one-rank domains win
        assert len(feasible) == len(priced)
        assert [list(d.ranks) for d in chosen] == [[0], [1], [2], [3]]
    else:  # a sample needs two ranks: no one-rank scheme, no one-rank domain
        assert {k for k in priced if k not in feasible} == {
            "megatron-cp-dp(cp=1)",
            "speed-aware-packing(cp=1)",
            "fast-only",
        }
        assert min(d.size for d in chosen) >= 2
        assert "does not fit in memory" in rows[str([[0], [1], [2], [3]])]["reason"]


def test_infeasible_schemes_are_reported_with_their_reason_and_not_trained(monkeypatch):
    def no_training(*args, **kwargs):
        raise AssertionError("an infeasible scheme was trained")

    monkeypatch.setattr(global_packed, "run_scheme", no_training)
    rec = compare_global_testbed(
        _cluster(0.045), MODEL, "1+3", DOCS, seq_length=S, samples=SAMPLES, steps=2, warmup=0,
        doc_scale=1.0, only=["megatron-cp-dp(cp=1)", "speed-aware-packing(cp=1)", "fast-only"],
    )  # fmt: skip
    out = rec["schemes"]
    assert set(out) == {"megatron-cp-dp(cp=1)", "speed-aware-packing(cp=1)", "fast-only"}
    assert "rank 0 needs 5" in out["megatron-cp-dp(cp=1)"]["infeasible"]  # ~50 MiB > 43.8
    assert "(16 of 16 micro-batches over)" in out["megatron-cp-dp(cp=1)"]["infeasible"]
    assert "fits no domain" in out["speed-aware-packing(cp=1)"]["infeasible"] or (
        "does not fit the domains' memory" in out["speed-aware-packing(cp=1)"]["infeasible"]
    )
    assert "on ranks [0]" in out["fast-only"]["infeasible"]
    assert rec["best_baseline"] is None and rec["speedup_over_best"] is None
    mem = rec["memory"]
    assert mem["min_ranks_per_sample"] == 2 and mem["usable_mib_per_rank"] == pytest.approx(43.8)
    assert mem["sample_mib_per_rank"][1] > 43.8 >= mem["sample_mib_per_rank"][2]
    # with 4 GiB they fit and would be trained
    rec = compare_global_testbed(
        _cluster(4.0), MODEL, "1+3", DOCS, seq_length=S, samples=SAMPLES, steps=2, warmup=0,
        doc_scale=1.0, only=["fast-only"], train=False,
    )  # fmt: skip
    assert "infeasible" not in rec["schemes"]["fast-only"]
    assert rec["memory"]["min_ranks_per_sample"] == 1


def test_each_micro_batch_pays_its_measured_overhead_once_the_step_the_rest():
    """``predict_steps``: a priced micro-batch carries the whole step overhead; a step of m
    micro-batches pays it once and ``micro_batch_overhead_ms`` m - 1 times more: Megatron's own
    grid (one four-rank ring, 8 micro-batches per step, layouts that do not depend on it) is
    priced exactly 7 x the largest per-micro-batch overhead slower with it than without."""
    spec = copy.deepcopy(SPEC)
    spec["gpus"]["CPU-vm-c0"]["micro_batch_overhead_ms"] = 4.0
    spec["gpus"]["CPU-vm-c1"]["micro_batch_overhead_ms"] = 9.0
    packed = global_batches(DOCS, S, SAMPLES, 2, CHOICE_SEED)
    batches = [units_of(b) for b in packed]
    m = replace(MODEL, seq_length=S)
    options = TrainOptions.for_model(MODEL)
    steps = []
    for cluster in (cluster_from_dict(SPEC), cluster_from_dict(spec)):
        schemes, _ = schemes_for(cluster, MODEL, options, packed, DOCS)
        sch = schemes["megatron-cp-dp(cp=4)"]
        assert sch.replicas == 1
        predicted, problem = price_scheme(sch, batches, m)
        assert problem is None
        steps.append(predicted)
    for without, with_ in zip(*steps):
        assert with_ - without == pytest.approx(7 * 0.009, rel=1e-9)
