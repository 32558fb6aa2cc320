"""``python -m megatron_hexiseq.pretrain_gpt <Megatron args>``: Megatron-LM's GPT pre-training
with HexiSeq, without patching Megatron-LM.

Needs a Megatron-LM checkout at tag ``core_v0.16.1`` on ``PYTHONPATH`` (its ``pretrain_gpt.py``,
``gpt_builders.py``, ``model_provider.py`` and ``megatron/training``). Imports that
``pretrain_gpt`` module (its ``__main__`` block does not run) and calls
``megatron_hexiseq.megatron.plugin.run_pretrain``: the same hooks as the patched script.
Example (per rank; see scripts/slurm/)::

    PYTHONPATH=$MEGATRON_LM python -m megatron_hexiseq.pretrain_gpt \\
        --context-parallel-size 4 --cp-comm-type hexiseq --calculate-per-token-loss \\
        --hexiseq-layout layout.json --seq-length 131072 ... (usual Megatron flags)

or, for a job of several domains, ``--hexiseq-job job.json --context-parallel-size <world size>``
instead of ``--hexiseq-layout`` (docs/megatron.md, "Jobs").
"""

from __future__ import annotations

import sys
import time

from megatron_hexiseq.errors import run_user_command
from megatron_hexiseq.megatron.args import job_flag, layout_flag

_PROGRAM_START_TIME = time.time()


def main() -> int:
    path, job = layout_flag(sys.argv[1:]), job_flag(sys.argv[1:])
    if path is not None or job is not None:  # before Megatron, torch and init_process_group
        from megatron_hexiseq.job import JobPlan
        from megatron_hexiseq.layout import Layout

        def check() -> None:
            if path is not None:
                Layout.load(path)
            if job is not None:
                JobPlan.load(job)

        rc = run_user_command(check, interrupts=False)
        if rc:
            return rc
    try:
        import pretrain_gpt as stock  # Megatron-LM's script, found on PYTHONPATH
    except ModuleNotFoundError as e:
        if e.name not in ("pretrain_gpt", "gpt_builders", "model_provider", "megatron.training"):
            raise
        print(
            f"error: cannot import Megatron-LM's pretrain_gpt ({e}); put a Megatron-LM checkout "
            "(tag core_v0.16.1) on PYTHONPATH",
            file=sys.stderr,
        )
        return 2
    # here, not at the top: it loads torch and megatron.core (6.5 s CPU on the development machine),
    # which Megatron's start-up timestamps count from _PROGRAM_START_TIME, as its own script does
    from megatron_hexiseq.megatron.plugin import run_pretrain

    stock._PROGRAM_START_TIME = min(
        getattr(stock, "_PROGRAM_START_TIME", _PROGRAM_START_TIME), _PROGRAM_START_TIME
    )
    return run_user_command(lambda: run_pretrain(stock), interrupts=False)


if __name__ == "__main__":
    sys.exit(main())
