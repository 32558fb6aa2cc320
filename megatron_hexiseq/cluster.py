"""Cluster spec (YAML) and the built-in GPU catalog.

A cluster is a list of nodes; each node holds ``count`` GPUs of one type. Devices (one per GPU)
are numbered node by node in file order, local index ascending: layout rank ``r`` runs on
``cluster.devices[r]``.

Units: TFLOP/s (dense BF16 tensor-core peak, 1e12 FLOP/s), GiB (2**30 bytes) of memory, GB/s
(1e9 bytes/s) of bandwidth. Every bandwidth here is **per GPU, one direction**: ``nvlink_GBps``
is what one GPU can send (and at the same time receive) to the other GPUs of its node,
``network_GBps`` what it can send to GPUs of other nodes. Vendor datasheets quote NVLink as a
bidirectional aggregate (H100: "900 GB/s"), so the catalog holds half of that number (450), the
figure the HexiSeq paper uses for its H100 nodes.

YAML format (see docs/specs.md)::

    name: mixed-h100-a100
    gpus:                     # optional: custom types, or overrides of catalog entries
      MY-GPU: {bf16_tflops: 200, memory_gib: 48, nvlink_GBps: 300}
    nodes:
      - name: node0           # hostname as the scheduler reports it
        gpu: H100-SXM-80GB    # catalog key or a key of `gpus`
        count: 8
        nvlink_GBps: 450      # optional (default: the GPU type's)
        network_GBps: 25      # per-GPU inter-node bandwidth (required)
        memory_gib: 60        # optional per-node memory budget (default: the GPU type's)
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from functools import cached_property
from types import MappingProxyType
from typing import Any

from megatron_hexiseq import gpu_rates, spec_schema
from megatron_hexiseq.errors import HexiSeqError, short
from megatron_hexiseq.io import read_yaml

# Names that reach a command line, a rank table ("RANK HOST LOCAL_RANK") or ``--exclude HOST:GPU``:
# a letter or digit, then letters, digits, ``_ . -`` (no ``:`` ``,`` ``/`` whitespace or ``..``).
NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$"
_NAME = re.compile(NAME_PATTERN)
NAME_RULE = (
    "a letter or digit, then letters, digits, '_', '.' or '-' (no ':', ',', '/', '..' or spaces), "
    "at most 128 characters"
)
# What a cluster spec may describe (a whole allocation, data-parallel replicas included) and what
# ``plan`` / ``simulate`` take on (one replica): docs/operability.md, "Documented maxima".
MAX_CLUSTER_GPUS, MAX_CLUSTER_NODES = 65_536, 16_384
MAX_PLAN_GPUS, MAX_PLAN_NODES = 4096, 1024


# A cluster's own name (``name:``, ``profile --name``): a name as above, '+' allowed too (the CPU
# testbed's shapes: cpu-testbed-1+2); it is printed in one-line tables and messages.
CLUSTER_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.+-]{0,127}$"
_CLUSTER_NAME = re.compile(CLUSTER_NAME_PATTERN)
CLUSTER_NAME_RULE = (
    "a letter or digit, then letters, digits, '_', '.', '+' or '-' (no spaces or line breaks), at "
    "most 128 characters"
)


def is_name(text: object) -> bool:
    """A node / host / GPU type name the launchers can pass around (:data:`NAME_PATTERN`; the whole
    text: ``re.match``'s ``$`` would also take a name ending in a line break)."""
    return isinstance(text, str) and _NAME.fullmatch(text) is not None and ".." not in text


def check_cluster_name(name: object, where: str = "name") -> str:
    """``name`` if it follows :data:`CLUSTER_NAME_PATTERN`, else one HexiSeqError."""
    if isinstance(name, str) and _CLUSTER_NAME.fullmatch(name) is not None:
        return name
    raise HexiSeqError(f"{where} {short(name)} is not a cluster name: {CLUSTER_NAME_RULE}")


DEFAULT_EFFICIENCY = 0.5
"""Achievable fraction of the peak for a GPU type described only by its peak (``bf16_tflops``):
custom types without ``achieved_tflops``. The catalog's GPUs carry achieved rates per operation
and kernel instead (``megatron_hexiseq.gpu_rates``, docs/specs.md "Achieved rates")."""

Curve = tuple[tuple[float, float], ...]
RATE_KEY = re.compile(r"^(matmul/(bf16|fp16)|[a-z0-9-]+/(bf16|fp16)/[1-9][0-9]*)$")
CURVE_KEY = re.compile(r"^[a-z0-9-]+/(causal|full)$")


@dataclass(frozen=True, kw_only=True)
class GpuType:
    """One kind of accelerator.

    ``bf16_tflops``: dense BF16 tensor-core peak (no sparsity); ``efficiency``: the achievable
    fraction of it; ``attention_tflops``: optional separate peak for the attention kernel (same
    efficiency scale; ``profile`` measures it), default = ``bf16_tflops``.

    Achieved rates (docs/specs.md "Achieved rates"; the catalog's come from
    :mod:`megatron_hexiseq.gpu_rates`, ``profile`` measures them on GPUs): ``achieved_tflops`` as
    ``(key, TFLOP/s)`` pairs, keys ``matmul/<dtype>`` (the linear work in training) and
    ``<kernel>/<dtype>/<head dim>`` (attention forward + backward on long causal blocks, the
    FlashAttention papers' FLOP count); ``attention_curves``: ``(kernel/mask, points)`` pairs that
    replace the catalog's measured curves of achieved rate against the work of one call;
    ``compute_capability`` decides the kernel ``auto`` picks and the training dtype (fp16 below 8.0).
    When ``achieved_tflops`` has a ``matmul`` figure it replaces ``bf16_tflops * efficiency`` for
    the linear work, and its attention figures replace it for attention, unless
    ``attention_tflops`` is given (one flat rate for every kernel and call size, as on the CPU
    testbed).

    Fixed costs (default 0, which is what the catalog assumes for GPUs; ``profile`` measures them on
    the CPU testbed, where they are large; docs/cost_model.md "Fixed costs"):
    ``step_overhead_ms`` per training iteration whatever the tokens (optimizer step, framework),
    of which ``micro_batch_overhead_ms`` is paid again by every further micro-batch of a step (the
    framework's fixed cost of a forward and backward: a step of ``m`` micro-batches pays
    ``step_overhead_ms + (m - 1) * micro_batch_overhead_ms``);
    ``collective_latency_us`` per head all-to-all collective; ``p2p_latency_us`` per K/V exchange
    step (one sub-ring round of one layer, one direction of the pass); ``window_overhead_us`` per
    attention kernel call of a packed micro-batch (one document window, or one block with a
    variable-length kernel), forward and backward each: the runtime's slicing and merging around it.

    ``hbm_GBps``: the device memory's bandwidth (datasheet, GB/s; the catalog's in
    :data:`HBM_GBPS` with sources): what the optimizer step, a memory-bound pass over the rank's
    shard, runs at (``costmodel.step``). 0: unknown, and the step's optimizer time is not priced
    (the CPU testbed, whose measured ``step_overhead_ms`` holds it).
    """

    name: str
    bf16_tflops: float
    memory_gib: float
    nvlink_GBps: float
    efficiency: float = DEFAULT_EFFICIENCY
    source: str = ""
    attention_tflops: float | None = None
    step_overhead_ms: float = 0.0
    micro_batch_overhead_ms: float = 0.0
    collective_latency_us: float = 0.0
    p2p_latency_us: float = 0.0
    window_overhead_us: float = 0.0
    hbm_GBps: float = 0.0
    compute_capability: float | None = None
    achieved_tflops: tuple[tuple[str, float], ...] = ()
    attention_curves: tuple[tuple[str, Curve], ...] = ()

    @property
    def train_dtype(self) -> str:
        """``bf16``, or ``fp16`` on GPUs without BF16 tensor cores (compute capability < 8.0)."""
        cc = self.compute_capability
        return "fp16" if cc is not None and cc < 8.0 else "bf16"

    def rate(self, key: str) -> float | None:
        """The achieved TFLOP/s under ``key`` (``matmul/bf16``, ``flash/bf16/128``), or None."""
        return self._by_key[0].get(key)

    def curve(self, key: str) -> Curve | None:
        """This type's own curve for ``kernel/mask`` (``profile`` writes them), or None."""
        return self._by_key[1].get(key)

    @cached_property
    def _by_key(self) -> tuple[dict[str, float], dict[str, Curve]]:
        """``achieved_tflops`` and ``attention_curves`` as dicts, built once per type
        (``Device.flops_per_s`` reads a rate on every call: the planner asks thousands of times
        per plan). Not a field: equality, hashing and the spec ignore it."""
        return dict(self.achieved_tflops), dict(self.attention_curves)


@dataclass(frozen=True, kw_only=True)
class Node:
    """A host with ``count`` GPUs of one type; bandwidths per GPU, one direction. ``shared_core``:
    the node's devices share one compute core (a CPU testbed core; ``profile --testbed`` sets it),
    so a device's fixed costs are scheduler waits, paid only while a sibling computes
    (docs/cost_model.md, "Fixed costs")."""

    name: str
    gpu: GpuType
    count: int
    nvlink_GBps: float
    network_GBps: float
    memory_gib: float
    shared_core: bool = False


@dataclass(frozen=True, kw_only=True)
class Device:
    """One GPU. ``index`` is its global number (= the layout rank that runs on it)."""

    index: int
    node: str
    local_index: int
    gpu: GpuType
    nvlink_GBps: float
    network_GBps: float
    memory_gib: float
    shared_core: bool = False

    @property
    def flops_per_s(self) -> float:
        """Achieved FLOP/s of the linear work: the type's ``matmul/<train dtype>`` figure, else
        ``bf16_tflops * 1e12 * efficiency``."""
        achieved = self.gpu.rate(f"matmul/{self.gpu.train_dtype}")
        if achieved is not None:
            return achieved * 1e12
        return self.gpu.bf16_tflops * 1e12 * self.gpu.efficiency

    @property
    def attention_flops_per_s(self) -> float:
        """Attention FLOP/s on long blocks in the cost model's count (12 d per pair and head): the
        figure of the kernel ``auto`` picks at head dim 128 (``costmodel.rates`` has the rate for
        any head dim, kernel and call size), else ``attention_tflops`` or ``bf16_tflops`` times
        efficiency."""
        g = self.gpu
        if g.attention_tflops is None:
            for kernel in auto_kernel_order(g):
                achieved = g.rate(f"{kernel}/{g.train_dtype}/128")
                if achieved is not None:
                    return achieved * 1e12 * gpu_rates.FA_TO_MODEL
        peak = g.attention_tflops if g.attention_tflops is not None else g.bf16_tflops
        return peak * 1e12 * g.efficiency

    @property
    def step_overhead_s(self) -> float:
        """Fixed seconds per iteration (optimizer step, framework), whatever the tokens."""
        return self.gpu.step_overhead_ms * 1e-3

    @property
    def micro_batch_overhead_s(self) -> float:
        """The part of ``step_overhead_s`` every further micro-batch of a step pays again."""
        return self.gpu.micro_batch_overhead_ms * 1e-3

    @property
    def collective_latency_s(self) -> float:
        """Fixed seconds per head all-to-all collective this device takes part in."""
        return self.gpu.collective_latency_us * 1e-6

    @property
    def p2p_latency_s(self) -> float:
        """Fixed seconds per K/V exchange step (one sub-ring round of one layer and pass)."""
        return self.gpu.p2p_latency_us * 1e-6

    @property
    def window_overhead_s(self) -> float:
        """Fixed seconds per attention kernel call of a packed micro-batch, per pass."""
        return self.gpu.window_overhead_us * 1e-6

    @property
    def memory_bytes(self) -> int:
        return int(self.memory_gib * 2**30)

    @property
    def hbm_Bps(self) -> float:
        """Device-memory bandwidth in bytes/s (0.0 when unknown)."""
        return self.gpu.hbm_GBps * 1e9


@dataclass(frozen=True, kw_only=True)
class Cluster:
    """Nodes in file order and their devices, numbered node by node."""

    name: str
    nodes: tuple[Node, ...]
    devices: tuple[Device, ...]

    @property
    def world_size(self) -> int:
        return len(self.devices)

    def same_node(self, a: int, b: int) -> bool:
        return self.devices[a].node == self.devices[b].node

    def link_GBps(self, a: int, b: int) -> float:
        """Bandwidth (GB/s, one direction) from device ``a`` to device ``b``.

        Same node: the smaller NVLink bandwidth of the two; different nodes: the smaller network
        bandwidth of the two. ``a == b`` is a local copy: ``math.inf``.
        """
        if a == b:
            return math.inf
        da, db = self.devices[a], self.devices[b]
        if da.node == db.node:
            return min(da.nvlink_GBps, db.nvlink_GBps)
        return min(da.network_GBps, db.network_GBps)


def auto_kernel_order(gpu: GpuType) -> tuple[str, ...]:
    """The CUDA kernels ``auto`` tries on ``gpu``, first choice first (attention/kernels.py):
    cudnn on compute capability 9.x, flash from 8.0, efficient everywhere."""
    cc = gpu.compute_capability
    if cc is None:
        return ("flash", "efficient")
    return (
        (("cudnn",) if 9.0 <= cc < 10.0 else ())
        + (("flash",) if cc >= 8.0 else ())
        + ("efficient",)
    )


# ---- catalog ----------------------------------------------------------------------------------
def _gpu(
    name: str,
    bf16_tflops: float,
    memory_gib: float,
    nvlink_GBps: float,
    source: str,
    efficiency: float = DEFAULT_EFFICIENCY,
) -> GpuType:
    return GpuType(
        name=name,
        bf16_tflops=bf16_tflops,
        memory_gib=memory_gib,
        nvlink_GBps=nvlink_GBps,
        efficiency=efficiency,
        source=source,
        hbm_GBps=HBM_GBPS[name][0],
        compute_capability=gpu_rates.COMPUTE_CAPABILITY.get(name),
        achieved_tflops=tuple(sorted(gpu_rates.ACHIEVED_TFLOPS.get(name, {}).items())),
    )


HBM_GBPS: Mapping[str, tuple[float, str]] = MappingProxyType(
    {
        "H100-SXM-80GB": (3350.0, "NVIDIA H100 Tensor Core GPU datasheet (SXM): 3.35 TB/s"),
        "H100-PCIe-80GB": (2000.0, "NVIDIA H100 PCIe product brief PB-11133-001: 2,000 GB/s"),
        "H200-141GB": (4800.0, "NVIDIA H200 Tensor Core GPU datasheet (SXM): 4.8 TB/s"),
        "B200-192GB": (8000.0, "NVIDIA HGX B200 datasheet: 64 TB/s per 8 GPUs -> 8 TB/s per GPU"),
        "A100-SXM-80GB": (2039.0, "NVIDIA A100 Tensor Core GPU datasheet (80GB SXM): 2,039 GB/s"),
        "A100-SXM-40GB": (1555.0, "NVIDIA A100 Tensor Core GPU datasheet (40GB SXM): 1,555 GB/s"),
        "A800-80GB": (2039.0, "NVIDIA A800 datasheet (80GB SXM): 2,039 GB/s, as the A100 80GB"),
        "L40S-48GB": (864.0, "NVIDIA L40S datasheet: 864 GB/s GDDR6"),
        "V100-SXM-32GB": (900.0, "NVIDIA V100 datasheet (SXM2): 900 GB/s HBM2"),
        "CPU": (
            0.0,
            "unknown: the CPU testbed's measured step_overhead_ms holds the optimizer step",
        ),
    }
)
"""Device-memory bandwidth of the catalog's GPU types (GB/s) and where each figure comes from."""

# Dense BF16 (no sparsity) peak, memory, and per-GPU one-direction NVLink = half the datasheet's
# bidirectional aggregate. GPUs without NVLink get their PCIe link (one direction).
GPU_CATALOG: Mapping[str, GpuType] = MappingProxyType(
    {
        g.name: g
        for g in (
            _gpu(
                "H100-SXM-80GB",
                989.4,
                80,
                450,
                "NVIDIA H100 Tensor Core GPU datasheet (SXM5): BF16 1,979 TFLOPS with sparsity -> 989 dense; "
                "80 GB HBM3; NVLink 900 GB/s bidirectional",
            ),
            _gpu(
                "H100-PCIe-80GB",
                756.5,
                80,
                64,
                "NVIDIA H100 datasheet (PCIe): BF16 1,513 TFLOPS with sparsity -> 756 dense; 80 GB HBM2e; "
                "NVLink bridge joins only pairs, so intra-node uses PCIe Gen5 x16 (128 GB/s bidirectional)",
            ),
            _gpu(
                "H200-141GB",
                989.4,
                141,
                450,
                "NVIDIA H200 Tensor Core GPU datasheet (SXM): BF16 1,979 TFLOPS with sparsity -> 989 dense; "
                "141 GB HBM3e; NVLink 900 GB/s bidirectional",
            ),
            _gpu(
                "B200-192GB",
                2250,
                180,
                900,
                "NVIDIA HGX B200 datasheet: FP16/BF16 36 PFLOPS with sparsity per 8 GPUs -> 2.25 PFLOPS dense "
                "per GPU; 192 GB HBM3e of which HGX exposes 180 GB (1,440 GB per 8 GPUs); NVLink 5 1.8 TB/s "
                "bidirectional",
            ),
            _gpu(
                "A100-SXM-80GB",
                312,
                80,
                300,
                "NVIDIA A100 Tensor Core GPU datasheet (SXM): BF16 312 TFLOPS dense; 80 GB HBM2e; "
                "NVLink 600 GB/s bidirectional",
            ),
            _gpu(
                "A100-SXM-40GB",
                312,
                40,
                300,
                "NVIDIA A100 Tensor Core GPU datasheet (SXM): BF16 312 TFLOPS dense; 40 GB HBM2; "
                "NVLink 600 GB/s bidirectional",
            ),
            _gpu(
                "A800-80GB",
                312,
                80,
                200,
                "NVIDIA A800 Tensor Core GPU datasheet (SXM): BF16 312 TFLOPS dense; 80 GB HBM2e; "
                "NVLink 400 GB/s bidirectional",
            ),
            _gpu(
                "L40S-48GB",
                362.05,
                48,
                32,
                "NVIDIA L40S datasheet: BF16 733 TFLOPS with sparsity -> 362 dense; 48 GB GDDR6; no NVLink, "
                "PCIe Gen4 x16 (64 GB/s bidirectional)",
            ),
            _gpu(
                "V100-SXM-32GB",
                125,
                32,
                150,
                "NVIDIA V100 datasheet (SXM2): no BF16 -- FP16 tensor 125 TFLOPS used instead (trains in FP16); "
                "32 GB HBM2; NVLink 300 GB/s bidirectional",
            ),
            _gpu(
                "CPU",
                0.1,
                8,
                5,
                "placeholder for the CPU testbed (gloo ranks); run `megatron-hexiseq profile` to measure",
                efficiency=1.0,
            ),
        )
    }
)

_FIXED_COST_KEYS = (
    "step_overhead_ms",
    "micro_batch_overhead_ms",
    "collective_latency_us",
    "p2p_latency_us",
    "window_overhead_us",
)
_GPU_REQUIRED = ("bf16_tflops", "memory_gib", "nvlink_GBps")  # for a type the catalog lacks


# ---- loading ----------------------------------------------------------------------------------
def load_cluster(path: str | os.PathLike) -> Cluster:
    """Read a cluster spec YAML; any problem raises HexiSeqError naming the file."""
    return cluster_from_dict(read_yaml(path, "cluster spec"), source=f"cluster spec {path}")


def cluster_from_dict(data: Any, *, source: str = "cluster spec") -> Cluster:
    """Validate a parsed cluster spec and build the Cluster (see module docstring for the format)."""
    try:
        return _build(data, source)
    except HexiSeqError as e:
        raise HexiSeqError(f"{source}: {e}") from None


def cluster_to_dict(cluster: Cluster) -> dict[str, Any]:
    """Plain dict that ``cluster_from_dict`` turns back into an equal Cluster.

    Every GPU type used is written out in full under ``gpus`` and every node field is explicit,
    so the file does not depend on the catalog of the release that reads it; except ``hbm_GBps``,
    written only when it is not the catalog's own figure for that name (so a plan's recorded
    spec is what it was before the field existed).
    """
    gpus: dict[str, dict[str, Any]] = {}
    for node in cluster.nodes:
        g = node.gpu
        entry: dict[str, Any] = {
            "bf16_tflops": g.bf16_tflops,
            "memory_gib": g.memory_gib,
            "nvlink_GBps": g.nvlink_GBps,
            "efficiency": g.efficiency,
            "source": g.source,
        }
        if g.attention_tflops is not None:
            entry["attention_tflops"] = g.attention_tflops
        for key in _FIXED_COST_KEYS:
            if getattr(g, key):
                entry[key] = getattr(g, key)
        catalog = GPU_CATALOG.get(g.name)
        if g.hbm_GBps and (catalog is None or catalog.hbm_GBps != g.hbm_GBps):
            entry["hbm_GBps"] = g.hbm_GBps  # a catalog type's own figure comes from the catalog
        if g.compute_capability is not None:
            entry["compute_capability"] = g.compute_capability
        if g.achieved_tflops:
            entry["achieved_tflops"] = dict(g.achieved_tflops)
        if g.attention_curves:
            entry["attention_curves"] = {k: [list(p) for p in pts] for k, pts in g.attention_curves}
        gpus[g.name] = entry
    nodes = [
        {
            "name": n.name,
            "gpu": n.gpu.name,
            "count": n.count,
            "nvlink_GBps": n.nvlink_GBps,
            "network_GBps": n.network_GBps,
            "memory_gib": n.memory_gib,
        }
        | ({"shared_core": True} if n.shared_core else {})
        for n in cluster.nodes
    ]
    return {"name": cluster.name, "gpus": gpus, "nodes": nodes}


def _build(data: Any, source: str) -> Cluster:
    if not isinstance(data, Mapping):
        raise HexiSeqError(
            f"expected a mapping with keys 'name' and 'nodes' at the top level, got {_kind(data)}"
        )
    spec_schema.check(data, "cluster", _where)  # types, ranges, required and unknown keys
    check_cluster_name(data.get("name", "cluster"), "the cluster's name")
    _check_names_and_size(data["nodes"])
    types = dict(GPU_CATALOG)
    for gname, spec in (data.get("gpus") or {}).items():
        types[gname] = _gpu_type(gname, spec, GPU_CATALOG.get(gname), source)
    nodes: list[Node] = []
    seen: set[str] = set()
    for raw in data["nodes"]:
        node = _node(raw, types)
        if node.name in seen:
            raise HexiSeqError(
                f"node name {short(node.name)} appears twice; node names must be unique hostnames"
            )
        seen.add(node.name)
        nodes.append(node)
    return cluster_of_nodes(data.get("name", "cluster"), nodes)


def cluster_of_nodes(name: str, nodes: Sequence[Node]) -> Cluster:
    """The cluster of ``nodes`` (validated already), its devices numbered node by node."""
    devices = tuple(
        Device(
            index=idx,
            node=n.name,
            local_index=local,
            gpu=n.gpu,
            nvlink_GBps=n.nvlink_GBps,
            network_GBps=n.network_GBps,
            memory_gib=n.memory_gib,
            shared_core=n.shared_core,
        )
        for idx, (n, local) in enumerate((n, j) for n in nodes for j in range(n.count))
    )
    return Cluster(name=name, nodes=tuple(nodes), devices=devices)


def _check_names_and_size(nodes: Sequence[Mapping[str, Any]]) -> None:
    """Node names a launcher can pass around, and a size the loader can build (before any
    device is built: ``count`` may be a million per node)."""
    if len(nodes) > MAX_CLUSTER_NODES:
        raise HexiSeqError(
            f"{len(nodes):,} nodes, more than the {MAX_CLUSTER_NODES:,} a cluster spec may have"
        )
    total = 0
    for i, raw in enumerate(nodes):
        if not is_name(raw["name"]):
            raise HexiSeqError(
                f"nodes[{i}].name {short(raw['name'])} is not a host name: {NAME_RULE}"
            )
        total += raw["count"]
    if total > MAX_CLUSTER_GPUS:
        raise HexiSeqError(
            f"{total:,} GPUs, more than the {MAX_CLUSTER_GPUS:,} a cluster spec may have"
        )


def _where(path: Sequence[Any], data: Any) -> str:
    """The place of a schema problem as the messages name it: ``top level``, ``'nodes'``,
    ``gpus.MY-GPU.bf16_tflops``, ``nodes[2]``, ``node 'gpu01': count``."""
    if not path:
        return "top level"
    if len(path) == 1:
        return repr(path[0])
    if path[0] == "gpus":
        return ".".join(str(p) for p in path)
    i = path[1]
    if len(path) == 2 or path[2] == "name":
        return f"nodes[{i}]" + ("" if len(path) == 2 else ".name")
    name = data["nodes"][i].get("name")
    return (
        f"node {short(name)}: {path[2]}"
        if isinstance(name, str) and name
        else f"nodes[{i}].{path[2]}"
    )


def _gpu_type(name: str, spec: Mapping[str, Any], base: GpuType | None, source: str) -> GpuType:
    if base is None:
        missing = [k for k in _GPU_REQUIRED if k not in spec]
        if missing:
            raise HexiSeqError(
                f"gpus.{name} is not in the catalog, so it needs {', '.join(missing)}"
            )
        base = GpuType(name=name, bf16_tflops=1.0, memory_gib=1.0, nvlink_GBps=1.0, source=source)
    fields = dict(spec)
    if "achieved_tflops" in fields:
        bad = [k for k in fields["achieved_tflops"] if not RATE_KEY.match(k)]
        if bad:
            raise HexiSeqError(
                f"gpus.{name}.achieved_tflops: key {short(bad[0])} is not matmul/<bf16|fp16> or "
                "<kernel>/<bf16|fp16>/<head dim> (e.g. flash/bf16/128)"
            )
        fields["achieved_tflops"] = tuple(sorted(fields["achieved_tflops"].items()))
    elif "bf16_tflops" in fields or "efficiency" in fields:
        # a peak or efficiency given for a catalog type means: model it by peak x efficiency
        fields["achieved_tflops"] = ()
    if "attention_curves" in fields:
        curves = []
        for key, points in fields["attention_curves"].items():
            xs = [p[0] for p in points]
            if not CURVE_KEY.match(key) or xs != sorted(set(xs)):
                raise HexiSeqError(
                    f"gpus.{name}.attention_curves.{short(key)}: expected key <kernel>/<causal|full> "
                    "and points [pair-heads, fraction] with pair-heads strictly increasing"
                )
            curves.append((key, tuple((float(x), float(f)) for x, f in points)))
        fields["attention_curves"] = tuple(sorted(curves))
    got = replace(base, **fields)
    if got.micro_batch_overhead_ms > got.step_overhead_ms:
        raise HexiSeqError(
            f"gpus.{name}.micro_batch_overhead_ms ({got.micro_batch_overhead_ms:g}) exceeds its "
            f"step_overhead_ms ({got.step_overhead_ms:g}): it is the part of the step overhead "
            "that every micro-batch pays; give at most step_overhead_ms (profile measures both)"
        )
    return got


def _node(raw: Mapping[str, Any], types: Mapping[str, GpuType]) -> Node:
    name, gpu_name = raw["name"], raw["gpu"]
    if gpu_name not in types:
        raise HexiSeqError(
            f"node {short(name)}: unknown GPU {short(gpu_name)}; known: {', '.join(sorted(types))} "
            "(or describe it under 'gpus')"
        )
    gpu = types[gpu_name]
    return Node(
        name=name,
        gpu=gpu,
        count=raw["count"],
        nvlink_GBps=raw.get("nvlink_GBps", gpu.nvlink_GBps),
        network_GBps=raw["network_GBps"],
        memory_gib=raw.get("memory_gib", gpu.memory_gib),
        shared_core=raw.get("shared_core", False),
    )


def _kind(x: Any) -> str:
    return "nothing (empty file?)" if x is None else type(x).__name__
