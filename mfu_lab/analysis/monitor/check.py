"""The field check every monitor record passes before the report reads it.

A record that is valid JSON can still carry a wrong type (``"wall_s": "abc"``, ``"rank": "abc"``,
``"steps": 0.5``), a value that is not finite (``NaN``, infinity) or a negative duration. Such a record is
skipped and counted, as a torn line is (:class:`mfu_lab.core.store.monitor_files.ReadCount`), and the report names
what was skipped: no wrong value ever reaches a sum, a bin or the verdict.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

EXAMPLES = 5  # records named in the report per read
TIME_MAX = 1e11  # unix seconds; beyond this no date can be printed

# interval fields: seconds or counts that must be finite and >= 0 when present (None allowed)
_INTERVAL_SECONDS = ("data_s", "host_s", "other_s", "comm_s", "tokens", "mfu", "tokens_per_s", "profiled_s")
_GPU_NUMBERS = ("temperature_c_max", "sm_clock_mhz_reference", "sm_clock_mhz_max", "sm_clock_mhz_busy_mean",
                "throttled_share", "throttled_clock_ratio", "power_w_mean", "ecc_uncorrected_new")
_START_DICTS = ("device", "peak", "flops", "comm", "nvml", "scheduler", "settings")


def _number(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _time(x: Any) -> bool:
    """Unix seconds a date can be made of (1970 to the year 5138): 1e300 is finite, but no date."""
    return _number(x) and 0 <= x < TIME_MAX


def _count(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= 0


def _short(x: Any) -> str:
    text = repr(x)
    return text if len(text) <= 40 else text[:37] + "..."


def problem(rec: dict[str, Any]) -> str | None:
    """Why the report cannot use ``rec`` (a record that passed :func:`iter_records`'s JSON check), or None.
    The reason names the field and its value: ``"interval: wall_s = 'abc' (seconds >= 0)"``."""
    kind = rec.get("kind")

    def bad(name: str, want: str) -> str:
        return f"{kind}: {name} = {_short(rec.get(name))} ({want})"

    if not _time(rec.get("t")):
        return bad("t", "unix seconds, a finite number >= 0")
    if not _count(rec.get("rank", 0)):
        return bad("rank", "a whole number >= 0")
    for name in ("node", "launch", "run"):
        if rec.get(name) is not None and not isinstance(rec[name], str):
            return bad(name, "text")
    if kind == "interval":
        return _interval(rec, bad)
    if kind == "start":
        if rec.get("world") is not None and not (_count(rec["world"]) and rec["world"] >= 1):
            return bad("world", "a whole number >= 1")
        for name in _START_DICTS:
            if rec.get(name) is not None and not isinstance(rec[name], dict):
                return bad(name, "an object")
    elif kind == "cluster":
        slurm = rec.get("slurm")
        if slurm is not None and not isinstance(slurm, dict):
            return bad("slurm", "an object")
        for name in ("SubmitTime", "queue_wait_s"):
            if slurm and name in slurm and not (_time(slurm[name])):
                return f"cluster: slurm.{name} = {_short(slurm[name])} (a finite number >= 0)"
    elif kind == "profile":
        for name in ("window_s", "overhead_s"):
            if rec.get(name) is not None and not (_number(rec[name]) and rec[name] >= 0):
                return bad(name, "seconds >= 0")
        b = rec.get("breakdown")
        if b is not None and not (isinstance(b, dict) and all(v is None or _number(v) for v in b.values())):
            return bad("breakdown", "an object of finite numbers")
    return None


def _interval(rec: dict[str, Any], bad) -> str | None:
    if not _count(rec.get("steps", 0)):
        return bad("steps", "a whole number of steps >= 0")
    if rec.get("step") is not None and not _count(rec["step"]):
        return bad("step", "a whole number >= 0")
    if rec.get("steps") and not (_number(rec.get("wall_s")) and rec["wall_s"] >= 0):
        return bad("wall_s", "seconds >= 0")
    if rec.get("t0") is not None and not _time(rec["t0"]):
        return bad("t0", "unix seconds, a finite number >= 0")
    for name in _INTERVAL_SECONDS:
        if rec.get(name) is not None and not (_number(rec[name]) and rec[name] >= 0):
            return bad(name, "a finite number >= 0")
    if rec.get("data_timed") is not None and not isinstance(rec["data_timed"], bool):
        return bad("data_timed", "true or false")
    step_s = rec.get("step_s")
    if step_s is not None:
        med = step_s.get("median") if isinstance(step_s, dict) else "not an object"
        if med is not None and not (_number(med) and med >= 0):
            return f"interval: step_s.median = {_short(med)} (seconds >= 0)"
    gpu = rec.get("gpu")
    if gpu is not None:
        if not isinstance(gpu, dict):
            return bad("gpu", "an object")
        for name in _GPU_NUMBERS:
            if gpu.get(name) is not None and not (_number(gpu[name]) and gpu[name] >= 0):
                return f"interval: gpu.{name} = {_short(gpu[name])} (a finite number >= 0)"
        if gpu.get("xid") is not None and not isinstance(gpu["xid"], list):
            return f"interval: gpu.xid = {_short(gpu['xid'])} (a list)"
    return None


@dataclass
class Skipped:
    """Records skipped by :func:`problem`: how many, by field, and the first few named with where they were."""

    records: int = 0
    by_field: dict[str, int] = field(default_factory=dict)
    examples: list[str] = field(default_factory=list)

    def add(self, why: str, where: str) -> None:
        self.records += 1
        key = why.split(" = ", 1)[0]  # "interval: wall_s"
        self.by_field[key] = self.by_field.get(key, 0) + 1
        if len(self.examples) < EXAMPLES:
            self.examples.append(f"{where}: {why}")
