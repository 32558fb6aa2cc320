"""The GPU acceptance scripts on CPU: layer (a) for the helpers, layer (b)-like for the full run.

``bench/gpu_check.py --device cpu --quick --self-test`` runs every part with its CPU stand-ins
(simulated ranks on CPU tensors, gloo world of one, ``cpu-flash``) and then every part again under
each break of ``gpu_check_breaks`` (zeros, a dropped received block, a wrong head map): it must pass
and every part must catch every break (~40 s here, 2 busy cores). The break context manager must
put the library back as it found it, and bad arguments are one line and exit code 2.
``bench/gpu_check_multi.py --dry-run`` checks its arguments and prints its plan without torchrun.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "bench"))

import gpu_check_breaks  # noqa: E402
import gpu_check_multi  # noqa: E402

from megatron_hexiseq.attention import kernels, subring  # noqa: E402


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([ROOT, env.get("PYTHONPATH", "")])
    return env


def _bench(*args: str, timeout: float = 240) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-W", "ignore", *args],
        cwd=ROOT,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_quick_self_test_on_cpu_passes_and_catches_every_break(tmp_path) -> None:
    proc = _bench(
        "bench/gpu_check.py", "--device", "cpu", "--quick", "--self-test", "--out", str(tmp_path)
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads((tmp_path / "gpu_check.json").read_text())
    parts = result["parts"]
    assert set(parts) == {"ranks", "pytest", "megatron", "memory", "throughput"}
    assert all(r["pass"] for r in parts.values()), parts
    assert parts["ranks"]["cases"] >= 12 and "cpu-flash" in parts["ranks"]["kernels"]
    assert parts["megatron"]["local"]["layers"] == 2
    breaks = result["self_test"]
    assert len(breaks) == len(gpu_check_breaks.BREAKS) * len(parts)
    assert all(r["caught"] for r in breaks.values()), {
        k: r for k, r in breaks.items() if not r["caught"]
    }
    last = proc.stdout.rstrip().splitlines()
    assert last[-1].startswith("| heads/throughput | yes |"), last[-3:]  # the table comes last
    assert "| self-test: break / part | caught | s |" in proc.stdout


@pytest.mark.parametrize("kind", gpu_check_breaks.BREAKS)
def test_breaks_put_the_library_back(kind: str) -> None:
    before = (kernels.block_forward, subring.block_forward, subring._block_forward)
    with gpu_check_breaks.broken_attention(kind):
        during = (kernels.block_forward, subring.block_forward, subring._block_forward)
        assert during != before
    assert (kernels.block_forward, subring.block_forward, subring._block_forward) == before


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


def test_unknown_break_and_bad_arguments_are_one_line() -> None:
    with pytest.raises(ValueError, match="unknown break 'nope'"):
        with gpu_check_breaks.broken_attention("nope"):
            pass
    proc = _bench("bench/gpu_check.py", "--device", "cpu", "--parts", "ranks,bogus")
    assert proc.returncode == 2 and "unknown part(s) ['bogus']" in proc.stderr
    if not torch.cuda.is_available():
        proc = _bench("bench/gpu_check.py", "--parts", "ranks")
        assert proc.returncode == 2
        assert proc.stdout.strip() == (
            "gpu_check: no CUDA GPU visible to torch; use --device cpu for the CPU stand-ins"
        )


# ---- bench/gpu_check_multi.py -------------------------------------------------------------------
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
    proc = _bench("bench/gpu_check_multi.py", *argv)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.count("torch.distributed.run") == 3
    assert "--cp-comm-type p2p" in proc.stdout and "--hexiseq-layout" in proc.stdout
    lay = gpu_check_multi.Layout.load(out / "pretrain_layout.json")
    assert lay.world_size == 2 and len({r.num_tokens for r in lay.ranks}) == 2  # uneven
    proc = _bench("bench/gpu_check_multi.py", *argv[:2], "3", *argv[3:])
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    proc = _bench(
        "bench/gpu_check_multi.py",
        "pretrain",
        "--nproc",
        "4",
        "--megatron-lm",
        str(tmp_path / "none"),
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
        "bench/gpu_check_multi.py", "attention", "--device", "cpu", "--layouts", "2",
        "--min-tokens", "24", "--max-tokens", "48", "--iters", "3", "--out", str(tmp_path),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    res = json.loads((tmp_path / "attention.json").read_text())
    assert res["pass"] and res["cases"] == 4 and res["world_size"] == 2
    proc = _bench(
        "bench/gpu_check_multi.py",
        "report",
        "--out",
        str(tmp_path),
        "--parts",
        "attention,pretrain",
    )
    assert proc.returncode == 1 and "| pretrain | NO | missing" in proc.stdout
