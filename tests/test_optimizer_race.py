"""Step 3's optimizer race (issue 46): AdamW's implementations timed side by side on the job, a pick proven faster
carried into tuned.yaml through its own reader and staircase rung, and one not proven (or not raced) said so."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from mfu_lab.analysis import tuning
from mfu_lab.analysis.result_keys import refusal
from mfu_lab.steps.kernels import optimizer_race as orace


def test_fused_and_foreach_are_probed_with_a_real_step():
    assert orace.runs_here("foreach", torch.device("cpu")) is None
    assert orace.runs_here("fused", torch.device("cpu")) is None  # CPU has fused AdamW since torch 2.4
    assert orace.runs_here("default", torch.device("cpu")) is None


def test_the_candidates_put_the_jobs_own_first(tiny_job):
    names, missing = orace.candidates(tiny_job, torch.device("cpu"))
    assert names[0] == tiny_job.adamw_impl and set(names) == {tiny_job.adamw_impl, "foreach", "fused"}
    assert missing == {}
    names, _ = orace.candidates(dataclasses.replace(tiny_job, adamw_impl="fused"), torch.device("cpu"))
    assert names == ["fused", "foreach"]


def test_a_race_that_does_not_fit_the_budget_says_to_set_the_key_by_hand(tiny_job):
    r = orace.race_optimizer(tiny_job, torch.device("cpu"), 0.2, left_s=0.5, step_s=0.1)
    assert r["ran"] is False and "adamw_impl by hand" in r["note"] and "about 4 s" in r["note"]
    assert orace.cost_s(3, 0.1) == pytest.approx(3 * orace.ROUNDS * (orace.STEPS_PER_ROUND + 1) * 0.1)


def test_the_race_times_every_implementation_and_adopts_only_beyond_the_noise(tiny_job):
    job = dataclasses.replace(tiny_job, steps=2, warmup_steps=1)
    said = []
    r = orace.race_optimizer(job, torch.device("cpu"), 0.2, None, 0.01, said.append)
    assert r["ran"] is True and [x["adamw_impl"] for x in r["rows"]] == ["default", "foreach", "fused"]
    assert all(x["steps"] == orace.ROUNDS * orace.STEPS_PER_ROUND for x in r["rows"])
    sp = r["speedup"]
    assert sp["low"] <= sp["value"] <= sp["high"]
    assert r["adopted"] == (r["pick"] != "default" and sp["low"] > 1.0 and r["final_gap"] <= job.loss_tolerance)
    assert any("optimizer race round" in m for m in said)
    # the same seed and batches: the implementations train alike
    losses = [x["final_loss"] for x in r["rows"]]
    assert max(losses) - min(losses) < 1e-3 * abs(losses[0])


def race(adopted: bool, low: float) -> dict:
    return {"optimizer_race": {"ran": True, "adopted": adopted, "pick": "fused", "reference": "default",
                               "speedup": {"value": 1.3, "low": low, "high": 1.5}, "why": "the optimizer step takes "
                               "25.6% of the step"}}


def test_an_adopted_pick_reaches_the_tuned_job_on_its_own_rung(tiny_job):
    chosen = tuning.changes(tiny_job, {"kernels": race(True, 1.1)})
    assert [(c.rung, c.key, c.new, c.label, c.adopted) for c in chosen] == [
        ("optimizer", "adamw_impl", "fused", "measured", True)]
    assert "1.30x [1.10, 1.50]" in chosen[0].evidence
    stairs = tuning.staircase(tiny_job, chosen)
    assert [name for name, _, _ in stairs] == ["original", "optimizer"] and stairs[1][1].adamw_impl == "fused"
    assert tuning.changes(tiny_job, {"kernels": race(False, 0.9)}) == []
    assert refusal("optimizer", "adamw_impl", "fused") is None
    assert refusal("optimizer", "dtype", "bfloat16") is not None  # its row owns adamw_impl only
