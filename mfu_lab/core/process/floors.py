"""The floors of a run under a budget, and what the run says about them before its first step.

A step that measures in rounds keeps a floor whatever its share (:func:`minimums`): step 3 its profiled steps and
a few timed ones, step 4 eager and one compiled mode with a cold compile, step 7 two rungs of two rounds. Before
the first step the runner says when the budget's plan gives a step less than its floor (:func:`minimum_text`,
rolled as the runner rolls the shares: :func:`roll`), refuses a budget whose share cannot hold step 1's minimum
(:func:`step1_refusal`), and says when the machine is busy and which ``--budget`` bounds the run
(:func:`busy_text`). The shares themselves and the fits inside each step live in :mod:`mfu_lab.core.process.budget`.
"""

from __future__ import annotations

import math

from mfu_lab.core.process.budget import (
    STEP1_MOST,
    STEP_OVERHEAD_S,
    WEIGHTS,
    cold_compile,
    job_step_s,
    plan,
    rolled_share,
    step1_minimum_s,
    step1_share_s,
    trial_start,
)


def minimums(job, earlier: dict[str, dict | None]) -> dict[str, tuple[float, str]]:
    """(seconds, how) each step with a floor needs at least, whatever its share: the floors the fit functions of
    :mod:`mfu_lab.core.process.budget` keep (step 3 its profiled steps and 1 warm-up and 3 timed steps; step 4
    eager and one compiled mode, 3 timed steps each, with their starts and a cold compile; step 7 two rungs of 2
    rounds). ``earlier``: the job's last results by step key (step 1's gives the step time, step 4's the cold
    compile)."""
    each, _ = job_step_s(earlier.get("baseline"))
    profiled = 1.5 * each * (job.profile_warmup_steps + job.profile_steps) + 5.0
    cold, where = cold_compile(job, earlier.get("compile"))
    start, start_from = trial_start(job)
    compile_s = 2 * (start + (job.compile_warmup_steps + 3) * each) + cold + 3 * 2 * each
    verify_s = 2 * (5.0 + job.verify_warmup_steps * each + 2 * job.verify_steps * each)
    return {
        "kernels": (profiled + 4 * each, "its profiled steps, 1 warm-up and 3 timed steps"),
        "compile": (compile_s, f"eager and one mode: two trial starts of about {start:.0f} s ({start_from}), a "
                               f"{cold:.0f} s cold compile ({where}), warm-up and 3 timed steps each"),
        "verify": (verify_s, f"the original and one rung, 2 rounds of {job.verify_steps} steps each"),
    }


def step_basis(earlier: dict[str, dict | None]) -> str:
    """The training step the floors of :func:`minimums` are counted at, and where it comes from, said once."""
    each, src = job_step_s(earlier.get("baseline"))
    return f"Training steps at about {each:.2g} s each: {src}"


ABSORBED = 0.5  # the least of its plan a step without a floor (2, 5, 6) is taken to keep when it gives up time


def roll(p: dict[str, float], take, overhead_s: float, notebook_s: float | None = None,
         fixed: dict[str, float] | None = None) -> tuple[dict[str, float], float]:
    """Plan ``p`` rolled as the runner rolls it (``budget.rolled_share`` before each step, in the workbook's order):
    each step's share (``fixed`` gives some outright, as step 1's), the step taking ``take(key, share)`` seconds and
    a notebook of ``notebook_s`` (``overhead_s``, the plan's, when None). Returns (the shares, seconds the run ends
    past the plan)."""
    keys = [k for k in WEIGHTS if k in p]
    planned, used, out = sum(p.values()) + len(keys) * overhead_s, 0.0, {}
    for i, k in enumerate(keys):
        out[k] = (fixed or {}).get(k, rolled_share(planned - used, keys[i:], overhead_s))
        used += take(k, out[k]) + (overhead_s if notebook_s is None else notebook_s)
    return out, used - planned


def minimum_text(job, keys: list[str], earlier: dict[str, dict | None], overhead_s: float = STEP_OVERHEAD_S) -> str:
    """What a run prints before its first step when the budget's plan gives a step less than its minimum
    (:func:`minimums`): the step runs its minimum anyway. The run rolled as the runner rolls it
    (:func:`roll`) says whether the steps after it absorb that (every floor held, the steps without one
    keeping :data:`ABSORBED` of their plan, the run ending within a second of the budget): then the line says so;
    otherwise the run may end about that much past the budget, said with the figures. '' when every share holds its
    step's minimum, or without a budget."""
    p = plan(getattr(job, "budget_min", 0.0) or 0.0, keys, overhead_s)
    if not p:
        return ""
    numbers = {k: i for i, k in enumerate(WEIGHTS, 1)}
    needs = {k: v for k, v in minimums(job, earlier).items() if k in p}
    short = [(k, p[k], need, how) for k, (need, how) in needs.items() if p[k] < need]
    if not short:
        return ""
    over = sum(need - share for _, share, need, _ in short)
    parts = "; ".join(f"step {numbers[k]} gets {share:.0f} s but needs about {need:.0f} s ({how})"
                      for k, share, need, how in short) + f". {step_basis(earlier)}"
    bigger = max(budget_for(k, need, overhead_s) for k, _, need, _ in short)
    shares, past = roll(p, lambda k, share: max(share, needs[k][0]) if k in needs else share, overhead_s)
    kept = all(shares[k] >= ABSORBED * p[k] for k in p if k not in needs)  # the steps without a floor gave little
    if past <= 1.0 and kept:  # the run's re-spread takes it from the steps after them
        return (f"the budget of {job.budget_min:g} min gives a step less than its minimum: {parts}. A step short of "
                f"its minimum runs it anyway and the steps after it get about {over:.0f} s less between them, so the "
                f"run can still keep to the budget; --budget {bigger:g} gives every step its minimum")
    return (f"the budget of {job.budget_min:g} min cannot hold every step's minimum: {parts}. Those steps run their "
            f"minimum, so the run may end about {max(past, over if not kept else 0.0):.0f} s past the budget (the "
            f"steps after them get less); --budget {bigger:g} holds them")


def budget_for(key: str, seconds: float, overhead_s: float = STEP_OVERHEAD_S) -> float:
    """The --budget in minutes whose share for step ``key`` is ``seconds`` (rounded up to a tenth)."""
    return math.ceil((seconds * sum(WEIGHTS.values()) / WEIGHTS[key] + len(WEIGHTS) * overhead_s) / 60.0 * 10) / 10


def step1_refusal(job, keys: list[str], earlier: dict | None = None) -> str:
    """Why the job's budget cannot hold step 1's minimum ('' when it can, or step 1 is not run, or no budget)."""
    budget = getattr(job, "budget_min", 0.0) or 0.0
    if not budget or "baseline" not in keys:
        return ""
    share = step1_share_s(job, earlier)
    need, how = step1_minimum_s(job, earlier)
    if share >= need:
        return ""
    others = [k for k in keys if k != "baseline"] or [k for k in WEIGHTS if k != "baseline"]
    return (f"--budget {budget:g} min gives step 1 {share:.1f} s (its share by the rule in README 'Cost': at most "
            f"{STEP1_MOST:.0%} of what {len(WEIGHTS)} x {STEP_OVERHEAD_S:.0f} s of notebooks leave), but "
            f"step 1 needs at least about {need:.0f} s ({how}). "
            f"Give --budget {budget_for('baseline', need):g} or more, or leave step 1 out: --steps {','.join(others)}")


def busy_text(contention, job_arg: str, keys: list[str], job=None, earlier: dict | None = None) -> str:
    """The warning a run prints first when other processes keep the machine busy ('' when it is not), with the
    command that bounds the run: ``--budget`` at the reference CPU's time for the steps selected (at least what
    step 1 needs), or fewer steps."""
    if contention is None or not contention.shared:
        return ""
    ref_s = sum(w + STEP_OVERHEAD_S for k, w in WEIGHTS.items() if k in keys)
    free = max(contention.usable_cores - (contention.other_cores or 0.0), 0.25)
    slower = contention.usable_cores / free if contention.other_cores is not None else None
    need = budget_for("baseline", step1_minimum_s(job, earlier)[0]) if job is not None else 0.0
    budget = max(math.ceil(ref_s / 60.0), need)
    cmd = "mfu-lab run" + (f" {job_arg}" if job_arg else "")
    cheap = ",".join(k for k in ("baseline", "kernels") if k in keys) or "baseline"
    has_budget = job is not None and getattr(job, "budget_min", 0.0)
    return (f"the machine is busy: {contention.text()}. The steps time a shared machine and take longer: about "
            f"{ref_s / 60:.1f} min for the steps selected on an idle 2-core reference CPU (README, 'Cost')"
            + (f"; with {free:.2f} of {contention.usable_cores} cores free here, expect about {slower:.1f}x that or "
               "more" if slower else "")
            + (f"; the job's budget of {job.budget_min:g} min bounds it" if has_budget else
               f". To bound the run: {cmd} --budget {budget:g} (minutes; each step shortens to fit), or fewer "
               f"steps: {cmd} --steps {cheap}") + ".")
