"""Layout: the plan every rank executes.

A layout assigns each rank of one context-parallel domain (the ranks that share one sequence)
an A2A group, a set of token segments of the global sequence, and a set of query heads.

Rules (checked in ``__post_init__``; messages carry the numbers):
- every rank ``0..world_size-1`` appears exactly once, in order;
- groups partition the ranks; each group lists its ranks in ascending order and each rank
  names the group that lists it;
- the segments of all ranks partition ``[0, seq_length)`` exactly; a rank's segments are sorted,
  non-empty half-open ``[start, end)`` intervals;
- inside each group, the ranks' query heads partition ``0..num_attention_heads-1``;
- ``num_attention_heads`` is a multiple of ``num_query_groups`` (GQA/MQA);
- a rank may hold 0 tokens or 0 heads, not both (it would do nothing); every group owns at
  least one token (a group without tokens has nothing to attend with). The attention runtime
  supports both edge cases (see docs/layout.md).

Token order on a rank is segment order. Inside a group, the "group sequence" after the head
all-to-all is the concatenation of the member ranks' tokens in ascending rank order.

Tensor parallelism: with ``tensor_model_parallel_size = t > 1`` a rank is a TP bundle of t GPUs of
one node and the head counts are per TP rank (``megatron_hexiseq.tensor_parallel``: the layout's
head h is the model's head ``i * H/t + h`` on TP rank i). The JSON key is written only when t > 1.

JSON form: ``format: "megatron-hexiseq/layout"``, ``version: 1``; the JSON Schema lives in
``megatron_hexiseq/schema/layout.schema.json``. ``Layout.from_json(layout.to_json())`` is exact.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from megatron_hexiseq.cluster import NAME_RULE, Cluster
from megatron_hexiseq.errors import HexiSeqError, check_positive_int, short
from megatron_hexiseq.io import check_finite, plain, read_json, schema_error, write_json_atomic
from megatron_hexiseq.model import ModelSpec
from megatron_hexiseq.tensor_parallel import tp_heads

FORMAT = "megatron-hexiseq/layout"
VERSION = 1

Segment = tuple[int, int]


@dataclass(frozen=True, kw_only=True)
class RankPlan:
    """What one rank does: its host/GPU, its group, its token segments and its query heads."""

    rank: int
    host: str
    gpu: str
    group: int
    segments: tuple[Segment, ...]
    heads: tuple[int, ...]

    @property
    def num_tokens(self) -> int:
        return sum(e - s for s, e in self.segments)

    def positions(self) -> list[int]:
        """Global token positions of this rank, in segment order."""
        return [p for s, e in self.segments for p in range(s, e)]


@dataclass(frozen=True, kw_only=True)
class Group:
    """An A2A (head-parallel) group: ranks that exchange heads by ragged all-to-all."""

    id: int
    ranks: tuple[int, ...]


@dataclass(frozen=True, kw_only=True)
class Layout:
    """A frozen, validated plan. Build with keywords, or load with ``Layout.load``."""

    seq_length: int
    num_attention_heads: int
    num_query_groups: int
    world_size: int
    groups: tuple[Group, ...]
    ranks: tuple[RankPlan, ...]
    tensor_model_parallel_size: int = (
        1  # t: each rank is a TP bundle of t GPUs (tensor_parallel.py)
    )
    predicted: Mapping[str, Any] | None = field(default=None, compare=False)
    baselines: tuple[Mapping[str, Any], ...] = field(default=(), compare=False)
    planner: Mapping[str, Any] = field(default_factory=dict, compare=False)
    meta: Mapping[str, Any] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        _validate(self)

    # ---- derived views -------------------------------------------------------------------
    @cached_property
    def _group_index(self) -> dict[int, Group]:
        return {g.id: g for g in self.groups}

    def group(self, group_id: int) -> Group:
        return self._group_index[group_id]

    def group_of(self, rank: int) -> Group:
        return self._group_index[self.ranks[rank].group]

    @property
    def heads_per_query_group(self) -> int:
        return self.num_attention_heads // self.num_query_groups

    def kv_heads(self, rank: int) -> tuple[int, ...]:
        """Sorted K/V heads (query groups) that rank's query heads need."""
        hpg = self.heads_per_query_group
        return tuple(sorted({h // hpg for h in self.ranks[rank].heads}))

    def group_segments(self, group_id: int) -> tuple[Segment, ...]:
        """Segments of a group's sequence, in group order (member ranks ascending)."""
        return tuple(seg for r in self.group(group_id).ranks for seg in self.ranks[r].segments)

    def group_num_tokens(self, group_id: int) -> int:
        return sum(self.ranks[r].num_tokens for r in self.group(group_id).ranks)

    def is_symmetric(self) -> bool:
        """True when every rank holds the same number of tokens and heads, all groups equal."""
        tokens = {r.num_tokens for r in self.ranks}
        heads = {len(r.heads) for r in self.ranks}
        sizes = {len(g.ranks) for g in self.groups}
        return len(tokens) == len(heads) == len(sizes) == 1

    # ---- JSON ------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "version": VERSION,
            "seq_length": self.seq_length,
            "num_attention_heads": self.num_attention_heads,
            "num_query_groups": self.num_query_groups,
            "world_size": self.world_size,
            **(
                {"tensor_model_parallel_size": self.tensor_model_parallel_size}
                if self.tensor_model_parallel_size > 1
                else {}
            ),
            "groups": [{"id": g.id, "ranks": list(g.ranks)} for g in self.groups],
            "ranks": [
                {
                    "rank": r.rank,
                    "host": r.host,
                    "gpu": r.gpu,
                    "group": r.group,
                    "segments": [list(s) for s in r.segments],
                    "heads": list(r.heads),
                }
                for r in self.ranks
            ],
            "predicted": plain(self.predicted),
            "baselines": [plain(b) for b in self.baselines],
            "planner": plain(self.planner),
            "meta": plain(self.meta),
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2) + "\n"

    def save(self, path: str | os.PathLike) -> None:
        """Write atomically: no half-written layout is ever left behind."""
        write_json_atomic(path, self.to_dict())

    @classmethod
    def from_dict(cls, data: Any, *, source: str = "layout") -> Layout:
        _check_schema(data, source)
        try:
            return cls(
                seq_length=data["seq_length"],
                num_attention_heads=data["num_attention_heads"],
                num_query_groups=data["num_query_groups"],
                world_size=data["world_size"],
                tensor_model_parallel_size=data.get("tensor_model_parallel_size", 1),
                groups=tuple(Group(id=g["id"], ranks=tuple(g["ranks"])) for g in data["groups"]),
                ranks=tuple(
                    RankPlan(
                        rank=r["rank"],
                        host=r["host"],
                        gpu=r["gpu"],
                        group=r["group"],
                        segments=tuple((s[0], s[1]) for s in r["segments"]),
                        heads=tuple(r["heads"]),
                    )
                    for r in data["ranks"]
                ),
                predicted=data["predicted"],
                baselines=tuple(data["baselines"]),
                planner=data["planner"],
                meta=data.get("meta", {}),
            )
        except HexiSeqError as e:
            raise HexiSeqError(f"{source}: {e}") from None

    @classmethod
    def from_json(cls, text: str, *, source: str = "layout") -> Layout:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise HexiSeqError(f"{source} is not valid JSON: {e.msg} at line {e.lineno}") from None
        return cls.from_dict(data, source=source)

    @classmethod
    def load(cls, path: str | os.PathLike) -> Layout:
        return cls.from_dict(read_json(path, "layout"), source=f"layout {path}")


# ---- construction helpers -------------------------------------------------------------------
def make_layout(
    *,
    seq_length: int,
    num_attention_heads: int,
    num_query_groups: int,
    segments: Sequence[Sequence[Segment]],
    heads: Sequence[Sequence[int]],
    group_sizes: Sequence[int] | None = None,
    groups: Sequence[Sequence[int]] | None = None,
    hosts: Sequence[str] | None = None,
    gpus: Sequence[str] | None = None,
    **extra: Any,
) -> Layout:
    """Build a Layout from per-rank lists (the one constructor from lists: tests, the planner's
    ``build_layout``, the baselines). Groups: ``group_sizes`` (consecutive runs of ranks) or
    ``groups`` (the ranks of each group, in group-id order); exactly one."""
    if (group_sizes is None) == (groups is None):
        raise HexiSeqError("give group_sizes or groups, not both or neither")
    if groups is None:
        assert group_sizes is not None
        starts = [sum(group_sizes[:i]) for i in range(len(group_sizes))]
        groups = [range(start, start + size) for start, size in zip(starts, group_sizes)]
    world = sum(len(g) for g in groups)
    if len(segments) != world or len(heads) != world:
        raise HexiSeqError(
            f"need segments and heads for {world} ranks, got {len(segments)} and {len(heads)}"
        )
    rank_group = [0] * world
    for gid, members in enumerate(groups):
        for r in members:
            rank_group[r] = gid
    # The planner builds ~30 layouts of every rank per plan: each RankPlan is filled in directly
    # (what the frozen dataclass's __init__ does, at half its cost; the Layout validates it) and
    # only values that are not ints already are converted.
    new, plan_type = object.__new__, RankPlan
    ranks_list = []
    for r in range(world):
        plan = new(plan_type)
        plan.__dict__.update(
            rank=r,
            host=hosts[r] if hosts else f"node{rank_group[r]}",
            gpu=gpus[r] if gpus else "CPU",
            group=rank_group[r],
            segments=tuple(
                [
                    (s, e) if type(s) is int and type(e) is int else (int(s), int(e))
                    for s, e in segments[r]
                ]
            ),
            heads=tuple(map(int, heads[r])),
        )
        ranks_list.append(plan)
    ranks = tuple(ranks_list)
    return Layout(
        seq_length=seq_length,
        num_attention_heads=num_attention_heads,
        num_query_groups=num_query_groups,
        world_size=world,
        groups=tuple(Group(id=gid, ranks=tuple(members)) for gid, members in enumerate(groups)),
        ranks=ranks,
        **extra,
    )


def split_evenly(total: int, parts: int) -> list[int]:
    """``total`` split into ``parts`` integers differing by at most one (larger ones first)."""
    q, r = divmod(total, parts)
    return [q + (1 if i < r else 0) for i in range(parts)]


def zigzag_segments(seq_length: int, cp: int) -> list[list[Segment]]:
    """Megatron's even 2xCP load-balanced split: rank i holds chunks i and 2*cp-1-i.

    Matches ``megatron.core.utils.get_batch_on_this_cp_rank`` (requires seq_length % (2*cp) == 0).
    """
    if seq_length % (2 * cp):
        raise HexiSeqError(
            f"zig-zag split needs seq_length divisible by 2*cp={2 * cp}, got {seq_length}"
        )
    c = seq_length // (2 * cp)
    return [[(i * c, (i + 1) * c), ((2 * cp - 1 - i) * c, (2 * cp - i) * c)] for i in range(cp)]


# ---- validation -----------------------------------------------------------------------------
def check_matches(
    layout: Layout, cluster: Cluster, model: ModelSpec | None = None, *, source: str = "the layout"
) -> None:
    """A layout runs on ``cluster`` (rank r on ``cluster.devices[r]``: same count, host and GPU type;
    with ``tensor_model_parallel_size`` t, bundle r on devices ``r*t .. r*t+t-1``, all on its host)
    and, given ``model``, trains it (same heads, query groups and sequence length; per TP rank with
    t > 1); otherwise a one-line HexiSeqError that starts with ``source`` ("layout out.json", "the
    layout")."""
    t = layout.tensor_model_parallel_size
    if layout.world_size * t != cluster.world_size:
        what = f"{layout.world_size} ranks" if t == 1 else f"{layout.world_size} TP bundles of {t}"
        raise HexiSeqError(
            f"{source} has {what} but cluster {cluster.name!r} has "
            f"{cluster.world_size} GPUs; plan for this cluster or pass the cluster it was planned for"
        )
    for plan in layout.ranks:
        for dev in cluster.devices[plan.rank * t : (plan.rank + 1) * t]:
            if plan.gpu != dev.gpu.name or plan.host != dev.node:
                raise HexiSeqError(
                    f"{source} rank {plan.rank} is on {plan.host}/{plan.gpu} but the cluster's device "
                    f"{dev.index} is {dev.node}/{dev.gpu.name}; was the layout planned for cluster "
                    f"{cluster.name!r}?"
                )
    if model is None:
        return
    want = _heads_per_tp_rank(model.num_attention_heads, model.num_query_groups, t, source)
    if (layout.num_attention_heads, layout.num_query_groups) != want:
        per = "" if t == 1 else f" per TP rank of {t}"
        raise HexiSeqError(
            f"{source} has {layout.num_attention_heads} heads in {layout.num_query_groups} query "
            f"groups{per} but model {model.name!r} has {want[0]} in {want[1]}"
            + ("" if t == 1 else f" ({model.num_attention_heads} / {model.num_query_groups})")
        )
    if layout.seq_length != model.seq_length:
        raise HexiSeqError(
            f"{source} is planned for seq_length {layout.seq_length} but model {model.name!r} has "
            f"seq_length {model.seq_length}; pass --seq-length {layout.seq_length}"
        )


def _heads_per_tp_rank(heads: int, groups: int, tp: int, source: str) -> tuple[int, int]:
    """``tensor_parallel.tp_heads`` with the message prefixed by ``source``."""
    try:
        return tp_heads(heads, groups, tp)
    except HexiSeqError as e:
        raise HexiSeqError(f"{source}: {e}") from None


def _fail(msg: str) -> None:
    raise HexiSeqError(msg)


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _validate(lay: Layout) -> None:
    for name in (
        "seq_length",
        "num_attention_heads",
        "num_query_groups",
        "world_size",
        "tensor_model_parallel_size",
    ):
        check_positive_int(name, getattr(lay, name))
    H, G, W = lay.num_attention_heads, lay.num_query_groups, lay.world_size
    if H % G:
        _fail(f"num_attention_heads={H} is not a multiple of num_query_groups={G}")
    if len(lay.ranks) != W:
        _fail(f"world_size is {W} but {len(lay.ranks)} ranks are listed")
    for i, r in enumerate(lay.ranks):
        if r.rank != i:
            _fail(f"ranks must be listed in order 0..{W - 1}: entry {i} is rank {r.rank}")
    # groups partition the ranks
    gids = [g.id for g in lay.groups]
    if not lay.groups:
        _fail("a layout needs at least one group")
    if len(set(gids)) != len(gids):
        _fail(f"group ids repeat: {gids}")
    seen: dict[int, int] = {}
    for g in lay.groups:
        if not g.ranks:
            _fail(f"group {g.id} has no ranks")
        if list(g.ranks) != sorted(g.ranks):
            _fail(f"group {g.id} must list its ranks in ascending order, got {list(g.ranks)}")
        for member in g.ranks:
            if not _is_int(member) or not 0 <= member < W:
                _fail(f"group {g.id} lists rank {member}, outside 0..{W - 1}")
            if member in seen:
                _fail(f"rank {member} is in group {seen[member]} and group {g.id}")
            seen[member] = g.id
    for r in lay.ranks:
        if r.rank not in seen:
            _fail(f"rank {r.rank} is in no group")
        if seen[r.rank] != r.group:
            _fail(f"rank {r.rank} says group {r.group} but group {seen[r.rank]} lists it")
    if not _partitions_hold(lay):  # the common case in one pass; else name the problem
        _check_partitions(lay)


def _check_partitions(lay: Layout) -> None:
    """The segment, head and work rules, each failure a message with the numbers."""
    H, S = lay.num_attention_heads, lay.seq_length
    # segments partition [0, S)
    owned: list[tuple[int, int, int]] = []
    for r in lay.ranks:
        prev_end = -1
        for seg in r.segments:
            if len(seg) != 2 or not all(_is_int(x) for x in seg):
                _fail(f"rank {r.rank}: segment {list(seg)} must be two integers [start, end)")
            s, e = seg
            if not 0 <= s < e <= S:
                _fail(
                    f"rank {r.rank}: segment [{s}, {e}) must satisfy 0 <= start < end <= seq_length={S}"
                )
            if s < prev_end:
                _fail(
                    f"rank {r.rank}: segments must be sorted and disjoint, [{s}, {e}) comes after one ending at {prev_end}"
                )
            prev_end = e
            owned.append((s, e, r.rank))
    owned.sort()
    pos, pos_owner = 0, -1
    for s, e, rk in owned:
        if s > pos:
            _fail(f"tokens [{pos}, {s}) belong to no rank; the segments must cover [0, {S})")
        if s < pos:
            _fail(f"segments of rank {pos_owner} overlap rank {rk} at [{s}, {min(pos, e)})")
        pos, pos_owner = e, rk
    if pos != S:
        _fail(f"tokens [{pos}, {S}) belong to no rank; the segments must cover [0, {S})")
    # heads partition 0..H-1 inside each group
    for g in lay.groups:
        holder: dict[int, int] = {}
        for member in g.ranks:
            for h in lay.ranks[member].heads:
                if not _is_int(h) or not 0 <= h < H:
                    _fail(f"rank {member}: head {h} outside 0..{H - 1}")
                if h in holder:
                    _fail(f"group {g.id}: head {h} is held by rank {holder[h]} and rank {member}")
                holder[h] = member
        missing = sorted(set(range(H)) - set(holder))
        if missing:
            _fail(
                f"group {g.id}: heads {_ranges(missing)} are held by no rank; each group must hold all {H} heads"
            )
        if sum(lay.ranks[r].num_tokens for r in g.ranks) == 0:
            _fail(f"group {g.id} owns no tokens; give it a segment or remove the group")
    for r in lay.ranks:
        if list(r.heads) != sorted(r.heads):
            _fail(f"rank {r.rank}: heads must be sorted ascending, got {list(r.heads)}")
        if r.num_tokens == 0 and not r.heads:
            _fail(f"rank {r.rank} holds neither tokens nor heads; drop it or give it work")


def _partitions_hold(lay: Layout) -> bool:
    """True when the rules ``_check_partitions`` checks all hold (without messages: the
    planner builds and validates thousands of layouts); False sends ``_validate`` through the checks
    that name what is wrong."""
    S, H = lay.seq_length, lay.num_attention_heads
    owned: list[tuple[int, int]] = []
    for r in lay.ranks:
        prev_end = -1
        for seg in r.segments:
            if len(seg) != 2 or type(seg[0]) is not int or type(seg[1]) is not int:
                return False
            s, e = seg
            if not (0 <= s < e <= S) or s < prev_end:
                return False
            prev_end = e
            owned.append(seg)
        heads = r.heads
        if heads and (set(map(type, heads)) != {int} or list(heads) != sorted(heads)):
            return False
        if not heads and prev_end < 0:
            return False  # neither tokens nor heads
    owned.sort()
    pos = 0
    for s, e in owned:
        if s != pos:
            return False
        pos = e
    if pos != S:
        return False
    every = list(range(H))
    for g in lay.groups:
        held = sorted(h for m in g.ranks for h in lay.ranks[m].heads)
        if held != every or all(not lay.ranks[m].segments for m in g.ranks):
            return False
    return True


def _ranges(xs: list[int]) -> str:
    """[0,1,2,5] -> '0-2,5' for compact messages."""
    out, i = [], 0
    while i < len(xs):
        j = i
        while j + 1 < len(xs) and xs[j + 1] == xs[j] + 1:
            j += 1
        out.append(f"{xs[i]}-{xs[j]}" if j > i else f"{xs[i]}")
        i = j + 1
    return ",".join(out)


def _check_schema(data: Any, source: str) -> None:
    """Structural check with the packaged JSON Schema; one-line message naming the path."""
    if not isinstance(data, dict):
        raise HexiSeqError(f"{source}: expected a JSON object at the top level")
    if data.get("format") != FORMAT:
        raise HexiSeqError(
            f"{source}: 'format' must be {FORMAT!r}, got {data.get('format')!r}; is this a layout file?"
        )
    if data.get("version") != VERSION:
        raise HexiSeqError(
            f"{source}: layout version {data.get('version')!r} is not supported (this release reads version {VERSION})"
        )
    err = schema_error(data, "layout.schema.json")
    if err is not None:
        where = "/".join(str(p) for p in err.absolute_path) or "(top level)"
        if err.validator in ("maximum", "pattern"):  # jsonschema's message quotes the whole value
            what = (
                "at most " + str(err.validator_value)
                if err.validator == "maximum"
                else ("a host name: " + NAME_RULE)
            )
            raise HexiSeqError(f"{source}: at {where}: must be {what}, got {short(err.instance)}")
        raise HexiSeqError(f"{source}: at {where}: {err.message}")
    # NaN and infinity are refused in every part of a layout file
    check_finite(data, source, ("predicted", "baselines", "planner", "meta"), "a layout")
    _check_meta(data, source)


def _check_meta(data: Mapping[str, Any], source: str) -> None:
    """What ``plan`` records in ``meta`` and the commands read back: the training options, the
    model spec (its heads, query groups and length must be the layout's), the GPU indices left
    after ``--exclude`` (distinct, one per rank of that host at least)."""
    from megatron_hexiseq.run_config import check_options_record

    meta = data.get("meta") or {}
    opts = check_options_record(meta.get("options"), source)
    flags = opts.get("megatron_flags", [])
    if not all(isinstance(f, str) and f and not any(c.isspace() for c in f) for f in flags):
        raise HexiSeqError(
            f"{source}: meta.options.megatron_flags must be a list of flags (strings without "
            f"spaces), got {short(flags)}; re-plan the layout"
        )
    spec = meta.get("model_spec")
    if spec is not None:
        if not isinstance(spec, Mapping):
            raise HexiSeqError(f"{source}: meta.model_spec must be a mapping, got {short(spec)}")
        tp = data.get("tensor_model_parallel_size", 1)
        if tp > 1 and all(
            isinstance(spec.get(k), int) for k in ("num_attention_heads", "num_query_groups")
        ):  # a layout over TP bundles counts heads per TP rank
            heads, groups = _heads_per_tp_rank(
                spec["num_attention_heads"], spec["num_query_groups"], tp, source
            )
            spec = {**spec, "num_attention_heads": heads, "num_query_groups": groups}
        for key in ("num_attention_heads", "num_query_groups", "seq_length"):
            if key in spec and spec[key] != data[key]:
                raise HexiSeqError(
                    f"{source}: {key} is {data[key]} but meta.model_spec.{key} is "
                    f"{short(spec[key])}; the layout was edited: re-plan it"
                )
    indices = meta.get("gpu_indices")
    if indices is None:
        return
    per_host: dict[str, int] = {}
    for r in data["ranks"]:
        per_host[r["host"]] = per_host.get(r["host"], 0) + 1
    if not isinstance(indices, Mapping):
        raise HexiSeqError(f"{source}: meta.gpu_indices must be a mapping, got {short(indices)}")
    for host, left in indices.items():
        ok = (
            isinstance(left, list)
            and all(_is_int(i) and 0 <= i < 1_000_000 for i in left)
            and len(set(left)) == len(left) == len(sorted(left))
            and left == sorted(left)
            and len(left) >= per_host.get(host, 0)
        )
        if not ok:
            raise HexiSeqError(
                f"{source}: meta.gpu_indices.{short(host)} must list the distinct GPU indices "
                f"(ascending) left on that host, at least one per rank there "
                f"({per_host.get(host, 0)}), got {short(left)}"
            )
