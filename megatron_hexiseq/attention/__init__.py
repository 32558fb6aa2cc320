"""Exact uneven attention runtime (HexiSeq): head all-to-all inside A2A groups, sub-ring K/V
exchange across groups, block attention with LSE merge. See docs/attention.md.

Public API: ``build_hexiseq_groups``, ``HexiSeqGroups``, ``hexiseq_attn_func``,
``reference_attention``, ``CommStats``, ``uneven_all_to_all``.
"""

from megatron_hexiseq.attention.comm import CommStats, uneven_all_to_all
from megatron_hexiseq.attention.groups import HexiSeqGroups, build_hexiseq_groups
from megatron_hexiseq.attention.hexiseq import hexiseq_attn_func
from megatron_hexiseq.attention.reference import reference_attention

__all__ = [
    "CommStats",
    "HexiSeqGroups",
    "build_hexiseq_groups",
    "hexiseq_attn_func",
    "reference_attention",
    "uneven_all_to_all",
]
