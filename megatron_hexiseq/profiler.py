"""``profile``: measure every rank, write a cluster spec whose numbers are measured.

Runs on an initialised default process group (torchrun, or the CPU testbed's spawned ranks).
All ranks measure compute *at the same time*, so ranks that share a core (the CPU testbed) or a
power/thermal budget see the speed they will see in training. Measurements:

- matmul throughput (GPU: BF16; CPU: float32, the dtype the CPU testbed trains in); with a model
  given, the cost model is calibrated for it instead: on GPU the throughput of that model's own
  layer (linear layers + norms + activation), on CPU a whole training step of the model without
  attention under Megatron DDP at three token counts, fitted as a FLOP rate (everything the cost
  model does not itemise is folded in) plus a fixed ``step_overhead_ms`` (optimizer step, gradient
  and loss reduction, framework);
- on CPU with a model and more than one rank: the fixed cost of each head all-to-all and each K/V
  exchange step, fitted from HexiSeq's own attention timed in place
  (:mod:`megatron_hexiseq.fixed_costs`: ``collective_latency_us``, ``p2p_latency_us``); on GPU
  these three fixed costs stay 0 (NCCL latency and Megatron's overlapped gradient reduction are
  below the model's resolution; set them in the spec by hand if you measured them);
- causal attention forward+backward throughput (same dtype, PyTorch SDPA; the model's head shape
  when a model is given);
- bandwidth of every pair of ranks (one pair at a time, ping-pong of ``message_bytes``);
- the all-to-all bandwidth of all ranks together;
- memory capacity (GPU: free memory; CPU: the configured budget).

Output: a cluster spec dict in the format of :mod:`megatron_hexiseq.cluster` (one custom GPU
type per node, efficiency 1.0 because the throughput *is* the measurement) and a raw dict of
every number measured.
"""
from __future__ import annotations

import socket
import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist


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
    node_names: Sequence[str] | None = None  # logical node of each rank (CPU testbed); else hostname
    model: Any = None  # a ModelSpec: measure with the model's own layer shapes (calibration)
    layer_tokens: int = 1024


def _timed_rate(work: Callable[[], None], work_units: float, seconds: float) -> float:
    """Units per second of ``work`` run repeatedly for about ``seconds`` (after one warm-up)."""
    work()
    n, start = 0, time.perf_counter()
    while True:
        work()
        n += 1
        elapsed = time.perf_counter() - start
        if elapsed >= seconds:
            return n * work_units / elapsed


def measure_matmul_flops(device: torch.device, dtype: torch.dtype, opts: ProfileOptions) -> float:
    n = opts.matmul_size
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)

    def work() -> None:
        torch.mm(a, b)
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    return _timed_rate(work, 2.0 * n**3, opts.seconds_per_test)


def measure_layer_flops(model: Any, device: torch.device, dtype: torch.dtype, opts: ProfileOptions) -> float:
    """Achieved FLOP/s of one transformer layer's non-attention work with the model's own shapes.

    Runs forward+backward of the layer's linear layers (QKV, projection, MLP with SwiGLU if set)
    plus its norms and activation on ``layer_tokens`` tokens, and divides the layer's share of
    :func:`megatron_hexiseq.costmodel.linear_flops_per_token` by the time: elementwise work and
    small-matrix inefficiency are folded into the rate, which is what the cost model then uses.
    """
    import torch.nn.functional as F

    h, a, g, d, f = model.hidden_size, model.num_attention_heads, model.num_query_groups, model.kv_channels, \
        model.ffn_hidden_size
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
    return _timed_rate(work, flops_per_token * T, opts.seconds_per_test)


class _NoAttention(torch.nn.Module):
    """Core attention that passes the query through: times everything in the model *but* attention."""

    def __init__(self, config: Any, layer_number: int, attn_mask_type: Any, attention_type: str,
                 attention_dropout: float | None = None, softmax_scale: float | None = None,
                 cp_comm_type: str | None = None, pg_collection: Any = None) -> None:
        super().__init__()

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: Any,
                attn_mask_type: Any = None, attention_bias: Any = None, packed_seq_params: Any = None) -> torch.Tensor:
        S, b, H, d = query.shape
        return query.reshape(S, b, H * d)


def measure_model_step(model: Any, tokens: int, opts: ProfileOptions) -> dict[str, Any]:
    """CPU calibration: a whole training step of the model *without* attention, as a rate plus a
    fixed cost: ``time(T) = step_overhead_s + T * flops_per_token / flops_per_s``.

    Builds the same megatron-core GPT the CPU driver trains (``train_cpu.build_gpt``) with a
    pass-through core attention, wrapped in Megatron's DDP over all ranks, and runs the driver's
    step (forward, per-token loss, backward; ``finalize_model_grads`` and the loss all-reduce; AdamW)
    at ``tokens // 2``, ``tokens`` and ``2 * tokens`` tokens per rank (``repeats`` steps after a
    warm-up), every rank at once. Each
    rank's local work (everything but the two collectives) is fitted with a least-squares line:
    the slope gives ``flops_per_s`` with the model's non-attention FLOPs
    (:func:`megatron_hexiseq.costmodel.linear_flops_per_token`; embedding, norms, RoPE and
    cross-entropy are folded in), the intercept is the rank's fixed local cost (optimizer step,
    framework). ``step_overhead_s`` = that intercept + the gradient and loss reduction (the fastest
    rank's median time in the collectives: the others also wait for stragglers, which the phase
    model already counts). A negative intercept (noise) becomes 0 and the rate the one at
    ``tokens``. Collective over the default group (Megatron's parallel state is set up and torn down).
    """
    from megatron.core import parallel_state as mpu
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    from megatron_hexiseq.costmodel import linear_flops_per_token
    from megatron_hexiseq.layout import make_layout
    from megatron_hexiseq.megatron.train_cpu import (TinyGPT, TrainConfig, build_gpt, cpu_device_shim, make_batch,
                                                     train_step)

    H = model.num_attention_heads
    sizes = sorted({max(1, tokens // 2), tokens, 2 * tokens})
    local_s, sync_s = [], []
    mpu.initialize_model_parallel(tensor_model_parallel_size=1, context_parallel_size=1)  # DP = all ranks
    try:
        with cpu_device_shim():  # megatron's RoPE asks torch.cuda for its device
            for T in sizes:
                layout = make_layout(seq_length=T, num_attention_heads=H, num_query_groups=model.num_query_groups,
                                     group_sizes=[1], segments=[[(0, T)]], heads=[list(range(H))])
                cfg = TrainConfig(model=TinyGPT.from_spec(model), layout=layout, steps=1)
                gpt = build_gpt(cfg, core_attention=_NoAttention)
                ddp = DistributedDataParallel(gpt.config, DistributedDataParallelConfig(grad_reduce_in_fp32=True),
                                              gpt)
                params = [p for p in ddp.parameters() if p.requires_grad]
                opt = torch.optim.AdamW(params, lr=1e-5)
                batch = make_batch(cfg, 0, dist.get_rank())
                loc, syn = [], []
                dist.barrier()  # every rank times the same size at the same time
                for _ in range(opts.repeats + 1):  # the same count on every rank: the loop has collectives
                    _, timing = train_step(ddp, opt, params, batch)
                    loc.append(timing.local_s)
                    syn.append(timing.sync_s)
                local_s.append(statistics.median(loc[1:]))  # the first step warms up
                sync_s.append(statistics.median(syn[1:]))
    finally:
        mpu.destroy_model_parallel()
    sync = torch.tensor([statistics.median(sync_s)], dtype=torch.float64)
    dist.all_reduce(sync, op=dist.ReduceOp.MIN)
    slope, intercept = statistics.linear_regression(sizes, local_s)
    if intercept < 0 or slope <= 0:
        k = sizes.index(tokens)
        slope, intercept = local_s[k] / tokens, 0.0
    return {"flops_per_s": linear_flops_per_token(model) / slope, "step_overhead_s": intercept + float(sync),
            "local_overhead_s": intercept, "grad_sync_s": float(sync),
            "points": [{"tokens": T, "local_s": t, "sync_s": y} for T, t, y in zip(sizes, local_s, sync_s)]}


def measure_attention_flops(device: torch.device, dtype: torch.dtype, opts: ProfileOptions) -> float:
    """Causal attention fwd+bwd FLOP/s counting only visible (q, k) pairs: 4*d fwd, 8*d bwd per pair-head.

    With ``opts.model`` the model's heads and head size are used (sequence capped at 2048).
    """
    s, h, d = opts.attention_seq, opts.attention_heads, opts.head_dim
    if opts.model is not None:
        s, h, d = min(opts.model.seq_length, 2048), opts.model.num_attention_heads, opts.model.kv_channels
        if device.type == "cpu":
            return measure_runtime_attention_flops(opts.model, s, opts)
    q = torch.randn(1, h, s, d, device=device, dtype=dtype, requires_grad=True)
    k = torch.randn(1, h, s, d, device=device, dtype=dtype, requires_grad=True)
    v = torch.randn(1, h, s, d, device=device, dtype=dtype, requires_grad=True)
    pairs = s * (s + 1) // 2

    def work() -> None:
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        out.sum().backward()
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    return _timed_rate(work, 12.0 * d * pairs * h, opts.seconds_per_test)


def measure_runtime_attention_flops(model: Any, tokens: int, opts: ProfileOptions) -> float:
    """CPU calibration: FLOP/s of HexiSeq's own attention (``kernel="auto"``) fwd+bwd on one rank.

    Every rank runs a one-rank layout of its own (one domain per rank, no communication), so the
    rate includes the runtime's block kernel, LSE bookkeeping and recompute-style backward — what
    training executes — rather than PyTorch's fused SDPA alone. Collective (group construction).
    """
    from megatron_hexiseq.attention.groups import build_hexiseq_groups
    from megatron_hexiseq.attention.hexiseq import hexiseq_attn_func
    from megatron_hexiseq.layout import make_layout

    H, G, d = model.num_attention_heads, model.num_query_groups, model.kv_channels
    layout = make_layout(seq_length=tokens, num_attention_heads=H, num_query_groups=G, group_sizes=[1],
                         segments=[[(0, tokens)]], heads=[list(range(H))])
    groups = build_hexiseq_groups(layout, domains=[[r] for r in range(dist.get_world_size())])
    q = torch.randn(tokens, 1, H, d, requires_grad=True)
    k = torch.randn(tokens, 1, G, d, requires_grad=True)
    v = torch.randn(tokens, 1, G, d, requires_grad=True)

    def work() -> None:
        hexiseq_attn_func(q, k, v, groups=groups, kernel="auto").sum().backward()

    return _timed_rate(work, 12.0 * d * H * tokens * (tokens + 1) / 2, opts.seconds_per_test)


def measure_pair_bandwidth(a: int, b: int, device: torch.device, opts: ProfileOptions) -> float | None:
    """Bytes/s between ranks a and b by ping-pong (median of repeats); None on other ranks."""
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


def _memory_gib(device: torch.device, opts: ProfileOptions) -> float:
    if opts.memory_gib is not None:
        return float(opts.memory_gib)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free / 2**30
    return 4.0


def _device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"


def run_profile(opts: ProfileOptions = ProfileOptions(), progress: Callable[[str], None] | None = None
                ) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """Measure all ranks; rank 0 returns ``(cluster_spec_dict, raw_dict)``, other ranks None."""
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    say = progress if (progress and rank == 0) else (lambda _msg: None)
    node = opts.node_names[rank] if opts.node_names else socket.gethostname()

    fixed: dict[str, Any] = {}  # fixed costs (CPU testbed with a model): see megatron_hexiseq.fixed_costs
    say("matmul throughput (all ranks at once)")
    dist.barrier()
    if opts.model is None:
        mm = measure_matmul_flops(device, dtype, opts)
    elif device.type == "cpu":  # calibrate with the very model the CPU driver trains
        step = measure_model_step(opts.model, -(-opts.model.seq_length // world), opts)
        mm, fixed["step_overhead_s"], fixed["model_step"] = step["flops_per_s"], step["step_overhead_s"], step["points"]
    else:
        mm = measure_layer_flops(opts.model, device, dtype, opts)
    say("attention throughput (all ranks at once)")
    dist.barrier()
    attn = measure_attention_flops(device, dtype, opts)
    pair_bw: dict[str, float] = {}
    for a in range(world):
        for b in range(a + 1, world):
            say(f"bandwidth {a}<->{b}")
            dist.barrier()
            bw = measure_pair_bandwidth(a, b, device, opts)
            if rank == a:
                pair_bw[f"{a}-{b}"] = bw
    say("all-to-all bandwidth")
    a2a = measure_alltoall_bandwidth(device, opts) if world > 1 else None
    if opts.model is not None and device.type == "cpu":
        from megatron_hexiseq.fixed_costs import can_calibrate, time_calibration_layouts

        if can_calibrate(opts.model, world):  # else the latencies stay 0 (one rank, or a tiny sequence)
            say("collective and K/V-step latency inside the attention runtime")
            fixed["calibration"] = time_calibration_layouts(opts.model, opts)
    mine = {"rank": rank, "node": node, "device": _device_name(device), "dtype": str(dtype).replace("torch.", ""),
            "matmul_flops": mm, "attention_flops": attn, "alltoall_Bps": a2a, "pair_Bps": pair_bw,
            "memory_gib": _memory_gib(device, opts), **fixed}
    everyone: list[dict[str, Any]] = [None] * world  # type: ignore[list-item]
    dist.all_gather_object(everyone, mine)
    if rank != 0:
        return None
    raw = {"ranks": everyone, "world_size": world,
           "options": opts.__dict__ | {"node_names": list(opts.node_names or []),
                                       "model": opts.model.to_dict() if opts.model is not None else None}}
    spec = cluster_spec_from_measurements(everyone)
    if "calibration" in everyone[0]:
        from megatron_hexiseq.fixed_costs import fit_latencies

        raw["latency_fit"] = fit_latencies(spec, everyone[0]["calibration"], opts.model)
    return spec, raw


def cluster_spec_from_measurements(per_rank: list[dict[str, Any]], name: str = "profiled") -> dict[str, Any]:
    """Turn per-rank measurements into the cluster spec format (one GPU type per node).

    Ranks must be listed node by node (the rank order the layout will use). Node type numbers are
    the mean over its ranks; intra-node bandwidth is the mean pair bandwidth inside the node, the
    network bandwidth the mean pair bandwidth to other nodes (falling back to each other's values
    for single-rank nodes or single-node clusters).
    """
    pair: dict[tuple[int, int], float] = {}
    for r in per_rank:
        for key, bw in r["pair_Bps"].items():
            a, b = (int(x) for x in key.split("-"))
            pair[(a, b)] = pair[(b, a)] = bw
    order: list[str] = []
    for r in per_rank:
        if order and r["node"] != order[-1] and r["node"] in order:
            raise ValueError(f"rank {r['rank']} on node {r['node']} is not next to the other ranks of that node")
        if not order or r["node"] != order[-1]:
            order.append(r["node"])
    gpus, nodes = {}, []
    all_bw = list(pair.values()) or [per_rank[0]["alltoall_Bps"] or 1e9]
    for node in order:
        members = [r for r in per_rank if r["node"] == node]
        ids = [r["rank"] for r in members]
        inside = [pair[(a, b)] for a in ids for b in ids if a < b]
        outside = [pair[(a, b)] for a in ids for b in range(len(per_rank)) if b not in ids]
        intra = statistics.mean(inside) if inside else statistics.mean(all_bw)
        inter = statistics.mean(outside) if outside else intra
        type_name = f"{members[0]['device']}-{node}".replace(" ", "-")
        gpus[type_name] = {
            "bf16_tflops": _sig(statistics.mean(r["matmul_flops"] for r in members) / 1e12),
            "attention_tflops": _sig(statistics.mean(r["attention_flops"] for r in members) / 1e12),
            "memory_gib": _sig(min(r["memory_gib"] for r in members)),
            "nvlink_GBps": _sig(intra / 1e9),
            "efficiency": 1.0,
        }
        if all("step_overhead_s" in r for r in members):
            gpus[type_name]["step_overhead_ms"] = _sig(statistics.mean(r["step_overhead_s"] for r in members) * 1e3)
        nodes.append({"name": node, "gpu": type_name, "count": len(members),
                      "nvlink_GBps": _sig(intra / 1e9), "network_GBps": _sig(inter / 1e9)})
    return {"name": name, "gpus": gpus, "nodes": nodes}


def _sig(x: float, digits: int = 6) -> float:
    """``x`` to ``digits`` significant digits (CPU rates are tiny in TFLOP/s)."""
    return float(f"{x:.{digits}g}")
