"""The whole runtime's CUDA paths on the ``meta`` device: K/V never expanded, packed blocks routed.

Layer (a), threads under NCCL's rules (``tests/nccl_sim.py``): ``hexiseq_attn_func`` forward and
backward on every rank of a layout, on ``meta`` tensors (the sizes a GPU would allocate, no
compute; PyTorch's CUDA attention ops have meta implementations), with the kernel given
explicitly (``resolve_kernel`` refuses CUDA kernels off CUDA). Every op is recorded per rank.

- No K/V expanded to the query heads, on every path (dense job layout, packed documents, a
  per-micro-batch layout, with and without documents) and every CUDA kernel (``flash``,
  ``cudnn``, ``efficient``): every attention op reads keys and values with at most the rank's K/V
  heads; and on a layout where one rank, whose query heads are an unaligned range of the query
  groups, receives a block far longer than its own tokens, no tensor on that rank has as many
  elements as the received K/V at its query heads (``T x B x H_r x D``). The previous packed path
  expanded K/V to ``[M, H, D]`` and returned float32 dK/dV at H heads there.
- Routing (``kernel_rules.VARLEN_KERNELS`` / ``packed_kernel``): with ``cudnn`` no packed block
  (documents or a per-micro-batch layout) reaches a dense cuDNN call, whose graph cuDNN would build
  per shape; they all go to the variable-length flash op. The job layout without documents keeps
  its dense cuDNN calls (its shapes are fixed for the run). ``cudnn_takes`` implies ``flash_takes``
  on every input, so the routed call applies wherever cuDNN did.
"""

from __future__ import annotations

import random

import pytest
import torch
from nccl_sim import NcclSim
from torch.utils._python_dispatch import TorchDispatchMode

import megatron_hexiseq.attention.comm as comm
import megatron_hexiseq.attention.groups as groups_mod
import megatron_hexiseq.attention.hexiseq as hexiseq_mod
from megatron_hexiseq import kernel_rules
from megatron_hexiseq.attention import build_hexiseq_groups, hexiseq_attn_func
from megatron_hexiseq.attention.kernels import Kernel, parse_kernel
from megatron_hexiseq.attention.testing_layouts import (
    random_batch_layout,
    random_bounds,
    random_layout,
)
from megatron_hexiseq.layout import Layout, make_layout

META = torch.device("meta")
CUDNN_OPS = ("_scaled_dot_product_cudnn_attention",)
ATTN_OPS = ("flash_attention", "efficient_attention", "cudnn_attention")
KERNELS = (Kernel.FLASH, Kernel.CUDNN, Kernel.EFFICIENT)


class _Ops(TorchDispatchMode):
    """Every op of one rank's thread: its name, its key/value arguments' head counts (attention
    ops), and the largest tensor it returned."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []
        self.kv_heads: list[tuple[str, int, int]] = []  # (op, query heads, K/V heads)
        self.max_numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func._schema.name
        self.names.append(name)
        if any(a in name for a in ATTN_OPS):
            bound = {a.name: v for a, v in zip(func._schema.arguments, args)} | kwargs
            q, k, v = bound["query"], bound["key"], bound["value"]
            # heads are dim 1 of both: varlen [N, h, D], dense [B, h, S, D]
            assert k.shape[1] == v.shape[1]
            self.kv_heads.append((name, q.shape[1], k.shape[1]))
        out = func(*args, **kwargs)
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.max_numel = max(self.max_numel, t.numel())
        return out


@pytest.fixture
def meta_runtime(monkeypatch: pytest.MonkeyPatch) -> None:
    """The runtime on simulated ranks; explicit CUDA kernels accepted for meta tensors."""
    monkeypatch.setattr(comm, "dist", comm.dist)
    monkeypatch.setattr(groups_mod, "dist", groups_mod.dist)
    monkeypatch.setattr(hexiseq_mod, "resolve_kernel", lambda kernel, **_: parse_kernel(kernel))


def _run(job: Layout, lay: Layout, kernel: Kernel, cu, *, batch: int = 2, D: int = 16):
    """Forward + backward of every rank of ``lay`` (``job``'s groups) on meta; per rank ``_Ops``."""
    sim = NcclSim(job.world_size)
    comm.dist, groups_mod.dist = sim, sim
    H, G = lay.num_attention_heads, lay.num_query_groups

    def fn(r: int) -> _Ops:
        groups = build_hexiseq_groups(job, device=META)
        view = groups.with_layout(lay)
        s = lay.ranks[r].num_tokens
        q = torch.empty(s, batch, H, D, device=META, dtype=torch.bfloat16, requires_grad=True)
        k, v = (
            torch.empty(s, batch, G, D, device=META, dtype=torch.bfloat16, requires_grad=True)
            for _ in "kv"
        )
        ops = _Ops()
        with ops:
            out = hexiseq_attn_func(q, k, v, groups=view, kernel=kernel, cu_seqlens=cu)
            out.backward(torch.empty_like(out))
        assert q.grad is not None and k.grad is not None and k.grad.shape == k.shape
        return ops

    return sim.run(fn)


def _g_heads(lay: Layout, r: int) -> int:
    ratio = lay.num_attention_heads // lay.num_query_groups
    return len({h // ratio for h in lay.ranks[r].heads})


def _check_kv_heads(lay: Layout, per_rank: list[_Ops], kernel: Kernel) -> None:
    for r, ops in enumerate(per_rank):
        if not lay.ranks[r].heads:
            continue
        assert ops.kv_heads, r
        for name, hq, hkv in ops.kv_heads:
            assert hkv <= _g_heads(lay, r), (r, name, hq, hkv)  # never K/V at the query heads
            if kernel is Kernel.EFFICIENT and "efficient" in name:
                assert hq == hkv  # one query head per K/V head (the op refuses G < H)
            else:
                assert hq % hkv == 0, (r, name, hq, hkv)  # native GQA on a head segment


# ---- a long received block on a rank with an unaligned head range -------------------------------
BIG, SMALL = 192, 12
LONG_BLOCK = make_layout(  # group 0 (rank 0) holds most tokens; group 1 (ranks 1, 2) a few
    seq_length=BIG + SMALL,
    num_attention_heads=16,
    num_query_groups=4,  # 4 query heads per K/V head
    group_sizes=[1, 2],
    segments=[[(0, BIG)], [(BIG, BIG + 5), (BIG + 9, BIG + SMALL)], [(BIG + 5, BIG + 9)]],
    heads=[list(range(16)), [2, 3, 4, 5, 6, 7], [0, 1, *range(8, 16)]],
)  # rank 1: heads 2-7 read K/V heads 0 (2 heads) and 1 (4): an unaligned range, 2 segments


def _long_block_batch_layout() -> Layout:
    return make_layout(
        seq_length=BIG + SMALL,
        num_attention_heads=16,
        num_query_groups=4,
        group_sizes=[1, 2],
        segments=[[(0, BIG)], [(BIG, BIG + 2), (BIG + 7, BIG + SMALL)], [(BIG + 2, BIG + 7)]],
        heads=[list(range(16)), [2, 3, 4, 5, 6, 7], [0, 1, *range(8, 16)]],
    )


PATHS = {
    "dense": (False, None),
    "documents": (False, [0, 40, BIG - 30, BIG + 3, BIG + SMALL]),  # one reaches into group 1
    "one document": (False, [0, BIG + SMALL]),
    "batch layout": (True, None),
    "batch layout + documents": (True, [0, 100, BIG + 7, BIG + SMALL]),
}


@pytest.mark.parametrize("path", list(PATHS))
@pytest.mark.parametrize("kernel", KERNELS)
def test_no_kv_expanded_tensor_on_any_path(meta_runtime, kernel: Kernel, path: str) -> None:
    per_batch, cu = PATHS[path]
    lay = _long_block_batch_layout() if per_batch else LONG_BLOCK
    B, D = 2, 16
    per_rank = _run(LONG_BLOCK, lay, kernel, cu, batch=B, D=D)
    _check_kv_heads(lay, per_rank, kernel)
    for r in (1, 2):  # each receives group 0's block: T = BIG keys (pruned: at most BIG)
        H_r = len(lay.ranks[r].heads)
        expanded = BIG * B * H_r * D  # the received K/V at this rank's query heads
        # the largest legitimate tensor: K and V stacked at the K/V heads (float32 dK/dV)
        assert 2 * BIG * B * _g_heads(lay, r) * D < expanded
        assert per_rank[r].max_numel < expanded, (r, per_rank[r].max_numel, expanded)


@pytest.mark.parametrize("kernel", KERNELS)
def test_random_layouts_read_kv_at_its_own_heads(meta_runtime, kernel: Kernel) -> None:
    """Random layouts (uneven, non-contiguous heads, GQA/MQA) x every path: every attention op
    reads K/V at no more than the rank's K/V heads; with ``cudnn`` no packed block calls cuDNN."""
    rng = random.Random(1 + KERNELS.index(kernel))
    for i in range(8):
        job = random_layout(
            rng, rng.randint(2, 5), seq_length=rng.randint(40, 90), heads=rng.choice(
                [(8, 2), (12, 4), (16, 4), (8, 1)]
            )
        )  # fmt: skip
        if not all(job.group_num_tokens(g.id) for g in job.groups):
            continue  # CUDA kernels are not documented to take empty blocks
        cu = random_bounds(rng, job)
        for lay, bounds in ((job, None), (job, cu), (random_batch_layout(rng, job), None)):
            if not all(lay.group_num_tokens(g.id) for g in lay.groups):
                continue
            per_rank = _run(job, lay, kernel, bounds)
            _check_kv_heads(lay, per_rank, kernel)
            packed = bounds is not None or lay is not job
            if kernel is Kernel.CUDNN and packed:
                assert not any(
                    any(c in n for c in CUDNN_OPS) for ops in per_rank for n in ops.names
                ), i


# ---- routing: no per-shape dense cuDNN call on the packed path ----------------------------------
@pytest.mark.parametrize("path", list(PATHS))
def test_cudnn_packed_blocks_go_to_the_varlen_call(meta_runtime, path: str) -> None:
    per_batch, cu = PATHS[path]
    lay = _long_block_batch_layout() if per_batch else LONG_BLOCK
    per_rank = _run(LONG_BLOCK, lay, Kernel.CUDNN, cu)
    names = [n for ops in per_rank for n in ops.names]
    cudnn = [n for n in names if any(c in n for c in CUDNN_OPS)]
    varlen = [n for n in names if n in ("aten::_flash_attention_forward",)]
    if path == "dense":  # the job layout's fixed shapes: cuDNN's dense calls, as auto chose
        assert cudnn and not varlen
    else:  # every block (a received block of one window too) in the variable-length call
        assert varlen and not cudnn, sorted(set(names) & set(cudnn))
        assert kernel_rules.packed_kernel(Kernel.CUDNN.value) == "flash"


def test_packed_kernel_rule_applies_wherever_cudnn_does() -> None:
    """The routed call is valid wherever cuDNN is: ``cudnn_takes`` implies ``flash_takes``; and no
    kernel ``auto`` picks runs packed blocks through cuDNN."""
    caps = [(8, 0), (8, 6), (8, 9), (9, 0), (10, 0), (12, 0), (12, 1), (7, 5)]
    for cc in caps:
        for dtype in ("bf16", "fp16", "fp32"):
            for head_dim in range(8, 264, 8):
                for version in (89000, 90000, 91400, 91900):
                    if kernel_rules.cudnn_takes(cc, dtype, head_dim, version):
                        assert kernel_rules.flash_takes(cc, dtype, head_dim), (cc, dtype, head_dim)
                    auto = kernel_rules.auto_kernel(cc, dtype, head_dim, version)
                    assert kernel_rules.packed_kernel(auto) in ("flash", "efficient")
    assert kernel_rules.VARLEN_KERNELS == ("flash", "cudnn")
