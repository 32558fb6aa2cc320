"""``--hexiseq-global-batch``'s data side, layer (a) only (no processes).

- ``global_data.step_units``: Megatron's EOD rule per sample (1-token documents, EOD as the last
  token), and ``StepUnits.flat``: where a bin's tokens sit in the step's batch;
- every rank's reading and document assignment over 1,000 steps of the three-domain job of
  tests/test_job_runtime.py (4 ranks, micro-batches of 2 samples, a global batch of 8), through
  the real ``torch`` DataLoader the run installs (``global_ahead.global_data_loaders``) and the
  run's scheduler (``GlobalPlanner`` on the job's domains): every document of every step (cut
  independently here from the dataset's tokens) is read exactly once, by exactly one domain; the
  ranks of a domain read the same documents; a resume in the middle (Megatron restores
  ``consumed_train_samples``) reads exactly what the uninterrupted run read from there on;
- the data loader stops before a partial global batch; a stream that ends inside one is one line;
- ``packed_checks.refuse_global_batch`` and the flag's own refusal: one line each.

Layer (b) is tests/test_megatron_lm_global.py (gloo, real Megatron-LM seams).
"""

from __future__ import annotations

import argparse

import numpy as np
import pytest
import torch
from test_job_runtime import job_three_domains

from megatron_hexiseq.errors import HexiSeqError
from megatron_hexiseq.megatron.args import HexiSeqArgs
from megatron_hexiseq.megatron.global_ahead import global_data_loaders
from megatron_hexiseq.megatron.global_data import (
    job_domains,
    planned_scheme,
    read_steps,
    step_units,
)
from megatron_hexiseq.megatron.job_runtime import domain_layout, job_place
from megatron_hexiseq.megatron.packed_checks import refuse_packed_combinations

EOD = 127


class EodSamples:
    """A stand-in for Megatron's GPT dataset: sample ``i`` is ``S`` tokens (labels: the next
    token) with EOD tokens at random places (about 1 in ``every``; 1-token documents and an EOD
    as the last token occur), loss mask and position ids from Megatron's own
    ``_get_ltor_masks_and_position_ids`` (``--reset-position-ids --reset-attention-mask
    --eod-mask-loss``). Deterministic in ``seed`` and ``i``."""

    def __init__(self, n: int, seq_length: int, *, seed: int = 0, every: int = 9) -> None:
        self.n, self.S, self.seed, self.every = n, seq_length, seed, every

    def __len__(self) -> int:
        return self.n

    def text(self, i: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + i)
        text = torch.randint(0, 100, (self.S + 1,), generator=g)
        text[torch.rand(self.S + 1, generator=g) < 1 / self.every] = EOD
        return text

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        from megatron.core.datasets.gpt_dataset import _get_ltor_masks_and_position_ids

        text = self.text(int(i))
        tokens = text[:-1].contiguous()
        _, loss_mask, position_ids = _get_ltor_masks_and_position_ids(
            tokens, EOD, True, True, True, False
        )
        return {
            "tokens": tokens,
            "labels": text[1:].contiguous(),
            "loss_mask": loss_mask,
            "position_ids": position_ids,
        }

    def documents(self, i: int) -> list[tuple[int, int, int]]:
        """Sample ``i``'s documents ``(i, start, end)``, cut here without the library."""
        tokens = self.text(i)[: self.S].numpy()
        ends = [int(p) + 1 for p in np.flatnonzero(tokens == EOD) if p + 1 < self.S]
        cuts = [0, *ends, self.S]
        return [(i, a, b) for a, b in zip(cuts[:-1], cuts[1:])]


def test_step_units_cut_at_eod_and_flat_positions() -> None:
    tokens = torch.tensor([[1, EOD, 2, 3, EOD, EOD], [EOD, 4, 5, 6, 7, EOD]])
    units = step_units(tokens, EOD)
    assert units.sample == (0, 0, 0, 1, 1)
    assert units.start == (0, 2, 5, 0, 1)
    assert units.length == (2, 3, 1, 1, 5)
    assert sum(units.length) == tokens.numel()
    # a bin of units 4, 0, 2 (any order): their tokens in that order, from the flattened batch
    flat = units.flat([4, 0, 2])
    assert flat.tolist() == [7, 8, 9, 10, 11, 0, 1, 5]
    assert tokens.reshape(-1)[torch.from_numpy(flat)].tolist() == [4, 5, 6, 7, EOD, 1, EOD, EOD]
    assert units.flat([]).tolist() == []


def _read(job, rank: int, data: EodSamples, consumed: int) -> list[list[tuple[int, int, int]]]:
    """Rank ``rank``'s documents ``(dataset sample, start, end)`` of every step from
    ``consumed``, read and scheduled as the run does (one list per step, bins in order)."""
    domain = job_place(job, rank).domain
    B, b = job.global_batch, job.micro_batch_size
    args = argparse.Namespace(global_batch_size=B, micro_batch_size=b, num_workers=0)
    loader = global_data_loaders(args)(data, consumed)
    domains = job_domains(job)
    scheme = planned_scheme(domains, domains[domain].structure, "job")
    out = []
    for step in read_steps(iter(loader), chunks=B // b, eod_token=EOD, scheme=scheme):
        first = consumed + step.number * B
        u = step.units
        docs = []
        for ids in step.bins[domain]:
            docs += [(first + u.sample[x], u.start[x], u.start[x] + u.length[x]) for x in ids]
        out.append(docs)
    return out


def test_1000_steps_every_document_once_same_in_a_domain_and_after_a_resume() -> None:
    job = job_three_domains()  # 3 domains on 4 ranks (process ranks 1 and 3: one domain)
    B, steps = job.global_batch, 1000
    data = EodSamples(steps * B + 5, 48, seed=7)  # a partial last global batch: nobody reads it
    ranks = range(len(job.run_ranks))
    domain_of = [job_place(job, r).domain for r in ranks]
    assert sorted(domain_of) == [0, 1, 1, 2]
    read = {r: _read(job, r, data, 0) for r in ranks}
    assert all(len(read[r]) == steps for r in ranks)
    pair = [r for r in ranks if domain_of[r] == 1]
    assert read[pair[0]] == read[pair[1]]  # every rank of a domain: the same documents
    one_per_domain = {domain_of[r]: r for r in ranks}
    moved = 0
    for t in range(steps):
        got = [doc for r in one_per_domain.values() for doc in read[r][t]]
        want = [doc for i in range(t * B, (t + 1) * B) for doc in data.documents(i)]
        assert len(got) == len(want) and sorted(got) == sorted(want), t  # once each, none lost
        # the scheduler moves documents between domains (not the sampler's fixed shares)
        start = job.sample_range(0).start
        moved += any(not start <= s - t * B < job.sample_range(0).stop for s, _, _ in read[0][t])
    assert moved > steps // 2, moved
    for r in ranks:  # resume after 437 steps: Megatron restores consumed_train_samples
        assert _read(job, r, data, 437 * B) == read[r][437:], r


def test_partial_global_batch_is_an_error_not_a_short_step() -> None:
    job = job_three_domains()
    domains = job_domains(job)
    scheme = planned_scheme(domains, domains[0].structure, "job")
    data = EodSamples(16, 48)
    batches = [
        {k: torch.stack([data[i][k] for i in (2 * j, 2 * j + 1)]) for k in data[0]}
        for j in range(6)
    ]
    steps = list(read_steps(iter(batches[:4]), chunks=4, eod_token=EOD, scheme=scheme))
    assert len(steps) == 1 and steps[0].batch["tokens"].shape == (8, 48)
    with pytest.raises(HexiSeqError, match=r"ended inside a global batch \(2 of 4"):
        list(read_steps(iter(batches), chunks=4, eod_token=EOD, scheme=scheme))


GOOD = {"hexiseq_global_batch": True, "reset_attention_mask": True, "dataloader_type": "single"}


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"reset_attention_mask": False}, "has no document boundaries: add --reset-attention"),
        ({"sft": True}, "packed SFT \\(THD\\) batches are not supported"),
        ({"pipeline_model_parallel_size": 2}, "with --pipeline-model-parallel-size 2 only"),
        ({"dataloader_type": "cyclic"}, "--dataloader-type cyclic: --hexiseq-global-batch"),
        ({"rampup_batch_size": [1, 1, 10]}, "--rampup-batch-size changes the global batch"),
        ({"full_validation": True}, "--full-validation reads the validation set"),
    ],
)
def test_global_batch_refusals_are_one_line(change: dict, message: str) -> None:
    with pytest.raises(HexiSeqError, match=message) as e:
        refuse_packed_combinations(argparse.Namespace(**{**GOOD, **change}))
    assert "\n" not in str(e.value)
    refuse_packed_combinations(argparse.Namespace(**GOOD))
    # TP bundles: every TP rank reads the step's samples itself (global_ahead)
    refuse_packed_combinations(argparse.Namespace(**GOOD, tensor_model_parallel_size=2))


def test_global_batch_flag_needs_a_layout_or_a_job() -> None:
    with pytest.raises(HexiSeqError, match="give --hexiseq-layout PATH .* or --hexiseq-job"):
        HexiSeqArgs(global_batch=True)
    assert HexiSeqArgs(global_batch=True, job="j.json").global_batch


def test_tp_domains_are_bundle_problems_and_their_layouts_bundle_layouts() -> None:
    """With TP bundles a job's domains are planned on the bundle problem (one device per bundle,
    one TP rank's model) and the scheme's layouts are over bundles, rounded to multiples of t;
    the agreement groups span every GPU of a domain's bundles. Whatever layout the scheme takes
    its model from, t comes from the domains (``run_global_batches`` passes a domain's)."""
    from test_job_runtime import job_tp

    from megatron_hexiseq.megatron.global_data import domain_side_ranks
    from megatron_hexiseq.megatron.job_runtime import domain_process_ranks

    job = job_tp()
    t = job.tensor_model_parallel_size
    domains = job_domains(job)
    assert [d.size for d in domains] == [1, 2] and t == 2
    for d in domains:
        assert d.structure.tensor_model_parallel_size == 1
        assert d.options.tensor_model_parallel_size == t
        assert d.cluster.world_size == d.structure.world_size
    assert domain_side_ranks(domains, t) == [sorted(r) for r in domain_process_ranks(job)]
    for model_from in (domains[1].structure, domain_layout(job, 1)[0]):
        scheme = planned_scheme(domains, model_from, "job")
        assert scheme.planner.model.num_attention_heads == 4  # 8 heads over TP 2
        layout = scheme.layout(1, [9, 3, 13, 1])  # 26 tokens over 2 bundles
        assert layout.tensor_model_parallel_size == t and layout.seq_length == 26
        assert all(r.num_tokens % t == 0 and r.num_tokens for r in layout.ranks)
