"""Step 4 end to end in plain Python on the tiny job, with dynamo's 'eager' backend (no code generation,
so it runs in seconds); tests/test_kernels.py's papermill run uses inductor."""

import dataclasses
import json

import pytest

from mfu_lab.core.job.schema import load_job
from mfu_lab.steps.compile import step as compiled

from .conftest import TINY
from .test_e2e import assert_offline


@pytest.fixture(scope="module")
def ran(tmp_path_factory):
    job = dataclasses.replace(load_job(TINY), out_dir=str(tmp_path_factory.mktemp("c")), compile_backend="eager",
                              compile_modes=["default", "reduce-overhead"])
    return job, compiled.run(job)


def test_every_mode_is_run_or_skipped_with_a_reason(ran):
    job, r = ran
    assert r.eager.status == "ok" and len(r.eager.loss) == job.compile_warmup_steps + job.steps
    # its process beyond its steps and 3 profiled ones: the whole trial less the steps its own file lists, at least
    # the interpreter and torch's import (over a second here, alone)
    walls = json.loads((job.step_dir("04_compile") / "trials" / "eager.json").read_text())["wall_s"]
    assert len(walls) == job.compile_warmup_steps + job.steps
    assert r.eager.start_s == pytest.approx(r.eager.seconds - sum(walls) - 3 * r.eager.step_median_s)
    assert r.eager.start_s > 0.5
    by = {t.mode: t for t in r.trials}
    assert by["reduce-overhead"].status == "skipped" and "CUDA" in by["reduce-overhead"].reason
    t = by["default"]
    # the eager backend runs the same kernels: at most float rounding apart (a busy machine can split a matmul's
    # reduction differently between threads, one ulp of float32), far inside the 1e-3 tolerance
    assert t.status == "ok" and t.drift <= 1e-6 and t.drift_ok
    assert t.speedup == pytest.approx(r.eager.step_median_s / t.step_median_s)
    assert t.compile_cold_s == pytest.approx(sum(t.first_steps_s) - 2 * t.step_median_s - (
        sum(r.eager.first_steps_s) - 2 * r.eager.step_median_s))
    # a CPU's cold compile under WARM_WORTH_S is not worth a warm-cache process (issue 20): said, not timed
    assert t.compile_warm_s is None and "warm cache could save at most" in t.warm_skipped
    assert t.break_even_warm is None and t.recompiles == 0 and t.graphs >= 1
    assert t.ops_per_step > 0 and r.step3["source"].startswith("the eager run's own trace")


def test_the_warm_cache_compile_is_timed_on_gpus_with_thorough_and_for_long_cold_compiles():
    from mfu_lab.core.process.budget import Clock

    job = load_job(TINY)
    short, long = compiled.Trial("default", "ok", compile_cold_s=5.0), compiled.Trial("default", "ok",
                                                                                      compile_cold_s=90.0)
    assert "under 60 s" in compiled._warm_skip(job, "cpu", short, Clock(None), 10.0)
    assert compiled._warm_skip(job, "cpu", long, Clock(None), 100.0) == ""
    assert compiled._warm_skip(job, "cuda", short, Clock(None), 10.0) == ""  # always on a GPU
    assert compiled._warm_skip(dataclasses.replace(job, thorough=True), "cpu", short, Clock(0.0), 10.0) == ""
    clock = Clock(planned_s=1.0)
    assert compiled._warm_skip(job, "cuda", short, clock, 10.0).startswith("budget:") and clock.shortened


def test_recompiles_and_shapes_are_reported(ran):
    _, r = ran
    own, static, auto = r.recompiles
    assert own.recompiles == 0 and not r.audit.varies  # fixed synthetic data
    assert (static.recompiles, auto.recompiles) == (2, 1)
    assert "size mismatch" in static.messages[0]
    assert r.metrics["recompiles_on_data"].value == 0 and r.metrics["graph_breaks"].value == 0


def test_result_file_round_trips_and_the_index_shows_step_4(ran):
    job, r = ran
    d = json.loads((job.step_dir("04_compile") / "result.json").read_text())
    again = compiled.CompileResult.from_dict(d)
    assert again.trials[0].step_median_s == r.trials[0].step_median_s
    assert again.recommendation["text"] == r.recommendation["text"]
    index = (job.output_root() / "index.html").read_text()
    assert "Step 4 · compile" in index and "lengths varied, dynamic=False" in index


def test_a_failing_mode_is_recorded_and_the_others_still_run(tmp_path):
    job = dataclasses.replace(load_job(TINY), out_dir=str(tmp_path), compile_backend="inductor",
                              compile_modes=["reduce-overhead"], steps=2,  # allowed options a CPU cannot compile:
                              compile_options={"max_autotune": True, "max_autotune_gemm_backends": "CUTLASS"})
    r = compiled.run(job)
    by = {t.mode: t for t in r.trials}
    assert by["reduce-overhead"].status == "skipped"
    assert by["options"].status == "failed" and "max_autotune_gemm_backends" in by["options"].error
    assert r.eager.status == "ok" and not r.recommendation["compile"]
    assert any("options" in a.message and "failed" in a.message for a in r.advice)


@pytest.mark.e2e
def test_notebook_compiles_with_inductor_under_papermill(full_run):
    p, job_root = full_run
    assert p.returncode == 0, p.stderr[-3000:]
    folder = job_root / "04_compile"
    nb = json.loads((folder / "04_compile.ipynb").read_text())
    outputs = [o for c in nb["cells"] for o in c.get("outputs", [])]
    assert not [o for o in outputs if o.get("output_type") == "error"]
    assert sum("image/png" in o.get("data", {}) for o in outputs) >= 2  # modes and break-even plots
    r = compiled.CompileResult.from_dict(json.loads((folder / "result.json").read_text()))
    t = next(t for t in r.trials if t.mode == "default")
    # racing (the default): a CPU's cold compile under a minute is not worth timing a warm cache, and says so
    assert t.status == "ok" and t.compile_warm_s is None and "under 60 s" in t.warm_skipped
    assert t.drift_ok and (folder / "trace_default.json.gz").is_file()
    assert r.step3["source"].startswith("step 3 result")  # step 3 ran first in the same run
    assert set(r.step3["default"]["removed"]) | set(r.step3["default"]["left"]) == set(r.step3["patterns"])
    report = (folder / "report.html").read_text()
    assert "break-even" in report and "dynamic=False" in report
    assert_offline(report)
