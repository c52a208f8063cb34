"""The monitor's record files: JSON lines, one file per rank and run, shared by the writer (in the user's training
job, :mod:`mfu_lab.monitor`) and the reader (:mod:`mfu_lab.analysis.monitor.read`,
:mod:`~mfu_lab.analysis.monitor.summary`).

The contract between the two sides (the writer keeps it; the reader may rely on it):

- **File names.** A monitor folder holds ``<host>-<run>-rank<k>.jsonl`` per rank, rotated by size into
  ``<host>-<run>-rank<k>.<n>.jsonl`` (``n`` = 1, 2, ... oldest first; the unnumbered file is the newest). Folders
  written before run ids existed hold ``<host>-rank<k>.jsonl`` (and ``.<n>.jsonl``); both are read.
  ``<host>`` is :func:`safe_host` (letters, digits, ``.``, ``_``, ``-``); ``<run>`` is :func:`safe_run` (letters,
  digits, ``.`` and ``_``: never a dash, so the last dash before ``-rank`` ends the host). An old name whose host
  holds a dash (``gpu-node-rank0.jsonl``) also fits the new pattern; :func:`rank_files` then reads the file's
  first line: a record without a ``run`` field was written before run ids, and the name is read the old way.
- **Which files are read.** :func:`rank_files` reads only files whose names match that pattern, in the folder and
  its subfolders at most 3 levels down (one per node or per run is fine), never following a linked folder: a
  ``monitor_dir: /`` does not walk the disk. :class:`RankFiles` carries ``host``, ``run`` ('' for old names),
  ``rank`` and the paths, oldest part first. Two runs of different jobs in one folder never share (or rotate)
  a file.
- **The run id** (``run``, a string in every record since ``v`` 2, first in the ``start`` record): the same on
  every rank of one job and across its restarts (a restart is a new ``launch``): ``Monitor(run=...)`` when
  given; else Slurm's job (``SLURM_JOB_ID``, the step, and the job's start time ``SLURM_JOB_START_TIME``
  where Slurm gives it); else torchrun's ``TORCHELASTIC_RUN_ID`` (on one node with the torchrun agent's start
  time, which every local rank shares; across nodes the rendezvous id alone, which the launcher makes unique);
  else ``<host>.<pid>.<start time>`` (one process). See :func:`mfu_lab.monitor.context.run_id`.
- **Times inside an interval** (the ``interval`` record), all host clock readings, in seconds:
  ``wall_s`` (the sum of the steps' wall times, ``step()`` to ``step()``); ``other_s`` (time between training
  steps that was neither a training step nor a data fetch: evaluation, checkpoints, logging, as the framework
  adapters see them through the framework's own hooks, or as a plain loop marks them with
  ``Monitor.other()``; 0 where nothing was marked); ``data_s`` (the wait for data, only where the monitor timed
  a fetch: its wrapped loader, ``Monitor.fetch()``, ``step(data_wait_s=...)``, or an adapter's gap before the
  batch with the ``other_s`` taken out) with ``data_timed`` (a boolean: false means no fetch was timed, and
  ``data_s`` is null: the report says "not timed", never 0% measured); ``host_s`` (from ``step()`` returning to
  the wrapped loader's next request; null where no loader was wrapped); ``comm_s``. MFU and tokens/s are taken
  over ``wall_s - other_s`` (training steps and data wait; evaluation, checkpoints and logging left out, as
  Lightning's ``ThroughputMonitor`` leaves evaluation out):
  ``mfu = flops_per_step * steps / ((wall_s - other_s) * peak)``; ``step_s`` (median, p90, max, mean) are of each
  step's wall time less its ``other_s``.

Each record is one line, appended with one ``os.write`` call, so a process that dies loses at most the record it
was writing (a torn last line, which the reader skips and counts) and never damages the earlier ones. The file is
flushed to disk (``fsync``) at intervals, so a node that dies loses at most that interval. A failed rotation
leaves the writer without a descriptor (never a stale number that the job's next ``open()`` could be given); the
next record reopens the file.

Record kinds (every record has ``kind``, ``v``, ``t`` (unix seconds), ``launch``, ``run``, ``rank`` and ``node``):

- ``start``: one per process start: ranks, device, peak, FLOPs source, how data wait is timed, the monitor's
  settings, the scheduler's ids (Slurm, torchrun), how communication is timed;
- ``cluster``: what the scheduler answered later (Slurm submit and start times, restarts);
- ``flops``: the FLOPs of one training step, counted when no formula was given: ``step`` (which step's window
  was counted), ``window``, ``per_step``, ``per_token``, ``rejected_windows`` (windows left out because an
  evaluation ran in them);
- ``interval``: every ``every`` steps: step-time median/p90/max, tokens/s, MFU, the times above, GPU health;
- ``profile``: a short torch.profiler window's breakdown (computing, exposed communication, copies, data, idle);
- ``end``: a clean close (or the exception that ended the loop), with the monitor's own failures counted, and
  under an adapter whose framework keeps a FLOP figure of its own (Hugging Face's ``total_flos``, a
  LightningModule's ``flops_per_batch``) ``framework``:
  its ``name``, ``per_step`` (per optimizer step and rank, over this run's ``steps``) and ``how``.
"""

from __future__ import annotations

import json
import os
import re
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mfu_lab.core.store.results import jsonable  # NaN and infinity as null: JSON has neither

VERSION = 2  # 2: a run id in every record and in the file name; other_s and data_timed in intervals
KINDS = ("start", "cluster", "flops", "interval", "profile", "end")
_NEW = re.compile(r"^(?P<host>.+)-(?P<run>[A-Za-z0-9._]+)-rank(?P<rank>\d+)(?:\.(?P<part>\d+))?\.jsonl$")
_OLD = re.compile(r"^(?P<host>.+)-rank(?P<rank>\d+)(?:\.(?P<part>\d+))?\.jsonl$")
MAX_DEPTH = 3  # subfolders below the monitor folder that rank_files looks into
RUN_MAX = 80  # characters of a run id


def safe_host(name: str | None = None) -> str:
    """The host name as it appears in file names: letters, digits, dot, dash and underscore only."""
    return re.sub(r"[^A-Za-z0-9._-]", "_", name or socket.gethostname() or "host")


def safe_run(run: str) -> str:
    """A run id as it appears in file names and records: letters, digits, dot and underscore (no dash, which
    separates the name's fields), at most ``RUN_MAX`` characters; '' stays ''."""
    return re.sub(r"[^A-Za-z0-9._]", "_", str(run))[:RUN_MAX]


def record_path(folder: Path, host: str, rank: int, run: str = "") -> Path:
    """``<host>-<run>-rank<k>.jsonl`` (``<host>-rank<k>.jsonl`` without a run: the names before run ids)."""
    run = safe_run(run)
    return Path(folder) / (f"{safe_host(host)}-{run}-rank{int(rank)}.jsonl" if run else
                           f"{safe_host(host)}-rank{int(rank)}.jsonl")


def parse_name(name: str) -> tuple[str, str, int, int | None] | None:
    """(host, run, rank, part) of a record file's name, run '' for the old names; None for any other name. A name
    both patterns fit is read the new way here; :func:`rank_files` settles it from the file's first record."""
    m = _NEW.match(name)
    if m is None:
        m = _OLD.match(name)
        if m is None:
            return None
        return m["host"], "", int(m["rank"]), int(m["part"]) if m["part"] else None
    return m["host"], m["run"], int(m["rank"]), int(m["part"]) if m["part"] else None


class RecordWriter:
    """Appends records to one rank's file: one ``os.write`` per record, ``fsync`` every ``fsync_s`` seconds,
    rotation once the file passes ``max_bytes``."""

    def __init__(self, path: Path, fsync_s: float = 60.0, max_bytes: int = 64 * 2**20):
        self.path, self.fsync_s, self.max_bytes = Path(path), fsync_s, max_bytes
        self._fd = -1
        self._closed = False
        self._lock = threading.Lock()  # a background thread (the scheduler's answer) may write too
        self.written = 0
        self._last_sync = time.monotonic()
        self._open()

    def _open(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def write(self, record: dict[str, Any]) -> None:
        line = (json.dumps(jsonable(record), allow_nan=False, default=str, separators=(",", ":")) + "\n").encode()
        with self._lock:
            self._write(line)

    def _write(self, line: bytes) -> None:
        if self._closed:
            raise ValueError(f"{self.path}: the record file is closed")
        if self._fd < 0:  # a rotation (or an open) failed earlier: try again; a failure raises, counted above
            self._open()
        os.write(self._fd, line)  # one call: a reader sees the whole line or (after a crash) a torn last one
        self.written += 1
        now = time.monotonic()
        if now - self._last_sync >= self.fsync_s:
            os.fsync(self._fd)
            self._last_sync = now
        if os.fstat(self._fd).st_size >= self.max_bytes:
            self._rotate()

    def _rotate(self) -> None:
        # the descriptor is forgotten before any call that can fail: were it kept after a failed close, rename or
        # open, the job's next open() could be given the same number and the monitor would write into its file
        fd, self._fd = self._fd, -1
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        stem = self.path.name[: -len(".jsonl")]
        parts = [n[3] for p in self.path.parent.glob(f"{stem}.*.jsonl")
                 if (n := parse_name(p.name)) and n[3] is not None and p.name[: -len(".jsonl")].rsplit(".", 1)[0]
                 == stem]
        self.path.rename(self.path.with_name(f"{stem}.{max(parts, default=0) + 1}.jsonl"))
        self._open()

    def close(self) -> None:
        with self._lock:
            self._close()

    def _close(self) -> None:
        self._closed = True
        fd, self._fd = self._fd, -1
        if fd >= 0:
            try:
                os.fsync(fd)
            finally:
                os.close(fd)


@dataclass
class RankFiles:
    """One rank's files of one run on one host, oldest part first (``run`` '' for the names before run ids)."""

    host: str
    rank: int
    paths: list[Path] = field(default_factory=list)
    run: str = ""


def _matching_files(folder: Path, depth: int = MAX_DEPTH) -> Iterator[Path]:
    """Files whose names fit the monitor's pattern, in ``folder`` and at most ``depth`` levels of subfolders below
    it; linked folders are not followed, unreadable ones are passed over."""
    try:
        entries = sorted(os.scandir(folder), key=lambda e: e.name)
    except OSError:
        return
    for e in entries:
        try:
            if e.is_dir(follow_symlinks=False):
                if depth > 0:
                    yield from _matching_files(Path(e.path), depth - 1)
            elif e.name.endswith(".jsonl") and e.is_file() and parse_name(e.name) is not None:
                yield Path(e.path)
        except OSError:
            continue


def _written_before_runs(path: Path) -> bool:
    """True when the file's first record has no ``run`` field (a writer before run ids). Reads one line."""
    try:
        with open(path, "rb") as f:
            rec = json.loads(f.readline(65536))
    except (OSError, ValueError, UnicodeDecodeError):
        return False
    return isinstance(rec, dict) and "run" not in rec


def rank_files(folder: Path) -> list[RankFiles]:
    """Every rank's record files in ``folder`` and its subfolders (at most ``MAX_DEPTH`` levels down), one entry
    per folder, host, run and rank."""
    groups: dict[tuple[str, str, str, int], list[tuple[int, Path]]] = {}
    for p in _matching_files(Path(folder)):
        host, run, rank, part = parse_name(p.name)
        if run and _OLD.match(p.name) and _written_before_runs(p):  # an old name whose host holds a dash
            m = _OLD.match(p.name)
            host, run = m["host"], ""
        # the unnumbered file is the newest part: sort it after every numbered one
        order = part if part is not None else 10**9
        groups.setdefault((str(p.parent), host, run, rank), []).append((order, p))
    return [RankFiles(key[1], key[3], [p for _, p in sorted(v)], key[2]) for key, v in sorted(groups.items())]


@dataclass
class ReadCount:
    """What a read skipped: lines that are not JSON objects (torn by a crash, edited, another format)."""

    lines: int = 0
    bytes: int = 0
    records: int = 0
    skipped: int = 0
    skipped_examples: list[str] = field(default_factory=list)
    unreadable_files: list[str] = field(default_factory=list)

    def skip(self, where: str) -> None:
        self.skipped += 1
        if len(self.skipped_examples) < 5:
            self.skipped_examples.append(where)


def iter_records(paths: list[Path], count: ReadCount) -> Iterator[dict[str, Any]]:
    """The records of one rank's files in order, one line at a time (never the whole file in memory).
    Malformed, truncated or unknown lines are skipped and counted in ``count``; an unreadable file is named."""
    for path in paths:
        try:
            f = open(path, "rb")  # noqa: SIM115 - closed below; bytes so a torn UTF-8 sequence cannot raise
        except OSError as e:
            count.unreadable_files.append(f"{path}: {e.strerror or e}")
            continue
        with f:
            for n, raw in enumerate(f, 1):
                count.lines += 1
                count.bytes += len(raw)
                try:
                    rec = json.loads(raw)
                except (ValueError, UnicodeDecodeError):
                    count.skip(f"{path.name}:{n}")
                    continue
                if not isinstance(rec, dict) or rec.get("kind") not in KINDS or not isinstance(rec.get("t"),
                                                                                               (int, float)):
                    count.skip(f"{path.name}:{n}")
                    continue
                count.records += 1
                yield rec


def first_and_last_time(paths: list[Path]) -> tuple[float | None, float | None]:
    """The times of the first and last readable records of one rank's files, reading only their ends."""
    first = last = None
    for path in paths:
        try:
            with open(path, "rb") as f:
                for raw in f:
                    t = _time_of(raw)
                    if t is not None:
                        first = t if first is None else min(first, t)
                        break
                f.seek(0, os.SEEK_END)
                size = f.tell()
                f.seek(max(0, size - 65536))
                for raw in reversed(f.read().splitlines()):
                    t = _time_of(raw)
                    if t is not None:
                        last = t if last is None else max(last, t)
                        break
        except OSError:
            continue
    return first, last


def _time_of(raw: bytes) -> float | None:
    try:
        rec = json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        return None
    t = rec.get("t") if isinstance(rec, dict) else None
    return float(t) if isinstance(t, (int, float)) else None
