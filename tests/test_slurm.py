"""SLURM launcher, layer (a): ``scripts/slurm/hexiseq.sbatch`` in DRY_RUN mode with stand-ins.

Stand-in ``scontrol`` (``show hostnames a,b`` -> one host per line) and ``srun`` (fails: a dry run
must launch nothing) on PATH; the real ``megatron-hexiseq`` plans/validates. Checks the printed
commands: host derivation, plan/validate, one srun per host (het group, nodelist) and every rank's
environment (RANK/LOCAL_RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT/CUDA_DEVICE_MAX_CONNECTIONS) with
rank -> host as the layout says, plus the rank table for data-parallel replicas. A requeued attempt
(same WORKDIR, a checkpoint in SAVE, EXCLUDE): re-planned for the GPUs left with the previous memory
mode, old vs new logged, --save/--load passed, the survivors of a host as CUDA_VISIBLE_DEVICES; a
re-plan that cannot resume the checkpoint is refused before srun.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_hexiseq.layout import Layout, make_layout
from megatron_hexiseq.megatron.launch import Placement, placements, split_replicas

ROOT = Path(__file__).resolve().parents[1]
SBATCH = ROOT / "scripts" / "slurm" / "hexiseq.sbatch"
pytestmark = pytest.mark.skipif(shutil.which("bash") is None, reason="bash not installed")


@pytest.fixture
def stand_ins(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text(
        '#!/usr/bin/env bash\n[ "$1 $2" = "show hostnames" ] || exit 1\ntr \',\' \'\\n\' <<< "$3"\n'
    )
    (bin_dir / "srun").write_text(
        '#!/usr/bin/env bash\necho "srun called in a dry run: $*" >&2\nexit 1\n'
    )
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    venv_bin = str(Path(sys.executable).parent)
    return {
        "PATH": f"{bin_dir}:{venv_bin}:{os.environ['PATH']}",
        "PYTHON": sys.executable,
        "DRY_RUN": "1",
        "SLURM_JOB_ID": "42",
        "WORKDIR": str(tmp_path / "wd"),
    }


def _run(env: dict, *args: str) -> subprocess.CompletedProcess:
    full = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    full.update(env)
    return subprocess.run(
        ["bash", str(SBATCH), *args], capture_output=True, text=True, env=full, timeout=300
    )


def _rank_lines(out: str) -> dict[int, tuple[str, dict[str, str], str]]:
    """'+ [host] env K=V ... CMD' -> {rank: (host, env, cmd)}."""
    ranks = {}
    for m in re.finditer(r"^\+ \[(\S+)\] env ((?:\w+=\S+ )+)(.*)$", out, re.M):
        env = dict(kv.split("=", 1) for kv in m.group(2).split())
        ranks[int(env["RANK"])] = (m.group(1), env, m.group(3))
    return ranks


def test_het_job_with_given_layout(stand_ins, tmp_path):
    layout = make_layout(
        seq_length=64,
        num_attention_heads=8,
        num_query_groups=2,
        group_sizes=[2, 2],
        segments=[[(0, 20)], [(20, 40)], [(40, 52)], [(52, 64)]],
        heads=[[0, 1, 2, 3], [4, 5, 6, 7], [0, 1, 2, 3], [4, 5, 6, 7]],
        hosts=["fast0", "fast0", "slow0", "slow0"],
        gpus=["H100-SXM-80GB"] * 2 + ["A100-SXM-80GB"] * 2,
    )
    layout.save(tmp_path / "layout.json")
    env = {
        **stand_ins,
        "SLURM_HET_SIZE": "2",
        "SLURM_JOB_NODELIST_HET_GROUP_0": "fast0",
        "SLURM_JOB_NODELIST_HET_GROUP_1": "slow0",
        "GPU_TYPES": "H100-SXM-80GB A100-SXM-80GB",
        "GPUS_PER_NODE": "2",
        "LAYOUT": str(tmp_path / "layout.json"),
        "MASTER_PORT": "6001",
    }
    res = _run(env, "--num-layers", "2", "--micro-batch-size", "1")
    assert res.returncode == 0, res.stderr + res.stdout
    out = res.stdout
    assert "+ scontrol show hostnames fast0" in out and "+ scontrol show hostnames slow0" in out
    assert f"validate {tmp_path}/layout.json --cluster" in out
    sruns = re.findall(r"^\+ srun (.*)$", out, re.M)
    assert len(sruns) == 2
    assert "--het-group=0 --nodes=1 --ntasks=1 --nodelist=fast0" in sruns[0]
    assert "--het-group=1 --nodes=1 --ntasks=1 --nodelist=slow0" in sruns[1]
    ranks = _rank_lines(out)
    assert sorted(ranks) == [0, 1, 2, 3]
    for r, (host, renv, cmd) in ranks.items():
        assert host == layout.ranks[r].host
        assert renv == {
            "RANK": str(r),
            "LOCAL_RANK": str(r % 2),
            "WORLD_SIZE": "4",
            "MASTER_ADDR": "fast0",
            "MASTER_PORT": "6001",
            "CUDA_DEVICE_MAX_CONNECTIONS": "1",
        }
        assert cmd.startswith(
            f"{sys.executable} -m megatron_hexiseq.pretrain_gpt --context-parallel-size 4 "
            "--cp-comm-type hexiseq --calculate-per-token-loss --seq-length 64 "
            f"--hexiseq-layout {tmp_path}/layout.json"
        )
        assert cmd.endswith("--num-layers 2 --micro-batch-size 1")


def test_het_job_plans_a_layout(stand_ins, tmp_path):
    env = {
        **stand_ins,
        "SLURM_HET_SIZE": "2",
        "SLURM_JOB_NODELIST_HET_GROUP_0": "fast0",
        "SLURM_JOB_NODELIST_HET_GROUP_1": "slow0,slow1",
        "GPU_TYPES": "H100-SXM-80GB A100-SXM-80GB",
        "GPUS_PER_NODE": "2",
        "MODEL_CONFIG": str(ROOT / "examples" / "models" / "gpt-tiny-gqa.yaml"),
        "SEQ_LENGTH": "4096",
        "PLAN_ARGS": "--time-limit 2 --reproducible",
        "ENTRY": "patched",
        "MEGATRON_LM": str(tmp_path / "Megatron-LM"),  # printed only: a dry run
    }
    res = _run(env)
    assert res.returncode == 0, res.stderr + res.stdout
    wd = Path(env["WORKDIR"])
    assert re.search(
        r"^\+ megatron-hexiseq plan --cluster \S+/cluster-replica0.yaml --model-config \S+ "
        r"--seq-length 4096 --data-parallel-size 1 -o \S+/layout.json --time-limit 2",
        res.stdout,
        re.M,
    )
    layout = Layout.load(wd / "layout.json")
    ranks = _rank_lines(res.stdout)
    assert sorted(ranks) == list(range(layout.world_size)) == list(range(6))
    for r, (host, renv, cmd) in ranks.items():
        assert host == layout.ranks[r].host and renv["MASTER_ADDR"] == layout.ranks[0].host
        assert cmd.startswith(
            f"{sys.executable} {tmp_path}/Megatron-LM/pretrain_gpt.py --context-parallel-size 6 "
        )


def test_plain_job_data_parallel_rank_table(stand_ins, tmp_path):
    layout = make_layout(
        seq_length=32,
        num_attention_heads=4,
        num_query_groups=4,
        group_sizes=[1, 1],
        segments=[[(0, 20)], [(20, 32)]],
        heads=[[0, 1, 2, 3]] * 2,
        hosts=["h0", "a0"],
        gpus=["H100-SXM-80GB", "A100-SXM-80GB"],
    )
    layout.save(tmp_path / "layout.json")
    env = {
        **stand_ins,
        "SLURM_JOB_NODELIST": "h0,a0,h1,a1",
        "GPUS_PER_NODE": "1",
        "DATA_PARALLEL": "2",
        "GPU_TYPES": "H100-SXM-80GB A100-SXM-80GB H100-SXM-80GB A100-SXM-80GB",
        "LAYOUT": str(tmp_path / "layout.json"),
    }
    res = _run(env)
    assert res.returncode == 0, res.stderr + res.stdout
    assert "--het-group" not in res.stdout
    hosts = {r: h for r, (h, _, cmd) in _rank_lines(res.stdout).items()}
    assert hosts == {0: "h0", 1: "a0", 2: "h1", 3: "a1"}  # replica 1 = the second node of each type
    assert "--context-parallel-size 2 " in res.stdout


def test_missing_gpu_types_is_one_clear_error(stand_ins):
    res = _run({**stand_ins, "SLURM_JOB_NODELIST": "n0"})
    assert res.returncode == 2 and res.stderr.strip().startswith("error: set GPU_TYPES")


def test_placements_unit():
    nodes = [
        {"name": n, "gpu": g, "count": 2}
        for n, g in (("h0", "H100"), ("h1", "H100"), ("a0", "A100"), ("a1", "A100"))
    ]
    assert [[n["name"] for n in rep] for rep in split_replicas(nodes, 2)] == [
        ["h0", "a0"],
        ["h1", "a1"],
    ]
    layout = make_layout(
        seq_length=16,
        num_attention_heads=2,
        num_query_groups=2,
        group_sizes=[3],
        segments=[[(0, 8)], [(8, 12)], [(12, 16)]],
        heads=[[0], [1], []],
        hosts=["a0", "h0", "h0"],
    )
    got = placements(layout, nodes, 2)
    assert got == [
        Placement(0, "a0", 0),
        Placement(1, "h0", 0),
        Placement(2, "h0", 1),
        Placement(3, "a1", 0),
        Placement(4, "h1", 0),
        Placement(5, "h1", 1),
    ]
    from megatron_hexiseq.errors import HexiSeqError

    with pytest.raises(HexiSeqError, match="cannot be split into 3 equal"):
        split_replicas(nodes, 3)
    with pytest.raises(HexiSeqError, match="host 'x9', which is not among"):
        placements(
            make_layout(
                seq_length=4,
                num_attention_heads=1,
                num_query_groups=1,
                group_sizes=[1],
                segments=[[(0, 4)]],
                heads=[[0]],
                hosts=["x9"],
            ),
            nodes,
        )


def test_dry_run_without_slurm_writes_nothing_in_the_working_folder(tmp_path):
    """No scontrol on PATH, no SLURM variables: HEXISEQ_NODES (a SLURM host list) gives the hosts,
    our own expander reads it, and every file goes to a fresh temporary WORKDIR."""
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    venv_bin = str(Path(sys.executable).parent)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env.update(
        {
            "PATH": f"{venv_bin}:/usr/bin:/bin",
            "PYTHON": sys.executable,
            "DRY_RUN": "1",
            "TMPDIR": str(tmp_path),
            "HEXISEQ_NODES": "gpu[01-02]",
            "GPUS_PER_NODE": "2",
            "GPU_TYPES": "H100-SXM-80GB A100-SXM-80GB",
            "MODEL_CONFIG": str(ROOT / "examples" / "models" / "gpt-tiny-gqa.yaml"),
            "PLAN_ARGS": "--time-limit 1 --reproducible",
            "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        }
    )
    assert shutil.which("scontrol", path=env["PATH"]) is None
    res = subprocess.run(
        ["bash", str(SBATCH), "--num-layers", "2"],
        capture_output=True,
        text=True,
        env=env,
        cwd=cwd,
        timeout=300,
    )
    assert res.returncode == 0, res.stderr + res.stdout
    assert "megatron_hexiseq.slurm hostnames 'gpu[01-02]'" in res.stdout
    assert list(cwd.iterdir()) == []  # nothing in the working folder
    workdirs = list(tmp_path.glob("hexiseq-dry-run-*"))
    assert len(workdirs) == 1 and (workdirs[0] / "layout.json").is_file()
    hosts = {h for h, _, _ in _rank_lines(res.stdout).values()}
    assert hosts == {"gpu01", "gpu02"}


def test_missing_inputs_fail_before_anything_is_written(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env.update(
        {
            "PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin",
            "PYTHON": sys.executable,
            "DRY_RUN": "1",
            "HEXISEQ_NODES": "n0 n1",
            "TMPDIR": str(tmp_path),
        }
    )
    for extra, match in (
        ({}, "set GPU_TYPES"),
        ({"GPU_TYPES": "H100-SXM-80GB"}, "set MODEL"),
        ({"GPU_TYPES": "H100-SXM-80GB", "MODEL": "gpt-7b"}, "set SEQ_LENGTH"),
        ({"GPU_TYPES": "H100-SXM-80GB", "LAYOUT": str(tmp_path / "none.json")}, "does not exist"),
    ):
        res = subprocess.run(
            ["bash", str(SBATCH)],
            capture_output=True,
            text=True,
            env={**env, **extra},
            cwd=tmp_path,
            timeout=60,
        )
        assert (
            res.returncode == 2 and res.stderr.strip().startswith("error: ") and match in res.stderr
        ), res.stderr
    assert list(tmp_path.iterdir()) == []


def test_layout_planned_with_hosts_is_reused(stand_ins, tmp_path):
    from megatron_hexiseq.cli import main

    cluster = ROOT / "examples" / "clusters" / "mixed-h100-a100.yaml"
    assert (
        main(
            [
                "plan",
                "--cluster",
                str(cluster),
                "--model",
                "gpt-3b",
                "--seq-length",
                "16384",
                "--hosts",
                "gpu[01-02]",
                "--time-limit",
                "1",
                "--format",
                "json",
                "-o",
                str(tmp_path / "layout.json"),
            ]
        )
        == 0
    )
    env = {
        **stand_ins,
        "SLURM_JOB_NODELIST": "gpu01,gpu02",
        "CLUSTER": str(cluster),
        "LAYOUT": str(tmp_path / "layout.json"),
    }
    res = _run(env)
    assert res.returncode == 0, res.stderr + res.stdout
    assert "megatron_hexiseq.slurm cluster --cluster" in res.stdout
    layout = Layout.load(tmp_path / "layout.json")
    assert {r: h for r, (h, _, _) in _rank_lines(res.stdout).items()} == {
        r.rank: r.host for r in layout.ranks
    }


def test_hostlist_expansion():
    from megatron_hexiseq.errors import HexiSeqError
    from megatron_hexiseq.slurm import expand_hostlist

    assert expand_hostlist("gpu[01-03,07],login1") == ["gpu01", "gpu02", "gpu03", "gpu07", "login1"]
    assert expand_hostlist("a b,c") == ["a", "b", "c"]
    assert expand_hostlist("r[1-2]n[0-1]") == ["r1n0", "r1n1", "r2n0", "r2n1"]
    for bad in ("", "gpu[1-", "gpu[a-b]", "gpu[3-1]"):
        with pytest.raises(HexiSeqError):
            expand_hostlist(bad)


def _dry_run_env(tmp_path, **extra) -> dict:
    """No scontrol, no SLURM: two hosts of 2 GPUs, the tiny model planned, files in WORKDIR."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env.update(
        {
            "PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin",
            "PYTHON": sys.executable,
            "DRY_RUN": "1",
            "HEXISEQ_NODES": "gpu[01-02]",
            "GPUS_PER_NODE": "2",
            "GPU_TYPES": "H100-SXM-80GB A100-SXM-80GB",
            "MODEL_CONFIG": str(ROOT / "examples" / "models" / "gpt-tiny-gqa.yaml"),
            "PLAN_ARGS": "--time-limit 1 --reproducible",
            "WORKDIR": str(tmp_path / "wd"),
            "SAVE": str(tmp_path / "ckpt"),
            "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
            **extra,
        }
    )
    return env


def test_requeue_replans_without_the_lost_gpu_and_resumes(tmp_path):
    """A first attempt plans 4 GPUs; the requeued attempt (same WORKDIR) loses GPU 0 of gpu01: it plans
    for the 3 left with the previous memory mode, logs old vs new, resumes --load, and starts gpu01's
    rank on its remaining GPU (CUDA_VISIBLE_DEVICES=1). EXCLUDE names a host the job did not get: a note."""
    first = subprocess.run(
        ["bash", str(SBATCH), "--num-layers", "2"],
        capture_output=True,
        text=True,
        env=_dry_run_env(tmp_path),
        cwd=tmp_path,
        timeout=300,
    )
    assert first.returncode == 0, first.stderr + first.stdout
    assert "no checkpoint in" in first.stdout and len(_rank_lines(first.stdout)) == 4
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").write_text("100\n")
    res = subprocess.run(
        ["bash", str(SBATCH), "--num-layers", "2"],
        capture_output=True,
        text=True,
        env=_dry_run_env(tmp_path, EXCLUDE="gpu01:0,gpu09"),
        cwd=tmp_path,
        timeout=300,
    )
    assert res.returncode == 0, res.stderr + res.stdout
    out, wd, ck = res.stdout, tmp_path / "wd", tmp_path / "ckpt"
    assert "note: --exclude gpu09: not in this allocation" in res.stderr
    assert f"+ cp {wd}/layout.json {wd}/layout-previous.json" in out
    assert re.search(
        r"^\+ megatron-hexiseq plan --cluster \S+/cluster-replica0-allocated.yaml --exclude gpu01:0 .*"
        r"--memory-mode distributed_optimizer --time-limit 1",
        out,
        re.M,
    )
    for line in (
        f"+ megatron-hexiseq show {wd}/layout.json --previous {wd}/layout-previous.json",
        "world size: 4 -> 3 (3 GPUs kept)",
        "ranks gone: gpu01:0 (H100-SXM-80GB)",
        "ranks added: none",
        "resume from its checkpoints: yes",
        f"+ # resuming {ck} at iteration 100",
    ):
        assert line in out, line
    layout = Layout.load(wd / "layout.json")
    assert layout.world_size == 3 and layout.meta["gpu_indices"] == {"gpu01": [1]}
    sruns = re.findall(r"^\+ srun (.*)$", out, re.M)
    assert [
        ("env CUDA_VISIBLE_DEVICES=1 bash" in s, "CUDA_VISIBLE_DEVICES" in s) for s in sruns
    ] == [(True, True), (False, False)]  # gpu01 keeps GPU 1 only; gpu02 lost nothing
    ranks = _rank_lines(out)
    assert sorted(ranks) == [0, 1, 2] and {r: h for r, (h, _, _) in ranks.items()} == {
        r.rank: r.host for r in layout.ranks
    }
    for _, renv, cmd in ranks.values():
        assert renv["WORLD_SIZE"] == "3" and f"--save {ck} --load {ck} " in cmd
        assert "--context-parallel-size 3 " in cmd


def test_requeue_refuses_a_layout_that_cannot_resume(tmp_path):
    """The previous run trained 1024 tokens; a restart asking for 2048 would not resume its checkpoint."""
    first = subprocess.run(
        ["bash", str(SBATCH)],
        capture_output=True,
        text=True,
        env=_dry_run_env(tmp_path),
        cwd=tmp_path,
        timeout=300,
    )
    assert first.returncode == 0, first.stderr + first.stdout
    res = subprocess.run(
        ["bash", str(SBATCH)],
        capture_output=True,
        text=True,
        env=_dry_run_env(tmp_path, SEQ_LENGTH="2048"),
        cwd=tmp_path,
        timeout=300,
    )
    assert res.returncode == 2, res.stderr + res.stdout
    assert (
        res.stderr.strip()
        .splitlines()[-1]
        .startswith(f"error: {tmp_path}/wd/layout.json cannot resume checkpoints written under")
    )
    assert "seq_length 1024 -> 2048" in res.stderr and "+ srun" not in res.stdout
