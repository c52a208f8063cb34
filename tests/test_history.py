"""Run history, run comparison, and the summary page's parts, on hand-made results."""

import json

import pytest

from mfu_lab.cli import main
from mfu_lab.core.store import history as hi
from mfu_lab.core.store.files import write_json_atomic
from mfu_lab.report import summary as su
from mfu_lab.report import write_index
from mfu_lab.report.format import compare_text

from .conftest import ROOT, in_process


def metric(value, unit="fraction", source="measured"):
    return {"value": value, "unit": unit, "source": source, "note": ""}


def baseline(mfu=0.5, median=0.100, p10=0.095, p90=0.105, flops=1e12, micro_batch=8, created="2026-11-29T10:00:00"):
    return {"step": "baseline", "job": {"job_name": "j", "micro_batch": micro_batch, "out_dir": "x"},
            "environment": {"device_name": "cpu0", "created_at": created, "git_commit": "abc"},
            "metrics": {"mfu": metric(mfu), "step_time_median_s": metric(median, "s"),
                        "step_time_p10_s": metric(p10, "s"), "step_time_p90_s": metric(p90, "s"),
                        "model_flops_per_step": metric(flops, "FLOP", "analytic")},
            "ledger": {"items": [{"name": "mfu", "fraction": mfu, "source": "measured", "explanation": ""},
                                 {"name": "efficiency", "fraction": 1 - mfu, "source": "measured", "explanation": ""}]},
            "advice": [{"severity": "info", "message": "b-info", "because": "x"},
                       {"severity": "act", "message": "b-act", "because": "y"}]}


def save(job_root, result, run_id, folder="01_baseline", step="baseline"):
    write_json_atomic(job_root / folder / "result.json", result)
    return hi.record(job_root, folder, step, result, run_id)


def test_every_save_is_kept_and_appended_never_overwritten(tmp_path):
    save(tmp_path, baseline(0.40), "20261129-100000")
    save(tmp_path, baseline(0.45), "20261129-110000")
    lines = (tmp_path / hi.HISTORY_FILE).read_text().splitlines()
    assert [json.loads(x)["metrics"]["mfu"]["value"] for x in lines] == [0.40, 0.45]
    for rid, v in (("20261129-100000", 0.40), ("20261129-110000", 0.45)):
        kept = json.loads((tmp_path / "runs" / rid / "01_baseline" / "result.json").read_text())
        assert kept["metrics"]["mfu"]["value"] == v
    # a torn last line (a killed writer) is skipped, the rest still read
    with open(tmp_path / hi.HISTORY_FILE, "a") as f:
        f.write('{"run": "2026')
    assert len(hi.load_history(tmp_path)) == 2
    assert list(hi.runs(tmp_path)) == ["20261129-100000", "20261129-110000"]
    assert hi.mfu_trend(tmp_path) == [("20261129-100000", {"01_baseline": 0.40}),
                                      ("20261129-110000", {"01_baseline": 0.45})]


def test_run_id_comes_from_the_environment_only_when_it_is_a_run_id(monkeypatch):
    monkeypatch.setenv(hi.RUN_ENV, "20260101-000000")
    assert hi.current_run_id() == "20260101-000000"
    monkeypatch.setenv(hi.RUN_ENV, "../../etc")  # never a path out of runs/
    rid = hi.current_run_id()
    assert rid != "../../etc" and hi._RUN_ID.match(rid)


def test_job_digest_ignores_the_output_folder_only():
    a = {"job_name": "j", "micro_batch": 8, "out_dir": "a"}
    assert hi.job_digest(a) == hi.job_digest(a | {"out_dir": "b"})
    assert hi.job_digest(a) != hi.job_digest(a | {"micro_batch": 16})


def run_of(results, label="r"):
    return hi.Run(label, ROOT, results)


def by_metric(changes):
    return {(c.step, c.metric): c for c in changes}


def test_compare_counts_a_change_only_beyond_the_noise():
    # noise: max(3%, half the p10-p90 spread / median) = max(0.03, 0.01/2/0.1 = 5%) = 5%
    a = run_of({"baseline": baseline(mfu=0.50)})
    same = by_metric(hi.compare(a, run_of({"baseline": baseline(mfu=0.52)}))[0])
    assert same[("baseline", "mfu")].verdict == "same"
    assert same[("baseline", "mfu")].tolerance == pytest.approx(0.05)
    better = by_metric(hi.compare(a, run_of({"baseline": baseline(mfu=0.60, median=0.08, p10=0.079,
                                                                   p90=0.081)}))[0])
    assert better[("baseline", "mfu")].verdict == "better"
    assert better[("baseline", "mfu")].rel == pytest.approx(0.2)
    assert better[("baseline", "step_time_median_s")].verdict == "better"  # lower step time is better
    worse = by_metric(hi.compare(a, run_of({"baseline": baseline(mfu=0.40)}))[0])
    assert worse[("baseline", "mfu")].verdict == "worse"


def test_compare_treats_analytic_figures_as_exact_and_notes_changed_parameters():
    a = run_of({"baseline": baseline(flops=1e12)})
    b = run_of({"baseline": baseline(flops=1.01e12, micro_batch=16)})
    changes, notes = hi.compare(a, b)
    c = by_metric(changes)[("baseline", "model_flops_per_step")]
    assert c.tolerance == hi.EXACT_TOL and c.verdict == "higher"  # 1% is a real change for a formula
    assert any("micro_batch 8 -> 16" in n for n in notes)
    assert not any("out_dir" in n for n in notes)


def test_compare_marks_metrics_and_steps_present_in_one_run_only():
    b_res = baseline()
    b_res["metrics"]["hfu"] = metric(0.6)
    changes, notes = hi.compare(run_of({"baseline": baseline()}),
                                run_of({"baseline": b_res, "fp8": {"metrics": {}, "job": {}, "environment": {}}}))
    assert by_metric(changes)[("baseline", "hfu")].verdict == "only in B"
    assert "05_fp8: only in B" in notes
    text = compare_text(run_of({}, "A"), run_of({}, "B"), changes, notes)
    assert "baseline.hfu" in text and "only in B" in text


def test_compare_rejects_a_negative_tolerance():
    with pytest.raises(Exception, match="--tolerance"):
        hi.compare(run_of({}), run_of({}), tolerance=-0.1)


def test_resolve_run_by_id_prefix_latest_previous_and_folder(tmp_path):
    for rid, v in (("20261128-090000", 0.3), ("20261129-100000", 0.4), ("20261129-110000", 0.5)):
        save(tmp_path, baseline(v), rid)
    assert hi.resolve_run("latest", tmp_path).label == "20261129-110000"
    assert hi.resolve_run("previous", tmp_path).label == "20261129-100000"
    assert hi.resolve_run("20261128", tmp_path).results["baseline"]["metrics"]["mfu"]["value"] == 0.3
    with pytest.raises(Exception, match="2 runs start with it"):
        hi.resolve_run("20261129", tmp_path)
    with pytest.raises(Exception, match="no run starts with it.*latest / previous"):
        hi.resolve_run("2025", tmp_path)
    assert hi.resolve_run(str(tmp_path), None).results["baseline"]["metrics"]["mfu"]["value"] == 0.5
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(Exception, match="holds no step result"):
        hi.resolve_run(str(empty), None)


def test_cli_compare_and_history(tmp_path, capsys):
    save(tmp_path, baseline(0.40), "20261129-100000")
    save(tmp_path, baseline(0.60), "20261129-110000")
    assert main(["compare", "previous", "latest", "--job-dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "baseline.mfu" in out and "+50.0%" in out and "better (measured)" in out
    assert main(["compare", "previous", "nope", "--job-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "'nope'" in err and "no run starts with it" in err
    assert main(["history", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "20261129-100000" in out and "01_baseline 40.0%" in out
    assert out.count("the job as in its file") == 2 and "overrides" not in out


def test_history_lists_each_runs_overrides_beside_its_figures(tmp_path, capsys, monkeypatch):
    from mfu_lab.core.job import overrides

    save(tmp_path, baseline(0.40), "20261129-100000")
    monkeypatch.setenv(overrides.OVERRIDES_ENV, json.dumps({"micro_batch": 4, "attention": "sdpa"}))
    r = baseline(0.55)
    r["environment"]["overrides"] = overrides.from_env()  # as results.environment() records a run's -p
    save(tmp_path, r, "20261129-110000")
    assert main(["history", str(tmp_path)]) == 0
    first, second = capsys.readouterr().out.strip().splitlines()
    assert first.startswith("20261129-100000") and "the job as in its file" in first and "-p" not in first
    assert second.startswith("20261129-110000") and "overrides -p attention=sdpa -p micro_batch=4" in second
    assert second.index("overrides") < second.index("MFU 01_baseline 55.0%")


# ------------------------------------------------------------------ the summary page
def step2(job_attention="sdpa", rec_fragment=None):
    rows = [{"status": "ok", "hook": "none", "bucket_mb": 25, "grad_as_bucket_view": False, "step_median_s": 0.30},
            {"status": "ok", "hook": "allreduce", "bucket_mb": 1, "grad_as_bucket_view": False, "step_median_s": 0.25}]
    return {"job": {"attention": job_attention}, "metrics": {"attention_speedup": metric(1.2, "x")},
            "comm": rows, "advice": [{"severity": "look", "message": "s2-look", "because": ""}],
            "recommendation": {"attention": "sdpa flash", "job_fragment": rec_fragment or {"attention": "sdpa"},
                               "comm": {"hook": "allreduce", "bucket_cap_mb": 1, "gradient_as_bucket_view": False},
                               "comm_text": "use 1 MB"}}


def test_changes_take_their_gains_from_the_measurements():
    rows = su.changes({"attention_comm": step2(job_attention="unfused")})
    att, ddp = rows
    assert att.status == "adopt" and att.gain == 1.2 and att.source == "measured"
    assert ddp.gain == pytest.approx(0.30 / 0.25) and ddp.status == "adopt"
    assert su.changes({"attention_comm": step2(job_attention="sdpa")})[0].status == "in the job"


def test_fp8_change_is_labelled_emulated_without_fp8_hardware():
    fp8 = {"job": {"fp8_layers": []}, "choice": {"policy": "MLP", "recipe": "tensorwise", "groups": ["mlp_up"],
                                                  "flops_share": 0.6, "fragment": "fp8_layers: [mlp_up]"},
           "speed": {"status": "skipped", "reason": "no FP8 units"}, "path": "emulated"}
    (c,) = su.changes({"fp8": fp8})
    assert (c.gain, c.unit, c.source, c.status) == (0.6, "fraction", "emulated", "not measured")  # nothing to time
    assert "no FP8 units" in c.how and "fp8_layers: [mlp_up]" in c.how
    # on FP8 units: timed faster -> adopt; timed not faster -> keep as is; not timed (torchao missing) -> not measured
    hw = fp8 | {"path": "fp8 hardware"}
    for speed, status, source in (({"status": "ok", "speedup": 1.2}, "adopt", "measured"),
                                  ({"status": "ok", "speedup": 0.7}, "keep as is", "measured"),
                                  ({"status": "slower", "reason": "no group faster"}, "keep as is", "measured"),
                                  ({"status": "skipped", "reason": "torchao is not installed"}, "not measured",
                                   "analytic")):
        (c,) = su.changes({"fp8": hw | {"speed": speed}})
        assert (c.status, c.source) == (status, source), speed


def test_recommendations_put_act_first_and_keep_step_order():
    items = su.recommendations({"baseline": baseline(), "attention_comm": step2()})
    assert [a["message"] for _, a in items] == ["b-act", "s2-look", "b-info"]


def test_ledger_after_is_step_7s_tuned_job_and_absent_without_it():
    led = {"items": [{"name": "mfu", "fraction": 0.7, "source": "measured", "explanation": ""}]}
    orig = {"items": [{"name": "mfu", "fraction": 0.5, "source": "measured", "explanation": ""}]}
    d = {"recommendation": {"compile": True, "mode": "default"}, "ledgers": {"eager": {"items": []}, "default": led}}
    before, after = su.ledger_before_after({"baseline": baseline(), "compile": d})
    assert before[1] == baseline()["ledger"] and after is None  # step 4's eager profile is not "after"
    v = {"ledgers": {"before": orig, "after": led}, "headline": {"text": "MFU 50.0% -> 70.0%", "carried": ["compile"]}}
    before, after = su.ledger_before_after({"baseline": baseline(), "compile": d, "verify": v})
    assert before[1] == orig and after[1] == led and "step 7" in before[0] and "tuned" in after[0]
    assert su.headline({"baseline": baseline(), "verify": v})[0].startswith("Verified: MFU 50.0% -> 70.0%")


def test_index_shows_summary_changes_recommendations_and_the_trend(tmp_path):
    save(tmp_path, baseline(0.40, created="2026-11-29T10:00:00"), "20261129-100000")
    save(tmp_path, baseline(0.45, created="2026-11-29T11:00:00"), "20261129-110000")
    page = write_index(tmp_path).read_text()
    for part in ("Summary", "The ledger, before and after", "Changes measured", "Recommendations, all steps",
                 "Runs of this job", "Environment and device health", 'alt="MFU across runs"',
                 "The job as it came measured 45.0% MFU (step 1, measured)", "mfu-lab compare previous latest"):
        assert part in page, part
    assert page.index("b-act") < page.index("b-info")


def test_index_escapes_text_taken_from_results(tmp_path):
    r = baseline()
    r["advice"] = [{"severity": "act", "message": "<script>alert(1)</script>", "because": "<b>"}]
    save(tmp_path, r, "20261129-100000")
    page = write_index(tmp_path).read_text()
    assert "<script>alert(1)" not in page and "&lt;script&gt;alert(1)" in page


@pytest.mark.e2e
def test_a_full_run_is_one_run_in_the_history(full_run):
    p, job_root = full_run
    assert p.returncode == 0, p.stderr[-3000:]
    table = hi.runs(job_root)
    assert len(table) == 1, table.keys()  # every step of one `mfu-lab run` shares its run id
    (steps,) = table.values()
    assert list(steps) == ["baseline", "attention_comm", "kernels", "compile", "fp8", "placement", "verify"]
    assert len({d["job_digest"] for d in steps.values()}) == 1
    c = in_process("compare", "latest", str(job_root), "--job-dir", str(job_root), "--all")
    assert c.returncode == 0, c.stderr
    assert " 0 better, 0 worse, 0 moved" in c.stdout  # a run against its own files: all the same
    index = (job_root / "index.html").read_text()
    assert 'alt="ledger before' in index and 'alt="MFU across runs"' in index
