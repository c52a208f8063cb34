"""This machine's fixed costs, measured by the runs made on it and kept per machine: what a step costs whatever
the job (its notebook: the kernel's start, the imports, the report and its HTML export), and a cold compile.

On a GPU these fixed costs dominate a short run (the H200 run of 2026-12-04: a notebook about 10 s, a process
start about 10 s, a cold compile 22 s, against 49 ms a training step), and they differ from the reference CPU's
the budget's weights come from, so the budget reads them from here once a run has measured them
(:mod:`mfu_lab.core.process.budget`): each step's notebook seconds are its wall time less the step function's own
``elapsed_s`` (both measured, by the runner and by the step), and a cold compile is step 4's longest measured
``compile_cold_s``, kept per compile backend (:func:`cold_compile_kind`), and a trial's start is step 4's eager
trial: its process's seconds beyond its steps and three profiled ones (the start, the model's build, the trace).

The file is ``$XDG_CACHE_HOME/mfu-lab/fixed_costs.json`` (``~/.cache/mfu-lab`` without it) beside the peak cache,
written atomically, keyed by :func:`machine_key` (the device kind, the CPU's model and its usable cores: no
torch is imported to know them). A file that cannot be read is taken as empty and rewritten; an entry that is not
a list of finite seconds >= 0 is left out. Only the last :data:`KEEP` figures of each kind are kept, and the
median is used: one slow notebook (a busy machine) moves nothing.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import tempfile
from pathlib import Path
from typing import Any

KEEP = 14  # figures kept per kind and machine: two whole runs' notebooks
KINDS = ("notebook_s", "cold_compile_s", "trial_start_s")  # and "cold_compile_s:<backend>" beside inductor


def cold_compile_kind(backend: str) -> str:
    """The kind a cold compile with ``backend`` is kept under: inductor's (code generation, a C++ or Triton build)
    and another backend's (``eager`` and ``aot_eager``: tracing alone, seconds) are not one figure."""
    return "cold_compile_s" if backend in ("inductor", "") else f"cold_compile_s:{backend}"


def _known(kind: str) -> bool:
    return kind in KINDS or (kind.startswith("cold_compile_s:") and len(kind) > len("cold_compile_s:"))


def cache_path() -> Path:
    """``$XDG_CACHE_HOME/mfu-lab/fixed_costs.json``, or ``~/.cache/mfu-lab/fixed_costs.json``."""
    root = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(root) / "mfu-lab" / "fixed_costs.json"


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text(encoding="utf-8", errors="replace").splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor() or platform.machine() or "unknown"


def machine_key(device: str) -> str:
    """The key of this machine's entry: the job's device kind (``cpu``, ``cuda``, ``auto``), the CPU's model and
    its usable cores (a notebook's start is the host's work, on a GPU node too)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return f"{device}|{_cpu_model()}|{cores}"


def _read() -> dict[str, Any]:
    try:
        data = json.loads(cache_path().read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):
        return {}
    return data if isinstance(data, dict) and isinstance(data.get("machines"), dict) else {}


def _seconds(xs: Any) -> list[float]:
    if not isinstance(xs, list):
        return []
    return [float(x) for x in xs if isinstance(x, (int, float)) and not isinstance(x, bool)
            and math.isfinite(x) and x >= 0]


def figures(key: str, kind: str) -> list[float]:
    """The figures of ``kind`` (one of :data:`KINDS`) kept for machine ``key``, oldest first ([] when none)."""
    entry = _read().get("machines", {}).get(key)
    return _seconds(entry.get(kind)) if isinstance(entry, dict) else []


def median(key: str, kind: str) -> tuple[float, int] | None:
    """(the median of the figures of ``kind`` kept for ``key``, how many), or None when none is kept."""
    xs = figures(key, kind)
    return (statistics.median(xs), len(xs)) if xs else None


def record(key: str, kind: str, seconds: float) -> None:
    """Keep one measured figure; a figure that is not finite and >= 0 is not kept. A cache that cannot be written
    (a read-only home) keeps nothing and raises nothing: the run goes on."""
    if not _known(kind):
        raise ValueError(f"kind {kind!r}: one of {', '.join(KINDS)}, or cold_compile_s:<backend>")
    if not _seconds([seconds]):
        return
    data = _read() or {"about": "mfu-lab's measured fixed costs per machine (mfu_lab.core.store.fixed_costs)",
                       "machines": {}}
    entry = data["machines"].get(key)
    entry = entry if isinstance(entry, dict) else {}
    entry[kind] = (_seconds(entry.get(kind)) + [round(float(seconds), 3)])[-KEEP:]
    data["machines"][key] = entry
    path = cache_path()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(json.dumps(data, indent=2) + "\n")
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    except OSError:
        pass
