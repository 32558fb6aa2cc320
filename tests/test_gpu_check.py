"""The GPU acceptance scripts on CPU: layer (a) for the helpers, layer (b)-like for the full run.

``scripts/gpu_check.sh --device cpu --quick --self-test`` runs every part of ``scripts/gpu_check/``
(the ``gpu_check`` package) with its CPU stand-ins (simulated ranks on CPU tensors, gloo world of
one, ``cpu-flash``, ``reference`` for ``efficient``, the packed path through
``tests/varlen_standin.py``) and then every part again under each break of ``gpu_check.breaks``
(zeros, a dropped received block, a wrong head map, a dropped document window, a wrong document
boundary): it must pass and every part must catch every break (~50 s here, 2 busy cores). Every
break must reach the variable-length path itself (a stand-in case alone fails under it), and the
break context manager must put the library back as it found it. Bad arguments and settings (no
part, a budget that is not a finite positive number, a ``GPU_CHECK_TIMEOUT`` that is not a number,
an output folder that cannot be made, no GPU) are one ``error:`` line on stderr and exit code 2
before anything runs. ``gpu_check.multi --dry-run`` checks its arguments and prints its plan
without torchrun.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))

from gpu_check import breaks as gpu_check_breaks  # noqa: E402
from gpu_check import multi as gpu_check_multi  # noqa: E402

import megatron_hexiseq.attention.documents as documents_mod  # noqa: E402
import megatron_hexiseq.attention.groups as groups_mod  # noqa: E402
from megatron_hexiseq.attention import kernels, subring, varlen  # noqa: E402

PARTS = {
    "efficient",
    "documents",
    "batch_layouts",
    "ranks",
    "pytest",
    "megatron",
    "memory",
    "throughput",
}


def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        [ROOT, os.path.join(ROOT, "scripts"), env.get("PYTHONPATH", "")]
    )
    env["PYTHON"] = sys.executable
    return env | extra


def _bench(*args: str, timeout: float = 240, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-W", "ignore", *args],
        cwd=ROOT,
        env=_env(**env),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def _script(*args: str, timeout: float = 600, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["scripts/gpu_check.sh", *args],
        cwd=ROOT,
        env=_env(**env),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_quick_self_test_on_cpu_passes_and_catches_every_break(tmp_path) -> None:
    proc = _script("--device", "cpu", "--quick", "--self-test", GPU_CHECK_OUT=str(tmp_path))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((tmp_path / "gpu_check.json").read_text())
    parts = result["parts"]
    assert list(parts)[:2] == ["efficient", "documents"]  # the two never yet run on a GPU first
    assert set(parts) == PARTS
    assert all(r["pass"] for r in parts.values()), parts
    assert parts["ranks"]["cases"] >= 6 and "cpu-flash" in parts["ranks"]["kernels"]
    assert parts["efficient"]["kernels"] == ["reference"]  # the CPU stand-in of its calls
    docs = parts["documents"]
    assert docs["kernels"] == ["cpu-flash", "varlen stand-in"]
    assert docs["cases_with_documents"] == docs["cases"] and docs["cases_with_unaligned_heads"]
    assert parts["batch_layouts"]["cases_with_documents"] < parts["batch_layouts"]["cases"]
    assert (
        parts["megatron"]["local"]["layers"] == parts["megatron"]["local_documents"]["layers"] == 2
    )
    breaks = result["self_test"]
    assert len(breaks) == len(gpu_check_breaks.BREAKS) * len(parts) == 40
    assert all(r["caught"] for r in breaks.values()), {
        k: r for k, r in breaks.items() if not r["caught"]
    }
    last = proc.stdout.rstrip().splitlines()
    assert last[-1].startswith("| boundary/throughput | yes |"), last[-3:]  # the table comes last
    assert "| self-test: break / part | caught | s |" in proc.stdout


PATCHED = (
    (kernels, "block_forward"),
    (subring, "block_forward"),
    (subring, "_block_forward"),
    (varlen, "_calls_forward"),
    (varlen, "local_forward"),
    (varlen, "merge_forward"),
    (subring, "local_forward"),
    (subring, "merge_forward"),
    (documents_mod, "document_schedule"),
    (groups_mod, "document_schedule"),
)


@pytest.mark.parametrize("kind", gpu_check_breaks.BREAKS)
def test_breaks_put_the_library_back(kind: str) -> None:
    before = [getattr(m, n) for m, n in PATCHED]
    with gpu_check_breaks.broken_attention(kind):
        during = [getattr(m, n) for m, n in PATCHED]
        assert during != before
    assert [getattr(m, n) for m, n in PATCHED] == before


@pytest.mark.parametrize("kind", gpu_check_breaks.BREAKS)
def test_every_break_reaches_the_variable_length_path(kind: str) -> None:
    """A packed-document case run through the variable-length path alone (the CPU stand-in of the
    flash op) passes intact and fails under every break, with a comparison (no exception)."""
    from gpu_check.packed import STANDIN, _standin
    from gpu_check.sim import Case, check_cases

    from megatron_hexiseq.attention.kernels import Kernel
    from megatron_hexiseq.layout import make_layout

    lay = make_layout(  # two groups; rank 1 holds an unaligned head range (2 segments)
        seq_length=64,
        num_attention_heads=8,
        num_query_groups=2,
        group_sizes=[1, 2],
        segments=[[(0, 20), (40, 48)], [(20, 30), (48, 64)], [(30, 40)]],
        heads=[list(range(8)), [2, 3, 4, 5, 6], [0, 1, 7]],
    )
    case = Case(
        STANDIN, Kernel.CPU_FLASH, torch.bfloat16, lay, 2, [0, 10, 25, 44, 64], None, 2, _standin
    )
    cpu = torch.device("cpu")
    assert check_cases(cpu, [case], head_dim=16, stop_early=True)["pass"]
    calls: list[int] = []
    real = varlen._calls_forward

    def counted(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    varlen._calls_forward = counted
    try:
        with gpu_check_breaks.broken_attention(kind):
            res = check_cases(cpu, [case], head_dim=16, stop_early=True)
    finally:
        varlen._calls_forward = real
    assert not res["pass"] and res["failures"], res
    assert calls  # the variable-length calls ran (under the break)


def test_zeros_break_zeroes_a_block_and_heads_break_moves_heads() -> None:
    q, k, v = torch.randn(6, 1, 2, 4), torch.randn(6, 1, 1, 4), torch.randn(6, 1, 1, 4)
    kw = dict(causal=True, kv_of_head_H=None, scale=0.5, kernel=kernels.Kernel.REFERENCE)
    k2, v2 = k.expand(6, 1, 2, 4), v.expand(6, 1, 2, 4)
    good, lse = kernels.block_forward(q, k2, v2, **kw)
    with gpu_check_breaks.broken_attention("zeros"):
        out, lse_z = kernels.block_forward(q, k2, v2, **kw)
    assert not out.any() and torch.equal(lse_z, lse)
    with gpu_check_breaks.broken_attention("heads"):
        out, _ = kernels.block_forward(q, k2, v2, **kw)
    torch.testing.assert_close(out[:, :, 0], good[:, :, 1])


def test_boundary_break_leaves_out_the_most_paired_boundary() -> None:
    from megatron_hexiseq.attention.documents import parse_cu_seqlens

    seen = []
    wrapped = gpu_check_breaks._merged_documents(lambda lay, r, bounds, *a: seen.append(bounds))
    bounds = parse_cu_seqlens([[0, 1, 2, 12, 20], [0, 20]], seq_length=20, batch=2)
    wrapped(None, 0, bounds, 1)
    assert seen[0].samples == ((0, 1, 2, 20), (0, 20))  # [2, 12) and [12, 20): 10 x 8 pairs


def _one_error_line(proc: subprocess.CompletedProcess, text: str) -> None:
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, (proc.returncode, proc.stdout[-500:], proc.stderr[-500:])
    assert len(lines) == 1 and lines[0].startswith("error: ") and text in lines[0], lines
    assert "PASS" not in proc.stdout and "Traceback" not in proc.stderr


def test_unknown_break_and_bad_arguments_are_one_line() -> None:
    with pytest.raises(ValueError, match="unknown break 'nope'"):
        with gpu_check_breaks.broken_attention("nope"):
            pass
    proc = _script("--device", "cpu", "--parts", "ranks,bogus")
    _one_error_line(proc, "unknown part(s) ['bogus']")
    if not torch.cuda.is_available():
        proc = _script("--parts", "ranks")
        _one_error_line(proc, "no CUDA GPU visible to torch; use --device cpu")
        assert proc.stdout == ""  # the error goes to stderr


@pytest.mark.parametrize(
    "args,env,text",
    [
        (["--parts", ""], {}, "--parts names no part"),
        (["--parts", ","], {}, "--parts names no part"),
        (["--budget-s", "nan"], {}, "--budget-s must be a finite number of seconds above 0"),
        (["--budget-s", "-1"], {}, "--budget-s must be a finite number of seconds above 0, got -1"),
        (["--budget-s", "inf"], {}, "--budget-s must be a finite number"),
        (["--budget-s", "soon"], {}, "--budget-s must be a number of seconds, got 'soon'"),
        ([], {"GPU_CHECK_TIMEOUT": "abc"}, "GPU_CHECK_TIMEOUT must be a whole number of seconds"),
        ([], {"GPU_CHECK_TIMEOUT": "0"}, "GPU_CHECK_TIMEOUT must be a whole number of seconds"),
        ([], {"GPU_CHECK_TIMEOUT": "-5"}, "GPU_CHECK_TIMEOUT must be a whole number of seconds"),
    ],
)
def test_nonsense_settings_are_refused_in_one_line(tmp_path, args, env, text) -> None:
    """Each was accepted before (``--parts ''`` ran nothing and printed PASS; ``--budget-s nan``
    was never applied; ``-1`` exited 1; ``GPU_CHECK_TIMEOUT=abc`` exited 125 from ``timeout``)."""
    out = tmp_path / "out"
    proc = _script("--device", "cpu", "--quick", *args, GPU_CHECK_OUT=str(out), **env)
    _one_error_line(proc, text)
    assert not out.exists()  # refused before anything ran or was written


def test_unwritable_output_folder_is_one_line(tmp_path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder\n")
    proc = _script("--device", "cpu", "--quick", GPU_CHECK_OUT=str(blocker / "out"))
    _one_error_line(proc, "cannot create the output folder")
    assert blocker.read_text() == "not a folder\n"


# ---- gpu_check.multi -------------------------------------------------------------------
LOG = (
    " [2026-12-04 10:00:00] iteration        {i}/       3 | consumed samples:            2 | "
    "elapsed time per iteration (ms): 812.3 | learning rate: 1.000000E-04 | global batch size:     2 "
    "| lm loss: {loss:.6E} | loss scale: 1.0 | grad norm: {gn:.3f} | number of skipped iterations:   0 |"
)


def _log(values) -> str:
    return "\n".join(LOG.format(i=i + 1, loss=l_, gn=g) for i, (l_, g) in enumerate(values))


def test_multi_compares_megatron_logs_against_the_yardstick() -> None:
    stock = [(10.4, 5.0), (10.1, 4.0), (9.8, 3.0)]
    runs = {
        "stock_cp": gpu_check_multi.parse_log(_log(stock)),
        "stock_no_cp": gpu_check_multi.parse_log(_log([(l_ * 1.001, g * 1.01) for l_, g in stock])),
        "hexiseq": gpu_check_multi.parse_log(_log([(l_ * 1.002, g * 1.02) for l_, g in stock])),
    }
    assert runs["stock_cp"] == {1: (10.4, 5.0), 2: (10.1, 4.0), 3: (9.8, 3.0)}
    res = gpu_check_multi.compare_runs(runs, 3)
    assert res["pass"], res
    runs["hexiseq"] = gpu_check_multi.parse_log(_log([(l_ * 1.05, g) for l_, g in stock]))
    res = gpu_check_multi.compare_runs(runs, 3)
    assert not res["pass"] and res["lm_loss"]["hexiseq_vs_stock_cp"] > res["lm_loss"]["allowed"]
    del runs["hexiseq"][3]
    assert "without 3 logged steps: ['hexiseq']" in gpu_check_multi.compare_runs(runs, 3)["error"]


def test_multi_pretrain_dry_run_and_bad_arguments(tmp_path) -> None:
    fake = tmp_path / "Megatron-LM"
    fake.mkdir()
    (fake / "pretrain_gpt.py").write_text("")
    out = tmp_path / "out"
    argv = ["pretrain", "--nproc", "4", "--megatron-lm", str(fake), "--out", str(out), "--dry-run"]
    proc = _bench("-m", "gpu_check.multi", *argv)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("torch.distributed.run") == 3
    assert "--cp-comm-type p2p" in proc.stdout and "--hexiseq-layout" in proc.stdout
    lay = gpu_check_multi.Layout.load(out / "pretrain_layout.json")
    assert lay.world_size == 2 and len({r.num_tokens for r in lay.ranks}) == 2  # uneven
    proc = _bench("-m", "gpu_check.multi", *argv[:2], "3", *argv[3:])
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    proc = _bench(
        "-m", "gpu_check.multi", "pretrain", "--nproc", "4", "--megatron-lm", str(tmp_path / "no")
    )
    assert proc.returncode == 2 and "no pretrain_gpt.py" in proc.stderr
    env = _env() | {"NPROC": "1"}
    proc = subprocess.run(
        ["scripts/gpu_check_multi.sh"], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert proc.returncode == 2 and "needs 2+ GPUs, found 1" in proc.stderr
    proc = subprocess.run(
        ["scripts/gpu_check_multi.sh", "--bogus"], cwd=ROOT, env=env, capture_output=True, text=True
    )
    assert proc.returncode == 2 and "unknown argument '--bogus'" in proc.stderr


def test_multi_attention_part_on_two_gloo_processes(tmp_path) -> None:
    proc = _bench(
        "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
        "-m", "gpu_check.multi", "attention", "--device", "cpu", "--layouts", "2",
        "--min-tokens", "24", "--max-tokens", "48", "--iters", "3", "--out", str(tmp_path),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    res = json.loads((tmp_path / "attention.json").read_text())
    assert res["pass"] and res["cases"] == 4 and res["world_size"] == 2
    proc = _bench(
        "-m",
        "gpu_check.multi",
        "report",
        "--out",
        str(tmp_path),
        "--parts",
        "attention,pretrain",
    )
    assert proc.returncode == 1 and "| pretrain | NO | missing" in proc.stdout
