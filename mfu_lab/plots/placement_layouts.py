"""Step 6 (placement): the node's layouts, measured beside the model (issue 29)."""

from __future__ import annotations

from mfu_lab.plots.base import COLORS, ReportFigure
from mfu_lab.plots.monitor import Unavailable


def node_layouts(result) -> ReportFigure:
    """Left: each layout's measured step time beside the model's (compute a rank gets / (t*p) x (1 + bubble)).
    Right: observed / model for every term of every layout, counted terms (exact, any device) apart from measured
    ones (times and memory)."""
    ok = [e for e in result.layouts if e["status"] == "ok"]
    if not ok:
        why = (result.layouts_run or {}).get("skipped") or "no layout ran (see the skipped list)"
        return Unavailable(f"No node layouts: {why}.")
    fig = ReportFigure(figsize=(11, 0.42 * len(ok) + 2.2))
    ax, ax2 = fig.subplots(1, 2, gridspec_kw={"width_ratios": [1, 1.3]})
    names = [e["layout"] for e in ok]
    step = {e["layout"]: next((t for t in e["terms"] if t["term"] == "step_time_s"), {}) for e in ok}
    ys = range(len(ok))
    gloo = ok[0].get("timed_on") == "gloo"
    ax.barh([y - 0.2 for y in ys], [(step[n].get("observed") or 0) * 1e3 for n in names], height=0.4,
            color=COLORS["compute"], label="measured" + (" (gloo: not used to calibrate)" if gloo else ""))
    ax.barh([y + 0.2 for y in ys], [(step[n].get("model") or 0) * 1e3 for n in names], height=0.4,
            color=COLORS["structure"], alpha=0.6, label="model: compute share x (1 + bubble), no communication")
    ax.set_yticks(list(ys), names, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("step time (ms)")
    ax.set_title("This node's layouts: step time", fontsize=10)
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.18), frameon=False)
    terms = sorted({t["term"] for e in ok for t in e["terms"] if t["term"] != "step_time_s"})
    marks = {"counted": ("o", COLORS["mfu"]), "measured": ("s", COLORS["data"])}
    for i, e in enumerate(ok):
        for t in e["terms"]:
            if t["term"] == "step_time_s" or t["ratio"] is None:
                continue
            mk, col = marks.get(t["source"], ("x", "#222"))
            ax2.scatter(t["ratio"], i + (terms.index(t["term"]) / len(terms) - 0.5) * 0.6, marker=mk, color=col,
                        s=18)
            if abs(t["ratio"] - 1) > 0.01:  # name the terms the model misses; the exact ones sit on the line
                ax2.annotate(t["term"].replace("memory_", "mem "), (t["ratio"],
                             i + (terms.index(t["term"]) / len(terms) - 0.5) * 0.6), fontsize=5, xytext=(3, -2),
                             textcoords="offset points")
    for src, (mk, col) in marks.items():
        ax2.scatter([], [], marker=mk, color=col, label=f"{src}" + (" (exact)" if src == "counted" else ""))
    ax2.axvline(1.0, color="#222", lw=0.8)
    ax2.set_xscale("log")
    ax2.set_yticks(list(ys), names, fontsize=8)
    ax2.set_ylim(len(ok) - 0.5, -0.5)
    ax2.set_xlabel("observed / model")
    ax2.set_title("Each term against the placement model (named where it misses by > 1%)", fontsize=9)
    ax2.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.18), ncol=2, frameon=False)
    fig.tight_layout()
    return fig
