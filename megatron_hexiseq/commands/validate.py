"""``megatron-hexiseq validate``: check a layout file (and, with --cluster, that it fits the
cluster) or a job file (its domains, shares and layouts, and that every domain fits its GPUs)."""

from __future__ import annotations

import argparse

from megatron_hexiseq.cluster import load_cluster
from megatron_hexiseq.commands import describe
from megatron_hexiseq.commands.inputs import check_fits, planned_options, recorded_model
from megatron_hexiseq.elastic import diff_layouts
from megatron_hexiseq.errors import HexiSeqError
from megatron_hexiseq.job.spec import JobPlan, load_layout_or_job
from megatron_hexiseq.layout import Layout, check_matches
from megatron_hexiseq.run_config import TrainOptions

EXAMPLES = """examples:
  megatron-hexiseq validate layout.json
  megatron-hexiseq validate layout.json --cluster examples/clusters/mixed-h100-a100.yaml
  # a re-planned layout must resume the old one's checkpoints (same model, length, memory mode)
  megatron-hexiseq validate layout.json --previous old-layout.json
  megatron-hexiseq validate job.json --cluster examples/clusters/mixed-h100-a100.yaml
"""


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "validate",
        help="check a layout file",
        description=describe(__doc__),
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("layout", help="layout or job JSON file (told apart by its format)")
    p.add_argument(
        "--cluster",
        metavar="C.yaml",
        help="also check ranks, hosts and GPU types against this cluster",
    )
    p.add_argument(
        "--previous",
        metavar="old.json",
        default=None,
        help="also print what changed against this earlier layout, and fail (exit 2) when training "
        "under this layout cannot resume a checkpoint written under it",
    )
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    loaded = load_layout_or_job(args.layout)
    if isinstance(loaded, JobPlan):
        return _validate_job(args, loaded)
    layout = loaded
    diff = None
    if args.previous:
        diff = diff_layouts(Layout.load(args.previous), layout)
        if diff.resume_problems:
            raise HexiSeqError(
                f"{args.layout} cannot resume checkpoints written under {args.previous}: "
                + "; ".join(diff.resume_problems)
            )
    where = ""
    if args.cluster:
        cluster = load_cluster(args.cluster)
        check_matches(layout, cluster, source=f"layout {args.layout}")
        where = f", matches cluster {cluster.name!r}"
        model = recorded_model(layout, args.layout)
        if model is not None:  # the same memory check as simulate's (the cost model's estimate)
            options = planned_options(TrainOptions.for_model(model), layout, args.layout)
            check_fits(layout, args.layout, cluster, model, options)
            where += " and fits its memory"
        else:
            where += " (memory not checked: the layout records no model spec)"
    sizes = sorted({len(g.ranks) for g in layout.groups})
    groups = f"{len(layout.groups)} group{'' if len(layout.groups) == 1 else 's'}"
    print(
        f"ok: {args.layout}: {layout.world_size} ranks in {groups} (sizes {sizes}), "
        f"seq_length {layout.seq_length}, {layout.num_attention_heads} heads{where}"
    )
    if diff is not None:
        print(f"changes against {args.previous}:")
        for line in diff.lines():
            print(f"  {line}")
    return 0


def _validate_job(args: argparse.Namespace, job: JobPlan) -> int:
    """A job file: valid as loaded (``JobPlan``), every domain's layout within its GPUs' memory
    under the job's options (the cost model, on the cluster it records), and with --cluster the
    cluster's GPUs, rank by rank, those the job was planned for."""
    from megatron_hexiseq.job.evaluate import price_job

    if args.previous:
        raise HexiSeqError(f"--previous compares two layouts; {args.layout} is a job file")
    where = ""
    if args.cluster:
        cluster = load_cluster(args.cluster)
        planned = job.cluster_spec
        if cluster.world_size != planned.world_size:
            raise HexiSeqError(
                f"job {args.layout} was planned for {planned.world_size} GPUs, cluster "
                f"{cluster.name!r} has {cluster.world_size}; re-plan the job for this cluster"
            )
        for r in job.run_ranks:
            a, b = planned.devices[r], cluster.devices[r]
            if (a.node, a.gpu.name) != (b.node, b.gpu.name):
                raise HexiSeqError(
                    f"job {args.layout}: cluster rank {r} is {a.node}/{a.gpu.name} in the job but "
                    f"{b.node}/{b.gpu.name} in cluster {cluster.name!r}; re-plan the job"
                )
        where = f", matches cluster {cluster.name!r}"
    priced = price_job(job)
    problems = [f"domain {d}: {e.reason}" for d, e in enumerate(priced.evals) if not e.feasible]
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise HexiSeqError(
            f"job {args.layout} does not fit the memory of its GPUs: {problems[0]}{more}; "
            "re-plan the job"
        )
    print(
        f"ok: {args.layout}: {len(job.domains)} domain{'' if len(job.domains) == 1 else 's'} on "
        f"{len(job.run_ranks)} of {job.cluster_spec.world_size} GPUs, {job.global_batch} sequences "
        f"of {job.seq_length} tokens per step{where}, every domain fits its memory"
    )
    return 0
