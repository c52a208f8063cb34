"""The bracket around one step's run, and the publication of the step's new files as one set.

Every step, whether its notebook runs under papermill (``mfu-lab run``) or its code runs in plain Python
(``mfu-lab step``), goes through :func:`step_bracket`. The step folder says ``running`` while it runs, and the
step's save is staged (:mod:`mfu_lab.core.store.staging`: ``result.json.staged``, written by the notebook's kernel, a
process of its own). Then either the whole new set is published -- ``result.json``, ``report.html``, the run's
copy under ``runs/<id>/``, the history line, the index -- or none of it is, and ``failure.json`` (failed /
interrupted / timeout) says why, the previous set kept whole.

The publication (:class:`Publication`): everything that takes room on the disk is written first, under staged
names (the result by the step, the report by the export, the run's copy); then the history line is appended (taken
back when its write fails); then renames put the files in place, each previous one hard-linked aside first; then
the index is rewritten. When the disk cannot take the index, the publication is undone: the previous files renamed
back, the history line taken back (a fault in the page's own code leaves the set published, and says so). Whatever
fails, the running mark is cleared and the index rewritten, or removed when even that cannot be (a page saying
"running" for a process that has ended would be false), and the message says what was kept. The renames are
journalled: a process killed among them (``kill -9``) leaves the set for the next run, ``mfu-lab step`` or
``mfu-lab report`` to complete (:func:`settle_publications`); killed before them, its staged files are removed and
the step says "interrupted".
"""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mfu_lab.core.errors import StepExecutionError
from mfu_lab.core.job.schema import Job
from mfu_lab.core.process import procs, quick_imports
from mfu_lab.core.process.faults import format_memory, memory_figures, oom_advice
from mfu_lab.core.store.files import RESULT_FILE, PlantedLink, read_json, refuse_links, refuse_links_below, write_atomic
from mfu_lab.core.store.history import RUNS_DIR, append_history, history_line, truncate_history
from mfu_lab.core.store.nodes import this_node
from mfu_lab.core.store.runstate import FAILURE_FILE, clear_running, mark_failed, mark_running
from mfu_lab.core.store.staging import (
    JOURNAL,
    KEPT,
    REPORT_FILE,
    STAGE_ENV,
    history_length,
    remove_leftovers,
    settle,
    staged,
    write_journal,
)
from mfu_lab.report import export_html, write_index

INDEX_FILE = "index.html"


class NotPublished(StepExecutionError):
    """The step ran to its end, but its new files could not all be written: none of them was published."""


def filesystem_problem(e: OSError) -> str:
    """An operating-system error in words: the path, what went wrong, what to do."""
    if isinstance(e, PlantedLink):  # says what to do itself
        return f"{e.filename}: {e.strerror}"
    where = f"{e.filename}: " if e.filename else ""
    return (f"{where}{e.strerror or e} ({type(e).__name__}): check that the folder can be written (permissions, "
            "free space, a file standing where a folder should be), or choose another out_dir (--out DIR)")


def _short(e: BaseException) -> str:
    """An error in a few words, for a note beside the main one."""
    if isinstance(e, OSError) and e.strerror:
        return f"{e.strerror}" + (f": {e.filename}" if e.filename else "")
    return f"{type(e).__name__}: {e}"


def _timed_out_preview(message: str) -> str:
    """The first line of the cell nbclient's CellTimeoutError quotes ("Here is a preview of the cell contents")."""
    lines = message.splitlines()
    for i, line in enumerate(lines):
        if "preview of the cell contents" in line:
            body = [x for x in lines[i + 1:] if x.strip() and not set(x.strip()) <= {"-"}]
            return body[0].strip() if body else ""
    return ""


def _mark_timeout(notebook: Path, limit: float, preview: str) -> str:
    """Papermill marks every cell 'completed' after a cell timeout; tell the truth in the saved notebook: the cell
    that ran out of time is marked 'timeout', the ones after it 'not run', and a banner says so at the top."""
    quick_imports.notebook_libraries()
    import nbformat  # lazy: only a timed-out run needs it, and it costs about a second to import

    nb = nbformat.read(str(notebook), as_version=4)
    code = [(i, c) for i, c in enumerate(nb.cells) if c.cell_type == "code"]
    hit = next((i for i, c in code if preview and c.source.strip().startswith(preview)), None)
    if hit is None:  # no preview to match: the first cell with an error, else the first that never finished
        hit = next((i for i, c in code if any(o.get("output_type") == "error" for o in c.get("outputs", []))), None)
    if hit is None:
        hit = next((i for i, c in code if not c.metadata.get("papermill", {}).get("end_time")), None)
    where = "an unknown cell"
    if hit is not None:
        first = nb.cells[hit].source.strip().splitlines()
        where = f"cell {hit + 1} ({first[0][:80] if first else 'empty'})"
        for i, cell in enumerate(nb.cells):
            meta = cell.metadata.setdefault("papermill", {})
            if i == hit:
                meta["status"] = "timeout"
            elif i > hit:
                meta["status"] = "not run"
    banner = nbformat.v4.new_markdown_cell(
        f'<span style="color:red;font-family:monospace">Execution timed out after {limit:g} s at {where}. '
        "The cells after it did not run.</span>")
    banner.metadata["tags"] = ["mfu-lab-timeout-banner"]
    nb.cells.insert(0, banner)
    nbformat.write(nb, str(notebook))
    return where


def _failure(exc: BaseException, notebook: Path | None, limit: float | None, job: Job) -> tuple[str, str, str]:
    """``(status, ename, evalue)`` recorded for a step that raised ``exc``, in each path's own words: papermill
    reports the failing cell's error name and value; a plain-Python step its exception's type and message."""
    if isinstance(exc, KeyboardInterrupt):
        how = "SIGTERM" if isinstance(exc, procs.Terminated) else "Ctrl-C"
        return "interrupted", "Interrupted", f"stopped by {how}" + (" (KeyboardInterrupt)" if notebook else "")
    if notebook is None:
        return "failed", type(exc).__name__, str(exc)
    if type(exc).__name__ == "CellTimeoutError":
        where = _mark_timeout(notebook, limit, _timed_out_preview(str(exc))) if notebook.is_file() else "a cell"
        return "timeout", "Timeout", (f"a cell ran longer than --execution-timeout {limit:g} s: "
                                      f"{where}; the cells after it did not run")
    ename = getattr(exc, "ename", None) or type(exc).__name__
    evalue = getattr(exc, "evalue", None) or str(exc)
    if ename == "DeadKernelError" or "Kernel died" in evalue:
        try:  # host memory only: this is the parent, the kernel is gone
            host = {"host": {k: v for k, v in memory_figures(devices=False).get("host", {}).items()
                             if k != "process_peak_rss_gib"}}
            now = format_memory(host)
        except Exception as e:  # noqa: BLE001 - a failure report must not fail
            now = f"not readable ({type(e).__name__})"
        evalue += (" -- the notebook's kernel process died without an error of its own; the usual cause is the "
                   f"machine running out of memory (the kernel's OOM killer ends the largest process). Host memory "
                   f"now: {now}. Try: " + "; ".join(oom_advice(job) or ["a smaller job"]))
    return "failed", ename, evalue


def fresh_step_folder(job: Job, info) -> Path:
    """The step's folder, created, without the failure record of an earlier attempt nor the staged files of a
    killed one. The folder, or anything in it, made a symbolic link (which would carry the step's files out of
    the job's folder) is refused, named."""
    folder = job.step_dir(info.folder)
    refuse_links(folder, include_self=True)
    refuse_links_below(folder)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / FAILURE_FILE).unlink(missing_ok=True)
    remove_leftovers(folder)
    if job.nnodes > 1:  # this node's file of an earlier run must not stand in for this run's
        this_node(job.nnodes).file(folder).unlink(missing_ok=True)
    return folder


def _keep_aside(path: Path) -> Path | None:
    """The file at ``path`` hard-linked (else copied) to ``<path>.kept``, so that a rename over it can be undone;
    None when there is no file there."""
    if not path.is_file():
        return None
    kept = path.with_name(path.name + KEPT)
    kept.unlink(missing_ok=True)
    try:
        os.link(path, kept)
    except OSError:  # a filesystem without hard links: a copy (which may fail for room: then nothing is published)
        shutil.copy2(path, kept)
    return kept


@dataclass
class Publication:
    """One step's new files, staged, published together or not at all (the module's docstring says how)."""

    job_root: Path
    folder: Path
    info: Any
    run_id: str
    moves: list[tuple[Path, Path]] = field(default_factory=list)  # (staged, final), in the order of the renames
    kept: dict[Path, Path | None] = field(default_factory=dict)  # final -> its previous file aside (None: none)
    placed: list[Path] = field(default_factory=list)  # finals renamed into place
    line: str = ""
    history_at: int | None = None  # the history's length before this publication's line
    journal: Path | None = None  # the renames' journal, while they are under way (core.store.staging)

    def prepare(self, notebook: Path | None) -> None:
        """Write every new file under its staged name: the report (from the staged result) and the run's copy."""
        result = staged(self.folder / RESULT_FILE)
        new = result if result.is_file() else None
        if notebook is not None and notebook.is_file():
            report = staged(self.folder / REPORT_FILE)
            self.moves.append((report, self.folder / REPORT_FILE))
            export_html(notebook, report, new)
        if new is not None:
            data = read_json(new)
            copy = self.job_root / RUNS_DIR / self.run_id / self.info.folder / RESULT_FILE
            self.moves.insert(0, (staged(copy), copy))
            write_atomic(staged(copy), new.read_bytes())
            self.moves.append((new, self.folder / RESULT_FILE))  # the result last: readers go by it
            self.line = history_line(self.run_id, self.info.folder, self.info.key, data)

    def commit(self) -> None:
        """Put the staged files in place: the previous ones aside, the journal, the history line, the renames;
        then the running mark cleared and the journal removed. A process killed after the journal is written
        leaves it, and the next run (or report) completes the set (:func:`mfu_lab.core.store.staging.settle`)."""
        for _, final in self.moves:
            self.kept[final] = _keep_aside(final)
        if self.moves:
            self.journal = write_journal(self.folder, self.run_id, self.info.key,
                                         history_length(self.job_root) if self.line else None)
        if self.line:
            self.history_at = append_history(self.job_root, self.line)
        for new, final in self.moves:
            os.replace(new, final)
            self.placed.append(final)
        clear_running(self.folder)
        if self.journal is not None:
            self.journal.unlink()
            self.journal = None

    def finish(self) -> None:
        """The publication stands: the previous files set aside are let go."""
        for kept in self.kept.values():
            if kept is not None:
                kept.unlink(missing_ok=True)

    def undo(self) -> list[str]:
        """Take the publication back, as far as it went: the previous files renamed back, the history line taken
        back, the staged files removed. What could not be undone, in words (empty when all was)."""
        problems: list[str] = []

        def attempt(what: str, fn, *args) -> None:
            try:
                fn(*args)
            except OSError as e:
                problems.append(f"{what} ({_short(e)})")

        for final in reversed(self.placed):
            kept = self.kept.get(final)
            if kept is not None:
                attempt(f"the previous {final.name} could not be put back", os.replace, kept, final)
            else:
                attempt(f"the new {final.name} could not be removed", final.unlink, True)
        if self.journal is not None:  # the renames are taken back: nothing is left to complete
            attempt(f"{JOURNAL} could not be removed", self.journal.unlink, True)
        for final, kept in self.kept.items():
            if kept is not None and final not in self.placed:
                attempt(f"{kept} could not be removed", kept.unlink, True)
        if self.history_at is not None:
            attempt("the history line could not be taken back", truncate_history, self.job_root, self.history_at)
        staged_files = {new for new, _ in self.moves} | {staged(self.folder / n) for n in (RESULT_FILE, REPORT_FILE)}
        for new in staged_files:
            attempt(f"{new} could not be removed", new.unlink, True)
        return problems


def rewrite_index(job_root: Path) -> str:
    """Rewrite the job's index after a failure, never raising: '' when written, else what became of it. A page
    that cannot be rewritten is removed (it may say "running" for a process that has ended), then tried once more
    (its removal may have made the room)."""
    try:
        write_index(job_root)
        return ""
    except Exception as e:  # noqa: BLE001 - the step's own failure is the one to report
        first = e
    index = Path(job_root) / INDEX_FILE
    try:
        index.unlink(missing_ok=True)
    except OSError as e:
        return f"{INDEX_FILE} could not be rewritten ({_short(first)}) nor removed ({_short(e)}); it is out of date"
    try:
        write_index(job_root)
        return ""
    except Exception:  # noqa: BLE001
        return (f"{INDEX_FILE} could not be rewritten ({_short(first)}), so it was removed rather than left "
                f"out of date; mfu-lab report {job_root} writes it again")


def settle_publications(job_root: Path, say=print) -> list[str]:
    """Complete (or take back) what a killed publication left in the job's folder
    (:func:`mfu_lab.core.store.staging.settle`; the caller holds the job's lock), say each, and rewrite the index
    when anything was done; what was said."""
    notes = settle(job_root)
    for note in notes:
        say(f"mfu-lab: {note}")
    if notes and (problem := rewrite_index(job_root)):
        say(f"mfu-lab: warning: {problem}")
    return notes


@contextmanager
def _staging_set() -> Iterator[None]:
    """``MFU_LAB_STAGE`` set for the step's run (a notebook's kernel inherits it), then restored."""
    before = os.environ.get(STAGE_ENV)
    os.environ[STAGE_ENV] = "1"
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(STAGE_ENV, None)
        else:
            os.environ[STAGE_ENV] = before


@contextmanager
def step_bracket(job: Job, info, source: str, run_id: str, notebook: Path | None = None,
                 limit: float | None = None) -> Iterator[Path]:
    """Around one step's run: mark the step folder running; on the way out either publish the step's new files
    as one set (:class:`Publication`: result, report, the run's copy, the history line, the index), or record
    why no new result came (``failure.json``: failed / interrupted / timeout), the previous set kept whole.

    ``notebook``: the executed notebook papermill writes (exported to ``report.html``, named in ``failure.json``);
    ``None`` for a plain-Python step. ``limit``: papermill's cell timeout, for its message. A failure leaves as
    :class:`StepExecutionError` (:class:`NotPublished` when the step ran to its end but its files could not be
    published); Ctrl-C (and, for a plain-Python step, any other non-``Exception`` such as ``SystemExit``) is
    re-raised as it came.
    """
    folder, root = fresh_step_folder(job, info), job.output_root()
    mark_running(folder, info.key, run_id)
    if notebook is not None:  # a notebook runs for minutes: the index shows it running meanwhile
        try:
            write_index(root)
        except BaseException:
            clear_running(folder)
            raise
    pub, ran = Publication(root, folder, info, run_id), False
    try:
        with _staging_set():
            yield folder
        ran = True
        pub.prepare(notebook)  # the running mark stays until the set is in place: a kill before says "interrupted"
        pub.commit()
        try:
            write_index(root)
        except OSError:  # the disk cannot hold the set (full, read-only): undone, below
            raise
        except Exception as e:  # noqa: BLE001 - a fault of the page's own code: the measured set stands
            note = rewrite_index(root) or "it was written on a second try"
            print(f"mfu-lab: warning: {info.folder}'s new result is published, but the index page could not be "
                  f"written ({type(e).__name__}: {e}); {note}", file=sys.stderr, flush=True)
    except BaseException as exc:  # PapermillExecutionError, CellTimeoutError, KeyboardInterrupt, a full disk...
        _fail(exc, job, info, source, pub, notebook, limit, ran)
    pub.finish()


def _fail(exc: BaseException, job: Job, info, source: str, pub: Publication, notebook: Path | None,
          limit: float | None, ran: bool) -> None:
    """Undo what was published, record the failure, rewrite the index, and raise: each part guarded, so that a
    second failure (the disk still full) does not hide the first, and the message says what was kept."""
    folder = pub.folder
    notes = pub.undo()
    if ran and not isinstance(exc, KeyboardInterrupt):
        status, ename = "failed", type(exc).__name__
        what = filesystem_problem(exc) if isinstance(exc, OSError) else str(exc)
        evalue = (f"the step ran to its end, but its new files could not all be written ({what}); none of them "
                  "was published: the previous result.json, report.html and history line stand as they were")
    else:
        status, ename, evalue = _failure(exc, notebook, limit, job)
    where = {"notebook": str(notebook)} if notebook is not None else {}
    try:
        mark_failed(folder, info.key, status, f"{ename}: {evalue}", job_file=source, **where)
    except OSError as e:
        notes.append(f"{FAILURE_FILE} could not be written ({_short(e)})")
        try:
            clear_running(folder)
        except OSError as e2:
            notes.append(f"the running mark could not be removed ({_short(e2)})")
    if not ran and notebook is not None and notebook.is_file():  # the report shows the error where it happened
        try:
            export_html(notebook, folder / REPORT_FILE)
        except Exception as e:  # noqa: BLE001
            notes.append(f"{REPORT_FILE} was not rewritten with the error ({_short(e)}); the previous one stands")
    if note := rewrite_index(job.output_root()):
        notes.append(note)
    if notes:
        evalue += "; also: " + "; ".join(notes)
    if isinstance(exc, KeyboardInterrupt) or (notebook is None and not isinstance(exc, Exception)):
        raise exc
    kind = NotPublished if ran else StepExecutionError
    raise kind(info.key, str(notebook or folder), ename, evalue) from None
