"""One CP communicator: ``build_runtime`` runs HexiSeq's sub-ring exchange on Megatron's CP group.

Layer (a): ``reused_cp_group`` (Megatron's group unless the NCCL YAML gives HexiSeq's CP traffic
its own options), and ``build_hexiseq_groups``'s refusals of a wrong ``cp_group``.
Layer (b), 4 gloo processes: Megatron's ``initialize_model_parallel`` with CP = 2 (two
data-parallel domains), then ``build_runtime`` on a 2-rank layout of two A2A groups; a spy on the
``new_group`` that ``attention.groups`` calls counts the groups HexiSeq creates: none (Megatron's CP
group is reused, and one-rank A2A groups need none), against one CP group per domain when the YAML
has a ``hexiseq_cp`` entry; the runtime's ``cp_group`` is Megatron's, and attention over it equals
the single-process oracle. With an A2A group of 2 ranks exactly one group per domain is created.
"""

from __future__ import annotations

import pytest
import torch

from megatron_hexiseq.errors import HexiSeqError
from megatron_hexiseq.layout import Layout, make_layout
from megatron_hexiseq.megatron.runtime import reused_cp_group
from megatron_hexiseq.testbed.spawn import run_ranks

TWO_GROUPS = make_layout(  # two A2A groups of one rank: the sub-ring runs on the CP group
    seq_length=24,
    num_attention_heads=4,
    num_query_groups=2,
    group_sizes=[1, 1],
    segments=[[(0, 5), (17, 24)], [(5, 17)]],
    heads=[[0, 1, 2, 3], [0, 1, 2, 3]],
)
ONE_GROUP = make_layout(  # one A2A group of two ranks
    seq_length=24,
    num_attention_heads=4,
    num_query_groups=2,
    group_sizes=[2],
    segments=[[(0, 10)], [(10, 24)]],
    heads=[[0, 1, 3], [2]],
)


def test_reused_cp_group_rule() -> None:
    megatron_cp = object()
    assert reused_cp_group(megatron_cp, {}) is megatron_cp  # type: ignore[arg-type]
    assert reused_cp_group(megatron_cp, {"cp": {"max_ctas": 4}}) is megatron_cp  # type: ignore[arg-type]
    assert reused_cp_group(megatron_cp, {"hexiseq_cp": {"max_ctas": 4}}) is None  # type: ignore[arg-type]
    assert reused_cp_group(None, {}) is None


def _worker(rank: int, world: int, layout: Layout, cfgs: dict) -> dict:
    import torch.distributed as dist
    from megatron.core import parallel_state as mpu

    import megatron_hexiseq.attention.groups as groups_mod
    from megatron_hexiseq.attention import hexiseq_attn_func, reference_attention
    from megatron_hexiseq.megatron.runtime import RunShape, build_runtime

    created: list[list[int]] = []

    class Spy:
        """``torch.distributed`` with ``new_group`` counted."""

        def __getattr__(self, name: str):
            return getattr(dist, name)

        def new_group(self, ranks, **kwargs):
            created.append(list(ranks))
            return dist.new_group(ranks, **kwargs)

    cp = layout.world_size
    mpu.initialize_model_parallel(tensor_model_parallel_size=1, context_parallel_size=cp)
    groups_mod.dist = Spy()  # type: ignore[assignment]
    try:
        run = RunShape(
            world_size=world,
            tensor_model_parallel_size=1,
            pipeline_model_parallel_size=1,
            context_parallel_size=cp,
            seq_length=layout.seq_length,
            num_attention_heads=4,
            num_query_groups=2,
            head_dim=8,
        )
        megatron_cp = mpu.get_context_parallel_group()
        runtime = build_runtime(layout, run, cp_group=megatron_cp, nccl_cfgs=cfgs)
        gen = torch.Generator().manual_seed(7)
        q, k, v = (
            torch.randn(layout.seq_length, 1, n, 8, generator=gen, dtype=torch.float64)
            for n in (4, 2, 2)
        )
        pos = torch.tensor(layout.ranks[runtime.rank].positions())
        out = hexiseq_attn_func(q[pos], k[pos], v[pos], groups=runtime.groups, kernel="reference")
        torch.testing.assert_close(out, reference_attention(q, k, v)[pos], rtol=1e-10, atol=1e-10)
        return {"created": created, "reused": runtime.groups.cp_group is megatron_cp}
    finally:
        groups_mod.dist = dist  # type: ignore[assignment]
        mpu.destroy_model_parallel()


@pytest.mark.parametrize(
    "layout,cfgs,created,reused",
    [
        (TWO_GROUPS, {}, [], True),  # no second communicator over the CP ranks
        (TWO_GROUPS, {"hexiseq_cp": {}}, [[0, 1], [2, 3]], False),  # own options: own group
        (ONE_GROUP, {}, [[0, 1], [2, 3]], True),  # only the A2A group of each domain
    ],
)
def test_build_runtime_reuses_megatrons_cp_group(layout, cfgs, created, reused) -> None:
    results = run_ranks(_worker, 4, layout, cfgs)
    assert [r["created"] for r in results] == [created] * 4
    assert all(r["reused"] is reused for r in results)


def test_cp_group_refusals(monkeypatch: pytest.MonkeyPatch) -> None:
    import megatron_hexiseq.attention.groups as groups_mod

    class One:
        def get_world_size(self):
            return 2

        def get_rank(self, group=None):
            return 0

        def get_process_group_ranks(self, group):
            return [0, 5]

    monkeypatch.setattr(groups_mod, "dist", One())
    with pytest.raises(HexiSeqError, match="the given CP group holds ranks \\[0, 5\\], its domain"):
        groups_mod.build_hexiseq_groups(ONE_GROUP, cp_group=object())  # type: ignore[arg-type]
    with pytest.raises(HexiSeqError, match="not both"):
        groups_mod.build_hexiseq_groups(ONE_GROUP, cp_groups=[object()], cp_group=object())  # type: ignore[list-item,arg-type]
