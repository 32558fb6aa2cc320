"""The CPU training driver on packed micro-batches, layer (b): 4 gloo ranks vs 1 process.

A [3, 1] job layout (uneven segments and heads) trains the tiny GPT on packed micro-batches whose
documents end with the EOD token (``TrainConfig.documents``, a different list every step): the ranks
read the boundaries from the EOD tokens through ``LayoutBatchSlicer`` (``--reset-attention-mask``),
(1) on the job's layout, (2) with a per-micro-batch layout every step (``TrainConfig.batch_layouts``:
random layouts of the job's structure, several runs per rank, whole documents inside one group),
(3) as (2) with ``reset_position_ids``. Per-token losses of 3 AdamW steps and every parameter
gradient of step 0 must equal the single-process model whose dense attention is masked with the
same documents (fp32 reordering tolerance of tests/test_megatron_gpt.py); the planner's calls are
timed once per step.
"""

from __future__ import annotations

import random
from dataclasses import replace

import numpy as np
import pytest
import torch
from test_megatron_gpt import HETERO, reordering_tolerance

from megatron_hexiseq.attention.testing_layouts import random_batch_layout
from megatron_hexiseq.layout import Layout
from megatron_hexiseq.testbed.spawn import run_ranks
from megatron_hexiseq.testbed.train import TrainConfig, reference_rank_many, train_rank_many

DOCUMENTS = ((5, 1, 20, 22), (48,), (10, 10, 1, 1, 26))  # per step; 1-token documents


class RandomBatchLayouts:
    """Document lengths -> a random layout of the job's structure, seeded by the lengths."""

    def __init__(self, job: Layout) -> None:
        self.job = job

    def __call__(self, lengths: tuple[int, ...]) -> Layout:
        rng = random.Random(hash(lengths))
        cu = [0, *np.cumsum(lengths).tolist()]
        return random_batch_layout(rng, self.job, bounds=cu, min_tokens=1)


BASE = TrainConfig(
    layout=HETERO, steps=3, kernel="reference", return_grads=True, documents=DOCUMENTS
)
CASES = [
    BASE,
    replace(BASE, batch_layouts=RandomBatchLayouts(HETERO), kernel="auto", comm_chunks=2),
    replace(BASE, batch_layouts=RandomBatchLayouts(HETERO), reset_position_ids=True),
]


@pytest.fixture(scope="module")
def runs():
    parallel = run_ranks(train_rank_many, 4, CASES, timeout_s=600)
    reference = run_ranks(reference_rank_many, 1, CASES[:1], timeout_s=600)[0][0]
    return parallel, reference


@pytest.mark.parametrize("case", [0, 1, 2], ids=["fixed", "per-batch", "per-batch-reset-pos"])
def test_packed_training_matches_single_process(runs, case: int) -> None:
    parallel, ref = runs
    per_rank = [results[case] for results in parallel]
    tol = reordering_tolerance(CASES[case])
    for res in per_rank:
        torch.testing.assert_close(
            torch.tensor(res.losses), torch.tensor(ref.losses), rtol=tol, atol=0
        )
        if CASES[case].batch_layouts is None:
            assert res.plan_times_s is None
        else:
            assert len(res.plan_times_s) == len(DOCUMENTS)
    got = per_rank[0].grads
    assert got.keys() == ref.grads.keys()
    for name, want in ref.grads.items():
        assert want.abs().max() > 0, name
        torch.testing.assert_close(
            got[name],
            want,
            rtol=tol,
            atol=tol * float(want.abs().max()),
            msg=lambda m: f"gradient of {name}: {m}",
        )


def test_per_batch_layouts_differ_every_step() -> None:
    source = RandomBatchLayouts(HETERO)
    layouts = [source(lengths) for lengths in DOCUMENTS]
    assert len({lay.ranks[0].segments for lay in layouts}) == len(DOCUMENTS)
    assert all(lay != HETERO for lay in layouts)


def test_documents_must_fill_the_micro_batch() -> None:
    from megatron_hexiseq.errors import HexiSeqError

    with pytest.raises(HexiSeqError, match="documents\\[1\\] must be positive lengths summing"):
        replace(BASE, documents=((48,), (40,)))
    with pytest.raises(HexiSeqError, match="batch_layouts and reset_position_ids need documents"):
        replace(BASE, documents=None, batch_layouts=RandomBatchLayouts(HETERO))


# ---- testbed/packed.py: the three schemes on the testbed ----------------------------------------
def test_even_split_is_thds_zigzag_per_document() -> None:
    from test_demo import _problem

    from megatron_hexiseq.testbed.packed import even_split, ring_structure

    cluster, model, _ = _problem()
    ring = ring_structure(cluster, model, 384)
    assert [g.ranks for g in ring.groups] == [(0,), (1,), (2,)]
    assert all(r.heads == tuple(range(8)) for r in ring.ranks)
    lengths = (60, 1, 300, 23)
    lay = even_split(ring, lengths)
    cu = np.cumsum((0,) + lengths)
    for d in (0, 2, 3):  # each document in 6 near-equal chunks, rank i: chunks i and 5 - i
        a, b = int(cu[d]), int(cu[d + 1])
        cuts = [a + (b - a) * k // 6 for k in range(7)]
        for i in range(3):
            mine = {p for s, e in lay.ranks[i].segments for p in range(s, e) if a <= p < b}
            want = set(range(cuts[i], cuts[i + 1])) | set(range(cuts[5 - i], cuts[6 - i]))
            assert mine == want, (d, i)
    assert all(r.num_tokens for r in even_split(ring, (384,)).ranks)


def test_packed_batches_scale_and_fill() -> None:
    from megatron_hexiseq.errors import HexiSeqError
    from megatron_hexiseq.testbed.packed import packed_batches

    batches = packed_batches([1600, 48, 3200, 160, 16], 384, 5, 0, 1 / 16)
    assert all(sum(b) == 384 for b in batches) and len(batches) == 5
    assert max(x for b in batches for x in b) <= 200
    with pytest.raises(HexiSeqError, match="--doc-scale must be in"):
        packed_batches([10], 384, 1, 0, 0.0)


@pytest.mark.skipif(len(__import__("os").sched_getaffinity(0)) < 2, reason="needs 2 cores")
def test_three_schemes_train_the_same_losses() -> None:
    """``compare_packed`` on the demo's fixed 3-rank cluster: the THD-style split, the fixed
    layout and the planner's per-micro-batch layouts (a new layout every step) train the same
    losses as the single-process document-masked reference."""
    from dataclasses import replace as dc_replace

    from test_demo import _problem

    from megatron_hexiseq.planner.plan import plan
    from megatron_hexiseq.testbed.packed import compare_packed

    cluster, model, options = _problem()
    layout = plan(cluster, model, model.seq_length, options, reproducible=True)
    lengths = [1600, 48, 3200, 160, 16, 900, 2400, 70, 33, 5000, 120, 640]
    rec = compare_packed(cluster, model, options, layout, "1+2", lengths, steps=3, warmup=1)
    assert rec["losses_agree"], rec["loss_max_rel_diff"]
    schemes = rec["schemes"]
    assert list(schemes) == ["thd-even", "hexiseq-fixed", "hexiseq-batch"]
    batch = schemes["hexiseq-batch"]
    assert batch["plan_ms_p50"] is not None and schemes["hexiseq-fixed"]["plan_ms_p50"] is None
    assert len({tuple(t) for t in schemes["thd-even"]["per_rank_tokens"]}) > 1  # per step
    for r in schemes.values():
        assert len(r["measured_step_s"]) == len(r["predicted_step_s"]) == 3
        assert r["tokens_per_s"] > 0 and r["predicted_tokens_per_s"] > 0
    cfg = TrainConfig(
        model=dc_replace(model, seq_length=layout.seq_length),
        layout=layout,
        steps=3,
        bucket_size=None,
        documents=tuple(tuple(b) for b in rec["doc_lengths"]),
    )
    ref = run_ranks(reference_rank_many, 1, [cfg])[0][0]
    tol = reordering_tolerance(cfg)
    for r in schemes.values():
        torch.testing.assert_close(
            torch.tensor(r["losses"]), torch.tensor(ref.losses), rtol=tol, atol=0
        )
