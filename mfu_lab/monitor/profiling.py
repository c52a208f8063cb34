"""The monitor's profiler windows: a few steps under torch.profiler, at a low duty cycle, analysed off the loop.

The training loop pays for opening the window, for its steps' profiling, for stopping the profiler, for writing
the trace (torch's own export, to plain JSON) and for starting one process. The trace's analysis and compression
(:mod:`mfu_lab.analysis.trace.window`, torch-free; about a second on a small CPU, the new interpreter's start
0.08 s) run in that process, at the lowest priority,
which writes its figures on its stdout and exits; a daemon thread of the monitor waits on that pipe (blocked in
the kernel, never holding the interpreter lock) and writes the ``profile`` record. Not a thread of Python work: a
thread parsing a trace holds the interpreter lock, and every torch call of the training loop waits for it
(measured on a 2-core CPU: a 106 ms loop of small torch ops took 13.6 s per step beside a Python thread parsing
JSON). Not a bare ``fork()`` either: a forked child of a process with threads ran no line of ours when another
thread was being torn down at the fork (CPython 3.11 deadlocked in ``PyOS_AfterFork_Child``; found by a CI run that
waited 300 s on torchrun's output, which the stuck child held). The process is started by fork and exec, with no
Python code between them. On a CPU it still shares the cores with the job while it runs:
``benchmarks/bench_monitor.py`` measures what the loop pays.

A child that has not answered after ``CHILD_S`` is killed; close() waits for windows being analysed up to
``JOIN_S``, then kills their children. Before a kill the child is asked for its threads' Python stacks (SIGUSR1,
``faulthandler``); the window's record carries them as ``hang_stack`` with the reason as ``error``. The child
never outlives the job: its standard streams are pipes to the monitor (never the launcher's), it dies with the
monitor's process (Linux's parent-death signal), and it kills itself after ``CHILD_S``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from mfu_lab.core.measure.timed import without_usdt_lines

JOIN_S = 30.0  # seconds close() waits for a window still being analysed
CHILD_S = 600.0  # seconds a window's analysis may take before its child is killed
# The analysis process's command, before its arguments: mfu_lab.analysis.trace.window's main(), loaded without the
# package's __init__ (which imports torch: 1.7 s of CPU on a 2-core AMD EPYC, against 0.08 s for what it needs).
_BOOT = ("import sys, types\n"
         "pkg = types.ModuleType('mfu_lab'); pkg.__path__ = [{root!r}]; sys.modules['mfu_lab'] = pkg\n"
         "from mfu_lab.analysis.trace.window import main\n"
         "sys.exit(main(sys.argv[1:]))\n")
CHILD = [sys.executable, "-c", _BOOT.format(root=str(Path(__file__).resolve().parents[1]))]


class ProfileWindows:
    def __init__(self, folder: Path, name: str, cuda: bool, steps: int, keep: int,
                 emit: Callable[..., None], fail: Callable[[str, BaseException], None]):
        self.folder, self.name, self.cuda, self.steps, self.keep = folder, name, cuda, steps, keep
        self._emit, self._fail = emit, fail
        self._prof = None
        self._left = 0
        self._threads: list[threading.Thread] = []
        self._children: dict[int, str] = {}  # pid -> why it was killed ("" while it may still answer)
        self._reap = threading.Lock()  # a pid leaves _children and is signalled under it, never both at once

    @property
    def open(self) -> bool:
        return self._prof is not None

    @property
    def analysing(self) -> bool:
        """A window's child has not answered yet (the monitor opens no new window meanwhile)."""
        return bool(self._children)

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
        t0 = time.perf_counter()
        try:
            path = self._export(prof)
            export_s = time.perf_counter() - t0
            t0 = time.perf_counter()
            proc = subprocess.Popen(
                [*CHILD, str(path), "--keep", str(self.keep), "--name", self.name, "--parent", str(os.getpid()),
                 "--limit-s", str(CHILD_S), "--steps", str(self.steps)],
                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                env=os.environ | {"OMP_NUM_THREADS": "1"})
        except Exception as e:  # a failed export or start costs one record, never the training job
            took = time.perf_counter() - t0
            self._emit("profile", steps=self.steps, error=f"{type(e).__name__}: {e}", stop_s=stop_s,
                       overhead_s=stop_s + took)
            return True
        spawn_s = time.perf_counter() - t0
        self._children[proc.pid] = ""
        t = threading.Thread(target=self._collect, args=(proc, stop_s, export_s, spawn_s),
                             name="mfu-lab-monitor-profile", daemon=True)
        self._threads = [x for x in self._threads if x.is_alive()] + [t]
        t.start()
        return True

    def _export(self, prof) -> Path:
        """torch's own export of the window, as plain JSON (the child analyses and compresses it)."""
        traces = self.folder / "traces"
        traces.mkdir(parents=True, exist_ok=True)
        path = traces / f"{self.name}-{time.time_ns()}.json"
        with without_usdt_lines():
            prof.export_chrome_trace(str(path))
        return path

    def _collect(self, proc: subprocess.Popen, stop_s: float, export_s: float, spawn_s: float) -> None:
        """Wait for the child's figures (blocked reading its pipes: no interpreter lock held), then write them."""
        try:
            out, err = proc.communicate(timeout=CHILD_S)
        except subprocess.TimeoutExpired:
            self._kill(proc.pid, f"the analysis child gave no answer within {CHILD_S:.0f} s and was killed")
            out, err = proc.communicate()
        with self._reap:  # communicate() reaped it: close() never signals a reused pid
            why = self._children.pop(proc.pid, "")
        try:
            fields = json.loads(out)
        except ValueError:
            tail = err.decode(errors="replace").strip().splitlines()[-1:] if err else []
            fields = {"steps": self.steps,
                      "error": why or f"the analysis child ended (exit {proc.returncode}) without an answer"
                               + (f": {tail[0]}" if tail else "")}
        if why and err:
            fields["hang_stack"] = err.decode(errors="replace")[-4000:]
        fields.update(analysed="in a child process, off the training loop", stop_s=stop_s, export_s=export_s,
                      spawn_s=spawn_s, overhead_s=stop_s + export_s + spawn_s)  # what the loop paid
        self._emit("profile", **fields)

    def stop(self) -> None:
        """Close: an open window is dropped; windows being analysed are waited for (up to JOIN_S), then killed."""
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
        for pid in list(self._children):  # still analysing after JOIN_S: killed, its thread writes the record
            self._kill(pid, f"the analysis child was still running {JOIN_S:.0f} s after the monitor closed; killed")
        for t in self._threads:
            t.join(5.0)

    def _kill(self, pid: int, why: str) -> None:
        with self._reap:
            if pid not in self._children:  # answered and reaped meanwhile
                return
            self._children[pid] = why
            try:
                if hasattr(signal, "SIGUSR1"):
                    os.kill(pid, signal.SIGUSR1)  # the child writes its stacks on stderr (faulthandler)
                    time.sleep(0.5)
                os.kill(pid, signal.SIGKILL if hasattr(signal, "SIGKILL") else signal.SIGTERM)
            except OSError:  # already gone
                pass
