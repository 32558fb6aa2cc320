"""``run_profile``: measure every rank at once and assemble a cluster spec whose numbers are measured.

Runs on an initialised default process group (torchrun, or the CPU testbed's spawned ranks).
All ranks measure compute *at the same time*, so ranks that share a core (the CPU testbed) or a
power/thermal budget see the speed they will see in training. Measurements
(:mod:`megatron_hexiseq.profile.measure`):

- compute: without a model, a square matmul; with a model, the cost model is calibrated for it: on
  GPU the throughput of that model's own layer (linear layers + norms + activation); on CPU, when
  a :class:`CpuCalibration` is given, a whole training step of the model without attention at
  three token counts, fitted as a FLOP rate plus a fixed ``step_overhead_ms``;
- causal attention forward+backward throughput (the model's head shape when a model is given; on
  CPU with a calibration, HexiSeq's own attention instead of PyTorch SDPA);
- on GPUs, every attention kernel that runs there (flash, efficient, cudnn) at several square block
  sizes, causal and full (:func:`megatron_hexiseq.profile.kernels.measure_kernel_rates`): the
  spec's GPU type then carries ``achieved_tflops`` (matmul and each kernel's long-block rate),
  ``attention_curves`` and ``compute_capability``, which the cost model prices instead of the
  catalog's figures (and no flat ``attention_tflops``);
- on CPU with a calibration that has one, the runtime's ``cpu-flash`` document windows at several
  sizes, causal and full: the type keeps its flat ``attention_tflops`` (the long-block rate) and
  gets ``cpu-flash`` ``attention_curves`` (the mean over the node's ranks), so each call is priced
  at its size as on GPUs;
- bandwidth of every pair of ranks (one pair at a time, ping-pong of ``message_bytes``) and the
  all-to-all bandwidth of all ranks together;
- on CPU with a calibration, a model and more than one rank: the fixed cost of each head
  all-to-all and each K/V exchange step (``collective_latency_us``, ``p2p_latency_us``); on GPU
  these fixed costs stay 0 (NCCL latency and Megatron's overlapped gradient reduction are below
  the model's resolution; set them in the spec by hand if you measured them);
- memory capacity (GPU: free memory; CPU: the configured budget).

The CPU calibration drives the CPU training driver, which belongs to the testbed; the library
does not import the testbed, so the caller passes it in (``megatron-hexiseq profile`` passes
:data:`megatron_hexiseq.testbed.calibrate.CPU_CALIBRATION` on CPU).

Output: a cluster spec dict in the format of :mod:`megatron_hexiseq.cluster` (one custom GPU
type per node, efficiency 1.0 because the throughput *is* the measurement) and a raw dict of
every number measured.
"""

from __future__ import annotations

import socket
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from megatron_hexiseq.model import ModelSpec
from megatron_hexiseq.profile.kernels import measure_kernel_rates, rates_to_spec
from megatron_hexiseq.profile.measure import (
    ProfileOptions,
    device_name,
    measure_alltoall_bandwidth,
    measure_attention_flops,
    measure_layer_flops,
    measure_matmul_flops,
    measure_pair_bandwidth,
    memory_gib,
    model_attention_seq,
    significant,
)


@dataclass(frozen=True, kw_only=True)
class CpuCalibration:
    """The measurements of a CPU rank that need the CPU training driver, as callables.

    ``model_step(model, tokens, opts)``: a training step without attention as
    ``{"flops_per_s", "step_overhead_s", "points"}`` (and ``micro_batch_overhead_s`` when
    measured); ``attention_flops(model, tokens, opts)``: FLOP/s of the runtime's own attention; ``can_time_fixed_costs(model, world)``: whether the world and
    sequence are large enough to fit fixed costs; ``fixed_costs(model, opts)``: the timed
    calibration calls; ``fit_latencies(spec, calls, model)``:
    sets the spec's latencies from those calls (in place) and returns the fit;
    ``attention_curve(model, tokens, opts)`` (optional): the runtime's CPU kernel at several window
    sizes, rows as ``kernels.measure_kernel_rates`` returns them (the spec's ``attention_curves``).
    All but ``fit_latencies`` are collective over the default group.
    """

    model_step: Callable[[ModelSpec, int, ProfileOptions], dict[str, Any]]
    attention_flops: Callable[[ModelSpec, int, ProfileOptions], float]
    can_time_fixed_costs: Callable[[ModelSpec, int], bool]
    fixed_costs: Callable[[ModelSpec, ProfileOptions], dict[str, Any]]
    fit_latencies: Callable[[dict[str, Any], dict[str, Any], ModelSpec], dict[str, Any]]
    attention_curve: Callable[[ModelSpec, int, ProfileOptions], list[dict[str, Any]]] | None = None


def run_profile(
    opts: ProfileOptions = ProfileOptions(),
    progress: Callable[[str], None] | None = None,
    *,
    cpu_calibration: CpuCalibration | None = None,
) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """Measure all ranks; rank 0 returns ``(cluster_spec_dict, raw_dict)``, other ranks None.

    ``cpu_calibration`` is used only on CPU with ``opts.model``; without it a CPU rank is measured
    like a GPU (the model's layer and PyTorch SDPA, no fixed costs).
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    device = (
        torch.device("cuda", torch.cuda.current_device())
        if torch.cuda.is_available()
        else torch.device("cpu")
    )
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    say = progress if (progress and rank == 0) else (lambda _msg: None)
    node = opts.node_names[rank] if opts.node_names else socket.gethostname()
    model = opts.model
    calibrate = cpu_calibration if (model is not None and device.type == "cpu") else None

    fixed: dict[str, Any] = {}  # step overhead and fixed-cost calls (CPU with a calibration)
    say("matmul throughput (all ranks at once)")
    dist.barrier()
    if model is None:
        mm = measure_matmul_flops(device, dtype, opts)
    elif calibrate is not None:  # calibrate with the very model the CPU driver trains
        step = calibrate.model_step(model, -(-model.seq_length // world), opts)
        mm, fixed["step_overhead_s"], fixed["model_step"] = (
            step["flops_per_s"],
            step["step_overhead_s"],
            step["points"],
        )
        if "micro_batch_overhead_s" in step:
            fixed["micro_batch_overhead_s"] = step["micro_batch_overhead_s"]
    else:
        mm = measure_layer_flops(model, device, dtype, opts)
    say("attention throughput (all ranks at once)")
    dist.barrier()
    if calibrate is not None and model is not None:  # a calibration comes only with a model
        attn = calibrate.attention_flops(model, model_attention_seq(model), opts)
    else:
        attn = measure_attention_flops(device, dtype, opts)
    kernel_rows: list[dict[str, Any]] = []
    capability = None
    cpu_rows: list[dict[str, Any]] = []
    if calibrate is not None and model is not None and calibrate.attention_curve is not None:
        say("attention kernel calls at several window sizes (all ranks at once)")
        dist.barrier()
        cpu_rows = calibrate.attention_curve(model, model_attention_seq(model), opts)
    if device.type == "cuda":
        say("attention kernels at several block sizes (all ranks at once)")
        dist.barrier()
        heads, head_dim = (
            (model.num_attention_heads, model.kv_channels)
            if model is not None
            else (opts.attention_heads, opts.head_dim)
        )
        kernel_rows = measure_kernel_rates(dtype, heads, head_dim, opts.kernel_sizes)
        major, minor = torch.cuda.get_device_capability(device)
        capability = major + minor / 10
    pair_bw: dict[str, float] = {}
    for a in range(world):
        for b in range(a + 1, world):
            say(f"bandwidth {a}<->{b}")
            dist.barrier()
            bw = measure_pair_bandwidth(a, b, device, opts)
            if rank == a:
                assert bw is not None  # rank a is one end of the pair, so it measured
                pair_bw[f"{a}-{b}"] = bw
    say("all-to-all bandwidth")
    a2a = measure_alltoall_bandwidth(device, opts) if world > 1 else None
    if (
        calibrate is not None and model is not None and calibrate.can_time_fixed_costs(model, world)
    ):  # else the latencies stay 0
        say("collective and K/V-step latency inside the attention runtime")
        fixed["calibration"] = calibrate.fixed_costs(model, opts)
    mine = {
        "rank": rank,
        "node": node,
        "device": device_name(device),
        "dtype": str(dtype).replace("torch.", ""),
        "matmul_flops": mm,
        "attention_flops": attn,
        "alltoall_Bps": a2a,
        "pair_Bps": pair_bw,
        "memory_gib": memory_gib(device, opts),
        "kernel_rates": kernel_rows,
        "cpu_kernel_rates": cpu_rows,
        "compute_capability": capability,
        **fixed,
    }
    everyone: list[dict[str, Any]] = [None] * world  # type: ignore[list-item]
    dist.all_gather_object(everyone, mine)
    if rank != 0:
        return None
    raw = {
        "ranks": everyone,
        "world_size": world,
        "options": opts.__dict__
        | {
            "node_names": list(opts.node_names or []),
            "model": model.to_dict() if model is not None else None,
        },
    }
    spec = cluster_spec_from_measurements(everyone)
    if opts.shared_cores and any(entry["count"] > 1 for entry in spec["nodes"]):
        # some core runs several ranks: every node is a core, so that the fit and the cost model
        # charge fixed costs by contention (a rank alone on its core is served at once)
        for entry in spec["nodes"]:
            entry["shared_core"] = True
    if calibrate is not None and model is not None and "calibration" in everyone[0]:
        raw["latency_fit"] = calibrate.fit_latencies(spec, everyone[0]["calibration"], model)
    return spec, raw


def cluster_spec_from_measurements(
    per_rank: list[dict[str, Any]], name: str = "profiled"
) -> dict[str, Any]:
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
            raise ValueError(
                f"rank {r['rank']} on node {r['node']} is not next to the other ranks of that node"
            )
        if not order or r["node"] != order[-1]:
            order.append(r["node"])
    gpus: dict[str, dict[str, Any]] = {}
    nodes = []
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
            "bf16_tflops": significant(statistics.mean(r["matmul_flops"] for r in members) / 1e12),
            "attention_tflops": significant(
                statistics.mean(r["attention_flops"] for r in members) / 1e12
            ),
            "memory_gib": significant(min(r["memory_gib"] for r in members)),
            "nvlink_GBps": significant(intra / 1e9),
            "efficiency": 1.0,
        }
        if all(r.get("kernel_rates") for r in members):  # a GPU: per-kernel rates and curves
            _add_kernel_rates(gpus[type_name], members)
        elif all(r.get("cpu_kernel_rates") for r in members):  # CPU: the flat rate's curves
            gpus[type_name]["attention_curves"] = _mean_curves(
                [r["cpu_kernel_rates"] for r in members]
            )
        if all("step_overhead_s" in r for r in members):
            gpus[type_name]["step_overhead_ms"] = significant(
                statistics.mean(r["step_overhead_s"] for r in members) * 1e3
            )
        if all("micro_batch_overhead_s" in r for r in members):
            gpus[type_name]["micro_batch_overhead_ms"] = significant(
                statistics.mean(r["micro_batch_overhead_s"] for r in members) * 1e3
            )
        nodes.append(
            {
                "name": node,
                "gpu": type_name,
                "count": len(members),
                "nvlink_GBps": significant(intra / 1e9),
                "network_GBps": significant(inter / 1e9),
            }
        )
    return {"name": name, "gpus": gpus, "nodes": nodes}


def _mean_curves(per_rank: list[list[dict[str, Any]]]) -> dict[str, list[list[float]]]:
    """``attention_curves`` of a node's ranks (``rates_to_spec`` of each): the mean fraction at
    every point (the ranks of a node measure the same sizes)."""
    curves: list[dict[str, list[list[float]]]] = [
        rates_to_spec(rows)["attention_curves"] for rows in per_rank
    ]
    out: dict[str, list[list[float]]] = {}
    for key, points in curves[0].items():
        out[key] = [
            [x, round(statistics.mean(c[key][i][1] for c in curves), 4)]
            for i, (x, _) in enumerate(points)
        ]
    return out


def _add_kernel_rates(gpu: dict[str, Any], members: list[dict[str, Any]]) -> None:
    """Put the node's measured kernel rates into its GPU type (in place): ``achieved_tflops`` (the
    mean over the node's ranks of each kernel's long-block rate, and the matmul rate in the
    training dtype), ``attention_curves`` (the first rank's) and ``compute_capability``; the flat
    ``attention_tflops`` is dropped so the per-kernel figures apply."""
    specs = [rates_to_spec(r["kernel_rates"]) for r in members]
    keys = set.intersection(*(set(s["achieved_tflops"]) for s in specs))
    dtype = "bf16" if members[0]["dtype"] == "bfloat16" else "fp16"
    gpu["achieved_tflops"] = {
        k: significant(statistics.mean(s["achieved_tflops"][k] for s in specs))
        for k in sorted(keys)
    } | {f"matmul/{dtype}": gpu["bf16_tflops"]}
    gpu["attention_curves"] = specs[0]["attention_curves"]
    if members[0].get("compute_capability") is not None:
        gpu["compute_capability"] = members[0]["compute_capability"]
    gpu.pop("attention_tflops", None)
