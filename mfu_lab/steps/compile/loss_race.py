"""Step 4's loss race (issue 46): the default cross-entropy computed eager, compiled, or chunked
(:mod:`mfu_lab.core.engine.losses`), raced side by side in the compile mode the job will train in after step 4,
and a pick proven faster carried into ``tuned.yaml`` (``loss_impl``, read by :mod:`mfu_lab.analysis.tuning`) for
step 7 to verify.

The mode: the one step 4 recommends (confirmed), else the job's own ``compile_mode``. Under a compile mode the
candidates are ``eager`` (the model compiled, the loss outside) and ``compiled`` (the forward and the loss as one
region); with ``compile_mode: off`` they are ``eager``, ``compiled`` (the loss alone compiled) and ``chunked``
(F.linear_cross_entropy, where this torch has it and the model has an ``lm_head``). A job with its own ``loss:``
or whose batches are not token ids has no default cross-entropy to race: said, not raced.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from mfu_lab.core.engine.losses import chunked_problem
from mfu_lab.core.job.rules import LOSS_IMPLS
from mfu_lab.core.job.schema import Job
from mfu_lab.core.process.budget import Clock
from mfu_lab.steps.key_race import ROUNDS, STEPS_PER_ROUND, cost_s, race_key


def candidates(job: Job, mode: str, chunked_why: str | None) -> tuple[list[str], dict[str, str]]:
    """The loss implementations to race in compile ``mode`` (the job's own first) and those left out, with why."""
    out, missing = [job.loss_impl], {}
    for impl in LOSS_IMPLS:
        if impl == job.loss_impl:
            continue
        if impl == "chunked" and mode != "off":
            missing[impl] = (f"chunked does not combine with a compiled region (mode {mode}): torch.compile falls "
                             "back to eager at the chunked operator")
        elif impl == "chunked" and chunked_why:
            missing[impl] = chunked_why
        else:
            out.append(impl)
    return out, missing


def race_loss(job: Job, mode: str, device: torch.device, model: torch.nn.Module, tokens: bool,
              left_s: float | None, step_s: float, compile_s: float, progress=None) -> dict[str, Any]:
    """The race's record for ``result.json`` (``loss_race``): the mode, the candidates, their medians and final
    losses, the pick and its interval against the job's own ``loss_impl``, and whether it is adopted.
    ``left_s``: the step's budget left (None: none); ``step_s``: a step's time in this mode; ``compile_s``: one
    cold compile (counted once per compiled candidate); ``model``: the job's model (whether it has an lm_head)."""
    base = {"mode": mode, "reference": job.loss_impl, "source": "measured"}
    if job.loss:
        return base | {"ran": False, "note": f"the job computes its own loss (loss: {job.loss}); loss_impl "
                       "chooses how the default cross-entropy runs, so there is nothing to race"}
    if not tokens:
        return base | {"ran": False, "note": "the batches are not token ids with targets: the job's loss is its "
                       "model's own or its loss:, not the default cross-entropy"}
    names, missing = candidates(job, mode, chunked_problem(model))
    base["left_out"] = missing
    compiles, need = race_cost(names, mode, step_s, compile_s)
    if left_s is not None and need > left_s:
        return base | {"ran": False, "note": f"budget: the race needs about {need:.0f} s ({len(names)} loss "
                       f"implementations, {ROUNDS} rounds of {STEPS_PER_ROUND} steps at about {step_s:.2g} s a step, "
                       f"{compiles} compile(s) of about {compile_s:.0f} s), {max(left_s, 0):.0f} s of step 4's share "
                       "left; set loss_impl by hand, or give a larger --budget"}
    raced = dataclasses.replace(job, compile_mode=mode)
    return base | race_key(raced, "loss_impl", names, device, "loss race", progress)


def race_cost(names: list[str], mode: str, step_s: float, compile_s: float) -> tuple[int, float]:
    """(cold compiles, seconds) of the race of ``names`` in compile ``mode``: every candidate compiles under a mode,
    only ``compiled`` without one (:func:`mfu_lab.steps.key_race.cost_s`)."""
    compiles = sum(1 for n in names if mode != "off" or n == "compiled")
    return compiles, cost_s(len(names), step_s, compiles * compile_s)


def reserve_s(job: Job, model: torch.nn.Module, tokens: bool, step_s: float, compile_s: float) -> float:
    """The seconds step 4 keeps back for the loss race while it still has compile modes to try (0 when the race
    would not run): the race in the job's own mode at eager's step (:func:`race_cost`). A further mode is worth
    less than the loss inside the compiled region (the first H200 run: 22% of the step)."""
    if job.loss or not tokens:
        return 0.0
    names, _ = candidates(job, job.compile_mode, chunked_problem(model))
    return race_cost(names, job.compile_mode, step_s, compile_s)[1] if len(names) > 1 else 0.0


def race_in_step(job: Job, rec: dict[str, Any], best, eager, trials: list, model, tokens: bool, clock: Clock,
                 skipped: list[dict[str, str]], say) -> dict[str, Any]:
    """Step 4's call: loss_impl raced (:func:`race_loss`) in the mode the job trains in after step 4 (``rec``, the
    step's recommendation), at the step time of that mode's trial (``best``, else the trial of that mode, else
    ``eager``: each a :class:`mfu_lab.steps.compile.step.Trial`) and the longest cold compile; a budget's cut goes
    to ``clock``, any other reason not to race to ``skipped``. Its record."""
    mode = rec["mode"] if rec.get("compile") else job.compile_mode
    ran = best or next((t for t in trials if t.mode == mode and t.status == "ok"), None)
    step_s = (ran or eager).step_median_s or 0.0
    compile_s = max([t.compile_cold_s or 0.0 for t in trials if t.status == "ok"] or [0.0])
    say(f"racing the loss's implementations side by side (mode {mode})")
    r = race_loss(job, mode, next(model.parameters()).device, model, tokens, clock.left_s(), step_s, compile_s,
                  say)
    if r.get("ran"):
        say(f"loss race: {r['verdict']}")
    elif r["note"].startswith("budget: "):
        clock.shorten("loss race", r["note"][len("budget: "):])
    else:
        skipped.append({"what": "loss race", "reason": r["note"]})
    return r
