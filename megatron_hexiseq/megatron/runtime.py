"""HexiSeq parallel state from a layout, built once at the Megatron boundary.

Megatron keeps its uniform grid: ``--context-parallel-size`` equals the layout's ``world_size``
(the ranks that share one sequence), and every data-parallel (and pipeline) replica runs the same
layout. After ``megatron.core.parallel_state.initialize_model_parallel`` has built the CP groups,
``build_runtime`` (a collective over the default group) learns every CP domain, checks the layout
against reality, builds the HexiSeq A2A groups and sub-ring peer tables with
``megatron_hexiseq.attention.groups.build_hexiseq_groups`` and returns one frozen
``HexiSeqRuntime``. That object is handed explicitly to the core attention (spec params), the
RoPE module and the batch slicer; nothing reads it from a global.

The layout rank of a process is its rank in Megatron's CP group (CP groups list their global ranks
in ascending order, which is also the order of ``domains[i]``).
"""

from __future__ import annotations

import argparse
import os
import re
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from megatron_hexiseq.attention.groups import HexiSeqGroups, build_hexiseq_groups
from megatron_hexiseq.attention.kernel_check import check_kernel
from megatron_hexiseq.attention.kernels import Kernel
from megatron_hexiseq.errors import HexiSeqError
from megatron_hexiseq.layout import Layout
from megatron_hexiseq.megatron.args import CP_COMM_TYPE
from megatron_hexiseq.megatron.batch_layout import MicroBatchLayout
from megatron_hexiseq.megatron.documents import MicroBatchDocuments
from megatron_hexiseq.megatron.tensor_parallel import check_tp_group_hosts, check_tp_layout

DTYPES = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float64": torch.float64,
}


@dataclass(frozen=True, kw_only=True)
class RunShape:
    """The facts of a Megatron run that a layout must agree with (read from Megatron's args)."""

    world_size: int
    tensor_model_parallel_size: int
    pipeline_model_parallel_size: int
    context_parallel_size: int
    seq_length: int
    num_attention_heads: int
    num_query_groups: int
    cp_comm_type: str = CP_COMM_TYPE
    calculate_per_token_loss: bool = True
    multi_latent_attention: bool = False
    params_dtype: str = "float32"  # the dtype attention runs in (--bf16 / --fp16)
    head_dim: int | None = None  # kv_channels (None: the start-up kernel check uses 64)
    sequence_parallel: bool = False  # --sequence-parallel (with TP: bundles of t-multiple tokens)

    @classmethod
    def from_megatron_args(cls, args: argparse.Namespace) -> RunShape:
        """From Megatron's parsed and validated ``args`` (``get_args()``)."""
        cp_comm = args.cp_comm_type
        if isinstance(cp_comm, (list, tuple)):
            cp_comm = cp_comm[0] if len(set(cp_comm)) == 1 else " ".join(cp_comm)
        groups = args.num_query_groups if getattr(args, "group_query_attention", False) else None
        return cls(
            world_size=args.world_size,
            tensor_model_parallel_size=args.tensor_model_parallel_size,
            pipeline_model_parallel_size=args.pipeline_model_parallel_size,
            context_parallel_size=args.context_parallel_size,
            seq_length=args.seq_length,
            num_attention_heads=args.num_attention_heads,
            num_query_groups=groups or args.num_attention_heads,
            cp_comm_type=cp_comm,
            calculate_per_token_loss=bool(args.calculate_per_token_loss),
            multi_latent_attention=bool(getattr(args, "multi_latent_attention", False)),
            params_dtype="bfloat16"
            if getattr(args, "bf16", False)
            else "float16"
            if getattr(args, "fp16", False)
            else "float32",
            head_dim=getattr(args, "kv_channels", None),
            sequence_parallel=bool(getattr(args, "sequence_parallel", False)),
        )


def check_run(layout: Layout, run: RunShape, *, source: str = "layout") -> None:
    """Fail with one clear message if the run cannot execute ``layout``. Pure; no processes."""
    W = layout.world_size
    if run.cp_comm_type != CP_COMM_TYPE:
        raise HexiSeqError(
            f"--hexiseq-layout needs --cp-comm-type {CP_COMM_TYPE} (for every layer), "
            f"got '{run.cp_comm_type}'"
        )
    if run.context_parallel_size != W:
        raise HexiSeqError(
            f"{source} has {W} ranks but --context-parallel-size is "
            f"{run.context_parallel_size}; set --context-parallel-size {W}"
        )
    model_parallel = run.tensor_model_parallel_size * run.pipeline_model_parallel_size * W
    if run.world_size % model_parallel:
        raise HexiSeqError(
            f"world size {run.world_size} is not a multiple of TP x PP x CP = "
            f"{run.tensor_model_parallel_size} x {run.pipeline_model_parallel_size} x {W}; "
            f"launch a multiple of {model_parallel} processes"
        )
    tp = run.tensor_model_parallel_size
    if tp > 1 or layout.tensor_model_parallel_size > 1:  # a layout over TP bundles
        check_tp_layout(
            layout,
            tensor_model_parallel_size=tp,
            num_attention_heads=run.num_attention_heads,
            num_query_groups=run.num_query_groups,
            sequence_parallel=run.sequence_parallel,
            source=source,
        )
    if run.seq_length != layout.seq_length:
        raise HexiSeqError(
            f"{source} is planned for seq_length {layout.seq_length} but --seq-length is "
            f"{run.seq_length}; re-plan or change --seq-length"
        )
    if tp == 1 and run.num_attention_heads != layout.num_attention_heads:
        raise HexiSeqError(
            f"{source} is planned for {layout.num_attention_heads} attention heads but the "
            f"model has --num-attention-heads {run.num_attention_heads}"
        )
    if tp == 1 and run.num_query_groups != layout.num_query_groups:
        raise HexiSeqError(
            f"{source} is planned for {layout.num_query_groups} query groups but the model "
            f"has {run.num_query_groups} (--num-query-groups with --group-query-attention)"
        )
    if not run.calculate_per_token_loss:
        raise HexiSeqError(
            "ranks of an uneven layout hold different token counts: add "
            "--calculate-per-token-loss so every token weighs the same"
        )
    if run.multi_latent_attention:
        raise HexiSeqError("HexiSeq attention does not support --multi-latent-attention")
    empty = [r.rank for r in layout.ranks if r.num_tokens == 0]
    if empty:
        raise HexiSeqError(
            f"{source}: layout ranks {empty} hold no tokens (heads only); Megatron's attention "
            "layer cannot run an empty sequence shard (its QKV reshape fails), so every rank "
            "must own at least one token: re-plan, or move a segment to those ranks"
        )


def gpu_name_matches(planned: str, device_name: str) -> bool:
    """Does the layout's ``gpu`` (e.g. ``"H100"``, ``"A100-80GB"``) name this device?

    The first alphanumeric token of ``planned`` must be a token of ``device_name``
    (``torch.cuda.get_device_name()``, e.g. ``"NVIDIA H100 80GB HBM3"``), case-insensitive.
    """
    want = re.findall(r"[a-z0-9]+", planned.lower())
    have = set(re.findall(r"[a-z0-9]+", device_name.lower()))
    return bool(want) and want[0] in have


def check_devices(
    layout: Layout,
    domains: Sequence[Sequence[int]],
    device_names: Sequence[str | None],
    *,
    allow_mismatch: bool = False,
) -> list[str]:
    """Check each process's device name against the layout's ``gpu`` for its layout rank.

    ``device_names[g]`` is global rank g's device name (None: no GPU, nothing to check).
    Raises HexiSeqError listing the mismatches, or returns them as warnings with ``allow_mismatch``.
    """
    problems = []
    for domain in domains:
        for layout_rank, g in enumerate(domain):
            name, planned = device_names[g], layout.ranks[layout_rank].gpu
            if name is not None and not gpu_name_matches(planned, name):
                problems.append(
                    f"global rank {g} (layout rank {layout_rank}) runs on '{name}' but the "
                    f"layout planned '{planned}'"
                )
    if problems and not allow_mismatch:
        more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
        raise HexiSeqError(
            "; ".join(problems[:3]) + more + ": launch ranks in layout order (see "
            "scripts/slurm/) or pass --hexiseq-allow-mismatch"
        )
    return problems


@dataclass(frozen=True, kw_only=True)
class HexiSeqRuntime:
    """What the Megatron modules of one process need: the layout, its groups and the kernel
    (concrete: proven on this device and dtype by ``build_runtime``)."""

    layout: Layout
    groups: HexiSeqGroups
    kernel: Kernel
    comm_chunks: int = 1
    fp32_grad_wire: bool = False
    # packed documents (--reset-attention-mask, THD batches): the current micro-batch's boundaries
    documents: MicroBatchDocuments | None = None
    # per-micro-batch layouts on these groups: the current micro-batch's plan (batch_layout.py)
    batch_layout: MicroBatchLayout | None = None

    def micro_batch_groups(self) -> HexiSeqGroups:
        """The groups running the current micro-batch: ``groups`` itself, or the view of the
        micro-batch's layout with per-micro-batch layouts."""
        if self.batch_layout is None:
            return self.groups
        return self.batch_layout.current().groups

    @property
    def rank(self) -> int:
        """This process's layout rank (= its rank in Megatron's CP group)."""
        return self.groups.rank

    @property
    def segments(self) -> tuple[tuple[int, int], ...]:
        """This rank's global token segments ``[start, end)``, in token order."""
        return self.layout.ranks[self.rank].segments

    @property
    def num_tokens(self) -> int:
        return self.layout.ranks[self.rank].num_tokens


def cp_domains(cp_group: dist.ProcessGroup | None) -> list[list[int]]:
    """Every CP domain (global ranks, ascending = layout-rank order), in the same order on all ranks.

    Collective over the default group. ``cp_group`` None means one domain of all ranks.
    """
    world = dist.get_world_size()
    mine = dist.get_process_group_ranks(cp_group) if cp_group is not None else list(range(world))
    gathered: list[list[int] | None] = [None] * world
    dist.all_gather_object(gathered, sorted(mine))
    domains = sorted({tuple(d) for d in gathered if d is not None})
    covered = sorted(g for d in domains for g in d)
    assert covered == list(range(world)), f"CP groups do not partition the world: {domains}"
    return [list(d) for d in domains]


def local_device_name() -> str | None:
    """``torch.cuda.get_device_name()`` of the current device, or None without CUDA."""
    return torch.cuda.get_device_name() if torch.cuda.is_available() else None


def runtime_device() -> torch.device:
    """The device this process computes on: the current CUDA device, else the CPU."""
    return (
        torch.device("cuda", torch.cuda.current_device())
        if torch.cuda.is_available()
        else torch.device("cpu")
    )


def nccl_comm_cfgs(
    path: str | None, high_priority_stream_groups: Sequence[str] = ()
) -> dict[str, dict[str, Any]]:
    """Megatron's per-group NCCL settings: ``--nccl-communicator-config-path`` YAML plus
    ``--high-priority-stream-groups``, read as ``initialize_model_parallel`` reads them."""
    import yaml

    cfgs: dict[str, dict[str, Any]] = {}
    if path:
        if not os.path.isfile(path):
            raise HexiSeqError(f"--nccl-communicator-config-path {path} does not exist")
        with open(path, encoding="utf-8") as f:
            cfgs = yaml.safe_load(f) or {}
    for name in high_priority_stream_groups or ():
        cfgs.setdefault(name, {})["is_high_priority_stream"] = True
    return cfgs


def hexiseq_pg_options(cfgs: dict[str, dict[str, Any]]):
    """``kind -> ProcessGroupNCCL.Options`` for HexiSeq's groups: ``hexiseq_cp`` / ``hexiseq_a2a``
    entries of the NCCL YAML when present, else the ``cp`` entry (the traffic they replace)."""

    def options(kind: str) -> Any:
        from megatron.core.parallel_state import get_nccl_options

        name = f"hexiseq_{kind}" if f"hexiseq_{kind}" in cfgs else "cp"
        return get_nccl_options(name, cfgs)

    return options


def prove_kernel(kernel: str, run: RunShape, device: torch.device) -> Kernel:
    """The concrete attention kernel, proven on this device and dtype by every rank (collective
    over the default group): all agree before anyone creates a group, and a failure on any rank
    is the same one-line error on every rank."""
    concrete, failure = None, None
    try:
        concrete = check_kernel(
            kernel, device=device, dtype=DTYPES[run.params_dtype], head_dim=run.head_dim or 64
        )
    except HexiSeqError as e:
        failure = str(e)
    failures: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(failures, failure)
    failed = [(g, f) for g, f in enumerate(failures) if f]
    if failed:
        more = f" (and {len(failed) - 1} more ranks)" if len(failed) > 1 else ""
        raise HexiSeqError(f"global rank {failed[0][0]}: {failed[0][1]}{more}")
    assert concrete is not None
    return concrete


def reused_cp_group(
    cp_group: dist.ProcessGroup | None, nccl_cfgs: dict[str, dict[str, Any]]
) -> dist.ProcessGroup | None:
    """Megatron's CP group, to carry HexiSeq's sub-ring exchange too (one NCCL communicator over
    the domain's ranks, not two); None (HexiSeq creates its own) without one, or when the NCCL
    YAML asks for other options for HexiSeq's CP traffic (a ``hexiseq_cp`` entry)."""
    return None if cp_group is None or "hexiseq_cp" in nccl_cfgs else cp_group


def build_runtime(
    layout: Layout,
    run: RunShape,
    *,
    cp_group: dist.ProcessGroup | None,
    kernel: str = "auto",
    comm_chunks: int = 1,
    allow_mismatch: bool = False,
    source: str = "layout",
    timeout: timedelta | None = None,
    nccl_cfgs: dict[str, dict[str, Any]] | None = None,
    fp32_grad_wire: bool = False,
    tp_group: dist.ProcessGroup | None = None,
) -> HexiSeqRuntime:
    """Check ``layout`` against the run, prove the attention kernel, build this process's groups.

    Collective over the default group (every process calls it once, after Megatron's
    ``initialize_model_parallel``). ``cp_group`` is Megatron's CP group of this process;
    ``timeout`` and ``nccl_cfgs`` (``nccl_comm_cfgs``) are applied to HexiSeq's own groups as
    Megatron applies them to its own (NCCL options only on the NCCL backend). Every process passes
    its ``cp_group`` on (``reused_cp_group``): the sub-ring exchange runs on Megatron's CP
    communicator, and HexiSeq creates only its A2A groups. ``tp_group``: Megatron's TP group of
    this process (with TP > 1 every TP group must sit on one host).
    """
    check_run(layout, run, source=source)
    if dist.get_world_size() != run.world_size:
        raise HexiSeqError(
            f"{dist.get_world_size()} processes joined but the run expects "
            f"{run.world_size}; check WORLD_SIZE and the launcher"
        )
    domains = cp_domains(cp_group)
    bad = [d for d in domains if len(d) != layout.world_size]
    if bad:
        raise HexiSeqError(
            f"CP group {bad[0]} has {len(bad[0])} ranks but {source} has "
            f"{layout.world_size}; set --context-parallel-size {layout.world_size}"
        )
    names: list[str | None] = [None] * dist.get_world_size()
    dist.all_gather_object(names, local_device_name())
    for problem in check_devices(layout, domains, names, allow_mismatch=allow_mismatch):
        if dist.get_rank() == 0:
            warnings.warn(f"hexiseq: {problem} (--hexiseq-allow-mismatch)", stacklevel=2)
    if tp_group is not None:
        check_tp_group_hosts(tp_group, allow_mismatch=allow_mismatch)
    device = runtime_device()
    concrete = prove_kernel(kernel, run, device)
    nccl = dist.get_backend() == "nccl"
    groups = build_hexiseq_groups(
        layout,
        domains=domains,
        cp_group=reused_cp_group(cp_group, nccl_cfgs or {}),
        device=device,
        timeout=timeout,
        pg_options=hexiseq_pg_options(nccl_cfgs or {}) if nccl else None,
    )
    if cp_group is not None:
        assert groups.rank == dist.get_rank(cp_group), (groups.rank, dist.get_rank(cp_group))
    return HexiSeqRuntime(
        layout=layout,
        groups=groups,
        kernel=concrete,
        comm_chunks=comm_chunks,
        fp32_grad_wire=fp32_grad_wire,
    )
