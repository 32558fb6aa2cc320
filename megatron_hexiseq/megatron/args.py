"""The ``--hexiseq-*`` flags: one frozen dataclass is the source of truth.

``HexiSeqArgs`` declares every flag (name, type, default, help) as field metadata;
``add_hexiseq_args(parser)`` (Megatron's ``extra_args_provider``) registers them and
``HexiSeqArgs.from_namespace(args)`` reads them back after Megatron parsed its arguments.
``tests/test_megatron_unit.py::test_flag_set_is_pinned`` pins the flag set.

The plugin also requires the stock Megatron flags ``--cp-comm-type hexiseq`` (Megatron declares
``--cp-comm-type`` without ``choices``; the value reaches the core attention as ``cp_comm_type``)
and ``--calculate-per-token-loss`` (checked at start-up, see ``parallel_state.check_args``).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any

from megatron_hexiseq.errors import HexiSeqError

#: Value of Megatron's ``--cp-comm-type`` that selects HexiSeq attention.
CP_COMM_TYPE = "hexiseq"

#: Attention kernels the flag accepts (``megatron_hexiseq.attention.kernels.Kernel``; ``sdpa`` is the
#: former name of ``auto``).
KERNELS = ("auto", "cudnn", "flash", "efficient", "cpu-flash", "flash-attn", "reference", "sdpa")


def _flag(help: str, *, default: Any, **argparse_kwargs: Any) -> Any:
    return field(default=default, metadata={"help": help, **argparse_kwargs})


@dataclass(frozen=True, kw_only=True)
class HexiSeqArgs:
    """Every ``--hexiseq-*`` flag; the attribute name is the flag without ``--hexiseq-``."""

    layout: str | None = _flag(
        "Layout JSON (from 'megatron-hexiseq plan') that every context-parallel domain runs; "
        "enables HexiSeq together with --cp-comm-type hexiseq.",
        metavar="PATH",
        default=None,
    )
    job: str | None = _flag(
        "Job JSON (from 'megatron-hexiseq plan --global-batch B'): domains of GPUs, each running "
        "its own layout on its own share of every step's global batch, one gradient reduction "
        "over all ranks per step. Instead of --hexiseq-layout; Megatron sees one context-parallel "
        "group of all ranks (--context-parallel-size = world size, data-parallel size 1; "
        "docs/megatron.md, 'Jobs').",
        metavar="PATH",
        default=None,
    )
    kernel: str = _flag(
        "Attention block kernel. auto (default): PyTorch's fused kernels chosen by device and dtype "
        "(CUDA bf16/fp16: flash; CUDA fp32 or head dims flash cannot take: efficient; CPU: cpu-flash); "
        "flash, efficient, cpu-flash: that kernel; flash-attn: the optional flash_attn package; "
        "reference: pure torch with [S, T] scores (the numerical oracle; short sequences only). "
        "Checked at start-up by one tiny forward+backward on the real device and dtype.",
        choices=KERNELS,
        default="auto",
    )
    fp32_grad_wire: bool = _flag(
        "Return the sub-ring's dK/dV to their holders in float32 instead of the input dtype "
        "(twice the backward K/V traffic in bf16; see docs/attention.md).",
        default=False,
    )
    comm_chunks: int = _flag(
        "How finely HexiSeq's head all-to-all / sub-ring K/V exchange is split and overlapped "
        "with attention compute (an overlap-tuner knob; integer >= 1).",
        metavar="N",
        default=1,
    )
    allow_mismatch: bool = _flag(
        "Downgrade the start-up check of each rank's GPU name against the layout's 'gpu' to a "
        "warning (e.g. a layout planned for another GPU model). Structural mismatches (world "
        "size, context-parallel size, sequence length, heads) always fail.",
        default=False,
    )
    batch_plan: bool = _flag(
        "Give every micro-batch its own token assignment, planned from its documents by the batch "
        "planner (megatron_hexiseq/varlen/) on the layout's groups and heads (the process groups "
        "are built once); needs packed documents (--reset-attention-mask, or THD batches) and a "
        "layout written by 'megatron-hexiseq plan' (it records the cluster and the model).",
        default=False,
    )
    global_batch: bool = _flag(
        "Schedule each step's whole global batch: every rank reads the step's samples, the "
        "documents (cut at EOD tokens) go to the domains (a job's, or the data-parallel replicas "
        "of --hexiseq-layout) and their micro-batches by predicted cost, and each micro-batch is "
        "planned by the batch planner in its domain (implies --hexiseq-batch-plan). Needs "
        "--reset-attention-mask, PP = 1 and a layout or job written by 'megatron-hexiseq "
        "plan' (docs/megatron.md, 'Packed long-context training').",
        default=False,
    )
    overlap_tune: bool = _flag(
        "Tune communication/computation overlap knobs online in the first iterations "
        "(megatron_hexiseq.overlap) and save the result.",
        default=False,
    )
    overlap_config: str | None = _flag(
        "Apply a saved overlap-tuning result (JSON from 'megatron-hexiseq tune').",
        metavar="PATH",
        default=None,
    )
    check_params: int = _flag(
        "Compare a 64-bit hash of the parameters across every rank that holds them after every "
        "N-th training step (one error naming the ranks that differ). 0 (default): once, at "
        "start-up, right after every parameter is broadcast from the first rank.",
        metavar="N",
        default=0,
    )

    def __post_init__(self) -> None:
        if self.comm_chunks < 1:
            raise HexiSeqError(f"--hexiseq-comm-chunks must be >= 1, got {self.comm_chunks}")
        if self.layout is not None and self.job is not None:
            raise HexiSeqError(
                "give --hexiseq-layout (one layout on every context-parallel domain) or "
                "--hexiseq-job (a job of domains with their own layouts), not both"
            )
        if self.global_batch and not self.enabled:
            raise HexiSeqError(
                "--hexiseq-global-batch schedules the global batch over HexiSeq domains: give "
                "--hexiseq-layout PATH (its data-parallel replicas) or --hexiseq-job PATH"
            )
        if self.check_params < 0:
            raise HexiSeqError(
                f"--hexiseq-check-params must be >= 0 (0: at start-up only), got {self.check_params}"
            )
        if self.overlap_tune and self.overlap_config:
            raise HexiSeqError(
                "use either --hexiseq-overlap-tune or --hexiseq-overlap-config, not both"
            )

    @property
    def enabled(self) -> bool:
        """True when a layout or a job was given (HexiSeq replaces Megatron's context parallelism)."""
        return self.layout is not None or self.job is not None

    @classmethod
    def from_namespace(cls, args: argparse.Namespace) -> HexiSeqArgs:
        """Read the flags back from Megatron's parsed ``args`` (missing ones take defaults)."""
        values = {
            f.name: getattr(args, dest(f.name)) for f in fields(cls) if hasattr(args, dest(f.name))
        }
        return cls(**values)


def flag(name: str) -> str:
    """``'comm_chunks'`` -> ``'--hexiseq-comm-chunks'``."""
    return "--hexiseq-" + name.replace("_", "-")


def dest(name: str) -> str:
    """``'comm_chunks'`` -> ``'hexiseq_comm_chunks'`` (the attribute on Megatron's args)."""
    return "hexiseq_" + name


def flag_names() -> tuple[str, ...]:
    """All ``--hexiseq-*`` flags, in declaration order."""
    return tuple(flag(f.name) for f in fields(HexiSeqArgs))


def add_hexiseq_args(
    parser: argparse.ArgumentParser,
    chain: Callable[[argparse.ArgumentParser], argparse.ArgumentParser] | None = None,
) -> argparse.ArgumentParser:
    """Megatron ``extra_args_provider``: add the ``--hexiseq-*`` flags (then ``chain``'s, if any).

    ``chain`` lets ``pretrain_gpt.py`` keep its own provider (ModelOpt's ``add_modelopt_args``).
    """
    group = parser.add_argument_group(
        title="hexiseq",
        description="Uneven context/head parallelism for heterogeneous GPUs (megatron-hexiseq)",
    )
    for f in fields(HexiSeqArgs):
        meta = dict(f.metadata)
        kwargs: dict[str, Any] = {
            "dest": dest(f.name),
            "default": f.default,
            "help": meta.pop("help"),
        }
        if f.type in ("bool", bool):
            kwargs["action"] = "store_true"
        else:
            kwargs["type"] = int if f.type in ("int", int) else str
        kwargs.update(meta)
        group.add_argument(flag(f.name), **kwargs)
    return chain(parser) if chain is not None else parser


def layout_flag(argv: list[str]) -> str | None:
    """The value of ``--hexiseq-layout`` in ``argv`` (``--hexiseq-layout P`` or ``=P``; the last
    one wins, as argparse does), None when absent."""
    return flag_value(argv, "--hexiseq-layout")


def job_flag(argv: list[str]) -> str | None:
    """The value of ``--hexiseq-job`` in ``argv``, as :func:`layout_flag` reads its flag."""
    return flag_value(argv, "--hexiseq-job")


def flag_value(argv: list[str], name: str) -> str | None:
    """The value of flag ``name`` in ``argv`` (``name P`` or ``name=P``; the last one wins)."""
    value = None
    for i, arg in enumerate(argv):
        if arg == name and i + 1 < len(argv):
            value = argv[i + 1]
        elif arg.startswith(name + "="):
            value = arg.split("=", 1)[1]
    return value
