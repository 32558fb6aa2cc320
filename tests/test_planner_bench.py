"""Layer (a), no processes besides the benchmarks' own: fast smoke runs of the planner benchmarks
(each writes its JSON + markdown into a temporary folder; the figures themselves are in the report).

They check that each script runs and writes what it says, not the numbers: that a plan is never
slower than a baseline is ``plan``'s own rule (tests/test_planner.py checks it against fresh
estimates, with a crippled planner that the check catches), and measured times are left alone."""

from __future__ import annotations

import json
import os
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))


def test_planner_scale_smoke(tmp_path):
    import planner_scale

    assert planner_scale.main(["--sizes", "16", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "planner_scale.json").read_text())
    row = data["rows"][0]
    assert row["gpus"] == 16 and all(
        isinstance(row[k], float) for k in ("total_s", "cpu_s", "peak_rss_mib")
    )
    assert "| 16 |" in (tmp_path / "planner_scale.md").read_text()


def test_optimality_gap_smoke(tmp_path):
    import optimality_gap

    assert optimality_gap.main(["--smoke", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "optimality_gap.json").read_text())
    assert data["summary"]["solved"] == 2
    for row in data["rows"]:
        # the exact model's optimum is never above the hierarchical result (both on the surrogate)
        assert row["exact_s"] <= row["hier_s"] * (1 + 1e-9)


def test_sim_suite_smoke(tmp_path):
    import sim_suite

    assert sim_suite.main(["--smoke", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "sim_suite.json").read_text())
    (row,) = data["rows"]
    assert row["speedup"] is not None and row["best_baseline"]


def test_planner_suite_smoke(tmp_path):
    import planner_suite

    assert planner_suite.main(["--smoke", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "planner_suite.json").read_text())
    assert len(data["rows"]) == 2 and len(planner_suite.cases()) >= 21
    for row in data["rows"]:
        assert (
            row["winner"]
            and isinstance(row["cpu_s"], float)
            and isinstance(row["over_heuristics"], dict)
        )
    assert "| 0 |" in (tmp_path / "planner_suite.md").read_text()


def test_planner_speed_smoke(tmp_path):
    import planner_speed

    assert (
        planner_speed.main(
            ["--sizes", "32", "--count", "1", "--repeats", "2", "--out", str(tmp_path)]
        )
        == 0
    )
    data = json.loads((tmp_path / "planner_speed.json").read_text())
    (row,) = data["rows"]
    assert (
        len(row["cpu_runs"]) == 2
        and row["cpu_s"]
        == sorted(row["cpu_runs"])[0]
        + (sorted(row["cpu_runs"])[1] - sorted(row["cpu_runs"])[0]) / 2
    )
    assert data["summary"]["32"]["cases"] == 1 and (tmp_path / "planner_speed.png").exists()


def test_a_measured_process_that_dies_stops_the_bench_instead_of_hanging():
    # a planner exception in the spawned process used to leave the bench waiting on its queue for
    # ever (found when the previous code raised IndexError on a generated cluster)
    import operator
    import threading

    from _common import in_fresh_process

    raised: list[BaseException] = []

    def call() -> None:
        try:  # truediv(1, 0, queue): a TypeError in the child
            in_fresh_process(operator.truediv, 1, 0)
        except BaseException as e:  # noqa: BLE001 - SystemExit is what we expect
            raised.append(e)

    t = threading.Thread(target=call, daemon=True)
    t.start()
    t.join(60)
    assert not t.is_alive(), "the bench is still waiting for a process that died"
    assert len(raised) == 1 and isinstance(raised[0], SystemExit)
    assert "exited with code 1 before reporting" in str(raised[0])


def test_planner_instructions_bad_input_and_smoke(tmp_path, capsys):
    # bad input: one line, exit code 2, nothing written; with valgrind, one small case end to end
    import shutil

    import planner_instructions

    for argv in (["--cases", "suite"], ["--cases", "gen:1:2"], ["--jobs", "0"]):
        with pytest.raises(SystemExit) as e:
            planner_instructions.main([*argv, "--out", str(tmp_path)])
        assert e.value.code == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("planner_instructions: ") and "\n" not in err
    assert not list(tmp_path.iterdir())
    if shutil.which("valgrind") is None:
        pytest.skip("valgrind is not installed: the count itself is not checked here")
    assert planner_instructions.main(["--cases", "suite:1", "--out", str(tmp_path)]) == 0
    (row,) = json.loads((tmp_path / "planner_instructions.json").read_text())["rows"]
    assert row["case"] == "suite:1" and row["this_minstr"] > 10  # a 32-GPU plan: ~10^8 or more
    assert "| suite:1 |" in (tmp_path / "planner_instructions.md").read_text()


def test_arranged_bound_smoke(tmp_path):
    import arranged_bound

    assert arranged_bound.main(["--smoke", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "arranged_bound.json").read_text())
    assert [r["shape"] for r in data["rows"]] == list(arranged_bound.SHAPES)
    assert all(r["instances"] == 5 and r["violations"] == 0 for r in data["rows"])
    assert "| fan-out |" in (tmp_path / "arranged_bound.md").read_text()
    assert arranged_bound.main(["--count", "0", "--out", str(tmp_path / "no")]) == 2
    assert not (tmp_path / "no").exists()


def test_planner_counters_smoke(tmp_path):
    import planner_counters

    assert planner_counters.main(["--smoke", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "planner_counters.json").read_text())
    rows = data["rows"]
    assert [r["gpus"] for r in rows] == [32, 64]
    for r in rows:
        assert r["members"] > 10 and r["best"]["time_s"] > 0
        assert r["plan_over_best"] == pytest.approx(r["plan_s"] / r["best"]["time_s"])
    assert data["summary"]["compared"] == 2
    assert "plan / best" in (tmp_path / "planner_counters.md").read_text()
    assert planner_counters.main(["--sizes", "20", "--out", str(tmp_path / "no")]) == 2
    assert not (tmp_path / "no").exists()


def test_planner_counters_families_are_the_documented_shapes():
    import random

    import planner_counters

    from megatron_hexiseq.cluster import cluster_from_dict
    from megatron_hexiseq.model import get_model

    case = planner_counters.wide_case(random.Random(3), 128, "t")
    cl = cluster_from_dict(case["spec"])
    m = get_model(case["model"])
    S = case["seq_length"]
    found = planner_counters.members(cl, m, S)
    names = {x.name for x in found}
    assert "knode(k=1,bands,balanced)" in names and any(n.startswith("prop(hp=") for n in names)
    for x in found:
        assert sum(x.tokens) == S and len(x.tokens) == len(x.groups)
        assert sorted(g for b in x.blocks for g in b) == list(range(len(x.groups)))
        assert sorted(r for g in x.groups for r in g) == list(range(cl.world_size))
        if x.name.startswith("knode("):  # whole nodes of one type per group
            for g in x.groups:
                assert len({cl.devices[r].gpu.name for r in g}) == 1
                assert len(g) % 8 == 0


def test_planner_counters_skips_a_case_that_does_not_fit(monkeypatch):
    import random

    import planner_counters

    from megatron_hexiseq.errors import HexiSeqError

    def no_fit(*args, **kwargs):
        raise HexiSeqError("does not fit in memory under any layout")

    monkeypatch.setattr(planner_counters, "plan", no_fit)
    row = planner_counters.run_case(planner_counters.wide_case(random.Random(1), 32, "t"))
    assert row["plan_s"] is None and row["plan_over_best"] is None and "fit" in row["infeasible"]
    s = planner_counters.summary([{**row, "seed": 1}])
    assert s["infeasible"] == 1 and s["compared"] == 0 and not s["target_met"]
