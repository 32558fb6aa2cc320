"""Ranks that plan the same thing independently check that they agree, instead of trusting it.

Every rank of a domain plans each micro-batch's layout itself (and every rank of the run schedules
the global batch): a different last bit of a floating-point cost on one CPU could flip a near-tie,
and the ranks would then post all-to-alls of mismatched sizes (a hang) or attend with another
rank's segments (silently wrong). So each item's 63-bit digest (``varlen.digest``) is compared once,
before anything of that micro-batch runs: ONE all-reduce (MIN of ``[d, -d]``: the minimum and the
maximum together) on a gloo side group, on the host, off the device. Only when some item differs are
the digests all-gathered, to name the ranks; every rank then raises the same ``HexiSeqError``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from megatron_hexiseq.errors import HexiSeqError


def check_agreement(
    digests: Sequence[int], group: dist.ProcessGroup, *, names: Sequence[str]
) -> None:
    """Raise on every member of ``group`` unless all hold the same ``digests`` (one per item,
    ``names[i]`` naming item i, e.g. "micro-batch 12"). Collective over ``group`` (gloo)."""
    n = len(digests)
    if n == 0 or dist.get_world_size(group) == 1:
        return
    both = torch.tensor([*digests, *(-int(d) for d in digests)], dtype=torch.int64)
    dist.all_reduce(both, op=dist.ReduceOp.MIN, group=group)
    low, high = both[:n].tolist(), [-x for x in both[n:].tolist()]
    bad = [i for i in range(n) if low[i] != high[i]]
    if not bad:
        return
    mine = torch.tensor([int(d) for d in digests], dtype=torch.int64)
    gathered = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
    dist.all_gather(gathered, mine, group=group)
    ranks = dist.get_process_group_ranks(group)
    i = bad[0]
    holders: dict[int, list[int]] = {}
    for r, got in zip(ranks, gathered):
        holders.setdefault(int(got[i]), []).append(r)
    camps = sorted(holders.values(), key=lambda rs: (-len(rs), rs))
    others = ", ".join(str(c) for c in camps[1:])
    raise HexiSeqError(
        f"{names[i]}: ranks {others} hold a different plan than ranks {camps[0]} "
        f"({len(bad)} of {n} items differ); every rank must plan the same from the same input "
        "(same code, same cluster/model/options, same documents): stopped before it ran"
    )
