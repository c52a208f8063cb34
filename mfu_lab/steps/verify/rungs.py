"""The verify step's rungs and their measurement: each rung in its own process, all timed in interleaved rounds.

A rung is the original job, or the job with one more of the adopted changes (analysis.tuning's staircase), and
:class:`Rung` records what it changes, whether it can be timed in one process here (DDP settings and a layout change
are verified under torchrun, steps.verify.ddp; FP8 is timed only where the device has FP8 units and torchao
converts the rung's layers, core.engine.fp8: emulated elsewhere),
the peak its MFU is taken against, and what it measured. Each measurable rung runs in a warm process of its own
(:class:`mfu_lab.workers.verify_rung.RungProcess`: compile and allocator state stay apart), warmed up first, then
all of them in interleaved rounds (A B C, A B C, ...) with the same seed and batches
(:func:`mfu_lab.core.measure.sidebyside.interleave`); a rung whose process fails is recorded and the others go on.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mfu_lab.core.engine.work import samples_per_step, token_job
from mfu_lab.core.errors import DeviceError
from mfu_lab.core.job.schema import Job
from mfu_lab.core.measure import device as dev
from mfu_lab.core.measure.sidebyside import interleave
from mfu_lab.core.process.progress import as_progress
from mfu_lab.steps.verify.ddp import UNDER_TORCHRUN
from mfu_lab.steps.verify.layout import rung_figures
from mfu_lab.steps.verify.memory_share import MemoryPlan
from mfu_lab.workers.verify_rung import RungProcess


@dataclass
class Rung:
    name: str  # original, or the staircase stage it adds (attention, data, compile, precision, fp8)
    keys: dict[str, Any]  # what this rung changes over the rung below: key -> new value
    status: str  # ok | failed | excluded
    reason: str = ""
    dtype: str = "float32"
    step_median_s: float | None = None
    step_p10_s: float | None = None
    step_p90_s: float | None = None
    tokens_per_s: float | None = None  # token-id jobs only
    samples_per_s: float | None = None  # every job: each batch's first dimension
    mfu: float | None = None
    hardware_flops_ratio: float | None = None  # hardware / model FLOPs per step (recompute), as the rung counted
    flops_source: str = ""
    peak_flops_per_s: float | None = None
    peak_source: str = ""
    peak_precision: str = ""  # the peak's row: fp32, tf32 (float32 at matmul precision high), bf16, fp16
    speedup: float | None = None  # original median / this median
    speedup_low: float | None = None
    speedup_high: float | None = None
    gain: float | None = None  # the rung below's median / this median: what this rung's change gave
    gain_low: float | None = None
    gain_high: float | None = None
    proven: bool | None = None  # the gain's interval lies off 1.0
    challenger: bool = False  # a re-check of an earlier choice at the tuned precision, adopted only if it wins
    warmup_s: float | None = None
    wall_s: list[float] = field(default_factory=list)
    data_s: list[float] = field(default_factory=list)
    compute_s: list[float] = field(default_factory=list)
    loss: list[float] = field(default_factory=list)  # warm-up steps first, then the measured ones


def staircase_rungs(stairs: list[tuple[str, Job, list]], device: dev.DeviceInfo) -> tuple[list[Rung], list[Job]]:
    """A rung per stage of analysis.tuning's staircase, with its job; one that a single process cannot time here is
    ``excluded``, with the reason."""
    no_fp8_units = _fp8_reason(device)
    rungs, jobs = [], []
    for name, rjob, mine in stairs:
        keys = {c.key: c.new for c in mine}
        rung = Rung(name, keys, "ok", dtype=rjob.dtype)
        if name in UNDER_TORCHRUN:  # DDP settings, a layout change: verified under torchrun (steps.verify.ddp)
            rung.status, rung.reason = "excluded", UNDER_TORCHRUN[name]
        elif name == "fp8" and no_fp8_units:
            rung.status, rung.reason = "excluded", (f"FP8 is emulated on this device ({no_fp8_units}): its layers "
                                                    "cannot train in FP8 here, so no speed is claimed or measured")
        elif name == "fp8" and importlib.util.find_spec("torchao") is None:
            rung.status, rung.reason = "excluded", ("torchao is not installed (pip install torchao): the rung's "
                                                    "fp8_layers could not be converted, so it is not timed")
        rungs.append(rung)
        jobs.append(rjob)
    return rungs, jobs


def _fp8_reason(device: dev.DeviceInfo) -> str:
    from mfu_lab.steps.fp8.step import fp8_hardware

    return fp8_hardware(device)


def give_peaks(job: Job, device: dev.DeviceInfo, rungs: list[Rung], jobs: list[Job], say) -> None:
    """Each measurable rung's peak FLOP/s, its source and its row (:func:`_peaks`), for its MFU."""
    peaks = _peaks(job, device, {(r.dtype, j.matmul_precision) for r, j in zip(rungs, jobs) if r.status == "ok"}, say)
    for r, j in zip(rungs, jobs):
        if r.status == "ok":
            r.peak_flops_per_s, r.peak_source, r.peak_precision = peaks[(r.dtype, j.matmul_precision)]


def _peaks(job: Job, device: dev.DeviceInfo, wanted: set[tuple[str, str]], say) -> dict[tuple, tuple]:
    """(FLOP/s or None, source, row) per (dtype, matmul precision): step 1's peak for the job's own; else the job's
    peak_flops for that dtype only, the datasheet row (a TF32 rung gets TF32's) or measured (CPU). A GPU with
    neither for a dtype gets no peak (no MFU), and the source says what it needs."""
    from mfu_lab.steps.baseline.reference import reference_peak

    out: dict[tuple, tuple] = {}
    for dtype, mp in sorted(wanted):
        row = dev.float32_precision_key(mp) if dtype == "float32" else dev.DTYPE_KEY[dtype]
        if dtype == job.dtype and (dtype != "float32" or row == dev.float32_precision_key(job.matmul_precision)):
            out[(dtype, mp)] = (*reference_peak(job, device)[:2], row)
            continue
        say(f"peak FLOP/s for {dtype} (matmul precision {mp})")
        try:
            p = dev.resolve_peak(device, dtype, job.peak_flops, mp, job.dtype, job.matmul_precision)
            out[(dtype, mp)] = (p.flops_per_s, p.source, row)
        except DeviceError:
            out[(dtype, mp)] = (None, f"none: no datasheet row for {device.name} and no peak_flops for {dtype}; "
                                      f"give it in the job, e.g. peak_flops: {{{job.dtype}: ..., {dtype}: ...}}", row)
    return out


def measure_rungs(job: Job, rungs: list[Rung], jobs: list[Job], work: Path, say,
                  memory: MemoryPlan | None = None) -> list[list]:
    """Start every measurable rung's process, warm them up, run the interleaved rounds; fill the rungs. ``memory``
    (on CUDA, memory_share.py): each rung's share of the GPU, or that the rungs free their caches between turns."""
    total = job.verify_rounds * job.verify_steps
    procs: dict[str, RungProcess] = {}
    flops: dict[str, float] = {}
    memory = memory or MemoryPlan()
    try:
        for rung, rjob in zip(rungs, jobs):
            if rung.status != "ok":
                continue
            say(f"rung {rung.name}: starting its process, {job.verify_warmup_steps} warm-up steps")
            dev.release_device_memory("cuda")  # each rung's process gets the GPU the launcher let go of
            p = RungProcess({"rung": rung.name, "job": rjob.to_dict(), "steps_total": total,
                             "memory_fraction": memory.fractions.get(rung.name), "release": memory.release,
                             "turns": job.verify_rounds}, work, job.compile_timeout_s)
            procs[rung.name] = p
            p.beat = lambda waited, name=rung.name: say(f"  rung {name}: still warming up ({waited:.0f} s so far; "
                                                        "a compiled rung compiles here)")
            try:
                ready = p.ready()
            except (RuntimeError, OSError) as e:
                rung.status, rung.reason = "failed", str(e)
                p.close()
                del procs[rung.name]
                continue
            if rung.name == "fp8" and ready.get("fp8_why_not"):  # its process could not convert: not FP8's speed
                rung.status, rung.reason = "excluded", (f"its process trained without FP8: {ready['fp8_why_not']}; "
                                                        "its time would not be FP8's, so the rung is not timed")
                p.close()
                del procs[rung.name]
                continue
            rung.warmup_s, rung.loss = ready["warmup_s"], list(ready["warmup_loss"])
            flops[rung.name] = ready["model_flops_per_step"]
            if ready["model_flops_per_step"]:
                rung.hardware_flops_ratio = ready["hardware_flops_per_step"] / ready["model_flops_per_step"]
                rung.flops_source = ready.get("flops_source", "")
        if not procs:
            return []
        by_name = {r.name: r for r in rungs}

        def runner(name: str, p: RungProcess):
            def run(k: int):
                try:
                    return p.run(k)
                except (RuntimeError, OSError) as e:  # its process died (a closed stdin: BrokenPipeError) or hung:
                    # recorded, the others go on
                    by_name[name].status, by_name[name].reason = "failed", f"during the rounds: {e}"
                    return None
            return run

        eta, lines = as_progress(say).eta("interleaved rounds", job.verify_rounds * len(procs)), [0]

        def round_line(msg: str) -> None:  # interleave's line per rung and round, with the time left
            lines[0] += 1
            say(msg + eta.tag(min(lines[0], eta.total)))

        done = interleave({name: runner(name, p) for name, p in procs.items()}, job.verify_rounds,
                          job.verify_steps, round_line)
    finally:
        for p in procs.values():
            p.close()
    for rung in rungs:
        s = done.series.get(rung.name)
        if s is None or rung.status != "ok" or not s.wall_s:
            continue
        rung.wall_s, rung.data_s, rung.compute_s = s.wall_s, s.data_s, s.compute_s
        rung.loss += s.loss
        rung_figures(rung, flops[rung.name], job.tokens_per_step if token_job(job) else 0,
                     samples_per_step(job))
    return [[r, n] for r, n in done.order]
