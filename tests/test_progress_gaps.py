"""Issue 34, items 4 and 5: no silence over long work (a heartbeat at most every GAP_S seconds, with the time left
when a count is known), a busy machine said at the run's start with the command that bounds it, and a budget that
bounds step 1 or is refused up front with the estimate. Every clock here is a fake one: nothing depends on the
machine's speed or load."""

from __future__ import annotations

import dataclasses
import re

import pytest

from mfu_lab import cli
from mfu_lab.commands import run as run_command
from mfu_lab.core.job.schema import load_job
from mfu_lab.core.measure import contention
from mfu_lab.core.measure.contention import Contention
from mfu_lab.core.process import budget, floors
from mfu_lab.core.process.progress import GAP_S, Heartbeat, Progress, printer
from tests.conftest import TINY


class FakeClock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def test_a_heartbeat_speaks_at_most_every_gap_and_at_least_every_30_s_with_the_time_left():
    clock, lines = FakeClock(), []
    hb = Heartbeat("work", lines.append, total=100, every_s=GAP_S, clock=clock)
    said_at = []
    for done in range(1, 101):  # 100 items of 1.3 s each, the heartbeat asked after every one
        clock.t += 1.3
        if hb.beat(done):
            said_at.append(clock.t)
    gaps = [b - a for a, b in zip([1000.0] + said_at, said_at)]
    assert lines and all(GAP_S <= g <= 30 for g in gaps), gaps
    assert all(re.search(r"\d+/100 \(.* s, about .* left\)", line) for line in lines), lines
    assert lines[0].startswith("work: still working")


def test_a_heartbeat_without_a_count_says_the_time_so_far_and_said_restarts_the_gap():
    clock, lines = FakeClock(), []
    hb = Heartbeat("wait", lines.append, clock=clock)
    clock.t += GAP_S - 1
    assert not hb.beat()
    hb.said()  # the caller printed a line of its own: the gap counts from here
    clock.t += GAP_S - 1
    assert not hb.beat()
    clock.t += 2
    assert hb.beat(what="compiling") and "compiling" in lines[0] and "time left unknown" in lines[0]


def test_counted_work_prints_between_its_quarters_when_a_gap_passes():
    clock, lines = FakeClock(), []
    tick = printer("steps", emit=lines.append, bar=False, clock=clock)
    for done in range(1, 401):  # 400 steps of 0.5 s: quarters are 50 s apart, longer than the gap
        clock.t += 0.5
        tick(done, 400, clock.t - 1000.0)
    times = [float(re.search(r"\((\d+\.\d) s", ln).group(1)) for ln in lines]
    assert max(b - a for a, b in zip(times, times[1:])) <= 30
    assert all("left" in ln for ln in lines[:-1]) and lines[-1].startswith("steps: 400/400")


def test_a_step_with_a_slow_training_step_prints_a_heartbeat(tiny_job, monkeypatch):
    """Step 1 on the tiny job: each of its steps made to take 20 s of a fake clock (the training step itself stays
    as fast as ever), so a line must come from inside the timed run, not only at its quarters."""
    from mfu_lab.core.measure import timed as measure
    from mfu_lab.core.process import progress
    from mfu_lab.steps.baseline import step as baseline

    clock = FakeClock()
    monkeypatch.setattr(progress.time, "monotonic", clock)
    real = measure.run_steps

    def slow_run_steps(step, batches, device, warmup, steps, prog=None):
        def slow(x, y):
            clock.t += 20.0  # a unit of work longer than the gap, on the fake clock
            return step(x, y)

        return real(slow, batches, device, warmup, steps, prog)

    monkeypatch.setattr(baseline, "run_steps", slow_run_steps)
    job = dataclasses.replace(tiny_job, steps=8, warmup_steps=0)
    lines: list[str] = []
    baseline.run(job, progress=Progress(lines.append, bar=False), write=False)
    counted = [ln for ln in lines if ln.startswith("baseline steps:")]
    assert len(counted) >= 8 and all("left" in ln for ln in counted[:-1]), lines  # every step: 20 s > the gap


def _busy(cores: float = 1.57) -> Contention:
    return Contention(True, "test", 0.5, cores * 0.5, cores, 2, 2.1, [], True)


def test_a_busy_machine_is_said_first_with_the_command_that_bounds_the_run(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(contention, "busy_now", lambda *a, **k: _busy())
    ran = {}
    monkeypatch.setattr(run_command, "run_steps", lambda *a, **k: ran.setdefault("yes", []) or [])
    code = cli.main(["run", str(TINY), "--out", str(tmp_path), "--steps", "baseline,kernels"])
    out = capsys.readouterr().out
    assert code == 0 and ran
    line = next(ln for ln in out.splitlines() if "busy" in ln)
    assert "1.57 of 2 cores" in line and f"mfu-lab run {TINY} --budget " in line and "--steps baseline,kernels" in line
    m = re.search(r"--budget (\S+) ", line)
    assert floors.step1_refusal(dataclasses.replace(load_job(TINY), budget_min=float(m.group(1))),
                                ["baseline", "kernels"]) == ""  # the suggested budget is one step 1 accepts


def test_a_quiet_machine_prints_no_warning(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(contention, "busy_now", lambda *a, **k: dataclasses.replace(_busy(0.0), shared=False))
    monkeypatch.setattr(run_command, "run_steps", lambda *a, **k: [])
    assert cli.main(["run", str(TINY), "--out", str(tmp_path), "--steps", "baseline"]) == 0
    assert "busy" not in capsys.readouterr().out


def test_a_budget_too_small_for_step_1_is_refused_up_front_with_the_estimate(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(contention, "busy_now", lambda *a, **k: pytest.fail("refused before anything else"))
    monkeypatch.setattr(run_command, "run_steps", lambda *a, **k: pytest.fail("no step may start"))
    code = cli.main(["run", str(TINY), "--out", str(tmp_path), "--budget", "0.5"])
    err = capsys.readouterr().err
    assert code == cli.EXIT_BAD_INPUT
    assert "--budget 0.5 min gives step 1" in err and "needs at least about" in err and "Give --budget" in err
    need = float(re.search(r"Give --budget (\S+) or more", err).group(1))
    assert need > 0.5 and floors.step1_refusal(
        dataclasses.replace(load_job(TINY), budget_min=need), ["baseline"]) == ""


@pytest.mark.parametrize("minutes, warm, timed, over", [(20.0, 3, 20, False), (3.0, 3, 9, False),
                                                        (1.5, 1, 3, True)])
def test_step_1_under_a_budget_times_fewer_steps_and_says_what_it_cut(tiny_job, monkeypatch, minutes, warm, timed,
                                                                      over):
    """Every training step takes 2 s of a fake clock and the estimate says so. The job's full step 1 needs 47 s
    (3 warm-up and 20 timed steps, 1 s after them), more than its share of a 20-minute budget (28.9 s, 16/622 of
    what the seven notebooks' 77 s leave), so it takes the 47 s (under a quarter of the steps' work) and times all
    20. A 3-minute budget gives it a quarter of 103 s, 25.8 s: the 3 warm-up steps (6 s) and 9 timed ones (18 s,
    1 s kept for the re-check). A 1.5-minute one gives 3.3 s: one warm-up step, then the fewest timed steps step 1
    takes (3), said to run past the share."""
    from mfu_lab.core.measure import timed as measure
    from mfu_lab.steps.baseline import step as baseline

    fake = {"t": 0.0}
    real = measure.run_steps

    def run_steps(step, batches, device, warmup, steps, prog=None):
        t = real(step, batches, device, warmup, steps, prog)
        fake["t"] += 2.0 * len(t.wall_s)
        return dataclasses.replace(t, wall_s=[2.0] * len(t.wall_s))

    class Clock(budget.Clock):  # the step's share counts the fake seconds only
        @property
        def used_s(self):
            return fake["t"]

    monkeypatch.setattr(baseline, "run_steps", run_steps)
    monkeypatch.setattr(budget, "Clock", Clock)
    monkeypatch.setattr(budget, "step1_estimate", lambda job, earlier=None: (0.0, 2.0, 2.0, "test"))
    job = dataclasses.replace(tiny_job, steps=20, warmup_steps=3, budget_min=minutes)
    lines: list[str] = []
    r = baseline.run(job, progress=Progress(lines.append, bar=False), write=False)
    assert r.timings.warmup_steps == warm and len(r.timings.measured("wall_s")) == timed
    cut = {s["what"]: s["reason"] for s in r.skipped}
    work = sum(budget.plan(minutes).values())
    assert r.budget["planned_s"] == pytest.approx(max(budget.plan(minutes)["baseline"], min(47.0, work / 4)))
    if timed == 20:
        assert not r.budget["shortened"] and "timed steps" not in cut
        return
    assert cut["timed steps"].startswith(f"budget: {timed} of the job's 20")
    assert ("past the share" in cut["timed steps"]) == over and ("warm-up steps" in cut) == (warm < 3)
    assert r.budget["shortened"]
    assert any(ln.startswith(f"budget: timing {timed} of the job's 20 steps") for ln in lines)


def test_a_launch_that_says_nothing_is_said_to_be_alive_once_per_gap(tmp_path, monkeypatch):
    from mfu_lab.workers import launch

    clock = FakeClock()
    monkeypatch.setattr(launch.time, "monotonic", clock)
    monkeypatch.setattr(launch.time, "sleep", lambda s: setattr(clock, "t", clock.t + s))

    class Proc:  # runs for 50 s of the fake clock and writes no event
        def poll(self):
            return None if clock.t < 1050.0 else 0

    got: list[dict] = []
    hung, seen, _ = launch.watch(Proc(), tmp_path / "progress.jsonl", got.append, timeout_s=600)
    assert not hung and seen == 0
    assert [e["event"] for e in got] == ["quiet"] * 3 and all(e["quiet_s"] >= GAP_S for e in got)


def test_alternated_turns_are_counted_with_the_time_left():
    from mfu_lab.workers import alternate

    lines: list[str] = []
    on = alternate.turn_lines(lines.append, "DDP turns", 4)
    cfg = {"hook": "none", "bucket_mb": 25.0, "grad_as_bucket_view": False}
    on({"event": "start", "config": cfg})
    on({"event": "step", "done": 1, "total": 3})  # within the gap: no line
    on({"event": "done", "config": cfg})
    assert len(lines) == 1 and "DDP turns [1/4]" in lines[0] and "left" in lines[0]
