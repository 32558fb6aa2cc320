"""Simulated ranks on one device for the GPU check: HexiSeq attention under the NCCL-rule harness.

``simulated_dist(world)`` swaps the ``torch.distributed`` module of the attention runtime
(``attention.comm`` and ``attention.groups``) for ``tests/nccl_sim.NcclSim`` (one thread per rank;
NCCL's matching, ordering, lazy-communicator and deadlock rules), so every layout rank runs the real
runtime (``build_hexiseq_groups`` with its warm-up, ``hexiseq_attn_func`` forward and backward) on
tensors of one device, CUDA included: the sim moves tensors with ``copy_`` and every rank enqueues on
the device's default stream, so the device runs them in a causal order.

``sim_attention`` gathers the ranks' outputs and gradients into full-sequence tensors (optionally
with packed documents, ``cu_seqlens``, and on a per-micro-batch layout run on a job layout's
groups), and ``check_ranks`` (the ``efficient`` and ``ranks`` parts) compares them with float64
single-device attention (``attention.reference``) on the same rounded inputs within the normwise
bounds of ``attention.kernel_check``, for the given kernels, bf16 and fp16, B = 2, ``comm_chunks``
1-3, one seeded random uneven layout (``attention.testing_layouts``) per case, every second case
with random document boundaries.
"""

from __future__ import annotations

import contextlib
import importlib.util
import os
import random
import sys
from collections.abc import Callable, Iterable, Iterator
from typing import Any, NamedTuple

import torch
from torch import Tensor

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tests"))

from nccl_sim import NcclSim  # noqa: E402

import megatron_hexiseq.attention.comm as comm_mod  # noqa: E402
import megatron_hexiseq.attention.groups as groups_mod  # noqa: E402
from megatron_hexiseq.attention import build_hexiseq_groups, hexiseq_attn_func  # noqa: E402
from megatron_hexiseq.attention.kernel_check import (  # noqa: E402
    BACKWARD_ROUNDINGS,
    FORWARD_ROUNDINGS,
    normwise_bound,
    normwise_error,
)
from megatron_hexiseq.attention.kernels import Kernel, resolve_kernel  # noqa: E402
from megatron_hexiseq.attention.reference import reference_attention  # noqa: E402
from megatron_hexiseq.attention.testing_layouts import random_bounds, random_layout  # noqa: E402
from megatron_hexiseq.errors import HexiSeqError  # noqa: E402
from megatron_hexiseq.layout import Layout  # noqa: E402


class PromptSim(NcclSim):
    """``NcclSim`` that wakes waiting ranks as soon as a posted batch completes their operation
    (the plain one lets them sleep until their next 1 s poll or another rank's wait returns)."""

    def batch_isend_irecv(self, ops: list[Any]) -> list[Any]:
        works = super().batch_isend_irecv(ops)
        with self.cond:
            self.cond.notify_all()
        return works


@contextlib.contextmanager
def simulated_dist(world: int) -> Iterator[NcclSim]:
    """The attention runtime talks to an ``NcclSim`` of ``world`` ranks inside the block."""
    sim = PromptSim(world)
    saved = comm_mod.dist, groups_mod.dist
    comm_mod.dist = groups_mod.dist = sim  # type: ignore[assignment]
    try:
        yield sim
    finally:
        comm_mod.dist, groups_mod.dist = saved


@contextlib.contextmanager
def on_device(device: torch.device) -> Iterator[None]:
    """A simulated rank's thread computes on ``device`` (CUDA's current device is per thread) and
    runs its own backward: by default autograd runs every CUDA node of every thread's backward on
    one shared per-device worker thread, where a rank waiting for another rank's dK/dV would block
    the other rank's backward for ever (``set_multithreading_enabled(False)``: the calling thread)."""
    with torch.autograd.set_multithreading_enabled(False):
        if device.type == "cuda":
            with torch.cuda.device(device):
                yield
        else:
            yield


class Grads(NamedTuple):
    """Full-sequence results gathered from every rank: ``out [S, B, H*D]``, ``dq [S, B, H, D]``,
    ``dk, dv [S, B, G, D]``."""

    out: Tensor
    dq: Tensor
    dk: Tensor
    dv: Tensor


def sim_attention(
    lay: Layout,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    dout: Tensor,
    *,
    kernel: str | Kernel,
    comm_chunks: int = 1,
    cu_seqlens: Any = None,
    job: Layout | None = None,
    timeout_s: float = 120.0,
) -> Grads:
    """Run HexiSeq attention forward + backward on every rank of ``lay`` (threads, one device).

    ``q [S, B, H, D]``, ``k, v [S, B, G, D]``, ``dout [S, B, H*D]`` (the full sequence, the dtype
    to run in); each rank takes the rows of its tokens. ``cu_seqlens``: packed documents. ``job``:
    the groups are built from this layout and ``lay`` runs as a per-micro-batch layout on them.
    """
    device = q.device
    S, B, H, D = q.shape
    with simulated_dist(lay.world_size) as sim:

        def rank_fn(r: int) -> tuple[Tensor, ...]:
            with on_device(device):
                groups = build_hexiseq_groups(job or lay, device=device)
                if job is not None:
                    groups = groups.with_layout(lay)
                pos = torch.tensor(lay.ranks[r].positions(), dtype=torch.long, device=device)
                ql, kl, vl = (x.detach()[pos].requires_grad_() for x in (q, k, v))
                out = hexiseq_attn_func(
                    ql,
                    kl,
                    vl,
                    groups=groups,
                    kernel=kernel,
                    comm_chunks=comm_chunks,
                    cu_seqlens=cu_seqlens,
                )
                out.backward(dout[pos])
                grads = [
                    x.grad if x.grad is not None else torch.zeros_like(x) for x in (ql, kl, vl)
                ]
                return (pos, out.detach(), *grads)

        threads = torch.get_num_threads()
        if device.type == "cpu":
            torch.set_num_threads(1)  # the ranks are the parallelism
        try:
            results = sim.run(rank_fn, timeout_s=timeout_s)
        finally:
            torch.set_num_threads(threads)
    full = Grads(
        q.new_zeros(S, B, H * D), torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    )
    for pos, *got in results:
        for dst, src in zip(full, got):
            dst[pos] = src.to(dst.dtype)
    return full


def reference_grads(q: Tensor, k: Tensor, v: Tensor, dout: Tensor, cu_seqlens: Any = None) -> Grads:
    """float64 single-device attention of the same (rounded) inputs, forward and backward
    (document-masked with ``cu_seqlens``)."""
    qd, kd, vd = (x.detach().double().requires_grad_() for x in (q, k, v))
    out = reference_attention(qd, kd, vd, cu_seqlens=cu_seqlens)
    out.backward(dout.double())
    assert qd.grad is not None and kd.grad is not None and vd.grad is not None
    return Grads(out.detach(), qd.grad, kd.grad, vd.grad)


def compare(got: Grads, want: Grads, dtype: torch.dtype, device: torch.device) -> dict[str, Any]:
    """Normwise error of each result and its bound (``kernel_check``; reduction = S)."""
    S = want.out.shape[0]
    errors, bounds = {}, {}
    for name, g, w in zip(Grads._fields, got, want):
        rnd = FORWARD_ROUNDINGS if name == "out" else BACKWARD_ROUNDINGS
        errors[name] = normwise_error(g, w)
        bounds[name] = normwise_bound(dtype, roundings=rnd, reduction=S, device=device)
    return {
        "pass": all(errors[n] <= bounds[n] for n in errors),
        "errors": errors,
        "bounds": bounds,
    }


def kernels_on(device: torch.device, head_dim: int) -> tuple[list[Kernel], dict[str, str]]:
    """Every concrete ``Kernel`` that resolves on ``device`` in bf16 and fp16, and why the others
    are skipped (``auto`` is not concrete: it names what it resolves to)."""
    use, skipped = [], {}
    for k in Kernel:
        if k is Kernel.AUTO:
            got = resolve_kernel(k, device=device, dtype=torch.bfloat16, head_dim=head_dim)
            skipped[k.value] = f"resolves to '{got.value}' in bf16 here (checked under that name)"
            continue
        if k is Kernel.FLASH_ATTN and importlib.util.find_spec("flash_attn") is None:
            skipped[k.value] = "the flash_attn package is not installed"
            continue
        try:
            for dtype in (torch.bfloat16, torch.float16):
                resolve_kernel(k, device=device, dtype=dtype, head_dim=head_dim)
        except HexiSeqError as e:
            skipped[k.value] = str(e)
            continue
        use.append(k)
    return use, skipped


def tokens_in_every_group(rng: random.Random, draw: Callable[[], Layout]) -> Layout:
    """Redraw until every A2A group holds tokens (0-token ranks stay). A group without tokens would
    call the kernels on 0-length blocks, which PyTorch's CUDA kernels are not documented to take;
    the CPU suite (tests/test_nccl_rules.py) covers such layouts."""
    for _ in range(1000):
        lay = draw()
        if all(lay.group_num_tokens(g.id) for g in lay.groups):
            return lay
    raise AssertionError("no layout with tokens in every group")


def rank_inputs(
    lay: Layout, *, batch: int, head_dim: int, dtype: torch.dtype, device: torch.device, seed: int
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Seeded q, k, v, dout of a layout (drawn on CPU in float32, rounded to ``dtype``)."""
    gen = torch.Generator().manual_seed(seed)
    S, H, G = lay.seq_length, lay.num_attention_heads, lay.num_query_groups
    shapes = ((S, batch, H, head_dim), (S, batch, G, head_dim), (S, batch, G, head_dim))
    q, k, v = (torch.randn(*s, generator=gen).to(dtype).to(device) for s in shapes)
    dout = torch.randn(S, batch, H * head_dim, generator=gen).to(dtype).to(device)
    return q, k, v, dout


def unaligned_heads(lay: Layout) -> bool:
    """Some rank holds part of a query group only (its heads are not a union of whole groups): the
    runtime then calls the kernels per head segment."""
    ratio = lay.num_attention_heads // lay.num_query_groups
    for r in lay.ranks:
        counts: dict[int, int] = {}
        for h in r.heads:
            counts[h // ratio] = counts.get(h // ratio, 0) + 1
        if any(n < ratio for n in counts.values()):
            return True
    return False


class Case(NamedTuple):
    """One run of the simulated runtime against float64: ``name`` shows in the report; ``job``:
    run ``layout`` as a per-micro-batch layout on ``job``'s groups; ``context``: entered around
    the run (the CPU stand-in of the variable-length op)."""

    name: str
    kernel: Kernel
    dtype: torch.dtype
    layout: Layout
    comm_chunks: int = 1
    cu_seqlens: Any = None
    job: Layout | None = None
    batch: int = 2
    context: Callable[[], contextlib.AbstractContextManager[Any]] = contextlib.nullcontext


def check_cases(
    device: torch.device, cases: Iterable[Case], *, head_dim: int, stop_early: bool
) -> dict[str, Any]:
    """Every case's output and gradients against float64 attention (document-masked where the
    case has boundaries) within ``kernel_check``'s bounds; the worst error per name and result."""
    n, worst, failures, documents, unaligned = 0, {}, [], 0, 0
    for case in cases:
        lay, dtype = case.layout, case.dtype
        q, k, v, dout = rank_inputs(
            lay, batch=case.batch, head_dim=head_dim, dtype=dtype, device=device, seed=n
        )
        with case.context():
            got = sim_attention(
                lay,
                q,
                k,
                v,
                dout,
                kernel=case.kernel,
                comm_chunks=case.comm_chunks,
                cu_seqlens=case.cu_seqlens,
                job=case.job,
            )
        res = compare(got, reference_grads(q, k, v, dout, case.cu_seqlens), dtype, device)
        n += 1
        documents += case.cu_seqlens is not None
        unaligned += unaligned_heads(lay)
        key = f"{case.name}/{str(dtype).removeprefix('torch.')}"
        for name, err in res["errors"].items():
            worst[f"{key}/{name}"] = max(worst.get(f"{key}/{name}", 0.0), err)
        if not res["pass"]:
            docs = "" if case.cu_seqlens is None else ", documents"
            failures.append(
                f"{key} comm_chunks {case.comm_chunks}, world {lay.world_size}, "
                f"S {lay.seq_length}{docs}: "
                + ", ".join(
                    f"{r} {e:.3g} > {res['bounds'][r]:.3g}"
                    for r, e in res["errors"].items()
                    if e > res["bounds"][r]
                )
            )
            if stop_early:
                break
    return {
        "pass": not failures and n > 0,
        "cases": n,
        "cases_with_documents": documents,
        "cases_with_unaligned_heads": unaligned,
        "worst_normwise_error": {k: round(v, 6) for k, v in worst.items()},
        "failures": failures,
    }


def head_dim_on(device: torch.device) -> int:
    return 16 if device.type == "cpu" else 128


def random_case_layout(rng: random.Random, quick: bool) -> Layout:
    """A random uneven layout (GQA/MQA, split and non-contiguous heads) with tokens in every group."""
    return tokens_in_every_group(
        rng,
        lambda: random_layout(
            rng,
            rng.randint(2, 6),
            seq_length=rng.randint(40, 96) if quick else rng.randint(768, 2048),
            heads=rng.choice([(8, 2), (12, 4), (16, 4), (8, 8), (8, 1), (6, 3)]),
        ),
    )


def check_ranks(
    device: torch.device,
    quick: bool,
    *,
    kernels: list[Kernel] | None = None,
    exclude: tuple[Kernel, ...] = (),
    stop_early: bool = False,
) -> dict[str, Any]:
    """The ``ranks`` / ``efficient`` parts: the given kernels (default: every kernel that resolves
    here, less ``exclude``) x {bf16, fp16} x comm_chunks {1, 2, 3}, each on its own random layout;
    the comm_chunks 2 cases with random document boundaries."""
    head_dim = head_dim_on(device)
    usable, skipped = kernels_on(device, head_dim)
    if kernels is None:
        kernels = [k for k in usable if k not in exclude]
        skipped |= {k.value: "checked by another part" for k in exclude if k in usable}
    rng = random.Random(26)

    def cases() -> Iterator[Case]:
        for kernel in kernels:
            for dtype in (torch.bfloat16, torch.float16):
                for chunks in (1, 2, 3):
                    lay = random_case_layout(rng, quick)
                    cu = random_bounds(rng, lay) if chunks == 2 else None
                    yield Case(kernel.value, kernel, dtype, lay, chunks, cu)

    res = check_cases(device, cases(), head_dim=head_dim, stop_early=stop_early)
    return {**res, "kernels": [k.value for k in kernels], "skipped_kernels": skipped}
