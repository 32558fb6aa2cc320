"""Integer coefficients of one A2A group's members (``GroupCoef``), with the group's place in the sequence.

Time in integer ns, memory in bytes, tokens in units (``planner.surrogate``). For member i holding
``t`` own units and ``h`` heads while the group holds ``T`` units:

    linear phase    t a_i
    attention phase t s_i + h beta_i(T)
    beta_i(T)     = max(att_i(T), visible(T) c_i) + T e_i      (attention vs K/V received, overlapped)
    memory          t mt_i + h T mh_i <= free_i

Position. The sequence is cut into consecutive *blocks* (``planner.arrange``); a group sits in the
block ``[start, end)`` (units; ``end = 0`` means the whole sequence), and the groups of one block
share it in the mirrored head+tail arrangement (``planner.build``). A mirrored pair of n tokens
inside ``[P, Q)`` has ``n (P + Q + 1) / 2`` causal pairs, so the attention work is proportional to
the group's tokens with the block's factor ``(P + Q) / N`` (``b_i`` is the cost per head per unit
for the whole sequence, ``P = 0, Q = N``):

    att_i(T)     = b_i T (P + Q) / N
    visible(T)   = Q - T      other groups' units at positions before the block's end: an upper
                              bound of what the group receives (exact for the outermost group of
                              its block; the inner ones see ``Q - o - T``, o = the tails outside them)

A *band* is a block holding one group (``band=True``): its block is ``[P, P + T)``, so

    att_i(T)     = b_i T (2P + T) / N
    visible(T)   = P          every unit before the band, whatever the band's own size.

Fan-out (``kv_extra``, and ``c`` scaled for the final block: ``planner.arrange.with_fan_out``): a holder
of K/V heads serves every receiver that needs them, so K/V from a smaller group counts more.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

INF = float("inf")
MIN_UNITS_PER_RANK = (
    1  # every rank owns >= 1 token unit: Megatron cannot run an empty sequence shard
)


class ClassRow(NamedTuple):
    """A class of identical members of a group (``GroupCoef.rows``): their count, the first
    member's coefficients and ``cap`` (units that fit with no heads). The
    innermost loops unpack it whole or slice ``[1:9]`` (a, s, b, c, e, free, mt, mh)."""

    members: int
    a: int
    s: int
    b: int
    c: int
    e: int
    free: int
    mt: int
    mh: int
    cap: int


@dataclass(frozen=True)
class GroupCoef:
    """Integer coefficients of a group's members (order = member order) and its block.

    Time (ns): a (linear phase, per own unit), s (A2A, attention phase, per own unit), b, c, e
    (attention phase, per head; see ``beta``). Memory (bytes): free, mt (per own unit), mh (per head
    per group unit). ``cap`` = units that fit with no heads. Position (units): ``start``, ``end``
    (0: the sequence's end), ``band`` (see the module docstring).
    """

    a: tuple[int, ...]
    b: tuple[int, ...]
    c: tuple[int, ...]
    e: tuple[int, ...]
    free: tuple[int, ...]
    mt: tuple[int, ...]
    mh: tuple[int, ...]
    heads: int
    num_units: int
    s: tuple[int, ...] = ()  # A2A ns per own unit (attention phase); empty = 0 for every member
    start: int = 0
    end: int = 0
    band: bool = False
    kv_extra: int = (
        0  # units added to visible(T): the fan-out of smaller sending groups (planner.arrange)
    )
    # derived once in __post_init__ (the planner's innermost loops read them): hash, member classes,
    # per-class rows and memory caps
    _hash: int = field(init=False, repr=False, compare=False)
    _members_hash: int = field(init=False, repr=False, compare=False)  # of the fields but the place
    classes: tuple[tuple[int, ...], ...] = field(init=False, repr=False, compare=False)
    rows: tuple[ClassRow, ...] = field(init=False, repr=False, compare=False)
    cap: tuple[int, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        fields = (self.a, self.b, self.c, self.e, self.free, self.mt, self.mh, self.heads)
        set_(self, "_members_hash", hash((*fields, self.num_units, self.s)))
        set_(self, "_hash", self._hash_at(self.start, self.end, self.band, self.kv_extra))
        # members with identical coefficients, grouped (they behave identically in the continuous model)
        groups: dict[tuple[int, ...], list[int]] = {}  # by (a, s, b, c, e, free, mt, mh)
        for i in range(len(self.a)):
            key = (
                self.a[i],
                self.s_(i),
                self.b[i],
                self.c[i],
                self.e[i],
                self.free[i],
                self.mt[i],
                self.mh[i],
            )
            groups.setdefault(key, []).append(i)
        set_(self, "classes", tuple(tuple(v) for v in groups.values()))
        # units that fit with no heads
        set_(self, "cap", tuple(f // m if m else 1 << 40 for f, m in zip(self.free, self.mt)))
        # per class of identical members: its count and its first member's coefficients
        set_(
            self,
            "rows",
            tuple(
                ClassRow(
                    len(m),
                    self.a[m[0]],
                    self.s_(m[0]),
                    self.b[m[0]],
                    self.c[m[0]],
                    self.e[m[0]],
                    self.free[m[0]],
                    self.mt[m[0]],
                    self.mh[m[0]],
                    self.cap[m[0]],
                )
                for m in self.classes
            ),
        )

    def _hash_at(self, start: int, end: int, band: bool, kv_extra: int) -> int:
        """The hash of the fields, with the place fields given (computed once per placement; the
        member fields' part once per group: Stage II places groups thousands of times per split, and
        hashing the member tuples each time cost ~5% of ``plan()``)."""
        return hash((self._members_hash, start, end, band, kv_extra))

    def __hash__(self) -> int:  # hashed on every cache lookup: computed once
        return self._hash

    def placed(self, start: int, end: int, band: bool, kv_extra: int = 0) -> GroupCoef:
        """The same group at another place in the sequence (the member-derived fields are reused:
        Stage II moves groups thousands of times per split)."""
        if (start, end, band, kv_extra) == (self.start, self.end, self.band, self.kv_extra):
            return self
        new = object.__new__(GroupCoef)
        new.__dict__.update(self.__dict__)
        set_ = object.__setattr__
        set_(new, "start", start)
        set_(new, "end", end)
        set_(new, "band", band)
        set_(new, "kv_extra", kv_extra)
        set_(new, "_hash", self._hash_at(start, end, band, kv_extra))
        return new

    def key(self) -> tuple:
        """A total order of group coefficients (equal keys: equal groups), independent of where the
        groups are listed (``stage2_split.hand_out`` breaks ties by it)."""
        return (
            self.size,
            self.a,
            self.s,
            self.b,
            self.c,
            self.e,
            self.free,
            self.mt,
            self.mh,
            self.heads,
            self.num_units,
            self.start,
            self.end,
            self.band,
            self.kv_extra,
        )

    def s_(self, i: int) -> int:
        """A2A ns per own unit of member i (attention phase)."""
        return self.s[i] if self.s else 0

    @property
    def size(self) -> int:
        return len(self.a)

    @property
    def block_end(self) -> int:
        """End of the block (units) for a group that is not a band."""
        return self.end or self.num_units

    def att_scale(self, T: int) -> tuple[int, int]:
        """(numerator, denominator) of the attention factor at T units: (P + Q, N) or (2P + T, N)."""
        if self.band:
            return 2 * self.start + T, self.num_units
        return self.start + self.block_end, self.num_units

    def visible(self, T: int) -> int:
        """Other groups' units the group receives K/V of (see the module docstring), plus ``kv_extra``."""
        return max(0, (self.start if self.band else self.block_end - T) + self.kv_extra)

    def att(self, i: int, T: int) -> int:
        """Attention ns per head of member i when the group holds T units."""
        num, den = self.att_scale(T)
        return self.b[i] * T * num // den

    def beta(self, i: int, T: int) -> int:
        """Per-head time coefficient of member i when the group holds T units (ns)."""
        return max(self.att(i, T), self.visible(T) * self.c[i]) + T * self.e[i]

    def betas(self, T: int) -> list[int]:
        """``beta(i, T)`` of every member, computed once per class of identical members (Stage III's
        integer repair probes a group of 16-32 identical members at hundreds of unit counts)."""
        if len(self.rows) == 1:
            return [self.beta(0, T)] * self.size
        out = [0] * self.size
        for members in self.classes:
            value = self.beta(members[0], T)
            for i in members:
                out[i] = value
        return out

    def head_mem_cap(self, i: int, T: int, t: float) -> float:
        """Most heads member i can hold in memory with t own units while the group holds T units."""
        per = T * self.mh[i]
        return (self.free[i] - t * self.mt[i]) / per if per else INF

    def min_units(self) -> int:
        """Fewest units the group can hold: one per member (no rank may own zero tokens)."""
        return self.size * MIN_UNITS_PER_RANK

    def max_units(self) -> int:
        """Most units the group's memory holds with no heads (and at most the sequence)."""
        return min(self.num_units, sum(self.cap))
