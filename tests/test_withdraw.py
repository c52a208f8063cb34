"""Step 7 withdraws what it did not measure faster (issue 46): a proposed change (step 4's unconfirmed compile
leader, a guessed loader setting) or an FP8 rung whose gain over the rung below is not beyond the noise goes back
to the job's value in tuned.yaml; a proven one stays."""

from __future__ import annotations

from mfu_lab.analysis import tuning
from mfu_lab.steps.verify.rungs import Rung
from mfu_lab.steps.verify.step import withdraw_unproven

LEADER = {"recommendation": {"compile": False, "led": "default", "text": "Stay eager: ..."},
          "trials": [{"mode": "default", "speedup": 1.12}]}


def test_an_unconfirmed_compile_leader_is_proposed_not_thrown_away(tiny_job):
    chosen = tuning.changes(tiny_job, {"compile": LEADER})
    assert [(c.key, c.new, c.label, c.adopted) for c in chosen] == [("compile_mode", "default", "proposed", True)]
    assert "1.12x eager" in chosen[0].evidence and "step 7 times it" in chosen[0].evidence


def rung(name, gain, low, high):
    return Rung(name, {}, "ok", gain=gain, gain_low=low, gain_high=high, proven=low > 1.0 or high < 1.0,
                wall_s=[0.1])


def test_step_7_withdraws_a_proposed_rung_not_faster_and_keeps_a_proven_one(tiny_job):
    chosen = tuning.changes(tiny_job, {"compile": LEADER})
    stairs = tuning.staircase(tiny_job, chosen)
    assert [s[0] for s in stairs] == ["original", "compile"]
    rungs = [Rung("original", {}, "ok", wall_s=[0.1]), rung("compile", 1.02, 0.97, 1.08)]
    assert withdraw_unproven(tiny_job, stairs, rungs, chosen) == {"compile"}
    after = tuning.in_effect(chosen, tiny_job.to_dict())
    assert [c.key for c in after if c.adopted] == []  # back to the job's own compile_mode: nothing left to change
    assert "not faster beyond the noise" in chosen[-1].evidence
    chosen = tuning.changes(tiny_job, {"compile": LEADER})
    rungs[1] = rung("compile", 1.20, 1.10, 1.30)
    assert withdraw_unproven(tiny_job, stairs, rungs, chosen) == set()
    assert [c.new for c in tuning.in_effect(chosen, tiny_job.to_dict())] == ["default"]


def test_a_measured_change_is_not_withdrawn_by_one_noisy_rung(tiny_job):
    kernels = {"optimizer_race": {"ran": True, "adopted": True, "pick": "fused", "reference": "default",
                                  "speedup": {"value": 1.3, "low": 1.1, "high": 1.5}}}
    chosen = tuning.changes(tiny_job, {"kernels": kernels})
    stairs = tuning.staircase(tiny_job, chosen)
    rungs = [Rung("original", {}, "ok", wall_s=[0.1]), rung("optimizer", 1.01, 0.95, 1.07)]
    assert withdraw_unproven(tiny_job, stairs, rungs, chosen) == set()


def test_a_proposed_compile_mode_step_7_cannot_time_within_its_share_is_not_adopted_and_said(tiny_job):
    from mfu_lab.core.process.budget import Clock
    from mfu_lab.steps.verify.step import untimed_proposals

    step4 = LEADER | {"trials": [{"mode": "default", "speedup": 1.12, "compile_cold_s": 20.0}]}
    chosen = tuning.changes(tiny_job, {"compile": step4})
    said = untimed_proposals(tiny_job, chosen, Clock(30.0), step4)  # 30 s left: not twice the 20 s cold compile
    assert not chosen[0].adopted and "about 20 s" in chosen[0].reason and "--budget" in said[0]["reason"]
    assert [s[0] for s in tuning.staircase(tiny_job, chosen)] == ["original"]  # no compile rung to time
    chosen = tuning.changes(tiny_job, {"compile": step4})
    assert untimed_proposals(tiny_job, chosen, Clock(60.0), step4) == [] and chosen[0].adopted
    assert untimed_proposals(tiny_job, chosen, Clock(None), step4) == [] and chosen[0].adopted  # no budget: timed


def test_what_step_7_withdrew_stays_withdrawn_when_tuned_yaml_is_written_again(tiny_job):
    """The runner writes tuned.yaml again from the stored results after step 7. Step 7's withdrawals (a proposed
    compile mode it could not time in its share, or one it timed and found not faster) are in its result and are
    read last: the rewritten file holds what step 7 decided, not step 4's proposal (the default run's tuned.yaml
    once kept an untimed compile_mode: default, '3 adopted of 3', while step 7 said '1 of 2')."""
    from mfu_lab.core.process.budget import Clock
    from mfu_lab.steps.verify.step import untimed_proposals, untimed_reverts

    step4 = LEADER | {"trials": [{"mode": "default", "speedup": 1.12, "compile_cold_s": 20.0}]}
    chosen = tuning.changes(tiny_job, {"compile": step4})
    untimed_proposals(tiny_job, chosen, Clock(30.0), step4)
    stairs = tuning.staircase(tiny_job, chosen)
    chosen += untimed_reverts(tiny_job, chosen)
    assert [s[0] for s in stairs] == ["original"]  # the revert makes no rung of its own
    stored = {"compile": step4, "verify": {"changes": [c.to_dict() for c in chosen]}}
    again = tuning.changes(tiny_job, stored)
    assert [c for c in again if c.adopted and c.key == "compile_mode"] == []
    assert tuning.tuned_job(tiny_job, again).compile_mode == tiny_job.compile_mode == "off"
    # timed and withdrawn: the same on re-reading
    chosen = tuning.changes(tiny_job, {"compile": LEADER})
    stairs = tuning.staircase(tiny_job, chosen)
    rungs = [Rung("original", {}, "ok", wall_s=[0.1]), rung("compile", 1.02, 0.97, 1.08)]
    assert withdraw_unproven(tiny_job, stairs, rungs, chosen) == {"compile"}
    again = tuning.changes(tiny_job, {"compile": LEADER, "verify": {"changes": [c.to_dict() for c in chosen]}})
    assert [c.key for c in again if c.adopted] == [] and not any(c.reason.startswith("refused") for c in again)


def test_a_proposed_rung_that_failed_in_step_7_is_withdrawn_untimed(tiny_job):
    """A proposal is adopted once step 7 times it faster; a rung whose process failed was not timed, so its
    change goes back to the job's value (the tuned file as written would otherwise hold an untimed guess)."""
    chosen = tuning.changes(tiny_job, {"compile": LEADER})
    stairs = tuning.staircase(tiny_job, chosen)
    rungs = [Rung("original", {}, "ok", wall_s=[0.1]), Rung("compile", {}, "failed", "inductor: out of memory")]
    assert withdraw_unproven(tiny_job, stairs, rungs, chosen) == {"compile"}
    assert "rung compile failed (inductor: out of memory): not timed" in chosen[-1].evidence
    assert tuning.tuned_job(tiny_job, chosen).compile_mode == tiny_job.compile_mode


def test_a_cuda_graph_mode_beside_fsdp2_with_accumulation_from_another_step_is_not_adopted(tiny_job):
    """Step 4 may pick reduce-overhead on a DDP job, and step 2 or 6 FSDP2: together, with accumulation, the tuned
    job's layout check would refuse them on CUDA. Step 7 leaves the compile mode out and says why."""
    import dataclasses

    from mfu_lab.steps.verify.step import graphs_clash, untimed_reverts

    job = dataclasses.replace(tiny_job, grad_accum=2)
    leader = {"recommendation": {"compile": True, "mode": "reduce-overhead"},
              "trials": [{"mode": "reduce-overhead", "speedup": 1.3}]}
    chosen = tuning.changes(job, {"compile": leader}) + [
        tuning.Change("layout", "placement", "dp_mode", "ddp", "fsdp", "step 6", "measured")]
    assert graphs_clash(job, chosen, "cpu") == []  # no CUDA graphs on a CPU
    said = graphs_clash(job, chosen, "cuda")
    (mode,) = [c for c in chosen if c.key == "compile_mode"]
    assert not mode.adopted and said[0]["reason"].startswith("'reduce-overhead' captures CUDA graphs, and with "
                                                             "dp_mode 'fsdp' and grad_accum 2")
    reverts = untimed_reverts(job, chosen)  # recorded, so that tuned.yaml written again from the results holds it
    assert [(c.key, c.new) for c in reverts] == [("compile_mode", job.compile_mode)]
    assert graphs_clash(job, tuning.changes(job, {"compile": leader}), "cuda") == []  # without FSDP2: nothing refused
    # the job's own mode captures graphs too: taking step 4's back does not help, and the entry says so
    own = dataclasses.replace(job, compile_mode="reduce-overhead")
    other = {"recommendation": {"compile": True, "mode": "max-autotune"}, "trials": [{"mode": "max-autotune",
                                                                                     "speedup": 1.4}]}
    chosen = tuning.changes(own, {"compile": other}) + [
        tuning.Change("layout", "placement", "dp_mode", "ddp", "fsdp", "step 6", "measured")]
    said = graphs_clash(own, chosen, "cuda")
    assert said[-1]["what"] == "the tuned file on CUDA" and "will refuse it" in said[-1]["reason"]


def test_an_mfu_ratio_outside_the_speedups_interval_is_explained_in_the_headline():
    """One 40 ms step among 2.7 ms ones: the median speedup is 1.2x, the total-wall MFU falls. The headline says
    why (MFU counts the total wall time, the speedup the median) and names the rung with the slow step; when the
    two agree it adds nothing."""
    from mfu_lab.steps.verify import staircase

    before = Rung("original again", {}, "ok", dtype="float32", peak_flops_per_s=1e12, wall_s=[0.0032] * 9 + [0.004])
    after = Rung("tuned as written", {}, "ok", dtype="float32", peak_flops_per_s=1e12,
                 wall_s=[0.0027] * 9 + [0.0405])
    staircase.speedups([before, after], "original again")
    flops = 1e7  # per step: MFU = flops x steps / (peak x total wall)
    before.mfu, after.mfu = (flops * len(r.wall_s) / (1e12 * sum(r.wall_s)) for r in (before, after))
    assert after.mfu < before.mfu and after.speedup > 1.1
    text = staircase.headline(before, after, [before, after], {"status": "ok"})["text"]
    assert f"the MFUs' ratio ({after.mfu / before.mfu:.2f}x) is outside the speedup's interval" in text
    assert "the tuned job's mean step is" in text and "its slowest 40.5 ms against a median of 2.7 ms" in text
    mfu = after.mfu
    after.mfu = mfu * 0.9  # the tuned rung counted fewer FLOPs per step: its MFU is not its wall time's to explain
    assert "outside the speedup's interval" not in staircase.headline(before, after, [before, after], {})["text"]
    after.mfu = mfu
    before.wall_s = [0.0032 * (1 + 0.01 * ((i * 7) % 5 - 2)) for i in range(10)]  # +-2% noise, no outlier
    after.wall_s = [0.0027 * (1 + 0.01 * ((i * 3) % 5 - 2)) for i in range(10)]
    staircase.speedups([before, after], "original again")
    before.mfu, after.mfu = (flops * len(r.wall_s) / (1e12 * sum(r.wall_s)) for r in (before, after))
    assert "outside the speedup's interval" not in staircase.headline(before, after, [before, after], {})["text"]
