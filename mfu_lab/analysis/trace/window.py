"""One monitor profiler window's analysis, in a process of its own: ``python -m mfu_lab.analysis.trace.window``.

The monitor (:mod:`mfu_lab.monitor.profiling`) exports a window's trace as plain JSON and starts this module as a
fresh process (fork and exec, no Python code run between them: a bare ``fork()`` of a process with threads can
deadlock in the child before a line of ours runs, as CPython 3.11's did in its thread-state clean-up). It analyses
the trace, keeps it gzipped (the newest ``keep`` of the rank's) or removes it, and writes the window's figures as
one JSON object on stdout. It runs at the lowest priority, dies with the monitor's process (Linux's parent-death
signal), kills itself after ``limit_s`` whatever happens, and writes its threads' Python stacks on stderr when it
gets SIGUSR1 (the monitor's signal before it kills a child that hangs). It imports no torch: the monitor loads
it without the package's ``__init__`` (0.08 s of start, not 1.7 s, on a 2-core AMD EPYC).
"""

from __future__ import annotations

import argparse
import faulthandler
import gzip
import json
import os
import shutil
import signal
import sys
import time
from pathlib import Path
from typing import Any

from mfu_lab.analysis.trace.breakdown import analyse
from mfu_lab.analysis.trace.events import load_trace
from mfu_lab.core.process.procs import die_with


def analyse_window(path: Path, keep: int, name: str) -> dict[str, Any]:
    """The figures of one window from its exported trace ``path``; the trace kept gzipped beside it (the newest
    ``keep`` files named ``name-*.json.gz``), or removed when ``keep`` is 0."""
    try:
        a = analyse(load_trace(path), top_n=5)
        kept = None
        if keep > 0:
            kept = path.with_name(path.name + ".gz")
            with open(path, "rb") as fin, gzip.open(kept, "wb", compresslevel=6) as fout:
                shutil.copyfileobj(fin, fout)
    finally:
        path.unlink(missing_ok=True)
    old = sorted(path.parent.glob(f"{name}-*.json.gz"), key=lambda p: p.stat().st_mtime)
    for p in old[:-keep] if keep > 0 else old:
        p.unlink(missing_ok=True)
    b = a.breakdown
    return {"window_s": a.window_s, "trace_kind": a.kind, "steps_in_trace": a.steps, "notes": a.notes,
            "trace": kept.name if kept else None,
            "breakdown": {"computing": b.computing, "communicating": b.communicating, "copying": b.copying,
                          "waiting_for_data": b.waiting_for_data, "idle": b.idle, "comm_total": b.comm_total},
            "top": [{"name": r.name, "share": r.share} for r in a.top]}


def bound(parent: int, limit_s: float) -> None:
    """Dies with ``parent`` and after ``limit_s``; SIGUSR1 writes every thread's stack on stderr."""
    die_with(parent)
    if hasattr(signal, "alarm"):
        signal.alarm(max(1, int(limit_s)))
    if hasattr(signal, "SIGUSR1"):
        faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True)
    try:
        os.nice(19)
    except (OSError, AttributeError):
        pass


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m mfu_lab.analysis.trace.window", description=__doc__.split("\n")[0])
    p.add_argument("trace", type=Path, help="the window's exported trace (.json); removed or gzipped")
    p.add_argument("--keep", type=int, default=0, help="how many of the rank's gzipped traces to keep")
    p.add_argument("--name", required=True, help="the rank's file prefix (NAME-*.json.gz)")
    p.add_argument("--parent", type=int, default=os.getppid(), help="die when this process ends")
    p.add_argument("--limit-s", type=float, default=600.0, help="die after this many seconds")
    p.add_argument("--steps", type=int, default=0, help="the window's steps (recorded as they were asked)")
    a = p.parse_args(argv)
    bound(a.parent, a.limit_s)
    t0 = time.perf_counter()
    fields: dict[str, Any] = {"steps": a.steps}
    try:
        fields.update(analyse_window(a.trace, a.keep, a.name))
    except Exception as e:  # a failed analysis costs one record, never the training job
        fields["error"] = f"{type(e).__name__}: {e}"
    fields["analysis_s"] = time.perf_counter() - t0
    sys.stdout.write(json.dumps(fields, default=str))
    sys.stdout.flush()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
