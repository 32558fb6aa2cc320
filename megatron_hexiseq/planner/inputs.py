"""Shared CLI inputs of ``plan`` and ``simulate``: cluster, model, sequence length, training options."""
from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from typing import Any

from megatron_hexiseq.errors import HexiSeqError

MEMORY_MODE_CHOICES = ("auto", "distributed_optimizer", "fsdp")


@dataclass(frozen=True)
class Problem:
    cluster: Any
    model: Any
    seq_length: int
    options: Any
    modes: tuple[tuple[str, bool], ...]  # (memory_mode, recompute) to try, in order


def add_problem_args(p: argparse.ArgumentParser, *, seq_required: bool = True) -> None:
    p.add_argument("--cluster", required=True, metavar="C.yaml", help="cluster spec YAML")
    m = p.add_mutually_exclusive_group(required=True)
    m.add_argument("--model", metavar="NAME", help="model preset (gpt-3b, gpt-7b, gpt-13b, llama2-7b, llama3-8b, llama3-70b, ...)")
    m.add_argument("--model-config", metavar="M.yaml", help="model spec YAML with Megatron's field names")
    p.add_argument("--seq-length", type=int, required=seq_required, metavar="N", help="tokens per sequence")
    p.add_argument("--micro-batch-size", type=int, default=None, metavar="B", help="sequences per iteration (default: the model's)")
    p.add_argument("--recompute", action="store_true", help="full activation recompute (always on)")
    p.add_argument("--memory-mode", choices=MEMORY_MODE_CHOICES, default="auto",
                   help="parameter/optimizer sharding; auto (default) tries distributed_optimizer, then fsdp, "
                        "then each with recompute, until one fits")
    p.add_argument("--data-parallel-size", type=int, default=1, metavar="D", help="replicas of the layout (default 1)")


def output_folder_exists(path: str) -> None:
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise HexiSeqError(f"cannot write {path}: folder {folder} does not exist; create it first")


def load_problem(args: argparse.Namespace, seq_length: int | None = None) -> Problem:
    """Cluster, model and options from parsed args; every bad input is a one-line HexiSeqError."""
    from megatron_hexiseq.cluster import load_cluster
    from megatron_hexiseq.costmodel import TrainOptions
    from megatron_hexiseq.model import get_model
    from megatron_hexiseq.planner.modes import AUTO_MODES

    seq = seq_length if seq_length is not None else args.seq_length
    if seq is None:
        raise HexiSeqError("give --seq-length N (or a --layout to take it from)")
    if seq <= 0:
        raise HexiSeqError(f"--seq-length must be a positive integer, got {seq}")
    if args.micro_batch_size is not None and args.micro_batch_size <= 0:
        raise HexiSeqError(f"--micro-batch-size must be a positive integer, got {args.micro_batch_size}")
    if args.data_parallel_size <= 0:
        raise HexiSeqError(f"--data-parallel-size must be a positive integer, got {args.data_parallel_size}")
    cluster = load_cluster(args.cluster)
    model = get_model(args.model, config_path=args.model_config, overrides={"seq_length": seq})
    mode = "distributed_optimizer" if args.memory_mode == "auto" else args.memory_mode
    options = TrainOptions(micro_batch_size=args.micro_batch_size or model.micro_batch_size,
                           recompute=bool(args.recompute), memory_mode=mode,
                           data_parallel_size=args.data_parallel_size)
    modes = tuple((m, r) for m, r in AUTO_MODES
                  if (args.memory_mode == "auto" or m == args.memory_mode) and (r or not args.recompute))
    return Problem(cluster=cluster, model=model, seq_length=seq, options=options, modes=modes)
