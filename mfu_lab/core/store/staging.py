"""Staged results: a step's new files written under names no reader opens, published later by renames.

Under ``mfu-lab run`` and ``mfu-lab step`` the runner's bracket (:mod:`mfu_lab.publish`) sets ``MFU_LAB_STAGE``
for the step, and the notebook's kernel (another process) inherits it:
:func:`mfu_lab.core.store.step_results.save` then writes ``<NN_step>/result.json.staged`` instead of ``result.json``,
and leaves the run-history line and the index to
the bracket, which publishes the whole set (result, report, the run's copy, the history line, the index) only
once every part of it is written. A failure before that (a full disk while the report is exported) leaves the
previous set whole. A step run from plain Python with no bracket (a notebook in JupyterLab) saves directly.

Every reader opens ``result.json`` by its exact name, so a staged file (``*.staged``) is never read as a result;
one left by a killed run is removed when the step next runs.

The renames that publish the set are journalled: ``<NN_step>/publishing.json`` (the run, the step, the history's
length before its line) is written once every staged file is complete, before the history line and the renames,
and removed after the last rename. A process killed in between (``kill -9``, a lost node) leaves the journal;
:func:`settle` (the next run, ``mfu-lab step`` or ``mfu-lab report``, holding the job's lock) completes the renames
and the history line (rolled forward), or, where a killed run left staged files but no journal (nothing renamed
yet), removes them (rolled back), and says which.
"""

from __future__ import annotations

import os
from pathlib import Path

from mfu_lab.core.registry import STEPS
from mfu_lab.core.store.files import RESULT_FILE, DamagedFile, read_json, refuse_links, write_json_atomic
from mfu_lab.core.store.history import _RUN_ID, HISTORY_FILE, RUNS_DIR, append_history, history_line
from mfu_lab.core.store.runstate import RUNNING_FILE

STAGE_ENV = "MFU_LAB_STAGE"
STAGED = ".staged"  # suffix of a file written, not yet published
KEPT = ".kept"  # suffix of the previous file, hard-linked aside while a publication can still be undone
JOURNAL = "publishing.json"  # in a step folder while its set is renamed into place
REPORT_FILE = "report.html"


def staging() -> bool:
    """Whether this process (or the runner that started its kernel) publishes the step's files itself."""
    return os.environ.get(STAGE_ENV) == "1"


def staged(path: Path) -> Path:
    """The staged name of ``path``: ``result.json`` -> ``result.json.staged``."""
    path = Path(path)
    return path.with_name(path.name + STAGED)


def remove_leftovers(*folders: Path) -> list[Path]:
    """Remove the staged and kept files a killed run left in ``folders``; those removed."""
    gone = []
    for folder in folders:
        for suffix in (STAGED, KEPT):
            for p in Path(folder).glob(f"*{suffix}"):
                if p.is_file() or p.is_symlink():
                    p.unlink(missing_ok=True)
                    gone.append(p)
    return gone


def published_files(job_root: Path, folder: str, run_id: str) -> list[Path]:
    """The files a publication of step ``folder`` by run ``run_id`` may put in place, in the order of the renames:
    the run's copy, the report, the result (last: readers go by it)."""
    step = Path(job_root) / folder
    return [Path(job_root) / RUNS_DIR / run_id / folder / RESULT_FILE, step / REPORT_FILE, step / RESULT_FILE]


def write_journal(folder: Path, run_id: str, step: str, history_at: int | None) -> Path:
    """The journal of a publication about to rename its staged files into place (``history_at``: the history's
    length before the line it appends; None when it appends none)."""
    return write_json_atomic(Path(folder) / JOURNAL, {"run": run_id, "step": step, "history_at": history_at})


def history_length(job_root: Path) -> int:
    """The job's history's length in bytes (0 before its first line)."""
    path = Path(job_root) / HISTORY_FILE
    return path.stat().st_size if path.is_file() else 0


def _roll_forward(job_root: Path, info, journal: dict) -> str:
    """Complete the journalled publication of ``info``'s step: the staged files renamed into place, the history
    line appended unless it is there; the previous files set aside and the killed run's running mark removed."""
    run, at, folder = journal["run"], journal["history_at"], Path(job_root) / info.folder
    placed = []
    for final in published_files(job_root, info.folder, run):
        refuse_links(final)
        if staged(final).is_file():
            os.replace(staged(final), final)
            placed.append(str(final.relative_to(job_root)))
    line = ""
    if at is not None and (folder / RESULT_FILE).is_file():
        line = history_line(run, info.folder, info.key, read_json(folder / RESULT_FILE))
        history = Path(job_root) / HISTORY_FILE
        if line.encode("utf-8") not in (history.read_bytes()[at:] if history.is_file() else b""):
            append_history(job_root, line)
        else:
            line = ""
    for where in (folder, Path(job_root) / RUNS_DIR / run / info.folder):
        for kept in where.glob(f"*{KEPT}"):
            kept.unlink(missing_ok=True)
    try:
        mark = read_json(folder / RUNNING_FILE)
    except (OSError, DamagedFile):
        mark = {}
    if mark.get("run") == run:
        (folder / RUNNING_FILE).unlink(missing_ok=True)
    (folder / JOURNAL).unlink()
    done = ", ".join(placed + (["its history line"] if line else [])) or "nothing was left to do"
    return (f"{info.folder}: the publication of run {run} was cut short (the process was killed while putting its "
            f"files in place); rolled forward: completed ({done}), so its result.json, report.html, history line "
            f"and run's copy are all run {run}'s")


def _journal(path: Path) -> dict | None:
    """A journal as written by :func:`write_journal`, None when it is not one (a workbook's file is data: its run
    must be a run id and its history offset a whole number, or nothing is renamed by it)."""
    try:
        j = read_json(path)
    except (OSError, DamagedFile):
        return None
    at = j.get("history_at")
    ok = _RUN_ID.fullmatch(str(j.get("run", ""))) and (at is None or (type(at) is int and at >= 0))
    return j if ok else None


def settle(job_root: Path) -> list[str]:
    """Finish what a killed publication left, in every step folder of the job (the caller holds the job's lock,
    so none is under way): a journal rolled forward, staged files without one rolled back; what was done, in
    words (empty when nothing was left)."""
    notes = []
    for info in STEPS:
        folder = Path(job_root) / info.folder
        journal = folder / JOURNAL
        if journal.is_file():
            j = _journal(journal)
            if j is not None and j.get("step") == info.key:
                notes.append(_roll_forward(job_root, info, j))
                continue
            notes.append(f"{journal} is not a journal mfu-lab wrote (damaged or edited): nothing was renamed by "
                         f"it; delete it and rerun step {info.number} ({info.key})")
            continue
        copies = [p for p in Path(job_root).glob(f"{RUNS_DIR}/*/{info.folder}")
                  if not (p.is_symlink() or p.parent.is_symlink())]  # never through a link planted in runs/
        gone = remove_leftovers(folder) + remove_leftovers(*copies)
        cut = sorted({p.name for p in gone if p.name.endswith(STAGED)})  # a .kept alone: the set was in place
        if cut:
            notes.append(f"{info.folder}: a publication was cut short before any file was put in place; rolled "
                         f"back: its staged files removed ({', '.join(cut)}), the previous result.json, "
                         "report.html and history line stand")
    return notes
