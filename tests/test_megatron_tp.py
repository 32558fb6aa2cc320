"""Tensor parallelism inside a HexiSeq layout, layer (b): gloo processes against one process.

One 6-process spawn (3 TP bundles x t = 2, Megatron's ``tp-cp-ep-dp-pp`` grid, CP = 3):

1. The tiny megatron-core GPT (4 layers, RoPE, SwiGLU, RMSNorm) with ``--tensor-model-parallel-size
   2`` and sequence parallelism, on an uneven layout over bundles (groups [2, 1], 12 / 10 / 26 tokens,
   bundle heads 3 / 1 / 4 of the 4 per TP rank), in two models: GQA 8 / 2 (each TP rank holds its own
   K/V head) and MQA 8 / 1 (Megatron replicates the K/V head on both TP ranks). Starting from the
   single-process model's weights (each TP rank its Megatron shard), per-token losses of 2 AdamW
   steps, every gradient of step 0 on both TP ranks, and the parameters after the steps equal stock
   single-process Megatron (TP = CP = 1, plain causal attention) on the same data. A third run packs
   documents (EOD tokens read by the slicer, RoPE restarting per document) with a layout of its own
   every micro-batch (bundles of even token counts), against the document-masked reference.
2. The attention runtime on Megatron's TP x CP groups with a **0-token bundle** (bundle 1 holds
   heads but no tokens; Megatron's attention layer cannot run an empty shard, so this case runs
   ``hexiseq_attn_func`` on the groups ``build_runtime`` builds, ``cp_domains`` of Megatron's CP
   groups), float64, three head shapes (8/2, 8/1 with K/V replication, 8/4): each TP rank's output
   and q/k/v gradients equal single-process attention over ITS slice of the model's heads
   (``tensor_parallel.global_query_head`` / ``global_kv_head``) to 1e-10.

What runs on CPU that a GPU run does not need: ``testbed/tp_cpu.py`` (a norm that accepts sequence
parallelism, ``torch.cuda.current_device()`` and the CUDA RNG tracker's fork). gloo has the
all-gather and reduce-scatter into tensors sequence parallelism uses (torch 2.13).

Tolerance (part 1): two fp32 summation orders of n terms differ by at most 2 gamma_n of the terms'
magnitude (Higham, section 4.2), one factor per layer and one for the head, as
``test_megatron_gpt.reordering_tolerance`` derives it; here n is the longest sum either run
reorders: the N = 48 tokens of the batch (DDP, attention) or, with TP, a reduction TP splits over
its ranks (the hidden size 64 of the row-parallel linears, the FFN size 96, the vocabulary 128 of the
vocabulary-parallel cross entropy): n = 128 -> 7.6e-5.

Mutation tried once (not kept): ``cp_domains`` swapped bundle 1's TP ranks between the two CP
domains, so bundle 1's TP rank 1 ran the layout with the TP-rank-0 GPUs of bundles 0 and 2 (its q/k/v
of heads 4-7 mixed with their heads 0-3). The GQA case failed (loss off by 3.9e-3, 8e-4 relative,
against 7.6e-5); the MQA case and part 2 passed, as they must: with one K/V head replicated on both
TP ranks a query row's attention depends only on its own q and the shared K/V, and part 2's bundle 1
holds no tokens of its own to mix.
"""

from __future__ import annotations

import random
from dataclasses import replace

import numpy as np
import pytest
import torch

from megatron_hexiseq.attention.testing_layouts import random_batch_layout
from megatron_hexiseq.errors import HexiSeqError
from megatron_hexiseq.layout import Layout, make_layout
from megatron_hexiseq.model import ModelSpec
from megatron_hexiseq.planner.tp import round_segments
from megatron_hexiseq.tensor_parallel import global_kv_head, global_query_head, tp_heads
from megatron_hexiseq.testbed.spawn import run_ranks
from megatron_hexiseq.testbed.tp_cpu import tp_slice
from megatron_hexiseq.testbed.train import TrainConfig, reference_rank_many, train_rank_many
from megatron_hexiseq.testbed.train_config import TINY_GPT

TP = 2
FP32_UNIT_ROUNDOFF = 2.0**-24

BUNDLES = make_layout(  # over 3 bundles of 2: groups [2, 1]; heads per TP rank: 4 (K/V: 1)
    seq_length=48,
    num_attention_heads=4,
    num_query_groups=1,
    group_sizes=[2, 1],
    segments=[[(0, 6), (36, 42)], [(6, 16)], [(16, 36), (42, 48)]],
    heads=[[0, 1, 2], [3], [0, 1, 2, 3]],
    tensor_model_parallel_size=TP,
)
TINY_MQA = replace(TINY_GPT, name="tiny-mqa", num_query_groups=1)


class EvenBatchLayouts:
    """Document lengths -> a random layout of the job's structure (several runs per bundle, whole
    documents inside one group), its boundaries rounded to multiples of t (sequence parallelism)."""

    def __init__(self, job: Layout) -> None:
        self.job = job

    def __call__(self, lengths: tuple[int, ...]) -> Layout:
        cu = [0, *np.cumsum(lengths).tolist()]
        for seed in range(100):
            rng = random.Random(hash((lengths, seed)))
            try:
                lay = random_batch_layout(rng, self.job, bounds=cu, min_tokens=4)
                return round_segments(lay, self.job.tensor_model_parallel_size)
            except HexiSeqError:  # a bundle left without tokens: draw again
                continue
        raise AssertionError(lengths)


CASES = [
    TrainConfig(
        model=model,
        layout=BUNDLES,
        steps=2,
        kernel=kernel,
        comm_chunks=chunks,
        return_grads=True,
        return_params=True,
        tensor_model_parallel_size=TP,
    )
    for model, kernel, chunks in ((TINY_GPT, "reference", 1), (TINY_MQA, "auto", 2))
] + [  # packed documents (EOD tokens, --reset-attention-mask) with a layout per micro-batch
    TrainConfig(
        layout=BUNDLES,
        steps=2,
        kernel="auto",
        return_grads=True,
        return_params=True,
        tensor_model_parallel_size=TP,
        documents=((5, 1, 20, 22), (10, 10, 2, 26)),
        batch_layouts=EvenBatchLayouts(BUNDLES),
        reset_position_ids=True,
    )
]


def zero_token_layout(heads: int, groups: int) -> Layout:
    """3 bundles, groups [2, 1]; bundle 1 holds heads but no tokens."""
    return make_layout(
        seq_length=20,
        num_attention_heads=heads,
        num_query_groups=groups,
        group_sizes=[2, 1],
        segments=[[(0, 4), (14, 20)], [], [(4, 14)]],
        heads=[list(range(heads - 1)), [heads - 1], list(range(heads))],
        tensor_model_parallel_size=TP,
    )


ATTENTION_MODELS = ((8, 2), (8, 1), (8, 4))  # (H, G) of the model; t = 2


def _attention_case(H: int, G: int) -> tuple[Layout, torch.Tensor, torch.Tensor, torch.Tensor]:
    torch.manual_seed(H * 10 + G)
    q = torch.randn(20, 2, H, 4, dtype=torch.float64)
    k, v = (torch.randn(20, 2, G, 4, dtype=torch.float64) for _ in range(2))
    return zero_token_layout(*tp_heads(H, G, TP)), q, k, v


def _attention_check(rank: int) -> int:
    """Part 2 on this process: returns the number of (model, tensor) pairs checked."""
    from megatron.core import parallel_state as mpu

    from megatron_hexiseq.attention.groups import build_hexiseq_groups
    from megatron_hexiseq.attention.hexiseq import hexiseq_attn_func
    from megatron_hexiseq.attention.reference import reference_attention
    from megatron_hexiseq.megatron.runtime import cp_domains

    mpu.initialize_model_parallel(tensor_model_parallel_size=TP, context_parallel_size=3)
    try:
        tp_rank = mpu.get_tensor_model_parallel_rank()
        domains = cp_domains(mpu.get_context_parallel_group())
        checked = 0
        for H, G in ATTENTION_MODELS:
            layout, q, k, v = _attention_case(H, G)
            groups = build_hexiseq_groups(layout, domains=domains)
            assert groups.rank == mpu.get_context_parallel_rank()
            Ht, Gt = layout.num_attention_heads, layout.num_query_groups
            q_heads = [global_query_head(h, tp_rank, H, TP) for h in range(Ht)]
            kv_heads = [global_kv_head(g, tp_rank, G, TP) for g in range(Gt)]
            # TP rank i's slice of the model's heads, whole sequence: the oracle's inputs
            full = [
                x[:, :, idx].clone().requires_grad_()
                for x, idx in ((q, q_heads), (k, kv_heads), (v, kv_heads))
            ]
            want = reference_attention(*full)
            dout = torch.randn(want.shape, dtype=torch.float64, generator=_gen(H, G, tp_rank))
            want.backward(dout)
            pos = torch.tensor(layout.ranks[groups.rank].positions(), dtype=torch.long)
            mine = [x.detach()[pos].clone().requires_grad_() for x in full]
            got = hexiseq_attn_func(*mine, groups=groups, kernel="reference")
            got.backward(dout[pos])
            pairs = [(got, want[pos])] + [(m.grad, f.grad[pos]) for m, f in zip(mine, full)]
            for name, (a, b) in zip(("out", "dq", "dk", "dv"), pairs):
                torch.testing.assert_close(
                    a,
                    b,
                    rtol=1e-10,
                    atol=1e-10,
                    msg=lambda m, n=name: f"H={H} G={G} tp {tp_rank} bundle {groups.rank} {n}: {m}",
                )
                checked += 1
        return checked
    finally:
        mpu.destroy_model_parallel()


def _gen(H: int, G: int, tp_rank: int) -> torch.Generator:
    return torch.Generator().manual_seed(1000 + 10 * H + G + 100 * tp_rank)


def _worker(rank: int, world: int, cases: list[TrainConfig]) -> tuple[list, int]:
    return train_rank_many(rank, world, cases), _attention_check(rank)


def reordering_tolerance(cfg: TrainConfig) -> float:
    """2 gamma_n (L + 1), n the longest reordered sum (module docstring)."""
    m: ModelSpec = cfg.model
    tokens = cfg.data_parallel * cfg.micro_batch_size * cfg.layout.seq_length
    n = max(tokens, m.hidden_size, m.ffn_hidden_size, m.vocab_size)
    gamma = n * FP32_UNIT_ROUNDOFF / (1 - n * FP32_UNIT_ROUNDOFF)
    return 2 * gamma * (m.num_layers + 1)


def assert_tp_shard_grads(per_tp_rank: list, ref_grads: dict, tol: float, gated: bool) -> None:
    """``per_tp_rank[i]``: TP rank i's gradients (one bundle's ranks) equal its shard of the
    single-process ``ref_grads`` (``tp_slice``) within ``tol`` of each tensor's largest entry;
    every reference shard is nonzero (the comparison can fail)."""
    for tp_rank, got in enumerate(per_tp_rank):
        assert got is not None and got.keys() == ref_grads.keys()
        for name, full in ref_grads.items():
            want = tp_slice(name, full, tp_rank, len(per_tp_rank), gated_linear_unit=gated)
            assert want.abs().max() > 0, name
            torch.testing.assert_close(
                got[name],
                want,
                rtol=tol,
                atol=tol * float(full.abs().max()),
                msg=lambda m, n=name, i=tp_rank: f"TP rank {i} gradient of {n}: {m}",
            )


@pytest.fixture(scope="module")
def runs():
    reference = run_ranks(reference_rank_many, 1, CASES, timeout_s=600)[0]
    cases = [replace(c, init_params=r.initial_params) for c, r in zip(CASES, reference)]
    parallel = run_ranks(_worker, len(BUNDLES.ranks) * TP, cases, timeout_s=1200)
    return parallel, reference


def test_attention_on_tp_groups_with_a_zero_token_bundle(runs):
    parallel, _ = runs
    assert [checked for _, checked in parallel] == [4 * len(ATTENTION_MODELS)] * 6


@pytest.mark.parametrize(
    "case", [0, 1, 2], ids=["gqa-8-2", "mqa-8-1-replicated-kv", "packed-per-batch-layouts"]
)
def test_tp_gpt_matches_single_process(runs, case):
    parallel, reference = runs
    ref, cfg = reference[case], CASES[case]
    per_rank = [results[case] for results, _ in parallel]
    tol = reordering_tolerance(cfg)
    for res in per_rank:
        torch.testing.assert_close(
            torch.tensor(res.losses), torch.tensor(ref.losses), rtol=tol, atol=0
        )
    gated = cfg.model.swiglu
    for tp_rank in range(TP):  # global ranks 0, 1: bundle 0's TP ranks
        got = per_rank[tp_rank].grads
        assert got.keys() == ref.grads.keys() and len(got) >= 4 * 4
        for name, full in ref.grads.items():
            want = tp_slice(name, full, tp_rank, TP, gated_linear_unit=gated)
            assert want.abs().max() > 0, name
            scale = float(full.abs().max())
            assert float(torch.linalg.vector_norm(got[name] - want)) <= tol * float(
                torch.linalg.vector_norm(full)
            ), name
            torch.testing.assert_close(
                got[name],
                want,
                rtol=tol,
                atol=tol * scale,
                msg=lambda m, n=name, i=tp_rank: f"TP rank {i} gradient of {n}: {m}",
            )
        # parameters after the steps (as test_megatron_gpt: norm-wise, elementwise where known)
        for name, full in ref.params.items():
            got_p = per_rank[tp_rank].params[name]
            want = tp_slice(name, full, tp_rank, TP, gated_linear_unit=gated)
            init = tp_slice(name, ref.initial_params[name], tp_rank, TP, gated_linear_unit=gated)
            update = float(torch.linalg.vector_norm(want - init))
            assert update > 0, name
            assert float(torch.linalg.vector_norm(got_p - want)) <= 1e-3 * update, name
            grad0 = tp_slice(name, ref.grads[name], tp_rank, TP, gated_linear_unit=gated).abs()
            known = grad0 >= 100 * tol * float(ref.grads[name].abs().max())
            torch.testing.assert_close(
                got_p[known], want[known], rtol=0, atol=0.1 * cfg.lr, msg=lambda m: f"{name}: {m}"
            )
