"""Megatron's tensor parallelism under a HexiSeq layout: the start-up checks of a TP run.

With ``--tensor-model-parallel-size t`` Megatron's rank order ``tp-cp-ep-dp-pp`` makes every t
consecutive global ranks one TP group (a **bundle**: one layout rank) and the CP group of TP rank
i the TP-rank-i GPUs of ``--context-parallel-size`` bundles. HexiSeq keeps that grid: the layout
(planned over bundles, ``layout.tensor_model_parallel_size == t``, heads per TP rank:
``megatron_hexiseq.tensor_parallel``) runs on every CP group, i.e. once per (data-parallel replica,
TP rank), and ``attention.groups.build_hexiseq_groups`` builds the A2A groups of each CP group as
for data-parallel replicas (every CP group is one *domain*, all created in one order on every
process). TP rank i's core attention receives exactly its slice of the heads
(``query [s_r, b, H/t, d]``, ``key/value [s_r, b, G_t, d]``) and runs the layout on it.

Sequence parallelism (``--sequence-parallel``) is Megatron's own: outside attention and the MLP a
bundle's ``s_r`` tokens are split over its t ranks (the embedding scatters them; the QKV and fc1
column-parallel linears all-gather them, the projection and fc2 row-parallel linears
reduce-scatter), so the core attention still sees the bundle's whole ``s_r`` tokens. Megatron's
scatter needs ``s_r % t == 0``: with sequence parallelism every bundle of the layout (and of every
per-micro-batch layout) must hold a multiple of t tokens.
"""

from __future__ import annotations

import socket
import warnings
from collections.abc import Sequence

import torch.distributed as dist

from megatron_hexiseq.errors import HexiSeqError
from megatron_hexiseq.layout import Layout
from megatron_hexiseq.tensor_parallel import tp_heads


def check_tp_layout(
    layout: Layout,
    *,
    tensor_model_parallel_size: int,
    num_attention_heads: int,
    num_query_groups: int,
    sequence_parallel: bool,
    source: str = "layout",
) -> None:
    """The layout was planned for this TP size and model (heads per TP rank), and with sequence
    parallelism every bundle holds a multiple of t tokens. One ``HexiSeqError`` line each."""
    t = tensor_model_parallel_size
    if layout.tensor_model_parallel_size != t:
        raise HexiSeqError(
            f"{source} is planned for TP bundles of {layout.tensor_model_parallel_size} GPUs but "
            f"--tensor-model-parallel-size is {t}; re-plan with 'megatron-hexiseq plan "
            f"--tensor-model-parallel-size {t}' or set --tensor-model-parallel-size "
            f"{layout.tensor_model_parallel_size}"
        )
    heads, groups = tp_heads(num_attention_heads, num_query_groups, t)
    if (layout.num_attention_heads, layout.num_query_groups) != (heads, groups):
        per = "" if t == 1 else f" per TP rank (model: {num_attention_heads} / {num_query_groups})"
        raise HexiSeqError(
            f"{source} is planned for {layout.num_attention_heads} attention heads in "
            f"{layout.num_query_groups} query groups but the model has {heads} in {groups}{per}; "
            "re-plan for this model (--num-query-groups with --group-query-attention)"
        )
    if sequence_parallel:
        check_bundle_tokens(layout, t, what=source)


def check_bundle_tokens(layout: Layout, tp: int, *, what: str = "layout") -> None:
    """With sequence parallelism, every bundle's token count is a multiple of ``tp`` (Megatron's
    scatter of the embedding output along the sequence needs it)."""
    if tp == 1:
        return
    odd = [(r.rank, r.num_tokens) for r in layout.ranks if r.num_tokens % tp]
    if odd:
        rank, n = odd[0]
        more = f" (and {len(odd) - 1} more)" if len(odd) > 1 else ""
        raise HexiSeqError(
            f"{what}: TP bundle {rank} holds {n} tokens{more}, not a multiple of "
            f"--tensor-model-parallel-size {tp}, which --sequence-parallel needs (Megatron splits a "
            f"bundle's tokens evenly over its {tp} GPUs); re-plan with 'megatron-hexiseq plan "
            f"--tensor-model-parallel-size {tp}' or drop --sequence-parallel"
        )


def check_bundle_hosts(
    tp_groups: Sequence[Sequence[int]], hosts: Sequence[str], *, allow_mismatch: bool = False
) -> list[str]:
    """Each TP group (global ranks) runs on one host (``hosts[g]``: global rank g's host name): a
    bundle is t GPUs of one node, its collectives run every layer over NVLink. Raises, or returns
    the problems as warnings with ``allow_mismatch``."""
    problems = []
    for group in tp_groups:
        names = sorted({hosts[g] for g in group})
        if len(names) > 1:
            problems.append(f"TP group {list(group)} spans hosts {', '.join(names)}")
    if problems and not allow_mismatch:
        raise HexiSeqError(
            f"{problems[0]}: a TP bundle must be t GPUs of one node (Megatron puts t consecutive "
            "global ranks in one TP group); launch ranks in layout order (scripts/slurm/) or pass "
            "--hexiseq-allow-mismatch"
        )
    return problems


def check_tp_group_hosts(tp_group: dist.ProcessGroup, *, allow_mismatch: bool = False) -> None:
    """:func:`check_bundle_hosts` on the running processes: every TP group (Megatron's, this
    process's ``tp_group`` one of them) on one host. Collective over the default group; nothing
    to check for a TP group of one process (every process passes a group of one alike). With
    ``allow_mismatch`` the problems are warnings (global rank 0's)."""
    if dist.get_world_size(tp_group) == 1:
        return
    bundles: list[tuple[tuple[int, ...], str] | None] = [None] * dist.get_world_size()
    mine = (tuple(sorted(dist.get_process_group_ranks(tp_group))), socket.gethostname())
    dist.all_gather_object(bundles, mine)
    hosts = [b[1] for b in bundles if b is not None]
    tp_groups = sorted({b[0] for b in bundles if b is not None})
    for problem in check_bundle_hosts(tp_groups, hosts, allow_mismatch=allow_mismatch):
        if dist.get_rank() == 0:
            warnings.warn(f"hexiseq: {problem} (--hexiseq-allow-mismatch)", stacklevel=2)
