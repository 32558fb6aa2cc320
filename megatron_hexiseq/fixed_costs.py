"""Fixed costs of the attention runtime's communication, measured in place by ``profile``.

Bandwidth alone under-predicts the CPU testbed badly (issue #6: -19% to -40%): a head all-to-all
or a K/V exchange step between ranks that share a core costs milliseconds of scheduling (one rank
must be switched out for its neighbour to send), whatever the bytes. ``profile`` therefore times
HexiSeq's own attention (``kernel="auto"``, the model's head shape; up to 4 calls forward, then
their backwards, as a model's layers run; seconds per call) on every rank at once, in two layouts
of all ranks:

- ``a2a``: one A2A group of all ranks (contiguous, even token split): pure
  head parallelism, 4 all-to-alls forward and 4 backward (heads equal among the ranks of a node;
  the same per-rank work is also timed alone, without communication, as the reference);
- ``p2p``: one group per rank, zig-zag segments: pure sub-ring, (n - 1) rounds forward, and
  backward K/V again plus dK/dV back.

``fit_latencies`` then asks the cost model what the same calls cost *without* fixed costs (the
measured compute rates and bandwidths of the profiled spec, a one-layer copy of the model) and
divides the difference by the number of collectives / exchange steps, giving
``collective_latency_us`` and ``p2p_latency_us`` for the spec's GPU types: measured minus modelled,
no constant set by hand. The same value goes to every type (the calls involve every rank; the
fit has two numbers for two layouts). Negative differences (the model already over-predicts)
give 0. docs/cost_model.md, "Fixed costs", has the formulas; docs/testbed.md the figures.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist

from megatron_hexiseq.layout import Layout, make_layout, split_evenly, zigzag_segments
from megatron_hexiseq.profiler import _sig

CALIBRATION_SEQ = 2048  # longest sequence the calibration runs (the CPU profile's attention cap)
CALIBRATION_LAYERS = 4  # attention calls per timed repetition (forward all, then backward all)


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


def calibration_layouts(world: int, seq_length: int, num_heads: int, num_query_groups: int,
                        hosts: list[str] | None = None, gpus: list[str] | None = None) -> dict[str, Layout]:
    """The two layouts of all ``world`` ranks the fit uses: ``a2a`` (one group; heads by
    :func:`calibration_heads` over ``hosts``) and ``p2p`` (a ring)."""
    sizes = split_evenly(seq_length, world)
    starts = [sum(sizes[:r]) for r in range(world)]
    per_head = calibration_heads(num_heads, list(hosts) if hosts else [str(r) for r in range(world)])
    first = [sum(per_head[:r]) for r in range(world)]
    common = dict(seq_length=seq_length, num_attention_heads=num_heads, num_query_groups=num_query_groups,
                  hosts=hosts, gpus=gpus)
    a2a = make_layout(group_sizes=[world], segments=[[(s, s + n)] for s, n in zip(starts, sizes)],
                      heads=[list(range(f, f + h)) for f, h in zip(first, per_head)], **common)
    p2p = make_layout(group_sizes=[1] * world, segments=zigzag_segments(seq_length, world),
                      heads=[list(range(num_heads))] * world, **common)
    return {"a2a": a2a, "p2p": p2p}


def can_calibrate(model: Any, world: int) -> bool:
    """The zig-zag ring needs two chunks of at least one token per rank."""
    return world > 1 and min(model.seq_length, CALIBRATION_SEQ) >= 2 * world


def time_calibration_layouts(model: Any, opts: Any) -> dict[str, Any]:
    """Collective over the default group: seconds per attention call (forward + backward, slowest
    rank, median of ``opts.repeats``) of each calibration layout. Same dict on every rank.
    Requires :func:`can_calibrate`."""
    from megatron_hexiseq.attention.groups import build_hexiseq_groups
    from megatron_hexiseq.attention.hexiseq import hexiseq_attn_func

    world, me = dist.get_world_size(), dist.get_rank()
    S = min(model.seq_length, CALIBRATION_SEQ) // (2 * world) * (2 * world)  # zig-zag: 2 chunks per rank
    H, G, d = model.num_attention_heads, model.num_query_groups, model.kv_channels
    nodes = list(opts.node_names) if opts.node_names else [str(r) for r in range(world)]
    layouts = calibration_layouts(world, S, H, G, hosts=nodes)
    # the a2a layout's compute alone: each rank its own heads over the whole sequence, no communication
    # more ranks than heads: a head-less rank still times one head (its compute reference is a
    # little high, so the fitted latency a little low)
    heads_r = max(1, len(layouts["a2a"].ranks[me].heads))
    alone = make_layout(seq_length=S, num_attention_heads=heads_r, num_query_groups=1, group_sizes=[1],
                        segments=[[(0, S)]], heads=[list(range(heads_r))])
    layers = max(1, min(model.num_layers, CALIBRATION_LAYERS))
    out: dict[str, Any] = {"seq_length": S, "repeats": opts.repeats, "layers": layers,
                           "a2a_heads": _heads(layouts["a2a"])}
    for name, layout, domains, g in (("a2a", layouts["a2a"], [list(range(world))], G),
                                     ("a2a_compute", alone, [[r] for r in range(world)], 1),
                                     ("p2p", layouts["p2p"], [list(range(world))], G)):
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
            sum(hexiseq_attn_func(q, k, v, groups=groups, kernel="auto").sum() for _ in range(layers)).backward()
            elapsed = torch.tensor([(time.perf_counter() - start) / layers], dtype=torch.float64)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
            if i:
                times.append(float(elapsed))
        out[f"{name}_call_s"] = statistics.median(times)
    return out


def _heads(layout: Layout) -> list[int]:
    return [len(r.heads) for r in layout.ranks]


def fit_latencies(spec: dict[str, Any], calibration: dict[str, Any], model: Any) -> dict[str, Any]:
    """Set ``collective_latency_us`` and ``p2p_latency_us`` of every GPU type in ``spec`` (in place)
    from the timed calibration calls; returns the fit (measured, modelled, counts) for the raw JSON."""
    from megatron_hexiseq.cluster import cluster_from_dict
    from megatron_hexiseq.costmodel import TrainOptions, estimate
    from megatron_hexiseq.costmodel.exchange import kv_exchange_forward
    from megatron_hexiseq.planner.build import hosts_and_gpus

    cluster = cluster_from_dict(spec, source="profiled cluster spec")
    S = calibration["seq_length"]
    one_layer = replace(model, num_layers=1, seq_length=S)
    options = TrainOptions()
    hosts, gpus = hosts_and_gpus(cluster)
    layouts = calibration_layouts(cluster.world_size, S, model.num_attention_heads, model.num_query_groups,
                                  hosts, gpus)
    passes = 1 + 1  # forward + backward (no recompute in the calibration call)
    counts = {"a2a": passes * 4,  # q, k, v in and the output back, per pass
              "p2p": (passes + 1) * max(kv_exchange_forward(layouts["p2p"], cluster, one_layer, 1).rounds)}
    fit: dict[str, Any] = {}
    for name, layout in layouts.items():
        est = estimate(layout, cluster, one_layer, options)
        measured = calibration[f"{name}_call_s"]
        if name == "a2a":  # measured compute (same work, no communication) + modelled bytes
            modelled = calibration["a2a_compute_call_s"] + max(r.breakdown["a2a_s"] for r in est.per_rank)
        else:  # modelled compute and exposed transfer (a zig-zag ring: equal work on every rank)
            modelled = max(r.time_s - r.breakdown["linear_s"] for r in est.per_rank)
        per_step = max(0.0, measured - modelled) / counts[name] if counts[name] else 0.0
        fit[name] = {"measured_s": measured, "modelled_without_fixed_s": modelled, "steps": counts[name],
                     "latency_us": _sig(per_step * 1e6)}
    for entry in spec["gpus"].values():
        entry["collective_latency_us"] = fit["a2a"]["latency_us"]
        entry["p2p_latency_us"] = fit["p2p"]["latency_us"]
    return fit

