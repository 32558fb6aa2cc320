"""The planner's work as a deterministic count: instructions of ``plan()`` under valgrind.

This machine's CPU time swings by 30% between runs of the same code (one suite case read 0.30 s
or 0.50 s in consecutive runs), more than most changes to the planner. The instructions a
process executes do not: each case is run twice under ``valgrind --tool=cachegrind
--cache-sim=no`` (``PYTHONHASHSEED=0``), once planning it and once doing everything but the
``plan()`` call, and the difference is ``plan()``'s instructions (repeat runs agree within 1%).
With ``--base REV`` the same cases are counted on another revision of this repository too (its
files from ``git archive``), so a change is judged by the ratio. Instructions are not time (cache
misses and memory stalls are not counted), so the CPU-time benches stay the targets' measure.

Cases are ``suite:IDX`` (``planner_suite.cases()``) or ``gen:SEED:WORLD:IDX`` (the IDX-th cluster
``planner_speed`` draws from SEED at WORLD GPUs). Each valgrind run takes ~30-60 s.
Writes results/bench/planner_instructions.{json,md} and prints the table.
    python bench/planner_instructions.py --base a47dcea
    python bench/planner_instructions.py --cases suite:5 gen:9000:128:6 --jobs 2
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from typing import NoReturn

from _common import write_outputs

ROOT = os.path.abspath(os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

# run in the measured tree (argv: ROOT SPEC PLAN): build the case, plan it when PLAN is "1"
CHILD = """
import random, sys
root, spec, do_plan = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
sys.path[:0] = [root, root + "/bench"]
import planner_suite as ps
from megatron_hexiseq.cluster import cluster_from_dict
from megatron_hexiseq.model import get_model
from megatron_hexiseq.planner.plan import plan
from megatron_hexiseq.run_config import AUTO_MODES, TrainOptions
kind, *rest = spec.split(":")
if kind == "suite":
    case = ps.cases()[int(rest[0])]
else:
    seed, world, idx = map(int, rest)
    rng = random.Random(seed)
    for i in range(idx + 1):
        case = ps.random_case(rng, world, f"speed-{world}-{i}")
cluster = cluster_from_dict(case["spec"])
model = get_model(case["model"], overrides={"seq_length": case["seq_length"]})
if do_plan:
    plan(cluster, model, case["seq_length"], TrainOptions(), modes=AUTO_MODES, time_limit_s=600)
"""

DEFAULT_CASES = ["suite:5", "suite:6", "suite:7", "gen:8000:128:0", "gen:9000:128:6"]


def _fail(msg: str) -> NoReturn:
    """Bad input or a missing tool: one line on stderr, exit code 2."""
    print(f"planner_instructions: {msg}", file=sys.stderr)
    raise SystemExit(2)


def _check_spec(spec: str) -> None:
    kind, *rest = spec.split(":")
    ok = (kind == "suite" and len(rest) == 1) or (kind == "gen" and len(rest) == 3)
    if not ok or not all(x.isdigit() for x in rest):
        _fail(f"case {spec!r}: give suite:IDX or gen:SEED:WORLD:IDX (integers)")


def instructions(tree: str, spec: str, do_plan: bool) -> int:
    """Instructions of one child process (valgrind's ``I refs``)."""
    env = dict(os.environ, PYTHONHASHSEED="0")
    cmd = [
        "valgrind",
        "--tool=cachegrind",
        "--cache-sim=no",
        "--cachegrind-out-file=/dev/null",
        sys.executable,
        "-c",
        CHILD,
        tree,
        spec,
        "1" if do_plan else "0",
    ]
    r = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True)
    for line in r.stderr.splitlines():
        if "I   refs:" in line or "I refs:" in line:
            return int(line.split(":")[-1].strip().replace(",", ""))
    tail = (r.stderr.strip().splitlines() or ["no output"])[-1]
    _fail(f"case {spec} in {tree}: valgrind gave no instruction count ({tail})")


def plan_instructions(tree: str, spec: str) -> int:
    return instructions(tree, spec, True) - instructions(tree, spec, False)


def export(rev: str, into: str) -> str:
    """The files of revision ``rev`` of this repository under ``into``."""
    got = subprocess.run(["git", "-C", ROOT, "archive", rev], capture_output=True, check=False)
    if got.returncode:
        msg = got.stderr.decode(errors="replace").strip().splitlines()
        _fail(f"--base {rev}: git archive failed ({msg[-1] if msg else 'no message'})")
    subprocess.run(["tar", "-x", "-C", into], input=got.stdout, check=True)
    return into


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", nargs="+", default=DEFAULT_CASES)
    ap.add_argument("--base", default=None, help="a git revision to count the same cases on")
    ap.add_argument("--jobs", type=int, default=2, help="valgrind runs at once")
    ap.add_argument("--out", default="results/bench")
    args = ap.parse_args(argv)
    for spec in args.cases:
        _check_spec(spec)
    if shutil.which("valgrind") is None:
        _fail("valgrind is not installed; install it (e.g. apt-get install valgrind)")
    if args.jobs < 1:
        _fail("--jobs must be at least 1")
    with tempfile.TemporaryDirectory() as tmp:
        trees = {"this": ROOT}
        if args.base:
            trees["base"] = export(args.base, tmp)
        jobs = [(name, tree, spec) for spec in args.cases for name, tree in trees.items()]
        with ThreadPoolExecutor(args.jobs) as pool:
            counts = list(pool.map(lambda j: plan_instructions(j[1], j[2]), jobs))
    got = {(name, spec): n for (name, _, spec), n in zip(jobs, counts)}
    rows = []
    for spec in args.cases:
        row = {"case": spec, "this_minstr": round(got[("this", spec)] / 1e6)}
        if args.base:
            base = got[("base", spec)]
            row.update(base_minstr=round(base / 1e6), ratio=round(got[("this", spec)] / base, 4))
        rows.append(row)
    if args.base:
        header = f"| case | {args.base} (M instr) | this tree (M instr) | ratio |\n|---|---:|---:|---:|\n"
        body = "".join(
            f"| {r['case']} | {r['base_minstr']} | {r['this_minstr']} | {r['ratio']:.3f} |\n"
            for r in rows
        )
        total = sum(r["this_minstr"] for r in rows) / sum(r["base_minstr"] for r in rows)
        body += f"\ntotal ratio {total:.3f}\n"
    else:
        header = "| case | this tree (M instr) |\n|---|---:|\n"
        body = "".join(f"| {r['case']} | {r['this_minstr']} |\n" for r in rows)
    table = header + body
    write_outputs(
        args.out,
        "planner_instructions",
        data={"base": args.base, "rows": rows},
        title="Instructions of plan() (valgrind cachegrind, PYTHONHASHSEED=0)",
        table=table,
    )
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
