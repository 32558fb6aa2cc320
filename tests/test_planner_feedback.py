"""Layer (a), no processes: the planner's time feedback — the K/V ring coefficient calibrated apart
from the other surrogate terms (``hierarchical.feedback_factors``), ``Surrogate.scaled`` with
separate K/V factors, the surrogate's per-rank parts, and the two feedback tracks."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from megatron_hexiseq.cluster import cluster_from_dict
from megatron_hexiseq.costmodel import estimate
from megatron_hexiseq.model import model_from_dict
from megatron_hexiseq.planner.coef import GroupCoef
from megatron_hexiseq.planner.feedback import SurrogateTimes, feedback_factors, surrogate_times
from megatron_hexiseq.planner.hierarchical import planner_candidates
from megatron_hexiseq.planner.surrogate import build_surrogate
from megatron_hexiseq.run_config import TrainOptions

pytestmark = pytest.mark.usefixtures("pinned_catalog")  # tests/conftest.py

TINY_GQA = {
    "name": "gpt-tiny-gqa",
    "num_layers": 2,
    "hidden_size": 128,
    "num_attention_heads": 8,
    "num_query_groups": 2,
    "ffn_hidden_size": 512,
    "vocab_size": 512,
    "seq_length": 1024,
}


def _cluster(*nodes, net=25):
    return cluster_from_dict(
        {
            "name": "t",
            "nodes": [
                {"name": f"n{i}", "gpu": g, "count": k, "network_GBps": net}
                for i, (g, k) in enumerate(nodes)
            ],
        }
    )


def _surrogate(world=4):
    cl = _cluster(("H100-SXM-80GB", world))
    return build_surrogate(cl, model_from_dict(TINY_GQA), TrainOptions(), 4096)


def _rank(time_s, kv_exchange_s=0.0, kv_exposed_s=0.0):
    return SimpleNamespace(
        time_s=time_s, breakdown={"kv_exchange_s": kv_exchange_s, "kv_exposed_s": kv_exposed_s}
    )


def _estimate(ranks):
    """A stand-in for an Estimate: ``per_rank`` rows and their ``values`` columns."""
    return SimpleNamespace(
        per_rank=ranks,
        values=lambda k: [getattr(r, k) if hasattr(r, k) else r.breakdown[k] for r in ranks],
    )


def _layout(tokens, heads, groups):
    """A stand-in for a Layout: ranks with tokens and heads, ``group_of`` from lists of ranks."""
    of = {r: SimpleNamespace(ranks=tuple(g)) for g in groups for r in g}
    return SimpleNamespace(
        ranks=[SimpleNamespace(num_tokens=t, heads=tuple(range(h))) for t, h in zip(tokens, heads)],
        group_of=of.__getitem__,
    )


def test_scaled_multiplies_only_the_ring_coefficient_by_the_kv_factors():
    sur = _surrogate(2)
    out = sur.scaled([2.0, 3.0], [0.5, 0.25])
    for d, o, f, fk in zip(sur.devices, out.devices, [2.0, 3.0], [0.5, 0.25]):
        for name in ("lin_s", "att_s", "a2a_tok_s", "a2a_head_s"):
            assert getattr(o, name) == pytest.approx(getattr(d, name) * f)
        assert o.kv_s == pytest.approx(d.kv_s * fk)
        assert (o.free_bytes, o.mem_tok_bytes, o.mem_head_bytes) == (
            d.free_bytes,
            d.mem_tok_bytes,
            d.mem_head_bytes,
        )
    same = sur.scaled([2.0, 3.0])  # without kv factors: one factor for every time coefficient
    assert [d.kv_s for d in same.devices] == pytest.approx(
        [d.kv_s * f for d, f in zip(sur.devices, [2.0, 3.0])]
    )


def test_surrogate_times_split_out_the_ring_and_its_exposed_part():
    # one group of 2 members in a sequence of 10 units, the group holds T = 4 (unit = 1 token here):
    # member 0: 3 units, 2 heads, b=1, c=2 -> ring 2*(10-4)*2 = 24, attention 2*4*1 = 8, exposed 16
    # member 1: 1 unit, 1 head, b=5, c=2 -> ring 12, attention 20, nothing exposed
    g = GroupCoef(
        a=(7, 9),
        s=(1, 1),
        b=(1, 5),
        c=(2, 2),
        e=(0, 0),
        free=(10**9,) * 2,
        mt=(1, 1),
        mh=(0, 0),
        heads=3,
        num_units=10,
    )
    sur = SimpleNamespace(unit=1)
    st = surrogate_times(sur, ((0, 1),), [g], tokens=[3, 1], heads=[2, 1])
    assert st.kv == pytest.approx([24e-9, 12e-9])
    assert st.kv_exposed == pytest.approx([16e-9, 0.0])
    # total: t (a + s) + h max(T b, ring c): 3*8 + 2*max(4, 12) = 48, 1*10 + 1*max(20, 12) = 30
    assert st.total == pytest.approx([48e-9, 30e-9])


def test_feedback_calibrates_the_ring_apart_from_the_other_terms():
    sur = _surrogate(4)
    # classes of (device, group size): ranks 0, 1 (one group of 2); ranks 2 and 3 (groups of 1 each)
    layout = _layout(tokens=[100, 100, 50, 80], heads=[2, 2, 0, 4], groups=[[0, 1], [2], [3]])
    st = SurrogateTimes(
        total=[10.0, 10.0, 5.0, 8.0], kv=[8.0, 8.0, 0.0, 6.0], kv_exposed=[4.0, 4.0, 0.0, 0.0]
    )
    est = _estimate(
        [
            _rank(
                7.0, kv_exchange_s=4.0, kv_exposed_s=1.0
            ),  # rest (7-1)/(10-4) = 1.0, ring 4/8 = 0.5
            _rank(
                10.0, kv_exchange_s=2.0, kv_exposed_s=1.0
            ),  # rest 9/6 = 1.5, ring 0.25: class means 1.25, 0.375
            _rank(10.0),  # no ring: 2.0, no K/V factor of its own
            _rank(80.0, kv_exchange_s=60.0),  # clipped to 4.0 (10x), ring 10x -> 4.0
        ]
    )  # class of 2 and 3: (2 + 4) / 2 = 3, ring 4
    f, fk = feedback_factors(sur, layout, est, st)
    assert f == [1.25, 1.25, 3.0, 3.0]
    assert fk == [0.375, 0.375, 4.0, 4.0]
    f1, fk1 = feedback_factors(sur, layout, est, st, separate_kv=False)  # the single-factor scheme
    assert f1 == fk1 == [0.85, 0.85, 3.0, 3.0]  # (0.7 + 1.0) / 2; (10/5 = 2 + 80/8 -> 4) / 2


def test_feedback_tracks_contain_the_single_factor_track():
    # 4 nodes of 4 mixed GPUs, 8 heads (no single cross-node group): several groups, so a K/V ring.
    # Both tracks start from the same round 0; the single-factor track alone gives the same
    # candidates as in the two-track run, so adding the K/V track can never make plan() slower.
    cl = _cluster(
        ("H100-SXM-80GB", 4), ("A100-SXM-80GB", 4), ("L40S-48GB", 4), ("H100-SXM-80GB", 4)
    )
    seq = 65536
    m = model_from_dict({**TINY_GQA, "seq_length": seq})
    o = TrainOptions()

    def run(schemes):
        cands = planner_candidates(
            cl, m, seq, o, lambda lay: estimate(lay, cl, m, o), feedback_schemes=schemes
        )
        return [
            (c.info["round"], c.info["feedback"], tuple(c.info["group_sizes"]), c.layout.ranks)
            for c in cands
        ]

    both, one = run(("one", "kv")), run(("one",))
    assert {x[1] for x in both} == {None, "one", "kv"}
    assert max(x[0] for x in both) == 2
    assert [x for x in both if x[1] != "kv"] == one
    kv = [x for x in both if x[1] == "kv"]
    assert kv and any(x not in one for x in kv)  # the K/V track found other layouts


def test_a_track_stops_once_its_factors_agree_with_the_cost_model(monkeypatch):
    # a track whose next factors are all within FEEDBACK_CONVERGED of 1 would re-split an unchanged
    # surrogate: it stops there; factors just beyond it keep the track going to its last round
    import megatron_hexiseq.planner.hierarchical as hierarchical

    cl = _cluster(
        ("H100-SXM-80GB", 4), ("A100-SXM-80GB", 4), ("L40S-48GB", 4), ("H100-SXM-80GB", 4)
    )
    seq = 65536
    m = model_from_dict({**TINY_GQA, "seq_length": seq})
    o = TrainOptions()
    real = hierarchical.feedback_factors

    def rounds(offset):
        calls = [0]

        def factors(*args, **kwargs):
            calls[0] += 1
            if calls[0] <= len(hierarchical.FEEDBACK_SCHEMES) * hierarchical.FEEDBACK_GROUPINGS:
                return real(*args, **kwargs)  # the tracks' starting factors
            f, kv = real(*args, **kwargs)
            return [round(1.0 + offset, 3)] * len(f), [round(1.0 - offset, 3)] * len(kv)

        monkeypatch.setattr(hierarchical, "feedback_factors", factors)
        cands = planner_candidates(cl, m, seq, o, lambda lay: estimate(lay, cl, m, o))
        return max(c.info["round"] for c in cands)

    limit = hierarchical.FEEDBACK_CONVERGED
    assert rounds(limit) == 1
    assert rounds(limit * 2) == 2
