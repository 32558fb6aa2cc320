"""Candidate jobs: the alternatives a user has without HexiSeq's job planning, and the job search's
own families, each priced in the same model (docs/job.md, "Alternatives" and "The search").

Alternatives (:data:`ALTERNATIVES`):

- ``megatron-cp-dp``: stock Megatron. Every symmetric CP x HP size ``c`` dividing the world (ring,
  Ulysses or USP at every ``hp`` that divides ``c`` and the heads), ``W / c`` data-parallel
  replicas of ``c`` consecutive ranks (nodes ordered by GPU type, the strongest host order a user
  would launch), equal shares (Megatron needs ``W / c`` to divide the micro-batches), so the slowest
  replica sets the pace.
- ``fast-only``: the same on the fastest kind of node alone, the other GPUs idle.
- ``typed-dp``: each kind of node its own symmetric replicas (its own ``c`` and best ``hp``), uneven
  shares by the exact min-max (equal under ``fsdp``, as every job of several domains).
- ``hexiseq-one-domain``: today's ``plan`` over every GPU, every micro-batch on it.
- ``hexiseq-replicas``: ``D`` equal mixed replicas (the same nodes of every kind in each), each
  planned by ``plan``, for every ``D`` that divides every kind's node count.

The search's families (whole nodes; each domain planned by ``plan``, once per shape):

- ``typed``: each kind's nodes cut into ``q`` near-equal domains, every ``q`` (and every node cut
  into equal domains of a few GPUs), the kinds' cuts chosen together with the shares
  (``shares.best_combination``); also on the fastest kind alone;
- ``mixed``: ``D`` domains dealt round-robin over the nodes, kind after kind (domains of unequal
  composition, differing by at most one node of a kind), ``D`` = each kind's node count or 2;
- ``paired``: each node of a slower kind with ``j`` nodes of the fastest kind, the other nodes
  ``typed``.

Every candidate runs in one memory mode for all its domains (the job's); each is tried in every mode
of the problem (``run_config.modes_to_try``) and keeps its fastest, except modes whose ideal step
(``Evaluator.ideal_step_s``: all the work at the GPUs' summed rates) is no better than what is
already found (for an alternative: its own best; for a family: the best job so far).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from typing import NamedTuple

from megatron_hexiseq.job.evaluate import DomainEval, Evaluator, Priced
from megatron_hexiseq.job.shares import best_combination, best_equal_combination, equal_shares
from megatron_hexiseq.run_config import TrainOptions, mode_label

ALTERNATIVES = (
    "megatron-cp-dp",
    "fast-only",
    "typed-dp",
    "hexiseq-one-domain",
    "hexiseq-replicas",
)
Mode = tuple[str, bool]


class Found(NamedTuple):
    """A candidate family's best job (None: none feasible) and what it chose."""

    priced: Priced | None
    config: str
    reason: str = ""

    def better(self, other: Found) -> Found:
        if other.priced is None:
            return self
        if self.priced is None or other.priced.step_s < self.priced.step_s:
            return other
        return self


NONE = Found(None, "", "nothing fits")


def divisors(n: int) -> list[int]:
    return [c for c in range(1, n + 1) if n % c == 0]


def head_parallel_options(c: int, heads: int) -> list[int]:
    """hp of the symmetric layouts of ``c`` ranks: 1 (ring), every divisor of ``c`` and the heads."""
    return [1] + [hp for hp in range(2, c + 1) if c % hp == 0 and heads % hp == 0]


def _chunks(items: Sequence[int], size: int) -> list[tuple[int, ...]]:
    return [tuple(items[i : i + size]) for i in range(0, len(items), size)]


# ---- alternatives ------------------------------------------------------------------------------
def _limit(best: Found, beat: float) -> float:
    return min(beat, best.priced.step_s if best.priced is not None else math.inf)


def symmetric_dp(
    ev: Evaluator, ranks: Sequence[int], modes: Sequence[Mode], beat: float = math.inf
) -> Found:
    """Stock Megatron on ``ranks`` (in launch order): every ``c`` and ``hp``, equal shares.
    ``beat``: modes whose ideal step (``Evaluator.ideal_step_s``) is no better are skipped
    (every family takes it), and so is a size ``c`` whose slowest replica's ideal share of the
    step (its ideal step over the replicas) is no better than the best so far."""
    best = NONE
    heads = ev.model.num_attention_heads
    for mode in modes:
        opts = ev.options(ranks, *mode)
        if ev.ideal_step_s(ranks, opts) >= _limit(best, beat):
            continue
        for c in divisors(len(ranks)):
            reps = _chunks(ranks, c)
            shares = equal_shares(len(reps), ev.micro_batches)
            if shares is None:
                continue
            # the slowest replica's share of the work at its summed rates: no faster than that
            if max(ev.ideal_step_s(r, opts) for r in reps) / len(reps) >= _limit(best, beat):
                continue
            for hp in head_parallel_options(c, heads):
                evals = [ev.symmetric(r, opts, hp) for r in reps]
                p = ev.price(opts, reps, evals, shares)
                label = f"c={c} ({evals[0].label}) x dp={len(reps)}, {mode_label(opts)}"
                best = best.better(Found(p, label))
    if best.priced is None:
        return best._replace(
            reason=f"no symmetric c x dp fits {ev.micro_batches} micro-batches in equal shares"
        )
    return best


def typed_dp(ev: Evaluator, modes: Sequence[Mode], beat: float = math.inf) -> Found:
    """Each kind its own symmetric replicas (per kind: its ``c``, the best ``hp``), min-max."""
    every = ev.index.canonical_ranks()
    per_kind = [
        [r for r in every if ev.index.kind_of_rank(r) == k] for k in range(len(ev.index.kinds))
    ]
    best = NONE
    heads = ev.model.num_attention_heads
    for mode in modes:
        opts = ev.options(every, *mode)
        if ev.ideal_step_s(every, opts) >= _limit(best, beat):
            continue

        def replicas(
            ranks: list[int], c: int, opts: TrainOptions = opts
        ) -> tuple[list[tuple[int, ...]], list[DomainEval]]:
            reps = _chunks(ranks, c)
            options = [
                [ev.symmetric(r, opts, hp) for r in reps] for hp in head_parallel_options(c, heads)
            ]
            ok = [o for o in options if all(e.feasible for e in o)]
            top = min(ok, key=lambda o: max(e.micro_batch_s for e in o), default=options[0])
            return reps, top

        slots = [[replicas(ranks, c) for c in divisors(len(ranks))] for ranks in per_kind]
        p = _best_of_slots(ev, every, opts, slots)
        if p is not None:
            sizes = [
                f"{ev.index.kinds[ev.index.kind_of_rank(d[0])][0].name} c={len(d)} ({e.label})"
                for d, e in _distinct(p)
            ]
            best = best.better(Found(p, "; ".join(sizes) + f", {mode_label(opts)}"))
    return best


def hexiseq_one_domain(ev: Evaluator, modes: Sequence[Mode], beat: float = math.inf) -> Found:
    """``plan`` over every GPU, every micro-batch on it. With a finite ``beat`` a mode is also
    skipped when its micro-batches' lower bound (``Evaluator.iteration_bound_s``) reaches it."""
    every = ev.index.canonical_ranks()
    best = NONE
    for mode in modes:
        opts = ev.options(every, *mode)
        if ev.ideal_step_s(every, opts) >= _limit(best, beat):
            continue
        if beat < math.inf and ev.micro_batches * ev.iteration_bound_s(every, opts) >= beat:
            continue
        e = ev.hexiseq(every, opts)
        best = best.better(Found(ev.price(opts, [every], [e]), f"{e.label}, {mode_label(opts)}"))
        if best.priced is None and e.reason:
            best = best._replace(reason=e.reason)
    return best


def hexiseq_replicas(ev: Evaluator, modes: Sequence[Mode], beat: float = math.inf) -> Found:
    """``D`` equal mixed replicas for every ``D`` >= 2 that divides every kind's node count. With a
    finite ``beat`` a ``D`` is also skipped when ``ceil(M / D)`` micro-batches' lower bound on one
    replica (``Evaluator.iteration_bound_s``: the replicas are alike) reaches it."""
    counts = [len(n) for n in ev.index.nodes_of]
    g = math.gcd(*counts)
    every = ev.index.canonical_ranks()
    best = Found(None, "", f"no D >= 2 divides every kind's node count {counts}")
    for mode in modes:
        opts = ev.options(every, *mode)
        if ev.ideal_step_s(every, opts) >= _limit(best, beat):
            continue
        for D in divisors(g)[1:]:
            if D > ev.micro_batches:
                continue
            reps = [
                ev.index.domain_of_nodes(
                    name for nodes in ev.index.nodes_of for name in _part(nodes, D, i)
                )
                for i in range(D)
            ]
            most = -(-ev.micro_batches // D)
            if beat < math.inf and most * ev.iteration_bound_s(reps[0], opts) >= beat:
                continue
            evals = [ev.hexiseq(r, opts) for r in reps]
            p = ev.price(opts, reps, evals)
            best = best.better(Found(p, f"D={D} ({evals[0].label}), {mode_label(opts)}"))
    return best


def _part(nodes: Sequence[str], D: int, i: int) -> Sequence[str]:
    k = len(nodes) // D
    return nodes[i * k : (i + 1) * k]


# ---- the search's families --------------------------------------------------------------------
def typed(
    ev: Evaluator,
    modes: Sequence[Mode],
    beat: float = math.inf,
    kinds: Sequence[int] | None = None,
) -> Found:
    """Each kind's nodes cut into domains (``_cuts``), the cut of every kind chosen with the
    shares; ``kinds``: the kinds taking part (default all)."""
    kinds = list(range(len(ev.index.kinds))) if kinds is None else list(kinds)
    union = ev.index.order(
        r for k in kinds for n in ev.index.nodes_of[k] for r in ev.index.ranks[n]
    )
    best = NONE
    for mode in modes:
        opts = ev.options(union, *mode)
        if ev.ideal_step_s(union, opts) >= _limit(best, beat):
            continue
        slots = [_cuts(ev, ev.index.nodes_of[k], opts) for k in kinds]
        p = _best_of_slots(ev, union, opts, slots)
        if p is not None:
            best = best.better(Found(p, _describe(ev, p, opts)))
    return best


def _cuts(
    ev: Evaluator, nodes: Sequence[str], opts: TrainOptions
) -> list[tuple[list[tuple[int, ...]], list[DomainEval]]]:
    """The cuts of ``nodes`` (one kind) into domains: for every count ``q`` of domains the nodes
    as evenly as possible (sizes ``floor(N / q)`` and ``ceil(N / q)`` nodes: every ``k`` that
    divides the nodes, and for the other ``k`` the balanced cut with as many domains as ``k``
    nodes and a remainder would make), and every node cut into domains of ``c`` GPUs, for each
    ``c`` that divides every node's GPU count."""
    out = []
    counts = {len(ev.index.ranks[n]) for n in nodes}
    for c in divisors(math.gcd(*counts))[:-1] if counts else []:
        doms = [d for n in nodes for d in _chunks(ev.index.order(ev.index.ranks[n]), c)]
        if len(doms) <= ev.micro_batches:
            out.append((doms, [ev.hexiseq(d, opts) for d in doms]))
    for q in range(1, min(len(nodes), ev.micro_batches) + 1):
        doms = [ev.index.domain_of_nodes(part) for part in balanced(nodes, q)]
        out.append((doms, [ev.hexiseq(d, opts) for d in doms]))
    return out


def balanced(items: Sequence[str], q: int) -> list[Sequence[str]]:
    """``items`` in ``q`` consecutive parts of ``floor(N / q)`` or ``ceil(N / q)`` (larger first)."""
    size, extra = divmod(len(items), q)
    out, start = [], 0
    for i in range(q):
        stop = start + size + (1 if i < extra else 0)
        out.append(items[start:stop])
        start = stop
    return out


def mixed(
    ev: Evaluator, modes: Sequence[Mode], counts: Iterable[int], beat: float = math.inf
) -> Found:
    """``D`` domains dealt round-robin over the nodes (kind after kind), for each ``D``."""
    every = ev.index.canonical_ranks()
    order = [n for nodes in ev.index.nodes_of for n in nodes]
    best = NONE
    for mode in modes:
        opts = ev.options(every, *mode)
        if ev.ideal_step_s(every, opts) >= _limit(best, beat):
            continue
        for D in sorted(set(counts)):
            if not 2 <= D <= min(len(order), ev.micro_batches):
                continue
            doms = [ev.index.domain_of_nodes(order[i::D]) for i in range(D)]
            evals = [ev.hexiseq(d, opts) for d in doms]
            p = ev.price(opts, doms, evals)
            best = best.better(Found(p, f"mixed D={D}, " + _describe(ev, p, opts) if p else ""))
    return best


def paired(ev: Evaluator, modes: Sequence[Mode], beat: float = math.inf) -> Found:
    """Each node of a slower kind ``s`` with ``j`` nodes of the fastest kind; the rest typed."""
    nodes_of = ev.index.nodes_of
    every = ev.index.canonical_ranks()
    best = Found(None, "", "no slower kind has as few nodes as the fastest")
    if all(len(nodes_of[0]) < len(n) for n in nodes_of[1:]):
        return best
    for mode in modes:
        opts = ev.options(every, *mode)
        if ev.ideal_step_s(every, opts) >= _limit(best, beat):
            continue
        for s in range(1, len(nodes_of)):
            fast, slow = nodes_of[0], nodes_of[s]
            for j in range(1, len(fast) // len(slow) + 1):
                doms = [
                    ev.index.domain_of_nodes([slow[i], *fast[i * j : (i + 1) * j]])
                    for i in range(len(slow))
                ]
                pairs = (doms, [ev.hexiseq(d, opts) for d in doms])
                rest = [fast[len(slow) * j :]] + [
                    nodes_of[k] for k in range(1, len(nodes_of)) if k != s
                ]
                slots = [[pairs]] + [_cuts(ev, nodes, opts) for nodes in rest if nodes]
                p = _best_of_slots(ev, every, opts, slots)
                if p is not None:
                    best = best.better(Found(p, f"paired j={j}, " + _describe(ev, p, opts)))
                if ev.deadline.passed():
                    return best
    return best


# ---- helpers ----------------------------------------------------------------------------------
def _best_of_slots(
    ev: Evaluator,
    union: Sequence[int],
    opts: TrainOptions,
    slots: Sequence[Sequence[tuple[list[tuple[int, ...]], list[DomainEval]]]],
) -> Priced | None:
    """The best choice of one option per slot with its shares (``shares.best_combination``);
    options with an infeasible domain are left out."""
    kept = [[o for o in slot if all(e.feasible for e in o[1])] for slot in slots]
    if any(not slot for slot in kept):
        return None
    # the offsets (exposed gradient reduction) depend on the ranks, not on the cut
    times = [[ev.times([union], opts, evals) for _, evals in slot] for slot in kept]
    search = best_equal_combination if opts.memory_mode == "fsdp" else best_combination
    choice = search(times, ev.micro_batches)
    if choice is None:
        return None
    doms = [d for slot, o in zip(kept, choice.options) for d in slot[o][0]]
    evals = [e for slot, o in zip(kept, choice.options) for e in slot[o][1]]
    return ev.price(opts, doms, evals)


def _distinct(p: Priced) -> list[tuple[tuple[int, ...], DomainEval]]:
    seen: dict[tuple[int, str], tuple[tuple[int, ...], DomainEval]] = {}
    for d, e in zip(p.domains, p.evals):
        seen.setdefault((len(d), e.label), (d, e))
    return list(seen.values())


def _describe(ev: Evaluator, p: Priced | None, opts: TrainOptions) -> str:
    """``2 x 16 H100 + 3 x 8 A100, distributed_optimizer``: the domains by GPU count and types
    (GPUs, not TP bundles)."""
    if p is None:
        return ""
    count: dict[str, int] = {}
    for d in p.domains:
        names: dict[str, int] = {}
        for r in d:
            n = ev.cluster.devices[r].gpu.name.split("-")[0]
            names[n] = names.get(n, 0) + ev.tp
        key = "+".join(f"{v} {k}" for k, v in names.items())
        count[key] = count.get(key, 0) + 1
    return ", ".join(f"{v} x ({k})" for k, v in count.items()) + f", {mode_label(opts)}"


Family = Callable[[Evaluator, Sequence[Mode]], Found]
