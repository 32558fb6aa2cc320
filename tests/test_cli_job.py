"""The job commands: ``plan --global-batch`` writes a job file; ``show``, ``validate`` and
``simulate`` read it; ``plan`` without ``--global-batch`` writes a layout as before.

Layer (a) only (no processes): the CLI in-process (``cli.main``) on a 4-GPU cluster and a tiny
model; the files it writes are loaded back and priced again.
"""

from __future__ import annotations

import json

import pytest

from megatron_hexiseq.cli import main
from megatron_hexiseq.job import JobPlan
from megatron_hexiseq.job.evaluate import price_job
from megatron_hexiseq.layout import Layout

CLUSTER = """name: small
nodes:
  - {name: a0, gpu: A100-SXM-80GB, count: 2, network_GBps: 25}
  - {name: h0, gpu: H100-SXM-80GB, count: 2, network_GBps: 25}
"""
MODEL = """name: tiny
num_layers: 2
hidden_size: 64
num_attention_heads: 8
num_query_groups: 2
ffn_hidden_size: 128
vocab_size: 128
seq_length: 4096
"""


@pytest.fixture()
def d(tmp_path):
    (tmp_path / "c.yaml").write_text(CLUSTER)
    (tmp_path / "m.yaml").write_text(MODEL)
    return tmp_path


def _plan(d, *extra):
    args = ["plan", "--cluster", str(d / "c.yaml"), "--model-config", str(d / "m.yaml")]
    return main([*args, "--time-limit", "5", "--reproducible", *extra])


def test_plan_global_batch_writes_a_job_file_the_other_commands_read(d, capsys):
    assert (
        _plan(d, "--global-batch", "8", "-o", str(d / "job.json"), "--plot", str(d / "j.png")) == 0
    )
    out = capsys.readouterr().out
    assert "predicted step vs the alternatives" in out and "megatron-cp-dp" in out
    job = JobPlan.load(d / "job.json")
    assert job.global_batch == 8 and sum(x.micro_batches for x in job.domains) == 8
    assert (d / "j.png").stat().st_size > 1000
    assert price_job(job).step_s == pytest.approx(job.predicted["step_time_s"], rel=1e-8)
    assert {a["name"] for a in job.alternatives} == {
        "megatron-cp-dp", "fast-only", "typed-dp", "hexiseq-one-domain", "hexiseq-replicas"
    }  # fmt: skip
    # the same inputs give the same file
    assert _plan(d, "--global-batch", "8", "-o", str(d / "job2.json")) == 0
    assert (d / "job.json").read_text() == (d / "job2.json").read_text()
    capsys.readouterr()
    assert main(["show", str(d / "job.json")]) == 0
    assert "domain" in capsys.readouterr().out
    assert main(["show", str(d / "job.json"), "--format", "json"]) == 0
    assert json.loads(capsys.readouterr().out)["format"] == "megatron-hexiseq/job"
    assert main(["validate", str(d / "job.json"), "--cluster", str(d / "c.yaml")]) == 0
    assert "every domain fits its memory" in capsys.readouterr().out
    assert main(["simulate", "--layout", str(d / "job.json"), "--format", "json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert rows[0]["name"] == "job"
    assert rows[0]["step_time_s"] == pytest.approx(job.predicted["step_time_s"], rel=1e-8)
    assert main(["simulate", "--layout", str(d / "job.json"), "--plot", str(d / "s.png")]) == 0
    assert (d / "s.png").exists()


def test_no_overlap_prices_the_reduction_fully(d, capsys):
    assert _plan(d, "--global-batch", "4", "-o", str(d / "a.json")) == 0
    assert _plan(d, "--global-batch", "4", "--no-overlap-grad-sync", "-o", str(d / "b.json")) == 0
    a, b = JobPlan.load(d / "a.json"), JobPlan.load(d / "b.json")
    assert a.options["overlap_grad_sync"] is True and "overlap_grad_sync" not in b.options
    assert "--overlap-grad-reduce" not in b.options["megatron_flags"]
    assert b.predicted["step_time_s"] >= a.predicted["step_time_s"]


def test_plan_without_global_batch_still_writes_a_layout(d, capsys):
    assert _plan(d, "--seq-length", "4096", "-o", str(d / "l.json")) == 0
    lay = Layout.load(d / "l.json")
    assert lay.world_size == 4 and "shard_group_size" not in lay.meta["options"]


def test_plan_a_job_over_tp_bundles_and_read_it_back(d, capsys):
    assert (
        _plan(
            d, "--global-batch", "8", "--tensor-model-parallel-size", "2", "-o", str(d / "t.json")
        )
        == 0
    )
    assert "TP bundles of 2 GPUs" in capsys.readouterr().out
    job = JobPlan.load(d / "t.json")
    assert job.tensor_model_parallel_size == 2 and job.options["tensor_model_parallel_size"] == 2
    assert all(dom.layout.tensor_model_parallel_size == 2 for dom in job.domains)
    assert price_job(job).step_s == pytest.approx(job.predicted["step_time_s"], rel=1e-8)
    assert main(["validate", str(d / "t.json"), "--cluster", str(d / "c.yaml")]) == 0
    assert "every domain fits its memory" in capsys.readouterr().out
    assert main(["simulate", "--layout", str(d / "t.json"), "--format", "json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert rows[0]["step_time_s"] == pytest.approx(job.predicted["step_time_s"], rel=1e-8)
    # auto: every size of 1, 2 (2-GPU nodes) for the job and each alternative, the best kept
    assert (
        _plan(
            d,
            "--global-batch",
            "8",
            "--tensor-model-parallel-size",
            "auto",
            "-o",
            str(d / "a.json"),
        )
        == 0
    )
    auto = JobPlan.load(d / "a.json")
    sizes = auto.planner["tensor_parallel"]["sizes"]
    assert [s["tensor_model_parallel_size"] for s in sizes] == [1, 2]
    assert all("tensor_model_parallel_size" in a for a in auto.alternatives if a["feasible"])
    assert auto.predicted["step_time_s"] <= job.predicted["step_time_s"] * (1 + 1e-9)
    capsys.readouterr()
    assert (
        _plan(
            d, "--global-batch", "8", "--tensor-model-parallel-size", "3", "-o", str(d / "x.json")
        )
        == 2
    )
    err = capsys.readouterr().err
    assert "do not divide over --tensor-model-parallel-size 3" in err and err.count("\n") == 1
    assert not (d / "x.json").exists()
