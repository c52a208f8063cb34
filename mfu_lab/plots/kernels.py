"""Step 3 (kernels): the top-N kernels or operators, the time breakdown, fusion candidates."""

from __future__ import annotations

from collections import Counter

import matplotlib.ticker

from mfu_lab.plots.base import ReportFigure

CATEGORY_COLORS = {"matmul": "#3b6fb6", "attention": "#7048e8", "normalisation": "#e8912d", "elementwise": "#f2c14e",
                   "reduction": "#c2255c", "memory copy": "#868e96", "communication": "#2f9e44",
                   "optimizer": "#0c8599", "data loading": "#a0522d", "other": "#ced4da"}
BREAKDOWN_COLORS = {"computing": "#3b6fb6", "communicating (exposed)": "#7048e8", "copying memory": "#868e96",
                    "waiting for data": "#e8912d", "idle": "#c92a2a"}
KIND_COLORS = {"allgather": "#9c36b5", "reduce_scatter": "#e64980", "allreduce": "#7048e8", "send": "#1098ad",
               "recv": "#0b7285", "broadcast": "#5f3dc4", "all_to_all": "#d6336c", "barrier": "#495057"}


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
    lay = getattr(result, "layout", None) or {}
    whose = f", rank 0 of {lay['name']}" if lay else ""
    caveat = f"\n{lay['caveat']}" if lay.get("caveat") else ""
    ax.set_title(f"Top {len(a.top)} {unit}{whose}: {a.top_share:.1%} of the step{caveat}", fontsize=10)
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
    for the one-process profile, or (``per_rank``) one bar per rank of the data-parallel profile, or of the job's
    own layout, where the exposed communication is split by collective kind."""
    lay = getattr(result, "layout", None) or {}
    if per_rank and lay.get("profiles"):
        return _layout_ranks(lay)
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


def _parts_by_kind(b) -> dict[str, tuple[float, str]]:
    """A rank's traced step in parts, the exposed communication split by kind: {label: (share, colour)}."""
    out = {"computing": (b.computing, BREAKDOWN_COLORS["computing"])}
    kinds = {k: v["exposed"] for k, v in sorted(b.comm_by_kind.items()) if v["exposed"] > 0}
    for i, (k, v) in enumerate(kinds.items()):
        out[f"{k} (exposed)"] = (v, KIND_COLORS.get(k, ["#ae3ec9", "#f783ac", "#74c0fc"][i % 3]))
    rest = b.communicating - sum(kinds.values())
    if rest > 1e-4:
        out["communicating (exposed, no kind)"] = (rest, BREAKDOWN_COLORS["communicating (exposed)"])
    for name in ("copying memory", "waiting for data", "idle"):
        out[name] = (b.parts()[name], BREAKDOWN_COLORS[name])
    return out


def _layout_ranks(lay: dict) -> ReportFigure:
    """One bar per rank of the job's own layout, its exposed communication split by collective kind."""
    rows = [(f"rank {p.rank} ({p.coords})", _parts_by_kind(p.breakdown)) for p in lay["profiles"]][::-1]
    caveat = f"\n{lay['caveat']}" if lay.get("caveat") else ""
    fig = ReportFigure(figsize=(11, 1.8 + 0.5 * len(rows)))
    ax = fig.subplots()
    seen: set[str] = set()
    for y, (_, parts) in enumerate(rows):
        left = 0.0
        for name, (share, colour) in parts.items():
            ax.barh([y], [share], left=left, color=colour, label=None if name in seen else name)
            seen.add(name)
            if share > 0.06:
                ax.text(left + share / 2, y, f"{share:.0%}", ha="center", va="center", color="white", fontsize=9)
            left += share
    ax.set_xlim(0, 1)
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([label for label, _ in rows])
    ax.xaxis.set_major_formatter(matplotlib.ticker.PercentFormatter(1.0))
    ax.set_title(f"{lay['name']}, per rank ({lay['world']} ranks over {lay['backend']}): the traced step, exposed "
                 f"communication by collective kind{caveat}", fontsize=10)
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=4, frameon=False)
    fig.tight_layout()
    return fig
