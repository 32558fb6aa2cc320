"""Shared CLI inputs of ``plan`` and ``simulate``: cluster, model, sequence length, training options."""

from __future__ import annotations

import argparse
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from megatron_hexiseq.cluster import (
    MAX_PLAN_GPUS,
    MAX_PLAN_NODES,
    Cluster,
    cluster_from_dict,
    load_cluster,
)
from megatron_hexiseq.costmodel.rates import FLAT_KERNELS, RUNTIME_KERNELS
from megatron_hexiseq.elastic import Survivors, exclude, parse_exclusions
from megatron_hexiseq.errors import HexiSeqError, check_positive_int, short
from megatron_hexiseq.layout import Layout
from megatron_hexiseq.model import ModelSpec, get_model, model_from_dict
from megatron_hexiseq.run_config import (
    MEMORY_MODE_CHOICES,
    TrainOptions,
    check_options_record,
    modes_to_try,
    options_from_record,
)
from megatron_hexiseq.slurm import expand_hostlist, rename_hosts

MAX_COUNT = 2**31 - 1
# what `plan` records in a layout's meta so that `simulate --layout` needs no --cluster / --model
CLUSTER_SPEC_KEY, MODEL_SPEC_KEY = "cluster_spec", "model_spec"


@dataclass(frozen=True, kw_only=True)
class Problem:
    """What ``plan`` and ``simulate`` work on, from their flags (or a layout's recorded specs)."""

    cluster: Cluster
    model: ModelSpec
    seq_length: int
    options: TrainOptions
    modes: tuple[tuple[str, bool], ...]  # (memory_mode, recompute) to try, in order
    survivors: Survivors | None = None  # --exclude: the devices left and where they are


def add_problem_args(
    p: argparse.ArgumentParser, *, seq_required: bool = True, spec_required: bool = True
) -> None:
    """Cluster, model, sequence length and training options (``plan`` and ``simulate``).
    ``spec_required=False``: cluster and model may come from a layout (``problem_from_layout``)."""
    from_layout = "" if spec_required else " (default: the one the --layout was planned for)"
    p.add_argument(
        "--cluster",
        required=spec_required,
        metavar="C.yaml",
        help="cluster spec YAML (docs/specs.md)" + from_layout,
    )
    p.add_argument(
        "--hosts",
        metavar="H",
        default=None,
        help="host names for the cluster's nodes, in file order (comma/space separated, or a SLURM "
        "host list such as gpu[01-04]); the layout's ranks then name these hosts, as "
        "scripts/slurm/hexiseq.sbatch LAYOUT=... requires",
    )
    m = p.add_mutually_exclusive_group(required=spec_required)
    m.add_argument(
        "--model",
        metavar="NAME",
        help="model preset (gpt-3b, gpt-7b, gpt-13b, llama2-7b, llama3-8b, "
        "llama3-70b, ...)" + from_layout,
    )
    m.add_argument(
        "--model-config", metavar="M.yaml", help="model spec YAML with Megatron's field names"
    )
    seq_help = "tokens per sequence" + (
        " (default: the --model-config file's seq_length; required with --model)"
        if seq_required
        else " (default: the layouts')"
    )
    p.add_argument("--seq-length", type=int, default=None, metavar="N", help=seq_help)
    p.add_argument(
        "--micro-batch-size",
        type=int,
        default=None,
        metavar="B",
        help="sequences per iteration (default: the model's)",
    )
    p.add_argument(
        "--recompute",
        action="store_true",
        help="plan with full activation recompute only (default: without it; --memory-mode auto "
        "then tries recompute only when nothing fits without)",
    )
    p.add_argument(
        "--memory-mode",
        choices=MEMORY_MODE_CHOICES,
        default="auto",
        help="parameter/optimizer sharding; auto (default) tries distributed_optimizer, then fsdp, "
        "then each with recompute, until one fits",
    )
    p.add_argument(
        "--data-parallel-size",
        type=int,
        default=1,
        metavar="D",
        help="data-parallel replicas (default 1): D copies of this cluster, each running the layout on "
        "its own sequences; tokens/s are those of all D copies, the cluster file describes one",
    )
    p.add_argument(
        "--attention-kernel",
        choices=KERNEL_CHOICES,
        default="auto",
        help="the attention kernel the run will force (--hexiseq-kernel), priced at its achieved "
        "rate on each GPU; auto (default): the kernel the runtime picks per GPU (cuDNN on Hopper, "
        "flash from Ampere, else memory-efficient)",
    )


KERNEL_CHOICES = (*RUNTIME_KERNELS, *FLAT_KERNELS)


def load_problem(
    args: argparse.Namespace, seq_length: int | None = None, model: ModelSpec | None = None
) -> Problem:
    """Cluster, model and options from parsed args; every bad input is a one-line HexiSeqError.
    ``model``: the model when the flags name none (``simulate --layout L --cluster C``: the one the
    layout records)."""
    seq = seq_length if seq_length is not None else args.seq_length
    if seq is None and not args.model_config and model is None:
        raise HexiSeqError(
            f"give --seq-length N for preset {args.model!r} (or a --model-config YAML, whose "
            "seq_length is the default; or a --layout to take it from)"
        )
    if seq is not None:
        check_positive_int("--seq-length", seq)
    _check_counts(args)
    cluster = _with_hosts(args, load_cluster(args.cluster))
    if model is None or args.model or args.model_config:
        model = get_model(args.model, config_path=args.model_config, overrides={"seq_length": seq})
    elif seq is not None:
        model = replace(model, seq_length=seq)
    if getattr(args, "exclude", None) is None:
        return _problem(args, cluster, model)
    kept = exclude(cluster, parse_exclusions(args.exclude))  # after --hosts: the allocation's names
    return replace(_problem(args, kept.cluster, model), survivors=kept)


def _with_hosts(args: argparse.Namespace, cluster: Cluster) -> Cluster:
    """``--hosts``: the cluster's nodes, in file order, renamed after the given hosts."""
    if getattr(args, "hosts", None) is None:  # '' is a mistake, not "no --hosts"
        return cluster
    return rename_hosts(cluster, expand_hostlist(args.hosts))


def _check_counts(args: argparse.Namespace) -> None:
    for flag, value in (
        ("--micro-batch-size", args.micro_batch_size),
        ("--data-parallel-size", args.data_parallel_size),
    ):
        if value is not None:
            check_positive_int(flag, value, at_most=MAX_COUNT)


def _problem(args: argparse.Namespace, cluster: Cluster, model: ModelSpec) -> Problem:
    if cluster.world_size > MAX_PLAN_GPUS or len(cluster.nodes) > MAX_PLAN_NODES:
        raise HexiSeqError(
            f"cluster {short(cluster.name)} has {cluster.world_size:,} GPUs in "
            f"{len(cluster.nodes):,} nodes; plan and simulate take at most {MAX_PLAN_GPUS:,} GPUs "
            f"in {MAX_PLAN_NODES:,} nodes (one data-parallel replica: describe one and pass "
            "--data-parallel-size)"
        )
    modes = modes_to_try(args.memory_mode, bool(args.recompute))
    options = TrainOptions.for_model(
        model,
        recompute=bool(args.recompute),
        memory_mode=modes[0][0],
        data_parallel_size=args.data_parallel_size,
        attention_kernel=getattr(args, "attention_kernel", "auto"),
        **({"micro_batch_size": args.micro_batch_size} if args.micro_batch_size else {}),
    )
    return Problem(
        cluster=cluster, model=model, seq_length=model.seq_length, options=options, modes=modes
    )


def problem_from_layout(
    args: argparse.Namespace, layouts: Sequence[tuple[str, Layout]], seq_length: int | None
) -> Problem:
    """The problem ``plan`` solved for the first layout: its recorded cluster and model specs
    (``meta.cluster_spec`` / ``meta.model_spec``), ``--model``/``--model-config`` and ``--hosts``
    still override."""
    if not layouts:
        raise HexiSeqError(
            "give --cluster C.yaml and --model NAME (or a --layout planned by 'megatron-hexiseq plan')"
        )
    path, layout = layouts[0]
    meta = layout.meta if isinstance(layout.meta, Mapping) else {}
    if CLUSTER_SPEC_KEY not in meta:
        raise HexiSeqError(
            f"layout {path} does not record its cluster spec (planned by an older version or "
            "edited); give --cluster C.yaml"
        )
    _check_counts(args)
    cluster = _with_hosts(
        args,
        cluster_from_dict(meta[CLUSTER_SPEC_KEY], source=f"layout {path}: meta.{CLUSTER_SPEC_KEY}"),
    )
    seq = seq_length if seq_length is not None else layout.seq_length
    if args.model or args.model_config:
        model = get_model(args.model, config_path=args.model_config, overrides={"seq_length": seq})
    elif MODEL_SPEC_KEY in meta:
        spec = meta[MODEL_SPEC_KEY]
        if not isinstance(spec, Mapping):
            raise HexiSeqError(
                f"layout {path}: meta.{MODEL_SPEC_KEY} must be a mapping of model fields, got {short(spec)}"
            )
        model = model_from_dict(
            {**spec, "seq_length": seq}, source=f"layout {path}: meta.{MODEL_SPEC_KEY}"
        )
    else:
        raise HexiSeqError(
            f"layout {path} does not record its model spec; give --model NAME or --model-config M.yaml"
        )
    return _problem(args, cluster, model)


def layout_options(layout: Layout, path: str) -> dict[str, Any]:
    """A layout's ``meta.options`` (the training options ``plan`` used), type-checked
    (``run_config.check_options_record``); empty when the layout records none."""
    opts = layout.meta.get("options") if isinstance(layout.meta, Mapping) else None
    return check_options_record(opts, f"layout {path}")


def planned_options(base: TrainOptions, layout: Layout, path: str) -> TrainOptions:
    """``base`` with the training options the layout was planned with (``meta.options``: memory
    mode, recompute, micro-batch size, data parallel size, usable memory share)."""
    return options_from_record(layout_options(layout, path), base)


def check_fits(
    layout: Layout, path: str, cluster: Cluster, model: ModelSpec, options: TrainOptions
) -> None:
    """The memory check ``validate --cluster`` and ``simulate`` share (the cost model's estimate):
    every rank's modelled memory within its GPU's usable capacity, else a one-line HexiSeqError
    naming the first rank over and how many more are."""
    from megatron_hexiseq import costmodel

    problems = costmodel.estimate(layout, cluster, model, options).memory_problems()
    if problems:
        more = f" (and {len(problems) - 1} more ranks)" if len(problems) > 1 else ""
        raise HexiSeqError(
            f"layout {path} does not fit the memory of cluster {short(cluster.name)}: "
            f"{problems[0]}{more}; re-plan for this cluster"
        )


def recorded_model(layout: Layout, path: str) -> ModelSpec | None:
    """The model spec ``plan`` recorded in the layout (``meta.model_spec``), or None."""
    meta = layout.meta if isinstance(layout.meta, Mapping) else {}
    spec = meta.get(MODEL_SPEC_KEY)
    if spec is None:
        return None
    if not isinstance(spec, Mapping):
        raise HexiSeqError(
            f"layout {path}: meta.{MODEL_SPEC_KEY} must be a mapping of model fields, got {short(spec)}"
        )
    return model_from_dict(
        {**spec, "seq_length": layout.seq_length}, source=f"layout {path}: meta.{MODEL_SPEC_KEY}"
    )
