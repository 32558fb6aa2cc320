"""Megatron integration, layer (a): no processes.

Flags (the pinned set), start-up checks (each mismatch has its message), batch slicing against
Megatron's own ``get_batch_on_this_cp_rank``, layout RoPE against Megatron's ``RotaryEmbedding``,
per-token loss, and the spec swap (local, MoE block, and TE spec when TE is installed).
"""

from __future__ import annotations

import argparse
import importlib.util
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from megatron_hexiseq.errors import HexiSeqError
from megatron_hexiseq.layout import make_layout, zigzag_segments
from megatron_hexiseq.megatron.args import HexiSeqArgs, add_hexiseq_args, flag_names
from megatron_hexiseq.megatron.batch import LayoutBatchSlicer, slice_batch
from megatron_hexiseq.megatron.loss import per_token_loss
from megatron_hexiseq.megatron.runtime import RunShape, check_devices, check_run, gpu_name_matches


def _layout(**kw):
    base = dict(
        seq_length=48,
        num_attention_heads=8,
        num_query_groups=2,
        group_sizes=[3, 1],
        segments=[[(0, 6), (40, 44)], [(6, 16)], [(16, 22), (44, 48)], [(22, 40)]],
        heads=[[0, 1, 2], [3, 4, 5, 6], [7], list(range(8))],
    )
    base.update(kw)
    return make_layout(**base)


def _run(**kw) -> RunShape:
    base = dict(
        world_size=8,
        tensor_model_parallel_size=1,
        pipeline_model_parallel_size=1,
        context_parallel_size=4,
        seq_length=48,
        num_attention_heads=8,
        num_query_groups=2,
    )
    base.update(kw)
    return RunShape(**base)


# ---- flags ---------------------------------------------------------------------------------
def test_flag_set_is_pinned():
    assert flag_names() == (
        "--hexiseq-layout",
        "--hexiseq-job",
        "--hexiseq-kernel",
        "--hexiseq-fp32-grad-wire",
        "--hexiseq-comm-chunks",
        "--hexiseq-allow-mismatch",
        "--hexiseq-batch-plan",
        "--hexiseq-global-batch",
        "--hexiseq-overlap-tune",
        "--hexiseq-overlap-config",
        "--hexiseq-check-params",
    )


def test_flags_parse_round_trip_and_chain():
    chained = []

    def other(parser):
        chained.append(True)
        parser.add_argument("--other-flag", type=int, default=0)
        return parser

    parser = add_hexiseq_args(argparse.ArgumentParser(), chain=other)
    args = parser.parse_args(
        [
            "--hexiseq-layout",
            "l.json",
            "--hexiseq-kernel",
            "reference",
            "--hexiseq-comm-chunks",
            "4",
            "--hexiseq-overlap-tune",
            "--other-flag",
            "3",
        ]
    )
    hs = HexiSeqArgs.from_namespace(args)
    assert chained and args.other_flag == 3
    assert hs == HexiSeqArgs(layout="l.json", kernel="reference", comm_chunks=4, overlap_tune=True)
    assert hs.enabled and not HexiSeqArgs.from_namespace(parser.parse_args([])).enabled
    with pytest.raises(SystemExit):
        parser.parse_args(["--hexiseq-kernel", "nope"])
    with pytest.raises(HexiSeqError, match="comm-chunks must be >= 1"):
        HexiSeqArgs(comm_chunks=0)
    with pytest.raises(HexiSeqError, match="not both"):
        HexiSeqArgs(overlap_tune=True, overlap_config="x.json")


def test_run_shape_from_megatron_args():
    args = SimpleNamespace(
        world_size=4,
        tensor_model_parallel_size=1,
        pipeline_model_parallel_size=1,
        context_parallel_size=4,
        seq_length=48,
        num_attention_heads=8,
        num_query_groups=2,
        group_query_attention=False,
        cp_comm_type=["hexiseq"],
        calculate_per_token_loss=True,
    )
    run = RunShape.from_megatron_args(args)
    assert run.num_query_groups == 8 and run.cp_comm_type == "hexiseq"  # GQA off -> groups = heads
    args.group_query_attention, args.cp_comm_type = True, ["p2p", "hexiseq"]
    run = RunShape.from_megatron_args(args)
    assert run.num_query_groups == 2 and run.cp_comm_type == "p2p hexiseq"


# ---- start-up checks -----------------------------------------------------------------------
@pytest.mark.parametrize(
    "change, message",
    [
        (dict(cp_comm_type="p2p"), "needs --cp-comm-type hexiseq"),
        (dict(context_parallel_size=2), "has 4 ranks but --context-parallel-size is 2"),
        (dict(world_size=6), "world size 6 is not a multiple of TP x PP x CP"),
        (dict(tensor_model_parallel_size=2), "--tensor-model-parallel-size 1"),
        (dict(seq_length=64), "planned for seq_length 48 but --seq-length is 64"),
        (
            dict(num_attention_heads=16),
            "planned for 8 attention heads but the model has --num-attention-heads 16",
        ),
        (dict(num_query_groups=4), "planned for 2 query groups but the model has 4"),
        (dict(calculate_per_token_loss=False), "add --calculate-per-token-loss"),
        (dict(multi_latent_attention=True), "multi-latent-attention"),
    ],
)
def test_check_run_messages(change, message):
    check_run(_layout(), _run())  # the matching run passes
    with pytest.raises(HexiSeqError, match=message.replace("(", r"\(").replace("+", r"\+")):
        check_run(_layout(), _run(**change))


def test_check_run_rejects_ranks_without_tokens():
    lay = _layout(segments=[[(0, 6), (40, 48)], [], [(6, 22)], [(22, 40)]])
    with pytest.raises(HexiSeqError, match=r"layout ranks \[1\] hold no tokens"):
        check_run(lay, _run())


def test_device_checks():
    assert gpu_name_matches("H100", "NVIDIA H100 80GB HBM3")
    assert gpu_name_matches("A100-80GB", "NVIDIA A100-SXM4-80GB")
    assert not gpu_name_matches("H100", "NVIDIA A100-SXM4-80GB")
    lay = _layout(gpus=["H100", "H100", "H100", "A100"])
    domains = [[0, 1, 2, 3], [4, 5, 6, 7]]
    good = ["NVIDIA H100 80GB HBM3"] * 3 + ["NVIDIA A100-SXM4-80GB"]
    assert check_devices(lay, domains, good * 2) == []
    assert check_devices(lay, domains, [None] * 8) == []  # no GPU: nothing to check
    swapped = good * 1 + good[:2] + good[3:] + good[2:3]  # replica 1: ranks 6 and 7 swapped
    with pytest.raises(
        HexiSeqError,
        match=r"global rank 6 \(layout rank 2\) runs on 'NVIDIA A100-SXM4-80GB' "
        r"but the layout planned 'H100'.*--hexiseq-allow-mismatch",
    ):
        check_devices(lay, domains, swapped)
    assert len(check_devices(lay, domains, swapped, allow_mismatch=True)) == 2


# ---- batch slicing -------------------------------------------------------------------------
def test_slice_batch_matches_megatron_zigzag(monkeypatch):
    import megatron.core.utils as mcore_utils
    from megatron.core.utils import get_batch_on_this_cp_rank

    monkeypatch.setattr(
        mcore_utils, "get_pg_size", lambda g: g.size()
    )  # a fake CP group, no processes
    monkeypatch.setattr(mcore_utils, "get_pg_rank", lambda g: g.rank())

    S, cp, b = 32, 4, 2
    full = {
        "tokens": torch.arange(b * S).view(b, S),
        "labels": torch.arange(b * S).view(b, S) + 1000,
        "loss_mask": torch.rand(b, S),
        "position_ids": torch.arange(S).expand(b, S),
        "attention_mask": torch.rand(b, 1, S, S) > 0.5,
    }
    for r, segs in enumerate(zigzag_segments(S, cp)):
        group = SimpleNamespace(size=lambda: cp, rank=lambda r=r: r)
        want = get_batch_on_this_cp_rank(dict(full), cp_group=group)
        got = LayoutBatchSlicer(segs, S)(dict(full))
        assert want.keys() == got.keys()
        for k in want:
            torch.testing.assert_close(got[k], want[k], rtol=0, atol=0)


def test_slice_batch_uneven_and_errors():
    lay = _layout()
    tokens = torch.arange(48).view(1, 48)
    parts = [
        slice_batch({"tokens": tokens, "attention_mask": None}, segments=r.segments, seq_length=48)
        for r in lay.ranks
    ]
    assert [p["tokens"].tolist()[0] for p in parts] == [r.positions() for r in lay.ranks]
    assert all(p["attention_mask"] is None for p in parts)
    with pytest.raises(HexiSeqError, match="batch 'tokens' has shape \\(1, 40\\)"):
        slice_batch({"tokens": tokens[:, :40]}, segments=lay.ranks[0].segments, seq_length=48)


# ---- RoPE ----------------------------------------------------------------------------------
@pytest.mark.parametrize("interleaved, factor", [(False, None), (True, 2.0)])
def test_layout_rope_matches_megatron(interleaved, factor):
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    from megatron_hexiseq.megatron.config import cpu_device_shim
    from megatron_hexiseq.megatron.rope import install_rope

    lay = _layout()
    stock = RotaryEmbedding(
        kv_channels=16,
        rotary_percent=1.0,
        rotary_interleaved=interleaved,
        seq_len_interpolation_factor=factor,
        use_cpu_initialization=True,
        cp_group=SimpleNamespace(size=lambda: 1),
    )
    with cpu_device_shim():
        full = stock.get_emb(48)  # [S, 1, 1, 16]
    for r in lay.ranks:
        holder = torch.nn.Module()
        holder.rotary_pos_emb = stock
        install_rope(holder, r.positions())
        got = holder.rotary_pos_emb(holder.rotary_pos_emb.get_rotary_seq_len())
        assert got.shape == (r.num_tokens, 1, 1, 16)
        torch.testing.assert_close(got, full[r.positions()], rtol=0, atol=0)


# ---- loss ----------------------------------------------------------------------------------
def test_per_token_loss_weighs_tokens_not_ranks():
    losses = torch.tensor([[1.0, 2.0, 3.0, 4.0, 5.0, 6.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0, 1.0, 1.0, 1.0]])
    full_sum, full_n = per_token_loss(losses, mask)
    a_sum, a_n = per_token_loss(losses[:, :1], mask[:, :1])  # uneven shards: 1 and 5 tokens
    b_sum, b_n = per_token_loss(losses[:, 1:], mask[:, 1:])
    assert (int(full_n), float(full_sum)) == (5, 18.0)
    assert float((a_sum + b_sum) / (a_n + b_n)) == pytest.approx(18.0 / 5)
    assert float(a_sum / a_n + b_sum / b_n) / 2 != pytest.approx(18.0 / 5)  # mean of means is wrong


# ---- spec swap -----------------------------------------------------------------------------
def _runtime():
    from megatron_hexiseq.attention.kernels import Kernel
    from megatron_hexiseq.megatron.runtime import HexiSeqRuntime

    lay = _layout()
    return HexiSeqRuntime(
        layout=lay, groups=SimpleNamespace(rank=0, layout=lay), kernel=Kernel.REFERENCE
    )


def test_spec_swap_local_and_moe():
    from megatron.core.models.gpt.gpt_layer_specs import (
        get_gpt_decoder_block_spec,
        get_gpt_layer_local_spec,
    )
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    from megatron_hexiseq.megatron.config import transformer_config
    from megatron_hexiseq.megatron.core_attention import HexiSeqCoreAttention
    from megatron_hexiseq.megatron.spec import count_core_attention, hexiseq_spec
    from megatron_hexiseq.testbed.train import TINY_GPT

    rt = _runtime()
    local = get_gpt_layer_local_spec()
    swapped = hexiseq_spec(local, rt)
    assert (
        count_core_attention(swapped) == 1 and count_core_attention(local, DotProductAttention) == 1
    )
    core = swapped.submodules.self_attention.submodules.core_attention
    assert core.module is HexiSeqCoreAttention and core.params["runtime"] is rt
    assert swapped.submodules.mlp == local.submodules.mlp  # everything else untouched

    config = transformer_config(TINY_GPT)
    config.num_moe_experts, config.moe_layer_freq = 4, [1, 0, 1, 0]
    block = get_gpt_decoder_block_spec(config, use_transformer_engine=False, pp_rank=0)
    swapped_block = hexiseq_spec(block, rt)
    assert count_core_attention(swapped_block) == 4 == len(swapped_block.layer_specs)
    assert count_core_attention(block, DotProductAttention) == 4  # input not modified
    with pytest.raises(HexiSeqError, match="no core_attention"):
        hexiseq_spec(torch.nn.Identity, rt)


@pytest.mark.skipif(
    importlib.util.find_spec("transformer_engine") is None,
    reason="Transformer Engine not installed",
)
def test_spec_swap_te_keeps_te_linears():  # layer (c) when TE is present
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_with_transformer_engine_spec

    from megatron_hexiseq.megatron.spec import count_core_attention, hexiseq_spec

    te = get_gpt_layer_with_transformer_engine_spec()
    swapped = hexiseq_spec(te, _runtime())
    assert count_core_attention(swapped) == 1
    assert (
        swapped.submodules.self_attention.submodules.linear_qkv
        is te.submodules.self_attention.submodules.linear_qkv
    )


def test_core_attention_rejects_unsupported():
    from megatron.core.transformer.enums import AttnMaskType

    from megatron_hexiseq.megatron.config import transformer_config
    from megatron_hexiseq.megatron.core_attention import HexiSeqCoreAttention
    from megatron_hexiseq.testbed.train import TINY_GPT

    config, rt = transformer_config(TINY_GPT), _runtime()
    kw = dict(
        config=config,
        layer_number=1,
        attn_mask_type=AttnMaskType.causal,
        attention_type="self",
        runtime=rt,
    )
    HexiSeqCoreAttention(**kw)
    with pytest.raises(HexiSeqError, match="causal"):
        HexiSeqCoreAttention(**{**kw, "attn_mask_type": AttnMaskType.padding})
    with pytest.raises(HexiSeqError, match="--cp-comm-type hexiseq"):
        HexiSeqCoreAttention(**kw, cp_comm_type="p2p")
    bad = transformer_config(replace(TINY_GPT, num_attention_heads=4, kv_channels=16))
    with pytest.raises(HexiSeqError, match="model has 4 heads"):
        HexiSeqCoreAttention(**{**kw, "config": bad})


def test_docs_list_every_flag():
    from pathlib import Path

    text = (Path(__file__).resolve().parents[1] / "docs" / "megatron.md").read_text()
    missing = [f for f in flag_names() if f"`{f}" not in text]
    assert not missing, f"docs/megatron.md does not document {missing}"
