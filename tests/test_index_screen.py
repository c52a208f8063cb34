"""The index's first screen (issue 34, item 6): at 1280 x 800 it shows the job's MFU with its peak, where the rest
went (the ledger as one bar) and the first thing to change (the largest recommendation by estimated gain, with its
evidence); recommendations are ordered by estimated gain everywhere; the summary says what the steps table says.

The results are a real default run's (``tests/data/default_run_results.json``), with step 3's figures set to the
issue's case: the optimizer at 23% of the step and a small fusion candidate first in step 3's own advice.
"""

import copy
import json
import os
import platform
from pathlib import Path

import pytest
from markupsafe import Markup

from mfu_lab.core.registry import BY_KEY, STEPS
from mfu_lab.core.store.files import write_json_atomic
from mfu_lab.report import index as ix
from mfu_lab.report import summary as su
from mfu_lab.report.browser import CHROMIUM_ARGS, ensure_chromium
from mfu_lab.report.first_screen import first_screen, ledger_bar
from mfu_lab.report.found import by_gain
from mfu_lab.report.gains import estimate, first_change
from mfu_lab.steps.kernels import step as kernels

DATA = Path(__file__).parent / "data" / "default_run_results.json"
VIEW = {"width": 1280, "height": 800}


def stored() -> dict:
    return copy.deepcopy(json.loads(DATA.read_text())["results"])


def issue_case(results: dict) -> dict:
    """Step 3 as in the issue's run: the optimizer updates one parameter at a time and takes 23% of the step, and
    the first fusion candidate ('add + layer_norm') saves far less; its advice made by step 3's own ``advise``."""
    d = results["kernels"]
    a = d["analysis"]
    a["optimizer"].update(share_of_step=0.23, multi_tensor=False, found=True)
    ln = next(c for c in a["fusion"] if c["pattern"] == "add + layer_norm")
    ln["share_of_step"] = 0.021  # above the fusion threshold, so step 3 advises it (first: "act")
    a["fusion"] = [ln] + [c for c in a["fusion"] if c is not ln]
    d["advice"] = [x.__dict__ for x in kernels.advise(kernels.KernelsResult.from_dict(d))]
    return results


def on_other_peaks(results: dict) -> dict:
    """Step 7 verified a tuned job in bfloat16 against the original in float32: tokens/s 2.12x, MFU 59.1% -> 18.8%,
    each against its own precision's peak (the README's case)."""
    v = results["verify"]
    orig = v["rungs"][0]
    peak, tps = orig["peak_flops_per_s"], 3960.0
    orig.update(status="ok", mfu=0.591, tokens_per_s=tps, step_median_s=0.5, peak_precision="fp32")
    v["rungs"].append({**orig, "name": "precision", "keys": {"dtype": "bfloat16"}, "dtype": "bfloat16",
                       "peak_precision": "bf16", "mfu": 0.188, "tokens_per_s": tps * 2.12, "step_median_s": 0.5 / 2.12,
                       "peak_flops_per_s": peak * 0.591 * 2.12 / 0.188, "speedup": 2.12, "speedup_low": 2.05,
                       "speedup_high": 2.19, "gain": 2.12, "proven": True})
    v["headline"] = {"text": "MFU 59.1% -> 18.8% (measured side by side, speedup 2.12x [2.05, 2.19])",
                     "mfu_before": 0.591, "mfu_after": 0.188, "speedup": 2.12, "speedup_low": 2.05,
                     "speedup_high": 2.19, "proven": True, "carried": ["precision"], "loss_ok": True}
    for name, value in (("mfu", 0.188), ("tokens_per_s", tps * 2.12), ("mfu_before", 0.591), ("mfu_after", 0.188),
                        ("speedup", 2.12)):
        v["metrics"][name]["value"] = value
    return results


def job_folder(root: Path, results: dict) -> Path:
    for key, d in results.items():
        write_json_atomic(root / BY_KEY[key].folder / "result.json", d)
    return root


# -- ordering, without a browser ---------------------------------------------------------------------------------


def test_recommendations_are_ordered_by_estimated_gain_and_the_optimizer_comes_before_a_small_fusion():
    results = issue_case(stored())
    items = su.recommendations(results)
    shares = [a["gain"].share for _, a in items if a["gain"] is not None and a["gain"].kind != "none"]
    assert shares and shares == sorted(shares, reverse=True)  # (no measured change caps a bound here)
    msgs = [a["message"] for _, a in items]
    opt = next(i for i, m in enumerate(msgs) if m.startswith("The optimiser updates one parameter"))
    fuse = next(i for i, m in enumerate(msgs) if m.startswith("Fuse 'add + layer_norm'"))
    assert opt < fuse
    # step 3's own advice put the fusion first; the order here is the gain's
    own = [x["message"] for x in results["kernels"]["advice"]]
    assert own.index(msgs[fuse]) < own.index(msgs[opt])
    folder, first = first_change(items)
    assert folder == "03_kernels" and first["message"] == msgs[opt] and first["gain"].share == pytest.approx(0.23)
    assert "23.0%" in first["gain"].evidence and first["gain"].source == "analytic"  # a bound, never measured
    # no estimate: after those with one; "keep as is": last
    kinds = ["gain" if a["gain"] and a["gain"].kind != "none" and a["gain"].share > 0 else
             "none" if a["gain"] is None else "keep" for _, a in items]
    assert kinds == sorted(kinds, key=["gain", "none", "keep"].index)


def test_a_measured_loader_pick_ranks_above_a_bound_on_the_same_data_wait():
    """Step 1's loader race measured its pick 1.50x side by side (so about 33% of the step); step 3's profile says
    up to 45% of its step waits for data, on the job's own loader. Both are about the data wait: the bound ranks
    no higher than what the measured change gave, and the first thing to change is the measured pick."""
    from mfu_lab.steps.baseline.step import _data_advice

    results = stored()
    b = results["baseline"]
    race = {"adopted": True, "pick": "num_workers=2", "speedup": {"value": 1.5, "low": 1.3, "high": 1.7},
            "method": "interleaved"}
    b["loader_race"] = race
    b["advice"] = [_data_advice(b["job"], 0.5, race).__dict__]
    k = results["kernels"]
    k["analysis"]["breakdown"]["waiting_for_data"] = 0.45
    k["advice"] = [{"severity": "act", "message": "The device waits for the next batch 45% of the step.",
                    "because": ""}] + list(k["advice"])
    items = su.recommendations(results)
    msgs = [a["message"] for _, a in items]
    pick = next(i for i, m in enumerate(msgs) if m.startswith("The device waits on data: load with num_workers=2"))
    bound = next(i for i, m in enumerate(msgs) if m.startswith("The device waits for the next batch"))
    assert pick < bound
    g = items[pick][1]["gain"]
    assert g.kind == "estimate" and g.source == "measured" and g.share == pytest.approx(1 - 1 / 1.5)
    assert "1.50x" in g.evidence and "loader race" in g.evidence
    assert items[bound][1]["gain"].text == "up to 45.0% of the step"  # its own figure is still shown as it is
    assert first_change(items)[1]["message"] == msgs[pick]


def test_each_estimate_comes_from_the_result():
    results = issue_case(stored())
    k = results["kernels"]
    fuse = next(a for a in k["advice"] if a["message"].startswith("Fuse 'add + layer_norm'"))
    g = estimate("kernels", k, fuse)
    c = k["analysis"]["fusion"][0]
    assert g.kind == "estimate" and g.source == "analytic"
    real = k["metrics"]["step_time_median_s"]["value"]  # the step without the profiler, not the profiled window's
    assert g.share == pytest.approx(c["est_saving_per_step_s"] / real) and "step without the profiler" in g.evidence
    comp = results["compile"]
    keep = estimate("compile", comp, {"message": comp["recommendation"]["text"]})
    assert keep.kind == "none" and keep.share == 0.0  # step 4 said stay eager: nothing to gain
    assert estimate("placement", results["placement"], results["placement"]["advice"][0]) is None
    assert estimate("kernels", {"analysis": None}, fuse) is None  # an older shape: no estimate, no error


def test_a_steps_report_lists_its_advice_by_gain_too():
    results = issue_case(stored())
    k = results["kernels"]
    acts = [a for a in k["advice"] if a["severity"] == "act"]
    listed = by_gain("kernels", k, acts)
    assert listed[0]["message"].startswith("The optimiser updates one parameter")
    assert listed[0]["gain"] == "up to 23.0% of the step"


def test_the_first_screen_has_the_mfu_its_peak_the_ledger_bar_and_the_first_change():
    results = issue_case(stored())
    top = first_screen(results, su.recommendations(results), {})
    m = results["baseline"]["metrics"]
    assert top["mfu"]["mfu"]["value"] == m["mfu"]["value"]
    assert top["mfu"]["peak"]["value"] == m["peak_flops_per_s"]["value"]
    assert top["mfu"]["shared"] == "" and "quiet" in top["mfu"]["quiet"]
    bar = top["bar"]
    assert [s["name"] for s in bar["segments"]] == [i["name"] for i in results["baseline"]["ledger"]["items"]]
    assert sum(s["width"] for s in bar["segments"]) == pytest.approx(100.0)
    assert bar["losses"][0]["name"] == "efficiency"
    assert top["first"]["message"].startswith("The optimiser updates one parameter")
    # a shared machine is said on the first screen
    c = results["baseline"]["timings"]["contention"]
    c.update(shared=True, other_cores=1.57)
    assert "1.57 of 2 cores" in first_screen(results, [], {})["mfu"]["shared"]
    assert ledger_bar(None) is None and first_screen({}, [], {})["mfu"] is None


def test_a_tuned_job_on_another_peak_reads_as_the_speedup_it_is():
    results = on_other_peaks(stored())
    line = su.headline(results)[0]
    assert line.startswith("Verified: tokens/s 2.12x (speedup 2.12x [2.05, 2.19], measured side by side)")
    assert "MFU 18.8% against bf16's peak, the original's 59.1% against fp32's" in line
    assert "MFU 59.1% -> 18.8%" not in line
    # the MFU chart's bars: step 7's stands on bf16's peak, said with its tokens/s against step 1's
    note = su.peaks_note(results)
    assert "so a lower bar is not a slower job" in note and "MFU 18.8% against bfloat16's peak" in note
    base = results["baseline"]["metrics"]["tokens_per_s"]["value"]
    assert f"tokens/s {3960 * 2.12 / base:.2f}x step 1's" in note
    assert su.peaks_note(stored()) == ""  # one peak: nothing to say
    assert "18.8% (07, against bfloat16's peak, not float32's)" in " ".join(su.headline(results))
    same = stored()
    same["verify"]["headline"] = {"text": "MFU 50.0% -> 70.0%", "speedup": 1.4, "carried": []}
    assert su.headline(same)[0].startswith("Verified: MFU 50.0% -> 70.0%")  # one peak: step 7's own words


def test_the_summary_says_what_the_steps_table_says(tmp_path):
    results = stored()
    del results["attention_comm"], results["kernels"]
    root = job_folder(tmp_path / "job", results)
    running = root / BY_KEY["attention_comm"].folder
    write_json_atomic(running / "running.json", {"step": "attention_comm", "run": "r", "pid": os.getpid(),
                                                 "host": platform.node(), "started_at": "now"})
    write_json_atomic(root / BY_KEY["kernels"].folder / "failure.json", {"step": "kernels", "status": "interrupted",
                                                                         "error": "Ctrl-C"})
    rows = [ix._step_row(root, info, results.get(info.key)) for info in STEPS]
    states = {info.key: r["status"] for info, r in zip(STEPS, rows, strict=True)}
    assert states["attention_comm"] == "running" and states["kernels"] == "interrupted"
    lines = su.headline(results, states)
    assert "Running now: 02_attention_and_comm" in " ".join(lines)
    assert "Interrupted: 03_kernels" in " ".join(lines)
    assert not any(x.startswith("Not run yet") for x in lines)  # every step is in the table as something else


# -- in a browser ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def chromium():
    pytest.importorskip("playwright", reason="playwright is not installed: pip install -e '.[test]'")
    path, why = ensure_chromium(install=False)
    if not path:
        pytest.skip(f"headless Chromium unavailable, browser check skipped: {why}")
    return path


def test_the_first_screen_at_1280_by_800_holds_the_mfu_the_ledger_bar_and_the_first_change(tmp_path, chromium,
                                                                                             monkeypatch):
    from playwright.sync_api import sync_playwright

    results = on_other_peaks(issue_case(stored()))
    root = job_folder(tmp_path / "default", results)
    # Each step's detailed section (its plots: most of the page's time) stands in as a tall block: the first
    # screen does not depend on it.
    monkeypatch.setattr(ix, "_section", lambda key, d: Markup(f'<section style="height:900px">{key}</section>'))
    page_path = ix.write_index(root)
    items = su.recommendations(results)
    first = first_change(items)[1]
    shots = Path(os.environ.get("MFU_LAB_SCREENSHOTS") or tmp_path)
    shots.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=chromium, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page(viewport=VIEW)
            page.route("**/*", lambda r: r.continue_() if r.request.url.startswith(("file:", "data:")) else r.abort())
            page.goto(page_path.as_uri(), wait_until="load")
            page.screenshot(path=str(shots / "index_first_screen.png"))
            boxes = {sel: page.locator(sel).bounding_box() for sel in ("#fs-mfu", "#fs-ledger-bar", "#fs-first")}
            texts = {sel: page.locator(sel).inner_text() for sel in boxes}
            segs = page.locator("#fs-ledger-bar .fs-seg").count()
            order = page.locator("#recommendations + p + ol > li").all_inner_texts()
        finally:
            browser.close()
    for sel, box in boxes.items():
        assert box and box["y"] >= 0 and box["y"] + box["height"] <= VIEW["height"], (sel, box)
        assert box["x"] >= 0 and box["x"] + box["width"] <= VIEW["width"], (sel, box)
    mfu = results["baseline"]["metrics"]["mfu"]["value"]
    assert f"{mfu:.1%}" in texts["#fs-mfu"]
    assert segs == sum(1 for i in results["baseline"]["ledger"]["items"] if i["fraction"] > 0)
    assert first["message"][:60] in " ".join(texts["#fs-first"].split())
    assert "up to 23.0% of the step" in texts["#fs-first"] and "step 3" in texts["#fs-first"]
    # the full list below, in the same order: the largest estimated gain first
    assert len(order) == len(items)
    listed = [" ".join(t.split()) for t in order]
    for text, (_, a) in zip(listed, items, strict=True):
        assert " ".join(a["message"].split())[:50] in text


def test_a_steps_report_on_another_peak_says_so_instead_of_an_mfu_ratio(tmp_path):
    from mfu_lab.report.found import found_html

    results = on_other_peaks(stored())
    root = job_folder(tmp_path / "job", {k: results[k] for k in ("baseline", "verify")})
    nb = root / "07_verify" / "07_verify.ipynb"
    nb.write_text("{}")
    os.utime(root / "07_verify" / "result.json", (1, 1))  # the result before its notebook, as a run leaves them
    html = str(found_html(nb))
    assert "The two MFUs stand on different peaks (bfloat16&#x27;s here, float32&#x27;s in step 1)" in html
    base = results["baseline"]["metrics"]["tokens_per_s"]["value"]
    assert f"tokens/s here are {3960 * 2.12 / base:.2f}x step 1" in html
    assert "x step 1&#x27;s)." not in html  # no MFU ratio between two peaks


def test_step_7s_card_says_its_headline_once_when_the_adopt_advice_says_it_whole(tmp_path):
    """Step 7's "Adopt the tuned job (tuned.yaml): <headline>" already holds the headline's text: the card lists it
    once, with its reason, not the headline again as a bullet of its own."""
    import re

    from mfu_lab.report.found import found_html

    results = on_other_peaks(stored())
    head = results["verify"]["headline"]["text"]
    results["verify"]["advice"] = [{"severity": "act", "message": f"Adopt the tuned job (tuned.yaml): {head}",
                                    "because": "changes carried the gain: precision"}]
    root = job_folder(tmp_path / "job", {k: results[k] for k in ("baseline", "verify")})
    nb = root / "07_verify" / "07_verify.ipynb"
    nb.write_text("{}")
    card = str(found_html(nb))
    bullets = re.findall(r"<li>(.*?)</li>", card.split("<b>Recommendation</b>")[1], re.S)
    assert len(bullets) == 1 and "Adopt the tuned job" in bullets[0] and "carried the gain" in bullets[0]
    assert card.count("speedup 2.12x [2.05, 2.19]") == 1


def test_the_index_says_what_is_on_the_page_and_every_link_lands(tmp_path):
    """A 50,000-pixel page opens with a line of links: each to a heading that exists, one per step in detail."""
    import re

    results = stored()
    page = ix.write_index(job_folder(tmp_path / "default", results)).read_text()
    toc = re.search(r'<p class="toc">(.*?)</p>', page, re.S).group(1)
    targets = re.findall(r'href="#([\w-]+)"', toc)
    ids = set(re.findall(r'id="([\w-]+)"', page))
    assert targets and [t for t in targets if t not in ids] == []
    steps = [t for t in targets if t.startswith("step-")]
    assert steps == [f"step-{BY_KEY[k].number}" for k in ix.SECTIONS if k in results]
    assert page.index('<p class="toc">') < page.index('id="summary"')
