"""Ranks that plan independently check that they agree (``megatron.agreement``, ``varlen.digest``).

Layer (a): digests of layouts and schedules: equal plans give equal digests, one moved token or one
moved document gives another; a one-ULP change of one rate of a homogeneous structure's batch
planner changes its plan (the hazard the check exists for: near-ties are everywhere when GPUs are
alike).
Layer (b), 3 gloo ranks: the real prepared-ahead path (``batch_ahead.Preparer``: boundaries from the
CPU tokens, the planner's layout, the agreement check on the domain's gloo side group) with rank 1's
planner one ULP off: every rank stops with the same ``HexiSeqError`` naming rank 1 against ranks
0 and 2, well before the run's deadline (not a timeout); with equal planners nothing is raised.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from megatron_hexiseq.cluster import cluster_from_dict
from megatron_hexiseq.errors import HexiSeqError
from megatron_hexiseq.layout import make_layout
from megatron_hexiseq.model import get_model
from megatron_hexiseq.run_config import TrainOptions
from megatron_hexiseq.testbed.spawn import run_ranks
from megatron_hexiseq.varlen.batch import BatchPlanner
from megatron_hexiseq.varlen.digest import digest_ints, layout_digest
from megatron_hexiseq.varlen.global_batch import DomainCosts, schedule_global

CLUSTER = cluster_from_dict(
    {"name": "t", "nodes": [{"name": "a", "gpu": "H100-SXM-80GB", "count": 3, "network_GBps": 25}]}
)
MODEL = get_model("gpt-tiny")
STRUCTURE = make_layout(
    seq_length=96,
    num_attention_heads=MODEL.num_attention_heads,
    num_query_groups=MODEL.num_query_groups,
    group_sizes=[1, 1, 1],
    segments=[[(0, 32)], [(32, 64)], [(64, 96)]],
    heads=[list(range(MODEL.num_attention_heads))] * 3,
    hosts=["a"] * 3,
    gpus=["H100-SXM-80GB"] * 3,
)
LENGTHS = [32, 32, 32]  # three equal documents on three equal GPUs: every choice is a tie
EOD = MODEL.vocab_size - 1


def _planner(ulp: bool) -> BatchPlanner:
    """The batch planner; ``ulp``: group 0's linear seconds per token one ULP higher."""
    p = BatchPlanner(STRUCTURE, CLUSTER, MODEL, TrainOptions())
    if ulp:
        lin = p.linear_per_token.copy()
        lin[0] = np.nextafter(lin[0], np.inf)
        p.linear_per_token = lin
    return p


def test_digests_tell_plans_apart() -> None:
    a = _planner(False).plan(LENGTHS, or_structure=False)
    b = _planner(True).plan(LENGTHS, or_structure=False)
    assert a.layout != b.layout  # one ULP flips a tie: the hazard
    assert layout_digest(a.layout, a.cu_seqlens) == layout_digest(
        replace(a.layout, meta={"x": 1}), a.cu_seqlens
    )
    assert layout_digest(a.layout, a.cu_seqlens) != layout_digest(b.layout, b.cu_seqlens)
    assert layout_digest(a.layout, (0, 32, 64, 96)) != layout_digest(a.layout, (0, 33, 64, 96))
    assert 0 <= digest_ints([1, 2, 3]) < 2**63
    assert digest_ints([1, 23]) != digest_ints([12, 3])
    t = [DomainCosts(1, 1, 0, 100)] * 2
    s1 = schedule_global([5, 4, 3], t, [1, 1])
    assert s1.digest() == schedule_global([5, 4, 3], list(t), [1, 1]).digest()
    assert s1.digest() != schedule_global([3, 4, 5], t, [1, 1]).digest()


def _rank(rank: int, world: int, perturb: int | None) -> str | None:
    import torch
    import torch.distributed as dist

    from megatron_hexiseq.attention.groups import build_hexiseq_groups
    from megatron_hexiseq.megatron.batch_ahead import Preparer
    from megatron_hexiseq.megatron.batch_layout import MicroBatchLayout, PlannerLayouts
    from megatron_hexiseq.megatron.documents import MicroBatchDocuments

    groups = build_hexiseq_groups(STRUCTURE)
    slot = MicroBatchLayout(groups, PlannerLayouts(_planner(rank == perturb)))
    docs = MicroBatchDocuments(
        seq_length=96, eod_token=EOD, reset_position_ids=False, required=True
    )
    side = dist.new_group(list(range(world)), backend="gloo")
    prepare = Preparer(docs, slot, reset_attention_mask=True, side_group=side, pin=False)
    tokens = torch.zeros(1, 96, dtype=torch.long)
    tokens[0, np.cumsum(LENGTHS) - 1] = EOD
    try:
        got = prepare({"tokens": tokens, "labels": tokens, "loss_mask": torch.ones(1, 96)})
    except HexiSeqError as e:
        return str(e)
    assert got.tensors["tokens"].shape == (1, got.plan.num_tokens)
    return None


@pytest.mark.parametrize("perturb", [None, 1])
def test_one_ulp_on_one_rank_is_one_error_naming_it(perturb: int | None) -> None:
    import time

    t0 = time.perf_counter()
    out = run_ranks(_rank, 3, perturb, timeout_s=300)
    if perturb is None:
        assert out == [None, None, None]
        return
    assert len(set(out)) == 1 and out[0] is not None, out
    assert "micro-batch 0: ranks [1] hold a different plan than ranks [0, 2]" in out[0]
    assert time.perf_counter() - t0 < 300
