"""Communication primitives of the attention runtime, with optional byte counting.

Legend: flat tensors are 1-D ``[N]`` (element counts in the split tables).

- ``uneven_all_to_all(x, *, group, send_splits, recv_splits)``: one ``autograd.Function``; forward
  is ``all_to_all_single`` with per-peer element counts (ragged, works on gloo and NCCL), backward is
  the dual all-to-all with the splits swapped. A group of size 1 (or ``None``) is the identity.
- ``post_p2p(sends, recvs, *, group, tag)``: posts one ``batch_isend_irecv`` batch and returns the
  works to wait on later (no autograd: the sub-ring attention Function drives it in forward and
  backward itself, like ring-flash-attention).
- ``warm_up(group, device)``: one tiny all-reduce in which every member takes part, so that a
  communicator that NCCL creates lazily exists before the first ``batch_isend_irecv`` on it (torch:
  every rank of a group must take part in its first P2P batch; a rank with no heads posts none).
- ``CommStats``: an optional, explicitly passed counter of bytes and computed blocks. It is the only
  mutable object here; pass one to ``hexiseq_attn_func(..., stats=...)`` to count, ``None`` to not.

No ``synchronize()`` anywhere; buffers come from ``x.new_empty``; dtypes follow the inputs.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup


@dataclass
class CommStats:
    """Bytes this rank sent/received per kind and peer (layout rank), and blocks it computed.

    Kinds: ``"a2a"`` (head all-to-all, forward and the output all-to-all), ``"a2a_bwd"`` (their
    duals in backward), ``"kv"`` (sub-ring K/V in forward), ``"kv_bwd"`` (the K/V fetched again in
    backward), ``"dkv"`` (dK/dV returned to holders). Per kind ``"local"`` (my group's own K/V) or
    ``"remote"`` (received blocks), counted in forward (backward computes the same again):
    ``blocks`` (q-block, kv-block) pairs computed, ``calls`` kernel calls (a variable-length call
    counts once), ``pairs`` (query, key) token pairs computed, summed over samples and my query heads.
    """

    sent: dict[str, dict[int, int]] = field(
        default_factory=lambda: defaultdict(lambda: defaultdict(int))
    )
    received: dict[str, dict[int, int]] = field(
        default_factory=lambda: defaultdict(lambda: defaultdict(int))
    )
    blocks: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    calls: dict[str, int] = field(default_factory=lambda: defaultdict(int))
    pairs: dict[str, int] = field(default_factory=lambda: defaultdict(int))

    def add(
        self,
        kind: str,
        *,
        sent_to: int | None = None,
        received_from: int | None = None,
        nbytes: int,
    ) -> None:
        if sent_to is not None:
            self.sent[kind][sent_to] += nbytes
        if received_from is not None:
            self.received[kind][received_from] += nbytes

    def total_sent(self, kind: str) -> int:
        return sum(self.sent[kind].values())

    def total_received(self, kind: str) -> int:
        return sum(self.received[kind].values())


def _nbytes(numel: int, x: Tensor) -> int:
    return numel * x.element_size()


# ---- ragged all-to-all ------------------------------------------------------------------------
def _all_to_all_flat(
    x_N: Tensor, group: ProcessGroup, send_splits: Sequence[int], recv_splits: Sequence[int]
) -> Tensor:
    """[sum(send_splits)] -> [sum(recv_splits)]: chunk i goes to group rank i."""
    out_N = x_N.new_empty(sum(recv_splits))
    dist.all_to_all_single(
        out_N,
        x_N.contiguous(),
        output_split_sizes=list(recv_splits),
        input_split_sizes=list(send_splits),
        group=group,
    )
    return out_N


class _UnevenAllToAll(torch.autograd.Function):
    """forward [sum(send)] -> [sum(recv)]; backward [sum(recv)] -> [sum(send)] (splits swapped)."""

    @staticmethod
    def forward(
        ctx,
        x_N: Tensor,
        group: ProcessGroup,
        send_splits: tuple[int, ...],
        recv_splits: tuple[int, ...],
        count: Callable[[str, Sequence[int], Sequence[int], Tensor], None] | None,
    ) -> Tensor:
        ctx.group, ctx.send_splits, ctx.recv_splits = group, send_splits, recv_splits
        ctx.count = count
        return _all_to_all_flat(x_N, group, send_splits, recv_splits)

    @staticmethod
    def backward(ctx, grad_N: Tensor):
        if ctx.count is not None:
            ctx.count("a2a_bwd", ctx.recv_splits, ctx.send_splits, grad_N)
        return (
            _all_to_all_flat(grad_N, ctx.group, ctx.recv_splits, ctx.send_splits),
            None,
            None,
            None,
            None,
        )


def uneven_all_to_all(
    x_N: Tensor,
    *,
    group: ProcessGroup | None,
    send_splits: Sequence[int],
    recv_splits: Sequence[int],
    stats: CommStats | None = None,
    peers: Sequence[int] | None = None,
    kind: str = "a2a",
) -> Tensor:
    """Ragged all-to-all of a flat tensor: ``x_N[chunk i]`` goes to group rank i.

    Shapes: forward ``[sum(send_splits)] -> [sum(recv_splits)]``; backward the reverse. ``group``
    of size 1 or ``None`` is the identity (``send_splits == recv_splits`` then). ``peers[i]`` names
    group rank i for ``stats`` (this rank's own chunk is not counted as traffic).
    """
    if x_N.dim() != 1 or x_N.numel() != sum(send_splits):
        raise ValueError(
            f"uneven_all_to_all wants a flat tensor of {sum(send_splits)} elements, got {tuple(x_N.shape)}"
        )
    if group is None or dist.get_world_size(group) == 1:
        assert tuple(send_splits) == tuple(recv_splits), (send_splits, recv_splits)
        return x_N
    count = None
    if stats is not None:
        me = dist.get_rank(group)

        def count(name: str, sends: Sequence[int], recvs: Sequence[int], like: Tensor) -> None:
            for i, (ns, nr) in enumerate(zip(sends, recvs)):
                if i != me:
                    peer = peers[i] if peers is not None else i
                    stats.add(name, sent_to=peer, nbytes=_nbytes(ns, like))
                    stats.add(name, received_from=peer, nbytes=_nbytes(nr, like))

        count(kind, send_splits, recv_splits, x_N)
    return _UnevenAllToAll.apply(x_N, group, tuple(send_splits), tuple(recv_splits), count)


# ---- batched point-to-point -------------------------------------------------------------------
def post_p2p(
    sends: Sequence[tuple[int, Tensor]],
    recvs: Sequence[tuple[int, Tensor]],
    *,
    group: ProcessGroup,
    tag: int,
) -> list:
    """Post one ``batch_isend_irecv`` batch; ``(global_peer, tensor)`` pairs. Returns works to wait on.

    Every transfer of one step between one (source, destination) pair is a single message, and the
    tag names the step, so messages match unambiguously on gloo (NCCL matches in posting order, which
    is the same global step order on both sides).
    """
    ops = [dist.P2POp(dist.isend, t, peer, group, tag) for peer, t in sends]
    ops += [dist.P2POp(dist.irecv, t, peer, group, tag) for peer, t in recvs]
    if not ops:
        return []
    return dist.batch_isend_irecv(ops)


def warm_up(group: ProcessGroup, device: torch.device) -> None:
    """Every member of ``group`` calls this once, right after the group is created (collective)."""
    dist.all_reduce(torch.zeros(1, device=device), group=group)


def wait_all(works: list) -> None:
    """Wait for works from ``post_p2p`` (a no-op for an empty list)."""
    for w in works:
        w.wait()
