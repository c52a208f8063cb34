"""The monitor's record files: JSON lines, one file per rank, shared by the writer (in the user's training job,
:mod:`mfu_lab.monitor`) and the reader (:mod:`mfu_lab.analysis.monitor_summary`).

A monitor folder holds ``<host>-rank<k>.jsonl`` per rank, rotated by size into ``<host>-rank<k>.<n>.jsonl``
(``n`` = 1, 2, ... oldest first; the unnumbered file is the newest). Each record is one line, appended with one
``os.write`` call, so a process that dies loses at most the record it was writing (a torn last line, which the
reader skips and counts) and never damages the earlier ones. The file is flushed to disk (``fsync``) at
intervals, so a node that dies loses at most that interval.

Record kinds (every record has ``kind``, ``v``, ``t`` (unix seconds), ``launch``, ``rank`` and ``node``):

- ``start``: one per process start: ranks, device, peak, FLOPs source, the monitor's settings, the scheduler's
  ids (Slurm, torchrun), how communication is timed;
- ``cluster``: what the scheduler answered later (Slurm submit and start times, restarts);
- ``flops``: the FLOPs per step counted on the first step, when no formula was given;
- ``interval``: every ``every`` steps: step-time median/p90/max, tokens/s, MFU, the data, host and
  communication time, GPU health over the interval;
- ``profile``: a short torch.profiler window's breakdown (computing, exposed communication, copies, data, idle);
- ``end``: a clean close (or the exception that ended the loop).
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

from mfu_lab.core.results import jsonable  # NaN and infinity as null: JSON has neither

VERSION = 1
KINDS = ("start", "cluster", "flops", "interval", "profile", "end")
_NAME = re.compile(r"^(?P<host>.+)-rank(?P<rank>\d+)(?:\.(?P<part>\d+))?\.jsonl$")


def safe_host(name: str | None = None) -> str:
    """The host name as it appears in file names: letters, digits, dot, dash and underscore only."""
    return re.sub(r"[^A-Za-z0-9._-]", "_", name or socket.gethostname() or "host")


def record_path(folder: Path, host: str, rank: int) -> Path:
    return Path(folder) / f"{safe_host(host)}-rank{int(rank)}.jsonl"


class RecordWriter:
    """Appends records to one rank's file: one ``os.write`` per record, ``fsync`` every ``fsync_s`` seconds,
    rotation once the file passes ``max_bytes``."""

    def __init__(self, path: Path, fsync_s: float = 60.0, max_bytes: int = 64 * 2**20):
        self.path, self.fsync_s, self.max_bytes = Path(path), fsync_s, max_bytes
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self._last_sync = time.monotonic()
        self._lock = threading.Lock()  # a background thread (the scheduler's answer) may write too
        self.written = 0

    def write(self, record: dict[str, Any]) -> None:
        line = (json.dumps(jsonable(record), allow_nan=False, default=str, separators=(",", ":")) + "\n").encode()
        with self._lock:
            self._write(line)

    def _write(self, line: bytes) -> None:
        if self._fd < 0:
            raise ValueError(f"{self.path}: the record file is closed")
        os.write(self._fd, line)  # one call: a reader sees the whole line or (after a crash) a torn last one
        self.written += 1
        now = time.monotonic()
        if now - self._last_sync >= self.fsync_s:
            os.fsync(self._fd)
            self._last_sync = now
        if os.fstat(self._fd).st_size >= self.max_bytes:
            self._rotate()

    def _rotate(self) -> None:
        os.fsync(self._fd)
        os.close(self._fd)
        stem = self.path.name[: -len(".jsonl")]
        parts = [int(m["part"]) for p in self.path.parent.glob(f"{stem}.*.jsonl")
                 if (m := _NAME.match(p.name)) and m["part"]]
        self.path.rename(self.path.with_name(f"{stem}.{max(parts, default=0) + 1}.jsonl"))
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def close(self) -> None:
        with self._lock:
            self._close()

    def _close(self) -> None:
        if self._fd >= 0:
            try:
                os.fsync(self._fd)
            finally:
                os.close(self._fd)
                self._fd = -1


@dataclass
class RankFiles:
    """One rank's files on one host, oldest part first."""

    host: str
    rank: int
    paths: list[Path] = field(default_factory=list)


def rank_files(folder: Path) -> list[RankFiles]:
    """Every rank's record files in ``folder`` (and its subfolders: one per node or per run is fine)."""
    groups: dict[tuple[str, int], list[tuple[int, Path]]] = {}
    for p in sorted(Path(folder).rglob("*.jsonl")):
        m = _NAME.match(p.name)
        if not m:
            continue
        # the unnumbered file is the newest part: sort it after every numbered one
        order = int(m["part"]) if m["part"] else 10**9
        groups.setdefault((str(p.parent / m["host"]), int(m["rank"])), []).append((order, p))
    return [RankFiles(Path(key[0]).name, key[1], [p for _, p in sorted(v)]) for key, v in sorted(groups.items())]


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
