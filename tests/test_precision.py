"""Step 5's precision ladder: the adoption rule, the native-bf16 reader, the plan of rungs, and one run of the
step on the tiny job with one rung made to fail (no assertion on speed: only on what machine load cannot move)."""

import dataclasses
import json

import pytest

from mfu_lab.analysis import precision as pr
from mfu_lab.core import device as dev
from mfu_lab.core.job import load_job
from mfu_lab.core.results import jsonable
from mfu_lab.steps import fp8
from mfu_lab.steps import precision_ladder as pl

from .conftest import TINY

TOL = 0.02


def fig(name, speedup, low, high, gap=0.001, diverged=""):
    return pr.Figures(name, speedup, low, high, gap, diverged)


# ------------------------------------------------------------------ the adoption rule
def test_a_faster_rung_whose_loss_is_off_is_not_adopted():
    verdicts, adopted = pr.judge([fig("float16", 2.0, 1.8, 2.2, gap=0.05)], TOL)
    assert adopted is None and verdicts[0][0] == pr.OFF and "+5.00%" in verdicts[0][1]


def test_a_rung_whose_interval_contains_one_is_not_adopted():
    verdicts, adopted = pr.judge([fig("bfloat16", 1.3, 0.9, 1.6)], TOL)
    assert adopted is None and verdicts[0][0] == pr.NOT_FASTER and "contains 1.0" in verdicts[0][1]
    assert pr.judge([fig("bfloat16", 0.3, 0.25, 0.35)], TOL)[0][0][0] == pr.SLOWER


def test_the_fastest_proven_rung_with_its_loss_kept_wins():
    rungs = [pr.Figures("float32", status=pr.REFERENCE), fig("tf32", 1.4, 1.2, 1.6), fig("bfloat16", 1.9, 1.7, 2.1),
             fig("float16", 2.5, 0.8, 4.0), fig("fp16-off", 3.0, 2.8, 3.2, gap=0.1),
             fig("bad", 3.5, 3.0, 4.0, diverged="non-finite loss"), pr.Figures("x", status=pr.SKIPPED)]
    verdicts, adopted = pr.judge(rungs, TOL)
    assert adopted == "bfloat16"
    assert [s for s, _ in verdicts] == [pr.REFERENCE, pr.OK, pr.ADOPTED, pr.NOT_FASTER, pr.OFF, pr.DIVERGED,
                                        pr.SKIPPED]


def test_a_race_judges_a_rung_not_proven_faster_by_its_speed_alone_and_says_why():
    """Racing (issue 20): only a rung proven faster can be adopted, so the others train no loss curve; their
    verdict comes from the speed, with the reason."""
    why = "loss curve not trained: not proven faster than float32"
    slow = pr.Figures("float16", 0.9, 0.85, 0.95, None, "", "", why)
    maybe = pr.Figures("bfloat16", 1.1, 0.95, 1.2, None, "", "", why)
    verdicts, adopted = pr.judge([slow, maybe], TOL)
    assert adopted is None
    assert verdicts[0][0] == pr.SLOWER and why in verdicts[0][1]
    assert verdicts[1][0] == pr.NOT_FASTER and why in verdicts[1][1]
    faster = pr.Figures("bfloat16", 1.9, 1.8, 2.0, None, "", "", why)  # never skipped when faster: a failure
    assert pr.judge([faster], TOL)[0][0][0] == pr.FAILED


def test_a_rung_without_figures_is_never_adopted():
    verdicts, adopted = pr.judge([fig("bfloat16", None, None, None), pr.Figures("tf32", 1.5, 1.2, 1.8)], TOL)
    assert adopted is None and [s for s, _ in verdicts] == [pr.FAILED, pr.FAILED]


# ------------------------------------------------------------------ native bf16
CPUINFO = """processor\t: 0
model name\t: Some Xeon
flags\t\t: fpu sse sse2 avx2 avx512f avx512_bf16 amx_tile amx_bf16 avx512_fp16
processor\t: 1
flags\t\t: fpu sse sse2 avx2 avx512f avx512_bf16 amx_tile amx_bf16
"""


def test_native_bf16_flags_are_read_from_cpuinfo(tmp_path, monkeypatch):
    assert pr.native_bf16(CPUINFO) == {"flags": ["avx512_bf16", "amx_bf16"], "native": True, "source": "given text"}
    old = CPUINFO.replace(" avx512_bf16", "").replace(" amx_bf16", "")
    assert pr.native_bf16(old)["flags"] == [] and pr.native_bf16(old)["native"] is False
    arm = "processor\t: 0\nFeatures\t: fp asimd sve bf16 i8mm\n"
    assert pr.native_bf16(arm)["native"] is True
    monkeypatch.setattr(pr, "CPUINFO", tmp_path / "absent")
    assert pr.native_bf16()["native"] is None  # cannot read it: claim nothing


# ------------------------------------------------------------------ the plan, skips and the choice
def test_tf32_is_skipped_on_a_cpu_with_its_reason():
    cpu = dev.resolve_device("cpu")
    rungs = pl.plan(load_job(TINY))
    assert [r.name for r in rungs] == ["float32", "tf32", "bfloat16", "float16"] and rungs[0].own
    why = pl.unavailable(rungs[1], cpu)
    assert "TF32" in why and "CPU" in why
    assert [pl.unavailable(r, cpu) for r in rungs if r.name != "tf32"] == ["", "", ""]


def test_the_jobs_own_precision_is_a_rung_and_float32_stays_the_reference():
    job = dataclasses.replace(load_job(TINY), dtype="bfloat16", precision_rungs=[])
    rungs = pl.plan(job)
    assert [(r.name, r.dtype, r.own) for r in rungs] == [("float32", "float32", False), ("bfloat16", "bfloat16", True)]
    job = dataclasses.replace(load_job(TINY), matmul_precision="high", precision_rungs=["float16"])
    assert [(r.name, r.own) for r in pl.plan(job)] == [("float32", False), ("float16", False), ("tf32", True)]


def rung(name, speedup=None, low=None, high=None, gap=None, status="", own=False):
    dtype, mp = pl.SETTINGS[name]
    return pl.Rung(name, dtype, mp, own=own, status=status, speedup=speedup, speedup_low=low, speedup_high=high,
                   final_gap=gap)


def test_slow_bf16_on_a_cpu_without_native_bf16_says_so_and_is_not_adopted():
    job = load_job(TINY)
    rungs = [rung("float32", 1.0, status=pr.REFERENCE, own=True), rung("bfloat16", 0.2, 0.15, 0.25, gap=0.0)]
    adopted = pl.settle(job, rungs, {"flags": [], "native": False, "source": "given text"})
    choice = pl.choose(job, rungs, adopted)
    assert adopted is None and rungs[1].status == pr.SLOWER and "no native bf16" in rungs[1].reason
    assert not choice["adopted"] and choice["dtype"] == "float32" and "no native bf16" in choice["text"]
    rungs = [rung("float32", 1.0, status=pr.REFERENCE, own=True), rung("bfloat16", 0.2, 0.15, 0.25, gap=0.0)]
    pl.settle(job, rungs, {"flags": ["amx_bf16"], "native": True, "source": "given text"})
    assert "native" not in rungs[1].reason


def test_the_choice_names_the_adopted_rung_with_its_figures():
    job = load_job(TINY)
    rungs = [rung("float32", 1.0, status=pr.REFERENCE, own=True), rung("bfloat16", 1.8, 1.6, 2.0, gap=0.004),
             rung("float16", 1.9, 1.7, 2.1, gap=0.06)]
    choice = pl.choose(job, rungs, pl.settle(job, rungs, None))
    assert {k: choice[k] for k in ("dtype", "matmul_precision", "rung", "adopted", "speedup", "final_gap")} == {
        "dtype": "bfloat16", "matmul_precision": "highest", "rung": "bfloat16", "adopted": True, "speedup": 1.8,
        "final_gap": 0.004}
    assert "1.80x [1.60, 2.00]" in choice["text"] and "dtype: bfloat16" in choice["text"]
    assert [r.status for r in rungs] == [pr.REFERENCE, pr.ADOPTED, pr.OFF]
    assert set(choice) >= {"dtype", "matmul_precision", "adopted", "rung", "text", "speedup", "speedup_low",
                           "speedup_high", "final_gap", "label"} and choice["label"] == "measured"


def test_a_jobs_own_precision_that_loses_the_loss_is_called_out():
    job = dataclasses.replace(load_job(TINY), dtype="float16")
    rungs = [rung("float32", 1.0, status=pr.REFERENCE), rung("float16", 2.0, 1.8, 2.2, gap=0.08, own=True)]
    choice = pl.choose(job, rungs, pl.settle(job, rungs, None))
    assert not choice["adopted"] and choice["dtype"] == "float16" and "consider float32" in choice["text"]


# ------------------------------------------------------------------ one run of the step, one rung made to fail
@pytest.fixture(scope="module")
def broken(tmp_path_factory):
    """Step 5 on the tiny job with float16 failing to build and bfloat16 failing in its second timed round."""
    job = dataclasses.replace(load_job(TINY), out_dir=str(tmp_path_factory.mktemp("p")), fp8_steps=6,
                              precision_rounds=3, steps=4, thorough=True)  # loss curves first, as exhaustively
    real_build, real_steps = pl.build_model, pl._Runner.steps
    calls = {"bfloat16": 0}

    def build(j):
        if j.dtype == "float16":
            raise RuntimeError("no float16 kernels here (test)")
        return real_build(j)

    def steps(self, k):
        if self.rung.name == "bfloat16":
            calls["bfloat16"] += 1
            if calls["bfloat16"] == 3:  # warm-up, round 1, then round 2 fails
                raise RuntimeError("lost the device (test)")
        return real_steps(self, k)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(pl, "build_model", build)
        mp.setattr(pl._Runner, "steps", steps)
        return job, fp8.run(job, progress=lambda m: None)


def test_failed_rungs_are_recorded_and_the_rest_of_the_step_is_kept(broken):
    job, r = broken
    by = {g["name"]: g for g in r.precision["rungs"]}
    assert by["float16"]["status"] == "failed" and "no float16 kernels here" in by["float16"]["reason"]
    assert by["bfloat16"]["status"] == "failed" and "lost the device" in by["bfloat16"]["reason"]
    assert len(by["bfloat16"]["loss"]) == job.fp8_steps  # its loss curve ran before the timing failed
    assert by["float32"]["status"] == "reference" and by["float32"]["step_median_s"] > 0
    assert by["tf32"]["status"] == "skipped" and "CPU" in by["tf32"]["reason"]
    assert r.precision["choice"]["adopted"] is False and r.precision["choice"]["dtype"] == "float32"
    assert r.metrics["precision_speedup"].value is None and r.metrics["precision_speedup"].source == "measured"
    assert r.trials and r.trials[0].status == "reference" and r.sensitivity  # the FP8 part ran in full
    assert {"precision float16", "precision tf32"} <= {s["what"] for s in r.skipped}
    assert r.advice[0].message == r.precision["choice"]["text"]


def test_the_interleave_order_alternates_the_rungs(broken):
    job, r = broken
    assert r.precision["order"] == [[i, n] for i in range(1, job.precision_rounds + 1) for n in ("float32", "bfloat16")]
    assert r.precision["native_bf16"]["source"]  # a CPU run records what it read


def test_the_precision_ladder_round_trips_and_draws(broken):
    job, r = broken
    d = json.loads((job.step_dir(fp8.INFO.folder) / "result.json").read_text())
    back = fp8.Fp8Result.from_dict(d)
    assert back.precision["choice"] == json.loads(json.dumps(jsonable(r.precision["choice"])))
    from mfu_lab import plots
    from mfu_lab.report.tables_fp8 import fp8_section, precision_table

    plots.precision(back)
    html = str(precision_table(back))
    assert "float16" in html and "failed" in html and "Precision ladder" in str(fp8_section(d))


def test_an_older_result_without_the_precision_ladder_still_loads(broken):
    job, r = broken
    d = json.loads((job.step_dir(fp8.INFO.folder) / "result.json").read_text())
    del d["precision"]
    old = fp8.Fp8Result.from_dict(d)
    assert old.precision == {} and old.choice == r.choice
    assert fp8.advise(old)[0].message == r.choice["text"]  # the FP8 advice leads when there is no ladder
    from mfu_lab.report.tables_fp8 import fp8_section, precision_table

    assert "Precision ladder" not in str(fp8_section(d)) and "No precision ladder" in str(precision_table(old))
