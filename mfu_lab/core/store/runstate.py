"""What state each step of a job is in, so that a long run can be resumed and nothing is lost.

A step folder holds at most one of these markers next to its ``result.json``:

- ``running.json`` while the step runs (written before it starts, removed when it ends). Found with no
  process behind it, it means the step was interrupted by a killed process or a lost node.
- ``failure.json`` when the step ended without a result: ``status`` is ``failed`` (an exception),
  ``interrupted`` (Ctrl-C) or ``timeout`` (a notebook cell ran past ``--execution-timeout``).

``result.json`` is only ever replaced whole (written to a temporary file, then renamed), so an interrupted
step leaves the previous result, never half of a new one.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import fcntl
import json
import os
import platform
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mfu_lab.core import __version__
from mfu_lab.core.errors import MfuLabError
from mfu_lab.core.store.files import (
    RESULT_FILE,
    DamagedFile,
    mark_job_root,
    open_nofollow,
    read_json,
    refuse_links_below,
    write_json_atomic,
)
from mfu_lab.core.store.history import LOCK_FILE, job_changes, job_digest
from mfu_lab.core.store.results import git_commit, source_digest

RUNNING_FILE = "running.json"
FAILURE_FILE = "failure.json"


def _now() -> str:
    return _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds")


def mark_running(folder: Path, step: str, run_id: str) -> None:
    write_json_atomic(folder / RUNNING_FILE, {"step": step, "run": run_id, "pid": os.getpid(),
                                              "host": platform.node(), "started_at": _now()})


def clear_running(folder: Path) -> None:
    (folder / RUNNING_FILE).unlink(missing_ok=True)


def mark_failed(folder: Path, step: str, status: str, error: str, **extra: Any) -> None:
    """Record why a step has no new result: ``status`` is failed | interrupted | timeout."""
    write_json_atomic(folder / FAILURE_FILE, {"step": step, "status": status, "error": error,
                                              "at": _now(), **extra})
    clear_running(folder)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # pragma: no cover - someone else's process
        return True
    return True


@dataclass
class StepState:
    status: str  # ok | failed | interrupted | timeout | running | damaged | not run
    detail: str = ""
    result: dict | None = None


def step_state(folder: Path, result: dict | None = None) -> StepState:
    """The state of one step folder, from its markers and result (``result``: already read by the caller)."""
    folder = Path(folder)
    damaged = ""
    if result is None and (folder / RESULT_FILE).is_file():
        try:
            result = read_json(folder / RESULT_FILE)
        except DamagedFile as e:
            damaged = str(e)
    running = folder / RUNNING_FILE
    if running.is_file():
        try:
            r = read_json(running)
        except ValueError:
            r = {}
        same_host = r.get("host") == platform.node()
        if same_host and isinstance(r.get("pid"), int) and _alive(r["pid"]):
            return StepState("running", f"since {r.get('started_at')} (pid {r.get('pid')})", result)
        where = "" if same_host else f" on {r.get('host')}"
        return StepState("interrupted", f"started {r.get('started_at')}{where} and never finished: the process "
                         "was killed or the node lost" + ("; the previous result is kept" if result else ""), result)
    if (folder / FAILURE_FILE).is_file():
        try:
            f = read_json(folder / FAILURE_FILE)
        except DamagedFile as e:
            f = {"status": "failed", "error": f"the step failed, and its failure record is damaged ({e.why})"}
        kept = "; the previous result is kept" if result else ""
        return StepState(str(f.get("status", "failed")), str(f.get("error", "")) + kept, result)
    if damaged:
        return StepState("damaged", damaged)
    if result:
        return StepState("ok", "", result)
    return StepState("not run")


class JobBusy(MfuLabError):
    """Another run holds the job's output folder."""


@contextlib.contextmanager
def job_lock(job_root: Path, run_id: str, wait: bool = False):
    """Hold the job's output folder for the length of a run (an exclusive ``flock`` on ``<job>/.lock``); yields
    ``holder(run_id)``, which rewrites the run named in the lock once it is known.

    Two runs of one job at once would overwrite each other's results and spoil each other's measurements on a
    shared device: a second run is refused, naming the run and pid that hold the folder, or waits (``wait``).
    The lock goes with the process: a killed run leaves no stale lock behind.
    """
    job_root = mark_job_root(job_root)
    # never through a link (holder() truncates the file): a link planted at .lock is refused, naming it
    f = os.fdopen(open_nofollow(job_root / LOCK_FILE, os.O_RDWR | os.O_CREAT), "r+", encoding="utf-8")
    try:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            f.seek(0)
            try:
                holder = json.loads(f.read() or "{}")
            except ValueError:
                holder = {}
            who = (f"run {holder.get('run', '?')} (pid {holder.get('pid', '?')} on {holder.get('host', '?')}, "
                   f"since {holder.get('since', '?')})")
            if not wait:
                raise JobBusy(f"{job_root} is in use by {who}: two runs of one job at once would overwrite each "
                              "other's results and spoil each other's measurements. Wait for it to finish, stop "
                              "it, or add --wait to start when it ends.") from None
            print(f"mfu-lab: {job_root} is in use by {who}; waiting for it to finish (--wait)", flush=True)
            fcntl.flock(f, fcntl.LOCK_EX)
        since = _now()
        refuse_links_below(job_root, depth=1)  # a step folder, runs/, history.jsonl... made a link: refused, named

        def holder(rid: str) -> None:
            f.seek(0)
            f.truncate()
            f.write(json.dumps({"run": rid, "pid": os.getpid(), "host": platform.node(), "since": since}))
            f.flush()

        holder(run_id)
        yield holder
    finally:
        f.close()  # releases the lock


def workbook_version() -> dict[str, str]:
    """The workbook's identity: its version, its commit, and a digest of its source (so that an edited checkout,
    whose commit is the same, is a different workbook)."""
    return {"mfu_lab": __version__, "git_commit": git_commit().removesuffix("+dirty"), "source_digest": source_digest()}


def resumable(folder: Path, job_dict: dict[str, Any]) -> tuple[bool, str]:
    """(True, why) when the step's result can be kept: it finished, for the same job parameters, with the same
    workbook version (package version and git commit); else (False, why it must run again)."""
    st = step_state(folder)
    if st.status == "damaged":
        return False, st.detail
    if st.status != "ok" or st.result is None:
        return False, {"not run": "no result yet"}.get(st.status, f"last attempt {st.status}: {st.detail}")
    r = st.result
    old, new = r.get("job", {}), job_dict
    if job_digest(old) != job_digest(new):
        return False, "job parameters changed: " + ", ".join(job_changes(old, new))
    env, now = r.get("environment", {}), workbook_version()
    if env.get("mfu_lab") != now["mfu_lab"]:
        return False, f"workbook version changed: {env.get('mfu_lab')} -> {now['mfu_lab']}"
    was = str(env.get("git_commit", "")).removesuffix("+dirty")
    if was != now["git_commit"]:
        return False, f"workbook commit changed: {was[:12]} -> {now['git_commit'][:12]}"
    if env.get("source_digest") != now["source_digest"]:
        return False, ("workbook source changed since it ran (edited files, same commit): source digest "
                       f"{env.get('source_digest') or 'not recorded'} -> {now['source_digest']}")
    return True, f"kept: finished {env.get('created_at')} with the same parameters and workbook"
