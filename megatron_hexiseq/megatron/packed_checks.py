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
"""

from __future__ import annotations

import argparse

from megatron_hexiseq.errors import HexiSeqError


def refuse_packed_combinations(args: argparse.Namespace) -> None:
    """Raise ``HexiSeqError`` for a packed-document flag combination (module docstring)."""
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
