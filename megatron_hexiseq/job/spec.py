"""JobPlan: the plan of a whole training job on a (mixed) cluster, and its file.

A job is a set of **domains**: disjoint sets of the cluster's GPUs, each running its own HexiSeq
layout on its own sequences. Ranks are **cluster ranks**: rank ``r`` is ``cluster.devices[r]``
(nodes in file order, GPUs numbered node by node). A domain lists its cluster ranks; its layout is
over local ranks ``0..n-1``, local rank ``j`` being cluster rank ``ranks[j]``. A GPU in no domain
takes no part in the run.

Per step, domain ``d`` runs ``micro_batches`` micro-batches of ``micro_batch_size`` sequences
(``options.micro_batch_size``) with its layout; the sequences of all domains make the global batch
(``sum(micro_batches) * micro_batch_size == global_batch``). Every TP rank holds its share of the
whole model, so one gradient reduction over every rank of the run ends the step.

**TP bundles.** A job has one tensor-parallel size ``t`` (``options.tensor_model_parallel_size``,
recorded when > 1; :attr:`JobPlan.tensor_model_parallel_size`). With ``t > 1`` a domain lists its
cluster ranks bundle by bundle: bundle ``j`` is ``ranks[j*t:(j+1)*t]``, ``t`` GPUs of one node (its
TP ranks in that order), and its layout is over bundles (``layout.world_size == len(ranks) / t``,
``layout.tensor_model_parallel_size == t``, heads per TP rank as ``tensor_parallel.tp_heads``
counts them): local rank ``j`` of the layout is bundle ``j``. ``t = 1`` is the plain case, every
GPU a bundle of its own.

Two orders the runtime relies on (``run_ranks``, ``sample_range``):
- the run's process ranks: process rank ``k`` is cluster rank ``run_ranks[k]`` (every rank of
  every domain, ascending; with ``t > 1`` bundle by bundle, bundles by their lowest cluster rank,
  each bundle's ranks in its TP-rank order, so that every ``t`` consecutive process ranks are one
  bundle: Megatron's TP group): a job that leaves GPUs out is launched on the others only;
- the global batch's sequences: domain ``d`` takes the ``sample_range(d)`` slice of each step's
  global batch (domains in file order, each a contiguous run of ``micro_batches *
  micro_batch_size`` sequences), whatever the speed of its GPUs.

Rules (checked at construction, one-line messages carrying the numbers): at least one domain;
every domain's ranks are distinct cluster ranks, no rank in two domains; a domain's layout has one
rank per listed GPU (per bundle with ``t > 1``: every bundle ``t`` GPUs of one node, the layout
planned for TP bundles of ``t``), that GPU's type and host, the job's sequence length and the
model's heads and query groups (per TP rank); ``micro_batches`` is a positive integer; the shares add up to the global batch; a
layout planned under other training options (memory mode, recompute, micro-batch size) than the
job's is refused.

JSON form: ``format: "megatron-hexiseq/job"``, ``version: 1``; the JSON Schema lives in
``megatron_hexiseq/schema/job.schema.json``. ``JobPlan.from_json(job.to_json())`` is exact.
``load_layout_or_job`` reads either kind of file, told apart by its ``format`` (``show``,
``validate``, ``simulate``).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, NamedTuple

from megatron_hexiseq.cluster import Cluster, cluster_from_dict
from megatron_hexiseq.errors import HexiSeqError, short
from megatron_hexiseq.io import check_finite, plain, read_json, schema_error, write_json_atomic
from megatron_hexiseq.layout import Layout
from megatron_hexiseq.model import ModelSpec, model_from_dict
from megatron_hexiseq.run_config import TrainOptions, check_options_record, options_from_record
from megatron_hexiseq.tensor_parallel import tp_heads

FORMAT = "megatron-hexiseq/job"
VERSION = 1
# the options a domain's layout must share with its job (the rest, e.g. data_parallel_size, is
# the domain's own)
SHARED_OPTIONS = ("memory_mode", "recompute", "micro_batch_size")


class DomainRank(NamedTuple):
    """Where a cluster rank runs in a job: its domain's index, its rank in that domain's layout
    (its bundle with ``t > 1``) and its TP rank in that bundle."""

    domain: int
    local_rank: int
    tp_rank: int = 0


class SampleRange(NamedTuple):
    """A domain's sequences of each step: global-batch indices ``[start, stop)``."""

    start: int
    stop: int


@dataclass(frozen=True, kw_only=True)
class Domain:
    """GPUs that share one HexiSeq layout, and how many micro-batches they run per step."""

    ranks: tuple[int, ...]  # cluster ranks; local rank j of ``layout`` is ranks[j]
    micro_batches: int
    layout: Layout

    @property
    def size(self) -> int:
        return len(self.ranks)

    def to_dict(self) -> dict[str, Any]:
        return {
            "ranks": list(self.ranks),
            "micro_batches": self.micro_batches,
            "layout": self.layout.to_dict(),
        }


@dataclass(frozen=True, kw_only=True)
class JobPlan:
    """A frozen, validated job plan. Build with keywords, or load with ``JobPlan.load``."""

    global_batch: int  # sequences per step
    seq_length: int
    model: Mapping[str, Any]  # ModelSpec.to_dict()
    cluster: Mapping[str, Any]  # cluster_to_dict(cluster): the whole cluster, every GPU
    options: Mapping[str, Any]  # run_config.options_record of the job's training options
    domains: tuple[Domain, ...]
    predicted: Mapping[str, Any] | None = field(default=None, compare=False)
    alternatives: tuple[Mapping[str, Any], ...] = field(default=(), compare=False)
    planner: Mapping[str, Any] = field(default_factory=dict, compare=False)
    meta: Mapping[str, Any] = field(default_factory=dict, compare=False)

    def __post_init__(self) -> None:
        _validate(self)

    # ---- derived views -------------------------------------------------------------------
    @cached_property
    def cluster_spec(self) -> Cluster:
        return cluster_from_dict(self.cluster, source="job cluster")

    @cached_property
    def model_spec(self) -> ModelSpec:
        return model_from_dict(self.model, source="job model")

    @cached_property
    def train_options(self) -> TrainOptions:
        return options_from_record(self.options)

    @property
    def micro_batch_size(self) -> int:
        return int(self.options.get("micro_batch_size", 1))

    @property
    def tensor_model_parallel_size(self) -> int:
        """GPUs per TP bundle (Megatron's ``--tensor-model-parallel-size``), 1 unless recorded."""
        return int(self.options.get("tensor_model_parallel_size", 1))

    def bundles(self, domain: int) -> tuple[tuple[int, ...], ...]:
        """Domain ``domain``'s TP bundles (cluster ranks), in its layout's rank order."""
        t, ranks = self.tensor_model_parallel_size, self.domains[domain].ranks
        return tuple(ranks[j : j + t] for j in range(0, len(ranks), t))

    @cached_property
    def run_ranks(self) -> tuple[int, ...]:
        """Cluster ranks of the run: process rank ``k`` runs cluster rank ``run_ranks[k]``;
        ascending, with ``t > 1`` bundle by bundle (module docstring)."""
        bundles = [b for d in range(len(self.domains)) for b in self.bundles(d)]
        return tuple(r for b in sorted(bundles, key=min) for r in b)

    @cached_property
    def _where(self) -> dict[int, DomainRank]:
        t = self.tensor_model_parallel_size
        return {
            r: DomainRank(d, j // t, j % t)
            for d, dom in enumerate(self.domains)
            for j, r in enumerate(dom.ranks)
        }

    def locate(self, cluster_rank: int) -> DomainRank:
        """The domain, local (bundle) rank and TP rank of a cluster rank; an error if the job does
        not use it."""
        try:
            return self._where[cluster_rank]
        except KeyError:
            raise HexiSeqError(
                f"cluster rank {short(cluster_rank)} is in no domain of this job "
                f"(it uses {len(self.run_ranks)} of {self.cluster_spec.world_size} GPUs); "
                "launch the job on its run ranks only"
            ) from None

    def sample_range(self, domain: int) -> SampleRange:
        """Global-batch indices of domain ``domain``'s sequences in every step."""
        start = self.micro_batch_size * sum(d.micro_batches for d in self.domains[:domain])
        return SampleRange(
            start, start + self.micro_batch_size * self.domains[domain].micro_batches
        )

    # ---- JSON ------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "version": VERSION,
            "global_batch": self.global_batch,
            "seq_length": self.seq_length,
            "model": plain(self.model),
            "cluster": plain(self.cluster),
            "options": plain(self.options),
            "domains": [d.to_dict() for d in self.domains],
            "predicted": plain(self.predicted),
            "alternatives": [plain(a) for a in self.alternatives],
            "planner": plain(self.planner),
            "meta": plain(self.meta),
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1) + "\n"

    def save(self, path: str | os.PathLike) -> None:
        """Write atomically: no half-written job file is ever left behind."""
        write_json_atomic(path, self.to_dict())

    @classmethod
    def from_dict(cls, data: Any, *, source: str = "job") -> JobPlan:
        _check_schema(data, source)
        try:
            return cls(
                global_batch=data["global_batch"],
                seq_length=data["seq_length"],
                model=data["model"],
                cluster=data["cluster"],
                options=data["options"],
                domains=domains_from_list(data["domains"], where="domains"),
                predicted=data["predicted"],
                alternatives=tuple(data["alternatives"]),
                planner=data["planner"],
                meta=data.get("meta", {}),
            )
        except HexiSeqError as e:
            raise HexiSeqError(f"{source}: {e}") from None

    @classmethod
    def from_json(cls, text: str, *, source: str = "job") -> JobPlan:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise HexiSeqError(f"{source} is not valid JSON: {e.msg} at line {e.lineno}") from None
        return cls.from_dict(data, source=source)

    @classmethod
    def load(cls, path: str | os.PathLike) -> JobPlan:
        return cls.from_dict(read_json(path, "job file"), source=f"job {path}")

    # ---- alternatives ----------------------------------------------------------------------
    def alternative_names(self) -> tuple[str, ...]:
        return tuple(str(a["name"]) for a in self.alternatives)

    def alternative(self, name: str) -> JobPlan:
        """The job an alternative stands for (its domains and shares, this job's batch and
        specs), validated as a job; an error for an unknown or infeasible alternative."""
        for alt in self.alternatives:
            if alt["name"] == name:
                if not alt.get("feasible") or not alt.get("domains"):
                    raise HexiSeqError(
                        f"alternative {short(name)} is not feasible: it has no plan to run"
                    )
                try:
                    domains = domains_from_list(
                        alt["domains"], where=f"alternatives.{name}.domains"
                    )
                    return JobPlan(
                        global_batch=self.global_batch,
                        seq_length=self.seq_length,
                        model=self.model,
                        cluster=self.cluster,
                        options=alt.get("options", self.options),
                        domains=domains,
                        predicted={k: v for k, v in alt.items() if k not in ("domains", "name")},
                        meta={"alternative_of": dict(self.meta), "name": name},
                    )
                except HexiSeqError as e:
                    raise HexiSeqError(f"alternative {short(name)}: {e}") from None
        raise HexiSeqError(
            f"no alternative named {short(name)}; this job has {', '.join(self.alternative_names()) or 'none'}"
        )


def domains_from_list(items: Sequence[Any], *, where: str) -> tuple[Domain, ...]:
    """Domains from their JSON form (each layout validated as a layout file is)."""
    out = []
    for i, d in enumerate(items):
        if not isinstance(d, Mapping) or set(d) != {"ranks", "micro_batches", "layout"}:
            raise HexiSeqError(
                f"{where}[{i}] must be an object with exactly the keys ranks, micro_batches, layout"
            )
        out.append(
            Domain(
                ranks=tuple(d["ranks"]) if isinstance(d["ranks"], list) else d["ranks"],
                micro_batches=d["micro_batches"],
                layout=Layout.from_dict(d["layout"], source=f"{where}[{i}].layout"),
            )
        )
    return tuple(out)


# ---- validation -------------------------------------------------------------------------------
def _fail(msg: str) -> None:
    raise HexiSeqError(msg)


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _validate(job: JobPlan) -> None:
    for name in ("global_batch", "seq_length"):
        value = getattr(job, name)
        if not _is_int(value) or value < 1:
            _fail(f"{name} must be a positive integer, got {short(value)}")
    if not job.domains:
        _fail("a job needs at least one domain")
    cluster = job.cluster_spec
    model = job.model_spec
    opts = check_options_record(job.options, "job")
    t = job.tensor_model_parallel_size
    try:
        heads = tp_heads(model.num_attention_heads, model.num_query_groups, t)
    except HexiSeqError as e:
        raise HexiSeqError(f"options.tensor_model_parallel_size: {e}") from None
    world = cluster.world_size
    seen: dict[int, int] = {}
    for d, dom in enumerate(job.domains):
        at = f"domain {d}"
        if not isinstance(dom.ranks, tuple) or not dom.ranks:
            _fail(f"{at}: ranks must be a non-empty list of cluster ranks, got {short(dom.ranks)}")
        if not _is_int(dom.micro_batches) or dom.micro_batches < 1:
            _fail(f"{at}: micro_batches must be a positive integer, got {short(dom.micro_batches)}")
        for r in dom.ranks:
            if not _is_int(r) or not 0 <= r < world:
                _fail(f"{at}: rank {short(r)} is not a rank of the cluster (0..{world - 1})")
            if r in seen:
                _fail(f"{at}: cluster rank {r} is in domain {seen[r]} too; a GPU runs one domain")
            seen[r] = d
        lay = dom.layout
        if t > 1:
            _check_bundles(job, d, lay, cluster)
        elif lay.tensor_model_parallel_size != 1:
            _fail(
                f"{at}: its layout is planned for TP bundles of {lay.tensor_model_parallel_size} "
                "GPUs but the job's options have no tensor_model_parallel_size; re-plan the job"
            )
        if lay.world_size * t != len(dom.ranks):
            _fail(
                f"{at}: its layout has {lay.world_size} ranks but the domain lists {len(dom.ranks)} GPUs"
                if t == 1
                else f"{at}: its layout has {lay.world_size} TP bundles of {t} but the domain lists "
                f"{len(dom.ranks)} GPUs"
            )
        if lay.seq_length != job.seq_length:
            _fail(
                f"{at}: its layout is for seq_length {lay.seq_length}, the job's is {job.seq_length}"
            )
        if (lay.num_attention_heads, lay.num_query_groups) != heads:
            per = "" if t == 1 else f" per TP rank of {t}: {heads[0]} / {heads[1]}"
            _fail(
                f"{at}: its layout has {lay.num_attention_heads} heads / {lay.num_query_groups} query "
                f"groups, the model {model.num_attention_heads} / {model.num_query_groups}{per}"
            )
        for j, r in enumerate(dom.ranks):
            dev, rp = cluster.devices[r], lay.ranks[j // t]
            if (rp.gpu, rp.host) != (dev.gpu.name, dev.node):
                _fail(
                    f"{at}: local rank {j} is planned for {rp.gpu} on {rp.host} but cluster rank {r} "
                    f"is {dev.gpu.name} on {dev.node}; re-plan the job"
                    if t == 1
                    else f"{at}: bundle {j // t} is planned for {rp.gpu} on {rp.host} but its cluster "
                    f"rank {r} is {dev.gpu.name} on {dev.node}; re-plan the job"
                )
        lay_opts = (lay.meta or {}).get("options") or {}
        for key in SHARED_OPTIONS:
            if key in lay_opts and key in opts and lay_opts[key] != opts[key]:
                _fail(
                    f"{at}: its layout was planned with {key} {short(lay_opts[key])}, the job runs "
                    f"{short(opts[key])}; re-plan the job"
                )
    mbs = opts.get("micro_batch_size", 1)
    total = mbs * sum(d.micro_batches for d in job.domains)
    if total != job.global_batch:
        _fail(
            f"the domains take {total} sequences per step ({' + '.join(str(d.micro_batches) for d in job.domains)} "
            f"micro-batches of {mbs}) but global_batch is {job.global_batch}"
        )


def _check_bundles(job: JobPlan, d: int, lay: Layout, cluster: Cluster) -> None:
    """With TP bundles of ``t > 1``: the domain's GPUs split into bundles of ``t`` GPUs of one
    node each, and its layout is planned over bundles of ``t``."""
    t = job.tensor_model_parallel_size
    at = f"domain {d}"
    ranks = job.domains[d].ranks
    if lay.tensor_model_parallel_size != t:
        _fail(
            f"{at}: its layout is planned for TP bundles of {lay.tensor_model_parallel_size} GPUs, "
            f"the job's tensor_model_parallel_size is {t}; re-plan the job"
        )
    if len(ranks) % t:
        _fail(
            f"{at}: {len(ranks)} GPUs do not split into TP bundles of {t} (bundle j is "
            f"ranks[j*{t}:(j+1)*{t}])"
        )
    for j, bundle in enumerate(job.bundles(d)):
        nodes = sorted({cluster.devices[r].node for r in bundle})
        if len(nodes) > 1:
            _fail(
                f"{at}: bundle {j} (cluster ranks {list(bundle)}) spans nodes {', '.join(nodes)}; "
                f"a TP bundle is {t} GPUs of one node"
            )


def _check_schema(data: Any, source: str) -> None:
    """Structural check with the packaged JSON Schema; one-line message naming the path."""
    if not isinstance(data, dict):
        raise HexiSeqError(f"{source}: expected a JSON object at the top level")
    if data.get("format") != FORMAT:
        hint = (
            "; a layout file goes to --hexiseq-layout"
            if data.get("format") == "megatron-hexiseq/layout"
            else ""
        )
        raise HexiSeqError(
            f"{source}: 'format' must be {FORMAT!r}, got {short(data.get('format'))}; is this a job file?{hint}"
        )
    if data.get("version") != VERSION:
        raise HexiSeqError(
            f"{source}: job version {short(data.get('version'))} is not supported (this release reads version {VERSION})"
        )
    err = schema_error(data, "job.schema.json")
    if err is not None:
        where = "/".join(str(p) for p in err.absolute_path) or "(top level)"
        if err.validator in ("maximum", "minimum", "type", "required", "additionalProperties"):
            raise HexiSeqError(f"{source}: at {where}: {_short_message(err)}")
        raise HexiSeqError(f"{source}: at {where}: {short(err.message)}")
    # NaN and infinity in the job's own records (an alternative's domains hold layouts: checked
    # when read)
    check_finite(
        data,
        source,
        ("predicted", "alternatives", "planner", "meta", "options"),
        "a job file",
        skip=("domains",),
    )


def _short_message(err: Any) -> str:
    """jsonschema's message quotes the whole offending value: keep it short."""
    if err.validator == "required":
        return short(err.message)
    if err.validator == "additionalProperties":
        return "unknown key(s): " + ", ".join(
            short(k) for k in err.instance if k not in err.schema.get("properties", {})
        )
    if err.validator == "type":
        return f"must be {err.validator_value}, got {short(err.instance)}"
    word = "at most" if err.validator == "maximum" else "at least"
    return f"must be {word} {err.validator_value}, got {short(err.instance)}"


def load_layout_or_job(path: str | os.PathLike) -> Layout | JobPlan:
    """A layout file or a job file, told apart by its ``format`` (the commands that take either:
    ``show``, ``validate``, ``simulate``); each validated as its own loader does."""
    data = read_json(path, "layout or job file")
    if isinstance(data, Mapping) and data.get("format") == FORMAT:
        return JobPlan.from_dict(data, source=f"job {path}")
    return Layout.from_dict(data, source=f"layout {path}")
