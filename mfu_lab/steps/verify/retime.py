"""Step 7's last turn: the tuned file as written, timed again beside the original, when the staircase's top rung
is no longer it.

The staircase adds the adopted changes one at a time, and a rung not measured faster than the rung below beyond
the noise is withdrawn (:func:`mfu_lab.steps.verify.step.withdraw_unproven`): its keys go back to the job's values
in ``tuned.yaml``. Every rung above it was measured *with* the withdrawn change, so the top rung kept is not the
tuned file, and its figure would describe a job nobody runs (on the tiny test job, ``num_workers: 2`` was withdrawn
at 0.57x, and the headline's 0.59x was that of a job still holding it). The original and the tuned job as written
then run once more, each in a process of its own, in interleaved rounds like the staircase's, and the headline,
the metrics, the loss check and the ledgers are theirs. The same holds wherever the top rung ran another job than the
file in a key its process applies (a change above it that failed, a layout's micro_batch withdrawn). Where step 7's
share cannot hold that turn, or the job runs in a layout of its own, the headline says in which keys its figure
differs from the file.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from mfu_lab.analysis import tuning
from mfu_lab.analysis.result_keys import MAY_SET
from mfu_lab.core.engine.layout import beyond_ddp
from mfu_lab.core.errors import JobError
from mfu_lab.core.job.schema import Job
from mfu_lab.core.process.budget import Clock, cold_compile, rung_turns_s
from mfu_lab.steps.verify import memory_share
from mfu_lab.steps.verify.rungs import Rung, give_peaks, measure_rungs
from mfu_lab.steps.verify.staircase import speedups

AGAIN, AS_WRITTEN = "original again", "tuned as written"


# keys a rung's single process does not apply: DDP and FSDP2 settings, the layout's degrees (verified under torchrun);
# a layout's micro_batch it does apply
NOT_IN_ONE_PROCESS = frozenset(k for rung in ("communication", "layout") for k in MAY_SET[rung].keys) - {
    "micro_batch"}
# FP8's keys it applies only where its FP8 rung was timed (core.engine.fp8 converted there: a withdrawn FP8 rung
# leaves the rungs above it timed with FP8 and tuned.yaml without); an excluded FP8 rung (emulated, or its process
# could not convert) means no rung converted, so there they change nothing a rung measured
FP8_KEYS = frozenset(MAY_SET["fp8"].keys)


@dataclasses.dataclass
class Stale:
    """What the top rung kept was measured with that the tuned file does not hold: key -> the top rung's value, and
    the rungs below it that set those keys (withdrawn by step 7, or by its torchrun checks)."""

    rungs: list[str]
    keys: dict[str, tuple]  # key -> (the top rung's value, the tuned file's)

    def words(self) -> str:
        if not self.keys:
            return "another job than the tuned file"
        return ", ".join(f"{k} {a} where tuned.yaml has {b}" for k, (a, b) in self.keys.items()) + (
            f" (rung {', '.join(self.rungs)})" if self.rungs else "")


def stale(rungs: list[Rung], jobs: list[Job], after: Rung | None, tuned: Job) -> Stale | None:
    """Where the job ``after`` (the top rung kept) ran differs from ``tuned`` (the file as written) in a key its
    process applies: a change withdrawn below it, timed or not (a rung that failed), or a layout's micro_batch the
    torchrun check withdrew. None when they are the same job there."""
    if after is None or after not in rungs:
        return None
    top = jobs[rungs.index(after)]
    timed_fp8 = any(r.name == "fp8" and r.status != "excluded" for r in rungs)
    ignored = NOT_IN_ONE_PROCESS | (frozenset() if timed_fp8 else FP8_KEYS)
    keys = {k: (v, getattr(tuned, k)) for k, v in changed(tuned, top).items() if k not in ignored}
    if not keys:
        return None
    return Stale([r.name for r in rungs[1:] if r is not after and set(r.keys) & set(keys)], keys)


def as_written(job: Job, chosen: list) -> Job:
    """The tuned job as ``tuned.yaml`` holds it (every change in effect: step 7's withdrawals and re-checks
    included), under the job's own name (a rung's process writes nothing of its own name)."""
    return dataclasses.replace(tuning.tuned_job(job, chosen), job_name=job.job_name)


@dataclasses.dataclass
class SecondTurn:
    gone: Stale
    pair: list[Rung]
    order: list
    not_timed: str  # why the pair is not the headline ("" when it is)

    def say_in(self, headline: dict, after: Rung, stairs: list[Rung]) -> None:
        """The headline's note on the turn; when the pair is the headline, the changes it carried are the tuned
        file's (timed together, against the original), less those not timed here (excluded rungs' keys)."""
        written = after.name == AS_WRITTEN
        headline["note"] = f"the staircase's top rung ran {self.gone.words()}: " + (
            "the tuned file as written was timed again beside the original" if written else
            "the tuned file as written was not timed (see skipped)")
        headline["text"] += "; " + headline["note"]
        headline["as_written"] = written
        if written:
            untimed = {k for r in stairs if r.status == "excluded" for k in r.keys}
            keys = ", ".join(f"{k}: {v}" for k, v in after.keys.items() if k not in untimed)
            headline["carried"] = [f"the tuned file as written ({keys})"] if after.proven and after.gain > 1 else []


def second_turn(job: Job, run_job: Job, chosen: list, rungs: list[Rung], jobs: list[Job], before: Rung | None,
                after: Rung | None, clock: Clock, device, work: Path, say, results: dict) -> SecondTurn | None:
    """Step 7's second turn where the top rung kept ran another job than the tuned file as written (None
    elsewhere): the file timed beside the original, or why not (a layout's staircase is not timed twice; the
    share; a tuned file that does not validate)."""
    if before is None or after is None or after is before:
        return None
    try:
        tuned = as_written(job, chosen)
    except JobError as e:  # recorded; the staircase's figures stand
        return SecondTurn(Stale([], {}), [], [], f"the tuned file as written does not validate: {e}")
    gone = stale(rungs, jobs, after, tuned)
    if not gone:
        return None
    if beyond_ddp(job):
        return SecondTurn(gone, [], [], "the job runs in a layout of its own, where the staircase is not timed twice")
    each = max(r.step_median_s for r in (before, after))
    pair, order, why = retime(job, run_job, tuned, gone, each, clock, device, work, say, results)
    return SecondTurn(gone, pair, order, why)


def need_s(job: Job, tuned: Job, each_s: float, rounds: int, compile_step: dict | None) -> float:
    """Seconds the turn takes: two rung processes, each started, warmed up (a compiled one compiles cold) and timed
    ``rounds`` x ``verify_steps`` steps of about ``each_s``."""
    compiles = sum(j.compile_mode != "off" for j in (job, tuned))
    return rung_turns_s(job, 2, rounds, each_s) + compiles * cold_compile(job, compile_step)[0]


def reserve(job: Job, stairs: list, rungs: list[Rung], jobs: list[Job], withdrawable, each_s: float,
            compile_step: dict | None) -> tuple[float, str]:
    """(seconds, what for) step 7 keeps back from the staircase's rounds for the second turn: its least (2 rounds)
    when a rung it may withdraw (``withdrawable(name, changes)``) is timed below another timed rung, else 0."""
    changes = {name: mine for name, _, mine in stairs}
    timed = [(r, j) for r, j in zip(rungs, jobs) if r.status == "ok"]  # a re-check above counts: it holds them too
    for r, _ in timed[1:-1]:
        if not r.challenger and withdrawable(r.name, changes.get(r.name) or []):
            s = need_s(job, timed[-1][1], each_s, 2, compile_step)
            return s, f"about {s:.0f} s kept for the tuned file's second turn, should rung {r.name} be withdrawn"
    return 0.0, ""


def retime(job: Job, run_job: Job, tuned: Job, gone: Stale, each_s: float, clock: Clock, device, work: Path,
           say, results: dict) -> tuple[list[Rung], list, str]:
    """Time ``tuned`` (the file as written) beside the original in rounds of their own, with as many of
    ``run_job``'s rounds as step 7's share holds (at least 2; ``each_s``: the staircase's slower median step): (the
    two rungs, the order they ran in, "") or ([], [], why not)."""
    rounds, left, step4 = run_job.verify_rounds, clock.left_s(), results.get("compile")
    if left is not None:
        rounds = next((n for n in range(rounds, 1, -1) if need_s(run_job, tuned, each_s, n, step4) <= left), 0)
        if not rounds:
            return [], [], (f"budget: {left:.0f} s of step 7's share left, and timing the tuned file as written "
                            f"beside the original takes about {need_s(run_job, tuned, each_s, 2, step4):.0f} s (two "
                            "processes, 2 rounds)")
    pair = [Rung(AGAIN, {}, "ok", dtype=job.dtype), Rung(AS_WRITTEN, changed(job, tuned), "ok", dtype=tuned.dtype)]
    jobs = [job, tuned]
    give_peaks(job, device, pair, jobs, say)
    memory = memory_share.for_device(device, {AGAIN: job.micro_batch, AS_WRITTEN: tuned.micro_batch},
                                     job.micro_batch, results.get("baseline"), memory_share.graph_rungs(pair, jobs))
    say(f"the tuned file as written (the staircase's top rung ran {gone.words()}): timing it beside the original, "
        f"{rounds} rounds")
    order = measure_rungs(dataclasses.replace(run_job, verify_rounds=rounds), pair, jobs, work, say, memory)
    if not all(r.wall_s for r in pair):
        return pair, order, "; ".join(f"{r.name} {r.status}: {r.reason}" for r in pair if not r.wall_s)
    speedups(pair, AGAIN)  # the speedup over the original again, which is also the gain: the rung below
    return pair, order, ""


def changed(job: Job, tuned: Job) -> dict[str, object]:
    """The keys ``tuned`` holds at other values than ``job`` (the rung's "adds": over the original)."""
    return {f.name: getattr(tuned, f.name) for f in dataclasses.fields(job)
            if f.name != "job_name" and getattr(tuned, f.name) != getattr(job, f.name)}
