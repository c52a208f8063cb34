"""One job key's values raced side by side in this process: step 3's AdamW implementations (``adamw_impl``) and
step 4's loss implementations (``loss_impl``).

Each value trains its own copy of the model from the job's seed on the same batches, in interleaved rounds (ABBA
order: the order that favours no one against a machine that drifts) of a few timed steps after one warm-up step
per round (the first round's warm-up absorbs a compile). The speedup is median(the job's own value) /
median(the fastest) with a 95% bootstrap interval; the fastest is adopted only when that interval lies above 1.0
and its final loss stays within ``loss_tolerance`` of the job's own.
"""

from __future__ import annotations

import dataclasses
import statistics
from typing import Any

import torch

from mfu_lab.core.engine.workload import build_loader, build_model, build_train_step
from mfu_lab.core.job.schema import Job
from mfu_lab.core.measure.sidebyside import bootstrap_speedup, interleave
from mfu_lab.core.measure.timed import run_steps

ROUNDS, STEPS_PER_ROUND = 3, 3


def cost_s(n_values: int, step_s: float, extra_s: float = 0.0) -> float:
    """The race's time at ``step_s`` a step: each value's rounds plus one warm-up step per round, and ``extra_s``
    (a compile) once."""
    return n_values * ROUNDS * (STEPS_PER_ROUND + 1) * step_s + extra_s


def race_key(job: Job, key: str, values: list[Any], device: torch.device, label: str,
             progress=None) -> dict[str, Any]:
    """Race ``values`` of job ``key`` (the job's own value first: the reference); the record's part for
    ``result.json``: rows (value, steps, median step, final loss), the pick, its speedup with the interval,
    the final-loss gap, whether it is adopted and the verdict in words."""
    return race_variants(job, {v: {key: v} for v in values}, key, device, label, progress)


def race_variants(job: Job, variants: dict[Any, dict[str, Any]], key: str, device: torch.device, label: str,
                  progress=None) -> dict[str, Any]:
    """Race the job changed by each of ``variants`` (name -> job keys; the first: the job's own, the reference);
    each row names its variant under ``key``; see :func:`race_key`."""
    steps: dict[Any, Any] = {}
    names = list(variants)
    for v, keys in variants.items():
        j = dataclasses.replace(job, **keys)
        steps[v] = (build_train_step(j, build_model(j).to(device).train(), device.type), j)

    def runner(v):
        step, j = steps[v]
        quiet = dataclasses.replace(j, num_workers=0, synthetic_load_ms=0.0)

        def run(n):
            t = run_steps(step, build_loader(quiet, 1 + n, device.type), device, 1, n)
            return {"wall_s": t.measured("wall_s"), "loss": t.loss[1:]}
        return run

    say = (lambda m: progress(f"{label} {m}")) if callable(progress) else None
    inter = interleave({v: runner(v) for v in names}, ROUNDS, STEPS_PER_ROUND, say, abba=True)
    rows = [{key: v, **({} if variants[v] == {key: v} else variants[v]), "steps": len(inter.series[v].wall_s),
             "median_step_s": statistics.median(inter.series[v].wall_s), "final_loss": inter.series[v].loss[-1]}
            for v in names]
    best, ref = min(rows, key=lambda r: r["median_step_s"]), rows[0]
    sp = bootstrap_speedup(inter.series[names[0]].wall_s, inter.series[best[key]].wall_s)
    gap = abs(best["final_loss"] - ref["final_loss"]) / max(abs(ref["final_loss"]), 1e-12)
    adopted = best[key] != names[0] and sp.low > 1.0 and gap <= job.loss_tolerance
    if best[key] == names[0]:
        verdict = f"the job's own {key} ({names[0]}) was the fastest"
    elif sp.low <= 1.0:
        verdict = f"{best[key]} led, {sp.text()}, but its interval includes 1.0: not proven, not adopted"
    elif not adopted:
        verdict = f"{best[key]} is faster but its final loss is {gap:.2%} from the job's: not adopted"
    else:
        verdict = f"{best[key]} is {sp.text()} faster, side by side: adopted ({key})"
    return {"ran": True, "rows": rows, "pick": best[key], "pick_keys": variants[best[key]],
            "speedup": {"value": sp.value, "low": sp.low, "high": sp.high},
            "final_gap": gap, "adopted": adopted, "verdict": verdict,
            "method": f"{len(names)} values of {key}, each its own model from the job's seed on the same batches, in "
                      f"{ROUNDS} interleaved rounds (ABBA order) of {STEPS_PER_ROUND} timed steps after one warm-up; "
                      f"speedup = median(the job's own) / median(pick), 95% bootstrap interval; adopted only beyond "
                      "the noise and within loss_tolerance"}
