"""The overlap tuner's CPU bench: the user's model, scaled to fit CPU ranks, trained with Megatron DDP on gloo.

Real training iterations: ``model(...)`` forward, ``loss.backward()`` (Megatron DDP launches the
bucket all-reduces from its backward hooks when ``overlap_grad_reduce``), ``finish_grad_sync()``
(waits for them: the *exposed* communication), ``torch.optim.AdamW`` on the gradient buffers.

The model is a :class:`~megatron_hexiseq.model.ModelSpec` converted by
``megatron.config.transformer_config`` into Megatron's ``GPTModel`` (rotary positions, untied
embeddings, the spec's normalization, activation and biases). ``scale_for_cpu`` shrinks a real
model to what CPU ranks can train in seconds per step:

* the **layer count, heads and query groups are kept**: they decide how backward is cut into
  pieces that gradient buckets can overlap;
* every **width** (``kv_channels``, ``hidden_size``, ``ffn_hidden_size``, ``vocab_size``) is
  multiplied by one factor ``r`` <= 1, the largest that keeps the parameter count within
  ``max_params``: every weight matrix then shrinks by about ``r**2``, so each layer's share of
  the parameters, and so which layers a bucket of a given *fraction* of the model covers, is kept;
* the **sequence is shortened** (default 32 tokens): gradient volume does not depend on it, and a
  CPU computes a token ~1000x slower than a GPU.

Bucket sizes stay in the user's model's parameters everywhere the tuner sees them (ladders,
trials, the result file); the bench converts a bucket to its own model by the parameter ratio
(``BenchModel.bench_bucket``), so Megatron's ``--overlap-grad-reduce`` default of 40M parameters
is 40M parameters *of the user's model* here too.

What a trial measures (medians over ``measure_steps`` after ``warmup_steps``), all microseconds:

* ``y_us``: forward + backward time, i.e. the computation the gradient all-reduce overlaps,
  slowed by the CPU the concurrent gloo all-reduces take;
* ``exposed_us``: the wait in ``finish_grad_sync``;
* ``z_us``: the whole step (including the optimizer).

``fit_cpu_ddp`` fits compute and exposed-communication time against the number of buckets from
measured configurations (least squares, with R^2): the benchmark reports it.

The step loop is timed by hand (``time.perf_counter``), not with ``torch.utils.benchmark``: every
step starts on a barrier of the data-parallel group and is split into three phases (fwd+bwd,
the exposed wait, the optimizer); ``Timer`` times one statement per call on one process.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.process_groups_config import ProcessGroupCollection
from megatron.core.transformer.spec_utils import ModuleSpec

from megatron_hexiseq.errors import HexiSeqError
from megatron_hexiseq.megatron.config import cpu_device_shim, transformer_config
from megatron_hexiseq.megatron.reference_attention import LocalCausalAttention
from megatron_hexiseq.model import ModelSpec
from megatron_hexiseq.overlap.knobs import OverlapConfig
from megatron_hexiseq.overlap.search import Trial, trial_from_exposed

#: Parameters the scaled bench model may hold: with fp32 weights, fp32 gradient buffer and AdamW's
#: two moments (16 bytes/parameter) that is ~384 MiB per rank, and a step of a few hundred ms.
DEFAULT_MAX_PARAMS = 24_000_000
#: Tokens per sequence on the bench (see the module docstring).
DEFAULT_SEQ_LENGTH = 32
#: Bytes the bench's attention may keep per rank: ``LocalCausalAttention`` materialises the
#: [b, H, S, S] fp32 probabilities, one per layer for backward plus ~3 in flight (see ``attention_bytes``).
MAX_ATTENTION_BYTES = 1 << 30
#: Megatron's bucket with ``--overlap-grad-reduce`` and no ``--ddp-bucket-size``:
#: ``max(40M, 1M * dp)`` parameters (``DistributedDataParallel.__init__``, core_v0.16.1).
MEGATRON_DEFAULT_BUCKET, MEGATRON_BUCKET_PER_DP = 40_000_000, 1_000_000

#: The bench's own model when ``tune`` is given none: communication-heavy (wide, few tokens).
DEFAULT_MODEL = ModelSpec(
    name="overlap-bench",
    num_layers=4,
    hidden_size=512,
    num_attention_heads=8,
    num_query_groups=8,
    ffn_hidden_size=2048,
    vocab_size=2048,
    kv_channels=64,
    swiglu=False,
    seq_length=DEFAULT_SEQ_LENGTH,
)


def scale_for_cpu(
    model: ModelSpec, *, max_params: int = DEFAULT_MAX_PARAMS, seq_length: int = DEFAULT_SEQ_LENGTH
) -> ModelSpec:
    """``model`` with its widths scaled by the largest ``r = kv / model.kv_channels`` (``kv`` an
    even integer: rotary embeddings rotate pairs of channels) that fits ``max_params``,
    layers/heads/groups kept, sequence ``min(seq, seq_length)``.

    ``r = 1`` when the model fits as it is. Raises ``HexiSeqError`` when even ``kv_channels = 2``
    does not fit (so many layers that ``max_params`` must grow).
    """
    if max_params < 1 or seq_length < 1:
        raise HexiSeqError(
            f"max_params and seq_length must be positive, got {max_params}, {seq_length}"
        )
    seq = min(model.seq_length, seq_length)
    if attention_bytes(model, seq) > MAX_ATTENTION_BYTES:
        fits = math.isqrt(MAX_ATTENTION_BYTES // attention_bytes(model, 1))
        raise HexiSeqError(
            f"--seq-length {seq}: the CPU bench's reference attention would keep "
            f"{attention_bytes(model, seq) / 2**30:.1f} GiB of [b, H, S, S] scores per rank for "
            f"{model.name}; use at most {fits} tokens"
        )
    for kv in [model.kv_channels] + [k for k in range(model.kv_channels - 1, 1, -1) if k % 2 == 0]:
        r = kv / model.kv_channels
        scaled = dataclasses.replace(
            model,
            name=model.name if kv == model.kv_channels else f"{model.name}@cpu",
            kv_channels=kv,
            hidden_size=max(1, round(model.hidden_size * r)),
            ffn_hidden_size=max(1, round(model.ffn_hidden_size * r)),
            vocab_size=max(2, round(model.vocab_size * r)),
            seq_length=seq,
        )
        if scaled.num_parameters <= max_params:
            return scaled
    raise HexiSeqError(
        f"model {model.name} does not fit the CPU bench's {max_params:,} parameters even at "
        f"kv_channels=2 ({scaled.num_parameters:,} parameters, {model.num_layers} layers): "
        "raise --max-params"
    )


def attention_bytes(model: ModelSpec, seq_length: int) -> int:
    """Bytes of fp32 attention probabilities the bench keeps: one [b, H, S, S] per layer for
    backward, plus 3 in flight in the layer being computed (scores, scaled, masked)."""
    per_layer = model.micro_batch_size * model.num_attention_heads * seq_length**2 * 4
    return (model.num_layers + 3) * per_layer


@dataclass(frozen=True, kw_only=True)
class BenchModel:
    """The user's model (``target``) and the model the bench trains for it (``bench``)."""

    target: ModelSpec
    bench: ModelSpec

    @classmethod
    def for_target(
        cls,
        target: ModelSpec,
        *,
        max_params: int = DEFAULT_MAX_PARAMS,
        seq_length: int = DEFAULT_SEQ_LENGTH,
    ) -> BenchModel:
        return cls(
            target=target, bench=scale_for_cpu(target, max_params=max_params, seq_length=seq_length)
        )

    @property
    def param_ratio(self) -> float:
        """Bench parameters per target parameter."""
        return self.bench.num_parameters / self.target.num_parameters

    def bench_bucket(self, config: OverlapConfig, dp_size: int) -> int | None:
        """The DDP bucket (bench parameters) standing for ``config``'s bucket of target parameters.

        Without overlap: None (one bucket, as Megatron). With overlap and no bucket size: Megatron's
        default ``max(40M, 1M * dp)`` target parameters, converted like any other size.
        """
        if not config.overlap_grad_reduce:
            return None
        target = config.bucket_size or max(
            MEGATRON_DEFAULT_BUCKET, MEGATRON_BUCKET_PER_DP * dp_size
        )
        return max(1, round(target * self.param_ratio))


@dataclass(frozen=True, kw_only=True)
class BenchConfig:
    model: BenchModel = field(
        default_factory=lambda: BenchModel(target=DEFAULT_MODEL, bench=DEFAULT_MODEL)
    )
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


def _pg_collection(dp_group: dist.ProcessGroup) -> ProcessGroupCollection:
    single = None
    for r in range(dist.get_world_size()):  # new_group is collective: every rank builds every one
        g = dist.new_group([r], backend="gloo")
        if r == dist.get_rank():
            single = g
    return ProcessGroupCollection(
        tp=single,
        pp=single,
        mp=single,
        cp=single,
        tp_cp=single,
        dp=dp_group,
        dp_cp=dp_group,
        tp_dp_cp=dp_group,
        intra_dp_cp=dp_group,
        expt_dp=single,
        intra_expt_dp=single,
        ep=single,
        expt_tp=single,
        tp_ep=single,
        tp_ep_pp=single,
        embd=single,
        pos_embd=single,
    )


class OverlapBench:
    """One rank's model factory and step timer; all ranks of ``dp_group`` call it collectively."""

    def __init__(self, cfg: BenchConfig, dp_group: dist.ProcessGroup) -> None:
        self.cfg, self.dp_group = cfg, dp_group
        self.pg = _pg_collection(dp_group)
        self.tokens = self.rank_tokens(dist.get_rank(dp_group))

    @property
    def spec(self) -> ModelSpec:
        return self.cfg.model.bench

    def rank_tokens(self, dp_rank: int) -> torch.Tensor:
        """The fixed synthetic batch of data-parallel rank ``dp_rank``: [b, s+1] token ids."""
        m = self.spec
        g = torch.Generator().manual_seed(self.cfg.seed * 1009 + dp_rank)
        return torch.randint(0, m.vocab_size, (m.micro_batch_size, m.seq_length + 1), generator=g)

    def build_model(self) -> GPTModel:
        """The bench ``GPTModel`` (same weights on every rank: seeded CPU init), without DDP."""
        torch.manual_seed(self.cfg.seed)
        layer_spec = get_gpt_layer_local_spec(normalization=self.spec.normalization)
        layer_spec.submodules.self_attention.submodules.core_attention = ModuleSpec(
            module=LocalCausalAttention
        )
        # mean loss per rank, so DDP averages over ranks (per-token loss would make it sum)
        config = transformer_config(self.spec, calculate_per_token_loss=False)
        return GPTModel(
            config=config,
            transformer_layer_spec=layer_spec,
            vocab_size=self.spec.vocab_size,
            max_sequence_length=self.spec.seq_length,
            share_embeddings_and_output_weights=False,
            position_embedding_type="rope",
            pg_collection=self.pg,
        )

    def _build(
        self, config: OverlapConfig
    ) -> tuple[DistributedDataParallel, torch.optim.Optimizer]:
        model = self.build_model()
        ddp_config = DistributedDataParallelConfig(
            overlap_grad_reduce=config.overlap_grad_reduce,
            bucket_size=self.cfg.model.bench_bucket(config, dist.get_world_size(self.dp_group)),
        )
        with cpu_device_shim():
            ddp = DistributedDataParallel(model.config, ddp_config, model, pg_collection=self.pg)
        return ddp, torch.optim.AdamW(ddp.parameters(), lr=self.cfg.lr)

    def loss(self, model: torch.nn.Module, tokens: torch.Tensor | None = None) -> torch.Tensor:
        """Mean next-token cross entropy of ``tokens`` [b, s+1] (this rank's batch by default)."""
        tokens = self.tokens if tokens is None else tokens
        ids, labels = tokens[:, :-1], tokens[:, 1:]
        pos = torch.arange(ids.shape[1]).expand_as(ids)
        with (
            cpu_device_shim()
        ):  # stock RoPE moves its frequencies to torch.cuda.current_device() once
            logits_BSV = model(
                ids, pos, None
            )  # TP = 1: full vocabulary; own loss (no global TP group)
        return torch.nn.functional.cross_entropy(logits_BSV.flatten(0, 1).float(), labels.flatten())

    def reduced_grads(self, config: OverlapConfig) -> tuple[dict[str, torch.Tensor], int]:
        """One forward/backward + ``finish_grad_sync`` under ``config``: the reduced gradients and
        the number of DDP buckets they went through."""
        ddp, _ = self._build(config)
        ddp.zero_grad_buffer()
        self.loss(ddp).backward()
        ddp.finish_grad_sync()
        grads = {n: p.main_grad.detach().clone() for n, p in ddp.module.named_parameters()}
        return grads, sum(len(g.buckets) for g in ddp.bucket_groups)

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
        return Measurement(
            y_us=statistics.median(s[0] for s in samples),
            exposed_us=statistics.median(s[1] for s in samples),
            z_us=statistics.median(s[2] for s in samples),
            num_buckets=sum(len(g.buckets) for g in ddp.bucket_groups),
        )


# --------------------------------------------------------------------------- fitted CPU model


@dataclass(frozen=True)
class LinearFit:
    """``target ~ coef . row``, fitted by least squares, with its R^2 on the data."""

    names: tuple[str, ...]
    coef: tuple[float, ...]
    r2: float

    def predict(self, row: Sequence[float]) -> float:
        return float(np.dot(self.coef, row))


def fit_linear(
    rows: Sequence[Sequence[float]], targets: Sequence[float], names: Sequence[str]
) -> LinearFit:
    a, b = np.asarray(rows, dtype=float), np.asarray(targets, dtype=float)
    if a.shape[0] < a.shape[1]:
        raise ValueError(
            f"need at least {a.shape[1]} measurements to fit {list(names)}, got {a.shape[0]}"
        )
    coef, *_ = np.linalg.lstsq(a, b, rcond=None)
    resid = b - a @ coef
    total = float(((b - b.mean()) ** 2).sum())
    r2 = 1.0 - float((resid**2).sum()) / total if total > 0 else 1.0
    return LinearFit(tuple(names), tuple(float(c) for c in coef), r2)


@dataclass(frozen=True)
class CpuDdpFit:
    """Measured CPU model of overlapped DDP gradient reduce against the bucket count n.

    ``compute``: Y(n) = y0 + a * n (each concurrent gloo all-reduce steals CPU from backward);
    ``exposed``: E(n) = e0 + t / n + c * n (the last bucket's tail shrinks as 1/n; every bucket
    costs a fixed overhead). Z(n) is predicted as Y + E + the non-overlapped rest.
    """

    compute: LinearFit
    exposed: LinearFit
    rest_us: float

    def predict_z_us(self, n_buckets: int) -> float:
        n = float(n_buckets)
        return (
            self.compute.predict([1.0, n]) + self.exposed.predict([1.0, 1.0 / n, n]) + self.rest_us
        )


def fit_cpu_ddp(
    n_buckets: Sequence[int],
    y_us: Sequence[float],
    exposed_us: Sequence[float],
    z_us: Sequence[float],
) -> CpuDdpFit:
    """Fit ``CpuDdpFit`` from overlapped-DDP measurements (one entry per configuration)."""
    compute = fit_linear([[1.0, n] for n in n_buckets], y_us, ("y0_us", "per_bucket_us"))
    exposed = fit_linear(
        [[1.0, 1.0 / n, n] for n in n_buckets], exposed_us, ("e0_us", "tail_us", "per_bucket_us")
    )
    rest = float(np.median([z - y - e for z, y, e in zip(z_us, y_us, exposed_us)]))
    return CpuDdpFit(compute, exposed, rest)
