"""Human output of plans and simulations: rich tables and a matplotlib figure."""

from __future__ import annotations

from collections.abc import Sequence

from rich.console import Console
from rich.table import Table

from megatron_hexiseq.costmodel import Estimate
from megatron_hexiseq.layout import Layout


def _fmt_time(x: float | None) -> str:
    """Seconds with 4 significant digits in s, ms or µs: 1.234 s, 12.34 ms, 5.678 µs (tiny models stay readable)."""
    if x is None:
        return "-"
    for scale, unit in ((1.0, "s"), (1e-3, "ms"), (1e-6, "µs")):
        if abs(x) >= scale:
            return f"{x / scale:.4g} {unit}"
    return f"{x / 1e-6:.4g} µs" if x else "0 s"


def _fmt_rate(x: float | None) -> str:
    return "-" if x is None else f"{x:,.0f}"


def layout_table(layout: Layout, title: str = "") -> Table:
    """Per rank: host, GPU, group, tokens, heads, segments, predicted time and memory."""
    per_rank = {p["rank"]: p for p in (layout.predicted or {}).get("per_rank", [])}
    table = Table(title=title or None, show_lines=False)
    for col in (
        "rank",
        "host",
        "gpu",
        "group",
        "tokens",
        "heads",
        "segments",
        "time",
        "memory GiB",
    ):
        table.add_column(
            col,
            justify="right"
            if col in ("rank", "group", "tokens", "heads", "time", "memory GiB")
            else "left",
        )
    for r in layout.ranks:
        p = per_rank.get(r.rank, {})
        cap = p.get("capacity_gib")
        mem = (
            "-"
            if "memory_gib" not in p
            else (f"{p['memory_gib']:.1f}" + (f" / {cap:.1f}" if cap else ""))
        )
        segs = " ".join(f"[{s},{e})" for s, e in r.segments)
        if len(segs) > 40:
            segs = segs[:37] + "..."
        table.add_row(
            str(r.rank),
            r.host,
            r.gpu,
            str(r.group),
            f"{r.num_tokens:,}",
            str(len(r.heads)),
            segs,
            _fmt_time(p.get("time_s")),
            mem,
        )
    return table


def baselines_table(layout: Layout) -> Table:
    """Predicted tokens/s of the layout vs each baseline and heuristic (speedup = layout / it)."""
    ours = (layout.predicted or {}).get("tokens_per_s")
    table = Table(title="predicted throughput vs baselines")
    for col in ("layout", "config", "iteration", "tokens/s", "speedup of plan"):
        table.add_column(col, justify="left" if col in ("layout", "config") else "right")
    chosen = layout.meta.get("chosen", "plan")
    table.add_row(
        f"[bold]plan ({chosen})[/bold]",
        "",
        _fmt_time((layout.predicted or {}).get("iteration_time_s")),
        _fmt_rate(ours),
        "1.00x",
    )
    heuristics = [
        dict(h, name=f"{h['name']} (heuristic)")
        for h in (layout.planner or {}).get("heuristics", [])
    ]
    for b in list(layout.baselines) + heuristics:
        cfg = ", ".join(
            f"{k}={v}"
            for k, v in b.get("config", {}).items()
            if k in ("k", "hp", "cp", "kv_replication")
        )
        rate = b.get("tokens_per_s")
        speed = f"{ours / rate:.2f}x" if ours and rate else ("infeasible" if rate is None else "-")
        note = b.get("reason", "")
        table.add_row(
            b["name"],
            cfg + (f" ({note})" if note and rate is None else ""),
            _fmt_time(b.get("iteration_time_s")),
            _fmt_rate(rate),
            speed,
        )
    return table


def tp_sizes_table(layout: Layout) -> Table | None:
    """``--tensor-model-parallel-size auto``'s choice (``planner.tensor_parallel.sizes``): each TP
    size's lower bound, its plan's iteration time and how it compares with the chosen one, or why it
    was not planned (its bound, the three-plan cap, memory). None when one size was given."""
    record = (layout.planner or {}).get("tensor_parallel") or {}
    sizes = record.get("sizes") or []
    if len(sizes) < 2:
        return None
    chosen = next((s for s in sizes if s.get("chosen")), None)
    best = chosen.get("iteration_time_s") if chosen else None
    planned = sum(s.get("iteration_time_s") is not None for s in sizes)
    search_s = record.get("time_s")  # 0 in a --reproducible file
    table = Table(
        title="tensor-parallel sizes (--tensor-model-parallel-size auto)",
        caption=f"{planned} size{'' if planned == 1 else 's'} planned"
        + (f" in {search_s:.2f} s" if search_s else ""),
    )
    for col in ("TP size", "lower bound", "iteration", "vs chosen", "outcome"):
        table.add_column(col, justify="left" if col == "outcome" else "right")
    for s in sizes:
        time_s = s.get("iteration_time_s")
        if s.get("chosen"):
            outcome = "[bold]chosen[/bold]"
        elif time_s is not None:
            outcome = "planned"
        else:
            outcome = s.get("skipped") or f"infeasible: {s.get('infeasible', '?')}"
        table.add_row(
            f"[bold]{s['tensor_model_parallel_size']}[/bold]"
            if s.get("chosen")
            else str(s["tensor_model_parallel_size"]),
            _fmt_time(s.get("lower_bound_s")),
            _fmt_time(time_s),
            f"{time_s / best:.2f}x slower" if time_s and best and not s.get("chosen") else "-",
            outcome,
        )
    return table


def make_console() -> Console:
    """A console as wide as the terminal, or 160 columns when output is piped (tables stay readable)."""
    c = Console()
    return c if c.is_terminal else Console(width=160)


def print_layout(layout: Layout, *, console: Console | None = None, title: str = "") -> None:
    console = console or make_console()
    groups = f"{len(layout.groups)} group{'' if len(layout.groups) == 1 else 's'}"
    console.print(
        layout_table(
            layout,
            title or f"layout: {_ranks_label(layout)}, {groups}, seq_length {layout.seq_length:,}",
        )
    )
    if layout.baselines:
        console.print(baselines_table(layout))
    sizes = tp_sizes_table(layout)
    if sizes is not None:
        console.print(sizes)
    pl = layout.planner
    if pl:
        bits = [f"status {pl.get('status')}", f"solve time {pl.get('solve_time_s', 0):.2f} s"]
        if pl.get("bound") is not None:
            bits.append(
                f"surrogate bound {_fmt_time(pl['bound'])}, gap {100 * (pl.get('gap') or 0):.2f}%"
            )
        if pl.get("method"):
            bits.insert(0, f"planner {pl['method']}")
        if pl.get("winner"):
            bits.insert(0, f"winner: {pl['winner'].get('family')} {pl['winner'].get('name')}")
        if pl.get("time_limit_reached"):
            bits.append(
                f"time limit of {pl.get('time_limit_s')} s reached: the search was cut short"
            )
        console.print("; ".join(bits))
        if pl.get("gap_meaning"):
            console.print(pl["gap_meaning"])
    opts = layout.meta.get("options")
    if opts:
        console.print(
            f"memory mode: {opts.get('memory_mode')}{' + recompute' if opts.get('recompute') else ''} "
            f"-> Megatron flags: {' '.join(opts.get('megatron_flags', []))}"
        )


def estimate_table(name: str, layout: Layout, est: Estimate) -> Table:
    """Per-rank cost-model figures of one layout (simulate)."""
    table = Table(
        title=f"{name}: iteration {_fmt_time(est.iteration_time_s)}, {_fmt_rate(est.tokens_per_s)} tokens/s"
        f"{'' if est.feasible else ' (OUT OF MEMORY)'}"
    )
    for col in (
        "rank",
        "gpu",
        "group",
        "tokens",
        "heads",
        "compute",
        "exposed comm",
        "time",
        "memory GiB",
        "capacity GiB",
    ):
        table.add_column(col, justify="left" if col == "gpu" else "right")
    gib = 2.0**30
    for pr, r in zip(est.per_rank, layout.ranks):
        table.add_row(
            str(pr.rank),
            pr.gpu,
            str(r.group),
            f"{pr.tokens:,}",
            str(pr.heads),
            _fmt_time(pr.compute_s),
            _fmt_time(pr.exposed_comm_s),
            _fmt_time(pr.time_s),
            f"{pr.memory_bytes / gib:.1f}",
            f"{pr.capacity_bytes / gib:.1f}",
        )
    return table


def plot_estimates(path: str, items: Sequence[tuple[str, Estimate]]) -> None:
    """Per layout: stacked bars per rank (compute / exposed comm / idle up to the step) and memory vs capacity."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = len(items)
    fig, axes = plt.subplots(n, 2, figsize=(14, 3.2 * n), squeeze=False)
    gib = 2.0**30
    for row, (name, est) in enumerate(items):
        ranks = [p.rank for p in est.per_rank]
        comp = [p.compute_s for p in est.per_rank]
        comm = [p.exposed_comm_s for p in est.per_rank]
        step = (
            est.iteration_time_s
            if est.iteration_time_s is not None
            else max(p.time_s for p in est.per_rank)
        )
        idle = [max(0.0, step - c - m) for c, m in zip(comp, comm)]
        ax = axes[row][0]
        ax.bar(ranks, comp, label="compute", color="#4c72b0")
        ax.bar(ranks, comm, bottom=comp, label="exposed comm", color="#dd8452")
        ax.bar(
            ranks, idle, bottom=[c + m for c, m in zip(comp, comm)], label="idle", color="#cccccc"
        )
        ax.set_title(f"{name}: time per rank (step {_fmt_time(step)})")
        ax.set_xlabel("rank")
        ax.set_ylabel("s")
        ax.legend(fontsize=7)
        ax = axes[row][1]
        ax.bar(ranks, [p.memory_bytes / gib for p in est.per_rank], label="memory", color="#55a868")
        ax.plot(
            ranks,
            [p.capacity_bytes / gib for p in est.per_rank],
            "k_",
            markersize=12,
            label="capacity",
        )
        ax.set_title(f"{name}: memory per rank")
        ax.set_xlabel("rank")
        ax.set_ylabel("GiB")
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _ranks_label(layout: Layout) -> str:
    """``16 ranks``, or ``8 TP bundles of 8 GPUs (heads per TP rank)`` for a layout over bundles."""
    t = layout.tensor_model_parallel_size
    if t == 1:
        return f"{layout.world_size} ranks"
    return f"{layout.world_size} TP bundles of {t} GPUs (heads per TP rank)"
