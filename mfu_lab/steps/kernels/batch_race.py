"""Step 3's batch race (issue 46): a larger ``micro_batch`` with a smaller ``grad_accum``, the samples of an
optimizer step held (micro_batch x grad_accum fixed), timed side by side against the job's own split; a pick
proven faster goes into ``tuned.yaml`` (read by :mod:`mfu_lab.analysis.tuning`, rung "batch") for step 7 to verify.

Larger micro-batches give larger matmuls and fewer launches per optimizer step, at the price of memory. Each
candidate must fit first: on a GPU one probed optimizer step's ``torch.cuda.max_memory_allocated`` against the
device's memory, elsewhere the analytic fit check of step 1 (:func:`mfu_lab.steps.fit.check_fit`). A candidate
that does not fit is tried again with activation checkpointing (recompute is preferred over a smaller batch): first
selective (``checkpoint_policy: selective``: the matmul and fused-attention outputs kept, only the cheap ops
recomputed), then, when that still does not fit, full (each block's whole forward recomputed); it is left out, with
the bytes of each try, when neither fits. A job already checkpointing keeps its own policy.

A job with ``grad_accum: 1`` has no accumulation to trade: a larger micro_batch there puts more samples into each
optimizer step, which changes the optimization (the gradient's noise, what the learning rate means). That is
said, never raced or adopted.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from mfu_lab.core.job.schema import Job
from mfu_lab.steps.key_race import ROUNDS, STEPS_PER_ROUND, cost_s, race_variants

MAX_CANDIDATES = 2  # the job's split, then micro_batch x 2 and x 4 (grad_accum / 2, / 4) where they divide


def no_trade_note(job: Job) -> str:
    return (f"grad_accum is 1: there is no accumulation to trade, so a larger micro_batch than {job.micro_batch} "
            "would put more samples into each optimizer step, which changes the optimization (the gradient's noise, "
            "what the learning rate means); not raced, not adopted. To let the workbook trade, give the same "
            "samples per optimizer step as micro_batch x grad_accum (e.g. micro_batch "
            f"{max(1, job.micro_batch // 2)} x grad_accum 2)")


def splits(job: Job) -> list[tuple[int, int]]:
    """(micro_batch, grad_accum) candidates holding micro_batch x grad_accum: the job's own first."""
    out = [(job.micro_batch, job.grad_accum)]
    f = 2
    while len(out) <= MAX_CANDIDATES and job.grad_accum % f == 0:
        out.append((job.micro_batch * f, job.grad_accum // f))
        f *= 2
    return out


def fits(job: Job, device: torch.device, probe=None) -> tuple[bool, str]:
    """Whether ``job``'s optimizer step fits this device's memory, and how that was read."""
    if device.type == "cuda":  # pragma: no cover - GPU only
        return (probe or _cuda_probe)(job, device)
    from mfu_lab.steps.fit import FitError, check_fit

    try:
        rec = check_fit(job, device.type, 1)
    except FitError as e:
        return False, str(e).split(". ")[0]
    if not rec.get("checked"):
        return True, rec.get("reason", "not checked")
    return True, (f"{rec['bytes_per_rank'] / 2**30:.2f} GiB (analytic) of {rec['available_per_rank'] / 2**30:.1f} "
                  "GiB available")


def _cuda_probe(job: Job, device: torch.device) -> tuple[bool, str]:  # pragma: no cover - GPU only
    from mfu_lab.core.engine.workload import build_loader, build_model, build_train_step
    from mfu_lab.core.measure.timed import run_steps

    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    total = torch.cuda.get_device_properties(device).total_memory
    try:
        model = build_model(job).to(device).train()
        run_steps(build_train_step(job, model, "cuda"), build_loader(job, 1, "cuda"), device, 0, 1)
        peak = torch.cuda.max_memory_allocated(device)
    except torch.cuda.OutOfMemoryError:
        return False, "out of memory in one probed optimizer step"
    finally:
        model = None
        torch.cuda.empty_cache()
    return peak < 0.9 * total, (f"{peak / 2**30:.1f} GiB peak (torch.cuda.max_memory_allocated, one probed step) of "
                                f"{total / 2**30:.0f} GiB")


def race_batch(job: Job, device: torch.device, left_s: float | None, step_s: float, progress=None,
               probe=None) -> dict[str, Any]:
    """The race's record for ``result.json`` (``batch_race``): the candidates with their fit, the rows, the pick
    and its interval against the job's own split, and whether it is adopted; or why it did not run."""
    base = {"reference": f"{job.micro_batch}x{job.grad_accum}", "samples_per_step": job.micro_batch * job.grad_accum,
            "source": "measured"}
    if job.grad_accum == 1:
        return base | {"ran": False, "note": no_trade_note(job)}
    if job.pp > 1:
        return base | {"ran": False, "note": "pp > 1: the pipeline splits its micro_batch into pp_microbatches "
                       "itself; not raced"}
    variants: dict[str, dict[str, Any]] = {}
    checks: list[dict[str, Any]] = []
    for mb, ga in splits(job):
        name = f"{mb}x{ga}"
        keys: dict[str, Any] = {"micro_batch": mb, "grad_accum": ga}
        ok, how = fits(dataclasses.replace(job, **keys), device, probe)
        if not ok and not job.activation_checkpointing and job.uses_reference_model and name != base["reference"]:
            for policy in ("selective", "full"):  # the least recompute that makes it fit
                ckpt = {"activation_checkpointing": True, "checkpoint_policy": policy}
                ok, how2 = fits(dataclasses.replace(job, **keys, **ckpt), device, probe)
                how = f"{how}; with {policy} activation checkpointing: {how2}"
                if ok:
                    keys |= ckpt
                    break
        checks.append({"split": name, "fits": ok, "how": how, **keys})
        if ok or name == base["reference"]:
            variants[name] = keys
    base["fit"] = checks
    if len(variants) < 2:
        return base | {"ran": False, "note": "no larger micro_batch fits: " + "; ".join(
            f"{c['split']}: {c['how']}" for c in checks[1:])}
    need = cost_s(len(variants), step_s)
    if left_s is not None and need > left_s:
        return base | {"ran": False, "note": f"budget: the race needs about {need:.0f} s ({len(variants)} splits, "
                       f"{ROUNDS} rounds of {STEPS_PER_ROUND} steps at about {step_s:.2g} s a step), "
                       f"{max(left_s, 0):.0f} s of step 3's share left; give a larger --budget"}
    try:
        return base | race_variants(job, variants, "split", device, "batch race", progress)
    except torch.OutOfMemoryError as e:
        # the fit check probes each split alone; the race holds every split's model, optimizer and batches at
        # once, side by side: recorded as not raced (the step's other figures stand), never the step's failure
        if device.type == "cuda":
            torch.cuda.empty_cache()
        said = (str(e).splitlines() or [""])[0][:200]
        return base | {"ran": False, "note": (
            f"out of memory with the {len(variants)} splits ({', '.join(variants)}) resident together, although "
            f"each fits alone ({said}); race them one at a time by hand, or set micro_batch and grad_accum "
            "yourself")}
