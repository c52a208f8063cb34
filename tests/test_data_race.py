"""Step 1's loader race (issue 30 item 4): which loaders run, what is recorded, what tuned.yaml takes.

Nothing here asserts which loader wins: that moves with the machine's load. The race's shape, its pick rule
(the lowest median; adopted only on an interval above 1) and that its workers end with it are asserted."""

from __future__ import annotations

import dataclasses

import psutil
import torch

from mfu_lab.analysis.tuning import changes
from mfu_lab.core.engine.workload import build_model, build_train_step
from mfu_lab.core.job.schema import Job
from mfu_lab.steps.baseline import data_race
from mfu_lab.steps.baseline.data_race import ROUNDS, STEPS_PER_ROUND, candidates, race_loader

TINY = Job(n_layers=1, n_heads=2, d_model=16, seq_len=16, vocab_size=64, micro_batch=2, synthetic_load_ms=20.0)


def test_candidates_start_with_the_jobs_own_loader_and_are_distinct():
    cands = candidates(dataclasses.replace(TINY, num_workers=2), "cpu", cores=2)
    assert cands[0]["num_workers"] == 2
    labels = [data_race.label(c) for c in cands]
    assert len(labels) == len(set(labels))
    assert {c["num_workers"] for c in cands} == {0, 1, 2}
    assert not any(c["pin_memory"] for c in cands)  # pinning is for CUDA copies only
    assert any(c["pin_memory"] for c in candidates(TINY, "cuda", cores=2))


def test_no_race_when_the_data_wait_is_within_the_limit():
    assert race_loader(TINY, None, torch.device("cpu"), "cpu", 0.01, 0.03) == {}


def test_the_race_times_every_loader_alike_and_ends_its_workers(monkeypatch):
    monkeypatch.setattr(data_race, "candidates", lambda job, dt: [data_race.knobs(job),
                        {"num_workers": 1, "prefetch_factor": 2, "pin_memory": False, "persistent_workers": True}])
    model = build_model(TINY)
    ts = build_train_step(TINY, model, "cpu")
    before = {p.pid for p in psutil.Process().children(recursive=True)}
    race = race_loader(TINY, ts, torch.device("cpu"), "cpu", 0.5, 0.03)
    assert race["ran"] and race["reference"] == "num_workers=0"
    assert [r["steps"] for r in race["rows"]] == [ROUNDS * STEPS_PER_ROUND] * 2
    best = min(race["rows"], key=lambda r: r["median_step_s"])
    assert race["pick"] == best["candidate"]
    assert race["adopted"] == (race["pick"] != race["reference"] and race["speedup"]["low"] > 1.0)
    own = race["rows"][0]
    assert own["median_step_s"] >= 0.020  # the in-process loader's steps hold its sleep (20 ms a batch)
    alive = [p for p in psutil.Process().children(recursive=True) if p.pid not in before and p.is_running()
             and p.status() != psutil.STATUS_ZOMBIE]
    assert alive == []  # the persistent workers ended with the race


def race(adopted: bool) -> dict:
    return {"ran": True, "adopted": adopted, "pick": "num_workers=2 prefetch_factor=4",
            "pick_knobs": {"num_workers": 2, "prefetch_factor": 4, "pin_memory": False, "persistent_workers": False},
            "speedup": {"value": 1.5, "low": 1.2 if adopted else 0.9, "high": 1.9}}


def baseline_result(loader_race: dict) -> dict:
    return {"metrics": {"data_wait_fraction": {"value": 0.4}}, "environment": {"device_type": "cpu"},
            "loader_race": loader_race}


def test_tuned_job_takes_a_proven_loader_as_measured():
    got = [c for c in changes(TINY, {"baseline": baseline_result(race(True))}) if c.rung == "data"]
    assert {(c.key, c.new, c.label) for c in got} == {("num_workers", 2, "measured"),
                                                      ("prefetch_factor", 4, "measured")}
    assert all("1.50x [1.20, 1.90]" in c.evidence for c in got)


def test_an_unproven_loader_leaves_the_proposal_and_a_users_own_loader_nothing():
    got = [c for c in changes(TINY, {"baseline": baseline_result(race(False))}) if c.rung == "data"]
    assert [(c.key, c.label) for c in got] == [("num_workers", "proposed")]
    fixed = {"ran": False, "fixed": ["num_workers"], "note": "its own DataLoader"}
    assert [c for c in changes(TINY, {"baseline": baseline_result(fixed)}) if c.rung == "data"] == []


def test_the_notebook_and_the_index_show_the_race_table():
    from mfu_lab.report import loader_race_view

    r = race(True) | {"why": "step 1 measured data wait 40.0%", "method": "m", "reference": "num_workers=0",
                      "rows": [{"candidate": "num_workers=0", "steps": 12, "median_step_s": 0.5,
                                "data_wait_fraction": 0.4},
                               {"candidate": "num_workers=2 prefetch_factor=4", "steps": 12, "median_step_s": 0.3,
                                "data_wait_fraction": 0.02}]}
    html = str(loader_race_view({"loader_race": r}))
    assert "500.0 ms" in html and "300.0 ms" in html and "40.0%" in html and "adopted" in html
    assert "(the job's own)" in html
    assert "No loader race" in str(loader_race_view({"loader_race": {}}))
    fixed = str(loader_race_view({"loader_race": {"ran": False, "why": "w", "note": "its own DataLoader"}}))
    assert "its own DataLoader" in fixed
