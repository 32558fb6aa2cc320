"""Packed documents through real Megatron-LM ``core_v0.16.1``: layer (b), 3 gloo ranks vs 1.

``--reset-attention-mask --reset-position-ids --eod-mask-loss``: the HexiSeq run (a [2, 1] layout,
uneven and non-contiguous segments, uneven heads) builds its GPT through ``pretrain_gpt``'s own
``model_provider``/``gpt_builder`` via ``plugin.model_provider`` and slices the micro-batch with the
``pretrain_gpt.get_batch_on_this_cp_rank`` the plugin installs (which records the documents from the
EOD tokens of the whole batch); the reference is stock single-process Megatron (CP 1, the stock local
layer spec with Megatron's ``DotProductAttention``) fed the dense document mask, loss mask and
position ids of Megatron's own ``_get_ltor_masks_and_position_ids`` with the same flags. Same
weights (same seed, checked), same data (2 samples with different documents: 1-token documents,
EOD on segment edges, EOD as the last token): per-token losses and the gradient of the masked loss
sum of every parameter (summed over the CP ranks) must agree to fp32 reordering tolerance; and
without documents the losses must differ (the test can fail). Also: the THD seam
(``get_thd_batch_on_this_cp_rank``) records ``cu_seqlens_padded``. Needs ``MEGATRON_LM`` as
tests/test_megatron_lm.py does.
"""

from __future__ import annotations

import contextlib
import os
import sys
from types import SimpleNamespace

import pytest

from megatron_hexiseq.layout import make_layout
from megatron_hexiseq.testbed.spawn import run_ranks

MEGATRON_LM = os.environ.get("MEGATRON_LM")
pytestmark = pytest.mark.skipif(
    not MEGATRON_LM, reason="set MEGATRON_LM=<Megatron-LM core_v0.16.1 checkout>"
)

S, EOD = 48, 127
LAYOUT = make_layout(  # groups [2, 1]
    seq_length=S,
    num_attention_heads=8,
    num_query_groups=2,
    group_sizes=[2, 1],
    segments=[[(0, 6), (30, 40)], [(6, 18)], [(18, 30), (40, 48)]],
    heads=[[0, 1, 2], [3, 4, 5, 6, 7], list(range(8))],
)
EOD_AT = ([5, 11, 12, 29, 47], [17, 33, 34, 35])  # per sample: segment edges, 1-token documents
COMMON = (
    "--num-layers 2 --hidden-size 64 --num-attention-heads 8 --group-query-attention "
    "--num-query-groups 2 --ffn-hidden-size 96 --swiglu --normalization RMSNorm "
    f"--position-embedding-type rope --seq-length {S} --max-position-embeddings {S} "
    "--micro-batch-size 2 --global-batch-size 2 --lr 1e-3 --train-iters 1 --transformer-impl local "
    "--use-cpu-initialization --no-gradient-accumulation-fusion --attention-dropout 0 "
    "--hidden-dropout 0 --disable-bias-linear --mock-data --tokenizer-type NullTokenizer "
    "--vocab-size 127 --no-rope-fusion --no-masked-softmax-fusion --no-bias-dropout-fusion "
    "--no-persist-layer-norm --calculate-per-token-loss "
    "--reset-attention-mask --reset-position-ids --eod-mask-loss"
).split()


def _parse(argv: list[str], rank: int, world: int):
    import megatron.training.arguments as margs
    from megatron.training import global_vars

    from megatron_hexiseq.megatron import plugin

    margs.get_device_arch_version = lambda: 9  # CUDA-only query inside validate_args
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    sys.argv = ["pretrain_gpt.py"] + argv
    args = margs.parse_args(extra_args_provider=plugin.extra_args_provider(None))
    args.rank, args.world_size = rank, world
    margs.validate_args(args, {"tokenizer_type": "GPT2BPETokenizer"})
    args.padded_vocab_size = 128
    global_vars.set_args(args)
    global_vars._GLOBAL_TOKENIZER = SimpleNamespace(eod=EOD)  # NullTokenizer(127): eod = 127
    return args


def _batch(dense_mask: bool):
    """Megatron's own masks / positions for 2 samples with EOD tokens."""
    import torch
    from megatron.core.datasets.gpt_dataset import _get_ltor_masks_and_position_ids

    g = torch.Generator().manual_seed(3)
    text = torch.randint(0, 100, (2, S + 1), generator=g)
    for b, where in enumerate(EOD_AT):
        text[b, where] = EOD
    tokens, labels = text[:, :-1].contiguous(), text[:, 1:].contiguous()
    parts = [
        _get_ltor_masks_and_position_ids(tokens[b], EOD, True, True, True, dense_mask)
        for b in range(2)
    ]
    return {
        "tokens": tokens,
        "labels": labels,
        "loss_mask": torch.stack([p[1] for p in parts]),
        "attention_mask": torch.stack([p[0] for p in parts]) if dense_mask else None,
        "position_ids": torch.stack([p[2] for p in parts]),
    }


def _step(model, batch) -> dict:
    import torch

    model.zero_grad(set_to_none=True)
    losses = model(
        batch["tokens"], batch["position_ids"], batch["attention_mask"], labels=batch["labels"]
    )
    (losses.float() * batch["loss_mask"]).sum().backward()
    return {
        "losses": losses.detach().double(),
        "grads": {n: p.grad.double().clone() for n, p in model.named_parameters()},
        "params": torch.cat([p.detach().double().flatten() for p in model.parameters()]).sum(),
    }


def _hexiseq_worker(rank: int, world: int, checkout: str, layout_path: str, docs: bool) -> dict:
    sys.path.insert(0, checkout)
    import pretrain_gpt as stock
    import torch
    from megatron.core import parallel_state as mpu
    from megatron.core.process_groups_config import ProcessGroupCollection

    from megatron_hexiseq.megatron import plugin

    argv = COMMON + ["--context-parallel-size", "3", "--cp-comm-type", "hexiseq"]
    argv += ["--hexiseq-layout", layout_path, "--hexiseq-kernel", "reference"]
    argv += ["--no-create-attention-mask-in-dataloader"]
    if not docs:
        argv = [a for a in argv if a not in ("--reset-attention-mask", "--reset-position-ids")]
    args = _parse(argv, rank, world)
    mpu.initialize_model_parallel(tensor_model_parallel_size=1, context_parallel_size=3)
    torch.manual_seed(0)
    model = plugin.model_provider(stock.model_provider, stock.gpt_builder, stock)(
        pre_process=True,
        post_process=True,
        config=None,
        pg_collection=ProcessGroupCollection.use_mpu_process_groups(),
    )
    assert args.create_attention_mask_in_dataloader is False
    # Megatron's own get_batch: the plugin's prepared batches (boundaries read on the host by
    # the planning thread, this rank's slice copied) and the slicer passing it through
    keys = ("tokens", "labels", "loss_mask", "attention_mask", "position_ids")
    got = stock.get_batch(iter([_batch(dense_mask=False)]))
    assert got[-1] is None  # no PackedSeqParams
    out = _step(model, dict(zip(keys, got)))
    out["positions"] = LAYOUT.ranks[rank].positions()
    thd_batch = {
        "tokens": torch.zeros(1, S, dtype=torch.long),
        "cu_seqlens": torch.tensor([0, 10, 40, S, S], dtype=torch.int32),
        "cu_seqlens_padded": torch.tensor([0, 12, 40, S], dtype=torch.int32),
        "max_seqlen": torch.tensor([30]),
    }
    thd = stock.get_batch(iter([thd_batch]))
    runtime = plugin.HexiSeqCoreAttention
    for m in model.modules():
        if isinstance(m, runtime):
            out["thd"] = (thd[-1], m.runtime.documents.bounds.samples, thd[0].shape)
            break
    mpu.destroy_model_parallel()
    return out


def _reference_worker(rank: int, world: int, checkout: str) -> dict:
    sys.path.insert(0, checkout)
    import pretrain_gpt as stock
    import torch
    from megatron.core import parallel_state as mpu
    from megatron.core.process_groups_config import ProcessGroupCollection

    from megatron_hexiseq.megatron.config import cpu_device_shim

    _parse(COMMON, rank, world)
    mpu.initialize_model_parallel(tensor_model_parallel_size=1, context_parallel_size=1)
    from megatron.core.tensor_parallel.random import get_cuda_rng_tracker

    # dropout is 0: DotProductAttention's CUDA RNG fork draws nothing (and needs CUDA to exist)
    get_cuda_rng_tracker().fork = lambda *a, **k: contextlib.nullcontext()
    torch.manual_seed(0)
    with cpu_device_shim():
        model = stock.model_provider(
            stock.gpt_builder,
            True,
            True,
            None,
            config=None,
            pg_collection=ProcessGroupCollection.use_mpu_process_groups(),
        )
        out = _step(model, _batch(dense_mask=True))
    mpu.destroy_model_parallel()
    return out


def test_reset_attention_mask_matches_stock_megatron(tmp_path) -> None:
    import torch

    path = tmp_path / "layout.json"
    LAYOUT.save(path)
    (ref,) = run_ranks(_reference_worker, 1, MEGATRON_LM, timeout_s=900)
    for docs in (True, False):
        results = run_ranks(_hexiseq_worker, 3, MEGATRON_LM, str(path), docs, timeout_s=900)
        for res in results:
            assert abs(res["params"] - ref["params"]) < 1e-9  # the same weights
        losses = torch.zeros_like(ref["losses"])
        for res in results:
            losses[:, res["positions"]] = res["losses"]
        if not docs:  # attending across documents changes the losses: the comparison can fail
            assert not torch.allclose(losses, ref["losses"], rtol=1e-3, atol=1e-4)
            continue
        # fp32 sums over <= 2 x 48 tokens in different orders (and float32 RoPE angles at
        # document positions instead of global ones): relative 1e-5 leaves a wide margin
        torch.testing.assert_close(losses, ref["losses"], rtol=1e-5, atol=1e-5)
        for name, want in ref["grads"].items():
            got = sum(res["grads"][name] for res in results)
            scale = want.abs().max().item() + 1e-6
            torch.testing.assert_close(got / scale, want / scale, rtol=0, atol=2e-5, msg=name)
        thd_params, bounds, shape = results[0]["thd"]
        assert thd_params is None and bounds == ((0, 12, 40, S),)
        assert shape == (1, LAYOUT.ranks[0].num_tokens)
