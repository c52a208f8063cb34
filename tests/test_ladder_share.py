"""Step 5's precision ladder inside its share (issue 46: it took 73 s of 8.6 s re-timing float32 for a job already
in bf16; a demo's step 5 had 0 s planned and used 185 s). Under a budget the job's own precision is the reference,
each other rung's step is probed once, and a rung whose rounds and loss curve at that step do not fit the share
left is skipped with the seconds. The share is frozen and the step probes are faked: nothing here depends on this
machine's speed."""

import dataclasses
import re

import pytest

from mfu_lab.analysis import precision as pr
from mfu_lab.core.engine.workload import build_loader
from mfu_lab.core.job.schema import load_job
from mfu_lab.core.measure import device as dev
from mfu_lab.core.process.budget import Clock
from mfu_lab.steps.fp8 import ladder_share as ls
from mfu_lab.steps.fp8 import ladder_timing as lt
from mfu_lab.steps.fp8 import policies
from mfu_lab.steps.fp8 import precision_ladder as pl
from mfu_lab.steps.fp8 import rungs as rg
from mfu_lab.steps.fp8 import step as fp8

from .conftest import TINY


class FrozenClock(Clock):
    """A share whose time left never moves while the ladder runs."""

    def left_s(self):
        return self.planned_s


def _job(tmp_path, **changes):
    return dataclasses.replace(load_job(TINY), **({"out_dir": str(tmp_path), "fp8_steps": 4, "precision_rounds": 2,
                                                   "steps": 4, "precision_rungs": ["bfloat16", "float16"]} | changes))


@pytest.fixture
def spy(monkeypatch):
    """Every rung's matmul probe equal (none ruled out by it), each rung's one-step probe as the test sets it, and
    which rungs were built for timing."""
    monkeypatch.setattr(rg, "probe", lambda rung, device: 100e9)
    steps: dict[str, float] = {}
    monkeypatch.setattr(ls, "probe_step", lambda runner: steps[runner.rung.name])
    built: list[str] = []
    real = lt.Runner.__init__

    def init(self, job, rung, *a, **k):
        built.append(rung.name)
        real(self, job, rung, *a, **k)

    monkeypatch.setattr(lt.Runner, "__init__", init)
    return steps, built


def _ladder(job, clock, reference="", reserve_s=0.0):
    batches = list(build_loader(job, job.fp8_steps, "cpu"))
    out = pl.ladder(job, batches, dev.resolve_device("cpu"), lambda m: None, reference, clock, reserve_s)
    return out, {g["name"]: g for g in out["rungs"]}


def test_a_rung_whose_probed_cost_does_not_fit_the_share_is_skipped_with_the_seconds(spy, tmp_path):
    steps, built = spy
    steps.update(float32=0.01, bfloat16=0.01, float16=100.0)  # float16: 100 s a step, probed
    clock = FrozenClock(60.0)
    out, by = _ladder(_job(tmp_path), clock)
    f16 = by["float16"]
    assert f16["status"] == pr.SKIPPED and f16["reason"].startswith("budget: not timed: its rounds and loss curve")
    assert "100000 ms a step, its one-step probe" in f16["reason"] and "60 s share" in f16["reason"]
    assert f16["step_probe_s"] == 100.0 and f16["step_median_s"] is None and f16["loss"] == []
    assert all(n != "float16" for _, n in out["order"])
    assert [n for _, n in out["order"]] == ["float32", "bfloat16"] * 2  # what fits is timed, the reference first
    assert by["bfloat16"]["step_median_s"] > 0 and by["bfloat16"]["speedup_low"] is not None
    assert {"what": "precision float16", "reason": f16["reason"]} in clock.shortened
    assert "float16 left out by step 5's share of the budget" in out["choice"]["text"]


def test_the_ladder_shrinks_to_its_least_before_it_leaves_a_rung_out(spy, tmp_path):
    """The demo on a slowed host (2026-12-06): 16.7 s of step 5's share left, float32's 3 rounds of 6 steps and
    30-step curve at 360 ms (17.3 s) fit alone and bfloat16's beside them (9.6 s more) did not, so the 1.8x rung
    was never timed. At 2 rounds of 2 steps and 10-step curves both fit (about 8 s): the ladder shrinks, says so,
    and only a rung that fits not even then (float16 at 100 s a step) is left out."""
    steps, built = spy
    steps.update(float32=0.36, bfloat16=0.2, float16=100.0)
    job = _job(tmp_path, fp8_steps=30, precision_rounds=3, steps=18)
    clock = FrozenClock(16.7)
    out, by = _ladder(job, clock, reference="no FP8 trial fits (test)")
    assert [n for _, n in out["order"]] == ["float32", "bfloat16"] * 2  # 2 rounds, not 3
    assert by["bfloat16"]["step_median_s"] > 0 and by["bfloat16"]["speedup_low"] is not None
    cut = next(c for c in clock.shortened if c["what"] == "precision ladder")
    assert "2 rounds of 2 steps and 10-step loss curves instead of 3 of 6 and 30" in cut["reason"]
    assert by["float16"]["status"] == pr.SKIPPED and "a 10-step curve" in by["float16"]["reason"]
    # the least is never more than the job's own counts, and a job already at it is not shrunk
    assert ls.lean(_job(tmp_path), True) == _job(tmp_path)
    assert ls.lean(job, False).fp8_steps == 30  # an FP8 trial reuses the reference's curve: its length stays


def test_the_jobs_own_precision_is_the_reference_and_float32_is_not_retimed_when_it_does_not_fit(spy, tmp_path):
    """A bf16 job under a budget: bf16 is built and probed first and every figure is against it; float32, probed
    far slower (as on the H200: 299 against 49 ms a step), does not fit and is not timed."""
    steps, built = spy
    steps.update(bfloat16=0.049, float32=30.0, float16=0.051)
    job = _job(tmp_path, dtype="bfloat16")
    # bf16 (the reference: 4 timed steps and a 4-step curve) and float16 fit with their builds; float32 needs 240 s
    clock = FrozenClock(60.0)
    out, by = _ladder(job, clock, reference="no FP8 trial fits (test)")
    assert out["reference"] == "bfloat16" and built[0] == "bfloat16"
    assert by["bfloat16"]["own"] and by["bfloat16"]["status"] == pr.REFERENCE
    assert [n for _, n in out["order"]] == ["bfloat16", "float16"] * 2
    f32 = by["float32"]
    assert f32["status"] == pr.SKIPPED and f32["reason"].startswith("budget: ") and f32["step_median_s"] is None
    assert "30000 ms a step" in f32["reason"] and float(re.search(r"about ([\d.]+) s", f32["reason"])[1]) >= 240
    assert by["float16"]["speedup"] is not None  # against bf16, the job's own
    text = out["choice"]["text"]
    assert "float32" in text and ("against bfloat16" in text or "proven faster than bfloat16" in text)


def test_no_share_left_builds_and_times_nothing(spy, tmp_path):
    """The demo's step 5 with 0 s planned: nothing is built, probed or timed, each rung says why."""
    steps, built = spy
    clock = FrozenClock(0.0)
    out, by = _ladder(_job(tmp_path), clock, reference="no FP8 trial fits (test)")
    assert built == [] and out["order"] == []
    for name in ("bfloat16", "float16"):
        assert by[name]["status"] == pr.SKIPPED and by[name]["reason"].startswith("budget: not probed or timed")
    assert "not timed" in by["float32"]["reason"] and by["float32"]["loss"] == []  # no curve: nothing needs it
    assert not out["choice"]["adopted"] and out["choice"]["dtype"] == "float32"


def test_the_share_kept_for_the_fp8_trials_is_not_the_ladders(spy, tmp_path):
    steps, built = spy
    steps.update(float32=0.01, bfloat16=0.01, float16=0.01)
    clock = FrozenClock(100.0)
    out, by = _ladder(_job(tmp_path), clock, reserve_s=100.0)  # all of it kept for the FP8 trials
    assert {by[n]["status"] for n in ("bfloat16", "float16")} == {pr.SKIPPED}
    assert "less 100 s kept for the FP8 trials" in by["float16"]["reason"] and out["order"] == []


def test_without_a_budget_float32_stays_the_reference_and_nothing_is_probed(spy, tmp_path, monkeypatch):
    monkeypatch.setattr(ls, "probe_step", lambda runner: pytest.fail("probed a step without a budget"))
    job = _job(tmp_path, dtype="bfloat16")
    for clock in (None, Clock(None)):
        out, by = _ladder(job, clock)
        assert out["reference"] == "float32" and [g["name"] for g in out["rungs"]][0] == "float32"
        assert [n for _, n in out["order"]] == ["float32", "bfloat16", "float16"] * 2
        assert all(g["step_probe_s"] is None for g in out["rungs"])


def test_a_proven_faster_rung_whose_loss_curve_does_not_fit_is_skipped_not_adopted():
    ref = pl.Rung("bfloat16", "bfloat16", "highest", own=True, status=pr.REFERENCE)
    fast = pl.Rung("float16", "float16", "highest", speedup=1.3, speedup_low=1.2, speedup_high=1.4)
    job = dataclasses.replace(load_job(TINY), fp8_steps=30)
    clock = FrozenClock(5.0)
    costs = {"bfloat16": (0.5, 0.1), "float16": (0.5, 0.1)}  # 30 steps at 0.1 s and a build: 3.5 s each curve
    kept = ls.curves_fit(job, [ref, fast], clock, 0.0, costs, ref_curve=True)
    assert kept == [ref] and fast.status == pr.SKIPPED
    assert fast.reason.startswith("budget: proven faster than bfloat16 (1.30x [1.20, 1.40] against bfloat16)")
    assert "cannot be adopted" in fast.reason and clock.shortened[-1]["what"] == "precision float16 loss curve"
    assert ls.curves_fit(job, [ref, fast], FrozenClock(10.0), 0.0, costs, ref_curve=True) == [ref, fast]


def test_step5_says_each_budget_cut_once_and_the_fp8_reference_reuses_the_jobs_own_curve(spy, tmp_path):
    steps, built = spy
    steps.update(bfloat16=0.01, float32=100.0, float16=0.01)
    job = _job(tmp_path, dtype="bfloat16")
    clock = FrozenClock(60.0)
    skipped: list[dict] = []
    out = fp8._precision(job, list(build_loader(job, job.fp8_steps, "cpu")), dev.resolve_device("cpu"),
                         lambda m: None, skipped, "", clock, 0.0)
    assert "precision float32" not in {s["what"] for s in skipped}  # said in the budget's cuts instead
    assert [s["what"] for s in clock.shortened].count("precision float32") == 1
    curve = policies._ladder_reference(job, out)  # the job's own curve, trained by the ladder: not a second time
    assert curve is not None and len(curve[0]) == job.fp8_steps
