"""SLURM launcher against Megatron-LM's own argument checks, layer (a) (subprocesses, no ranks).

``scripts/slurm/hexiseq.sbatch`` in DRY_RUN mode plans a layout for every memory mode the planner
can pick (``run_config.AUTO_MODES``: distributed optimizer or Megatron-FSDP, each with and without
full recompute; forced with ``PLAN_ARGS="--memory-mode M [--recompute]"``) and once with the
planner's own choice for llama3-8b at 128K tokens on four H100s (Megatron-FSDP with recompute),
and twice over TP bundles (``TENSOR_PARALLEL`` 2 with the distributed optimizer, 4 with FSDP:
``--tensor-model-parallel-size``, ``--sequence-parallel`` and CP = GPUs / TP).
Every rank's printed command line and environment then go through the real Megatron-LM
``parse_args`` (with the plugin's ``extra_args_provider`` and its post-parse hook) and
``validate_args`` of the shared snapshot, on a Hopper GPU as far as ``validate_args`` can tell (``get_device_arch_version`` = 9:
the architectures where ``CUDA_DEVICE_MAX_CONNECTIONS`` matters). Megatron-FSDP needs
``CUDA_DEVICE_MAX_CONNECTIONS`` other than 1, context parallelism without FSDP needs exactly 1:
a launcher that exports 1 for every run fails here. The same parse checks the post-parse hook's
decisions on Megatron-LM's real flags: the dataloader's dense attention mask is off for every
HexiSeq run (rank 0 says so once, with its size: 16 GiB per GPU at 128K), and CUDA graphs and
YaRN RoPE are refused with one line naming the flag.

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
# line out: per command, the error (validate_args' assertion or the plugin's one-line refusal)
# or null, and the parsed create_attention_mask_in_dataloader
VALIDATE = """if True:
    import json, os, sys
    import megatron.training.arguments as margs
    from megatron_hexiseq.errors import HexiSeqError
    from megatron_hexiseq.megatron import plugin
    margs.get_device_arch_version = lambda: 9  # Hopper: a CUDA-only query inside validate_args
    verdicts = []
    for env, argv in json.load(open(sys.argv[1])):
        os.environ.update(env)
        sys.argv = ["pretrain_gpt.py"] + argv
        try:
            args = margs.parse_args(extra_args_provider=plugin.extra_args_provider(None))
            margs.validate_args(args, {"tokenizer_type": "GPT2BPETokenizer"})
            verdicts.append([None, args.create_attention_mask_in_dataloader])
        except (AssertionError, HexiSeqError) as e:
            verdicts.append([f"{type(e).__name__}: {e}", None])
    print(json.dumps(verdicts))
"""

# flags a HexiSeq run refuses at argument parsing, and the start of each one-line refusal
REFUSED = {
    "--cuda-graph-impl local": "HexiSeqError: --cuda-graph-impl local: HexiSeq attention does not",
    "--cuda-graph-impl transformer_engine": "HexiSeqError: --cuda-graph-impl transformer_engine:",
    "--enable-cuda-graph": "HexiSeqError: --enable-cuda-graph: HexiSeq attention does not run",
    "--external-cuda-graph": "HexiSeqError: --external-cuda-graph: HexiSeq attention does not",
    "--rope-type yarn": "HexiSeqError: --rope-type yarn: HexiSeq's layout RoPE does not",
    "--init-model-with-meta-device": "HexiSeqError: --init-model-with-meta-device: HexiSeq needs",
    "--qk-clip": "HexiSeqError: --qk-clip: HexiSeq attention does not report each head's",
    "--log-max-attention-logit": "HexiSeqError: --log-max-attention-logit: HexiSeq attention",
    "--attention-dropout 0.1": "HexiSeqError: --attention-dropout 0.1: HexiSeq attention is exact",
    "--overlap-moe-expert-parallel-comm": "HexiSeqError: --overlap-moe-expert-parallel-comm: its",
}

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
    "planner's choice": ("gpu1 gpu2", "H100-SXM-80GB", "131072", ""),
    # TP bundles (TENSOR_PARALLEL): Megatron's TP + sequence parallelism with HexiSeq's CP
    "distributed_optimizer tp2": (
        "gpu1 gpu2",
        "H100-SXM-80GB A100-SXM-80GB",
        "16384",
        "--memory-mode distributed_optimizer",
        {"TENSOR_PARALLEL": "2"},
    ),
    "fsdp tp4": (
        "gpu1 gpu2",
        "H100-SXM-80GB A100-SXM-80GB",
        "16384",
        "--memory-mode fsdp",
        {"TENSOR_PARALLEL": "4"},
    ),
}


def validate(
    commands: list[tuple[dict, list[str]]], tmp_path: Path
) -> tuple[list, subprocess.CompletedProcess]:
    """Every ``(env, argv)`` through Megatron-LM's ``parse_args`` + ``validate_args`` (``VALIDATE``,
    one fresh interpreter): per command ``[error or None, create_attention_mask_in_dataloader]``."""
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
    return json.loads(res.stdout.strip().splitlines()[-1]), res


def _dry_run(stand_ins: dict, tmp_path: Path, name: str) -> list[tuple[dict, list[str]]]:
    hosts, gpus, seq, plan_args, *extra = RUNS[name]
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
        **(extra[0] if extra else {}),
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
        tp = int(name[-1]) if " tp" in name else 1  # the layout's bundles, CP = 8 / TP
        for _, argv in run:
            got = int(argv[argv.index("--tensor-model-parallel-size") + 1]) if tp > 1 else 1
            assert got == tp and argv[argv.index("--context-parallel-size") + 1] == str(8 // tp)
            assert ("--sequence-parallel" in argv) == (tp > 1), name
        commands += run
        fsdp += [uses_fsdp == {True}] * len(run)
    # the same command lines with a flag HexiSeq refuses, then rank 0 of the first run again
    refused = [(commands[0][0], commands[0][1] + flag.split()) for flag in REFUSED]
    verdicts, res = validate(commands + refused + commands[:1], tmp_path)
    failed = [(c[0], v) for c, v in zip(commands, verdicts) if v[0] is not None]
    assert not failed, failed[:3]
    assert any(fsdp) and not all(fsdp)
    for (renv, _), uses_fsdp in zip(commands, fsdp):  # no FSDP rank gets 1, every other rank 1
        assert renv["CUDA_DEVICE_MAX_CONNECTIONS"] == ("8" if uses_fsdp else "1"), renv
    # Megatron's default would build a [mbs, 1, S, S] mask; the post-parse hook turned it off,
    # and rank 0 said so once per parse (a refused run stops before)
    assert all(v[1] is False for v in verdicts[: len(commands)])
    said = res.stdout.count("hexiseq: not building the dataloader's attention mask")
    assert said == sum(renv["RANK"] == "0" for renv, _ in commands) + 1
    assert "(it would take 16.0 GiB per GPU" in res.stdout  # micro-batch 1 at 131072 tokens
    for (flag, message), (error, _) in zip(REFUSED.items(), verdicts[len(commands) :]):
        assert error is not None and error.startswith(message), (flag, error)
        assert any(
            x in error for x in ("drop", "use --rope-type rope", "pass --attention-dropout 0")
        )
    assert verdicts[-1] == [None, False]
