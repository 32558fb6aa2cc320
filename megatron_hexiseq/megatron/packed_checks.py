"""Flag combinations of packed-document runs that HexiSeq refuses at start-up, one line each.

Called from ``post_parse.refuse_unsupported`` (right after argparse, before ``validate_args`` and
before anything is built), on every rank alike, for runs with ``--hexiseq-layout``:

- ``--hexiseq-batch-plan`` without document boundaries: the batch planner plans each micro-batch
  from its documents; without ``--reset-attention-mask`` (boundaries at EOD tokens) or a packed
  THD dataset (``--sft``) there are none, and every micro-batch would fail on its first step.
- ``--hybrid-context-parallel``: Megatron's hybrid CP regroups CP ranks for every sub-sample
  (``BalancedCPScheduler``, one forward per sub-sample, a barrier per group) inside its own data
  path; HexiSeq's groups are fixed by the layout and its documents are planned per micro-batch
  (``--hexiseq-batch-plan``): the two cannot both own the batch.
- pipeline parallelism with ``--reset-attention-mask`` or ``--hexiseq-batch-plan``: middle stages
  do not load the batch, so they would know neither the documents nor the micro-batch's layout.
- ``--dataloader-type external``: the prepared-ahead batches (``batch_ahead``) read Megatron's
  batch dict; an external loader yields anything.
- ``--hexiseq-global-batch`` where it cannot work (``refuse_global_batch``): without
  ``--reset-attention-mask`` (it cuts the step's samples into documents at their EOD tokens), with
  a packed SFT dataset (``--sft``: THD batches carry their boundaries in ``cu_seqlens``, which the
  step reader does not take), with pipeline parallelism (only the first and last stages read
  data; with TP every TP rank reads the step itself: ``global_ahead.every_rank_builds_datasets``),
  with another data order than Megatron's ``single`` one, a batch-size ramp-up
  (the step's samples are the global batch) or ``--full-validation`` (its own loader order).
"""

from __future__ import annotations

import argparse

from megatron_hexiseq.errors import HexiSeqError


def refuse_packed_combinations(args: argparse.Namespace) -> None:
    """Raise ``HexiSeqError`` for a packed-document flag combination (module docstring)."""
    refuse_global_batch(args)
    batch_plan = bool(getattr(args, "hexiseq_batch_plan", False))
    reset_mask = bool(getattr(args, "reset_attention_mask", False))
    if batch_plan and not (reset_mask or getattr(args, "sft", False)):
        raise HexiSeqError(
            "--hexiseq-batch-plan plans each micro-batch from its documents, but this run has no "
            "document boundaries: add --reset-attention-mask (documents end at EOD tokens; with "
            "--reset-position-ids and --eod-mask-loss as usual) or feed a packed (THD) dataset"
        )
    if getattr(args, "hybrid_context_parallel", False):
        raise HexiSeqError(
            "--hybrid-context-parallel: Megatron's hybrid CP regroups CP ranks per sub-sample, "
            "HexiSeq's groups are fixed by the layout; drop --hybrid-context-parallel (HexiSeq "
            "balances packed documents itself: --hexiseq-batch-plan)"
        )
    pp = getattr(args, "pipeline_model_parallel_size", 1) or 1
    if pp > 1 and (reset_mask or batch_plan):
        flag = "--hexiseq-batch-plan" if batch_plan else "--reset-attention-mask"
        raise HexiSeqError(
            f"{flag} with --hexiseq-layout does not support pipeline parallelism yet (middle "
            "stages do not load the batch, so they know neither its documents nor its layout); "
            "use --pipeline-model-parallel-size 1"
        )
    if getattr(args, "dataloader_type", None) == "external":
        raise HexiSeqError(
            "--dataloader-type external: HexiSeq prepares every micro-batch ahead from Megatron's "
            "batch dict (tokens, labels, loss_mask, position_ids); use --dataloader-type single "
            "or cyclic"
        )


def refuse_global_batch(args: argparse.Namespace) -> None:
    """Raise ``HexiSeqError`` where ``--hexiseq-global-batch`` cannot work (module docstring)."""
    if not getattr(args, "hexiseq_global_batch", False):
        return
    flag = "--hexiseq-global-batch"
    if not getattr(args, "reset_attention_mask", False):
        raise HexiSeqError(
            f"{flag} cuts every step's samples into documents at their EOD tokens and schedules "
            "the documents, but this run has no document boundaries: add --reset-attention-mask "
            "(with --reset-position-ids and --eod-mask-loss as usual)"
        )
    if getattr(args, "sft", False):
        raise HexiSeqError(
            f"{flag} reads document boundaries from the EOD tokens of Megatron's GPT dataset; "
            "packed SFT (THD) batches are not supported: drop --sft or --hexiseq-global-batch"
        )
    pp = getattr(args, "pipeline_model_parallel_size", 1) or 1
    if pp > 1:
        raise HexiSeqError(
            f"{flag} needs every rank to read the step's samples, but with "
            f"--pipeline-model-parallel-size {pp} only the first and last stages read data; use "
            f"--pipeline-model-parallel-size 1 or drop {flag}"
        )
    kind = getattr(args, "dataloader_type", None) or "single"
    if kind != "single":
        raise HexiSeqError(
            f"--dataloader-type {kind}: {flag} reads each step's global batch in Megatron's "
            "'single' order (megatron/global_data.py); use --dataloader-type single"
        )
    for attr, name, why in (
        ("rampup_batch_size", "--rampup-batch-size", "changes the global batch every step reads"),
        ("full_validation", "--full-validation", "reads the validation set in its own order"),
    ):
        if getattr(args, attr, None):
            raise HexiSeqError(f"{name} {why}; drop it with {flag}")
