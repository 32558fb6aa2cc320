"""NCCL communicator YAML (Megatron's ``--nccl-communicator-config-path``).

Format, as read by ``megatron.core.parallel_state.initialize_model_parallel`` (core_v0.16.1):
``yaml.safe_load`` of a mapping from process-group name (``dp``, ``dp_cp``, ``cp``, ``hcp``,
``tp``, ... see ``knobs.MEGATRON_NCCL_GROUPS``) to a mapping with any of ``min_ctas``,
``max_ctas``, ``cga_cluster_size`` (ints), ``net_name`` (``IB``/``socket``) and
``is_high_priority_stream`` (bool). ``get_nccl_options`` turns an entry into
``ProcessGroupNCCL.Options``; a key left out keeps NCCL's default (Hopper: cga 4, max 32, min 1).
``--high-priority-stream-groups g1 g2`` sets ``is_high_priority_stream: true`` on top of the YAML.
"""

from __future__ import annotations

import os
from typing import Any

import yaml

from megatron_hexiseq.io import write_text_atomic
from megatron_hexiseq.overlap.knobs import OverlapConfig


def nccl_yaml_dict(config: OverlapConfig) -> dict[str, dict[str, Any]]:
    """The YAML mapping for ``config.nccl``: one entry per group, unset keys left out."""
    out: dict[str, dict[str, Any]] = {}
    for g in config.nccl:
        entry: dict[str, Any] = {}
        for key in ("min_ctas", "max_ctas", "cga_cluster_size"):
            value = getattr(g, key)
            if value is not None:
                entry[key] = int(value)
        entry["is_high_priority_stream"] = bool(g.is_high_priority_stream)
        out[g.group] = entry
    return out


def nccl_yaml_text(config: OverlapConfig) -> str:
    return yaml.safe_dump(nccl_yaml_dict(config), sort_keys=True, default_flow_style=False)


def write_nccl_yaml(config: OverlapConfig, path: str | os.PathLike) -> bool:
    """Write the YAML atomically; returns False (and writes nothing) when no group is configured."""
    if not config.nccl:
        return False
    write_text_atomic(path, nccl_yaml_text(config))
    return True
