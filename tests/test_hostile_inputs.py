"""Hostile and careless input to every command: one line on stderr and exit 2 (130 on an
interrupt), never a hang, a traceback, an unbounded message, or a clobbered or half-written file.

Layers: (a) no processes -- every input class below runs the command in-process (``cli.main``)
and checks exit code, the single ``error:`` line, its length, and that inputs are untouched and no
output is left; "checked before the long work" is proven by replacing the long work with a function
that fails the test if called. (b) real processes -- ``run_ranks`` with a hung rank (deadline) and a
wrong world size, and SIGINT/SIGTERM to ``tune``, ``profile --testbed`` and the demo in
subprocesses: exit 130, one line, every rank process gone, nothing left in the temp folder.
"""

from __future__ import annotations

import json
import math
import os
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megatron_hexiseq import __version__
from megatron_hexiseq.cli import main
from megatron_hexiseq.errors import HexiSeqError

ROOT = Path(__file__).resolve().parents[1]
MAX_LINE = 400  # an error line names a problem and what to do, values cut short

CLUSTER = """name: small
nodes:
  - {name: h0, gpu: H100-SXM-80GB, count: 2, network_GBps: 25}
  - {name: a0, gpu: A100-SXM-80GB, count: 2, network_GBps: 25}
"""
MODEL = """name: tiny
num_layers: 2
hidden_size: 64
num_attention_heads: 8
num_query_groups: 2
ffn_hidden_size: 128
vocab_size: 128
seq_length: 4096
"""
# 9 levels of 9 aliases: 9**9 = 387 million leaves if anything expanded it (a 488-byte file)
ALIAS_BOMB = (
    "["
    + ", ".join(
        [f"&a [{', '.join(['1'] * 9)}]"]
        + [f"&{chr(98 + i)} [{', '.join([f'*{chr(97 + i)}'] * 9)}]" for i in range(8)]
    )
    + "]"
)


@pytest.fixture()
def d(tmp_path):
    (tmp_path / "c.yaml").write_text(CLUSTER)
    (tmp_path / "m.yaml").write_text(MODEL)
    return tmp_path


def _error(capsys, argv, match, *, code=2):
    try:
        rc = main(argv)
    except SystemExit as e:  # argparse's own errors (OneLineParser: one line, exit 2)
        rc = e.code
    out, err = capsys.readouterr()
    assert rc == code, err + out
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err, err
    assert len(lines[0]) <= MAX_LINE, f"{len(lines[0])} characters: {lines[0][:200]}..."
    assert match in lines[0], lines[0]
    return lines[0]


def _plan(d, *extra, cluster=None, model=None, out=None):
    return [
        "plan",
        "--cluster",
        str(cluster or d / "c.yaml"),
        "--model-config",
        str(model or d / "m.yaml"),
        "--time-limit",
        "1",
        "-o",
        str(d / "out.json" if out is None else out),
        *extra,
    ]


def _stop_long_work(monkeypatch) -> None:
    """From here on the planner, the rank launcher and the demo's training fail the test if reached."""

    def reached(*a, **k):
        raise AssertionError("the long work started before the inputs were checked")

    import megatron_hexiseq.planner.plan
    import megatron_hexiseq.testbed.demo
    import megatron_hexiseq.testbed.spawn

    monkeypatch.setattr(megatron_hexiseq.planner.plan, "plan", reached)
    monkeypatch.setattr(megatron_hexiseq.testbed.spawn, "run_ranks", reached)
    monkeypatch.setattr(megatron_hexiseq.testbed.demo, "compare", reached)


@pytest.fixture()
def no_long_work(monkeypatch):
    _stop_long_work(monkeypatch)


def test_version(capsys):
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert (
        e.value.code == 0 and capsys.readouterr().out.strip() == f"megatron-hexiseq {__version__}"
    )


# ---- numbers that never end, overflow or are not numbers ---------------------------------------
@pytest.mark.parametrize(
    "argv, match",
    [
        (["tune", "--min-bucket", "0"], "--min-bucket must be a positive"),
        (["tune", "--min-bucket", "-5"], "--min-bucket must be a positive"),
        (["tune", "--max-params", "0"], "--max-params must be in"),
        (["tune", "--warmup-steps", "-1"], "--warmup-steps must be in"),
        (["tune", "--seq-length", "0"], "--seq-length must be in"),
        (["tune", "--max-params", "99999999999"], "--max-params must be in"),
        (["tune", "--world-size", "1"], "--world-size must be in"),
        (["tune", "--tolerance", "nan"], "--tolerance must be in"),
        (
            ["profile", "--testbed", "1+1", "--seconds", "nan", "-o", "{d}/c2.yaml"],
            "--seconds must be a positive",
        ),
        (
            ["profile", "--testbed", "1+1", "--seconds", "inf", "-o", "{d}/c2.yaml"],
            "--seconds must be a positive",
        ),
        (
            ["profile", "--testbed", "1+1", "--memory-gib", "nan", "-o", "{d}/c2.yaml"],
            "--memory-gib must be",
        ),
        (
            [
                "plan",
                "--cluster",
                "{d}/c.yaml",
                "--model",
                "gpt-3b",
                "--seq-length",
                "8192",
                "--time-limit",
                "nan",
                "-o",
                "{d}/o.json",
            ],
            "--time-limit must be positive",
        ),
        (
            [
                "plan",
                "--cluster",
                "{d}/c.yaml",
                "--model",
                "gpt-3b",
                "--seq-length",
                "8192",
                "--time-limit",
                "inf",
                "-o",
                "{d}/o.json",
            ],
            "--time-limit must be positive",
        ),
        (
            [
                "plan",
                "--cluster",
                "{d}/c.yaml",
                "--model",
                "gpt-3b",
                "--seq-length",
                "9" * 40,
                "-o",
                "{d}/o.json",
            ],
            "seq_length must be a positive integer",
        ),
        (
            [
                "plan",
                "--cluster",
                "{d}/c.yaml",
                "--model",
                "gpt-3b",
                "--seq-length",
                "8192",
                "--data-parallel-size",
                "9" * 30,
                "-o",
                "{d}/o.json",
            ],
            "--data-parallel-size must be a positive",
        ),
        (
            [
                "plan",
                "--cluster",
                "{d}/c.yaml",
                "--model",
                "gpt-3b",
                "--seq-length",
                "9" * 5000,
                "-o",
                "{d}/o.json",
            ],
            "argument --seq-length: invalid int value: '999",
        ),
        (
            ["plan", "--cluster", "{d}/c.yaml", "--model", "gpt-3b", "-o", "{d}/o.json"]
            + ["--frobnicate"] * 2000,
            "unrecognized arguments: --frobnicate",
        ),
        (
            ["varlen", "--cluster", "{d}/c.yaml", "--model", "gpt-3b", "--doc-lengths", "{d}/l"]
            + ["--tokens-per-batch", "4096", "--seed", "9" * 5000, "-o", "{d}/o.json"],
            "argument --seed: invalid int value: '999",
        ),
        (
            ["varlen", "--cluster", "{d}/c.yaml", "--model", "gpt-3b", "--doc-lengths", "{d}/l"]
            + ["--tokens-per-batch", "4096", "--seed", "-" + "9" * 4000, "-o", "{d}/o.json"],
            "--seed must be a non-negative integer, got <an integer of",
        ),
        (
            ["varlen", "--cluster", "{d}/c.yaml", "--model", "gpt-3b", "--doc-lengths", "{d}/l"]
            + ["--tokens-per-batch", "9" * 5000, "-o", "{d}/o.json"],
            "argument --tokens-per-batch: invalid int value: '999",
        ),
        (
            ["varlen", "--cluster", "{d}/c.yaml", "--model", "gpt-3b", "--doc-lengths", "{d}/l"]
            + ["--tokens-per-batch", "9" * 4000, "-o", "{d}/o.json"],
            "--tokens-per-batch must be a positive integer, got <an integer of",
        ),
    ],
)
def test_bad_numbers_stop_before_any_work(d, capsys, no_long_work, argv, match):
    _error(capsys, [a.replace("{d}", str(d)) for a in argv], match)
    assert sorted(p.name for p in d.iterdir()) == ["c.yaml", "m.yaml"]


@pytest.mark.parametrize(
    "edit, match",
    [
        (
            lambda s: s.replace(
                "count: 2, network_GBps: 25}", "count: 2, network_GBps: 1.0e+400}", 1
            ),
            "got inf",
        ),
        (
            lambda s: s.replace(
                "count: 2, network_GBps: 25}", "count: 2, network_GBps: 1.0e-300}", 1
            ),
            "allowed: 1e-09",
        ),
        (lambda s: s.replace("count: 2,", "count: " + "9" * 500 + ",", 1), "an integer of"),
        (
            lambda s: s.replace("count: 2,", "count: " + "9" * 30 + ",", 1),
            "count must be a positive integer",
        ),
        (
            lambda s: s + "gpus:\n  H100-SXM-80GB: {bf16_tflops: " + "9" * 400 + "}\n",
            "bf16_tflops must be",
        ),
        (lambda s: s + "gpus:\n  H100-SXM-80GB: {memory_gib: .nan}\n", "memory_gib must be"),
    ],
)
def test_cluster_numbers_out_of_range(d, capsys, edit, match):
    (d / "c.yaml").write_text(edit(CLUSTER))
    _error(capsys, _plan(d), match)
    assert not (d / "out.json").exists()


@pytest.mark.parametrize(
    "field, value, match",
    [
        ("hidden_size", "9" * 5000, "not valid YAML"),
        ("hidden_size", "9" * 300, "hidden_size must be"),
        ("num_layers", "99999999999", "at most 2147483647"),
        ("seq_length", "-3", "seq_length must be"),
        ("vocab_size", "1.5", "vocab_size must be"),
    ],
)
def test_model_sizes_out_of_range(d, capsys, field, value, match):
    (d / "m.yaml").write_text(MODEL.replace(f"{field}: ", f"{field}: {value} #", 1))
    _error(capsys, _plan(d), match)


# ---- files that are not what they claim ---------------------------------------------------------
@pytest.mark.parametrize("which", ["cluster", "model"])
def test_yaml_alias_bomb_gives_a_short_error(d, capsys, which):
    if which == "cluster":
        (d / "c.yaml").write_text(CLUSTER.replace("count: 2,", f"count: {ALIAS_BOMB},", 1))
    else:
        (d / "m.yaml").write_text(MODEL.replace("num_layers: 2", f"num_layers: {ALIAS_BOMB}"))
    assert len((d / f"{which[0]}.yaml").read_text()) < 1000
    line = _error(capsys, _plan(d), "count must be" if which == "cluster" else "num_layers must be")
    assert "..." in line


@pytest.mark.parametrize(
    "which, text, match",
    [
        ("c.yaml", CLUSTER + "name: again\n", "'name' appears twice"),
        (
            "c.yaml",
            CLUSTER.replace(
                "count: 2, network_GBps: 25}", "count: 2, count: 4, network_GBps: 25}", 1
            ),
            "'count' appears twice",
        ),
        ("m.yaml", MODEL + "num_layers: 4\n", "'num_layers' appears twice"),
    ],
)
def test_duplicate_yaml_keys_are_errors(d, capsys, which, text, match):
    (d / which).write_text(text)
    _error(capsys, _plan(d), match)


def _layout(d, capsys) -> Path:
    assert main(_plan(d, "--reproducible", "--format", "json")) == 0
    capsys.readouterr()
    return d / "out.json"


def test_non_utf8_in_every_reader(d, capsys):
    layout = _layout(d, capsys)
    bad = b"name: caf\xe9\n"
    for name in ("c.yaml", "m.yaml"):
        good = (d / name).read_bytes()
        (d / name).write_bytes(good + bad)
        _error(capsys, _plan(d, out=d / "o2.json"), "is not UTF-8 text")
        (d / name).write_bytes(good)
    (d / "l.json").write_bytes(layout.read_bytes()[:-3] + b"\xff}\n")
    for argv in (
        ["show", str(d / "l.json")],
        ["validate", str(d / "l.json")],
        ["simulate", "--layout", str(d / "l.json"), "--baselines"],
        ["tune", "--from-result", str(d / "l.json")],
    ):
        _error(capsys, argv, "is not UTF-8 text")


def test_huge_or_deep_json(d, capsys, monkeypatch):
    (d / "deep.json").write_text("[" * 200_000 + "]" * 200_000)
    _error(capsys, ["show", str(d / "deep.json")], "nested too deeply")
    (d / "bigint.json").write_text('{"format": ' + "9" * 10_000 + "}")
    _error(capsys, ["validate", str(d / "bigint.json")], "not valid JSON")
    import megatron_hexiseq.io

    monkeypatch.setattr(megatron_hexiseq.io, "MAX_INPUT_BYTES", 1 << 10)
    (d / "big.json").write_text("[" + "0, " * 2000 + "0]")
    _error(capsys, ["show", str(d / "big.json")], "MiB, more than the")


# ---- document lengths: varlen, plan --doc-lengths ------------------------------------------------
def test_many_one_token_documents_plan_within_the_time_limit(d, capsys):
    """65,536 one-token documents per micro-batch are valid: ``plan --doc-lengths`` plans them, and
    --time-limit bounds the structure choice (past it only the planner's own layout is scored)."""
    (d / "ones.json").write_text("[1]")
    argv = _plan(d, "--seq-length", "65536", "--doc-lengths", str(d / "ones.json"))
    argv[argv.index("--time-limit") + 1] = "0.001"
    assert main([*argv, "--format", "json"]) == 0, capsys.readouterr().err
    capsys.readouterr()
    layout = json.loads((d / "out.json").read_text())
    rec = layout["planner"]["documents"]
    assert rec["time_limit_reached"] is True and layout["planner"]["time_limit_reached"] is True
    assert rec["chosen"] == "hexiseq" and rec["candidates"][0]["mean_step_s"] > 0
    assert len(rec["candidates"]) > 1
    assert all(r["reason"] == "not scored: time limit" for r in rec["candidates"][1:])


@pytest.mark.parametrize(
    "text, match",
    [
        ("[9223372036854775808]", "entry 0 is 9223372036854775808 (at most 2^63 - 1)"),
        ("[1, " + "9" * 400 + "]", "entry 1 is <an integer of 400 digits> (at most 2^63 - 1)"),
        ("[1, 2.5]", "entry 1 is 2.5"),
        ("[1, true]", "entry 1 is True"),
        ("[1, 0]", "entry 1 is 0"),
        ("[" + "9" * 5000 + "]", "is not valid JSON: 'Exceeds the limit"),
        ("[" + "[1], " * 10_000 + "1]", "entry 0 is [1]"),
    ],
)
def test_document_lengths_an_int64_cannot_hold(d, capsys, no_long_work, text, match):
    """Lengths of 2^63 and more (or not positive integers): one line before any planning, in
    ``plan --doc-lengths`` and ``varlen`` (it was an OverflowError traceback after the plan)."""
    (d / "docs.json").write_text(text)
    docs = ["--doc-lengths", str(d / "docs.json")]
    _error(capsys, _plan(d, "--seq-length", "4096", *docs), match)
    varlen = ["varlen", "--cluster", str(d / "c.yaml"), "--model-config", str(d / "m.yaml")]
    _error(capsys, [*varlen, *docs, "--tokens-per-batch", "4096", "-o", str(d / "v.json")], match)
    assert not (d / "out.json").exists() and not (d / "v.json").exists()


def test_the_longest_document_length_plans(d, capsys):
    """2^63 - 1 tokens is a valid length (every micro-batch is a cut piece of it)."""
    (d / "docs.json").write_text(f"[{2**63 - 1}, 5]")
    argv = _plan(d, "--seq-length", "4096", "--doc-lengths", str(d / "docs.json"))
    assert main([*argv, "--format", "json"]) == 0, capsys.readouterr().err
    capsys.readouterr()
    assert json.loads((d / "out.json").read_text())["planner"]["documents"]["documents"] == 2


@pytest.mark.parametrize(
    "edit, match",
    [
        (lambda m: m.update(options=[1, 2]), "meta.options must be a mapping"),
        (lambda m: m["options"].update(memory_mode=5), "meta.options.memory_mode must be str"),
        (lambda m: m["options"].update(memory_mode="zero3"), "memory_mode must be one of"),
        (lambda m: m["options"].update(recompute="yes"), "meta.options.recompute must be bool"),
        (
            lambda m: m["options"].update(capacity_fraction=float("nan")),
            "meta.options.capacity_fraction is nan",
        ),
        (
            lambda m: m.update(cluster_spec={"nodes": "x" * 10_000}),
            "'nodes' must be a non-empty list",
        ),
        (lambda m: m.pop("cluster_spec"), "does not record its cluster spec"),
    ],
)
def test_hand_edited_layout_meta(d, capsys, edit, match):
    layout = json.loads(_layout(d, capsys).read_text())
    edit(layout["meta"])
    (d / "edited.json").write_text(json.dumps(layout))
    _error(capsys, ["simulate", "--layout", str(d / "edited.json"), "--baselines"], match)


@pytest.mark.parametrize(
    "edit, match",
    [
        (lambda r: r["config"].update(bucket_size="abc"), "malformed"),
        (lambda r: r["config"].update(bucket_size=-5), "bucket_size must be a positive"),
        (lambda r: r["config"].update(comm_chunks="many"), "malformed"),
        (lambda r: r.update(trials=[{"levels": [0], "y_us": "fast"}]), "malformed"),
        (lambda r: r.pop("config"), "not an overlap tuning result"),
        (lambda r: r.update(format_version=[[1]] * 10_000), "format_version"),
    ],
)
def test_tune_from_result_bad_values(d, capsys, edit, match):
    result = {
        "format_version": 1,
        "config": {"overlap_grad_reduce": True, "bucket_size": 1000, "comm_chunks": 1},
        "levels": [1],
        "ladders": [],
        "trials": [],
    }
    from megatron_hexiseq.overlap.results import FORMAT_VERSION

    result["format_version"] = FORMAT_VERSION
    edit(result)
    (d / "r.json").write_text(json.dumps(result))
    _error(
        capsys,
        ["tune", "--from-result", str(d / "r.json"), "--nccl-yaml", str(d / "n.yaml")],
        match,
    )
    assert not (d / "n.yaml").exists()


# ---- outputs that would clobber something -------------------------------------------------------
def test_output_equal_to_an_input_is_refused(d, capsys, no_long_work):
    before = {p.name: p.read_bytes() for p in d.iterdir()}
    _error(capsys, _plan(d, out=d / "c.yaml"), "is also an input")
    _error(capsys, _plan(d, out=d / "m.yaml"), "is also an input")
    _error(
        capsys,
        ["profile", "--testbed", "1+1", "-o", str(d / "x.yaml"), "--raw", str(d / "x.yaml")],
        "are the same file",
    )
    _error(
        capsys,
        [
            "profile",
            "--testbed",
            "1+1",
            "--model-config",
            str(d / "m.yaml"),
            "-o",
            str(d / "m.yaml"),
        ],
        "is also an input",
    )
    (d / "r.json").write_text("{}")
    _error(
        capsys,
        ["tune", "--from-result", str(d / "r.json"), "--out", str(d / "r.json")],
        "is also an input",
    )
    assert {p.name: p.read_bytes() for p in d.iterdir() if p.name != "r.json"} == before


@pytest.mark.skipif(not os.path.exists("/dev/full"), reason="no /dev/full")
def test_device_directory_empty_and_unwritable_outputs(d, capsys, no_long_work):
    _error(capsys, _plan(d, out="/dev/full"), "is not a regular file")
    assert stat.S_ISCHR(os.stat("/dev/full").st_mode)  # the device node is still there
    _error(capsys, _plan(d, out=d), "is a directory")
    _error(capsys, _plan(d, out=""), "is empty")
    _error(capsys, _plan(d, out=d / "missing" / "o.json"), "does not exist; create it first")
    if os.path.isdir("/proc/self"):  # procfs: unwritable even for root
        _error(capsys, _plan(d, out="/proc/o.json"), "cannot write -o /proc/o.json")
    if os.geteuid() != 0:  # root writes into a read-only folder anyway
        ro = d / "ro"
        ro.mkdir()
        ro.chmod(0o555)
        _error(capsys, _plan(d, out=ro / "o.json"), "cannot write")


def test_symlinked_output_is_refused(d, capsys, no_long_work):
    target = d / "precious.png"
    target.write_bytes(b"keep me")
    (d / "link.png").symlink_to(target)
    _error(
        capsys,
        [
            "simulate",
            "--cluster",
            str(d / "c.yaml"),
            "--model",
            "gpt-3b",
            "--seq-length",
            "8192",
            "--baselines",
            "--plot",
            str(d / "link.png"),
        ],
        "is a symbolic link",
    )
    (d / "link.json").symlink_to(target)
    _error(capsys, _plan(d, out=d / "link.json"), "is a symbolic link")
    assert target.read_bytes() == b"keep me"


def test_plot_with_unsupported_extension_fails_first(d, capsys, no_long_work):
    _error(
        capsys,
        [
            "simulate",
            "--cluster",
            str(d / "c.yaml"),
            "--model",
            "gpt-3b",
            "--seq-length",
            "8192",
            "--baselines",
            "--plot",
            str(d / "sim.xyz"),
        ],
        "cannot write a figure as .xyz",
    )
    sim = ["simulate", "--cluster", str(d / "c.yaml"), "--model", "gpt-3b", "--seq-length", "8192"]
    for path, match in (
        (str(d / ("x" * 5000)), "cannot write a figure as a file without a suffix"),
        (str(d / ("x" * 5000)) + ".png", "the file name is 5004 bytes, more than the"),
        (str(d) + "/x" * 2500 + ".png", "the path is"),
        (str(d / "a\nb" / "c.png"), "a\\nb does not exist"),  # one line: the newline escaped
    ):
        line = _error(capsys, [*sim, "--baselines", "--plot", path], match)
        assert "x" * 200 not in line


def test_demo_checks_every_output_before_training(d, capsys, monkeypatch):
    from megatron_hexiseq.testbed import demo

    layout = _layout(d, capsys)
    _stop_long_work(monkeypatch)
    base = [
        "--cluster",
        str(d / "c.yaml"),
        "--layout",
        str(layout),
        "--model-config",
        str(d / "m.yaml"),
        "--testbed",
        "1+1",
        "--steps",
        "2",
        "--warmup",
        "1",
    ]
    png = str(d / "demo.png")
    for extra, match in (
        (["-o", str(d / "demo.json"), "--plot", str(d / "demo.bad")], "cannot write a figure"),
        (["-o", str(d / "no" / "demo.json"), "--plot", png], "does not exist"),
        (["-o", str(layout), "--plot", png], "is also an input"),
        (["-o", png, "--plot", png], "are the same file"),
    ):
        assert demo.main(base + extra) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and match in err[0], err
    assert not (d / "demo.json").exists()


def _demo_sh(tmp_path: Path, **env: str) -> subprocess.CompletedProcess:
    """scripts/demo.sh with a stand-in venv: its python runs this interpreter on this checkout, its
    megatron-hexiseq (the 30-s profile, the plan) only leaves a MARK file."""
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True, exist_ok=True)
    for name, body in (
        ("python", f'exec {sys.executable} "$@"'),
        ("megatron-hexiseq", f"touch {tmp_path / 'MARK'}; exit 1"),
    ):
        (venv / "bin" / name).write_text(f"#!/bin/sh\n{body}\n")
        (venv / "bin" / name).chmod(0o755)
    (venv / ".hexiseq-installed").write_text("test")  # newer than setup.py: no installation
    full = {
        "PATH": "/usr/bin:/bin",
        "VENV": str(venv),
        "HEXISEQ_EXTRAS": "test",
        "OUT": str(tmp_path / "out"),
        "PYTHONPATH": str(ROOT),
        **env,
    }
    return subprocess.run(
        ["bash", str(ROOT / "scripts" / "demo.sh")],
        capture_output=True,
        text=True,
        env=full,
        cwd=tmp_path,
        timeout=120,
    )


@pytest.mark.parametrize(
    "env, match",
    [
        ({"PACKED": "yes"}, "PACKED must be 0 or 1, got 'yes'"),
        ({"PACKED": "1 "}, "PACKED must be 0 or 1"),
        ({"PACKED": "x" * 100_000}, "PACKED must be 0 or 1, got 'xxx"),
        ({"STEPS": "3O"}, "STEPS must be a positive integer"),
        ({"SEQ": "-1"}, "SEQ must be a positive integer"),
        ({"PACKED": "1", "DOCS": "DOCS.json"}, "entry 0 is 9223372036854775808 (at most 2^63"),
        ({"PACKED": "1", "DOCS": "missing.json"}, "missing.json does not exist"),
    ],
)
def test_demo_script_checks_its_knobs_first(tmp_path, env, match):
    """The demo's knobs (and with PACKED=1 its document lengths) are one line and exit 2 before
    the set-up, the profile and the plan (PACKED=yes ran the unpacked demo; a length of 2^63 was a
    traceback after 31 s of profile and plan)."""
    (tmp_path / "DOCS.json").write_text("[9223372036854775808]")
    env = {k: v.replace("DOCS.json", str(tmp_path / "DOCS.json")) for k, v in env.items()}
    res = _demo_sh(tmp_path, **env)
    _one_line(res, match)
    assert not (tmp_path / "MARK").exists() and not (tmp_path / "out").exists()


@pytest.mark.parametrize("packed", ["0", "1"])
def test_demo_script_valid_knobs_reach_the_profile(tmp_path, packed):
    (tmp_path / "docs.json").write_text(f"[{2**63 - 1}, 512]")
    res = _demo_sh(tmp_path, PACKED=packed, DOCS=str(tmp_path / "docs.json"), STEPS="5")
    assert res.returncode == 1 and (tmp_path / "MARK").exists(), res.stderr  # the stand-in profile


def test_written_files_follow_the_umask(d, capsys):
    old = os.umask(0o022)
    try:
        layout = _layout(d, capsys)
    finally:
        os.umask(old)
    assert stat.S_IMODE(layout.stat().st_mode) == 0o644
    assert not [p for p in d.iterdir() if p.name.startswith(".")]  # no temporary file left


def test_hosts_for_a_slurm_node_list(d, capsys):
    assert main(_plan(d, "--hosts", "gpu[01-02]", "--format", "json")) == 0
    lay = json.loads(capsys.readouterr().out)
    assert [r["host"] for r in lay["ranks"]] == ["gpu01"] * 2 + ["gpu02"] * 2
    _error(capsys, _plan(d, "--hosts", "gpu[01-03]"), "3 host name(s) for 2 node(s)")
    _error(capsys, _plan(d, "--hosts", "gpu[01-02"), "unbalanced brackets")


# ---- module CLIs: inputs never clobbered, specs through the loader -------------------------------
def _module_error(capsys, entry, argv, match):
    rc = entry(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and err[0].startswith("error: ") and match in err[0], err
    assert len(err[0]) <= MAX_LINE


def test_launch_helpers_never_clobber_their_input(d, capsys):
    from megatron_hexiseq import elastic, slurm
    from megatron_hexiseq.megatron import launch

    before = (d / "c.yaml").read_bytes()
    c = str(d / "c.yaml")
    _module_error(capsys, launch.main, ["replica0", "--cluster", c, "-o", c], "is also an input")
    _module_error(
        capsys, slurm.main, ["cluster", "--cluster", c, "--hosts", "x,y", "-o", c], "also an input"
    )
    _module_error(
        capsys,
        elastic.main,
        ["exclude", "--cluster", c, "--exclude", "h0", "-o", c],
        "also an input",
    )
    assert (d / "c.yaml").read_bytes() == before


@pytest.mark.parametrize(
    "count, match", [("'8'", "count must be a positive integer, got '8'"), ("0", "got 0")]
)
def test_launch_reads_the_cluster_through_the_loader(d, capsys, count, match):
    from megatron_hexiseq.megatron import launch

    (d / "c.yaml").write_text(CLUSTER.replace("count: 2", f"count: {count}", 1))
    _module_error(
        capsys,
        launch.main,
        ["replica0", "--cluster", str(d / "c.yaml"), "-o", str(d / "o.yaml")],
        match,
    )
    _module_error(
        capsys, launch.main, ["ranks", "--cluster", str(d / "c.yaml"), "--layout", "x"], match
    )
    assert not (d / "o.yaml").exists()


def test_module_cli_argument_errors_are_one_line(d, capsys):
    from megatron_hexiseq import elastic, slurm
    from megatron_hexiseq.megatron import launch

    for entry, argv in (
        (launch.main, ["replica0", "--cluster", "c", "--data-parallel", "x", "-o", "o"]),
        (slurm.main, ["nothing"]),
        (elastic.main, ["exclude"]),
    ):
        with pytest.raises(SystemExit) as e:
            entry(argv)
        err = capsys.readouterr().err.strip().splitlines()
        assert e.value.code == 2 and len(err) == 1 and err[0].startswith("error: "), err


# ---- sizes past the documented maxima: refused at once, never a hang ---------------------------
def _big_cluster(d: Path, nodes: int, count: int) -> Path:
    lines = ["name: big", "nodes:"] + [
        f"  - {{name: n{i}, gpu: H100-SXM-80GB, count: {count}, network_GBps: 25}}"
        for i in range(nodes)
    ]
    (d / "big.yaml").write_text("\n".join(lines) + "\n")
    return d / "big.yaml"


@pytest.mark.parametrize(
    "nodes, count, match",
    [
        (1, 100_000, "100,000 GPUs, more than the 65,536 a cluster spec may have"),
        (1025, 1, "plan and simulate take at most 4,096 GPUs in 1,024 nodes"),
        (1, 4097, "plan and simulate take at most 4,096 GPUs"),
    ],
)
def test_plan_refuses_clusters_past_the_maximum(d, capsys, no_long_work, nodes, count, match):
    big = _big_cluster(d, nodes, count)
    start = time.monotonic()
    _error(capsys, _plan(d, cluster=big), match)
    _error(
        capsys,
        ["simulate", "--cluster", str(big), "--model-config", str(d / "m.yaml"), "--baselines"],
        match,
    )
    assert time.monotonic() - start < 60


def test_huge_yaml_is_refused_before_parsing(d, capsys, no_long_work):
    (d / "huge.yaml").write_text("name: x\nnodes:\n" + "# padding\n" * 500_000)
    _error(capsys, _plan(d, cluster=d / "huge.yaml"), "more than the 4 MiB")


@pytest.mark.parametrize(
    "shape, match",
    [
        ("1+99999999999999999999", "must look like '1+2'"),
        ("1+1000", "has 1001 ranks; the CPU testbed runs at most 64"),
        ("9" * 5000, "must look like '1+2'"),
        ("1+-1", "must look like '1+2'"),
        ("1+0", "every core needs at least one rank"),
    ],
)
def test_testbed_size_is_capped(d, capsys, no_long_work, shape, match):
    _error(capsys, ["profile", "--testbed", shape, "-o", str(d / "p.yaml")], match)
    assert not (d / "p.yaml").exists()


# ---- user text that int() or a parser would choke on --------------------------------------------
@pytest.mark.parametrize(
    "flag, value, match",
    [
        ("--exclude", "h0:²", "cannot read 'h0:²'"),
        ("--exclude", "h0:" + "9" * 5000, "cannot read"),
        ("--exclude", "h0:-1", "cannot read"),
        ("--exclude", "a/b", "cannot read 'a/b'"),
        ("--exclude", "..:1", "cannot read"),
        ("--exclude", ",,,", "--exclude is empty"),
        ("--hosts", "gpu[0-" + "9" * 5000 + "]", "is not a number or a range"),
        ("--hosts", "gpu[0-999999]-[0-999999]", "names 1,000,000,000,000 hosts"),
        ("--hosts", "gpu[[1-2]]", "nested or unbalanced"),
        ("--hosts", "gpu1]", "unbalanced brackets"),
        ("--hosts", "", "the host list is empty"),
        ("--hosts", "a:1,b", "'a:1' is not a host name"),
        ("--hosts", "a/b,c", "is not a host name"),
    ],
)
def test_exclusions_and_host_lists(d, capsys, no_long_work, flag, value, match):
    start = time.monotonic()
    _error(capsys, _plan(d, flag, value), match)
    assert time.monotonic() - start < 30
    assert not (d / "out.json").exists()


def test_module_helpers_read_numbers_safely(d, capsys):
    from megatron_hexiseq import elastic, slurm

    c, o = str(d / "c.yaml"), str(d / "o.yaml")
    _module_error(
        capsys,
        elastic.main,
        ["exclude", "--cluster", c, "--exclude", "h0:" + "9" * 5000, "-o", o],
        "cannot read",
    )
    _module_error(
        capsys,
        elastic.main,
        ["exclude", "--cluster", c, "--exclude", "h0:٣", "-o", o],
        "cannot read",
    )
    _module_error(capsys, slurm.main, ["hostnames", "x[" + "1" * 5000 + "]"], "not a number")
    _module_error(capsys, slurm.main, ["hostnames", "gpu[0-999999]-[0-999999]"], "more than the")
    _module_error(
        capsys, slurm.main, ["cluster", "--cluster", c, "--hosts", "a,a", "-o", o], "must be unique"
    )
    assert not (d / "o.yaml").exists()


def test_repeated_exclusions_are_recorded_once(d, capsys):
    assert main(_plan(d, "--exclude", ",".join(["h0:1"] * 10_000), "--reproducible")) == 0
    capsys.readouterr()
    meta = json.loads((d / "out.json").read_text())["meta"]
    assert meta["excluded"] == ["h0:1"] and meta["gpu_indices"] == {"h0": [0]}


@pytest.mark.parametrize("name", ["h:0", "a,b", "a b", "a/b", "..", "-x", "", "x" * 129, "h0\n"])
def test_node_names_that_break_launchers(d, capsys, no_long_work, name):
    (d / "c.yaml").write_text(CLUSTER.replace("name: h0", f"name: {json.dumps(name)}"))
    _error(capsys, _plan(d), "nodes[0]" if name else "nodes[0].name")


@pytest.mark.parametrize("name", ["x\ny", "x\n", "a b", "", "x" * 129, "-x"])
def test_cluster_names_follow_the_name_rule(d, capsys, no_long_work, name):
    """A cluster's own name is printed in tables and messages: the name rule (and '+', as in the
    testbed's cpu-testbed-1+2), in a spec ``plan`` reads and in ``profile --name``."""
    (d / "c.yaml").write_text(CLUSTER.replace("name: small", f"name: {json.dumps(name)}"))
    match = "" if name == "" else "is not a cluster name"
    _error(capsys, _plan(d), match)
    argv = ["profile", "--testbed", "1+1", f"--name={name}", "-o", str(d / "p.yaml")]
    _error(capsys, argv, "--name ")
    assert not (d / "p.yaml").exists() and not (d / "out.json").exists()


def test_long_or_folder_outputs(d, capsys, no_long_work):
    _error(capsys, _plan(d, out=str(d / ("x" * 300 + ".json"))), "more than the 255")
    (d / "sub").mkdir()
    _error(capsys, _plan(d, out=str(d / "sub") + "/"), "names a folder")
    _error(capsys, _plan(d, out=str(d / "new") + "/"), "names a folder")
    assert list((d / "sub").iterdir()) == [] and not (d / "new").exists()


# ---- tampered layouts -------------------------------------------------------------------------
def _edit_layout(d, capsys, edit) -> Path:
    text = _layout(d, capsys).read_text()
    data = json.loads(text)
    out = edit(data)
    (d / "edited.json").write_text(out if isinstance(out, str) else json.dumps(data))
    return d / "edited.json"


@pytest.mark.parametrize(
    "edit, match",
    [
        (
            lambda L: L["predicted"].update(iteration_time_s=float("nan")),
            "predicted.iteration_time_s is nan",
        ),
        (lambda L: L["predicted"].update(tokens_per_s=float("inf")), "is inf; numbers in a layout"),
        (lambda L: L["planner"].update(x=float("-inf")), "planner.x is -inf"),
        (lambda L: L.update(seq_length=2**31), "at seq_length: must be at most 2147483647"),
        (lambda L: L.update(num_query_groups=1), "meta.model_spec.num_query_groups is 2"),
        (lambda L: L["meta"]["model_spec"].update(num_attention_heads=16), "edited"),
        (lambda L: L["meta"].update(options="fast"), "meta.options must be a mapping"),
        (lambda L: L["meta"]["options"].update(megatron_flags=5), "megatron_flags must be list"),
        (
            lambda L: L["meta"]["options"].update(megatron_flags=["--a b"]),
            "megatron_flags must be a list of flags",
        ),
        (lambda L: L["meta"].update(model_spec="gpt"), "meta.model_spec must be a mapping"),
        (lambda L: L["meta"].update(gpu_indices={"h0": [1, 1]}), "meta.gpu_indices.'h0'"),
        (lambda L: L["meta"].update(gpu_indices={"h0": "all"}), "meta.gpu_indices.'h0'"),
        (lambda L: L["meta"].update(gpu_indices={"h0": [0]}), "at least one per rank there (2)"),
        (lambda L: L["meta"].update(gpu_indices=[0]), "meta.gpu_indices must be a mapping"),
        (lambda L: L["ranks"][0].update(host="h0:1"), "must be a host name"),
        (lambda L: L["ranks"][0].update(host="a b"), "must be a host name"),
        (
            lambda L: json.dumps(L).replace('"seq_length"', '"seq_length": 1, "seq_length"', 1),
            "appears twice",
        ),
    ],
)
def test_tampered_layouts(d, capsys, edit, match):
    path = _edit_layout(d, capsys, edit)
    for argv in (["show", str(path)], ["validate", str(path)], ["simulate", "--layout", str(path)]):
        _error(capsys, argv, match)


def test_validate_checks_memory_as_simulate_does(d, capsys):
    layout = _layout(d, capsys)
    # 4 MiB per GPU: under the tiny model's ~9 MB per rank
    small = CLUSTER.replace("network_GBps: 25}", "network_GBps: 25, memory_gib: 0.004}")
    (d / "small.yaml").write_text(small)
    _error(
        capsys,
        ["validate", str(layout), "--cluster", str(d / "small.yaml")],
        "does not fit the memory",
    )
    assert (
        main(
            [
                "simulate",
                "--layout",
                str(layout),
                "--cluster",
                str(d / "small.yaml"),
                "--format",
                "json",
            ]
        )
        == 0
    )
    rows = json.loads(capsys.readouterr().out)
    assert rows[0]["feasible"] is False
    assert main(["validate", str(layout), "--cluster", str(d / "c.yaml")]) == 0
    assert "fits its memory" in capsys.readouterr().out


def test_simulate_takes_the_model_from_the_layout(d, capsys):
    """--help: the model defaults to the layout's, also with --cluster."""
    layout = _layout(d, capsys)
    assert (
        main(
            [
                "simulate",
                "--layout",
                str(layout),
                "--cluster",
                str(d / "c.yaml"),
                "--format",
                "json",
            ]
        )
        == 0
    )
    rows = json.loads(capsys.readouterr().out)
    assert len(rows) == 1 and rows[0]["feasible"] is True
    _error(capsys, ["simulate", "--cluster", str(d / "c.yaml"), "--baselines"], "give --model NAME")


# ---- argument errors before torch and megatron.core ---------------------------------------------
@pytest.mark.parametrize(
    "argv, match",
    [
        (["tune", "--model", "gpt-7b", "--min-bucket", str(10**30)], "is more than the model's"),
        (["tune", "--model", "gpt-7b", "--world-size", "1000"], "--world-size must be in"),
        (["tune", "--model", "nope"], "nope"),
        (["tune", "--model", "gpt-7b", "--out", "{d}/missing/x.json"], "does not exist"),
        (["profile", "--testbed", "1+1000", "-o", "p.yaml"], "at most 64"),
        (["DEMO", "--testbed", "1+1+1+1+1", "--steps", "2", "--warmup", "1"], "has 5"),
        (["DEMO", "--testbed", "1+1", "--steps", "2", "--warmup", "5"], "--steps (2) must exceed"),
        (["DEMO", "--testbed", "1+1", "--steps", "x"], "invalid int value"),
        (["PRETRAIN", "--hexiseq-layout", "missing.json"], "does not exist"),
        (["PRETRAIN", "--num-layers", "2", "--hexiseq-layout=m.yaml"], "is not valid JSON"),
    ],
)
def test_argument_errors_come_before_heavy_imports(d, capsys, argv, match):
    """In a fresh interpreter: one line, exit 2, and torch never imported (5-40 s on a busy machine).
    Missing folders are made under ``d`` (tmp_path), never taken from the host ('/nonexistent' is
    the home of ``nobody`` on many images)."""
    layout = _layout(d, capsys)
    argv = [a.replace("{d}", str(d)) for a in argv]
    if argv[0] == "DEMO":
        entry = "from megatron_hexiseq.testbed.demo import main"
        argv = [
            "--cluster",
            str(d / "c.yaml"),
            "--layout",
            str(layout),
            "--model-config",
            str(d / "m.yaml"),
            "-o",
            str(d / "demo.json"),
            "--plot",
            str(d / "demo.png"),
            *argv[1:],
        ]
    elif argv[0] == "PRETRAIN":
        entry = "from megatron_hexiseq.pretrain_gpt import main as m; main = lambda a: (sys.argv.__setitem__(slice(1, None), a), m())[1]"
        argv = argv[1:]
    else:
        entry = "from megatron_hexiseq.cli import main"
    code = (
        f"import sys; {entry}; rc = main({argv!r}); "
        "assert 'torch' not in sys.modules, 'torch imported'; sys.exit(rc)"
    )
    res = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=d,
        timeout=120,
        env={
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        },
    )
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2 and len(lines) == 1 and match in lines[0], res.stderr


def test_tune_parent_does_not_repeat_megatron_warnings(d):
    """The Apex / Transformer Engine warnings are silenced in the parent as in the rank processes."""
    from megatron_hexiseq.overlap.results import FORMAT_VERSION

    result = {
        "format_version": FORMAT_VERSION,
        "config": {"overlap_grad_reduce": True, "bucket_size": 1000, "comm_chunks": 1},
        "levels": [1],
        "ladders": [],
        "trials": [],
    }
    (d / "r.json").write_text(json.dumps(result))
    res = subprocess.run(
        [sys.executable, "-m", "megatron_hexiseq", "tune", "--from-result", str(d / "r.json")],
        capture_output=True,
        text=True,
        timeout=300,
        env={
            **os.environ,
            "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        },
    )
    assert res.returncode == 0, res.stderr
    assert "not installed" not in res.stderr, res.stderr


def test_patched_entry_checks_the_layout_before_pretrain(d, capsys, monkeypatch):
    """The patched pretrain_gpt.py calls help_with_hexiseq_flags first: a bad --hexiseq-layout ends
    there (one line, exit 2), before Megatron parses or starts a process group."""
    pytest.importorskip("megatron.training")
    from megatron_hexiseq.megatron import plugin

    (d / "bad.json").write_text("{")
    monkeypatch.setattr(
        sys,
        "argv",
        ["pretrain_gpt.py", "--num-layers", "2", "--hexiseq-layout", str(d / "bad.json")],
    )
    with pytest.raises(SystemExit) as e:
        plugin.help_with_hexiseq_flags()
    err = capsys.readouterr().err.strip().splitlines()
    assert e.value.code == 2 and len(err) == 1 and "is not valid JSON" in err[0], err
    monkeypatch.setattr(sys, "argv", ["pretrain_gpt.py", "--num-layers", "2"])
    plugin.help_with_hexiseq_flags()  # no layout, no --help: nothing happens


# ---- the sbatch script: every variable is data -------------------------------------------------
SBATCH = ROOT / "scripts" / "slurm" / "hexiseq.sbatch"


def _sbatch(tmp_path: Path, **env: str) -> subprocess.CompletedProcess:
    """The sbatch script in a dry run outside SLURM (no scontrol: python-hostlist expands)."""
    full = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "HEXISEQ_"))}
    full.update(
        PATH=f"{Path(sys.executable).parent}:/usr/bin:/bin",
        PYTHON=sys.executable,
        DRY_RUN="1",
        GPU_TYPES="H100-SXM-80GB",
        MODEL="gpt-7b",
        SEQ_LENGTH="131072",
        WORKDIR=str(tmp_path / "wd"),
        PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    )
    full.update(env)
    return subprocess.run(
        ["bash", str(SBATCH)], capture_output=True, text=True, env=full, cwd=tmp_path, timeout=120
    )


def _one_line(res: subprocess.CompletedProcess, match: str) -> None:
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2, res.stderr + res.stdout
    assert len(lines) == 1 and lines[0].startswith("error: ") and match in lines[0], res.stderr
    assert len(lines[0]) <= MAX_LINE


@pytest.mark.parametrize(
    "env, match",
    [
        (
            {"SLURM_HET_SIZE": "HOSTS[$(touch MARK)]", "SLURM_JOB_NODELIST_HET_GROUP_0": "gpu01"},
            "SLURM_HET_SIZE must be an integer",
        ),
        ({"SLURM_JOB_NODELIST": "gpu01", "DATA_PARALLEL": "a[$(touch MARK)]"}, "DATA_PARALLEL"),
        ({"HEXISEQ_NODES": "gpu01", "SEQ_LENGTH": "x[$(touch MARK)]"}, "SEQ_LENGTH"),
        ({"HEXISEQ_NODES": "gpu01", "MASTER_PORT": "abc"}, "MASTER_PORT must be an integer"),
        ({"HEXISEQ_NODES": "gpu01", "MASTER_PORT": "70000"}, "MASTER_PORT must be an integer"),
        ({"HEXISEQ_NODES": "gpu01", "GPUS_PER_NODE": "abc"}, "GPUS_PER_NODE must be an integer"),
        (
            {"HEXISEQ_NODES": "gpu01", "GPUS_PER_NODE": "8, memory_gib: 1000"},
            "GPUS_PER_NODE must be an integer",
        ),
        ({"HEXISEQ_NODES": "gpu01", "NETWORK_GBPS": "25, memory_gib: 1"}, "NETWORK_GBPS"),
        ({"HEXISEQ_NODES": "gpu01", "GPU_TYPES": "H100-SXM-80GB}"}, "GPU_TYPES must be a name"),
        ({"HEXISEQ_NODES": "gpu01", "MODEL": "$(touch MARK)"}, "MODEL must be a name"),
        ({"HEXISEQ_NODES": "gpu01", "DRY_RUN": "yes"}, "DRY_RUN must be one of"),
        ({"HEXISEQ_NODES": "gpu01", "ENTRY": "x;touch MARK"}, "ENTRY must be one of"),
        ({"HEXISEQ_NODES": "*"}, "is not a host name"),
        ({"HEXISEQ_NODES": "gpu[[1-2]]"}, "nested or unbalanced"),
        ({"HEXISEQ_NODES": "gpu[0-999999]-[0-999999]"}, "more than the 16,384 allowed"),
        ({"HEXISEQ_NODES": "a:1 b"}, "is not a host name"),
        (
            {"HEXISEQ_NODES": "gpu1 gpu2", "GPU_TYPES": "H100-SXM-80GB A100-SXM-80GB L40S-48GB"},
            "GPU_TYPES has 3 entries for 2 hosts",
        ),
        (
            {
                "SLURM_HET_SIZE": "2",
                "SLURM_JOB_NODELIST_HET_GROUP_0": "a0",
                "SLURM_JOB_NODELIST_HET_GROUP_1": "b0",
                "GPU_TYPES": "H100-SXM-80GB A100-SXM-80GB L40S-48GB",
            },
            "GPU_TYPES has 3 entries for a job of 2 het components",
        ),
        (
            {"SLURM_HET_SIZE": "2", "SLURM_JOB_NODELIST_HET_GROUP_0": "a0"},
            "SLURM_JOB_NODELIST_HET_GROUP_1 is unset",
        ),
        (
            {"HEXISEQ_NODES": "gpu01", "PLAN_ARGS": "--time-limit 5\n--frobnicate"},
            "PLAN_ARGS must be one line of words (it holds a line break)",
        ),
        (
            {"HEXISEQ_NODES": "gpu01", "HEXISEQ_ARGS": "--x 1\r\n--save /tmp"},
            "HEXISEQ_ARGS must be one line of words",
        ),
        ({"HEXISEQ_NODES": "gpu01", "PLAN_ARGS": "-o MARK"}, "may not set the layout's output"),
        ({"HEXISEQ_NODES": "gpu01", "PLAN_ARGS": "-oMARK"}, "may not set the layout's output"),
        (
            {"HEXISEQ_NODES": "gpu01", "PLAN_ARGS": "--time-limit 5 --outp=MARK"},
            "may not set the layout's output ('--outp=",
        ),
        ({"HEXISEQ_NODES": "gpu01", "PLAN_ARGS": "--output MARK"}, "('--output')"),
    ],
)
def test_sbatch_variables_are_data(tmp_path, env, match):
    """Nothing the user sets is run, globbed or pasted into YAML: one line, exit 2, no command run,
    no file written."""
    for name in ("a", "b", "MARK0"):
        (tmp_path / name).write_text("")  # what '*' would glob to
    env = {k: v.replace("MARK", str(tmp_path / "MARK")) for k, v in env.items()}
    _one_line(_sbatch(tmp_path, **env), match)
    assert not (tmp_path / "MARK").exists()
    assert not (tmp_path / "wd").exists() or not list((tmp_path / "wd").iterdir())


@pytest.mark.parametrize(
    "env, match",
    [
        ({"PLAN_ARGS": "y" * 100_000}, "unrecognized arguments: yyy"),
        ({"PLAN_ARGS": " ".join(["--x"] * 30_000)}, "words start with '-', more than the 2,048"),
        ({"PLAN_ARGS": " ".join(["x"] * 30_000)}, "unrecognized arguments: x x x"),
    ],
)
def test_sbatch_huge_plan_args(tmp_path, env, match):
    """100,000 characters or 30,000 words in PLAN_ARGS: plan's one short line within seconds (the
    script quoted the command a subshell per word: over 180 s)."""
    res = _sbatch(tmp_path, HEXISEQ_NODES="gpu01", **env)
    _one_line(res, match)


def _tiny_layout(tmp_path: Path) -> Path:
    from megatron_hexiseq.layout import make_layout

    layout = make_layout(
        seq_length=64,
        num_attention_heads=8,
        num_query_groups=2,
        group_sizes=[2],
        segments=[[(0, 32)], [(32, 64)]],
        heads=[[0, 1, 2, 3], [4, 5, 6, 7]],
        hosts=["gpu01", "gpu01"],
        gpus=["H100-SXM-80GB"] * 2,
    )
    layout.save(tmp_path / "layout.json")
    return tmp_path / "layout.json"


@pytest.mark.parametrize(
    "text, match",
    [
        ('{"format": "megatron-hexiseq/lay', "is not valid JSON"),
        ("meta-string", "at meta"),
        ("flags-number", "megatron_flags"),
    ],
)
def test_sbatch_reads_layouts_through_the_loader(tmp_path, text, match):
    """A truncated or hand-edited PREVIOUS_LAYOUT / LAYOUT: one line from the layout loader."""
    good = json.loads(_tiny_layout(tmp_path).read_text())
    if text == "meta-string":
        good["meta"] = "x"
        text = json.dumps(good)
    elif text == "flags-number":
        good["meta"] = {"options": {"megatron_flags": 5}}
        text = json.dumps(good)
    (tmp_path / "prev.json").write_text(text)
    res = _sbatch(
        tmp_path,
        HEXISEQ_NODES="gpu01",
        GPUS_PER_NODE="2",
        PREVIOUS_LAYOUT=str(tmp_path / "prev.json"),
    )
    _one_line(res, match)
    res = _sbatch(
        tmp_path, HEXISEQ_NODES="gpu01", GPUS_PER_NODE="2", LAYOUT=str(tmp_path / "prev.json")
    )
    _one_line(res, match)


def test_sbatch_quotes_what_it_prints(tmp_path):
    """A SAVE folder with a space and a PLAN_ARGS-like glob in HEXISEQ_ARGS: printed quoted, passed
    as one word, never globbed."""
    (tmp_path / "x1").write_text("")
    save = tmp_path / "my ckpt"
    res = _sbatch(
        tmp_path,
        HEXISEQ_NODES="gpu01",
        GPUS_PER_NODE="2",
        LAYOUT=str(_tiny_layout(tmp_path)),
        SAVE=str(save),
        HEXISEQ_ARGS="x*",
    )
    assert res.returncode == 0, res.stderr + res.stdout
    srun = [line for line in res.stdout.splitlines() if line.startswith("+ srun ")]
    assert len(srun) == 1 and f"--save '{save}' --load '{save}'" in srun[0], srun
    assert " 'x*' " in srun[0] and "x1" not in res.stdout  # before the script's own last flags


def test_sbatch_dry_run_rank_commands_paste_safely(tmp_path):
    """Each rank's printed command is shell-quoted word by word: pasted into a shell it runs the
    same words (a SAVE with a space stays one word, ';touch' runs nothing); 30,000 words in
    HEXISEQ_ARGS are printed within the subprocess deadline."""
    import shlex

    save = tmp_path / "ck pt"
    mark = tmp_path / "MARK"
    many = ["--w"] * 30_000
    res = _sbatch(
        tmp_path,
        HEXISEQ_NODES="gpu01",
        GPUS_PER_NODE="2",
        LAYOUT=str(_tiny_layout(tmp_path)),
        SAVE=str(save),
        HEXISEQ_ARGS=" ".join([f";touch {mark}", "x*", "$(id)", *many]),
    )
    assert res.returncode == 0, res.stderr + res.stdout[-2000:]
    ranks = [line for line in res.stdout.splitlines() if line.startswith("+ [gpu01] env ")]
    assert len(ranks) == 2, res.stdout[-2000:]
    for line in ranks:
        words = shlex.split(line[len("+ [gpu01] ") :])
        assert words[0] == "env" and any(w.startswith("RANK=") for w in words)
        i = words.index("--save")
        assert words[i : i + 4] == ["--save", str(save), "--load", str(save)]
        j = words.index(";touch")
        assert words[j : j + 5] == [";touch", str(mark), "x*", "$(id)", "--w"]
        assert words.count("--w") == 30_000
    subprocess.run(["bash", "-c", "set -- " + ranks[0][len("+ [gpu01] env ") :]], cwd=tmp_path)
    assert not mark.exists()


# ---- layer (b): real processes -----------------------------------------------------------------
def _sleep_rank(rank: int, world: int) -> int:
    if rank == 1:
        time.sleep(600)
    import torch.distributed as dist

    dist.barrier()
    return rank


def _world_of_two(rank: int, world: int) -> int:
    if world != 2:
        raise HexiSeqError(f"this function needs 2 ranks, got {world}")
    return rank


def _leftovers(folder: Path) -> list[str]:
    return sorted(
        p.name
        for p in folder.iterdir()
        if p.name.startswith(("hexiseq-ranks-", "pytorch-errorfile"))
    )


def test_run_ranks_deadline_names_the_stuck_rank(tmp_path, monkeypatch):
    import tempfile

    from megatron_hexiseq.testbed.spawn import RanksFailed, run_ranks

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    # the deadline counts from the spawn, so it must leave the ranks time to start (import torch,
    # join the group) on this machine under its current load: 10 s plus twice a measured start (a
    # fixed 10 s failed on a loaded CI run, both ranks still importing torch)
    t0 = time.monotonic()
    assert run_ranks(_world_of_two, 2, timeout_s=120) == [0, 1]
    deadline = math.ceil(10 + 2 * (time.monotonic() - t0))
    with pytest.raises(
        RanksFailed, match=rf"rank\(s\) \[0, 1\] of 2 did not finish within {deadline} s"
    ) as e:
        run_ranks(_sleep_rank, 2, timeout_s=deadline)
    assert "in _sleep_rank" in str(e.value) and "line" in str(e.value)  # where rank 1 was
    with pytest.raises(HexiSeqError, match="this function needs 2 ranks, got 3"):
        run_ranks(_world_of_two, 3, timeout_s=120)
    assert _leftovers(tmp_path) == []


def _children(pid: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid:
                out.append(int(entry.name))
    return out


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def _interrupt(argv: list[str], world: int, how: str, tmp_path: Path) -> None:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
        "TMPDIR": str(tmp_path),
        "PYTHONWARNINGS": "ignore",
    }
    # a shell starts background jobs with SIGINT ignored, and exec keeps that: give the command
    # the default a person's terminal gives it
    proc = subprocess.Popen(
        [sys.executable, *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=tmp_path,
        start_new_session=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        ranks: list[int] = []
        for _ in range(1200):  # wait (up to 2 minutes on a loaded machine) until every rank runs
            ranks = [c for c in _children(proc.pid) if b"_child_main" in _cmdline(c)]
            if len(ranks) == world or proc.poll() is not None:
                break
            time.sleep(0.1)
        assert len(ranks) == world, (
            proc.poll(),
            proc.stderr.read() if proc.poll() is not None else "",
        )
        time.sleep(1.0)  # the ranks are inside their work now
        if how == "terminal":  # Ctrl-C: SIGINT to the terminal's foreground process group
            os.killpg(proc.pid, signal.SIGINT)
        else:
            proc.send_signal(signal.SIGTERM if how == "sigterm" else signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130, err
    assert err.strip().splitlines()[-1:] == ["error: interrupted"] and "Traceback" not in err, err
    assert [r for r in ranks if Path(f"/proc/{r}").exists()] == []  # every rank process is gone
    assert _leftovers(tmp_path) == []


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="the testbed needs 2 cores")
@pytest.mark.parametrize("case", ["tune-terminal", "profile-sigterm", "demo-sigint"])
def test_interrupts_exit_130_and_kill_every_rank(tmp_path, capsys, case):
    if case == "tune-terminal":
        argv, world, how = (
            [
                "-m",
                "megatron_hexiseq.cli",
                "tune",
                "--model",
                "gpt-tiny",
                "--world-size",
                "2",
                "--measure-steps",
                "500",
                "--out",
                str(tmp_path / "t.json"),
            ],
            2,
            "terminal",
        )
    elif case == "profile-sigterm":
        argv, world, how = (
            [
                "-m",
                "megatron_hexiseq.cli",
                "profile",
                "--testbed",
                "1+1",
                "--seconds",
                "30",
                "-o",
                str(tmp_path / "c.yaml"),
            ],
            2,
            "sigterm",
        )
    else:
        (tmp_path / "c.yaml").write_text(
            "name: tb\nnodes:\n  - {name: c0, gpu: CPU, count: 1, network_GBps: 1}\n"
            "  - {name: c1, gpu: CPU, count: 1, network_GBps: 1}\n"
        )
        (tmp_path / "m.yaml").write_text(MODEL.replace("seq_length: 4096", "seq_length: 256"))
        assert (
            main(
                [
                    "plan",
                    "--cluster",
                    str(tmp_path / "c.yaml"),
                    "--model-config",
                    str(tmp_path / "m.yaml"),
                    "--time-limit",
                    "1",
                    "-o",
                    str(tmp_path / "l.json"),
                    "--format",
                    "json",
                ]
            )
            == 0
        )
        capsys.readouterr()
        argv, world, how = (
            [
                "-m",
                "megatron_hexiseq.testbed.demo",
                "--cluster",
                str(tmp_path / "c.yaml"),
                "--layout",
                str(tmp_path / "l.json"),
                "--model-config",
                str(tmp_path / "m.yaml"),
                "--testbed",
                "1+1",
                "--steps",
                "5000",
                "-o",
                str(tmp_path / "demo.json"),
                "--plot",
                str(tmp_path / "demo.png"),
            ],
            2,
            "sigint",
        )
    _interrupt(argv, world, how, tmp_path)
    assert not [
        p for p in tmp_path.iterdir() if p.suffix in (".png",) or p.name in ("t.json", "demo.json")
    ]
