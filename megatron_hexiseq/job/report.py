"""Human output of a job: the alternatives table, the domains table (with a busy/idle bar each),
and the picture of the domains (``plot_job``: the cluster's GPUs coloured by domain, each domain's
busy / exposed-reduction / idle bar over the step)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from rich.console import Console
from rich.table import Table

from megatron_hexiseq.io import atomic_path
from megatron_hexiseq.job.spec import JobPlan
from megatron_hexiseq.planner.report import _fmt_rate, _fmt_time, make_console

BAR = 24  # characters of a domain's text bar


def _gpus(job: JobPlan, ranks: Sequence[int]) -> str:
    """``8 H100 + 4 A100``: a domain's GPUs by type, in its rank order."""
    count: dict[str, int] = {}
    for r in ranks:
        name = job.cluster_spec.devices[r].gpu.name.split("-")[0]
        count[name] = count.get(name, 0) + 1
    return " + ".join(f"{v} {k}" for k, v in count.items())


def _hosts(job: JobPlan, ranks: Sequence[int]) -> str:
    hosts: list[str] = []
    for r in ranks:
        h = job.cluster_spec.devices[r].node
        if h not in hosts:
            hosts.append(h)
    text = ",".join(hosts)
    return text if len(text) <= 40 else text[:37] + "..."


def alternatives_table(job: JobPlan) -> Table:
    """The job and each alternative: step, tokens/s, the job's speed-up over it, what it chose."""
    pred = job.predicted or {}
    ours = pred.get("step_time_s")
    table = Table(title="predicted step vs the alternatives (same model, same fixed costs)")
    for col in ("job", "step", "tokens/s", "speed-up of the job", "config"):
        table.add_column(col, justify="left" if col in ("job", "config") else "right")
    winner = (job.planner or {}).get("winner", {})
    table.add_row(
        f"[bold]plan ({winner.get('family', 'job')})[/bold]",
        _fmt_time(ours),
        _fmt_rate(pred.get("tokens_per_s")),
        "1.00x",
        str(winner.get("config", "")),
    )
    for alt in job.alternatives:
        step = alt.get("step_time_s")
        speed = f"{step / ours:.2f}x" if step and ours else "infeasible"
        note = alt.get("config") or "" if alt.get("feasible") else alt.get("reason", "")
        table.add_row(
            str(alt["name"]), _fmt_time(step), _fmt_rate(alt.get("tokens_per_s")), speed, str(note)
        )
    return table


def domain_rows(job: JobPlan) -> list[dict[str, Any]]:
    """Per domain: its GPUs, micro-batches, busy time (micro-batches and exposed reduction) and
    the time it waits for the busiest domain (from ``predicted``)."""
    pred = job.predicted or {}
    per = pred.get("domains") or [{} for _ in job.domains]
    step = pred.get("step_time_s") or 0.0
    top = max((p.get("busy_s", 0.0) for p in per), default=0.0)
    rows = []
    for i, (d, p) in enumerate(zip(job.domains, per)):
        busy = p.get("busy_s", 0.0)
        rows.append(
            {
                "domain": i,
                "gpus": _gpus(job, d.ranks),
                "hosts": _hosts(job, d.ranks),
                "micro_batches": d.micro_batches,
                "micro_batch_s": p.get("micro_batch_s"),
                "compute_s": busy - p.get("grad_sync_s", 0.0),
                "grad_sync_s": p.get("grad_sync_s", 0.0),
                "idle_s": top - busy,
                "fixed_s": step - top,
                "step_s": step,
                "layout": p.get("layout", ""),
            }
        )
    return rows


def _bar(row: Mapping[str, Any]) -> str:
    """A domain's step in ``BAR`` characters: busy, exposed reduction, waiting, fixed costs."""
    step = row["step_s"] or 1.0
    parts = (
        ("█", row["compute_s"]),
        ("▓", row["grad_sync_s"]),
        ("·", row["idle_s"]),
        ("|", row["fixed_s"]),
    )
    return "".join(ch * round(BAR * s / step) for ch, s in parts)[:BAR]


def domains_table(job: JobPlan) -> Table:
    pred = job.predicted or {}
    table = Table(
        title=f"{len(job.domains)} domain{'s' if len(job.domains) != 1 else ''}: busy █, exposed "
        f"gradient reduction ▓, waiting ·, optimizer and fixed costs | (idle "
        f"{100 * (pred.get('idle_fraction') or 0):.1f}% on average)"
    )
    for col in (
        "domain",
        "GPUs",
        "hosts",
        "layout",
        "micro-batches",
        "micro-batch",
        "busy",
        "step",
    ):
        table.add_column(col, justify="right" if col in ("domain", "micro-batches") else "left")
    for row in domain_rows(job):
        table.add_row(
            str(row["domain"]),
            row["gpus"],
            row["hosts"],
            str(row["layout"]),
            str(row["micro_batches"]),
            _fmt_time(row["micro_batch_s"]),
            _fmt_time(row["compute_s"] + row["grad_sync_s"]),
            _bar(row),
        )
    return table


def print_job(job: JobPlan, *, console: Console | None = None) -> None:
    """The job's summary line, its domains and the alternatives."""
    console = console or make_console()
    pred = job.predicted or {}
    console.print(
        f"job: {job.global_batch} sequences x {job.seq_length:,} tokens per step on "
        f"{len(job.run_ranks)} of {job.cluster_spec.world_size} GPUs ({job.meta.get('cluster', '')}, "
        f"{job.model_spec.name}{_tp_words(job)}): step {_fmt_time(pred.get('step_time_s'))}, "
        f"{_fmt_rate(pred.get('tokens_per_s'))} tokens/s; gradient reduction exposed "
        f"{_fmt_time(pred.get('grad_sync_s'))}, optimizer {_fmt_time(pred.get('optimizer_s'))}"
    )
    console.print(domains_table(job))
    if job.alternatives:
        console.print(alternatives_table(job))
    pl = job.planner or {}
    if pl.get("time_limit_reached"):
        console.print(
            f"time limit of {pl.get('time_limit_s')} s reached: not tried {', '.join(pl.get('skipped', [])) or '-'}"
        )
    opts = job.options
    console.print(
        f"memory mode: {opts.get('memory_mode')}{' + recompute' if opts.get('recompute') else ''} "
        f"-> Megatron flags: {' '.join(opts.get('megatron_flags', []))}"
    )


def _tp_words(job: JobPlan) -> str:
    t = job.tensor_model_parallel_size
    return "" if t == 1 else f", TP bundles of {t} GPUs"


def plot_job(path: str, job: JobPlan) -> None:
    """Left: every GPU of the cluster (a row per node, file order) coloured by its domain (grey:
    in none). Right: each domain's step as a bar: busy with its micro-batches, exposed gradient
    reduction, waiting for the busiest domain, then the optimizer and fixed costs."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Rectangle

    cluster = job.cluster_spec
    rows = domain_rows(job)
    colors = plt.get_cmap("tab20")
    owner = {r: d for d, dom in enumerate(job.domains) for r in dom.ranks}
    n_nodes = len(cluster.nodes)
    width = max(n.count for n in cluster.nodes)
    fig, (ax, bx) = plt.subplots(
        1, 2, figsize=(13, max(3.0, 0.25 * max(n_nodes, len(rows)) + 1.5)), width_ratios=[1, 2]
    )
    start = 0
    for i, node in enumerate(cluster.nodes):
        for j in range(node.count):
            d = owner.get(start + j)
            color = "#dddddd" if d is None else colors(d % 20)
            ax.add_patch(Rectangle((j, n_nodes - 1 - i), 0.9, 0.9, color=color))
        start += node.count
    ax.set_xlim(0, width)
    ax.set_ylim(0, n_nodes)
    ax.set_yticks([n_nodes - 1 - i + 0.45 for i in range(n_nodes)])
    ax.set_yticklabels(
        [f"{n.name} ({n.gpu.name.split('-')[0]})" for n in cluster.nodes], fontsize=6
    )
    ax.set_xticks([])
    ax.set_title("GPUs by domain")
    y = list(range(len(rows)))[::-1]
    left = [0.0] * len(rows)
    segments: tuple[tuple[str, str, str], ...] = (
        ("compute_s", "micro-batches", ""),
        ("grad_sync_s", "exposed gradient reduction", "#222222"),
        ("idle_s", "waiting", "#cccccc"),
        ("fixed_s", "optimizer, fixed", "#8172b2"),
    )
    for key, label, color in segments:
        vals = [r[key] for r in rows]
        bar_colors = [colors(r["domain"] % 20) for r in rows] if not color else color
        bx.barh(y, vals, left=left, color=bar_colors, label=label, edgecolor="white", lw=0.3)
        left = [a + b for a, b in zip(left, vals)]
    bx.set_yticks(y)
    bx.set_yticklabels(
        [f"{r['domain']}: {r['gpus']} x{r['micro_batches']}" for r in rows], fontsize=7
    )
    bx.set_xlabel("seconds")
    pred = job.predicted or {}
    bx.set_title(
        f"step {_fmt_time(pred.get('step_time_s'))}: {job.global_batch} x "
        f"{job.seq_length:,} tokens, {pred.get('memory_mode', '')}"
    )
    bx.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def save_plot(path: str, job: JobPlan) -> None:
    """:func:`plot_job` written atomically (an interrupted run leaves no half-written figure)."""
    with atomic_path(path) as tmp:
        plot_job(tmp, job)
