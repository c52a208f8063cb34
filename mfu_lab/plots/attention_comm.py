"""Step 2 (attention and communication): attention implementations, the DDP bucket/hook sweep,
all-reduce bandwidth."""

from __future__ import annotations

import matplotlib.ticker

from mfu_lab.plots.base import COLORS, ReportFigure
from mfu_lab.plots.monitor import Unavailable

HOOK_COLORS = {"none": "#495057", "allreduce": "#3b6fb6", "fp16_compress": "#2f9e44", "bf16_compress": "#e8912d",
               "powersgd": "#c2255c"}


def attention_times(result) -> ReportFigure:
    """Attention forward+backward alone, and the whole step, per implementation that ran correctly."""
    rows = [r for r in result.attention if r.status == "ok"]
    others = [r for r in result.attention if r.status != "ok"]
    fig = ReportFigure(figsize=(11, 0.5 * max(len(rows), 2) + 1.6))
    ax, ax2 = fig.subplots(1, 2, sharey=True)
    names = [r.name for r in rows]
    ax.barh(names, [r.attn_median_s * 1e3 for r in rows], color=COLORS["compute"],
            xerr=[[max(0, (r.attn_median_s - r.attn_p10_s) * 1e3) for r in rows],
                  [max(0, (r.attn_p90_s - r.attn_median_s) * 1e3) for r in rows]])
    ax.set_xlabel("attention forward + backward, one layer (ms, median, p10-p90)")
    ax2.barh(names, [r.step_median_s * 1e3 for r in rows], color=COLORS["mfu"],
             xerr=[[max(0, (r.step_median_s - r.step_p10_s) * 1e3) for r in rows],
                   [max(0, (r.step_p90_s - r.step_median_s) * 1e3) for r in rows]])
    for i, r in enumerate(rows):
        ax2.text(r.step_median_s * 1e3, i, f"  MFU {r.mfu:.1%}", va="center", fontsize=8)
    ax2.set_xlabel("whole training step (ms, median, p10-p90)")
    if others:
        fig.text(0.01, 0.01, "not timed: " + "; ".join(f"{r.name} ({r.status})" for r in others), fontsize=7)
    fig.suptitle("Attention implementations, measured")
    fig.tight_layout(rect=(0, 0.05 if others else 0, 1, 1))
    return fig


def comm_sweep(result) -> ReportFigure | Unavailable:
    """Step time and exposed-communication share against bucket size, one line per hook; no plot (and why) when no
    DDP configuration completed, such as at world size 1, where the DDP half does not run."""
    if result.comm_layout.get("skipped"):
        return Unavailable("No communication to draw: " + result.comm_layout["skipped"])
    if not any(getattr(r, "kind", "ddp") == "ddp" and r.status == "ok" for r in result.comm):
        return Unavailable("No communication to draw: no DDP configuration completed (the table says why for each).")
    fig = ReportFigure(figsize=(11, 3.8))
    ax, ax2 = fig.subplots(1, 2)
    for hook in dict.fromkeys(r.hook for r in result.comm if getattr(r, "kind", "ddp") == "ddp"):  # FSDP2: no buckets
        for gabv, style in ((False, "-"), (True, "--")):
            pts = sorted((r.bucket_mb, r) for r in result.comm
                         if r.hook == hook and r.grad_as_bucket_view == gabv and r.status == "ok")
            if not pts:
                continue
            xs = [b for b, _ in pts]
            label = f"{hook}{' (bucket view)' if gabv else ''}"
            ax.plot(xs, [r.step_median_s * 1e3 for _, r in pts], style, marker="o", color=HOOK_COLORS.get(hook),
                    label=label)
            ax2.plot(xs, [r.exposed_share for _, r in pts], style, marker="o", color=HOOK_COLORS.get(hook))
    for a in (ax, ax2):
        a.set_xscale("log")
        a.set_xlabel("bucket_cap_mb")
    ax.set_ylabel("DDP step time (ms, median)")
    ax2.set_ylabel("exposed communication / step")
    ax2.yaxis.set_major_formatter(matplotlib.ticker.PercentFormatter(1.0))
    ax.legend(fontsize=7)
    ax.set_title(f"Step time ({result.comm_layout.get('world_size')} ranks, {result.comm_layout.get('backend')})")
    ax2.set_title("Exposed communication share")
    fig.tight_layout()
    return fig


def allreduce_bandwidth(result) -> ReportFigure:
    fig = ReportFigure(figsize=(6, 3.4))
    ax = fig.subplots()
    rows = result.allreduce
    ax.plot([r["bytes"] for r in rows], [r["busbw_gbps"] for r in rows], marker="o", label="bus bandwidth")
    ax.plot([r["bytes"] for r in rows], [r["algbw_gbps"] for r in rows], marker=".", ls=":", label="algorithm bw")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("message size (bytes)")
    ax.set_ylabel("GB/s")
    ax.set_title("All-reduce bandwidth (nccl-tests definitions)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def race(result) -> ReportFigure | Unavailable:
    """Step 2's races: each candidate's median step time after each round; a candidate's line ends where it was
    dropped. One panel per race (attention implementations, DDP configurations)."""
    races = [(k, r) for k, r in (getattr(result, "races", None) or {}).items() if r and r.rounds]
    if not races:
        return Unavailable("No race to draw: this result was measured before sweeps raced, or nothing ran.")
    fig = ReportFigure(figsize=(11, 4.2))
    axes = fig.subplots(1, len(races), squeeze=False)[0]
    for ax, (key, log) in zip(axes, races):
        names = list(dict.fromkeys(n for r in log.rounds for n in r.medians))
        for name in names:
            pts = [(r.number, r.medians[name] * 1e3) for r in log.rounds if r.medians.get(name) is not None]
            if not pts:
                continue
            ref = name in log.references
            ax.plot(*zip(*pts), marker="o", lw=2.2 if ref else 1, color="#222" if ref else None, alpha=1 if ref
                    else 0.7, label=name + (" (reference)" if ref else "") if ref or len(names) <= 8 else None)
        ax.set_xticks([r.number for r in log.rounds])
        ax.set_xticklabels([f"round {r.number}\n{r.steps} steps, "  # a candidate ruled out untimed did not run
                            f"{sum(m is not None for m in r.medians.values())} ran" for r in log.rounds], fontsize=8)
        ax.set_ylabel("median step (ms)")
        ax.set_title(f"{key}: {log.mode}", fontsize=10)
        ax.legend(fontsize=7, loc="best")
    fig.suptitle("The races: candidates against rounds (measured); a line that stops was dropped")
    fig.tight_layout()
    return fig
