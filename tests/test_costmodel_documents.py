"""Document-masked pricing (``costmodel.documents``) against brute-force counts.

Layer (a): no processes. Random layouts (uneven groups, heads, scattered segments) x random document
boundaries (1-token documents, boundaries on segment edges, one document over everything): pairs per
rank, pruned K/V tokens per rank, the per-round pairs and visible tokens, the whole round pipeline
(rebuilt round by round with ``pipelined_exposed_s``), and ``estimate`` reproduced with one document.
"""

import random

import numpy as np
import pytest

from megatron_hexiseq.attention.testing_layouts import random_layout
from megatron_hexiseq.cluster import cluster_from_dict
from megatron_hexiseq.costmodel import estimate, fan_units, pipelined_exposed_s
from megatron_hexiseq.costmodel.documents import (
    MAX_PIECE_PAIRS,
    cross_rounds,
    estimate_documents,
)
from megatron_hexiseq.costmodel.pieces import (
    check_cu_seqlens,
    cu_from_lengths,
    document_pairs,
    document_pieces,
)
from megatron_hexiseq.errors import HexiSeqError
from megatron_hexiseq.layout import make_layout
from megatron_hexiseq.model import ModelSpec
from megatron_hexiseq.run_config import TrainOptions

BASE = dict(
    name="tiny",
    num_layers=2,
    hidden_size=8,
    ffn_hidden_size=16,
    vocab_size=16,
    kv_channels=4,
    swiglu=False,
)


def _case(rng: random.Random):
    """A random cluster (1-3 nodes, two GPU types) and a random layout on it."""
    nodes = [(f"n{i}", rng.randint(1, 3), rng.choice([1, 2, 4])) for i in range(rng.randint(1, 3))]
    gpus = {
        f"G{i}": {
            "bf16_tflops": rng.choice([0.0005, 0.002, 0.01]),
            "memory_gib": 1,
            "nvlink_GBps": rng.choice([5, 10]),
            "efficiency": 1.0,
        }
        for i in range(2)
    }
    c = cluster_from_dict(
        {
            "name": "r",
            "gpus": gpus,
            "nodes": [
                {"name": nm, "gpu": rng.choice(sorted(gpus)), "count": k, "network_GBps": net}
                for nm, k, net in nodes
            ],
        }
    )
    W = c.world_size
    base = random_layout(rng, W)
    lay = make_layout(
        seq_length=base.seq_length,
        num_attention_heads=base.num_attention_heads,
        num_query_groups=base.num_query_groups,
        groups=[g.ranks for g in base.groups],
        segments=[r.segments for r in base.ranks],
        heads=[r.heads for r in base.ranks],
        hosts=[d.node for d in c.devices],
        gpus=[d.gpu.name for d in c.devices],
    )
    model = ModelSpec(
        **BASE,
        num_attention_heads=lay.num_attention_heads,
        num_query_groups=lay.num_query_groups,
        seq_length=lay.seq_length,
    )
    return lay, c, model


def _random_cu(rng: random.Random, lay):
    """Random boundaries; sometimes exactly the segment edges, sometimes one document."""
    S = lay.seq_length
    kind = rng.random()
    if kind < 0.15:
        return [0, S]
    if kind < 0.35:
        edges = sorted({s for r in lay.ranks for s, _ in r.segments} | {S})
        return edges
    k = rng.randint(1, S - 1)
    return [0, *sorted(rng.sample(range(1, S), k)), S]


def _doc_of(cu):
    return np.repeat(np.arange(len(cu) - 1), np.diff(cu))


def _positions(lay, ranks):
    return [p for r in ranks for s, e in lay.ranks[r].segments for p in range(s, e)]


def _visible(lay, doc, g_src, g_dst):
    """Keys of group g_src some query of g_dst sees (same document, k <= q)."""
    q = _positions(lay, lay.groups[g_dst].ranks)
    last = {}
    for p in q:
        last[doc[p]] = max(last.get(doc[p], -1), p)
    return [k for k in _positions(lay, lay.groups[g_src].ranks) if k <= last.get(doc[k], -1)]


def _pairs(lay, doc, g_q, g_k):
    q = _positions(lay, lay.groups[g_q].ranks)
    k = _positions(lay, lay.groups[g_k].ranks)
    return sum(1 for a in q for b in k if b <= a and doc[a] == doc[b])


def test_bad_boundaries_are_one_clear_error():
    with pytest.raises(HexiSeqError, match="start at 0 and end"):
        check_cu_seqlens([0, 4, 7], 8)
    with pytest.raises(HexiSeqError, match="strictly increasing: entry 2"):
        check_cu_seqlens([0, 4, 4, 8], 8)
    with pytest.raises(HexiSeqError, match="at least two integers"):
        check_cu_seqlens([0], 8)
    assert cu_from_lengths([3, 1, 4]) == (0, 3, 4, 8)
    assert document_pairs([(0, 8)], [0, 8]) == 36
    assert document_pairs([(0, 8)], [0, 4, 8]) == 20
    assert document_pairs([(2, 6)], [0, 3, 8]) == 3 + 1 + 2 + 3


def test_pairs_and_pruned_kv_match_brute_force():
    rng = random.Random(11)
    for _ in range(60):
        lay, c, model = _case(rng)
        cu = _random_cu(rng, lay)
        doc = _doc_of(cu)
        est = estimate_documents(lay, c, model, TrainOptions(), cu)
        n = len(lay.groups)
        gidx = {g.id: i for i, g in enumerate(lay.groups)}
        for r in lay.ranks:
            g = gidx[r.group]
            assert est.pairs[r.rank] == _pairs(lay, doc, g, g) + sum(
                _pairs(lay, doc, g, s) for s in range(n) if s != g
            )
            assert est.pairs[r.rank] == document_pairs(
                [seg for m in lay.groups[g].ranks for seg in lay.ranks[m].segments], cu
            )
            recv = sum(len(_visible(lay, doc, s, g)) for s in range(n) if s != g)
            assert est.kv_units[r.rank] == recv * len(lay.kv_heads(r.rank))
        b, L = 1, model.num_layers
        assert est.kv_bytes == int(est.kv_units.sum()) * 4 * model.kv_channels * b * L * 3


def test_round_cells_match_brute_force():
    rng = random.Random(5)
    for _ in range(40):
        lay, c, model = _case(rng)
        cu = np.array(_random_cu(rng, lay))
        doc = _doc_of(cu)
        gi = np.array([r.group for r in lay.ranks])
        rg, sg, vis, pairs = cross_rounds(document_pieces(lay, cu), gi)
        got = {(int(a), int(b)): (int(v), int(p)) for a, b, v, p in zip(rg, sg, vis, pairs)}
        n = len(lay.groups)
        want = {}
        for g in range(n):
            for s in range(n):
                if s != g:
                    v, p = len(_visible(lay, doc, s, g)), _pairs(lay, doc, g, s)
                    if v or p:
                        want[(g, s)] = (v, p)
        assert got == want


def _reference_rounds(lay, c, model, cu):
    """Each rank's forward exchange, round by round, from explicit positions."""
    doc = _doc_of(cu)
    n, L, d = len(lay.groups), model.num_layers, model.kv_channels
    out_comm, out_exposed = [], []
    sig = [tuple(lay.kv_heads(m) for m in g.ranks) for g in lay.groups]
    for r in lay.ranks:
        g = r.group
        pos = lay.groups[g].ranks.index(r.rank)
        rate = c.devices[r.rank].attention_flops_per_s
        comps = [4 * d * L * _pairs(lay, doc, g, g) * len(r.heads) / rate]
        comms = [0.0]
        for t in range(1, n):
            s = (g - t) % n
            vis = len(_visible(lay, doc, s, g))
            if not vis or not r.heads:
                continue
            src = lay.groups[s].ranks
            same = all(c.devices[m].node == c.devices[r.rank].node for m in src)
            link = (
                min([c.devices[m].nvlink_GBps for m in src] + [c.devices[r.rank].nvlink_GBps])
                if same
                else min(
                    [c.devices[m].network_GBps for m in src] + [c.devices[r.rank].network_GBps]
                )
            )
            fan = fan_units(sig[s], sig[g])[pos]
            comms.append(4 * d * L * vis * fan / (link * 1e9))
            comps.append(4 * d * L * _pairs(lay, doc, g, s) * len(r.heads) / rate)
        out_comm.append(sum(comms))
        out_exposed.append(pipelined_exposed_s(comps, comms))
    return out_comm, out_exposed


def test_pruned_pipeline_matches_round_by_round_reference():
    rng = random.Random(3)
    checked = 0
    while checked < 40:
        lay, c, model = _case(rng)
        if len({d.node for d in c.devices}) > 1 and any(
            len({c.devices[m].node for m in g.ranks}) > 1 for g in lay.groups
        ):
            continue  # the reference's link rule is the single-node-group one
        cu = _random_cu(rng, lay)
        est = estimate_documents(lay, c, model, TrainOptions(), cu)
        assert est.exchange_model in ("rounds", "none")
        comm, exposed = _reference_rounds(lay, c, model, np.array(cu))
        steps = 3  # forward + backward (2x)
        assert est.kv_exchange_s == pytest.approx(np.array(comm) * steps, rel=1e-9, abs=1e-15)
        assert est.kv_exposed_s == pytest.approx(np.array(exposed) * steps, rel=1e-9, abs=1e-12)
        checked += 1


def test_one_document_reproduces_estimate():
    rng = random.Random(17)
    for i in range(50):
        lay, c, model = _case(rng)
        mode = "fsdp" if i % 3 == 0 else "distributed_optimizer"  # fsdp: its collectives too
        options = TrainOptions(recompute=bool(i % 2), memory_mode=mode)
        est = estimate(lay, c, model, options)
        doc = estimate_documents(lay, c, model, options, [0, lay.seq_length])
        assert doc.iteration_time_s == pytest.approx(est.iteration_time_s, rel=1e-12)
        assert doc.time_s == pytest.approx(np.array(est.values("time_s")), rel=1e-12, abs=1e-15)
        assert doc.memory_bytes.tolist() == est.values("memory_bytes")
        assert doc.kv_exposed_s == pytest.approx(
            np.array(est.values("kv_exposed_s")), rel=1e-9, abs=1e-12
        )


def test_uniform_rounds_keep_exact_counts(monkeypatch):
    rng = random.Random(23)
    for _ in range(20):
        lay, c, model = _case(rng)
        cu = _random_cu(rng, lay)
        exact = estimate_documents(lay, c, model, TrainOptions(), cu)
        monkeypatch.setattr("megatron_hexiseq.costmodel.documents.MAX_PIECE_PAIRS", -1)
        uniform = estimate_documents(lay, c, model, TrainOptions(), cu)
        monkeypatch.setattr("megatron_hexiseq.costmodel.documents.MAX_PIECE_PAIRS", MAX_PIECE_PAIRS)
        assert uniform.pairs.tolist() == exact.pairs.tolist()
        assert uniform.kv_units.tolist() == exact.kv_units.tolist()
        assert uniform.attention_s.tolist() == exact.attention_s.tolist()
        if len(lay.groups) > 1 and exact.kv_units.any():
            assert uniform.exchange_model == "uniform"


def test_te_ring_sends_every_step_in_full():
    rng = random.Random(29)
    for _ in range(20):
        lay, c, model = _case(rng)
        ring = (
            make_layout(
                seq_length=lay.seq_length,
                num_attention_heads=lay.num_attention_heads,
                num_query_groups=lay.num_query_groups,
                group_sizes=[1] * lay.world_size,
                segments=[r.segments or [] for r in lay.ranks],
                heads=[list(range(lay.num_attention_heads))] * lay.world_size,
                hosts=[d.node for d in c.devices],
                gpus=[d.gpu.name for d in c.devices],
            )
            if all(r.segments for r in lay.ranks)
            else None
        )
        if ring is None:
            continue
        cu = _random_cu(rng, ring)
        te = estimate_documents(ring, c, model, TrainOptions(), cu, exchange="te-ring")
        pruned = estimate_documents(ring, c, model, TrainOptions(), cu)
        W, S, G = ring.world_size, ring.seq_length, ring.num_query_groups
        tokens = np.array([r.num_tokens for r in ring.ranks])
        assert te.kv_units.tolist() == ((S - tokens) * G).tolist()
        assert te.pairs.tolist() == pruned.pairs.tolist()
        assert (te.kv_units >= pruned.kv_units).all()
        assert (te.rounds == W - 1).all()


def test_vectorised_pipeline_matches_scalar_pipeline():
    from megatron_hexiseq.costmodel.documents import _pipeline

    rng = np.random.default_rng(0)
    W = 7
    counts = rng.integers(0, 9, W)
    comp0 = rng.random(W)
    rank = np.repeat(np.arange(W), counts)
    comp, comm = rng.random(rank.size) * 2, rng.random(rank.size) * 3
    exposed, comm_sum = _pipeline(comp0, rank, comp, comm)
    for r in range(W):
        e = rank == r
        want = pipelined_exposed_s([comp0[r], *comp[e]], [0.0, *comm[e]])
        assert exposed[r] == pytest.approx(want, rel=1e-12, abs=1e-12)
        assert comm_sum[r] == pytest.approx(comm[e].sum())
