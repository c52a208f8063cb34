"""Exported reports, results first (issue 21): small notebooks built with nbformat, exported with export_html."""

import json
import os
import re

import nbformat
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook, new_output

from mfu_lab.report.export import export_html
from mfu_lab.report.found import job_differences

from .test_e2e import assert_offline

PNG = ("iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAYAAAAfFcSJAAAADUlEQVR42mNk+M9QDwADhgGAWjR9awAAAABJRU5ErkJggg==")
JOB_SRC = "job = from_namespace(globals(), _names_before_parameters)\njob"
STEP2 = "02_attention_and_comm"


def _job(**kw):
    return {"job_name": "tiny", "out_dir": "/tmp/a", "device": "cpu", "micro_batch": 4, "seq_len": 32, "steps": 4,
            **kw}


def _result(mfu, **job):
    return {"result_format": 1, "step": "attention_comm", "status": "ok", "job": _job(**job),
            "environment": {"device_name": "cpu0", "created_at": "2026-01-01T00:00:00+00:00"},
            "metrics": {"mfu": {"value": mfu, "unit": "fraction", "source": "measured", "note": "how MFU was timed"},
                        "attention_speedup": {"value": 1.25, "unit": "x", "source": "measured", "note": ""},
                        "step_time_median_s": {"value": 0.1, "unit": "s", "source": "measured", "note": ""},
                        "step_time_p10_s": {"value": 0.09, "unit": "s", "source": "measured", "note": ""},
                        "step_time_p90_s": {"value": 0.11, "unit": "s", "source": "measured", "note": ""}},
            "recommendation": {"attention_text": "Switch to FUSED-ATTENTION-MARK.", "comm_text": ""},
            "advice": [{"severity": "act", "message": "ACT-MARK: bigger buckets", "because": "exposed 40%"},
                       {"severity": "look", "message": "LOOK-MARK", "because": ""}]}


def _notebook(job_cell_error=False):
    table = "<table><tr><td><code>job_name</code></td><td>'PARAMCHECK'</td></tr></table>"
    job_out = (new_output("error", ename="ValueError", evalue="unknown parameter 'micro_bacth'",
                          traceback=["ValueError: unknown parameter 'micro_bacth'"]) if job_cell_error else
               new_output("execute_result", data={"text/html": table, "text/plain": "Job(...)"}, execution_count=3))
    cells = [
        new_markdown_cell("<span style=\"color:red\">An Exception was encountered at 'In [7]'.</span>",
                          metadata={"tags": ["papermill-error-cell-tag"]}),
        new_markdown_cell("# Step 2 · a test notebook\n\nNARRATIVE-MARK."),
        new_code_cell("from mfu_lab import from_namespace\nIMPORT_CODE_MARK = 1"),
        new_code_cell('# Job parameters\njob_name = "tiny"\nmicro_batch = 4', metadata={"tags": ["parameters"]}),
        new_code_cell('# Parameters\njob_name = "PARAMCHECK"\nmicro_batch = 8',
                      metadata={"tags": ["injected-parameters"]}),
        new_markdown_cell("## The job\n\nThe parameters above are checked."),
        new_code_cell(JOB_SRC, outputs=[job_out]),
        new_markdown_cell("## Measure"),
        new_code_cell("result = run(job)  # RUN-CODE-MARK", outputs=[
            new_output("stream", name="stdout", text="PROGRESS-MARK configuration 1/48\n"),
            new_output("stream", name="stderr", text="STDERR-MARK warning\n"),
            new_output("display_data", data={"text/html": "<p>RESULT-TABLE-MARK break-even</p>",
                                             "text/plain": "table"})]),
        new_code_cell("plots.step_times(result)  # PLOT-CODE-MARK", outputs=[
            new_output("execute_result", data={"image/png": PNG, "text/plain": "<Figure>"}, execution_count=5)]),
        new_code_cell("raise RuntimeError('boom')  # RAISE-CODE-MARK", outputs=[
            new_output("error", ename="RuntimeError", evalue="BOOM-MARK", traceback=["RuntimeError: BOOM-MARK"])]),
    ]
    nb = new_notebook(cells=cells)
    nb.metadata["papermill"] = {"parameters": {"job_name": "PARAMCHECK", "micro_batch": 8}}
    return nb


def _export(tmp_path, result=None, base=None, step=STEP2, nb=None, raw_result=None):
    folder = tmp_path / "tiny" / step
    folder.mkdir(parents=True)
    if base is not None:
        (tmp_path / "tiny" / "01_baseline").mkdir()
        (tmp_path / "tiny" / "01_baseline" / "result.json").write_text(json.dumps(base))
    if raw_result is not None:
        (folder / "result.json").write_text(raw_result)
    elif result is not None:
        (folder / "result.json").write_text(json.dumps(result))
    notebook = folder / f"{step}.ipynb"
    nbformat.write(nb or _notebook(), str(notebook))
    return export_html(notebook, folder / "report.html").read_text()


def _found(html):
    m = re.search(r'<section class="mfu mfu-found".*?</section>', html, re.S)
    assert m, "no found block"
    return m.group(0)


def _inside_closed_details(html, needle, cls):
    """Whether every occurrence of ``needle`` sits inside a <details class=cls> that is closed (no ``open``)."""
    spots = [m.start() for m in re.finditer(re.escape(needle), html)]
    assert spots, needle
    for i in spots:
        stack = []  # the <details> tags open at i, outermost first
        for m in re.finditer(r"<details[^>]*>|</details>", html[:i]):
            stack.pop() if m.group(0) == "</details>" else stack.append(m.group(0))
        assert any(f'class="{cls}"' in tag and " open" not in tag for tag in stack), (needle, stack)
    return True


def test_a_report_opens_with_what_the_step_found_and_keeps_every_result(tmp_path):
    html = _export(tmp_path, _result(0.013), base=_result(0.010, micro_batch=8, job_name="other", out_dir="/x",
                                                            steps=40))
    body = html[html.index("<body"):]
    found = _found(body)
    # the found block first, before any output and the notebook's own narrative
    assert body.index("What this step found") < body.index("jp-OutputArea") < body.index("RESULT-TABLE-MARK")
    assert body.index("What this step found") < body.index("NARRATIVE-MARK")
    # MFU with its unit and label, its change against step 1, the recommendation, the parameter that differs
    assert "1.3%" in found and "src-measured" in found and "MFU" in found and "1.25x" in found
    assert "1.30x step 1" in found and "1.0%" in found
    assert "FUSED-ATTENTION-MARK" in found and "ACT-MARK" in found and "LOOK-MARK" not in found
    assert "micro_batch 4 (step 1: 8)" in found and "not like for like" in found
    text = re.sub(r"<[^>]+>", "", found)  # sentences stay apart once the template's tags are gone
    assert not re.search(r"[a-z]\.[A-Z]", text), re.search(r".{30}[a-z]\.[A-Z].{30}", text)
    same = re.sub(r"<[^>]+>", "", _found(_export(tmp_path / "same", _result(0.013), base=_result(0.010))))
    assert "Both measured with the same workload parameters" in same and not re.search(r"[a-z]\.[A-Z]", same)
    for bookkeeping in ("job_name", "out_dir", "steps"):  # not workload parameters: not named
        assert bookkeeping not in found.split("Measured with other job parameters")[1].split(".")[0]
    # code: hidden by default, one click away
    for code in ("IMPORT_CODE_MARK", "RUN-CODE-MARK", "PLOT-CODE-MARK", "RAISE-CODE-MARK"):
        assert _inside_closed_details(body, code, "mfu-code")
    assert "show code" in body
    # streams gone; error, papermill's banner, markdown, HTML and image outputs kept
    assert "PROGRESS-MARK" not in html and "STDERR-MARK" not in html
    assert "BOOM-MARK" in html and "RuntimeError" in html and "An Exception was encountered" in html
    assert "NARRATIVE-MARK" in html and "RESULT-TABLE-MARK break-even" in html and "Measure" in html
    assert f"data:image/png;base64,{PNG}" in html
    assert_offline(html)
    assert "<script src=" not in html and "@import" not in html and "url(http" not in html


def test_the_job_parameters_appear_once_in_a_closed_block_at_the_end(tmp_path):
    html = _export(tmp_path, _result(0.013), base=_result(0.010))
    body = html[html.index("<body"):]
    assert body.count("PARAMCHECK") == 1  # the job table only: not the injected cell, not papermill's metadata
    assert "micro_batch = 4" not in html and "# Parameters" not in html  # the parameters cells are gone
    assert body.count("<summary>Job parameters</summary>") == 1
    assert _inside_closed_details(body, "PARAMCHECK", "mfu-job")
    job_block = body.index('<details class="mfu-job"')
    assert job_block > body.index("BOOM-MARK") > body.index("RESULT-TABLE-MARK")  # after every result
    assert body.index("The parameters above are checked") > job_block  # the job's own heading went with it
    assert "same workload parameters" in _found(body)


def test_a_failing_job_cell_keeps_its_error_in_place_and_the_parameters_come_from_papermill(tmp_path):
    html = _export(tmp_path, _result(0.013), base=_result(0.010), nb=_notebook(job_cell_error=True))
    body = html[html.index("<body"):]
    assert "unknown parameter" in body and body.index("unknown parameter") < body.index("RESULT-TABLE-MARK")
    assert body.count("PARAMCHECK") == 1 and _inside_closed_details(body, "PARAMCHECK", "mfu-job")
    assert "papermill injected" in body


def test_without_a_result_the_report_says_so_in_one_sentence(tmp_path):
    html = _export(tmp_path)
    found = _found(html)
    assert "There is no result.json beside this notebook" in found and "<table>" not in found
    assert "BOOM-MARK" in html and "An Exception was encountered" in html
    assert_offline(html)


def test_a_failed_run_does_not_show_the_earlier_result_as_its_own(tmp_path):
    folder = tmp_path / "tiny" / STEP2
    folder.mkdir(parents=True)
    (folder / "failure.json").write_text(json.dumps({"step": "attention_comm", "status": "failed",
                                                     "error": "RuntimeError: BOOM-MARK"}))
    (folder / "result.json").write_text(json.dumps(_result(0.5)))
    nb = folder / f"{STEP2}.ipynb"
    nbformat.write(_notebook(), str(nb))
    found = _found(export_html(nb, folder / "report.html").read_text())
    assert "did not finish (failed: RuntimeError: BOOM-MARK" in found and "earlier run's" in found
    assert "50.0%" not in found


def test_a_finished_run_exported_under_its_own_running_mark_shows_its_figures(tmp_path):
    """Publishing exports the report from the staged result while the step's running mark is still in place (it
    goes once the set is in place): that report is the finished run's, not "did not finish"."""
    from mfu_lab.core.store.runstate import mark_running

    folder = tmp_path / "tiny" / STEP2
    folder.mkdir(parents=True)
    mark_running(folder, "attention_comm", "run-1")  # this process: alive, as the runner is while it publishes
    staged = folder / "result.json.staged"
    staged.write_text(json.dumps(_result(0.5)))
    nb = folder / f"{STEP2}.ipynb"
    nbformat.write(_notebook(), str(nb))
    found = _found(export_html(nb, folder / "report.html", staged).read_text())
    assert "did not finish" not in found and "50.0%" in found
    without = _found(export_html(nb, folder / "report.html").read_text())  # no staged result: still running
    assert "did not finish (running" in without


def test_a_result_of_an_odd_shape_never_stops_the_export(tmp_path):
    odd = {"metrics": [1, 2], "advice": "none", "job": None, "recommendation": "text",
           "environment": {"created_at": 3}}
    html = _export(tmp_path, odd, base={"metrics": {"mfu": "high"}, "job": [1]})
    assert "What this step found" in html and "BOOM-MARK" in html
    for raw in ("{not json", "[1, 2]"):
        html = _export(tmp_path / raw[:2], raw_result=raw)
        assert "cannot be read" in _found(html)
    weird = _result(0.01)
    weird["metrics"]["mfu"] = {"value": [0.1], "unit": None}
    weird["advice"] = [None, {"severity": "act", "message": None}]
    assert "What this step found" in _export(tmp_path / "w", weird, base=weird)


def test_a_result_newer_than_the_notebook_is_not_shown_as_its_figures(tmp_path):
    _export(tmp_path, _result(0.013))
    folder = tmp_path / "tiny" / STEP2
    old = (folder / f"{STEP2}.ipynb").stat().st_mtime - 60
    os.utime(folder / f"{STEP2}.ipynb", (old, old))
    found = _found(export_html(folder / f"{STEP2}.ipynb", folder / "report.html").read_text())
    assert "newer than it" in found and "1.3%" not in found


def test_step_1_is_its_own_reference_and_the_monitor_has_no_found_block(tmp_path):
    r = _result(0.02) | {"step": "baseline", "advice": [{"severity": "look", "message": "SHARED-MARK", "because": ""}]}
    found = _found(_export(tmp_path, r, step="01_baseline"))
    assert "This is step 1" in found and "2.0%" in found
    assert "Nothing to act on from this step alone; to look at:" in found and "SHARED-MARK" in found
    monitor = tmp_path / "mon"
    monitor.mkdir()
    nbformat.write(_notebook(), str(monitor / "00_monitor.ipynb"))
    html = export_html(monitor / "00_monitor.ipynb", monitor / "report.html").read_text()
    assert '<section class="mfu mfu-found"' not in html and "BOOM-MARK" in html and "PROGRESS-MARK" not in html


def test_which_job_parameters_count_as_a_different_workload():
    a, b = _job(), _job(micro_batch=8, out_dir="/b", job_name="x", steps=99, comm_steps=7)
    assert job_differences(a, b) == ["micro_batch 4 (step 1: 8)"]
    assert job_differences(a, a, {"device_name": "H100"}, {"device_name": "cpu"}) == ["device 'H100' (step 1: 'cpu')"]
    assert job_differences(None, [1]) == []


def test_anything_unexpected_while_summarising_gives_one_sentence(tmp_path, monkeypatch):
    from mfu_lab.report import found

    def broken(*a):
        raise KeyError("metrics")

    monkeypatch.setattr(found, "_context", broken)
    html = _export(tmp_path, _result(0.013))
    assert "could not be summarised (KeyError" in _found(html) and "BOOM-MARK" in html


def test_a_figure_gives_its_titles_as_the_images_alternative_text(tmp_path):
    """A ReportFigure shown by a cell carries its titles as the output's metadata (IPython's display formatter, as
    the kernel runs it), and the report writes them as the image's alt, not nbconvert's 'No description'."""
    import base64

    from IPython.core.formatters import DisplayFormatter

    from mfu_lab.plots.base import ReportFigure

    fig = ReportFigure(figsize=(3, 2))
    fig.suptitle("ALT-MARK <&>")
    fig.subplots(1, 2)[1].set_title("Distribution")
    data, md = DisplayFormatter().format(fig)
    assert md == {"image/png": {"alt": "Plot: ALT-MARK <&>; Distribution"}}
    nb = _notebook()
    nb.cells.append(new_code_cell("fig", outputs=[new_output(
        "execute_result", data={"image/png": base64.b64encode(data["image/png"]).decode(), "text/plain": "<Figure>"},
        metadata=md, execution_count=6)]))
    html = _export(tmp_path, nb=nb)
    assert 'alt="Plot: ALT-MARK &lt;&amp;&gt;; Distribution"' in html
    assert len(re.findall(r"<img ", html)) == 2 and html.count(" alt=") == 2  # the other image: nbconvert's default
