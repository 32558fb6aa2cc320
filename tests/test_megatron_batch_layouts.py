"""Per-micro-batch layouts through real Megatron-LM ``core_v0.16.1``: layer (b), 3 gloo ranks vs 1.

``--reset-attention-mask --reset-position-ids --eod-mask-loss`` as in tests/test_megatron_documents.py,
with a per-micro-batch layout provider passed to ``plugin.model_provider``: the job's groups come
from the job's [2, 1] layout, and two consecutive micro-batches each run their own layout of that
structure (several runs per rank, other token counts than the job's): the slicer
``pretrain_gpt.get_batch_on_this_cp_rank`` hands each rank that layout's positions and RoPE rotates
them (per-sample boundaries in the first micro-batch: global positions; shared boundaries in the
second: positions inside each document). Per-token losses and the gradient of the masked loss sum of
every parameter (summed over the CP ranks) must equal stock single-process Megatron's (CP 1, dense
document mask from ``_get_ltor_masks_and_position_ids``) for each micro-batch. The losses are placed
by the micro-batch's layout: a slicer or RoPE that kept the job's positions fails. The same with
``--hexiseq-batch-plan`` (the batch planner built from the cluster and model recorded in the
layout chooses each micro-batch's layout). Needs ``MEGATRON_LM`` as tests/test_megatron_lm.py does.
"""

from __future__ import annotations

import contextlib
import os
import sys

import pytest
from test_megatron_documents import COMMON, EOD, LAYOUT, S, _parse, _step

from megatron_hexiseq.layout import Layout, make_layout
from megatron_hexiseq.testbed.spawn import run_ranks

MEGATRON_LM = os.environ.get("MEGATRON_LM")
pytestmark = pytest.mark.skipif(
    not MEGATRON_LM, reason="set MEGATRON_LM=<Megatron-LM core_v0.16.1 checkout>"
)


def _batch_layout(segments: list[list[tuple[int, int]]]) -> Layout:
    return make_layout(
        seq_length=S,
        num_attention_heads=8,
        num_query_groups=2,
        group_sizes=[2, 1],
        segments=segments,
        heads=[list(r.heads) for r in LAYOUT.ranks],
    )


# (EOD positions per sample, data seed, the micro-batch's layout)
MICRO_BATCHES = [
    (
        ([5, 11, 12, 29, 47], [17, 33, 34, 35]),  # per-sample boundaries
        3,
        _batch_layout([[(0, 3), (10, 14), (40, 48)], [(3, 10), (14, 20)], [(20, 40)]]),
    ),
    (
        ([0, 9, 23, 24, 35], [0, 9, 23, 24, 35]),  # shared boundaries: RoPE restarts per document
        4,
        _batch_layout([[(0, 1), (24, 30), (36, 44)], [(1, 24)], [(30, 36), (44, 48)]]),
    ),
]


def _batch(eod_at, seed: int, dense_mask: bool):
    """Megatron's own masks / positions for 2 samples with EOD tokens."""
    import torch
    from megatron.core.datasets.gpt_dataset import _get_ltor_masks_and_position_ids

    g = torch.Generator().manual_seed(seed)
    text = torch.randint(0, 100, (2, S + 1), generator=g)
    for b, where in enumerate(eod_at):
        text[b, where] = EOD
    tokens, labels = text[:, :-1].contiguous(), text[:, 1:].contiguous()
    parts = [
        _get_ltor_masks_and_position_ids(tokens[b], EOD, True, True, True, dense_mask)
        for b in range(2)
    ]
    return {
        "tokens": tokens,
        "labels": labels,
        "loss_mask": torch.stack([p[1] for p in parts]),
        "attention_mask": torch.stack([p[0] for p in parts]) if dense_mask else None,
        "position_ids": torch.stack([p[2] for p in parts]),
    }


class _Table:
    """The provider: the micro-batch's layout looked up by its boundaries (deterministic)."""

    def __init__(self) -> None:
        from megatron_hexiseq.megatron.documents import eod_boundaries

        self.layouts = {}
        for eod_at, seed, lay in MICRO_BATCHES:
            bounds = eod_boundaries(_batch(eod_at, seed, False)["tokens"], EOD)
            key = tuple(tuple(b) for b in bounds)
            self.layouts[key[:1] if len(set(key)) == 1 else key] = lay

    def __call__(self, bounds) -> Layout:
        return self.layouts[bounds.samples]


def _hexiseq_worker(
    rank: int, world: int, checkout: str, layout_path: str, flag: bool = False
) -> list[dict]:
    sys.path.insert(0, checkout)
    import pretrain_gpt as stock
    import torch
    from megatron.core import parallel_state as mpu
    from megatron.core.process_groups_config import ProcessGroupCollection

    from megatron_hexiseq.megatron import plugin

    argv = COMMON + ["--context-parallel-size", "3", "--cp-comm-type", "hexiseq"]
    argv += ["--hexiseq-layout", layout_path, "--hexiseq-kernel", "reference"]
    argv += ["--no-create-attention-mask-in-dataloader"]
    argv += ["--hexiseq-batch-plan"] if flag else []
    _parse(argv, rank, world)
    mpu.initialize_model_parallel(tensor_model_parallel_size=1, context_parallel_size=3)
    torch.manual_seed(0)
    provider = plugin.model_provider(
        stock.model_provider, stock.gpt_builder, stock, batch_layouts=None if flag else _Table()
    )
    model = provider(
        pre_process=True,
        post_process=True,
        config=None,
        pg_collection=ProcessGroupCollection.use_mpu_process_groups(),
    )
    runtime = provider.runtime
    assert runtime is not None and runtime.batch_layout is not None
    outs = []
    for eod_at, seed, lay in MICRO_BATCHES:
        got = stock.get_batch(iter([_batch(eod_at, seed, False)]))  # Megatron's own get_batch
        keys = ("tokens", "labels", "loss_mask", "attention_mask", "position_ids")
        out = _step(model, dict(zip(keys, got)))
        plan = runtime.batch_layout.current()
        assert plan.layout == lay or flag
        assert plan.groups.cp_group is runtime.groups.cp_group
        out["positions"] = plan.layout.ranks[rank].positions()
        outs.append(out)
    mpu.destroy_model_parallel()
    return outs


def _reference_worker(rank: int, world: int, checkout: str) -> list[dict]:
    sys.path.insert(0, checkout)
    import pretrain_gpt as stock
    import torch
    from megatron.core import parallel_state as mpu
    from megatron.core.process_groups_config import ProcessGroupCollection

    from megatron_hexiseq.megatron.config import cpu_device_shim

    _parse(COMMON, rank, world)
    mpu.initialize_model_parallel(tensor_model_parallel_size=1, context_parallel_size=1)
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()
    torch.manual_seed(0)
    with cpu_device_shim():
        model = stock.model_provider(
            stock.gpt_builder,
            True,
            True,
            None,
            config=None,
            pg_collection=ProcessGroupCollection.use_mpu_process_groups(),
        )
        outs = [
            _step(model, _batch(eod_at, seed, dense_mask=True)) for eod_at, seed, _ in MICRO_BATCHES
        ]
    mpu.destroy_model_parallel()
    return outs


@pytest.fixture(scope="module")
def refs() -> list[dict]:
    (out,) = run_ranks(_reference_worker, 1, MEGATRON_LM, timeout_s=900)
    return out


# what 'megatron-hexiseq plan' records in a layout for --hexiseq-batch-plan: the job's [2, 1]
# structure on node0 (2 CPUs) + node1 (1 CPU), the test's model, default options
PLANNED_META = {
    "cluster_spec": {
        "name": "cpu-2+1",
        "gpus": {
            "CPU": {
                "bf16_tflops": 0.02,
                "attention_tflops": 0.01,
                "memory_gib": 4,
                "nvlink_GBps": 2,
                "efficiency": 1.0,
            }
        },
        "nodes": [
            {"name": "node0", "gpu": "CPU", "count": 2, "network_GBps": 2},
            {"name": "node1", "gpu": "CPU", "count": 1, "network_GBps": 2},
        ],
    },
    "model_spec": {
        "name": "test-gpt",
        "num_layers": 2,
        "hidden_size": 64,
        "num_attention_heads": 8,
        "num_query_groups": 2,
        "ffn_hidden_size": 96,
        "vocab_size": 128,
        "swiglu": True,
        "normalization": "RMSNorm",
        "add_bias_linear": False,
        "seq_length": S,
    },
    "options": {},
}


def _check(refs: list[dict], results: list[list[dict]]) -> None:
    import torch

    for i, ref in enumerate(refs):
        per_rank = [res[i] for res in results]
        for res in per_rank:
            assert abs(res["params"] - ref["params"]) < 1e-9  # the same weights
        losses = torch.full_like(ref["losses"], float("nan"))
        for res in per_rank:
            losses[:, res["positions"]] = res["losses"]
        # fp32 sums over <= 2 x 48 tokens in different orders: relative 1e-5 leaves a wide margin
        torch.testing.assert_close(losses, ref["losses"], rtol=1e-5, atol=1e-5)
        for name, want in ref["grads"].items():
            got = sum(res["grads"][name] for res in per_rank)
            scale = want.abs().max().item() + 1e-6
            torch.testing.assert_close(got / scale, want / scale, rtol=0, atol=2e-5, msg=name)


def test_per_batch_layouts_match_stock_megatron(tmp_path, refs) -> None:
    path = tmp_path / "layout.json"
    LAYOUT.save(path)
    assert all(lay != LAYOUT for _, _, lay in MICRO_BATCHES)
    _check(refs, run_ranks(_hexiseq_worker, 3, MEGATRON_LM, str(path), timeout_s=900))


def test_batch_plan_flag_matches_stock_megatron(tmp_path, refs) -> None:
    """``--hexiseq-batch-plan``: the batch planner, built from the layout's recorded cluster and
    model, gives every micro-batch its layout; losses and gradients still equal stock Megatron's."""
    from dataclasses import replace

    path = tmp_path / "layout.json"
    replace(LAYOUT, meta=PLANNED_META).save(path)
    results = run_ranks(_hexiseq_worker, 3, MEGATRON_LM, str(path), True, timeout_s=900)
    _check(refs, results)
    assert any(
        res[i]["positions"] != LAYOUT.ranks[r].positions()
        for r, res in enumerate(results)
        for i in range(len(MICRO_BATCHES))
    )
