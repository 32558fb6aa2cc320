"""SLURM host lists, cluster specs named after an allocation's hosts, and the sbatch script's
helpers (every value the script reads goes through here as data, never through the shell).

- :func:`expand_hostlist`: ``"gpu[01-03,07],login1"`` -> ``["gpu01", "gpu02", "gpu03", "gpu07",
  "login1"]`` (what ``scontrol show hostnames`` prints), with the maintained ``python-hostlist``
  package, so the launcher and ``plan --hosts`` work where SLURM is not installed (dry runs,
  planning on a laptop). The list is sized (:func:`count_hostlist`) before it is expanded, and
  every name must match ``cluster.NAME_PATTERN``.
- :func:`rename_hosts`: a cluster whose nodes (in file order) take the given host names, so a
  layout planned from an example spec names the allocation's hosts and can be reused by
  ``scripts/slurm/hexiseq.sbatch`` (``LAYOUT=...``), which checks ``host`` and ``gpu`` per rank.
- :func:`allocation_cluster`: the cluster spec of an allocation from its hosts and ``GPU_TYPES``
  (one type per het component, per node, or one for all), built as a dict and validated by the
  cluster loader.

CLI (used by the sbatch script; errors are one line, exit 2)::

    python -m megatron_hexiseq.slurm hostnames 'gpu[01-02],a0'        -> one host per line
    python -m megatron_hexiseq.slurm cluster --cluster C.yaml --hosts 'gpu[01-02]' -o C2.yaml
    python -m megatron_hexiseq.slurm allocation --gpu-types 'H100-SXM-80GB' --gpus-per-node 8 \\
        --network-gbps 25 --name slurm-42 -o C.yaml --hosts gpu01 gpu02 [--components 0 1]
    python -m megatron_hexiseq.slurm node-names C.yaml                 -> the node names, one line
    python -m megatron_hexiseq.slurm layout-field L.json memory-mode|seq-length|megatron-flags|tensor-model-parallel-size
"""

from __future__ import annotations

import re
import sys
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from megatron_hexiseq.cluster import (
    MAX_CLUSTER_NODES,
    NAME_RULE,
    Cluster,
    cluster_from_dict,
    cluster_to_dict,
    is_name,
    load_cluster,
)
from megatron_hexiseq.errors import HexiSeqError, run_user_command, short
from megatron_hexiseq.io import check_outputs, write_text_atomic

MAX_HOSTS = MAX_CLUSTER_NODES  # hosts one host list may name (docs/operability.md)
MAX_HOSTLIST_CHARS = 1 << 20
_GROUP = re.compile(r"\[([^\[\]]*)\]")
_RANGE = re.compile(r"^(\d{1,18})(?:-(\d{1,18}))?$")
_NUMBER = re.compile(r"^\d{1,9}(\.\d{1,9})?$")


def count_hostlist(text: str) -> int:
    """How many names the host list ``text`` expands to, without expanding it (a list such as
    ``gpu[0-999999]-[0-999999]`` would take minutes and all memory). Nested or unbalanced brackets
    and ranges that are not ``N`` or ``N-M`` (``M >= N``) are one-line errors."""
    total = 0
    for item in _split_top(text):
        n = 1
        rest = _GROUP.sub("", item)
        if "[" in rest or "]" in rest:
            raise HexiSeqError(
                f"host list {short(text)}: cannot read {short(item)} (nested or unbalanced brackets)"
            )
        for body in _GROUP.findall(item):
            width = 0
            for part in body.split(","):
                r = _RANGE.match(part.strip())
                if r is None:
                    raise HexiSeqError(
                        f"host list {short(text)}: {short(part)} is not a number or a range like 01-04"
                    )
                lo, hi = int(r.group(1)), int(r.group(2) or r.group(1))
                if hi < lo:
                    raise HexiSeqError(f"host list {short(text)}: range {lo}-{hi} runs backwards")
                width += hi - lo + 1
            n *= width
        total += n
    return total


def expand_hostlist(text: str) -> list[str]:
    """Expand a SLURM host list (comma- or space-separated names, ``prefix[a-b,c]suffix`` ranges,
    zero padding kept) into host names in order; sized first (at most :data:`MAX_HOSTS`), every
    name checked against ``cluster.NAME_PATTERN``."""
    import hostlist

    if len(text) > MAX_HOSTLIST_CHARS:
        raise HexiSeqError(
            f"the host list is {len(text):,} characters long; at most {MAX_HOSTLIST_CHARS:,}"
        )
    items = _split_top(text)
    if not items:
        raise HexiSeqError(
            "the host list is empty; give host names like 'gpu01,gpu02' or 'gpu[01-02]'"
        )
    n = count_hostlist(text)
    if n > MAX_HOSTS:
        raise HexiSeqError(
            f"host list {short(text)} names {n:,} hosts, more than the {MAX_HOSTS:,} allowed"
        )
    try:
        hosts = [h for item in items for h in hostlist.expand_hostlist(item, allow_duplicates=True)]
    except hostlist.BadHostlist as e:
        raise HexiSeqError(f"host list {short(text)}: {e}") from None
    for h in hosts:
        if not is_name(h):
            raise HexiSeqError(
                f"host list {short(text)}: {short(h)} is not a host name: {NAME_RULE}"
            )
    return hosts


def _split_top(text: str) -> list[str]:
    """Split at commas and whitespace outside brackets (a bracket left open is an error)."""
    items: list[str] = []
    cur: list[str] = []
    depth = 0
    for ch in text:
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise HexiSeqError(f"host list {short(text)} has unbalanced brackets")
        if depth == 0 and (ch == "," or ch.isspace()):
            if cur:
                items.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    if depth != 0:
        raise HexiSeqError(f"host list {short(text)} has unbalanced brackets")
    if cur:
        items.append("".join(cur))
    return items


def rename_hosts(cluster: Cluster, hosts: Sequence[str]) -> Cluster:
    """``cluster`` with node ``i`` (file order) renamed ``hosts[i]``; devices follow their node."""
    if len(hosts) != len(cluster.nodes):
        raise HexiSeqError(
            f"{len(hosts)} host name(s) for {len(cluster.nodes)} node(s) of cluster "
            f"{short(cluster.name)}: give one host per node, in the cluster file's node order"
        )
    if len(set(hosts)) != len(hosts):
        raise HexiSeqError("the host names must be unique")
    for h in hosts:
        if not is_name(h):
            raise HexiSeqError(f"{short(h)} is not a host name: {NAME_RULE}")
    names = {n.name: h for n, h in zip(cluster.nodes, hosts)}
    return replace(
        cluster,
        nodes=tuple(replace(n, name=names[n.name]) for n in cluster.nodes),
        devices=tuple(replace(d, node=names[d.node]) for d in cluster.devices),
    )


def allocation_cluster(
    *,
    name: str,
    hosts: Sequence[str],
    components: Sequence[int] | None,
    gpu_types: Sequence[str],
    gpus_per_node: int,
    network_gbps: float,
) -> dict[str, Any]:
    """The cluster spec (a dict the loader accepted) of an allocation: host ``i`` gets the type of
    its het component (``components``), else ``gpu_types[i]``, else the one type given. A count of
    types that fits none of these is an error (never a type dropped or guessed)."""
    if not gpu_types:
        raise HexiSeqError("GPU_TYPES is empty; give one GPU type per het component or per node")
    if components is not None:
        if len(components) != len(hosts):
            raise HexiSeqError(f"{len(components)} components for {len(hosts)} hosts")
        het = max(components) + 1
        if len(gpu_types) != het and len(gpu_types) != 1:
            raise HexiSeqError(
                f"GPU_TYPES has {len(gpu_types)} entries for a job of {het} het components; "
                "give one GPU type per component (or one for all)"
            )
        types = [gpu_types[c] if len(gpu_types) > 1 else gpu_types[0] for c in components]
    elif len(gpu_types) == 1:
        types = [gpu_types[0]] * len(hosts)
    elif len(gpu_types) == len(hosts):
        types = list(gpu_types)
    else:
        raise HexiSeqError(
            f"GPU_TYPES has {len(gpu_types)} entries for {len(hosts)} hosts; give one GPU type per "
            "node (in host list order) or one for all"
        )
    spec = {
        "name": name,
        "nodes": [
            {"name": h, "gpu": t, "count": gpus_per_node, "network_GBps": network_gbps}
            for h, t in zip(hosts, types)
        ],
    }
    cluster_from_dict(
        spec, source="the allocation's cluster (GPU_TYPES, GPUS_PER_NODE, NETWORK_GBPS)"
    )
    return spec


def _int_text(flag: str, text: str) -> int:
    if not re.fullmatch(r"\d{1,9}", text):
        raise HexiSeqError(f"{flag} must be a positive integer, got {short(text)}")
    return int(text)


def _number_text(flag: str, text: str) -> float:
    if not _NUMBER.match(text):
        raise HexiSeqError(
            f"{flag} must be a positive number such as 25 or 12.5, got {short(text)}"
        )
    return float(text)


def layout_field(path: str, field: str) -> str:
    """One value of a layout for the sbatch script: ``seq-length``, ``tensor-model-parallel-size``
    (the GPUs of a TP bundle, 1 without TP), ``memory-mode`` (empty when none is recorded) or
    ``megatron-flags`` (the planner's Megatron flags, space-separated)."""
    from megatron_hexiseq.layout import Layout
    from megatron_hexiseq.run_config import check_options_record

    layout = Layout.load(path)
    if field == "seq-length":
        return str(layout.seq_length)
    if field == "tensor-model-parallel-size":
        return str(layout.tensor_model_parallel_size)
    opts = check_options_record(layout.meta.get("options"), f"layout {path}")
    if field == "memory-mode":
        return str(opts.get("memory_mode") or "")
    return flag_words(opts.get("megatron_flags") or [], f"layout {path}: meta.options")


def flag_words(flags: Any, where: str) -> str:
    """Planner-recorded Megatron flags as one space-separated line, each checked to be a plain
    flag word (no spaces, quotes or shell characters): ``where`` names the record in the error."""
    for flag in flags:
        if not isinstance(flag, str) or not re.fullmatch(r"[A-Za-z0-9_.=:/+-]+", flag):
            raise HexiSeqError(
                f"{where}.megatron_flags holds {short(flag)}, not a flag; re-plan it"
            )
    return " ".join(flags)


def main(argv: list[str] | None = None) -> int:
    import yaml

    from megatron_hexiseq.errors import OneLineParser

    parser = OneLineParser(
        prog="python -m megatron_hexiseq.slurm", description=__doc__.splitlines()[0]
    )
    sub = parser.add_subparsers(dest="command", required=True, parser_class=OneLineParser)
    p0 = sub.add_parser("hostnames", help="print the hosts of a SLURM host list, one per line")
    p0.add_argument("hostlist")
    p1 = sub.add_parser(
        "cluster", help="write a cluster spec whose nodes are named after the given hosts"
    )
    p1.add_argument("--cluster", required=True)
    p1.add_argument("--hosts", required=True)
    p1.add_argument("-o", "--output", required=True)
    p2 = sub.add_parser("allocation", help="write the cluster spec of an allocation")
    p2.add_argument("--name", required=True)
    p2.add_argument("--gpu-types", required=True, help="space-separated GPU types")
    p2.add_argument("--gpus-per-node", required=True)
    p2.add_argument("--network-gbps", required=True)
    p2.add_argument("--hosts", nargs="+", required=True)
    p2.add_argument("--components", nargs="+", default=None, help="het component of each host")
    p2.add_argument("-o", "--output", required=True)
    p3 = sub.add_parser("node-names", help="print a cluster spec's node names on one line")
    p3.add_argument("cluster")
    p4 = sub.add_parser("layout-field", help="print one value of a layout")
    p4.add_argument("layout")
    p4.add_argument(
        "field",
        choices=("seq-length", "memory-mode", "megatron-flags", "tensor-model-parallel-size"),
    )
    args = parser.parse_args(argv)

    def body() -> int:
        if args.command == "hostnames":
            print("\n".join(expand_hostlist(args.hostlist)))
        elif args.command == "cluster":
            check_outputs([("-o", args.output)], inputs=[args.cluster])
            renamed = rename_hosts(load_cluster(args.cluster), expand_hostlist(args.hosts))
            write_text_atomic(
                args.output, yaml.safe_dump(cluster_to_dict(renamed), sort_keys=False)
            )
        elif args.command == "allocation":
            check_outputs([("-o", args.output)])
            components = (
                None
                if args.components is None
                else [_int_text("a het component", c) for c in args.components]
            )
            spec = allocation_cluster(
                name=args.name,
                hosts=args.hosts,
                components=components,
                gpu_types=args.gpu_types.split(),
                gpus_per_node=_int_text("GPUS_PER_NODE", args.gpus_per_node),
                network_gbps=_number_text("NETWORK_GBPS", args.network_gbps),
            )
            write_text_atomic(args.output, yaml.safe_dump(spec, sort_keys=False))
        elif args.command == "node-names":
            print(" ".join(n.name for n in load_cluster(args.cluster).nodes))
        else:
            print(layout_field(args.layout, args.field))
        return 0

    return run_user_command(body)


if __name__ == "__main__":
    sys.exit(main())
