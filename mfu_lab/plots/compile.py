"""Step 4 (torch.compile): step time and compile time per mode, and the break-even point."""

from __future__ import annotations

from mfu_lab.plots.base import ReportFigure

MODE_COLORS = {"eager": "#495057", "default": "#3b6fb6", "max-autotune-no-cudagraphs": "#7048e8",
               "reduce-overhead": "#2f9e44", "max-autotune": "#c2255c", "options": "#e8912d"}


def compile_modes(result) -> ReportFigure:
    """Steady-state step time per mode (median, p10-p90) beside its compile time, cold and warm."""
    rows = [result.eager] + [t for t in result.trials if t.status == "ok"]
    fig = ReportFigure(figsize=(11, 0.55 * len(rows) + 1.8))
    ax, ax2 = fig.subplots(1, 2, sharey=True)
    ys = list(range(len(rows)))[::-1]
    med = [t.step_median_s * 1e3 for t in rows]
    ax.barh(ys, med, color=[MODE_COLORS.get(t.mode, "#868e96") for t in rows],
            xerr=[[max(0, (t.step_median_s - t.step_p10_s) * 1e3) for t in rows],
                  [max(0, (t.step_p90_s - t.step_median_s) * 1e3) for t in rows]])
    for y, t in zip(ys, rows):
        label = "" if t.mode == "eager" else f"  {t.speedup:.2f}x" + ("" if t.drift_ok else ", loss drifts")
        ax.text(t.step_p90_s * 1e3, y, label, va="center", fontsize=8)
    ax.set_yticks(ys)
    ax.set_yticklabels([t.mode for t in rows])
    ax.set_xlabel("steady-state step (ms, median, p10-p90)")
    ax.set_xlim(0, max(med) * 1.35)
    h = 0.38
    cold = [t.compile_cold_s or 0 for t in rows]
    warm = [t.compile_warm_s or 0 for t in rows]
    ax2.barh([y + h / 2 for y in ys], cold, height=h, color="#c92a2a", label="cold (empty cache)")
    ax2.barh([y - h / 2 for y in ys], warm, height=h, color="#e8912d", label="warm (cache reused)")
    for y, t in zip(ys, rows):
        if getattr(t, "warm_skipped", ""):  # not measured: said on the bar's place, not drawn as 0 s
            ax2.text(0, y - h / 2, " warm: not measured", va="center", fontsize=7, color="#555")
    ax2.set_xlabel("compile time (s): extra time of the first steps")
    ax2.legend(fontsize=8, loc="lower right")
    fig.suptitle("torch.compile against eager, measured")
    fig.tight_layout()
    return fig


def break_even(result) -> ReportFigure:
    """Cumulative time against steps: eager, and each mode starting from its compile time."""
    e = result.eager.step_median_s
    ok = [t for t in result.trials if t.status == "ok"]
    evens = [t.break_even_cold for t in ok if t.break_even_cold is not None]
    horizon = max([100.0] + [2.2 * b for b in evens])
    fig = ReportFigure(figsize=(9, 3.8))
    ax = fig.subplots()
    xs = [0, horizon]
    ax.plot(xs, [0, horizon * e / 60], color=MODE_COLORS["eager"], lw=2, label="eager")
    for t in ok:
        c = MODE_COLORS.get(t.mode, "#868e96")
        ax.plot(xs, [(t.compile_cold_s or 0) / 60, ((t.compile_cold_s or 0) + horizon * t.step_median_s) / 60],
                color=c, label=f"{t.mode} (cold)")
        if t.compile_warm_s is not None:
            ax.plot(xs, [t.compile_warm_s / 60, (t.compile_warm_s + horizon * t.step_median_s) / 60], color=c,
                    ls="--", label=f"{t.mode} (warm cache)")
        if t.break_even_cold is not None:
            ax.plot([t.break_even_cold], [t.break_even_cold * e / 60], "o", color=c)
            ax.annotate(f"{t.break_even_cold:.0f} steps", (t.break_even_cold, t.break_even_cold * e / 60),
                        textcoords="offset points", xytext=(4, -12), fontsize=8, color=c)
    ax.set_xlabel("training steps")
    ax.set_ylabel("time (min)")
    ax.set_title("When does compiling pay? Cumulative time, compile included")
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig
