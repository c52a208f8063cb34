"""Issue 29, item 4: tuned.yaml proposes a layout measured faster beyond the noise (step 6's layouts, step 2's FSDP2
pick) with its evidence, and step 7 verifies it under torchrun beside the original job."""

import dataclasses
from types import SimpleNamespace

import pytest

from mfu_lab.analysis import tuned_file, tuning
from mfu_lab.analysis.layouts.proposal import faster_layout, is_own_layout, layout_keys
from mfu_lab.core.job.schema import load_job

TINY = "tests/data/tiny.yaml"


def _job():
    return load_job(TINY)


def _entry(name, median, p10=None, p90=None, status="ok"):
    term = {"term": "step_time_s", "model": None, "observed": median, "ratio": None, "source": "measured"}
    if p10 is not None:
        term |= {"p10": p10, "p90": p90}
    return {"layout": name, "status": status,
            "terms": [{"term": "p2p_sends", "model": 16, "observed": 12, "ratio": 0.75, "source": "counted"}, term]}


def _placement(*layouts):
    return {"layouts": list(layouts), "job": {}}


def test_layout_names_read_as_job_keys():
    assert layout_keys("fsdp2-noreshard") | {} == layout_keys("fsdp2") | {"fsdp_reshard_after_forward": False}
    k = layout_keys("pp2-interleaved_1f1b-v2-m4")
    assert (k["pp"], k["pp_schedule"], k["pp_virtual_stages"], k["pp_microbatches"]) == (2, "interleaved_1f1b", 2, 4)
    k = layout_keys("tp2-fsdp4")
    assert (k["tp"], k["dp_mode"]) == (2, "fsdp") and layout_keys("tp2-sp")["sp"] is True
    assert layout_keys("cp2") is None  # not understood: never proposed
    assert is_own_layout(_job(), "ddp2") and not is_own_layout(_job(), "fsdp2")


def test_tuned_yaml_proposes_a_layout_faster_beyond_the_noise_with_its_evidence():
    job = _job()
    results = {"placement": _placement(_entry("ddp2", 0.100, 0.098, 0.102), _entry("fsdp2", 0.080, 0.078, 0.082),
                                       _entry("tp2", 0.060, 0.059, 0.061, status="failed"),
                                       _entry("pp2-1f1b-m4", 0.120, 0.118, 0.125))}
    chosen = tuning.changes(job, results)
    assert {c.key: c.new for c in chosen} == {"dp_mode": "fsdp"}  # reshard stays the job's (true)
    c = chosen[0]
    assert c.rung == "layout" and c.step == "placement" and c.adopted and c.label == "measured"
    mb = job.micro_batch  # world unknown here: the same data-parallel degree, compared per sample
    assert "fsdp2" in c.evidence and f"{80 / mb:.1f} ms per sample" in c.evidence
    assert f"ddp2 {100 / mb:.1f} ms" in c.evidence
    text = tuned_file.tuned_yaml(job, chosen, "tests/data/tiny.yaml", overrides={})
    line = next(ln for ln in text.splitlines() if ln.startswith("dp_mode:"))
    assert line.startswith("dp_mode: fsdp  # layout, step 6: layout fsdp2") and "was ddp" in line
    stairs = [name for name, _, _ in tuning.staircase(job, chosen)]
    assert stairs == ["original", "layout"]


@pytest.mark.parametrize("other", [(0.099, 0.090, 0.110), (0.130, 0.125, 0.135)], ids=["within noise", "slower"])
def test_a_slower_or_within_noise_layout_is_not_proposed(other):
    job = _job()
    results = {"placement": _placement(_entry("ddp2", 0.100, 0.095, 0.105), _entry("fsdp2-noreshard", *other))}
    assert tuning.changes(job, results) == []
    # without a recorded spread, the race's noise floor (3%) decides on the medians
    near = {"placement": _placement(_entry("ddp2", 0.100), _entry("fsdp2", 0.098))}
    assert faster_layout(job, near["placement"]["layouts"]) is None
    far = faster_layout(job, [_entry("ddp2", 0.100), _entry("fsdp2", 0.090)])
    assert far["changes"] == {"dp_mode": "fsdp"} and "noise floor" in far["rule"]


def test_layouts_of_another_data_parallel_degree_are_compared_per_sample_at_the_jobs_samples_per_step():
    job = dataclasses.replace(_job(), micro_batch=4)
    # on 2 ranks ddp2 trains 8 samples a step, tp2 and pp2 4: tp2's 0.090 s is slower per sample than ddp2's 0.100
    assert faster_layout(job, [_entry("ddp2", 0.100), _entry("tp2", 0.090)], world=2) is None
    assert faster_layout(job, [_entry("ddp2", 0.100), _entry("tp2", 0.090)]) is None  # world unknown: not compared
    far = faster_layout(job, [_entry("ddp2", 0.100), _entry("tp2", 0.040)], world=2)
    assert far["changes"] == {"tp": 2, "micro_batch": 8}  # the job's 8 samples a step, on one data-parallel rank
    assert far["speedup"] == pytest.approx((0.100 / 8) / (0.040 / 4))
    odd = dataclasses.replace(job, micro_batch=3)  # pp2 with 4 micro-batches cannot take 6 samples: not proposed
    assert faster_layout(odd, [_entry("ddp2", 0.100), _entry("pp2-1f1b-m4", 0.010)], world=2) is None


def _step2(reduce="bfloat16", gap=1e-6):
    keys = {"dp_mode": "fsdp", "fsdp_reshard_after_forward": False, "fsdp_prefetch": 1, "fsdp_reduce_dtype": reduce}
    name = f"fsdp reshard=false prefetch=1 reduce={reduce}"
    return {"job": {}, "recommendation": {"comm": {"kind": "fsdp", "hook": name, "bucket_cap_mb": 0.0,
                                                   "gradient_as_bucket_view": False, "job_keys": keys}},
            "comm": [{"hook": "none", "bucket_mb": 25.0, "grad_as_bucket_view": False, "step_median_s": 0.2},
                     {"hook": name, "bucket_mb": 0.0, "grad_as_bucket_view": False, "step_median_s": 0.1,
                      "loss_gap": gap, "kind": "fsdp"}]}


def test_step_2s_fsdp_pick_is_a_layout_change_and_step_6s_pick_replaces_it():
    job = _job()
    chosen = tuning.changes(job, {"attention_comm": _step2()})
    assert {c.key: c.new for c in chosen} == {"dp_mode": "fsdp", "fsdp_reshard_after_forward": False,
                                              "fsdp_prefetch": 1, "fsdp_reduce_dtype": "bfloat16"}
    assert all(c.rung == "layout" and c.lossy and c.adopted and "within loss_tolerance" in c.reason for c in chosen)
    assert "100.0 ms against DDP's defaults' 200.0 ms" in chosen[0].evidence
    tuning.tuned_job(job, chosen)  # validates
    both = tuning.changes(job, {"attention_comm": _step2(), "placement": _placement(
        _entry("ddp2", 0.100, 0.098, 0.102), _entry("tp2", 0.020, 0.019, 0.021)) | {"layouts_run": {"world": 2}}})
    assert {c.key: c.new for c in both} == {"tp": 2, "micro_batch": 2 * job.micro_batch}


def test_step7_verifies_a_layout_change_side_by_side_under_torchrun(monkeypatch, tmp_path):
    from mfu_lab.steps.verify import layout as verify_layout
    from mfu_lab.steps.verify.ddp import UNDER_TORCHRUN, torchrun_reason

    job = dataclasses.replace(_job(), verify_rounds=3)
    chosen = tuning.changes(job, {"placement": _placement(_entry("ddp2", 0.100, 0.098, 0.102),
                                                          _entry("fsdp2", 0.080, 0.078, 0.082))})
    seen = {}

    def fake_runs(job, device_type, work, items, progress=None, steps=None):
        seen["items"] = items
        return [SimpleNamespace(status="ok", reason="", losses=[5.0, 4.9],
                                layout={"name": "FSDP2" if it["overrides"] else "DDP2"},
                                step_times_s=[[0.08, 0.081, 0.079] if it["overrides"] else [0.1, 0.101, 0.099]] * 2)
                for it in items]

    monkeypatch.setattr(verify_layout, "run_layouts", fake_runs)
    r = verify_layout.verify_layout_change(job, "cpu", chosen, tmp_path, lambda *a: None)
    assert [it["overrides"] for it in seen["items"]] == [{}, {"dp_mode": "fsdp"}, {"dp_mode": "fsdp"}, {}, {},
                                                         {"dp_mode": "fsdp"}]  # ABBA, one launch
    assert r["status"] == "ok" and r["proven"] and r["speedup"] > 1 and r["loss_ok"]
    assert "DDP2 -> FSDP2" in r["text"] and "faster" in r["text"]
    rung = SimpleNamespace(name="layout", reason=UNDER_TORCHRUN["layout"])
    assert "faster" in torchrun_reason(rung, {"status": "skipped", "layout": r})
    none = verify_layout.verify_layout_change(job, "cpu", [], tmp_path, lambda *a: None)
    assert none["status"] == "skipped"


def test_step7_withdraws_a_layout_it_does_not_find_faster(monkeypatch, tmp_path):
    from mfu_lab.steps.verify import layout as verify_layout

    job = dataclasses.replace(_job(), verify_rounds=2)
    chosen = tuning.changes(job, {"placement": _placement(_entry("ddp2", 0.100, 0.098, 0.102),
                                                          _entry("fsdp2", 0.080, 0.078, 0.082))})
    monkeypatch.setattr(verify_layout, "run_layouts", lambda job, dt, work, items, **k: [SimpleNamespace(
        status="ok", reason="", losses=[5.0], layout={"name": "x"},
        step_times_s=[[0.12, 0.121, 0.119] if it["overrides"] else [0.1, 0.101, 0.099]]) for it in items])
    r = verify_layout.verify_layout_change(job, "cpu", chosen, tmp_path, lambda *a: None)
    assert r["withdrawn"] and "slower" in r["text"]
    stored = {"placement": _placement(_entry("ddp2", 0.100, 0.098, 0.102), _entry("fsdp2", 0.080, 0.078, 0.082)),
              "verify": {"changes": [c.to_dict() for c in chosen]}}
    assert tuning.changes(job, stored) == []  # tuned.yaml, written again after step 7, keeps the job's layout
    # read as a withdrawal: the runner's last line ("step 7 took back dp_mode") and the staircase plot count it
    assert [c.key for c in tuning.withdrawals(stored["verify"])] == ["dp_mode"]
    before = {**stored, "verify": {"changes": [{**c, "reason": "the proposed layout is withdrawn: not verified faster "
                                                 "beside the original"} if c["step"] == "verify" else c
                                           for c in stored["verify"]["changes"]]}}  # a result of before 2026-12-08
    assert [c.key for c in tuning.withdrawals(before["verify"])] == ["dp_mode"] and tuning.changes(job, before) == []
    # the index's summary counts what tuned.yaml holds: the proposal and its withdrawal are not adopted changes
    assert len(stored["verify"]["changes"]) > 0
    stored["verify"]["job"] = job.to_dict()
    from mfu_lab.report.summary import headline, standing

    assert standing(stored["verify"]) == []
    told = [line for line in headline(stored, {}) if line.startswith("tuned.yaml adopts")]
    assert told == ["tuned.yaml adopts 0 of 0 recommended change(s) (step 7)."]
