"""CPU stand-ins that let Megatron's tensor + sequence parallelism run on gloo (testbed and tests only).

Megatron-core 0.16.1's sequence parallelism needs, besides the collectives, three things a CPU-only
torch lacks; nothing else is replaced (the linears, their all-gathers / reduce-scatters, the
vocabulary-parallel embedding and cross entropy, ``finalize_model_grads``' all-reduce of the norms'
gradients over the TP group all run as on a GPU):

- **a norm that accepts ``sequence_parallel``**: the local spec's ``WrappedTorchNorm`` asserts it off
  (on GPUs Apex's ``FusedLayerNorm`` or TE's norm take it). :class:`SequenceParallelNorm` is the
  same torch ``LayerNorm``/``RMSNorm`` with its parameters marked ``sequence_parallel`` as those
  norms mark them, so ``finalize_model_grads`` sums their gradients over the TP group;
- **``torch.cuda.current_device()``** in the all-gather / reduce-scatter buffers
  (``megatron.config.cpu_device_shim``);
- **the CUDA RNG tracker**, which the embedding and the transformer block ``fork()`` around
  dropout under sequence parallelism: a no-op fork here (the testbed's dropout is 0, so no random
  number is drawn inside it).

gloo itself has what sequence parallelism calls (``all_gather_into_tensor``,
``reduce_scatter_tensor``: torch 2.13's gloo backend implements both; checked on this machine).

Also here: :func:`tp_slice`, how a TP=1 parameter maps onto TP rank i's shard (Megatron's
column-/row-parallel split; SwiGLU's fc1 splits its gate and its up half separately, as
megatron-core's checkpoint resharding does), so a TP run can start from the weights of the
single-process reference and its gradients can be compared with the reference's.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping

import torch
from megatron.core import tensor_parallel
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_block import TransformerBlockSubmodules
from megatron.core.transformer.transformer_config import TransformerConfig

from megatron_hexiseq.megatron.config import cpu_device_shim


class SequenceParallelNorm:
    """``WrappedTorchNorm`` (``megatron/core/transformer/torch_norm.py``) that allows sequence
    parallelism: a torch ``LayerNorm``/``RMSNorm`` whose parameters carry ``sequence_parallel``."""

    def __new__(  # type: ignore[misc]  # Megatron's norm-class pattern (WrappedTorchNorm)
        cls,
        config: TransformerConfig,
        hidden_size: int,
        eps: float = 1e-5,
        persist_layer_norm: bool = False,
        zero_centered_gamma: bool = False,
        normalization: str = "LayerNorm",
    ) -> torch.nn.Module:
        norm_cls = torch.nn.RMSNorm if config.normalization == "RMSNorm" else torch.nn.LayerNorm
        norm = norm_cls(normalized_shape=hidden_size, eps=eps)
        for p in norm.parameters():
            p.sequence_parallel = config.sequence_parallel  # type: ignore[attr-defined]
        return norm


def sequence_parallel_spec(layer_spec: ModuleSpec, num_layers: int) -> TransformerBlockSubmodules:
    """The local layer spec with both norms and the final norm made :class:`SequenceParallelNorm`."""
    sub = layer_spec.submodules
    sub.input_layernorm = SequenceParallelNorm
    sub.pre_mlp_layernorm = SequenceParallelNorm
    return TransformerBlockSubmodules(
        layer_specs=[layer_spec] * num_layers, layer_norm=SequenceParallelNorm
    )


class _NoForkTracker:
    """The CUDA RNG tracker's ``fork`` as a no-op (dropout 0: no random number is drawn)."""

    @contextlib.contextmanager
    def fork(self, name: str = "") -> Iterator[None]:
        yield


@contextlib.contextmanager
def cpu_sequence_parallel() -> Iterator[None]:
    """Megatron's TP + sequence parallelism on a CPU-only torch (module docstring); no-op with CUDA."""
    if torch.cuda.is_available():
        yield
        return
    original = tensor_parallel.get_cuda_rng_tracker
    tensor_parallel.get_cuda_rng_tracker = lambda *a, **k: _NoForkTracker()  # type: ignore[assignment]
    try:
        with cpu_device_shim():
            yield
    finally:
        tensor_parallel.get_cuda_rng_tracker = original  # type: ignore[assignment]


# parameter name suffix -> Megatron's partition dim (None: replicated over the TP group)
_SPLIT = (
    ("word_embeddings.weight", 0),  # VocabParallelEmbedding
    ("output_layer.weight", 0),  # ColumnParallelLinear over the vocabulary
    ("linear_qkv.weight", 0),
    ("linear_qkv.bias", 0),
    ("linear_fc1.weight", 0),
    ("linear_fc1.bias", 0),
    ("linear_proj.weight", 1),  # RowParallelLinear
    ("linear_fc2.weight", 1),
)


def partition_dim(name: str) -> int | None:
    """The dimension Megatron splits parameter ``name`` along over TP, or None (replicated:
    norms, row-parallel biases)."""
    return next((dim for suffix, dim in _SPLIT if name.endswith(suffix)), None)


def tp_slice(
    name: str, full: torch.Tensor, tp_rank: int, tp: int, *, gated_linear_unit: bool
) -> torch.Tensor:
    """TP rank ``tp_rank``'s shard of the TP=1 parameter (or gradient) ``full`` named ``name``."""
    dim = partition_dim(name)
    if dim is None or tp == 1:
        return full
    if gated_linear_unit and ".linear_fc1." in name:  # [gate; up] -> [gate_i; up_i]
        return torch.cat([half.chunk(tp, dim)[tp_rank] for half in full.chunk(2, dim)], dim)
    return full.chunk(tp, dim)[tp_rank]


def load_tp_slices(
    model: torch.nn.Module,
    full: Mapping[str, torch.Tensor],
    tp_rank: int,
    tp: int,
    *,
    gated_linear_unit: bool,
) -> None:
    """Copy each TP=1 parameter's shard into ``model`` (a TP model of the same architecture);
    checks each split dimension against the partition dim Megatron recorded on the parameter."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if getattr(p, "tensor_model_parallel", False):
                dim = getattr(p, "partition_dim", None)
                assert partition_dim(name) == dim, (name, dim)
            else:
                assert partition_dim(name) is None or tp == 1, name
            shard = tp_slice(name, full[name], tp_rank, tp, gated_linear_unit=gated_linear_unit)
            assert shard.shape == p.shape, (name, tuple(shard.shape), tuple(p.shape))
            p.copy_(shard)
