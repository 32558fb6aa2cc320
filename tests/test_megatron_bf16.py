"""Megatron integration in bf16, layer (b): Megatron's ``Float16Module`` around the HexiSeq GPT.

1. RoPE beyond 65536 under ``Float16Module`` (bf16 casts every floating buffer): the layout RoPE of a
   GPT with 131072 positions, wrapped in bf16, must return float32 angles bit-identical to the stock
   ``RotaryEmbedding`` of the same model in float32 at positions 65530..65541 and 120000..120007
   (in bf16 the angles of positions 120000..120007 would all be 119808; in fp16 past 65504: inf),
   and rotating a bf16 query with them must equal the stock rotation bit for bit.
2. A bf16 training step of the tiny GPT on a 3-rank uneven HexiSeq layout (two A2A groups, GQA)
   against the same weights in one process: the per-token loss and every parameter gradient are
   compared with the float32 single-process model, and must be as close to it as the stock bf16
   model (Megatron's own RoPE, plain causal attention) is: error <= 2 x the stock bf16 error + 2u
   (u = bf16 unit roundoff), normwise per gradient. A wrong block or a bf16 angle gives errors of
   order 1e-1.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_hexiseq.layout import make_layout
from megatron_hexiseq.testbed.spawn import run_ranks

LAYOUT = make_layout(
    seq_length=64,
    num_attention_heads=8,
    num_query_groups=2,
    group_sizes=[2, 1],
    segments=[[(0, 8), (50, 64)], [(8, 20)], [(20, 50)]],
    heads=[[0, 1, 2, 5], [3, 4, 6, 7], list(range(8))],
)
U_BF16 = torch.finfo(torch.bfloat16).eps / 2


def _cfg(layout):
    from dataclasses import replace

    from megatron_hexiseq.testbed.train import TINY_GPT, TrainConfig

    return TrainConfig(model=replace(TINY_GPT, num_layers=2), layout=layout)


def _bf16(model):
    from megatron.core.transformer.module import Float16Module

    model.config.bf16 = True
    return Float16Module(model.config, model)


def _step(model, batch):
    """Forward + backward of the per-token loss sum; returns (loss sum, tokens, grads by name)."""
    from megatron_hexiseq.megatron.loss import per_token_loss

    out = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    loss_sum, num_tokens = per_token_loss(out.float(), batch["loss_mask"])
    loss_sum.backward()
    inner = model.module if hasattr(model, "module") else model
    return (
        loss_sum.detach(),
        num_tokens.float(),
        {n: p.grad.float().clone() for n, p in inner.named_parameters()},
    )


def _rope_beyond_65536() -> None:
    from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb

    from megatron_hexiseq.megatron.config import cpu_device_shim
    from megatron_hexiseq.megatron.rope import install_rope
    from megatron_hexiseq.testbed.train import build_gpt

    long = make_layout(
        seq_length=131072,
        num_attention_heads=8,
        num_query_groups=2,
        group_sizes=[1],
        segments=[[(0, 131072)]],
        heads=[list(range(8))],
    )
    cfg = _cfg(long)
    positions = list(range(65530, 65542)) + list(range(120000, 120008))
    with cpu_device_shim():
        stock = build_gpt(cfg)
        want = stock.rotary_pos_emb(131072)[positions]  # stock RoPE, float32
        model = build_gpt(cfg)
        install_rope(model, positions)
        wrapped = _bf16(model)
    got = wrapped.module.rotary_pos_emb()
    assert got.dtype == torch.float32 and torch.equal(got, want), (
        "layout RoPE angles changed under bf16"
    )
    q = torch.randn(len(positions), 1, 8, 8).bfloat16()
    torch.testing.assert_close(
        apply_rotary_pos_emb(q, got, config=model.config),
        apply_rotary_pos_emb(q, want, config=model.config),
        rtol=0,
        atol=0,
    )


def _worker(rank: int, world: int) -> dict:
    from megatron.core import parallel_state as mpu

    from megatron_hexiseq.megatron.batch import slice_batch
    from megatron_hexiseq.megatron.config import cpu_device_shim
    from megatron_hexiseq.megatron.runtime import RunShape, build_runtime
    from megatron_hexiseq.testbed.train import build_gpt, make_batch

    cfg = _cfg(LAYOUT)
    batch = make_batch(cfg, 0, 0)
    if world == 1:  # the single-process references: float32 and stock bf16
        mpu.initialize_model_parallel(tensor_model_parallel_size=1, context_parallel_size=1)
        try:
            _rope_beyond_65536()
            with cpu_device_shim():
                fp32 = _step(build_gpt(cfg), batch)
                bf16 = _step(_bf16(build_gpt(cfg)), batch)
            return {"fp32": fp32, "bf16": bf16}
        finally:
            mpu.destroy_model_parallel()
    mpu.initialize_model_parallel(tensor_model_parallel_size=1, context_parallel_size=world)
    try:
        run = RunShape(
            world_size=world,
            tensor_model_parallel_size=1,
            pipeline_model_parallel_size=1,
            context_parallel_size=world,
            seq_length=LAYOUT.seq_length,
            num_attention_heads=8,
            num_query_groups=2,
            params_dtype="bfloat16",
            head_dim=8,
        )
        runtime = build_runtime(LAYOUT, run, cp_group=mpu.get_context_parallel_group())
        model = _bf16(build_gpt(cfg, runtime=runtime))
        loss, tokens, grads = _step(
            model, slice_batch(batch, segments=runtime.segments, seq_length=LAYOUT.seq_length)
        )
        for t in (
            loss,
            tokens,
            *grads.values(),
        ):  # parameters are replicated over CP: sum the shards
            dist.all_reduce(t)
        return {"hexiseq": (loss, tokens, grads)}
    finally:
        mpu.destroy_model_parallel()


def test_bf16_gpt_matches_float32_as_well_as_stock_bf16() -> None:
    ref = run_ranks(_worker, 1)[0]
    hexiseq = run_ranks(_worker, LAYOUT.world_size)[0]["hexiseq"]
    (l32, n32, g32), (l16, n16, g16), (lh, nh, gh) = ref["fp32"], ref["bf16"], hexiseq
    assert float(n32) == float(nh) == float(n16)
    loss32, loss16, lossh = float(l32 / n32), float(l16 / n16), float(lh / nh)
    assert abs(lossh - loss32) <= 2 * abs(loss16 - loss32) + 2 * U_BF16 * abs(loss32), (
        loss32,
        loss16,
        lossh,
    )
    assert g32.keys() == gh.keys() and len(g32) >= 8
    for name, want in g32.items():
        want = want / n32  # gradients of the per-token mean
        norm = float(torch.linalg.vector_norm(want))
        err_stock = float(torch.linalg.vector_norm(g16[name] / n16 - want)) / norm
        err_hexiseq = float(torch.linalg.vector_norm(gh[name] / nh - want)) / norm
        assert err_hexiseq <= 2 * err_stock + 2 * U_BF16, (
            f"{name}: hexiseq {err_hexiseq:.3g}, stock {err_stock:.3g}"
        )
