"""Core contention: fixed communication costs on devices that share one compute core.

On the CPU testbed the ranks of a node share one core (``Node.shared_core``). A head all-to-all or
a K/V exchange step then costs a rank milliseconds of scheduling whatever the bytes (its peer must be
switched in to send), but only while a sibling on the core has work to be switched out of: a rank
whose siblings are idle, or a rank alone on its core, is served at once. So the fixed costs
``profile`` fits (``collective_latency_us``, ``p2p_latency_us``; measured with every rank busy)
are scaled per rank by

    f_r = (busiest sibling's busy time) / (the step's time),

both without fixed costs (busy = linear work + attention + transfer time; the step: the slowest
linear phase plus the slowest attention phase, the bulk-synchronous iteration). f_r is 0 for a rank
alone on its core and about 1 for a rank whose sibling is as busy as the slowest rank. Devices on
nodes that do not share a core (GPUs) keep their fixed costs as they are. docs/cost_model.md,
"Fixed costs".
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from megatron_hexiseq.cluster import Cluster
from megatron_hexiseq.costmodel.comm import cluster_arrays


def shared_core_members(cluster: Cluster) -> tuple[np.ndarray, ...]:
    """The device indices of each ``shared_core`` node (empty when no node shares a core)."""
    memo = cluster_arrays(cluster).memo
    if "shared_core_members" not in memo:
        members: dict[str, list[int]] = {}
        for d in cluster.devices:
            if d.shared_core:
                members.setdefault(d.node, []).append(d.index)
        memo["shared_core_members"] = tuple(np.array(m) for m in members.values())
    return memo["shared_core_members"]


def contention_scale(
    cluster: Cluster, linear_s: np.ndarray, attention_phase_s: np.ndarray
) -> np.ndarray:
    """Per device, the factor on its fixed communication costs (module docstring), from each rank's
    linear time and attention-phase time without fixed costs: 1 off ``shared_core`` nodes.
    Callers skip it when :func:`shared_core_members` is empty, so that their figures stay bit for
    bit as without it."""
    nodes = shared_core_members(cluster)
    busy = linear_s + attention_phase_s
    step = float(linear_s.max()) + float(attention_phase_s.max())
    scale = np.ones(linear_s.size)
    for members in nodes:
        if members.size == 1:
            scale[members] = 0.0
            continue
        b = busy[members]
        top = int(np.argmax(b))
        second = float(np.max(np.delete(b, top)))
        sibling = np.full(members.size, float(b[top]))
        sibling[top] = second
        scale[members] = np.minimum(1.0, sibling / step) if step > 0 else 0.0
    return scale


class ScaledFixedCosts(NamedTuple):
    """Per rank, the head all-to-all time (bytes and scaled collective latencies) and the scaled
    K/V-step latencies."""

    a2a_s: np.ndarray
    kv_latency_s: np.ndarray


def scale_fixed_costs(
    cluster: Cluster,
    linear_s: np.ndarray,
    busy_s: np.ndarray,
    a2a_s: np.ndarray,
    a2a_fixed_s: np.ndarray,
    kv_latency_s: np.ndarray,
) -> ScaledFixedCosts:
    """The fixed costs of ``estimate`` and ``estimate_documents`` under core contention: ``a2a_s``
    holds ``a2a_fixed_s`` of collective latencies, which are scaled by :func:`contention_scale`
    as ``kv_latency_s`` is; ``busy_s``: each rank's attention phase without fixed costs. Only for
    clusters with :func:`shared_core_members` (callers skip it otherwise)."""
    scale = contention_scale(cluster, linear_s, busy_s)
    return ScaledFixedCosts(a2a_s - a2a_fixed_s + a2a_fixed_s * scale, kv_latency_s * scale)
