"""The one conversion of a :class:`~megatron_hexiseq.model.ModelSpec` to Megatron's ``TransformerConfig``.

Every place that builds a Megatron model from a ``ModelSpec`` (the CPU training driver and the
step calibration built on it, the overlap bench, the GPU acceptance check, the tests) calls
:func:`transformer_config`; ``pretrain_gpt.py`` builds its own from Megatron's arguments.

Also here: :func:`cpu_device_shim`, the one stand-in for ``torch.cuda.current_device()`` that
lets Megatron code which allocates on "the current CUDA device" run on a CPU-only torch.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_hexiseq.model import ModelSpec


def transformer_config(
    model: ModelSpec,
    *,
    context_parallel_size: int = 1,
    params_dtype: torch.dtype = torch.float32,
    **overrides: Any,
) -> TransformerConfig:
    """Megatron's ``TransformerConfig`` of ``model``: its shapes, SwiGLU (gated SiLU) or GELU, its
    normalization and linear biases; no dropout, CPU initialisation, per-token loss, no fused
    kernels (none of them runs on CPU); ``cp_comm_type="hexiseq"`` when ``context_parallel_size > 1``.

    ``params_dtype`` is the parameters' dtype (``bf16=True``/``fp16=True`` follow from it);
    ``overrides`` are further ``TransformerConfig`` fields (they win).
    """
    fields: dict[str, Any] = dict(
        num_layers=model.num_layers,
        hidden_size=model.hidden_size,
        num_attention_heads=model.num_attention_heads,
        num_query_groups=model.num_query_groups,
        kv_channels=model.kv_channels,
        ffn_hidden_size=model.ffn_hidden_size,
        gated_linear_unit=model.swiglu,
        activation_func=F.silu if model.swiglu else F.gelu,
        normalization=model.normalization,
        add_bias_linear=model.add_bias_linear,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        use_cpu_initialization=True,
        context_parallel_size=context_parallel_size,
        cp_comm_type="hexiseq" if context_parallel_size > 1 else None,
        calculate_per_token_loss=True,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        params_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        fp16=params_dtype == torch.float16,
    )
    return TransformerConfig(**(fields | overrides))


def _cpu_device() -> str:
    return "cpu"


@contextlib.contextmanager
def cpu_device_shim() -> Iterator[None]:
    """Let Megatron code that allocates on ``torch.cuda.current_device()`` allocate on CPU.

    Megatron DDP's gradient buffers and stock RoPE's frequencies do that; on a CPU-only torch the
    call raises. Used around model/DDP construction and stock-RoPE forwards in the CPU driver and
    the benches; a no-op when CUDA is available.
    """
    if torch.cuda.is_available():
        yield
        return
    original = torch.cuda.current_device
    # deliberate: a device string where torch declares an int index (callers pass it on as a device)
    torch.cuda.current_device = _cpu_device  # type: ignore[assignment]
    try:
        yield
    finally:
        torch.cuda.current_device = original  # type: ignore[assignment]
