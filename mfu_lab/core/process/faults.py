"""Device faults turned into errors that say what happened and what to do.

- Out of memory (CUDA, or a CPU allocation that failed) in any step: the memory figures at the time,
  and concrete advice computed from the job (a smaller micro-batch, activation checkpointing...).
- A non-finite loss: the step (or trial) that produced it is named; the measurement stops there.

``guarded(step)`` wraps each step's ``run``. For tests only, ``MFU_LAB_FAULT=<step>:<oom|nan|error|hang>``
injects a fault when that step starts, so the handling can be checked on a machine without a GPU (``hang``
sleeps: a cell timeout without a core kept busy).
"""

from __future__ import annotations

import functools
import math
import os
import time
from typing import Any

import torch

from mfu_lab.core.errors import StepError
from mfu_lab.core.store.steplock import holds_job

FAULT_ENV = "MFU_LAB_FAULT"
GIB = 2 ** 30


class OutOfMemory(StepError):
    """A step ran out of device memory; ``figures`` holds the memory readings at the time."""

    def __init__(self, message: str, figures: dict[str, Any]):
        self.figures = figures
        super().__init__(message)


class NonFiniteLoss(StepError):
    def __init__(self, step_index: int, value: float, where: str = ""):
        self.step_index, self.value = step_index, value
        super().__init__(f"the loss became {value} at training step {step_index}{where}, so no figure measured "
                         "from these steps is kept. Usual causes: a learning rate too high for this precision, "
                         "float16 without loss scaling (use bfloat16), or bad data; rerun the step after fixing it.")


def check_losses(losses: list[float], where: str = "") -> None:
    """Raise :class:`NonFiniteLoss` naming the first step (1-based) whose loss is NaN or infinite."""
    for i, v in enumerate(losses, 1):
        if not math.isfinite(v):
            raise NonFiniteLoss(i, v, where)


def is_oom(exc: BaseException) -> bool:
    oom_type = getattr(torch, "OutOfMemoryError", None) or getattr(torch.cuda, "OutOfMemoryError", None)
    if oom_type is not None and isinstance(exc, oom_type):
        return True
    text = str(exc)
    return isinstance(exc, MemoryError) or (
        isinstance(exc, RuntimeError) and ("out of memory" in text.lower() or "can't allocate memory" in text))


def memory_figures(devices: bool = True) -> dict[str, Any]:
    """Memory readings now: per CUDA device allocated / reserved / peak / free / total (``devices``), and the
    host's RAM. A parent process reporting on a dead child passes ``devices=False``: touching CUDA there would
    open a context on every GPU for the rest of the run, and its own counters say nothing of the child."""
    out: dict[str, Any] = {}
    if devices and torch.cuda.is_available():  # pragma: no cover - GPU only
        for i in range(torch.cuda.device_count()):
            free, total = torch.cuda.mem_get_info(i)
            out[f"cuda:{i}"] = {"allocated_gib": torch.cuda.memory_allocated(i) / GIB,
                                "reserved_gib": torch.cuda.memory_reserved(i) / GIB,
                                "peak_allocated_gib": torch.cuda.max_memory_allocated(i) / GIB,
                                "free_gib": free / GIB, "total_gib": total / GIB}
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f if line.split()[1:2]}
        out["host"] = {"total_gib": info["MemTotal"] / GIB, "available_gib": info["MemAvailable"] / GIB}
    except (OSError, KeyError, ValueError):
        pass
    try:
        import resource

        out.setdefault("host", {})["process_peak_rss_gib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    except (ImportError, OSError):  # pragma: no cover - not on Linux
        pass
    return out


def oom_advice(job) -> list[str]:
    """What to change, from the job's own values."""
    out = []
    if job.micro_batch > 1:
        # the largest divisor of micro_batch up to its half, so that micro_batch x grad_accum stays exactly as it is
        half = max(d for d in range(1, job.micro_batch // 2 + 1) if job.micro_batch % d == 0)
        out.append(f"micro_batch: {half} with grad_accum: {job.grad_accum * job.micro_batch // half} (now "
                   f"{job.micro_batch} x {job.grad_accum}; activations scale with micro_batch, and the samples per "
                   "optimizer step stay as they are)")
    if not job.activation_checkpointing and getattr(job, "model", "gpt") == "gpt":  # a factory checkpoints itself
        out.append("activation_checkpointing: true with checkpoint_policy: selective (keeps the matmul outputs and "
                   "recomputes the cheap ops in the backward: less activation memory for little compute), or with "
                   "checkpoint_policy: full (recomputes each block's whole forward: far less activation memory for "
                   "about a third more compute)")
    if job.dtype == "float32":
        out.append("dtype: bfloat16 (halves activation memory)")
    if job.seq_len > 256:
        out.append(f"seq_len: {job.seq_len // 2} (now {job.seq_len}), if the task allows")
    return out


def format_memory(figs: dict[str, Any]) -> str:
    parts = []
    for dev, f in figs.items():
        parts.append(dev + ": " + ", ".join(f"{k.removesuffix('_gib')} {v:.2f} GiB" for k, v in f.items()))
    return "; ".join(parts) or "no memory reading available"


def _inject(step: str) -> None:
    spec = os.environ.get(FAULT_ENV, "")
    target, _, kind = spec.partition(":")
    if target != step:
        return
    if kind == "oom":
        raise torch.OutOfMemoryError(f"injected out-of-memory fault ({FAULT_ENV}={spec}, tests only)")
    if kind == "nan":
        check_losses([2.0, float("nan")], f" (injected, {FAULT_ENV}={spec}, tests only)")
    if kind == "error":
        raise RuntimeError(f"injected failure ({FAULT_ENV}={spec}, tests only)")
    if kind == "hang":  # a step that never returns, without a core kept busy (a cell timeout's test)
        time.sleep(24 * 3600)


def guarded(step: str):
    """Decorate a step's ``run(job, ...)``: an out-of-memory error becomes :class:`OutOfMemory` with the memory
    figures and advice; everything else passes through unchanged. With ``write`` (the default) the step holds the
    job's folder while it runs, refused at once while another run holds it (:mod:`mfu_lab.core.store.steplock`)."""

    def wrap(fn):
        @functools.wraps(fn)
        def run(job, *args, **kwargs):
            try:
                _inject(step)
                return fn(job, *args, **kwargs)
            except StepError:
                raise
            except BaseException as exc:
                if not is_oom(exc):
                    raise
                figs = memory_figures()
                advice = oom_advice(job)
                msg = (f"step {step} ran out of memory ({type(exc).__name__}: {str(exc).splitlines()[0][:300]}). "
                       f"Memory at the time: {format_memory(figs)}. Try, in the job file: " + "; ".join(advice or [
                           "a smaller model or a device with more memory"]))
                raise OutOfMemory(msg, figs) from exc

        return holds_job(step)(run)

    return wrap
