"""Layer (a), no processes: the plan / show / validate / simulate commands, success and every error path
(exit code 2, one line on stderr, no traceback, no output file left behind)."""

from __future__ import annotations

import json
import os

import pytest

from megatron_hexiseq.cli import main

pytestmark = pytest.mark.usefixtures("pinned_catalog")  # tests/conftest.py

CLUSTER = """name: small
nodes:
  - {name: h0, gpu: H100-SXM-80GB, count: 2, network_GBps: 25}
  - {name: a0, gpu: A100-SXM-80GB, count: 2, network_GBps: 25}
"""


@pytest.fixture()
def files(tmp_path):
    (tmp_path / "c.yaml").write_text(CLUSTER)
    return tmp_path


def _plan_args(d, *extra, seq="32768", model="gpt-3b"):
    return [
        "plan",
        "--cluster",
        str(d / "c.yaml"),
        "--model",
        model,
        "--seq-length",
        seq,
        "--time-limit",
        "600",
        "-o",
        str(d / "out.json"),
        *extra,
    ]


def _error(capsys, argv, match):
    rc = main(argv)
    err = capsys.readouterr().err
    assert rc == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err, err
    assert match in lines[0], lines[0]
    return lines[0]


def test_plan_show_validate_simulate_round(files, capsys):
    assert main(_plan_args(files)) == 0
    out = capsys.readouterr().out
    assert "predicted throughput vs baselines" in out and "ring" in out and "status" in out
    lay = json.loads((files / "out.json").read_text())
    assert (
        lay["meta"]["chosen"]
        and isinstance(lay["planner"]["solve_time_s"], float)
        and len(lay["baselines"]) >= 2
    )
    assert main(["show", str(files / "out.json")]) == 0
    assert "h0" in capsys.readouterr().out
    assert main(["show", str(files / "out.json"), "--format", "json"]) == 0
    assert json.loads(capsys.readouterr().out)["ranks"] == lay["ranks"]
    assert main(["validate", str(files / "out.json"), "--cluster", str(files / "c.yaml")]) == 0
    assert capsys.readouterr().out.startswith("ok: ")
    png = files / "sim.png"
    assert (
        main(
            [
                "simulate",
                "--cluster",
                str(files / "c.yaml"),
                "--model",
                "gpt-3b",
                "--layout",
                str(files / "out.json"),
                "--baselines",
                "--plot",
                str(png),
                "--format",
                "json",
            ]
        )
        == 0
    )
    rows = json.loads(capsys.readouterr().out)
    assert rows[0]["iteration_time_s"] == pytest.approx(
        lay["predicted"]["iteration_time_s"], rel=1e-6
    )
    assert {r["name"].split("(")[0] for r in rows[1:]} >= {"ring", "ulysses", "usp"}
    assert png.stat().st_size > 1000


def test_plan_json_output_and_reproducible(files, capsys):
    assert main(_plan_args(files, "--format", "json", "--reproducible")) == 0
    printed = capsys.readouterr().out
    assert json.loads(printed)["planner"]["solve_time_s"] == 0
    first = (files / "out.json").read_bytes()
    assert main(_plan_args(files, "--format", "json", "--reproducible")) == 0
    capsys.readouterr()
    assert (files / "out.json").read_bytes() == first


@pytest.mark.parametrize(
    "mutate, match",
    [
        (lambda d: os.remove(d / "c.yaml"), "does not exist"),
        (lambda d: (d / "c.yaml").write_text("nodes: [\n"), "not valid YAML"),
        (
            lambda d: (d / "c.yaml").write_text(CLUSTER.replace("A100-SXM-80GB", "Z9000")),
            "unknown GPU 'Z9000'",
        ),
        (
            lambda d: (d / "c.yaml").write_text(CLUSTER.replace("count: 2", "count: -1", 1)),
            "count must be a positive",
        ),
        (
            lambda d: (d / "c.yaml").write_text(
                CLUSTER.replace("network_GBps: 25", "network_GBps: 0", 1)
            ),
            "network_GBps",
        ),
    ],
)
def test_plan_bad_cluster(files, capsys, mutate, match):
    mutate(files)
    _error(capsys, _plan_args(files), match)
    assert not (files / "out.json").exists()


@pytest.mark.parametrize(
    "argv_edit, match",
    [
        (
            lambda a: a[: a.index("--seq-length") + 1] + ["0"] + a[a.index("--seq-length") + 2 :],
            "--seq-length must be a positive",
        ),
        (lambda a: [x if x != "gpt-3b" else "gpt-1t" for x in a], "unknown model preset"),
        (lambda a: a + ["--time-limit", "0"], "--time-limit must be positive"),
        (lambda a: a + ["--method", "exact"], None),  # fine on 4 GPUs (checked below for > 16)
        (
            lambda a: [
                x if not x.endswith("out.json") else x.replace("out.json", "no/such/out.json")
                for x in a
            ],
            "does not exist; create it first",
        ),
    ],
)
def test_plan_bad_arguments(files, capsys, argv_edit, match):
    argv = argv_edit(_plan_args(files))
    if match is None:
        assert main(argv) == 0
        capsys.readouterr()
        return
    _error(capsys, argv, match)
    assert not (files / "out.json").exists()


def test_plan_infeasible_leaves_no_file(files, capsys):
    line = _error(
        capsys,
        _plan_args(files, "--memory-mode", "distributed_optimizer", seq=str(1 << 22)),
        "does not fit",
    )
    assert (
        "GiB" in line
        and "short by" in line
        and "more GPUs" in line
        and "--memory-mode fsdp" in line
    )
    assert not (files / "out.json").exists()


def test_plan_bad_model_config(files, capsys):
    (files / "m.yaml").write_text(
        "num_layers: 2\nhidden_size: 64\nnum_attention_heads: 6\nnum_query_groups: 4\n"
    )
    argv = _plan_args(files)
    i = argv.index("--model")
    argv[i : i + 2] = ["--model-config", str(files / "m.yaml")]
    _error(capsys, argv, "model")
    assert not (files / "out.json").exists()


def test_exact_refuses_large_clusters(files, capsys):
    (files / "c.yaml").write_text(
        "name: big\nnodes:\n"
        + "".join(
            f"  - {{name: n{i}, gpu: H100-SXM-80GB, count: 8, network_GBps: 25}}\n"
            for i in range(3)
        )
    )
    _error(capsys, _plan_args(files, "--method", "exact"), "at most 16 GPUs")


def test_validate_errors(files, capsys):
    assert main(_plan_args(files, "--reproducible")) == 0
    capsys.readouterr()
    lay = json.loads((files / "out.json").read_text())
    bad = dict(lay)
    bad["ranks"] = [dict(r) for r in lay["ranks"]]
    (s, e), *rest = lay["ranks"][0]["segments"]
    bad["ranks"][0]["segments"] = [
        [s, e - 1],
        *rest,
    ]  # the segment's last token then belongs to no rank
    (files / "bad.json").write_text(json.dumps(bad))
    _error(capsys, ["validate", str(files / "bad.json")], "belong to no rank")
    (files / "trunc.json").write_text((files / "out.json").read_text()[:50])
    _error(capsys, ["validate", str(files / "trunc.json")], "not valid JSON")
    _error(capsys, ["show", str(files / "missing.json")], "does not exist")
    (files / "other.yaml").write_text(CLUSTER.replace("count: 2", "count: 4", 1))
    _error(
        capsys,
        ["validate", str(files / "out.json"), "--cluster", str(files / "other.yaml")],
        "has 6 GPUs",
    )
    (files / "swap.yaml").write_text(CLUSTER.replace("H100-SXM-80GB", "H200-141GB"))
    _error(
        capsys,
        ["validate", str(files / "out.json"), "--cluster", str(files / "swap.yaml")],
        "rank 0 is on h0/H100-SXM-80GB but the cluster's device 0 is h0/H200-141GB",
    )


def test_simulate_errors(files, capsys):
    base = ["simulate", "--cluster", str(files / "c.yaml"), "--model", "gpt-3b"]
    _error(capsys, base + ["--seq-length", "4096"], "nothing to simulate")
    _error(capsys, base + ["--baselines"], "give --seq-length")
    assert main(_plan_args(files)) == 0
    capsys.readouterr()
    _error(
        capsys,
        [
            "simulate",
            "--cluster",
            str(files / "c.yaml"),
            "--model",
            "gpt-13b",
            "--layout",
            str(files / "out.json"),
        ],
        "has 32 heads in 32 query groups but model 'gpt-13b' has 40 in 40",
    )
    _error(
        capsys,
        base + ["--layout", str(files / "out.json"), "--seq-length", "4096"],
        "planned for seq_length 32768",
    )
    _error(
        capsys,
        base + ["--baselines", "--seq-length", "4096", "--plot", str(files / "no" / "x.png")],
        "create it first",
    )
    assert main(base + ["--baselines", "--seq-length", "4096"]) == 0
    assert "ring" in capsys.readouterr().out


def test_seq_length_defaults_to_the_model_file(files, capsys):
    (files / "m.yaml").write_text(
        "name: tiny\nnum_layers: 2\nhidden_size: 64\nnum_attention_heads: 8\n"
        "ffn_hidden_size: 128\nvocab_size: 128\nseq_length: 6144\n"
    )
    assert (
        main(
            [
                "plan",
                "--cluster",
                str(files / "c.yaml"),
                "--model-config",
                str(files / "m.yaml"),
                "--time-limit",
                "1",
                "-o",
                str(files / "out.json"),
                "--format",
                "json",
            ]
        )
        == 0
    )
    assert json.loads(capsys.readouterr().out)["seq_length"] == 6144
    _error(
        capsys,
        [
            "plan",
            "--cluster",
            str(files / "c.yaml"),
            "--model",
            "gpt-3b",
            "-o",
            str(files / "o.json"),
        ],
        "give --seq-length N for preset 'gpt-3b'",
    )


def test_simulate_takes_cluster_and_model_from_the_layout(files, capsys):
    assert main(_plan_args(files, "--data-parallel-size", "2")) == 0
    assert "copies of this cluster" in capsys.readouterr().out
    assert (
        main(
            [
                "simulate",
                "--layout",
                str(files / "out.json"),
                "--baselines",
                "--plot",
                str(files / "s.png"),
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "best is faster by" in out and "small: 4 GPUs, gpt-3b" in out and "ring" in out
    assert "compute" not in out  # the per-rank tables only with --per-rank
    assert len(out.splitlines()) < 40 and (files / "s.png").stat().st_size > 1000
    assert main(["simulate", "--layout", str(files / "out.json"), "--per-rank"]) == 0
    assert "exposed comm" in capsys.readouterr().out
    assert main(["simulate", "--layout", str(files / "out.json"), "--format", "json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    lay = json.loads((files / "out.json").read_text())
    assert rows[0]["iteration_time_s"] == pytest.approx(
        lay["predicted"]["iteration_time_s"], rel=1e-6
    )
