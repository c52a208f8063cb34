"""Step 5's FP8 policy trials (emulated): which layer groups can train in FP8 and keep the loss curve.

A policy is a set of linear-layer groups in FP8 under one scaling recipe: the reference precision (no FP8), FP8
on the MLP, on every group but the most sensitive (:mod:`mfu_lab.steps.fp8.sensitivity`), everywhere, the job's
own ``fp8_layers`` and ``fp8_policies``; the scaling study adds everywhere under the other recipe and everywhere
without scaling. Each trains the job's model from the same seed on the same batches for ``fp8_steps`` steps under
the divergence watch against the reference's curve (a float32 job reuses the precision ladder's float32 curve, the
same training; under a budget, any job reuses the ladder's curve of its own precision). Unless ``thorough``, the
broadest policy races first: once one keeps the loss, narrower ones cannot win and are not run. A trial that no
longer fits step 5's budget is skipped with the reason. :func:`choose` picks the policy that puts the most matmul
FLOPs into FP8 while its loss stays within ``fp8_tolerance`` of the reference, and writes it as a job-file
fragment.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import torch

from mfu_lab.analysis import fp8_numerics as f8
from mfu_lab.core.errors import JobError, JobProblem
from mfu_lab.core.job.schema import Job
from mfu_lab.core.process.budget import Clock, job_step_s
from mfu_lab.core.store import step_results as store
from mfu_lab.steps.fp8.precision_ladder import train_trial

LADDER_REUSED = ("the precision ladder's reference loss curve: the same model, seed, batches, precision and "
                 "divergence watch, so not trained a second time")


@dataclass
class PolicyTrial:
    name: str
    groups: list[str]
    recipe: str  # tensorwise | rowwise | rowwise_with_gw_hp | none (no scaling)
    flops_share: float  # share of linear-layer FLOPs in FP8 (analytic)
    status: str  # reference | ok | diverged | off (loss beyond tolerance) | skipped
    reason: str = ""
    loss: list[float] = field(default_factory=list)
    grad_norm: list[float] = field(default_factory=list)
    stopped_at: int | None = None
    final_gap: float | None = None  # last-window mean loss / reference's - 1
    study: bool = False  # part of the scaling study, not a candidate policy


def check_groups(job: Job, groups: list[str], source: str = "the job") -> None:
    """The job's ``fp8_layers`` and ``fp8_policies`` name only this model's layer groups, else a JobError naming
    ``source``."""
    problems = []
    for key, lists in (("fp8_layers", {"fp8_layers": job.fp8_layers}), ("fp8_policies", job.fp8_policies)):
        for name, gs in lists.items():
            if not isinstance(gs, list):
                problems.append(JobProblem(key, gs, f"{name}: must be a list of layer groups"))
                continue
            unknown = [g for g in gs if g not in groups]
            if unknown:
                policy = "" if key == "fp8_layers" else f"policy {name}: "
                problems.append(JobProblem(key, gs, f"{policy}unknown layer group(s) {', '.join(map(str, unknown))}; "
                                           f"this model's groups: {', '.join(groups)}"))
    if problems:
        raise JobError(source, problems)


def trials_minimum_s(job: Job) -> tuple[float, str]:
    """(seconds, where the step time is from) the FP8 trials need at least: the reference and one policy, 2 x
    ``fp8_steps`` training steps at step 1's step time (an emulated FP8 step takes longer still)."""
    step_s, where = job_step_s(store.earlier(job, "baseline").data)
    return 2 * job.fp8_steps * step_s, where


def why_no_trial_fits(job: Job, clock: Clock) -> str:
    """Why no FP8 policy can be trained within step 5's share ('' when one can, or without a budget): the float32
    reference and one policy need 2 x ``fp8_steps`` training steps at step 1's step time at least
    (:func:`trials_minimum_s`). Said once in the budget's cuts; the policies each carry it."""
    need, where = trials_minimum_s(job)
    if clock.fits(need):
        return ""
    why = (f"{max(clock.left_s(), 0.0):.0f} s of step 5's {clock.planned_s:.0f} s share left, less than the float32 "
           f"reference and one policy ({2 * job.fp8_steps} steps, about {need:.0f} s: {where})")
    clock.shorten("FP8 policy trials", why)
    return why


def _policies(job: Job, groups: list[str], most_sensitive: str) -> list[tuple[str, list[str], str, bool]]:
    """(name, groups, recipe, study) for every trial."""
    mlp = [g for g in groups if "mlp" in g or "ffn" in g or "fc" in g]
    out = [("reference", [], job.fp8_recipe, False)]
    if mlp:
        out.append(("mlp only", mlp, job.fp8_recipe, False))
    if len(groups) > 1:
        out.append((f"all but {most_sensitive}", [g for g in groups if g != most_sensitive], job.fp8_recipe, False))
    out.append(("all linears", list(groups), job.fp8_recipe, False))
    if job.fp8_layers:
        out.append(("the job's fp8_layers", list(job.fp8_layers), job.fp8_recipe, False))
    for name, gs in job.fp8_policies.items():
        out.append((name, list(gs), job.fp8_recipe, False))
    other = "rowwise" if job.fp8_recipe == "tensorwise" else "tensorwise"
    out.append((f"all linears, {other}", list(groups), other, True))
    out.append(("all linears, no scaling", list(groups), "none", True))
    return out


def _ladder_reference(job: Job, precision: dict[str, Any]) -> tuple[list[float], list[float], float] | None:
    """(losses, gradient norms, seconds) of the ladder's reference curve when it is the FP8 reference's training: the
    job trains in the reference rung's dtype and matmul precision (float32's; under a budget the job's own, always),
    and the curve ran every FP8 step without stopping."""
    rungs = precision.get("rungs", [])
    r = next((r for r in rungs if r.get("status") == "reference"), None) or next(
        (r for r in rungs if r["name"] == "float32"), None)
    if (r is None or (job.dtype, job.matmul_precision) != (r["dtype"], r["matmul_precision"]) or r.get("diverged")
            or len(r.get("loss") or []) != job.fp8_steps or len(r.get("grad_norm") or []) != job.fp8_steps):
        return None
    return list(r["loss"]), list(r["grad_norm"]), r.get("loss_s") or 0.0


def train_policies(job: Job, groups: list[str], most: str, share: dict[str, float], batches: list,
                   device: torch.device, precision: dict[str, Any], clock: Clock, no_fp8: str, say,
                   skipped: list[dict[str, str]]) -> list[PolicyTrial]:
    """Every policy's trial, the reference first. ``share``: each group's share of the linear-layer FLOPs;
    ``precision``: the precision ladder's result (its float32 curve); ``no_fp8``: why no trial fits the budget."""
    trials: list[PolicyTrial] = []
    reference: list[float] | None = None
    plan = _policies(job, groups, most)
    if not job.thorough:  # race: the broadest policy first; once one keeps the loss, narrower ones cannot win
        plan = plan[:1] + sorted((p for p in plan[1:] if not p[3]), key=lambda p: -sum(share[g] for g in p[1]))
    last_s = 0.0  # the last trial's seconds: the next one's estimate against the budget
    passed: float | None = None  # FLOP share of the broadest policy that kept the loss (racing)
    eta = say.eta("FP8 policy trials", len(plan))
    for i, (name, gs, recipe, study) in enumerate(plan, 1):
        if passed is not None and sum(share[g] for g in gs) < passed:
            trials.append(PolicyTrial(name, gs, recipe, sum(share[g] for g in gs), "skipped",
                                      f"not run: a policy with {passed:.0%} of the linear FLOPs in FP8 already kept "
                                      "the loss, and the choice is the broadest such policy (--thorough runs it)"))
            continue
        if no_fp8:  # not even the reference and one policy fit: none is trained, each said
            trials.append(PolicyTrial(name, gs, recipe, sum(share[g] for g in gs), "skipped", "budget: " + no_fp8,
                                      study=study))
            continue
        if trials and gs and not clock.fits(last_s):  # the reference always runs: the others compare with it
            why = (f"{clock.left_s():.0f} s of the step's {clock.planned_s:.0f} s left, less than one trial "
                   f"({last_s:.0f} s)")
            trials.append(PolicyTrial(name, gs, recipe, sum(share[g] for g in gs), "skipped", "budget: " + why,
                                      study=study))
            clock.shorten(f"FP8 policy {name}", why)
            continue
        ladder_curve = None if gs else _ladder_reference(job, precision)
        if ladder_curve:  # the same training the ladder's float32 rung already ran: its curve, not a second run
            losses, norms, last_s = ladder_curve
            reference = losses
            trials.append(PolicyTrial(name, gs, recipe, 0.0, "reference", LADDER_REUSED, losses, norms))
            say(f"[{i}/{len(plan)}] {name}: {LADDER_REUSED}")
            continue
        t_trial = time.perf_counter()
        say(f"[{i}/{len(plan)}] {name}: {job.fp8_steps} steps" + (f", FP8 on {', '.join(gs)} ({recipe})" if gs
                                                                  else ", no FP8 (the reference)") + eta.tag(i - 1))
        watch = f8.Watch(reference, job.fp8_tolerance, job.fp8_window, job.fp8_spike)
        losses, norms, why, at = train_trial(job, gs, recipe, batches[:job.fp8_steps], device, watch,
                                             say.heartbeat(f"  {name}", job.fp8_steps))
        t = PolicyTrial(name, gs, recipe, sum(share[g] for g in gs), "reference" if not gs else "ok", why or "",
                        losses, norms, at, study=study)
        if not gs:
            reference = losses
        elif why:
            t.status = "diverged"
        else:
            w = min(job.fp8_window, len(losses))
            t.final_gap = (sum(losses[-w:]) / w) / (sum(reference[-w:]) / w) - 1
            if t.final_gap > job.fp8_tolerance:
                t.status, t.reason = "off", f"final loss {t.final_gap:+.1%} from the reference"
        trials.append(t)
        last_s = time.perf_counter() - t_trial
        if t.status == "ok" and not study and not job.thorough:
            passed = t.flops_share if passed is None else max(passed, t.flops_share)
        say(f"  {t.status}" + (f": {t.reason}" if t.reason else "") + f"; last loss {losses[-1]:.4f}")
    if not job.thorough:
        skipped.append({"what": "FP8 scaling study (the other recipe, no scaling)",
                        "reason": "a study for the report, not a candidate policy: run with --thorough to see it"})
    eta.finish([t.reason for t in trials if t.status == "skipped"])
    return trials


def kept(trials: list[PolicyTrial]) -> list[PolicyTrial]:
    """The candidate policies whose loss stayed within ``fp8_tolerance`` without diverging."""
    return [t for t in trials if t.status == "ok" and not t.study]


def choose(job: Job, trials: list[PolicyTrial]) -> tuple[PolicyTrial | None, dict[str, Any]]:
    """The kept policy with the most linear-layer FLOPs in FP8 (the fewest groups on a tie), and the choice as
    the result records it: its job-file fragment and its text, or why every layer stays in high precision."""
    best = max(kept(trials), key=lambda t: (t.flops_share, -len(t.groups)), default=None)
    if best:
        fragment = f"fp8_layers: [{', '.join(best.groups)}]\nfp8_recipe: {job.fp8_recipe}"
        return best, {"policy": best.name, "groups": best.groups, "recipe": job.fp8_recipe,
                      "flops_share": best.flops_share, "fragment": fragment,
                      "text": f"Train {', '.join(best.groups)} in FP8 ({job.fp8_recipe} scaling): "
                              f"{best.flops_share:.0%} of the linear-layer FLOPs, loss within {job.fp8_tolerance:.0%} "
                              f"of the reference over {job.fp8_steps} steps (final gap {best.final_gap:+.2%}). "
                              "Job-file fragment: " + fragment.replace("\n", "; ")}
    tried = [t for t in trials if t.groups and t.status in ("ok", "off", "diverged")]
    cut = [t.name for t in trials if t.groups and t.status == "skipped" and t.reason.startswith("budget: ")]
    why = (f"no FP8 policy kept the loss within {job.fp8_tolerance:.0%} of the reference without diverging"
           if tried else "no FP8 policy was trained")
    if cut:
        why += (f"; {', '.join(cut)} not trained: the budget ran out first (a larger --budget, or none, "
                "trains them)")
    return None, {"policy": None, "groups": [], "recipe": job.fp8_recipe, "flops_share": 0.0, "fragment": "",
                  "text": "Keep every layer in high precision: " + why}
