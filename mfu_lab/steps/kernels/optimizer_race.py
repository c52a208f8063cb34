"""Step 3's optimizer race (issue 46): when the trace finds AdamW taking more than OPTIMIZER_LIMIT of the step, its
implementations are timed side by side on the job itself, and a pick proven faster goes into ``tuned.yaml``
(``adamw_impl``, read by :mod:`mfu_lab.analysis.tuning`), which step 7 verifies like every other change.

The candidates: the job's own ``adamw_impl`` first (the reference), then ``foreach`` (multi-tensor kernels) and
``fused`` (one fused kernel per parameter group) where this device and torch run them. Whether ``fused`` runs is
probed with one real step on a one-element parameter, not assumed from a version table (CUDA has it; CPU since
torch 2.4). They race eager (the optimizer step lies outside a compiled forward either way) by
:func:`mfu_lab.steps.key_race.race_key`: interleaved rounds, a bootstrap interval, adopted only beyond the noise
and with the loss kept.
"""

from __future__ import annotations

from typing import Any

import torch

from mfu_lab.core.engine.workload import eager
from mfu_lab.core.job.schema import Job
from mfu_lab.steps import key_race
from mfu_lab.steps.key_race import ROUNDS, STEPS_PER_ROUND, race_key

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
    """The race's time at ``step_s`` a step (:func:`mfu_lab.steps.key_race.cost_s`)."""
    return key_race.cost_s(n_candidates, step_s)


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
    return base | race_key(eager(job), "adamw_impl", names, device, "optimizer race", progress)
