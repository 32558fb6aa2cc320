"""Every figure the commands write holds what it plots, layer (a): no processes.

``axes_problems`` draws a figure and lists each plotted value outside its axes' limits (bars,
lines, line collections such as ``hlines``, text placed in data coordinates, whose whole box must
lie inside the axes) and each text that overlaps an axes title. The figure writers run through a ``Figure.savefig`` that checks first:
the demo's comparison (``testbed.demo.plot``, with a measured step above and below the
prediction) and ``simulate --plot`` (``planner.report.plot_estimates``).
"""

from __future__ import annotations

import math
from pathlib import Path

import matplotlib
import pytest

matplotlib.use("Agg")
from matplotlib.figure import Figure  # noqa: E402
from matplotlib.patches import Rectangle  # noqa: E402

from megatron_hexiseq.cli import main  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TOL = 1e-9


def axes_problems(fig: Figure) -> list[str]:
    """What a reader would miss: values outside the axes, text over a title."""
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()  # type: ignore[attr-defined]
    out: list[str] = []
    for ax in fig.axes:
        (x0, x1), (y0, y1) = sorted(ax.get_xlim()), sorted(ax.get_ylim())
        sx, sy = (x1 - x0) * TOL + TOL, (y1 - y0) * TOL + TOL
        name = ax.get_title() or "an axes"

        def check(
            x: float, y: float, what: str, *, x0=x0, x1=x1, y0=y0, y1=y1, sx=sx, sy=sy, name=name
        ) -> None:
            if not (math.isfinite(x) and math.isfinite(y)):
                return
            if not (x0 - sx <= x <= x1 + sx and y0 - sy <= y <= y1 + sy):
                out.append(
                    f"{name}: {what} at ({x:.4g}, {y:.4g}) outside x {x0:.4g}..{x1:.4g}, y {y0:.4g}..{y1:.4g}"
                )

        for p in ax.patches:
            if isinstance(p, Rectangle) and p.get_visible():
                x, y, w, h = p.get_x(), p.get_y(), p.get_width(), p.get_height()
                check(x, y, "a bar")
                check(x + w, y + h, "a bar")
        for line in ax.lines:
            for x, y in zip(line.get_xdata(), line.get_ydata()):
                check(float(x), float(y), f"line {line.get_label()!r}")
        for coll in ax.collections:
            for seg in getattr(coll, "get_segments", lambda: [])():
                for x, y in seg:
                    check(float(x), float(y), "a line segment")
        titles = [a.title.get_window_extent(renderer) for a in fig.axes if a.get_title()]
        frame = ax.get_window_extent(renderer)
        for t in ax.texts:
            box = t.get_window_extent(renderer)
            if t.get_transform() == ax.transData:
                check(*map(float, t.get_position()), f"text {t.get_text()!r}")
                if not (
                    frame.x0 - 1 <= box.x0
                    and box.x1 <= frame.x1 + 1
                    and frame.y0 - 1 <= box.y0
                    and box.y1 <= frame.y1 + 1
                ):
                    out.append(f"{name}: text {t.get_text()!r} runs outside the axes")
            if any(box.overlaps(tb) for tb in titles):
                out.append(f"{name}: text {t.get_text()!r} overlaps a title")
    return out


@pytest.fixture
def checked_figures(monkeypatch):
    """Every ``Figure.savefig`` from here on first asserts :func:`axes_problems` is empty."""
    saved: list[str] = []
    original = Figure.savefig

    def savefig(self, fname, *args, **kwargs):
        problems = axes_problems(self)
        assert not problems, "\n".join(problems)
        saved.append(str(fname))
        return original(self, fname, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", savefig)
    return saved


def _demo_record(sym_measured: float, hex_measured: float) -> dict:
    def run(name, measured, predicted, parts, tokens):
        return {
            "name": name,
            "measured_step_s": measured,
            "predicted_step_s": predicted,
            "per_rank_tokens": tokens,
            "per_rank_heads": [4] * len(parts),
            "predicted_per_rank": [{"linear_s": a, "attention_s": b} for a, b in parts],
            "losses": [5.0, 4.6, 4.3],
        }

    return {
        "speedup_measured": sym_measured / hex_measured,
        "speedup_predicted": 0.30 / 0.23,
        "symmetric": run(
            "symmetric:hp1",
            sym_measured,
            0.30,
            [(0.1, 0.2), (0.12, 0.18), (0.1, 0.15)],
            [683, 683, 682],
        ),
        "hexiseq": run(
            "hexiseq",
            hex_measured,
            0.23,
            [(0.1, 0.13), (0.08, 0.12), (0.08, 0.1)],
            [1000, 524, 524],
        ),
    }


@pytest.mark.parametrize("measured", [(0.32, 0.24), (0.8, 0.24), (0.1, 0.05), (0.3, 2.0)])
def test_demo_figure_holds_its_bars_lines_and_names(tmp_path, checked_figures, measured):
    from megatron_hexiseq.testbed.demo import plot

    plot(_demo_record(*measured), str(tmp_path / "demo.png"))
    assert (
        checked_figures == [str(tmp_path / "demo.png")] and (tmp_path / "demo.png").stat().st_size
    )


def test_simulate_figure_holds_its_bars(tmp_path: Path, checked_figures):
    assert (
        main(
            [
                "simulate",
                "--cluster",
                str(ROOT / "examples" / "clusters" / "mixed-h100-a100.yaml"),
                "--model",
                "gpt-7b",
                "--seq-length",
                "32768",
                "--baselines",
                "--format",
                "json",
                "--plot",
                str(tmp_path / "sim.png"),
            ]
        )
        == 0
    )
    assert len(checked_figures) == 1


def test_the_check_catches_a_label_above_the_axes(checked_figures):
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    fig = Figure()
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    ax.set_title("title")
    ax.bar([0, 1], [1.0, 2.0])
    ax.text(0.5, 2.3, "label over the top")
    assert any("outside" in p for p in axes_problems(fig))
    ax.set_ylim(0, 1.5)
    assert any("a bar" in p for p in axes_problems(fig))
