"""Files of a job's output folder: one atomic write, one JSON reader, every step's result.json by key.

``outputs/<job>/<NN_step>/result.json`` holds each step's latest result; ``runs/<id>/`` and
``history.jsonl`` keep every earlier one (:mod:`mfu_lab.core.store.history`). Every file the workbook writes whole
goes through :func:`write_atomic`: written aside, flushed, then renamed over the old one, so a reader sees the
old file or the complete new one, never half.
"""

from __future__ import annotations

import errno
import json
import os
import stat
import tempfile
from pathlib import Path
from typing import Any

from mfu_lab.core.errors import MfuLabError
from mfu_lab.core.registry import STEPS
from mfu_lab.core.store.results import jsonable, result_type_problem

RESULT_FILE = "result.json"



def write_atomic(path: Path, content: str | bytes, durable: bool = True) -> Path:
    """Write ``content`` so that ``path`` holds either the old file or the complete new one, never half.

    The content goes to a temporary file in the same folder, is flushed to disk, then renamed over ``path``
    (``os.replace`` is atomic on POSIX and Windows). ``durable=False`` skips the flush to disk, for small status
    files rewritten inside a timed loop (a crash may then lose the latest one, never leave half of it).
    """
    path = Path(path)
    refuse_links(path)  # a folder on the way that is a link would carry the file out of the job's folder
    path.parent.mkdir(parents=True, exist_ok=True)
    data = content.encode("utf-8") if isinstance(content, str) else content
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            if durable:
                os.fsync(f.fileno())
        os.chmod(tmp, 0o644)  # mkstemp makes 0600; results are meant to be shared
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def write_json_atomic(path: Path, data: Any) -> Path:
    """``data`` (dataclasses, dicts, lists; NaN and inf as null) as indented JSON, written atomically."""
    return write_atomic(path, json.dumps(jsonable(data), indent=2, allow_nan=False) + "\n")


class DamagedFile(MfuLabError, ValueError):
    """A stored file that cannot be read back (truncated, another encoding, not a JSON object). Names the file;
    ``what_to_do`` says how to get a good one back."""

    def __init__(self, path: Path, why: str, what_to_do: str = ""):
        self.path, self.why = Path(path), why
        self.what_to_do = what_to_do or _what_to_do(self.path)
        super().__init__(f"{self.path} is damaged ({why}): {self.what_to_do}")


def _what_to_do(path: Path) -> str:
    info = next((s for s in STEPS if s.folder == path.parent.name), None)
    if info is None:
        return "delete or restore it"
    return f"step {info.number}'s {path.name} is damaged: rerun step {info.number} ({info.key})"


def read_json(path: Path) -> dict[str, Any]:
    """A stored JSON object; a file that cannot be read as one raises :class:`DamagedFile` naming it."""
    path = Path(path)
    try:
        data = json.loads(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as e:
        raise DamagedFile(path, f"not UTF-8 text at byte {e.start}") from None
    except json.JSONDecodeError as e:
        raise DamagedFile(path, f"not complete JSON: {e.msg} at line {e.lineno}, column {e.colno}") from None
    if not isinstance(data, dict):
        raise DamagedFile(path, f"a JSON {type(data).__name__}, not an object")
    if path.name == RESULT_FILE and (why := result_type_problem(data)) is not None:
        raise DamagedFile(path, f"wrong type: {why}")
    return data


JOB_MARKER = ".mfu-lab"  # in every job output folder the workbook made; commands that rewrite a folder check it


def mark_job_root(job_root: Path) -> Path:
    """Make the job's output folder (if needed) and mark it as the workbook's."""
    job_root = Path(job_root)
    marker = job_root / JOB_MARKER
    if not marker.is_file():
        write_atomic(marker, "This folder holds mfu-lab results; mfu-lab report may rewrite its HTML.\n")
    return job_root


class PlantedLink(OSError):
    """A symbolic link below a job's output folder, where the workbook writes: refused, never followed."""

    def __init__(self, path: Path, root: Path | None = None):
        where = f"inside the job's output folder {root}" if root else "where mfu-lab writes"
        super().__init__(errno.ELOOP, f"is a symbolic link {where}: mfu-lab does not write through one there (it "
                         "would carry the write outside the job's folder); remove it (out_dir and the job's folder "
                         "itself may be links)", str(path))


def job_root_of(path: Path) -> Path | None:
    """The job output folder that holds ``path``: its highest folder with the workbook's marker (a link planted
    below a job's folder may point into another one, so the lowest is not the one). None when none holds it."""
    found = None
    for folder in Path(os.path.abspath(path)).parents:
        if (folder / JOB_MARKER).is_file():
            found = folder
    return found


def refuse_links(path: Path, include_self: bool = False) -> None:
    """Raise :class:`PlantedLink` for a symbolic link among the folders between the job's output folder that
    holds ``path`` and ``path`` (``path`` itself too with ``include_self``: a folder about to be used). The job's
    folder and the folders above it may be links (the user's own); outside any job's folder nothing is checked.
    ``write_atomic`` needs no check of ``path`` itself: its rename replaces a link, never follows it."""
    path = Path(os.path.abspath(path))
    root = job_root_of(path)
    if root is None:
        return
    below = [p for p in ([path] if include_self else []) + list(path.parents) if p != root and root in p.parents]
    for p in reversed(below):  # the highest first: the one to remove
        if p.is_symlink():
            raise PlantedLink(p, root)


def refuse_links_below(folder: Path, depth: int | None = None) -> None:
    """Raise :class:`PlantedLink` for the first symbolic link found below ``folder`` (down to ``depth`` levels;
    every level when None), links never followed; nothing when ``folder`` does not exist."""
    todo = [(Path(folder), 1)]
    while todo:
        here, level = todo.pop()
        try:
            entries = list(os.scandir(here))
        except (FileNotFoundError, NotADirectoryError):
            continue
        for e in entries:
            if e.is_symlink():
                raise PlantedLink(Path(e.path), job_root_of(Path(e.path)) or Path(folder))
            if e.is_dir(follow_symlinks=False) and (depth is None or level < depth):
                todo.append((Path(e.path), level + 1))


def open_nofollow(path: Path, flags: int, mode: int = 0o644) -> int:
    """``os.open`` of a file the workbook appends to or rewrites in place (the history, the job's lock), never
    through a link: a link at ``path`` or on the folders below the job's folder is refused (:class:`PlantedLink`),
    and so is anything that is not a regular file. The descriptor; the caller closes it."""
    path = Path(path)
    refuse_links(path)
    try:
        fd = os.open(path, flags | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0), mode)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.EMLINK) and path.is_symlink():  # EMLINK: the BSDs' answer
            raise PlantedLink(path, job_root_of(path)) from None
        raise
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise OSError(errno.EINVAL, "is not a regular file (mfu-lab writes this file itself); remove it", str(path))
    return fd


def is_job_root(folder: Path) -> bool:
    """Whether the workbook made ``folder``: its marker, or (made before the marker existed) a run history or a
    step folder with a result or a run marker in it."""
    folder = Path(folder)
    if (folder / JOB_MARKER).is_file() or (folder / "history.jsonl").is_file():
        return True
    return any((folder / info.folder / name).is_file() for info in STEPS
               for name in (RESULT_FILE, "failure.json", "running.json"))


def load_results(job_root: Path, damaged: dict[str, DamagedFile] | None = None) -> dict[str, dict[str, Any]]:
    """Every step's result.json under a job's output folder (or a run's copy of one), by step key. A damaged one
    is left out (and put in ``damaged`` when given): the other steps' results do not depend on it."""
    out = {}
    for info in STEPS:
        p = Path(job_root) / info.folder / RESULT_FILE
        if p.is_file():
            try:
                out[info.key] = read_json(p)
            except DamagedFile as e:
                if damaged is not None:
                    damaged[info.key] = e
    return out
