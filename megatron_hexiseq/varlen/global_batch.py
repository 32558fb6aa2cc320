"""Global-batch scheduling: a step's documents assigned to (domain, micro-batch) bins by cost.

A step's global batch is a list of **units**: the documents of the loader's samples (a document
cut at a sample boundary is two units), in loader order, each at most a sample long. Each domain
(``varlen.domains.Domain``) runs ``micro_batches`` micro-batches per step, each planned inside the
domain by its own ``BatchPlanner`` (or, for the stock baselines, split THD zig-zag over a CP ring).
``schedule_global`` decides which units go to which bin; then each bin is one micro-batch:

- **Costs are integers** (``DomainCosts``, attoseconds): per domain the seconds per token (linear
  work and head all-to-all of the whole domain, perfectly divided), per document-masked pair
  (attention; a unit of ``l`` tokens has ``l (l + 1) / 2``), per micro-batch (fixed costs) and
  per step (a measured step overhead: the optimizer step, paid once however many micro-batches),
  rounded once from the cost model's rates (``domain_costs``) with IEEE basic operations only
  (``math.fsum``, division, multiplication: correctly rounded, the same on every CPU), then scaled
  by the domain's measured planning efficiency (an integer in 1/1024, fixed when the domain is
  planned). Every decision below compares integers, so every rank that schedules the same units
  with the same tables gets the same bins, whatever its CPU's ``log``/``exp`` or SIMD width.
- **Units, longest first** (ties: loader order), each to the domain where the step's finish time
  (its fixed costs plus the costs of its units so far) grows least, among the domains with a bin
  that has room for it (``DomainCosts.capacity`` tokens: memory): the earliest-finish-time rule for
  unrelated machines, so faster domains take more work (speed-aware) and a long document's
  quadratic attention is priced where it goes (document-aware). Inside the domain, the bin with
  the least cost (then the fewest tokens) that has room. Domains with equal tables sit in one
  min-heap of their loads, so a step costs O(units x kinds of domain x log domains).
- **Small bins**: a bin with fewer tokens than its domain has ranks takes the smallest units of its
  domain's fullest bin (every rank needs a token).
- **Exchanges**: a domain full in memory may still have time; it takes a long unit of a bin
  that paces the step for its own shortest units, while that lowers the step
  (``_swap_long_units``).
- **Lockstep** (Megatron-FSDP: micro-batch ``k`` of every domain runs together, so the step is
  the sum over slots of the costliest bin): each domain's own units re-packed against the slots'
  levels, kept only where no level rises (``_level_domains``).
- Each bin's units keep loader order: that is the micro-batch's packing order; a domain's bins
  come costliest first (Megatron-FSDP's domains run micro-batch ``k`` in lockstep).

``GlobalSchedule.digest`` is what every rank compares once per step (``megatron.agreement``).
docs/varlen.md, "Global-batch scheduling".
"""

from __future__ import annotations

import bisect
import heapq
import math
from collections.abc import Sequence
from typing import NamedTuple

from megatron_hexiseq.errors import HexiSeqError
from megatron_hexiseq.varlen.batch import BatchPlanner
from megatron_hexiseq.varlen.digest import digest_ints

ATTO = 10**18  # cost units per second
OPEN_SCAN = 8  # open domains of one kind a unit is priced on, least loaded first (below)
LEVEL_ROUNDS = 3  # lockstep re-packing rounds (``_level_domains``)
SWAP_ROUNDS = 32  # exchanges of a long unit for short ones per step at most (``_swap_long_units``)
SWAP_UNITS = 8  # the longest units of a pacing micro-batch offered in an exchange
SWAP_DOMAINS = 8  # the least-loaded other domains each of them is offered to
# an exchange must lower the step by the tables by 1/SWAP_GAIN of it at least: a table prices a
# micro-batch it has not seen planned to a few per cent, and on case 8 of the suite (512 A100 /
# A800 / L40S, llama3-8b 32K) an exchange that gained 1 ms of 5.3 s by the tables cost 354 ms
# once its micro-batches were planned and priced; with the bar that step is left alone
SWAP_GAIN = 256


class LongUnit(NamedTuple):
    """A point of ``DomainCosts.long_unit``: a micro-batch whose longest unit has ``tokens``
    tokens runs ``extra_as`` attoseconds longer than its divided work (that document's K/V
    exchange across the domain's groups, or its group's share, sets the pace; ``GlobalPlanner``
    prices it on the domain)."""

    tokens: int
    extra_as: int


class DomainCosts(NamedTuple):
    """One domain's integer cost table: attoseconds per token, per document-masked pair and per
    micro-batch, the most tokens one micro-batch may hold, and attoseconds once per step (the
    devices' measured step overhead: optimizer step and framework, paid once whatever the
    micro-batch count); ``floor_as``: the least any micro-batch lasts beyond ``batch_as`` (e.g.
    Megatron-FSDP's gathers, which a short micro-batch cannot hide); ``long_unit``: what a long
    unit adds to its micro-batch (``long_unit_as``); ``fill``: the most tokens a micro-batch that
    holds several units may reach (``room``; None: ``capacity``); ``unit_as``: what each unit
    adds, whatever its length (its kernel calls and windows)."""

    token_as: int
    pair_as: int
    batch_as: int
    capacity: int
    step_as: int = 0
    floor_as: int = 0
    long_unit: tuple[LongUnit, ...] = ()
    fill: int | None = None
    unit_as: int = 0

    @property
    def fill_tokens(self) -> int:
        return self.capacity if self.fill is None else self.fill

    def room(self, tokens: int, holds_units: bool) -> int:
        """Tokens a micro-batch of ``tokens`` may still take: up to ``capacity`` for its first
        unit, up to ``fill`` (default ``capacity``) once it holds units."""
        return (self.fill_tokens if holds_units else self.capacity) - tokens

    def cost_as(self, tokens: int, pairs: int) -> int:
        return self.token_as * tokens + self.pair_as * pairs

    def unit_work_as(self, length: int) -> int:
        """What a unit of ``length`` tokens adds to its micro-batch's divided work: its tokens,
        its document-masked pairs and ``unit_as``."""
        return self.cost_as(length, length * (length + 1) // 2) + self.unit_as

    def long_unit_as(self, length: int) -> int:
        """What a micro-batch whose longest unit has ``length`` tokens runs beyond its divided
        work: ``long_unit`` (points of increasing length) interpolated linearly (from 0 at 0
        tokens; the last segment's slope beyond the last point), integers only."""
        pts = self.long_unit
        if not pts:
            return 0
        if length <= pts[0].tokens or len(pts) == 1:
            return pts[0].extra_as * length // pts[0].tokens
        i = bisect.bisect_right([p.tokens for p in pts], length) - 1
        a, b = (pts[i], pts[i + 1]) if i + 1 < len(pts) else (pts[i - 1], pts[i])
        return a.extra_as + (b.extra_as - a.extra_as) * (length - a.tokens) // (b.tokens - a.tokens)

    def bin_as(self, lengths: Sequence[int]) -> int:
        """A micro-batch of units ``lengths`` by the table: its fixed costs plus the larger of
        ``floor_as`` and its divided work with ``unit_as`` per unit and what its longest unit
        adds."""
        work = self.cost_as(sum(lengths), sum(x * (x + 1) // 2 for x in lengths))
        work += self.unit_as * len(lengths)
        return self.batch_as + self.level_as(work, max(lengths, default=0))

    def level_as(self, work: int, longest: int) -> int:
        """A micro-batch's cost beyond its fixed costs: the larger of ``floor_as`` and its divided
        ``work`` plus what its longest unit (``longest`` tokens) adds."""
        return max(self.floor_as, work + self.long_unit_as(longest))


class GlobalSchedule(NamedTuple):
    """``bins[d][k]``: the unit indices (loader order) of domain ``d``'s micro-batch ``k``;
    ``predicted_as[d]``: domain ``d``'s step by the integer tables (attoseconds)."""

    bins: tuple[tuple[tuple[int, ...], ...], ...]
    predicted_as: tuple[int, ...]

    def digest(self) -> int:
        """63-bit digest of the bins (every rank of the run must hold the same)."""

        def stream():
            for d in self.bins:
                yield -2
                for b in d:
                    yield -1
                    yield from b

        return digest_ints(stream())

    def tokens(self, lengths: Sequence[int]) -> list[list[int]]:
        """Tokens of every bin."""
        return [[sum(lengths[u] for u in b) for b in d] for d in self.bins]


def as_of(seconds: float) -> int:
    """Seconds in attoseconds, rounded once."""
    return int(round(seconds * ATTO))


def domain_costs(
    planner: BatchPlanner, *, even: bool = False, efficiency_1024: int = 1024
) -> DomainCosts:
    """The integer table of a domain from its planner's rates (``BatchPlanner``: per group the
    linear seconds per token ``1 / c_g``, attention seconds per pair ``alpha_g``, all-to-all per
    group token, fixed costs, token capacity).

    Default (a HexiSeq domain: tokens by speed, documents placed per group): the targets of
    ``BatchPlanner`` per token and per pair, ``1 / sum c_g`` and ``1 / sum 1 / alpha_g``, the
    all-to-all at the linear split; capacity where the tightest group is full at that split, and a
    micro-batch of several units filled to 15/16 of it when the domain has several groups (whole
    short documents do not split at exactly that point: 13 documents of 54,070 tokens did not plan
    on 8 L40S with a capacity of 54,071 once micro-batches below their floor were filled; one
    document splits at will); a one-group domain holds every unit in its one group, up to its
    capacity.
    ``even`` (a THD zig-zag ring: every document in equal chunks): the slowest member paces,
    ``n x max 1 / c_g`` per token over n ranks, likewise pairs; capacity ``n x min cap_g``.
    ``efficiency_1024``: the per-token and per-pair costs are scaled by it / 1024 (integers: the
    domain's planned micro-batches over its divided work, ``Domain.efficiency_1024``)."""
    c = [1.0 / float(x) for x in planner.linear_per_token]
    inv_alpha = [1.0 / float(a) for a in planner.alpha]
    n = len(c)
    caps = [float(x) for x in planner.cap]
    fixed_s = max(float(f) for f in planner.fixed)
    if even:
        token_s = max(1.0 / x for x in c) / n + max(float(a) for a in planner.a2a) / n
        pair_s = max(float(a) for a in planner.alpha) / n
        capacity = n * int(min(caps))
        fill = capacity  # every document splits evenly over the ring
    else:
        C, A = math.fsum(c), math.fsum(inv_alpha)
        a2a = math.fsum(ci / C * float(planner.a2a[g]) * inv_alpha[g] for g, ci in enumerate(c))
        token_s = 1.0 / C + a2a / A
        pair_s = 1.0 / A
        capacity = min(int(caps[g] * C / c[g]) for g in range(n))
        fill = capacity - capacity // 16 if n > 1 else capacity  # one group holds every unit
    scale = int(efficiency_1024)
    return DomainCosts(
        as_of(token_s) * scale // 1024,
        as_of(pair_s) * scale // 1024,
        as_of(fixed_s),
        capacity,
        as_of(float(max(planner.overhead))),
        fill=fill,
    )


def schedule_global(
    lengths: Sequence[int],
    costs: Sequence[DomainCosts],
    micro_batches: Sequence[int],
    min_tokens: Sequence[int] | None = None,
    *,
    lockstep: bool = False,
) -> GlobalSchedule:
    """The bins of one step (module docstring). ``lengths``: the units in loader order;
    ``costs[d]`` and ``micro_batches[d]``: domain ``d``'s table and micro-batch count;
    ``min_tokens[d]``: tokens each of its micro-batches needs (its ranks; default 1);
    ``lockstep``: the domains run micro-batch ``k`` together (Megatron-FSDP), so each domain's
    units are then re-packed against the slots' levels (``_level_domains``)."""
    D = len(costs)
    if D == 0 or len(micro_batches) != D:
        raise HexiSeqError("a global schedule needs at least one domain and a count for each")
    if any(int(m) < 1 for m in micro_batches):
        raise HexiSeqError("every domain needs at least one micro-batch per step")
    lengths = [int(x) for x in lengths]
    if not lengths or min(lengths) < 1:
        raise HexiSeqError("the global batch needs documents of at least one token each")
    floor_tokens = [1] * D if min_tokens is None else [max(1, int(x)) for x in min_tokens]
    # domain state: step load (fixed costs + each bin's cost), bins
    load = [int(m) * (c.batch_as + c.floor_as) + c.step_as for m, c in zip(micro_batches, costs)]
    bins = [[_Bin(c.floor_as) for _ in range(int(m))] for m, c in zip(micro_batches, costs)]
    members: dict[tuple, list[int]] = {}
    for d, c in enumerate(costs):
        members.setdefault((c, int(micro_batches[d])), []).append(d)
    kinds = [_Kind(key[0], ds, load, min(lengths)) for key, ds in members.items()]
    biggest = max(c.capacity for c in costs)
    for u in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        l_u = lengths[u]
        if l_u > biggest:
            raise HexiSeqError(
                f"a document of {l_u:,} tokens fits no domain's micro-batch (the largest holds "
                f"{biggest:,} tokens in memory); use larger domains, a memory mode with less per "
                "GPU, or shorter samples"
            )
        work = [kind.cost.unit_work_as(l_u) for kind in kinds]
        long = [kind.cost.long_unit_as(l_u) for kind in kinds]
        best: _Choice | None = None
        for _, i in sorted([(kind.least_load(), i) for i, kind in enumerate(kinds)]):
            best = kinds[i].choose(i, l_u, work[i], long[i], load, bins, best)
        if best is None:
            raise HexiSeqError(
                f"the global batch does not fit the domains' memory (no micro-batch has room for a "
                f"document of {l_u:,} tokens); run more micro-batches per step or larger domains"
            )
        bins[best.domain][best.bin].add(u, l_u, work[best.kind], long[best.kind])
        moved = best.finish != load[best.domain]
        load[best.domain] = best.finish
        kinds[best.kind].update(best.domain, load, bins, moved)
    _fill_small_bins(bins, lengths, floor_tokens)
    level = lockstep and max(int(m) for m in micro_batches) > 1
    if level:
        bins = _level_domains(bins, costs, lengths, floor_tokens)
    # the exchanges after the re-packing, then it again: neither raises the step by the tables,
    # so the step is never above the re-packing's alone (before it, on case 3 of the suite, the
    # re-packing then found less to level: 1 step in 4 by the tables ended higher)
    if D > 1 and _swap_long_units(bins, costs, lengths, floor_tokens, lockstep) and level:
        bins = _level_domains(bins, costs, lengths, floor_tokens)
    cost = [[_bin_cost(c, b, lengths) for b in bins[d]] for d, c in enumerate(costs)]
    # each domain's micro-batches costliest first (ties: as filled): under Megatron-FSDP the
    # domains run micro-batch k in lockstep, and aligning every domain's k-th costliest
    # minimises the sum over k of the slowest (``global_schemes.lockstep_s``); elsewhere the
    # order of a domain's micro-batches changes nothing
    order = [sorted(range(len(c)), key=lambda k: (-c[k], k)) for c in cost]
    return GlobalSchedule(
        bins=tuple(tuple(tuple(sorted(bins[d][k].units)) for k in order[d]) for d in range(D)),
        predicted_as=tuple(
            int(m) * c.batch_as + c.step_as + sum(cost[d])
            for d, (m, c) in enumerate(zip(micro_batches, costs))
        ),
    )


class _Bin:
    """A micro-batch being filled: its divided work, what its longest unit adds, its tokens and
    units (attoseconds, integers); ``floor``: the domain's ``floor_as``. It costs
    ``max(floor, work + long)`` (``_cheapest_bin``)."""

    __slots__ = ("work", "long", "floor", "tokens", "units")

    def __init__(self, floor: int) -> None:
        self.work, self.long, self.floor, self.tokens = 0, 0, floor, 0
        self.units: list[int] = []

    def add(self, u: int, length: int, work: int, long: int) -> None:
        self.work += work
        self.long = max(self.long, long)
        self.tokens += length
        self.units.append(u)


class _Kind:
    """Domains with one table and micro-batch count, in min-heaps of (load, domain):

    - ``plain``: every bin holds a unit and costs more than the floor (or is too full for the
      shortest unit), so a unit makes any bin of the domain that can take it grow by its work
      (units come longest first: a bin's longest unit is its first); the least-loaded one with
      room is the kind's best of them;
    - ``open``: the others (an empty bin, or one below the floor: a unit may cost less there);
    - ``aside``: by -room, the domains whose emptiest bin had no room for a unit; they come back
      once the units are short enough.

    An entry is stale when the domain's load or heap is no longer the one it records."""

    def __init__(
        self, cost: DomainCosts, domains: Sequence[int], load: Sequence[int], shortest: int
    ) -> None:
        self.cost, self.shortest = cost, shortest
        self.plain: list[tuple[int, int]] = []
        self.open = [(load[d], d) for d in domains]
        heapq.heapify(self.open)
        self.aside: list[tuple[int, int]] = []
        self.where = {d: "open" for d in domains}

    def update(
        self, d: int, load: Sequence[int], bins: Sequence[list[_Bin]], moved: bool = True
    ) -> None:
        """Domain ``d`` took a unit (its load ``moved`` or not) or came back from ``aside``: an
        entry at its load in the heap its bins now put it in, unless its entry is still valid
        (one valid entry per domain)."""
        shut = self.cost.fill_tokens - self.shortest  # a bin past this takes no more units
        plain = all(b.units and (b.work + b.long >= b.floor or b.tokens > shut) for b in bins[d])
        where = "plain" if plain else "open"
        if moved or where != self.where[d]:
            self.where[d] = where
            heapq.heappush(self.plain if where == "plain" else self.open, (load[d], d))

    def least_load(self) -> tuple[int, int]:
        """A lower bound of the kind's loads (a stale entry's load is an older, smaller one)
        with its domain: the kind that likely ends the unit earliest is asked first, so the
        others stop sooner."""
        tops = [h[0] for h in (self.plain, self.open) if h]
        return min(tops) if tops else (2**127, 0)

    def choose(
        self,
        index: int,
        length: int,
        work: int,
        long: int,
        load: Sequence[int],
        bins: Sequence[list[_Bin]],
        best: _Choice | None,
    ) -> _Choice | None:
        """``best``, or where in this kind (its ``index``) a unit of ``length`` tokens, ``work``
        and long-unit cost ``long`` ends earlier (finish, then the lower domain): the first
        ``plain`` domain with room, and ``open`` ones by least load (ties: the lower index) while
        (load, index) is at most the best (finish, domain): a unit never ends a domain's step
        before its load, so no later one can win."""
        while self.aside and -self.aside[0][0] >= length:
            d = heapq.heappop(self.aside)[1]
            self.update(d, load, bins)
        cap, fill = self.cost.capacity, self.cost.fill_tokens  # ``DomainCosts.room``, inlined
        for name, heap in (("plain", self.plain), ("open", self.open)):
            scanned = []
            while heap:
                key, d = heap[0]
                if key != load[d] or self.where[d] != name:
                    heapq.heappop(heap)
                    continue
                if best is not None and key >= best.finish:
                    break
                heapq.heappop(heap)
                grows = _cheapest_bin(bins[d], cap, fill, length, work, long)
                if grows is None:  # no bin has room: aside until the units fit its emptiest
                    room = max((fill if b.units else cap) - b.tokens for b in bins[d])
                    self.where[d] = "aside"
                    heapq.heappush(self.aside, (-room, d))
                    continue
                scanned.append((key, d))
                extra, k = grows
                if best is None or (key + extra, d) < best[:2]:
                    best = _Choice(key + extra, d, k, index)
                if name == "plain" or len(scanned) >= OPEN_SCAN:
                    break
            for x in scanned:
                heapq.heappush(heap, x)
        return best


class _Choice(NamedTuple):
    """Where a unit goes: the step load of ``domain`` after it (``finish``), its bin, its kind."""

    finish: int
    domain: int
    bin: int
    kind: int


def _bin_cost(costs: DomainCosts, b: _Bin, lengths: Sequence[int]) -> int:
    """A filled bin's cost by the table (after small bins took units: recomputed)."""
    return costs.bin_as([lengths[u] for u in b.units]) - costs.batch_as


def _cheapest_bin(
    bins: list[_Bin], cap: int, fill: int, length: int, work: int, long: int
) -> tuple[int, int] | None:
    """(how much it grows, index) of the bin of a domain that grows least with the unit (then
    the least cost, the fewest tokens, the lower index) among those with room (``cap``, ``fill``:
    the kind's ``DomainCosts.capacity`` and ``fill_tokens``); None when none has. A bin costs
    ``max(floor, work + long)``; with the unit, ``max(floor, work + unit's work + max(long, unit's
    long))``. Written out with local variables, ``DomainCosts.room`` too: this is the scheduler's
    inner loop. On the 16M-token step over 1,024 GPUs of ``bench/varlen_suite.py
    --schedule-time`` (2026-12-07, one thread): the bin's cost and growth as ``_Bin`` methods
    400-443 ms, written out 236-275 ms; then ``room`` as a method 174-186 ms, inlined 154-168 ms;
    then (13:45 UTC, interleaved runs on a slower machine) a domain's room computed by the caller
    only when this finds no bin with room, not for every domain scanned: 160-171 against 188-200
    ms."""
    best = None
    for k, b in enumerate(bins):
        if (fill if b.units else cap) - b.tokens < length:  # ``DomainCosts.room``, inlined
            continue
        now = b.work + b.long
        if now < b.floor:
            now = b.floor
        grown = b.work + work + (long if long > b.long else b.long)
        extra = (grown if grown > b.floor else b.floor) - now
        key = (extra, now, b.tokens, k)
        if best is None or key < best:
            best = key
    return None if best is None else (best[0], best[3])


def _fill_small_bins(bins: list[list[_Bin]], lengths: Sequence[int], need: Sequence[int]) -> None:
    """A bin of domain ``d`` with fewer than ``need[d]`` tokens (its ranks) takes the smallest unit
    of the fullest other bin of its domain that keeps its own need without it (ties: the lower
    bin), or, when no bin of its domain can give, of the fullest such bin of the other domains
    (ties: the lower domain, then bin); until it has enough or no bin can give (a long unit alone
    in each of its domain's bins can leave another bin empty)."""
    for d, own in enumerate(bins):
        for b in own:
            while b.tokens < need[d]:
                mine = [(x.tokens, d, k) for k, x in enumerate(own) if x is not b]
                others = [(x.tokens, e, k) for e, dom in enumerate(bins) if e != d
                          for k, x in enumerate(dom)]  # fmt: skip
                if not (
                    _give(b, mine, bins, lengths, need) or _give(b, others, bins, lengths, need)
                ):
                    break


def _give(
    b: _Bin,
    donors: list[tuple[int, int, int]],
    bins: list[list[_Bin]],
    lengths: Sequence[int],
    need: Sequence[int],
) -> bool:
    """Move the smallest unit of the fullest donor ``(tokens, domain, bin)`` that keeps its
    domain's need without it into ``b``; False when none can."""
    for _, e, k in sorted(donors, key=lambda x: (-x[0], x[1], x[2])):
        donor = bins[e][k]
        if len(donor.units) < 2:
            continue
        u = min(donor.units, key=lambda j: (lengths[j], j))
        if donor.tokens - lengths[u] >= need[e]:
            donor.units.remove(u)
            donor.tokens -= lengths[u]
            b.units.append(u)
            b.tokens += lengths[u]
            return True
    return False


def _refilled(cost: DomainCosts, units: Sequence[int], lengths: Sequence[int]) -> _Bin:
    """A bin of ``units`` with its sums by ``cost`` (recomputed from scratch)."""
    b = _Bin(cost.floor_as)
    for u in units:
        length = lengths[u]
        b.add(u, length, cost.unit_work_as(length), cost.long_unit_as(length))
    return b


class _Sorted:
    """A bin's units shortest first (ties: index) with running sums, so that an exchange
    (``_swap_long_units``) is priced without rebuilding the bin: ``tokens[i]`` and ``pairs[i]``
    of the first ``i`` units, the bin's divided work with ``unit_as`` per unit, and its level
    (``DomainCosts.level_as``: what ``DomainCosts.bin_as`` adds to the fixed costs)."""

    __slots__ = ("units", "tokens", "pairs", "work", "level")

    def __init__(self, units: Sequence[int], cost: DomainCosts, lengths: Sequence[int]) -> None:
        self.units = sorted(units, key=lambda j: (lengths[j], j))
        n = len(self.units)
        self.tokens, self.pairs = [0] * (n + 1), [0] * (n + 1)
        for i, u in enumerate(self.units):
            x = lengths[u]
            self.tokens[i + 1] = self.tokens[i] + x
            self.pairs[i + 1] = self.pairs[i] + x * (x + 1) // 2
        self.work = cost.cost_as(self.tokens[n], self.pairs[n]) + cost.unit_as * n
        self.level = cost.level_as(self.work, lengths[self.units[-1]] if n else 0)


class _Trade(NamedTuple):
    """An exchange priced (``_exchange``): how many of the receiver's shortest units go back, and
    the two bins' levels after it."""

    moved: int
    src_level: int
    dst_level: int


def _exchange(
    u: int,
    src: _Sorted,
    dst: _Sorted,
    src_cost: DomainCosts,
    dst_cost: DomainCosts,
    lengths: Sequence[int],
    need: tuple[int, int],
) -> _Trade | None:
    """Unit ``u`` of ``src`` into ``dst``, and the fewest shortest units of ``dst`` (each shorter
    than ``u``) into ``src`` that leave ``dst`` room for it (``DomainCosts.room``); None when
    ``src`` has no room for them or a bin would hold fewer tokens than its ``need``."""
    length = lengths[u]
    n = len(dst.units)
    over = dst.tokens[n] + length - dst_cost.fill_tokens  # tokens that must leave ``dst``
    e = 0 if over <= 0 else bisect.bisect_left(dst.tokens, over)
    if e > n:  # not even all out leaves room within ``fill``: ``u`` alone, up to capacity
        if length > dst_cost.capacity:
            return None
        e = n
    if e and lengths[dst.units[e - 1]] >= length:
        return None
    out_tokens, out_pairs = dst.tokens[e], dst.pairs[e]
    src_n = len(src.units) - 1 + e
    src_tokens = src.tokens[-1] - length + out_tokens
    if src_tokens > (src_cost.fill_tokens if src_n > 1 else src_cost.capacity):
        return None
    dst_tokens = dst.tokens[n] - out_tokens + length
    if src_tokens < need[0] or dst_tokens < need[1]:
        return None
    pairs = length * (length + 1) // 2
    src_work = src.work + src_cost.cost_as(out_tokens - length, out_pairs - pairs)
    src_work += src_cost.unit_as * (e - 1)
    rest = src.units[-1] if src.units[-1] != u else (src.units[-2] if len(src.units) > 1 else -1)
    src_longest = max(lengths[rest] if rest >= 0 else 0, lengths[dst.units[e - 1]] if e else 0)
    dst_work = dst.work + dst_cost.cost_as(length - out_tokens, pairs - out_pairs)
    dst_work += dst_cost.unit_as * (1 - e)
    dst_longest = max(length, lengths[dst.units[-1]] if e < n else 0)
    return _Trade(
        e, src_cost.level_as(src_work, src_longest), dst_cost.level_as(dst_work, dst_longest)
    )


class _Pace(NamedTuple):
    """The step by the tables before an exchange (``_swap_long_units``): every bin's level
    (``profiles[d][k]``), every domain's load (fixed costs plus its levels), the step (``now``),
    and what an exchange is measured against: the three slowest domains ``(load, -domain)``, or
    under lockstep per slot the three costliest ``(level, domain)`` of the ``k``-th costliest
    bins."""

    lockstep: bool
    profiles: list[list[int]]
    loads: list[int]
    now: int
    top: list  # list[tuple[int, int]], or per slot a list of them under lockstep

    @classmethod
    def of(cls, profiles: list[list[int]], fixed: Sequence[int], lockstep: bool) -> _Pace:
        loads = [f + sum(p) for f, p in zip(fixed, profiles)]
        if not lockstep:
            top = heapq.nlargest(3, ((x, -d) for d, x in enumerate(loads)))
            return cls(False, profiles, loads, top[0][0], top)
        ranked = [sorted(p, reverse=True) for p in profiles]
        tops = [heapq.nlargest(3, ((r[k], d) for d, r in enumerate(ranked) if k < len(r)))
                for k in range(max(len(r) for r in ranked))]  # fmt: skip
        return cls(True, profiles, loads, sum(t[0][0] for t in tops), tops)

    def sources(self) -> list[tuple[int, int]]:
        """The bins that pace the step: the slowest domain's, or each slot's costliest."""
        if not self.lockstep:
            d = -self.top[0][1]
            return [(d, k) for k in range(len(self.profiles[d]))]
        out = []
        for k, t in enumerate(self.top):  # slot k's costliest: domain d's k-th costliest bin
            d = t[0][1]
            levels = self.profiles[d]
            out.append((d, sorted(range(len(levels)), key=lambda j: (-levels[j], j))[k]))
        return out

    def step_with(self, p: int, kp: int, vp: int, q: int, kq: int, vq: int) -> int:
        """The step with bin ``kp`` of domain ``p`` at level ``vp`` and ``kq`` of ``q`` at ``vq``."""
        pp, pq = self.profiles[p], self.profiles[q]
        if not self.lockstep:
            rest = next((x for x, nd in self.top if -nd not in (p, q)), 0)
            return max(rest, self.loads[p] - pp[kp] + vp, self.loads[q] - pq[kq] + vq)
        new_p = sorted(pp[:kp] + [vp] + pp[kp + 1 :], reverse=True)
        new_q = sorted(pq[:kq] + [vq] + pq[kq + 1 :], reverse=True)
        total = 0
        for k, t in enumerate(self.top):
            level = next((x for x, d in t if d not in (p, q)), 0)
            if k < len(new_p):
                level = max(level, new_p[k])
            if k < len(new_q):
                level = max(level, new_q[k])
            total += level
        return total


class _Swap(NamedTuple):
    """The best exchange of a round (``_swap_long_units``): the step after it, unit ``unit`` of
    bin ``src_bin`` of domain ``src`` for the ``moved`` shortest units of bin ``dst_bin`` of
    ``dst``."""

    step: int
    src: int
    src_bin: int
    dst: int
    dst_bin: int
    unit: int
    moved: int


def _swap_long_units(
    bins: list[list[_Bin]],
    costs: Sequence[DomainCosts],
    lengths: Sequence[int],
    need: Sequence[int],
    lockstep: bool,
) -> bool:
    """Units go longest first to the earliest finish, so a long document lands on a domain that
    is still empty, and the short ones that follow fill a domain **full in memory** before it is
    busy: case 7 of ``bench/varlen_suite.py`` (64 L40S and 192 A100, llama3-70b at 128K under
    Megatron-FSDP) put every document of 64K-128K tokens on the A100s, whose slots then ran 32.2
    and 29.7 s, while the L40S domain, holding the 565,584 tokens its memory allows per
    micro-batch, all short, ran 24.6 s in each. A long unit costs more per token (its pairs) in the
    same memory, so for up to ``SWAP_ROUNDS`` rounds: each bin that paces the step (the slowest
    domain's bins; under lockstep each slot's costliest) offers its ``SWAP_UNITS`` longest units
    to the cheaper bins of the ``SWAP_DOMAINS`` least-loaded other domains, each taking the unit
    for its own shortest units (``_exchange``); the exchange that lowers the step by the tables
    most, by ``1 / SWAP_GAIN`` of it at least, is made (ties: the first found), and the rounds
    stop when none does; True when one was made. Integers only, like the rest of the schedule; a
    trial costs the units it moves (``_Sorted``'s running sums) and the slots or the three
    slowest domains (``_Pace``), not a pass over every domain."""
    D = len(bins)
    fixed = [len(bins[d]) * c.batch_as + c.step_as for d, c in enumerate(costs)]
    profiles = [[_bin_cost(c, b, lengths) for b in bins[d]] for d, c in enumerate(costs)]
    view: dict[tuple[int, int], _Sorted] = {}  # built when a bin is first offered or offers
    changed = False

    def sorted_bin(d: int, k: int) -> _Sorted:
        if (d, k) not in view:
            view[d, k] = _Sorted(bins[d][k].units, costs[d], lengths)
        return view[d, k]

    for _ in range(SWAP_ROUNDS):
        pace = _Pace.of(profiles, fixed, lockstep)
        bar = pace.now - pace.now // SWAP_GAIN
        best: _Swap | None = None
        by_load = sorted(range(D), key=lambda d: (pace.loads[d], d))
        for p, kp in pace.sources():
            src = sorted_bin(p, kp)
            others = [d for d in by_load if d != p][:SWAP_DOMAINS]
            for u in src.units[::-1][:SWAP_UNITS]:
                for q in others:
                    for kq in range(len(bins[q])):
                        if profiles[q][kq] >= profiles[p][kp]:
                            continue
                        dst = sorted_bin(q, kq)
                        got = _exchange(
                            u, src, dst, costs[p], costs[q], lengths, (need[p], need[q])
                        )
                        if got is None:
                            continue
                        step = pace.step_with(p, kp, got.src_level, q, kq, got.dst_level)
                        if step < bar and (best is None or step < best.step):
                            best = _Swap(step, p, kp, q, kq, u, got.moved)
        if best is None:
            break
        changed = True
        p, kp, q, kq, u, e = best[1:]
        src, dst = view[p, kp], view[q, kq]
        view[p, kp] = _Sorted([j for j in src.units if j != u] + dst.units[:e], costs[p], lengths)
        view[q, kq] = _Sorted(dst.units[e:] + [u], costs[q], lengths)
        for d, k in ((p, kp), (q, kq)):
            bins[d][k] = _refilled(costs[d], view[d, k].units, lengths)
            profiles[d][k] = view[d, k].level
    return changed


def _levels(profiles: Sequence[Sequence[int]]) -> list[int]:
    """Slot ``k``'s level: the largest ``k``-th costliest bin cost over the domains (each
    domain's bin costs, costliest first, in ``profiles``): what slot ``k`` lasts in lockstep,
    beyond the fixed costs."""
    levels: list[int] = []
    for profile in profiles:
        for k, x in enumerate(profile):
            if k == len(levels):
                levels.append(x)
            elif x > levels[k]:
                levels[k] = x
    return levels


def _level_domains(
    bins: list[list[_Bin]],
    costs: Sequence[DomainCosts],
    lengths: Sequence[int],
    need: Sequence[int],
) -> list[list[_Bin]]:
    """Under lockstep the step is the sum over slots of the slowest bin, not the slowest domain:
    a domain whose total is balanced may still hold a second-costliest bin that sets slot 1's
    level while its costliest sits well below slot 0's (set elsewhere, e.g. by the step's longest
    document). So, for ``LEVEL_ROUNDS`` rounds: the slots' levels (``_levels``), then each domain's
    units re-packed longest first into its bins against them: each unit to the first bin (the
    costliest slot first) that stays within its slot's level and has room, else to the bin it
    overflows least; kept only when no bin of the re-packing passes its slot's level and every
    bin has its ``need`` (so no level rises: the step by the tables never grows). Case 8 of
    ``bench/varlen_suite.py`` (512 A100 / A800 / L40S, llama3-8b, 32K, Megatron-FSDP): slot 0 at
    3.56 s (a 32K document), slot 1 at 2.80 s while the mean domain ran 5.16 s in all.

    A re-packed bin's cost is ``max(floor, work + long)`` from its own sums (exact: the table's
    work is linear in tokens and pairs, and what a long unit adds grows with its length); a
    domain whose levels did not move since its last re-packing is not re-packed again (the same
    units against the same levels give the same bins); each domain's units are sorted once. The
    1,024-GPU schedule of ``--schedule-time`` (128 domains, 2 micro-batches each; median of 15
    interleaved runs, one thread): 153 ms without the re-packing, 177 ms with ``_bin_cost`` for
    every bin in every round and a sort per re-packing, 170 ms so (the same bins)."""
    profiles = [sorted((_bin_cost(c, b, lengths) for b in bins[d]), reverse=True)
                for d, c in enumerate(costs)]  # fmt: skip
    tried: dict[int, list[int]] = {}  # the levels each domain was last re-packed against
    order: dict[int, list[int]] = {}
    for _ in range(LEVEL_ROUNDS):
        levels = _levels(profiles)
        changed = False
        for d, c in enumerate(costs):
            m = len(bins[d])
            if m < 2 or tried.get(d) == levels[:m]:
                continue
            tried[d] = levels[:m]
            if d not in order:  # a domain's units stay its own: sorted once, longest first
                order[d] = sorted(
                    (u for b in bins[d] for u in b.units), key=lambda j: (-lengths[j], j)
                )
            got = _repack(order[d], c, lengths, levels[:m])
            if got is None or any(b.tokens < need[d] for b in got):
                continue
            new = sorted((max(b.floor, b.work + b.long) for b in got), reverse=True)
            if new != profiles[d] and all(x <= y for x, y in zip(new, levels)):
                bins[d], profiles[d] = got, new
                changed = True
        if not changed:
            break
    return bins


def _repack(
    units: list[int], cost: DomainCosts, lengths: Sequence[int], levels: Sequence[int]
) -> list[_Bin] | None:
    """``units`` (one domain's, longest first) into ``len(levels)`` bins in that order: each to
    the first bin whose cost stays within its level and that has room (``DomainCosts.room``,
    inlined), else to the bin with room that passes its level least; None when a unit finds no
    room."""
    out = [_Bin(cost.floor_as) for _ in levels]
    cap, fill = cost.capacity, cost.fill_tokens
    for u in units:
        length = lengths[u]
        work = cost.unit_work_as(length)
        long = cost.long_unit_as(length)
        pick, over = -1, None
        for k, b in enumerate(out):
            if (fill if b.units else cap) - b.tokens < length:
                continue
            grown = b.work + work + max(long, b.long)
            excess = max(grown, b.floor) - levels[k]
            if excess <= 0:
                pick = k
                break
            if over is None or excess < over:
                pick, over = k, excess
        if pick < 0:
            return None
        out[pick].add(u, length, work, long)
    return out
