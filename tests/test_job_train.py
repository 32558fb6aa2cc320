"""A job trains exactly: layer (b), gloo ranks driven as Megatron-LM drives ``--hexiseq-job``.

The CPU job driver (``testbed/job_train.py``: Megatron's grid with one context-parallel group of
every rank, every domain's groups, the job's sampler, Megatron DDP with ``no_sync`` over each
domain's micro-batches, ``finalize_model_grads``, AdamW) against one process training the tiny GPT
on each step's whole global batch (stock-free local attention, plain autograd):

1. two domains, 1 + 2 ranks, 3 and 1 micro-batches of one sequence (the pair listed high rank
   first, an uneven A2A group); and three domains on 4 ranks (1 rank with 2 micro-batches, an
   uneven two-rank ring with 1, a rank alone with 1), micro-batches of 2 sequences: the per-token
   loss of every step and every parameter's gradient of step 0 equal the single process's to the
   fp32 reordering bound of tests/test_megatron_gpt.py (N = tokens of the global batch), and the
   same bound would reject a global batch that lost one domain's share or counted it twice (the
   gradients of the reference run on those batches are farther from the job's than 10x the bound);
2. the same weights on every rank: one rank's first weight moved one ULP before the broadcast
   trains exactly as the unmoved run (bit-identical losses); without the broadcast the start-up
   check stops every rank with one line naming global rank 1;
3. checkpoints: a job's checkpoint (after step 1) resumes under another job (one domain over the
   same GPUs, same global batch) with the saved parameters and AdamW state bit-exact and steps 2-3
   equal to the uninterrupted job's; and under a plain layout (``train.train_rank``) bit-exact.

Layer (a) is tests/test_job_runtime.py.
"""

from __future__ import annotations

import pytest
import torch
from test_job_runtime import job_1_2, job_three_domains, one_domain_job
from test_megatron_gpt import (  # the fp32 two-orderings bound, derived there, and its checks
    assert_matches_reference,
    reordering_tolerance,
)

from megatron_hexiseq.layout import make_layout
from megatron_hexiseq.testbed.job_train import (
    JobTrainConfig,
    SampleData,
    job_reference_rank,
    train_job_rank_many,
)
from megatron_hexiseq.testbed.spawn import run_ranks
from megatron_hexiseq.testbed.train import TrainConfig, train_rank, train_reference

STEPS = 3


def _tolerance(cfg: JobTrainConfig) -> float:
    # the bound for N = the global batch's tokens (TrainConfig counts dp x micro-batch x seq)
    job = cfg.job
    return reordering_tolerance(
        TrainConfig(layout=job.domains[0].layout, micro_batch_size=job.global_batch)
    )


def _mutated_references(rank: int, world_size: int, cfg: JobTrainConfig) -> list:
    """The reference on global batches without domain 1's share, and with it twice."""
    job = cfg.job
    data = SampleData(cfg.model, job.seq_length, cfg.data_seed)
    B = job.global_batch
    start, stop = job.sample_range(1)
    base = TrainConfig(model=cfg.model, layout=job.domains[0].layout, steps=1, return_grads=True)
    out = []
    for twice in (0, 2):
        samples = [i for i in range(B) if not start <= i < stop] + list(range(start, stop)) * twice
        out.append(train_reference(base, lambda step, s=samples: data.batch(s)))
    return out


@pytest.fixture(scope="module")
def exact_runs():
    cases = [
        JobTrainConfig(job=job_1_2(), steps=STEPS, return_grads=True),
        JobTrainConfig(job=job_three_domains(), steps=STEPS, kernel="auto", return_grads=True),
    ]
    three = run_ranks(train_job_rank_many, 3, [cases[0]], timeout_s=900)
    four = run_ranks(train_job_rank_many, 4, [cases[1]], timeout_s=900)
    refs = [run_ranks(job_reference_rank, 1, c, timeout_s=600)[0] for c in cases]
    mutated = run_ranks(_mutated_references, 1, cases[0], timeout_s=600)[0]
    return cases, [[r[0] for r in three], [r[0] for r in four]], refs, mutated


def _grad_distance(got: dict, want: dict) -> float:
    """Largest elementwise difference relative to each tensor's largest magnitude."""
    return max(
        float((got[n] - w).abs().max() / w.abs().max()) for n, w in want.items() if w.abs().max()
    )


@pytest.mark.parametrize("case", [0, 1], ids=["1+2-ranks-m3-m1", "three-domains"])
def test_job_matches_single_process(exact_runs, case):
    cases, parallel, refs, _ = exact_runs
    ref, per_rank, tol = refs[case], parallel[case], _tolerance(cases[case])
    assert_matches_reference(per_rank, ref, tol)


def test_a_dropped_or_doubled_share_would_fail(exact_runs):
    cases, parallel, refs, mutated = exact_runs
    tol = _tolerance(cases[0])
    got = parallel[0][0].grads
    assert _grad_distance(got, refs[0].grads) <= tol
    for wrong in mutated:  # domain 1's share dropped, then counted twice
        # (the gradients carry it: on random tokens every sequence's mean loss is ~ln(vocab), so a
        # lost or doubled sequence moves the mean loss by only ~1.5e-4 of itself)
        assert _grad_distance(got, wrong.grads) > 10 * tol


# ---- the same weights everywhere ---------------------------------------------------------------
def test_broadcast_fixes_one_ulp_and_the_check_catches_it():
    job = job_1_2()
    cfgs = [
        JobTrainConfig(job=job, steps=2),
        JobTrainConfig(job=job, steps=2, perturb_rank=1),
        JobTrainConfig(job=job, steps=2, perturb_rank=1, broadcast_params=False),
    ]
    results = run_ranks(train_job_rank_many, 3, cfgs, timeout_s=900)
    for plain, fixed, caught in results:
        assert fixed.losses == plain.losses  # bit-identical: rank 0's weights everywhere
        assert isinstance(caught, str)
        assert caught.startswith("parameters differ across ranks at start-up: global rank 1 hold")


# ---- checkpoints -------------------------------------------------------------------------------
PLAIN = make_layout(  # the plain driver's 3-rank layout: one A2A group, uneven
    seq_length=48,
    num_attention_heads=8,
    num_query_groups=2,
    group_sizes=[3],
    segments=[[(0, 20)], [(20, 34)], [(34, 48)]],
    heads=[[0, 1, 2, 3], [4, 5], [6, 7]],
)


def _save_then_resume(rank: int, world_size: int, folder: str) -> list:
    whole = JobTrainConfig(job=job_1_2(), steps=STEPS)
    saved = JobTrainConfig(
        job=job_1_2(), steps=1, save_dir=folder, save_at_step=1, return_params=True
    )
    other_job = JobTrainConfig(
        job=one_domain_job(), steps=STEPS, load_dir=folder, return_params=True
    )
    out = train_job_rank_many(rank, world_size, [whole, saved, other_job])
    plain = TrainConfig(layout=PLAIN, steps=2, load_dir=folder, return_params=True)
    return [*out, train_rank(rank, world_size, plain)]


def test_job_checkpoint_resumes_under_another_job_and_a_plain_layout(tmp_path):
    results = run_ranks(_save_then_resume, 3, str(tmp_path / "ckpt"), timeout_s=900)
    whole, saved, other, plain = results[0]
    for resumed in (other, plain):
        assert resumed.start_step == 1
        for name, p in saved.params.items():
            assert torch.equal(resumed.resumed["params"][name], p), name
            for key, value in saved.opt_state[name].items():
                assert torch.equal(resumed.resumed["opt_state"][name][key], value), (name, key)
    tol = _tolerance(JobTrainConfig(job=job_1_2()))
    torch.testing.assert_close(
        torch.tensor(other.losses), torch.tensor(whole.losses[1:]), rtol=tol, atol=0
    )
