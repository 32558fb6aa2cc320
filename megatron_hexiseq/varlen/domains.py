"""The domains a global batch is scheduled over: sets of GPUs that each run one layout.

A **domain** is a set of cluster ranks running one HexiSeq structure (its A2A groups and query
heads; a stock CP group is a structure too) on its own micro-batches: ``micro_batches`` of them per
step. Domains come from a job file (``job.spec.JobPlan``: its domains, layouts and micro-batch
counts), from a structure's data-parallel replicas (Megatron's grid: replica ``i`` runs the layout
on the ``i``-th block of every GPU type's nodes, ``replica_blocks``), or, for the stock baselines,
from symmetric CP groups of ``c`` consecutive GPUs in the canonical node order (``cp_groups``).

``sub_cluster`` is the cluster of a domain's GPUs, numbered ``0..n-1`` in the domain's rank order
(local rank ``j`` = cluster rank ``ranks[j]``), so that the single-domain code (``BatchPlanner``,
``estimate_documents``) runs on it unchanged.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from megatron_hexiseq.cluster import Cluster
from megatron_hexiseq.errors import HexiSeqError
from megatron_hexiseq.layout import Layout
from megatron_hexiseq.planner.canonical import canonical_order
from megatron_hexiseq.run_config import TrainOptions


@dataclass(frozen=True, kw_only=True)
class Domain:
    """GPUs that share one structure, and how many micro-batches they run per step.

    ``ranks``: cluster ranks (local rank ``j`` is ``ranks[j]``); ``structure``: a layout over the
    local ranks (its groups and heads are kept, its segments ignored); ``cluster``: the domain's
    ``sub_cluster``; ``options``: the training options its micro-batches are priced with (the
    optimizer shards over the whole run: ``data_parallel_size`` = run ranks // domain size).
    ``efficiency_1024``: how much longer the domain's planned micro-batches take than its
    perfectly divided work, in 1/1024 (1024: as divided; ``global_batch.domain_costs`` scales the
    integer table by it): measured once, when the domain is planned, on sample micro-batches of
    the length distribution (``domain_choice.plan_domains``)."""

    index: int
    ranks: tuple[int, ...]
    micro_batches: int
    structure: Layout
    cluster: Cluster
    options: TrainOptions
    efficiency_1024: int = 1024

    def __post_init__(self) -> None:
        if self.micro_batches < 1:
            raise HexiSeqError(
                f"domain {self.index}: micro_batches must be at least 1, got {self.micro_batches}"
            )
        if self.structure.world_size != len(self.ranks):
            raise HexiSeqError(
                f"domain {self.index}: its structure has {self.structure.world_size} ranks but it "
                f"lists {len(self.ranks)} GPUs"
            )

    @property
    def size(self) -> int:
        return len(self.ranks)


def sub_cluster(cluster: Cluster, ranks: Sequence[int], name: str | None = None) -> Cluster:
    """The cluster of devices ``ranks`` (in that order, renumbered ``0..n-1``); nodes keep their
    names and bandwidths, each with the count of its devices taken."""
    if not ranks or len(set(ranks)) != len(ranks):
        raise HexiSeqError("a domain needs at least one GPU and no GPU twice")
    W = cluster.world_size
    bad = [r for r in ranks if not 0 <= r < W]
    if bad:
        raise HexiSeqError(f"ranks {bad[:5]} are not ranks of the cluster (0..{W - 1})")
    by_name = {n.name: n for n in cluster.nodes}
    counts: dict[str, int] = {}
    devices = []
    for j, r in enumerate(ranks):
        d = cluster.devices[r]
        devices.append(replace(d, index=j, local_index=counts.get(d.node, 0)))
        counts[d.node] = counts.get(d.node, 0) + 1
    nodes = tuple(replace(by_name[k], count=c) for k, c in counts.items())
    return Cluster(
        name=name or f"{cluster.name}[{len(ranks)}]", nodes=nodes, devices=tuple(devices)
    )


def domain_options(
    options: TrainOptions, cluster: Cluster, run_ranks: Sequence[int], size: int
) -> TrainOptions:
    """``options`` for pricing one domain of ``size`` GPUs in a run on ``run_ranks`` of
    ``cluster``: the distributed optimizer and Megatron-FSDP shard over every rank of the run
    (``shard_group_size``), FSDP's collectives ride the ring over all of them
    (``shard_group_GBps``, ``costmodel.step.ring_bus_GBps``); ``data_parallel_size`` = run ranks
    // domain size."""
    from megatron_hexiseq.costmodel.step import ring_bus_GBps

    n = len(run_ranks)
    bus = ring_bus_GBps(cluster, run_ranks) if n > 1 else 0.0
    return replace(
        options,
        data_parallel_size=max(1, n // size),
        shard_group_size=n,
        shard_group_GBps=bus if bus != float("inf") else 0.0,
    )


def node_blocks(cluster: Cluster, order: Sequence[int] | None = None) -> list[list[int]]:
    """Cluster ranks node by node, nodes in ``order`` of devices (canonical by default)."""
    order = list(canonical_order(cluster) if order is None else order)
    blocks: list[list[int]] = []
    for r in order:
        if blocks and cluster.devices[blocks[-1][0]].node == cluster.devices[r].node:
            blocks[-1].append(r)
        else:
            blocks.append([r])
    return blocks


def replica_blocks(cluster: Cluster, replicas: int) -> list[list[int]] | None:
    """Megatron's data-parallel replicas of one mixed layout: every GPU type's nodes (canonical
    order) split into ``replicas`` equal blocks, replica ``i`` taking block ``i`` of every type
    (the sbatch script's rule). None when some type's GPUs do not split evenly."""
    by_type: dict[str, list[int]] = {}
    for r in canonical_order(cluster):
        by_type.setdefault(cluster.devices[r].gpu.name, []).append(r)
    out: list[list[int]] = [[] for _ in range(replicas)]
    for ranks in by_type.values():
        if len(ranks) % replicas:
            return None
        k = len(ranks) // replicas
        for i in range(replicas):
            out[i].extend(ranks[i * k : (i + 1) * k])
    return out


def typed_blocks(cluster: Cluster, size: int) -> list[list[int]] | None:
    """Domains of one GPU type each: every type's GPUs (canonical order) in blocks of ``size``.
    None when some type's GPUs do not split into blocks of ``size``."""
    by_type: dict[str, list[int]] = {}
    for r in canonical_order(cluster):
        by_type.setdefault(cluster.devices[r].gpu.name, []).append(r)
    out: list[list[int]] = []
    for ranks in by_type.values():
        if len(ranks) % size:
            return None
        out.extend(ranks[i : i + size] for i in range(0, len(ranks), size))
    return out


def cp_groups(cluster: Cluster, c: int) -> list[list[int]]:
    """Megatron's CP groups of size ``c``: ``c`` consecutive GPUs in the canonical node order
    (groups inside a node, nodes of one type together: in the baseline's favour)."""
    order = canonical_order(cluster)
    if cluster.world_size % c:
        raise HexiSeqError(f"CP size {c} does not divide the {cluster.world_size} GPUs")
    return [order[i : i + c] for i in range(0, len(order), c)]


def fastest_type_ranks(cluster: Cluster) -> list[int]:
    """The GPUs of the fastest type (linear FLOP/s, then attention), canonical order."""
    order = canonical_order(cluster)
    first = cluster.devices[order[0]].gpu.name
    return [r for r in order if cluster.devices[r].gpu.name == first]


def speed_shares(total: int, speeds: Sequence[float]) -> list[int]:
    """``total`` micro-batches split in proportion to ``speeds`` (largest remainders, ties to the
    lower index), then every domain at least one (taken from the largest share). Needs ``total >=
    len(speeds)``."""
    n = len(speeds)
    if total < n:
        raise HexiSeqError(f"{total} micro-batches cannot give each of {n} domains one")
    s = sum(speeds)
    raw = [total * x / s for x in speeds]
    out = [int(x) for x in raw]
    order = sorted(range(n), key=lambda i: (-(raw[i] - out[i]), i))
    for i in order[: total - sum(out)]:
        out[i] += 1
    for i in range(n):
        if out[i] == 0:
            j = max(range(n), key=lambda k: (out[k], -k))
            out[j] -= 1
            out[i] = 1
    return out
