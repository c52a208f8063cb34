"""The split of each step's time, and the interval its timed steps are summed into.

Between two ``step()`` calls the monitor holds what was timed so far: data wait, host time outside the step, other
time (evaluation, checkpoints, logging), each with whether it was timed at all; ``step()``'s own seconds are added
to them. A timed step adds its wall time to the interval; every ``every`` timed steps the ``interval`` record is
written, with MFU and tokens/s over the training steps and the data wait (other time left out)::

    mfu = flops_per_step * steps / ((wall_s - other_s) * peak_flops_per_s)

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

    def _tokens(self, tokens) -> int | None:
        if tokens is None:
            return None
        try:
            n = float(tokens)
            if not math.isfinite(n) or n < 0:
                raise ValueError(f"step(tokens={tokens!r}): not a finite count >= 0")
            return int(n)
        except (TypeError, ValueError, OverflowError) as e:
            self._fail("tokens", e)
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
                                    "data_steps": 0, "host": 0.0, "host_steps": 0, "tokens": None, "profiled": 0,
                                    "profiled_s": 0.0}

    def _add_profiled(self, dur: float) -> None:
        """A step inside a profiler window: counted, left out of the timing."""
        self._iv["profiled"] += 1
        self._iv["profiled_s"] += dur

    def _add_timed(self, dur: float, other: float, data: float, data_timed: bool, host: float, host_timed: bool,
                   tokens: int | None) -> bool:
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
        return len(iv["durs"]) >= self.every

    def _interval(self, partial: bool = False) -> None:
        iv, durs = self._iv, self._iv["durs"]
        wall, other = iv["wall"], iv["other"]
        train = wall - other  # training steps and data wait: evaluation, checkpoints and logging left out
        comm = self.comm.take() if self._comm_timed else None
        tokens = iv["tokens"]
        mfu = None
        if self._peak_flops and train > 0:
            if self.flops_per_token and tokens:
                mfu = self.flops_per_token * tokens / (train * self._peak_flops)
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
            "mfu": mfu, "profiled_steps": iv["profiled"], "profiled_s": iv["profiled_s"], "gpu": gpu,
        }
        self._reset_interval()
        self.comm.new_interval()
        self._emit("interval", **rec)
        if self._tb is not None:
            try:
                for name, value in (("mfu", mfu), ("tokens_per_s", rec["tokens_per_s"]),
                                    ("step_s_median", rec["step_s"]["median"]),
                                    ("data_share", data / wall if data is not None and wall > 0 else None),
                                    ("comm_share", comm / wall if comm is not None and wall > 0 else None)):
                    if value is not None:
                        self._tb.add_scalar(f"mfu_lab/{name}", value, self.steps_done)
            except Exception as e:
                self._fail("write", e)
