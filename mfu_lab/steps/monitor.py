"""Step 0, the production monitor: what does this job do in production, over days?

The user's own training loop records itself with :class:`mfu_lab.monitor.Monitor` (one JSON-lines file per
rank). :func:`run` reads a monitor folder of any size (:mod:`mfu_lab.analysis.monitor.summary`) and writes
``summary.json`` beside the records (or into ``out``): the shares of the step (compute, communication, data,
host), the stragglers, the operations loss measured where it happens, and which tuning step to start with.
``mfu-lab monitor report DIR`` runs the ``00_monitor`` notebook over it and exports ``report.html`` too.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mfu_lab.analysis.monitor.summary import MonitorSummary, summarise
from mfu_lab.core.advice import Advice
from mfu_lab.core.errors import JobError, JobProblem
from mfu_lab.core.registry import BY_KEY
from mfu_lab.core.store.files import read_json, write_json_atomic
from mfu_lab.core.store.monitor_files import rank_files

SUMMARY_FILE = "summary.json"


def check_folder(monitor_dir: str | Path, what: str = "monitor_dir") -> Path:
    """The monitor folder, or a JobError naming it and saying what a monitor folder holds."""
    if not str(monitor_dir).strip():
        raise JobError("monitor", [JobProblem(what, "", "is empty: name the folder mfu_lab.monitor.Monitor wrote in "
                                              "the training job (mfu-lab monitor report DIR)")])
    folder = Path(monitor_dir).expanduser()
    if not folder.is_dir():
        raise JobError("monitor", [JobProblem(what, str(folder), "no such folder")])
    if not rank_files(folder):
        raise JobError("monitor", [JobProblem(what, str(folder), "holds no monitor records (<host>-rank<k>.jsonl "
                                              "files, written by mfu_lab.monitor.Monitor in the training job)")])
    return folder


def run(monitor_dir: str | Path, out: str | Path | None = None, write: bool = True, progress=None,
        run: str | None = None) -> MonitorSummary:
    """Summarise one run of a monitor folder (``run``, as the report names it; default: the latest by start
    time); write ``summary.json`` into ``out`` (default: the monitor folder). A large folder reports how far the
    read got through ``progress`` (None prints)."""
    folder = check_folder(monitor_dir)
    try:
        summary = summarise(folder, progress if progress is not None else print, run=run or None)
    except ValueError as e:
        raise JobError("monitor", [JobProblem("run", run, str(e))]) from None
    if write:
        write_json_atomic(Path(out or folder) / SUMMARY_FILE, summary)
    return summary


def load(folder: str | Path) -> dict[str, Any] | None:
    """A monitor folder's ``summary.json``, None when there is none."""
    p = Path(folder) / SUMMARY_FILE
    return read_json(p) if p.is_file() else None


def advise(s: MonitorSummary) -> list[Advice]:
    out = []
    if s.start_with:
        info = BY_KEY[s.start_with]
        out.append(Advice("act", f"Start with step {info.number}: {info.title}", s.verdict))
    for st in s.stragglers:
        out.append(Advice("act", f"Rank {st['rank']} on {st['node']} was the slowest in {st['slowest_share']:.0%} "
                          "of the intervals: check that node's health (mfu-lab gate), its data shard and its "
                          "neighbours before tuning anything else.",
                          f"the other ranks lost {st['others_lost_s']:.1f} rank-seconds waiting for it "
                          f"({st['others_lost_share']:.1%} of all ranks' time); its work per step was "
                          f"{(st['excess'] or 0):.0%} above the median rank's"))
    restarts = s.operations_loss["parts"]["restarts_and_gaps"]
    if restarts.get("value"):
        out.append(Advice("look", "Restarts cost wall-clock time: checkpoint more often, or find why the job "
                          "restarted (the end reasons below).", restarts["note"]))
    if s.read["skipped_lines"]:
        out.append(Advice("look", "Some record lines were unreadable and skipped.", "; ".join(s.notes[:1])))
    if s.read.get("skipped_records"):
        out.append(Advice("look", f"{s.read['skipped_records']} record(s) with a wrong type, a value that is not "
                          "finite or a negative duration were skipped: was a file edited, or written by another "
                          "program?", next((n for n in s.notes if "wrong type" in n), "")))
    if s.read.get("other_runs"):
        out.append(Advice("look", f"This folder holds {len(s.read['other_runs'])} other run(s); this report reads "
                          f"run {s.read.get('run') or '(no run id)'} only. Give each job a folder of its own, or "
                          "summarise another one with run=...", next((n for n in s.notes if "other run" in n), "")))
    clock = s.read.get("clock") or {}
    if clock.get("not_corrected") or clock.get("not_compared"):
        out.append(Advice("look", "Some rank clocks could not be aligned: straggler figures may miss them. Check "
                          "the nodes' time synchronisation (chrony, NTP).",
                          next((n for n in s.notes if "clock" in n), "")))
    return out
