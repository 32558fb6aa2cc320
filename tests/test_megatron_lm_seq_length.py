"""Megatron-LM's own ``validate_args`` with the plugin, layer (a) (argument parsing, no processes).

Stock Megatron-LM asserts ``seq_length % (2 * context_parallel_size) == 0`` (its even zig-zag
split). A HexiSeq layout splits any length, e.g. 131072 tokens on 12 ranks or 44 tokens on 4: with
``--hexiseq-layout`` and ``--cp-comm-type hexiseq`` the real ``parse_args`` + ``validate_args`` must
accept them and leave ``args.seq_length`` at the requested length, while the same flags without
HexiSeq still fail Megatron's check (so the test would notice if Megatron dropped it). The same
real parser refuses, at parsing and in one line each, what a HexiSeq run does not support
(``--init-model-with-meta-device``, ``--qk-clip``, ``--log-max-attention-logit``, a non-zero
``--attention-dropout`` including Megatron's default 0.1, ``--overlap-moe-expert-parallel-comm``),
and lets stock runs keep them. Needs ``MEGATRON_LM`` (``scripts/test.sh`` unpacks the snapshot in
``../shared/megatron-lm``).
"""

from __future__ import annotations

import os
import sys

import pytest

MEGATRON_LM = os.environ.get("MEGATRON_LM")
pytestmark = pytest.mark.skipif(
    not MEGATRON_LM, reason="set MEGATRON_LM=<Megatron-LM core_v0.16.1 checkout>"
)

BASE = (
    "--num-layers 2 --hidden-size 64 --num-attention-heads 8 --group-query-attention --num-query-groups 2 "
    "--ffn-hidden-size 96 --position-embedding-type rope --micro-batch-size 1 --global-batch-size 1 "
    "--lr 1e-3 --train-iters 1 --transformer-impl local --calculate-per-token-loss --mock-data "
    "--tokenizer-type NullTokenizer --vocab-size 128 --attention-dropout 0"
).split()


def _validate(argv: list[str], world: int, base: list[str] = BASE):
    sys.path.insert(0, MEGATRON_LM)
    try:
        import megatron.training.arguments as margs
    except ImportError as e:
        pytest.fail(f"Megatron-LM's arguments module does not import (install .[megatron-lm]): {e}")
    from megatron_hexiseq.megatron import plugin

    saved = sys.argv, margs.get_device_arch_version
    margs.get_device_arch_version = lambda: 9  # a CUDA-only query inside validate_args
    sys.argv = ["pretrain_gpt.py", *base, *argv]
    os.environ.setdefault("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    try:
        args = margs.parse_args(extra_args_provider=plugin.extra_args_provider(None))
        args.rank, args.world_size = 0, world
        margs.validate_args(args, {"tokenizer_type": "GPT2BPETokenizer"})
        return args
    finally:
        sys.argv, margs.get_device_arch_version = saved


@pytest.mark.parametrize("seq,cp", [(44, 4), (131072, 12), (131072, 24)])
def test_validate_args_accepts_any_hexiseq_length(seq: int, cp: int) -> None:
    flags = [
        "--seq-length",
        str(seq),
        "--max-position-embeddings",
        str(seq),
        "--context-parallel-size",
        str(cp),
    ]
    args = _validate(
        flags + ["--cp-comm-type", "hexiseq", "--hexiseq-layout", "layout.json"], world=cp
    )
    assert (
        args.seq_length == seq
        and args.encoder_seq_length == seq
        and args.context_parallel_size == cp
    )
    with pytest.raises(AssertionError, match="multiple of 2 \\* context-parallel-size"):
        _validate(flags + ["--cp-comm-type", "p2p"], world=cp)  # stock Megatron still checks


def test_other_seq_length_checks_still_apply() -> None:
    flags = [
        "--seq-length",
        "44",
        "--max-position-embeddings",
        "40",
        "--context-parallel-size",
        "4",
        "--cp-comm-type",
        "hexiseq",
        "--hexiseq-layout",
        "layout.json",
    ]
    with pytest.raises(AssertionError, match="max_position_embeddings"):
        _validate(flags, world=4)


HEXISEQ = "--seq-length 64 --max-position-embeddings 64 --context-parallel-size 4 "
HEXISEQ += "--cp-comm-type hexiseq --hexiseq-layout layout.json"


@pytest.mark.parametrize(
    "flag,line",
    [
        (
            "--init-model-with-meta-device",
            "--init-model-with-meta-device: HexiSeq needs the model's tensors at start-up",
        ),
        ("--qk-clip", "--qk-clip: HexiSeq attention does not report each head's largest"),
        ("--log-max-attention-logit", "--log-max-attention-logit: HexiSeq attention does not"),
        ("--attention-dropout 0.1", "--attention-dropout 0.1: HexiSeq attention is exact and "),
        ("--attention-dropout 0.05", "applies no dropout (Megatron's default is 0.1); pass --att"),
        (
            "--overlap-moe-expert-parallel-comm",
            "--overlap-moe-expert-parallel-comm: its combined-1F1B schedule runs one micro-batch's",
        ),
    ],
)
def test_unsupported_flags_are_refused_at_parsing_in_one_line(flag: str, line: str) -> None:
    from megatron_hexiseq.errors import HexiSeqError

    with pytest.raises(HexiSeqError) as err:
        _validate(HEXISEQ.split() + flag.split(), world=4)
    assert line in str(err.value) and "\n" not in str(err.value), str(err.value)
    stock = ["--context-parallel-size", "1", *flag.split()]
    try:  # a stock run keeps the flag: Megatron's own checks may refuse it, the plugin does not
        _validate(stock, world=1)
    except AssertionError:
        pass


def test_megatrons_default_attention_dropout_is_refused_and_zero_accepted() -> None:
    from megatron_hexiseq.errors import HexiSeqError

    base = BASE[: BASE.index("--attention-dropout")]  # Megatron's default
    with pytest.raises(HexiSeqError, match="--attention-dropout 0.1: .*pass --attention-dropout 0"):
        _validate(HEXISEQ.split(), world=4, base=base)
    assert _validate(HEXISEQ.split(), world=4).attention_dropout == 0
