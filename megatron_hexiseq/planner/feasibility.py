"""Can a memory mode fit at all, and the one-line message when none does.

The modes, their flags and the automatic order are in ``megatron_hexiseq.run_config``; these two
checks need the cost model's byte formulas, so they live above ``costmodel``. ``may_fit`` skips a
mode whose free memory cannot even hold the activations; ``explain_infeasible`` says which GPU
type runs out of memory, by how much, and what would help.
"""

from __future__ import annotations

from megatron_hexiseq import costmodel
from megatron_hexiseq.cluster import Cluster
from megatron_hexiseq.model import ModelSpec
from megatron_hexiseq.run_config import TrainOptions, mode_label


def may_fit(cluster: Cluster, model: ModelSpec, seq_length: int, options: TrainOptions) -> bool:
    """Necessary condition: the devices' free memory (after static) holds every token's activations."""
    static = costmodel.static_memory_bytes(model, options, options.shard_ranks(cluster.world_size))
    act = options.micro_batch_size * costmodel.activation_bytes_per_token(model, options)
    free = sum(
        max(0.0, options.capacity_fraction * d.memory_bytes - static) for d in cluster.devices
    )
    return free >= seq_length * act


def explain_infeasible(
    cluster: Cluster, model: ModelSpec, seq_length: int, tried: list[TrainOptions]
) -> str:
    """One line: which GPU type runs out of memory, by how much, and what would help."""
    opts = tried[-1]  # the most memory-frugal mode tried
    W = cluster.world_size
    static = costmodel.static_memory_bytes(model, opts, opts.shard_ranks(W))
    act = max(1, costmodel.activation_bytes_per_token(model, opts))
    usable = [opts.capacity_fraction * d.memory_bytes for d in cluster.devices]
    free = [max(0.0, u - static) for u in usable]
    gib = 2.0**30
    modes = ", ".join(mode_label(o) for o in tried)
    helps = ["more GPUs"]
    if not any(o.recompute for o in tried):
        helps.append("--recompute")
    if not any(o.memory_mode == "fsdp" for o in tried):
        helps.append("--memory-mode fsdp")
    helps.append("a shorter --seq-length")
    worst: tuple[float, str, float] = (0.0, "", 0.0)
    if any(f == 0 for f in free):
        helps = [
            h for h in helps if h in ("more GPUs", "--memory-mode fsdp")
        ]  # tokens are not the problem
        for d, u in zip(cluster.devices, usable):
            short = static - u
            if short > worst[0]:
                worst = (short, d.gpu.name, u)
        if worst[1]:
            return (
                f"{model.name} does not fit ({modes}): each {worst[1]} needs {static / gib:.1f} GiB for parameters, "
                f"gradients and optimizer states before any tokens but has {worst[2] / gib:.1f} GiB usable "
                f"({opts.capacity_fraction:.0%} of capacity), short by {worst[0] / gib:.1f} GiB; try {', '.join(helps)}"
            )
    total_free = sum(free)
    for d, u, f in zip(cluster.devices, usable, free):
        need = static + seq_length * act * (f / total_free if total_free else 1 / W)
        if need - u > worst[0]:
            worst = (need - u, d.gpu.name, u)
    if worst[1]:
        return (
            f"seq_length {seq_length} does not fit in memory under any layout ({modes}): even with tokens spread by "
            f"free memory each {worst[1]} needs {(worst[0] + worst[2]) / gib:.1f} GiB but has {worst[2] / gib:.1f} GiB "
            f"usable ({opts.capacity_fraction:.0%} of capacity), short by {worst[0] / gib:.1f} GiB; try {', '.join(helps)}"
        )
    return (
        f"seq_length {seq_length} does not fit in memory under any layout ({modes}): the attention working set "
        f"and buffers exceed capacity on some GPUs; try {', '.join(helps)}"
    )
