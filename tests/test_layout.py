"""Layer (a), no processes: the Layout contract — valid layouts, each invalid kind, JSON round trip, schema errors."""

from __future__ import annotations

import json

import pytest

from megatron_hexiseq.errors import HexiSeqError
from megatron_hexiseq.layout import Layout, make_layout, split_evenly, zigzag_segments


def _two_groups(**over):
    kw = dict(
        seq_length=16,
        num_attention_heads=4,
        num_query_groups=2,
        group_sizes=[2, 1],
        segments=[[(0, 4), (12, 16)], [(4, 8)], [(8, 12)]],
        heads=[[0, 1, 2], [3], [0, 1, 2, 3]],
    )
    kw.update(over)
    return make_layout(**kw)


def _dict():
    return json.loads(_two_groups().to_json())


def test_valid_layout_views():
    lay = _two_groups()
    assert lay.group_segments(0) == ((0, 4), (12, 16), (4, 8))
    assert lay.group_num_tokens(0) == 12 and lay.group_num_tokens(1) == 4
    assert lay.kv_heads(0) == (0, 1) and lay.kv_heads(1) == (1,)
    assert not lay.is_symmetric()


def test_round_trip_is_exact():
    lay = _two_groups(
        predicted={"iteration_time_s": 1.5, "tokens_per_s": 10.0, "per_rank": []},
        baselines=({"name": "ring", "config": {}, "iteration_time_s": None, "tokens_per_s": None},),
        planner={"solve_time_s": 0.1, "status": "OPTIMAL"},
        meta={"chosen": "hexiseq"},
    )
    again = Layout.from_json(lay.to_json())
    assert again == lay and again.to_json() == lay.to_json()


def test_zigzag_matches_megatron():
    assert zigzag_segments(16, 2) == [[(0, 4), (12, 16)], [(4, 8), (8, 12)]]
    assert split_evenly(10, 3) == [4, 3, 3]


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda d: d["ranks"][1]["segments"].__setitem__(0, [3, 8]), "overlap"),
        (lambda d: d["ranks"][1]["segments"].__setitem__(0, [5, 8]), "belong to no rank"),
        (lambda d: d["ranks"][2]["segments"].__setitem__(0, [8, 17]), "seq_length"),
        (lambda d: d["ranks"][0]["heads"].remove(2), "held by no rank"),
        (
            lambda d: d["ranks"][1]["heads"].append(2) or d["ranks"][1]["heads"].sort(),
            "held by rank 0 and rank 1",
        ),
        (lambda d: d["ranks"][0]["heads"].append(9), "outside"),
        (lambda d: d["ranks"][0]["heads"].reverse(), "sorted"),
        (lambda d: d["groups"][1].__setitem__("ranks", [1, 2]), "is in group 0 and group 1"),
        (lambda d: d["groups"][1]["ranks"].append(9), "outside"),
        (lambda d: d.__setitem__("world_size", 4), "world_size is 4"),
        (lambda d: d["ranks"][2].__setitem__("group", 0), "says group 0"),
        (lambda d: d.__setitem__("num_query_groups", 3), "not a multiple"),
        (lambda d: d["ranks"].reverse(), "in order"),
        (lambda d: d["ranks"][0]["segments"].reverse(), "sorted and disjoint"),
    ],
)
def test_each_invalid_kind(edit, message):
    d = _dict()
    edit(d)
    with pytest.raises(HexiSeqError, match=message):
        Layout.from_dict(d)


def test_rank_with_nothing_and_group_without_tokens():
    with pytest.raises(HexiSeqError, match="neither tokens nor heads"):
        _two_groups(
            segments=[[(0, 8), (12, 16)], [], [(8, 12)]], heads=[[0, 1, 2, 3], [], [0, 1, 2, 3]]
        )
    with pytest.raises(HexiSeqError, match="owns no tokens"):
        _two_groups(segments=[[(0, 12)], [(12, 16)], []])
    # zero tokens with heads, or zero heads with tokens, is allowed
    _two_groups(segments=[[(0, 12)], [], [(12, 16)]])
    _two_groups(heads=[[0, 1, 2, 3], [], [0, 1, 2, 3]])


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda d: d.__setitem__("format", "other"), "'format' must be"),
        (lambda d: d.__setitem__("version", 2), "version 2 is not supported"),
        (lambda d: d.pop("groups"), "'groups' is a required property"),
        (lambda d: d["ranks"][0].__setitem__("heads", "all"), "at ranks/0/heads"),
        (lambda d: d.__setitem__("extra", 1), "Additional properties"),
        (lambda d: d["baselines"].append({"name": "x"}), "at baselines/0"),
    ],
)
def test_schema_errors(edit, message):
    d = _dict()
    edit(d)
    with pytest.raises(HexiSeqError, match=message):
        Layout.from_dict(d)


def test_bad_json_and_missing_file(tmp_path):
    with pytest.raises(HexiSeqError, match="not valid JSON"):
        Layout.from_json("{")
    with pytest.raises(HexiSeqError, match="does not exist"):
        Layout.load(tmp_path / "none.json")


def test_save_is_atomic_and_loads(tmp_path):
    lay = _two_groups()
    lay.save(tmp_path / "l.json")
    assert Layout.load(tmp_path / "l.json") == lay
    assert [p.name for p in tmp_path.iterdir()] == ["l.json"]
