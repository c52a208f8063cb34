"""Optional interactive cells: pick what to compare from a step's measured results and re-plot, and in
step 6 move what-if sliders that re-run the placement model.

Each ``explore_*`` returns an :class:`Explorer`. In JupyterLab it shows ipywidgets controls over a plot
that redraws on every change. Where no live kernel stands behind the page (papermill's saved notebook,
the exported HTML report) the same output carries a static fallback: the plot of the initial selection
as an embedded PNG, captioned as such. Nothing is fetched from the internet: the HTML export does not
embed the widget manager, so the fallback is what a report reader sees, and the caption says so.

The drawing functions are plain functions of the result and the selection (``draw_*``), tested without
widgets; every figure they show was measured by the step, or modelled by step 6 and labelled so.
"""

from __future__ import annotations

import dataclasses
import html
import textwrap
from collections.abc import Callable
from typing import Any

from mfu_lab import plots
from mfu_lab.analysis.placement.calibration import calibrate
from mfu_lab.analysis.placement.cluster_files import load_cluster
from mfu_lab.analysis.placement.model import Shape, occupied_groups
from mfu_lab.analysis.placement.strategies import best_layout, strategy_rows
from mfu_lab.core.measure.flops import mfu as model_flops_utilisation
from mfu_lab.core.measure.timed import stats
from mfu_lab.plots import ReportFigure
from mfu_lab.steps.placement.step import earlier_results

FALLBACK_NOTE = ("Static image of the initial selection: this page has no Python kernel behind it, so the "
                 "controls cannot redraw it here. Open the notebook in JupyterLab and run the cell to explore.")


class Explorer:
    """Controls (ipywidgets) over a figure and a line of text, redrawn by ``draw(**values)``."""

    def __init__(self, title: str, controls: dict[str, Any], draw: Callable[..., tuple[ReportFigure, str]]):
        import ipywidgets as w

        self.title, self.controls, self.draw = title, controls, draw
        self.image = w.Image(format="png", layout=w.Layout(max_width="100%"))
        self.text = w.HTML()
        self.redraws = 0
        for c in controls.values():
            c.observe(lambda _change: self.update(), names="value")
        self.update()
        self.box = w.VBox([w.HTML(f"<b>{html.escape(title)}</b>"), w.HBox(list(controls.values()),
                          layout=w.Layout(flex_flow="row wrap")), self.image, self.text])

    def values(self) -> dict[str, Any]:
        return {k: c.value for k, c in self.controls.items()}

    def update(self) -> None:
        fig, text = self.draw(**self.values())
        self.fig, self.redraws = fig, self.redraws + 1
        self.image.value = fig.png()
        self.text.value = f"<small>{text}</small>"

    def fallback_html(self) -> str:
        return (f'<div class="mfu-explore"><p><b>{html.escape(self.title)}</b></p>'
                f'<img alt="{html.escape(self.title)}" src="{plots.to_data_uri(self.fig)}" style="max-width:100%">'
                f"<p><small>{self.text.value}</small></p><p><small><i>{FALLBACK_NOTE}</i></small></p></div>")

    def _repr_mimebundle_(self, include=None, exclude=None):
        data = self.box._repr_mimebundle_(include=include, exclude=exclude)
        if isinstance(data, tuple):
            data = data[0]
        data = dict(data or {})
        data["text/html"] = self.fallback_html()  # what a page without a kernel shows
        data["text/plain"] = f"{self.title} (interactive; static image in the HTML export)"
        return data


def _multi(options: list[str], value: list[str], description: str):
    import ipywidgets as w

    return w.SelectMultiple(options=options, value=tuple(v for v in value if v in options) or tuple(options[:1]),
                            description=description, rows=min(8, max(3, len(options))),
                            style={"description_width": "initial"})


# ------------------------------------------------------------------ step 1
def draw_baseline(result, discard: int = 0) -> tuple[ReportFigure, str]:
    """Step times with ``discard`` more measured steps dropped; median and MFU over the rest, by step 1's formula."""
    t = result.timings
    wall = t.measured("wall_s")
    discard = max(0, min(discard, len(wall) - 1))
    kept = wall[discard:]
    flops, peak = result.metrics["model_flops_per_step"].value, result.metrics["peak_flops_per_s"].value
    mfu = model_flops_utilisation(flops, len(kept) / sum(kept), peak)  # model FLOPs x steps / (peak x wall)
    st = stats(kept)
    fig = ReportFigure(figsize=(9, 3.2))
    ax = fig.subplots()
    xs = list(range(t.warmup_steps + 1, t.warmup_steps + len(wall) + 1))
    ax.plot(xs, [v * 1e3 for v in wall], marker="o", ms=3, color=plots.COLORS["compute"])
    if discard:
        ax.axvspan(xs[0] - 0.5, xs[discard - 1] + 0.5, color="#000", alpha=0.08, label=f"{discard} more discarded")
    ax.axhline(st.median * 1e3, color="#222", ls="--", lw=1, label=f"median {st.median * 1e3:.1f} ms")
    ax.set_xlabel("training step (after the job's warm-up)")
    ax.set_ylabel("step time (ms)")
    ax.set_title(f"MFU over the kept steps: {mfu:.1%} (measured)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    base = result.metrics["mfu"].value
    return fig, (f"{len(kept)} steps kept: median {st.median * 1e3:.1f} ms (p10-p90 {st.p10 * 1e3:.1f}-"
                 f"{st.p90 * 1e3:.1f}), MFU {mfu:.1%} [measured: model FLOPs x steps / (peak x their wall time)]; "
                 f"all {len(wall)} measured steps: {base:.1%}.")


def explore_baseline(result) -> Explorer:
    import ipywidgets as w

    n = len(result.timings.measured("wall_s"))
    return Explorer("How much does the warm-up choice move MFU?",
                    {"discard": w.IntSlider(0, 0, max(0, n - 2), description="discard more",
                                            style={"description_width": "initial"})},
                    lambda discard: draw_baseline(result, discard))


# ------------------------------------------------------------------ step 2
def comm_label(r) -> str:
    return f"{r.hook} / {r.bucket_mb:g} MB" + (" / view" if r.grad_as_bucket_view else "")


def draw_attention_comm(result, attention: list[str], comm: list[str]) -> tuple[ReportFigure, str]:
    """Step time (median, p10-p90) of the selected attention implementations and DDP configurations."""
    att = [r for r in result.attention if r.status == "ok" and r.step_median_s and r.name in attention]
    com = [r for r in result.comm if r.status == "ok" and r.step_median_s and comm_label(r) in comm]
    fig = ReportFigure(figsize=(11, 0.35 * max(len(att), len(com), 2) + 1.8))
    ax, ax2 = fig.subplots(1, 2)
    for a, rows, labels, title in ((ax, att, [r.name for r in att], "Attention: whole training step"),
                                   (ax2, com, [comm_label(r) for r in com], "DDP: step time, 2 ranks")):
        if rows:
            med = [r.step_median_s * 1e3 for r in rows]
            err = [[m - r.step_p10_s * 1e3 for m, r in zip(med, rows)], [r.step_p90_s * 1e3 - m for m, r in
                                                                          zip(med, rows)]]
            a.barh(labels, med, xerr=err, color=plots.COLORS["compute"], capsize=3)
            a.invert_yaxis()
        a.set_xlabel("step time (ms): median, p10-p90 (measured)")
        a.set_title(title)
    fig.tight_layout()
    parts = []
    if att:
        best = min(att, key=lambda r: r.step_median_s)
        parts.append(f"fastest attention selected: {best.name} at {best.step_median_s * 1e3:.1f} ms")
    if com:
        best = min(com, key=lambda r: r.step_median_s)
        parts.append(f"fastest DDP configuration selected: {comm_label(best)} at {best.step_median_s * 1e3:.1f} ms"
                     f" (exposed communication {best.exposed_share or 0:.1%})")
    return fig, "; ".join(parts) + ". Overlapping p10-p90 bars are within the noise." if parts else "nothing selected"


def explore_attention_comm(result) -> Explorer:
    att = [r.name for r in result.attention if r.status == "ok" and r.step_median_s]
    com = [comm_label(r) for r in result.comm if r.status == "ok" and r.step_median_s]
    default = [c for c in com if c.startswith("none / 25 MB")]
    fastest = sorted(com, key=lambda c: next(r.step_median_s for r in result.comm if comm_label(r) == c))[:3]
    controls = {"attention": _multi(att, att, "attention"),
                "comm": _multi(com, default + fastest, "DDP (hook / bucket)")}
    return Explorer("Compare attention implementations and DDP configurations", controls,
                    lambda attention, comm: draw_attention_comm(result, list(attention), list(comm)))


# ------------------------------------------------------------------ step 3
def draw_kernels(result, top: int, categories: list[str]) -> tuple[ReportFigure, str]:
    """The ``top`` operators (or kernels) of the selected categories, from the trace's top list."""
    rows = [r for r in result.analysis.top if r.category in categories][:top]
    view = dataclasses.replace(result, analysis=dataclasses.replace(result.analysis, top=rows))
    fig = plots.top_kernels(view)
    share = sum(r.share for r in rows)
    return fig, (f"{len(rows)} {'kernels' if result.analysis.kind == 'gpu' else 'operators'} shown cover "
                 f"{share:.1%} of the profiled step (measured self time)")


def explore_kernels(result) -> Explorer:
    import ipywidgets as w

    cats = sorted({r.category for r in result.analysis.top})
    n = len(result.analysis.top)
    return Explorer("The top operators, by category", {
        "top": w.IntSlider(min(10, n), 1, max(n, 1), description="show top", style={"description_width": "initial"}),
        "categories": _multi(cats, cats, "categories")},
        lambda top, categories: draw_kernels(result, top, list(categories)))


# ------------------------------------------------------------------ step 4
def draw_compile(result, modes: list[str], steps: int, warm: bool) -> tuple[ReportFigure, str]:
    """Cumulative training time over ``steps`` steps: compile time (cold or warm cache) + steps x step time."""
    eager = result.eager
    ok = [t for t in result.trials if t.status == "ok" and t.mode in modes]
    fig = ReportFigure(figsize=(9, 3.6))
    ax = fig.subplots()
    xs = [steps * i / 50 for i in range(51)]
    ax.plot(xs, [x * eager.step_median_s for x in xs], color="#222", lw=2, label="eager")
    lines = []
    for t in ok:
        c = (t.compile_warm_s if warm else t.compile_cold_s) or 0.0
        ax.plot(xs, [c + x * t.step_median_s for x in xs], label=f"{t.mode} ({'warm' if warm else 'cold'} cache)")
        saved = steps * (eager.step_median_s - t.step_median_s) - c
        lines.append(f"{t.mode}: {'saves' if saved > 0 else 'costs'} {abs(saved):.1f} s over {steps:,} steps")
    ax.set_xlabel("training steps")
    ax.set_ylabel("cumulative time (s)")
    ax.set_title("Does compiling pay within this many steps? (measured step and compile times)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig, "; ".join(lines) + " (step times and compile times measured; the sum is arithmetic)" if lines \
        else "no compiled mode selected (or none ran)"


def explore_compile(result) -> Explorer:
    import ipywidgets as w

    modes = [t.mode for t in result.trials if t.status == "ok"]
    be = [t.break_even_cold for t in result.trials if t.status == "ok" and t.break_even_cold]
    horizon = int(min(max(be) * 2, 1e6)) if be else 1000
    return Explorer("When does each compile mode pay for itself?", {
        "modes": _multi(modes, modes, "modes"),
        "steps": w.IntSlider(max(horizon, 10), 10, max(horizon * 5, 1000), step=10, description="steps",
                             style={"description_width": "initial"}),
        "warm": w.Checkbox(False, description="warm compile cache")},
        lambda modes, steps, warm: draw_compile(result, list(modes), steps, warm))


# ------------------------------------------------------------------ step 5
def draw_fp8(result, policies: list[str]) -> tuple[ReportFigure, str]:
    """Loss curves of the reference and the selected policies (emulated FP8 on devices without FP8 units)."""
    ref = [t for t in result.trials if t.status == "reference"]
    sel = [t for t in result.trials if t.status != "reference" and t.name in policies and t.loss]
    fig = plots.fp8_losses(dataclasses.replace(result, trials=ref + sel))
    gaps = "; ".join(f"{t.name}: {t.status}" + (f", last-window gap {t.final_gap:+.2%}" if t.final_gap is not None
                                               else "") for t in sel)
    return fig, (gaps or "no policy selected") + f" ({result.path})"


def explore_fp8(result) -> Explorer:
    names = [t.name for t in result.trials if t.status != "reference" and t.loss]  # a policy not run has no curve
    return Explorer("Compare FP8 policies' loss curves", {"policies": _multi(names, names, "policies")},
                    lambda policies: draw_fp8(result, list(policies)))


# ------------------------------------------------------------------ step 6
@dataclasses.dataclass
class WhatIf:
    """Step 6's model re-run for one setting of the sliders: every figure modelled."""

    layout: str
    rows: list[dict]  # per strategy: prediction fields, or status
    text: str


def what_if(job, result, gpus: int, tp: int = 0, pp: int = 0, oversubscription: float | None = None,
            neighbour_gpus: int | None = None, neighbour_traffic: float = 1.0) -> WhatIf:
    """Re-run the placement model with a changed size, layout, uplink oversubscription and neighbour: the
    GPUs others hold (the first ``neighbour_gpus``) all-reduce across their nodes ``neighbour_traffic`` of
    the time, sharing the leaf uplinks with this job."""
    cluster = load_cluster(job.cluster_path())
    changes = {}
    if oversubscription is not None:
        changes["oversubscription"] = float(oversubscription)
    if neighbour_gpus is not None:
        changes["occupied_gpus"] = int(neighbour_gpus)
    cluster = dataclasses.replace(cluster, **changes)
    cluster, cal, _ = calibrate(job, cluster, earlier_results(job))
    shape = Shape(**{k: v for k, v in result.shape.items() if k != "from"})
    best = best_layout(cluster, shape, gpus, job.global_batch, cal, tp, pp, job.cluster_interleave)
    if best is None:
        return WhatIf("-", [], f"no layout of {gpus} GPUs fits (tp {tp or 'auto'}, pp {pp or 'auto'}, global_batch "
                      f"{job.global_batch}, {cluster.n_gpus - cluster.occupied_gpus} GPUs free)")
    rows = strategy_rows(cluster, shape, best.layout, cal, job.seed, occupied_groups(cluster), neighbour_traffic)
    ok = [r for r in rows if r["status"] == "ok"]
    uplinks = uplink_note(cluster, shape, best.layout, cal, job.seed, neighbour_traffic, ok)
    text = "; ".join(f"{r['strategy']}: {r['step_s'] * 1e3:.2f} ms, MFU {r['mfu']:.1%}"
                     + (f" ({r['vs_aware']:.2f}x)" if r.get("vs_aware") and r["strategy"] != "topology-aware" else "")
                     for r in ok)
    return WhatIf(best.layout.label(), rows, f"{gpus} GPUs as {best.layout.label()} on {cluster.name} "
                  f"(oversubscription {cluster.oversubscription:g}:1, {cluster.occupied_gpus} GPUs held by a "
                  f"neighbour communicating {neighbour_traffic:.0%} of the time) [modelled]: {text}"
                  + (f". {uplinks}" if uplinks else ""))


def uplink_note(cluster, shape, layout, cal, seed: int, traffic: float, rows: list[dict]) -> str:
    """Why the uplink control moves nothing at these settings, or '': the model re-run at every oversubscription
    the slider offers (1:1 to 8:1); when none changes a step time, each group's per-GPU network share is the
    tighter limit, and the sentence says what would make the uplinks matter."""
    def steps(over: float) -> list[float]:
        c = dataclasses.replace(cluster, oversubscription=over)
        return [r["step_s"] for r in strategy_rows(c, shape, layout, cal, seed, occupied_groups(c), traffic)
                if r["status"] == "ok"]

    now = [r["step_s"] for r in rows]
    moved = [o / 2 for o in range(2, 17) if steps(o / 2) != now]
    if moved and min(moved) <= cluster.oversubscription:
        return ""  # lowering the oversubscription changes the step: the uplinks bind here
    if not moved:
        return ("The uplink oversubscription moves nothing here: the uplinks are not the bottleneck, each group's "
                "per-GPU network share is tighter at every setting from 1:1 to 8:1; raise the neighbour's GPUs or "
                "its traffic to see an effect")
    return (f"The uplinks are not the bottleneck at {cluster.oversubscription:g}:1: each group's per-GPU network "
            f"share is tighter; the step changes from {min(moved):g}:1 up, or with more of the neighbour's GPUs")


def draw_placement(job, result, **kw) -> tuple[ReportFigure, str]:
    wi = what_if(job, result, **kw)
    ok = [r for r in wi.rows if r["status"] == "ok"]
    fig = ReportFigure(figsize=(9, 0.6 * max(len(ok), 1) + 1.6))
    ax = fig.subplots()
    if ok:
        plots.term_bars(ax, ok, [f"{r['strategy']} ({r['nodes']} nodes, {r['switches']} sw)" for r in ok])
    else:  # never an empty plot: say why there is nothing to draw
        ax.axis("off")
        ax.text(0.5, 0.5, textwrap.fill(wi.text, 90), ha="center", va="center", fontsize=9, transform=ax.transAxes)
    ax.set_title(f"What if: {kw.get('gpus')} GPUs, {wi.layout} [modelled]")
    fig.tight_layout()
    return fig, wi.text


def explore_placement(job, result) -> Explorer:
    import ipywidgets as w

    c = result.cluster
    sizes = [r["gpus_n"] for r in result.sweep if r.get("status") == "ok"]  # never a size the step found impossible
    start = len(result.chosen["gpus"]) if result.chosen else (sizes or [1])[0]
    style = {"description_width": "initial"}
    controls = {
        "gpus": w.Dropdown(options=sorted(set(sizes) | {start}), value=start, description="GPUs", style=style),
        "tp": w.Dropdown(options=[0, 1, 2, 4, 8], value=job.cluster_tp, description="TP (0: best)", style=style),
        "pp": w.Dropdown(options=[0, 1, 2, 4, 8], value=job.cluster_pp, description="PP (0: best)", style=style),
        "oversubscription": w.FloatSlider(c["oversubscription"], min=1.0, max=8.0, step=0.5,
                                          description="uplink oversubscription", style=style),
        "neighbour_gpus": w.IntSlider(c["occupied_gpus"], 0, c["gpus"] // 2, step=c["gpus_per_node"] // 2 or 1,
                                      description="GPUs a neighbour holds", style=style),
        "neighbour_traffic": w.FloatSlider(1.0, min=0.0, max=1.0, step=0.1, description="neighbour's traffic",
                                           style=style),
    }
    return Explorer("What if: size, layout, uplinks and a neighbour's traffic (the placement model, re-run)",
                    controls, lambda **kw: draw_placement(job, result, **kw))


def draw_layout(result, layout: str) -> tuple[ReportFigure, str]:
    """One of this node's layouts: each term's observed figure against the model's (model = 1), and the step
    time beside it; the cluster extrapolation is the size sweep above, from the model these terms checked."""
    e = next((x for x in result.layouts if x["layout"] == layout), None)
    terms = [t for t in (e or {}).get("terms", []) if t["ratio"] is not None]
    fig = ReportFigure(figsize=(9, 0.35 * max(len(terms), 1) + 1.6))
    ax = fig.subplots()
    if not terms:
        ax.set_axis_off()
        why = "not measured" if e is None else f"{e['status']}: {e['reason']}" if e["status"] != "ok" else "no ratio"
        ax.text(0.5, 0.5, textwrap.fill(f"{layout}: {why}", 90), ha="center", va="center", transform=ax.transAxes)
        return fig, why
    ys = list(range(len(terms)))[::-1]
    ax.barh([y + 0.2 for y in ys], [1.0] * len(terms), height=0.4, color="#adb5bd", label="model")
    ax.barh([y - 0.2 for y in ys], [t["ratio"] for t in terms], height=0.4, label="observed",
            color=[plots.COLORS["mfu"] if t["source"] == "counted" else plots.COLORS["data"] for t in terms])
    for y, t in zip(ys, terms):
        ax.text(t["ratio"], y - 0.2, f" {t['ratio']:.3f} ({t['source']})", va="center", fontsize=7)
    ax.set_yticks(ys, [t["term"] for t in terms], fontsize=8)
    ax.set_xlabel("observed / model")
    ax.legend(fontsize=7)
    ax.set_title(f"{layout} on this node ({e['timed_on']}): counted terms exact, times "
                 + ("gloo's, not used to calibrate" if e["timed_on"] == "gloo" else "measured"), fontsize=9)
    fig.tight_layout()
    return fig, "; ".join(f"{t['term']} {t['ratio']:.3f}" for t in terms)


def explore_layouts(result) -> Explorer:
    import ipywidgets as w

    names = [e["layout"] for e in result.layouts] or ["-"]
    return Explorer("This node's layouts: each term against the model",
                    {"layout": w.Dropdown(options=names, value=names[0], description="layout")},
                    lambda **kw: draw_layout(result, **kw))


# ------------------------------------------------------------------ step 7
def draw_verify(result, rungs: list[str], steps: int) -> tuple[ReportFigure, str]:
    """Wall-clock time of a training run of ``steps`` steps for each selected rung: warm-up time + steps x its
    measured median step (computed from step 7's measurements)."""
    sel = [r for r in result.rungs if r.step_median_s and r.name in rungs]
    fig = ReportFigure(figsize=(9, 0.5 * max(len(sel), 1) + 1.6))
    ax = fig.subplots()
    if not sel:
        ax.text(0.5, 0.5, "No timed rung selected (or none was timed: see the staircase's reasons)", ha="center",
                va="center", transform=ax.transAxes)
        ax.set_axis_off()
        return fig, "nothing to project"
    hours = [((r.warmup_s or 0) + steps * r.step_median_s) / 3600 for r in sel]
    ys = list(range(len(sel)))[::-1]
    ax.barh(ys, hours, color=[plots.rung_color(r.name) for r in sel])
    for y, h in zip(ys, hours):
        ax.text(h, y, f" {h:.2f} h", va="center", fontsize=8)
    ax.set_yticks(ys)
    ax.set_yticklabels([r.name for r in sel])
    ax.set_xlabel(f"hours for {steps:,} steps on this device (warm-up + steps x measured median step)")
    ax.set_xlim(0, max(hours) * 1.25)
    fig.tight_layout()
    # the original timed in the same rounds as the last rung picked: step 7's second turn has its own
    again = sel[-1].name == "tuned as written"
    base = next((r for r in result.rungs if r.name == ("original again" if again else "original") and r.step_median_s),
                None)
    text = f"{steps:,} steps, computed from the measured medians"
    if base and sel[-1] is not base:
        b = (base.warmup_s or 0) + steps * base.step_median_s
        t = (sel[-1].warmup_s or 0) + steps * sel[-1].step_median_s
        text += f": {sel[-1].name} saves {(b - t) / 3600:.2f} h of the original's {b / 3600:.2f} h"
    return fig, text


def explore_verify(result) -> Explorer:
    import ipywidgets as w

    timed = [r.name for r in result.rungs if r.step_median_s]
    return Explorer("What does the tuned job save on a real training run?", {
        "rungs": _multi(timed, timed, "rungs"),
        "steps": w.IntSlider(100_000, 1_000, 1_000_000, step=1_000, description="training steps",
                             style={"description_width": "initial"})},
        lambda rungs, steps: draw_verify(result, list(rungs), steps))
