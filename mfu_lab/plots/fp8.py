"""Step 5 (precision and FP8): the precision ladder, per-layer FP8 sensitivity and the loss curves of each policy."""

from __future__ import annotations

import math
import textwrap

import matplotlib.ticker

from mfu_lab.plots.base import ReportFigure


def fp8_sensitivity(result) -> ReportFigure:
    """Heatmap: each layer group's FP8 signal-to-noise (dB) for output, input gradient and weight gradient,
    under each scaling. Low (red) is sensitive."""
    scalings = [s for s in ("tensorwise", "rowwise", "none") if s in result.sensitivity]
    groups = [g.group for g in result.sensitivity[scalings[0]]]
    cols = [(s, k) for s in scalings for k in ("output_snr_db", "grad_input_snr_db", "grad_weight_snr_db")]
    by = {(s, g.group): g for s in scalings for g in result.sensitivity[s]}
    data = [[min(getattr(by[(s, grp)], k), 60.0) for s, k in cols] for grp in groups]
    fig = ReportFigure(figsize=(11, 0.45 * len(groups) + 2.2))
    ax = fig.subplots()
    im = ax.imshow(data, cmap="RdYlGn", vmin=0, vmax=40, aspect="auto")
    for i, row in enumerate(data):
        for j, v in enumerate(row):
            ax.text(j, i, f"{v:.0f}", ha="center", va="center", fontsize=8)
    ax.set_yticks(range(len(groups)))
    ax.set_yticklabels(groups)
    ax.set_xticks(range(len(cols)))
    ax.set_xticklabels([f"{s}\n{k.split('_snr')[0].replace('_', ' ')}" for s, k in cols], fontsize=7)
    fig.colorbar(im, ax=ax, label="SNR (dB), emulated")
    ax.set_title("FP8 error per layer group against float32 (signal-to-noise, dB; higher is safer)")
    fig.tight_layout()
    return fig


def fp8_losses(result) -> ReportFigure:
    """Loss curves of every policy over the same steps; a cross where the divergence watch stopped one."""
    ref = next((t for t in result.trials if t.status == "reference" and t.loss), None)
    if ref is None:  # no policy trained (a budget with no room for the reference): say why instead of a curve
        fig = ReportFigure(figsize=(11, 1.6))
        ax = fig.subplots()
        ax.axis("off")
        why = next((t.reason for t in result.trials if not t.groups and t.reason), "no policy was trained")
        ax.text(0.01, 0.5, "No loss curves: the reference was not trained (" + textwrap.shorten(why, 220) + ")",
                va="center", fontsize=9, wrap=True)
        return fig
    fig = ReportFigure(figsize=(11, 4.2))
    ax, ax2 = fig.subplots(1, 2)
    for t in result.trials:
        if not t.loss:  # not run (a race that had its answer): named in the table, not drawn
            continue
        style = {"lw": 2.2, "color": "#222"} if t is ref else {"lw": 1.2, "ls": "--" if t.study else "-"}
        ax.plot(range(len(t.loss)), t.loss, label=f"{t.name} ({t.status})", **style)
        if t.stopped_at is not None:
            ax.plot([t.stopped_at], [t.loss[-1] if math.isfinite(t.loss[-1]) else max(ref.loss)], "x", ms=10,
                    color="#c92a2a")
        if t is not ref:
            n = min(len(t.loss), len(ref.loss))
            ax2.plot(range(n), [t.loss[i] / ref.loss[i] - 1 for i in range(n)], label=t.name,
                     ls="--" if t.study else "-")
    tol = result.job["fp8_tolerance"]
    ax2.axhline(tol, color="#c92a2a", lw=1, ls=":", label=f"tolerance {tol:.0%}")
    ax2.axhline(-tol, color="#c92a2a", lw=1, ls=":")
    ax2.yaxis.set_major_formatter(matplotlib.ticker.PercentFormatter(1.0))
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax.set_title("Loss curves, same seed and batches (emulated FP8)")
    ax2.set_xlabel("step")
    ax2.set_title("Loss relative to the reference")
    ax.legend(fontsize=7)
    fig.tight_layout()
    return fig


STATUS_COLORS = {"reference": "#495057", "adopted": "#2f9e44", "ok": "#74b816", "not faster": "#868e96",
                 "slower": "#e8912d", "off": "#c92a2a", "diverged": "#c92a2a", "skipped": "#dee2e6",
                 "failed": "#dee2e6", "cannot be faster here": "#dee2e6"}
RUNG_COLORS = {"tf32": "#e8912d", "bfloat16": "#3b6fb6", "float16": "#7048e8"}


def precision(result) -> ReportFigure:
    """The precision ladder: each rung's step time (median, p10-p90 whiskers) with its speedup over the reference
    (float32, or the job's own precision under a budget) and 95% interval, and each rung's loss relative to the
    reference's over the same steps (both measured)."""
    rungs = result.precision.get("rungs", [])
    ref_name = result.precision.get("reference") or "float32"  # older results: float32 was always the reference
    fig = ReportFigure(figsize=(11, 4.2))
    ax, ax2 = fig.subplots(1, 2)
    timed = [r for r in rungs if r.get("step_median_s") is not None]
    top = max((r["step_p90_s"] for r in timed), default=1.0) * 1e3
    for i, r in enumerate(rungs):
        color = STATUS_COLORS.get(r["status"], "#868e96")
        if r.get("step_median_s") is None:
            ax.bar(i, top * 0.05, color="none", edgecolor="#868e96", hatch="//")
            pb = r.get("probe") or {}
            note = r["status"].replace("cannot be faster here", "cannot be\nfaster here")
            if pb.get("cannot_be_faster"):  # both probe rates: why it was not timed
                note += (f"\nmatmul {pb['flops_per_s'] / 1e9:.3g}\nvs {pb.get('reference') or ref_name} "
                         f"{pb['float32_flops_per_s'] / 1e9:.3g}\nGFLOP/s")
            ax.text(i, top * 0.07, note, ha="center", va="bottom", fontsize=7 if "\n" in note else 8)
            continue
        med, lo, hi = (r[k] * 1e3 for k in ("step_median_s", "step_p10_s", "step_p90_s"))
        ax.bar(i, med, color=color, yerr=[[med - lo], [hi - med]], capsize=4)
        note = "reference" if r["status"] == "reference" else (
            f"{r['speedup']:.2f}x\n[{r['speedup_low']:.2f}, {r['speedup_high']:.2f}]\n{r['status']}"
            if r.get("speedup_low") is not None else r["status"])
        ax.text(i, hi, note, ha="center", va="bottom", fontsize=7)
    ax.set_xticks(range(len(rungs)))
    ax.set_xticklabels([r["name"] + (" (job)" if r.get("own") else "") for r in rungs], fontsize=8)
    ax.set_ylim(0, top * 1.35)
    ax.set_ylabel("ms per step (median, p10-p90)")
    ax.set_title("Step time by precision, interleaved rounds (measured)")
    ref = next((r for r in rungs if r["status"] == "reference"), None)
    base = [v if v is not None else math.nan for v in (ref or {}).get("loss", [])]
    for r in rungs:
        if r is ref or not r.get("loss") or not base:
            continue
        n = min(len(r["loss"]), len(base))
        ys = [(v / base[j] - 1) if v is not None and base[j] else math.nan for j, v in enumerate(r["loss"][:n])]
        ax2.plot(range(n), ys, label=f"{r['name']} ({r['status']})", color=RUNG_COLORS.get(r["name"]))
        if r.get("stopped_at") is not None:
            last = next((v for v in reversed(ys) if math.isfinite(v)), 0.0)  # where a NaN ended it: its last value
            ax2.plot([r["stopped_at"]], [last], "x", ms=10, color="#c92a2a")
    tol = result.job.get("loss_tolerance", 0.02)
    ax2.axhline(tol, color="#c92a2a", lw=1, ls=":", label=f"tolerance {tol:.0%}")
    ax2.axhline(0, color="#495057", lw=0.8)
    ax2.yaxis.set_major_formatter(matplotlib.ticker.PercentFormatter(1.0))
    ax2.set_xlabel("step")
    ax2.set_title(f"Loss relative to {ref_name}, same seed and batches")
    if ax2.get_legend_handles_labels()[0]:
        ax2.legend(fontsize=7)
    fig.tight_layout()
    return fig
