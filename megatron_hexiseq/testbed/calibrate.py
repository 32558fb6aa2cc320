"""CPU calibration of ``profile``: the testbed's training step and the runtime's fixed costs.

Bandwidth and FLOP rates alone under-predict the CPU testbed badly; ``profile`` therefore calls
:data:`CPU_CALIBRATION` (a :class:`~megatron_hexiseq.profile.run.CpuCalibration`) on CPU with a
model, and it measures what training executes:

- :func:`measure_model_step`: a whole training step of the CPU driver's model *without* attention
  (a pass-through core attention) at three token counts, fitted as a FLOP rate plus a fixed
  ``step_overhead_s``;
- :func:`measure_runtime_attention_flops`: HexiSeq's own attention (``kernel="auto"``) on one rank;
- fixed costs of the attention runtime's communication: a head all-to-all or a K/V exchange step
  between ranks that share a core costs milliseconds of scheduling (one rank must be switched out
  for its neighbour to send), whatever the bytes, and how much of it the compute between two steps
  absorbs depends on that compute. :func:`time_calibration_layouts` therefore times the driver's
  whole training step (:func:`time_calibration_steps`; the model with HexiSeq's attention, every
  rank at once) in two layouts of all ranks (:func:`calibration_layouts`), each on the plain
  sequence and on the sequence packed as ``CALIBRATION_DOCUMENTS`` equal documents
  (``--reset-attention-mask``), where little attention is left to hide a step:

  - ``a2a``: one A2A group of all ranks (contiguous, even token split; heads equal among the ranks
    of a node): pure head parallelism, 4 all-to-alls per layer forward and 4 backward;
  - ``p2p``: one group per rank: pure sub-ring, K/V forward, K/V again and dK/dV back per round;
    zig-zag segments (every document in 2 W chunks, Megatron's THD split), and for the packed
    documents also the contiguous split (documents cross rank boundaries as in HexiSeq layouts).

  :func:`fit_latencies` prices each step with ``estimate_documents`` (the profiled spec's rates and
  bandwidths, the full model) as a function of that layout's latency and fits
  ``collective_latency_us`` / ``p2p_latency_us`` by least squares of the relative errors over the
  layout's steps, so a latency is neither its hidden nor its exposed extreme. (Attention-only calls
  on one long sequence, the earlier calibration, gave 1.1-1.4 ms per K/V step on the 2-core VM;
  training steps on packed documents 2.5-3.4 ms: docs/testbed.md.) The same values go to every
  type of the spec (the steps involve every rank); a step faster than modelled pulls towards 0,
  never below. docs/cost_model.md, "Fixed costs", has the formulas; docs/testbed.md the figures.
"""

from __future__ import annotations

import functools
import statistics
from collections.abc import Sequence
from dataclasses import replace
from typing import Any, NamedTuple

import numpy as np
import torch
import torch.distributed as dist
from megatron.core import parallel_state as mpu
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

from megatron_hexiseq.attention.groups import build_hexiseq_groups
from megatron_hexiseq.attention.hexiseq import hexiseq_attn_func
from megatron_hexiseq.cluster import cluster_from_dict
from megatron_hexiseq.costmodel import TrainOptions, linear_flops_per_token
from megatron_hexiseq.costmodel.documents import cu_from_lengths, estimate_documents
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
from megatron_hexiseq.testbed.train import (
    TrainConfig,
    build_gpt,
    make_batch,
    train_rank,
    train_step,
)
from megatron_hexiseq.varlen.schemes import zigzag_docs


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
    ``tokens``. Collective over the default group (Megatron's parallel state is set up and torn down).
    """
    H = model.num_attention_heads
    sizes = sorted({max(1, tokens // 2), tokens, 2 * tokens})
    local_s, sync_s = [], []
    mpu.initialize_model_parallel(
        tensor_model_parallel_size=1, context_parallel_size=1
    )  # DP = all ranks
    try:
        with cpu_device_shim():  # megatron's RoPE asks torch.cuda for its device
            for T in sizes:
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
                batch = make_batch(cfg, 0, dist.get_rank())
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
    slope, intercept = statistics.linear_regression(sizes, local_s)
    if intercept < 0 or slope <= 0:
        k = sizes.index(tokens)
        slope, intercept = local_s[k] / tokens, 0.0
    return {
        "flops_per_s": linear_flops_per_token(model) / slope,
        "step_overhead_s": intercept + float(sync),
        "local_overhead_s": intercept,
        "grad_sync_s": float(sync),
        "points": [
            {"tokens": T, "local_s": t, "sync_s": y} for T, t, y in zip(sizes, local_s, sync_s)
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
    wk = WindowKernel(
        Kernel.CPU_FLASH, d**-0.5, torch.tensor(of_head), True, {}, kv_map(of_head, G)
    )
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


def calibration_layouts(
    world: int,
    seq_length: int,
    num_heads: int,
    num_query_groups: int,
    hosts: list[str] | None = None,
    gpus: list[str] | None = None,
) -> dict[str, Layout]:
    """The two layouts of all ``world`` ranks the fit uses: ``a2a`` (one group; heads by
    :func:`calibration_heads` over ``hosts``) and ``p2p`` (a ring)."""
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
    return {"a2a": a2a, "p2p": p2p}


def can_calibrate(model: ModelSpec, world: int) -> bool:
    """The zig-zag ring needs two chunks of at least one token per rank."""
    return world > 1 and min(model.seq_length, CALIBRATION_SEQ) >= 2 * world


def time_calibration_layouts(model: ModelSpec, opts: ProfileOptions) -> dict[str, Any]:
    """Collective over the default group: the timed ``CALIBRATION_STEPS`` (``CalibrationStep`` dicts,
    :func:`time_calibration_steps`) on the two calibration layouts of
    ``min(seq_length, CALIBRATION_SEQ)`` tokens rounded down to whole zig-zag chunks. Same dict on
    every rank. Requires :func:`can_calibrate`."""
    world = dist.get_world_size()
    S = min(model.seq_length, CALIBRATION_SEQ) // (2 * world) * (2 * world)
    nodes = list(opts.node_names) if opts.node_names else [str(r) for r in range(world)]
    layouts = calibration_layouts(
        world, S, model.num_attention_heads, model.num_query_groups, hosts=nodes
    )
    return {
        "seq_length": S,
        "repeats": opts.repeats,
        "a2a_heads": _heads(layouts["a2a"]),
        "steps": time_calibration_steps(model, layouts, opts),
    }


CALIBRATION_DOCUMENTS = 7  # equal documents of the packed steps (fewer when the sequence is short);
# 7: their boundaries fall inside the contiguous split's ranks for any ring but of 7 or 14 ranks


class CalibrationStep(NamedTuple):
    """One timed training step: the calibration layout (``a2a``: one A2A group of all ranks;
    ``p2p``: one group per rank), ``documents`` (lengths; one for the plain sequence), how they are
    ``split`` over the ranks (``SPLITS``) and the median step seconds of the slowest rank."""

    layout: str
    documents: tuple[int, ...]
    split: str
    step_s: float


SPLITS = ("zigzag", "contiguous")
"""``zigzag``: every document in ``2 W`` chunks, rank i holding chunks i and ``2W - 1 - i``
(Megatron's THD split; the plain ring for one document); ``contiguous``: rank i holds tokens
``[i S / W, (i + 1) S / W)`` whatever the documents (a HexiSeq-style position split)."""

CALIBRATION_STEPS = (
    ("a2a", "one", "contiguous"),
    ("a2a", "packed", "contiguous"),
    ("p2p", "one", "zigzag"),
    ("p2p", "packed", "zigzag"),
    ("p2p", "packed", "contiguous"),
)
"""The calibration's training steps: (layout, documents, split); ``one``: the plain sequence,
``packed``: :func:`calibration_documents`."""


def calibration_documents(seq_length: int, world: int) -> tuple[int, ...]:
    """``CALIBRATION_DOCUMENTS`` near-equal lengths summing to ``seq_length``, each at least
    ``2 x world`` tokens (a zig-zag chunk per rank and half)."""
    n = max(1, min(CALIBRATION_DOCUMENTS, seq_length // (2 * world)))
    return tuple(int(x) for x in np.diff([seq_length * i // n for i in range(n + 1)]))


def split_layout(layout: Layout, documents: Sequence[int], split: str) -> Layout:
    """``layout`` with its tokens split over its ranks as ``split`` says (``SPLITS``) for these
    document lengths (groups and heads unchanged)."""
    W, S = layout.world_size, layout.seq_length
    if split == "zigzag":
        segments = zigzag_docs(np.asarray(cu_from_lengths(documents)), list(range(W)), W)
    elif split == "contiguous":
        bounds = [S * i // W for i in range(W + 1)]
        segments = [[(bounds[i], bounds[i + 1])] for i in range(W)]
    else:
        raise ValueError(f"unknown split {split!r}; use one of {SPLITS}")
    return replace(
        layout, ranks=tuple(replace(r, segments=tuple(s)) for r, s in zip(layout.ranks, segments))
    )


def step_documents(which: str, seq_length: int, world: int) -> tuple[int, ...]:
    """The document lengths of a ``CALIBRATION_STEPS`` entry's ``one`` / ``packed``."""
    return (seq_length,) if which == "one" else calibration_documents(seq_length, world)


def time_calibration_steps(
    model: ModelSpec, layouts: dict[str, Layout], opts: ProfileOptions
) -> list[dict[str, Any]]:
    """Collective over the default group: the CPU driver's training step (``testbed.train``: the
    model with HexiSeq's attention, ``kernel="auto"``, Megatron DDP; packed documents with
    ``--reset-attention-mask``) for each of ``CALIBRATION_STEPS`` on ``layouts``
    (:func:`calibration_layouts`). Per step a ``CalibrationStep`` as a dict: the median over
    ``opts.repeats`` steps (after one warm-up) of the slowest rank's step time."""
    out = []
    for name, which, split in CALIBRATION_STEPS:
        base = layouts[name]
        S, W = base.seq_length, base.world_size
        documents = step_documents(which, S, W)
        cfg = TrainConfig(
            model=replace(model, seq_length=S),
            layout=split_layout(base, documents, split),
            steps=opts.repeats + 1,
            kernel="auto",
            bucket_size=None,
            documents=None if len(documents) == 1 else (documents,),
        )
        dist.barrier()
        times = torch.tensor(train_rank(dist.get_rank(), W, cfg).step_times_s[1:])
        dist.all_reduce(times, op=dist.ReduceOp.MAX)
        out.append(
            CalibrationStep(name, documents, split, statistics.median(times.tolist()))._asdict()
        )
    return out


def _heads(layout: Layout) -> list[int]:
    return [len(r.heads) for r in layout.ranks]


REFINEMENTS = 4  # grids of the latency fit (each 100x finer)


class StepPrediction(NamedTuple):
    """A calibration step's modelled iteration as a function of one latency x: the slowest linear
    phase plus the slowest rank's ``attention_s + steps x`` (per-rank arrays: the attention phase
    without that latency, and how many times the rank pays it)."""

    linear_s: float
    attention_s: np.ndarray
    steps: np.ndarray

    def at(self, x: np.ndarray) -> np.ndarray:
        """The iteration at each latency of ``x`` (seconds)."""
        return self.linear_s + (self.attention_s[None, :] + np.outer(x, self.steps)).max(axis=1)


def _least_relative_squares(curves: list[StepPrediction], measured: np.ndarray) -> float:
    """The latency x >= 0 minimising ``sum_i (curve_i(x) / measured_i - 1)^2``. Each curve is convex
    and piecewise linear in x, so the sum is searched on a grid of 201 points refined
    ``REFINEMENTS`` times around the best (to ~1e-9 of the first grid's span: 0 to the largest
    latency any one step could hold, its measured time over its fewest steps)."""
    hi = max(
        float(m) / max(1, int(c.steps[c.steps > 0].min(initial=1)))
        for c, m in zip(curves, measured)
    )
    lo, best = 0.0, 0.0
    for _ in range(REFINEMENTS):
        grid = np.linspace(lo, hi, 201)
        cost = sum(((c.at(grid) / m - 1.0) ** 2 for c, m in zip(curves, measured)), np.zeros(201))
        k = int(np.argmin(cost))
        best, step = float(grid[k]), (hi - lo) / 200
        lo, hi = max(0.0, best - step), best + step
    return best


LATENCY_FIELDS = {"a2a": "collective_latency_us", "p2p": "p2p_latency_us"}
"""The fixed cost each calibration layout's steps fit."""


def fit_latencies(
    spec: dict[str, Any], calibration: dict[str, Any], model: ModelSpec
) -> dict[str, Any]:
    """Set ``collective_latency_us`` and ``p2p_latency_us`` of every GPU type in ``spec`` (in place)
    from the timed calibration steps; returns the fit (per step: measured, modelled without the
    latency, its count, predicted with it) for the raw JSON.

    Per calibration layout, the latency x >= 0 minimising ``sum_i (p_i(x) / m_i - 1)^2`` over its
    steps i (module docstring): m_i measured, p_i(x) the iteration ``estimate_documents`` predicts
    with that latency x and the other fixed cost 0 (``StepPrediction``; neither layout has the
    other's communication). Counts per rank: ``a2a`` 2 passes x layers x 4 collectives (one group
    of all ranks); ``p2p`` 3 x layers x the rank's rounds (zig-zag: every rank the same; contiguous:
    rank i receives from the ranks before it that share a document)."""
    bare = cluster_from_dict(
        {
            **spec,
            "gpus": {
                k: {**v, "p2p_latency_us": 0.0, "collective_latency_us": 0.0}
                for k, v in spec["gpus"].items()
            },
        },
        source="profiled cluster spec",
    )
    hosts, gpus = [d.node for d in bare.devices], [d.gpu.name for d in bare.devices]
    S = calibration["seq_length"]
    layouts = calibration_layouts(
        bare.world_size, S, model.num_attention_heads, model.num_query_groups, hosts, gpus
    )
    full = replace(model, seq_length=S)
    options = TrainOptions()
    fit: dict[str, Any] = {}
    for name, field in LATENCY_FIELDS.items():
        rows, curves = [], []
        for step in calibration["steps"]:
            if step["layout"] != name:
                continue
            documents = tuple(step["documents"])
            lay = split_layout(layouts[name], documents, step["split"])
            e = estimate_documents(lay, bare, full, options, cu_from_lengths(documents))
            if name == "a2a":
                count = np.full(lay.world_size, 2 * model.num_layers * 4, dtype=np.int64)
            else:
                count = 3 * model.num_layers * e.rounds
            curve = StepPrediction(float(e.linear_s.max()), e.time_s - e.linear_s, count)
            curves.append(curve)
            rows.append(
                {
                    **step,
                    "modelled_without_latency_s": e.iteration_time_s,
                    "steps": int(count.max()),
                }
            )
        measured = np.array([r["step_s"] for r in rows])
        x = significant(_least_relative_squares(curves, measured) * 1e6) if rows else 0.0
        for r, curve in zip(rows, curves):
            r["predicted_s"] = float(curve.at(np.array([x * 1e-6]))[0])
        fit[name] = {"steps": rows, "latency_us": x}
        for entry in spec["gpus"].values():
            entry[field] = x
    return fit


CPU_CALIBRATION = CpuCalibration(
    model_step=measure_model_step,
    attention_flops=measure_runtime_attention_flops,
    attention_curve=measure_cpu_kernel_curve,
    can_time_fixed_costs=can_calibrate,
    fixed_costs=time_calibration_layouts,
    fit_latencies=fit_latencies,
)
