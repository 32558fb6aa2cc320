"""Rank placement for launchers (``scripts/slurm/hexiseq.sbatch``): which process runs where.

Megatron's rank order (``tp-cp-ep-dp-pp``, PP = 1) gives global rank ``g`` the TP rank ``g % TP``,
the CP rank ``(g // TP) % CP`` and the data-parallel replica ``g // (TP x CP)``; the CP rank is the
layout rank (with TP > 1 a layout rank is a TP bundle: ``layout.tensor_model_parallel_size``
consecutive global ranks on one host). Layout rank ``r`` must run on its planned host
(``layout.ranks[r].host``, a node name of the cluster YAML = the scheduler's hostname) at local GPU
indices = its position among the layout ranks of that host, times TP, plus the TP rank (the cluster
numbers devices node by node, local index ascending).

Data-parallel replicas: the allocation's nodes are split per GPU type into ``D`` equal consecutive
blocks (replica ``i`` takes block ``i`` of every type, file order kept). The layout is planned on
replica 0's nodes; replica ``i`` runs it on its own nodes, node ``j`` of replica 0 -> node ``j``
of replica ``i`` (same GPU type by construction).

A job (``--hexiseq-job``): process rank ``k`` runs cluster rank ``job.run_ranks[k]``, on that
device's node at its local index (:func:`job_placements`, checked against the allocation's
cluster YAML: the node exists, with that GPU type and enough GPUs). A job over TP bundles of t
lists its run ranks bundle by bundle, so every t consecutive process ranks (Megatron's TP group)
are the t GPUs of one node.

CLI (prints; errors are one line, exit 2)::

    python -m megatron_hexiseq.megatron.launch replica0 --cluster C.yaml --data-parallel D -o C0.yaml
    python -m megatron_hexiseq.megatron.launch ranks --layout L.json --cluster C.yaml --data-parallel D
    python -m megatron_hexiseq.megatron.launch ranks --job J.json --cluster C.yaml
        -> one line per global rank: "RANK HOST LOCAL_RANK"
    python -m megatron_hexiseq.megatron.launch job-flags --job J.json [--planner-flags 0|1]
        -> the job's Megatron flags on one line (sequence length, global and micro-batch sizes,
           and the planner's memory-mode flags)
    python -m megatron_hexiseq.megatron.launch job-domains --job J.json
        -> one line per domain: its ranks (host:local), micro-batches and sample range
    python -m megatron_hexiseq.megatron.launch job-tp --job J.json
        -> the job's tensor-parallel size (Megatron's --tensor-model-parallel-size; 1 without TP)
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from megatron_hexiseq.cluster import MAX_CLUSTER_GPUS, cluster_to_dict, load_cluster
from megatron_hexiseq.errors import HexiSeqError, check_positive_int, run_user_command
from megatron_hexiseq.io import check_outputs, write_text_atomic
from megatron_hexiseq.job import JobPlan
from megatron_hexiseq.layout import Layout
from megatron_hexiseq.slurm import flag_words


@dataclass(frozen=True)
class Placement:
    """One process: its global rank, host and local GPU index."""

    rank: int
    host: str
    local_rank: int


def split_replicas(
    nodes: Sequence[dict[str, Any]], data_parallel: int
) -> list[list[dict[str, Any]]]:
    """Split cluster-YAML ``nodes`` into ``data_parallel`` replicas with the same mix of node types."""
    by_type: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for node in nodes:
        by_type.setdefault((str(node["gpu"]), int(node.get("count", 1))), []).append(node)
    for (gpu, count), group in by_type.items():
        if len(group) % data_parallel:
            raise HexiSeqError(
                f"{len(group)} nodes of {count} x {gpu} cannot be split into {data_parallel} "
                f"equal data-parallel replicas; change the allocation or --data-parallel"
            )
    replicas: list[list[dict[str, Any]]] = []
    for i in range(data_parallel):
        mine = {
            id(n)
            for group in by_type.values()
            for n in group[i * len(group) // data_parallel : (i + 1) * len(group) // data_parallel]
        }
        replicas.append([n for n in nodes if id(n) in mine])
    return replicas


def placements(
    layout: Layout, nodes: Sequence[dict[str, Any]], data_parallel: int = 1
) -> list[Placement]:
    """Global rank -> (host, local rank) for ``data_parallel`` replicas of ``layout``."""
    replicas = split_replicas(nodes, data_parallel)
    names0 = [str(n["name"]) for n in replicas[0]]
    counts0 = [int(n.get("count", 1)) for n in replicas[0]]
    t = layout.tensor_model_parallel_size  # a layout rank is a TP bundle of t GPUs of its host
    local: list[int] = []  # each layout rank's first local GPU index
    for r in layout.ranks:
        if r.host not in names0:
            raise HexiSeqError(
                f"layout rank {r.rank} is planned on host '{r.host}', which is not among the "
                f"allocation's (first replica's) nodes {names0}; re-plan for this allocation"
            )
        j = names0.index(r.host)
        local.append(t * sum(1 for q in layout.ranks[: r.rank] if q.host == r.host))
        if local[-1] + t > counts0[j]:
            raise HexiSeqError(
                f"layout puts {local[-1] + t} GPUs on host '{r.host}', which has {counts0[j]}"
            )
    out = []
    for i, replica in enumerate(replicas):
        for r in layout.ranks:
            host = str(replica[names0.index(r.host)]["name"])
            first = (i * layout.world_size + r.rank) * t  # Megatron's tp-cp-ep-dp-pp order
            out += [
                Placement(rank=first + k, host=host, local_rank=local[r.rank] + k) for k in range(t)
            ]
    return out


def job_placements(job: JobPlan, nodes: Sequence[dict[str, Any]]) -> list[Placement]:
    """Process rank -> (host, local rank) of a job, checked against the allocation's ``nodes``."""
    have = {str(n["name"]): (str(n["gpu"]), int(n.get("count", 1))) for n in nodes}
    out = []
    for k, r in enumerate(job.run_ranks):
        dev = job.cluster_spec.devices[r]
        if dev.node not in have:
            raise HexiSeqError(
                f"the job runs cluster rank {r} on host '{dev.node}', which is not in the "
                f"allocation ({', '.join(sorted(have))}); plan the job with --hosts for these hosts"
            )
        gpu, count = have[dev.node]
        if gpu != dev.gpu.name or dev.local_index >= count:
            raise HexiSeqError(
                f"the job runs cluster rank {r} on GPU {dev.local_index} of host '{dev.node}' "
                f"({dev.gpu.name}) but the allocation has {count} x {gpu} there; re-plan the job"
            )
        out.append(Placement(rank=k, host=dev.node, local_rank=dev.local_index))
    return out


def job_flags(job: JobPlan, *, planner_flags: bool = True) -> str:
    """The Megatron flags a job's ranks need besides ``--hexiseq-job`` and the CP flags."""
    flags = [
        f"--seq-length {job.seq_length}",
        f"--global-batch-size {job.global_batch}",
        f"--micro-batch-size {job.micro_batch_size}",
    ]
    if planner_flags:
        recorded = flag_words(job.options.get("megatron_flags") or [], "job options")
        flags += [recorded] if recorded else []
    return " ".join(flags)


def job_domains(job: JobPlan) -> list[str]:
    """One line per domain for the job's log: process ranks on host:GPU, micro-batches, samples."""
    process = {r: k for k, r in enumerate(job.run_ranks)}
    lines = []
    for d, dom in enumerate(job.domains):
        devices = [job.cluster_spec.devices[r] for r in dom.ranks]
        where = " ".join(
            f"{process[r]}@{v.node}:{v.local_index}" for r, v in zip(dom.ranks, devices)
        )
        start, stop = job.sample_range(d)
        types = sorted({v.gpu.name for v in devices})
        t = job.tensor_model_parallel_size
        bundles = "" if t == 1 else f" in {dom.size // t} TP bundles of {t}"
        lines.append(
            f"domain {d}: {dom.size} x {' + '.join(types)}{bundles}, "
            f"ranks {where}, {dom.micro_batches} micro-batches per step (samples {start}-{stop - 1} "
            f"of each global batch of {job.global_batch}), groups "
            f"{[list(g.ranks) for g in dom.layout.groups]}"
        )
    return lines


def _nodes(path: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The cluster spec through the cluster loader (types, ranges, names), as plain dicts."""
    data = cluster_to_dict(load_cluster(path))
    return data, data["nodes"]


def main(argv: list[str] | None = None) -> int:
    import yaml

    from megatron_hexiseq.errors import OneLineParser

    parser = OneLineParser(
        prog="python -m megatron_hexiseq.megatron.launch", description=__doc__.splitlines()[0]
    )
    sub = parser.add_subparsers(dest="command", required=True, parser_class=OneLineParser)
    p0 = sub.add_parser(
        "replica0", help="write the cluster YAML of data-parallel replica 0 (to plan on)"
    )
    p1 = sub.add_parser("ranks", help="print 'RANK HOST LOCAL_RANK' for every process")
    for p in (p0, p1):
        p.add_argument("--cluster", required=True)
        p.add_argument("--data-parallel", type=int, default=1)
    p0.add_argument("-o", "--output", required=True)
    which = p1.add_mutually_exclusive_group(required=True)
    which.add_argument("--layout")
    which.add_argument("--job")
    p2 = sub.add_parser("job-flags", help="print a job's Megatron flags on one line")
    p3 = sub.add_parser("job-domains", help="print one line per domain of a job")
    p4 = sub.add_parser("job-tp", help="print a job's tensor-parallel size")
    for p in (p2, p3, p4):
        p.add_argument("--job", required=True)
    p2.add_argument("--planner-flags", choices=("0", "1"), default="1")
    args = parser.parse_args(argv)
    if args.command in ("job-flags", "job-domains", "job-tp"):
        return run_user_command(lambda: _print_job(args))

    def body() -> None:
        check_positive_int("--data-parallel", args.data_parallel, at_most=MAX_CLUSTER_GPUS)
        if args.command == "replica0":
            check_outputs([("-o", args.output)], inputs=[args.cluster])
        data, nodes = _nodes(args.cluster)
        if args.command == "replica0":
            first = {**data, "nodes": split_replicas(nodes, args.data_parallel)[0]}
            write_text_atomic(args.output, yaml.safe_dump(first, sort_keys=False))
        elif args.job is not None:
            if args.data_parallel != 1:
                raise HexiSeqError(
                    "a job plans its own domains: drop --data-parallel (DATA_PARALLEL) with --job"
                )
            for p in job_placements(JobPlan.load(args.job), nodes):
                print(p.rank, p.host, p.local_rank)
        else:
            for p in placements(Layout.load(args.layout), nodes, args.data_parallel):
                print(p.rank, p.host, p.local_rank)

    return run_user_command(body)


def _print_job(args: Any) -> None:
    job = JobPlan.load(args.job)
    if args.command == "job-flags":
        print(job_flags(job, planner_flags=args.planner_flags == "1"))
    elif args.command == "job-tp":
        print(job.tensor_model_parallel_size)
    else:
        print("\n".join(job_domains(job)))


if __name__ == "__main__":
    sys.exit(main())
