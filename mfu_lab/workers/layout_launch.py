"""Running a job in its layout through torchrun (mfu_lab.workers.layout_rank), surviving ranks that crash or hang.

Several layouts can share one launch (start-up is paid once). A watchdog reads the ranks' progress file; a
launch with no progress for ``comm_timeout_s`` is ended and the layout it was in is recorded as hung, with each
rank's last heartbeat; a crash is recorded with each rank's last error line. A new launch takes the layouts
left. Every child (torchrun and its ranks) is ended on every way out: success, failure, Ctrl-C, SIGTERM.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

from mfu_lab.core.engine.layout import Layout
from mfu_lab.core.job.schema import Job, validate
from mfu_lab.core.measure.device import release_device_memory
from mfu_lab.core.process import procs
from mfu_lab.workers.launch import (
    _rank_stderr,
    _read,
    _torchrun_cmd,
    error_lines,
    stalled_ranks,
    startup_allowance,
    watch,
    world_layout,
)

WORKER = "mfu_lab.workers.layout_rank"


@dataclass
class LayoutRun:
    """One layout's run: the loss check, per-rank step times, counted collectives, memory and (PP) bubble."""

    layout: dict  # Layout.to_dict() plus "name"
    world: int
    backend: str  # nccl | gloo
    threads_per_rank: int  # intra-op threads each rank used (CPU: the cores shared out)
    status: str  # ok | refused | crashed | hung
    reason: str = ""  # why it was refused, crashed or hung
    step_times_s: list[list[float]] = field(default_factory=list)  # per rank, per timed step (measured)
    tokens_per_step: int = 0  # useful (non-padding) tokens of the global batch per optimizer step
    loss_check: dict | None = None  # reference, steps, layout_losses, reference_losses, max_rel_gap, tolerance...
    collectives: list[dict] = field(default_factory=list)  # per rank: {kind: {"count", "bytes"}} for one step
    memory: list[dict] = field(default_factory=list)  # per rank: peak_bytes, peak_source, shard_bytes{...}
    bubble: dict | None = None  # PP: {"per_stage": [...], "analytic": (p-1)/(v*m)}
    notes: list[str] = field(default_factory=list)
    fp8: dict = field(default_factory=dict)  # the job's fp8_layers in the ranks (core.engine.fp8.Fp8Applied + text)
    trace_paths: list[str] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)  # the timed steps' losses (mean over data-parallel ranks)
    launch_seconds: float = 0.0  # the wall time of the launch it ran in (shared by every layout of that launch)
    stderr: str = ""  # crashed or hung: the ranks' stderr

    @property
    def name(self) -> str:
        return self.layout.get("name", "?")

    def step_s(self) -> float | None:
        """Median over the timed steps of the slowest rank's time (a step ends when its last rank ends)."""
        if not self.step_times_s or not all(self.step_times_s):
            return None
        return statistics.median(max(per) for per in zip(*self.step_times_s))

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> LayoutRun:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in names})


def layout_of(job: Job, overrides: dict, world: int) -> dict:
    """The layout a spec item names, for a record the worker never wrote (a crash before it started)."""
    try:
        layout = Layout.from_job(validate({**job.to_dict(), **overrides}, "layout"), world)
        return layout.to_dict() | {"name": layout.name}
    except Exception:  # noqa: BLE001 - the worker refuses it with the reason; here it is only named
        return {"name": " ".join(f"{k}={v}" for k, v in overrides.items()) or "the job's layout",
                "overrides": overrides}


def launch(job: Job, spec: dict, work: Path, attempt: int, progress=None) -> dict:
    """One torchrun launch of the worker, ended when it stalls for ``job.comm_timeout_s``; its events, exit code
    (None: ended by the watchdog), the ranks' stderr and, on a hang, which rank stopped where."""
    nnodes, nproc = world_layout(job, spec["device_type"])
    work.mkdir(parents=True, exist_ok=True)
    spec = {**spec, "out": str(work), "timeout_s": job.comm_timeout_s}
    spec_path = work / f"spec_{attempt}.json"
    spec_path.write_text(json.dumps(spec))
    progress_file = work / "progress.jsonl"
    progress_file.unlink(missing_ok=True)
    for old in (work / "beats").glob("rank*.json"):
        old.unlink()
    log_dir = work / f"logs_{attempt}"
    shutil.rmtree(log_dir, ignore_errors=True)  # torchrun adds a folder per run: an earlier run's stderr would show
    cmd = _torchrun_cmd(job, nnodes, nproc, log_dir, spec_path)
    cmd[cmd.index("mfu_lab.workers.ddp_rank")] = WORKER
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TORCHELASTIC_ERROR_FILE": str(work / f"error_{attempt}.json")}
    env.setdefault("OMP_NUM_THREADS", "1")
    release_device_memory(spec["device_type"])
    t0 = time.perf_counter()
    with open(work / f"launcher_{attempt}.log", "w") as err:
        proc = procs.popen(cmd, stdout=err, stderr=err, env={**env, **procs.launcher_env()}, cwd=os.getcwd(),
                           death_signal=signal.SIGTERM, grace_s=20.0)
        try:
            with procs.interrupt_on_sigterm():
                hung, seen, allowed = watch(proc, progress_file, progress, job.comm_timeout_s,
                                            startup_allowance(nnodes))
        finally:
            procs.kill(proc)  # every way out: a finished torchrun has nothing left; else it and its ranks end
    events = _read(progress_file)
    if progress:
        for ev in events[seen:]:
            progress(ev)
    return {"returncode": None if hung else proc.returncode, "events": events, "rank_stderr": _rank_stderr(log_dir),
            "launcher_stderr": (work / f"launcher_{attempt}.log").read_text(errors="replace")[-3000:],
            "stalled": stalled_ranks(work / "beats") if hung else "", "seconds": time.perf_counter() - t0,
            "waited_s": allowed}


def run_layouts(job: Job, device_type: str, work: Path, items: list[dict], progress=None, profile: bool = False,
                steps: int | None = None, fault: list | None = None, check_steps: int | None = None) -> list[LayoutRun]:
    """Every layout in ``items`` (each ``{"overrides": {job key: value}, "reference": "auto" | "single" |
    {overrides of another layout}, "one_process_fits": bool}``) in as few launches as crashes allow: a layout that
    crashes or hangs is recorded so, and a new launch takes the ones after it. ``steps``: timed steps (default
    the job's ``steps``); warm-up steps are the job's ``warmup_steps``; ``check_steps``: the loss check's steps
    (default the worker's CHECK_STEPS). ``fault`` (tests only): a list of
    ``{"layout": index, "rank": r, "kind": "crash" | "hang"}`` for the first launch."""
    nnodes, nproc = world_layout(job, device_type)
    world, backend = nnodes * nproc, "nccl" if device_type == "cuda" else "gloo"
    results: dict[int, LayoutRun] = {}
    todo = list(range(len(items)))
    attempt = 0
    while todo:
        spec = {"job": job.to_dict(), "device_type": device_type, "layouts": [items[i] for i in todo],
                "steps": steps or job.steps, "warmup": job.warmup_steps, "profile": profile,
                "check_steps": check_steps,
                "fault": fault if attempt == 0 else None}
        run = launch(job, spec, work, attempt, progress)
        attempt += 1
        threads = next((e["threads"] for e in run["events"] if e["event"] == "launch"), 0)
        started = None
        for ev in run["events"]:
            if ev["event"] == "start":
                started = todo[ev["index"]]
            elif ev["event"] == "done":
                i = todo[ev["index"]]
                rec = {k: v for k, v in ev.items() if k not in ("event", "index")}
                rec.setdefault("layout", layout_of(job, items[i].get("overrides", {}), world))
                results[i] = LayoutRun.from_dict({"world": world, "backend": backend, "threads_per_rank": threads,
                                                  "launch_seconds": run["seconds"]} | rec)
                started = None
        finished = run["returncode"] == 0 and any(e["event"] == "finished" for e in run["events"])
        left = [i for i in todo if i not in results]
        if finished or not left:
            break
        detail = error_lines(run["rank_stderr"])
        status = "hung" if run["returncode"] is None else "crashed"
        why = (f"no progress for {run['waited_s']:.0f} s: the launch was ended; {run['stalled']}"
               if status == "hung" else f"the launch exited with code {run['returncode']}")
        why += f" ({detail})" if detail else ""
        stderr = "\n".join(f"--- {r} ---\n{t}" for r, t in run["rank_stderr"].items() if t.strip()) \
            or run["launcher_stderr"]
        failed = [started] if started is not None else left  # outside any layout (start-up): every one left
        for i in failed:
            results[i] = LayoutRun(layout_of(job, items[i].get("overrides", {}), world), world, backend, threads,
                                   status, why if started is not None else f"{why}, before this layout ran",
                                   launch_seconds=run["seconds"], stderr=stderr)
        todo = [i for i in left if i not in results]
    return [results[i] for i in range(len(items))]


def run_layout(job: Job, device_type: str, work: Path, progress=None, profile: bool = False,
               steps: int | None = None) -> LayoutRun:
    """The job in its own layout (its dp_mode, fsdp_*, tp, sp, pp... keys), checked, timed, counted, on
    ``nnodes x nproc_per_node`` ranks (workers.launch.world_layout)."""
    return run_layouts(job, device_type, work, [{}], progress, profile, steps)[0]
