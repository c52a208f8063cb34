"""Plots drawn from results (never from live state). Each returns a matplotlib Figure."""

from __future__ import annotations

import base64
import io

import matplotlib.ticker
from matplotlib.figure import Figure

# Figures are built without pyplot: nothing is registered globally, so headless runs
# need no backend choice, and a notebook shows each returned figure exactly once,
# through the figure's own _repr_png_.


class ReportFigure(Figure):
    """A Figure that Jupyter displays as PNG when a cell returns it."""

    def _repr_png_(self) -> bytes:
        buf = io.BytesIO()
        self.savefig(buf, format="png", dpi=110)
        return buf.getvalue()

COLORS = {"compute": "#3b6fb6", "data": "#e8912d", "host": "#9a9a9a",
          "mfu": "#2f9e44", "hardware": "#c92a2a", "structure": "#7048e8", "software": "#e8912d",
          "operations": "#868e96", "peak": "#495057"}


def step_times(result) -> Figure:
    """Per-step timeline (data / compute / host stacked; warm-up shaded) and the measured distribution."""
    t = result.timings
    fig = ReportFigure(figsize=(11, 4.0))
    ax, ax2 = fig.subplots(1, 2, gridspec_kw={"width_ratios": [2.2, 1]})
    steps = list(range(1, len(t.wall_s) + 1))
    ms = lambda xs: [v * 1e3 for v in xs]  # noqa: E731
    ax.bar(steps, ms(t.compute_s), color=COLORS["compute"], label="compute")
    ax.bar(steps, ms(t.data_s), bottom=ms(t.compute_s), color=COLORS["data"], label="data wait")
    ax.bar(steps, ms(t.host_s), bottom=[c + d for c, d in zip(ms(t.compute_s), ms(t.data_s))],
           color=COLORS["host"], label="host")
    if t.warmup_steps:
        ax.axvspan(0.5, t.warmup_steps + 0.5, color="#000", alpha=0.07, label="warm-up (discarded)")
    ax.axhline(result.step_stats.median * 1e3, color="#222", lw=1, ls="--", label="median (measured)")
    ax.set_xlabel("training step")
    ax.set_ylabel("time (ms)")
    ax.set_title("Step time, per step")
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=5, frameon=False)
    wall = ms(t.measured("wall_s"))
    ax2.hist(wall, bins=min(20, max(5, len(wall) // 2)), color=COLORS["compute"], alpha=0.8)
    for q, name in ((result.step_stats.p10, "p10"), (result.step_stats.median, "median"),
                    (result.step_stats.p90, "p90")):
        ax2.axvline(q * 1e3, color="#222", lw=1, ls=":" if name != "median" else "--")
        ax2.text(q * 1e3, ax2.get_ylim()[1] * 0.95, name, fontsize=7, rotation=90, va="top", ha="right")
    ax2.set_xlabel("step time (ms), measured steps")
    ax2.set_ylabel("steps")
    ax2.set_title(f"Distribution (CV {result.step_stats.cv:.1%})")
    fig.tight_layout()
    return fig


def ledger_waterfall(ledger, title: str = "MFU ledger: where the peak goes") -> Figure:
    """100% of peak, minus each named loss, down to MFU."""
    fig = ReportFigure(figsize=(8, 3.8))
    ax = fig.subplots()
    losses = [i for i in ledger.items if i.name != "mfu"]
    mfu_item = ledger.get("mfu")
    level = 1.0
    labels, x = ["peak"], 0
    ax.bar(x, 1.0, color=COLORS["peak"])
    ax.text(x, 1.0, "100%", ha="center", va="bottom", fontsize=8)
    for item in losses:
        x += 1
        bottom = level - item.fraction
        ax.bar(x, item.fraction, bottom=bottom, color=COLORS[item.name])
        label = f"-{item.fraction:.1%}" if abs(item.fraction) >= 0.0005 else "0%"
        ax.text(x, max(level, bottom), label, ha="center", va="bottom", fontsize=8)
        labels.append(f"{item.name}\nloss")
        level = bottom
    x += 1
    ax.bar(x, mfu_item.fraction, color=COLORS["mfu"])
    ax.text(x, mfu_item.fraction, f"{mfu_item.fraction:.1%}", ha="center", va="bottom", fontsize=9, weight="bold")
    labels.append("MFU")
    ax.set_xticks(range(len(labels)), labels, fontsize=8)
    ax.set_ylim(min(0.0, level) - 0.02, 1.1)
    ax.yaxis.set_major_formatter(matplotlib.ticker.PercentFormatter(1.0))
    ax.set_ylabel("share of peak FLOP/s x time")
    ax.set_title(title)
    fig.tight_layout()
    return fig


def mfu_progression(points: list[tuple[str, float]]) -> Figure:
    """MFU after each step that has run, in workbook order."""
    fig = ReportFigure(figsize=(max(4, 1.3 * len(points) + 2), 3.2))
    ax = fig.subplots()
    names = [p[0] for p in points]
    values = [p[1] for p in points]
    ax.bar(names, values, color=COLORS["mfu"])
    for i, v in enumerate(values):
        ax.text(i, v, f"{v:.1%}", ha="center", va="bottom", fontsize=9)
    ax.yaxis.set_major_formatter(matplotlib.ticker.PercentFormatter(1.0))
    ax.set_ylim(0, max(values + [0.01]) * 1.25)
    ax.set_ylabel("MFU")
    ax.set_title("MFU, step by step")
    fig.tight_layout()
    return fig


def to_data_uri(fig: ReportFigure) -> str:
    """PNG data URI for embedding in an offline HTML page."""
    return "data:image/png;base64," + base64.b64encode(fig._repr_png_()).decode("ascii")
