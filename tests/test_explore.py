"""The notebooks' optional explorers, the what-if model behind step 6's sliders, and progress with time left."""

import importlib
import io

import nbformat
import pytest

from mfu_lab import explore as ex
from mfu_lab.analysis.placement import model as pl
from mfu_lab.analysis.placement.cluster_files import load_cluster
from mfu_lab.core.job.schema import load_job
from mfu_lab.core.process import progress as pg
from mfu_lab.core.registry import BY_KEY
from mfu_lab.core.store.files import read_json

from .conftest import ROOT, TINY

CLASSES = {"baseline": ("mfu_lab.steps.baseline.step", "BaselineResult"),
           "attention_comm": ("mfu_lab.steps.attention_comm.step", "AttentionCommResult"),
           "kernels": ("mfu_lab.steps.kernels.step", "KernelsResult"),
           "compile": ("mfu_lab.steps.compile.step", "CompileResult"),
           "fp8": ("mfu_lab.steps.fp8.step", "Fp8Result"),
           "placement": ("mfu_lab.steps.placement.step", "PlacementResult")}


def test_time_left_is_the_mean_time_per_item_times_the_items_left():
    assert pg.eta_text(1, 4, 10.0) == "10.0 s, about 30 s left"
    assert pg.eta_text(3, 4, 600.0) == "600.0 s, about 200 s left".replace("200 s", "3 min")
    assert pg.eta_text(4, 4, 12.0) == "12.0 s"
    assert "unknown" in pg.eta_text(0, 4, 1.0)
    eta = pg.Eta("modes", 3, bar=False)
    assert eta.tag(0) == ""
    assert eta.tag(1).startswith(" (1/3 done, ") and "left)" in eta.tag(1)


def test_printer_prints_each_quarter_with_time_left():
    out = io.StringIO()
    p = pg.printer("steps", stream=out, bar=False)
    for i in range(1, 9):
        p(i, 8, float(i))
    lines = out.getvalue().splitlines()
    assert lines[0] == "steps: 1/8 (1.0 s, about 7 s left)"
    assert lines[-1] == "steps: 8/8 (8.0 s)"
    assert len(lines) == 5  # 1/8, then at 2/8, 4/8, 6/8 and the end


def test_live_bar_html_is_a_progress_element_with_the_same_text():
    h = pg.LiveBar("DDP <configs>", enabled=False).html(3, 12, 20.0)
    assert '<progress value="3" max="12"' in h and "DDP &lt;configs&gt;: 3/12 (20.0 s, about 60 s left)" in h
    shown = []
    eta = pg.Eta("FP8 policy trials", 4, bar=False)
    eta.live.update = lambda done, total, elapsed, note="": shown.append(eta.live.html(done, total, 0.0, note))
    eta.finish(["budget: 3 s left", "budget: 2 s left", "budget: 1 s left"])
    assert "FP8 policy trials: 4/4 (0.0 s; 3 of them not run: budget)" in shown[-1]  # not run is not 'done' work
    eta.finish(["budget: 3 s left", "reduce-overhead needs CUDA"])
    assert shown[-1].endswith("4/4 (0.0 s; 2 of them not run: see the table)</div>")
    eta.finish()
    assert shown[-1].endswith("4/4 (0.0 s)</div>")


def test_a_silent_neighbour_leaves_the_uplink_to_this_job():
    import dataclasses

    # 8:1 uplinks: a leaf's 4 nodes x 400 GB/s / 8 = 200 GB/s, less than 9 groups x 50 GB/s ask
    c = dataclasses.replace(load_cluster(ROOT / "parameters/clusters/example_h100.yaml"), oversubscription=8.0)
    g = c.gpus_per_node
    per_switch = len(next(iter(c.switches.values()))) * g
    ours = [[0 * g + per_switch, per_switch * 2]]  # one GPU under leaf 1 and one under leaf 2: crosses the spine
    # a neighbour's rails across leaves 1 and 2 as well, 8 groups of 2
    nb = [[per_switch + j, 2 * per_switch + j] for j in range(1, g)]
    loud = pl._group_links(c, ours, nb, 1.0)[0].busbw_gbps
    quiet = pl._group_links(c, ours, nb, 0.0)[0].busbw_gbps
    half = pl._group_links(c, ours, nb, 0.5)[0].busbw_gbps
    assert quiet >= half >= loud and quiet > loud
    assert pl._group_links(c, ours, [], 1.0)[0].busbw_gbps == quiet


def test_occupied_gpus_communicate_along_rails():
    c = load_cluster(ROOT / "parameters/clusters/example_h100.yaml")
    import dataclasses

    g = c.gpus_per_node
    assert pl.occupied_groups(dataclasses.replace(c, occupied_gpus=4)) == []  # one node: nothing crosses it
    groups = pl.occupied_groups(dataclasses.replace(c, occupied_gpus=2 * g))
    assert len(groups) == g and groups[0] == [0, g]


# ------------------------------------------------------------------ on a real run's results
@pytest.fixture(scope="module")
def results(full_run):
    p, job_root = full_run
    assert p.returncode == 0, p.stderr[-3000:]
    out = {}
    for key, (mod, cls) in CLASSES.items():
        d = read_json(job_root / BY_KEY[key].folder / "result.json")
        out[key] = getattr(importlib.import_module(mod), cls).from_dict(d)
    return out, job_root


@pytest.mark.e2e
def test_baseline_explorer_recomputes_mfu_by_step_1s_formula(results):
    r = results[0]["baseline"]
    e = ex.explore_baseline(r)
    wall = r.timings.measured("wall_s")
    flops, peak = r.metrics["model_flops_per_step"].value, r.metrics["peak_flops_per_s"].value
    assert f"MFU {flops * len(wall) / (peak * sum(wall)):.1%}" in e.text.value
    e.controls["discard"].value = 1  # moving a control redraws
    assert e.redraws == 2
    kept = wall[1:]
    assert f"{len(kept)} steps kept" in e.text.value
    assert f"MFU {flops * len(kept) / (peak * sum(kept)):.1%}" in e.text.value


@pytest.mark.e2e
def test_selections_redraw_from_the_measured_rows(results):
    res = results[0]
    r = res["attention_comm"]
    ok = [x for x in r.attention if x.status == "ok" and x.step_median_s]
    _, text = ex.draw_attention_comm(r, [ok[0].name], [])
    assert f"{ok[0].name} at {ok[0].step_median_s * 1e3:.1f} ms" in text
    k = res["kernels"]
    cat = k.analysis.top[0].category
    _, text = ex.draw_kernels(k, 3, [cat])
    rows = [x for x in k.analysis.top if x.category == cat][:3]
    assert f"{len(rows)} " in text and f"{sum(x.share for x in rows):.1%}" in text
    c = res["compile"]
    t = next(x for x in c.trials if x.status == "ok")
    _, text = ex.draw_compile(c, [t.mode], 1000, False)
    saved = 1000 * (c.eager.step_median_s - t.step_median_s) - t.compile_cold_s
    assert f"{abs(saved):.1f} s over 1,000 steps" in text
    f = res["fp8"]
    name = next(x.name for x in f.trials if x.status != "reference" and x.loss)
    _, text = ex.draw_fp8(f, [name])
    assert text.startswith(name) and "emulated" in text
    for key in ("baseline", "attention_comm", "kernels", "compile", "fp8"):
        bundle = getattr(ex, f"explore_{key}")(res[key])._repr_mimebundle_()
        assert "application/vnd.jupyter.widget-view+json" in bundle
        assert ex.FALLBACK_NOTE in bundle["text/html"] and "data:image/png;base64" in bundle["text/html"]


@pytest.mark.e2e
def test_what_if_with_the_files_values_reproduces_the_step_and_moves_with_the_sliders(results):
    res, job_root = results
    r = res["placement"]
    job = load_job(TINY, {"out_dir": str(job_root.parent)})
    wi = ex.what_if(job, r, gpus=len(r.chosen["gpus"]))
    stored = {s["strategy"]: s["step_s"] for s in r.strategies if s.get("status") == "ok"}
    assert {x["strategy"]: x["step_s"] for x in wi.rows if x["status"] == "ok"} == pytest.approx(stored, rel=1e-12)
    assert "[modelled]" in wi.text
    assert "no layout of 7 GPUs" in ex.what_if(job, r, gpus=7, tp=2).text
    e = ex.explore_placement(job, r)
    e.controls["oversubscription"].value = 8.0
    assert e.redraws == 2 and "oversubscription 8:1" in e.text.value
    # issue 21: no size the step found impossible is offered, and a control that moves nothing says why
    impossible = {s["gpus_n"] for s in r.sweep if s.get("status") != "ok"}
    assert impossible and not impossible & set(e.controls["gpus"].options)
    moved = {o: [x["step_s"] for x in ex.what_if(job, r, gpus=len(r.chosen["gpus"]), oversubscription=o).rows
                 if x["status"] == "ok"] for o in (1.0, 8.0)}
    if moved[1.0] == moved[8.0]:  # the uplinks do not bind at this size: the caption must say so
        assert "the uplinks are not the bottleneck" in e.text.value
    fig, text = ex.draw_placement(job, r, gpus=7, tp=2)
    assert "no layout of 7 GPUs" in text and fig.axes[0].texts  # said in the figure, not an empty plot


@pytest.mark.e2e
def test_notebooks_keep_the_static_fallback_and_the_final_progress_bar(results):
    _, job_root = results
    for info in BY_KEY.values():
        html = (job_root / info.folder / "report.html").read_text()
        assert ex.FALLBACK_NOTE in html, info.folder
        assert "application/vnd.jupyter.widget-view+json" not in html, info.folder
    nb = nbformat.read(job_root / "01_baseline" / "01_baseline.ipynb", 4)
    bars = [o["data"]["text/html"] for c in nb.cells for o in c.get("outputs", [])
            if "mfu-progress" in o.get("data", {}).get("text/html", "")]
    assert bars, "no live progress bar in the executed notebook"
    import re

    job = load_job(TINY)
    total = job.steps + job.warmup_steps
    # papermill applied the bar's updates to the saved notebook: it shows the end, not 0%
    assert any(re.search(rf'value="{total}" max="{total}"', b) for b in bars), bars
