"""Elastic re-planning: a cluster minus its lost GPUs, and what changed between two layouts.

- :func:`parse_exclusions` / :func:`exclude`: ``"gpu01:1,gpu03"`` -> the cluster without GPU 1 of
  host ``gpu01`` and without host ``gpu03``. A node that loses some GPUs stays in place (node order
  is kept) with fewer GPUs; :class:`Survivors` remembers which GPU indices of each such host are
  left (``gpu_indices``), because the survivors are renumbered ``0..n-1`` (the launcher makes them
  the visible devices of that host, in order).
- :func:`device_names`: the ``host:gpu-index`` of every rank of a layout (the index is the GPU the
  rank runs on, ``meta.gpu_indices`` taken into account).
- :func:`diff_layouts`: ranks gone and added (by ``host:gpu-index``), world size, predicted
  iteration time and tokens/s before and after, memory mode, and :func:`resume_problems`: why a
  checkpoint written under the old layout cannot be resumed under the new one (another model,
  sequence length or memory mode). Every other change (ranks, groups, segments, heads, data
  parallel replicas) is what a checkpoint survives: parameters are replicated over the CP domain.

CLI (used by ``scripts/slurm/hexiseq.sbatch``; errors are one line, exit 2)::

    python -m megatron_hexiseq.elastic exclude --cluster C.yaml --exclude 'gpu01:1,gpu03' -o C2.yaml
        -> writes C2.yaml; prints "HOST I,J,..." (the GPUs left) for every host that lost some GPUs
"""

from __future__ import annotations

import re
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from megatron_hexiseq.cluster import Cluster, Device, cluster_to_dict, is_name, load_cluster
from megatron_hexiseq.errors import HexiSeqError, run_user_command, short
from megatron_hexiseq.io import check_outputs, write_text_atomic
from megatron_hexiseq.layout import Layout
from megatron_hexiseq.run_config import CHECKPOINT_FORMAT

# layout meta keys written by ``plan --exclude``
EXCLUDED_KEY, GPU_INDICES_KEY = "excluded", "gpu_indices"
# model fields a checkpoint's parameter shapes depend on (ModelSpec names = Megatron's)
MODEL_SHAPE_FIELDS = (
    "num_layers",
    "hidden_size",
    "num_attention_heads",
    "num_query_groups",
    "ffn_hidden_size",
    "vocab_size",
    "kv_channels",
    "swiglu",
    "normalization",
    "add_bias_linear",
)


@dataclass(frozen=True)
class Exclusion:
    """One lost device (``local_rank`` = its GPU index on ``host``) or a whole host (``None``)."""

    host: str
    local_rank: int | None = None

    def __str__(self) -> str:
        return self.host if self.local_rank is None else f"{self.host}:{self.local_rank}"


MAX_EXCLUDE_CHARS = 1 << 20
_INDEX = re.compile(r"[0-9]{1,7}")  # ASCII digits only ('²'.isdigit() is True); < the count limit


def parse_exclusions(text: str) -> tuple[Exclusion, ...]:
    """``"HOST[:LOCAL_RANK],..."`` (commas or spaces) -> exclusions in the order given, each once
    (a repeat is dropped). HOST must be a host name (``cluster.NAME_PATTERN``), LOCAL_RANK a GPU
    index in ASCII digits."""
    if len(text) > MAX_EXCLUDE_CHARS:
        raise HexiSeqError(
            f"--exclude is {len(text):,} characters long; at most {MAX_EXCLUDE_CHARS:,}"
        )
    items = [t for t in text.replace(",", " ").split() if t]
    if not items:
        raise HexiSeqError(
            "--exclude is empty; give HOST or HOST:LOCAL_RANK, comma-separated (e.g. gpu01:3,gpu04)"
        )
    out: dict[Exclusion, None] = {}
    for item in items:
        host, sep, index = item.partition(":")
        if not is_name(host) or (sep and not _INDEX.fullmatch(index)):
            raise HexiSeqError(
                f"--exclude: cannot read {short(item)}; write HOST or HOST:LOCAL_RANK (HOST a host "
                "name, LOCAL_RANK a GPU index such as 0)"
            )
        out.setdefault(Exclusion(host, int(index) if sep else None))
    return tuple(out)


@dataclass(frozen=True, kw_only=True)
class Survivors:
    """The cluster without the excluded devices, and where its devices really are."""

    cluster: Cluster
    excluded: tuple[Exclusion, ...]
    gpu_indices: Mapping[str, tuple[int, ...]] = field(
        default_factory=dict
    )  # partly excluded hosts only
    absent: tuple[
        Exclusion, ...
    ] = ()  # exclusions naming hosts the cluster does not have (allow_absent)


def exclude(
    cluster: Cluster, exclusions: Sequence[Exclusion], *, allow_absent: bool = False
) -> Survivors:
    """``cluster`` without ``exclusions``. Unknown host or GPU index, or nothing left: HexiSeqError
    (with ``allow_absent``, exclusions of hosts the cluster does not have are set aside instead)."""
    nodes = {n.name: n for n in cluster.nodes}
    lost: dict[str, set[int]] = {}
    absent = []
    for ex in exclusions:
        node = nodes.get(ex.host)
        if node is None:
            if allow_absent:
                absent.append(ex)
                continue
            raise HexiSeqError(
                f"--exclude {ex}: cluster {cluster.name!r} has no host {ex.host!r} "
                f"(hosts: {', '.join(short(h) for h in list(nodes)[:8])}"
                f"{', ...' if len(nodes) > 8 else ''})"
            )
        if ex.local_rank is not None and not 0 <= ex.local_rank < node.count:
            raise HexiSeqError(f"--exclude {ex}: host {ex.host!r} has GPUs 0..{node.count - 1}")
        lost.setdefault(ex.host, set()).update(
            range(node.count) if ex.local_rank is None else {ex.local_rank}
        )
    kept_nodes, indices = [], {}
    for node in cluster.nodes:
        left = tuple(i for i in range(node.count) if i not in lost.get(node.name, ()))
        if not left:
            continue
        if len(left) < node.count:
            indices[node.name] = left
        kept_nodes.append(replace(node, count=len(left)))
    if not kept_nodes:
        raise HexiSeqError(
            f"--exclude leaves no GPU of cluster {cluster.name!r}; exclude fewer devices"
        )
    devices: list[Device] = []
    per_node: dict[str, int] = {}  # node name -> last local index kept
    for d in cluster.devices:
        if d.local_index in lost.get(d.node, ()):
            continue
        local = per_node[d.node] = per_node.get(d.node, -1) + 1
        devices.append(replace(d, index=len(devices), local_index=local))
    return Survivors(
        cluster=replace(cluster, nodes=tuple(kept_nodes), devices=tuple(devices)),
        excluded=tuple(exclusions),
        gpu_indices=indices,
        absent=tuple(absent),
    )


def record_exclusions(layout: Layout, survivors: Survivors) -> Layout:
    """``layout`` (planned for ``survivors.cluster``) with the exclusions and the GPU indices each
    partly excluded host keeps in its meta (``excluded``, ``gpu_indices``)."""
    if not survivors.excluded:
        return layout
    return replace(
        layout,
        meta={
            **layout.meta,
            EXCLUDED_KEY: [str(e) for e in survivors.excluded],
            GPU_INDICES_KEY: {h: list(left) for h, left in survivors.gpu_indices.items()},
        },
    )


def device_names(layout: Layout) -> list[str]:
    """``host:gpu-index`` of every rank: its position among the host's ranks, mapped through
    ``meta.gpu_indices`` when the host lost GPUs."""
    indices = layout.meta.get(GPU_INDICES_KEY) if isinstance(layout.meta, Mapping) else None
    indices = indices if isinstance(indices, Mapping) else {}
    seen: dict[str, int] = {}
    names = []
    for r in layout.ranks:
        pos = seen.get(r.host, 0)
        seen[r.host] = pos + 1
        left = indices.get(r.host)
        names.append(
            f"{r.host}:{left[pos] if isinstance(left, Sequence) and pos < len(left) else pos}"
        )
    return names


def _memory_mode(layout: Layout) -> str | None:
    opts = layout.meta.get("options") if isinstance(layout.meta, Mapping) else None
    return opts.get("memory_mode") if isinstance(opts, Mapping) else None


def _model_spec(layout: Layout) -> Mapping[str, Any] | None:
    spec = layout.meta.get("model_spec") if isinstance(layout.meta, Mapping) else None
    return spec if isinstance(spec, Mapping) else None


def resume_problems(old: Layout, new: Layout) -> list[str]:
    """Why training under ``new`` cannot resume a checkpoint written under ``old`` (empty: it can).

    Compared: sequence length, heads and query groups, the recorded model spec's shape fields, and
    the memory mode (each mode has its own checkpoint format)."""
    problems = []
    if old.seq_length != new.seq_length:
        problems.append(
            f"seq_length {old.seq_length} -> {new.seq_length} (re-plan with --seq-length {old.seq_length})"
        )
    for name in ("num_attention_heads", "num_query_groups"):
        if getattr(old, name) != getattr(new, name):
            problems.append(f"{name} {getattr(old, name)} -> {getattr(new, name)} (another model)")
    a, b = _model_spec(old), _model_spec(new)
    if a is not None and b is not None:
        for name in MODEL_SHAPE_FIELDS:
            if (
                name in a
                and name in b
                and a[name] != b[name]
                and name not in ("num_attention_heads", "num_query_groups")
            ):
                problems.append(f"model {name} {a[name]} -> {b[name]} (another model)")
    ma, mb = _memory_mode(old), _memory_mode(new)
    if ma and mb and ma != mb:
        problems.append(
            f"memory mode {ma} ({CHECKPOINT_FORMAT.get(ma, ma)}) -> {mb} "
            f"({CHECKPOINT_FORMAT.get(mb, mb)}): re-plan with --memory-mode {ma}"
        )
    return problems


@dataclass(frozen=True, kw_only=True)
class LayoutDiff:
    """What changed from ``old`` to ``new``; ``resume_problems`` empty means a checkpoint carries over."""

    world_size: tuple[int, int]
    gone: tuple[str, ...]  # "host:gpu-index (GPU type)" of ranks only the old layout has
    added: tuple[str, ...]  # ... only the new layout has
    kept: int
    iteration_time_s: tuple[float | None, float | None]
    tokens_per_s: tuple[float | None, float | None]
    memory_mode: tuple[str | None, str | None]
    resume_problems: tuple[str, ...]

    def to_dict(self) -> dict[str, Any]:
        return {
            "world_size": list(self.world_size),
            "gone": list(self.gone),
            "added": list(self.added),
            "kept": self.kept,
            "iteration_time_s": list(self.iteration_time_s),
            "tokens_per_s": list(self.tokens_per_s),
            "memory_mode": list(self.memory_mode),
            "resume_problems": list(self.resume_problems),
            "resumable": not self.resume_problems,
        }

    def lines(self) -> list[str]:
        """Human summary, one fact per line."""

        def t(x: float | None) -> str:  # seconds in s, ms or µs with 4 significant digits
            scale, unit = next(
                ((f, u) for f, u in ((1.0, "s"), (1e-3, "ms")) if x and abs(x) >= f), (1e-6, "µs")
            )
            return "-" if x is None else f"{x / scale:.4g} {unit}"

        def r(x: float | None) -> str:
            return "-" if x is None else f"{x:,.0f}"

        out = [
            f"world size: {self.world_size[0]} -> {self.world_size[1]} ({self.kept} GPUs kept)",
            f"ranks gone: {', '.join(self.gone) or 'none'}",
            f"ranks added: {', '.join(self.added) or 'none'}",
            f"predicted iteration time: {t(self.iteration_time_s[0])} -> {t(self.iteration_time_s[1])}",
            f"predicted tokens/s: {r(self.tokens_per_s[0])} -> {r(self.tokens_per_s[1])}",
        ]
        if self.memory_mode[0] or self.memory_mode[1]:
            out.append(f"memory mode: {self.memory_mode[0] or '-'} -> {self.memory_mode[1] or '-'}")
        out.append(
            "resume from its checkpoints: "
            + ("yes" if not self.resume_problems else "no: " + "; ".join(self.resume_problems))
        )
        return out


def diff_layouts(old: Layout, new: Layout) -> LayoutDiff:
    """Compare two layouts device by device (``host:gpu-index``)."""

    def devices(layout: Layout) -> dict[str, str]:
        return {name: f"{name} ({r.gpu})" for name, r in zip(device_names(layout), layout.ranks)}

    a, b = devices(old), devices(new)

    def predicted(layout: Layout, key: str) -> float | None:
        value = (layout.predicted or {}).get(key)
        return (
            float(value)
            if isinstance(value, (int, float)) and not isinstance(value, bool)
            else None
        )

    return LayoutDiff(
        world_size=(old.world_size, new.world_size),
        gone=tuple(v for k, v in a.items() if k not in b),
        added=tuple(v for k, v in b.items() if k not in a),
        kept=len(a.keys() & b.keys()),
        iteration_time_s=(predicted(old, "iteration_time_s"), predicted(new, "iteration_time_s")),
        tokens_per_s=(predicted(old, "tokens_per_s"), predicted(new, "tokens_per_s")),
        memory_mode=(_memory_mode(old), _memory_mode(new)),
        resume_problems=tuple(resume_problems(old, new)),
    )


def main(argv: list[str] | None = None) -> int:
    import yaml

    from megatron_hexiseq.errors import OneLineParser

    parser = OneLineParser(
        prog="python -m megatron_hexiseq.elastic", description=__doc__.splitlines()[0]
    )
    sub = parser.add_subparsers(dest="command", required=True, parser_class=OneLineParser)
    p = sub.add_parser("exclude", help="write the cluster spec without the excluded GPUs or hosts")
    p.add_argument("--cluster", required=True)
    p.add_argument("--exclude", required=True, metavar="HOST[:LOCAL_RANK],...")
    p.add_argument(
        "--allow-absent",
        action="store_true",
        help="set aside exclusions of hosts the cluster does not have (a requeued job's new allocation)",
    )
    p.add_argument("-o", "--output", required=True)
    args = parser.parse_args(argv)

    def body() -> int:
        check_outputs([("-o", args.output)], inputs=[args.cluster])
        kept = exclude(
            load_cluster(args.cluster),
            parse_exclusions(args.exclude),
            allow_absent=args.allow_absent,
        )
        for ex in kept.absent:
            print(
                f"note: --exclude {ex}: not in this allocation, nothing to exclude", file=sys.stderr
            )
        write_text_atomic(
            args.output, yaml.safe_dump(cluster_to_dict(kept.cluster), sort_keys=False)
        )
        for host, left in kept.gpu_indices.items():
            print(host, ",".join(map(str, left)))
        return 0

    return run_user_command(body)


if __name__ == "__main__":
    sys.exit(main())
