"""Shared fixtures.

``pinned_catalog``: the planner's tests plan on catalog GPU names; this fixture replaces the
catalog, for one test, by GPU types whose numbers are written here (dense BF16 peak x 0.5, one flat
rate for matmul and attention, memory, NVLink), so a recalibration of the real catalog
(``megatron_hexiseq.gpu_rates``) cannot change what those tests check. Use it with
``pytestmark = pytest.mark.usefixtures("pinned_catalog")``.
"""

from __future__ import annotations

from types import MappingProxyType

import pytest

import megatron_hexiseq.cluster as cluster_module
from megatron_hexiseq.cluster import GpuType

# name: (dense BF16 TFLOP/s, memory GiB, NVLink GB/s one direction)
PINNED = {
    "H100-SXM-80GB": (989.4, 80, 450),
    "H100-PCIe-80GB": (756.5, 80, 64),
    "H200-141GB": (989.4, 141, 450),
    "B200-192GB": (2250, 180, 900),
    "A100-SXM-80GB": (312, 80, 300),
    "A100-SXM-40GB": (312, 40, 300),
    "A800-80GB": (312, 80, 200),
    "L40S-48GB": (362.05, 48, 32),
    "V100-SXM-32GB": (125, 32, 150),
}


@pytest.fixture
def pinned_catalog(monkeypatch: pytest.MonkeyPatch) -> None:
    types = {
        name: GpuType(
            name=name,
            bf16_tflops=peak,
            memory_gib=mem,
            nvlink_GBps=nvlink,
            efficiency=0.5,
            source="pinned for the planner's tests (tests/conftest.py)",
        )
        for name, (peak, mem, nvlink) in PINNED.items()
    }
    types["CPU"] = cluster_module.GPU_CATALOG["CPU"]
    monkeypatch.setattr(cluster_module, "GPU_CATALOG", MappingProxyType(types))
