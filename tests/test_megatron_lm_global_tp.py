"""``--hexiseq-global-batch`` over TP bundles through real Megatron-LM ``core_v0.16.1``: layer (b),
8 gloo ranks vs 1.

As tests/test_megatron_lm_global.py (Megatron-LM's own ``parse_args`` + ``validate_args``, the GPT
through ``pretrain_gpt``'s ``model_provider`` via ``plugin.model_provider``, the plugin's data
loader, each micro-batch through ``pretrain_gpt.get_batch``; steps driven by hand), with
``--tensor-model-parallel-size 2 --sequence-parallel`` and a layout over TP bundles (domain 1 of
``test_job_runtime.job_tp``: 2 bundles, one A2A group, the tiny GPT's 8 / 2 heads as 4 / 1 per TP
rank) as ``--hexiseq-layout``, 2 data-parallel replicas: 8 processes, Megatron's grid TP 2 x CP 2
x DP 2. What the plugin does at TP > 1 runs here: the refusal is lifted, every TP rank's
``get_batch_on_this_tp_rank`` is the prepared global-batch path (not Megatron's TP broadcast),
the replicas are Megatron's tensor x context-parallel groups, the scheme plans the bundle problem
and pads micro-batches to even token counts.

What runs on CPU that a GPU run does not need (test only): Megatron-LM's local spec with the CPU
norm that accepts sequence parallelism (``testbed/tp_cpu.SequenceParallelNorm`` patched in as the
local backend's and the block's norm class) and ``cpu_sequence_parallel`` (``torch.cuda`` device and
the RNG tracker's fork); each TP rank loads its shard of the reference's initial weights
(``load_tp_slices``: Megatron's CPU initialisation splits SwiGLU's fc1 rows otherwise than its TP
checkpoint layout).

Against stock single-process Megatron (TP = CP = 1, the dense document mask) on each step's 4
samples: every token of every step held once per TP rank (filler tokens aside), per-token losses of
both steps, and step 0's gradients (each TP rank's shard; the norms', which sequence parallelism
leaves partial per TP rank, summed over all ranks) within the fp32 reordering bound of
tests/test_megatron_lm_global.py with n = max(global batch tokens, vocabulary).
"""

from __future__ import annotations

import contextlib
import os
import sys

import pytest
from test_job_runtime import job_tp
from test_megatron_lm_global import ARGV, HEXISEQ, LAYERS, STEPS, B, S, _data, _reference_worker

from megatron_hexiseq.megatron.job_runtime import domain_layout
from megatron_hexiseq.testbed.spawn import run_ranks
from megatron_hexiseq.testbed.train_config import TINY_GPT

MEGATRON_LM = os.environ.get("MEGATRON_LM")
pytestmark = pytest.mark.skipif(
    not MEGATRON_LM, reason="set MEGATRON_LM=<Megatron-LM core_v0.16.1 checkout>"
)

TP, REPLICAS = 2, 2
DATA_SEED = 19  # the stand-in dataset's seed: its steps give micro-batches of odd token counts


def _tp_worker(rank: int, world: int, checkout: str, flags: list[str], initial: dict) -> dict:
    sys.path.insert(0, checkout)
    import pretrain_gpt as stock
    import torch
    from megatron.core import parallel_state as mpu
    from megatron.core.models import backends
    from megatron.core.rerun_state_machine import RerunDataIterator
    from megatron.core.transformer import transformer_block
    from megatron.training import training
    from test_megatron_documents import _parse, hexiseq_model

    from megatron_hexiseq.testbed.tp_cpu import (
        SequenceParallelNorm,
        cpu_sequence_parallel,
        load_tp_slices,
    )

    args = _parse(ARGV + HEXISEQ + flags, rank, world)
    mpu.initialize_model_parallel(
        tensor_model_parallel_size=TP, context_parallel_size=args.context_parallel_size
    )
    # the CPU stand-in (module docstring): the local backend's norm class and the block's
    backends.WrappedTorchNorm = backends.LNImpl = SequenceParallelNorm
    transformer_block.LayerNormImpl = SequenceParallelNorm
    tp_rank = mpu.get_tensor_model_parallel_rank()
    out: dict = {"tp_rank": tp_rank, "steps": [], "loss_tokens": 0.0}
    with cpu_sequence_parallel():
        model = hexiseq_model(stock)
        load_tp_slices(model, initial, tp_rank, TP, gated_linear_unit=True)
        count = B // (args.micro_batch_size * mpu.get_data_parallel_world_size())
        loader = training.build_pretraining_data_loader(_data(DATA_SEED), 0)
        iterator = RerunDataIterator(iter(loader))
        ahead = stock.get_batch_on_this_tp_rank
        out["seq_lengths"] = []
        for step in range(STEPS):
            losses, origins = [], []
            for _ in range(count):
                tokens, labels, loss_mask, _, position_ids, _ = stock.get_batch(iterator)
                item = ahead.current
                out["seq_lengths"].append(item.plan.layout.seq_length)
                with contextlib.nullcontext() if step == 0 else torch.no_grad():
                    per_token = model(tokens, position_ids, None, labels=labels)
                if step == 0:
                    (per_token.float() * loss_mask).sum().backward()
                    out["loss_tokens"] += float(loss_mask.sum())
                losses.append(per_token.detach().double().reshape(-1))
                origins.append(item.origins)
            out["steps"].append((torch.cat(losses), torch.cat(origins)))
    out["grads"] = {n: p.grad.double().clone() for n, p in model.named_parameters()}
    out["count"] = count
    mpu.destroy_model_parallel()
    return out


@pytest.fixture(scope="module")
def reference():
    return run_ranks(_reference_worker, 1, MEGATRON_LM, DATA_SEED, timeout_s=900)[0]


def test_global_batch_over_tp_bundles_matches_single_process(tmp_path, reference) -> None:
    import torch
    from test_megatron_lm_global import _bound

    from megatron_hexiseq.testbed.tp_cpu import partition_dim, tp_slice

    layout = domain_layout(job_tp(TINY_GPT), 1)[0]
    assert layout.tensor_model_parallel_size == TP and layout.world_size == 2
    path = tmp_path / "layout.json"
    layout.save(path)
    flags = [
        "--hexiseq-layout",
        str(path),
        "--context-parallel-size",
        str(layout.world_size),
        "--tensor-model-parallel-size",
        str(TP),
        "--sequence-parallel",
    ]
    world = layout.world_size * TP * REPLICAS
    results = run_ranks(_tp_worker, world, MEGATRON_LM, flags, reference["initial"], timeout_s=1200)
    ref = reference
    n = max(B * S, TINY_GPT.vocab_size)
    tol = _bound() * n / (B * S)  # the same bound at n (linear in n while n u << 1)
    assert [r["tp_rank"] for r in results] == [0, 1] * (world // TP)
    assert all(r["count"] == B // REPLICAS for r in results)
    assert all(x % TP == 0 and x > 0 for r in results for x in r["seq_lengths"])
    fillers = sum(int((o >= B * S).sum()) for r in results for _, o in r["steps"])
    loss_err, worst = 0.0, 0.0
    for step in range(STEPS):
        for tp_rank in range(TP):
            held = torch.zeros(B * S, dtype=torch.long)
            losses = torch.zeros(B * S, dtype=torch.float64)
            for res in results[tp_rank::TP]:
                got, origins = res["steps"][step]
                real = origins < B * S  # filler tokens aside
                held.index_add_(0, origins[real], torch.ones_like(origins[real]))
                losses[origins[real]] = got[real]
            assert held.tolist() == [1] * (B * S), (step, tp_rank)
            err = float((losses - ref["losses"][step]).abs().max())
            loss_err = max(loss_err, err)
            assert err <= tol * max(float(x.abs().max()) for x in ref["losses"]), (step, err)
    total = sum(r["loss_tokens"] for r in results[::TP])
    assert total == ref["loss_tokens"]
    want_all = ref["grads"][0]
    assert len(want_all) >= 4 * LAYERS
    for name, full in want_all.items():
        if partition_dim(name) is None:  # replicated, partial per TP rank: sum over all ranks
            got = sum(r["grads"][name] for r in results) / total
            pairs = [(got, full)]
        else:
            pairs = [
                (
                    sum(r["grads"][name] for r in results[i::TP]) / total,
                    tp_slice(name, full, i, TP, gated_linear_unit=True),
                )
                for i in range(TP)
            ]
        for got, want in pairs:
            assert want.abs().max() > 0, name
            dist = float((got - want).abs().max() / full.abs().max())
            worst = max(worst, dist)
            assert dist <= tol, (name, dist, tol)
    print(
        f"TP {TP}: bound {tol:.3g}; loss {loss_err:.3g}, grad {worst:.3g}; filler tokens {fillers}"
    )
    assert fillers > 0  # some micro-batch's documents summed to an odd count
