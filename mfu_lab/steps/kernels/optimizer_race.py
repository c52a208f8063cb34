"""Step 3's optimizer race (issue 46): when the trace finds AdamW taking more than OPTIMIZER_LIMIT of the step, its
implementations are timed side by side on the job itself, and a pick proven faster goes into ``tuned.yaml``
(``adamw_impl``, read by :mod:`mfu_lab.analysis.tuning`), which step 7 verifies like every other change.

The candidates: the job's own ``adamw_impl`` first (the reference), then ``foreach`` (multi-tensor kernels) and
``fused`` (one fused kernel per parameter group) where this device and torch run them. Whether ``fused`` runs is
probed with one real step on a one-element parameter, not assumed from a version table (CUDA has it; CPU since
torch 2.4). Each candidate trains its own copy of the model from the job's seed on the same batches, eager (the
optimizer step lies outside a compiled forward either way), in interleaved rounds (ABBA order); the speedup is
median(reference) / median(candidate) with a 95% bootstrap interval, adopted only when the interval lies above 1
and the loss stays within ``loss_tolerance``.
"""

from __future__ import annotations

import dataclasses
import statistics
from typing import Any

import torch

from mfu_lab.core.engine.workload import build_loader, build_model, build_train_step, eager
from mfu_lab.core.job.schema import Job
from mfu_lab.core.measure.sidebyside import bootstrap_speedup, interleave
from mfu_lab.core.measure.timed import run_steps

ROUNDS, STEPS_PER_ROUND = 3, 3
IMPLS = ("foreach", "fused")


def runs_here(impl: str, device: torch.device) -> str | None:
    """Why AdamW's ``impl`` cannot run on ``device`` (torch's own error, from one real step), None when it can."""
    if impl == "default":
        return None
    p = torch.zeros(4, device=device, requires_grad=True)
    try:
        opt = torch.optim.AdamW([p], **{impl: True})
        p.grad = torch.ones_like(p)
        opt.step()
    except (RuntimeError, TypeError, ValueError) as e:
        return f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
    return None


def candidates(job: Job, device: torch.device) -> tuple[list[str], dict[str, str]]:
    """The implementations to race (the job's own first) and those left out, with torch's reason."""
    out, missing = [job.adamw_impl], {}
    for impl in IMPLS:
        if impl == job.adamw_impl:
            continue
        why = runs_here(impl, device)
        if why:
            missing[impl] = why
        else:
            out.append(impl)
    return out, missing


def cost_s(n_candidates: int, step_s: float) -> float:
    """The race's time at ``step_s`` a step: each candidate's rounds plus one warm-up step per round."""
    return n_candidates * ROUNDS * (STEPS_PER_ROUND + 1) * step_s


def race_optimizer(job: Job, device: torch.device, share: float, left_s: float | None, step_s: float,
                   progress=None) -> dict[str, Any]:
    """The race's record for ``result.json`` (``optimizer_race``): why it ran, the candidates, their medians and
    final losses, the pick and its interval against the job's own implementation, and whether it is adopted.
    ``share``: the optimizer's share of the step (the trace's); ``left_s``: the step's budget left (None: none)."""
    why = f"the optimizer step takes {share:.1%} of the step (the trace)"
    names, missing = candidates(job, device)
    base = {"why": why, "reference": job.adamw_impl, "left_out": missing, "source": "measured"}
    if len(names) < 2:
        return base | {"ran": False, "note": "no other AdamW implementation runs here: " + "; ".join(
            f"{k}: {v}" for k, v in missing.items())}
    need = cost_s(len(names), step_s)
    if left_s is not None and need > left_s:
        return base | {"ran": False, "note": f"budget: the race needs about {need:.0f} s ({len(names)} "
                       f"implementations, {ROUNDS} rounds of {STEPS_PER_ROUND} steps at about {step_s:.2g} s a step), "
                       f"{max(left_s, 0):.0f} s of step 3's share left; set adamw_impl by hand, or give a larger "
                       "--budget"}
    plain = eager(job)
    steps: dict[str, Any] = {}
    for impl in names:
        j = dataclasses.replace(plain, adamw_impl=impl)
        model = build_model(j).to(device).train()
        steps[impl] = build_train_step(j, model, device.type)
    quiet = dataclasses.replace(plain, num_workers=0, synthetic_load_ms=0.0)

    def runner(impl):
        def run(n):
            t = run_steps(steps[impl], build_loader(quiet, 1 + n, device.type), device, 1, n)
            return {"wall_s": t.measured("wall_s"), "loss": t.loss[1:]}
        return run

    say = (lambda m: progress(f"optimizer race {m}")) if callable(progress) else None
    inter = interleave({n: runner(n) for n in names}, ROUNDS, STEPS_PER_ROUND, say, abba=True)
    rows = [{"adamw_impl": n, "steps": len(inter.series[n].wall_s),
             "median_step_s": statistics.median(inter.series[n].wall_s), "final_loss": inter.series[n].loss[-1]}
            for n in names]
    best = min(rows, key=lambda r: r["median_step_s"])
    ref = rows[0]
    sp = bootstrap_speedup(inter.series[names[0]].wall_s, inter.series[best["adamw_impl"]].wall_s)
    gap = abs(best["final_loss"] - ref["final_loss"]) / max(abs(ref["final_loss"]), 1e-12)
    adopted = best["adamw_impl"] != names[0] and sp.low > 1.0 and gap <= job.loss_tolerance
    if best["adamw_impl"] == names[0]:
        verdict = f"the job's own adamw_impl ({names[0]}) was the fastest"
    elif sp.low <= 1.0:
        verdict = f"{best['adamw_impl']} led, {sp.text()}, but its interval includes 1.0: not proven, not adopted"
    elif not adopted:
        verdict = f"{best['adamw_impl']} is faster but its final loss is {gap:.2%} from the job's: not adopted"
    else:
        verdict = f"{best['adamw_impl']} is {sp.text()} faster, side by side: adopted (adamw_impl)"
    return base | {"ran": True, "rows": rows, "pick": best["adamw_impl"],
                   "speedup": {"value": sp.value, "low": sp.low, "high": sp.high}, "final_gap": gap,
                   "adopted": adopted, "verdict": verdict,
                   "method": f"{len(names)} implementations, each its own model from the job's seed on the same "
                             f"batches, eager, in {ROUNDS} interleaved rounds (ABBA order) of {STEPS_PER_ROUND} timed "
                             "steps after one warm-up; speedup = median(the job's own) / median(pick), 95% "
                             "bootstrap interval; adopted only beyond the noise and within loss_tolerance"}
