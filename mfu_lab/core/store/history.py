"""Run history: every step result a job ever produced, kept; two runs compared metric by metric.

Each time a step saves its result, besides ``<job>/<NN_step>/result.json`` (the latest, which the
reports read), the same file is copied to ``<job>/runs/<run_id>/<NN_step>/result.json`` and one line is
appended to ``<job>/history.jsonl``: the run, the step, when, the workbook commit, a digest of the job's
parameters and every metric with its unit and label. Nothing in ``runs/`` or the history is ever
rewritten, so a rerun never overwrites what an earlier run measured.

A run is one ``mfu-lab run`` (every step it executes shares the id, passed to the notebooks' kernels in
``MFU_LAB_RUN_ID``); a step run on its own (a notebook in JupyterLab, ``mfu-lab step``) is a run of its own. The
variable names the run only while that run holds the job's folder: an id left in it (or set by hand) that names a
run which has ended is an earlier run's, and a save takes a new id rather than join it.
"""

from __future__ import annotations

import datetime as _dt
import fcntl
import hashlib
import json
import os
import platform
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mfu_lab.core.errors import JobError, JobProblem, short_repr
from mfu_lab.core.registry import BY_KEY, STEPS
from mfu_lab.core.store.files import RESULT_FILE, load_results, open_nofollow, refuse_links, write_atomic

HISTORY_FILE = "history.jsonl"
RUNS_DIR = "runs"
RUN_ENV = "MFU_LAB_RUN_ID"
LOCK_FILE = ".lock"  # the job's lock (core.store.runstate.job_lock): the run holding the folder names itself in it
_RUN_ID = re.compile(r"\d{8}-\d{6}(-\d+)?")


def new_run_id(now: _dt.datetime | None = None, job_root: Path | None = None) -> str:
    """A run id that sorts by time: ``YYYYMMDD-HHMMSS`` (UTC). Given the job's folder, the id is reserved there
    (``runs/<id>/`` made with an exclusive mkdir), with ``-2``, ``-3``... when another run took it in the same
    second, so two runs never share an id."""
    base = (now or _dt.datetime.now(_dt.UTC)).strftime("%Y%m%d-%H%M%S")
    if job_root is None:
        return base
    runs_dir = Path(job_root) / RUNS_DIR
    refuse_links(runs_dir, include_self=True)  # runs/ made a link would take every run's copies elsewhere
    runs_dir.mkdir(parents=True, exist_ok=True)
    for n in range(1, 10_000):
        rid = base if n == 1 else f"{base}-{n}"
        try:
            (runs_dir / rid).mkdir()
            return rid
        except FileExistsError:
            continue
    raise RuntimeError(f"no free run id under {runs_dir} for {base}")  # pragma: no cover - 10,000 in a second


def resumed_run_id(job_root: Path, job_dict: dict[str, Any], workbook: dict[str, str] | None = None) -> str | None:
    """The run a ``--resume`` goes on with, so that it keeps its id (``compare previous latest`` and ``history``
    then see one run): the job's latest run, when it was made with the same parameters (and, given ``workbook``,
    the same workbook identity). Otherwise None, and the resumed run is a new one: a run of other parameters or
    other code came in between, and its record must not be overwritten."""
    lines = load_history(job_root)
    if not lines:
        return None
    last = lines[-1]
    same = last.get("job_digest") == job_digest(job_dict) and _RUN_ID.fullmatch(str(last.get("run", "")))
    if same and workbook is not None:
        same = all(last.get(k) == v for k, v in workbook.items() if k in last)
    return last["run"] if same else None


def run_id_from_env(job_root: Path | None = None) -> str | None:
    """``MFU_LAB_RUN_ID`` when a ``mfu-lab run`` set it to a well-formed id (anything else could name a path).
    Given the job's folder, only while that run holds it (:func:`run_holds_job`): the id of a run that has ended
    is an earlier run's, whose ``runs/`` copy and history line are never rewritten."""
    rid = os.environ.get(RUN_ENV, "")
    if not _RUN_ID.fullmatch(rid):
        return None
    return rid if job_root is None or run_holds_job(job_root, rid) else None


def run_holds_job(job_root: Path, rid: str) -> bool:
    """Whether run ``rid`` holds the job's folder now: another process on this host holds the job's lock
    (:func:`mfu_lab.core.store.runstate.job_lock`, an exclusive ``flock``) and names ``rid`` in it. The lock is
    tried for a moment, shared, only when the file names ``rid``: a taken try means no run holds the folder."""
    try:
        fd = open_nofollow(Path(job_root) / LOCK_FILE, os.O_RDONLY)
    except OSError:
        return False
    with os.fdopen(fd, "rb") as f:
        try:
            holder = json.loads(f.read(4096) or b"{}")
        except ValueError:
            return False
        if not (isinstance(holder, dict) and holder.get("run") == rid and holder.get("host") == platform.node()
                and holder.get("pid") != os.getpid()):
            return False
        try:
            fcntl.flock(f, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(f, fcntl.LOCK_UN)
        return False


def current_run_id(job_root: Path | None = None) -> str:
    """The run this process belongs to: ``MFU_LAB_RUN_ID`` when a ``mfu-lab run`` set it (given the job's folder:
    when that run holds the folder now), else a new id, reserved in the job's folder when given. A variable that
    names no run of the job in progress is said on stderr, and not used."""
    rid = run_id_from_env(job_root)
    if rid:
        return rid
    new = new_run_id(job_root=job_root)
    given = os.environ.get(RUN_ENV, "")
    if given and job_root is not None:
        what = ("is not a run of {root} in progress (that run has ended, or never held this job's folder): its kept "
                "results and history stay as they were" if _RUN_ID.fullmatch(given) else
                "is not a run id (YYYYMMDD-HHMMSS, as mfu-lab run sets it)").format(root=job_root)
        shown = given if _RUN_ID.fullmatch(given) else short_repr(given, 40)
        print(f"mfu-lab: warning: {RUN_ENV}={shown} {what}; these results are kept as a new run {new}",
              file=sys.stderr, flush=True)
    return new


def job_digest(job_dict: dict[str, Any]) -> str:
    """12 hex digits identifying a job's parameters (output folder left out: moving results is no change)."""
    d = {k: v for k, v in job_dict.items() if k != "out_dir"}
    return hashlib.sha256(json.dumps(d, sort_keys=True, default=str).encode()).hexdigest()[:12]


def job_changes(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """'key old -> new' for every job parameter that differs (the output folder left out, as in the digest)."""
    keys = sorted(k for k in set(old) | set(new) if k != "out_dir" and old.get(k) != new.get(k))
    return [f"{k} {old.get(k)!r} -> {new.get(k)!r}" for k in keys]


def record(job_root: Path, folder: str, step: str, result: dict[str, Any], run_id: str | None = None) -> str:
    """Keep a copy of a just-saved step result under ``runs/<run_id>/`` and append its line to the history."""
    job_root = Path(job_root)
    rid = run_id or current_run_id(job_root)
    src = job_root / folder / RESULT_FILE
    write_atomic(job_root / RUNS_DIR / rid / folder / RESULT_FILE, src.read_bytes())
    append_history(job_root, history_line(rid, folder, step, result))
    return rid


def history_line(rid: str, folder: str, step: str, result: dict[str, Any]) -> str:
    """The history's line (with its newline) for one step result of run ``rid``."""
    env = result.get("environment", {})
    line = {"run": rid, "step": step, "folder": folder, "saved_at": env.get("created_at"),
            "git_commit": env.get("git_commit"), "source_digest": env.get("source_digest"),
            "device": env.get("device_name"), "overrides": env.get("overrides") or {},  # the command line's -p
            "job_digest": job_digest(result.get("job", {})), "status": result.get("status", "ok"),
            "elapsed_s": result.get("elapsed_s"),
            "metrics": {k: {"value": m.get("value"), "unit": m.get("unit"), "source": m.get("source")}
                        for k, m in result.get("metrics", {}).items()}}
    return json.dumps(line, allow_nan=False) + "\n"


def append_history(job_root: Path, text: str) -> int:
    """Append ``text`` (one line) to the job's history; the file's length before it, which
    :func:`truncate_history` takes back to. One write() on a file opened for appending: lines from concurrent
    steps never interleave. Never through a link planted in the job's folder (open_nofollow refuses it, naming
    it). A write that fails (a full disk) is taken back, so that no torn line is left for the next to join."""
    fd = open_nofollow(Path(job_root) / HISTORY_FILE, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    try:
        before = os.fstat(fd).st_size
        try:
            os.write(fd, text.encode("utf-8"))
            os.fsync(fd)
        except BaseException:
            os.ftruncate(fd, before)
            raise
    finally:
        os.close(fd)
    return before


def truncate_history(job_root: Path, length: int) -> None:
    """Take the job's history back to ``length`` bytes (a line appended by a publication that was undone)."""
    fd = open_nofollow(Path(job_root) / HISTORY_FILE, os.O_WRONLY)
    try:
        os.ftruncate(fd, length)
        os.fsync(fd)
    finally:
        os.close(fd)


def load_history(job_root: Path) -> list[dict[str, Any]]:
    """Every line of the job's history, oldest first. A line that is not a history line (a torn write, another
    encoding, fields of the wrong type) is skipped: the others do not depend on it."""
    path = Path(job_root) / HISTORY_FILE
    if not path.is_file():
        return []
    out = []
    for raw in path.read_bytes().splitlines():
        try:
            d = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError):
            continue
        if _is_history_line(d):
            out.append(d)
    return out


def _is_history_line(d: Any) -> bool:
    if not (isinstance(d, dict) and isinstance(d.get("run"), str) and isinstance(d.get("step"), str)):
        return False
    metrics = d.get("metrics", {})
    return isinstance(metrics, dict) and all(
        isinstance(m, dict) and (m.get("value") is None or isinstance(m.get("value"), (int, float)))
        for m in metrics.values())


def runs(job_root: Path) -> dict[str, dict[str, dict[str, Any]]]:
    """run id -> step key -> its history line (the last, if a step was saved twice in one run), in time order."""
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for d in load_history(job_root):
        out.setdefault(d["run"], {})[d["step"]] = d
    return dict(sorted(out.items()))


@dataclass
class Run:
    """One run's step results, read back from disk: where they are and what each step measured."""

    label: str
    where: Path
    results: dict[str, dict[str, Any]]  # step key -> result.json




def resolve_run(spec: str, job_root: Path | None) -> Run:
    """A run named on the command line: a folder holding step folders (a job's output folder, or one of its
    ``runs/<id>``), or, inside ``job_root``, a run id, a unique prefix of one, ``latest`` or ``previous``."""
    path = Path(spec)
    if path.is_dir():
        results = load_results(path)
        if not results:
            raise JobError("command line (compare)", [JobProblem("RUN", spec, "this folder holds no step "
                                                                 "result (NN_step/result.json)")])
        return Run(str(path), path, results)
    if job_root is None or not (Path(job_root) / RUNS_DIR).is_dir():
        raise JobError("command line (compare)", [JobProblem(
            "RUN", spec, f"is neither a folder nor a run of {job_root or 'a job'} (no {RUNS_DIR}/ folder there; "
            "give --job-dir outputs/<job_name>)")])
    ids = sorted(p.name for p in (Path(job_root) / RUNS_DIR).iterdir()  # runs that kept a result
                 if p.is_dir() and any(p.glob(f"*/{RESULT_FILE}")))
    if spec in ("latest", "previous"):
        need = 1 if spec == "latest" else 2
        if len(ids) < need:
            again = ("run a step again (e.g. mfu-lab run --steps baseline) so there are two runs to compare"
                     if ids else "run a step first (e.g. mfu-lab run --steps baseline)")
            raise JobError("command line (compare)", [JobProblem(
                "RUN", spec, f"{job_root} has {len(ids)} run{'' if len(ids) == 1 else 's'} kept: {again}")])
        rid = ids[-need]
    else:
        match = [i for i in ids if i.startswith(spec)]
        if len(match) != 1:
            what = "no run starts with it" if not match else f"{len(match)} runs start with it: {', '.join(match)}"
            raise JobError("command line (compare)", [JobProblem(
                "RUN", spec, f"{what}; runs of {job_root}: {', '.join(ids) or 'none'}, or latest / previous")])
        rid = match[0]
    folder = Path(job_root) / RUNS_DIR / rid
    return Run(rid, folder, load_results(folder))


# ------------------------------------------------------------------ comparing two runs
HIGHER_IS_BETTER = ("mfu", "hfu", "tokens_per_s", "speedup", "busbw", "achieved_flops", "fp8_flops_share")
LOWER_IS_BETTER = ("step_time", "step_median", "step_s", "exposed_comm", "structure_loss", "slowdown",
                   "data_wait", "host_fraction", "compile_cold", "compile_warm", "break_even", "check_error")
EXACT_SOURCES = ("counted", "analytic", "datasheet")
EXACT_TOL = 1e-6


def direction(name: str) -> int:
    """+1 when a higher value is better, -1 when lower is, 0 when the metric has no better side."""
    n = name.lower()
    if any(k in n for k in LOWER_IS_BETTER):
        return -1
    if any(k in n for k in HIGHER_IS_BETTER):
        return 1
    return 0


def step_noise(result: dict[str, Any]) -> float | None:
    """Half the step's p10-p90 spread relative to its median step time, when the step reports one."""
    m = result.get("metrics", {})
    med = (m.get("step_time_median_s") or {}).get("value")
    p10, p90 = (m.get("step_time_p10_s") or {}).get("value"), (m.get("step_time_p90_s") or {}).get("value")
    if med and p10 is not None and p90 is not None:
        return (p90 - p10) / 2 / med
    return None


@dataclass
class Change:
    step: str
    metric: str
    unit: str
    source_a: str | None
    source_b: str | None
    a: float | None
    b: float | None
    rel: float | None  # (b - a) / |a|
    tolerance: float
    verdict: str  # same | better | worse | higher | lower | only in A | only in B | no value


def compare(a: Run, b: Run, tolerance: float = 0.03) -> tuple[list[Change], list[str]]:
    """Metric by metric, what changed from run A to run B, and notes (parameters or device that differ).

    Rule: a change counts only beyond the noise. For figures labelled counted, analytic or datasheet the
    noise is 1e-6 (they are deterministic); for measured, modelled and emulated figures it is the larger of
    ``tolerance`` and half of either run's p10-p90 step-time spread relative to its median (when the step
    reports one).
    """
    if not 0 <= tolerance < 10:
        raise JobError("command line (compare)", [JobProblem("--tolerance", tolerance, "must be a relative "
                                                             "tolerance between 0 and 10, e.g. 0.03 for 3%")])
    changes, notes = [], []
    for info in STEPS:
        ra, rb = a.results.get(info.key), b.results.get(info.key)
        if ra is None and rb is None:
            continue
        if ra is None or rb is None:
            notes.append(f"{info.folder}: only in {'B' if ra is None else 'A'}")
            continue
        diff = job_changes(ra.get("job", {}), rb.get("job", {}))
        if diff:
            notes.append(f"{info.folder}: job parameters differ: " + ", ".join(diff))
        da, db = ra.get("environment", {}).get("device_name"), rb.get("environment", {}).get("device_name")
        if da != db:
            notes.append(f"{info.folder}: device differs: {da} -> {db}")
        noise = max([tolerance] + [x for x in (step_noise(ra), step_noise(rb)) if x is not None])
        ma, mb = ra.get("metrics", {}), rb.get("metrics", {})
        for name in list(ma) + [k for k in mb if k not in ma]:
            x, y = ma.get(name), mb.get(name)
            unit = (x or y)["unit"]
            va, vb = (x or {}).get("value"), (y or {}).get("value")
            sa, sb = (x or {}).get("source"), (y or {}).get("source")
            exact = sa in EXACT_SOURCES and sb in EXACT_SOURCES
            tol = EXACT_TOL if exact else noise
            rel = None
            if x is None or y is None:
                verdict = "only in B" if x is None else "only in A"
            elif va is None or vb is None:
                verdict = "same" if va is None and vb is None else "no value"
            else:
                rel = (vb - va) / abs(va) if va else (0.0 if vb == va else float("inf"))
                if abs(rel) <= tol:
                    verdict = "same"
                else:
                    d = direction(name)
                    verdict = ("better" if d * rel > 0 else "worse") if d else ("higher" if rel > 0 else "lower")
            changes.append(Change(info.key, name, unit, sa, sb, va, vb, rel if rel != float("inf") else None,
                                  tol, verdict))
    return changes, notes


def mfu_trend(job_root: Path, table: dict[str, dict[str, dict[str, Any]]] | None = None
              ) -> list[tuple[str, dict[str, float]]]:
    """Per run (oldest first): step folder -> the MFU it measured, for the steps that report one.
    ``table`` is :func:`runs`' answer when the caller already has it."""
    out = []
    for rid, steps in (runs(job_root) if table is None else table).items():
        pts = {BY_KEY[k].folder: d["metrics"]["mfu"]["value"] for k, d in steps.items()
               if k in BY_KEY and (d.get("metrics", {}).get("mfu") or {}).get("value") is not None}
        if pts:
            out.append((rid, pts))
    return out
