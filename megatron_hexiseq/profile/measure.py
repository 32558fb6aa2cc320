"""Micro-benchmarks of one rank: compute rates, bandwidths, memory, device name.

Each runs on an initialised default process group where it communicates; :func:`megatron_hexiseq.profile.run.run_profile`
runs them on every rank at once and assembles the cluster spec. Rates are achieved rates (work
units per second of the timed loop, one warm-up call left out), in the dtype training uses on that
device (GPU: BF16; CPU: float32).

- :func:`measure_matmul_flops`: a square matmul (no model given);
- :func:`measure_layer_flops`: one transformer layer's non-attention work with the model's shapes;
- :func:`measure_attention_flops`: causal attention forward+backward (PyTorch SDPA);
- :func:`measure_pair_bandwidth`: ping-pong between two ranks; :func:`measure_alltoall_bandwidth`:
  an all-to-all of all ranks;
- :func:`memory_gib`, :func:`device_name`.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils import benchmark

from megatron_hexiseq.model import ModelSpec


@dataclass(frozen=True, kw_only=True)
class ProfileOptions:
    matmul_size: int = 512
    attention_seq: int = 512
    attention_heads: int = 4
    head_dim: int = 64
    seconds_per_test: float = 0.5
    message_bytes: int = 4 << 20
    repeats: int = 5
    memory_gib: float | None = None  # CPU budget; GPU uses free memory when None
    node_names: Sequence[str] | None = (
        None  # logical node of each rank (CPU testbed); else hostname
    )
    # the logical nodes are CPU cores their ranks share (the testbed): nodes get ``shared_core``
    shared_cores: bool = False
    model: ModelSpec | None = None  # measure with the model's own layer shapes (calibration)
    layer_tokens: int = 1024
    kernel_sizes: tuple[int, ...] = (
        512,
        1024,
        2048,
        4096,
        8192,
        16384,
    )  # GPU: block sizes per kernel


def timed_rate(work: Callable[[], None], work_units: float, seconds: float) -> float:
    """Units per second of ``work``: ``torch.utils.benchmark`` runs it in blocks for at least
    ``seconds`` (after its own warm-up) and the rate is taken at the median block time. The rank
    keeps its torch threads (``Timer`` would otherwise time with one); CUDA work is synchronised
    by ``work`` itself and by the benchmark timer."""
    timer = benchmark.Timer(
        stmt="work()", globals={"work": work}, num_threads=torch.get_num_threads()
    )
    return work_units / timer.blocked_autorange(min_run_time=seconds).median


def measure_matmul_flops(device: torch.device, dtype: torch.dtype, opts: ProfileOptions) -> float:
    n = opts.matmul_size
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)

    def work() -> None:
        torch.mm(a, b)
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    return timed_rate(work, 2.0 * n**3, opts.seconds_per_test)


def measure_layer_flops(
    model: ModelSpec, device: torch.device, dtype: torch.dtype, opts: ProfileOptions
) -> float:
    """Achieved FLOP/s of one transformer layer's non-attention work with the model's own shapes.

    Runs forward+backward of the layer's linear layers (QKV, projection, MLP with SwiGLU if set)
    plus its norms and activation on ``layer_tokens`` tokens, and divides the layer's share of
    :func:`megatron_hexiseq.costmodel.linear_flops_per_token` by the time: elementwise work and
    small-matrix inefficiency are folded into the rate, which is what the cost model then uses.
    """
    h, a, g, d, f = (
        model.hidden_size,
        model.num_attention_heads,
        model.num_query_groups,
        model.kv_channels,
        model.ffn_hidden_size,
    )
    m = 2 if model.swiglu else 1
    T = opts.layer_tokens
    mk = lambda i, o: (torch.randn(i, o, device=device, dtype=dtype) / i**0.5).requires_grad_()  # noqa: E731
    w_qkv, w_proj, w_fc1, w_fc2 = mk(h, (a + 2 * g) * d), mk(a * d, h), mk(h, f * m), mk(f, h)
    x = torch.randn(T, h, device=device, dtype=dtype, requires_grad=True)

    def work() -> None:
        y = F.rms_norm(x, (h,))
        qkv = y @ w_qkv
        z = x + qkv[:, : a * d] @ w_proj
        u = F.rms_norm(z, (h,)) @ w_fc1
        u = F.silu(u[:, :f]) * u[:, f:] if model.swiglu else F.gelu(u)
        out = z + u @ w_fc2
        out.sum().backward()
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    flops_per_token = 6 * (h * (a + 2 * g) * d + a * d * h + h * f * m + f * h)
    return timed_rate(work, flops_per_token * T, opts.seconds_per_test)


def measure_attention_flops(
    device: torch.device, dtype: torch.dtype, opts: ProfileOptions
) -> float:
    """Causal attention fwd+bwd FLOP/s counting only visible (q, k) pairs: 4*d fwd, 8*d bwd per pair-head.

    With ``opts.model`` the model's heads and head size are used (sequence capped at
    :data:`MODEL_ATTENTION_SEQ`).
    """
    s, h, d = opts.attention_seq, opts.attention_heads, opts.head_dim
    if opts.model is not None:
        s, h, d = (
            model_attention_seq(opts.model),
            opts.model.num_attention_heads,
            opts.model.kv_channels,
        )
    q = torch.randn(1, h, s, d, device=device, dtype=dtype, requires_grad=True)
    k = torch.randn(1, h, s, d, device=device, dtype=dtype, requires_grad=True)
    v = torch.randn(1, h, s, d, device=device, dtype=dtype, requires_grad=True)
    pairs = s * (s + 1) // 2

    def work() -> None:
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        out.sum().backward()
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    return timed_rate(work, 12.0 * d * pairs * h, opts.seconds_per_test)


def measure_pair_bandwidth(
    a: int, b: int, device: torch.device, opts: ProfileOptions
) -> float | None:
    """Bytes/s between ranks a and b by ping-pong (median of repeats); None on other ranks.

    A fixed count of repeats timed by hand, not ``torch.utils.benchmark``: both ranks must run the
    same number of sends and receives, which a time-based autorange cannot promise."""
    me = dist.get_rank()
    if me not in (a, b):
        return None
    buf = torch.empty(opts.message_bytes // 4, dtype=torch.float32, device=device)
    times = []
    for _ in range(opts.repeats + 1):
        start = time.perf_counter()
        if me == a:
            dist.send(buf, b)
            dist.recv(buf, b)
        else:
            dist.recv(buf, a)
            dist.send(buf, a)
        times.append(time.perf_counter() - start)
    return 2 * opts.message_bytes / statistics.median(times[1:])


def measure_alltoall_bandwidth(device: torch.device, opts: ProfileOptions) -> float:
    """Per-rank bytes/s sent by an all-to-all of ``message_bytes`` per rank (median)."""
    world = dist.get_world_size()
    n = max(world, opts.message_bytes // 4 // world * world)
    src = torch.empty(n, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    times = []
    for _ in range(opts.repeats + 1):
        dist.barrier()
        start = time.perf_counter()
        dist.all_to_all_single(dst, src)
        times.append(time.perf_counter() - start)
    return n * 4 * (world - 1) / world / statistics.median(times[1:])


MODEL_ATTENTION_SEQ = 2048  # longest sequence an attention measurement with a model runs


def model_attention_seq(model: ModelSpec) -> int:
    """Tokens of an attention measurement with ``model``: its sequence, capped."""
    return min(model.seq_length, MODEL_ATTENTION_SEQ)


def memory_gib(device: torch.device, opts: ProfileOptions) -> float:
    if opts.memory_gib is not None:
        return float(opts.memory_gib)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free / 2**30
    return 4.0


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"


def significant(x: float, digits: int = 6) -> float:
    """``x`` to ``digits`` significant digits (CPU rates are tiny in TFLOP/s)."""
    return float(f"{x:.{digits}g}")
