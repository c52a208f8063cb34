"""Step 5's precision ladder, timed: one rung's model and step continuing round after round (:class:`Runner`),
and the interleaved rounds that give each rung its step times and its speedup against the reference with a
bootstrap interval (:func:`speed`, measured side by side)."""

from __future__ import annotations

import itertools
import math

import torch

from mfu_lab.analysis import precision as pr
from mfu_lab.core.engine.workload import build_model, build_train_step
from mfu_lab.core.job.schema import Job
from mfu_lab.core.measure.sidebyside import bootstrap_speedup, interleave
from mfu_lab.core.measure.timed import run_steps, stats
from mfu_lab.core.process.progress import as_progress
from mfu_lab.steps.fp8.rungs import NOT_RUN, Rung, as_job


class Runner:
    """One rung's model and training step, continuing over the shared batches round after round."""

    def __init__(self, job: Job, rung: Rung, batches: list, device: torch.device, say, tally: dict | None = None,
                 warm: bool = True):
        self.rung, self.device, self.say = rung, device, say
        self.tally = tally  # shared by the rungs: {"n": rounds run, "eta": Eta, "beat": Heartbeat} (time left)
        self.job = as_job(job, rung)
        self.model = build_model(self.job).to(device).train()
        self.step = build_train_step(self.job, self.model, device.type, fp8=False)
        self.batches = itertools.cycle(batches)
        if job.warmup_steps and warm:  # warm=False: the budget's probe warms it (probe_step, then warm_rest)
            self.steps(job.warmup_steps)

    def warm_rest(self, done: int) -> None:
        """The job's warm-up steps less the ``done`` ones already run (the probe's)."""
        if self.job.warmup_steps > done:
            self.steps(self.job.warmup_steps - done)

    def steps(self, k: int):
        torch.set_float32_matmul_precision(self.rung.matmul_precision)  # process-wide: set for each round
        beat = self.tally["beat"] if self.tally else None  # a line between steps, at most every GAP_S seconds
        tick = None if beat is None else (lambda done, total, _: beat.beat(done, total, f"{self.rung.name}, steps"))
        if beat is not None:
            beat.restart()  # the time left counts this run's steps
        return run_steps(self.step, self.batches, self.device, 0, k, tick)

    def __call__(self, k: int) -> dict[str, list[float]]:
        if self.rung.status != pr.FAILED:
            try:
                t = self.steps(k)
                tag = ""
                if self.tally:
                    self.tally["n"] += 1
                    tag = self.tally["eta"].tag(min(self.tally["n"], self.tally["eta"].total))
                    self.tally["beat"].said()
                self.say(f"  {self.rung.name}: {stats(t.wall_s).median * 1e3:.1f} ms per step" + tag)
                return {"wall_s": t.wall_s, "data_s": t.data_s, "compute_s": t.compute_s, "loss": t.loss}
            except Exception as err:  # noqa: BLE001 - the other rungs keep their rounds
                self.rung.fail("timing", err)
                self.say(f"  {self.rung.name}: timing failed: {self.rung.reason}")
        return {"wall_s": [math.nan] * k}  # a failed rung's slot: kept in the order, its times are not used


def tally_of(say) -> dict:
    p = as_progress(say)
    return {"n": 0, "eta": p.eta("precision rounds", 0), "beat": p.heartbeat("  precision ladder")}


def round_steps(job: Job) -> int:
    """Steps of each rung in each interleaved round."""
    return max(2, job.steps // job.precision_rounds)


def speed(job: Job, rungs: list[Rung], batches, device: torch.device, say,
           runners: dict[str, Runner] | None = None, tally: dict | None = None) -> list[list]:
    """Interleaved timing of every runnable rung (``runners``: built and warmed already, under a budget); fills
    step times and speedups against the reference (``rungs[0]``); returns the order run."""
    p = as_progress(say)
    tally = tally or tally_of(say)
    if runners is None:
        runners = {}
        for r in rungs:
            if r.status in NOT_RUN:
                continue
            try:
                runners[r.name] = Runner(job, r, batches, device, say, tally)
            except Exception as err:  # noqa: BLE001 - one rung's failure must not end the step
                r.fail("building and warming up", err)
                say(f"  {r.name}: failed: {r.reason}")
    if not runners:
        return []
    k = round_steps(job)
    say(f"timing {', '.join(runners)}: {job.precision_rounds} interleaved rounds of {k} steps each")
    tally["eta"] = p.eta("precision rounds", job.precision_rounds * len(runners))  # counted from here
    run = interleave(runners, job.precision_rounds, k)
    ref = rungs[0]
    for r in rungs:
        if r.name not in runners or r.status == pr.FAILED:
            continue
        s = stats(run.series[r.name].wall_s)
        r.step_median_s, r.step_p10_s, r.step_p90_s = s.median, s.p10, s.p90
        if r is ref:
            r.speedup = 1.0
        elif ref.status != pr.FAILED and ref.name in runners:
            sp = bootstrap_speedup(run.series[ref.name].wall_s, run.series[r.name].wall_s)
            r.speedup, r.speedup_low, r.speedup_high = sp.value, sp.low, sp.high
    return [[i, name] for i, name in run.order]
