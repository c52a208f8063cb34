"""Step 5's precision ladder (measured): float32 -> TF32 -> bf16 / fp16 autocast, before the FP8 layer groups.

Every rung trains a model built from the job's seed on the same batches. Its speed is measured side by side
with float32 (highest matmul precision), in interleaved rounds (:mod:`mfu_lab.core.measure.sidebyside`), and its
speedup carries a bootstrap interval; its loss curve over ``fp8_steps`` steps runs under the same
divergence watch as the FP8 trials, against float32's curve. :func:`mfu_lab.analysis.precision.judge`
adopts the fastest rung that is proven faster and kept the loss; otherwise the job keeps its precision.
A rung that cannot run here is skipped with its reason, and one that raises is recorded as failed while the
others go on. Before anything is built, every rung's matmul rate is probed beside float32's (:func:`.rungs.probe`); a
rung that cannot reach float32's within the probes' noise is recorded as "cannot be faster here" with both
rates and is neither trained nor timed (:func:`mfu_lab.analysis.precision.cannot_be_faster`), unless the job is
``thorough``.

Under a budget (a ``clock`` with a share) the ladder plans its rungs from the share it is given
(:func:`.ladder_share.fit`): the job's own precision is the reference, built and probed first, so a job already in
bf16 is judged against bf16 and float32 is only one more rung; each other rung's step is probed once
(:func:`.ladder_share.probe_step`, after one warm-up step) and the rungs are taken cheapest first while their timing
rounds and loss curves, at their probed steps, fit what is left of the share: the others are skipped with the
seconds, and none is timed when none fits. Without a budget everything is as above, against float32.
"""


from __future__ import annotations

import dataclasses
import math
import time
from typing import Any

import torch

from mfu_lab.analysis import fp8_numerics as f8
from mfu_lab.analysis import precision as pr
from mfu_lab.core.engine.batches import to_device
from mfu_lab.core.engine.workload import build_model, build_train_step, eager
from mfu_lab.core.job.schema import Job
from mfu_lab.core.measure import device as dev
from mfu_lab.core.process.progress import as_progress
from mfu_lab.steps.fp8.ladder_share import curves_fit, fit
from mfu_lab.steps.fp8.ladder_timing import round_steps, speed, tally_of
from mfu_lab.steps.fp8.rungs import (
    NO_NATIVE_BF16,
    NOT_RUN,
    REFERENCE,
    WORDS,
    Rung,
    as_job,
    figures,
    plan,
    probe_all,
    unavailable,
)

__all__ = ["NOT_RUN", "Rung", "choose", "ladder", "plan", "settle", "train_trial", "unavailable"]


def train_trial(job: Job, groups: list[str], recipe: str, batches, device: torch.device,
                watch: f8.Watch, beat=None) -> tuple[list[float], list[float], str | None, int | None]:
    """Train a fresh model (the job's seed, dtype and matmul precision, eager) on ``batches``, with ``groups``
    in emulated FP8; stop on the watch. Under float16 the loss scaler runs as in training; a step it skips
    (an overflow, which lowers its scale) is not a divergence and gives the watch no gradient norm. ``beat``: a
    :class:`mfu_lab.core.process.progress.Heartbeat`, called after each step (it prints at most every GAP_S seconds)."""
    model = build_model(job).to(device).train()
    f8.apply_policy(model, groups, recipe)
    ts = build_train_step(eager(job), model, device.type, fp8=False)  # emulation hooks run eager
    for i, (x, y) in enumerate(batches):
        loss = ts.loss(to_device(x, device), to_device(y, device))
        ts.scaler.scale(loss).backward()
        ts.scaler.unscale_(ts.optimizer)
        norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), math.inf))
        ts.scaler.step(ts.optimizer)
        ts.scaler.update()
        ts.optimizer.zero_grad(set_to_none=True)
        value = float(loss.detach())
        if beat is not None:
            beat.beat(i + 1, len(batches), "steps")
        if ts.scaler.is_enabled() and not math.isfinite(norm) and math.isfinite(value):
            watch.losses.append(value)
            continue
        why = watch.check(value, norm)
        if why:
            return watch.losses, watch.grad_norms, why, i
    return watch.losses, watch.grad_norms, None, None


def _loss_check(job: Job, rungs: list[Rung], batches, device: torch.device, say) -> None:
    """Each runnable rung's loss curve under the divergence watch, against the reference rung's (float32's, or the
    job's own under a budget), trained first; final-window gap."""
    reference: list[float] | None = None
    ref_name = next((r.name for r in rungs if r.status == pr.REFERENCE), REFERENCE)
    p = as_progress(say)
    todo = [r for r in rungs if r.status not in NOT_RUN]
    eta = p.eta("loss curves", len(todo))
    for r in rungs:
        if r.status in NOT_RUN:
            continue
        if r.status != pr.REFERENCE and reference is None:
            r.status, r.reason = pr.FAILED, f"no {ref_name} loss curve to compare with"
            continue
        watch = f8.Watch(reference, job.loss_tolerance, job.fp8_window, job.fp8_spike)
        t0 = time.perf_counter()
        try:
            beat = p.heartbeat(f"  {r.name}: loss curve", len(batches))
            losses, norms, why, at = train_trial(as_job(job, r), [], job.fp8_recipe, batches, device, watch, beat)
        except Exception as err:  # noqa: BLE001 - one rung's failure must not end the step
            r.fail("loss curve", err)
            say(f"  {r.name}: loss curve failed: {r.reason}")
            continue
        r.loss, r.grad_norm, r.loss_s, r.diverged, r.stopped_at = losses, norms, time.perf_counter() - t0, why or "", at
        r.scaler_skipped = len(losses) - len(watch.grad_norms)
        if r.status == pr.REFERENCE:
            reference = losses
        elif not why:
            w = min(job.fp8_window, len(losses), len(reference))
            r.final_gap = (sum(losses[-w:]) / w) / (sum(reference[-w:]) / w) - 1
        say(f"  {r.name}: loss {losses[0]:.4f} -> {losses[-1]:.4f}" + (f"; stopped: {why}" if why else "")
            + eta.tag(todo.index(r) + 1))


def ladder(job: Job, batches: list, device: dev.DeviceInfo, say, reference: str = "", clock=None,
           reserve_s: float = 0.0) -> dict[str, Any]:
    """The precision ladder on this device: every rung's figures, the interleave order and the choice.
    ``reference``: why no one needs the reference's loss curve beyond the ladder (step 5's budget holds no FP8
    trial); then, when no other rung is timed, that curve is not trained either ("" trains it). ``clock``: step 5's
    :class:`mfu_lab.core.process.budget.Clock`; with a share, the ladder takes the job's own precision as its
    reference and times only the rungs that fit the share left less ``reserve_s``
    (:func:`.ladder_share.fit`); without one (no budget), float32 is the reference and every runnable rung is timed."""
    torch_device = device.torch_device
    budget = clock is not None and clock.left_s() is not None
    rungs = plan(job, own_first=budget)
    ref = rungs[0]
    for r in rungs[1:]:  # the reference is what the job trains in (float32, or the job's own under a budget)
        why = unavailable(r, device)
        if why:
            r.status, r.reason = pr.SKIPPED, why
    ref.status = pr.REFERENCE
    native = pr.native_bf16() if device.type == "cpu" else None
    out = {"reference": ref.name, "native_bf16": native}
    if len(rungs) == 1:  # precision_rungs is empty and the job trains in float32: nothing to compare
        ref.reason = "no lower precision to try (precision_rungs is empty)"
        return out | {"rungs": [dataclasses.asdict(ref)], "order": [], "choice": choose(job, rungs, None)}
    costs: dict[str, tuple[float, float]] = {}
    try:
        probe_all(job, rungs, device, say)
        runners, tally = None, tally_of(say)
        if budget:
            runners, costs, job = fit(job, rungs, batches, torch_device, say, clock, reserve_s, bool(reference),
                                      tally)  # job: with fewer rounds and curve steps where that lets a rung fit
        timed = any(r.status not in NOT_RUN for r in rungs[1:])
        if not timed and not ref.reason:  # nothing left to race the reference against: its loss curve only
            ref.reason = "not timed: no other precision can be faster here or run here"
        if job.thorough:
            say(f"precision ladder: loss curves over {job.fp8_steps} steps, same seed and batches")
            _loss_check(job, rungs, batches[:job.fp8_steps], torch_device, say)
            order = speed(job, rungs, batches, torch_device, say, runners, tally) if timed else []
        else:  # race: time first; only a rung proven faster can be adopted, so only those need a loss curve
            order = speed(job, rungs, batches, torch_device, say, runners, tally) if timed else []
            runners = None  # their models are not needed for the loss curves
            check = [r for r in rungs if r is ref or r.status not in NOT_RUN and (
                r.speedup_low is None or r.speedup_low > 1.0)]
            if budget:
                check = curves_fit(job, check, clock, reserve_s, costs, bool(reference))
            if reference and check == [ref]:  # nothing to compare with it, and no FP8 trial to reuse it
                ref.loss_skipped, check = f"loss curve not trained: {reference}", []
            for r in rungs:
                if r not in check and r.status not in NOT_RUN:
                    r.loss_skipped = (f"loss curve not trained: not proven faster than {ref.name}, so it cannot be "
                                      "adopted (--thorough trains it)")
            if check:
                say(f"precision ladder: loss curves over {job.fp8_steps} steps for "
                    f"{', '.join(r.name for r in check)}")
                _loss_check(job, check, batches[:job.fp8_steps], torch_device, say)
    finally:
        torch.set_float32_matmul_precision(job.matmul_precision)
    choice = choose(job, rungs, settle(job, rungs, native))
    return out | {"rungs": [dataclasses.asdict(r) for r in rungs], "order": order, "choice": choice}


def settle(job: Job, rungs: list[Rung], native: dict | None) -> str | None:
    """Each rung's status and reason under the adoption rule (:func:`mfu_lab.analysis.precision.judge`), with
    what this device adds to them; returns the adopted rung's name or None."""
    if rungs[0].status == pr.FAILED:  # no reference (float32, or the job's own): nothing else can be judged
        for r in rungs[1:]:
            if r.status not in (pr.SKIPPED, pr.FAILED):
                r.status, r.reason = pr.FAILED, f"the {rungs[0].name} reference failed: " + rungs[0].reason
    figures = [pr.Figures(r.name, r.speedup, r.speedup_low, r.speedup_high, r.final_gap, r.diverged,
                          r.status if r.status in pr.UNJUDGED else "", r.loss_skipped) for r in rungs]
    verdicts, adopted = pr.judge(figures, job.loss_tolerance, next((r.name for r in rungs if r.own), ""),
                                 rungs[0].name)
    for r, (status, reason) in zip(rungs, verdicts):
        if r.status not in pr.UNJUDGED:
            r.status, r.reason = status, reason
        slow = status in (pr.SLOWER, pr.CANNOT_BE_FASTER) or (status == pr.NOT_FASTER and (r.speedup or 1.0) < 1.0)
        if r.dtype == "bfloat16" and slow and native and native["native"] is False:
            r.reason += f"; {NO_NATIVE_BF16}"
        if r.probe.get("cannot_be_faster") and r.status != pr.CANNOT_BE_FASTER:  # timed anyway: --thorough
            r.reason += f"; {r.probe['reason']}"
        if r.scaler_skipped:
            r.reason += f"; the loss scaler skipped {r.scaler_skipped} step(s) on overflow"
    return adopted


def _note(r: Rung) -> str:
    """The part of a rung's reason the choice repeats: why it could not run, or why its bf16 is slow."""
    if r.status in (pr.SKIPPED, pr.FAILED, pr.DIVERGED, pr.CANNOT_BE_FASTER):
        return f" ({r.reason.split(';')[0]})"
    return f"; {NO_NATIVE_BF16}" if NO_NATIVE_BF16 in r.reason else ""


def choose(job: Job, rungs: list[Rung], adopted: str | None) -> dict[str, Any]:
    """The precision this job should train in, with one sentence that carries the figures. ``rungs[0]`` is the
    reference every figure is against (float32, or the job's own under a budget)."""
    tol, k, ref = job.loss_tolerance, round_steps(job), rungs[0]
    how = (f"{job.precision_rounds} interleaved rounds of {k} steps; loss over {job.fp8_steps} steps from the same "
           f"seed and batches, tolerance {tol:.0%}")
    out = [r.name for r in rungs if r.status == pr.CANNOT_BE_FASTER]
    if out:
        how += (f"; {', '.join(out)} ruled out before any training by {pr.PROBES} matmul probes beside {ref.name}'s "
                "(measured), so not timed")
    cut = [r.name for r in rungs if r.status == pr.SKIPPED and r.reason.startswith("budget: ")]
    if cut:
        how += f"; {', '.join(cut)} left out by step 5's share of the budget (each with its seconds)"
    pick = next((r for r in rungs if r.name == adopted), None) or next(r for r in rungs if r.own)
    if adopted:
        verb, mine = ("Keep", " (the job's own precision)") if pick.own else ("Train in", "")
        text = (f"{verb} {WORDS.get(pick.name, pick.name)}{mine}: "
                f"{figures(pick, ref.name)} ({how}). Job-file: dtype: {pick.dtype}; matmul_precision: "
                f"{pick.matmul_precision}")
    else:
        others = [f"{r.name} {r.status}" + (f" ({figures(r, ref.name)})" if figures(r) else "") + _note(r)
                  for r in rungs if r is not ref]
        than = "lower precision was" if ref.name == REFERENCE else f"other precision was proven faster than {ref.name}"
        text = (f"Keep the job's precision ({pick.dtype}, matmul {pick.matmul_precision}): no {than}"
                + (" proven faster" if ref.name == REFERENCE else "") + " with its loss kept"
                + (f" — {'; '.join(others)}" if others else "") + f" ({how})")
        if pick.own and pick.status in (pr.OFF, pr.DIVERGED):
            text += f". The job's own {pick.name} did not keep float32's loss ({pick.reason}): consider float32"
        if pick.own and pick.status == pr.CANNOT_BE_FASTER:
            text += (f". The job's own {pick.name} cannot be faster than float32 here "
                     f"({pick.reason.split(';')[0]}): consider float32")
    measured = pick is not ref
    return {"dtype": pick.dtype, "matmul_precision": pick.matmul_precision, "rung": pick.name,
            "adopted": adopted is not None, "text": text,
            "speedup": pick.speedup if measured else None, "speedup_low": pick.speedup_low if measured else None,
            "speedup_high": pick.speedup_high if measured else None,
            "final_gap": pick.final_gap if measured else None, "label": "measured"}
