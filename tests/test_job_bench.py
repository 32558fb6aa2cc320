"""Layer (a), no processes besides the benchmark's own: a smoke run of ``bench/job_suite.py`` (two
small generated clusters and the paper's testbed) writes its JSON, markdown and PNG, and its figures
keep the suite's own rule: the job is never slower than an alternative (each planned at its best TP
size)."""

from __future__ import annotations

import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))


def test_job_suite_smoke(tmp_path, monkeypatch):
    import job_suite

    monkeypatch.chdir(ROOT)  # the paper's testbed is examples/clusters/mixed-h100-a100.yaml
    assert job_suite.main(["--smoke", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "job_suite.json").read_text())
    assert len(data["rows"]) == 2 and len(job_suite.cases()) == len(job_suite.SIZES)
    assert data["summary"]["never_slower"]
    for row in data["rows"]:
        assert all(s is None or s >= 1 - 1e-9 for s in row["speedup"].values())
        assert row["cpu_s"] > 0 and row["winner"]["family"]
        assert row["tp"] in (1, 2, 4, 8)  # auto: the job and each alternative at its best TP
        assert set(row["alternatives_tp"].values()) <= {1, 2, 4, 8}
    paper = data["paper_testbed"]
    assert {(p["kernel"], p["seq_length"], p["global_batch"]) for p in paper} == {
        (k, s, b) for k in ("auto", "flash") for s in (16384, 32768) for b in (1, 8)
    }
    assert all(p["speedup"] > 1 for p in paper)
    assert (tmp_path / "job_suite.png").stat().st_size > 1000
    assert "The paper's testbed" in (tmp_path / "job_suite.md").read_text()
