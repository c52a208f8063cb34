"""Plots drawn from results (never from live state). Each returns a matplotlib Figure."""

from __future__ import annotations

import base64
import io
import math
from collections import Counter

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
    ax.yaxis.set_major_formatter(matplotlib.ticker.PercentFormatter(1.0, decimals=0))
    ax.set_ylim(0, max([v for _, pts in trend for v in pts.values()] + [0.01]) * 1.25)
    ax.set_ylabel("MFU (measured)")
    ax.set_title(f"MFU across this job's runs ({len(trend)} run{'s' if len(trend) != 1 else ''})")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
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


def comm_sweep(result) -> ReportFigure:
    """Step time and exposed-communication share against bucket size, one line per hook."""
    fig = ReportFigure(figsize=(11, 3.8))
    ax, ax2 = fig.subplots(1, 2)
    for hook in dict.fromkeys(r.hook for r in result.comm):
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


CATEGORY_COLORS = {"matmul": "#3b6fb6", "attention": "#7048e8", "normalisation": "#e8912d", "elementwise": "#f2c14e",
                   "reduction": "#c2255c", "memory copy": "#868e96", "communication": "#2f9e44",
                   "optimizer": "#0c8599", "data loading": "#a0522d", "other": "#ced4da"}
BREAKDOWN_COLORS = {"computing": "#3b6fb6", "communicating (exposed)": "#7048e8", "copying memory": "#868e96",
                    "waiting for data": "#e8912d", "idle": "#c92a2a"}


def _short(name: str, n: int = 48) -> str:
    return name if len(name) <= n else name[:n - 1] + "…"


def top_kernels(result) -> ReportFigure:
    """The top-N table as bars (time per step, coloured by category), and time by category beside it."""
    a = result.analysis
    rows = a.top[::-1]
    fig = ReportFigure(figsize=(11.5, 0.26 * max(len(rows), 8) + 1.6))
    ax, ax2 = fig.subplots(1, 2, gridspec_kw={"width_ratios": [2.3, 1]})
    per_step = [r.total_s / a.steps * 1e3 for r in rows]
    names = Counter(r.name for r in rows)  # one operator can appear in two categories (copy_ in the optimiser)
    ys = list(range(len(rows)))
    ax.barh(ys, per_step, color=[CATEGORY_COLORS[r.category] for r in rows])
    ax.set_yticks(ys)
    ax.set_yticklabels([_short(r.name) + (f" ({r.category})" if names[r.name] > 1 else "") for r in rows])
    for i, (v, r) in enumerate(zip(per_step, rows)):
        ax.text(v, i, f" {r.share:.1%}", va="center", fontsize=7)
    ax.set_xlim(0, max(per_step + [1e-6]) * 1.15)
    ax.tick_params(axis="y", labelsize=7)
    unit = "kernels" if a.kind == "gpu" else "operators (self time)"
    ax.set_xlabel("ms per profiled step (label: share of the step)")
    ax.set_title(f"Top {len(a.top)} {unit}: {a.top_share:.1%} of the step")
    cats = [(c, s) for c, s in a.category_share.items() if s > 0][::-1]
    ax2.barh([c for c, _ in cats], [s for _, s in cats], color=[CATEGORY_COLORS[c] for c, _ in cats])
    for i, (_, s) in enumerate(cats):
        ax2.text(s, i, f" {s:.1%}", va="center", fontsize=8)
    ax2.xaxis.set_major_formatter(matplotlib.ticker.PercentFormatter(1.0))
    ax2.set_xlim(0, max([s for _, s in cats] + [0.01]) * 1.3)
    ax2.set_title("Time by category (all rows)")
    fig.tight_layout()
    return fig


def time_breakdown(result, per_rank: bool = False) -> ReportFigure:
    """The profiled window split into computing, exposed communication, copies, data wait and idle: one bar
    for the one-process profile, or (``per_rank``) one bar per rank of the data-parallel profile."""
    if per_rank:
        rows = [(f"rank {r.rank}", r.breakdown) for r in result.ddp.get("ranks", [])][::-1]
        title = (f"Data-parallel, per rank ({result.ddp.get('world_size')} ranks over {result.ddp.get('backend')}, "
                 f"hook {result.ddp['config']['hook']}, bucket {result.ddp['config']['bucket_mb']:g} MB)")
    else:
        b = result.analysis.breakdown
        rows = [("one process", b)]
        title = f"Where the profiled step goes ({b.steps} steps, {b.window_s / b.steps * 1e3:.1f} ms each)"
    fig = ReportFigure(figsize=(11, 1.4 + 0.5 * len(rows)))
    ax = fig.subplots()
    for y, (_, b) in enumerate(rows):
        left = 0.0
        for name, share in b.parts().items():
            ax.barh([y], [share], left=left, color=BREAKDOWN_COLORS[name], label=name if y == 0 else None)
            if share > 0.06:
                ax.text(left + share / 2, y, f"{share:.0%}", ha="center", va="center", color="white", fontsize=9)
            left += share
    ax.set_xlim(0, 1)
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([label for label, _ in rows])
    ax.xaxis.set_major_formatter(matplotlib.ticker.PercentFormatter(1.0))
    ax.set_title(title)
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.45 if len(rows) == 1 else -0.2), ncol=5,
              frameon=False)
    fig.tight_layout()
    return fig


def fusion_candidates(result, n: int = 10) -> ReportFigure:
    """Each candidate's measured time per step beside the traffic time a fused kernel would save."""
    cands = result.analysis.fusion[:n][::-1]
    fig = ReportFigure(figsize=(11, 0.42 * max(len(cands), 2) + 1.9))
    ax = fig.subplots()
    names = [_short(f"{c.pattern} (x{c.per_step:g})", 52) for c in cands]
    ys = list(range(len(cands)))
    ax.barh([y + 0.2 for y in ys], [c.time_per_step_s * 1e3 for c in cands], height=0.4, color="#3b6fb6",
            label="measured time of these runs")
    ax.barh([y - 0.2 for y in ys], [(c.est_saving_per_step_s or 0) * 1e3 for c in cands], height=0.4,
            color="#2f9e44", label="estimated saving: intermediate traffic / measured bandwidth")
    ax.set_yticks(ys)
    ax.set_yticklabels(names, fontsize=7)
    ax.set_xlabel("ms per step")
    ax.set_title("Fusion candidates, ranked by estimated saving")
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.25), ncol=2, frameon=False)
    fig.tight_layout()
    return fig


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


# ------------------------------------------------------------------ step 6: placement
TERM_COLORS = {"compute_s": "#3b6fb6", "bubble_s": "#adb5bd", "tp_s": "#7048e8", "pp_s": "#e8912d",
               "dp_exposed_s": "#c92a2a"}
TERM_NAMES = {"compute_s": "compute", "bubble_s": "pipeline bubble", "tp_s": "TP all-reduce",
              "pp_s": "PP send/receive", "dp_exposed_s": "DP all-reduce, exposed"}


def size_sweep(result) -> ReportFigure:
    """Predicted MFU and tokens per GPU-hour against GPU count, the efficient size marked (modelled)."""
    ok = [r for r in result.sweep if r["status"] == "ok"]
    fig = ReportFigure(figsize=(10, 3.8))
    ax, ax2 = fig.subplots(1, 2)
    n = [r["gpus_n"] for r in ok]
    ax.plot(n, [r["mfu"] * 100 for r in ok], "o-", color=COLORS["mfu"])
    shown = None
    for r in ok:  # name the layout where it changes (micro-batch count aside)
        lay = r["label"].rsplit(" m", 1)[0].replace(" DP" + str(r["layout"]["dp"]), "")
        if lay != shown:
            ax.annotate(lay, (r["gpus_n"], r["mfu"] * 100), fontsize=7, textcoords="offset points", xytext=(3, -10))
            shown = lay
    ax2.plot(n, [r["tokens_per_gpu_hour"] / 1e6 for r in ok], "o-", color=COLORS["compute"])
    for a in (ax, ax2):
        a.set_xscale("log", base=2)
        a.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}"))
        a.set_xlabel("GPUs")
        if result.efficient_size:
            a.axvline(result.efficient_size, color="#222", ls="--", lw=1)
            a.text(result.efficient_size, a.get_ylim()[0], " efficient size", fontsize=8, va="bottom")
    ax.set_ylabel("MFU (%)")
    ax.set_title("Predicted MFU by size [modelled]")
    ax2.set_ylabel("million tokens per GPU-hour")
    ax2.set_title("Predicted tokens per GPU-hour [modelled]")
    fig.tight_layout()
    return fig


def _term_bars(ax, rows, labels):
    left = [0.0] * len(rows)
    for term, color in TERM_COLORS.items():
        vals = [r[term] * 1e3 for r in rows]
        if any(v > 0 for v in vals):
            ax.barh(labels, vals, left=left, color=color, label=TERM_NAMES[term])
            left = [a + b for a, b in zip(left, vals)]
    ax.invert_yaxis()
    ax.set_xlabel("predicted step time (ms)")
    ax.legend(fontsize=7, loc="lower right")


def placement_strategies(result) -> ReportFigure:
    """Predicted step time of each placement strategy, split into its terms (modelled)."""
    rows = [r for r in result.strategies if r.get("status") == "ok"]
    fig = ReportFigure(figsize=(9, 0.6 * len(rows) + 1.6))
    ax = fig.subplots()
    _term_bars(ax, rows, [f"{r['strategy']} ({r['nodes']} nodes, {r['switches']} sw)" for r in rows])
    ax.set_title(f"Placement strategies, {result.chosen['label']} [modelled]")
    fig.tight_layout()
    return fig


def placement_map(result) -> ReportFigure:
    """Which GPUs each placement occupies: one panel per strategy and per shared partition.

    Rows are nodes (grouped by leaf switch), columns GPUs; a single job is coloured by TP group (the
    GPUs of one group share a colour), shared partitions by job; hatched cells are held by others.
    """
    c = result.cluster
    g = c["gpus_per_node"]
    nodes = c["nodes"]
    panels = [(r["strategy"], [r["gpus"]]) for r in result.strategies if r.get("status") == "ok"]
    for part in ("whole racks", "interleaved nodes"):
        jobs = [r["gpus"] for r in result.shared if r.get("partition") == part and r.get("status") == "ok"]
        if jobs:
            panels.append((f"{len(jobs)} jobs: {part}", jobs))
    if not panels:
        return None
    fig = ReportFigure(figsize=(2.3 * len(panels), max(3.0, 0.16 * nodes + 1.2)))
    axes = fig.subplots(1, len(panels), squeeze=False)[0]
    import matplotlib.colors as mcolors

    palette = list(mcolors.TABLEAU_COLORS.values())
    sizes = [len(v) for v in c["switches"].values()]
    for ax, (title, jobs) in zip(axes, panels):
        grid = [[(1, 1, 1)] * g for _ in range(nodes)]
        for x in range(c["occupied_gpus"]):
            grid[x // g][x % g] = (0.75, 0.75, 0.75)
        tp = result.chosen["layout"]["tp"] if result.chosen else 1
        for j, gpus in enumerate(jobs):
            for rank, x in enumerate(gpus):
                key = j if len(jobs) > 1 or tp == 1 else rank // tp
                grid[x // g][x % g] = mcolors.to_rgb(palette[key % len(palette)])
        ax.imshow(grid, aspect="auto", interpolation="nearest")
        edge = -0.5
        for s in sizes[:-1]:
            edge += s
            ax.axhline(edge, color="#222", lw=1.2)
        ax.set_xticks(range(g))
        ax.set_xticklabels(range(g), fontsize=6)
        ax.set_yticks([])
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("GPU in node", fontsize=7)
    axes[0].set_ylabel("nodes (lines: leaf switches)", fontsize=8)
    fig.suptitle("Where the ranks sit (grey: held by others; colour: a TP group, or a job when several share)",
                 fontsize=9)
    fig.tight_layout()
    return fig


def model_check(result) -> ReportFigure:
    """Predicted against measured data-parallel step time on this machine, one bar per compute source."""
    ch = result.check
    if not ch.available or not ch.rows:
        return None
    fig = ReportFigure(figsize=(9, 0.5 * len(ch.rows) + 1.8))
    ax = fig.subplots()
    labels = [r["name"] for r in ch.rows]
    ax.barh(labels, [r["compute_s"] * 1e3 for r in ch.rows], color=COLORS["compute"], label="compute (measured)")
    ax.barh(labels, [r["comm_s"] * 1e3 for r in ch.rows], left=[r["compute_s"] * 1e3 for r in ch.rows],
            color=COLORS["structure"], label="all-reduce (modelled from step 2's benchmark)")
    ax.axvline(ch.measured_s * 1e3, color="#222", lw=1.5, label="measured DDP step (step 2)")
    ax.axvspan(ch.measured_p10_s * 1e3, ch.measured_p90_s * 1e3, color="#222", alpha=0.1, label="p10-p90")
    for i, r in enumerate(ch.rows):
        ax.text(r["predicted_s"] * 1e3, i, f" {r['error']:+.0%}", va="center", fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("step time (ms)")
    ax.set_title(f"The model against step 2: {ch.world} ranks over {ch.backend}")
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.28), ncol=4, frameon=False)
    fig.tight_layout()
    return fig


def gang_timeline(result) -> ReportFigure:
    """GPUs running and GPUs held idle over time, gang against partial starts (simulated)."""
    fig = ReportFigure(figsize=(10, 3.4))
    axes = fig.subplots(1, len(result.gang), sharey=True, squeeze=False)[0]
    total = result.cluster["gpus"]
    for ax, run in zip(axes, result.gang):
        tl = run["timeline"] + [[run["horizon_h"] or run["timeline"][-1][0], 0, 0]]
        ts = [p[0] for p in tl]
        ax.step(ts, [p[1] for p in tl], where="post", color=COLORS["mfu"], label="GPUs running a job")
        ax.step(ts, [p[2] for p in tl], where="post", color=COLORS["hardware"], label="GPUs held, waiting")
        ax.axhline(total, color="#222", lw=0.8, ls=":")
        if run["deadlock_h"] is not None:
            ax.axvline(run["deadlock_h"], color=COLORS["hardware"], ls="--", lw=1)
            ax.text(run["deadlock_h"], total * 0.5, " deadlock", color=COLORS["hardware"], fontsize=8)
        ax.set_title(f"{run['policy']}: {run['idle_gpu_hours']:.0f} idle GPU-hours", fontsize=9)
        ax.set_xlabel("hours")
    axes[0].set_ylabel("GPUs")
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    return fig
