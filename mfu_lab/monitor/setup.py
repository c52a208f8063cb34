"""What the monitor looks up once, at start: the device, the training dtype, the peak MFU is taken against, and
TensorBoard. Each says what it did; a failure is the caller's to count (the monitor never stops the job).

The peak of a CPU is the per-machine cached peak (:mod:`mfu_lab.core.measure.peak_cache`, through
:func:`mfu_lab.core.measure.device.resolve_peak`): measured once per machine and dtype (about 1.5 s the first time),
then re-checked at each start with five short probes (about 0.25 s on a 2-core CPU). The workbook's steps read the same
cache, so the monitor and the steps share one peak. It is looked up in ``Monitor.start()``, before the monitor's
first clock reading, so no monitor figure holds it; a job that starts its own timer before ``start()`` (or a
framework whose train() calls the adapter's start) sees those 0.25 s once.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from typing import Any

import torch

from mfu_lab.core.measure.device import DeviceInfo, cpu_name, resolve_peak

DTYPES = ("float32", "bfloat16", "float16")


def first_param(model: torch.nn.Module | None):
    return next(iter(model.parameters()), None) if model is not None else None


def device_type(model: torch.nn.Module | None) -> str:
    p = first_param(model)
    if p is not None:
        return p.device.type
    return "cuda" if torch.cuda.is_available() else "cpu"


def device_info(model: torch.nn.Module | None, cuda: bool) -> DeviceInfo:
    if cuda:  # pragma: no cover - GPU only
        p = first_param(model)
        idx = p.device.index if p is not None and p.device.index is not None else torch.cuda.current_device()
        return DeviceInfo("cuda", torch.cuda.get_device_name(idx), idx, None, None)
    return DeviceInfo("cpu", cpu_name(), None, None, torch.get_num_threads())


def train_dtype(model: torch.nn.Module | None, given: str | None) -> str:
    if given:
        return given
    p = first_param(model)
    name = str(p.dtype).replace("torch.", "") if p is not None else "float32"
    return name if name in DTYPES else "float32"


def peak_record(device: DeviceInfo, dtype: str, given_dtype: str | None, peak_flops) -> dict[str, Any]:
    """The peak as the start record holds it: given, the datasheet's (GPU), or this CPU's cached measured peak."""
    try:
        p = resolve_peak(device, dtype, peak_flops)
    except Exception as e:  # an unknown GPU: MFU is left out, said so
        return {"flops_per_s": None, "source": None, "note": str(e)}
    if peak_flops is not None:
        return {"flops_per_s": p.flops_per_s, "source": "given", "precision": p.precision,
                "note": "peak_flops given to the monitor"}
    guessed = "" if given_dtype else (f" (the training dtype {dtype} is the parameters'; under autocast pass "
                                      "Monitor(dtype=...) so MFU is taken against that precision's peak)")
    return {"flops_per_s": p.flops_per_s, "source": p.source, "precision": p.precision, "note": p.note + guessed}


def tensorboard(on: bool, folder):
    if not on:
        return None, "off"
    try:
        from torch.utils.tensorboard import SummaryWriter

        return SummaryWriter(log_dir=str(folder)), f"writing to {folder}"
    except Exception as e:
        return None, f"requested but unavailable: {e}"


def _positive(name: str, value, *, whole: bool = False, none_ok: bool = False, zero_ok: bool = False):
    if value is None and none_ok:
        return
    ok = isinstance(value, int) if whole else isinstance(value, (int, float)) and math.isfinite(value)
    if isinstance(value, bool) or not ok or value < 0 or (value == 0 and not zero_ok):
        kind = "a whole number" if whole else "a finite number"
        raise ValueError(f"Monitor({name}={value!r}): must be {kind} {'>= 0' if zero_ok else '> 0'}"
                         + (", or None" if none_ok else ""))


def check(out_dir, *, model, flops_per_token, peak_flops, every, dtype, profile_every_s, profile_steps, nvml_interval_s,
          fsync_s, max_bytes, keep_traces, run, flops_per_sample=None) -> None:
    """Monitor(...)'s arguments: a bad one raises here, at construction, with its name (before training starts)."""
    if not isinstance(out_dir, (str, os.PathLike)) or not str(out_dir):
        raise TypeError(f"Monitor(out_dir={out_dir!r}): a folder path (str or os.PathLike)")
    if model is not None and not isinstance(model, torch.nn.Module):
        raise TypeError(f"Monitor(model=...): a torch.nn.Module, got {type(model).__name__}")
    _positive("every", every, whole=True)
    _positive("profile_every_s", profile_every_s, none_ok=True)
    _positive("profile_steps", profile_steps, whole=True)
    _positive("flops_per_token", flops_per_token, none_ok=True)
    _positive("flops_per_sample", flops_per_sample, none_ok=True)
    if flops_per_token is not None and flops_per_sample is not None:
        raise ValueError("Monitor(flops_per_token=..., flops_per_sample=...): give one, the FLOPs per unit of work "
                         "that step() counts (tokens= or samples=)")
    if not isinstance(peak_flops, Mapping):
        _positive("peak_flops", peak_flops, none_ok=True)
    _positive("nvml_interval_s", nvml_interval_s)
    _positive("fsync_s", fsync_s, zero_ok=True)
    _positive("max_bytes", max_bytes, whole=True)
    _positive("keep_traces", keep_traces, whole=True, zero_ok=True)
    if dtype is not None and dtype not in DTYPES:
        raise ValueError(f"Monitor(dtype={dtype!r}): one of float32, bfloat16, float16 (the training dtype "
                         "whose peak MFU is measured against)")
    if run is not None and (not isinstance(run, str) or not run.strip()):
        raise ValueError(f"Monitor(run={run!r}): a non-empty string (the run id), or None to derive one")
