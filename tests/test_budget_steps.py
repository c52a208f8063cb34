"""--budget bounds steps 3, 6 and 7 too (issue 34): what each keeps and leaves out, against the stated estimates."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from types import SimpleNamespace

import pytest

from mfu_lab.core.job.schema import load_job
from mfu_lab.core.process import budget
from mfu_lab.core.process.budget import Clock, fit_count, fit_kernels, fit_verify, job_step_s
from mfu_lab.steps.placement import layouts as placement_layouts
from mfu_lab.steps.placement.step import coloc_job

from .conftest import TINY

STEP = (0.5, "step 1's median step 500 ms (measured)")


def _job(**kw):
    return dataclasses.replace(load_job(TINY), **kw)


def test_fit_count_keeps_what_ends_inside_the_time_left():
    assert fit_count(None, 20, 1.0) == 20  # no budget: everything
    assert fit_count(10.0, 20, 1.0, fixed_s=2.0) == 8
    assert fit_count(1.0, 20, 1.0, fixed_s=2.0, least=3) == 3  # never below the least
    assert fit_count(100.0, 5, 1.0) == 5  # never above what is wanted
    assert fit_count(1.0, 2, 1.0, least=3) == 2


def test_the_job_step_comes_from_step_1_or_says_it_is_the_reference():
    s, where = job_step_s({"metrics": {"step_time_median_s": {"value": 0.25}}})
    assert s == 0.25 and "250 ms" in where and "measured" in where
    s, where = job_step_s(None)
    assert s == budget.REFERENCE_STEP_S and "no step-1 result" in where


def test_weights_are_the_measured_default_run():
    assert budget.WEIGHTS == {"baseline": 16, "attention_comm": 121, "kernels": 37, "compile": 133, "fp8": 105,
                              "placement": 112, "verify": 98}
    for k, v in budget.WEIGHTS.items():  # the rule is stated with the same figures it uses
        assert f"{v} s" in budget.__doc__, k


def test_step3_without_a_budget_changes_nothing():
    job = _job(steps=20, profile_ddp=True)
    assert fit_kernels(job, Clock(None), STEP) == (job, True)


def test_step3_under_a_budget_keeps_the_profile_then_3_timed_steps_then_the_rank_traces():
    job = _job(steps=20, warmup_steps=3, profile_warmup_steps=2, profile_steps=3, profile_ddp=True)
    profiled = 1.5 * 0.5 * 5 + 5.0  # 8.75 s
    ranks = 10.0 + 2 * profiled  # 27.5 s
    clock = Clock(profiled + ranks + 0.5 * 6 + 0.01)  # the traces and 5 timed steps after 1 warm-up
    timed, with_ddp = fit_kernels(job, clock, STEP)
    assert with_ddp and timed.steps == 5 and timed.warmup_steps == 1
    assert [c["what"] for c in clock.shortened] == ["unprofiled steps"]
    assert "5 of the job's 20" in clock.shortened[0]["reason"] and "500 ms" in clock.shortened[0]["reason"]
    tight = Clock(profiled + 0.5 * 4 + 1.0)  # no room for the traces: they go, the 3 timed steps stay
    timed, with_ddp = fit_kernels(job, tight, STEP)
    assert not with_ddp and timed.steps >= 3
    assert tight.shortened[0]["what"] == "per-rank profile" and tight.shortened[0]["reason"].startswith("budget:")


def test_step6_coloc_steps_fit_a_third_of_the_share_and_at_least_three():
    job = _job(coloc_steps=8, warmup_steps=3)
    assert coloc_job(job, Clock(None), STEP) is job
    each = 4 * 0.5
    clock = Clock(3 * (2 * 6.0 + each + 5 * each) + 0.3)  # a third of it holds 5 steps
    c = coloc_job(job, clock, STEP)
    assert c.coloc_steps == 5 and c.warmup_steps == 1
    assert clock.shortened[0]["what"] == "co-location steps" and "5 of coloc_steps 8" in clock.shortened[0]["reason"]
    assert coloc_job(job, Clock(1.0), STEP).coloc_steps == 3


def test_step6_budget_keeps_the_job_own_layout_then_one_of_each_family(monkeypatch, tmp_path: Path):
    job = _job(nproc_per_node=2, n_heads=4, n_layers=4, micro_batch=8, pp_microbatches=4)
    items = placement_layouts.node_layouts(2, 4, 4, 8, 4)
    names = [it["name"] for it in items]
    order = [it["name"] for it in placement_layouts.budget_order(dataclasses.replace(job, dp_mode="fsdp"), items)]
    assert order[0] == "fsdp2"  # the job's own first
    assert order[1:4] == ["ddp2", "tp2", next(n for n in names if n.startswith("pp"))]
    assert sorted(order) == sorted(names)
    seen = {}

    def fake(job, device_type, work, items, **kw):
        seen["names"] = [it["overrides"] for it in items]
        raise RuntimeError("stop here")  # the selection is what is tested; the launch is tested elsewhere

    monkeypatch.setattr(placement_layouts, "run_layouts", fake)
    each = placement_layouts.layout_seconds(job, STEP[0])
    assert each == pytest.approx((2 * placement_layouts.CHECK_STEPS + job.comm_warmup_steps + job.comm_steps
                                  + placement_layouts.REBUILD_STEPS) * 2 * 0.5)
    monkeypatch.setattr(placement_layouts, "job_facts", lambda *a: None)
    with pytest.raises(RuntimeError, match="stop here"):
        placement_layouts.measure_layouts(job, "cpu", tmp_path, None, None, None, 3 * each + 0.1, STEP)
    # ddp2 (the job's own), fsdp2, tp2
    assert [(o["dp_mode"], o["tp"], o["pp"]) for o in seen["names"]] == [("ddp", 1, 1), ("fsdp", 1, 1), ("ddp", 2, 1)]


def test_step6_layout_budget_is_said_in_about(monkeypatch, tmp_path: Path):
    job = _job(nproc_per_node=2, n_heads=4, n_layers=4, micro_batch=8, pp_microbatches=4)
    monkeypatch.setattr(placement_layouts, "run_layouts", lambda job, dt, work, items, **kw: [
        SimpleNamespace(to_dict=lambda: {"status": "failed", "reason": "x"}, notes=[], threads_per_rank=1,
                        loss_check=None) for _ in items])
    monkeypatch.setattr(placement_layouts, "job_facts", lambda *a: None)
    monkeypatch.setattr(placement_layouts, "layout_entry", lambda d, *a: {"status": d["status"]})
    entries, about = placement_layouts.measure_layouts(job, "cpu", tmp_path, None, None, None, 1.0, STEP)
    assert len(entries) == 1 and about["layouts"] == 1  # the job's own layout at least
    assert about["budget"].startswith(f"{len(placement_layouts.node_layouts(2, 4, 4, 8, 4)) - 1} layout(s) not "
                                      "measured") and "500 ms" in about["budget"]


def test_step7_rounds_fit_the_share_never_below_two():
    job = _job(verify_rounds=10, verify_steps=4, verify_warmup_steps=3, comm_warmup_steps=1)
    assert fit_verify(job, Clock(None), STEP, 3, True, False) is job

    def need(r, rungs=3, layout=False):
        return rungs * (5 + 3 * 0.5 + r * 4 * 0.5) + (10 + min(r, 3) * 2 * 19 * 2 * 0.5 if layout else 0.0)

    clock = Clock(need(6) + 0.5)
    assert fit_verify(job, clock, STEP, 3, False, False).verify_rounds == 6
    assert "6 of verify_rounds 10" in clock.shortened[0]["reason"]
    assert fit_verify(job, Clock(1.0), STEP, 3, False, False).verify_rounds == 2
    assert fit_verify(job, Clock(1.0), STEP, 1, True, False).verify_rounds == 1  # the layout check alone
    assert fit_verify(job, Clock(need(10, layout=True) + 1), STEP, 3, True, False) is job
    # step 7's second turn kept back: the rounds fit what is left after it, and the shortening says so
    clock = Clock(need(6) + 30.5)
    assert fit_verify(job, clock, STEP, 3, False, False, (30.0, "about 30 s kept for the second turn")) \
        .verify_rounds == 6
    assert clock.shortened[0]["reason"].endswith("; about 30 s kept for the second turn)")


def test_step7_keeps_room_for_its_second_turn_only_when_a_rung_it_may_withdraw_has_a_timed_rung_above(tiny_job):
    from mfu_lab.analysis import tuning
    from mfu_lab.steps.verify import retime
    from mfu_lab.steps.verify.rungs import Rung
    from mfu_lab.steps.verify.step import withdrawable

    data = tuning.Change("data", "baseline", "num_workers", 0, 2, "step 1", "proposed")
    fused = tuning.Change("optimizer", "kernels", "adamw_impl", "default", "fused", "step 3", "measured")
    stairs = [("original", tiny_job, []), ("data", tiny_job, [data]), ("optimizer", tiny_job, [fused])]
    rungs = [Rung(n, {}, "ok") for n, _, _ in stairs]
    jobs = [j for _, j, _ in stairs]
    s, why = retime.reserve(tiny_job, stairs, rungs, jobs, withdrawable, 0.5, None)
    assert s == retime.need_s(tiny_job, tiny_job, 0.5, 2, None) > 0 and "should rung data be withdrawn" in why
    # the proposed rung on top: its withdrawal leaves the rung below as the tuned job, nothing to time again
    assert retime.reserve(tiny_job, stairs[::2] + stairs[1:2], rungs[::2] + rungs[1:2], jobs, withdrawable, 0.5,
                          None) == (0.0, "")
    rungs[2].status = "excluded"  # nothing timed above it
    assert retime.reserve(tiny_job, stairs, rungs, jobs, withdrawable, 0.5, None) == (0.0, "")
    # but an attention re-check above it holds it too: room kept
    rungs.append(Rung("attention at bfloat16", {}, "ok", challenger=True))
    assert retime.reserve(tiny_job, stairs, rungs, jobs + [tiny_job], withdrawable, 0.5, None)[0] > 0


def test_step2_screens_the_references_then_as_many_as_fit_half_the_time_left(tmp_path: Path):
    from mfu_lab.steps.attention_comm.comm_race import name, screen_fit
    from mfu_lab.workers.comm_configs import screened_configs

    job = _job(out_dir=str(tmp_path), comm_warmup_steps=1, race_steps=2)
    configs = screened_configs(job, {"hook": "none", "bucket_mb": 25.0, "grad_as_bucket_view": False})
    refs = [name(configs[-1])]
    assert screen_fit(job, configs, refs, Clock(None)) == (configs, [])
    each = (1 + 2 + 1) * 2 * budget.REFERENCE_STEP_S  # no step-1 result in tmp_path: the reference step
    ref_s = (2 * (1 + job.comm_steps) + 1) * 2 * budget.REFERENCE_STEP_S  # the reference in full, first
    clock = Clock(2 * (10.0 + ref_s + 2 * each) + 0.1)
    kept, cut = screen_fit(job, configs, refs, clock)
    assert [name(c) for c in kept][0] == refs[0] and len(kept) == 3 and len(cut) == len(configs) - 3
    assert all(why.startswith("budget: not screened") and "no step-1 result" in why for _, why in cut)
    assert "the references in full" in cut[0][1]
    kept, _ = screen_fit(job, configs, refs, Clock(2 * (10.0 + 3 * each) + 0.1))  # screening cost alone: too little
    assert len(kept) < 3
    assert clock.shortened[0]["what"] == "DDP first round"
    kept, _ = screen_fit(job, configs, refs, Clock(0.0))
    assert [name(c) for c in kept] == refs  # the references always


def test_step4_times_fewer_steps_so_eager_and_one_mode_fit():
    from mfu_lab.core.process.budget import COLD_COMPILE_S, TRIAL_START_S, fit_compile

    job = _job(steps=20, compile_warmup_steps=2)
    assert fit_compile(job, Clock(None), STEP) == 20
    fixed = 2 * (TRIAL_START_S + (2 + 3) * 0.5) + COLD_COMPILE_S  # 55 s before any timed step
    clock = Clock(fixed + 6 * 2 * 0.5 + 0.1)
    assert fit_compile(job, clock, STEP) == 6
    assert "6 of the job's 20" in clock.shortened[0]["reason"] and "the default job's" in clock.shortened[0]["reason"]
    earlier = {"trials": [{"compile_cold_s": 10.0}, {"compile_cold_s": None}]}  # this job's own cold compile
    longer = _job(steps=40, compile_warmup_steps=2)  # 20 s less of compile: 20 more steps of 1 s (eager + mode)
    assert fit_compile(longer, Clock(fixed + 6 * 2 * 0.5 + 0.1), STEP, earlier) == 6 + 20
    assert fit_compile(job, Clock(1.0), STEP) == 3


def test_in_a_run_each_step_gets_its_weight_of_what_the_run_has_left(monkeypatch):
    """The runner's LEFT_ENV rolls the shares: at the run's start they equal the plan; a step that overran leaves
    the later ones less, by the weights of those still to run; a stale or foreign value falls back to the plan."""
    keys = list(budget.WEIGHTS)
    p = budget.plan(6.0)
    monkeypatch.setenv(budget.LEFT_ENV, budget.left_env(6.0, keys, 0.0, "baseline"))
    assert budget.share_s(6.0, "baseline") == pytest.approx(p["baseline"], abs=0.01)
    # step 5 next, after the run used 30 s more than the plan of steps 1-4 with their notebooks
    used = sum(p[k] + budget.STEP_OVERHEAD_S for k in keys[:4]) + 30.0
    monkeypatch.setenv(budget.LEFT_ENV, budget.left_env(6.0, keys, used, "fp8"))
    rest = keys[4:]
    expect = (sum(p[k] for k in rest) - 30.0) * budget.WEIGHTS["fp8"] / sum(budget.WEIGHTS[k] for k in rest)
    assert budget.share_s(6.0, "fp8") == pytest.approx(expect, abs=0.01)
    assert budget.share_s(6.0, "fp8") < p["fp8"]
    assert Clock.for_step(SimpleNamespace(budget_min=6.0), "fp8").planned_s == pytest.approx(expect, abs=0.01)
    assert budget.share_s(6.0, "compile") == p["compile"]  # the value is step 5's: another step takes the plan
    assert budget.share_s(0.0, "fp8") is None
    # a run of two steps: the first keeps the share it has alone
    monkeypatch.setenv(budget.LEFT_ENV, budget.left_env(6.0, ["kernels", "verify"], 0.0, "kernels"))
    assert budget.share_s(6.0, "kernels") == pytest.approx(p["kernels"], abs=0.01)


def test_a_run_leaves_no_budget_left_behind(tmp_path: Path, monkeypatch):
    """The runner sets LEFT_ENV for each step's kernel and removes it when the run ends, failed or not."""
    import os

    from mfu_lab import runner
    from mfu_lab.core.registry import BY_KEY

    seen = []

    def fake_step(info, job, *a, **k):
        seen.append(os.environ.get(budget.LEFT_ENV))
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(runner, "execute_step", fake_step)
    job = load_job(TINY, {"out_dir": str(tmp_path), "budget_min": 6.0})
    runner.run_steps(job, str(TINY), [BY_KEY["kernels"], BY_KEY["verify"]], keep_going=True)
    assert [s.split(";")[1] for s in seen] == ["kernels,verify", "verify"]
    assert budget.LEFT_ENV not in os.environ


def test_step3_lists_a_budget_cut_once(tmp_path: Path):
    """Step 3 under a budget too small for the per-rank traces: its skipped list names them once, as the budget's
    cut (it listed them twice before)."""
    from mfu_lab.steps.kernels import step as kernels

    job = _job(out_dir=str(tmp_path), budget_min=0.5, profile_ddp=True, steps=3, warmup_steps=1)
    r = kernels.run(job, progress=lambda m: None, write=False)
    cut = [s for s in r.skipped if s["what"] == "per-rank profile"]
    assert len(cut) == 1 and cut[0]["reason"].startswith("budget: ")
    assert r.ddp["status"] == "skipped" and r.ddp["reason"] == cut[0]["reason"]


@pytest.mark.parametrize("planned", [None, 0.0])
def test_step2_attention_final_round_takes_half_of_the_share_left(planned):
    """Without a budget every finalist runs the job's steps; with one, the final round fits half of what is left
    (the other half is the DDP race's): the leader and the job's own attention only, fewer steps, at least
    FINAL_LEAST, each cut said."""
    from mfu_lab.core.measure import device as dev
    from mfu_lab.core.process.progress import Progress
    from mfu_lab.steps.attention_comm import attention_race

    job = _job(steps=12, warmup_steps=1, race_steps=2)
    device = dev.resolve_device("cpu")
    clock = Clock(planned)
    lines: list[str] = []
    rows, log = attention_race.attention_section(job, device, device.torch_device, 1e9, 1e11,
                                                 Progress(lines.append, bar=False), clock)
    final = log.rounds[-1]
    ran = [r for r in rows if r.status == "ok"]
    if planned is None:
        assert final.steps == 12 and not clock.shortened
        return
    assert final.steps == attention_race.FINAL_LEAST and len(ran) <= 2
    cut = {s["what"]: s["reason"] for s in clock.shortened}
    assert "half of step 2's" in cut["attention final steps"] and f"{attention_race.FINAL_LEAST} of the job's 12" in \
        cut["attention final steps"]
    assert any(f": {attention_race.FINAL_LEAST} steps" in ln for ln in lines)
