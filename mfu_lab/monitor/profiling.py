"""The monitor's profiler windows: a few steps under torch.profiler, at a low duty cycle, analysed off the loop.

The training loop pays for opening the window, for its steps' profiling, and for stopping the profiler; the
trace's export and its analysis (:func:`mfu_lab.analysis.trace.analyse`, about a second on a small CPU) run in a
daemon thread at the lowest scheduling priority the system gives a thread, so the step that closes the window
returns at once. On a CPU that thread still shares the cores (and Python's interpreter lock) with the job for
that second: ``benchmarks/bench_monitor.py`` measures what the loop pays, the analysis included. A window still
being analysed when the monitor closes is waited for (up to ``JOIN_S``), so its record is written.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mfu_lab.core.measure import without_usdt_lines

JOIN_S = 30.0  # seconds close() waits for a window still being analysed


class ProfileWindows:
    def __init__(self, folder: Path, name: str, cuda: bool, steps: int, keep: int,
                 emit: Callable[..., None], fail: Callable[[str, BaseException], None]):
        self.folder, self.name, self.cuda, self.steps, self.keep = folder, name, cuda, steps, keep
        self._emit, self._fail = emit, fail
        self._prof = None
        self._left = 0
        self._threads: list[threading.Thread] = []

    @property
    def open(self) -> bool:
        return self._prof is not None

    def start(self) -> None:
        from torch.profiler import ProfilerAction, ProfilerActivity, profile

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
        # a schedule that always records: it also turns on the ProfilerStep#N spans the trace analysis needs
        prof = profile(activities=acts, record_shapes=False, schedule=lambda _: ProfilerAction.RECORD)
        with without_usdt_lines():
            prof.start()  # opens ProfilerStep#0; each later step() closes one and opens the next
        self._prof, self._left = prof, self.steps

    def step(self) -> bool:
        """One step of the window; True when it was the last (the profiler stopped, the analysis handed off)."""
        self._left -= 1
        if self._left > 0:
            self._prof.step()
            return False
        prof, self._prof = self._prof, None
        t0 = time.perf_counter()
        with without_usdt_lines():
            prof.stop()
        stop_s = time.perf_counter() - t0
        t = threading.Thread(target=self._analyse_and_emit, args=(prof, stop_s), name="mfu-lab-monitor-profile",
                             daemon=True)
        self._threads = [x for x in self._threads if x.is_alive()] + [t]
        t.start()
        return True

    def stop(self) -> None:
        """Close: an open window is dropped; windows being analysed are waited for (up to JOIN_S)."""
        prof, self._prof = self._prof, None
        if prof is not None:
            try:
                with without_usdt_lines():
                    prof.stop()
            except Exception as e:
                self._fail("profiler", e)
        deadline = time.monotonic() + JOIN_S
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))

    def _analyse_and_emit(self, prof, stop_s: float) -> None:
        try:  # the lowest priority for this thread only (Linux: a thread has its own nice value)
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        except (AttributeError, OSError):
            pass
        t0 = time.perf_counter()
        fields: dict[str, Any] = {"steps": self.steps, "stop_s": stop_s}
        try:
            fields.update(self._analyse(prof))
        except Exception as e:  # a failed analysis costs one record, never the training job
            fields["error"] = f"{type(e).__name__}: {e}"
        fields["analysis_s"] = time.perf_counter() - t0
        fields["overhead_s"] = stop_s  # what the step that closed the window paid; the analysis ran off the loop
        fields["analysed"] = "in a background thread, off the training loop"
        self._emit("profile", **fields)

    def _analyse(self, prof) -> dict[str, Any]:
        from mfu_lab.analysis.trace import analyse
        from mfu_lab.analysis.trace_events import load_trace

        traces = self.folder / "traces"
        traces.mkdir(parents=True, exist_ok=True)
        path = traces / f"{self.name}-{int(time.time())}.json.gz"
        prof.export_chrome_trace(str(path))  # torch gzips a path ending in .gz
        a = analyse(load_trace(path), top_n=5)
        kept = sorted(traces.glob(f"{self.name}-*.json.gz"))
        for old in kept[:-self.keep] if self.keep > 0 else kept:
            old.unlink(missing_ok=True)
        b = a.breakdown
        return {"window_s": a.window_s, "trace_kind": a.kind, "steps_in_trace": a.steps, "notes": a.notes,
                "trace": path.name if self.keep > 0 else None,
                "breakdown": {"computing": b.computing, "communicating": b.communicating, "copying": b.copying,
                              "waiting_for_data": b.waiting_for_data, "idle": b.idle, "comm_total": b.comm_total},
                "top": [{"name": r.name, "share": r.share} for r in a.top]}
