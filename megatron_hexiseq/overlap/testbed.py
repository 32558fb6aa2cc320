"""CPU testbed for the overlap tuner: a tiny megatron-core GPT trained with Megatron DDP on gloo.

Real training iterations: ``model(...)`` forward, ``loss.backward()`` (Megatron DDP launches the
bucket all-reduces from its backward hooks when ``overlap_grad_reduce``), ``finish_grad_sync()``
(waits for them: the *exposed* communication), ``torch.optim.AdamW`` on the gradient buffers.
The model is communication-heavy on purpose (wide layers, few tokens) so the DDP knobs matter.

What a trial measures (medians over ``measure_steps`` after ``warmup_steps``), all microseconds:

* ``y_us``: forward + backward time, i.e. the computation the gradient all-reduce overlaps,
  slowed by the CPU the concurrent gloo all-reduces take;
* ``exposed_us``: the wait in ``finish_grad_sync``;
* ``z_us``: the whole step (including the optimizer);
* ``x_us`` (for the search): gloo does not expose when an overlapped all-reduce ran, only the
  part left on the critical path, so by Z = max(Y, X) for the window we estimate
  ``x = y + exposed`` while communication is exposed (communication-bound: X = Z) and
  ``x = exposed`` (< y) once it hides under backward (exposed <= ``hidden_tol`` * z).

The core attention is a plain causal SDPA module (Megatron's DotProductAttention needs CUDA RNG
state); attention is not what this testbed studies.
"""
from __future__ import annotations

import contextlib
import statistics
import time
from dataclasses import dataclass, field
from typing import Iterator

import torch
import torch.distributed as dist

from megatron_hexiseq.overlap.knobs import OverlapConfig
from megatron_hexiseq.overlap.search import Trial, trial_from_exposed


@dataclass(frozen=True, kw_only=True)
class TestbedModel:
    """Tiny GPT (Megatron field names); defaults are communication-heavy (~14.7M params, 32 tokens)."""

    num_layers: int = 4
    hidden_size: int = 512
    num_attention_heads: int = 8
    vocab_size: int = 2048
    seq_length: int = 32
    micro_batch_size: int = 1


@dataclass(frozen=True, kw_only=True)
class TestbedConfig:
    model: TestbedModel = field(default_factory=TestbedModel)
    warmup_steps: int = 2
    measure_steps: int = 6
    hidden_tol: float = 0.02
    seed: int = 1234
    lr: float = 1e-4


@dataclass(frozen=True)
class Measurement:
    """Medians of one configuration's steps (us) and its bucket count."""

    y_us: float
    exposed_us: float
    z_us: float
    num_buckets: int

    def trial(self, hidden_tol: float) -> Trial:
        return trial_from_exposed(self.y_us, [self.exposed_us], self.z_us, hidden_tol=hidden_tol)


@contextlib.contextmanager
def _cpu_device_shim() -> Iterator[None]:
    """Megatron's gradient buffers allocate on ``torch.cuda.current_device()``: make that CPU.

    Only around DDP construction, only on a CPU-only torch.
    """
    if torch.cuda.is_available():
        yield
        return
    original = torch.cuda.current_device
    torch.cuda.current_device = lambda: "cpu"  # type: ignore[assignment]
    try:
        yield
    finally:
        torch.cuda.current_device = original  # type: ignore[assignment]


class _CausalSdpa(torch.nn.Module):
    """Core attention with Megatron's builder signature: q/k/v [s, b, h, d] -> [s, b, h*d]."""

    def __init__(self, config, layer_number, attn_mask_type, attention_type=None, cp_comm_type=None,
                 softmax_scale=None, pg_collection=None, attention_dropout=None, **_: object) -> None:
        super().__init__()

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        s, b, h, d = query.shape
        q_BHSD, k_BHSD, v_BHSD = (t.permute(1, 2, 0, 3) for t in (query, key, value))
        o_BHSD = torch.nn.functional.scaled_dot_product_attention(q_BHSD, k_BHSD, v_BHSD, is_causal=True)
        return o_BHSD.permute(2, 0, 1, 3).reshape(s, b, h * d)  # [b,h,s,d] -> [s,b,h*d]


def _pg_collection(dp_group: dist.ProcessGroup):
    from megatron.core.process_groups_config import ProcessGroupCollection

    single = None
    for r in range(dist.get_world_size()):  # new_group is collective: every rank builds every one
        g = dist.new_group([r], backend="gloo")
        if r == dist.get_rank():
            single = g
    return ProcessGroupCollection(tp=single, pp=single, mp=single, cp=single, tp_cp=single, dp=dp_group,
                                  dp_cp=dp_group, tp_dp_cp=dp_group, intra_dp_cp=dp_group, expt_dp=single,
                                  intra_expt_dp=single, ep=single, expt_tp=single, tp_ep=single,
                                  tp_ep_pp=single, embd=single, pos_embd=single)


class Testbed:
    """One rank's model factory and step timer; all ranks of ``dp_group`` call it collectively."""

    def __init__(self, cfg: TestbedConfig, dp_group: dist.ProcessGroup) -> None:
        self.cfg, self.dp_group = cfg, dp_group
        self.pg = _pg_collection(dp_group)
        self.tokens = self.rank_tokens(dist.get_rank(dp_group))
        self.num_params: int | None = None

    def rank_tokens(self, dp_rank: int) -> torch.Tensor:
        """The fixed synthetic batch of data-parallel rank ``dp_rank``: [b, s+1] token ids."""
        m = self.cfg.model
        g = torch.Generator().manual_seed(self.cfg.seed * 1009 + dp_rank)
        return torch.randint(0, m.vocab_size, (m.micro_batch_size, m.seq_length + 1), generator=g)

    def build_model(self):
        """The tiny ``GPTModel`` (same weights on every rank: seeded CPU init), without DDP."""
        from megatron.core.models.gpt import GPTModel
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        from megatron.core.transformer import TransformerConfig

        m = self.cfg.model
        torch.manual_seed(self.cfg.seed)
        tc = TransformerConfig(num_layers=m.num_layers, hidden_size=m.hidden_size,
                               num_attention_heads=m.num_attention_heads, use_cpu_initialization=True,
                               hidden_dropout=0.0, attention_dropout=0.0, bias_dropout_fusion=False)
        spec = get_gpt_layer_local_spec()
        spec.submodules.self_attention.submodules.core_attention = _CausalSdpa
        model = GPTModel(config=tc, transformer_layer_spec=spec, vocab_size=m.vocab_size,
                         max_sequence_length=m.seq_length, position_embedding_type="learned_absolute",
                         pg_collection=self.pg)
        self.num_params = sum(p.numel() for p in model.parameters())
        return tc, model

    def _build(self, config: OverlapConfig):
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

        tc, model = self.build_model()
        ddp_config = DistributedDataParallelConfig(overlap_grad_reduce=config.overlap_grad_reduce,
                                                   bucket_size=config.bucket_size)
        with _cpu_device_shim():
            ddp = DistributedDataParallel(tc, ddp_config, model, pg_collection=self.pg)
        opt = torch.optim.AdamW(ddp.parameters(), lr=self.cfg.lr)
        return ddp, opt

    def loss(self, model: torch.nn.Module, tokens: torch.Tensor | None = None) -> torch.Tensor:
        """Mean next-token cross entropy of ``tokens`` [b, s+1] (this rank's batch by default)."""
        tokens = self.tokens if tokens is None else tokens
        ids, labels = tokens[:, :-1], tokens[:, 1:]
        pos = torch.arange(ids.shape[1]).expand_as(ids)
        logits_BSV = model(ids, pos, None)  # TP = 1: full vocabulary; own loss (no global TP group)
        return torch.nn.functional.cross_entropy(logits_BSV.flatten(0, 1).float(), labels.flatten())

    def reduced_grads(self, config: OverlapConfig) -> dict[str, torch.Tensor]:
        """One forward/backward + ``finish_grad_sync`` under ``config``: the reduced gradients."""
        ddp, _ = self._build(config)
        ddp.zero_grad_buffer()
        self.loss(ddp).backward()
        ddp.finish_grad_sync()
        return {n: p.main_grad.detach().clone() for n, p in ddp.module.named_parameters()}

    def count_params(self) -> int:
        if self.num_params is None:
            self._build(OverlapConfig())
        assert self.num_params is not None
        return self.num_params

    def measure(self, config: OverlapConfig, *, steps: int | None = None) -> Measurement:
        """Build the model with ``config``'s DDP knobs and time real training steps."""
        ddp, opt = self._build(config)
        samples = []
        n = steps or self.cfg.measure_steps
        for step in range(self.cfg.warmup_steps + n):
            dist.barrier(group=self.dp_group)  # every rank starts the step together
            t0 = time.perf_counter()
            ddp.zero_grad_buffer()
            self.loss(ddp).backward()
            t1 = time.perf_counter()
            ddp.finish_grad_sync()
            t2 = time.perf_counter()
            for p in ddp.parameters():
                p.grad = p.main_grad
            opt.step()
            t3 = time.perf_counter()
            if step >= self.cfg.warmup_steps:
                samples.append(((t1 - t0) * 1e6, (t2 - t1) * 1e6, (t3 - t0) * 1e6))
        return Measurement(y_us=statistics.median(s[0] for s in samples),
                           exposed_us=statistics.median(s[1] for s in samples),
                           z_us=statistics.median(s[2] for s in samples),
                           num_buckets=sum(len(g.buckets) for g in ddp.bucket_groups))
