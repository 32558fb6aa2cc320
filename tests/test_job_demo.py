"""The job demo's training path, short version (layer (b): gloo ranks pinned like the testbed).

A job built by hand on the 1 + 3 testbed's cluster shape (the fast rank alone as one domain with
3 micro-batches, the three slow ranks as one A2A group with 1) and the two alternatives the demo
trains besides it, recorded in the job as the planner records them (``hexiseq-one-domain``: one
domain over all four ranks with all 4 micro-batches; ``megatron-cp-dp``: four one-rank replicas
with one each): three runs of 3 steps from the same weights on the same global batches, whose
per-token losses agree (exact attention: only fp reordering), and the record, the markdown table
and the figure the demo writes. Layer (a): a missing alternative is a note, a job for another
testbed one line.
"""

from __future__ import annotations

import json

import pytest
from test_job_runtime import ALL_HEADS, ONE_RANK, layout_on, make_job

from megatron_hexiseq.errors import HexiSeqError
from megatron_hexiseq.job import JobPlan
from megatron_hexiseq.testbed.job_demo import main, markdown_table, train_job_on_testbed


def _domains(job: JobPlan) -> list[dict]:
    return json.loads(job.to_json())["domains"]


def job_for_1_3() -> JobPlan:
    slow = layout_on(
        [1, 2, 3],
        [[(0, 16)], [(16, 32)], [(32, 48)]],
        [[0, 1, 2], [3, 4, 5], [6, 7]],
        [[0, 1, 2]],
    )
    job = make_job([([0], 3, layout_on([0], *ONE_RANK)), ([1, 2, 3], 1, slow)])
    one = make_job(
        [
            (
                [0, 1, 2, 3],
                4,
                layout_on(
                    [0, 1, 2, 3],
                    [[(0, 24)], [(24, 32)], [(32, 40)], [(40, 48)]],
                    [ALL_HEADS] * 4,
                    [[0], [1], [2], [3]],
                ),
            )
        ]
    )
    dp = make_job([([r], 1, layout_on([r], *ONE_RANK)) for r in range(4)])
    data = json.loads(job.to_json())
    data["predicted"] = {
        "step_time_s": 1.0,
        "tokens_per_s": 192.0,
        "grad_sync_s": 0.1,
        "optimizer_s": 0.01,
        "idle_fraction": 0.1,
    }
    data["alternatives"] = [
        {
            "name": "hexiseq-one-domain",
            "step_time_s": 1.2,
            "tokens_per_s": 160.0,
            "feasible": True,
            "domains": _domains(one),
        },
        {
            "name": "megatron-cp-dp",
            "step_time_s": 1.5,
            "tokens_per_s": 128.0,
            "feasible": True,
            "domains": _domains(dp),
        },
    ]
    return JobPlan.from_dict(data)


def test_job_and_baselines_train_alike_on_the_testbed(tmp_path, capsys):
    job = job_for_1_3()
    job.save(tmp_path / "job.json")
    out = tmp_path / "demo.json"
    rc = main(
        [
            "--job", str(tmp_path / "job.json"),
            "--testbed", "1+3",
            "--steps", "3",
            "--warmup", "1",
            "--kernel", "reference",
            "-o", str(out),
            "--markdown", str(tmp_path / "demo.md"),
            "--plot", str(tmp_path / "demo.png"),
        ]
    )  # fmt: skip
    assert rc == 0, capsys.readouterr()
    rec = json.loads(out.read_text())
    assert [r["name"] for r in rec["runs"]] == ["job", "one HexiSeq domain", "equal-share DP"]
    assert rec["losses_agree"] and rec["loss_max_rel_diff"] <= 1e-4
    assert rec["speedup_predicted"] == pytest.approx(1.2)
    assert rec["runs"][0]["domains"][1]["micro_batches"] == 1
    assert rec["runs"][2]["predicted_tokens_per_s"] == pytest.approx(48 * 4 / 1.5)
    assert (tmp_path / "demo.png").stat().st_size > 0
    table = (tmp_path / "demo.md").read_text()
    assert (
        "| job | 0: 3, 1+2+3: 1 |" in table
        and "| equal-share DP | 0: 1, 1: 1, 2: 1, 3: 1 |" in table
    )


def test_missing_alternatives_are_notes_and_other_testbeds_refused():
    rec = {
        "testbed": "1+3", "model": "m", "seq_length": 48, "global_batch": 4, "steps": 3,
        "warmup": 1, "runs": [], "notes": ["equal-share DP left out: no alternative named"],
    }  # fmt: skip
    assert "- equal-share DP left out" in markdown_table(rec)
    with pytest.raises(HexiSeqError, match="has 4 ranks but testbed 1\\+2 has 3"):
        train_job_on_testbed(job_for_1_3(), "1+2", steps=2)
