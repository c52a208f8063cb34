"""The monitor's profiler windows: a few steps under torch.profiler, at a low duty cycle, analysed off the loop.

The training loop pays for opening the window, for its steps' profiling, for stopping the profiler, and for one
``fork()``. The trace's export and its analysis (:func:`mfu_lab.analysis.trace.analyse`, about a second on a small
CPU) run in the forked child, at the lowest priority, which hands its figures back through a pipe and exits; a
daemon thread of the monitor waits on that pipe (blocked in the kernel, never holding the interpreter lock) and
writes the ``profile`` record. Not a thread of Python work: a thread parsing a trace holds the interpreter lock,
and every torch call of the training loop waits for it (measured on a 2-core CPU: a 106 ms loop of small torch
ops took 13.6 s per step beside a Python thread parsing JSON). On a CPU the child still shares the cores with
the job while it runs: ``benchmarks/bench_monitor.py`` measures what the loop pays. Where ``fork`` is missing
(Windows) the analysis runs in the loop and its time is in ``overhead_s``. A child that has not answered after
``CHILD_S`` is killed (its window's record says so); close() waits for a window being analysed up to ``JOIN_S``.
"""

from __future__ import annotations

import json
import os
import select
import signal
import threading
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mfu_lab.core.measure import without_usdt_lines
from mfu_lab.core.results import jsonable

JOIN_S = 30.0  # seconds close() waits for a window still being analysed
CHILD_S = 600.0  # seconds a window's analysis may take before its child is killed


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
        if not hasattr(os, "fork"):  # pragma: no cover - Windows: analysed here, in the loop
            self._emit("profile", **self._fields(prof, stop_s, "in the training loop (no fork here)"))
            return True
        t0 = time.perf_counter()
        r, w = os.pipe()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)  # Python 3.12+: fork beside threads; see _child
            pid = os.fork()
        if pid == 0:
            self._child(prof, r, w)  # never returns
        os.close(w)
        fork_s = time.perf_counter() - t0
        t = threading.Thread(target=self._collect, args=(pid, r, stop_s, fork_s), name="mfu-lab-monitor-profile",
                             daemon=True)
        self._threads = [x for x in self._threads if x.is_alive()] + [t]
        t.start()
        return True

    def _fields(self, prof, overhead_s: float, where: str) -> dict[str, Any]:
        t0 = time.perf_counter()
        fields: dict[str, Any] = {"steps": self.steps}
        try:
            fields.update(self._analyse(prof))
        except Exception as e:  # a failed analysis costs one record, never the training job
            fields["error"] = f"{type(e).__name__}: {e}"
        fields["analysis_s"] = time.perf_counter() - t0
        fields["overhead_s"] = overhead_s + (fields["analysis_s"] if "loop" in where else 0.0)
        fields["analysed"] = where
        return fields

    def _child(self, prof, r: int, w: int) -> None:  # pragma: no cover - runs in the forked child
        """The forked child: export and analyse the window, write the figures to the pipe, exit at once (no exit
        handlers, no buffers of the parent flushed twice). It touches no device, no file of the job, no lock of
        the monitor's threads (none of which exist here)."""
        code = 0
        try:
            os.close(r)
            try:
                os.nice(19)
            except OSError:
                pass
            fields = self._fields(prof, 0.0, "in a forked child process, off the training loop")
            data = memoryview(json.dumps(jsonable(fields), default=str).encode())
            while data:
                data = data[os.write(w, data):]
        except BaseException:
            code = 1
        finally:
            os._exit(code)

    def _collect(self, pid: int, r: int, stop_s: float, fork_s: float) -> None:
        """Wait for the child's figures (blocked in select/read: no interpreter lock held), then write them."""
        chunks, deadline = [], time.monotonic() + CHILD_S
        try:
            while True:
                left = deadline - time.monotonic()
                if left <= 0 or not select.select([r], [], [], left)[0]:
                    os.kill(pid, signal.SIGKILL)
                    break
                chunk = os.read(r, 1 << 16)
                if not chunk:
                    break
                chunks.append(chunk)
        except OSError:
            pass
        finally:
            os.close(r)
            try:
                os.waitpid(pid, 0)
            except OSError:
                pass
        try:
            fields = json.loads(b"".join(chunks))
        except ValueError:
            fields = {"steps": self.steps, "error": f"the analysis child gave no answer within {CHILD_S:.0f} s or "
                      "ended without one"}
        fields.update(stop_s=stop_s, fork_s=fork_s, overhead_s=stop_s + fork_s)  # what the loop paid
        self._emit("profile", **fields)

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
