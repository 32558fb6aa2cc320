"""``megatron-hexiseq profile``: measure ranks and write a cluster spec that ``plan`` accepts."""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
from typing import TYPE_CHECKING, Any

import yaml

from megatron_hexiseq.cluster import check_cluster_name, cluster_from_dict
from megatron_hexiseq.commands import describe
from megatron_hexiseq.errors import HexiSeqError
from megatron_hexiseq.io import check_outputs, write_json_atomic, write_text_atomic
from megatron_hexiseq.model import get_model
from megatron_hexiseq.testbed import (
    spawn,
)  # the module, not run_ranks: a test stops spawn.run_ranks
from megatron_hexiseq.testbed.pinning import TestbedShape, cpu_sets, node_names

if TYPE_CHECKING:
    from megatron_hexiseq.profile.measure import ProfileOptions

EXAMPLES = """examples:
  # on GPUs, one process per GPU:
  torchrun --nnodes 2 --nproc-per-node 8 -m megatron_hexiseq.cli profile -o cluster.yaml
  # the heterogeneous CPU testbed: rank 0 alone on a core, ranks 1-2 sharing the next core
  megatron-hexiseq profile --testbed 1+2 --memory-gib 4 -o results/cluster.yaml
  # calibrated for one model: its own layer shapes instead of a square matmul
  megatron-hexiseq profile --testbed 1+2 --model-config examples/models/cpu-demo.yaml -o results/cluster.yaml
"""


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "profile",
        help="measure compute, bandwidth and memory of every rank; write a cluster spec",
        description=describe(__doc__),
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("-o", "--output", required=True, help="cluster spec YAML to write")
    p.add_argument("--raw", help="raw measurements JSON (default: OUTPUT with .raw.json)")
    p.add_argument(
        "--testbed",
        default=None,
        help="spawn a CPU testbed of this shape (ranks per core, e.g. 1+2) instead of using torchrun's ranks",
    )
    p.add_argument(
        "--memory-gib", type=float, default=None, help="memory budget per rank on CPU (default 4)"
    )
    p.add_argument(
        "--name", default=None, help="cluster name in the spec (default: profiled-<shape or world>)"
    )
    p.add_argument(
        "--seconds", type=float, default=0.5, help="seconds per compute measurement (default 0.5)"
    )
    p.add_argument(
        "--model",
        default=None,
        help="calibrate with this preset's layer shapes (see 'plan --model')",
    )
    p.add_argument(
        "--model-config", default=None, help="calibrate with the layer shapes of this model YAML"
    )
    p.add_argument("--quiet", action="store_true", help="no progress output")
    p.set_defaults(run=run)


MAX_SECONDS = 3600.0
MAX_MEMORY_GIB = 1e6


def run(args: argparse.Namespace) -> int:
    if args.testbed is not None:
        TestbedShape.parse(args.testbed)  # its size is capped: checked before torch is imported
    if args.name is not None:
        check_cluster_name(args.name, "--name")
    from megatron_hexiseq.profile.measure import (
        ProfileOptions,
    )  # torch: 2 s CPU of import for every command

    raw_path = args.raw or (os.path.splitext(args.output)[0] + ".raw.json")
    check_outputs([("-o", args.output), ("--raw", raw_path)], inputs=[args.model_config])
    if not (math.isfinite(args.seconds) and 0 < args.seconds <= MAX_SECONDS):
        raise HexiSeqError(
            f"--seconds must be a positive number of seconds (at most {MAX_SECONDS:g}), got {args.seconds}"
        )
    if args.memory_gib is not None and not (
        math.isfinite(args.memory_gib) and 0 < args.memory_gib <= MAX_MEMORY_GIB
    ):
        raise HexiSeqError(
            f"--memory-gib must be a positive number (at most {MAX_MEMORY_GIB:g}), got {args.memory_gib}"
        )
    model = None
    if args.model or args.model_config:
        model = get_model(args.model, config_path=args.model_config)
    opts = ProfileOptions(seconds_per_test=args.seconds, memory_gib=args.memory_gib, model=model)
    if args.testbed is not None:
        spec, raw = profile_testbed(args.testbed, opts, quiet=args.quiet)
    elif "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        result = _profile_torchrun(opts, quiet=args.quiet)
        if result is None:
            return 0  # not rank 0: nothing to write
        spec, raw = result
    else:
        raise HexiSeqError(
            "no ranks to profile: run under torchrun, or pass --testbed SHAPE (e.g. 1+2) on CPU"
        )
    spec["name"] = args.name or spec["name"]
    write_profile(spec, raw, args.output, raw_path)
    if not args.quiet:
        print(f"wrote {args.output} and {raw_path}")
        for node in spec["nodes"]:
            t = spec["gpus"][node["gpu"]]
            print(
                f"  {node['name']}: {node['count']} rank(s), {t['bf16_tflops'] * 1e3:.1f} GFLOP/s linear, "
                f"{t['attention_tflops'] * 1e3:.1f} GFLOP/s attention, intra {node['nvlink_GBps']:.2f} GB/s, "
                f"inter {node['network_GBps']:.2f} GB/s"
            )
    return 0


def write_profile(spec: dict[str, Any], raw: dict[str, Any], spec_path: str, raw_path: str) -> None:
    """Validate the spec with the cluster loader, then write both files atomically."""
    cluster_from_dict(spec, source="profiled cluster spec")
    write_text_atomic(
        spec_path,
        "# measured by megatron-hexiseq profile\n" + yaml.safe_dump(spec, sort_keys=False),
    )
    write_json_atomic(raw_path, raw)


def _progress(quiet: bool):
    return None if quiet else (lambda msg: print(f"[profile] {msg}", flush=True))


def _run_profile(opts: ProfileOptions, quiet: bool) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """``run_profile`` on this rank, with the testbed's step calibration when the rank is a CPU."""
    # torch (2 s CPU of import) and, for the calibration, megatron.core (5-6 s): here, not at the top,
    # so that every other command and --help start without them
    import torch

    from megatron_hexiseq.profile.run import run_profile
    from megatron_hexiseq.testbed.calibrate import CPU_CALIBRATION

    calibration = None if torch.cuda.is_available() else CPU_CALIBRATION
    return run_profile(opts, progress=_progress(quiet), cpu_calibration=calibration)


def _profile_rank(
    rank: int, world: int, opts: ProfileOptions, quiet: bool
) -> tuple[dict[str, Any], dict[str, Any]] | None:
    return _run_profile(opts, quiet)


def profile_testbed(
    shape_text: str, opts: ProfileOptions, *, quiet: bool = False
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Spawn the CPU testbed ranks pinned to their cores and profile them."""
    shape = TestbedShape.parse(shape_text)
    sets = cpu_sets(shape)
    opts = dataclasses.replace(
        opts,
        node_names=tuple(node_names(shape)),
        shared_cores=True,
        memory_gib=opts.memory_gib if opts.memory_gib is not None else 4.0,
    )
    results = spawn.run_ranks(_profile_rank, shape.world_size, opts, quiet, cpu_sets=sets)
    spec, raw = results[0]
    spec["name"] = f"cpu-testbed-{shape}"
    raw["testbed"] = {"shape": str(shape), "cpu_sets": sets}
    return spec, raw


def _profile_torchrun(
    opts: ProfileOptions, *, quiet: bool
) -> tuple[dict[str, Any], dict[str, Any]] | None:
    import torch  # 2 s CPU of import for every command if at the top
    import torch.distributed as dist

    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    try:
        return _run_profile(opts, quiet)
    finally:
        dist.destroy_process_group()
