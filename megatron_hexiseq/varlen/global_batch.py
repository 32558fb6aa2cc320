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
- Each bin's units keep loader order: that is the micro-batch's packing order.

``GlobalSchedule.digest`` is what every rank compares once per step (``megatron.agreement``).
docs/varlen.md, "Global-batch scheduling".
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Sequence
from typing import NamedTuple

from megatron_hexiseq.errors import HexiSeqError
from megatron_hexiseq.varlen.batch import BatchPlanner
from megatron_hexiseq.varlen.digest import digest_ints

ATTO = 10**18  # cost units per second


class DomainCosts(NamedTuple):
    """One domain's integer cost table: attoseconds per token, per document-masked pair and per
    micro-batch, the most tokens one micro-batch may hold, and attoseconds once per step (the
    devices' measured step overhead: optimizer step and framework, paid once whatever the
    micro-batch count)."""

    token_as: int
    pair_as: int
    batch_as: int
    capacity: int
    step_as: int = 0

    def cost_as(self, tokens: int, pairs: int) -> int:
        return self.token_as * tokens + self.pair_as * pairs


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


def _as(seconds: float) -> int:
    return int(round(seconds * ATTO))


def domain_costs(
    planner: BatchPlanner, *, even: bool = False, efficiency_1024: int = 1024
) -> DomainCosts:
    """The integer table of a domain from its planner's rates (``BatchPlanner``: per group the
    linear seconds per token ``1 / c_g``, attention seconds per pair ``alpha_g``, all-to-all per
    group token, fixed costs, token capacity).

    Default (a HexiSeq domain: tokens by speed, documents placed per group): the targets of
    ``BatchPlanner`` per token and per pair, ``1 / sum c_g`` and ``1 / sum 1 / alpha_g``, the
    all-to-all at the linear split; capacity where the tightest group is full at that split.
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
    else:
        C, A = math.fsum(c), math.fsum(inv_alpha)
        a2a = math.fsum(ci / C * float(planner.a2a[g]) * inv_alpha[g] for g, ci in enumerate(c))
        token_s = 1.0 / C + a2a / A
        pair_s = 1.0 / A
        capacity = min(int(caps[g] * C / c[g]) for g in range(n))
    scale = int(efficiency_1024)
    return DomainCosts(
        _as(token_s) * scale // 1024,
        _as(pair_s) * scale // 1024,
        _as(fixed_s),
        capacity,
        _as(float(max(planner.overhead))),
    )


def schedule_global(
    lengths: Sequence[int],
    costs: Sequence[DomainCosts],
    micro_batches: Sequence[int],
    min_tokens: Sequence[int] | None = None,
) -> GlobalSchedule:
    """The bins of one step (module docstring). ``lengths``: the units in loader order;
    ``costs[d]`` and ``micro_batches[d]``: domain ``d``'s table and micro-batch count;
    ``min_tokens[d]``: tokens each of its micro-batches needs (its ranks; default 1)."""
    D = len(costs)
    if D == 0 or len(micro_batches) != D:
        raise HexiSeqError("a global schedule needs at least one domain and a count for each")
    if any(int(m) < 1 for m in micro_batches):
        raise HexiSeqError("every domain needs at least one micro-batch per step")
    lengths = [int(x) for x in lengths]
    if not lengths or min(lengths) < 1:
        raise HexiSeqError("the global batch needs documents of at least one token each")
    floor = [1] * D if min_tokens is None else [max(1, int(x)) for x in min_tokens]
    # domain state: step load (fixed costs + units), bins [cost, tokens, units]
    load = [int(m) * c.batch_as + c.step_as for m, c in zip(micro_batches, costs)]
    bins: list[list[list]] = [[[0, 0, []] for _ in range(int(m))] for m in micro_batches]
    kinds: dict[tuple, list[tuple[int, int]]] = {}
    for d, c in enumerate(costs):
        kinds.setdefault((c, int(micro_batches[d])), []).append((load[d], d))
    heaps = [(key[0], h) for key, h in kinds.items()]
    for _, h in heaps:
        heapq.heapify(h)
    biggest = max(c.capacity for c in costs)
    for u in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        l_u = lengths[u]
        p_u = l_u * (l_u + 1) // 2
        if l_u > biggest:
            raise HexiSeqError(
                f"a document of {l_u:,} tokens fits no domain's micro-batch (the largest holds "
                f"{biggest:,} tokens in memory); use larger domains, a memory mode with less per "
                "GPU, or shorter samples"
            )
        best: tuple[int, int, int] | None = None  # (finish, domain, heap index)
        for i, (cost, h) in enumerate(heaps):
            top = _top_with_room(h, load, bins, cost.capacity, l_u)
            if top is None:
                continue
            finish = load[top] + cost.cost_as(l_u, p_u)
            if best is None or (finish, top) < best[:2]:
                best = (finish, top, i)
        if best is None:
            raise HexiSeqError(
                f"the global batch does not fit the domains' memory (no micro-batch has room for a "
                f"document of {l_u:,} tokens); run more micro-batches per step or larger domains"
            )
        finish, d, i = best
        cost, h = heaps[i]
        load[d] = finish
        heapq.heappush(h, (finish, d))  # the old entry of d is now stale (load differs)
        k = min(
            (k for k, b in enumerate(bins[d]) if b[1] + l_u <= cost.capacity),
            key=lambda k: (bins[d][k][0], bins[d][k][1], k),
        )
        b = bins[d][k]
        b[0] += cost.cost_as(l_u, p_u)
        b[1] += l_u
        b[2].append(u)
    for d in range(D):
        _fill_small_bins(bins[d], lengths, floor[d])
    return GlobalSchedule(
        bins=tuple(tuple(tuple(sorted(b[2])) for b in bins[d]) for d in range(D)),
        predicted_as=tuple(load),
    )


def _top_with_room(
    heap: list[tuple[int, int]],
    load: list[int],
    bins: list[list[list]],
    capacity: int,
    length: int,
) -> int | None:
    """The least-loaded domain of a heap (ties: the lower index) with a bin that has room for
    ``length`` tokens. Entries whose load is not the domain's current one are stale and dropped;
    domains without room are set aside and put back."""
    aside = []
    found = None
    while heap:
        key, d = heap[0]
        if key != load[d]:
            heapq.heappop(heap)
            continue
        if any(b[1] + length <= capacity for b in bins[d]):
            found = d
            break
        aside.append(heapq.heappop(heap))
    for x in aside:
        heapq.heappush(heap, x)
    return found


def _fill_small_bins(bins: list[list], lengths: Sequence[int], floor: int) -> None:
    """A bin with fewer than ``floor`` tokens takes the smallest unit of the fullest other bin of
    its domain that keeps at least ``floor`` tokens without it (ties: the lower bin), until it has
    ``floor`` or no bin can give."""
    for b in bins:
        while b[1] < floor:
            donors = sorted(
                (i for i, x in enumerate(bins) if x is not b and len(x[2]) > 1),
                key=lambda i: (-bins[i][1], i),
            )
            for i in donors:
                donor = bins[i]
                u = min(donor[2], key=lambda j: (lengths[j], j))
                if donor[1] - lengths[u] >= floor:
                    donor[2].remove(u)
                    donor[1] -= lengths[u]
                    b[2].append(u)
                    b[1] += lengths[u]
                    break
            else:
                return
