"""Issue 21: what the reader meets: impossible figures flagged, empty outputs explained."""

from __future__ import annotations

from types import SimpleNamespace

from mfu_lab.report.format import flagged, impossible
from mfu_lab.report.templating import macros


def test_a_share_outside_0_to_100_percent_is_flagged_and_explained():
    assert impossible("attention_share", 1.279, "fraction").startswith("127.9% cannot be a share of a whole")
    assert impossible("mfu", -0.01, "fraction")
    assert impossible("attention_share", 0.42, "fraction") == ""
    assert impossible("profiler_overhead", 1.5, "fraction") == ""  # a relative change, not a share
    assert impossible("flops_disagreement", -0.3, "fraction") == ""
    html = str(flagged("attention_share", 1.279, "fraction"))
    assert "127.9%" in html and "⚠" in html and "not used for any recommendation" in html
    assert "⚠" not in str(flagged("mfu", 0.5, "fraction"))


def test_the_metrics_table_and_the_cards_carry_the_flag():
    metrics = {"attention_share": {"value": 1.279, "unit": "fraction", "source": "measured", "note": ""},
               "mfu": {"value": 0.4, "unit": "fraction", "source": "measured", "note": ""}}
    table = str(macros("parts.html.j2").metrics_table(metrics))
    assert table.count("⚠") == 1 and "cannot be a share" in table
    cards = str(macros("parts.html.j2").cards(metrics, [("share", "attention_share"), ("MFU", "mfu")]))
    assert cards.count("⚠") == 1


def test_a_plot_that_cannot_be_drawn_says_why_in_one_sentence():
    from types import SimpleNamespace

    from mfu_lab import plots
    from mfu_lab.analysis.placement.check import Check

    check = plots.model_check(SimpleNamespace(check=Check(False, "step 2 has not run for this job")))
    assert not check and "step 2 has not run" in check._repr_markdown_()
    stairs = plots.staircase(SimpleNamespace(rungs=[SimpleNamespace(step_median_s=None)]))
    assert not stairs and "No staircase" in stairs._repr_markdown_()
    loss = plots.verify_loss(SimpleNamespace(loss={"status": "skipped", "reason": "the original did not run"}))
    assert not loss and "the original did not run" in loss._repr_markdown_()


def test_mfu_axes_keep_distinct_tick_labels_when_every_mfu_is_a_few_percent():
    """The staircase's and the run trend's MFU axes at 1-2% MFU: no repeated labels ("0% 0% 1% 1%")."""
    from mfu_lab import plots
    from mfu_lab.steps.verify.rungs import Rung

    def labels(ax):
        ax.figure.canvas.draw()
        axis = ax.xaxis if ax.get_xlabel().startswith("MFU") else ax.yaxis
        return [t.get_text() for t in axis.get_ticklabels() if t.get_text()]

    rungs = [Rung("original", {}, "ok", step_median_s=0.3, step_p10_s=0.29, step_p90_s=0.31, mfu=0.012),
             Rung("data", {"num_workers": 2}, "ok", step_median_s=0.25, step_p10_s=0.24, step_p90_s=0.26,
                  mfu=0.0165, speedup=1.2, speedup_low=1.1, speedup_high=1.3, proven=True)]
    fig = plots.staircase(SimpleNamespace(rungs=rungs, changes=[]))
    trend = [("20261207-010000", {"01_baseline": 0.012}), ("20261207-020000", {"01_baseline": 0.017})]
    for ax in (fig.axes[1], plots.mfu_trend(trend).axes[0]):
        shown = labels(ax)
        assert len(shown) >= 3 and len(set(shown)) == len(shown), shown


def test_the_index_never_links_an_earlier_runs_report_to_a_newer_result(tmp_path):
    import dataclasses
    import os

    from mfu_lab.core.job.schema import load_job
    from mfu_lab.report import write_index
    from mfu_lab.steps.baseline import step as baseline

    from .conftest import TINY

    job = dataclasses.replace(load_job(TINY), out_dir=str(tmp_path))
    folder = job.step_dir("01_baseline")
    folder.mkdir(parents=True)
    for name in ("01_baseline.ipynb", "report.html"):  # an earlier run's notebook and report...
        (folder / name).write_text("{}")
        os.utime(folder / name, (1_000_000_000, 1_000_000_000))
    baseline.run(job, progress=lambda m: None)  # ...then a plain-Python run replaces the result
    index = write_index(job.output_root()).read_text()
    assert 'href="01_baseline/report.html"' not in index and 'href="01_baseline/01_baseline.ipynb"' not in index
    assert "made without a notebook" in index and 'href="01_baseline/result.json"' in index
    (folder / "01_baseline.ipynb").touch()  # papermill wrote the notebook after the result; the report is older
    os.utime(folder / "report.html", (1_000_000_000, 1_000_000_000))
    index = write_index(job.output_root()).read_text()
    assert 'href="01_baseline/01_baseline.ipynb"' in index and 'href="01_baseline/report.html"' not in index
    assert "report.html is older than the executed notebook" in index


def test_steps_measured_with_other_job_parameters_are_named():
    from mfu_lab.report.index import job_differences

    base = {"micro_batch": 8, "dtype": "float32", "steps": 20, "compile_modes": ["default"]}
    results = {"baseline": {"job": base}, "kernels": {"job": base | {"steps": 5, "compile_modes": []}},
               "compile": {"job": base | {"micro_batch": 4}}}
    lines = job_differences(results)
    assert len(lines) == 1 and lines[0].startswith("Step 4 was measured with other job parameters than step 1")
    assert "micro_batch 4 (step 1: 8)" in lines[0] and "not like for like" in lines[0]
    # several steps that differ alike: one sentence naming them all (the index said it once per step)
    other = base | {"fp8_layers": []}
    results = {"baseline": {"job": base | {"fp8_layers": ["mlp_x"]}}, "attention_comm": {"job": other},
               "kernels": {"job": other}, "compile": {"job": other | {"micro_batch": 4}}}
    lines = job_differences(results)
    assert lines == ["Steps 2 and 3 were measured with other job parameters than step 1: fp8_layers [] (step 1: "
                     "['mlp_x']). Their comparisons with step 1 are not like for like; rerun with the same parameters.",
                     "Step 4 was measured with other job parameters than step 1: micro_batch 4 (step 1: 8), fp8_layers "
                     "[] (step 1: ['mlp_x']). Its comparisons with step 1 are not like for like; rerun with the same "
                     "parameters."]


def test_the_summary_chart_says_what_each_bar_is_and_gives_ddp_its_own_bar():
    from mfu_lab.report.summary import bar_meanings, mfu_points

    m = lambda v: {"value": v, "unit": "fraction", "source": "measured"}  # noqa: E731
    results = {"baseline": {"metrics": {"mfu": m(0.4)}},
               "attention_comm": {"metrics": {"mfu": m(0.43), "ddp_mfu": m(0.63)}, "comm_layout": {"world_size": 8}}}
    pts = mfu_points(results)
    assert [p[0] for p in pts] == ["01_baseline", "02_attention_and_comm", "02_attention_and_comm/DDP"]
    meanings = bar_meanings(results)
    assert "one process" in meanings[1] and meanings[2].startswith("data-parallel, 8 ranks")
    assert not any("peak" in x for x in meanings)  # one precision on every bar: nothing to warn about
    # step 7's tuned job trains in bfloat16: its bar stands on another peak than step 1's, and every bar says which
    results = {"baseline": {"metrics": {"mfu": m(0.6)}, "job": {"dtype": "float32"}},
               "verify": {"metrics": {"mfu": m(0.19)}, "job": {"dtype": "float32"},
                          "rungs": [{"mfu": 0.6, "dtype": "float32"}, {"mfu": 0.19, "dtype": "bfloat16"}]}}
    meanings = bar_meanings(results)
    assert meanings[0].endswith("against the float32 peak") and meanings[1].endswith("against the bfloat16 peak")


def test_a_mistake_in_a_p_override_is_the_command_lines_not_the_files(tmp_path):
    import pytest

    from mfu_lab.core.errors import JobError
    from mfu_lab.core.job.schema import load_job

    from .conftest import TINY

    with pytest.raises(JobError) as e:
        load_job(TINY, {"micro_bacth": 4})
    assert e.value.source == "command line (-p KEY=VALUE)" and "did you mean 'micro_batch'" in str(e.value)
    bad = tmp_path / "job.yaml"
    bad.write_text("stepz: 3\n")
    with pytest.raises(JobError) as e:
        load_job(bad, {"micro_bacth": 4})
    assert e.value.source == f"{bad} and the command line (-p KEY=VALUE)"
    with pytest.raises(JobError) as e:
        load_job(bad, {})
    assert e.value.source == str(bad)


def test_run_and_step_suggest_a_step_name_for_a_typo():
    import pytest

    from mfu_lab.core.errors import JobError
    from mfu_lab.runner import select_steps

    with pytest.raises(JobError, match="did you mean 'kernels'"):
        select_steps("baseline,kernal")


@__import__("pytest").mark.e2e
def test_ctrl_c_during_a_run_is_quiet_and_clean(tmp_path):
    """Ctrl-C reaches the whole foreground process group (the runner and the notebook's kernel): the terminal gets
    the runner's one "interrupted" message, no kernel transport warning or ZMQ traceback; exit 130."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from .conftest import ROOT, TINY

    # a pytest started in the background (``cmd &``) ignores SIGINT, and an ignored signal stays ignored in its
    # children: the runner is started with Python's own handler back, as a terminal's foreground process has it
    start = ("import runpy, signal, sys; signal.signal(signal.SIGINT, signal.default_int_handler); "
             "sys.argv[0] = 'mfu_lab'; runpy.run_module('mfu_lab', run_name='__main__', alter_sys=True)")
    p = subprocess.Popen([sys.executable, "-c", start, "run", str(TINY), "--out", str(tmp_path), "--steps",
                          "baseline", "-p", "synthetic_load_ms=400", "-p", "steps=60"], cwd=ROOT, text=True,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    seen = []  # stdout read line by line until the kernel is up and the step measures (its progress lines), however
    deadline = time.monotonic() + 120  # long a busy machine takes to start the kernel: a sleep would race it
    for line in p.stdout:
        seen.append(line)
        if "baseline steps:" in line or time.monotonic() > deadline:
            break
    time.sleep(1)
    os.killpg(p.pid, signal.SIGINT)
    out, err = p.communicate(timeout=120)
    out = "".join(seen) + out
    both = out + err
    assert p.returncode == 130, both[-3000:]
    assert "interrupted" in both and "ZMQError" not in both and "IPKernelApp" not in both, both[-3000:]
    assert "Traceback" not in err, err[-3000:]


def test_a_table_cell_wraps_at_an_operator_chains_joins_and_never_between_a_number_and_its_unit():
    """wrap_cells adds ``<wbr>`` after the joins of a cell's long tokens only: never in a tag or attribute, never
    outside a table cell, never in a short word; it keeps a number and its unit together; the text a reader copies
    is the same; twice is once."""
    import re

    from mfu_lab.report.templating import wrap_cells

    chain = "transpose+expand+view+bmm+_unsafe_view+_softmax"
    page = (f'<p>{chain}</p><table><tr><td title="{chain}"><code>{chain}</code> num_workers</td>'
            f"<td>sdpa (torch&#x27;s choice)</td></tr></table>")
    out = wrap_cells(page)
    assert f'<td title="{chain}">' in out and f"<p>{chain}</p>" in out
    assert "transpose+<wbr>expand+<wbr>view+<wbr>bmm+<wbr>_<wbr>unsafe_<wbr>view+<wbr>_<wbr>softmax" in out
    assert " num_workers</td>" in out and "torch&#x27;s choice" in out  # short words stay whole
    assert re.sub("<wbr>", "", out) == page and wrap_cells(out) == out
    # a number keeps its unit on its line; a range may still wrap at its dash; outside a cell nothing changes
    out = wrap_cells("<p>3.0 ms</p><table><tr><td>821.4 µs</td><td>3.0 ms–5.6 ms at 17.6 ktokens/s</td></tr></table>")
    assert out == ('<p>3.0 ms</p><table><tr><td><span class="nu">821.4 µs</span></td><td><span class="nu">3.0 ms'
                   '</span>–<span class="nu">5.6 ms</span> at <span class="nu">17.6 ktokens/s</span></td></tr></table>')
    assert wrap_cells(out) == out
    # what a second pass could mistake for a new start (the rest of a broken token), an exponent, a script: whole
    script = '<td><script>var a = "1 ms";</script> 3 ms</td>'
    broken = "<td>abc_<wbr>defghijklmnopqrstuvwxyz_<wbr>3 ms</td>"
    for cell, want in (("<td>abc_defghijklmnopqrstuvwxyz_3 ms</td>", broken),
                       ("<td>1e-05 s</td>", '<td><span class="nu">1e-05 s</span></td>'),
                       (script, script), ("<td><!-- 4 ms --></td>", "<td><!-- 4 ms --></td>")):
        assert wrap_cells(cell) == want and wrap_cells(want) == want
