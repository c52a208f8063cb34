"""Step 5's precision rule on the first H200 run's figures (tests/data/h200/small_job_05_fp8_result.json): a bf16
job is not moved to TF32 on noise, and keeping the job's own precision scores no gain."""

import dataclasses
import json

import pytest

from mfu_lab.analysis import precision as pr
from mfu_lab.core.job.schema import Job
from mfu_lab.report.gains import estimate
from mfu_lab.steps.fp8 import precision_ladder as ladder

from .conftest import ROOT

RESULT = json.loads((ROOT / "tests" / "data" / "h200" / "small_job_05_fp8_result.json").read_text())


def _rungs() -> list[ladder.Rung]:
    names = {f.name for f in dataclasses.fields(ladder.Rung)}
    out = []
    for d in RESULT["precision"]["rungs"]:
        r = ladder.Rung(**{k: v for k, v in d.items() if k in names})
        if r.status != pr.REFERENCE:
            r.status, r.reason = "", ""  # judged again
        out.append(r)
    return out


def test_a_bf16_job_is_not_moved_to_tf32_on_noise():
    """As run: TF32 2.64x [2.42, 2.82] was adopted over the job's own bf16 2.38x [2.27, 2.65]: the intervals
    overlap, so TF32 is not faster than what the job has beyond the noise, and the job keeps bf16."""
    stored = {r["name"]: r["status"] for r in RESULT["precision"]["rungs"]}
    assert stored["tf32"] == "adopted" and stored["bfloat16"] == "ok"  # the fixture as the old rule judged it
    job = Job(**{k: v for k, v in RESULT["job"].items() if k in {f.name for f in dataclasses.fields(Job)}})
    rungs = _rungs()
    adopted = ladder.settle(job, rungs, None)
    by = {r.name: r for r in rungs}
    assert adopted == "bfloat16" and by["bfloat16"].status == pr.ADOPTED and by["bfloat16"].own
    assert by["tf32"].status == pr.OK and "not faster than the job's own bfloat16 beyond the noise" in by["tf32"].reason
    choice = ladder.choose(job, rungs, adopted)
    assert choice["rung"] == "bfloat16" and choice["text"].startswith("Keep bfloat16 autocast (the job's own")


def test_a_rung_beyond_the_jobs_own_is_still_adopted():
    rungs = [pr.Figures("float32", status=pr.REFERENCE),
             pr.Figures("tf32", 3.0, 2.9, 3.1, 0.0), pr.Figures("bfloat16", 2.4, 2.3, 2.6, 0.0)]
    verdicts, adopted = pr.judge(rungs, 0.02, own="bfloat16")
    assert adopted == "tf32" and verdicts[1][0] == pr.ADOPTED and verdicts[2][0] == pr.OK
    assert pr.judge(rungs, 0.02)[1] == "tf32"  # a float32 job: the rule as before
    # the job's own rung off the loss: the others are judged against float32 alone
    off = [rungs[0], rungs[1], pr.Figures("bfloat16", 2.4, 2.3, 2.6, 0.5)]
    verdicts, adopted = pr.judge(off, 0.02, own="bfloat16")
    assert adopted == "tf32" and verdicts[2][0] == pr.OFF


def test_keeping_the_jobs_own_precision_gains_nothing():
    d = json.loads(json.dumps(RESULT))
    d["precision"]["choice"] |= {"rung": "bfloat16", "adopted": True, "text": "Keep bfloat16 autocast (the job's own "
                                                                              "precision): 2.38x ..."}
    g = estimate("fp8", d, {"message": d["precision"]["choice"]["text"]})
    assert g is not None and g.share == 0.0 and g.kind == "none" and "job's own precision" in g.evidence
    d["precision"]["choice"] |= {"rung": "tf32", "text": "Train in TF32 matmuls: 2.64x ...", "speedup": 2.64}
    assert estimate("fp8", d, {"message": d["precision"]["choice"]["text"]}).share == pytest.approx(1 - 1 / 2.64)


def test_a_bound_is_labelled_analytic_never_measured():
    """Step 1's "raise micro_batch ... up to 70.3%" on the H200 was labelled measured: it is a bound (the compute
    efficiency loss it addresses), never a measured gain."""
    d = json.loads((ROOT / "tests" / "data" / "h200" / "01_baseline_result.json").read_text())
    advice = next(a for a in d["advice"] if a["message"].startswith("Most of the peak is lost"))
    g = estimate("baseline", d, advice)
    assert g.kind == "bound" and g.source == "analytic" and g.share == pytest.approx(0.703, abs=0.001)
    assert g.text == "up to 70.3% of the step" and "compute efficiency loss 70.3%" in g.evidence


def test_the_tuned_job_adopts_neither_tf32_nor_the_slower_float8_policy():
    """The H200 check's small job, judged again: the precision ladder keeps bf16, and the FP8 policy that torchao
    measured at 0.70x of bf16 is listed, not adopted (step 5 chose it on its loss alone)."""
    from mfu_lab.analysis import tuning

    job = Job(**{k: v for k, v in RESULT["job"].items() if k in {f.name for f in dataclasses.fields(Job)}})
    rungs = _rungs()
    d = json.loads(json.dumps(RESULT))
    d["precision"] = {**d["precision"], "choice": ladder.choose(job, rungs, ladder.settle(job, rungs, None))}
    assert d["speed"]["status"] == "ok" and d["speed"]["speedup"] == pytest.approx(0.70, abs=0.01)
    found = tuning.changes(job, {"fp8": d})
    adopted = [(c.key, c.new) for c in found if c.adopted]
    assert adopted == [], adopted
    fp8 = [c for c in found if c.key == "fp8_layers"]
    assert fp8 and not fp8[0].adopted and "measured 0.70x of bf16" in fp8[0].reason
    assert not any(c.key in ("dtype", "matmul_precision") for c in found)  # bf16 is the job's own: no change


def test_figures_name_the_reference_the_ladder_timed_against():
    """Under a budget the ladder's reference is the job's own precision: a float32 job whose bf16 rung was timed
    against float32 says float32, and a bf16 job's tf32 rung timed against bf16 says bf16 (the tuned job's
    evidence and the index's gain), never float32 by default."""
    from mfu_lab.analysis import tuning

    job = Job(dtype="bfloat16")
    choice = {"adopted": True, "rung": "tf32", "dtype": "float32", "matmul_precision": "high", "speedup": 1.3,
              "speedup_low": 1.2, "speedup_high": 1.4, "final_gap": 0.001, "text": "Train in TF32 matmuls: 1.30x"}
    d = {"precision": {"reference": "bfloat16", "choice": choice, "rungs": [{"name": "bfloat16", "own": True}]}}
    found = [c for c in tuning.changes(job, {"fp8": d}) if c.key == "dtype"]
    assert found and "over bfloat16" in found[0].evidence and "from bfloat16" in found[0].evidence
    assert "float32" not in found[0].evidence
    g = estimate("fp8", d, {"message": choice["text"]})
    assert "tf32 against bfloat16" in g.evidence
    del d["precision"]["reference"]  # a result from before the budgeted ladder: float32 was its reference
    assert "tf32 against float32" in estimate("fp8", d, {"message": choice["text"]}).evidence
