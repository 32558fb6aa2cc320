"""What one run of the CPU training driver is (:class:`TrainConfig`) and returns (:class:`TrainResult`).

The model is a :class:`~megatron_hexiseq.model.ModelSpec`, the one model description of the
project; :data:`TINY_GPT` is the default, small enough for multi-rank tests on two shared cores.
Kept apart from :mod:`megatron_hexiseq.testbed.train` so that the checkpoint module, which the
driver calls, can name these types without importing the driver.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch

from megatron_hexiseq.errors import HexiSeqError
from megatron_hexiseq.layout import Layout
from megatron_hexiseq.model import ModelSpec

# 4 layers, GQA 8/2 heads of 8 channels, SwiGLU, RMSNorm, no linear biases, vocabulary 128.
# seq_length is not read by the driver (the layout's is trained); 64 is the tests' usual length.
TINY_GPT = ModelSpec(
    name="tiny-gpt",
    num_layers=4,
    hidden_size=64,
    num_attention_heads=8,
    num_query_groups=2,
    ffn_hidden_size=96,
    vocab_size=128,
    kv_channels=8,
    swiglu=True,
    seq_length=64,
    normalization="RMSNorm",
    add_bias_linear=False,
)


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """One training run: model, layout (one CP domain), DP replicas, optimizer, data, DDP knobs."""

    model: ModelSpec = TINY_GPT
    layout: Layout
    data_parallel: int = 1
    micro_batch_size: int = 1
    steps: int = 3
    lr: float = 1e-3
    seed: int = 1234
    data_seed: int = 99
    bucket_size: int | None = 2_000  # parameters per DDP bucket (small: several buckets)
    overlap_grad_reduce: bool = True
    kernel: str = "reference"
    comm_chunks: int = 1
    return_grads: bool = False  # rank 0 returns the gradients of step 0 (for equivalence tests)
    return_params: bool = False  # rank 0 returns the parameters after the last step (+ initial:
    #                               reference only; + AdamW's state, and both right after a load)
    save_dir: str | None = None  # checkpoint folder (testbed/ckpt.py)
    save_at_step: int | None = None  # save once this many steps are done (1..steps)
    load_dir: str | None = None  # resume from this folder's latest checkpoint (any layout)
    # packed documents: per step (cycled) the micro-batch's document lengths, summing to the layout's
    # seq_length; each document ends with the EOD token (vocab_size - 1) and attention stays inside
    # it (--reset-attention-mask); the boundaries are read from the EOD tokens, as in Megatron
    documents: tuple[tuple[int, ...], ...] | None = None
    # per-micro-batch layouts: document lengths -> a Layout of ``layout``'s structure, called every
    # step on every rank (deterministic); picklable (it travels to the spawned ranks)
    batch_layouts: Callable[[tuple[int, ...]], Layout] | None = None
    reset_position_ids: bool = False  # RoPE restarts in each document (needs documents)
    # tensor parallelism: every layout rank is a TP bundle of this many processes (the layout must
    # be planned over bundles: layout.tensor_model_parallel_size), with Megatron's sequence
    # parallelism inside the bundle; init_params: TP=1 weights (the reference's initial_params)
    # each TP rank starts from its shard of (testbed/tp_cpu.py), instead of its own seeded init
    tensor_model_parallel_size: int = 1
    sequence_parallel: bool = True
    init_params: Mapping[str, torch.Tensor] | None = field(default=None, compare=False, repr=False)

    @property
    def eod_token(self) -> int:
        return self.model.vocab_size - 1

    def doc_lengths(self, step: int) -> tuple[int, ...] | None:
        """The document lengths of step ``step``'s micro-batch (None without documents)."""
        return None if self.documents is None else self.documents[step % len(self.documents)]

    def __post_init__(self) -> None:
        S = self.layout.seq_length
        for i, lengths in enumerate(self.documents or ()):
            if not lengths or min(lengths) < 1 or sum(lengths) != S:
                raise HexiSeqError(
                    f"TrainConfig: documents[{i}] must be positive lengths summing to the "
                    f"layout's {S} tokens, got {len(lengths)} summing to {sum(lengths)}"
                )
        if (self.batch_layouts is not None or self.reset_position_ids) and not self.documents:
            raise HexiSeqError(
                "TrainConfig: batch_layouts and reset_position_ids need documents (packed "
                "micro-batches)"
            )
        m = self.model
        if (
            m.kv_channels * m.num_attention_heads != m.hidden_size
        ):  # the driver is tested only with d = h / a
            raise HexiSeqError(
                f"model {m.name}: the CPU driver needs kv_channels * heads == hidden_size "
                f"({m.kv_channels} * {m.num_attention_heads} != {m.hidden_size})"
            )
        if self.tensor_model_parallel_size != self.layout.tensor_model_parallel_size:
            raise HexiSeqError(
                f"TrainConfig: tensor_model_parallel_size {self.tensor_model_parallel_size} but the "
                f"layout is planned for TP bundles of {self.layout.tensor_model_parallel_size}"
            )
        if (self.save_dir is None) != (self.save_at_step is None):
            raise HexiSeqError("TrainConfig: give save_dir and save_at_step together")
        if self.save_at_step is not None and not 1 <= self.save_at_step <= self.steps:
            raise HexiSeqError(
                f"TrainConfig: save_at_step must be in 1..steps={self.steps}, got {self.save_at_step}"
            )


@dataclass(frozen=True)
class TrainResult:
    """Per rank: global per-token loss of each step, wall time of each step (s), optional tensors."""

    losses: list[float]
    step_times_s: list[float]
    grads: dict[str, torch.Tensor] | None = None
    params: dict[str, torch.Tensor] | None = None
    initial_params: dict[str, torch.Tensor] | None = None
    start_step: int = 0  # steps a loaded checkpoint had done (losses start there)
    opt_state: dict[str, dict[str, torch.Tensor]] | None = None  # AdamW's after the last step
    resumed: dict[str, dict] | None = (
        None  # {"params", "opt_state"} right after loading a checkpoint
    )
    plan_times_s: list[float] | None = None  # per step: the batch_layouts call (thread CPU time)
