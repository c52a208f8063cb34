"""Step 0 (the production monitor): MFU over time, the step's shares over time, step time per rank with the
stragglers marked, GPU clocks and temperature, and the operations loss. Each takes the summary (the dataclass or
its ``summary.json`` dict); a figure with nothing to draw is replaced by :class:`Unavailable`, which says why."""

from __future__ import annotations

import datetime as _dt
from typing import Any

import matplotlib.dates
import matplotlib.ticker

from mfu_lab.plots.base import COLORS, ReportFigure

SHARE_COLORS = {"data": COLORS["data"], "host": COLORS["host"], "comm": COLORS["structure"],
                "compute": COLORS["compute"], "other": "#adb5bd"}


class Unavailable:
    """What a notebook shows in place of a figure that cannot be drawn: one sentence saying why."""

    def __init__(self, why: str):
        self.why = why

    def __bool__(self) -> bool:
        return False

    def _repr_markdown_(self) -> str:
        return f"*Not drawn: {self.why}*"

    def __repr__(self) -> str:
        return f"Not drawn: {self.why}"


def _get(summary: Any, name: str):
    return summary[name] if isinstance(summary, dict) else getattr(summary, name)


def _times(ts: list[float]) -> list[_dt.datetime]:
    return [_dt.datetime.fromtimestamp(t) for t in ts]


def _time_axis(ax) -> None:
    loc = matplotlib.dates.AutoDateLocator()
    ax.xaxis.set_major_locator(loc)
    ax.xaxis.set_major_formatter(matplotlib.dates.ConciseDateFormatter(loc))


def _restarts(ax, series: dict[str, Any]) -> None:
    starts = series.get("launch_starts") or []
    for i, t in enumerate(starts[1:]):
        ax.axvline(_dt.datetime.fromtimestamp(t), color="#c92a2a", lw=0.8, ls="--",
                   label="restart" if i == 0 else None)


def overview(summary) -> ReportFigure | Unavailable:
    """MFU over time (overall and per node) above the shares of the step over time (stacked)."""
    s = _get(summary, "series")
    if not s.get("t"):
        return Unavailable("no interval record was readable in the monitor folder")
    t = _times(s["t"])
    fig = ReportFigure(figsize=(10, 5.4))
    ax1, ax2 = fig.subplots(2, 1, sharex=True)
    if any(v is not None for v in s["mfu"]):
        ax1.plot(t, [v if v is not None else float("nan") for v in s["mfu"]], color=COLORS["mfu"], lw=2,
                 label="all ranks")
        by_node = s.get("mfu_by_node") or {}
        if len(by_node) > 1:
            for node, vals in list(by_node.items())[:12]:
                ax1.plot(t, [v if v is not None else float("nan") for v in vals], lw=0.8, alpha=0.7, label=node)
        ax1.yaxis.set_major_formatter(matplotlib.ticker.PercentFormatter(1.0))
        ax1.set_ylim(bottom=0)
        ax1.set_ylabel("MFU (measured)")
    else:
        ax1.text(0.5, 0.5, "no MFU in the record: give the monitor flops_per_token or the model",
                 transform=ax1.transAxes, ha="center", va="center", fontsize=9, color="#868e96")
    _restarts(ax1, s)
    ax1.legend(fontsize=7, loc="upper right")
    ax1.set_title("The job in production: MFU, and where each step's time went")
    shares = s["shares"]
    data_timed = any(v is not None for v in shares["data"])
    data = [v or 0.0 for v in shares["data"]]
    host = [v or 0.0 for v in shares["host"]]
    comm = [v or 0.0 for v in shares["comm"]]
    other = [v or 0.0 for v in shares.get("other") or [None] * len(t)]  # older summaries have none
    compute = [max(0.0, 1 - a - b - c - d) for a, b, c, d in zip(data, host, comm, other)]
    ax2.stackplot(t, compute, comm, data, host, other,
                  colors=[SHARE_COLORS[k] for k in ("compute", "comm", "data", "host", "other")],
                  labels=["compute (no collective, no data wait)" if data_timed else
                          "compute (data wait not timed: inside)", "communication in flight",
                          "data wait" if data_timed else "data wait: not timed", "host between steps",
                          "evaluation, checkpoints, logging"])
    ax2.yaxis.set_major_formatter(matplotlib.ticker.PercentFormatter(1.0))
    ax2.set_ylim(0, 1)
    ax2.set_ylabel("share of step time")
    ax2.legend(fontsize=7, loc="lower left", ncol=3)
    _time_axis(ax2)
    fig.tight_layout()
    return fig


def step_by_rank(summary) -> ReportFigure | Unavailable:
    """Each rank's work per step over time (its step time minus the time a collective was in flight): the band
    across all ranks, the stragglers drawn in red. Without timed collectives: the step time."""
    s = _get(summary, "series")
    if not s.get("work_by_rank"):
        return Unavailable("no interval record was readable in the monitor folder")
    t = _times(s["t"])
    fig = ReportFigure(figsize=(10, 3.4))
    ax = fig.subplots()
    band = s.get("work_band") or []
    if band and len(s["work_by_rank"]) > 1:
        lo = [b[0] * 1e3 if b[0] is not None else float("nan") for b in band]
        hi = [b[2] * 1e3 if b[2] is not None else float("nan") for b in band]
        ax.fill_between(t, lo, hi, color="#dee2e6", label="fastest to slowest rank")
    slow = set(s.get("stragglers") or [])
    for name, vals in s["work_by_rank"].items():
        y = [v * 1e3 if v is not None else float("nan") for v in vals]
        if name in slow:
            ax.plot(t, y, color="#c92a2a", lw=2, label=f"{name} (straggler)")
        else:
            ax.plot(t, y, color=COLORS["compute"], lw=0.8, alpha=0.6)
    _restarts(ax, s)
    ax.set_ylabel("step time (ms)" if s.get("work_is_step") else "work per step (ms)")
    ax.set_ylim(bottom=0)
    ax.set_title("Step time per rank (no collective was timed)" if s.get("work_is_step") else
                 "Each rank's work per step: step time minus the time a collective was in flight (in DDP every "
                 "rank waits for the slowest, so step times agree)", fontsize=8)
    ax.legend(fontsize=7)
    _time_axis(ax)
    fig.tight_layout()
    return fig


def gpu_health(summary) -> ReportFigure | Unavailable:
    """SM clock against its maximum, the share of throttled samples, and the hottest temperature, over time."""
    s = _get(summary, "series")
    g = s.get("gpu") or {}
    if not any(v is not None for v in g.get("clock_ratio") or []) and \
            not any(v is not None for v in g.get("temperature_c_max") or []):
        parts = _get(summary, "operations_loss")["parts"]
        return Unavailable(f"no GPU health was sampled ({parts['throttling']['note']})")
    t = _times(s["t"])
    fig = ReportFigure(figsize=(10, 3.2))
    ax = fig.subplots()
    nan = float("nan")
    ax.plot(t, [v if v is not None else nan for v in g["clock_ratio"]], color=COLORS["compute"],
            label="SM clock while busy / rated clock")
    ax.fill_between(t, 0, [v or 0 for v in g["throttled_share"]], color="#ffa8a8", alpha=0.6,
                    label="busy samples with a power or thermal reason")
    ax.yaxis.set_major_formatter(matplotlib.ticker.PercentFormatter(1.0))
    ax.set_ylim(0, 1.05)
    ax2 = ax.twinx()
    ax2.plot(t, [v if v is not None else nan for v in g["temperature_c_max"]], color="#e8590c", lw=0.8,
             label="hottest GPU (°C)")
    ax2.set_ylabel("°C")
    for i, (x, n) in enumerate(zip(t, g.get("xid") or [])):
        if n:
            ax.axvline(x, color="black", lw=1, label="XID error" if i == 0 else None)
    ax.legend(fontsize=7, loc="lower left")
    ax2.legend(fontsize=7, loc="lower right")
    ax.set_title("Clocks, throttling and temperature (NVML, measured)")
    _time_axis(ax)
    fig.tight_layout()
    return fig


def operations_loss(summary) -> ReportFigure | Unavailable:
    """The operations loss's parts as shares of the wall-clock; unknown parts named, not drawn as zero."""
    ops = _get(summary, "operations_loss")
    parts = ops["parts"]
    known = {k: p for k, p in parts.items() if p["value"] is not None}
    if not known:
        return Unavailable("no part of the operations loss could be measured from this record")
    fig = ReportFigure(figsize=(8, 0.45 * len(parts) + 1.4))
    ax = fig.subplots()
    names = list(parts)[::-1]  # the first part on top
    for y, k in enumerate(names):
        p = parts[k]
        if p["value"] is None:
            ax.text(0.01, y, f"unknown: {p['note'][:90]}", va="center", fontsize=7, color="#868e96",
                    transform=ax.get_yaxis_transform())
        else:
            ax.barh(y, p["value"], color=COLORS["operations"])
            ax.text(p["value"], y, f" {p['value']:.1%}", va="center", fontsize=8)
    ax.set_yticks(range(len(names)), [k.replace("_", " ") for k in names], fontsize=8)
    ax.xaxis.set_major_formatter(matplotlib.ticker.PercentFormatter(1.0))
    ax.set_xlim(0, max([p["value"] for p in known.values()] + [0.01]) * 1.4)
    hours = ops["wall_clock_s"] / 3600
    span = f"{hours:.1f} h" if hours >= 1 else f"{ops['wall_clock_s'] / 60:.1f} min"
    ax.set_title(f"Operations loss, measured: {ops['total']['value']:.1%} of the wall-clock ({span})", fontsize=9)
    fig.tight_layout()
    return fig
