"""Shared CLI inputs of ``plan`` and ``simulate``: cluster, model, sequence length, training options."""
from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from megatron_hexiseq.errors import HexiSeqError, short

MEMORY_MODE_CHOICES = ("auto", "distributed_optimizer", "fsdp")
MAX_COUNT = 2**31 - 1
# what `plan` records in a layout's meta so that `simulate --layout` needs no --cluster / --model
CLUSTER_SPEC_KEY, MODEL_SPEC_KEY = "cluster_spec", "model_spec"
_OPTION_TYPES = {"micro_batch_size": int, "recompute": bool, "memory_mode": str, "data_parallel_size": int,
                 "capacity_fraction": float, "memory_modes_tried": list, "megatron_flags": list}


@dataclass(frozen=True)
class Problem:
    cluster: Any
    model: Any
    seq_length: int
    options: Any
    modes: tuple[tuple[str, bool], ...]  # (memory_mode, recompute) to try, in order
    survivors: Any = None  # --exclude: elastic.Survivors (the devices left and where they are)


def add_problem_args(p: argparse.ArgumentParser, *, seq_required: bool = True, spec_required: bool = True) -> None:
    """Cluster, model, sequence length and training options (``plan`` and ``simulate``).
    ``spec_required=False``: cluster and model may come from a layout (``problem_from_layout``)."""
    from_layout = "" if spec_required else " (default: the one the --layout was planned for)"
    p.add_argument("--cluster", required=spec_required, metavar="C.yaml", help="cluster spec YAML (docs/specs.md)"
                                                                            + from_layout)
    p.add_argument("--hosts", metavar="H", default=None,
                   help="host names for the cluster's nodes, in file order (comma/space separated, or a SLURM "
                        "host list such as gpu[01-04]); the layout's ranks then name these hosts, as "
                        "scripts/slurm/hexiseq.sbatch LAYOUT=... requires")
    m = p.add_mutually_exclusive_group(required=spec_required)
    m.add_argument("--model", metavar="NAME", help="model preset (gpt-3b, gpt-7b, gpt-13b, llama2-7b, llama3-8b, "
                                                   "llama3-70b, ...)" + from_layout)
    m.add_argument("--model-config", metavar="M.yaml", help="model spec YAML with Megatron's field names")
    seq_help = ("tokens per sequence" + (" (default: the --model-config file's seq_length; required with --model)"
                                         if seq_required else " (default: the layouts')"))
    p.add_argument("--seq-length", type=int, default=None, metavar="N", help=seq_help)
    p.add_argument("--micro-batch-size", type=int, default=None, metavar="B",
                   help="sequences per iteration (default: the model's)")
    p.add_argument("--recompute", action="store_true",
                   help="plan with full activation recompute only (default: without it; --memory-mode auto "
                        "then tries recompute only when nothing fits without)")
    p.add_argument("--memory-mode", choices=MEMORY_MODE_CHOICES, default="auto",
                   help="parameter/optimizer sharding; auto (default) tries distributed_optimizer, then fsdp, "
                        "then each with recompute, until one fits")
    p.add_argument("--data-parallel-size", type=int, default=1, metavar="D",
                   help="data-parallel replicas (default 1): D copies of this cluster, each running the layout on "
                        "its own sequences; tokens/s are those of all D copies, the cluster file describes one")


def load_problem(args: argparse.Namespace, seq_length: int | None = None) -> Problem:
    """Cluster, model and options from parsed args; every bad input is a one-line HexiSeqError."""
    from megatron_hexiseq.cluster import load_cluster
    from megatron_hexiseq.model import get_model

    seq = seq_length if seq_length is not None else args.seq_length
    if seq is None and not args.model_config:
        raise HexiSeqError(f"give --seq-length N for preset {args.model!r} (or a --model-config YAML, whose "
                           "seq_length is the default; or a --layout to take it from)")
    if seq is not None and seq <= 0:
        raise HexiSeqError(f"--seq-length must be a positive integer, got {seq}")
    _check_counts(args)
    cluster = _with_hosts(args, load_cluster(args.cluster))
    model = get_model(args.model, config_path=args.model_config, overrides={"seq_length": seq})
    if getattr(args, "exclude", None) is None:
        return _problem(args, cluster, model)
    from dataclasses import replace

    from megatron_hexiseq.elastic import exclude, parse_exclusions

    kept = exclude(cluster, parse_exclusions(args.exclude))  # after --hosts: the allocation's names
    return replace(_problem(args, kept.cluster, model), survivors=kept)


def _with_hosts(args: argparse.Namespace, cluster: Any) -> Any:
    """``--hosts``: the cluster's nodes, in file order, renamed after the given hosts."""
    if not getattr(args, "hosts", None):
        return cluster
    from megatron_hexiseq.slurm import expand_hostlist, rename_hosts

    return rename_hosts(cluster, expand_hostlist(args.hosts))


def _check_counts(args: argparse.Namespace) -> None:
    for flag, value in (("--micro-batch-size", args.micro_batch_size), ("--data-parallel-size", args.data_parallel_size)):
        if value is not None and not 0 < value <= MAX_COUNT:
            raise HexiSeqError(f"{flag} must be a positive integer (at most {MAX_COUNT}), got {value}")


def _problem(args: argparse.Namespace, cluster: Any, model: Any) -> Problem:
    from megatron_hexiseq.costmodel import TrainOptions
    from megatron_hexiseq.planner.modes import AUTO_MODES

    seq = model.seq_length
    mode = "distributed_optimizer" if args.memory_mode == "auto" else args.memory_mode
    options = TrainOptions(micro_batch_size=args.micro_batch_size or model.micro_batch_size,
                           recompute=bool(args.recompute), memory_mode=mode,
                           data_parallel_size=args.data_parallel_size)
    modes = tuple((m, r) for m, r in AUTO_MODES
                  if (args.memory_mode == "auto" or m == args.memory_mode) and (r or not args.recompute))
    return Problem(cluster=cluster, model=model, seq_length=seq, options=options, modes=modes)


def problem_from_layout(args: argparse.Namespace, layouts: Sequence[tuple[str, Any]], seq_length: int | None) -> Problem:
    """The problem ``plan`` solved for the first layout: its recorded cluster and model specs
    (``meta.cluster_spec`` / ``meta.model_spec``), ``--model``/``--model-config`` and ``--hosts``
    still override."""
    from megatron_hexiseq.cluster import cluster_from_dict
    from megatron_hexiseq.model import get_model, model_from_dict

    if not layouts:
        raise HexiSeqError("give --cluster C.yaml and --model NAME (or a --layout planned by 'megatron-hexiseq plan')")
    path, layout = layouts[0]
    meta = layout.meta if isinstance(layout.meta, Mapping) else {}
    if CLUSTER_SPEC_KEY not in meta:
        raise HexiSeqError(f"layout {path} does not record its cluster spec (planned by an older version or "
                           "edited); give --cluster C.yaml")
    _check_counts(args)
    cluster = _with_hosts(args, cluster_from_dict(meta[CLUSTER_SPEC_KEY], source=f"layout {path}: meta.{CLUSTER_SPEC_KEY}"))
    seq = seq_length if seq_length is not None else layout.seq_length
    if args.model or args.model_config:
        model = get_model(args.model, config_path=args.model_config, overrides={"seq_length": seq})
    elif MODEL_SPEC_KEY in meta:
        spec = meta[MODEL_SPEC_KEY]
        if not isinstance(spec, Mapping):
            raise HexiSeqError(f"layout {path}: meta.{MODEL_SPEC_KEY} must be a mapping of model fields, got {short(spec)}")
        model = model_from_dict({**spec, "seq_length": seq}, source=f"layout {path}: meta.{MODEL_SPEC_KEY}")
    else:
        raise HexiSeqError(f"layout {path} does not record its model spec; give --model NAME or --model-config M.yaml")
    return _problem(args, cluster, model)


def layout_options(layout: Any, path: str) -> dict[str, Any]:
    """A layout's ``meta.options`` (the training options ``plan`` used), type-checked: a hand-edited
    value is a one-line error naming the key, not a traceback later."""
    opts = layout.meta.get("options") if isinstance(layout.meta, Mapping) else None
    if opts is None:
        return {}
    if not isinstance(opts, Mapping):
        raise HexiSeqError(f"layout {path}: meta.options must be a mapping, got {short(opts)}; re-plan the layout")
    for key, value in opts.items():
        want = _OPTION_TYPES.get(key)
        ok = want is None or (isinstance(value, want) and not (want is int and isinstance(value, bool)))
        if want is float:
            ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        if not ok:
            raise HexiSeqError(f"layout {path}: meta.options.{key} must be {want.__name__}, got {short(value)}; "
                               "re-plan the layout or fix the value")
    from megatron_hexiseq.costmodel import TrainOptions

    keep = {k: opts[k] for k in ("micro_batch_size", "recompute", "memory_mode", "data_parallel_size",
                                 "capacity_fraction") if k in opts}
    try:
        TrainOptions(**keep)
    except HexiSeqError as e:
        raise HexiSeqError(f"layout {path}: meta.options: {e}; re-plan the layout") from None
    return dict(opts)
