"""Megatron integration, layer (b): a tiny megatron-core GPT trained on gloo ranks.

Tiny GPT (4 layers, GQA 8/2, RoPE, SwiGLU) in Megatron ``DistributedDataParallel`` with
``overlap_grad_reduce`` and small buckets, per-token loss, ``torch.optim.AdamW``:
(1) 4 ranks = one heterogeneous layout of two A2A groups of sizes 3 and 1 (uneven,
non-contiguous segments, uneven heads); (2) DP=2 x a 2-rank uneven layout (world 4).
Per-token loss and every parameter gradient of step 0 must equal the single-process model with the
same weights over the unsharded batch (fp32, to a tolerance derived below); then 3 AdamW steps keep
matching. Both parallel runs share one 4-process spawn, both references one 1-process spawn.
"""

from __future__ import annotations

import pytest
import torch

from megatron_hexiseq.layout import make_layout
from megatron_hexiseq.testbed.spawn import run_ranks
from megatron_hexiseq.testbed.train import TrainConfig, reference_rank_many, train_rank_many

HETERO = make_layout(  # groups [3, 1]; rank 3 alone holds every head and the most tokens
    seq_length=48,
    num_attention_heads=8,
    num_query_groups=2,
    group_sizes=[3, 1],
    segments=[[(0, 6), (40, 44)], [(6, 16)], [(16, 22), (44, 48)], [(22, 40)]],
    heads=[[0, 1, 2], [3, 4, 5, 6], [7], list(range(8))],
)
UNEVEN2 = make_layout(  # one A2A group of 2 ranks, 28 vs 20 tokens, 5 vs 3 heads
    seq_length=48,
    num_attention_heads=8,
    num_query_groups=2,
    group_sizes=[2],
    segments=[[(0, 12), (32, 48)], [(12, 32)]],
    heads=[[0, 1, 2, 3, 4], [5, 6, 7]],
)

CASES = [
    TrainConfig(layout=HETERO, steps=3, kernel="reference", return_grads=True, return_params=True),
    TrainConfig(
        layout=UNEVEN2,
        data_parallel=2,
        micro_batch_size=2,
        steps=3,
        kernel="auto",
        comm_chunks=2,
        return_grads=True,
        return_params=True,
    ),
]


FP32_UNIT_ROUNDOFF = 2.0**-24  # torch.finfo(torch.float32).eps / 2


def reordering_tolerance(cfg: TrainConfig) -> float:
    """Relative tolerance of fp32 results that two runs compute in different summation orders.

    Every gradient element (and the loss) is a sum over the N tokens of the global batch
    (N = data_parallel x micro_batch_size x seq_length) of per-token terms. The parallel run adds
    them per rank, then in DDP's all-reduce, and its attention merges key blocks by log-sum-exp; the
    reference adds them in one pass. Two orderings of an N-term fp32 sum differ by at most
    2 * gamma_N * sum|terms|, gamma_N = N*u / (1 - N*u), u = 2**-24 (Higham, "Accuracy and Stability
    of Numerical Algorithms", 2nd ed., section 4.2). The per-token terms are themselves reordered
    results of each layer's backward: one more such factor per layer and one for the head, i.e.
    (L + 1). sum|terms| is measured by the tensor's own scale: elementwise the tolerance is this
    fraction of the tensor's largest magnitude (an element that cancels to near zero still carries
    the rounding of its large terms), norm-wise this fraction of the tensor's norm. It depends
    only on the dtype, N and L: no machine figure in it (case 1: N = 192, L = 4 -> 1.2e-4; this
    machine's worst elementwise difference was 9e-7 of the tensor's largest magnitude; a missing
    or doubled token would move a gradient by about 1/N = 5e-3).
    """
    n = cfg.data_parallel * cfg.micro_batch_size * cfg.layout.seq_length
    gamma = n * FP32_UNIT_ROUNDOFF / (1 - n * FP32_UNIT_ROUNDOFF)
    return 2 * gamma * (cfg.model.num_layers + 1)


def assert_matches_reference(per_rank: list, ref, tol: float) -> None:
    """Every rank's per-token loss of every step, and rank 0's gradients of step 0 (after the
    reduction and the division by the global token count), equal the single-process ``ref``'s to
    ``tol``: losses relatively (sums of positive terms), gradients norm-wise and elementwise
    relative to each tensor's largest magnitude (``reordering_tolerance``)."""
    # the per-token loss of every step, as every rank reports it (a sum of positive terms: relative)
    for res in per_rank:
        torch.testing.assert_close(
            torch.tensor(res.losses), torch.tensor(ref.losses), rtol=tol, atol=0
        )
    # every parameter gradient of step 0 (after DDP reduce + division by the global token count)
    got = per_rank[0].grads
    assert got.keys() == ref.grads.keys() and len(got) >= 4 * 4
    for name, want in ref.grads.items():
        assert want.abs().max() > 0, name
        assert float(torch.linalg.vector_norm(got[name] - want)) <= tol * float(
            torch.linalg.vector_norm(want)
        )
        torch.testing.assert_close(
            got[name],
            want,
            rtol=tol,
            atol=tol * float(want.abs().max()),
            msg=lambda m: f"gradient of {name}: {m}",
        )


@pytest.fixture(scope="module")
def runs():
    parallel = run_ranks(train_rank_many, 4, CASES, timeout_s=600)
    reference = run_ranks(reference_rank_many, 1, CASES, timeout_s=600)[0]
    return parallel, reference


@pytest.mark.parametrize("case", [0, 1], ids=["hetero-3+1", "dp2-x-uneven2"])
def test_gpt_matches_single_process(runs, case):
    parallel, reference = runs
    ref = reference[case]
    per_rank = [results[case] for results in parallel]
    tol = reordering_tolerance(CASES[case])
    assert_matches_reference(per_rank, ref, tol)
    # parameters after 3 AdamW steps. Adam normalises each element's step (m / (sqrt(v) + 1e-8)): an
    # element whose gradient is at the level of the gradients' elementwise error (tol x the tensor's
    # largest magnitude, above) can take any step in [-lr, lr] in either run. So compare each
    # parameter's total update norm-wise (1e-3 relative; measured worst 3.5e-4), and elementwise only
    # where step 0's gradient is at least 100x its error bound: there each gradient is known to 1%,
    # each of the 3 steps (a ratio of the gradients to themselves) to about 2% of lr, the total to
    # 10% of one step (a dropped or doubled token moves a step by ~1/N of the gradient: still caught
    # norm-wise, and elementwise where it changes the sign of the mean).
    for name, want in ref.params.items():
        got_p, init = per_rank[0].params[name], ref.initial_params[name]
        update = float(torch.linalg.vector_norm(want - init))
        assert update > 0, name
        assert float(torch.linalg.vector_norm(got_p - want)) <= 1e-3 * update, name
        grad0 = ref.grads[name].abs()
        known = grad0 >= 100 * tol * float(grad0.max())
        assert bool(known.any()), name
        torch.testing.assert_close(
            got_p[known],
            want[known],
            rtol=0,
            atol=0.1 * CASES[case].lr,
            msg=lambda m: f"parameter {name}: {m}",
        )
