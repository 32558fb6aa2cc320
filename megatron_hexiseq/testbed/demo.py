"""The main job on the heterogeneous CPU testbed: train with the best symmetric layout and with
the HexiSeq layout, measure both, compare with the cost model, check the losses agree.

``python -m megatron_hexiseq.testbed.demo --cluster C.yaml --layout L.json --model-config M.yaml
--testbed 1+2`` (``scripts/demo.sh`` runs ``profile`` and ``plan`` first to make C and L).

The best symmetric layout is rebuilt from the planner's own baseline list (the feasible one with
the lowest predicted time), so both runs use the same cost model, cluster and model. Both runs
start from the same weights and see the same data; attention is exact, so their losses must agree
to floating-point reordering (checked: relative 1e-4 at every step).

``--packed L.json`` (a JSON list of document lengths, e.g. ``../shared/data/doc_lengths_prolong.json``)
trains on packed micro-batches instead, with ``--reset-attention-mask``: the THD-style even split,
the fixed HexiSeq layout and per-micro-batch layouts from the batch planner
(``testbed/packed.py``), each on the same micro-batches.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from megatron_hexiseq.cluster import Cluster, load_cluster
from megatron_hexiseq.costmodel import estimate
from megatron_hexiseq.errors import HexiSeqError, run_user_command, short
from megatron_hexiseq.io import atomic_path, check_outputs, write_json_atomic
from megatron_hexiseq.layout import Layout
from megatron_hexiseq.model import ModelSpec, get_model
from megatron_hexiseq.planner.baselines import best_symmetric
from megatron_hexiseq.progress import waiting
from megatron_hexiseq.run_config import TrainOptions, check_options_record, options_from_record
from megatron_hexiseq.testbed.pinning import TestbedShape, cpu_sets
from megatron_hexiseq.testbed.spawn import run_ranks

if TYPE_CHECKING:
    from megatron_hexiseq.testbed.train import TrainConfig

# Megatron warns on import that Apex and Transformer Engine are missing (a dozen lines on a CPU
# run, nothing to act on): the rank processes (testbed.spawn) and this driver both silence it
NOT_INSTALLED_WARNING = r".*(Apex|Transformer Engine).* not installed"

LOSS_RTOL = 1e-4


@dataclass(frozen=True, kw_only=True)
class RunSummary:
    """One training run on the testbed."""

    name: str
    layout: Layout
    losses: list[float]
    step_times_s: list[list[float]]  # [rank][step]
    predicted_step_s: float
    predicted_per_rank: list[
        dict[str, float]
    ]  # per rank: linear_s, attention_s (incl. exposed comm)
    warmup: int

    @property
    def measured_step_s(self) -> float:
        """Median over measured steps of the slowest rank's step time."""
        steps = range(self.warmup, len(self.losses))
        return statistics.median(max(t[s] for t in self.step_times_s) for s in steps)

    @property
    def tokens_per_s(self) -> float:
        return self.layout.seq_length / self.measured_step_s

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "losses": self.losses,
            "step_times_s": self.step_times_s,
            "measured_step_s": self.measured_step_s,
            "predicted_step_s": self.predicted_step_s,
            "tokens_per_s": self.tokens_per_s,
            "predicted_tokens_per_s": self.layout.seq_length / self.predicted_step_s,
            "prediction_error": self.predicted_step_s / self.measured_step_s - 1.0,
            "per_rank_tokens": [r.num_tokens for r in self.layout.ranks],
            "per_rank_heads": [len(r.heads) for r in self.layout.ranks],
            "groups": [list(g.ranks) for g in self.layout.groups],
            "predicted_per_rank": self.predicted_per_rank,
        }


def best_symmetric_layout(
    cluster: Cluster, model: ModelSpec, options: TrainOptions
) -> tuple[str, Layout]:
    """The feasible symmetric baseline with the lowest predicted time, as (label, layout)."""
    best = best_symmetric(cluster, model, model.seq_length, [options])
    if best is None:
        raise HexiSeqError("no symmetric layout fits in memory on this testbed; raise --memory-gib")
    layout = best[0].layout
    assert layout is not None  # a baseline without a layout has no time, so it is never the best
    return best[0].label, layout


def driver_config(
    layout: Layout, model: ModelSpec, *, steps: int, kernel: str = "auto"
) -> TrainConfig:
    """The CPU driver's run config; Megatron's start-up checks run here, before any process starts."""
    from megatron_hexiseq.megatron.runtime import check_run  # torch, megatron.core: 5-40 s
    from megatron_hexiseq.testbed.train import TrainConfig, run_shape

    cfg = TrainConfig(
        model=model, layout=layout, steps=steps, kernel=kernel, bucket_size=None, lr=1e-3
    )
    check_run(layout, run_shape(cfg))
    return cfg


def train_on_testbed(cfg: TrainConfig, shape: str) -> tuple[list[float], list[list[float]]]:
    """Train ``cfg`` on pinned testbed ranks: (losses, step times per rank)."""
    from megatron_hexiseq.testbed.train import train_rank

    tb = TestbedShape.parse(shape)
    if tb.world_size != cfg.layout.world_size:
        raise HexiSeqError(
            f"layout has {cfg.layout.world_size} ranks but testbed {shape} has {tb.world_size}"
        )
    results = run_ranks(train_rank, tb.world_size, cfg, cpu_sets=cpu_sets(tb))
    return results[0].losses, [r.step_times_s for r in results]


def compare(
    cluster: Cluster,
    model: ModelSpec,
    options: TrainOptions,
    hexiseq: Layout,
    shape: str,
    *,
    steps: int,
    warmup: int,
    kernel: str = "auto",
) -> dict[str, Any]:
    """Train with the best symmetric layout and with ``hexiseq``; return the comparison record."""
    sym_label, sym = best_symmetric_layout(cluster, model, options)
    named = [(f"symmetric:{sym_label}", sym), ("hexiseq", hexiseq)]
    cfgs = [
        driver_config(lay, model, steps=steps, kernel=kernel) for _, lay in named
    ]  # check both first
    runs = []
    for (name, lay), cfg in zip(named, cfgs):
        losses, times = train_on_testbed(cfg, shape)
        est = estimate(lay, cluster, model, options)
        per_rank = [
            {"linear_s": r.breakdown["linear_s"], "attention_s": r.time_s - r.breakdown["linear_s"]}
            for r in est.per_rank
        ]
        runs.append(
            RunSummary(
                name=name,
                layout=lay,
                losses=losses,
                step_times_s=times,
                predicted_step_s=est.iteration_time_s,
                predicted_per_rank=per_rank,
                warmup=warmup,
            )
        )
    s, h = runs
    worst = max(abs(a - b) / max(abs(a), 1e-12) for a, b in zip(s.losses, h.losses))
    return {
        "testbed": shape,
        "cluster": cluster.name,
        "model": model.name,
        "seq_length": model.seq_length,
        "steps": steps,
        "warmup": warmup,
        "kernel": kernel,
        "symmetric": s.to_dict(),
        "hexiseq": h.to_dict(),
        "speedup_measured": s.measured_step_s / h.measured_step_s,
        "speedup_predicted": s.predicted_step_s / h.predicted_step_s,
        "loss_max_rel_diff": worst,
        "losses_agree": worst <= LOSS_RTOL,
    }


def print_table(rec: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(
        title=f"CPU testbed {rec['testbed']}: {rec['model']}, {rec['seq_length']} tokens, "
        f"{rec['steps']} steps ({rec['warmup']} warm-up)"
    )
    for col in (
        "layout",
        "tokens/rank",
        "heads/rank",
        "measured tok/s",
        "predicted tok/s",
        "pred. error",
        "final loss",
    ):
        t.add_column(col, justify="right" if col != "layout" else "left")
    for key in ("symmetric", "hexiseq"):
        r = rec[key]
        t.add_row(
            r["name"],
            ",".join(map(str, r["per_rank_tokens"])),
            ",".join(map(str, r["per_rank_heads"])),
            f"{r['tokens_per_s']:.0f}",
            f"{r['predicted_tokens_per_s']:.0f}",
            f"{100 * r['prediction_error']:+.1f}%",
            f"{r['losses'][-1]:.6f}",
        )
    con = Console(width=120)
    con.print(t)
    con.print(
        f"speedup measured {rec['speedup_measured']:.2f}x, predicted {rec['speedup_predicted']:.2f}x; "
        f"losses agree: {rec['losses_agree']} (max rel diff {rec['loss_max_rel_diff']:.1e})"
    )


def plot(rec: dict[str, Any], path: str) -> None:
    """Left: per-rank predicted time breakdown (linear phase, attention phase incl. exposed comm,
    idle up to the predicted step) for both layouts, with the measured step time. Right: losses."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    x, ticks, labels = 0.0, [], []
    labels_at: list[tuple[float, float, str]] = []
    for i, key in enumerate(("symmetric", "hexiseq")):
        r = rec[key]
        for rank, part in enumerate(r["predicted_per_rank"]):
            lin, att = part["linear_s"], part["attention_s"]
            idle = max(0.0, r["predicted_step_s"] - lin - att)
            first = i == 0 and rank == 0
            ax1.bar(x, lin, color="C0", label="linear (predicted)" if first else None)
            ax1.bar(
                x,
                att,
                bottom=lin,
                color="C1",
                label="attention + exposed comm (predicted)" if first else None,
            )
            ax1.bar(
                x, idle, bottom=lin + att, color="0.85", label="idle (predicted)" if first else None
            )
            ticks.append(x)
            labels.append(f"r{rank}\n{r['per_rank_tokens'][rank]}t/{r['per_rank_heads'][rank]}h")
            x += 1
        ax1.hlines(
            r["measured_step_s"],
            x - len(r["predicted_per_rank"]) - 0.4,
            x - 0.6,
            colors="k",
            label="measured step (median)" if i == 0 else None,
        )
        labels_at.append(
            (x - len(r["predicted_per_rank"]) / 2 - 0.5, r["measured_step_s"], r["name"])
        )
        x += 0.8
        ax2.plot(r["losses"], label=r["name"], linestyle="-" if i == 0 else "--")
    # the y axis holds every bar, every measured-step line and the layout name above each line
    # (names are placed in data coordinates: autoscaling ignores text, so the limit is set here)
    top = max(
        max(
            r["measured_step_s"],
            r["predicted_step_s"],
            *(p["linear_s"] + p["attention_s"] for p in r["predicted_per_rank"]),
        )
        for r in (rec["symmetric"], rec["hexiseq"])
    )
    ax1.set_ylim(0, top * 1.15)
    for xpos, y, name in labels_at:
        ax1.text(xpos, y + top * 0.02, name, ha="center", va="bottom", fontsize=8)
    ax1.set_xticks(ticks, labels, fontsize=7)
    ax1.set_ylabel("seconds per step")
    ax1.set_title(
        f"speed-up {rec['speedup_measured']:.2f}x measured, {rec['speedup_predicted']:.2f}x predicted"
    )
    ax1.legend(fontsize=7, loc="lower center", bbox_to_anchor=(0.5, -0.42), ncol=2)
    ax2.set_xlabel("step")
    ax2.set_ylabel("per-token loss")
    ax2.set_title("loss curves (must coincide)")
    ax2.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    from megatron_hexiseq.errors import OneLineParser

    p = OneLineParser(
        prog="python -m megatron_hexiseq.testbed.demo", description=__doc__.splitlines()[0]
    )
    p.add_argument(
        "--cluster", required=True, help="cluster spec (from 'megatron-hexiseq profile')"
    )
    p.add_argument("--layout", required=True, help="HexiSeq layout (from 'megatron-hexiseq plan')")
    p.add_argument("--model-config", required=True, help="model YAML used for the plan")
    p.add_argument("--testbed", required=True, help="testbed shape used for the profile, e.g. 1+2")
    p.add_argument("--steps", type=int, default=30, help="training steps per layout (default 30)")
    p.add_argument("--warmup", type=int, default=3, help="steps left out of the timing (default 3)")
    p.add_argument(
        "--kernel",
        default="auto",
        choices=("auto", "reference"),
        help="attention kernel (default auto: the fused kernel for the device)",
    )
    p.add_argument(
        "--packed",
        metavar="L.json",
        default=None,
        help="document lengths (JSON list): train on packed micro-batches, three schemes "
        "(THD-style even split, fixed HexiSeq layout, per-micro-batch layouts)",
    )
    p.add_argument(
        "--doc-scale",
        type=float,
        default=None,
        help="with --packed: scale the lengths by this factor before packing (default 1/16: a "
        "2K-token micro-batch holds the documents of a 32K one)",
    )
    p.add_argument("--seed", type=int, default=0, help="with --packed: packing seed (default 0)")
    p.add_argument(
        "-o",
        "--output",
        default="results/demo.json",
        help="comparison JSON (default results/demo.json)",
    )
    p.add_argument(
        "--plot", default="results/demo.png", help="figure; '' for none (default results/demo.png)"
    )
    args = p.parse_args(argv)
    return run_user_command(lambda: _run(args))


def _run(args: argparse.Namespace) -> int:
    if not 0 <= args.warmup < args.steps <= 100_000:
        raise HexiSeqError(
            f"--steps ({short(args.steps)}) must exceed --warmup ({short(args.warmup)}) >= 0 (and be "
            "at most 100000)"
        )
    plot_path = args.plot or None
    check_outputs(
        [
            ("-o", args.output),
            ("--plot", plot_path),
        ],  # every output checked before minutes of training
        inputs=[args.cluster, args.layout, args.model_config, args.packed],
        figures=["--plot"],
    )
    if args.packed is None and args.doc_scale is not None:
        raise HexiSeqError("--doc-scale needs --packed L.json")
    layout = Layout.load(args.layout)
    cluster = load_cluster(args.cluster)
    model = get_model(config_path=args.model_config, overrides={"seq_length": layout.seq_length})
    options = options_from_record(
        check_options_record(layout.meta.get("options"), f"layout {args.layout}")
    )
    shape = TestbedShape.parse(args.testbed)
    if shape.world_size != layout.world_size:
        raise HexiSeqError(
            f"layout {args.layout} has {layout.world_size} ranks but testbed {args.testbed} has "
            f"{shape.world_size}; give the --testbed the layout was planned for"
        )
    cpu_sets(shape)  # the cores exist
    warnings.filterwarnings("ignore", message=NOT_INSTALLED_WARNING, category=UserWarning)
    if args.packed is not None:
        return _run_packed(args, cluster, model, options, layout, plot_path)
    with waiting(f"training twice on testbed {args.testbed}, {args.steps} steps each"):
        rec = compare(
            cluster,
            model,
            options,
            layout,
            args.testbed,
            steps=args.steps,
            warmup=args.warmup,
            kernel=args.kernel,
        )
    if plot_path:
        with atomic_path(plot_path) as tmp:
            plot(rec, tmp)
    write_json_atomic(args.output, rec)
    print_table(rec)
    print(f"wrote {args.output}" + (f" and {plot_path}" if plot_path else ""))
    return 0 if rec["losses_agree"] else 1


def _run_packed(
    args: argparse.Namespace,
    cluster: Cluster,
    model: ModelSpec,
    options: TrainOptions,
    layout: Layout,
    plot_path: str | None,
) -> int:
    from megatron_hexiseq.testbed.packed import (
        DOC_SCALE,
        compare_packed,
        plot_packed,
        print_packed_table,
    )
    from megatron_hexiseq.varlen.packing import load_doc_lengths

    lengths = load_doc_lengths(args.packed)
    with waiting(f"training three schemes on testbed {args.testbed}, {args.steps} steps each"):
        rec = compare_packed(
            cluster,
            model,
            options,
            layout,
            args.testbed,
            lengths,
            steps=args.steps,
            warmup=args.warmup,
            seed=args.seed,
            doc_scale=args.doc_scale if args.doc_scale is not None else DOC_SCALE,
            kernel=args.kernel,
        )
    if plot_path:
        with atomic_path(plot_path) as tmp:
            plot_packed(rec, tmp)
    write_json_atomic(args.output, rec)
    print_packed_table(rec)
    print(f"wrote {args.output}" + (f" and {plot_path}" if plot_path else ""))
    return 0 if rec["losses_agree"] else 1


if __name__ == "__main__":
    sys.exit(main())
