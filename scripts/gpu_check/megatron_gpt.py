"""The ``megatron`` part of the GPU check: a megatron-core GPT with HexiSeq attention against stock
Megatron.

One process holds a world of one (NCCL on a GPU, gloo on CPU; Megatron's parallel state with
TP = PP = CP = 1). On the same weights and the same tokens it runs, in bf16 (``Float16Module``):

- stock Megatron: the layer spec's own core attention over the whole sequence on one device
  (``DotProductAttention`` for the local spec, ``TEDotProductAttention`` for the Transformer Engine
  spec; on CPU the local spec's stand-in ``LocalCausalAttention``, since the stock one needs CUDA);
- HexiSeq: the same spec with ``HexiSeqCoreAttention``, one model per layout rank of an uneven
  3-rank layout (two A2A groups of 2 and 1 ranks, non-contiguous segments and query heads, GQA),
  every rank a thread under the NCCL-rule harness (``sim.simulated_dist``), each on its
  own tokens with the layout's RoPE positions;
- the yardstick: the stock model in float32.

With packed documents (``local_documents``, the local spec): the same run with document
boundaries (``[0, S/8, S/3, 5S/8, S]``, global positions for RoPE on both sides): HexiSeq gets them
through its runtime's ``MicroBatchDocuments`` slot, as the batch slicer records them in training;
the stock model's core attention is ``LocalCausalAttention`` with the same slot (a dense
"same document and causal" mask in plain torch; Megatron's own ``DotProductAttention`` would
ignore a mask under its fused causal softmax), on both devices.

Compared: EACH layer's core-attention output (hooks; HexiSeq's ranks' rows put back in position
order) and EVERY parameter gradient of the per-token loss (HexiSeq: the sum over ranks). HexiSeq
passes when its normwise error against float32 is at most twice stock bf16's error plus 4u
(u = bf16 unit roundoff) for every layer and every gradient. The weights are drawn with std 0.1
(not Megatron's 0.02), so that attention is sharp enough for a wrong head or a missing key block to
move the outputs (with near-uniform attention every head reads about the mean of its values).
"""

from __future__ import annotations

import contextlib
import importlib.util
import threading
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from megatron_hexiseq.attention import build_hexiseq_groups
from megatron_hexiseq.attention.kernel_check import normwise_error
from megatron_hexiseq.attention.kernels import Kernel, resolve_kernel
from megatron_hexiseq.layout import Layout, make_layout
from megatron_hexiseq.megatron.config import cpu_device_shim, transformer_config
from megatron_hexiseq.megatron.documents import MicroBatchDocuments
from megatron_hexiseq.megatron.loss import per_token_loss
from megatron_hexiseq.megatron.rope import install_rope
from megatron_hexiseq.megatron.runtime import HexiSeqRuntime
from megatron_hexiseq.megatron.spec import hexiseq_spec
from megatron_hexiseq.model import ModelSpec

from .sim import on_device, simulated_dist

U_BF16 = torch.finfo(torch.bfloat16).eps / 2
INIT_STD = 0.1


def tiny_gpt(S: int, quick: bool) -> ModelSpec:
    h = 64 if quick else 256
    return ModelSpec(
        name="gpu-check",
        num_layers=2,
        hidden_size=h,
        num_attention_heads=8,
        num_query_groups=2,
        ffn_hidden_size=96 if quick else 512,
        vocab_size=512,
        kv_channels=h // 8,
        swiglu=True,
        seq_length=S,
        normalization="RMSNorm",
        add_bias_linear=False,
    )


def three_rank_layout(S: int) -> Layout:
    """Two A2A groups (ranks 0, 1 | rank 2), uneven non-contiguous segments, split query heads."""
    a, b, c = S // 8, 5 * S // 16, 25 * S // 32
    return make_layout(
        seq_length=S,
        num_attention_heads=8,
        num_query_groups=2,
        group_sizes=[2, 1],
        segments=[[(0, a), (c, S)], [(a, b)], [(b, c)]],
        heads=[[0, 1, 2, 5], [3, 4, 6, 7], list(range(8))],
    )


def layer_specs(device: torch.device) -> tuple[dict[str, Callable[[], Any]], dict[str, str]]:
    """The layer specs to check, and why the others are skipped."""
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

    specs: dict[str, Callable[[], Any]] = {}
    skipped: dict[str, str] = {}
    if importlib.util.find_spec("transformer_engine") is None:
        skipped["transformer_engine"] = "Transformer Engine is not installed"
    elif device.type != "cuda":
        skipped["transformer_engine"] = "Transformer Engine needs CUDA"
    else:
        from megatron.core.models.gpt.gpt_layer_specs import (
            get_gpt_layer_with_transformer_engine_spec,
        )

        specs["transformer_engine"] = get_gpt_layer_with_transformer_engine_spec
    specs["local"] = lambda: get_gpt_layer_local_spec(normalization="RMSNorm")
    return specs, skipped


def _stock_spec(
    make_spec: Callable[[], Any], device: torch.device, documents: MicroBatchDocuments | None
) -> Any:
    spec = make_spec()
    if device.type == "cpu" or documents is not None:
        # the stock DotProductAttention allocates on CUDA, and under its fused causal softmax it
        # would ignore a document mask: the plain-torch oracle attention of the same slot
        from megatron.core.transformer.spec_utils import ModuleSpec

        from megatron_hexiseq.megatron.reference_attention import LocalCausalAttention

        spec.submodules.self_attention.submodules.core_attention = ModuleSpec(
            module=LocalCausalAttention, params={"documents": documents}
        )
    return spec


def _documents(S: int, cu: list[int] | None) -> MicroBatchDocuments | None:
    """A document slot holding ``cu`` (the slicer's role in training), or None without documents."""
    if cu is None:
        return None
    slot = MicroBatchDocuments(
        seq_length=S, eod_token=None, reset_position_ids=False, required=True
    )
    slot.update(cu, batch=1)
    return slot


def _build(
    tiny: ModelSpec, spec: Any, bf16: bool, device: torch.device, positions: list[int] | None
) -> torch.nn.Module:
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.module import Float16Module

    config = transformer_config(tiny, init_method_std=INIT_STD)
    with cpu_device_shim():
        model = GPTModel(
            config=config,
            transformer_layer_spec=spec,
            vocab_size=tiny.vocab_size,
            max_sequence_length=tiny.seq_length,
            position_embedding_type="rope",
            share_embeddings_and_output_weights=False,
        )
    if positions is not None:
        install_rope(model, positions)
    model = model.to(device)
    if not bf16:
        return model
    config.bf16 = True
    return Float16Module(config, model)


def _inner(model: torch.nn.Module) -> torch.nn.Module:
    return model.module if hasattr(model, "module") else model


class _Run:
    """Forward + backward of one model on some tokens: per-layer core-attention outputs, grads."""

    def __init__(self, model: torch.nn.Module, weights: dict[str, Tensor] | None) -> None:
        self.model, self.attn = model, []
        inner = _inner(model)
        if weights is not None:
            params = dict(inner.named_parameters())
            assert set(params) == set(weights), sorted(set(params) ^ set(weights))
            with torch.no_grad():
                for name, p in params.items():
                    p.copy_(weights[name])
        for layer in inner.decoder.layers:
            layer.self_attention.core_attention.register_forward_hook(
                lambda _m, _i, out: self.attn.append(out.detach().float())
            )

    def step(self, text: Tensor, pos: Tensor, num_tokens: int, *, shim: bool) -> dict[str, Tensor]:
        """Loss sum over ``pos`` / ``num_tokens``, backward. The cross entropy is computed here in
        float32 (Megatron's vocab-parallel one all-reduces over the TP group, which the simulated
        ranks' threads would call concurrently on one real communicator)."""
        tokens, labels = text[:, :-1][:, pos], text[:, 1:][:, pos]
        with cpu_device_shim() if shim else contextlib.nullcontext():  # stock RoPE: cuda device
            logits = self.model(tokens, pos[None], None)  # [b, s, V]
        losses = torch.nn.functional.cross_entropy(
            logits.float().flatten(0, 1), labels.flatten(), reduction="none"
        )
        loss_sum, _ = per_token_loss(losses, torch.ones_like(labels))
        (loss_sum / num_tokens).backward()
        return {
            n: p.grad.float()
            for n, p in _inner(self.model).named_parameters()
            if p.grad is not None
        }


def compare_spec(
    make_spec: Callable[[], Any],
    device: torch.device,
    quick: bool,
    *,
    stop_early: bool,
    documents: bool = False,
) -> dict[str, Any]:
    S = 256 if quick else 2048
    cu = [0, S // 8, S // 3, 5 * S // 8, S] if documents else None
    tiny, lay = tiny_gpt(S, quick), three_rank_layout(S)
    g = torch.Generator().manual_seed(5)
    text = torch.randint(0, tiny.vocab_size, (1, S + 1), generator=g).to(device)
    everything = torch.arange(S, device=device)
    torch.manual_seed(1234)
    ref_model = _build(tiny, _stock_spec(make_spec, device, _documents(S, cu)), False, device, None)
    weights = {n: p.detach().clone() for n, p in ref_model.named_parameters()}
    ref = _Run(ref_model, None)
    ref_grads = ref.step(text, everything, S, shim=True)
    stock_spec = _stock_spec(make_spec, device, _documents(S, cu))
    stock = _Run(_build(tiny, stock_spec, True, device, None), weights)
    stock_grads = stock.step(text, everything, S, shim=True)

    kernel = resolve_kernel(
        Kernel.AUTO, device=device, dtype=torch.bfloat16, head_dim=tiny.kv_channels
    )
    lock = threading.Lock()
    with simulated_dist(lay.world_size) as sim:

        def rank_fn(r: int) -> tuple[Tensor, list[Tensor], dict[str, Tensor]]:
            with on_device(device):
                groups = build_hexiseq_groups(lay, device=device)
                runtime = HexiSeqRuntime(
                    layout=lay, groups=groups, kernel=kernel, documents=_documents(S, cu)
                )
                positions = lay.ranks[r].positions()
                with lock:  # model construction draws from the global RNG; weights are copied
                    model = _build(
                        tiny, hexiseq_spec(make_spec(), runtime), True, device, positions
                    )
                run = _Run(model, weights)
                pos = torch.tensor(positions, dtype=torch.long, device=device)
                return pos, run.attn, run.step(text, pos, S, shim=False)

        results = sim.run(rank_fn, timeout_s=300.0)
    hex_attn = [torch.zeros_like(a) for a in ref.attn]
    hex_grads = {n: torch.zeros_like(t) for n, t in ref_grads.items()}
    for pos, attn, grads in results:
        for full, part in zip(hex_attn, attn):
            full[pos] = part
        for n, t in grads.items():
            hex_grads[n] += t

    rows, failures = [], []
    checks = [(f"layer {i + 1} attention", i) for i in range(len(ref.attn))]
    checks += [(f"grad {n}", n) for n in ref_grads]
    for what, key in checks:
        if isinstance(key, int):
            want, got_stock, got_hex = ref.attn[key], stock.attn[key], hex_attn[key]
        else:
            want, got_stock, got_hex = ref_grads[key], stock_grads[key], hex_grads[key]
        e_stock, e_hex = normwise_error(got_stock, want), normwise_error(got_hex, want)
        allowed = 2 * e_stock + 4 * U_BF16
        rows.append(
            {"what": what, "stock_bf16": e_stock, "hexiseq_bf16": e_hex, "allowed": allowed}
        )
        if not e_hex <= allowed:
            failures.append(f"{what}: {e_hex:.3g} > {allowed:.3g} (stock {e_stock:.3g})")
            if stop_early:
                break
    worst = max(rows, key=lambda r: r["hexiseq_bf16"] / r["allowed"])
    return {
        "pass": not failures,
        "kernel": kernel.value,
        "layers": len(ref.attn),
        "gradients": len(ref_grads),
        "worst": worst,
        "rows": rows,
        "failures": failures,
    }


def check_megatron(
    device: torch.device, quick: bool, *, stop_early: bool = False, init_world: Callable[[], None]
) -> dict[str, Any]:
    """Every layer spec that applies, and the local spec with packed documents (see the top)."""
    from megatron.core import parallel_state as mpu
    from megatron.core import tensor_parallel

    specs, skipped = layer_specs(device)
    init_world()
    mpu.initialize_model_parallel(tensor_model_parallel_size=1, context_parallel_size=1)
    result: dict[str, Any] = {"skipped_specs": skipped}
    try:
        if device.type == "cuda":  # Megatron's CUDA RNG tracker (dropout, init) needs its states
            tensor_parallel.model_parallel_cuda_manual_seed(1234)
        runs = [(name, make_spec, False) for name, make_spec in specs.items()]
        runs.insert(0, ("local_documents", specs["local"], True))
        for name, make_spec, documents in runs:
            result[name] = compare_spec(
                make_spec, device, quick, stop_early=stop_early, documents=documents
            )
            if stop_early and not result[name]["pass"]:
                break
    finally:
        mpu.destroy_model_parallel()
    result["pass"] = all(result[n]["pass"] for n, _, _ in runs if n in result)
    return result
