"""Shared pieces of the plots: the figure class, colours, PNG data URIs, and the cross-step figures
(the MFU ledger waterfall, before/after ledgers, MFU step by step and across runs)."""

from __future__ import annotations

import base64
import io
import textwrap

import matplotlib.ticker
from matplotlib.figure import Figure

# Figures are built without pyplot: nothing is registered globally, so headless runs
# need no backend choice, and a notebook shows each returned figure exactly once,
# through the figure's own _repr_png_.


class ReportFigure(Figure):
    """A Figure that Jupyter displays as PNG when a cell returns it."""

    def png(self) -> bytes:
        buf = io.BytesIO()
        self.savefig(buf, format="png", dpi=110, bbox_inches="tight")  # a legend set outside the axes is kept
        return buf.getvalue()

    def _repr_png_(self) -> tuple[bytes, dict[str, str]]:
        """The PNG with its alternative text as the output's metadata (IPython's (data, metadata) form): the
        report's template writes it as the image's ``alt``."""
        return self.png(), {"alt": self.alt_text()}

    def alt_text(self) -> str:
        """What the figure shows, for a reader who cannot see it: its title and its axes' titles (else their
        axis labels)."""
        parts = [self._suptitle.get_text()] if self._suptitle else []
        for ax in self.axes:
            title = ax.get_title() or ax.get_title("left")
            labels = " against ".join(t for t in (ax.get_ylabel(), ax.get_xlabel()) if t)
            parts.append(title or labels)
        parts = [t for t in dict.fromkeys(" ".join(p.split()) for p in parts) if t]
        return "Plot: " + "; ".join(parts) if parts else "Plot: its figures are in the table beside it"


COLORS = {"compute": "#3b6fb6", "data": "#e8912d", "host": "#9a9a9a",
          "mfu": "#2f9e44", "recompute": "#1098ad", "efficiency": "#c92a2a", "structure": "#7048e8",
          "software": "#e8912d", "operations": "#868e96", "peak": "#495057",
          "hardware": "#c92a2a"}  # "hardware": the placement plots' waiting and deadlock marks


def ledger_waterfall(ledger, title: str = "MFU ledger: where the peak goes") -> Figure:
    """100% of peak, minus each named loss, down to MFU."""
    fig = ReportFigure(figsize=(8, 3.8))
    _waterfall(fig.subplots(), ledger, title)
    fig.tight_layout()
    return fig


def ledger_before_after(before, after, titles: tuple[str, str]) -> Figure:
    """Two ledgers side by side on the same scale: the job as it came, and after a measured change."""
    fig = ReportFigure(figsize=(11, 3.9))
    axes = fig.subplots(1, 2, sharey=True)
    for ax, ledger, title in zip(axes, (before, after), titles):
        _waterfall(ax, ledger, title, fontsize=8)
    fig.tight_layout()
    return fig


def _waterfall(ax, ledger, title: str, fontsize: int = 12) -> None:
    losses = [i for i in ledger.items if i.name != "mfu"]
    mfu_item = ledger.get("mfu")
    level = 1.0
    labels, x = ["peak"], 0
    ax.bar(x, 1.0, color=COLORS["peak"])
    ax.text(x, 1.0, "100%", ha="center", va="bottom", fontsize=8)
    for item in losses:
        x += 1
        bottom = level - item.fraction
        ax.bar(x, item.fraction, bottom=bottom, color=COLORS.get(item.name, COLORS["host"]))
        label = f"-{item.fraction:.1%}" if abs(item.fraction) >= 0.0005 else "0%"
        ax.text(x, max(level, bottom), label, ha="center", va="bottom", fontsize=8)
        name = getattr(item, "label", f"{item.name} loss")  # the ledger's own name, a word or two a line
        labels.append(name.replace(" loss", "\nloss").replace(" ", "\n", 1))
        level = bottom
    x += 1
    ax.bar(x, mfu_item.fraction, color=COLORS["mfu"])
    ax.text(x, mfu_item.fraction, f"{mfu_item.fraction:.1%}", ha="center", va="bottom", fontsize=9, weight="bold")
    labels.append("MFU")
    ax.set_xticks(range(len(labels)), labels, fontsize=8 if fontsize >= 12 else 7)  # side by side: smaller
    ax.set_ylim(min(0.0, level) - 0.02, 1.1)
    ax.yaxis.set_major_formatter(matplotlib.ticker.PercentFormatter(1.0))
    ax.set_ylabel("share of peak FLOP/s x time")
    ax.set_title(title, fontsize=fontsize)


def mfu_trend(trend: list[tuple[str, dict[str, float]]]) -> Figure:
    """MFU per step across the job's runs (oldest left): one line per step that reports an MFU."""
    fig = ReportFigure(figsize=(max(5.0, 0.9 * len(trend) + 3), 3.2))
    ax = fig.subplots()
    steps = sorted({k for _, pts in trend for k in pts})
    for k in steps:
        xs = [i for i, (_, pts) in enumerate(trend) if k in pts]
        ax.plot(xs, [trend[i][1][k] for i in xs], marker="o", label=k)
    ax.set_xticks(range(len(trend)), [rid[4:8] + "\n" + rid[9:15] for rid, _ in trend], fontsize=7)
    ax.set_xlim(-0.5, len(trend) - 0.5)
    ax.set_xlabel("run (MMDD, HHMMSS UTC)")
    ax.yaxis.set_major_formatter(matplotlib.ticker.PercentFormatter(1.0))
    ax.set_ylim(0, max([v for _, pts in trend for v in pts.values()] + [0.01]) * 1.25)
    ax.set_ylabel("MFU (measured)")
    ax.set_title(f"MFU across this job's runs ({len(trend)} run{'s' if len(trend) != 1 else ''})")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    fig.tight_layout()
    return fig


def mfu_progression(points: list[tuple[str, float]], meanings: list[str] | None = None) -> Figure:
    """MFU after each step that has run, in workbook order; ``meanings`` (one per point) says what each bar
    measured: data-parallel bars are hatched and modelled ones pale, with the meaning under each bar."""
    meanings = meanings or ["" for _ in points]
    fig = ReportFigure(figsize=(max(5, 1.9 * len(points) + 2), 4.0))
    ax = fig.subplots()
    names = [p[0].replace("_", " ") for p in points]
    values = [p[1] for p in points]
    for i, (v, what) in enumerate(zip(values, meanings)):
        ax.bar(i, v, color=COLORS["mfu"], alpha=0.45 if "modelled" in what else 1.0,
               hatch="//" if "data-parallel" in what else None, edgecolor="#1b5e20")
    ax.set_xticks(range(len(points)))
    ax.set_xticklabels([f"{n}\n{textwrap.fill(w, 24)}" if w else n for n, w in zip(names, meanings)], fontsize=7)
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
    return "data:image/png;base64," + base64.b64encode(fig.png()).decode("ascii")
