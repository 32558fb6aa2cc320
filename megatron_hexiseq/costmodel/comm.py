"""Communication time: ragged all-to-all and overlapped P2P rounds.

Link model (documented in docs/cost_model.md): every device has two independent, full-duplex
ports, NVLink (to its own node) and network (to other nodes). Messages through one port in one
direction are serialised; each message moves at ``cluster.link_GBps(src, dst)`` (the slower
endpoint's port). The two ports and the two directions run at the same time. Latency is ignored
(messages here are megabytes). GB/s = 1e9 bytes/s.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from megatron_hexiseq.cluster import Cluster


def port_times_s(
    messages: Sequence[tuple[int, int, int]], cluster: Cluster
) -> tuple[dict[int, float], dict[int, float]]:
    """Send and receive busy time per device for ``messages`` ``(src, dst, bytes)`` sent together.

    A device's send time is the larger of its serialised NVLink sends and its serialised network
    sends; receive time likewise. Self-messages (src == dst) are local copies and cost nothing.
    Returns ``(send_s, recv_s)`` keyed by device index (only devices that appear).
    """
    send: dict[int, list[float]] = {}  # device -> [nvlink_s, network_s]
    recv: dict[int, list[float]] = {}
    for src, dst, nbytes in messages:
        if src == dst or nbytes == 0:
            continue
        seconds = nbytes / (cluster.link_GBps(src, dst) * 1e9)
        port = 0 if cluster.same_node(src, dst) else 1
        send.setdefault(src, [0.0, 0.0])[port] += seconds
        recv.setdefault(dst, [0.0, 0.0])[port] += seconds
    return {k: max(v) for k, v in send.items()}, {k: max(v) for k, v in recv.items()}


def alltoall_rank_times_s(
    send_bytes: Sequence[Sequence[int]], ranks: Sequence[int], cluster: Cluster
) -> list[float]:
    """Per-participant busy time of a ragged all-to-all: ``max(send_s, recv_s)`` of each device.

    ``send_bytes[i][j]``: bytes from device ``ranks[i]`` to device ``ranks[j]``. Same port model
    as :func:`port_times_s`, vectorised (an all-to-all over thousands of ranks stays fast).
    """
    n = len(ranks)
    if n == 0:
        return []
    nbytes = np.asarray(send_bytes, dtype=np.float64).reshape(n, n)
    return rank_times_from_links(nbytes, *group_links(cluster, ranks)).tolist()


def rank_times_from_links(nbytes: np.ndarray, same: np.ndarray, link_Bps: np.ndarray) -> np.ndarray:
    """Per-participant busy time of a ragged all-to-all of ``nbytes[i, j]`` (float64 bytes) given
    its members' ``group_links``."""
    seconds = nbytes / link_Bps
    np.fill_diagonal(seconds, 0.0)  # a rank's share for itself is a local copy
    send = np.maximum(np.where(same, seconds, 0).sum(1), np.where(same, 0, seconds).sum(1))
    recv = np.maximum(np.where(same, seconds, 0).sum(0), np.where(same, 0, seconds).sum(0))
    return np.maximum(send, recv)


class ClusterArrays:
    """Per-device arrays of one cluster that the cost model reads on every call: node number (by
    sorted node name), NVLink and network bytes/s, attention FLOP/s; plus each member tuple's
    link matrices (``group_links``), computed once per tuple, and ``memo``: other tables per cluster."""

    def __init__(self, cluster: Cluster) -> None:
        devs = cluster.devices
        names = sorted({d.node for d in devs})
        node_id = {name: i for i, name in enumerate(names)}
        self.node = np.array([node_id[d.node] for d in devs])
        self.nv = np.array([d.nvlink_GBps for d in devs]) * 1e9
        self.net = np.array([d.network_GBps for d in devs]) * 1e9
        self.rate = np.array([d.attention_flops_per_s for d in devs])
        self.links: dict[tuple[int, ...], tuple[np.ndarray, np.ndarray]] = {}
        self.memo: dict[str, Any] = {}  # other per-cluster tables, by the name of what they hold


_ARRAYS: dict[
    int, tuple[Cluster, ClusterArrays]
] = {}  # id -> (the cluster, kept alive: ids stay unique)
_ARRAYS_MAX = 8
_LINKS_CACHED_MAX = 256  # larger groups' [n, n] matrices are rebuilt per call rather than kept


def cluster_arrays(cluster: Cluster) -> ClusterArrays:
    """The cluster's ``ClusterArrays`` (a few recent clusters are kept; clusters are frozen)."""
    got = _ARRAYS.get(id(cluster))
    if got is not None and got[0] is cluster:
        return got[1]
    if len(_ARRAYS) >= _ARRAYS_MAX:
        _ARRAYS.pop(next(iter(_ARRAYS)))
    arrays = ClusterArrays(cluster)
    _ARRAYS[id(cluster)] = (cluster, arrays)
    return arrays


def group_links(cluster: Cluster, ranks: Sequence[int]) -> tuple[np.ndarray, np.ndarray]:
    """(same node [n, n] bool, link bytes/s [n, n]) of the devices ``ranks``: the slower endpoint's
    NVLink inside a node, its network port between nodes."""
    arrays = cluster_arrays(cluster)
    key = tuple(ranks)
    got = arrays.links.get(key)
    if got is None:
        idx = np.array(key)
        node, nv, net = arrays.node[idx], arrays.nv[idx], arrays.net[idx]
        same = node[:, None] == node[None, :]
        got = (
            same,
            np.where(
                same, np.minimum(nv[:, None], nv[None, :]), np.minimum(net[:, None], net[None, :])
            ),
        )
        if len(key) <= _LINKS_CACHED_MAX:
            arrays.links[key] = got
    return got


def alltoall_time_s(
    send_bytes: Sequence[Sequence[int]], ranks: Sequence[int], cluster: Cluster
) -> float:
    """Time of a ragged all-to-all among cluster devices ``ranks``: the slowest participant.

    ``send_bytes[i][j]`` is sent from ``ranks[i]`` to ``ranks[j]``. Each device serialises its
    sends per port and its receives per port (see module docstring); the collective ends when the
    busiest device is done, and every participant waits for it.
    """
    return max(alltoall_rank_times_s(send_bytes, ranks, cluster), default=0.0)


def pipelined_exposed_s(compute_s: Sequence[float], comm_s: Sequence[float]) -> float:
    """Communication time left exposed by a double-buffered prefetch pipeline over blocks.

    Block ``k`` needs transfer ``comm_s[k]`` before computing ``compute_s[k]``. Block 0 is local
    (``comm_s[0]`` is ignored, it uses no receive buffer); blocks 1, 2, 3, ... alternate between
    two receive buffers. Transfers run one after another on a comm stream; transfer ``k`` also
    waits until its buffer is free (the compute of block ``k-2`` ended, for ``k >= 3``); compute
    ``k`` starts when compute ``k-1`` and transfer ``k`` are done::

        comm_end[k] = max(comm_end[k-1], comp_end[k-2] if k >= 3 else 0) + comm[k]
        comp_end[k] = max(comp_end[k-1], comm_end[k]) + compute[k]

    Returns ``comp_end[last] - sum(compute)``: 0 when every transfer hides behind the compute
    before it, ``sum_k max(0, comm[k] - compute[k-1])`` when every transfer is longer.
    """
    if not compute_s:
        return 0.0
    comm_end, comp_end = 0.0, compute_s[0]
    buffer_free = [0.0, 0.0]  # when each receive buffer can be overwritten
    for k in range(1, len(compute_s)):
        comm_end = max(comm_end, buffer_free[k % 2]) + comm_s[k]
        comp_end = max(comp_end, comm_end) + compute_s[k]
        buffer_free[k % 2] = comp_end
    return max(0.0, comp_end - sum(compute_s))
