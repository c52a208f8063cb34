"""Step 5's precision ladder under a budget: which rungs the share holds. The job's own precision is the reference,
built and probed first; each other rung's step is probed once (:func:`probe_step`) and the rungs are taken cheapest
first while their rounds and loss curves fit what is left (:func:`fit`); a rung proven faster whose loss curve
does not fit is skipped with the seconds (:func:`curves_fit`)."""

from __future__ import annotations

import dataclasses
import time

import torch

from mfu_lab.analysis import precision as pr
from mfu_lab.core.job.schema import Job
from mfu_lab.steps.fp8.ladder_timing import Runner, round_steps
from mfu_lab.steps.fp8.rungs import NOT_RUN, Rung, figures

PROBE_STEPS = 2  # steps a budget's probe runs on a fresh rung: one warm-up, then the one it times


def probe_step(runner: Runner) -> float:
    """Seconds of one training step of the runner's rung (measured, the second step of its fresh model, after one
    warm-up step; both count towards the job's warm-up): the budget's estimate of each of its steps."""
    runner.steps(1)
    return float(runner.steps(1).wall_s[0])


LEAN_ROUNDS, LEAN_ROUND_STEPS, LEAN_CURVE = 2, 2, 10  # the least ladder that still gives a spread and a curve


def lean(job: Job, ref_curve: bool) -> Job:
    """The job's ladder at its least: :data:`LEAN_ROUNDS` rounds of :data:`LEAN_ROUND_STEPS` steps and, where no FP8
    trial reuses the reference's curve (``ref_curve``), :data:`LEAN_CURVE`-step loss curves; never more than the
    job's own counts."""
    rounds = min(job.precision_rounds, LEAN_ROUNDS)
    k = min(round_steps(job), LEAN_ROUND_STEPS)
    curve = min(job.fp8_steps, LEAN_CURVE) if ref_curve else job.fp8_steps
    if (rounds, k, curve) == (job.precision_rounds, round_steps(job), job.fp8_steps):
        return job  # already at its least: the same job, not a copy
    return dataclasses.replace(job, precision_rounds=rounds, steps=rounds * k, fp8_steps=curve)


def fit(job: Job, rungs: list[Rung], batches, device: torch.device, say, clock, reserve_s: float,
        ref_curve: bool, tally: dict) -> tuple[dict[str, Runner], dict[str, tuple[float, float]], Job]:
    """Under a budget: (the runners the share holds, warmed, the reference first; {rung: (build s, step s)} as
    probed). The reference (``rungs[0]``, the job's own) is built and probed first, then every other runnable rung
    while the share left holds a probe (about the reference's build and :data:`PROBE_STEPS` steps). Each rung's
    cost is its interleaved rounds and the rest of its warm-up at its probed step, and its loss curve (a build and
    ``fp8_steps`` steps), since only a rung with a loss curve can be adopted; the reference's curve counts when
    only the ladder needs it (``ref_curve``). The other rungs are taken cheapest first while the reference's cost
    and theirs fit the share left less ``reserve_s`` (what step 5 keeps for what comes after); the rest are
    skipped with the seconds. When a rung does not fit but would at the ladder's least (:func:`lean`: fewer rounds,
    steps and curve steps), the ladder shrinks to that, said in the clock's cuts. None fits: nothing is timed, the
    reference included. The third value is the job whose counts the ladder then runs with."""
    ref, live = rungs[0], [r for r in rungs[1:] if r.status not in NOT_RUN]
    if not live:
        return {}, {}, job
    where = (f"step 5's {clock.planned_s:.0f} s share" + (f", less {reserve_s:.0f} s kept for the FP8 trials"
                                                          if reserve_s else ""))

    def left() -> float:
        return clock.left_s() - reserve_s

    def skip(r: Rung, why: str) -> None:
        r.status, r.reason = pr.SKIPPED, "budget: " + why + " (a larger --budget, or none, times it)"
        clock.shorten(f"precision {r.name}", r.reason.removeprefix("budget: "))

    if left() <= 0:
        for r in live:
            skip(r, f"not probed or timed: {max(left(), 0.0):.1f} s left of {where}")
        ref.reason = f"not timed: no time left of {where} for another precision"
        return {}, {}, job
    runners: dict[str, Runner] = {}
    costs: dict[str, tuple[float, float]] = {}
    probe_s = 0.0  # the reference's build and probe: what one more probe costs, about
    for r in [ref] + live:
        if r is not ref and left() < probe_s:
            skip(r, f"not probed or timed: {left():.1f} s left of {where}, less than one probe (about {probe_s:.1f} "
                    f"s: {ref.name}'s build and {PROBE_STEPS} steps, measured)")
            continue
        t0 = time.perf_counter()
        try:
            runner = Runner(job, r, batches, device, say, tally, warm=False)
            build = time.perf_counter() - t0
            r.step_probe_s = probe_step(runner)
        except Exception as err:  # noqa: BLE001 - one rung's failure must not end the step
            r.fail("building and probing", err)
            say(f"  {r.name}: failed: {r.reason}")
            if r is ref:  # nothing to time the others against
                return {}, {}, job
            continue
        runners[r.name], costs[r.name] = runner, (build, r.step_probe_s)
        if r is ref:
            probe_s = time.perf_counter() - t0

    def take(j: Job) -> tuple[list[Rung], dict[str, str]]:  # the rungs whose cost at j's counts fits, cheapest first
        rest = max(j.warmup_steps - PROBE_STEPS, 0) + j.precision_rounds * round_steps(j)  # steps after the probe

        def cost(name: str, curve: bool) -> float:
            build, step = costs[name]
            return rest * step + (build + j.fp8_steps * step if curve else 0.0)

        need = cost(ref.name, ref_curve) if ref.name in runners else 0.0
        kept, over = [], {}
        for r in sorted((r for r in live if r.name in runners), key=lambda r: r.step_probe_s):
            c = cost(r.name, True)
            if need + c <= left():
                kept.append(r)
                need += c
                continue
            over[r.name] = (f"not timed: its rounds and loss curve need about {c:.1f} s ({rest} steps and a "
                            f"{j.fp8_steps}-step curve at {r.step_probe_s * 1e3:.0f} ms a step, its one-step probe, "
                            f"measured), but {left():.1f} s of {where} are left and "
                            f"{', '.join([ref.name] + [x.name for x in kept])} take about {need:.1f} s of them")
        return kept, over

    kept, over = take(job)
    small = lean(job, ref_curve)
    if over and small is not job:  # shrink the ladder to fit before leaving a rung out (the demo's bf16 on a slow host)
        small_kept, small_over = take(small)
        if len(small_kept) > len(kept):
            clock.shorten("precision ladder", (
                f"{small.precision_rounds} rounds of {round_steps(small)} steps and {small.fp8_steps}-step loss curves "
                f"instead of {job.precision_rounds} of {round_steps(job)} and {job.fp8_steps}, so that "
                f"{', '.join(r.name for r in small_kept)} fit {where}"))
            job, kept, over = small, small_kept, small_over
    for r in live:
        if r.name in over:
            skip(r, over[r.name])
            del runners[r.name]
    say("precision ladder: one-step probes (measured): " + ", ".join(
        f"{r.name} {r.step_probe_s * 1e3:.0f} ms" for r in [ref] + live if r.step_probe_s is not None)
        + f"; {', '.join(x.name for x in kept) or 'none'} timed against {ref.name} within {where}")
    if not kept:
        ref.reason = f"not timed: no other precision's rounds and loss curve fit {where}"
        return {}, costs, job
    for r in [ref] + kept:
        try:
            runners[r.name].warm_rest(PROBE_STEPS)
        except Exception as err:  # noqa: BLE001 - one rung's failure must not end the step
            r.fail("warming up", err)
            say(f"  {r.name}: failed: {r.reason}")
            del runners[r.name]
    return runners, costs, job


def curves_fit(job: Job, check: list[Rung], clock, reserve_s: float, costs: dict[str, tuple[float, float]],
                ref_curve: bool) -> list[Rung]:
    """Under a budget, the rungs of ``check`` (the reference first) whose loss curves still fit the share left less
    ``reserve_s`` after the timing, at their probed steps; a rung proven faster whose curve does not fit is skipped
    with the seconds (it cannot be adopted without one). The reference's curve counts only when the ladder alone
    needs it (``ref_curve``: no FP8 trial reuses it)."""
    ref, out, need = check[0], check[:1], 0.0
    left = clock.left_s() - reserve_s
    if ref_curve and ref.name in costs:
        build, step = costs[ref.name]
        need = build + job.fp8_steps * step
    for r in check[1:]:
        build, step = costs.get(r.name, (0.0, 0.0))
        c = build + job.fp8_steps * step
        if need + c <= left:
            out.append(r)
            need += c
            continue
        why = (f"proven faster than {ref.name} ({figures(r, ref.name)}), but its {job.fp8_steps}-step loss curve "
               f"(about {c:.1f} s at its probed {step * 1e3:.0f} ms a step) does not fit the "
               f"{max(left - need, 0.0):.1f} s left of step 5's share, so it cannot be adopted (a larger --budget, or "
               "none, trains it)")
        r.status, r.reason = pr.SKIPPED, "budget: " + why
        clock.shorten(f"precision {r.name} loss curve", why)
    return out
