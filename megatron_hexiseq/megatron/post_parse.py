"""What the plugin's post-parse hook decides about Megatron's own flags for a HexiSeq run.

Runs right after argparse has parsed Megatron-LM's command line (``plugin.after_parse``), before
``validate_args`` and before anything is built, on every rank alike, and once more on the final
args in ``plugin.setup`` (the model provider's first call, before any collective and before the
datasets are built): Megatron-LM's ``--yaml-cfg`` replaces the parsed args after the hook. A run
without ``--hexiseq-layout`` or ``--hexiseq-job`` is left as it is.

* ``refuse_unsupported(args)``: Megatron features HexiSeq attention does not support yet end the
  run here with one line naming the flag and what to do (``HexiSeqError``: exit 2 through
  ``python -m megatron_hexiseq.pretrain_gpt``), instead of failing or silently computing something
  else hours into a job. CUDA graphs (``--cuda-graph-impl local|transformer_engine`` and the
  deprecated ``--enable-cuda-graph`` / ``--external-cuda-graph``): the attention's exchanges and
  its start-up checks were never captured in a graph. YaRN RoPE (``--rope-type yarn``, or a
  ``position_embedding_type`` of ``yarn`` from a YAML config): the layout's RoPE
  (``megatron.rope``) recomputes plain RoPE angles (with ``--use-rope-scaling`` / interpolation)
  at each rank's global positions, not YaRN's. ``--init-model-with-meta-device``: the start-up
  kernel check copies tensors out of the model's device and the layout RoPE computes its angles
  at construction, neither of which a meta-device model has. ``--qk-clip`` /
  ``--log-max-attention-logit``: they read each head's largest attention logit from the core
  attention (``current_max_attn_logits``), which HexiSeq's fused kernels do not report.
  ``--attention-dropout`` > 0 (Megatron's default is 0.1): HexiSeq attention is exact and applies no
  dropout; a run must say ``--attention-dropout 0``. The combined-1F1B MoE overlap schedule
  (``--overlap-moe-expert-parallel-comm``): it runs one micro-batch's forward inside another's
  backward, while HexiSeq holds one micro-batch's document boundaries and layout at a time.
* ``drop_dataloader_mask(args)``: Megatron's default ``create_attention_mask_in_dataloader=True``
  makes the dataset build a causal ``[S, S]`` mask and every rank receive a ``[mbs, 1, S, S]`` bool
  mask on its GPU (16 GiB at 128K tokens, micro-batch 1). HexiSeq attention never reads it (the
  mask is causal over global positions by construction; packed documents get their boundaries
  from the tokens, not from a dense mask), so it is switched off, and rank 0 says so once.
"""

from __future__ import annotations

import argparse
import os

from megatron_hexiseq.errors import HexiSeqError
from megatron_hexiseq.megatron.packed_checks import refuse_packed_combinations

GiB = 1024**3


def is_hexiseq_run(args: argparse.Namespace) -> bool:
    """A layout or a job was given: HexiSeq attention replaces Megatron's context parallelism."""
    return bool(getattr(args, "hexiseq_layout", None) or getattr(args, "hexiseq_job", None))


def _cuda_graph_flag(args: argparse.Namespace) -> str | None:
    """The CUDA-graph flag on the command line, as the user wrote it (None: no CUDA graphs)."""
    if getattr(args, "enable_cuda_graph", False):
        return "--enable-cuda-graph"
    if getattr(args, "external_cuda_graph", False):
        return "--external-cuda-graph"
    impl = getattr(args, "cuda_graph_impl", None)
    if impl not in (None, "none"):
        return f"--cuda-graph-impl {impl}"
    return None


def refuse_unsupported(args: argparse.Namespace) -> None:
    """Raise ``HexiSeqError`` for a Megatron feature a HexiSeq run does not support yet."""
    if not is_hexiseq_run(args):
        return
    refuse_packed_combinations(args)  # packed documents: packed_checks.py
    graphs = _cuda_graph_flag(args)
    if graphs:
        raise HexiSeqError(
            f"{graphs}: HexiSeq attention does not run inside CUDA graphs yet; drop {graphs} "
            "(or run without --hexiseq-layout)"
        )
    if getattr(args, "rope_type", None) == "yarn":
        raise HexiSeqError(
            "--rope-type yarn: HexiSeq's layout RoPE does not implement YaRN yet; use "
            "--rope-type rope (optionally with --use-rope-scaling) or run without --hexiseq-layout"
        )
    if getattr(args, "position_embedding_type", None) == "yarn":
        raise HexiSeqError(
            "position_embedding_type yarn: HexiSeq's layout RoPE does not implement YaRN yet; "
            "use --position-embedding-type rope or run without --hexiseq-layout"
        )
    if getattr(args, "init_model_with_meta_device", False):
        raise HexiSeqError(
            "--init-model-with-meta-device: HexiSeq needs the model's tensors at start-up (the "
            "attention kernel check runs on them, the layout RoPE computes its angles when built); "
            "drop --init-model-with-meta-device (or run without --hexiseq-layout)"
        )
    for flag in ("qk_clip", "log_max_attention_logit"):
        if getattr(args, flag, False):
            name = "--" + flag.replace("_", "-")
            raise HexiSeqError(
                f"{name}: HexiSeq attention does not report each head's largest attention logit "
                f"(current_max_attn_logits), which {name} reads; drop {name} (or run without "
                "--hexiseq-layout)"
            )
    dropout = getattr(args, "attention_dropout", None) or 0.0
    if dropout != 0:
        raise HexiSeqError(
            f"--attention-dropout {dropout:g}: HexiSeq attention is exact and applies no dropout "
            "(Megatron's default is 0.1); pass --attention-dropout 0"
        )
    if getattr(args, "overlap_moe_expert_parallel_comm", False):
        raise HexiSeqError(
            "--overlap-moe-expert-parallel-comm: its combined-1F1B schedule runs one "
            "micro-batch's forward inside another's backward, and HexiSeq attention holds one "
            "micro-batch's documents and layout at a time; drop --overlap-moe-expert-parallel-comm "
            "(and --delay-wgrad-compute)"
        )


def dataloader_mask_bytes(args: argparse.Namespace) -> int:
    """Bytes of the ``[mbs, 1, S, S]`` bool mask a rank receives per micro-batch."""
    seq = getattr(args, "seq_length", None) or getattr(args, "encoder_seq_length", None) or 0
    return int(getattr(args, "micro_batch_size", None) or 1) * int(seq) ** 2


def drop_dataloader_mask(args: argparse.Namespace) -> bool:
    """Turn ``create_attention_mask_in_dataloader`` off for a HexiSeq run; True when it changed.

    Rank 0 (``RANK`` of the environment: ``args.rank`` is not set yet) prints one line saying so.
    """
    if not is_hexiseq_run(args) or not getattr(args, "create_attention_mask_in_dataloader", False):
        return False
    args.create_attention_mask_in_dataloader = False
    if os.environ.get("RANK", "0") == "0":
        size = dataloader_mask_bytes(args)
        print(
            "hexiseq: not building the dataloader's attention mask "
            "(--no-create-attention-mask-in-dataloader): HexiSeq attention never reads it "
            f"(it would take {size / GiB:.1f} GiB per GPU: [mbs, 1, S, S] bool)",
            flush=True,
        )
    return True
