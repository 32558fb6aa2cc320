"""The canonical order of a cluster's nodes, so that plans do not depend on the order of the file.

Layout rank ``r`` runs on ``cluster.devices[r]``, numbered node by node in file order. The planner
and the baselines work on the *canonical* cluster instead: nodes sorted by their hardware (fastest
GPU type first, then faster network, NVLink, more memory, more GPUs) and by name among equals, so
nodes of one type sit next to each other (symmetric head-parallel groups that span nodes then pack
nodes of one type) and the same set of nodes in any file order gives the same canonical cluster.
``to_original`` maps a layout planned on the canonical cluster back to the file's rank numbering.
"""

from __future__ import annotations

from dataclasses import replace

from megatron_hexiseq.cluster import Cluster, Device, Node
from megatron_hexiseq.layout import Group, Layout, RankPlan


def hardware_key(node: Node, device: Device) -> tuple:
    """A node's hardware, fastest first (``device``: one of its devices): achieved matmul rate,
    attention rate, network, NVLink, memory, GPU type name. The canonical order's key before the
    GPU count and name; the job planner orders its kinds of node by it too."""
    return (
        -device.flops_per_s,
        -device.attention_flops_per_s,
        -node.network_GBps,
        -node.nvlink_GBps,
        -node.memory_gib,
        device.gpu.name,
    )


def _node_key(node: Node, first_device: int, cluster: Cluster) -> tuple:
    return (*hardware_key(node, cluster.devices[first_device]), -node.count, node.name)


def canonical_order(cluster: Cluster) -> list[int]:
    """``order[i]``: the file's device index of canonical device ``i``."""
    starts, k = [], 0
    for node in cluster.nodes:
        starts.append(k)
        k += node.count
    nodes = sorted(
        range(len(cluster.nodes)), key=lambda i: _node_key(cluster.nodes[i], starts[i], cluster)
    )
    return [starts[i] + j for i in nodes for j in range(cluster.nodes[i].count)]


def canonical_cluster(cluster: Cluster) -> tuple[Cluster, list[int]]:
    """The cluster with its nodes in canonical order, and ``order`` (canonical device -> file device).
    A cluster already in canonical order is returned as is."""
    order = canonical_order(cluster)
    if order == list(range(cluster.world_size)):
        return cluster, order
    starts, k = {}, 0
    for node in cluster.nodes:
        starts[node.name] = k
        k += node.count
    nodes = tuple(sorted(cluster.nodes, key=lambda n: _node_key(n, starts[n.name], cluster)))
    devices = tuple(replace(cluster.devices[f], index=i) for i, f in enumerate(order))
    return Cluster(name=cluster.name, nodes=nodes, devices=devices), order


def to_original(layout: Layout, order: list[int]) -> Layout:
    """A layout of the canonical cluster renumbered for the file's cluster: canonical rank ``i``
    becomes rank ``order[i]``; groups keep their ids and order (the sub-ring order), segments and
    heads move with their rank."""
    if order == list(range(layout.world_size)):
        return layout
    ranks = sorted(
        (
            RankPlan(
                rank=order[r.rank],
                host=r.host,
                gpu=r.gpu,
                group=r.group,
                segments=r.segments,
                heads=r.heads,
            )
            for r in layout.ranks
        ),
        key=lambda r: r.rank,
    )
    groups = tuple(
        Group(id=g.id, ranks=tuple(sorted(order[r] for r in g.ranks))) for g in layout.groups
    )
    return Layout(
        seq_length=layout.seq_length,
        num_attention_heads=layout.num_attention_heads,
        num_query_groups=layout.num_query_groups,
        world_size=layout.world_size,
        groups=groups,
        ranks=tuple(ranks),
        predicted=layout.predicted,
        baselines=layout.baselines,
        planner=layout.planner,
        meta=layout.meta,
    )
