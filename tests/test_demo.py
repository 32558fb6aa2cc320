"""The demo's training path, short version (layer (b): gloo ranks pinned like the testbed).

A fixed heterogeneous 3-rank cluster (one fast core, two ranks sharing a slow one), a tiny model,
the real planner: the HexiSeq layout differs from the best symmetric one, both train 2 steps from
the same weights on the same data, and their losses agree with each other and with the
single-process reference (exact attention => only fp reordering; the bound is
``test_megatron_gpt.reordering_tolerance``). Layer (a) for the checks before any process starts.
"""

import os

import pytest
import torch
from test_megatron_gpt import reordering_tolerance  # the fp32 two-orderings bound, derived there

from megatron_hexiseq.cluster import cluster_from_dict
from megatron_hexiseq.costmodel import TrainOptions
from megatron_hexiseq.errors import HexiSeqError
from megatron_hexiseq.layout import make_layout
from megatron_hexiseq.model import model_from_dict
from megatron_hexiseq.planner.plan import plan
from megatron_hexiseq.testbed.demo import LOSS_RTOL, best_symmetric_layout, compare, driver_config
from megatron_hexiseq.testbed.spawn import run_ranks
from megatron_hexiseq.testbed.train import reference_rank

CLUSTER = {
    "name": "testbed-1+2",
    "gpus": {
        "FAST": {
            "bf16_tflops": 0.02,
            "attention_tflops": 0.01,
            "memory_gib": 4,
            "nvlink_GBps": 2,
            "efficiency": 1.0,
        },
        "SLOW": {
            "bf16_tflops": 0.01,
            "attention_tflops": 0.005,
            "memory_gib": 4,
            "nvlink_GBps": 2,
            "efficiency": 1.0,
        },
    },
    "nodes": [
        {"name": "h-c0", "gpu": "FAST", "count": 1, "network_GBps": 2},
        {"name": "h-c1", "gpu": "SLOW", "count": 2, "network_GBps": 2},
    ],
}
MODEL = {
    "name": "demo-tiny",
    "num_layers": 2,
    "hidden_size": 64,
    "num_attention_heads": 8,
    "num_query_groups": 2,
    "ffn_hidden_size": 128,
    "vocab_size": 128,
    "swiglu": True,
    "normalization": "RMSNorm",
    "add_bias_linear": False,
    "seq_length": 384,
}


def _problem():
    cluster = cluster_from_dict(CLUSTER)
    model = model_from_dict(MODEL)
    return cluster, model, TrainOptions()


def test_planner_picks_an_uneven_layout_for_the_testbed():
    cluster, model, options = _problem()
    layout = plan(cluster, model, model.seq_length, options, reproducible=True)
    label, sym = best_symmetric_layout(cluster, model, options)
    assert sym.is_symmetric() and not layout.is_symmetric()
    fast = layout.ranks[0].num_tokens
    assert all(fast > r.num_tokens for r in layout.ranks[1:]), (
        "the fast rank should hold the most tokens"
    )


def test_cpu_driver_rejects_models_it_cannot_build():
    bad = model_from_dict({**MODEL, "kv_channels": 4})
    one_rank = make_layout(
        seq_length=384,
        num_attention_heads=8,
        num_query_groups=2,
        group_sizes=[1],
        segments=[[(0, 384)]],
        heads=[list(range(8))],
    )
    driver_config(
        one_rank, model_from_dict(MODEL), steps=2
    )  # the same layout with a buildable model
    with pytest.raises(HexiSeqError, match="kv_channels"):
        driver_config(one_rank, bad, steps=2)


def test_layouts_megatron_cannot_run_fail_before_any_process_starts():
    model = model_from_dict(MODEL)
    heads_only = make_layout(
        seq_length=384,
        num_attention_heads=8,
        num_query_groups=2,
        group_sizes=[3],
        segments=[[(0, 384)], [], []],
        heads=[[], [0, 1, 2, 3], [4, 5, 6, 7]],
    )
    with pytest.raises(HexiSeqError, match=r"ranks \[1, 2\] hold no tokens"):
        driver_config(heads_only, model, steps=1)


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="the testbed needs 2 cores")
def test_symmetric_and_hexiseq_training_losses_agree():
    cluster, model, options = _problem()
    layout = plan(cluster, model, model.seq_length, options, reproducible=True)
    rec = compare(cluster, model, options, layout, "1+2", steps=2, warmup=1)
    s, h = rec["symmetric"]["losses"], rec["hexiseq"]["losses"]
    assert len(s) == len(h) == 2
    assert rec["losses_agree"], (s, h)
    assert all(abs(a - b) <= LOSS_RTOL * abs(a) for a, b in zip(s, h))
    assert rec["symmetric"]["per_rank_tokens"] != rec["hexiseq"]["per_rank_tokens"]
    assert rec["speedup_predicted"] > 1.0
    cfg = driver_config(layout, model, steps=2)
    ref = run_ranks(reference_rank, 1, cfg)[
        0
    ].losses  # same weights and data, unsharded, one process
    for losses in (s, h):
        torch.testing.assert_close(
            torch.tensor(losses), torch.tensor(ref), rtol=reordering_tolerance(cfg), atol=0
        )
