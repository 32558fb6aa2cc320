"""The bound of arrangements with two or more prefix blocks against brute force.

Stage II splits a prefix greedily (each block takes the most it can hold); with two or more prefix
blocks that split is not optimal and its own bound is no bound (docs/planner.md, "Known gap: two or
more prefix blocks"). ``relaxed_bound.arranged_bound`` is the proven bound the planner reports there. On
small random instances (single-rank groups in 2 or 3 prefix blocks, or a block of two 2-rank groups
after a 1-rank one, so K/V fan-out enters; 12-20 units) this compares, against the best split by
brute force (each prefix block's groups holding equal units):

- ``arranged_bound`` (must never lie above the optimum: ``violations``; how close: bound / optimum),
- the greedy split (``split_arranged``): how often it finds a split at all, how far above the
  optimum it is, and how often its own ``bound_ns`` lies above the optimum (why it is not reported).

Writes results/bench/arranged_bound.{json,md} and prints the table.
    python bench/arranged_bound.py                  # 3 shapes x 200 instances, seed 1 (~1 minute)
    python bench/arranged_bound.py --seed 7 --count 100
    python bench/arranged_bound.py --smoke          # 3 shapes x 5 instances, for the test suite
"""

from __future__ import annotations

import argparse
import itertools
import math
import random
import statistics
import sys
from collections.abc import Sequence

from _common import write_outputs

from megatron_hexiseq.planner.arrange import Arrangement, positioned, with_fan_out
from megatron_hexiseq.planner.arranged_split import split_arranged
from megatron_hexiseq.planner.coef import GroupCoef
from megatron_hexiseq.planner.relaxed_bound import arranged_bound
from megatron_hexiseq.planner.unit_range import group_time

SHAPES = ("2 blocks", "3 blocks", "fan-out")
BIG = 10**15


def group(rng: random.Random, n: int, N: int) -> GroupCoef:
    """A group of n identical members with random time coefficients, 2 heads, no memory limit."""
    row = (rng.randint(1, 9), rng.randint(5, 60), rng.randint(0, 40))
    return GroupCoef(
        a=(row[0],) * n,
        b=(row[1],) * n,
        c=(row[2],) * n,
        e=(0,) * n,
        free=(BIG,) * n,
        mt=(1,) * n,
        mh=(0,) * n,
        heads=2,
        num_units=N,
    )


def instance(rng: random.Random, shape: str) -> tuple[list[GroupCoef], Arrangement, int]:
    """One random instance of ``shape``: groups, arrangement, units."""
    N = rng.choice((12, 16, 20))
    if shape == "fan-out":
        two = group(rng, 2, N)
        coefs = [group(rng, 1, N), two, two, group(rng, 2, N)]
        return coefs, Arrangement(prefix=((0,), (1, 2)), final=(3,), name="prefix"), N
    blocks = 2 if shape == "2 blocks" else 3
    coefs = [group(rng, 1, N) for _ in range(blocks + 1)]
    arr = Arrangement(prefix=tuple((i,) for i in range(blocks)), final=(blocks,), name="prefix")
    return coefs, arr, N


def brute_blocks(coefs: Sequence[GroupCoef], arr: Arrangement, N: int) -> float:
    """The best phase objective (linear + attention, surrogate ns) over every split in ``arr`` with
    each prefix block's groups holding equal units (identical members split evenly)."""
    fanned = with_fan_out(coefs, arr)
    best = math.inf

    def walk(i: int, P: int, sizes: list[int]) -> None:
        nonlocal best
        if i < len(arr.prefix):
            k, n = len(arr.prefix[i]), coefs[arr.prefix[i][0]].size
            for T in range(n, (N - P) // k + 1):
                walk(i + 1, P + k * T, sizes + [T])
            return
        for rest in itertools.product(*[range(coefs[g].size, N + 1) for g in arr.final]):
            if P + sum(rest) != N:
                continue
            units = [0] * len(coefs)
            for block, T in zip(arr.prefix, sizes):
                for g in block:
                    units[g] = T
            for g, u in zip(arr.final, rest):
                units[g] = u
            placed = positioned(fanned, arr, units)
            att = max(group_time(c, u) for c, u in zip(placed, units))
            lin = max(u / c.size * c.a[0] for c, u in zip(coefs, units))
            best = min(best, lin + att)

    walk(0, 0, [])
    return best


def measure(seed: int, count: int) -> list[dict]:
    rng = random.Random(seed)
    rows = []
    for shape in SHAPES:
        ratios, greedy_over, greedy_bound_over, found = [], [], 0, 0
        for _ in range(count):
            coefs, arr, N = instance(rng, shape)
            best = brute_blocks(coefs, arr, N)
            if not math.isfinite(best):
                continue
            bound = arranged_bound(with_fan_out(coefs, arr), arr, N)
            ratios.append(0.0 if bound is None else bound / best)
            got = split_arranged(coefs, arr, N)
            if got is not None:
                found += 1
                greedy_over.append(got[0].z_rounded_ns / best)
                greedy_bound_over += got[0].bound_ns > best * (1 + 1e-9)
        rows.append(
            {
                "shape": shape,
                "instances": len(ratios),
                "violations": sum(r > 1 + 1e-9 for r in ratios),
                "bound_min": min(ratios),
                "bound_median": statistics.median(ratios),
                "greedy_found": found,
                "greedy_median_over": statistics.median(greedy_over) if greedy_over else None,
                "greedy_max_over": max(greedy_over) if greedy_over else None,
                "greedy_bound_above_optimum": greedy_bound_over,
            }
        )
    return rows


def table(rows: list[dict]) -> str:
    def fmt(x: float | None, p: int = 3) -> str:
        return "-" if x is None else f"{x:.{p}f}"

    lines = [
        "| shape | instances | bound above optimum | bound / optimum min | median | greedy found a split "
        "| greedy / optimum median | max | greedy's own bound above optimum |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['shape']} | {r['instances']} | {r['violations']} | {fmt(r['bound_min'])} | "
            f"{fmt(r['bound_median'])} | {r['greedy_found']} | {fmt(r['greedy_median_over'])} | "
            f"{fmt(r['greedy_max_over'])} | {r['greedy_bound_above_optimum']} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--count", type=int, default=200, help="instances per shape")
    ap.add_argument("--smoke", action="store_true", help="5 instances per shape")
    ap.add_argument("--out", default="results/bench")
    args = ap.parse_args(argv)
    if args.count < 1:
        print("arranged_bound: --count must be at least 1", file=sys.stderr)
        return 2
    rows = measure(args.seed, 5 if args.smoke else args.count)
    md = table(rows)
    print(md)
    write_outputs(
        args.out,
        "arranged_bound",
        data={"seed": args.seed, "rows": rows},
        title=f"Bound with several prefix blocks against brute force (seed {args.seed})",
        table=md,
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
