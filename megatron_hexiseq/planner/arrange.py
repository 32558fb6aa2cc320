"""Where each group's tokens sit in the sequence: arrangements, their K/V fan-out, the ring order.

An ``Arrangement`` cuts the sequence into consecutive blocks. Its *prefix* blocks each hold the
groups of one class of identical groups (typically one GPU type), in order from the start of the
sequence; the *final* block ``[P, N)`` holds every other group. The groups of a block share it in
the mirrored head+tail arrangement (``planner.build``), outermost first. With an empty prefix this
is the plain mirrored arrangement (Megatron's zig-zag generalised). Why a prefix: a token at
position p attends to p + 1 keys and a group receives the K/V of every other group's tokens before
its last query, so a group early in the sequence does less attention per token and receives
little K/V. Slow GPUs or GPUs on a slow network placed first (slow-to-fast) stop paying for the
whole sequence's K/V (``planner.coef`` has the position-aware terms).

Here: which arrangements Stage I tries (``arrangements``), the K/V fan-out between groups of
different sizes (``kappa``, ``with_fan_out``, ``fan_extras``), each group's coefficients at its place
(``positioned``) and the final block's ring order (``ring_blocks``). Stage II for an arrangement
with a prefix is ``arranged_split`` (on the closed forms of ``arranged_forms``); its proven bound
for several prefix blocks is ``relaxed_bound``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from functools import lru_cache
from operator import mul
from typing import NamedTuple

from megatron_hexiseq.planner.coef import GroupCoef


@dataclass(frozen=True)
class Arrangement:
    """Blocks of group indices in sequence order: ``prefix`` blocks (each the groups of one class),
    then the ``final`` block's groups, outermost first. ``order`` is the sub-ring order."""

    prefix: tuple[tuple[int, ...], ...]
    final: tuple[int, ...]
    name: str = "mirrored"

    @property
    def share(self) -> float:
        """The prefix's share of the classes (``prefix-kv-4of8``: 0.5), 0 for the mirrored one."""
        if not self.prefix:
            return 0.0
        m, c = self.name.rsplit("-", 1)[1].split("of")
        return int(m) / int(c)

    @property
    def order_name(self) -> str:
        """The slowness order the prefix follows ("kv", "compute"; "" for the mirrored one)."""
        return self.name.split("-")[1] if self.prefix else ""

    @property
    def order(self) -> list[int]:
        return [g for block in self.prefix for g in block] + list(self.final)

    @property
    def blocks(self) -> list[tuple[int, ...]]:
        return list(self.prefix) + [self.final]


def mirrored(num_groups: int, order: Sequence[int] | None = None) -> Arrangement:
    """One block of every group (outermost first: ``order``, default the grouping's order)."""
    return Arrangement(prefix=(), final=tuple(order if order is not None else range(num_groups)))


def _class_keys(g: GroupCoef) -> tuple[float, float]:
    """(K/V ns per visible unit, attention ns per group unit) of one member rank with an even head split."""
    per_rank = g.heads / g.size
    return max(g.c) * per_rank, max(g.b) * per_rank


def arrangements(
    coefs: Sequence[GroupCoef],
    shares: Sequence[float] | None = None,
    orders: Sequence[str] | None = None,
) -> list[Arrangement]:
    """The arrangements Stage I tries for a grouping (``coefs``: one per group; identical groups
    share one object). Classes of identical groups are ordered slow-to-fast by two keys — K/V cost
    per visible unit first, attention cost first — and each order gives prefixes of its slowest m
    classes (one block per class) before a final block of the rest: every m from 1 to C - 1, or, with
    ``shares``, m = 1, m = C - 1 and m = round(share * C) for each share (``Arrangement.share``: the
    prefix's share of the classes, which carries over between groupings with other class counts);
    ``orders``: only the orders named ("kv", "compute"; ``Arrangement.order_name``).
    The final block's order (the sub-ring order) is settled when the layout is built
    (``ring_blocks``). The first arrangement is the plain mirrored one."""
    classes: dict[GroupCoef, list[int]] = {}
    for i, c in enumerate(coefs):
        classes.setdefault(c, []).append(i)
    keys = {c: _class_keys(c) for c in classes}
    first = list(classes)
    C = len(first)

    def final(cs: Sequence[GroupCoef]) -> tuple[int, ...]:
        return tuple(
            i for c in sorted(cs, key=lambda c: (keys[c][0], first.index(c))) for i in classes[c]
        )

    out = [Arrangement(prefix=(), final=final(first))]
    seen: set[tuple[tuple[tuple[int, ...], ...], tuple[int, ...]]] = {((), out[0].final)}
    ms = (
        set(range(1, C))
        if shares is None
        else ({1, C - 1} | {round(s * C) for s in shares}) & set(range(1, C))
    )
    for name, key in (
        ("kv", lambda c: (-keys[c][0], -keys[c][1], first.index(c))),
        ("compute", lambda c: (-keys[c][1], -keys[c][0], first.index(c))),
    ):
        if orders is not None and name not in orders:
            continue
        slow_first = sorted(first, key=key)
        for m in sorted(ms):
            prefix = tuple(tuple(classes[c]) for c in slow_first[:m])
            arr = Arrangement(
                prefix=prefix, final=final(slow_first[m:]), name=f"prefix-{name}-{m}of{C}"
            )
            if (arr.prefix, arr.final) not in seen:
                seen.add((arr.prefix, arr.final))
                out.append(arr)
    return out


def kappa(receiver: GroupCoef, sender: GroupCoef) -> float:
    """K/V fan-out of a receiving group from a sending group: ``max(1, n / m)`` for group sizes n, m.

    A holder of K/V heads serves every receiver of the other group that needs them, one copy each
    (the runtime's ``attention/peers.py``; ``costmodel.exchange.fan_units``): with even head splits
    a rank of a group of ``n`` receives ``H/n`` heads' K/V per round from a group of ``m`` ranks whose
    holders send ``H/m`` each, and the round lasts ``max(H/n, H/m)`` blocks. Without it the surrogate
    saw 40-rank groups with one head each at the end of the sequence as cheap (9.5 s) while
    ``estimate`` gave 13.6 s: 8-rank senders with 5 heads each."""
    return max(1.0, receiver.size / sender.size)


def _final_kappa(coefs: Sequence[GroupCoef], arr: Arrangement) -> dict[int, float]:
    """Per final group its ``kappa`` from the other final groups, averaged with their share of the
    block's tokens estimated by their linear FLOP rate (sum of 1/a over members): a small group that
    holds few tokens adds little fan-out. (The largest kappa charged every final group for its
    smallest neighbour whatever that held: 52 H100 + 4 A100 + 8 A800, gpt-13b, 256K, put a 4-GPU
    A100 group next to 8-GPU H100 groups and lost the node groups' plan, 4.68 s, for 5.40 s.)"""
    size: dict[GroupCoef, int] = {}
    weight: dict[GroupCoef, float] = {}
    count: dict[GroupCoef, int] = {}
    for g in arr.final:
        c = coefs[g]
        k = count.get(c)
        if k is None:  # a class's size and weight once (they depend on its coefficients only)
            count[c] = 1
            size[c] = c.size
            weight[c] = sum(1.0 / a for a in c.a if a > 0)
        else:
            count[c] = k + 1
    per: dict[GroupCoef, float] = {}
    for c in count:
        num = den = 0.0
        for d, k in count.items():
            k -= d is c  # the other groups only
            num += k * weight[d] * max(1.0, size[c] / size[d])
            den += k * weight[d]
        per[c] = num / den if den > 0 else 1.0
    return {g: per[coefs[g]] for g in arr.final}


def with_fan_out(coefs: Sequence[GroupCoef], arr: Arrangement) -> list[GroupCoef]:
    """The final block's K/V coefficients ``c`` scaled by their fan-out from the other final groups
    (``_final_kappa``); the fan-out from prefix blocks enters through ``GroupCoef.kv_extra``
    once their sizes are known (``arranged_feasible``, ``positioned``), the prefix blocks' through their
    visible units (``block_max``)."""
    out = list(coefs)
    for g, mult in _final_kappa(coefs, arr).items():
        if mult > 1.0:
            out[g] = _kv_scaled(coefs[g], mult)
    return out


@lru_cache(maxsize=100_000)
def _kv_scaled(g: GroupCoef, mult: float) -> GroupCoef:
    """``g`` with its K/V coefficients ``c`` times ``mult`` (rounded), one object per (g, mult):
    every arrangement of every grouping scales the same few classes again."""
    return replace(g, c=tuple(round(x * mult) for x in g.c))


def ring_blocks(
    coefs: Sequence[GroupCoef], arr: Arrangement, units: Sequence[int], reverse: bool = False
) -> list[list[int]]:
    """The arrangement's blocks for ``build_layout``, the final block's groups ordered by the ratio
    of their K/V transfer to their attention per received unit, ``c / (b T)`` (``reverse``: the other
    way round). In a mirrored block the outermost group's last query is the block's end, so it
    receives everything before it, an inner group less; which order hides the K/V better depends on
    how the rounds pipeline, so the planner builds both and ``estimate`` decides (2 H100 + 1 A100
    groups, gpt-7b, 128K: 3.652 s with the A100 group innermost, 3.798 s outermost). The surrogate's
    K/V term, an upper bound, is the same in any order."""
    where = {g: i for i, g in enumerate(arr.final)}

    def key(g: int) -> tuple[float, int]:
        c = coefs[g]
        return (max(c.c) / max(1, max(c.b) * units[g]), where[g])

    final = sorted(arr.final, key=key)
    return [list(b) for b in arr.prefix] + [final[::-1] if reverse else final]


class FanWeights(NamedTuple):
    """The linear weights of ``fan_extras`` for one (groups, arrangement)."""

    block: tuple[tuple[float, ...], ...]  # per prefix block, per earlier block: kappa x its groups
    final: dict[
        int, tuple[float, ...]
    ]  # per final group, per prefix block: (kappa / kappa_final - 1) x its groups


@lru_cache(maxsize=4096)
def fan_weights(coefs: tuple[GroupCoef, ...], arr: Arrangement) -> FanWeights:
    """The linear weights of ``fan_extras`` (per prefix block over the earlier blocks' sizes, per final
    group over the prefix blocks' sizes), computed once per (groups, arrangement)."""
    heads = [coefs[b[0]] for b in arr.prefix]
    block_w = tuple(
        tuple(kappa(heads[i], heads[j]) * len(arr.prefix[j]) for j in range(i))
        for i in range(len(heads))
    )
    fin = _final_kappa(coefs, arr)
    final_w = {
        g: tuple((kappa(coefs[g], h) / fin[g] - 1) * len(b) for h, b in zip(heads, arr.prefix))
        for g in arr.final
    }
    return FanWeights(block_w, final_w)


def fan_extras(
    coefs: Sequence[GroupCoef], arr: Arrangement, sizes: Sequence[int]
) -> tuple[list[int], dict[int, int]]:
    """Fan-out in visible units: per prefix block ``V_b - P_b`` (its visible units from the earlier
    blocks, each counted ``kappa`` times, less its start), per final group ``kv_extra`` (the prefix
    blocks' units counted ``kappa / kappa_final`` times instead of once; ``c`` is scaled by
    ``kappa_final``, see ``with_fan_out``). ``sizes``: units per group of each prefix block."""
    block_w, final_w = fan_weights(tuple(coefs), arr)
    block_extra, P = [], 0
    for i, block in enumerate(arr.prefix):
        block_extra.append(round(sum(map(mul, block_w[i], sizes))) - P)
        P += len(block) * sizes[i]
    return block_extra, {g: round(sum(map(mul, w, sizes))) for g, w in final_w.items()}


def positioned(
    coefs: Sequence[GroupCoef], arr: Arrangement, units: Sequence[int]
) -> list[GroupCoef]:
    """Each group's coefficients at the place ``arr`` and ``units`` give it (``GroupCoef.start``,
    ``end``, ``band``, ``kv_extra``)."""
    N = coefs[0].num_units
    sizes = [units[b[0]] for b in arr.prefix]
    block_extra, final_extra = fan_extras(coefs, arr, sizes)
    out = list(coefs)
    P = 0
    for i, block in enumerate(arr.blocks):
        Q = P + sum(units[g] for g in block)
        for g in block:
            if block is arr.final:
                out[g] = coefs[g].placed(P, 0 if Q >= N else Q, False, final_extra[g])
            else:
                out[g] = coefs[g].placed(P, 0 if Q >= N else Q, len(block) == 1, block_extra[i])
        P = Q
    return out
