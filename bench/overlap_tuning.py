"""Benchmark: Lagom-style overlap tuning vs Megatron defaults vs an exhaustive grid (CPU, gloo).

Tiny megatron-core GPT (communication-heavy: ~14.7M parameters, 32 tokens per rank) trained with
Megatron DDP on ``--world-size`` gloo ranks (``megatron_hexiseq.testbed.overlap_bench``). Knobs: the DDP
ladder (no overlap = Megatron's default, then overlap with buckets of N/2, N/4, ... parameters)
plus Megatron's ``--overlap-grad-reduce`` default bucket (40M parameters: one bucket here).

1. grid: every configuration measured ``--rounds`` times, interleaved (round-robin) so that load
   drift hits every configuration alike; the median of the per-round medians is its step time;
2. tuner: ``--tuner-runs`` independent runs of the priority search (one measurement per trial, as
   in production); trials counted;
3. final: default, default-with-overlap, each tuned choice and the grid best re-measured
   ``--final-rounds`` times, interleaved.

Writes results/bench/overlap_tuning_<scenario>.{json,md,png}. CPU timings on a shared machine are noisy:
the JSON keeps every sample.

    .venv/bin/python bench/overlap_tuning.py            # ~5-10 min on 2 busy cores
    .venv/bin/python bench/overlap_tuning.py --quick    # smoke run
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist
from _common import write_outputs  # noqa: E402  (bench/ on sys.path: scripts run as bench/NAME.py)
from megatron.core import parallel_state as mpu
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

from megatron_hexiseq.layout import make_layout
from megatron_hexiseq.megatron.batch import slice_batch
from megatron_hexiseq.megatron.config import cpu_device_shim
from megatron_hexiseq.megatron.runtime import RunShape, build_runtime
from megatron_hexiseq.model import ModelSpec
from megatron_hexiseq.overlap.knobs import Ladder, OverlapConfig, SearchSpace, ddp_ladder
from megatron_hexiseq.overlap.search import distributed_priority_search, trial_from_exposed
from megatron_hexiseq.testbed.overlap_bench import (
    DEFAULT_MODEL,
    BenchConfig,
    BenchModel,
    OverlapBench,
    fit_cpu_ddp,
)
from megatron_hexiseq.testbed.spawn import run_ranks
from megatron_hexiseq.testbed.train import TrainConfig, build_gpt, make_batch, train_step

OUT_DIR = os.path.join("results", "bench")


def _agree(values: dict, group) -> dict:
    """Slowest rank's medians (a synchronous step is as slow as its slowest rank)."""
    keys = ("y_us", "exposed_us", "z_us")
    t = torch.tensor([values[k] for k in keys], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return {**values, **{k: v for k, v in zip(keys, t.tolist())}}


class _DdpScenario:
    """Plain data parallelism: the overlap testbed; one communication (DDP gradient reduce)."""

    def __init__(self, opts: dict, group) -> None:
        h = opts["model"]["hidden_size"]
        model = dataclasses.replace(
            DEFAULT_MODEL,
            hidden_size=h,
            kv_channels=h // DEFAULT_MODEL.num_attention_heads,
            ffn_hidden_size=4 * h,
            num_layers=opts["model"]["num_layers"],
            seq_length=opts["model"]["seq_length"],
        )
        self.cfg = BenchConfig(
            model=BenchModel(target=model, bench=model),
            warmup_steps=opts["warmup"],
            measure_steps=opts["steps"],
        )
        self.tb = OverlapBench(self.cfg, group)
        self.num_params = model.num_parameters
        self.space = SearchSpace(
            ladders=(ddp_ladder(self.num_params, min_bucket_params=opts["min_bucket"]),)
        )

    def measure(self, config: OverlapConfig) -> dict:
        m = self.tb.measure(config)
        return {
            "y_us": m.y_us,
            "exposed_us": m.exposed_us,
            "z_us": m.z_us,
            "buckets": m.num_buckets,
        }

    def trial(self, v: dict):
        return trial_from_exposed(
            v["y_us"], [v["exposed_us"]], v["z_us"], hidden_tol=self.cfg.hidden_tol
        )


class _HexiSeqScenario:
    """Context parallelism over the ranks with HexiSeq attention (two A2A groups of one rank: the
    K/V sub-ring) + Megatron DDP over dp_cp, per-token loss, AdamW: the steps of the Megatron CPU
    driver (``testbed.train``), with Megatron's groups and the HexiSeq runtime built ONCE per
    process (``train_rank`` builds them per call, ~50 gloo threads each). Two communications: DDP
    gradient reduce and HexiSeq's K/V exchange (``comm_chunks``). The attention's waits happen
    inside forward/backward, so trials use the step time alone (``trial_from_exposed`` with y = 0).
    """

    def __init__(self, opts: dict, group) -> None:
        W, S = dist.get_world_size(), opts["model"]["seq_length"]
        cut = [round(S * i / (2 * W)) for i in range(2 * W + 1)]  # zig-zag halves per rank
        segments = [[(cut[r], cut[r + 1]), (cut[2 * W - r - 1], cut[2 * W - r])] for r in range(W)]
        self.layout = make_layout(
            seq_length=S,
            num_attention_heads=8,
            num_query_groups=8,
            group_sizes=[1] * W,
            segments=segments,
            heads=[list(range(8))] * W,
        )
        h = opts["model"]["hidden_size"]
        self.model = ModelSpec(
            name="overlap-bench-hexiseq",
            num_layers=opts["model"]["num_layers"],
            hidden_size=h,
            num_attention_heads=8,
            num_query_groups=8,
            kv_channels=h // 8,
            ffn_hidden_size=2 * h,
            vocab_size=512,
            swiglu=True,
            normalization="RMSNorm",
            add_bias_linear=False,
            seq_length=S,
        )
        self.TrainConfig, self.build_gpt, self.opts = TrainConfig, build_gpt, opts
        mpu.initialize_model_parallel(tensor_model_parallel_size=1, context_parallel_size=W)
        run = RunShape(
            world_size=W,
            tensor_model_parallel_size=1,
            pipeline_model_parallel_size=1,
            context_parallel_size=W,
            seq_length=S,
            num_attention_heads=8,
            num_query_groups=8,
        )
        self.runtime = build_runtime(
            self.layout, run, cp_group=mpu.get_context_parallel_group(), kernel="auto"
        )
        self.dp_cp = mpu.get_data_parallel_group(with_context_parallel=True)
        cfg = TrainConfig(model=self.model, layout=self.layout)
        self.num_params = sum(p.numel() for p in build_gpt(cfg, runtime=self.runtime).parameters())
        ddp = ddp_ladder(
            self.num_params, min_bucket_params=max(opts["min_bucket"], self.num_params // 32)
        )
        self.space = SearchSpace(
            ladders=(ddp, Ladder(name="hexiseq_attn", knob="comm_chunks", values=(1, 2, 4, 8)))
        )

    def measure(self, config: OverlapConfig) -> dict:
        o = self.opts
        cfg = self.TrainConfig(
            model=self.model,
            layout=self.layout,
            kernel="auto",
            comm_chunks=config.comm_chunks,
            bucket_size=config.bucket_size,
            overlap_grad_reduce=config.overlap_grad_reduce,
        )
        runtime = dataclasses.replace(self.runtime, comm_chunks=config.comm_chunks)
        model = self.build_gpt(cfg, runtime=runtime)
        ddp_config = DistributedDataParallelConfig(
            overlap_grad_reduce=config.overlap_grad_reduce,
            bucket_size=config.bucket_size,
            grad_reduce_in_fp32=True,
        )
        with cpu_device_shim():
            ddp = DistributedDataParallel(model.config, ddp_config, model)
        params = [p for p in ddp.parameters() if p.requires_grad]
        opt = torch.optim.AdamW(params, lr=cfg.lr)
        batch = slice_batch(
            make_batch(cfg, 0, 0), segments=runtime.segments, seq_length=self.layout.seq_length
        )
        times = []
        for _ in range(o["warmup"] + o["steps"]):
            dist.barrier(group=self.dp_cp)
            _, timing = train_step(ddp, opt, params, batch, report_group=self.dp_cp)
            times.append(timing.local_s + timing.sync_s)
        z = statistics.median(times[o["warmup"] :]) * 1e6
        return {"y_us": 0.0, "exposed_us": 0.0, "z_us": z, "buckets": -1}

    def trial(self, v: dict):
        return trial_from_exposed(0.0, [v["z_us"]] * len(self.space.ladders), v["z_us"])


def _bench_rank(rank: int, world_size: int, opts: dict) -> dict:
    group = dist.group.WORLD
    sc = (_HexiSeqScenario if opts["scenario"] == "hexiseq" else _DdpScenario)(opts, group)
    space = sc.space
    configs = [space.config_at(lv) for lv in space.grid()]
    megatron_overlap_default = dataclasses.replace(
        configs[0], overlap_grad_reduce=True
    )  # 40M bucket
    grid = configs + [megatron_overlap_default]
    out: dict = {
        "num_params": sc.num_params,
        "grid": [c.to_dict() for c in grid],
        "labels": [c.label() for c in grid],
        "ladders": [
            {
                "name": lv.name,
                "knob": lv.knob,
                "values": [list(v) if isinstance(v, tuple) else v for v in lv.values],
            }
            for lv in space.ladders
        ],
    }

    def measure_all(cs, rounds):
        samples = [[] for _ in cs]
        for _ in range(rounds):
            for i, c in enumerate(cs):
                samples[i].append(_agree(sc.measure(c), group))
        return samples

    t0 = time.perf_counter()
    out["grid_samples"] = measure_all(grid, opts["rounds"])
    out["grid_s"] = time.perf_counter() - t0

    runs = []
    for _ in range(opts["tuner_runs"]):
        t0 = time.perf_counter()
        res = distributed_priority_search(
            space.num_levels,
            lambda lv: sc.trial(sc.measure(space.config_at(lv))),
            group=group,
            gallop=not opts["no_gallop"],
            tolerance=opts["tolerance"],
        )
        runs.append(
            {
                "levels": list(res.levels),
                "config": space.config_at(res.levels).to_dict(),
                "label": space.config_at(res.levels).label(),
                "num_trials": res.num_trials,
                "trials": [
                    {
                        "levels": list(s.levels),
                        "y_us": s.trial.y_us,
                        "x_us": list(s.trial.x_us),
                        "z_us": s.trial.z_us,
                        "decision": s.decision,
                    }
                    for s in res.history
                ],
                "seconds": time.perf_counter() - t0,
            }
        )
    out["tuner_runs"] = runs

    grid_z = [statistics.median(s["z_us"] for s in smp) for smp in out["grid_samples"]]
    best = min(range(len(grid)), key=grid_z.__getitem__)
    finalists = {
        "default (no overlap)": configs[0],
        "default, measured again (noise check)": configs[0],
        "default --overlap-grad-reduce": megatron_overlap_default,
        "grid best": grid[best],
    }
    for i, r in enumerate(runs):
        finalists[f"tuned run {i + 1}"] = OverlapConfig.from_dict(r["config"])
    names = list(finalists)
    final = measure_all([finalists[n] for n in names], opts["final_rounds"])
    out["final"] = {
        n: {"config": finalists[n].to_dict(), "label": finalists[n].label(), "samples": s}
        for n, s in zip(names, final)
    }
    out["grid_best_index"] = best
    return out


def _summarise(raw: dict, opts: dict) -> dict:
    def med(samples, key="z_us"):
        return statistics.median(s[key] for s in samples)

    grid = [
        {
            "label": lv,
            "config": c,
            "z_ms": med(s) / 1e3,
            "y_ms": med(s, "y_us") / 1e3,
            "exposed_ms": med(s, "exposed_us") / 1e3,
            "buckets": s[0]["buckets"],
        }
        for lv, c, s in zip(raw["labels"], raw["grid"], raw["grid_samples"])
    ]
    final = {
        n: {
            "label": f["label"],
            "z_ms": med(f["samples"]) / 1e3,
            "z_ms_all_rounds": [s["z_us"] / 1e3 for s in f["samples"]],
        }
        for n, f in raw["final"].items()
    }
    best = final["grid best"]["z_ms"]
    default = final["default (no overlap)"]["z_ms"]
    default_ov = final["default --overlap-grad-reduce"]["z_ms"]
    grid_size = len(grid)
    runs = []
    for i, r in enumerate(raw["tuner_runs"]):
        z = final[f"tuned run {i + 1}"]["z_ms"]
        runs.append(
            {
                "label": r["label"],
                "num_trials": r["num_trials"],
                "trial_share_of_grid": r["num_trials"] / grid_size,
                "z_ms": z,
                "gap_to_grid_best": z / best - 1.0,
                "vs_default": z / default,
                "vs_default_overlap": z / default_ov,
                "trials": r["trials"],
                "seconds": r["seconds"],
            }
        )
    grid_best_label = final["grid best"]["label"]
    noise = final["default, measured again (noise check)"]["z_ms"] / default - 1.0
    summary = {
        "setup": {
            **opts,
            "num_params": raw["num_params"],
            "grid_size": grid_size,
            "ladders": raw["ladders"],
            "grid_seconds": raw["grid_s"],
            "note": "2 CPU cores shared with other work; timings noisy",
        },
        "grid": grid,
        "final": final,
        "tuner_runs": runs,
        "same_config_noise": noise,
        "default_is_grid_optimal": grid_best_label == final["default (no overlap)"]["label"],
        "default_overlap_is_grid_optimal": grid_best_label
        == final["default --overlap-grad-reduce"]["label"],
    }
    overlapped = [g for g in grid if g["config"]["overlap_grad_reduce"] and g["buckets"] > 0]
    if opts["scenario"] == "ddp" and len({g["buckets"] for g in overlapped}) >= 3:
        fit = fit_cpu_ddp(
            [g["buckets"] for g in overlapped],
            [g["y_ms"] * 1e3 for g in overlapped],
            [g["exposed_ms"] * 1e3 for g in overlapped],
            [g["z_ms"] * 1e3 for g in overlapped],
        )
        summary["cpu_fit"] = {
            "compute": dataclasses.asdict(fit.compute),
            "exposed": dataclasses.asdict(fit.exposed),
            "rest_us": fit.rest_us,
        }
    return summary


def _markdown(s: dict) -> str:
    st = s["setup"]
    what = (
        "data parallel, one sequence per rank"
        if st["scenario"] == "ddp"
        else "HexiSeq context parallelism over the ranks + DDP over dp_cp; step time only"
    )
    lines = [
        f"# Overlap tuning, scenario '{st['scenario']}' ({what}; {st['world_size']} gloo ranks, "
        f"{st['num_params']:,} params, sequence {st['model']['seq_length']})",
        "",
        "Shared 2-core machine: timings are noisy; medians of interleaved rounds.",
        "",
        "## Grid",
        "",
        "| config | buckets | step ms | fwd+bwd ms | exposed comm ms |",
        "|---|---|---|---|---|",
    ]
    for g in s["grid"]:
        if st["scenario"] == "hexiseq":  # the driver reports step times only
            lines.append(f"| {g['label']} | - | {g['z_ms']:.1f} | - | - |")
        else:
            lines.append(
                f"| {g['label']} | {g['buckets']} | {g['z_ms']:.1f} | {g['y_ms']:.1f} | {g['exposed_ms']:.1f} |"
            )
    lines += [
        "",
        "## Final (re-measured, interleaved)",
        "",
        "| who | config | step ms |",
        "|---|---|---|",
    ]
    for n, f in s["final"].items():
        lines.append(f"| {n} | {f['label']} | {f['z_ms']:.1f} |")
    lines += [
        "",
        "## Tuner runs",
        "",
        "| run | choice | trials | trials / grid | step ms | gap to grid best | vs default | vs default+overlap |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for i, r in enumerate(s["tuner_runs"]):
        lines.append(
            f"| {i + 1} | {r['label']} | {r['num_trials']} | {r['trial_share_of_grid']:.0%} | "
            f"{r['z_ms']:.1f} | {r['gap_to_grid_best']:+.1%} | {r['vs_default']:.3f}x | "
            f"{r['vs_default_overlap']:.3f}x |"
        )
    lines += [
        "",
        f"Noise check: the default configuration measured twice in the final rounds differs by "
        f"{s['same_config_noise']:+.1%}; differences smaller than that are not resolved.",
        "",
        f"Grid size {s['setup']['grid_size']}. Default (no overlap) grid-optimal: "
        f"{s['default_is_grid_optimal']}; default --overlap-grad-reduce grid-optimal: "
        f"{s['default_overlap_is_grid_optimal']}.",
        "",
    ]
    if "cpu_fit" not in s:
        return "\n".join(lines)
    c, e = s["cpu_fit"]["compute"], s["cpu_fit"]["exposed"]
    lines += [
        f"CPU cost-model fit over overlapped configs (n = buckets): fwd+bwd = {c['coef'][0] / 1e3:.1f} ms + "
        f"{c['coef'][1] / 1e3:.2f} ms * n (R^2 {c['r2']:.2f}); exposed = {e['coef'][0] / 1e3:.1f} + "
        f"{e['coef'][1] / 1e3:.1f}/n + {e['coef'][2] / 1e3:.2f} * n ms (R^2 {e['r2']:.2f}).",
        "",
    ]
    return "\n".join(lines)


def _plot(s: dict, ax) -> None:
    if s["setup"]["scenario"] == "hexiseq":
        _heatmap(s, ax.figure, ax)
        return
    ov = [g for g in s["grid"] if g["config"]["overlap_grad_reduce"] and g["config"]["bucket_size"]]
    xs = [g["config"]["bucket_size"] for g in ov]
    ax.plot(xs, [g["z_ms"] for g in ov], "o-", label="step (overlap, bucket)")
    ax.plot(xs, [g["y_ms"] for g in ov], "s--", label="fwd+bwd")
    ax.plot(xs, [g["exposed_ms"] for g in ov], "^--", label="exposed comm")
    no = s["grid"][0]
    ax.axhline(no["z_ms"], color="gray", ls=":", label="step, no overlap (default)")
    for r in s["tuner_runs"]:
        b = next((g["config"]["bucket_size"] for g in s["grid"] if g["label"] == r["label"]), None)
        if b:
            ax.plot([b], [r["z_ms"]], "r*", ms=12)
    ax.set_xscale("log")
    ax.set_xlabel("DDP bucket size (parameters)")
    ax.set_ylabel("ms (grid medians; red star: tuned, re-measured)")
    ax.legend(fontsize=8)


def _heatmap(s: dict, fig, ax) -> None:
    """Step time over (DDP level x comm_chunks) for the two-communication scenario."""
    import numpy as np

    ddp_values, chunk_values = (
        s["setup"]["ladders"][0]["values"],
        s["setup"]["ladders"][1]["values"],
    )
    z = np.full((len(ddp_values), len(chunk_values)), np.nan)
    for g in s["grid"]:
        key = [g["config"]["overlap_grad_reduce"], g["config"]["bucket_size"]]
        if key in ddp_values:
            z[ddp_values.index(key), chunk_values.index(g["config"]["comm_chunks"])] = g["z_ms"]
    im = ax.imshow(z, aspect="auto", cmap="viridis")
    ax.set_yticks(
        range(len(ddp_values)),
        ["no overlap" if not o else f"b={b:,}" for o, b in ddp_values],
        fontsize=7,
    )
    ax.set_xticks(range(len(chunk_values)), [str(c) for c in chunk_values])
    ax.set_xlabel("HexiSeq comm_chunks")
    fig.colorbar(im, ax=ax, label="step ms (grid median)")
    for r in s["tuner_runs"]:
        g = next(g for g in s["grid"] if g["label"] == r["label"])
        key = [g["config"]["overlap_grad_reduce"], g["config"]["bucket_size"]]
        ax.plot(
            [chunk_values.index(g["config"]["comm_chunks"])], [ddp_values.index(key)], "r*", ms=12
        )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--scenario", choices=("ddp", "hexiseq"), default="ddp")
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--hidden-size", type=int, help="default 512 (ddp) / 256 (hexiseq)")
    p.add_argument("--num-layers", type=int, help="default 4 (ddp) / 2 (hexiseq)")
    p.add_argument("--seq-length", type=int, help="default 32 (ddp) / 2048 (hexiseq)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--final-rounds", type=int, default=5)
    p.add_argument("--tuner-runs", type=int, default=3)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--min-bucket", type=int, default=50_000)
    p.add_argument("--no-gallop", action="store_true")
    p.add_argument(
        "--tolerance",
        type=float,
        default=0.05,
        help="search noise tolerance (0 = Lagom as written)",
    )
    p.add_argument("--quick", action="store_true", help="tiny smoke run")
    a = p.parse_args(argv)
    hexiseq = a.scenario == "hexiseq"
    a.hidden_size = a.hidden_size or (256 if hexiseq else 512)
    a.num_layers = a.num_layers or (2 if hexiseq else 4)
    a.seq_length = a.seq_length or (2048 if hexiseq else 32)
    if a.quick:
        a.seq_length = 256 if hexiseq else a.seq_length
        a.hidden_size, a.rounds, a.final_rounds, a.tuner_runs, a.steps, a.warmup = (
            128,
            1,
            1,
            1,
            2,
            1,
        )
    opts = {
        "scenario": a.scenario,
        "world_size": a.world_size,
        "model": {
            "hidden_size": a.hidden_size,
            "num_layers": a.num_layers,
            "seq_length": a.seq_length,
        },
        "rounds": a.rounds,
        "final_rounds": a.final_rounds,
        "tuner_runs": a.tuner_runs,
        "steps": a.steps,
        "warmup": a.warmup,
        "min_bucket": a.min_bucket,
        "no_gallop": a.no_gallop,
        "tolerance": a.tolerance,
    }
    t0 = time.perf_counter()
    raw = run_ranks(_bench_rank, a.world_size, opts)[0]
    summary = _summarise(raw, opts)
    summary["setup"]["total_seconds"] = time.perf_counter() - t0
    md = _markdown(summary)
    title, table = md.split("\n", 1)
    write_outputs(
        OUT_DIR,
        f"overlap_tuning_{a.scenario}",
        data={"summary": summary, "raw": raw},
        title=title.removeprefix("# "),
        table=table.strip(),
        plot=lambda ax: _plot(summary, ax),
    )
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
