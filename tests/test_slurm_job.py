"""The SLURM launcher with a job (``JOB=job.json``), layer (a) (subprocesses, no ranks).

``scripts/slurm/hexiseq.sbatch`` in DRY_RUN mode with a job built by hand for two hosts (two H100s
listed high GPU first as domain 0 with 6 micro-batches, two A100s as domain 1 with 2): the log
lists each domain's ranks; the rank table puts process ``k`` on cluster rank ``run_ranks[k]``'s
host and GPU; every rank's command has ``--hexiseq-job``, ``--context-parallel-size`` = world
size and the job's sequence length, global and micro-batch sizes. Refused in one line: a job and
a layout together, ``DATA_PARALLEL`` with a job, a fixed job with ``EXCLUDE``, a job planned for
other hosts. With ``MEGATRON_LM`` set (a Megatron-LM ``core_v0.16.1`` checkout), every rank's
command and environment of a job in each memory mode a job can choose (``run_config.AUTO_MODES``)
pass Megatron-LM's real ``parse_args`` + ``validate_args`` (``CUDA_DEVICE_MAX_CONNECTIONS`` 8 for
Megatron-FSDP, 1 otherwise). A job over TP bundles of 2 (one bundle per host, the H100 bundle
listed GPU 1 first): the rank table keeps each bundle on its host, TP rank order first
(Megatron's TP groups: consecutive ranks), every command has ``--tensor-model-parallel-size 2`` and
``--context-parallel-size`` = world size / 2, and (with ``MEGATRON_LM``) passes ``validate_args``
in both memory modes.
"""

from __future__ import annotations

import sys

import pytest
import test_slurm
from test_slurm import _rank_lines, _run
from test_slurm_megatron_args import MEGATRON_LM, MODEL_ARGV, validate

from megatron_hexiseq.cluster import cluster_from_dict, cluster_to_dict
from megatron_hexiseq.job import Domain, JobPlan
from megatron_hexiseq.layout import make_layout
from megatron_hexiseq.model import get_model
from megatron_hexiseq.run_config import AUTO_MODES, TrainOptions, options_record

stand_ins = test_slurm.stand_ins  # the fixture: stand-in srun/scontrol on PATH, DRY_RUN=1
SEQ = 16384
CLUSTER = cluster_from_dict(
    {
        "name": "two-hosts",
        "nodes": [
            {"name": "gpu1", "gpu": "H100-SXM-80GB", "count": 2, "network_GBps": 25},
            {"name": "gpu2", "gpu": "A100-SXM-80GB", "count": 2, "network_GBps": 25},
        ],
    }
)
MODEL = get_model("llama3-8b", overrides={"seq_length": SEQ})


def _pair(host: str, gpu: str, options: dict):
    return make_layout(
        seq_length=SEQ,
        num_attention_heads=MODEL.num_attention_heads,
        num_query_groups=MODEL.num_query_groups,
        group_sizes=[2],
        segments=[[(0, 9000)], [(9000, SEQ)]],
        heads=[list(range(16)), list(range(16, 32))],
        hosts=[host] * 2,
        gpus=[gpu] * 2,
        meta={"options": options},
    )


def _job(
    memory_mode: str = "distributed_optimizer", recompute: bool = False, tp: int = 1
) -> JobPlan:
    """The H100 pair (GPU 1 first) with 6 micro-batches, the A100 pair with 2: each a two-rank
    layout, or with ``tp = 2`` one TP bundle (llama3-8b: 16 / 4 heads per TP rank)."""
    options = options_record(
        TrainOptions(memory_mode=memory_mode, recompute=recompute, tensor_model_parallel_size=tp),
        [],
    )

    def bundle(host: str, gpu: str):
        return make_layout(
            seq_length=SEQ,
            num_attention_heads=MODEL.num_attention_heads // 2,
            num_query_groups=MODEL.num_query_groups // 2,
            group_sizes=[1],
            segments=[[(0, SEQ)]],
            heads=[list(range(16))],
            hosts=[host],
            gpus=[gpu],
            tensor_model_parallel_size=2,
            meta={"options": options},
        )

    layout = _pair if tp == 1 else (lambda host, gpu, _: bundle(host, gpu))
    return JobPlan(
        global_batch=8,
        seq_length=SEQ,
        model=MODEL.to_dict(),
        cluster=cluster_to_dict(CLUSTER),
        options=options,
        domains=(
            Domain(ranks=(1, 0), micro_batches=6, layout=layout("gpu1", "H100-SXM-80GB", options)),
            Domain(ranks=(2, 3), micro_batches=2, layout=layout("gpu2", "A100-SXM-80GB", options)),
        ),
    )


def _env(stand_ins: dict, tmp_path, job_path, **extra: str) -> dict:
    return {
        **stand_ins,
        "WORKDIR": str(tmp_path / "work"),
        "HEXISEQ_NODES": "gpu1 gpu2",
        "GPU_TYPES": "H100-SXM-80GB A100-SXM-80GB",
        "GPUS_PER_NODE": "2",
        "JOB": str(job_path),
        "CUDA_DEVICE_MAX_CONNECTIONS": "1",  # must not reach an FSDP run
        **extra,
    }


def test_dry_run_prints_each_domain_and_its_rank_commands(stand_ins, tmp_path):
    job = _job()
    job.save(tmp_path / "job.json")
    res = _run(_env(stand_ins, tmp_path, tmp_path / "job.json"), *MODEL_ARGV)
    assert res.returncode == 0, res.stderr + res.stdout
    assert "+ # domain 0: 2 x H100-SXM-80GB, ranks 1@gpu1:1 0@gpu1:0, 6 micro-batches" in res.stdout
    assert "+ # domain 1: 2 x A100-SXM-80GB, ranks 2@gpu2:0 3@gpu2:1, 2 micro-batches" in res.stdout
    ranks = _rank_lines(res.stdout)
    assert sorted(ranks) == [0, 1, 2, 3]
    for k, (host, env, cmd) in ranks.items():
        dev = job.cluster_spec.devices[job.run_ranks[k]]
        assert (host, env["LOCAL_RANK"], env["WORLD_SIZE"]) == (dev.node, str(dev.local_index), "4")
        words = cmd.split()
        for flag, value in (
            ("--hexiseq-job", str(tmp_path / "job.json")),
            ("--context-parallel-size", "4"),
            ("--seq-length", str(SEQ)),
            ("--global-batch-size", "8"),
            ("--micro-batch-size", "1"),
        ):
            assert words[words.index(flag) + 1] == value, flag
        assert "--hexiseq-layout" not in words and "--use-distributed-optimizer" in words


def test_a_tp_job_runs_bundles_on_their_hosts(stand_ins, tmp_path):
    job = _job(tp=2)
    job.save(tmp_path / "job.json")
    res = _run(_env(stand_ins, tmp_path, tmp_path / "job.json"), *MODEL_ARGV)
    assert res.returncode == 0, res.stderr + res.stdout
    assert (
        "+ # domain 0: 2 x H100-SXM-80GB in 1 TP bundles of 2, ranks 0@gpu1:1 1@gpu1:0"
        in res.stdout
    )
    ranks = _rank_lines(res.stdout)
    where = {k: (host, env["LOCAL_RANK"]) for k, (host, env, _) in ranks.items()}
    assert where == {0: ("gpu1", "1"), 1: ("gpu1", "0"), 2: ("gpu2", "0"), 3: ("gpu2", "1")}
    for _, _, cmd in ranks.values():
        words = cmd.split()
        assert words[words.index("--tensor-model-parallel-size") + 1] == "2"
        assert words[words.index("--context-parallel-size") + 1] == "2"
        assert "--sequence-parallel" in words and "--hexiseq-job" in words


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"LAYOUT": "LAYOUT"}, "give LAYOUT (one layout on every domain) or a job"),
        ({"DATA_PARALLEL": "2"}, "a job plans its own domains: drop DATA_PARALLEL"),
        ({"EXCLUDE": "gpu2:1"}, "JOB was planned with every GPU"),
        ({"HEXISEQ_NODES": "gpu1 gpu3"}, "host 'gpu2', which is not in the allocation"),
    ],
)
def test_job_refusals_are_one_line(stand_ins, tmp_path, extra, message):
    _job().save(tmp_path / "job.json")
    if "LAYOUT" in extra:
        extra = {"LAYOUT": str(tmp_path / "job.json")}
    res = _run(_env(stand_ins, tmp_path, tmp_path / "job.json", **extra), *MODEL_ARGV)
    assert res.returncode == 2, res.stdout
    assert message in res.stderr and res.stderr.count("\n") == 1, res.stderr


@pytest.mark.skipif(not MEGATRON_LM, reason="set MEGATRON_LM=<Megatron-LM core_v0.16.1 checkout>")
def test_job_commands_pass_megatron_validate_args_in_every_memory_mode(stand_ins, tmp_path):
    commands: list[tuple[dict, list[str]]] = []
    jobs = [(f"{m}{r}", _job(m, r), m, r) for m, r in AUTO_MODES] + [
        (f"tp-{m}", _job(m, tp=2), m, False) for m in ("distributed_optimizer", "fsdp")
    ]
    for name, job, mode, recompute in jobs:
        folder = tmp_path / name
        folder.mkdir()
        job.save(folder / "job.json")
        res = _run(_env(stand_ins, folder, folder / "job.json"), *MODEL_ARGV)
        assert res.returncode == 0, res.stderr + res.stdout
        prefix = f"{sys.executable} -m megatron_hexiseq.pretrain_gpt "
        run = [
            (env, cmd[len(prefix) :].split()) for _, env, cmd in _rank_lines(res.stdout).values()
        ]
        assert len(run) == 4
        for env, argv in run:
            fsdp = mode == "fsdp"
            assert ("--use-megatron-fsdp" in argv) == fsdp, mode
            assert env["CUDA_DEVICE_MAX_CONNECTIONS"] == ("8" if fsdp else "1")
            assert ("--recompute-granularity" in argv) == recompute
        commands += run
    verdicts, _ = validate(commands, tmp_path)
    failed = [(c[0], v) for c, v in zip(commands, verdicts) if v[0] is not None]
    assert not failed, failed[:3]
