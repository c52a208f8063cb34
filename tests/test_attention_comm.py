"""Step 2 end to end: the notebooks through ``mfu-lab run`` on the tiny CPU job, then the result checked."""

import json

import pytest

from mfu_lab.steps.attention_comm.step import AttentionCommResult, _pick
from mfu_lab.workers.comm_configs import bf16_hook_allowed

from .test_e2e import assert_offline


@pytest.mark.e2e
def test_step2_runs_after_step1_and_reports_everything(full_run):
    p, job_root = full_run
    assert p.returncode == 0, p.stderr[-3000:]
    folder = job_root / "02_attention_and_comm"
    d = json.loads((folder / "result.json").read_text())
    r = AttentionCommResult.from_dict(d)
    assert r.baseline["source"].startswith("step 1 result")
    by_name = {a.name: a for a in r.attention}
    # racing (the default): a correct implementation is measured in full or dropped after round 1, with why
    assert {by_name["unfused"].status, by_name["sdpa math"].status} <= {"ok", "dropped"}
    assert all(a.reason for a in r.attention if a.status == "dropped")
    assert r.races["attention"].mode == "racing" and r.races["ddp"].mode == "racing"
    assert "sdpa (torch's choice)" in r.races["attention"].rounds[-1].medians  # the job's own: never dropped
    assert by_name["sdpa efficient"].status == "unavailable" and by_name["sdpa efficient"].reason
    # on a CPU torch's choice is the flash kernel: one training step timed for both, the other said why
    assert by_name["sdpa flash"].status == "same kernel" and "sdpa (torch's choice)" in by_name["sdpa flash"].reason
    assert all("sdpa flash" not in rnd.medians for rnd in r.races["attention"].rounds)
    assert by_name["flash_attn package"].status == "unavailable"
    job_own = by_name["sdpa (torch's choice)"]
    assert job_own.speedup == pytest.approx(1.0)
    for a in r.attention:
        if a.status == "ok":
            assert a.rel_error <= a.tolerance and a.step_median_s > 0
            # n_layers x attention alone / whole step (both measured, so noise can push it past 1 on a busy box)
            assert a.attention_share == pytest.approx(r.job["n_layers"] * r.job["grad_accum"] * a.attn_median_s
                                                      / a.step_median_s)
    statuses = {(c.hook, c.bucket_mb): c.status for c in r.comm}
    problems = [f"{c.hook} {c.bucket_mb}: {c.status}: {c.error}\n{c.stderr}" for c in r.comm
                if c.status not in ("ok", "unsupported", "dropped")]
    assert not problems, "\n".join(problems)
    # a CPU build of torch refuses the bf16 hook before any launch; a CUDA build runs it on gloo too
    assert statuses[("bf16_compress", 25)] in (("ok", "dropped") if bf16_hook_allowed() else ("unsupported",))
    assert statuses[("none", 25)] == "ok"  # DDP's default, the job's own
    # the factor screen: each knob alone from the job's settings, no combination of two changed knobs
    assert statuses[("allreduce", 25)] in ("ok", "dropped") and statuses[("none", 0.05)] in ("ok", "dropped")
    assert ("allreduce", 0.05) not in statuses
    assert all(c.error for c in r.comm if c.status == "dropped")
    assert r.ledger.total == pytest.approx(1.0)
    assert r.ledger.get("structure").fraction >= 0
    assert r.recommendation["attention_text"] and r.recommendation["comm_text"]
    assert r.allreduce and r.metrics["allreduce_busbw_max_gbps"].value > 0
    report = (folder / "report.html").read_text()
    assert "Exposed communication share" in report or "exposed" in report
    assert_offline(report)
    index = (job_root / "index.html").read_text()
    assert "Step 2 · attention and communication" in index and "02_attention_and_comm/report.html" in index
    assert_offline(index)


class Row:
    def __init__(self, median, p10, p90):
        self.step_median_s, self.step_p10_s, self.step_p90_s = median, p10, p90


def test_a_change_is_recommended_only_beyond_the_noise():
    ref = Row(10.0, 9.0, 11.0)
    overlapping = Row(9.5, 8.5, 10.0)  # faster median, but ranges overlap
    clear = Row(7.0, 6.5, 8.0)  # p90 below the reference's p10
    assert _pick([ref, overlapping], ref) is ref
    assert _pick([ref, overlapping, clear], ref) is clear
    assert _pick([overlapping], None) is overlapping
    assert _pick([], ref) is None


def test_lossy_hooks_are_recommended_with_a_warning():
    from mfu_lab.core.job.schema import Job
    from mfu_lab.steps.attention_comm.step import CommRow, _recommend

    row = CommRow("powersgd", 100, False, "ok", step_median_s=1.0, step_p10_s=0.9, step_p90_s=1.1,
                  exposed_share=0.0, mfu=0.5)
    assert "lossy" in _recommend(Job(), None, row, {})["comm_text"]
    row.hook = "allreduce"
    assert "lossy" not in _recommend(Job(), None, row, {})["comm_text"]
    default = CommRow("none", 25, False, "ok", step_median_s=1.0, step_p10_s=0.9, step_p90_s=1.1, exposed_share=0.1,
                      mfu=0.5)
    assert _recommend(Job(), None, default, {})["comm_text"].startswith("Keep DDP's defaults")


def test_one_training_step_is_timed_per_kernel_and_the_jobs_own_row_speaks_for_its_kernel():
    from mfu_lab.steps.attention_comm.attention_race import AttentionRow, _one_per_kernel

    flash, own, math_, unfused = (AttentionRow("sdpa flash", "ok", kernel="flash"),
                                  AttentionRow("sdpa (torch's choice)", "ok", kernel="flash"),
                                  AttentionRow("sdpa math", "ok", kernel="math"),
                                  AttentionRow("unfused", "ok", kernel=""))
    kept = _one_per_kernel([flash, own, math_, unfused], own)
    assert kept == [own, math_, unfused]  # the job's own row times the flash kernel, whatever the order
    assert flash.status == "same kernel" and "sdpa (torch's choice)" in flash.reason
    again, other = AttentionRow("sdpa flash", "ok", kernel="flash"), AttentionRow("flash 2", "ok", kernel="flash")
    assert _one_per_kernel([again, other], None) == [again] and other.status == "same kernel"  # no job row: the first


def test_keeping_the_jobs_own_attention_or_ddps_defaults_is_info_and_a_switch_is_act():
    """'Keep ...' asks nothing of the user, so it is never listed as an action; a switch is."""
    import dataclasses
    from types import SimpleNamespace

    from mfu_lab.core.job.schema import Job
    from mfu_lab.steps.attention_comm.attention_race import AttentionRow
    from mfu_lab.steps.attention_comm.step import CommRow, _recommend, advise

    def severities(att, comm):
        rec = _recommend(Job(), att, comm, {"source": "measured here"})
        r = SimpleNamespace(recommendation=rec, job={"attention": Job().attention}, attention=[], comm=[],
                            comm_layout={}, baseline={"source": "measured here"}, metric=lambda _: None)
        return [(a.message.split(" (", 1)[0].split(":")[0], a.severity) for a in advise(r)]

    own = AttentionRow("sdpa (torch's choice)", "ok", step_median_s=1.0, speedup=1.0, mfu=0.4)
    other = AttentionRow("unfused", "ok", step_median_s=0.8, speedup=1.25, mfu=0.5)
    default = CommRow("none", 25, False, "ok", step_median_s=1.0, step_p10_s=0.9, step_p90_s=1.1, exposed_share=0.1,
                      mfu=0.5)
    bigger = CommRow("none", 100, False, "ok", step_median_s=0.8, step_p10_s=0.75, step_p90_s=0.85,
                     exposed_share=0.05, mfu=0.6)
    assert severities(own, default) == [("Keep the job's attention", "info"), ("Keep DDP's defaults", "info")]
    assert [s for _, s in severities(other, bigger)] == ["act", "act"]
    # a job with buckets of its own (100 MB): DDP's defaults winning is a change, said as one, and act
    job = dataclasses.replace(Job(), ddp_bucket_mb=100.0)
    rec = _recommend(job, None, default, {"source": "measured here"})
    assert rec["comm_text"].startswith("Use DDP's defaults (bucket_cap_mb=25, no hook, gradient_as_bucket_view=False)"
                                       ", not the job's (bucket_cap_mb=100") and rec["comm"]["keep"] is False
    r = SimpleNamespace(recommendation=rec, job={"attention": job.attention}, attention=[], comm=[], comm_layout={},
                        baseline={"source": "measured here"}, metric=lambda _: None)
    assert [a.severity for a in advise(r)] == ["act"]
    assert _recommend(job, None, CommRow("none", 100, False, "ok", step_median_s=1.0, step_p10_s=0.9,
                                         step_p90_s=1.1, exposed_share=0.1, mfu=0.5), {})["comm"]["keep"] is True
    # the ranks' FP8 outcome (workers.ddp_rank's "fp8" event): look when they trained without it, info when in it
    from mfu_lab.core.engine.fp8 import Fp8Applied

    for applied, severity in ((Fp8Applied(("mlp_up",), (), "tensorwise", "a CPU has no FP8 matmul units"), "look"),
                              (Fp8Applied(("mlp_up",), ("blocks.0.mlp.0",), "tensorwise"), "info")):
        r.comm_layout = {"fp8": applied.record()}
        said = [a for a in advise(r) if a.message.startswith("FP8 in the data-parallel ranks: ")]
        assert len(said) == 1 and said[0].severity == severity and applied.text() in said[0].message
