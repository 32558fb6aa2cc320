"""``megatron-hexiseq tune``: offline overlap tuning on the CPU testbed (gloo ranks)."""
from __future__ import annotations

import argparse
import json

from megatron_hexiseq.errors import HexiSeqError

EXAMPLES = """examples:
  megatron-hexiseq tune --out overlap.json
  megatron-hexiseq tune --hidden-size 256 --measure-steps 4 --format json --out overlap.json
  megatron-hexiseq tune --from-result overlap.json --nccl-yaml nccl.yaml   # YAML of a saved result
then train with: --hexiseq-overlap-config overlap.json
"""


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("tune", help="tune communication/computation overlap knobs (Lagom search)",
                              description=__doc__, epilog=EXAMPLES,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", metavar="PATH", help="write the result JSON here (for --hexiseq-overlap-config)")
    p.add_argument("--from-result", metavar="PATH", help="do not tune: load this result (e.g. to write its NCCL YAML)")
    p.add_argument("--nccl-yaml", metavar="PATH", help="write the NCCL communicator YAML of the result here")
    p.add_argument("--world-size", type=int, default=2, help="gloo ranks (data-parallel replicas)")
    p.add_argument("--num-layers", type=int, default=4)
    p.add_argument("--hidden-size", type=int, default=512)
    p.add_argument("--seq-length", type=int, default=32)
    p.add_argument("--vocab-size", type=int, default=2048)
    p.add_argument("--warmup-steps", type=int, default=2)
    p.add_argument("--measure-steps", type=int, default=6, help="timed iterations per trial")
    p.add_argument("--min-bucket", type=int, default=100_000, help="smallest DDP bucket tried (parameters)")
    p.add_argument("--no-gallop", action="store_true", help="advance one ladder level per trial (Lagom as written)")
    p.add_argument("--tolerance", type=float, default=0.05,
                   help="measurement noise: reject a move only when it is worse by this fraction (0 = Lagom as written)")
    p.add_argument("--format", choices=("human", "json"), default="human")
    p.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    from megatron_hexiseq.overlap.nccl import write_nccl_yaml
    from megatron_hexiseq.overlap.results import load_result, save_result

    if args.from_result:
        result = load_result(args.from_result)
    else:
        if args.world_size < 2:
            raise HexiSeqError(f"--world-size must be >= 2 (data-parallel gradient reduce), got {args.world_size}")
        if not 0 <= args.tolerance < 1:
            raise HexiSeqError(f"--tolerance must be in [0, 1), got {args.tolerance}")
        if args.measure_steps < 1 or args.warmup_steps < 0:
            raise HexiSeqError("--measure-steps must be >= 1 and --warmup-steps >= 0")
        from megatron_hexiseq.overlap.offline import OfflineTuneSpec, tune_offline
        from megatron_hexiseq.overlap.testbed import TestbedConfig, TestbedModel

        model = TestbedModel(num_layers=args.num_layers, hidden_size=args.hidden_size,
                             seq_length=args.seq_length, vocab_size=args.vocab_size)
        spec = OfflineTuneSpec(testbed=TestbedConfig(model=model, warmup_steps=args.warmup_steps,
                                                     measure_steps=args.measure_steps),
                               world_size=args.world_size, min_bucket_params=args.min_bucket,
                               gallop=not args.no_gallop, tolerance=args.tolerance)
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
        print(f"step time: default {result.default_z_us / 1e3:.1f} ms -> tuned {result.tuned_z_us / 1e3:.1f} ms "
              f"({result.tuned_z_us / result.default_z_us:.3f}x; CPU timings are noisy)")
    for s in result.trials:
        print(f"  levels={list(s.levels)} y={s.trial.y_us / 1e3:.1f}ms X={s.trial.X_us / 1e3:.1f}ms "
              f"z={s.trial.z_us / 1e3:.1f}ms {s.decision}")
    if args.out:
        print(f"wrote {args.out}; train with --hexiseq-overlap-config {args.out}")
    if args.nccl_yaml:
        print(f"wrote {args.nccl_yaml}" if wrote_yaml else
              "no NCCL options in this result (CPU/gloo tuning): no YAML written")
    return 0
