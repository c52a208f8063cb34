"""The monitor's records and its own failures: each record appended to this rank's JSON-lines file, and every
failure inside the monitor counted and warned about once, so that the job goes on.

Every record carries the same head (kind, format version, time, launch, run, rank, node); the file and its
rotation are :class:`mfu_lab.core.store.monitor_files.RecordWriter`'s. A record that cannot be written (a full
disk, a folder that is a file, the open-file limit) is counted in ``Monitor.errors``; the file is opened again at
the next record, and a start record that did not get through is written first.
"""

from __future__ import annotations

import os
import time
import warnings
from pathlib import Path
from typing import Any

from mfu_lab.core.store.monitor_files import VERSION, RecordWriter

WHAT = {"start": "setting up at start", "write": "writing a record", "step": "recording a step", "close": "closing",
        "tokens": "reading the token count", "samples": "reading the sample count",
        "arguments": "reading step()'s seconds", "flops": "counting FLOPs"}


class WritesRecords:
    """The Monitor's part that appends its records and counts its own failures, by kind (``Monitor.errors``)."""

    out_dir: Path
    host: str
    ids: dict[str, int]
    launch: str
    run: str
    fsync_s: float
    max_bytes: int
    errors: dict[str, int]
    write_errors: int
    _writer: RecordWriter | None
    _writer_path: Path | None
    _writer_closed: bool
    _unwritten_start: dict[str, Any] | None
    _pid: int

    def _fail(self, kind: str, e: BaseException, where: str = "") -> None:
        """Count a failure inside the monitor and warn about its kind once; the job goes on."""
        self.errors[kind] = self.errors.get(kind, 0) + 1
        if kind == "write":
            self.write_errors += 1
        if self.errors[kind] == 1:
            at = f" ({where})" if where else ""
            warnings.warn(f"mfu-lab monitor: {WHAT.get(kind, kind)} failed{at}: {type(e).__name__}: {e}; training "
                          "goes on, later failures of this kind are counted in Monitor.errors", stacklevel=3)

    def _emit(self, kind: str, **fields: Any) -> None:
        """Append one record. A record that cannot be written (a full disk, a folder that is a file, the open-file
        limit) is counted and warned about once; the file is opened again at the next record."""
        if os.getpid() != self._pid:
            return  # a forked child: this rank's file is its parent's (recorder.Monitor._forked)
        rec = {"kind": kind, "v": VERSION, "t": time.time(), "launch": self.launch, "run": self.run,
               "rank": self.ids["rank"], "node": self.host, **fields}
        try:
            writer = self._writer
            if writer is None:
                if self._writer_closed or self._writer_path is None:
                    return
                writer = self._writer = RecordWriter(self._writer_path, self.fsync_s, self.max_bytes)
            if self._unwritten_start is not None and kind != "start":
                writer.write(self._unwritten_start)
                self._unwritten_start = None
            writer.write(rec)
        except Exception as e:
            if kind == "start":
                self._unwritten_start = rec  # written before the next record that gets through
            self._fail("write", e, where=str(self._writer_path or self.out_dir))
