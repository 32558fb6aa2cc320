"""Layer (a): per-micro-batch layouts at the Megatron boundary, no processes (megatron-core wheel).

- the slicer records the boundaries of the whole micro-batch, asks the provider for that
  micro-batch's layout and hands each rank exactly its positions of that layout (several runs),
  a different layout every micro-batch; the THD seam does the same;
- RoPE follows the micro-batch's layout: stock float32 angles at the plan's positions (inside each
  document with ``--reset-position-ids`` and shared boundaries, global otherwise), its length is the
  plan's token count; the slicer and RoPE share one device index per micro-batch;
- the core attention's groups are the micro-batch's view of the job's groups;
- bad provider output is one clear ``HexiSeqError`` line: another structure, another length, a rank
  without tokens, not a Layout; no plan recorded; pipeline parallelism refused.
"""

from __future__ import annotations

import random
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from megatron_hexiseq.attention.documents import DocumentBounds
from megatron_hexiseq.attention.groups import HexiSeqGroups
from megatron_hexiseq.attention.testing_layouts import random_batch_layout
from megatron_hexiseq.errors import HexiSeqError
from megatron_hexiseq.layout import Layout, make_layout
from megatron_hexiseq.megatron.batch import LayoutBatchSlicer
from megatron_hexiseq.megatron.batch_layout import MicroBatchLayout
from megatron_hexiseq.megatron.documents import MicroBatchDocuments, positions_in_documents

S, EOD = 48, 99
JOB = make_layout(
    seq_length=S,
    num_attention_heads=4,
    num_query_groups=2,
    group_sizes=[2, 1],
    segments=[[(0, 6), (30, 40)], [(6, 18)], [(18, 30), (40, 48)]],
    heads=[[0, 1], [2, 3], [0, 1, 2, 3]],
)


def _groups(rank: int) -> HexiSeqGroups:
    """The job's groups as the runtime would hold them (no processes: no group objects)."""
    members = JOB.group_of(rank).ranks
    return HexiSeqGroups(
        layout=JOB,
        rank=rank,
        cp_group=None,  # type: ignore[arg-type]
        cp_global_ranks=(0, 1, 2),
        a2a_group=None,
        a2a_global_ranks=members,
    )


def _tokens(eod_at: list[list[int]], seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 90, (len(eod_at), S), generator=g)
    for b, where in enumerate(eod_at):
        tokens[b, where] = EOD
    return tokens


class _Provider:
    """A deterministic provider: a random layout of the job's structure seeded by the boundaries."""

    def __init__(self) -> None:
        self.seen: list[DocumentBounds | None] = []

    def __call__(self, bounds: DocumentBounds | None) -> Layout:
        self.seen.append(bounds)
        key = hash(bounds.samples) if bounds is not None else 0
        b = list(bounds.samples[0]) if bounds is not None else None
        return random_batch_layout(random.Random(key), JOB, bounds=b, min_tokens=1)


def _setup(rank: int, reset_position_ids: bool = True):
    docs = MicroBatchDocuments(
        seq_length=S, eod_token=EOD, reset_position_ids=reset_position_ids, required=True
    )
    provider = _Provider()
    slot = MicroBatchLayout(_groups(rank), provider, reset_position_ids=reset_position_ids)
    slicer = LayoutBatchSlicer(
        JOB.ranks[rank].segments, S, docs, reset_attention_mask=True, batch_layout=slot
    )
    return docs, provider, slot, slicer


def test_slicer_follows_each_micro_batchs_layout() -> None:
    for rank in range(3):
        docs, provider, slot, slicer = _setup(rank)
        layouts = []
        for eod_at, seed in (([[5, 17, 30], [2, 40]], 0), ([[11, 12, 29]] * 2, 1)):
            tokens = _tokens(eod_at, seed)
            labels = tokens + 1
            mask = torch.arange(2 * S).view(2, 1, 1, S).expand(2, 1, S, S).contiguous()
            out = slicer({"tokens": tokens, "labels": labels, "attention_mask": mask, "x": None})
            lay = slot.current().layout
            layouts.append(lay)
            assert provider.seen[-1] is docs.current()  # the boundaries of this micro-batch
            pos = lay.ranks[rank].positions()
            assert out["tokens"].tolist() == tokens[:, pos].tolist()
            assert out["labels"].tolist() == labels[:, pos].tolist()
            assert torch.equal(out["attention_mask"], mask[:, :, pos])
            assert out["x"] is None
            assert slot.current().groups.layout is lay
        assert layouts[0] != layouts[1] and any(len(r.segments) > 1 for r in layouts[0].ranks)
        # THD: the boundaries of the packed batch choose the layout
        thd, params = slicer.thd(
            {"tokens": tokens[:1]}, torch.tensor([0, 10, 40, S], dtype=torch.int32), None
        )
        lay = slot.current().layout
        assert params is None and provider.seen[-1].samples == ((0, 10, 40, S),)
        assert thd["tokens"].tolist() == tokens[:1, lay.ranks[rank].positions()].tolist()


def _rope(slot: MicroBatchLayout, docs: MicroBatchDocuments):
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    from megatron_hexiseq.megatron.config import cpu_device_shim
    from megatron_hexiseq.megatron.rope import install_rope

    stock = RotaryEmbedding(
        kv_channels=16,
        rotary_percent=1.0,
        use_cpu_initialization=True,
        cp_group=SimpleNamespace(size=lambda: 1),
    )
    with cpu_device_shim():
        full = stock.get_emb(S)  # [S, 1, 1, 16] at positions 0..S-1
    holder = torch.nn.Module()
    holder.rotary_pos_emb = stock
    rank = slot.groups.rank
    install_rope(holder, JOB.ranks[rank].positions(), docs, slot)
    return holder.rotary_pos_emb, full


@pytest.mark.parametrize("reset_position_ids", [True, False])
def test_rope_follows_each_micro_batchs_layout(reset_position_ids: bool) -> None:
    for rank in range(3):
        docs, _, slot, slicer = _setup(rank, reset_position_ids)
        rope, full = _rope(slot, docs)
        for eod_at, seed in (([[11, 12, 29]] * 2, 1), ([[5, 17, 30], [2, 40]], 0)):
            tokens = _tokens(eod_at, seed)
            slicer({"tokens": tokens})
            plan = slot.current()
            pos = plan.layout.ranks[rank].positions()
            bounds = docs.current()
            want = pos
            if reset_position_ids and bounds.shared:  # per-sample boundaries: global positions
                want = positions_in_documents(pos, bounds.samples[0])
            assert rope.get_rotary_seq_len() == len(pos)
            got = rope(rope.get_rotary_seq_len())
            assert got.dtype == torch.float32
            torch.testing.assert_close(got, full[want], rtol=0, atol=0)
            assert rope(0) is got  # once per micro-batch
            assert len(plan._device) == 1  # the slicer's and RoPE's index: one copy


def test_core_attention_groups_are_the_micro_batchs_view() -> None:
    from megatron_hexiseq.attention.kernels import Kernel
    from megatron_hexiseq.megatron.runtime import HexiSeqRuntime

    docs, _, slot, slicer = _setup(1)
    runtime = HexiSeqRuntime(
        layout=JOB, groups=slot.groups, kernel=Kernel.REFERENCE, documents=docs, batch_layout=slot
    )
    with pytest.raises(HexiSeqError, match="no layout was recorded for this micro-batch"):
        runtime.micro_batch_groups()
    slicer({"tokens": _tokens([[5, 17]], 0)})
    view = runtime.micro_batch_groups()
    assert view.layout is slot.current().layout and view.job_layout is JOB
    assert replace(runtime, batch_layout=None).micro_batch_groups() is slot.groups


def _bad(layout_fn, match: str) -> None:
    slot = MicroBatchLayout(_groups(0), lambda bounds: layout_fn())
    with pytest.raises(HexiSeqError, match=match) as err:
        slot.update(None)
    assert "\n" not in str(err.value)


def test_bad_provider_output_is_one_clear_error() -> None:
    segs = [list(r.segments) for r in JOB.ranks]
    other_heads = make_layout(
        seq_length=S,
        num_attention_heads=4,
        num_query_groups=2,
        group_sizes=[2, 1],
        segments=segs,
        heads=[[0], [1, 2, 3], [0, 1, 2, 3]],
    )
    _bad(lambda: other_heads, "does not fit the job's process groups: rank 0 has heads \\(0,\\)")
    shorter = make_layout(
        seq_length=40,
        num_attention_heads=4,
        num_query_groups=2,
        group_sizes=[2, 1],
        segments=[[(0, 6)], [(6, 18)], [(18, 40)]],
        heads=[[0, 1], [2, 3], [0, 1, 2, 3]],
    )
    _bad(lambda: shorter, "covers 40 tokens but the micro-batch has 48")
    empty = replace(
        JOB,
        ranks=(
            replace(JOB.ranks[0], segments=((0, 18), (30, 40))),
            replace(JOB.ranks[1], segments=()),
            JOB.ranks[2],
        ),
    )
    _bad(lambda: empty, "gives ranks \\[1\\] no tokens")
    _bad(lambda: [(0, 48)], "returned list, not a Layout")


def test_pipeline_parallelism_is_refused() -> None:
    from megatron_hexiseq.megatron.plugin import micro_batch_layout

    args = SimpleNamespace(pipeline_model_parallel_size=2, reset_position_ids=True)
    with pytest.raises(HexiSeqError, match="do not support pipeline parallelism"):
        micro_batch_layout(args, _groups(0), _Provider())
    args.pipeline_model_parallel_size = 1
    assert micro_batch_layout(args, _groups(0), _Provider()).reset_position_ids


def test_batch_plan_flag_builds_the_planner_from_the_layout() -> None:
    """``--hexiseq-batch-plan``: the planner comes from the cluster, model and options ``plan``
    records in the layout; it plans the union of per-sample boundaries; one line without them."""
    from test_demo import CLUSTER, _problem

    from megatron_hexiseq.attention.documents import parse_cu_seqlens
    from megatron_hexiseq.attention.groups import structure_difference
    from megatron_hexiseq.megatron.batch_layout import batch_planner_layouts
    from megatron_hexiseq.planner.plan import plan
    from megatron_hexiseq.varlen.batch import BatchPlanner

    cluster, model, options = _problem()
    job = plan(cluster, model, model.seq_length, options, reproducible=True)
    job = replace(job, meta={**job.meta, "cluster_spec": CLUSTER, "model_spec": model.to_dict()})
    provider = batch_planner_layouts(job)
    S = job.seq_length
    one = parse_cu_seqlens([0, 20, 21, 200, S], seq_length=S, batch=1)
    lay = provider(one)
    assert structure_difference(lay, job) is None and lay.seq_length == S
    assert lay == BatchPlanner(job, cluster, model, options).plan([20, 1, 179, S - 200]).layout
    two = parse_cu_seqlens([[0, 20, S], [0, 200, S]], seq_length=S, batch=2)
    assert provider(two) == provider(parse_cu_seqlens([0, 20, 200, S], seq_length=S, batch=1))
    with pytest.raises(HexiSeqError, match="add --reset-attention-mask"):
        provider(None)
    with pytest.raises(HexiSeqError, match="has no meta.cluster_spec, meta.model_spec"):
        batch_planner_layouts(replace(job, meta={"options": job.meta["options"]}), "layout x.json")
