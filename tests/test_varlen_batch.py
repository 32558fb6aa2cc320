"""The per-micro-batch planner, the packed-document schemes, ``plan --doc-lengths`` and ``varlen``.

Layer (a): no processes (the CLI runs in-process through ``cli.main``). Assignments are validated
layouts with the structure's groups and heads, deterministic, never leave a rank empty, keep short
documents inside one group (no K/V exchanged), spread a document too long for one group in mirrored
pieces, and are never slower by the cost model than the fixed layout on the test cases; the
baselines' token splits match Megatron's zig-zag; bad input is one line and exit code 2.
"""

import json
import random
from dataclasses import replace

import numpy as np
import pytest

from megatron_hexiseq.cli import main
from megatron_hexiseq.cluster import cluster_from_dict
from megatron_hexiseq.costmodel.documents import estimate_documents
from megatron_hexiseq.errors import HexiSeqError
from megatron_hexiseq.layout import zigzag_segments
from megatron_hexiseq.model import get_model
from megatron_hexiseq.planner.plan import plan
from megatron_hexiseq.run_config import TrainOptions
from megatron_hexiseq.varlen.batch import (
    EXACT_MARGIN,
    MAX_UNITS,
    BatchAssignment,
    BatchPlanner,
    placement_units,
    same_structure,
)
from megatron_hexiseq.varlen.packing import heavy_tailed_lengths, pack_batches
from megatron_hexiseq.varlen.schemes import SCHEMES, Schemes, zigzag_docs

N = 65536


def _cluster(types=("H100-SXM-80GB", "L40S-48GB"), per_node=4):
    return cluster_from_dict(
        {
            "name": "mix",
            "nodes": [
                {"name": f"n{i}", "gpu": t, "count": per_node, "network_GBps": 25}
                for i, t in enumerate(types)
            ],
        }
    )


@pytest.fixture(scope="module")
def setup():
    c = _cluster()
    m = get_model("llama3-8b", overrides={"seq_length": N})
    o = TrainOptions(recompute=True, memory_mode="fsdp")
    fixed = plan(c, m, N, o, time_limit_s=30, reproducible=True)
    return c, m, o, fixed


def test_assignment_is_a_valid_deterministic_layout(setup):
    c, m, o, fixed = setup
    bp = BatchPlanner(fixed, c, m, o)
    docs = heavy_tailed_lengths(400, seed=1)
    for batch in pack_batches(docs, N, 4, seed=2):
        a = bp.plan(batch)
        assert a.layout.seq_length == N and sum(batch) == N
        assert same_structure(a.layout, fixed)
        assert all(r.num_tokens >= 1 for r in a.layout.ranks)
        assert a.doc_lengths == list(batch)
        again = BatchPlanner(fixed, c, m, o).plan(batch)
        assert again.layout == a.layout and again.cu_seqlens == a.cu_seqlens
        a.check_structure(fixed)
        positions = np.concatenate([a.rank_positions(r) for r in range(a.layout.world_size)])
        assert sorted(positions.tolist()) == list(range(N))
    with pytest.raises(HexiSeqError, match="does not match the job's structure"):
        a.check_structure(_other_structure(fixed, c, m))


def _other_structure(layout, c, m):
    """A symmetric layout whose groups differ from ``layout``'s (one group of all, or one per rank)."""
    from megatron_hexiseq.planner.baselines import symmetric_layout

    hp = c.world_size if len(layout.groups) > 1 else 1
    return symmetric_layout(c, m, layout.seq_length, hp)


def test_short_documents_stay_whole_inside_one_group(setup):
    c, m, o, fixed = setup
    batch = [512] * (N // 512)
    a = BatchPlanner(fixed, c, m, o).plan(batch, or_structure=False)
    group_of = {r.rank: r.group for r in a.layout.ranks}
    for d in range(len(batch)):
        s, e = d * 512, (d + 1) * 512
        groups = {
            group_of[r.rank] for r in a.layout.ranks for x, y in r.segments if x < e and y > s
        }
        assert len(groups) == 1, (d, groups)
    est = estimate_documents(a.layout, c, m, o, a.cu_seqlens)
    assert est.kv_units.sum() == 0  # no K/V crosses a group


def test_long_document_is_split_in_mirrored_pieces(setup):
    c, m, o, fixed = setup
    if len(fixed.groups) < 2:
        pytest.skip("one group: nothing to split over")
    batch = [N - 4096, 4096]
    a = BatchPlanner(fixed, c, m, o).plan(batch, or_structure=False)
    holders = {r.group for r in a.layout.ranks for s, e in r.segments if s < N - 4096}
    assert len(holders) >= 2
    # every group holding the long document holds a piece at its head and its mirror at its tail
    cu = a.cu_seqlens
    for g in holders:
        mine = [
            (max(s, 0), min(e, cu[1]))
            for r in a.layout.ranks
            if r.group == g
            for s, e in r.segments
            if s < cu[1]
        ]
        pos = np.concatenate([np.arange(s, e) for s, e in mine])
        assert pos.min() < (N - 4096) // 2 <= pos.max()


def test_per_batch_plan_beats_or_matches_the_fixed_layout(setup):
    c, m, o, fixed = setup
    bp = BatchPlanner(fixed, c, m, o)
    docs = heavy_tailed_lengths(2000, seed=3)
    ratios = []
    for batch in pack_batches(docs, N, 6, seed=4):
        a = bp.plan(batch)
        mine = estimate_documents(a.layout, c, m, o, a.cu_seqlens)
        theirs = estimate_documents(fixed, c, m, o, a.cu_seqlens)
        assert mine.feasible
        ratios.append(theirs.iteration_time_s / mine.iteration_time_s)
    assert np.median(ratios) >= 1.0


def test_the_structures_layout_is_kept_when_predicted_faster(setup):
    c, m, o, fixed = setup
    bp = BatchPlanner(fixed, c, m, o)
    for batch in pack_batches(heavy_tailed_lengths(800, seed=9), N, 4, seed=10):
        cu = np.array([0, *np.cumsum(batch)])
        own = bp.plan(batch, or_structure=False)
        best = bp.plan(batch)
        assert own.predicted_s == pytest.approx(bp.predict(own.layout, cu))
        p_own, p_fixed = own.predicted_s, bp.predict(fixed, cu)
        if abs(p_own - p_fixed) > EXACT_MARGIN * min(p_own, p_fixed):
            assert best.predicted_s == min(p_own, p_fixed)
        else:  # too close to call: estimate_documents decides
            t_own, t_fixed = (
                estimate_documents(x, c, m, o, own.cu_seqlens, packed=True).iteration_time_s
                for x in (own.layout, fixed)
            )
            assert best.layout == (fixed if t_fixed < t_own else own.layout)
        assert best.layout in (own.layout, fixed)


def test_bad_micro_batches_are_one_clear_error(setup):
    c, m, o, fixed = setup
    bp = BatchPlanner(fixed, c, m, o)
    with pytest.raises(HexiSeqError, match="positive number of tokens"):
        bp.plan([10, 0, 5])
    with pytest.raises(HexiSeqError, match="every rank needs at least one"):
        bp.plan([3])
    with pytest.raises(HexiSeqError, match="cu_seqlens must start at 0"):
        BatchAssignment(layout=fixed, cu_seqlens=(0, 5))


def test_placement_units_bundle_short_documents_past_max_units():
    rng = random.Random(5)
    few = [rng.randint(1, 50) for _ in range(MAX_UNITS)]
    cu = np.concatenate(([0], np.cumsum(few)))
    assert placement_units(cu).tolist() == list(range(MAX_UNITS + 1))  # every document a unit
    many = [rng.choice((1, 1, 3, 17, 40)) for _ in range(30_000)] + [5000, 1, 1, 9000, 2]
    rng.shuffle(many)
    cu = np.concatenate(([0], np.cumsum(many)))
    units = placement_units(cu)
    B = -(-int(cu[-1]) // MAX_UNITS)
    assert units[0] == 0 and units[-1] == len(many) and (np.diff(units) > 0).all()
    assert units.size - 1 <= 3 * MAX_UNITS + 1 < len(many)
    for a, b in zip(units[:-1].tolist(), units[1:].tolist()):
        if b - a > 1:  # a bundle: short documents starting in one B-token window
            assert (
                all(x < B for x in many[a:b]) and len({int(cu[d]) // B for d in range(a, b)}) == 1
            )
            assert cu[b] - cu[a] < 2 * B
    long_docs = [d for d, x in enumerate(many) if x >= B]
    assert set(long_docs) <= set(units.tolist()) and all(d + 1 in units for d in long_docs)


def test_many_one_token_documents_plan_in_bundles(setup):
    """65,536 one-token documents: a valid assignment whose documents lie in runs (bundles placed
    whole), not one segment per document (the per-document placement alternated between groups:
    ~40,000 segments on the 16-GPU mixed cluster)."""
    c, m, o, fixed = setup
    a = BatchPlanner(fixed, c, m, o).plan([1] * N, or_structure=False)
    assert a.layout.seq_length == N and len(a.cu_seqlens) == N + 1
    assert all(r.num_tokens >= 1 for r in a.layout.ranks)
    segments = sum(len(r.segments) for r in a.layout.ranks)
    assert segments <= 3 * MAX_UNITS + 1 + c.world_size, segments
    est = estimate_documents(a.layout, c, m, o, a.cu_seqlens)
    assert est.kv_units.sum() == 0 and int(est.pairs[0]) > 0  # one-token documents: nothing shared


def test_small_documents_go_to_the_least_linear_load_with_room(setup):
    """The heap placement of small documents against the per-document rule it implements: each
    one (longest first) to the group with the lowest linear phase that has room, a group without
    room for one leaving for the rest."""
    from megatron_hexiseq.varlen import batch

    c, m, o, fixed = setup
    bp = BatchPlanner(fixed, c, m, o)
    n = len(bp.groups)
    rng = np.random.default_rng(3)
    for trial in range(20):
        lengths = np.sort(rng.integers(1, 60, 300))[::-1].astype(np.int64)
        starts = np.concatenate(([0], np.cumsum(lengths)[:-1]))
        pairs = lengths * (lengths + 1) // 2
        lin0 = rng.uniform(0, 1e-3, n)
        tokens0 = rng.integers(0, 200, n).astype(float)
        cap = tokens0 + rng.integers(0, 3000 if trial % 2 else 40_000, n)
        state = batch._State(
            lin=lin0.copy(), att=np.zeros(n), tokens=tokens0.copy(),
            pieces=[[] for _ in range(n)], u=None, v=None, w=None, lin_target=1.0, att_target=1.0,
        )  # fmt: skip
        bp.cap = cap
        lin, tokens, alive, want = lin0.tolist(), tokens0.tolist(), set(range(n)), {}
        failed = False
        for i in range(lengths.size):
            l_d = int(lengths[i])
            while alive:
                g = min(alive, key=lambda x: (lin[x], x))
                if tokens[g] + l_d > cap[g]:
                    alive.discard(g)
                    continue
                lin[g] += l_d * bp.linear_per_token[g]
                tokens[g] += l_d
                want[i] = g
                break
            else:
                failed = True
                break
        if failed:
            with pytest.raises(HexiSeqError, match="does not fit in the cluster's memory"):
                bp._place_small(state, np.arange(lengths.size), lengths, starts, pairs)
            continue
        bp._place_small(state, np.arange(lengths.size), lengths, starts, pairs)
        got = {
            i: g
            for g in range(n)
            for s, e in state.pieces[g]
            for i in range(lengths.size)
            if s <= starts[i] < e
        }
        assert got == want and state.lin.tolist() == lin and state.tokens.tolist() == tokens


def test_zigzag_docs_is_megatrons_split_per_document():
    cu = np.array([0, 16, 48])
    got = zigzag_docs(cu, [0, 1, 2, 3], 4)
    first = zigzag_segments(16, 4)
    second = [[(s + 16, e + 16) for s, e in segs] for segs in zigzag_segments(32, 4)]
    for r in range(4):
        want = sorted(first[r] + second[r])
        merged = []
        for s, e in want:
            if merged and merged[-1][1] == s:
                merged[-1] = (merged[-1][0], e)
            else:
                merged.append((s, e))
        assert got[r] == merged


def test_every_scheme_prices_the_same_micro_batch(setup):
    c, m, o, fixed = setup
    modes = [o, replace(o, memory_mode="distributed_optimizer")]
    schemes = Schemes(c, m, o, fixed, modes=modes)
    batch = pack_batches(heavy_tailed_lengths(500, seed=5), N, 1, seed=6)[0]
    runs = {s: schemes.run(s, batch) for s in SCHEMES}
    pairs = {
        s: int(r.estimate.pairs.astype(object) @ r.estimate.heads.astype(object))
        for s, r in runs.items()
    }
    # every scheme computes the same document-masked attention: sum over ranks of pairs x heads
    # is the micro-batch's pairs x heads (each group computes every head of its query tokens once)
    total = sum(length * (length + 1) // 2 for length in batch) * m.num_attention_heads
    assert set(pairs.values()) == {total}
    thd = runs["megatron-thd-cp"].estimate
    tokens = np.array([r.num_tokens for r in runs["megatron-thd-cp"].layout.ranks])
    assert thd.kv_units.tolist() == ((N - tokens) * m.num_query_groups).tolist()  # TE: no pruning
    # per-document: every document of at least 2 tokens per group is held by every group
    per_doc = runs["per-document"].layout
    cu = np.cumsum([0, *batch])
    n = len(per_doc.groups)
    for d in range(len(batch)):
        if batch[d] >= 64 * n:
            held = {
                r.group for r in per_doc.ranks for s, e in r.segments if s < cu[d + 1] and e > cu[d]
            }
            assert len(held) == n
    assert runs["dynamic-cp"].config["cp"] in schemes.cp_sizes
    assert (
        runs["dynamic-cp"].estimate.iteration_time_s <= thd.iteration_time_s * (1 + 1e-12)
        or not thd.feasible
    )


def test_pack_batches_is_exact_and_seeded():
    docs = [5, 7, 11, 13]
    a = pack_batches(docs, 10, 5, seed=1)
    assert all(sum(b) == 10 for b in a)
    assert sum(map(sum, a)) == 50
    assert a == pack_batches(docs, 10, 5, seed=1)
    assert heavy_tailed_lengths(50, seed=2) == heavy_tailed_lengths(50, seed=2)


def _write(tmp_path, name, obj):
    p = tmp_path / name
    p.write_text(json.dumps(obj) if not isinstance(obj, str) else obj)
    return str(p)


def test_varlen_command_writes_every_field(tmp_path, capsys):
    cluster = tmp_path / "c.yaml"
    cluster.write_text(
        "name: tiny-mix\nnodes:\n"
        "  - {name: a, gpu: H100-SXM-80GB, count: 2, network_GBps: 25}\n"
        "  - {name: b, gpu: A100-SXM-80GB, count: 2, network_GBps: 25}\n"
    )
    docs = _write(tmp_path, "d.json", heavy_tailed_lengths(300, seed=7, median=512))
    out = tmp_path / "out.json"
    rc = main(
        ["varlen", "--cluster", str(cluster), "--model", "gpt-tiny", "--doc-lengths", docs,
         "--tokens-per-batch", "8192", "--batches", "2", "--seed", "3", "-o", str(out)]
    )  # fmt: skip
    assert rc == 0
    data = json.loads(out.read_text())
    assert set(data["schemes"]) == set(SCHEMES)
    for name, rec in data["schemes"].items():
        for key in ("mean_step_s", "p90_step_s", "imbalance", "kv_bytes"):
            assert key in rec, (name, key)
    assert {"plan_ms_p50", "plan_ms_max"} <= set(data["schemes"]["hexiseq-batch"])
    assert len(data["batches"]) == 2
    for b in data["batches"]:
        assert sum(b["doc_lengths"]) == 8192
        for s in SCHEMES:
            ranks = b["schemes"][s]["ranks"]
            assert len(ranks) == 4 and all("segments" in r and "heads" in r for r in ranks)
    assert "hexiseq-batch" in capsys.readouterr().out


@pytest.mark.parametrize(
    "docs, extra, message",
    [
        ("[1, 2, 0]", [], "list of positive integers"),
        ("{}", [], "list of positive integers"),
        ("[100, 200]", ["--tokens-per-batch", "0"], "--tokens-per-batch must be a positive"),
        ("[100, 200]", ["--tokens-per-batch", "2"], "below the 4 GPUs"),
    ],
)
def test_varlen_bad_input_is_one_line_exit_2(tmp_path, capsys, docs, extra, message):
    cluster = tmp_path / "c.yaml"
    cluster.write_text(
        "name: t\nnodes:\n  - {name: a, gpu: H100-SXM-80GB, count: 4, network_GBps: 25}\n"
    )
    path = _write(tmp_path, "d.json", docs)
    out = tmp_path / "out.json"
    args = ["varlen", "--cluster", str(cluster), "--model", "gpt-tiny", "--doc-lengths", path,
            "--tokens-per-batch", "4096", "-o", str(out)]  # fmt: skip
    if extra:
        args[args.index("--tokens-per-batch") : args.index("--tokens-per-batch") + 2] = extra
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err
    assert not out.exists()


def test_plan_doc_lengths_records_the_choice(tmp_path):
    cluster = tmp_path / "c.yaml"
    cluster.write_text(
        "name: tiny-mix\nnodes:\n"
        "  - {name: a, gpu: H100-SXM-80GB, count: 2, network_GBps: 25}\n"
        "  - {name: b, gpu: L40S-48GB, count: 2, network_GBps: 25}\n"
    )
    docs = _write(tmp_path, "d.json", heavy_tailed_lengths(300, seed=8, median=512))
    plain, with_docs = tmp_path / "a.json", tmp_path / "b.json"
    base = ["plan", "--cluster", str(cluster), "--model", "gpt-tiny", "--seq-length", "8192",
            "--reproducible", "--format", "json"]  # fmt: skip
    assert main([*base, "-o", str(plain)]) == 0
    assert main([*base, "--doc-lengths", docs, "-o", str(with_docs)]) == 0
    a, b = json.loads(plain.read_text()), json.loads(with_docs.read_text())
    assert "documents" not in a["planner"]
    rec = b["planner"]["documents"]
    assert rec["chosen"] == b["meta"]["chosen"]
    best = min(r["mean_step_s"] for r in rec["candidates"] if r.get("feasible"))
    assert next(r for r in rec["candidates"] if r["name"] == rec["chosen"])["mean_step_s"] == best
    random.seed(0)


def test_structure_choice_scores_each_layout_once(monkeypatch):
    """Candidates equal to an earlier one (the baselines and heuristics repeat some) take its
    scores; the scores of the others are what ``score_structure`` gives."""
    from megatron_hexiseq.varlen import structure

    c = _cluster(per_node=2)
    m = get_model("gpt-tiny", overrides={"seq_length": 8192})
    o = TrainOptions()
    fixed = plan(c, m, 8192, o, time_limit_s=5, reproducible=True)
    calls = []
    real = structure.score_structure

    def counted(lay, *args):
        calls.append(structure._same_key(lay))
        return real(lay, *args)

    monkeypatch.setattr(structure, "score_structure", counted)
    docs = heavy_tailed_lengths(200, seed=4, median=256)
    _, rec = structure.choose_structure(fixed, c, m, o, docs, batches=2)
    assert len(calls) == len(set(calls)) < len(rec["candidates"])
    by_name = {r["name"]: r for r in rec["candidates"]}
    sample = pack_batches(docs, 8192, 2, structure.STRUCTURE_SEED)
    for name, lay in [("hexiseq", fixed)] + [
        (b.label, b.layout)
        for b in structure.baseline_layouts(c, m, 8192) + structure.heuristic_layouts(c, m, 8192)
        if b.layout is not None
    ]:
        mean_s, _ = real(lay, c, m, o, sample)
        assert by_name[name]["mean_step_s"] == structure._sig(mean_s), name
    assert rec["time_limit_reached"] is False


def test_plan_doc_lengths_bad_file_is_one_line_exit_2(tmp_path, capsys):
    cluster = tmp_path / "c.yaml"
    cluster.write_text(
        "name: t\nnodes:\n  - {name: a, gpu: H100-SXM-80GB, count: 2, network_GBps: 25}\n"
    )
    docs = _write(tmp_path, "d.json", "[100, -3]")
    out = tmp_path / "l.json"
    args = ["plan", "--cluster", str(cluster), "--model", "gpt-tiny", "--seq-length", "4096",
            "--doc-lengths", docs, "-o", str(out)]  # fmt: skip
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "list of positive integers" in err[0], err
    assert not out.exists()
    assert main([*args[:-2], "-o", docs]) == 2  # the output would clobber an input
    assert json.loads(open(docs).read()) == [100, -3]


def test_varlen_suite_smoke(tmp_path):
    import os
    import sys

    bench = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench")
    sys.path.insert(0, bench)
    import varlen_suite

    if not os.path.exists(varlen_suite.PROLONG_DOCS):
        pytest.skip("the shared ProLong length list is not next to this checkout")
    assert varlen_suite.main(["--smoke", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "varlen_suite.json").read_text())
    assert [r["dist"] for r in data["rows"]] == ["prolong"]
    for row in data["rows"]:
        assert set(row["speedup"]) >= {"megatron-cp-dp", "speed-aware-packing", "best-of-4"}
        assert row["tokens_per_s"]["hexiseq-global"] > 0 and row["schedule_ms_max"] > 0
    assert "| 0 |" in (tmp_path / "varlen_suite.md").read_text()
    assert (tmp_path / "varlen_suite.png").exists()


@pytest.mark.parametrize("hp", [1, 2, 8])
def test_edge_micro_batches_give_valid_assignments(setup, hp):
    from megatron_hexiseq.planner.baselines import symmetric_layout

    c, m, o, _ = setup
    rng = random.Random(hp)
    W = c.world_size
    for tokens in (W, W + 3, 4096, N):
        structure = symmetric_layout(c, replace(m, seq_length=tokens), tokens, hp)
        bp = BatchPlanner(structure, c, replace(m, seq_length=tokens), o)
        shapes = [
            [tokens],  # one document over everything
            [1] * tokens if tokens <= 4096 else [1] * 4000 + [tokens - 4000],  # 1-token documents
            [rng.randint(1, max(1, tokens // 3)) for _ in range(200)],
        ]
        for docs in shapes:
            docs = list(docs)
            while sum(docs) > tokens:
                docs.pop()
            if sum(docs) < tokens:
                docs.append(tokens - sum(docs))
            a = bp.plan(docs)
            assert same_structure(a.layout, structure) and a.layout.seq_length == tokens
            assert all(r.num_tokens >= 1 for r in a.layout.ranks)
            est = estimate_documents(a.layout, c, replace(m, seq_length=tokens), o, a.cu_seqlens)
            assert np.isfinite(est.iteration_time_s)
