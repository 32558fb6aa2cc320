"""Global-batch training on the CPU driver (``testbed/global_train.py``), layer (b): 4 gloo ranks vs 1.

Two domains (Megatron's data-parallel replicas of a 2-rank structure: two single-rank groups,
every head each) train the tiny GPT on global batches of packed documents: (1) ``hexiseq-global``
(the global planner's bins, uneven micro-batch counts and tokens between the domains, a
``BatchPlanner`` layout per bin), (2) ``megatron-cp-dp`` (sample i to replica i mod 2, THD
zig-zag per document). Each rank reads only its domain's documents, plans one step ahead in a
thread and checks the schedule and every micro-batch's layout with the other ranks. Per-token
losses of 2 AdamW steps and step 0's gradients equal the single-process model that runs every
document alone (fp32 reordering tolerance), every unit of a step lands in exactly one micro-batch,
and each micro-batch's exposed host time is recorded.
"""

from __future__ import annotations

import pytest
import torch
from test_megatron_gpt import FP32_UNIT_ROUNDOFF

from megatron_hexiseq.cluster import cluster_from_dict
from megatron_hexiseq.layout import make_layout
from megatron_hexiseq.run_config import TrainOptions
from megatron_hexiseq.testbed.global_schemes import (
    PlannedScheme,
    SampleOrder,
    _domains,
    _ring_structure,
)
from megatron_hexiseq.testbed.global_train import (
    GlobalTrainConfig,
    train_global_rank,
    train_global_reference,
)
from megatron_hexiseq.testbed.spawn import run_ranks
from megatron_hexiseq.testbed.train_config import TINY_GPT
from megatron_hexiseq.varlen.global_planner import GlobalPlanner

CLUSTER = cluster_from_dict(
    {
        "name": "t4",
        "nodes": [
            {"name": "a", "gpu": "H100-SXM-80GB", "count": 2, "network_GBps": 25},
            {"name": "b", "gpu": "A100-SXM-80GB", "count": 2, "network_GBps": 25},
        ],
    }
)
S = 64
SAMPLES = (((20, 3, 41), (64,), (10, 10, 1, 43), (30, 34)), ((64,), (5, 59), (1, 1, 62), (64,)))
UNITS = tuple(tuple(x for s in step for x in s) for step in SAMPLES)
MODEL = TINY_GPT


def _structure():
    return make_layout(
        seq_length=S,
        num_attention_heads=MODEL.num_attention_heads,
        num_query_groups=MODEL.num_query_groups,
        group_sizes=[1, 1],
        segments=[[(0, 32)], [(32, 64)]],
        heads=[list(range(8)), list(range(8))],
        hosts=["a", "a"],
        gpus=["H100-SXM-80GB"] * 2,
    )


def _configs() -> list[GlobalTrainConfig]:
    options = TrainOptions()
    structure = _structure()
    blocks = [[0, 1], [2, 3]]
    doms = _domains(CLUSTER, blocks, structure, options, [3, 1])  # uneven counts: H100s faster
    hexiseq = PlannedScheme(GlobalPlanner(doms, MODEL), structure)
    ring = _ring_structure(CLUSTER, MODEL, [0, 1])
    rdoms = _domains(CLUSTER, blocks, ring, options, [2, 2])
    cpdp = SampleOrder(
        GlobalPlanner(rdoms, MODEL, mode="zigzag"), ring, [[len(s) for s in st] for st in SAMPLES]
    )
    base = dict(model=MODEL, replicas=2, batches=UNITS, kernel="reference", return_grads=True)
    return [
        GlobalTrainConfig(structure=structure, scheme=hexiseq, **base),
        GlobalTrainConfig(structure=ring, scheme=cpdp, **base),
    ]


@pytest.fixture(scope="module")
def runs():
    cfgs = _configs()
    parallel = [run_ranks(train_global_rank, 4, cfg, timeout_s=600) for cfg in cfgs]
    ref = run_ranks(train_global_reference, 1, cfgs[0], timeout_s=600)[0]
    return cfgs, parallel, ref


@pytest.mark.parametrize("case", [0, 1], ids=["hexiseq-global", "megatron-cp-dp"])
def test_global_batches_match_single_process(runs, case: int) -> None:
    cfgs, parallel, ref = runs
    results = parallel[case]
    n = sum(UNITS[0])
    tol = 2 * n * FP32_UNIT_ROUNDOFF / (1 - n * FP32_UNIT_ROUNDOFF) * (MODEL.num_layers + 1)
    for res in results:
        torch.testing.assert_close(
            torch.tensor(res.losses), torch.tensor(ref.losses), rtol=tol, atol=0
        )
        assert len(res.exposed_s) == sum(len(b) for b in res.bins) and min(res.exposed_s) >= 0
        assert len(res.plan_cpu_s) == len(UNITS)
    for step, units in enumerate(UNITS):  # every unit in exactly one micro-batch of one domain
        placed = sorted(u for d in (0, 2) for b in results[d].bins[step] for u in b)
        assert placed == list(range(len(units)))
        assert results[0].bins[step] == results[1].bins[step]  # a domain's ranks agree
    if case == 0:  # the faster domain took more micro-batches and more tokens
        assert len(results[0].bins[0]) == 3 and len(results[2].bins[0]) == 1
    got = results[0].grads
    for name, want in ref.grads.items():
        assert want.abs().max() > 0, name
        torch.testing.assert_close(
            got[name], want, rtol=tol, atol=tol * float(want.abs().max()), msg=name
        )
