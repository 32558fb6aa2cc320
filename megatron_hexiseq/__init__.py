"""megatron-hexiseq: uneven context + head parallelism for Megatron-LM on mixed GPUs.

The public API (docs/architecture.md shows the layers behind it)::

    from megatron_hexiseq import AUTO_MODES, TrainOptions, estimate, get_model, load_cluster, plan

    cluster = load_cluster("examples/clusters/mixed-h100-a100.yaml")
    model = get_model("gpt-7b", overrides={"seq_length": 131072})
    layout = plan(cluster, model, model.seq_length, TrainOptions(), modes=AUTO_MODES)  # --memory-mode auto
    print(layout.predicted["iteration_time_s"], layout.meta["options"]["memory_mode"])
    layout.save("layout.json")

Names are resolved on first use (PEP 562), so ``import megatron_hexiseq`` stays cheap: torch,
OR-Tools and megatron.core load only with the parts that need them.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from megatron_hexiseq.errors import HexiSeqError

__version__ = "0.1.0"

# public name -> the module that defines it
_EXPORTS = {
    "Cluster": "megatron_hexiseq.cluster",
    "load_cluster": "megatron_hexiseq.cluster",
    "cluster_from_dict": "megatron_hexiseq.cluster",
    "ModelSpec": "megatron_hexiseq.model",
    "get_model": "megatron_hexiseq.model",
    "Layout": "megatron_hexiseq.layout",
    "TrainOptions": "megatron_hexiseq.run_config",
    "AUTO_MODES": "megatron_hexiseq.run_config",
    "Estimate": "megatron_hexiseq.costmodel.estimate",
    "estimate": "megatron_hexiseq.costmodel.estimate",
    "plan": "megatron_hexiseq.planner.plan",
}

__all__ = [  # noqa: RUF022 (grouped as _EXPORTS)
    "HexiSeqError",
    "__version__",
    "Cluster",
    "load_cluster",
    "cluster_from_dict",
    "ModelSpec",
    "get_model",
    "Layout",
    "TrainOptions",
    "AUTO_MODES",
    "Estimate",
    "estimate",
    "plan",
]

if TYPE_CHECKING:
    from megatron_hexiseq.cluster import Cluster, cluster_from_dict, load_cluster
    from megatron_hexiseq.costmodel.estimate import Estimate, estimate
    from megatron_hexiseq.layout import Layout
    from megatron_hexiseq.model import ModelSpec, get_model
    from megatron_hexiseq.planner.plan import plan
    from megatron_hexiseq.run_config import AUTO_MODES, TrainOptions


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'megatron_hexiseq' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value  # resolved once
    return value
