"""Step 7 (verify): the staircase of adopted changes, and the loss of the original against the tuned job."""

from __future__ import annotations

import textwrap

import matplotlib.ticker

from mfu_lab.analysis import tuning
from mfu_lab.plots.base import ReportFigure
from mfu_lab.plots.monitor import Unavailable

RUNG_COLORS = {"original": "#495057", "attention": "#3b6fb6", "communication": "#7048e8", "data": "#e8912d",
               "optimizer": "#f08c00", "batch": "#1098ad", "compile": "#2f9e44", "loss": "#5c940d",
               "precision": "#c2255c", "fp8": "#868e96"}


def rung_color(name: str, default: str = "#868e96") -> str:
    """A rung's colour by its stage, its name's first word ("attention at bfloat16" is attention's)."""
    return RUNG_COLORS.get(name.split()[0], default)


def staircase(result) -> ReportFigure | Unavailable:
    """Each rung's median step time (p10-p90) with its speedup over the original [95% interval], and its MFU.
    Excluded or failed rungs are listed with why, without a bar; :class:`Unavailable` when nothing was measured."""
    rungs = result.rungs
    if not any(r.step_median_s for r in rungs):
        return Unavailable("No staircase: no rung of the tuned job was measured (see the table for why).")
    fig = ReportFigure(figsize=(11, 0.6 * len(rungs) + 1.9))
    ax, ax2 = fig.subplots(1, 2, sharey=True, gridspec_kw={"width_ratios": [3, 1.3]})
    ys = list(range(len(rungs)))[::-1]
    withdrawn = {c.rung for c in tuning.withdrawals({"changes": result.changes})}
    top = max(r.step_p90_s or 0 for r in rungs) * 1e3
    for y, r in zip(ys, rungs):
        color = rung_color(r.name)
        if r.step_median_s is None:
            why = textwrap.shorten(f"{r.status}: {r.reason}", 170, placeholder=" ... (the table gives the rest)")
            ax.text(0, y, textwrap.fill(why, 85, initial_indent="  ", subsequent_indent="  "), va="center",
                    fontsize=7, color="#868e96")
            continue
        err = [[max(0, (r.step_median_s - r.step_p10_s) * 1e3)], [max(0, (r.step_p90_s - r.step_median_s) * 1e3)]]
        ax.barh(y, r.step_median_s * 1e3, color=color, xerr=err)
        if not r.name.startswith("original") and r.speedup is not None:
            label = f"  {r.speedup:.2f}x [{r.speedup_low:.2f}, {r.speedup_high:.2f}]"
            if r.challenger:  # compared with the tuned job it would replace
                label += (f"; {r.gain:.2f}x the tuned job: " + ("adopted" if r.proven and r.gain > 1 else
                                                                 "not proven, not adopted"))
            elif r.name == "tuned as written":  # step 7's second turn, beside the original again
                label += " over the original again" + ("" if r.proven else " (not proven)")
            elif not r.proven:
                label += " (this rung's own gain not proven)"
            if r.name in withdrawn:
                label += "; withdrawn"
            ax.text(r.step_p90_s * 1e3, y, label, va="center", fontsize=8)
        if r.mfu is not None:
            ax2.barh(y, r.mfu, color=color)
            ax2.text(r.mfu, y, f" {r.mfu:.1%}", va="center", fontsize=8)
    ax.set_yticks(ys)
    ax.set_yticklabels([("" if r.name.startswith(("original", "tuned")) else "+ ") + r.name for r in rungs])
    ax.set_xlim(0, top * 1.6)
    ax.set_ylim(-0.6, len(rungs) - 0.4)
    ax.set_xlabel("step time, ms (median, p10-p90); label: speedup over the original [95%]")
    ax2.set_xlabel("MFU (own precision's peak)")
    ax2.xaxis.set_major_formatter(matplotlib.ticker.PercentFormatter(1.0))
    ax2.set_xlim(0, max((r.mfu or 0) for r in rungs) * 1.35 or 1)
    fig.suptitle("The staircase: each adopted change added in the workflow's order, measured side by side" + (
        "\nlast two: the tuned file as written, timed again beside the original"
        if any(r.name == "tuned as written" for r in rungs) else ""))
    fig.tight_layout()
    return fig


def verify_loss(result) -> ReportFigure | Unavailable:
    """The original's and the tuned job's loss over the same steps, and their relative gap against the tolerance."""
    loss = result.loss
    if loss.get("status") not in ("ok", "off"):
        return Unavailable("No loss comparison: " + (loss.get("reason") or f"the loss check is "
                                                     f"{loss.get('status', 'missing')}") + ".")
    fig = ReportFigure(figsize=(11, 3.6))
    ax, ax2 = fig.subplots(1, 2)
    a, b = loss["original"], loss["tuned"]
    # the original as a broad grey band under the tuned line: where the two agree, both stay visible
    ax.plot(range(len(a)), a, color="#adb5bd", lw=4.5, label="original" + (
        " (again)" if loss["tuned_rung"] == "tuned as written" else ""))
    ax.plot(range(len(b)), b, color=rung_color(loss["tuned_rung"], "#c2255c"), lw=1.4,
            label="tuned, as written" if loss["tuned_rung"] == "tuned as written" else
            f"tuned (up to + {loss['tuned_rung']})")
    ax.set_xlabel("step (warm-up first)")
    ax.set_ylabel("training loss")
    ax.set_title("Loss, same seed and batches")
    ax.legend(fontsize=8)
    ax2.plot(range(len(a)), [y / x - 1 for x, y in zip(a, b)], color="#c2255c")
    tol = loss["tolerance"]
    ax2.axhline(tol, color="#c92a2a", lw=1, ls=":", label=f"loss_tolerance {tol:.0%}")
    ax2.axhline(-tol, color="#c92a2a", lw=1, ls=":")
    ax2.yaxis.set_major_formatter(matplotlib.ticker.PercentFormatter(1.0))
    ax2.set_title(f"tuned / original - 1 (final {loss['final_gap']:+.2%})")
    ax2.set_xlabel("step")
    ax2.legend(fontsize=8)
    fig.tight_layout()
    return fig
