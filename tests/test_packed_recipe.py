"""The packed long-context recipe of docs/megatron.md, end to end up to Megatron's argument checks.

Layer (a) (subprocesses, no ranks):
- ``megatron-hexiseq doc-lengths`` reads a Megatron indexed dataset written by Megatron's own
  ``IndexedDatasetBuilder`` (documents of one and of several sequences, an empty one) and writes
  each document's length; a missing prefix, a blend weight and a clobbered input are one line,
  exit 2, nothing written.
- ``packed_checks``: each refused combination is one line naming the flag.
- With ``MEGATRON_LM``: the recipe's sbatch dry run (``PLAN_ARGS="--doc-lengths L.json"``,
  ``HEXISEQ_ARGS="--hexiseq-batch-plan"``, ``--reset-attention-mask --reset-position-ids
  --eod-mask-loss``) plans a layout for the lengths (``planner.documents`` recorded) and every
  rank's command passes Megatron-LM's real ``parse_args`` + ``validate_args``; the same commands
  with ``--hybrid-context-parallel``, or without ``--reset-attention-mask``, are refused in one line
  by the post-parse hook.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import test_slurm
from test_slurm import _rank_lines, _run

from megatron_hexiseq.cli import main
from megatron_hexiseq.errors import HexiSeqError
from megatron_hexiseq.megatron.packed_checks import refuse_packed_combinations
from megatron_hexiseq.varlen.packing import heavy_tailed_lengths

ROOT = Path(__file__).resolve().parents[1]
MEGATRON_LM = os.environ.get("MEGATRON_LM")
stand_ins = test_slurm.stand_ins  # the fixture: stand-in srun/scontrol on PATH, DRY_RUN=1


def _write_dataset(prefix: Path) -> list[int]:
    """Megatron's own writer: documents of 5, 3 + 4 (two sequences), 1 and 9 tokens, and an empty
    one; returns the expected document lengths."""
    import torch
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    b = IndexedDatasetBuilder(str(prefix) + ".bin", dtype=np.int32)
    for seqs in ([5], [3, 4], [1], [], [9]):
        for n in seqs:
            b.add_item(torch.arange(n, dtype=torch.int32))
        if seqs:
            b.end_document()
    b.finalize(str(prefix) + ".idx")
    return [5, 7, 1, 9]


def test_doc_lengths_reads_megatrons_indexed_dataset(tmp_path, capsys) -> None:
    prefix = tmp_path / "corpus_text_document"
    want = _write_dataset(prefix)
    out = tmp_path / "L.json"
    assert main(["doc-lengths", "--data-path", str(prefix), "-o", str(out)]) == 0
    assert json.loads(out.read_text()) == want
    assert "4 documents, 22 tokens" in capsys.readouterr().out
    both = tmp_path / "both.json"
    assert main(["doc-lengths", "--data-path", str(prefix), str(prefix), "-o", str(both)]) == 0
    assert json.loads(both.read_text()) == want + want
    for argv, message in (
        (["--data-path", str(tmp_path / "nope")], "nope.idx does not exist"),
        (["--data-path", "0.5", str(prefix)], "looks like a blend weight"),
    ):
        bad = tmp_path / "bad.json"
        assert main(["doc-lengths", *argv, "-o", str(bad)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and message in err[0], err
        assert not bad.exists()
    assert main(["doc-lengths", "--data-path", str(prefix), "-o", str(prefix) + ".idx"]) == 2
    assert "is also an input" in capsys.readouterr().err
    assert json.loads(out.read_text()) == want  # inputs untouched


@pytest.mark.parametrize(
    "flags, message",
    [
        ({"hexiseq_batch_plan": True}, "--hexiseq-batch-plan plans each micro-batch"),
        ({"hybrid_context_parallel": True, "reset_attention_mask": True}, "--hybrid-context"),
        (
            {"reset_attention_mask": True, "pipeline_model_parallel_size": 2},
            "--reset-attention-mask with --hexiseq-layout does not support pipeline",
        ),
        ({"dataloader_type": "external"}, "--dataloader-type external"),
    ],
)
def test_packed_combinations_are_refused_in_one_line(flags: dict, message: str) -> None:
    with pytest.raises(HexiSeqError, match=message) as e:
        refuse_packed_combinations(argparse.Namespace(**flags))
    assert "\n" not in str(e.value)
    ok = {"hexiseq_batch_plan": True, "reset_attention_mask": True, "dataloader_type": "single"}
    refuse_packed_combinations(argparse.Namespace(**ok))


# the Megatron flags of docs/megatron.md's recipe, after the script's own (llama3-8b's shape)
RECIPE_ARGV = (
    "--num-layers 32 --hidden-size 4096 --num-attention-heads 32 --group-query-attention "
    "--num-query-groups 8 --ffn-hidden-size 14336 --swiglu --normalization RMSNorm "
    "--position-embedding-type rope --max-position-embeddings 131072 --micro-batch-size 1 "
    "--global-batch-size 16 --lr 1e-4 --train-iters 10 --bf16 --mock-data "
    "--tokenizer-type NullTokenizer --vocab-size 128256 "
    "--reset-attention-mask --reset-position-ids --eod-mask-loss"
).split()


@pytest.mark.skipif(not MEGATRON_LM, reason="set MEGATRON_LM=<Megatron-LM core_v0.16.1 checkout>")
def test_recipe_dry_run_passes_megatron_validate_args(stand_ins, tmp_path) -> None:
    from test_slurm_megatron_args import VALIDATE

    lengths = tmp_path / "L.json"
    lengths.write_text(json.dumps(heavy_tailed_lengths(2000, seed=4, median=1500)))
    env = {
        **stand_ins,
        "WORKDIR": str(tmp_path / "work"),
        "HEXISEQ_NODES": "gpu1 gpu2",
        "GPU_TYPES": "H100-SXM-80GB A100-SXM-80GB",
        "GPUS_PER_NODE": "4",
        "MODEL": "llama3-8b",
        "SEQ_LENGTH": "16384",
        "PLAN_ARGS": f"--time-limit 2 --reproducible --doc-lengths {lengths}",
        "HEXISEQ_ARGS": "--hexiseq-batch-plan",
    }
    res = _run(env, *RECIPE_ARGV)
    assert res.returncode == 0, res.stderr + res.stdout
    layout = json.loads((tmp_path / "work" / "layout.json").read_text())
    assert layout["planner"]["documents"]["chosen"] == layout["meta"]["chosen"]
    ranks = _rank_lines(res.stdout)
    assert sorted(ranks) == list(range(8))
    prefix = f"{sys.executable} -m megatron_hexiseq.pretrain_gpt "
    commands = []
    for _, renv, cmd in ranks.values():
        argv = cmd[len(prefix) :].split()
        assert "--hexiseq-batch-plan" in argv and "--reset-attention-mask" in argv
        commands.append((renv, argv))
    first_env, first = commands[0]
    refused = [
        (first_env, first + ["--hybrid-context-parallel"]),
        (first_env, [a for a in first if a != "--reset-attention-mask"]),
    ]
    path = tmp_path / "commands.json"
    path.write_text(json.dumps(commands + refused))
    run_env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), str(MEGATRON_LM)]),
        "PYTHONWARNINGS": "ignore",
    }
    out = subprocess.run(
        [sys.executable, "-c", VALIDATE, str(path)],
        capture_output=True,
        text=True,
        env=run_env,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    verdicts = json.loads(out.stdout.strip().splitlines()[-1])
    assert all(v[0] is None for v in verdicts[: len(commands)]), verdicts[:2]
    hybrid, no_docs = verdicts[len(commands) :]
    assert hybrid[0].startswith("HexiSeqError: --hybrid-context-parallel"), hybrid
    assert no_docs[0].startswith("HexiSeqError: --hexiseq-batch-plan plans each"), no_docs
