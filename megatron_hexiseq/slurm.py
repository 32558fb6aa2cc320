"""SLURM host lists and cluster specs named after an allocation's hosts.

- :func:`expand_hostlist`: ``"gpu[01-03,07],login1"`` -> ``["gpu01", "gpu02", "gpu03", "gpu07",
  "login1"]`` (what ``scontrol show hostnames`` prints), so the launcher and ``plan --hosts`` work
  where SLURM is not installed (dry runs, planning on a laptop);
- :func:`rename_hosts`: a cluster whose nodes (in file order) take the given host names, so a
  layout planned from an example spec names the allocation's hosts and can be reused by
  ``scripts/slurm/hexiseq.sbatch`` (``LAYOUT=...``), which checks ``host`` and ``gpu`` per rank.

CLI (used by the sbatch script; errors are one line, exit 2)::

    python -m megatron_hexiseq.slurm hostnames 'gpu[01-02],a0'        -> one host per line
    python -m megatron_hexiseq.slurm cluster --cluster C.yaml --hosts 'gpu[01-02]' -o C2.yaml
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from megatron_hexiseq.cluster import cluster_to_dict, load_cluster
from megatron_hexiseq.errors import HexiSeqError, run_user_command
from megatron_hexiseq.io import check_outputs, write_text_atomic

MAX_HOSTS = 1_000_000
_RANGE = re.compile(r"^(\d+)(?:-(\d+))?$")


def expand_hostlist(text: str) -> list[str]:
    """Expand a SLURM host list (comma- or space-separated names, ``prefix[a-b,c]suffix`` ranges,
    zero padding kept from the range's first number) into host names in order."""
    hosts: list[str] = []
    for item in _split_top(text.strip()):
        hosts.extend(_expand_one(item, text))
        if len(hosts) > MAX_HOSTS:
            raise HexiSeqError(f"host list {_short(text)} names more than {MAX_HOSTS} hosts")
    if not hosts:
        raise HexiSeqError(
            "the host list is empty; give host names like 'gpu01,gpu02' or 'gpu[01-02]'"
        )
    return hosts


def _split_top(text: str) -> list[str]:
    """Split at commas/whitespace outside brackets."""
    items, depth, cur = [], 0, ""
    for ch in text:
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
        if depth == 0 and (ch == "," or ch.isspace()):
            if cur:
                items.append(cur)
            cur = ""
        else:
            cur += ch
    if depth != 0:
        raise HexiSeqError(f"host list {_short(text)} has unbalanced brackets")
    if cur:
        items.append(cur)
    return items


def _expand_one(item: str, text: str) -> list[str]:
    m = re.search(r"\[([^\[\]]*)\]", item)
    if m is None:
        if "[" in item or "]" in item:
            raise HexiSeqError(f"host list {_short(text)}: cannot read {_short(item)}")
        return [item]
    head, body, tail = item[: m.start()], m.group(1), item[m.end() :]
    out: list[str] = []
    for part in body.split(","):
        r = _RANGE.match(part.strip())
        if r is None:
            raise HexiSeqError(
                f"host list {_short(text)}: {_short(part)} is not a number or a range like 01-04"
            )
        lo, hi = r.group(1), r.group(2) or r.group(1)
        if int(hi) < int(lo) or int(hi) - int(lo) > MAX_HOSTS:
            raise HexiSeqError(f"host list {_short(text)}: bad range {lo}-{hi}")
        out.extend(f"{head}{str(i).zfill(len(lo))}{tail}" for i in range(int(lo), int(hi) + 1))
    return [h for o in out for h in _expand_one(o, text)]  # a second bracket group in the same name


def rename_hosts(cluster: Any, hosts: Sequence[str]):
    """``cluster`` with node ``i`` (file order) renamed ``hosts[i]``; devices follow their node."""
    if len(hosts) != len(cluster.nodes):
        raise HexiSeqError(
            f"{len(hosts)} host name(s) for {len(cluster.nodes)} node(s) of cluster "
            f"{cluster.name!r}: give one host per node, in the cluster file's node order"
        )
    if len(set(hosts)) != len(hosts):
        raise HexiSeqError("the host names must be unique")
    names = {n.name: h for n, h in zip(cluster.nodes, hosts)}
    return replace(
        cluster,
        nodes=tuple(replace(n, name=names[n.name]) for n in cluster.nodes),
        devices=tuple(replace(d, node=names[d.node]) for d in cluster.devices),
    )


def _short(text: str, limit: int = 60) -> str:
    text = str(text)
    return repr(text if len(text) <= limit else text[:limit] + "...")


def main(argv: list[str] | None = None) -> int:
    import yaml

    parser = argparse.ArgumentParser(
        prog="python -m megatron_hexiseq.slurm", description=__doc__.splitlines()[0]
    )
    sub = parser.add_subparsers(dest="command", required=True)
    p0 = sub.add_parser("hostnames", help="print the hosts of a SLURM host list, one per line")
    p0.add_argument("hostlist")
    p1 = sub.add_parser(
        "cluster", help="write a cluster spec whose nodes are named after the given hosts"
    )
    p1.add_argument("--cluster", required=True)
    p1.add_argument("--hosts", required=True)
    p1.add_argument("-o", "--output", required=True)
    args = parser.parse_args(argv)

    def body() -> int:
        if args.command == "hostnames":
            print("\n".join(expand_hostlist(args.hostlist)))
            return 0
        check_outputs([("-o", args.output)], inputs=[args.cluster])
        renamed = rename_hosts(load_cluster(args.cluster), expand_hostlist(args.hosts))
        write_text_atomic(args.output, yaml.safe_dump(cluster_to_dict(renamed), sort_keys=False))
        return 0

    return run_user_command(body)


if __name__ == "__main__":
    sys.exit(main())
