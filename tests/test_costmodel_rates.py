"""Achieved rates: the calibrated catalog, the kernel ``auto`` picks, head-dim interpolation, the
achieved fraction of a call against its work, and ``estimate`` pricing every block as one call.

Layers: (a) no processes -- the catalog checks test structure (no single efficiency, every GPU
priced), never particular figures; the cost-model checks build their own GPU types; ``profile``'s
spec from measured kernel rows. (c) one GPU-only test: the kernel measurement on a real GPU.
"""

import math

import numpy as np
import pytest
import torch

from megatron_hexiseq import gpu_rates
from megatron_hexiseq.cluster import GPU_CATALOG, cluster_from_dict, cluster_to_dict
from megatron_hexiseq.costmodel import estimate
from megatron_hexiseq.costmodel.rates import attention_rate, call_fraction, pick_kernel
from megatron_hexiseq.errors import HexiSeqError
from megatron_hexiseq.layout import make_layout, zigzag_segments
from megatron_hexiseq.model import ModelSpec
from megatron_hexiseq.run_config import TrainOptions


def test_catalog_prices_every_gpu_and_has_no_single_efficiency():
    """Every GPU of the catalog (not the CPU placeholder) has a matmul figure in its training dtype
    and a kernel ``auto`` can price; the achieved fractions of the peak differ between GPU types and
    between matmul and attention (no one efficiency for all)."""
    fractions = set()
    for name, g in GPU_CATALOG.items():
        if name == "CPU":
            assert pick_kernel(g, 128) is None
            continue
        matmul = g.rate(f"matmul/{g.train_dtype}")
        assert matmul is not None, name
        kernel = pick_kernel(g, 128)
        assert kernel is not None, name
        att = attention_rate(g, 128)
        assert att.kernel == kernel and att.causal is not None
        fractions.add(round(matmul / g.bf16_tflops, 3))
        assert not math.isclose(att.flops_per_s, matmul * 1e12), name
    assert len(fractions) >= 4


def test_auto_mirrors_the_runtime_choice():
    cat = GPU_CATALOG
    assert pick_kernel(cat["H100-SXM-80GB"], 128) == "cudnn"
    assert pick_kernel(cat["H200-141GB"], 64) == "cudnn"
    assert pick_kernel(cat["H100-SXM-80GB"], 256) == "flash"  # cudnn takes head dims <= 128
    assert pick_kernel(cat["A100-SXM-80GB"], 128) == "flash"
    assert pick_kernel(cat["B200-192GB"], 128) == "flash"  # compute capability 10.0: not 9.x
    assert pick_kernel(cat["L40S-48GB"], 80) == "flash"
    v100 = cat["V100-SXM-32GB"]
    assert v100.train_dtype == "fp16" and pick_kernel(v100, 128) == "efficient"
    assert pick_kernel(cat["H100-SXM-80GB"], 128, "flash") == "flash"
    assert pick_kernel(cat["H100-SXM-80GB"], 128, dtype="fp16") == "cudnn"
    assert pick_kernel(cat["A100-SXM-80GB"], 128, dtype="fp32") is None  # no fp32 figures
    assert pick_kernel(cat["H100-SXM-80GB"], 128, "sdpa") == "cudnn"  # the runtime's old auto
    assert pick_kernel(cat["H100-SXM-80GB"], 128, "reference") is None  # flat rate
    with pytest.raises(HexiSeqError, match=r"'flash' has no rate on V100-SXM-32GB for fp16"):
        pick_kernel(v100, 128, "flash")
    with pytest.raises(HexiSeqError, match=r"unknown attention kernel 'flahs'"):
        pick_kernel(cat["A100-SXM-80GB"], 128, "flahs")


def test_head_dim_interpolation_and_convention():
    g = GPU_CATALOG["A100-SXM-80GB"]
    r64, r96, r128 = (attention_rate(g, d, "flash").flops_per_s for d in (64, 96, 128))
    assert r96 == pytest.approx((r64 + r128) / 2)
    assert attention_rate(g, 32, "flash").flops_per_s == r64  # nearer end outside
    assert attention_rate(g, 256, "flash").flops_per_s == r128
    # the FlashAttention papers' 14 d per pair-head -> the cost model's 12 d
    assert r128 == pytest.approx(g.rate("flash/bf16/128") * 1e12 * 12 / 14)


def test_call_fraction_curve_floor_and_ends():
    curve = ((100.0, 0.1), (10_000.0, 0.5), (1_000_000.0, 1.0))
    f = call_fraction(curve, np.array([100.0, 1000.0, 10_000.0, 1e6, 1e9]))
    assert f.tolist() == pytest.approx([0.1, 0.3, 0.5, 1.0, 1.0])  # linear in log(work)
    # below the first point the call's time stays the first point's: time ~ work / fraction
    small = np.array([1.0, 10.0, 50.0, 100.0])
    times = small / call_fraction(curve, small)
    assert times == pytest.approx([1000.0] * 4)
    assert call_fraction(curve, np.array([0.0])).tolist() == [1.0]
    assert call_fraction(None, np.array([5.0])).tolist() == [1.0]
    # every measured curve rises with the work (up to the measurement's 3% noise at the top)
    for key, points in gpu_rates.ATTENTION_CURVES.items():
        fs = [p[1] for p in points]
        assert all(b >= a - 0.03 for a, b in zip(fs, fs[1:])), key


TINY = ModelSpec(
    name="tiny",
    num_layers=2,
    hidden_size=8,
    num_attention_heads=2,
    num_query_groups=2,
    ffn_hidden_size=16,
    vocab_size=16,
    kv_channels=8,
    swiglu=False,
    seq_length=8,
)
CURVE = [[1, 0.25], [64, 1.0]]


def _cluster(curves: bool) -> object:
    gpu = {
        "bf16_tflops": 1,
        "memory_gib": 1,
        "nvlink_GBps": 10,
        "compute_capability": 8.0,
        "achieved_tflops": {"matmul/bf16": 2, "flash/bf16/64": 1.4, "flash/bf16/128": 2.8},
    }
    if curves:
        gpu["attention_curves"] = {"flash/causal": CURVE, "flash/full": CURVE}
    else:  # one flat rate: no kernel, no curve
        gpu.update(attention_tflops=1.2, efficiency=1.0)
    return cluster_from_dict(
        {
            "name": "t",
            "gpus": {"G": gpu},
            "nodes": [
                {"name": "n0", "gpu": "G", "count": 1, "network_GBps": 1},
                {"name": "n1", "gpu": "G", "count": 1, "network_GBps": 1},
            ],
        }
    )


def test_estimate_prices_each_block_at_its_achieved_rate():
    """A 2-rank zig-zag ring (positions 0,1,6,7 and 2..5): each rank computes its own block (10
    causal pairs) and one received block (8 pairs); with a curve every block's time is its work over
    the rate times the curve's fraction at ``pairs x heads x b``, summed over blocks and passes; a
    flat ``attention_tflops`` prices every pair alike."""
    lay = make_layout(
        seq_length=8,
        num_attention_heads=2,
        num_query_groups=2,
        group_sizes=[1, 1],
        segments=zigzag_segments(8, 2),
        heads=[[0, 1], [0, 1]],
        hosts=["n0", "n1"],
        gpus=["G", "G"],
    )
    flat, curved = estimate(lay, _cluster(False), TINY), estimate(lay, _cluster(True), TINY)
    rate = 1.4e12 * 12 / 14  # head dim 8: the 64 figure, FlashAttention count -> the model's
    heads, per_pair = 2, 12 * TINY.kv_channels * TINY.num_layers  # fwd + bwd FLOPs per pair-head
    blocks = {0: [(10, "causal"), (8, "full")], 1: [(10, "causal"), (8, "full")]}
    for r, want in blocks.items():
        frac = lambda p: min(1.0, 0.25 + 0.75 * math.log(p * heads) / math.log(64))  # noqa: E731
        expect = sum(per_pair * p * heads / (rate * frac(p)) for p, _ in want)
        assert curved.per_rank[r].breakdown["attention_s"] == pytest.approx(expect)
        plain = sum(per_pair * p * heads / 1.2e12 for p, _ in want)  # flat attention_tflops
        assert flat.per_rank[r].breakdown["attention_s"] == pytest.approx(plain)
    assert curved.iteration_time_s > flat.iteration_time_s


def test_forced_kernel_reaches_the_estimate_and_the_record():
    lay = make_layout(
        seq_length=8,
        num_attention_heads=2,
        num_query_groups=2,
        group_sizes=[2],
        segments=[[(0, 4)], [(4, 8)]],
        heads=[[0], [1]],
        hosts=["n0", "n1"],
        gpus=["G", "G"],
    )
    c = _cluster(True)
    with pytest.raises(HexiSeqError, match="'cudnn' has no rate on G"):
        estimate(lay, c, TINY, TrainOptions(attention_kernel="cudnn"))
    assert estimate(lay, c, TINY, TrainOptions(attention_kernel="reference")).iteration_time_s > 0


def test_spec_rates_and_curves_validate_and_round_trip():
    c = _cluster(True)
    assert cluster_from_dict(cluster_to_dict(c)) == c
    g = c.devices[0].gpu
    assert g.rate("flash/bf16/64") == 1.4 and g.curve("flash/causal") == ((1.0, 0.25), (64.0, 1.0))

    def bad(gpu_extra):
        spec = cluster_to_dict(c)
        spec["gpus"]["G"].update(gpu_extra)
        with pytest.raises(HexiSeqError) as e:
            cluster_from_dict(spec)
        return str(e.value)

    assert "key 'flash/bf17/64' is not matmul" in bad({"achieved_tflops": {"flash/bf17/64": 1}})
    assert "strictly increasing" in bad({"attention_curves": {"flash/causal": [[5, 1], [5, 1]]}})
    assert "must be a positive number" in bad({"achieved_tflops": {"matmul/bf16": 0}})
    # a peak or efficiency override of a catalog type means peak x efficiency again
    spec = {
        "name": "o",
        "gpus": {"A100-SXM-80GB": {"efficiency": 0.4}},
        "nodes": [{"name": "a", "gpu": "A100-SXM-80GB", "count": 1, "network_GBps": 1}],
    }
    d = cluster_from_dict(spec).devices[0]
    assert d.flops_per_s == pytest.approx(312e12 * 0.4) and pick_kernel(d.gpu, 128) is None


def _kernel_rows(kernel: str, top: float) -> list[dict]:
    """Rows as ``profile.kernels.measure_kernel_rates`` returns them: rates rising with the size."""
    return [
        {"kernel": kernel, "dtype": "bf16", "D": 128, "causal": c, "S": S, "H": 4,
         "fwd_bwd_tflops": top * f}
        for c in (True, False)
        for S, f in ((512, 0.2), (2048, 0.6), (8192, 1.0))
    ]  # fmt: skip


def test_profiled_kernel_rates_become_the_gpus_priced_rates():
    """``profile`` on a GPU: each kernel's long-block rate and curves go into the spec's GPU type
    (mean over the node's ranks), no flat ``attention_tflops``; the cost model then prices them."""
    from megatron_hexiseq.profile.kernels import pair_heads, rates_to_spec
    from megatron_hexiseq.profile.run import cluster_spec_from_measurements

    refused = [{"kernel": "efficient", "dtype": "bf16", "D": 128, "causal": True, "S": 512,
                "H": 4, "error": "RuntimeError: no"}]  # fmt: skip
    ranks = [
        {
            "rank": r,
            "node": "g0",
            "device": "NVIDIA H200",
            "dtype": "bfloat16",
            "matmul_flops": 600e12,
            "attention_flops": 300e12,
            "memory_gib": 140.0,
            "alltoall_Bps": 1e11,
            "pair_Bps": {"0-1": 2e11} if r == 0 else {},
            "kernel_rates": _kernel_rows("flash", 300 + 20 * r)
            + _kernel_rows("cudnn", 500)
            + refused,
            "compute_capability": 9.0,
        }
        for r in range(2)
    ]
    spec = cluster_spec_from_measurements(ranks)
    (gpu,) = spec["gpus"].values()
    assert "attention_tflops" not in gpu and gpu["compute_capability"] == 9.0
    assert gpu["achieved_tflops"] == {
        "cudnn/bf16/128": 500,
        "flash/bf16/128": 310,
        "matmul/bf16": 600,
    }
    assert gpu["attention_curves"]["flash/full"] == [
        [float(pair_heads(S, 4, False)), f] for S, f in ((512, 0.2), (2048, 0.6), (8192, 1.0))
    ]
    assert set(rates_to_spec(refused)["achieved_tflops"]) == set()  # a refused kernel is left out
    g = cluster_from_dict(spec).devices[0].gpu
    rate = attention_rate(g, 128)
    assert rate.kernel == "cudnn" and rate.flops_per_s == pytest.approx(500e12 * 12 / 14)
    assert rate.causal == tuple((float(pair_heads(S, 4, True)), f) for S, f in
                                ((512, 0.2), (2048, 0.6), (8192, 1.0)))  # fmt: skip


@pytest.mark.skipif(not torch.cuda.is_available(), reason="layer (c): needs a CUDA GPU")
def test_measure_kernel_rates_on_a_gpu():
    from megatron_hexiseq.profile.kernels import measure_kernel_rates, rates_to_spec

    rows = measure_kernel_rates(torch.bfloat16, 4, 64, sizes=(256, 1024))
    spec = rates_to_spec(rows)
    assert "flash/bf16/64" in spec["achieved_tflops"]  # compute capability >= 8.0
    assert all(v > 0 for v in spec["achieved_tflops"].values())
    assert [p[1] for p in spec["attention_curves"]["flash/causal"]][-1] == 1.0


def test_cli_attention_kernel_flag(tmp_path, capsys):
    """``plan --attention-kernel`` prices the forced kernel and records it; a kernel one of the GPUs
    has no figure for is one line, exit 2, no file; ``simulate --layout`` re-uses the record."""
    from megatron_hexiseq.cli import main
    from megatron_hexiseq.io import read_json

    spec = tmp_path / "c.yaml"
    spec.write_text(
        "name: t\nnodes:\n"
        "  - {name: h0, gpu: H100-SXM-80GB, count: 2, network_GBps: 25}\n"
        "  - {name: a0, gpu: A100-SXM-80GB, count: 2, network_GBps: 25}\n"
    )
    args = ["plan", "--cluster", str(spec), "--model", "gpt-7b", "--seq-length", "8192"]
    out = tmp_path / "l.json"
    assert main([*args, "--attention-kernel", "flash", "-o", str(out)]) == 0
    assert read_json(out, "layout")["meta"]["options"]["attention_kernel"] == "flash"
    assert main(["simulate", "--layout", str(out), "--format", "json"]) == 0
    capsys.readouterr()
    bad = tmp_path / "bad.json"
    assert main([*args, "--attention-kernel", "flash-attn3", "-o", str(bad)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "'flash-attn3' has no rate on A100-SXM-80GB" in err
    assert not bad.exists()


def test_paper_tables_smoke(tmp_path):
    """``bench/paper_tables.py --quick`` runs, writes its files, puts the paper's figures beside the
    predictions and summarises a sim_suite JSON; the reconciling fixed time solves its equation."""
    import json
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "bench"))
    import paper_tables

    sim = tmp_path / "sim.json"
    sim.write_text(
        json.dumps(
            {
                "summary": {"mean_speedup": 1.5, "max_speedup": 1.9, "with_baseline": 3},
                "flop_pairs": [{"label": "a vs b", "model": "gpt-13b", "ratio": 0.9}],
            }
        )
    )
    assert paper_tables.main(["--quick", "--sim-json", str(sim), "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "paper_tables.json").read_text())
    rows = {(r["seq_length"], r["kernel"]): r for r in data["rows"]}
    assert set(rows) == {(s, k) for s in (16384, 32768) for k in ("auto", "flash")}
    r = rows[(32768, "flash")]
    assert r["paper"] == 1.17 and r["speedup"] >= 1.0 and r["grad_sync_s"] > 0
    g = r["implied_fixed_s"]
    assert (r["baseline_s"] + g) / (r["plan_s"] + g) == pytest.approx(1.17)
    assert data["summary"]["simulated"]["mean_speedup"] == 1.5
    assert "a vs b (gpt-13b): 0.900" in (tmp_path / "paper_tables.md").read_text()


def _runs(segments):
    """Merged segments as the runtime's runs ``(local start, local end, position)``."""
    out, off = [], 0
    for s, e in segments:
        out.append((off, off + e - s, s))
        off += e - s
    return tuple(out)


def test_block_calls_vec_matches_the_runtime_calls():
    """The vectorised calls of a received block are the runtime's ``block_calls`` (same rows merged
    into the same calls): compared through a nonlinear price of each call on random segments."""
    import random

    from megatron_hexiseq.attention.peers import block_calls
    from megatron_hexiseq.costmodel.exchange import _merged, block_calls_vec

    rng = random.Random(5)
    for _ in range(300):
        seq = rng.randint(4, 60)
        cuts = sorted(rng.sample(range(1, seq), rng.randint(1, min(8, seq - 1))))
        pieces = list(zip([0, *cuts], [*cuts, seq]))
        owner = [rng.randrange(2) for _ in pieces]
        if len(set(owner)) < 2:
            continue
        mine = _merged(tuple(p for p, o in zip(pieces, owner) if o == 0))
        theirs = _merged(tuple(p for p, o in zip(pieces, owner) if o == 1))
        calls = block_calls(_runs(mine), _runs(theirs))
        want = sum(((e - s) * k) ** 0.5 for s, e, k in calls)  # a call priced by sqrt(pairs)
        w = max(len(mine), len(theirs)) + 1  # padded with an empty segment, as exchange does
        arr = np.zeros((4, w), dtype=np.int64)
        arr[0, : len(mine)] = [s for s, _ in mine]
        arr[1, : len(mine)] = [e for _, e in mine]
        arr[2, : len(theirs)] = [s for s, _ in theirs]
        arr[3, : len(theirs)] = [e for _, e in theirs]
        work, total = block_calls_vec(arr[0], arr[1], arr[2], arr[3])
        got = sum(wk / t**0.5 for wk, t in zip(work.tolist(), total.tolist()) if wk)
        assert got == pytest.approx(want), (mine, theirs, calls)
        assert work.sum() == sum((e - s) * k for s, e, k in calls)
