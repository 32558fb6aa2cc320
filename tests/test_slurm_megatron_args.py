"""SLURM launcher against Megatron-LM's own argument checks, layer (a) (subprocesses, no ranks).

``scripts/slurm/hexiseq.sbatch`` in DRY_RUN mode plans a layout for every memory mode the planner
can pick (``run_config.AUTO_MODES``: distributed optimizer or Megatron-FSDP, each with and without
full recompute; forced with ``PLAN_ARGS="--memory-mode M [--recompute]"``) and once with the
planner's own choice for llama3-8b at 128K tokens on four H100s (Megatron-FSDP with recompute).
Every rank's printed command line and environment then go through the real Megatron-LM
``parse_args`` (with the plugin's ``extra_args_provider``) and ``validate_args`` of the shared
snapshot, on a Hopper GPU as far as ``validate_args`` can tell (``get_device_arch_version`` = 9:
the architectures where ``CUDA_DEVICE_MAX_CONNECTIONS`` matters). Megatron-FSDP needs
``CUDA_DEVICE_MAX_CONNECTIONS`` other than 1, context parallelism without FSDP needs exactly 1:
a launcher that exports 1 for every run fails here.

Needs ``MEGATRON_LM`` (a Megatron-LM ``core_v0.16.1`` checkout; skipped when unset). About 40 s.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import test_slurm
from test_slurm import _rank_lines, _run

from megatron_hexiseq.run_config import AUTO_MODES

ROOT = Path(__file__).resolve().parents[1]
MEGATRON_LM = os.environ.get("MEGATRON_LM")
pytestmark = pytest.mark.skipif(
    not MEGATRON_LM, reason="set MEGATRON_LM=<Megatron-LM core_v0.16.1 checkout>"
)

# llama3-8b's shape, the Megatron flags a user passes after the script's own
MODEL_ARGV = (
    "--num-layers 32 --hidden-size 4096 --num-attention-heads 32 --group-query-attention "
    "--num-query-groups 8 --ffn-hidden-size 14336 --swiglu --normalization RMSNorm "
    "--position-embedding-type rope --max-position-embeddings 131072 --micro-batch-size 1 "
    "--global-batch-size 8 --lr 1e-4 --train-iters 10 --bf16 --mock-data "
    "--tokenizer-type NullTokenizer --vocab-size 128256"
).split()

# parse + validate every (env, argv) of a JSON list with Megatron-LM's own functions; one JSON
# line out: the assertion message per command, or null
VALIDATE = """if True:
    import json, os, sys
    import megatron.training.arguments as margs
    from megatron_hexiseq.megatron import plugin
    margs.get_device_arch_version = lambda: 9  # Hopper: a CUDA-only query inside validate_args
    verdicts = []
    for env, argv in json.load(open(sys.argv[1])):
        os.environ.update(env)
        sys.argv = ["pretrain_gpt.py"] + argv
        args = margs.parse_args(extra_args_provider=plugin.extra_args_provider(None))
        try:
            margs.validate_args(args, {"tokenizer_type": "GPT2BPETokenizer"})
            verdicts.append(None)
        except AssertionError as e:
            verdicts.append(str(e))
    print(json.dumps(verdicts))
"""

stand_ins = test_slurm.stand_ins  # the fixture: stand-in srun/scontrol on PATH, DRY_RUN=1

RUNS = {
    **{
        f"{mode}{'+recompute' if recompute else ''}": (
            "gpu1 gpu2",
            "H100-SXM-80GB A100-SXM-80GB",
            "16384",
            f"--memory-mode {mode}{' --recompute' if recompute else ''}",
        )
        for mode, recompute in AUTO_MODES
    },
    "planner's choice": ("gpu1", "H100-SXM-80GB", "131072", ""),
}


def _dry_run(stand_ins: dict, tmp_path: Path, name: str) -> list[tuple[dict, list[str]]]:
    hosts, gpus, seq, plan_args = RUNS[name]
    env = {
        **stand_ins,
        "WORKDIR": str(tmp_path / name.replace(" ", "_").replace("'", "")),
        "HEXISEQ_NODES": hosts,
        "GPU_TYPES": gpus,
        "GPUS_PER_NODE": "4",
        "MODEL": "llama3-8b",
        "SEQ_LENGTH": seq,
        "PLAN_ARGS": f"--time-limit 2 --reproducible {plan_args}".strip(),
        # a 1 exported by the submitting shell must not reach an FSDP run
        "CUDA_DEVICE_MAX_CONNECTIONS": "1",
    }
    res = _run(env, *MODEL_ARGV)
    assert res.returncode == 0, res.stderr + res.stdout
    ranks = _rank_lines(res.stdout)
    assert sorted(ranks) == list(range(len(hosts.split()) * 4))
    prefix = f"{sys.executable} -m megatron_hexiseq.pretrain_gpt "
    out = []
    for _, renv, cmd in ranks.values():
        assert cmd.startswith(prefix)
        out.append((renv, cmd[len(prefix) :].split()))
    return out


def test_dry_run_commands_pass_megatron_validate_args_in_every_memory_mode(stand_ins, tmp_path):
    commands: list[tuple[dict, list[str]]] = []
    fsdp: list[bool] = []
    for name in RUNS:
        run = _dry_run(stand_ins, tmp_path, name)
        uses_fsdp = {"--use-megatron-fsdp" in argv for _, argv in run}
        assert len(uses_fsdp) == 1
        if name == "planner's choice":  # the planner picks Megatron-FSDP for llama3-8b at 128K
            assert uses_fsdp == {True}, name
        else:
            assert uses_fsdp == {name.startswith("fsdp")}, name
            assert ("--recompute-granularity" in run[0][1]) == name.endswith("+recompute"), name
        commands += run
        fsdp += [uses_fsdp == {True}] * len(run)
    path = tmp_path / "commands.json"
    path.write_text(json.dumps(commands))
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), str(MEGATRON_LM)]),
        "PYTHONWARNINGS": "ignore",
    }
    res = subprocess.run(
        [sys.executable, "-c", VALIDATE, str(path)],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    verdicts = json.loads(res.stdout.strip().splitlines()[-1])
    failed = [(c[0], v) for c, v in zip(commands, verdicts) if v is not None]
    assert not failed, failed[:3]
    assert any(fsdp) and not all(fsdp)
    for (renv, _), uses_fsdp in zip(commands, fsdp):  # no FSDP rank gets 1, every other rank 1
        assert renv["CUDA_DEVICE_MAX_CONNECTIONS"] == ("8" if uses_fsdp else "1"), renv
