"""Overrides stay visible (issue 34, item 7): a run with ``-p`` overrides records them in every step's result
(``environment.overrides``, handed to the kernels in ``MFU_LAB_OVERRIDES``); the index, the summary and every step's
report show them beside the figures they produced, and the index no longer calls such a run "the job as it came";
``tuned.yaml`` comments every value that came from the command line.

Fast: the results are a real default run's (``tests/data/default_run_results.json``, as in test_index_screen), with
the overrides written into them; one end-to-end ``mfu-lab step baseline`` on the tiny job.
"""

import copy
import json
import os
from pathlib import Path

import yaml

from mfu_lab.analysis import tuned_file, tuning
from mfu_lab.core.job import overrides as ov
from mfu_lab.core.job.schema import load_job
from mfu_lab.core.measure.environment import environment
from mfu_lab.core.registry import BY_KEY, STEPS
from mfu_lab.core.store.files import read_json, write_json_atomic
from mfu_lab.report import index as ix
from mfu_lab.report import summary as su
from mfu_lab.report.first_screen import first_screen
from mfu_lab.report.found import found_html
from mfu_lab.runner import overrides_set

DATA = Path(__file__).parent / "data" / "default_run_results.json"
TINY = Path(__file__).parent / "data" / "tiny.yaml"


def stored(**given) -> dict:
    results = copy.deepcopy(json.loads(DATA.read_text())["results"])
    for d in results.values():
        d.setdefault("environment", {})["overrides"] = dict(given)
    return results


def job_folder(root: Path, results: dict) -> Path:
    for key, d in results.items():
        write_json_atomic(root / BY_KEY[key].folder / "result.json", d)
    return root


def test_the_runner_hands_the_overrides_down_and_every_result_records_them(monkeypatch):
    monkeypatch.delenv(ov.OVERRIDES_ENV, raising=False)
    assert environment("cpu", "cpu")["overrides"] == {}  # none: recorded as none
    with overrides_set({"micro_batch": 16, "budget_min": 5, "out_dir": "/tmp/x"}) as kept:
        assert kept == {"micro_batch": 16, "budget_min": 5}  # out_dir is where, not what
        assert json.loads(os.environ[ov.OVERRIDES_ENV]) == kept  # what a notebook's kernel inherits
        assert environment("cpu", "cpu")["overrides"] == {"micro_batch": 16, "budget_min": 5}
    assert ov.OVERRIDES_ENV not in os.environ  # restored after the run
    monkeypatch.setenv(ov.OVERRIDES_ENV, "not json")
    assert ov.from_env() == {}


def test_workload_overrides_and_how_they_are_said():
    given = {"micro_batch": 16, "thorough": True, "budget_min": 5}
    assert ov.workload(given) == {"micro_batch": 16}  # cost keys do not change the job measured
    assert ov.workload({"tp": 2, "comm_hooks": ["none"], "steps": 9, "job_name": "x"}) == {"tp": 2}  # nor sweeps
    assert ov.flags(given) == "-p micro_batch=16 --thorough --budget 5"
    assert ov.pairs({"dtype": "bfloat16", "compile_mode": "default"}) == "dtype=bfloat16, compile_mode=default"
    assert ov.flags({"comm_hooks": ["none", "allreduce"], "comm_bucket_mb": [0.05, 25], "sp": False}) \
        == "-p comm_hooks=[none, allreduce] -p comm_bucket_mb=[0.05, 25] -p sp=false"  # as typed
    assert ov.recorded({"environment": {}}) == {} and ov.recorded(None) == {}  # results from before: none


def test_the_index_names_the_overrides_instead_of_the_job_as_it_came(tmp_path):
    plain = stored()
    top = first_screen(plain, su.recommendations(plain))["mfu"]
    assert top["job"] == "the job as it came" and top["overrides"] == ""
    assert any(x.startswith("The job as it came measured") for x in su.headline(plain))

    results = stored(micro_batch=16)
    top = first_screen(results, su.recommendations(results))["mfu"]
    assert top["job"] == "the job with -p micro_batch=16" and top["overrides"] == "-p micro_batch=16"
    lines = su.headline(results)
    assert any(x.startswith("The job with -p micro_batch=16 measured") for x in lines)
    assert not any("as it came" in x for x in lines)
    numbers = [info.number for info in STEPS if info.key in results]
    named = f"steps {', '.join(map(str, numbers[:-1]))} and {numbers[-1]} (-p micro_batch=16)."
    assert any("overrides from the command line" in x and x.endswith(named) for x in lines)  # one run's: once
    results["verify"]["environment"]["overrides"] = {"micro_batch": 8}  # another run's step 7: named on its own
    line = next(x for x in su.headline(results) if "overrides from the command line" in x)
    first = [n for n in numbers if n != 7]
    assert line.endswith(f"steps {', '.join(map(str, first[:-1]))} and {first[-1]} (-p micro_batch=16); "
                         "step 7 (-p micro_batch=8).")
    results["verify"]["environment"]["overrides"] = {"micro_batch": 16}
    assert su.ledger_before_after({"baseline": results["baseline"]})[0][0].startswith(
        "Before: the job with -p micro_batch=16")

    page = ix.write_index(job_folder(tmp_path / "job", results)).read_text()
    assert "MFU of the job with -p micro_batch=16 (step 1," in page
    assert "MFU of the job as it came" not in page
    assert 'id="fs-overrides"' in page and "these figures are not the job file" in page
    # one run's overrides: said once above the steps' table, not in each of its rows
    assert page.count("with <code>-p micro_batch=16</code> from the command line") == 1
    assert ('<p class="overrides" id="table-overrides"><small>Every step below measured with <code>-p '
            'micro_batch=16</code> from the command line.</small></p>') in page
    results["verify"]["environment"]["overrides"] = {"micro_batch": 8}  # another run's step 7: every row its own
    page = ix.write_index(job_folder(tmp_path / "job2", results)).read_text()
    assert 'id="table-overrides"' not in page
    assert page.count("with <code>-p micro_batch=16</code> from the command line") == len(first)
    assert page.count("with <code>-p micro_batch=8</code> from the command line") == 1


def test_cost_overrides_alone_leave_the_job_as_it_came():
    results = stored(budget_min=5, thorough=True)
    top = first_screen(results, su.recommendations(results))["mfu"]
    assert top["job"] == "the job as it came" and top["overrides"] == ""
    assert top["others"] == "--budget 5 --thorough"  # still shown beside the figures
    results = stored(**{f"comm_steps_{i}": 2 for i in range(12)}, micro_batch=16)  # many: counted, not listed
    top = first_screen(results, su.recommendations(results))["mfu"]
    assert top["overrides"] == "-p micro_batch=16" and top["others"] == "12, with the steps table"


def test_every_steps_report_shows_the_overrides_in_what_this_step_found(tmp_path):
    for given, expect in (({"micro_batch": 16}, True), ({}, False)):
        results = stored(**given)
        root = job_folder(tmp_path / str(expect), {k: results[k] for k in ("baseline", "compile")})
        for key in ("baseline", "compile"):
            folder = root / BY_KEY[key].folder
            nb = folder / BY_KEY[key].notebook
            nb.write_text("{}")
            os.utime(folder / "result.json", (1, 1))  # the result before its notebook, as a run leaves them
            html = str(found_html(nb))
            assert ("Overrides from the command line: <code>micro_batch=16</code>" in html) is expect, key


def _tuned(tmp_path, overrides):
    job = load_job(TINY, {**(overrides or {"micro_batch": 2}), "out_dir": str(tmp_path)})
    chosen = [tuning.Change("compile", "compile", "compile_mode", "off", "default", "1.3x measured", "measured")]
    return job, tuned_file.tuned_yaml(job, chosen, str(TINY), "20261202-000000", overrides=overrides)


def test_tuned_yaml_comments_every_value_that_came_from_the_command_line(tmp_path):
    job, text = _tuned(tmp_path, {"micro_batch": 2, "budget_min": 5})
    lines = {line.split(":")[0]: line for line in text.splitlines() if not line.startswith("#")}
    assert lines["micro_batch"] == f"micro_batch: 2  # from the command line (-p micro_batch=2), not {TINY}"
    assert "# from the command line (--budget 5)" in lines["budget_min"]
    assert "command line" not in lines["seq_len"] and "command line" not in lines["compile_mode"]
    assert "as the command line changed it (-p micro_batch=2 --budget 5)" in text.splitlines()[0]
    back = yaml.safe_load(text)  # the comments change no value
    assert back["micro_batch"] == 2 and back["budget_min"] == 5 and back["compile_mode"] == "default"
    assert back["seq_len"] == job.seq_len

    job = load_job(TINY, {"micro_batch": 2, "budget_min": 5, "out_dir": str(tmp_path)})  # the same values, from a file
    plain = tuned_file.tuned_yaml(job, [tuning.Change("compile", "compile", "compile_mode", "off", "default", "1.3x",
                                                  "measured")], str(TINY), overrides={})
    assert "command line" not in plain
    assert yaml.safe_load(plain) == back


def test_tuned_yaml_reads_the_runs_overrides_by_default(tmp_path):
    with overrides_set({"micro_batch": 2}):
        _, text = _tuned(tmp_path, None)
    assert "micro_batch: 2  # from the command line (-p micro_batch=2)" in text


def test_mfu_lab_step_records_its_overrides_in_the_result(tmp_path, capsys):
    from mfu_lab.cli import main

    assert main(["step", "baseline", "--job", str(TINY), "--out", str(tmp_path), "-p", "micro_batch=2"]) == 0
    assert "measured with overrides from the command line, not the job file's values: -p micro_batch=2" \
        in capsys.readouterr().out
    result = read_json(tmp_path / "tiny" / BY_KEY["baseline"].folder / "result.json")
    assert result["environment"]["overrides"] == {"micro_batch": 2}
    assert result["job"]["micro_batch"] == 2
    assert ov.OVERRIDES_ENV not in os.environ
    page = (tmp_path / "tiny" / "index.html").read_text()
    assert "MFU of the job with -p micro_batch=2 (step 1," in page
    line = json.loads((tmp_path / "tiny" / "history.jsonl").read_text().splitlines()[-1])
    assert line["overrides"] == {"micro_batch": 2}  # the run's line in the history, and the runs table, name them
    assert "<br><small>with <code>-p micro_batch=2</code></small>" in page
