"""CPU calibration of ``profile``: the testbed's training step and the runtime's fixed costs.

Bandwidth and FLOP rates alone under-predict the CPU testbed badly; ``profile`` therefore calls
:data:`CPU_CALIBRATION` (a :class:`~megatron_hexiseq.profile.run.CpuCalibration`) on CPU with a
model, and it measures what training executes:

- :func:`measure_model_step`: a whole training step of the CPU driver's model *without* attention
  (a pass-through core attention) at three token counts, fitted as a FLOP rate plus a fixed
  ``step_overhead_s``, and a step of several micro-batches of the smallest: the part of that fixed
  cost each further micro-batch pays again (``micro_batch_overhead_s``);
- :func:`measure_runtime_attention_flops`: HexiSeq's own attention (``kernel="auto"``) on one rank;
- fixed costs of the attention runtime's communication: a head all-to-all or a K/V exchange step
  between ranks that share a core costs milliseconds of scheduling (one rank must be switched out
  for its neighbour to send), whatever the bytes. :func:`time_calibration_layouts` times HexiSeq's
  own attention (the model's head shape; up to 4 calls forward, then their backwards, as a model's
  layers run; seconds per call) on every rank at once, in two layouts of all ranks:

  - ``a2a``: one A2A group of all ranks (contiguous, even token split): pure head parallelism,
    4 all-to-alls forward and 4 backward (heads equal among the ranks of a node; the same per-rank
    work is also timed alone, without communication, as the reference);
  - ``p2p``: one group per rank, zig-zag segments: pure sub-ring, (n - 1) rounds forward, and
    backward K/V again plus dK/dV back;
  - ``p2p_docs``: the same ring on :data:`CALIBRATION_DOCUMENTS` equal packed documents, each cut
    into 2 n zig-zag chunks (Megatron's THD split): tens of small document windows per layer, each
    one kernel call with the runtime's slicing and merging around it.

  :func:`fit_latencies` then asks the cost model what the same calls cost *without* fixed costs
  (the measured compute rates and bandwidths of the profiled spec, a one-layer copy of the model)
  and divides the difference by the number of collectives / exchange steps, giving
  ``collective_latency_us``, ``p2p_latency_us`` and ``window_overhead_us`` (per kernel call of a
  packed micro-batch; fitted last, on top of the two latencies) for the spec's GPU types: measured
  minus modelled, no constant set by hand. The same value goes to every type (the calls involve
  every rank; the fit has three numbers for three layouts). On ``shared_core`` nodes each rank's
  count of fixed costs is weighted by its contention factor
  (:mod:`megatron_hexiseq.costmodel.contention`), as the cost model will charge them; the latency
  is the one that makes the slowest modelled rank match the measured call. Negative differences
  (the model already over-predicts) give 0. docs/cost_model.md, "Fixed costs", has the formulas;
  docs/testbed.md the figures.
"""

from __future__ import annotations

import functools
import statistics
import time
from dataclasses import replace
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import parallel_state as mpu
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

from megatron_hexiseq.attention.groups import build_hexiseq_groups
from megatron_hexiseq.attention.hexiseq import hexiseq_attn_func
from megatron_hexiseq.cluster import cluster_from_dict
from megatron_hexiseq.costmodel import TrainOptions, estimate, linear_flops_per_token
from megatron_hexiseq.costmodel.contention import contention_scale
from megatron_hexiseq.costmodel.documents import estimate_documents
from megatron_hexiseq.costmodel.exchange import kv_exchange_forward
from megatron_hexiseq.layout import Layout, make_layout, split_evenly, zigzag_segments
from megatron_hexiseq.megatron.config import cpu_device_shim
from megatron_hexiseq.megatron.reference_attention import PassThroughAttention
from megatron_hexiseq.model import ModelSpec
from megatron_hexiseq.profile.measure import (
    MODEL_ATTENTION_SEQ,
    ProfileOptions,
    significant,
    timed_rate,
)
from megatron_hexiseq.profile.run import CpuCalibration
from megatron_hexiseq.testbed.train import TrainConfig, build_gpt, make_batch, train_step
from megatron_hexiseq.varlen.schemes import zigzag_docs

MICRO_BATCHES = 4  # measure_model_step's split step: this many micro-batches of the smallest


def measure_model_step(model: ModelSpec, tokens: int, opts: ProfileOptions) -> dict[str, Any]:
    """CPU calibration: a whole training step of the model *without* attention, as a rate plus a
    fixed cost: ``time(T) = step_overhead_s + T * flops_per_token / flops_per_s``.

    Builds the same megatron-core GPT the CPU driver trains (:func:`~megatron_hexiseq.testbed.train.build_gpt`) with a
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
    ``tokens``. Then ``MICRO_BATCHES`` micro-batches of ``tokens // 2`` (the driver's gradient
    accumulation, about ``2 * tokens`` in all): its local time over the line's at its tokens, per
    further micro-batch, is ``micro_batch_overhead_s`` (the framework's fixed cost of a forward
    and backward, which a step pays once per micro-batch; within 0 and the intercept).
    Collective over the default group (Megatron's parallel state is set up and torn down).
    """
    H = model.num_attention_heads
    sizes = sorted({max(1, tokens // 2), tokens, 2 * tokens})
    # (tokens per micro-batch, micro-batches): the three sizes as one micro-batch, then
    # MICRO_BATCHES of the smallest (about the largest's tokens; what it costs over the fitted
    # line is what each further micro-batch of a step pays again)
    runs = [(T, 1) for T in sizes] + [(sizes[0], MICRO_BATCHES)]
    local_s, sync_s = [], []
    mpu.initialize_model_parallel(
        tensor_model_parallel_size=1, context_parallel_size=1
    )  # DP = all ranks
    try:
        with cpu_device_shim():  # megatron's RoPE asks torch.cuda for its device
            for T, m in runs:
                layout = make_layout(
                    seq_length=T,
                    num_attention_heads=H,
                    num_query_groups=model.num_query_groups,
                    group_sizes=[1],
                    segments=[[(0, T)]],
                    heads=[list(range(H))],
                )
                cfg = TrainConfig(model=model, layout=layout, steps=1)
                gpt = build_gpt(cfg, core_attention=PassThroughAttention)
                ddp = DistributedDataParallel(
                    gpt.config, DistributedDataParallelConfig(grad_reduce_in_fp32=True), gpt
                )
                params = [p for p in ddp.parameters() if p.requires_grad]
                opt = torch.optim.AdamW(params, lr=1e-5)
                batch = [make_batch(cfg, i, dist.get_rank()) for i in range(m)]
                loc, syn = [], []
                dist.barrier()  # every rank times the same size at the same time
                for _ in range(
                    opts.repeats + 1
                ):  # the same count on every rank: the loop has collectives
                    _, timing = train_step(ddp, opt, params, batch)
                    loc.append(timing.local_s)
                    syn.append(timing.sync_s)
                local_s.append(statistics.median(loc[1:]))  # the first step warms up
                sync_s.append(statistics.median(syn[1:]))
    finally:
        mpu.destroy_model_parallel()
    sync = torch.tensor([statistics.median(sync_s)], dtype=torch.float64)
    dist.all_reduce(sync, op=dist.ReduceOp.MIN)
    single = local_s[: len(sizes)]
    slope, intercept = statistics.linear_regression(sizes, single)
    if intercept < 0 or slope <= 0:
        k = sizes.index(tokens)
        slope, intercept = single[k] / tokens, 0.0
    # each further micro-batch: the split step's local time over the line's at its tokens, per
    # further micro-batch, within [0, the intercept] (a part of the step's fixed cost; noise
    # could put it outside)
    line = intercept + slope * sizes[0] * MICRO_BATCHES
    per_micro = min(max(0.0, (local_s[-1] - line) / (MICRO_BATCHES - 1)), intercept)
    return {
        "flops_per_s": linear_flops_per_token(model) / slope,
        "step_overhead_s": intercept + float(sync),
        "micro_batch_overhead_s": per_micro,
        "local_overhead_s": intercept,
        "grad_sync_s": float(sync),
        "points": [
            {"tokens": T, "micro_batches": m, "local_s": t, "sync_s": y}
            for (T, m), t, y in zip(runs, local_s, sync_s)
        ],
    }


def measure_runtime_attention_flops(model: ModelSpec, tokens: int, opts: ProfileOptions) -> float:
    """CPU calibration: FLOP/s of HexiSeq's own attention (``kernel="auto"``) fwd+bwd on one rank.

    Every rank runs a one-rank layout of its own (one domain per rank, no communication), so the
    rate includes the runtime's block kernel, LSE bookkeeping and recompute-style backward — what
    training executes — rather than PyTorch's fused SDPA alone. Collective (group construction).
    """
    H, G, d = model.num_attention_heads, model.num_query_groups, model.kv_channels
    layout = make_layout(
        seq_length=tokens,
        num_attention_heads=H,
        num_query_groups=G,
        group_sizes=[1],
        segments=[[(0, tokens)]],
        heads=[list(range(H))],
    )
    groups = build_hexiseq_groups(layout, domains=[[r] for r in range(dist.get_world_size())])
    q = torch.randn(tokens, 1, H, d, requires_grad=True)
    k = torch.randn(tokens, 1, G, d, requires_grad=True)
    v = torch.randn(tokens, 1, G, d, requires_grad=True)

    def work() -> None:
        hexiseq_attn_func(q, k, v, groups=groups, kernel="auto").sum().backward()

    return timed_rate(work, 12.0 * d * H * tokens * (tokens + 1) / 2, opts.seconds_per_test)


CURVE_SIZES = (16, 64, 256, 1024)
"""Window sizes of the ``cpu-flash`` call-size curve (plus the attention measurement's own size)."""
CURVE_TIME_SHARE = 0.25  # of ``seconds_per_test`` per curve point (10 points: ~2.5 tests' time)


def measure_cpu_kernel_curve(
    model: ModelSpec, tokens: int, opts: ProfileOptions
) -> list[dict[str, Any]]:
    """CPU calibration: the runtime's document windows (``attention.varlen``: ``local_forward`` /
    ``merge_forward`` then ``windows_backward``, one ``cpu-flash`` kernel call each, with their
    output copies and LSE merges) at square sizes ``CURVE_SIZES`` below ``tokens`` and ``tokens``
    itself, causal (a local window) and full (a received window), the model's heads and head dim,
    on every rank at once. Rows in ``profile.kernels.measure_kernel_rates``' format (kernel
    ``cpu-flash``; ``fwd_bwd_tflops`` in the FlashAttention count), so ``rates_to_spec`` turns them
    into ``attention_curves``: fractions of the rate at ``tokens`` tokens, the size the flat
    attention rate (:func:`measure_runtime_attention_flops`) is measured at. Collective only in
    that every rank runs it at the same time (the caller's barrier)."""
    from megatron_hexiseq.attention.kernels import Kernel, kv_map
    from megatron_hexiseq.attention.peers import Window
    from megatron_hexiseq.attention.varlen import (
        WindowKernel,
        local_forward,
        merge_forward,
        windows_backward,
    )
    from megatron_hexiseq.profile.kernels import attention_flops

    H, G, d = model.num_attention_heads, model.num_query_groups, model.kv_channels
    of_head = tuple(h // (H // G) for h in range(H))
    wk = WindowKernel(Kernel.CPU_FLASH, d**-0.5, kv_map(of_head, G), {})
    rows = []
    for causal in (True, False):
        for S in sorted({s for s in CURVE_SIZES if s < tokens} | {tokens}):
            q, dout = torch.randn(S, 1, H, d), torch.randn(S, 1, H, d)
            k, v = torch.randn(S, 1, G, d), torch.randn(S, 1, G, d)
            win = (Window(None, 0, S, 0, S),)

            def work(q=q, k=k, v=v, dout=dout, win=win, causal=causal, S=S) -> None:
                if causal:
                    out, lse = local_forward(wk, win, q, k, v)
                else:
                    out, lse = torch.zeros(S, 1, H, d), torch.zeros(S, 1, H)
                    merge_forward(wk, win, "recv", q, k, v, out, lse)
                dq = torch.zeros(S, 1, H, d)
                windows_backward(wk, win, "k", dout, q, k, v, out, lse, dq, causal=causal)

            fl = 3.5 * attention_flops(S, S, H, d, causal)
            rate = timed_rate(work, fl, opts.seconds_per_test * CURVE_TIME_SHARE)
            rows.append(
                {
                    "kernel": "cpu-flash",
                    "dtype": "fp32",
                    "D": d,
                    "causal": causal,
                    "S": S,
                    "H": H,
                    "fwd_bwd_tflops": rate / 1e12,
                }
            )
    return rows


CALIBRATION_SEQ = (
    MODEL_ATTENTION_SEQ  # longest sequence the calibration runs (the profile's attention cap)
)
CALIBRATION_LAYERS = 4  # attention calls per timed repetition (forward all, then backward all)
# equal documents of the packed calibration call: a ProLong micro-batch of the testbed's 2K tokens
# (documents scaled by 1/16, bench/varlen_testbed.py) holds 8-17; 12 is the middle, and a cluster's
# own distribution is not known to `profile`
CALIBRATION_DOCUMENTS = 12


def calibration_heads(num_heads: int, nodes: list[str]) -> list[int]:
    """Heads per rank of the ``a2a`` layout: as even as possible, but equal among the ranks of one
    node (ranks sharing a core with unequal work would not share it half and half: the scheduler
    gives the busier one the core once the other waits). Leftover heads go to the first rank."""
    world = len(nodes)
    per = [num_heads // world] * world
    left = num_heads - sum(per)
    members: dict[str, list[int]] = {}
    for r, n in enumerate(nodes):
        members.setdefault(n, []).append(r)
    for ranks in sorted(members.values(), key=len):
        if len(ranks) <= left:
            for r in ranks:
                per[r] += 1
            left -= len(ranks)
    per[0] += left
    return per


def calibration_cu_seqlens(seq_length: int, world: int) -> list[int]:
    """Boundaries of the ``p2p_docs`` call's equal documents: :data:`CALIBRATION_DOCUMENTS` of
    them, fewer when a document would not give each of the ``2 world`` zig-zag chunks a token."""
    docs = max(1, min(CALIBRATION_DOCUMENTS, seq_length // (2 * world)))
    return [seq_length * i // docs for i in range(docs + 1)]


def calibration_layouts(
    world: int,
    seq_length: int,
    num_heads: int,
    num_query_groups: int,
    hosts: list[str] | None = None,
    gpus: list[str] | None = None,
) -> dict[str, Layout]:
    """The three layouts of all ``world`` ranks the fit uses: ``a2a`` (one group; heads by
    :func:`calibration_heads` over ``hosts``), ``p2p`` (a ring) and ``p2p_docs`` (the ring on the
    THD split of :func:`calibration_cu_seqlens`)."""
    sizes = split_evenly(seq_length, world)
    starts = [sum(sizes[:r]) for r in range(world)]
    per_head = calibration_heads(
        num_heads, list(hosts) if hosts else [str(r) for r in range(world)]
    )
    first = [sum(per_head[:r]) for r in range(world)]
    layout_of = functools.partial(
        make_layout,
        seq_length=seq_length,
        num_attention_heads=num_heads,
        num_query_groups=num_query_groups,
        hosts=hosts,
        gpus=gpus,
    )
    a2a = layout_of(
        group_sizes=[world],
        segments=[[(s, s + n)] for s, n in zip(starts, sizes)],
        heads=[list(range(f, f + h)) for f, h in zip(first, per_head)],
    )
    p2p = layout_of(
        group_sizes=[1] * world,
        segments=zigzag_segments(seq_length, world),
        heads=[list(range(num_heads))] * world,
    )
    docs = layout_of(
        group_sizes=[1] * world,
        segments=zigzag_docs(
            np.array(calibration_cu_seqlens(seq_length, world)), list(range(world)), world
        ),
        heads=[list(range(num_heads))] * world,
    )
    return {"a2a": a2a, "p2p": p2p, "p2p_docs": docs}


def can_calibrate(model: ModelSpec, world: int) -> bool:
    """The zig-zag ring needs two chunks of at least one token per rank."""
    return world > 1 and min(model.seq_length, CALIBRATION_SEQ) >= 2 * world


def time_calibration_layouts(model: ModelSpec, opts: ProfileOptions) -> dict[str, Any]:
    """Collective over the default group: seconds per attention call (forward + backward, slowest
    rank, median of ``opts.repeats``) of each calibration layout. Same dict on every rank.
    Requires :func:`can_calibrate`."""
    world, me = dist.get_world_size(), dist.get_rank()
    S = (
        min(model.seq_length, CALIBRATION_SEQ) // (2 * world) * (2 * world)
    )  # zig-zag: 2 chunks per rank
    H, G, d = model.num_attention_heads, model.num_query_groups, model.kv_channels
    nodes = list(opts.node_names) if opts.node_names else [str(r) for r in range(world)]
    layouts = calibration_layouts(world, S, H, G, hosts=nodes)
    # the a2a layout's compute alone: each rank its own heads over the whole sequence, no communication
    # more ranks than heads: a head-less rank still times one head (its compute reference is a
    # little high, so the fitted latency a little low)
    heads_r = max(1, len(layouts["a2a"].ranks[me].heads))
    alone = make_layout(
        seq_length=S,
        num_attention_heads=heads_r,
        num_query_groups=1,
        group_sizes=[1],
        segments=[[(0, S)]],
        heads=[list(range(heads_r))],
    )
    layers = max(1, min(model.num_layers, CALIBRATION_LAYERS))
    out: dict[str, Any] = {
        "seq_length": S,
        "repeats": opts.repeats,
        "layers": layers,
        "a2a_heads": _heads(layouts["a2a"]),
    }
    cu = calibration_cu_seqlens(S, world)
    out["documents"] = len(cu) - 1
    for name, layout, domains, g, cu_seqlens in (
        ("a2a", layouts["a2a"], [list(range(world))], G, None),
        ("a2a_compute", alone, [[r] for r in range(world)], 1, None),
        ("p2p", layouts["p2p"], [list(range(world))], G, None),
        ("p2p_docs", layouts["p2p_docs"], [list(range(world))], G, cu),
    ):
        groups = build_hexiseq_groups(layout, domains=domains)
        s_r, h = layout.ranks[0 if len(domains) > 1 else me].num_tokens, layout.num_attention_heads
        gen = torch.Generator().manual_seed(me)
        q = torch.randn(s_r, 1, h, d, generator=gen, requires_grad=True)
        k = torch.randn(s_r, 1, g, d, generator=gen, requires_grad=True)
        v = torch.randn(s_r, 1, g, d, generator=gen, requires_grad=True)
        times = []
        for i in range(opts.repeats + 1):  # the first call warms up
            dist.barrier()
            start = time.perf_counter()
            # `layers` calls forward, then their backwards (as a model's layers run): per call time
            total = sum(
                hexiseq_attn_func(
                    q, k, v, groups=groups, kernel="auto", cu_seqlens=cu_seqlens
                ).sum()
                for _ in range(layers)
            )
            assert isinstance(total, torch.Tensor)  # layers >= 1: a sum of tensors, not sum's 0
            total.backward()
            elapsed = torch.tensor([(time.perf_counter() - start) / layers], dtype=torch.float64)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            if i:
                times.append(float(elapsed))
        out[f"{name}_call_s"] = statistics.median(times)
    return out


def _heads(layout: Layout) -> list[int]:
    return [len(r.heads) for r in layout.ranks]


def _solve_latency(measured: float, base: np.ndarray, count: np.ndarray) -> float:
    """The latency x with ``max_r(base_r + count_r * x) = measured`` (seconds), 0 when the model
    without fixed costs is already as slow as the measured call or nothing counts."""
    some = count > 0
    if not some.any():
        return 0.0
    return max(0.0, float(((measured - base[some]) / count[some]).min()))


def fit_latencies(
    spec: dict[str, Any], calibration: dict[str, Any], model: ModelSpec
) -> dict[str, Any]:
    """Set ``collective_latency_us``, ``p2p_latency_us`` and (when the calibration timed the
    packed call) ``window_overhead_us`` of every GPU type in ``spec`` (in place) from the timed
    calibration calls; returns the fit (measured, modelled, counts) for the raw JSON."""
    fitted = ("collective_latency_us", "p2p_latency_us", "window_overhead_us")

    def spec_with(values: dict[str, float]) -> dict[str, Any]:
        out = {**spec, "gpus": {k: dict(v) for k, v in spec["gpus"].items()}}
        for entry in out["gpus"].values():
            for key in fitted:
                entry.pop(key, None)
            entry.update(values)
        return out

    cluster = cluster_from_dict(spec_with({}), source="profiled cluster spec")
    S = calibration["seq_length"]
    one_layer = replace(model, num_layers=1, seq_length=S)
    options = TrainOptions()
    hosts, gpus = [d.node for d in cluster.devices], [d.gpu.name for d in cluster.devices]
    layouts = calibration_layouts(
        cluster.world_size, S, model.num_attention_heads, model.num_query_groups, hosts, gpus
    )
    passes = 1 + 1  # forward + backward (no recompute in the calibration call)
    fit: dict[str, Any] = {}

    def record(name: str, base: np.ndarray, count: np.ndarray, weighted: np.ndarray) -> None:
        measured = calibration[f"{name}_call_s"]
        fit[name] = {
            "measured_s": measured,
            "modelled_without_fixed_s": float(base.max()),
            "steps": int(count.max()),
            "latency_us": significant(_solve_latency(measured, base, weighted) * 1e6),
        }

    for name in ("a2a", "p2p"):
        est = estimate(layouts[name], cluster, one_layer, options)
        linear = np.array([r.breakdown["linear_s"] for r in est.per_rank])
        base = np.array([r.time_s for r in est.per_rank]) - linear
        # each rank's contention factor from the model's phases (without fixed costs)
        weight = contention_scale(cluster, linear, base)  # 1 off shared-core nodes
        if name == "a2a":  # measured compute (same work, no communication) + modelled bytes
            a2a_bytes = max(r.breakdown["a2a_s"] for r in est.per_rank)
            base = np.full(linear.size, calibration["a2a_compute_call_s"] + a2a_bytes)
            count = np.full(linear.size, float(passes * 4))  # q, k, v in, output back, per pass
        else:  # K/V, K/V again in the backward, dK/dV back; per round with something to receive
            rounds = kv_exchange_forward(layouts[name], cluster, one_layer, 1).rounds
            count = (passes + 1) * np.array(rounds, dtype=np.float64)
        record(name, base, count, count * weight)
    if "p2p_docs_call_s" in calibration:  # the latencies as fitted; per kernel call what is left
        latencies = {
            "collective_latency_us": fit["a2a"]["latency_us"],
            "p2p_latency_us": fit["p2p"]["latency_us"],
        }
        cu = calibration_cu_seqlens(S, cluster.world_size)

        def phase(overhead_us: float) -> float:
            """The packed call's slowest attention phase with this overhead per kernel call (it
            also makes the ranks busier, so their contention-scaled latencies grow with it)."""
            c = cluster_from_dict(
                spec_with(latencies | {"window_overhead_us": overhead_us}),
                source="profiled cluster spec",
            )
            e = estimate_documents(layouts["p2p_docs"], c, one_layer, options, cu)
            return float((e.time_s - e.linear_s).max())

        measured = calibration["p2p_docs_call_s"]
        e = estimate_documents(
            layouts["p2p_docs"],
            cluster_from_dict(spec_with(latencies), source="profiled cluster spec"),
            one_layer,
            options,
            cu,
        )
        calls = int(passes * e.kernel_calls.max())
        without = float((e.time_s - e.linear_s).max())  # phase(0.0)
        overhead_us = 0.0
        if without < measured and calls:
            # phase() grows monotonically, for the rank with most calls by at least `calls` per
            # unit: bisect between 0 and the overhead that rank alone would need
            low = float((e.time_s - e.linear_s).min())
            lo, hi = 0.0, (measured - low) / calls * 1e6
            for _ in range(60):
                mid = (lo + hi) / 2
                lo, hi = (mid, hi) if phase(mid) < measured else (lo, mid)
            overhead_us = hi
        fit["p2p_docs"] = {
            "measured_s": measured,
            "modelled_without_fixed_s": without,
            "steps": calls,
            "latency_us": significant(overhead_us),
        }
    for entry in spec["gpus"].values():
        entry["collective_latency_us"] = fit["a2a"]["latency_us"]
        entry["p2p_latency_us"] = fit["p2p"]["latency_us"]
        if "p2p_docs" in fit:
            entry["window_overhead_us"] = fit["p2p_docs"]["latency_us"]
    return fit


CPU_CALIBRATION = CpuCalibration(
    model_step=measure_model_step,
    attention_flops=measure_runtime_attention_flops,
    attention_curve=measure_cpu_kernel_curve,
    can_time_fixed_costs=can_calibrate,
    fixed_costs=time_calibration_layouts,
    fit_latencies=fit_latencies,
)
