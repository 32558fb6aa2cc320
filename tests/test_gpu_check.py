"""bench/gpu_check.py's kernel part on CPU (layer a: no processes).

The GPU acceptance script emulates each group's sub-ring work on one device with the kernels it
checks; on CPU its ``--quick`` mode runs the same emulation with ``cpu-flash`` in bf16. The
emulation must pick a rank that holds heads (a 0-head rank computes nothing): with the first rank
of every group instead, random layout 8 (a 0-head first rank) misses every received block and its
normwise error is ~0.7 against a bound of ~0.02. Bounds come from bf16's unit roundoff and the
sequence length (attention.kernel_check), not from this machine.
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "bench"))

import gpu_check  # noqa: E402

from megatron_hexiseq.attention.kernels import Kernel  # noqa: E402


def test_kernel_part_passes_on_cpu_with_zero_head_ranks():
    result = gpu_check.check_kernels(
        torch.device("cpu"), [Kernel.CPU_FLASH], layouts=12, quick=True
    )
    assert result["cases"] >= 12
    assert result["pass"], result
