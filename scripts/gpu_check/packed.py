"""The ``documents`` and ``batch_layouts`` parts of the GPU check: the packed-document path.

Both run the real runtime over simulated ranks on this device (``sim.py``) against float64
attention with the document mask on the same rounded inputs, within ``kernel_check``'s normwise
bounds, in bf16 and fp16, for every kernel ``auto`` can pick that runs here:

- on CUDA ``cudnn`` and ``flash`` (their packed blocks are one variable-length flash call per block
  and head segment, ``attention/varlen.py``) and ``efficient`` (one call per document window);
- on CPU ``cpu-flash`` (one call per window) and ``varlen stand-in``: ``cpu-flash`` with every
  block's windows through the variable-length path, the flash op replaced by its float64 CPU
  stand-in (``tests/varlen_standin.py``), so the packing, head segments, scatter and LSE merge of
  the CUDA path run (and can be broken) without a GPU.

``documents``: random uneven layouts whose query heads are split unevenly (the part fails unless
some case has a rank with an unaligned head range, i.e. several kernel calls per block) with random
boundaries (1-token documents, boundaries on segment edges, one document over every rank; per
sample with B = 2 in some cases), ``comm_chunks`` 1-3.
``batch_layouts``: per-micro-batch layouts (``HexiSeqGroups.with_layout``): a random job layout's
groups run two micro-batches of other layouts of its structure, one with boundaries (some documents
whole inside one group) and one without (on CUDA that one runs as one document through the
variable-length call: its block shapes change every micro-batch).
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Callable, Iterator
from typing import Any

import torch

from megatron_hexiseq.attention.kernels import Kernel, resolve_kernel
from megatron_hexiseq.attention.testing_layouts import random_batch_layout, random_bounds
from megatron_hexiseq.errors import HexiSeqError
from megatron_hexiseq.layout import Layout

from .sim import Case, check_cases, head_dim_on, random_case_layout, tokens_in_every_group

STANDIN = "varlen stand-in"


def _standin() -> contextlib.AbstractContextManager[Any]:
    from varlen_standin import varlen_standin  # tests/ is on sys.path (sim.py)

    return varlen_standin()


def packed_kernels(device: torch.device) -> list[tuple[str, Kernel, Callable[..., Any]]]:
    """(name, kernel, context) of every kernel ``auto`` can pick that runs here (see the top)."""
    if device.type == "cpu":
        return [
            (Kernel.CPU_FLASH.value, Kernel.CPU_FLASH, contextlib.nullcontext),
            (STANDIN, Kernel.CPU_FLASH, _standin),
        ]
    out = []
    for kernel in (Kernel.CUDNN, Kernel.FLASH, Kernel.EFFICIENT):
        try:
            for dtype in (torch.bfloat16, torch.float16):
                resolve_kernel(kernel, device=device, dtype=dtype, head_dim=head_dim_on(device))
        except HexiSeqError:
            continue
        out.append((kernel.value, kernel, contextlib.nullcontext))
    return out


def check_documents(device: torch.device, quick: bool, *, stop_early: bool) -> dict[str, Any]:
    rng = random.Random(41)
    kernels = packed_kernels(device)

    def cases() -> Iterator[Case]:
        for name, kernel, context in kernels:
            for i, dtype in enumerate((torch.bfloat16, torch.float16, torch.bfloat16)):
                lay = random_case_layout(rng, quick)
                per_sample = i == 2
                cu = (
                    [random_bounds(rng, lay), random_bounds(rng, lay)]
                    if per_sample
                    else random_bounds(rng, lay)
                )
                yield Case(name, kernel, dtype, lay, 1 + i, cu, context=context)

    res = check_cases(device, cases(), head_dim=head_dim_on(device), stop_early=stop_early)
    if res["pass"] and not res["cases_with_unaligned_heads"]:
        res["pass"] = False
        res["failures"].append("no case had a rank with an unaligned head range")
    return {**res, "kernels": [name for name, _, _ in kernels]}


def _batch_layout(rng: random.Random, job: Layout, S: int, bounds: list[int] | None) -> Layout:
    return tokens_in_every_group(
        rng, lambda: random_batch_layout(rng, job, seq_length=S, bounds=bounds)
    )


def check_batch_layouts(device: torch.device, quick: bool, *, stop_early: bool) -> dict[str, Any]:
    rng = random.Random(43)
    kernels = packed_kernels(device)

    def cases() -> Iterator[Case]:
        for name, kernel, context in kernels:
            for i, dtype in enumerate((torch.bfloat16, torch.float16)):
                job = random_case_layout(rng, quick)
                S = job.seq_length + rng.randint(-job.seq_length // 4, job.seq_length // 4)
                documents = random_bounds(rng, _batch_layout(rng, job, S, None))
                with_docs = _batch_layout(rng, job, S, documents)
                yield Case(name, kernel, dtype, with_docs, 1 + i, documents, job, context=context)
                plain = _batch_layout(rng, job, job.seq_length, None)
                yield Case(name, kernel, dtype, plain, 2 - i, None, job, context=context)

    res = check_cases(device, cases(), head_dim=head_dim_on(device), stop_early=stop_early)
    return {**res, "kernels": [name for name, _, _ in kernels]}
