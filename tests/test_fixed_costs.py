"""The budget reads this machine's fixed costs (issue 46 §3): a notebook's seconds and a cold compile, measured by
the runs made here and kept per machine, and a run says up front when the budget cannot hold a step's minimum."""

from __future__ import annotations

import dataclasses
import json
from types import SimpleNamespace

import pytest

from mfu_lab import runner
from mfu_lab.core.job.schema import load_job
from mfu_lab.core.process import budget, floors
from mfu_lab.core.store import fixed_costs

from .conftest import ROOT, TINY


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    return tmp_path / "xdg" / "mfu-lab" / "fixed_costs.json"


def test_figures_are_kept_per_machine_and_kind_and_the_median_reads_the_last_ones(cache):
    key = fixed_costs.machine_key("cpu")
    assert fixed_costs.median(key, "notebook_s") is None
    for s in [9.0, 30.0, 8.0] + [7.0] * fixed_costs.KEEP:
        fixed_costs.record(key, "notebook_s", s)
    assert fixed_costs.figures(key, "notebook_s") == [7.0] * fixed_costs.KEEP  # only the last KEEP
    assert fixed_costs.median(key, "notebook_s") == (7.0, fixed_costs.KEEP)
    assert fixed_costs.median(fixed_costs.machine_key("cuda"), "notebook_s") is None  # another device kind
    fixed_costs.record(key, "notebook_s", float("nan"))  # not kept
    fixed_costs.record(key, "notebook_s", -1.0)
    assert len(fixed_costs.figures(key, "notebook_s")) == fixed_costs.KEEP
    with pytest.raises(ValueError, match="notebook_s, cold_compile_s"):
        fixed_costs.record(key, "coffee_s", 1.0)
    assert json.loads(cache.read_text())["machines"][key]["notebook_s"][-1] == 7.0


def test_a_damaged_cache_is_taken_as_empty_and_rewritten(cache):
    cache.parent.mkdir(parents=True)
    cache.write_text("{not json")
    key = fixed_costs.machine_key("cpu")
    assert fixed_costs.median(key, "notebook_s") is None
    cache.write_text(json.dumps({"machines": {key: {"notebook_s": ["x", True, float("inf"), 4.0]}}}))
    assert fixed_costs.figures(key, "notebook_s") == [4.0]  # a hand edit's strings, booleans and infinities left out
    fixed_costs.record(key, "notebook_s", 6.0)
    assert fixed_costs.median(key, "notebook_s") == (5.0, 2)


def test_the_plan_spends_the_notebooks_measured_here_and_says_so(cache):
    assert budget.overhead("cpu") == (budget.STEP_OVERHEAD_S, budget.overhead("cpu")[1])
    assert "none measured" in budget.overhead("cpu")[1]
    for s in (3.0, 4.0, 5.0):
        fixed_costs.record(fixed_costs.machine_key("cpu"), "notebook_s", s)
    each, where = budget.overhead("cpu")
    assert each == 4.0 and "measured (median of 3)" in where
    p = budget.plan(5.0, overhead_s=each)
    assert sum(p.values()) + len(budget.WEIGHTS) * each == pytest.approx(300.0)  # the budget, all of it
    assert sum(p.values()) > sum(budget.plan(5.0).values())  # cheaper notebooks leave the steps more
    text = budget.plan_text(5.0, list(budget.WEIGHTS), {}, (each, where))
    assert "about 4 s for each step's notebook" in text and "median of 3" in text


def test_a_run_hands_each_step_the_notebook_seconds_it_planned_with(monkeypatch):
    keys = list(budget.WEIGHTS)
    env = budget.left_env(5.0, keys, 0.0, "kernels", overhead_s=4.0)
    monkeypatch.setenv(budget.LEFT_ENV, env)
    rest = keys[keys.index("kernels"):]
    left = float(env.split(";")[0])
    want = (left - len(rest) * 4.0) * budget.WEIGHTS["kernels"] / sum(budget.WEIGHTS[k] for k in rest)
    assert budget.share_s(5.0, "kernels") == pytest.approx(want)
    monkeypatch.setenv(budget.LEFT_ENV, env.rsplit(";", 1)[0])  # an older runner's two fields: the reference's
    weight = budget.WEIGHTS["kernels"] / sum(budget.WEIGHTS[k] for k in rest)
    want = (left - len(rest) * budget.STEP_OVERHEAD_S) * weight
    assert budget.share_s(5.0, "kernels") == pytest.approx(want)


def test_a_cold_compile_comes_from_the_job_then_this_machine_then_the_reference(cache):
    job = load_job(TINY)
    assert budget.cold_compile(job) == (budget.COLD_COMPILE_S, "the default job's on the reference CPU")
    fixed_costs.record(fixed_costs.machine_key(job.device), "cold_compile_s", 22.0)
    cold, where = budget.cold_compile(job)
    assert cold == 22.0 and "this machine's" in where
    cold, where = budget.cold_compile(job, {"trials": [{"compile_cold_s": 12.5}, {"compile_cold_s": None}]})
    assert cold == 12.5 and "this job's last step 4" in where


def test_a_cold_compile_is_kept_and_read_per_backend(cache, tmp_path):
    """The vision example's step 4 (compile_backend eager: dynamo's tracing alone) compiled in 0.6 s, and the
    budget then said its 52 s minimum held "a 24 s cold compile (this machine's cold compiles)": an inductor
    figure. A backend's cold compile is kept under its own kind, and an inductor job's figure moves nothing."""
    inductor = load_job(TINY)
    eager = dataclasses.replace(inductor, compile_backend="eager", out_dir=str(tmp_path / "out"))
    key = fixed_costs.machine_key(eager.device)
    fixed_costs.record(key, "cold_compile_s", 24.0)
    cold, where = budget.cold_compile(eager)
    assert (cold, where) == (budget.TRACE_ONLY_S, "assumed: compile_backend eager traces, it generates no code")
    folder = eager.step_dir("04_compile")
    folder.mkdir(parents=True)
    (folder / "result.json").write_text(json.dumps({"elapsed_s": 10.0, "trials": [{"compile_cold_s": 0.6}]}))
    runner.record_fixed_costs(eager, SimpleNamespace(key="compile", folder="04_compile"), 15.0)
    assert fixed_costs.figures(key, "cold_compile_s:eager") == [0.6]
    assert fixed_costs.figures(key, "cold_compile_s") == [24.0]  # inductor's median unmoved
    cold, where = budget.cold_compile(eager)
    assert cold == 0.6 and "this machine's cold compiles with eager, measured (median of 1)" in where
    assert budget.cold_compile(inductor)[0] == 24.0
    other = dataclasses.replace(inductor, compile_backend="tvm")  # generates code: inductor's reference, said so
    assert budget.cold_compile(other) == (budget.COLD_COMPILE_S, "the default job's on the reference CPU with "
                                          "inductor (compile_backend tvm has no figure here yet)")
    # a step 4 of another backend is not this job's cold compile
    earlier = {"job": {"compile_backend": "eager"}, "trials": [{"compile_cold_s": 0.6}]}
    assert budget.cold_compile(inductor, earlier)[0] == 24.0 and budget.cold_compile(eager, earlier)[0] == 0.6
    mins = floors.minimums(eager, {"baseline": {"metrics": {"step_time_median_s": {"value": 0.5}}}})
    assert "a 1 s cold compile (this job's last step 4" not in mins["compile"][1]  # no earlier step 4 given
    assert "a 1 s cold compile (this machine's cold compiles with eager" in mins["compile"][1]


def test_step_4s_floor_takes_this_machines_trial_start_once_a_run_measured_it(cache, tmp_path):
    """The default run on a 2-core Xeon: its eager trial took 4.6 s beyond its steps, against the reference CPU's
    10 s a trial start; the floor of step 4 read "needs about 51 s" against a 50 s share. Once measured, the floor
    uses this machine's trial start, and says so."""
    job = dataclasses.replace(load_job(TINY), out_dir=str(tmp_path / "out"))
    step1 = {"baseline": {"metrics": {"step_time_median_s": {"value": 0.3}}}}
    before = floors.minimums(job, step1)["compile"]
    assert budget.trial_start(job) == (budget.TRIAL_START_S, "the reference CPU's")
    folder = job.step_dir("04_compile")
    folder.mkdir(parents=True)
    (folder / "result.json").write_text(json.dumps({"elapsed_s": 40.0, "eager": {"start_s": 4.6}}))
    runner.record_fixed_costs(job, SimpleNamespace(key="compile", folder="04_compile"), 50.0)
    assert budget.trial_start(job) == (4.6, "this machine's trial starts, measured (median of 1)")
    after = floors.minimums(job, step1)["compile"]
    assert before[0] - after[0] == pytest.approx(2 * (budget.TRIAL_START_S - 4.6))  # two trials, eager's and one mode's
    assert "two trial starts of about 5 s (this machine's trial starts, measured (median of 1))" in after[1]


def test_a_budget_too_small_for_a_steps_minimum_is_said_up_front_with_the_figures(cache):
    job = dataclasses.replace(load_job(TINY), budget_min=2.0)
    step1 = {"metrics": {"step_time_median_s": {"value": 0.5}}}
    mins = floors.minimums(job, {"baseline": step1})
    cold = budget.COLD_COMPILE_S
    assert mins["compile"][0] == pytest.approx(2 * (budget.TRIAL_START_S + (job.compile_warmup_steps + 3) * 0.5)
                                               + cold + 6 * 0.5)
    text = floors.minimum_text(job, list(budget.WEIGHTS), {"baseline": step1})
    # the step time the floors are counted at is said once, with where it comes from
    assert text.count("Training steps at about 0.5 s each: step 1's median step 500 ms (measured).") == 1
    assert text.count("a step") == 0
    p = budget.plan(2.0)
    short = [k for k, (need, _) in mins.items() if p[k] < need]
    assert short and "cannot hold every step's minimum" in text
    for k in short:
        n = list(budget.WEIGHTS).index(k) + 1
        assert f"step {n} gets {p[k]:.0f} s but needs about {mins[k][0]:.0f} s" in text
    over = sum(mins[k][0] - p[k] for k in short)
    assert f"about {over:.0f} s past the budget" in text
    bigger = float(text.rsplit("--budget ", 1)[1].split()[0])
    assert floors.minimum_text(dataclasses.replace(job, budget_min=bigger), list(budget.WEIGHTS),
                               {"baseline": step1}) == ""  # the budget it names holds them
    assert floors.minimum_text(dataclasses.replace(job, budget_min=0.0), list(budget.WEIGHTS), {}) == ""


def test_the_runner_keeps_each_steps_notebook_seconds_and_step_4s_cold_compile(cache, tmp_path):
    job = dataclasses.replace(load_job(TINY), out_dir=str(tmp_path / "out"))
    info = SimpleNamespace(key="compile", folder="04_compile")
    folder = job.step_dir(info.folder)
    folder.mkdir(parents=True)
    (folder / "result.json").write_text(json.dumps({"elapsed_s": 40.0, "trials": [
        {"compile_cold_s": 18.0}, {"compile_cold_s": 25.0}, {"mode": "eager"}]}))
    runner.record_fixed_costs(job, info, 52.5)
    key = fixed_costs.machine_key(job.device)
    assert fixed_costs.figures(key, "notebook_s") == [12.5]  # wall 52.5 s less the step's own 40 s
    assert fixed_costs.figures(key, "cold_compile_s") == [25.0]
    assert fixed_costs.figures(key, "trial_start_s") == []  # no eager trial in this result
    (folder / "result.json").write_text("{damaged")
    runner.record_fixed_costs(job, info, 60.0)  # nothing read, nothing kept
    assert fixed_costs.figures(key, "notebook_s") == [12.5]


def test_a_short_share_that_the_later_steps_can_give_up_is_said_as_such_not_as_an_overrun(cache):
    """The demo's 4.5 minutes on a machine that has measured nothing yet: step 4's minimum (reference figures)
    exceeds its share, by less than half of what steps 5 and 6 (no floor) are planned: no 'past the budget'."""
    job = load_job(ROOT / "parameters" / "default.yaml")
    p, mins = budget.plan(4.5, None, budget.STEP_OVERHEAD_S), floors.minimums(job, {})
    over = mins["compile"][0] - p["compile"]
    assert 0 < over <= floors.ABSORBED * (p["fp8"] + p["placement"])  # the case at hand, by the formula
    text = floors.minimum_text(job, list(budget.WEIGHTS), {})
    assert f"step 4 gets {p['compile']:.0f} s but needs about {mins['compile'][0]:.0f} s" in text
    assert f"the steps after it get about {over:.0f} s less between them" in text
    assert "past the budget" not in text and "can still keep to the budget" in text
    # step 7 is last: nothing after it can give up its overrun
    tiny = dataclasses.replace(load_job(TINY), budget_min=2.0)
    assert "past the budget" in floors.minimum_text(tiny, ["verify"], {})


def test_the_run_says_a_short_share_after_its_plan_line_not_before_the_job(cache, tmp_path, monkeypatch, capsys):
    """`mfu-lab run` names the job, then its plan, then the step whose share is under its floor (the line speaks
    of the plan's shares); start_checks leaves that line to the run."""
    from mfu_lab.core.registry import BY_KEY

    job = dataclasses.replace(load_job(ROOT / "parameters" / "default.yaml"), out_dir=str(tmp_path / "out"))
    steps = [BY_KEY[k] for k in budget.WEIGHTS]
    monkeypatch.setattr(runner, "execute_step", lambda info, *a: tmp_path / f"{info.folder}.html")
    monkeypatch.setattr(runner, "_tuned", lambda *a: None)
    runner.start_checks(job, "parameters/default.yaml", list(budget.WEIGHTS), minimum=False)
    runner.run_steps(job, "parameters/default.yaml", steps)
    lines = capsys.readouterr().out.splitlines()
    at = {k: next(i for i, line in enumerate(lines) if line.startswith(p)) for k, p in (
        ("job", "mfu-lab: job 'default'"), ("plan", "mfu-lab: budget 4.5 min"),
        ("short", "mfu-lab: the budget of 4.5 min gives a step less than its minimum"), ("step", "[1/7]"))}
    assert at["job"] < at["plan"] < at["short"] < at["step"]
    assert sum("less than its minimum" in line for line in lines) == 1


@pytest.mark.parametrize("step_s, expect", [(0.05, "every step's share now holds its minimum"),
                                            (2.0, "cannot hold every step's minimum")])
def test_step_1s_measured_step_rechecks_the_floors_the_first_line_guessed(cache, tmp_path, monkeypatch, capsys,
                                                                          step_s, expect):
    """A job's first run has no step time of its own: the floors before step 1 take the reference CPU's 0.5 s
    step (the vision job's is 59 ms, and its first line warned of an overrun that never came). Once step 1 has
    measured the step, the run says what the measured step changes, with the figure; a job with a step-1 result
    already is not re-checked."""
    from mfu_lab.core.registry import BY_KEY

    job = dataclasses.replace(load_job(ROOT / "parameters" / "default.yaml"), out_dir=str(tmp_path / "out"))
    keys, overhead = list(budget.WEIGHTS), budget.overhead(job.device)[0]
    fast = {"baseline": {"metrics": {"step_time_median_s": {"value": 0.05}}}}
    job = next(j for j in (dataclasses.replace(job, budget_min=b / 10) for b in range(40, 80))
               if floors.minimum_text(j, keys, {}, overhead) and not floors.minimum_text(j, keys, fast, overhead))
    steps = [BY_KEY[k] for k in keys]  # the budget whose shares hold the floors at a 50 ms step, not at 0.5 s

    def execute(info, *a):
        if info.key == "baseline":
            folder = job.step_dir(info.folder)
            folder.mkdir(parents=True, exist_ok=True)
            (folder / "result.json").write_text(json.dumps({"metrics": {"step_time_median_s": {"value": step_s}}}))
        return tmp_path / f"{info.folder}.html"

    monkeypatch.setattr(runner, "execute_step", execute)
    monkeypatch.setattr(runner, "_tuned", lambda *a: None)
    runner.run_steps(job, "parameters/default.yaml", steps)
    lines = capsys.readouterr().out.splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith(f"mfu-lab: the budget of {job.budget_min:g} min"))
    assert "the reference CPU's 0.5 s step" in lines[first]
    done = next(i for i, line in enumerate(lines) if line.startswith("[1/7] 01_baseline done"))
    again = [line for line in lines if "step 1 measured the job's step" in line]
    assert len(again) == 1 and lines.index(again[0]) == done + 1
    assert f"at {step_s * 1e3:.3g} ms (the floors above took the reference CPU's 0.5 s)" in again[0]
    assert expect in again[0]
    if step_s == 2.0:  # the floors at the measured step, by the same formula as the first line's
        assert again[0].endswith(floors.minimum_text(job, keys, {
            "baseline": {"metrics": {"step_time_median_s": {"value": 2.0}}}}, overhead))
    runner.run_steps(job, "parameters/default.yaml", steps)  # step 1's result is there from the start now
    assert "step 1 measured the job's step" not in capsys.readouterr().out
