"""Global-batch scheduling over TP bundles, layer (b): 8 gloo ranks (2 replicas x 2 bundles x t = 2)
against one process.

The CPU global-batch driver (``testbed/global_train.py``) runs what ``--hexiseq-global-batch
--tensor-model-parallel-size 2 --sequence-parallel`` runs in Megatron-LM: the domains and the
scheme are the library's own (``global_data.replica_domains`` + ``planned_scheme`` on a layout over
TP bundles that records its cluster, model and options: domain 1 of ``test_job_runtime.job_tp``,
two bundles of 2 CPU "GPUs" in one A2A group, the tiny GPT's 8 / 2 heads as 4 / 1 per TP rank), so
each micro-batch is planned on the bundle problem and rounded to multiples of t; every one of the 8
ranks reads the step, schedules it and prepares its bundle's micro-batches itself (both TP ranks of
a bundle alike); micro-batches whose documents sum to an odd token count end with a one-token
filler document (``StepPreparer``: sequence parallelism needs a multiple of t). Megatron's sequence
parallelism runs inside each bundle with the CPU stand-ins of ``testbed/tp_cpu.py``.

Against the single-process model (TP = CP = 1, every document alone, the same initial weights:
each TP rank loads its shard of them): per-token losses of 2 AdamW steps on every rank, and step
0's gradients on both TP ranks of bundle 0 (each its shard, ``tp_slice``). Every unit of a step
lands in exactly one micro-batch of one domain, and at least one micro-batch carries a filler.

Tolerance: ``test_megatron_tp.reordering_tolerance``'s 2 gamma_n (L + 1) (Higham, section 4.2), n the
longest sum either run reorders: the step's tokens (the per-token loss over the global batch) or
the vocabulary 128 of the vocabulary-parallel cross entropy, whichever is longer.

Mutation tried once (not kept): the filler's loss mask set to 1 in ``StepPreparer`` (its zero
tokens trained as if they were data): the loss comparison failed on every rank.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from test_job_runtime import job_tp
from test_megatron_gpt import FP32_UNIT_ROUNDOFF
from test_megatron_tp import assert_tp_shard_grads

from megatron_hexiseq.megatron.global_data import planned_scheme, replica_domains
from megatron_hexiseq.megatron.job_runtime import domain_layout
from megatron_hexiseq.testbed.global_train import (
    GlobalTrainConfig,
    train_global_rank,
    train_global_reference,
)
from megatron_hexiseq.testbed.spawn import run_ranks
from megatron_hexiseq.testbed.train_config import TINY_GPT

TP, REPLICAS, MICRO_BATCHES = 2, 2, 2
# two steps of unit lengths (documents in loader order); odd totals make fillers likely
UNITS = ((20, 3, 25, 48, 10, 10, 1, 27, 17, 31), (48, 5, 43, 1, 1, 46, 48, 7))


def _config() -> GlobalTrainConfig:
    structure = domain_layout(job_tp(TINY_GPT), 1)[0]  # 2 bundles over TP 2, with its meta
    assert structure.tensor_model_parallel_size == TP and structure.world_size == 2
    size = structure.world_size * TP
    replicas = [list(range(d * size, (d + 1) * size)) for d in range(REPLICAS)]
    domains = replica_domains(structure, replicas, MICRO_BATCHES, "test layout")
    assert [d.ranks for d in domains] == [(0, 1), (2, 3)] and domains[0].structure.world_size == 2
    return GlobalTrainConfig(
        model=TINY_GPT,
        structure=structure,
        replicas=REPLICAS,
        batches=UNITS,
        scheme=planned_scheme(domains, structure, "test layout"),
        kernel="reference",
        return_grads=True,
        tensor_model_parallel_size=TP,
    )


@pytest.fixture(scope="module")
def runs():
    cfg = _config()
    ref = run_ranks(train_global_reference, 1, cfg, timeout_s=600)[0]
    cfg = replace(cfg, init_params=ref.initial_params)
    world = cfg.structure.world_size * REPLICAS * TP
    return cfg, run_ranks(train_global_rank, world, cfg, timeout_s=1200), ref


def _tolerance() -> float:
    n = max(max(sum(u) for u in UNITS), TINY_GPT.vocab_size)
    return 2 * n * FP32_UNIT_ROUNDOFF / (1 - n * FP32_UNIT_ROUNDOFF) * (TINY_GPT.num_layers + 1)


def test_global_batches_over_tp_bundles_match_single_process(runs) -> None:
    cfg, results, ref = runs
    tol = _tolerance()
    for res in results:
        torch.testing.assert_close(
            torch.tensor(res.losses), torch.tensor(ref.losses), rtol=tol, atol=0
        )
    size = cfg.structure.world_size * TP
    for step, units in enumerate(UNITS):  # every unit in exactly one micro-batch of one domain
        placed = sorted(u for d in range(REPLICAS) for b in results[d * size].bins[step] for u in b)
        assert placed == list(range(len(units)))
        for d in range(REPLICAS):  # every rank of a domain (both TP ranks of each bundle) agrees
            mine = results[d * size : (d + 1) * size]
            assert all(r.bins[step] == mine[0].bins[step] for r in mine)
            assert all(r.layouts[step] == mine[0].layouts[step] for r in mine)
    layouts = [lay for res in results for step in res.layouts for lay in step]
    assert all(lay.tensor_model_parallel_size == TP for lay in layouts)
    assert all(r.num_tokens % TP == 0 and r.num_tokens for lay in layouts for r in lay.ranks)
    # a filler: some micro-batch's documents sum to an odd count, its layout one token more
    odd = [
        (sum(units[u] for u in b), lay.seq_length)
        for d in range(REPLICAS)
        for step, units in enumerate(UNITS)
        for b, lay in zip(results[d * size].bins[step], results[d * size].layouts[step])
        if sum(units[u] for u in b) % TP
    ]
    assert odd and all(n == tokens + 1 for tokens, n in odd), odd
    # process ranks 0, 1: replica 0's bundle 0
    assert_tp_shard_grads([r.grads for r in results[:TP]], ref.grads, tol, TINY_GPT.swiglu)
