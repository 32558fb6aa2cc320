"""``megatron-hexiseq validate``: check a layout file (and, with --cluster, that it fits the cluster)."""
from __future__ import annotations

import argparse

from megatron_hexiseq.commands import describe
from megatron_hexiseq.errors import HexiSeqError

EXAMPLES = """examples:
  megatron-hexiseq validate layout.json
  megatron-hexiseq validate layout.json --cluster examples/clusters/mixed-h100-a100.yaml
  # a re-planned layout must resume the old one's checkpoints (same model, length, memory mode)
  megatron-hexiseq validate layout.json --previous old-layout.json
"""


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("validate", help="check a layout file", description=describe(__doc__), epilog=EXAMPLES,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("layout", help="layout JSON file")
    p.add_argument("--cluster", metavar="C.yaml", help="also check ranks, hosts and GPU types against this cluster")
    p.add_argument("--previous", metavar="old.json", default=None,
                   help="also print what changed against this earlier layout, and fail (exit 2) when training "
                        "under this layout cannot resume a checkpoint written under it")
    p.set_defaults(run=run)


def check_against_cluster(layout, cluster) -> None:
    """Rank r of the layout must run on cluster.devices[r]: same count, host and GPU type."""
    if layout.world_size != cluster.world_size:
        raise HexiSeqError(f"layout has {layout.world_size} ranks but cluster {cluster.name!r} has "
                           f"{cluster.world_size} GPUs; plan again for this cluster")
    for r, d in zip(layout.ranks, cluster.devices):
        if r.host != d.node or r.gpu != d.gpu.name:
            raise HexiSeqError(f"rank {r.rank} is planned for {r.gpu} on {r.host} but cluster {cluster.name!r} "
                               f"has {d.gpu.name} on {d.node} there; plan again for this cluster")


def run(args: argparse.Namespace) -> int:
    from megatron_hexiseq.layout import Layout

    layout = Layout.load(args.layout)
    diff = None
    if args.previous:
        from megatron_hexiseq.elastic import diff_layouts

        diff = diff_layouts(Layout.load(args.previous), layout)
        if diff.resume_problems:
            raise HexiSeqError(f"{args.layout} cannot resume checkpoints written under {args.previous}: "
                               + "; ".join(diff.resume_problems))
    where = ""
    if args.cluster:
        from megatron_hexiseq.cluster import load_cluster

        cluster = load_cluster(args.cluster)
        check_against_cluster(layout, cluster)
        where = f", matches cluster {cluster.name!r}"
    sizes = sorted({len(g.ranks) for g in layout.groups})
    groups = f"{len(layout.groups)} group{'' if len(layout.groups) == 1 else 's'}"
    print(f"ok: {args.layout}: {layout.world_size} ranks in {groups} (sizes {sizes}), "
          f"seq_length {layout.seq_length}, {layout.num_attention_heads} heads{where}")
    if diff is not None:
        print(f"changes against {args.previous}:")
        for line in diff.lines():
            print(f"  {line}")
    return 0
