"""Step 1's figures as later steps read them: its stored result when it ran on this device (no other device is a
fair reference), the step times it measured, and the peak it measured MFU against, so that every later step
compares like with like."""

from __future__ import annotations

import statistics
from typing import Any

from mfu_lab.core.job.schema import Job
from mfu_lab.core.measure import device as dev
from mfu_lab.core.registry import BY_KEY
from mfu_lab.core.store import step_results as store

INFO = BY_KEY["baseline"]


def step1_on(job: Job, device_name: str) -> store.Earlier | None:
    """Step 1's stored result when it was measured on this device, else None (another device is no fair
    reference). Later steps compare against it."""
    e = store.earlier(job, INFO.key)
    return e if e and e.data["environment"].get("device_name") == device_name else None


def step1_reference(job: Job, device_name: str) -> dict[str, Any] | None:
    """Step 1's figures that later steps compare with, when step 1 ran on this device."""
    e = step1_on(job, device_name)
    if e is None:
        return None
    m = e.data["metrics"]
    wall = e.data["timings"]["wall_s"][e.data["timings"]["warmup_steps"]:]
    return {"source": f"step 1 result ({e.path})", "mfu": m["mfu"]["value"], "step_mean_s": statistics.fmean(wall),
            "step_median_s": m["step_time_median_s"]["value"], "median_s": m["step_time_median_s"]["value"],
            "p10_s": m["step_time_p10_s"]["value"], "p90_s": m["step_time_p90_s"]["value"],
            "peak": m["peak_flops_per_s"]["value"], "peak_source": m["peak_flops_per_s"]["source"],
            "peak_note": m["peak_flops_per_s"]["note"]}


def reference_peak(job: Job, device: dev.DeviceInfo) -> tuple[float, str, str, bool]:
    """The peak step 1 measured MFU against on this device, so later steps compare like with like:
    (FLOP/s, source label, note, taken from step 1). Without a step-1 result on this device: resolved here."""
    e = step1_on(job, device.name)
    if e:
        pk = e.data["metrics"]["peak_flops_per_s"]
        return pk["value"], pk["source"], pk["note"] + " (as in step 1)", True
    p = dev.resolve_peak(device, job.dtype, job.peak_flops, job.matmul_precision)
    return p.flops_per_s, p.source, p.note, False
