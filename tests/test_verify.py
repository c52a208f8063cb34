"""Step 7 (verify) and the tuned job: changes from the steps' results, tuned.yaml, the staircase, side by side."""

import dataclasses
import json
import statistics

import pytest

from mfu_lab.analysis import tuned_file, tuning
from mfu_lab.core.errors import JobError
from mfu_lab.core.job.schema import load_job
from mfu_lab.core.measure.sidebyside import bootstrap_speedup, interleave

from .conftest import in_process


# ------------------------------------------------------------------ results as the steps store them
def step2(attention="unfused", hook="none", bucket=25, view=False):
    return {"recommendation": {"attention": attention, "job_fragment": {"attention": attention},
                               "comm": {"hook": hook, "bucket_cap_mb": bucket, "gradient_as_bucket_view": view}},
            "attention": [{"name": attention, "speedup": 1.2}], "comm": []}


def step4(compile_=True, mode="default"):
    return {"recommendation": {"compile": compile_, "mode": mode, "break_even_cold": 40.0},
            "trials": [{"mode": mode, "speedup": 1.3}]}


def step5(dtype="bfloat16", adopted=True, groups=("mlp_up",)):
    return {"precision": {"choice": {"dtype": dtype, "matmul_precision": "highest", "rung": dtype, "adopted": adopted,
                                     "speedup": 1.8, "speedup_low": 1.6, "speedup_high": 2.0, "final_gap": 0.004}},
            "choice": {"groups": list(groups), "recipe": "tensorwise"}, "path": "emulated",
            "metrics": {"chosen_final_gap": {"value": 0.01}}}


def step1(data_wait=0.01):
    return {"metrics": {"data_wait_fraction": {"value": data_wait}}, "environment": {"device_type": "cpu"}}


ALL = {"baseline": step1(0.2), "attention_comm": step2(), "compile": step4(), "fp8": step5()}
FP8_TIMED = {"path": "fp8 hardware", "speed": {"status": "ok", "speedup": 1.3}}  # step 5 on FP8 units, timed faster


def test_every_recommendation_becomes_a_change_in_the_staircase_order(tiny_job):
    chosen = tuning.changes(tiny_job, ALL)
    assert [(c.rung, c.key, c.new) for c in chosen] == [
        ("attention", "attention", "unfused"), ("data", "num_workers", 2), ("compile", "compile_mode", "default"),
        ("precision", "dtype", "bfloat16"), ("fp8", "fp8_layers", ["mlp_up"])]
    assert all(c.adopted for c in chosen[:-1])
    fp8 = chosen[-1]  # emulated: numerics only, nothing to time here, so listed and not adopted
    assert fp8.label == "emulated" and "no speed is claimed" in fp8.evidence
    assert not fp8.adopted and fp8.reason.startswith(tuning.EMULATED_FP8)
    assert tuning.tuned_job(tiny_job, chosen).fp8_layers == []
    assert tuning.changes(tiny_job, ALL | {"fp8": step5() | FP8_TIMED})[-1].adopted  # timed faster: adopted


def test_a_step_that_keeps_the_job_as_it_is_changes_nothing(tiny_job):
    kept = {"baseline": step1(0.01), "attention_comm": step2(attention="sdpa"), "compile": step4(compile_=False),
            "fp8": step5(adopted=False, groups=())}
    assert tuning.changes(tiny_job, kept) == []
    assert tuning.tuned_job(tiny_job, []).to_dict() == tiny_job.to_dict() | {"job_name": "tiny-tuned"}


def test_a_lossy_change_whose_trial_failed_is_not_applied(tiny_job):
    # step 5's precision rung left the tolerance (adopted false) and no FP8 policy kept the loss (groups empty)
    chosen = tuning.changes(tiny_job, {"fp8": step5(adopted=False, groups=())})
    assert chosen == []
    # a compressing DDP hook has no loss curve behind it: listed, not adopted
    (hook,) = tuning.changes(tiny_job, {"attention_comm": step2(attention="sdpa", hook="powersgd")})
    assert hook.lossy and not hook.adopted and "lossy-unchecked" in hook.reason
    assert tuning.tuned_job(tiny_job, [hook]).ddp_hook == "none"


def test_keep_pins_a_key_from_the_job_or_the_command_line(tiny_job):
    chosen = tuning.changes(tiny_job, ALL, keep=["compile_mode"])
    pinned = next(c for c in chosen if c.key == "compile_mode")
    assert not pinned.adopted and pinned.reason.startswith("pinned")
    assert tuning.tuned_job(tiny_job, chosen).compile_mode == "off"
    job = dataclasses.replace(tiny_job, keep=["dtype"])
    assert tuning.tuned_job(job, tuning.changes(job, ALL)).dtype == "float32"
    with pytest.raises(ValueError, match="--keep complie_mode: not a job key"):
        tuning.changes(tiny_job, ALL, keep=["complie_mode"])


def test_keep_in_a_job_file_is_checked_with_a_suggestion(tmp_path):
    p = tmp_path / "j.yaml"
    p.write_text("keep: [dtpye]\n")
    with pytest.raises(JobError) as e:
        load_job(p)
    assert "did you mean 'dtype'" in str(e.value)


def test_tuned_yaml_round_trips_and_comments_each_change(tiny_job, tmp_path):
    chosen = tuning.changes(tiny_job, ALL | {"attention_comm": step2(hook="powersgd")})
    text = tuned_file.tuned_yaml(tiny_job, chosen, "tests/data/tiny.yaml", "20261201-000000")
    p = tmp_path / "tuned.yaml"
    p.write_text(text)
    assert load_job(p) == tuning.tuned_job(tiny_job, chosen)
    line = next(x for x in text.splitlines() if x.startswith("compile_mode:"))
    assert "# compile, step 4: 1.30x eager" in line and "(measured)" in line and "was 'off'" in line
    assert "# not adopted: ddp_hook: none -> powersgd (communication): lossy-unchecked" in text
    r = in_process("validate", str(p))
    assert r.returncode == 0, r.stderr


def test_each_rung_differs_from_the_one_below_by_exactly_its_change(tiny_job):
    stairs = tuning.staircase(tiny_job, tuning.changes(tiny_job, ALL | {"fp8": step5() | FP8_TIMED}))
    assert [name for name, _, _ in stairs] == ["original", "attention", "data", "compile", "precision", "fp8"]
    emulated = tuning.staircase(tiny_job, tuning.changes(tiny_job, ALL))  # FP8 not adopted: no rung
    assert [name for name, _, _ in emulated] == ["original", "attention", "data", "compile", "precision"]
    for (_, below, _), (_, job, mine) in zip(stairs, stairs[1:]):
        diff = {k for k, v in job.to_dict().items() if below.to_dict()[k] != v}
        assert diff == {c.key for c in mine}
    assert stairs[0][1] == tiny_job


# ------------------------------------------------------------------ side by side
def test_interleaving_alternates_the_candidates_and_records_the_order():
    calls = []

    def runner(name, t):
        def run(k):
            calls.append(name)
            return {"wall_s": [t] * k, "loss": [1.0] * k}
        return run

    done = interleave({"A": runner("A", 0.2), "B": runner("B", 0.1), "C": runner("C", 0.1)}, rounds=3, steps=2)
    assert calls == ["A", "B", "C"] * 3
    assert done.order == [(r, n) for r in (1, 2, 3) for n in "ABC"]
    assert len(done.series["A"].wall_s) == 6 and done.series["B"].round_medians_s == [0.1] * 3


def test_bootstrap_interval_of_identical_configurations_contains_one():
    a = [0.100, 0.104, 0.098, 0.110, 0.101, 0.099, 0.103, 0.097, 0.105, 0.102]
    same = bootstrap_speedup(a, list(a))
    assert same.low <= 1.0 <= same.high and not same.proven
    faster = bootstrap_speedup(a, [x / 2 for x in a])
    assert faster.value == pytest.approx(2.0) and faster.low > 1.0 and faster.proven


# ------------------------------------------------------------------ the step itself, on the tiny job
def _store(job, key, data):
    from mfu_lab.core.registry import BY_KEY

    d = job.output_root() / BY_KEY[key].folder
    d.mkdir(parents=True, exist_ok=True)
    (d / "result.json").write_text(json.dumps(data | {"environment": {"device_name": "cpu", "device_type": "cpu"},
                                                      "metrics": data.get("metrics", {}), "advice": []}))


def test_verify_measures_the_staircase_interleaved_and_writes_the_tuned_job(tiny_job):
    from mfu_lab.report import write_index
    from mfu_lab.steps.verify import step as verify

    job = dataclasses.replace(tiny_job, verify_rounds=2, verify_steps=2, verify_warmup_steps=1)
    _store(job, "attention_comm", step2(attention="unfused"))
    _store(job, "fp8", step5(dtype="bfloat16", groups=("mlp_up",)))
    lines = []
    r = verify.run(job, progress=lines.append)
    names = [x.name for x in r.rungs]
    # step 2 chose attention at float32 and the tuned job trains in bfloat16: the other one is timed again
    assert names == ["original", "attention", "precision", "attention at bfloat16"]  # emulated FP8: not adopted
    assert r.order == [[1, "original"], [1, "attention"], [1, "precision"], [1, "attention at bfloat16"],
                       [2, "original"], [2, "attention"], [2, "precision"], [2, "attention at bfloat16"]]
    orig, att, prec, again = r.rungs
    assert again.challenger and again.keys == {"attention": "sdpa"} and again.dtype == "bfloat16"
    won = again.proven and again.gain > 1
    assert again.reason.startswith("adopted" if won else "not adopted")
    # what the terminal says: the first count is steps 1-6's, then step 7's own re-check and its outcome (the
    # run's last line counts again, from the results as stored: runner._tuned)
    assert lines[0].startswith("steps 1-6: 2 change(s) adopted of 3 recommended; tuned job: "), lines[0]
    assert any(x.startswith("attention at bfloat16: step 2 chose unfused at float32") for x in lines), lines
    assert f"attention at bfloat16: {again.reason}" + (" (tuned.yaml: attention: sdpa)" if won else "") in lines
    assert att.keys == {"attention": "unfused"} and prec.keys == {"dtype": "bfloat16"}
    for x in (orig, att, prec):
        assert x.status == "ok" and len(x.wall_s) == 4 and x.step_p10_s <= x.step_median_s <= x.step_p90_s
    assert orig.speedup == 1.0 and prec.speedup == pytest.approx(
        statistics.median(orig.wall_s) / prec.step_median_s)
    assert prec.dtype == "bfloat16" and prec.peak_flops_per_s and prec.mfu is not None
    assert r.loss["tuned_rung"] == ("attention at bfloat16" if won else "precision")
    assert len(r.loss["original"]) == len(r.loss["tuned"]) == 1 + 4
    assert set(r.ledgers) == {"before", "after"}
    assert r.ddp["status"] == "skipped"
    # across precisions the speedup leads: the two MFUs stand on different peaks
    assert r.headline["text"].startswith("speedup " if prec.peak_flops_per_s != orig.peak_flops_per_s else "MFU ")
    tuned = load_job(job.output_root() / "tuned.yaml")
    assert (tuned.attention, tuned.dtype, tuned.fp8_layers, tuned.job_name) == (
        "sdpa" if won else "unfused", "bfloat16", [], "tiny-tuned")
    assert "# not adopted: fp8_layers: [] -> [mlp_up] (fp8): " + tuning.EMULATED_FP8 in (
        job.output_root() / "tuned.yaml").read_text()
    from mfu_lab import explore

    fig, text = explore.draw_verify(r, ["original", "precision"], 10_000)
    hours = ((orig.warmup_s or 0) + 10_000 * orig.step_median_s) / 3600
    assert f"of the original's {hours:.2f} h" in text and fig.axes
    stored = json.loads((job.output_root() / "07_verify" / "result.json").read_text())
    assert verify.Result.from_dict(stored).rungs[1].keys == {"attention": "unfused"}
    page = write_index(job.output_root()).read_text()
    assert 'alt="staircase"' in page and 'alt="ledger before and after"' in page
    # one peak: step 7's own words; the tuned job on another precision's peak: the speed first (issue 34, item 6)
    assert "Verified: MFU" in page or ("Verified: tokens/s" in page and "compare the speed, not the MFU" in page)
    assert any("round 2/2: precision" in line for line in lines)


def test_verify_with_nothing_adopted_says_so_and_times_nothing(tiny_job):
    from mfu_lab.steps.verify import step as verify

    r = verify.run(tiny_job, write=False)
    assert [x.name for x in r.rungs] == ["original"] and r.order == [] and r.rungs[0].wall_s == []
    assert any(s["what"] == "the staircase" and "no change was adopted" in s["reason"] for s in r.skipped)
    assert "no measured gain" in r.headline["text"]


def test_a_rung_that_fails_is_recorded_and_the_others_run(tiny_job, monkeypatch):
    from mfu_lab.steps.verify import rungs
    from mfu_lab.steps.verify import step as verify

    # dynamo alone (compile_backend eager): the rung 'tuned as written' compiles as the job says, in seconds
    job = dataclasses.replace(tiny_job, verify_rounds=2, verify_steps=1, verify_warmup_steps=0,
                              compile_backend="eager")
    _store(job, "attention_comm", step2(attention="unfused"))
    _store(job, "compile", step4(mode="default"))
    real = rungs.RungProcess

    def broken(spec, work, timeout_s):
        if spec["rung"] == "compile":
            spec = spec | {"job": spec["job"] | {"model": "no_such_module:factory"}}
        return real(spec, work, timeout_s)

    monkeypatch.setattr(rungs, "RungProcess", broken)
    r = verify.run(job, write=False)
    comp = r.rungs[2]
    assert comp.name == "compile" and comp.status == "failed" and "no_such_module" in comp.reason
    assert [x.status for x in r.rungs[:2]] == ["ok", "ok"] and r.rungs[1].speedup is not None
    assert [n for _, n in r.order][:4] == ["original", "attention"] * 2
    # tuned.yaml keeps the measured compile change, which the staircase could not time: the file as written is
    # timed again beside the original (here its compile works: only the rung named compile was broken)
    assert [x.name for x in r.rungs[3:]] == ["original again", "tuned as written"]
    assert "ran compile_mode off where tuned.yaml has default (rung compile)" in r.headline["text"]


@pytest.mark.e2e
def test_the_verify_notebook_runs_end_to_end_in_a_full_run(full_run):
    p, job_root = full_run
    assert p.returncode == 0, p.stderr[-3000:]
    step = job_root / "07_verify"
    result = json.loads((step / "result.json").read_text())
    assert result["step"] == "verify" and result["rungs"][0]["name"] == "original"
    nb = json.loads((step / "07_verify.ipynb").read_text())
    assert not [o for c in nb["cells"] for o in c.get("outputs", []) if o.get("output_type") == "error"]
    assert "Step 7" in (step / "report.html").read_text()
    tuned = load_job(job_root / "tuned.yaml")  # mfu-lab run rewrote it with the run's source and id
    assert tuned.job_name == "tiny-tuned"
    assert "tuned job: " in p.stdout and "tiny.yaml" in (job_root / "tuned.yaml").read_text().splitlines()[0]


def test_keep_on_the_command_line_pins_the_key_in_the_tuned_file(tmp_path):
    from .conftest import TINY

    job = dataclasses.replace(load_job(TINY), out_dir=str(tmp_path))
    _store(job, "compile", step4(mode="default"))
    r = in_process("step", "verify", "--job", str(TINY), "--out", str(tmp_path), "--keep", "compile_mode")
    assert r.returncode == 0, r.stderr[-2000:]
    text = (tmp_path / "tiny" / "tuned.yaml").read_text()
    assert "compile_mode: 'off'" in text.splitlines()
    assert "# not adopted: compile_mode: 'off' -> default (compile): pinned" in text
    assert load_job(tmp_path / "tiny" / "tuned.yaml").keep == ["compile_mode"]
    ran = in_process("step", "baseline", "--job", str(tmp_path / "tiny" / "tuned.yaml"))
    assert ran.returncode == 0, ran.stderr[-2000:]  # the tuned file is a job file that runs, under its own name
    assert (tmp_path / "tiny-tuned" / "01_baseline" / "result.json").is_file()
    bad = in_process("step", "verify", "--job", str(TINY), "--out", str(tmp_path), "--keep", "complie_mode")
    assert bad.returncode == 2 and "complie_mode" in bad.stderr and "did you mean 'compile_mode'" in bad.stderr


def test_attention_is_rechecked_only_when_the_precision_changed(tiny_job):
    from mfu_lab.steps.verify.tuned import attention_recheck

    s2 = step2(attention="sdpa") | {"job": {"dtype": "float32"}}
    assert attention_recheck(tiny_job, {"attention_comm": s2}, tiny_job) is None
    bf16 = dataclasses.replace(tiny_job, dtype="bfloat16")
    again, why = attention_recheck(tiny_job, {"attention_comm": s2}, bf16)
    assert (again.attention, again.dtype) == ("unfused", "bfloat16") and "chose sdpa at float32" in why
    assert attention_recheck(tiny_job, {}, bf16) is None  # no step 2: nothing was chosen to re-check


def test_a_change_step_7_adopted_itself_stays_in_the_rewritten_tuned_file(tiny_job):
    bf16 = {"fp8": step5(dtype="bfloat16", groups=())}
    again = tuning.Change("attention", "verify", "attention", "sdpa", "unfused", "step 7: unfused 1.10x", "measured")
    chosen = tuning.changes(tiny_job, bf16 | {"verify": {"changes": [again.to_dict()]}})
    assert [(c.step, c.key, c.new) for c in chosen] == [("fp8", "dtype", "bfloat16"),
                                                        ("verify", "attention", "unfused")]
    assert tuning.tuned_job(tiny_job, chosen).attention == "unfused"
    # step 2's own attention change is replaced by step 7's, not applied twice
    both = tuning.changes(tiny_job, bf16 | {"attention_comm": step2(attention="unfused"),
                                            "verify": {"changes": [again.to_dict() | {"new": "sdpa"}]}})
    assert [c.step for c in both if c.key == "attention"] == []  # back to the job's own: no change at all


def test_a_candidate_that_drops_out_mid_rounds_leaves_the_others_running():
    def steady(k):
        return {"wall_s": [0.1] * k}

    calls = {"n": 0}

    def dies(k):
        calls["n"] += 1
        return {"wall_s": [0.2] * k} if calls["n"] == 1 else None

    done = interleave({"A": steady, "B": dies, "C": steady}, rounds=3, steps=2)
    assert done.order == [(1, "A"), (1, "B"), (1, "C"), (2, "A"), (2, "C"), (3, "A"), (3, "C")]
    assert calls["n"] == 2 and len(done.series["A"].wall_s) == 6


def test_a_rung_whose_process_dies_during_the_rounds_is_recorded(tiny_job, monkeypatch):
    from mfu_lab.steps.verify import rungs
    from mfu_lab.steps.verify import step as verify

    job = dataclasses.replace(tiny_job, verify_rounds=3, verify_steps=1, verify_warmup_steps=0)
    _store(job, "attention_comm", step2(attention="unfused"))
    real_run = rungs.RungProcess.run

    def run(self, steps):
        if self.name == "attention" and getattr(self, "_seen", False):
            self.proc.kill()  # the rung's process dies after its first round
        self._seen = True
        return real_run(self, steps)

    monkeypatch.setattr(rungs.RungProcess, "run", run)
    r = verify.run(job, write=False)
    orig, att = r.rungs
    assert att.status == "failed" and "during the rounds" in att.reason and att.wall_s == []
    assert orig.status == "ok" and len(orig.wall_s) == 3
    assert [n for _, n in r.order] == ["original", "attention", "original", "original"]


def test_a_result_measured_with_other_job_values_says_so_in_the_evidence(tiny_job):
    other = step4() | {"job": tiny_job.to_dict() | {"micro_batch": 16}}
    (c,) = tuning.changes(tiny_job, {"compile": other})
    assert c.evidence.endswith("measured with micro_batch=16 (this job: 4)")
    (same,) = tuning.changes(tiny_job, {"compile": step4() | {"job": tiny_job.to_dict()}})
    assert "measured with" not in same.evidence


def test_keep_items_that_are_not_names_are_refused_clearly(tmp_path):
    p = tmp_path / "j.yaml"
    p.write_text("keep: [[]]\n")  # found by the fuzz test: a list inside keep used to raise TypeError
    with pytest.raises(JobError) as e:
        load_job(p)
    assert "keep" in str(e.value) and "not a job key" in str(e.value)


def test_varying_shapes_under_a_compile_recommendation_propose_buckets(tiny_job):
    varlen = dataclasses.replace(tiny_job, data="synthetic_varlen")
    s4 = step4() | {"audit": {"shapes": {"4x17": 1, "4x29": 1, "4x32": 2}}}
    s4["recommendation"]["shapes_first"] = True
    chosen = tuning.changes(varlen, {"compile": s4})
    assert [(c.key, c.new, c.label) for c in chosen] == [("seq_policy", "bucket", "proposed"),
                                                         ("compile_mode", "default", "measured")]
    assert "3 batch shapes" in chosen[0].evidence
    assert tuning.changes(dataclasses.replace(varlen, seq_policy="pack"), {"compile": s4})[0].key == "compile_mode"


def test_a_rungs_mfu_is_taken_over_the_total_wall_time_of_its_measured_steps():
    """One MFU statistic (issue 34): model FLOPs x steps / (peak x their total wall time), in one process and in the
    job's layout; the median step stays its own figure."""
    from mfu_lab.steps.verify.layout import rung_figures
    from mfu_lab.steps.verify.rungs import Rung

    wall = [0.1, 0.2, 0.6, 0.1]  # a slow step: the median (0.15 s) would hide it, the total wall does not
    rung = Rung("original", {}, "ok", peak_flops_per_s=1e10)
    rung.wall_s = list(wall)
    rung_figures(rung, 1e9, 256)
    assert rung.mfu == pytest.approx(1e9 * len(wall) / (1e10 * sum(wall)))
    assert rung.tokens_per_s == pytest.approx(256 * len(wall) / sum(wall))
    assert rung.step_median_s == pytest.approx(0.15)
    rung_figures(rung, 2 * 1e9, 2 * 256)  # the layout's call: FLOPs and tokens of every data-parallel rank
    assert rung.mfu == pytest.approx(2e9 * len(wall) / (1e10 * sum(wall)))
    rung.peak_flops_per_s = None
    rung_figures(rung, 1e9, 256)
    assert rung.mfu is None


def test_the_staircase_header_names_no_unit_it_did_not_measure():
    """A step 7 that timed nothing (the stored default run's: the original excluded with the only change) has no
    throughput to show: its header says neither tokens/s nor samples/s (a vision job's page once said tokens/s)."""
    import json

    from mfu_lab.report.tables.verify import staircase_table
    from mfu_lab.steps.verify.step import VerifyResult

    from .conftest import ROOT

    d = json.loads((ROOT / "tests" / "data" / "default_run_results.json").read_text())["results"]["verify"]
    r = VerifyResult.from_dict(d)
    assert r.rungs[0].tokens_per_s is None
    html = str(staircase_table(r))
    assert "tokens/s" not in html and "samples/s" not in html and "<th>throughput</th>" in html
    r.rungs[0].tokens_per_s = 1000.0
    assert "<th>tokens/s</th>" in str(staircase_table(r))


def test_a_withdrawn_rung_below_the_top_gets_the_tuned_file_timed_again_as_written(tiny_job, monkeypatch, capsys):
    """A proposed num_workers withdrawn at 0.5x below a kept optimizer rung: every rung above it was measured
    with it, so the top rung is not tuned.yaml. Step 7 times the file as written (num_workers back, AdamW fused)
    beside the original again, and the headline, the loss check and the metrics are that pair's. A slower tuned job
    is never advised for adoption. The rung processes are replaced by made-up medians (what is tested is what step 7
    does with them; test_verify_measures_the_staircase_interleaved_and_writes_the_tuned_job runs real ones)."""
    from mfu_lab.steps.verify import retime
    from mfu_lab.steps.verify import step as verify

    job = dataclasses.replace(tiny_job, verify_rounds=3, verify_steps=2, verify_warmup_steps=1)
    _store(job, "baseline", step1(0.2))  # data waits 20% of the step: num_workers 2 proposed
    _store(job, "kernels", {"optimizer_race": {"ran": True, "adopted": True, "pick": "fused", "reference": "default",
                                               "speedup": {"value": 1.3, "low": 1.1, "high": 1.5}}})
    ms = {"original": 10.0, "data": 20.0, "optimizer": 16.0, retime.AGAIN: 11.0, retime.AS_WRITTEN: 8.0}
    timed = {}

    def rungs_measured(run_job, rungs, jobs, work, say, memory=None):
        for r, j in zip(rungs, jobs):
            timed[r.name] = (j, run_job.verify_rounds)
            n = run_job.verify_rounds * run_job.verify_steps
            r.wall_s = [ms[r.name] / 1e3 * (1 + 0.01 * (i % 3)) for i in range(n)]
            r.data_s, r.compute_s, r.loss = [0.0] * n, list(r.wall_s), [4.0] * (n + 1)
            r.step_median_s = r.step_p10_s = r.step_p90_s = statistics.median(r.wall_s)
            r.mfu = 0.01 * ms["original"] / ms[r.name]
        return [[k + 1, r.name] for k in range(run_job.verify_rounds) for r in rungs]

    monkeypatch.setattr(verify, "measure_rungs", rungs_measured)
    monkeypatch.setattr(retime, "measure_rungs", rungs_measured)
    from mfu_lab.steps.verify import memory_share  # as on a GPU: each rung's share, kept in the result
    monkeypatch.setattr(memory_share, "for_device", lambda device, mbs, mb, base, graphs=frozenset():
                        memory_share.MemoryPlan({n: 0.3 for n in mbs}, note="each rung bounded to 30%"))
    r = verify.run(job)
    assert r.memory["fractions"] == {"original": 0.3, "data": 0.3, "optimizer": 0.3} and not r.memory["release"]
    assert [x.name for x in r.rungs] == ["original", "data", "optimizer", retime.AGAIN, retime.AS_WRITTEN]
    assert timed["optimizer"][0].num_workers == 2  # the top rung held the change withdrawn below it
    written, rounds = timed[retime.AS_WRITTEN]
    assert (written.num_workers, written.adamw_impl, rounds) == (0, "fused", 3)  # tuned.yaml's job, all rounds
    tuned = load_job(job.output_root() / "tuned.yaml")
    assert (tuned.num_workers, tuned.adamw_impl) == (written.num_workers, written.adamw_impl)
    again, last = r.rungs[-2:]
    assert last.keys == {"adamw_impl": "fused"} and last.speedup == last.gain == pytest.approx(11.0 / 8.0, rel=0.02)
    assert r.headline["speedup"] == last.speedup and r.headline["as_written"] is True
    # the headline's original is the one timed in the same rounds, not the staircase's
    assert r.headline["mfu_before"] == again.mfu == r.metrics["mfu_before"].value != r.rungs[0].mfu
    assert r.ledgers["before"].get("mfu").fraction == pytest.approx(again.mfu)
    assert ("top rung ran num_workers 2 where tuned.yaml has 0 (rung data): the tuned file as written was timed "
            "again") in r.headline["text"]
    assert r.loss["tuned_rung"] == retime.AS_WRITTEN and r.metrics["speedup"].value == last.speedup
    assert r.advice[0].message.startswith("Adopt the tuned job (tuned.yaml)")
    assert r.headline["carried"] == ["the tuned file as written (adamw_impl: fused)"]
    assert not any(retime.AS_WRITTEN in a.message for a in r.advice)  # the pair is the headline, not a rung's line
    opt = r.rungs[2]  # had the optimizer's own gain been within the noise: measured over the withdrawn rung, said
    opt.gain, opt.gain_low, opt.gain_high, opt.proven = 0.98, 0.90, 1.05, False
    (line,) = [a for a in verify.advise(r) if a.message.startswith("The optimizer change is not proven")]
    assert line.because.endswith("; measured over rung data, which step 7 withdrew: the tuned file as written, "
                                 "timed again, is the headline's figure")
    # a layout step 7 withdrew under the optimizer rung: in one process its dp_mode never ran, so it is not named;
    # under torchrun in the job's own layout (the staircase ran there) every rung above held it
    from mfu_lab.steps.verify.rungs import Rung
    r.rungs.insert(2, Rung("layout", {"dp_mode": "fsdp"}, "excluded", "verified under torchrun"))
    r.changes.append({"rung": "layout", "step": "verify", "key": "dp_mode", "old": "fsdp", "new": "ddp",
                      "adopted": True, "reason": "withdrawn: the proposed layout was not verified faster"})
    over = [a.because for a in verify.advise(r) if a.message.startswith("The optimizer change is not proven")]
    assert over[0].endswith("; measured over rung data, which step 7 withdrew: the tuned file as written, timed "
                            "again, is the headline's figure")
    r.job = {**r.job, "dp_mode": "fsdp"}
    over = [a.because for a in verify.advise(r) if a.message.startswith("The optimizer change is not proven")]
    assert "; measured over rung data, layout, which step 7 withdrew" in over[0]
    del r.rungs[2], r.changes[-1]
    r.job = {**r.job, "dp_mode": job.dp_mode}
    assert [o for o in r.order if o[1] == retime.AGAIN] == [[1, retime.AGAIN], [2, retime.AGAIN], [3, retime.AGAIN]]
    from mfu_lab.steps.verify.tuned import withdrawn_keys
    assert withdrawn_keys(job) == ["num_workers"]  # the runner's last line names what step 7 took back
    from mfu_lab import runner
    capsys.readouterr()
    runner._tuned(job, "the job", "")  # taken back: still counted among the recommended, named
    assert "(1 change(s) adopted of 2 recommended; step 7 took back num_workers" in capsys.readouterr().out

    # the file as written slower than the original, beyond the noise: never "adopt"
    ms[retime.AS_WRITTEN] = 14.0
    r = verify.run(job)
    assert r.headline["speedup"] < 1 and r.headline["proven"]
    assert r.advice[0].severity == "act" and r.advice[0].message.startswith("Keep the original job: the tuned job "
                                                                          "(tuned.yaml) measured slower")

    # no share left for the second turn: the figure is the top rung's, and the headline says what it still holds
    job = dataclasses.replace(job, budget_min=0.01)
    timed.clear()
    r = verify.run(job)
    assert retime.AS_WRITTEN not in timed and r.headline["as_written"] is False
    assert "ran num_workers 2 where tuned.yaml has 0 (rung data): the tuned file as written was not timed" in \
        r.headline["text"]
    assert any(s["what"].startswith("the tuned file as written") and s["reason"].startswith("budget:")
               for s in r.skipped)


def test_the_index_reads_the_second_turns_pair_and_keeps_its_note():
    """The index's verified line, across precisions' peaks, takes the original of the pair the headline is
    (step 7's second turn), not the staircase's first original, and keeps what the headline says of the turn."""
    from mfu_lab.report.summary import verified_text

    peak32, peak16 = dict(peak_flops_per_s=1e11, peak_precision="fp32"), dict(peak_flops_per_s=4e11,
                                                                              peak_precision="bf16")
    rungs = [dict(name="original", mfu=0.30, tokens_per_s=900.0, **peak32),
             dict(name="data", mfu=0.10, tokens_per_s=500.0, **peak16),
             dict(name="original again", mfu=0.40, tokens_per_s=1000.0, **peak32),
             dict(name="tuned as written", mfu=0.20, tokens_per_s=2000.0, **peak16)]
    h = {"text": "MFU ...", "mfu_after": 0.20, "speedup": 2.0, "speedup_low": 1.8, "speedup_high": 2.2,
         "note": "the staircase's top rung held num_workers 2 (rung data), withdrawn since: ...", "as_written": True}
    text = verified_text({"headline": h, "rungs": rungs})
    assert text.startswith("tokens/s 2.00x (speedup 2.00x [1.80, 2.20]") and "the original's 40.0%" in text
    assert text.endswith("; the staircase's top rung held num_workers 2 (rung data), withdrawn since: ...")
    # the second turn did not make the headline (it failed, or the share could not hold it): the staircase's original
    rungs[3]["mfu"], rungs[1]["mfu"] = None, 0.20
    text = verified_text({"headline": h | {"as_written": False}, "rungs": rungs})
    assert "the original's 30.0%" in text and text.startswith("tokens/s 0.56x")


def test_a_proposed_rung_that_failed_below_a_timed_one_gets_the_second_turn_too(tiny_job, monkeypatch):
    """The data rung's process fails: its proposal is withdrawn untimed, but the optimizer rung above ran with it.
    The top rung's job and tuned.yaml differ in num_workers, so the file as written is timed again."""
    from mfu_lab.steps.verify import retime
    from mfu_lab.steps.verify import step as verify

    job = dataclasses.replace(tiny_job, verify_rounds=2, verify_steps=2, verify_warmup_steps=1)
    _store(job, "baseline", step1(0.2))
    _store(job, "kernels", {"optimizer_race": {"ran": True, "adopted": True, "pick": "fused", "reference": "default",
                                               "speedup": {"value": 1.3, "low": 1.1, "high": 1.5}}})
    ms = {"original": 10.0, "optimizer": 16.0, retime.AGAIN: 10.0, retime.AS_WRITTEN: 8.0}
    timed = {}

    def rungs_measured(run_job, rungs, jobs, work, say, memory=None):
        for r, j in zip(rungs, jobs):
            timed[r.name] = j
            if r.name == "data":
                r.status, r.reason = "failed", "worker 1 exited"
                continue
            n = run_job.verify_rounds * run_job.verify_steps
            r.wall_s = [ms[r.name] / 1e3 * (1 + 0.01 * (i % 3)) for i in range(n)]
            r.data_s, r.compute_s, r.loss = [0.0] * n, list(r.wall_s), [4.0] * (n + 1)
            r.step_median_s = r.step_p10_s = r.step_p90_s = statistics.median(r.wall_s)
        return [[k + 1, r.name] for k in range(run_job.verify_rounds) for r in rungs if r.wall_s]

    monkeypatch.setattr(verify, "measure_rungs", rungs_measured)
    monkeypatch.setattr(retime, "measure_rungs", rungs_measured)
    r = verify.run(job)
    assert any(c["key"] == "num_workers" and "rung data failed (worker 1 exited): not timed" in c["evidence"]
               for c in r.changes)
    assert timed["optimizer"].num_workers == 2 and timed[retime.AS_WRITTEN].num_workers == 0
    assert r.headline["as_written"] and "ran num_workers 2 where tuned.yaml has 0 (rung data)" in r.headline["text"]
    assert r.headline["speedup"] == pytest.approx(10.0 / 8.0, rel=0.02)
