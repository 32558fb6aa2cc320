"""Megatron integration against the real Megatron-LM ``core_v0.16.1``: layer (b), 2 gloo ranks,
plus ``pretrain_gpt.py --help`` in a fresh interpreter.

Needs ``MEGATRON_LM`` = a Megatron-LM checkout at tag ``core_v0.16.1`` (``scripts/test.sh`` unpacks
the snapshot in ``../shared/megatron-lm/`` and sets it; skipped only when it is unset) and
Megatron-LM's own dependencies (``pip install -e .[megatron-lm]``, part of the ``test`` extra):
without them the test FAILS with the import error. It runs Megatron-LM's own
``parse_args``/``validate_args`` with our ``extra_args_provider``, its ``model_provider`` and
``gpt_builders`` through ``plugin.model_provider``, and checks: every layer got
``HexiSeqCoreAttention``, RoPE follows the layout, ``pretrain_gpt.get_batch_on_this_cp_rank``
slices by the layout, and the start-up checks reject a wrong run with their messages; and that
``--help`` of the patched script and of ``python -m megatron_hexiseq.pretrain_gpt`` lists the
``--hexiseq-*`` flags. (CUDA-only corners of Megatron-LM are stubbed in the test:
``get_device_arch_version``.)
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_hexiseq.layout import make_layout
from megatron_hexiseq.testbed.spawn import run_ranks

MEGATRON_LM = os.environ.get("MEGATRON_LM")
pytestmark = pytest.mark.skipif(
    not MEGATRON_LM, reason="set MEGATRON_LM=<Megatron-LM core_v0.16.1 checkout>"
)

# one A2A group of 2 ranks: uneven tokens (24 vs 24 in 2 + 1 segments) and heads (3 vs 5)
LAYOUT = make_layout(
    seq_length=48,
    num_attention_heads=8,
    num_query_groups=2,
    group_sizes=[2],
    segments=[[(0, 6), (30, 48)], [(6, 30)]],
    heads=[[0, 1, 2], [3, 4, 5, 6, 7]],
)
ARGV = (
    "--num-layers 4 --hidden-size 64 --num-attention-heads 8 --group-query-attention "
    "--num-query-groups 2 --ffn-hidden-size 96 --swiglu --normalization RMSNorm "
    "--position-embedding-type rope --seq-length 48 --max-position-embeddings 48 "
    "--micro-batch-size 1 --global-batch-size 1 --lr 1e-3 --train-iters 1 --transformer-impl local "
    "--context-parallel-size 2 --cp-comm-type hexiseq --calculate-per-token-loss "
    "--hexiseq-kernel reference --use-cpu-initialization --no-gradient-accumulation-fusion "
    "--attention-dropout 0 --hidden-dropout 0 --disable-bias-linear "
    "--no-create-attention-mask-in-dataloader --mock-data --tokenizer-type NullTokenizer "
    "--vocab-size 128 --no-rope-fusion --no-masked-softmax-fusion --no-bias-dropout-fusion "
    "--no-persist-layer-norm"
).split()


def _parse(argv: list[str], rank: int, world: int):
    import megatron.training.arguments as margs

    from megatron_hexiseq.megatron import plugin

    margs.get_device_arch_version = lambda: 9  # CUDA-only query inside validate_args
    sys.argv = ["pretrain_gpt.py"] + argv
    args = margs.parse_args(extra_args_provider=plugin.extra_args_provider(None))
    args.rank, args.world_size = rank, world
    margs.validate_args(args, {"tokenizer_type": "GPT2BPETokenizer"})
    args.padded_vocab_size = 128
    return args


def _worker(rank: int, world: int, layout_path: str) -> dict:
    import pretrain_gpt as stock
    import torch
    from megatron.core import parallel_state as mpu
    from megatron.core.process_groups_config import ProcessGroupCollection
    from megatron.training.global_vars import set_args

    from megatron_hexiseq.errors import HexiSeqError
    from megatron_hexiseq.megatron import plugin
    from megatron_hexiseq.megatron.core_attention import HexiSeqCoreAttention
    from megatron_hexiseq.megatron.rope import LayoutRotaryEmbedding

    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    out: dict = {"errors": []}
    # start-up checks reject wrong runs (each before any collective, identically on every rank)
    for change, drop in (
        (["--seq-length", "96", "--max-position-embeddings", "96"], []),
        ([], ["--calculate-per-token-loss"]),
    ):
        argv = [a for a in ARGV if a not in drop] + ["--hexiseq-layout", layout_path] + change
        args = _parse(argv, rank, world)
        try:
            plugin.setup(args, None, cp_group=object())
        except HexiSeqError as e:
            out["errors"].append(str(e))
    args = _parse(ARGV + ["--hexiseq-layout", layout_path], rank, world)
    set_args(args)
    mpu.initialize_model_parallel(
        tensor_model_parallel_size=1, context_parallel_size=args.context_parallel_size
    )
    provider = plugin.model_provider(stock.model_provider, stock.gpt_builder, stock)
    model = provider(
        pre_process=True,
        post_process=True,
        config=None,
        pg_collection=ProcessGroupCollection.use_mpu_process_groups(),
    )
    out["hexiseq_layers"] = sum(isinstance(m, HexiSeqCoreAttention) for m in model.modules())
    out["rope"] = isinstance(model.rotary_pos_emb, LayoutRotaryEmbedding)
    out["tokens"] = stock.get_batch(iter([{"tokens": torch.arange(48).view(1, 48)}]))[0][0].tolist()
    mpu.destroy_model_parallel()
    return out


def _worker_on_megatron_lm(rank: int, world: int, checkout: str, layout_path: str) -> dict:
    sys.path.insert(
        0, checkout
    )  # this fresh process imports Megatron-LM's megatron/, not the wheel's
    return _worker(rank, world, layout_path)


def test_real_megatron_lm_args_model_provider_and_batch(tmp_path):
    assert (Path(MEGATRON_LM) / "pretrain_gpt.py").is_file(), (
        f"MEGATRON_LM={MEGATRON_LM} has no pretrain_gpt.py"
    )
    path = tmp_path / "layout.json"
    LAYOUT.save(path)
    results = run_ranks(_worker_on_megatron_lm, 2, MEGATRON_LM, str(path), timeout_s=600)
    for rank, res in enumerate(results):
        assert res["hexiseq_layers"] == 4 and res["rope"]
        assert res["tokens"] == LAYOUT.ranks[rank].positions()
        assert "planned for seq_length 48 but --seq-length is 96" in res["errors"][0]
        assert "add --calculate-per-token-loss" in res["errors"][1]


def test_help_lists_hexiseq_flags(tmp_path):
    """``--help`` through the real snapshot: the patched script and our module entry point.

    Megatron-LM's ``inprocess_restart`` parses the command line once without our
    ``extra_args_provider``; ``plugin.help_with_hexiseq_flags`` must run before it.
    """
    root = Path(__file__).resolve().parents[1]
    shutil.copy(Path(MEGATRON_LM) / "pretrain_gpt.py", tmp_path / "pretrain_gpt.py")
    patched = subprocess.run(
        [str(root / "scripts" / "apply_megatron_patch.sh"), str(tmp_path)],
        capture_output=True,
        text=True,
    )
    assert patched.returncode == 0, patched.stderr
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(root), MEGATRON_LM, os.environ.get("PYTHONPATH", "")]),
        "PYTHONWARNINGS": "ignore",
    }
    # both entry points in one fresh interpreter (importing Megatron-LM costs seconds), as `python X --help` runs them
    code = """if True:
        import contextlib, io, json, runpy, sys
        script = sys.argv[1]
        runs = {"patched": lambda: runpy.run_path(script, run_name="__main__"),
                "module": lambda: runpy.run_module("megatron_hexiseq.pretrain_gpt", run_name="__main__")}
        out = {}
        for name, run in runs.items():
            sys.argv, buf, code = ["pretrain_gpt.py", "--help"], io.StringIO(), None
            with contextlib.redirect_stdout(buf):
                try:
                    run()
                except SystemExit as e:
                    code = e.code
            out[name] = [code, buf.getvalue()]
        print(json.dumps(out))
    """
    res = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / "pretrain_gpt.py")],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=300,
    )
    assert res.returncode == 0, res.stderr[-2000:]
    import json

    for name, (code, out) in json.loads(res.stdout.strip().splitlines()[-1]).items():
        assert code == 0, f"{name}: exit {code}"
        assert "--hexiseq-layout PATH" in out and "--hexiseq-kernel" in out, (
            f"{name}: {out[-2000:]}"
        )
        assert "--context-parallel-size" in out  # Megatron's own flags are still there
