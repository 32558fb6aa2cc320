"""Domains as sub-clusters: node kinds, a domain's rank order, its shape, and moving a layout
between two domains of one shape.

A **kind** of node is its hardware (GPU type, NVLink and network bandwidth, memory, shared core);
kinds are ordered fastest first (achieved matmul rate, then attention rate, network, NVLink,
memory), as the planner's canonical order orders nodes. A domain is a list of cluster ranks
(whole nodes, or some GPUs of a node); its **rank order** lists its nodes by kind (ties in file
order), each node's GPUs ascending: local rank ``j`` is ``ranks[j]``. Its **shape** is the kind and
GPU count of each of its nodes in that order; two domains of one shape have the same hardware rank
by rank, so a layout planned for one is a layout of the other once its hosts are renamed
(:func:`move_layout`), with the same estimate.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import replace
from typing import Any

from megatron_hexiseq.cluster import Cluster, Device, Node
from megatron_hexiseq.layout import Layout
from megatron_hexiseq.planner.canonical import hardware_key

Shape = tuple[tuple[Any, int], ...]


def node_kind(node: Node) -> tuple[Any, ...]:
    """A node's hardware, its name and GPU count left out."""
    return (node.gpu, node.nvlink_GBps, node.network_GBps, node.memory_gib, node.shared_core)


def kind_order_key(d: Device, node: Node) -> tuple[Any, ...]:
    """Fastest kind first (the planner's canonical node order, without name and count); ``d``: a
    device of ``node``."""
    return (*hardware_key(node, d), node.shared_core)


class NodeIndex:
    """The cluster's nodes with their cluster ranks and kinds (kinds fastest first)."""

    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster
        self.ranks: dict[str, tuple[int, ...]] = {}
        for d in cluster.devices:
            self.ranks.setdefault(d.node, ())
            self.ranks[d.node] += (d.index,)
        self.node = {n.name: n for n in cluster.nodes}
        self.position = {n.name: i for i, n in enumerate(cluster.nodes)}
        order: dict[tuple[Any, ...], tuple[Any, ...]] = {}
        for n in cluster.nodes:
            order.setdefault(
                node_kind(n), kind_order_key(cluster.devices[self.ranks[n.name][0]], n)
            )
        self.kinds = sorted(order, key=lambda k: order[k])  # fastest first
        self.kind_rank = {k: i for i, k in enumerate(self.kinds)}
        # nodes of each kind, in file order
        self.nodes_of: list[list[str]] = [[] for _ in self.kinds]
        for n in cluster.nodes:
            self.nodes_of[self.kind_rank[node_kind(n)]].append(n.name)

    def kind_of_rank(self, rank: int) -> int:
        return self.kind_rank[node_kind(self.node[self.cluster.devices[rank].node])]

    def domain_of_nodes(self, names: Iterable[str]) -> tuple[int, ...]:
        """The ranks of whole nodes ``names``, in a domain's rank order."""
        return self.order([r for name in names for r in self.ranks[name]])

    def order(self, ranks: Iterable[int]) -> tuple[int, ...]:
        """Ranks in a domain's rank order: by kind, then node file order, then rank."""
        devs = self.cluster.devices
        return tuple(
            sorted(ranks, key=lambda r: (self.kind_of_rank(r), self.position[devs[r].node], r))
        )

    def canonical_ranks(self) -> tuple[int, ...]:
        """Every rank, nodes by kind (fastest first) then file order: stock Megatron's rank order
        on a host list sorted by GPU type, the strongest a user would launch."""
        return self.order(range(self.cluster.world_size))

    def shape(self, ranks: Sequence[int]) -> Shape:
        """The kind and GPU count of each node of a domain, in its rank order."""
        out: list[tuple[Any, int]] = []
        last = None
        for r in ranks:
            name = self.cluster.devices[r].node
            if name != last:
                out.append((node_kind(self.node[name]), 0))
                last = name
            out[-1] = (out[-1][0], out[-1][1] + 1)
        return tuple(out)


def sub_cluster(cluster: Cluster, ranks: Sequence[int], name: str) -> Cluster:
    """The devices ``ranks`` of ``cluster`` (node-contiguous, in that order) as a cluster of their
    own: device ``j`` is ``ranks[j]``, nodes keep their names and hardware with the GPUs taken."""
    nodes: list[Node] = []
    devices: list[Device] = []
    by_name = {n.name: n for n in cluster.nodes}
    for j, r in enumerate(ranks):
        d = cluster.devices[r]
        if not nodes or nodes[-1].name != d.node:
            nodes.append(replace(by_name[d.node], count=0))
            local = 0
        nodes[-1] = replace(nodes[-1], count=nodes[-1].count + 1)
        devices.append(replace(d, index=j, local_index=local))
        local += 1
    return Cluster(name=name, nodes=tuple(nodes), devices=tuple(devices))


def move_layout(layout: Layout, cluster: Cluster) -> Layout:
    """A layout of one domain for another domain of the same shape (``cluster``: its
    sub-cluster): rank ``j`` keeps its plan and takes device ``j``'s host."""
    ranks = tuple(
        replace(r, host=cluster.devices[r.rank].node)
        if r.host != cluster.devices[r.rank].node
        else r
        for r in layout.ranks
    )
    return replace(layout, ranks=ranks)
