"""Tensor parallelism inside a HexiSeq layout: TP bundles and how heads map onto TP ranks.

With Megatron's ``--tensor-model-parallel-size t`` a **TP bundle** is the t GPUs of one node that
share every layer's weights (Megatron's TP group: t consecutive global ranks, ``tp-cp-ep-dp-pp``
order). A layout with ``tensor_model_parallel_size = t`` is planned **over bundles**: its rank r
is bundle r (``host`` and ``gpu`` name the bundle's node and GPU type), its groups, segments and
heads are the bundle's, and TP rank i of every bundle runs the same layout with the TP-rank-i
GPUs of the other bundles (Megatron's CP group of TP rank i).

**Heads.** A layout over bundles counts heads per TP rank, as Megatron's attention does
(``num_attention_heads_per_partition``, ``num_query_groups_per_partition``): ``H_t = H / t`` query
heads and ``G_t = G / t`` K/V heads, or ``G_t = 1`` with Megatron's K/V replication when ``G < t``
(``t % G == 0``: each K/V head is computed on ``t / G`` TP ranks). Those are the layout's
``num_attention_heads`` and ``num_query_groups``. Its head ``h`` is **local head h on every TP rank**:
on TP rank i it is the model's query head ``i * H_t + h``, reading the model's K/V head
``i * G_t + h // (H_t / G_t)`` (``i // (t / G)`` with replication). So the layout's head ranges are
planned once, on ``H_t`` bundle heads, and each TP rank computes them on its own slice of the
model's heads: exactly the query/key/value tensors Megatron's ``SelfAttention`` hands the core
attention of TP rank i (``megatron/core/transformer/attention.py``, core_v0.16.1).

Pure, torch-free: the layout, the runtime's start-up checks, the planner and the cost model share it.
"""

from __future__ import annotations

from collections.abc import Sequence

from megatron_hexiseq.errors import HexiSeqError, check_positive_int


def tp_heads(num_attention_heads: int, num_query_groups: int, tp: int) -> tuple[int, int]:
    """``(query heads, K/V heads)`` of one TP rank: ``(H / t, G / t)``, or ``(H / t, 1)`` with K/V
    replication (``G < t``, ``t % G == 0``). One ``HexiSeqError`` line when Megatron cannot split
    the heads over ``tp`` ranks (its ``divide`` asserts)."""
    check_positive_int("--tensor-model-parallel-size", tp)
    H, G = num_attention_heads, num_query_groups
    if H % tp:
        raise HexiSeqError(
            f"{H} attention heads do not divide over --tensor-model-parallel-size {tp}; choose a "
            f"tensor-parallel size that divides {H}"
        )
    if G >= tp:
        if G % tp:
            raise HexiSeqError(
                f"{G} query groups do not divide over --tensor-model-parallel-size {tp}; choose a "
                f"tensor-parallel size that divides {G} (or a multiple of it that divides {H})"
            )
        return H // tp, G // tp
    if tp % G:
        raise HexiSeqError(
            f"{G} query groups on --tensor-model-parallel-size {tp}: Megatron replicates K/V heads "
            f"only when the tensor-parallel size is a multiple of the query groups; choose one "
            f"that divides {G} or is a multiple of it"
        )
    return H // tp, 1


def valid_tp_sizes(
    num_attention_heads: int, num_query_groups: int, gpus_per_node: Sequence[int]
) -> list[int]:
    """Every t (ascending) that splits the heads (``tp_heads``) and divides every node's GPU count."""
    out = []
    for t in range(1, min(gpus_per_node, default=1) + 1):
        if any(n % t for n in gpus_per_node):
            continue
        try:
            tp_heads(num_attention_heads, num_query_groups, t)
        except HexiSeqError:
            continue
        out.append(t)
    return out


def global_query_head(local_head: int, tp_rank: int, num_attention_heads: int, tp: int) -> int:
    """The model's query head that a layout's (local) head ``local_head`` is on TP rank ``tp_rank``."""
    return tp_rank * (num_attention_heads // tp) + local_head


def global_kv_head(local_kv_head: int, tp_rank: int, num_query_groups: int, tp: int) -> int:
    """The model's K/V head that local K/V head ``local_kv_head`` is on TP rank ``tp_rank``
    (with replication, ``G < t``, every TP rank holds one: ``tp_rank // (t / G)``)."""
    if num_query_groups < tp:
        assert local_kv_head == 0, local_kv_head
        return tp_rank // (tp // num_query_groups)
    return tp_rank * (num_query_groups // tp) + local_kv_head


def check_bundle_nodes(gpus_per_node: Sequence[tuple[str, int]], tp: int) -> None:
    """Every node's GPU count is a multiple of ``tp`` (a bundle never spans nodes); else one line
    naming the first node that does not split."""
    for name, count in gpus_per_node:
        if count % tp:
            raise HexiSeqError(
                f"node {name!r} has {count} GPUs, which do not split into TP bundles of "
                f"--tensor-model-parallel-size {tp}; a bundle is t GPUs of one node"
            )
