"""Faults and resumable runs: nothing finished is lost, every failure says what happened and what to do."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from mfu_lab.core.job.schema import Job
from mfu_lab.core.process import faults
from mfu_lab.core.store.files import write_json_atomic
from mfu_lab.core.store.runstate import RUNNING_FILE, mark_failed, resumable, step_state, workbook_version

from .conftest import ROOT, TINY, in_process


def cli(*args, env=None, timeout=600):
    return subprocess.run([sys.executable, "-m", "mfu_lab", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})


# ------------------------------------------------------------------ units
def test_non_finite_loss_names_the_first_bad_step():
    faults.check_losses([2.0, 1.9, 1.8])
    with pytest.raises(faults.NonFiniteLoss, match="the loss became inf at training step 3"):
        faults.check_losses([2.0, 1.9, float("inf"), float("nan")])


def test_oom_advice_comes_from_the_job():
    advice = faults.oom_advice(Job(micro_batch=8, seq_len=1024, dtype="float32"))
    assert advice[0].startswith("micro_batch: 4 with grad_accum: 2 (now 8 x 1;")  # samples per optimizer step held
    for mb, accum, want in ((8, 3, "micro_batch: 4 with grad_accum: 6 (now 8 x 3;"),
                            (6, 1, "micro_batch: 3 with grad_accum: 2 (now 6 x 1;"),
                            (5, 2, "micro_batch: 1 with grad_accum: 10 (now 5 x 2;")):  # 5 has no half: 1 x 5
        assert faults.oom_advice(Job(micro_batch=mb, grad_accum=accum))[0].startswith(want)
    assert any(a.startswith("activation_checkpointing: true") for a in advice)
    assert any(a.startswith("dtype: bfloat16") for a in advice)
    assert any(a.startswith("seq_len: 512") for a in advice)
    assert faults.oom_advice(Job(micro_batch=1, activation_checkpointing=True, dtype="bfloat16", seq_len=128)) == []


def test_guarded_turns_an_oom_into_figures_and_advice():
    @faults.guarded("demo")
    def run(job):
        raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")

    with pytest.raises(faults.OutOfMemory) as e:
        run(Job(micro_batch=8))
    msg = str(e.value)
    assert "step demo ran out of memory" in msg and "Tried to allocate 2.00 GiB" in msg
    assert "host: total" in msg and "micro_batch: 4 with grad_accum: 2 (now 8 x 1" in msg
    assert e.value.figures["host"]["total_gib"] > 0

    @faults.guarded("demo")
    def other(job):
        raise ValueError("not memory")

    with pytest.raises(ValueError, match="not memory"):
        other(Job())


def _result(folder, job_dict, **env):
    write_json_atomic(folder / "result.json", {"job": job_dict, "status": "ok", "metrics": {},
                                               "environment": {**workbook_version(), "created_at": "t0", **env}})


def test_resumable_only_for_the_same_parameters_and_workbook(tmp_path):
    job = Job().to_dict()
    assert resumable(tmp_path, job) == (False, "no result yet")
    _result(tmp_path, job)
    assert resumable(tmp_path, job)[0]
    assert resumable(tmp_path, job | {"out_dir": "elsewhere"})[0]  # moving the results is no change
    keep, why = resumable(tmp_path, job | {"micro_batch": 16})
    assert not keep and why == "job parameters changed: micro_batch 8 -> 16"
    _result(tmp_path, job, mfu_lab="0.0.1")
    assert resumable(tmp_path, job) == (False, f"workbook version changed: 0.0.1 -> {workbook_version()['mfu_lab']}")
    _result(tmp_path, job, git_commit="0" * 40)
    assert "workbook commit changed" in resumable(tmp_path, job)[1]
    _result(tmp_path, job)
    mark_failed(tmp_path, "baseline", "timeout", "Timeout: a cell ran longer")
    keep, why = resumable(tmp_path, job)
    assert not keep and why.startswith("last attempt timeout: Timeout: a cell ran longer")
    assert "previous result is kept" in why


def test_a_running_marker_without_its_process_reads_as_interrupted(tmp_path):
    import platform

    write_json_atomic(tmp_path / RUNNING_FILE, {"pid": os.getpid(), "host": platform.node(), "started_at": "t"})
    assert step_state(tmp_path).status == "running"
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    write_json_atomic(tmp_path / RUNNING_FILE, {"pid": p.pid, "host": platform.node(), "started_at": "t"})
    st = step_state(tmp_path)
    assert st.status == "interrupted" and "never finished" in st.detail


# ------------------------------------------------------------------ end to end, on the tiny job
@pytest.mark.e2e
@pytest.mark.parametrize("kind,expect", [
    ("oom", ["baseline ran out of memory", "Memory at the time: host: total",
             "micro_batch: 2 with grad_accum: 2 (now 4 x 1"]),
    ("nan", ["the loss became nan at training step 2"]),
])
def test_device_faults_in_a_step_are_recorded_with_advice(tmp_path, kind, expect):
    p = cli("step", "baseline", "--job", str(TINY), "--out", str(tmp_path), env={faults.FAULT_ENV: f"baseline:{kind}"})
    assert p.returncode == 1, p.stdout + p.stderr
    for text in expect:
        assert text in p.stderr, p.stderr
    failure = json.loads((tmp_path / "tiny" / "01_baseline" / "failure.json").read_text())
    assert failure["status"] == "failed" and expect[0] in failure["error"]
    assert not (tmp_path / "tiny" / "01_baseline" / RUNNING_FILE).exists()
    assert "failed" in (tmp_path / "tiny" / "index.html").read_text()


@pytest.mark.e2e
def test_keep_going_runs_the_other_steps_and_resume_keeps_what_finished(tmp_path, monkeypatch):
    out = str(tmp_path)
    monkeypatch.setenv(faults.FAULT_ENV, "baseline:error")  # the steps' kernels inherit it
    # step 1 fails; without --keep-going the run stops and says what did not run
    p = in_process("run", str(TINY), "--steps", "baseline,fp8", "--out", out, "-q")
    assert p.returncode == 1 and "not run: 05_fp8" in p.stderr, p.stderr
    # with --keep-going step 5 runs, and the exit code still says a step failed
    p = in_process("run", str(TINY), "--steps", "baseline,fp8", "--out", out, "-q", "--keep-going")
    assert p.returncode == 1 and "1 step(s) failed: 01_baseline" in p.stderr, p.stderr
    monkeypatch.delenv(faults.FAULT_ENV)
    fp8 = tmp_path / "tiny" / "05_fp8" / "result.json"
    assert fp8.is_file()
    index = (tmp_path / "tiny" / "index.html").read_text()
    assert "injected failure" in index  # the failed step's error, on the index
    assert 'href="01_baseline/report.html"' in index  # its executed notebook's report, with papermill's banner
    assert "An Exception was encountered" in (tmp_path / "tiny" / "01_baseline" / "report.html").read_text()
    # --resume: step 5 is kept (same parameters and workbook), step 1 runs again, now without the fault
    stamp = fp8.stat().st_mtime_ns
    p = in_process("run", str(TINY), "--steps", "baseline,fp8", "--out", out, "-q", "--resume")
    assert p.returncode == 0, p.stderr
    assert "05_fp8: kept: finished" in p.stdout
    assert "01_baseline: runs again (last attempt failed" in p.stdout
    assert fp8.stat().st_mtime_ns == stamp
    assert (tmp_path / "tiny" / "01_baseline" / "result.json").is_file()
    # the resumed run kept the id of the run it went on with: one run in the history, not two
    lines = [json.loads(x) for x in (tmp_path / "tiny" / "history.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == ["fp8", "baseline"]
    assert lines[0]["run"] == lines[1]["run"]
    # a changed parameter would rerun it, saying why (checked without running it: resumable's unit test)
    from mfu_lab.core.job.schema import load_job

    job = load_job(TINY, {"out_dir": out, "fp8_steps": 12})
    keep, why = resumable(tmp_path / "tiny" / "05_fp8", job.to_dict())
    assert not keep and why.startswith("job parameters changed: fp8_steps")


@pytest.mark.e2e
def test_a_cell_timeout_is_reported_as_a_timeout(tmp_path):
    # the measuring cell hangs (a test fault that sleeps: a step that trains past the timeout would keep a core
    # busy for all of it)
    p = cli("run", str(TINY), "--steps", "baseline", "--out", str(tmp_path), "-q", "--execution-timeout", "12",
            env={faults.FAULT_ENV: "baseline:hang"})
    assert p.returncode == 1
    # the measuring cell is named, not the ones around it
    assert "Timeout: a cell ran longer than --execution-timeout 12 s: cell " in p.stderr, p.stderr
    assert "(from mfu_lab.steps import baseline); the cells after it did not run" in p.stderr
    step = tmp_path / "tiny" / "01_baseline"
    failure = json.loads((step / "failure.json").read_text())
    assert failure["status"] == "timeout"
    nb = json.loads((step / "01_baseline.ipynb").read_text())
    statuses = [c["metadata"].get("papermill", {}).get("status") for c in nb["cells"]]
    assert "timeout" in statuses and statuses[-1] == "not run"  # papermill had marked them all completed
    assert "Execution timed out after 12 s" in "".join(nb["cells"][0]["source"])
    assert not (step / "result.json").exists()
    assert "timeout" in (tmp_path / "tiny" / "index.html").read_text()


@pytest.mark.e2e
def test_a_killed_run_keeps_the_previous_result_whole_and_is_marked_interrupted(tmp_path):
    p = in_process("step", "baseline", "--job", str(TINY), "--out", str(tmp_path))
    assert p.returncode == 0, p.stderr
    step = tmp_path / "tiny" / "01_baseline"
    before = (step / "result.json").read_bytes()
    proc = subprocess.Popen([sys.executable, "-m", "mfu_lab", "step", "baseline", "--job", str(TINY), "--out",
                             str(tmp_path), "-p", "steps=100000"], cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.time() + 120
    while not (step / RUNNING_FILE).exists() and time.time() < deadline:
        time.sleep(0.2)
    time.sleep(3)  # well into the steps
    os.killpg(proc.pid, signal.SIGKILL)  # a lost node: nothing gets to clean up
    proc.wait()
    assert (step / "result.json").read_bytes() == before  # never half a new one
    st = step_state(step)
    assert st.status == "interrupted" and "previous result is kept" in st.detail
    p = in_process("report", str(tmp_path / "tiny"))
    assert p.returncode == 0
    assert "interrupted" in (tmp_path / "tiny" / "index.html").read_text()


@pytest.mark.e2e
def test_rerunning_a_step_with_the_same_inputs_reproduces_it(tmp_path):
    """Seeds, parameters, versions and the commit are recorded; the same inputs give the same counted and
    analytic figures exactly, the same losses (seeded), and measured figures that compare records as noise."""
    from mfu_lab.core.store.history import compare, resolve_run, runs

    for _ in range(2):
        p = cli("step", "baseline", "--job", str(TINY), "--out", str(tmp_path))
        assert p.returncode == 0, p.stderr
        time.sleep(1.1)  # a new run id
    root = tmp_path / "tiny"
    a, b = resolve_run("previous", root), resolve_run("latest", root)
    ra, rb = a.results["baseline"], b.results["baseline"]
    assert ra["job"]["seed"] == 0 and ra["environment"]["git_commit"] and ra["environment"]["torch"]
    assert ra["timings"]["loss"] == rb["timings"]["loss"]  # bit for bit
    changes, notes = compare(a, b)
    exact = [c for c in changes if c.source_a in ("counted", "analytic")]
    assert exact and all(c.verdict == "same" for c in exact), [(c.metric, c.a, c.b) for c in exact]
    assert not notes
    assert len(runs(root)) == 2
