"""``megatron-hexiseq tune``: offline overlap tuning of your model on the CPU testbed (gloo ranks)."""

from __future__ import annotations

import argparse
import json
import math
import warnings
from typing import TYPE_CHECKING

from megatron_hexiseq.commands import describe
from megatron_hexiseq.errors import HexiSeqError, short
from megatron_hexiseq.io import check_outputs
from megatron_hexiseq.model import MODEL_PRESETS, get_model
from megatron_hexiseq.progress import waiting

if TYPE_CHECKING:
    from megatron_hexiseq.testbed.overlap_bench import BenchModel

# what the CPU testbed can run in minutes; larger is a typo (and would exhaust memory in every rank)
LIMITS = {
    "world_size": 64,
    "seq_length": 1 << 20,
    "max_params": 256_000_000,
    "warmup_steps": 10_000,
    "measure_steps": 10_000,
}

EXAMPLES = """examples:
  megatron-hexiseq tune --model gpt-7b --out overlap.json
  megatron-hexiseq tune --model-config examples/models/cpu-demo.yaml --measure-steps 4 --format json --out overlap.json
  megatron-hexiseq tune --from-result overlap.json --nccl-yaml nccl.yaml   # YAML of a saved result
then train with: --hexiseq-overlap-config overlap.json

The model is scaled to fit the CPU ranks (layers and heads kept, widths shrunk to --max-params,
sequence shortened to --seq-length); bucket sizes in the result are in YOUR model's parameters.
"""


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "tune",
        help="tune communication/computation overlap knobs (Lagom search)",
        description=describe(__doc__),
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--model", metavar="NAME", help=f"model preset to tune for ({', '.join(MODEL_PRESETS)})"
    )
    p.add_argument(
        "--model-config", metavar="M.yaml", help="model spec YAML with Megatron's field names"
    )
    p.add_argument(
        "--out", metavar="PATH", help="write the result JSON here (for --hexiseq-overlap-config)"
    )
    p.add_argument(
        "--from-result",
        metavar="PATH",
        help="do not tune: load this result (e.g. to write its NCCL YAML)",
    )
    p.add_argument(
        "--nccl-yaml", metavar="PATH", help="write the NCCL communicator YAML of the result here"
    )
    p.add_argument(
        "--world-size",
        type=int,
        default=2,
        metavar="N",
        help=f"gloo ranks = data-parallel replicas of the model (default 2, at most {LIMITS['world_size']})",
    )
    p.add_argument(
        "--seq-length",
        type=int,
        default=32,
        metavar="S",
        help="tokens per sequence on the CPU ranks (default 32; at most the model's)",
    )
    p.add_argument(
        "--max-params",
        type=int,
        default=24_000_000,
        metavar="P",
        help="parameters the CPU-scaled model may hold (default 24000000, ~384 MiB per rank)",
    )
    p.add_argument(
        "--warmup-steps",
        type=int,
        default=2,
        metavar="K",
        help="untimed iterations per trial (default 2)",
    )
    p.add_argument(
        "--measure-steps",
        type=int,
        default=6,
        metavar="K",
        help="timed iterations per trial (default 6)",
    )
    p.add_argument(
        "--min-bucket",
        type=int,
        default=None,
        metavar="P",
        help="smallest DDP bucket tried, in parameters of your model (default: 1/128 of the model; "
        "the ladder halves the bucket down to it)",
    )
    p.add_argument(
        "--no-gallop",
        action="store_true",
        help="advance one ladder level per trial (Lagom as written)",
    )
    p.add_argument(
        "--tolerance",
        type=float,
        default=0.05,
        help="measurement noise: reject a move only when it is worse by this fraction (0 = Lagom as written)",
    )
    p.add_argument(
        "--format", choices=("human", "json"), default="human", help="what to print (default human)"
    )
    p.set_defaults(run=run)


def _check(args: argparse.Namespace) -> None:
    """Every number before any process starts (a bucket of 0 parameters would never end the ladder)."""
    for name, hi in LIMITS.items():
        v = getattr(args, name)
        lo = 0 if name == "warmup_steps" else (2 if name == "world_size" else 1)
        if not lo <= v <= hi:
            why = " (data-parallel gradient reduce)" if name == "world_size" else ""
            raise HexiSeqError(
                f"--{name.replace('_', '-')} must be in [{lo}, {hi}]{why}, got {short(v)}"
            )
    if args.min_bucket is not None and args.min_bucket < 1:
        raise HexiSeqError(
            f"--min-bucket must be a positive number of parameters, got {short(args.min_bucket)}"
        )
    if not (math.isfinite(args.tolerance) and 0 <= args.tolerance < 1):
        raise HexiSeqError(f"--tolerance must be in [0, 1), got {args.tolerance}")


def run(args: argparse.Namespace) -> int:
    # Every argument is checked first: the overlap and testbed modules import torch and
    # megatron.core (2.4 s CPU, 5-40 s of wall time on a busy machine), imported only afterwards
    # (and not at the top: every other command starts without them).
    check_outputs(
        [("--out", args.out), ("--nccl-yaml", args.nccl_yaml)],
        inputs=[args.from_result, args.model_config],
    )
    model = None
    if args.from_result:
        if args.model or args.model_config:
            raise HexiSeqError("--from-result loads a finished tuning: drop --model/--model-config")
    else:
        _check(args)
        model = get_model(args.model, config_path=args.model_config)
        if args.min_bucket is not None and args.min_bucket > model.num_parameters:
            raise HexiSeqError(
                f"--min-bucket {short(args.min_bucket)} is more than the model's "
                f"{model.num_parameters:,} parameters; give at most that"
            )
    # Megatron warns on import that Apex and Transformer Engine are missing (12 lines on a CPU
    # run, nothing to act on): silenced here as in the rank processes (testbed.spawn)
    warnings.filterwarnings(
        "ignore", message=r".*(Apex|Transformer Engine).* not installed", category=UserWarning
    )
    from megatron_hexiseq.overlap.nccl import write_nccl_yaml
    from megatron_hexiseq.overlap.results import load_result, save_result
    from megatron_hexiseq.testbed.overlap_bench import BenchConfig, BenchModel
    from megatron_hexiseq.testbed.overlap_tune import OfflineTuneSpec, tune_offline

    if model is None:
        result = load_result(args.from_result)
    else:
        models = BenchModel.for_target(
            model, max_params=args.max_params, seq_length=args.seq_length
        )
        spec = OfflineTuneSpec(
            bench=BenchConfig(
                model=models, warmup_steps=args.warmup_steps, measure_steps=args.measure_steps
            ),
            world_size=args.world_size,
            min_bucket_params=args.min_bucket,
            gallop=not args.no_gallop,
            tolerance=args.tolerance,
        )
        if args.format != "json":
            print(_describe(models))
        with waiting(f"tuning on {args.world_size} gloo ranks", enabled=args.format != "json"):
            result = tune_offline(spec)
    if args.out:
        save_result(result, args.out)
    wrote_yaml = False
    if args.nccl_yaml:
        wrote_yaml = write_nccl_yaml(result.config, args.nccl_yaml)
    if args.format == "json":
        print(json.dumps(result.to_dict(), indent=2))
        return 0
    print(f"chosen: {result.config.label()}  ({result.num_trials} trials)")
    if result.default_z_us and result.tuned_z_us:
        print(
            f"step time: default {result.default_z_us / 1e3:.1f} ms -> tuned {result.tuned_z_us / 1e3:.1f} ms "
            f"({result.tuned_z_us / result.default_z_us:.3f}x; CPU timings are noisy)"
        )
    for s in result.trials:
        print(
            f"  levels={list(s.levels)} y={s.trial.y_us / 1e3:.1f}ms X={s.trial.X_us / 1e3:.1f}ms "
            f"z={s.trial.z_us / 1e3:.1f}ms {s.decision}"
        )
    if args.out:
        print(f"wrote {args.out}; train with --hexiseq-overlap-config {args.out}")
    if args.nccl_yaml:
        print(
            f"wrote {args.nccl_yaml}"
            if wrote_yaml
            else "no NCCL options in this result (CPU/gloo tuning): no YAML written"
        )
    return 0


def _describe(models: BenchModel) -> str:
    t, b = models.target, models.bench
    if b.num_parameters == t.num_parameters:
        return f"model {t.name}: {t.num_parameters:,} parameters, trained as it is with {b.seq_length} tokens"
    return (
        f"model {t.name} ({t.num_parameters:,} parameters) on the CPU ranks: {b.num_layers} layers, "
        f"{b.num_attention_heads} heads, hidden {b.hidden_size} (was {t.hidden_size}), ffn {b.ffn_hidden_size}, "
        f"vocab {b.vocab_size}, {b.seq_length} tokens: {b.num_parameters:,} parameters; bucket sizes are "
        f"scaled by {models.param_ratio:.3g} on the ranks and reported in {t.name}'s parameters"
    )
