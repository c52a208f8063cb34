"""Step 5 (FP8): per-layer sensitivity and the loss curves of each policy."""

from __future__ import annotations

import math

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
    fig = ReportFigure(figsize=(11, 4.2))
    ax, ax2 = fig.subplots(1, 2)
    ref = next(t for t in result.trials if t.status == "reference")
    for t in result.trials:
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
