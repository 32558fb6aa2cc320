"""The same weights on every GPU model: one broadcast at set-up, 64-bit hash checks after.

Megatron initialises the parameters on the GPU from one seed on every data-parallel and
context-parallel rank and never broadcasts them (it does only with ``--data-parallel-random-init``,
whose seeds differ on purpose). PyTorch's CUDA generator lays random numbers out over a launch grid
sized by the GPU's number of SMs (``calc_execution_policy`` in ATen's
``native/cuda/DistributionTemplates.h``), so an H100 SXM (132 SMs), an A100 (108) and an H100 PCIe
(114) draw different weights from the same seed: with plain DDP the replicas would never become
one model, and with the distributed optimizer step 1 would mix shards of different models.

- :func:`broadcast_parameters` sends every parameter and every *persistent* buffer (what a
  checkpoint holds) from the first rank of the group that holds it to the others: dense tensors
  over Megatron's data-parallel x context-parallel group, expert-parallel parameters (Megatron
  marks them ``allreduce = False``) over the expert data-parallel group, as Megatron's own
  ``DistributedDataParallel.broadcast_params`` chooses. Non-persistent buffers are per-rank state by
  design (the layout RoPE's positions) and stay; tensors on the meta device (Megatron-FSDP's
  deferred initialisation: each shard is then initialised once, on the rank that holds it) are
  skipped.
- :func:`tensors_hash` is a 64-bit hash of the tensors' bits: ``sum_i bits_i x w_i mod 2^64``, with
  ``w_i`` an odd number derived from element i's position (two's-complement int64 arithmetic, which
  torch's integer kernels use on CPU and CUDA alike; the sum modulo 2^64 does not depend on the
  reduction order, so every device computes the same value). Changing any single element by any
  amount, one ULP included, changes the hash (``delta x w_i`` is never 0 mod 2^64 for an odd ``w_i``
  and ``0 < |delta| < 2^64``).
- :func:`check_same_parameters` all-gathers the hashes over each group and raises one
  ``HexiSeqError`` naming the global ranks whose parameters differ from the majority.

:func:`share_initial_parameters` (the plugin's model provider calls it on every model chunk it
builds, before Megatron wraps it in DDP and builds the optimizer from it) broadcasts, then checks.
:class:`ParamsCheck` repeats the check after every N-th training step (``--hexiseq-check-params N``).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from megatron_hexiseq.errors import HexiSeqError

# 0x9E3779B97F4A7C15 (2^64 / golden ratio, Knuth's multiplicative hashing) as a signed int64
_MIX = 0x9E3779B97F4A7C15 - (1 << 64)
_CHUNK = 1 << 22  # elements hashed at once (three int64 temporaries of 32 MiB)
_BITS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}

Groups = tuple[Any, Any]  # (dense group, expert group or None)


def replicated_tensors(module: torch.nn.Module) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """``(dense, expert)``: the parameters and persistent buffers of ``module``, each once, in
    module order; expert-parallel parameters (``allreduce = False``) apart. Meta tensors left out."""
    dense: list[torch.Tensor] = []
    expert: list[torch.Tensor] = []
    for p in module.parameters():
        if not p.is_meta:
            (dense if getattr(p, "allreduce", True) else expert).append(p)
    seen: set[int] = set()
    for mod in module.modules():
        for name, buf in mod._buffers.items():
            if buf is None or buf.is_meta or name in mod._non_persistent_buffers_set:
                continue
            if id(buf) not in seen:
                seen.add(id(buf))
                dense.append(buf)
    return dense, expert


def tensors_hash(tensors: Iterable[torch.Tensor]) -> int:
    """The 64-bit hash of the tensors' bits (module docstring), as an unsigned Python int. The sum
    stays on the tensors' device (int64, wrapping mod 2^64) until the end: one host sync per device."""
    totals: dict[torch.device, torch.Tensor] = {}
    offset = 0
    for t in tensors:
        flat = t.detach().reshape(-1)
        if flat.is_complex():
            flat = torch.view_as_real(flat).reshape(-1)
        bits = flat.view(_BITS[flat.element_size()])
        for start in range(0, bits.numel(), _CHUNK):
            part = bits[start : start + _CHUNK].to(torch.int64)
            pos = torch.arange(
                offset + start + 1,
                offset + start + 1 + part.numel(),
                dtype=torch.int64,
                device=part.device,
            )
            chunk = (part * ((pos * _MIX) | 1)).sum()
            totals[part.device] = totals[part.device] + chunk if part.device in totals else chunk
        offset += bits.numel()
    return sum(int(t) for t in totals.values()) % (1 << 64)


def _comm_device(group: Any) -> torch.device:
    """Where a collective of ``group`` takes its tensors: the current CUDA device on NCCL."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


@torch.no_grad()
def broadcast_parameters(module: torch.nn.Module, *, group: Any, expert_group: Any = None) -> None:
    """Collective over ``group`` (and ``expert_group``): every rank takes the first rank's values
    of every parameter and persistent buffer (module docstring)."""
    dense, expert = replicated_tensors(module)
    for tensors, grp in ((dense, group), (expert, expert_group)):
        if grp is None or dist.get_world_size(grp) == 1 or not tensors:
            continue
        src = dist.get_process_group_ranks(grp)[0]
        device = _comm_device(grp)
        for t in tensors:
            if t.device == device or device.type == "cpu":
                dist.broadcast(t.data, src=src, group=grp)
            else:  # CPU-initialised weights on NCCL: through the device and back
                on_device = t.data.to(device)
                dist.broadcast(on_device, src=src, group=grp)
                t.data.copy_(on_device)


def check_same_parameters(
    module: torch.nn.Module, *, group: Any, expert_group: Any = None, when: str = ""
) -> None:
    """Collective over ``group`` (and ``expert_group``): one ``HexiSeqError`` naming the ranks whose
    parameters differ from the majority's (64-bit hashes compared; ``when`` goes in the message)."""
    dense, expert = replicated_tensors(module)
    for kind, tensors, grp in (
        ("parameters", dense, group),
        ("expert parameters", expert, expert_group),
    ):
        if grp is None or dist.get_world_size(grp) == 1 or not tensors:
            continue
        mine = torch.tensor([tensors_hash(tensors) - (1 << 63)], dtype=torch.int64)
        gathered = [
            torch.empty_like(mine, device=_comm_device(grp))
            for _ in range(dist.get_world_size(grp))
        ]
        dist.all_gather(gathered, mine.to(_comm_device(grp)), group=grp)
        hashes = [int(h.item()) + (1 << 63) for h in gathered]
        if len(set(hashes)) > 1:
            raise HexiSeqError(
                mismatch_message(kind, hashes, dist.get_process_group_ranks(grp), when)
            )


def mismatch_message(kind: str, hashes: Sequence[int], ranks: Sequence[int], when: str) -> str:
    """One line: which global ranks hold other ``kind`` than the majority (pure)."""
    common, _ = Counter(hashes).most_common(1)[0]
    odd = [g for g, h in zip(ranks, hashes) if h != common]
    agree = [g for g, h in zip(ranks, hashes) if h == common]
    others = sorted({h for h in hashes if h != common})
    return (
        f"{kind} differ across ranks{' ' + when if when else ''}: global rank"
        f"{'s' if len(odd) > 1 else ''} {', '.join(map(str, odd))} hold other values than "
        f"global rank{'s' if len(agree) > 1 else ''} {', '.join(map(str, agree))} (64-bit hash "
        f"{', '.join(f'{h:#018x}' for h in others)} vs {common:#018x}); every rank must run the "
        "same model: check that all ranks start from the same weights or checkpoint"
    )


def megatron_replica_groups(pg_collection: Any = None) -> Groups:
    """(dense, expert) groups of Megatron's run: ``dp_cp`` and the expert data-parallel group,
    from ``pg_collection`` when it has them, else from ``megatron.core.parallel_state``."""
    from megatron.core import parallel_state as mpu

    dense = getattr(pg_collection, "dp_cp", None) or mpu.get_data_parallel_group(
        with_context_parallel=True
    )
    expert = getattr(pg_collection, "expt_dp", None) or mpu.get_expert_data_parallel_group(
        check_initialized=False
    )
    return dense, expert


def share_initial_parameters(module: torch.nn.Module, groups: Groups) -> None:
    """Broadcast the freshly built ``module``'s parameters over ``groups``, then check them."""
    dense, expert = groups
    broadcast_parameters(module, group=dense, expert_group=expert)
    check_same_parameters(module, group=dense, expert_group=expert, when="at start-up")


class ParamsCheck:
    """:func:`check_same_parameters` on every model chunk after every ``every``-th call of
    :meth:`after_step` (one call per training step, on every rank); ``groups()`` gives the groups."""

    def __init__(self, every: int, groups: Callable[[], Groups]) -> None:
        if every < 1:
            raise HexiSeqError(f"a parameter check needs a period >= 1, got {every}")
        self.every = every
        self.groups = groups
        self.steps = 0

    def after_step(self, model: torch.nn.Module | Sequence[torch.nn.Module]) -> None:
        self.steps += 1
        if self.steps % self.every:
            return
        dense, expert = self.groups()
        for chunk in [model] if isinstance(model, torch.nn.Module) else model:
            check_same_parameters(
                chunk,
                group=dense,
                expert_group=expert,
                when=f"after training step {self.steps} of this run",
            )
