"""Step 6 (placement): size sweep, placement strategies and map, the model check, gang scheduling."""

from __future__ import annotations

import matplotlib.ticker

from mfu_lab.plots.base import COLORS, ReportFigure
from mfu_lab.plots.monitor import Unavailable

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
    unit, per = getattr(result, "unit", "tokens"), getattr(result, "per_unit", 1) or 1
    ax2.plot(n, [r["tokens_per_gpu_hour"] / per / 1e6 for r in ok], "o-", color=COLORS["compute"])
    for a in (ax, ax2):
        a.set_xscale("log", base=2)
        a.xaxis.set_major_formatter(matplotlib.ticker.FuncFormatter(lambda v, _: f"{v:g}"))
        a.set_xlabel("GPUs")
        if result.efficient_size:
            a.axvline(result.efficient_size, color="#222", ls="--", lw=1)
            a.text(result.efficient_size, a.get_ylim()[0], " efficient size", fontsize=8, va="bottom")
    ax.set_ylabel("MFU (%)")
    ax.set_title("Predicted MFU by size [modelled]")
    ax2.set_ylabel(f"million {unit} per GPU-hour")
    ax2.set_title(f"Predicted {unit} per GPU-hour [modelled]")
    fig.tight_layout()
    return fig


def term_bars(ax, rows, labels):
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
    term_bars(ax, rows, [f"{r['strategy']} ({r['nodes']} nodes, {r['switches']} sw)" for r in rows])
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
        return Unavailable("No placement to draw: no strategy or shared partition could be placed on this cluster.")
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
        return Unavailable("No model check: " + (ch.reason or "step 2 has not measured a data-parallel step on this "
                                                 "machine to check the model against") + ".")
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
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.28), ncol=2, frameon=False)
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
