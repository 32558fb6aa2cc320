"""Feedback from ``costmodel.estimate`` into the planner's surrogate.

Memory feedback (``lower_free``): a rank ``estimate`` finds over capacity gets its free memory lowered
by the overflow, so the next round gives it fewer tokens. Time feedback (``feedback_factors``): per-rank
factors (estimated / surrogate time) that scale the surrogate's coefficients, so terms the surrogate
leaves out (K/V fan-out between groups of different sizes, causal visibility, the A2A as a collective)
steer the next round; ``surrogate_times`` gives the surrogate's side of the ratio.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from megatron_hexiseq.costmodel import Estimate
from megatron_hexiseq.layout import Layout
from megatron_hexiseq.planner.coef import GroupCoef
from megatron_hexiseq.planner.stage1_groups import Grouping
from megatron_hexiseq.planner.surrogate import DeviceCoef, Surrogate


def lower_free(sur: Surrogate, over: dict[int, int]) -> Surrogate:
    """Memory feedback: the free memory of every rank of an over-capacity rank's device class lowered by
    the class's largest overflow (and one unit). Per class, not per rank, so the members of a group
    stay identical (Stage II's closed forms; per-rank values made a 128-GPU plan's Stage I 50 s)."""
    worst: dict[object, int] = {}
    for r, extra in over.items():
        d = sur.devices[r]
        worst[d] = max(worst.get(d, 0), extra + d.mem_tok_bytes)
    return sur.with_free(
        [max(0, d.free_bytes - worst[d]) if d in worst else d.free_bytes for d in sur.devices]
    )


@dataclass(frozen=True)
class SurrogateTimes:
    """Surrogate seconds per rank of a solved grouping (lists indexed by rank).

    ``total``: l_r t_r + s_r t_r + h_r beta_r(T_g); ``kv``: the K/V ring term h_r visible(T_g) c_r (the
    transfer); ``kv_exposed``: the part of it not hidden behind attention, h_r max(0, visible c_r - att_r).
    """

    total: list[float]
    kv: list[float]
    kv_exposed: list[float]


def surrogate_times(
    sur: Surrogate,
    grouping: Grouping,
    coefs: list[GroupCoef],
    tokens: Sequence[int],
    heads: Sequence[int],
) -> SurrogateTimes:
    """Surrogate seconds per rank of a solved grouping (``tokens`` per rank), with its K/V ring term apart."""
    W = len(tokens)
    total, kv, exposed = [0.0] * W, [0.0] * W, [0.0] * W
    for members, co in zip(grouping, coefs):
        T = sum(tokens[r] for r in members) // sur.unit
        ring = co.visible(T)
        for k, r in enumerate(members):
            total[r] = (
                tokens[r] // sur.unit * (co.a[k] + co.s_(k)) + heads[r] * co.beta(k, T)
            ) * 1e-9
            kv[r] = heads[r] * ring * co.c[k] * 1e-9
            exposed[r] = heads[r] * max(0, ring * co.c[k] - co.att(k, T)) * 1e-9
    return SurrogateTimes(total, kv, exposed)


def feedback_factors(
    sur: Surrogate, layout: Layout, est: Estimate, st: SurrogateTimes, separate_kv: bool = True
) -> tuple[list[float], list[float]]:
    """Time feedback: per-rank factors for (every other time coefficient, the K/V ring coefficient c_r).

    ``separate_kv=False``: one factor for all of a rank's coefficients, ``estimate``'s time over the
    surrogate's. ``separate_kv=True``: K/V gets ``estimate``'s transfer time (``kv_exchange_s``: only
    causally visible K/V is sent) over the surrogate's ring term h_r visible(T_g) c_r (an upper
    bound that counts hidden tokens; ranks without heads or without a ring take the other factor), the rest
    ``estimate``'s time without its exposed K/V over the surrogate's time without its exposed ring.
    Each clipped to [0.25, 4] and averaged per class of (device coefficients, group size), so
    identical groups stay identical, and so do the members of one group that Stage III gave one unit
    or one head more or less (40 heads over 16 ranks: 2 or 3 each): Stage II/III keep sharing their
    work across them and keep their closed forms for identical members (thousands of GPUs, few classes).
    """
    raw: list[float] = []
    raw_kv: list[float | None] = []
    time_s, exposed_s, exchange_s = (
        est.values(k) for k in ("time_s", "kv_exposed_s", "kv_exchange_s")
    )
    for t, t_exp, t_kv, s, s_kv, s_exp in zip(
        time_s, exposed_s, exchange_s, st.total, st.kv, st.kv_exposed
    ):
        if not separate_kv:
            raw.append(min(4.0, max(0.25, t / s)) if s > 0 else 1.0)
            raw_kv.append(None)
            continue
        rest = s - s_exp
        raw.append(min(4.0, max(0.25, (t - t_exp) / rest)) if rest > 0 else 1.0)
        raw_kv.append(min(4.0, max(0.25, t_kv / s_kv)) if s_kv > 0 else None)
    classes: dict[tuple[DeviceCoef, int], list[int]] = {}  # (device, group size) -> ranks
    for r, (dev, _) in enumerate(zip(sur.devices, layout.ranks)):
        classes.setdefault((dev, len(layout.group_of(r).ranks)), []).append(r)
    factors, kv_factors = [1.0] * len(raw), [1.0] * len(raw)
    for members in classes.values():
        mean = round(sum(raw[r] for r in members) / len(members), 3)
        kvs = [kv for kv in (raw_kv[r] for r in members) if kv is not None]
        mean_kv = round(sum(kvs) / len(kvs), 3) if kvs else mean
        for r in members:
            factors[r], kv_factors[r] = mean, mean_kv
    return factors, kv_factors
