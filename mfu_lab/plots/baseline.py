"""Step 1 (baseline): the per-step timeline and the step-time distribution."""

from __future__ import annotations

from matplotlib.figure import Figure

from mfu_lab.plots.base import COLORS, ReportFigure


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
