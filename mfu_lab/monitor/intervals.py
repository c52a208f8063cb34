"""The split of each step's time, and the interval its timed steps are summed into.

Between two ``step()`` calls the monitor holds what was timed so far: data wait, host time outside the step, other
time (evaluation, checkpoints, logging), each with whether it was timed at all; ``step()``'s own seconds are added
to them. A timed step adds its wall time to the interval; every ``every`` timed steps the ``interval`` record is
written, with MFU and tokens/s (or samples/s) over the training steps and the data wait (other time left out)::

    mfu = flops_per_step * steps / ((wall_s - other_s) * peak_flops_per_s)

with ``flops_per_step * steps`` read as ``flops_per_token * tokens`` where FLOPs per token are known and the steps
counted tokens, else ``flops_per_sample * samples`` where FLOPs per sample are known and the steps counted samples
(``step(samples=)``: images, rows; work that is not tokens), else the FLOPs counted in one step times the steps.
The record names its unit: ``unit`` is ``tokens/s`` when the interval's steps counted tokens, ``samples/s`` when
they counted samples only, null when they counted neither; ``tokens_per_s`` and ``samples_per_s`` are each null
where that count is unknown.

The record's fields and their contract: :mod:`mfu_lab.core.store.monitor_files`.
"""

from __future__ import annotations

import math
import statistics
import time
from typing import Any

from mfu_lab.core.measure.timed import percentile
from mfu_lab.monitor.comm import CommTimer
from mfu_lab.monitor.context import NvmlProbe


class SplitsSteps:
    """The Monitor's part that splits each step's time (data wait, host, other), sums the timed steps of an
    interval and writes its ``interval`` record (and its TensorBoard scalars)."""

    every: int
    steps_done: int
    flops_per_step: float | None
    flops_per_token: float | None
    flops_per_sample: float | None
    comm: CommTimer
    nvml: NvmlProbe | None
    _peak_flops: float | None
    _comm_timed: bool
    _tb: Any

    # ------------------------------------------------------------------ between two step() calls
    def _reset_pending(self) -> None:
        self._data_pending = self._host_pending = self._other_pending = 0.0
        self._data_timed = self._host_timed = False

    def _seconds(self, value) -> float | None:
        if value is None:
            return None
        v = float(value)
        if not math.isfinite(v) or v < 0:
            self._fail("arguments", ValueError(f"{value!r} seconds: not a finite number >= 0, left out"))
            return None
        return v

    def _tokens(self, tokens, name: str = "tokens") -> int | None:
        """``step(tokens=)`` or ``step(samples=)`` (``name``) as a whole count; a bad one is counted in errors
        under ``name`` and left out."""
        if tokens is None:
            return None
        try:
            n = float(tokens)
            if not math.isfinite(n) or n < 0:
                raise ValueError(f"step({name}={tokens!r}): not a finite count >= 0")
            return int(n)
        except (TypeError, ValueError, OverflowError) as e:
            self._fail(name, e)
            return None

    def _take_pending(self, given: list[float | None]) -> tuple[float, bool, float, bool, float]:
        """The step's data wait, host and other time (with whether data and host were timed): what was timed since
        the last ``step()`` plus ``given`` (``step()``'s data_wait_s, host_s, other_s); the pending time restarts."""
        data, host, other = self._data_pending, self._host_pending, self._other_pending
        data_timed, host_timed = self._data_timed, self._host_timed
        if given[0] is not None:
            data, data_timed = data + given[0], True
        if given[1] is not None:
            host, host_timed = host + given[1], True
        if given[2] is not None:
            other += given[2]
        self._reset_pending()
        return data, data_timed, host, host_timed, other

    # ------------------------------------------------------------------ the interval
    def _reset_interval(self) -> None:
        self._iv: dict[str, Any] = {"t0": time.time(), "durs": [], "wall": 0.0, "other": 0.0, "data": 0.0,
                                    "data_steps": 0, "host": 0.0, "host_steps": 0, "tokens": None, "samples": None,
                                    "profiled": 0, "profiled_s": 0.0}

    def _add_profiled(self, dur: float) -> None:
        """A step inside a profiler window: counted, left out of the timing."""
        self._iv["profiled"] += 1
        self._iv["profiled_s"] += dur

    def _add_timed(self, dur: float, other: float, data: float, data_timed: bool, host: float, host_timed: bool,
                   tokens: int | None, samples: int | None = None) -> bool:
        """Add one timed step to the interval; True when the interval holds ``every`` steps (its record is due)."""
        iv = self._iv
        iv["durs"].append(max(dur - other, 0.0))
        iv["wall"] += dur
        iv["other"] += other
        if data_timed:
            iv["data"] += data
            iv["data_steps"] += 1
        if host_timed:
            iv["host"] += host
            iv["host_steps"] += 1
        if tokens is not None:
            iv["tokens"] = (iv["tokens"] or 0) + tokens
        if samples is not None:
            iv["samples"] = (iv["samples"] or 0) + samples
        return len(iv["durs"]) >= self.every

    def _interval(self, partial: bool = False) -> None:
        iv, durs = self._iv, self._iv["durs"]
        wall, other = iv["wall"], iv["other"]
        train = wall - other  # training steps and data wait: evaluation, checkpoints and logging left out
        comm = self.comm.take() if self._comm_timed else None
        tokens, samples = iv["tokens"], iv["samples"]
        mfu = None
        if self._peak_flops and train > 0:
            if self.flops_per_token and tokens:
                mfu = self.flops_per_token * tokens / (train * self._peak_flops)
            elif self.flops_per_sample and samples:
                mfu = self.flops_per_sample * samples / (train * self._peak_flops)
            elif self.flops_per_step:
                mfu = self.flops_per_step * len(durs) / (train * self._peak_flops)
        gpu = self.nvml.take() if self.nvml is not None else None
        data = iv["data"] if iv["data_steps"] else None
        rec = {
            "t0": iv["t0"], "step": self.steps_done, "steps": len(durs), "partial": partial,
            "step_s": {"median": statistics.median(durs), "p90": percentile(durs, 90), "max": max(durs),
                       "mean": sum(durs) / len(durs)},
            "wall_s": wall, "other_s": other, "data_s": data, "data_timed": bool(iv["data_steps"]),
            "data_timed_steps": iv["data_steps"], "host_s": iv["host"] if iv["host_steps"] else None,
            "comm_s": comm, "tokens": tokens, "tokens_per_s": tokens / train if tokens and train > 0 else None,
            "samples": samples, "samples_per_s": samples / train if samples and train > 0 else None,
            "unit": "tokens/s" if tokens is not None else "samples/s" if samples is not None else None,
            "mfu": mfu, "profiled_steps": iv["profiled"], "profiled_s": iv["profiled_s"], "gpu": gpu,
        }
        self._reset_interval()
        self.comm.new_interval()
        self._emit("interval", **rec)
        if self._tb is not None:
            try:
                for name, value in (("mfu", mfu), ("tokens_per_s", rec["tokens_per_s"]),
                                    ("samples_per_s", rec["samples_per_s"]),
                                    ("step_s_median", rec["step_s"]["median"]),
                                    ("data_share", data / wall if data is not None and wall > 0 else None),
                                    ("comm_share", comm / wall if comm is not None and wall > 0 else None)):
                    if value is not None:
                        self._tb.add_scalar(f"mfu_lab/{name}", value, self.steps_done)
            except Exception as e:
                self._fail("write", e)
