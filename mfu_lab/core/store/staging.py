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
"""

from __future__ import annotations

import os
from pathlib import Path

STAGE_ENV = "MFU_LAB_STAGE"
STAGED = ".staged"  # suffix of a file written, not yet published
KEPT = ".kept"  # suffix of the previous file, hard-linked aside while a publication can still be undone


def staging() -> bool:
    """Whether this process (or the runner that started its kernel) publishes the step's files itself."""
    return os.environ.get(STAGE_ENV) == "1"


def staged(path: Path) -> Path:
    """The staged name of ``path``: ``result.json`` -> ``result.json.staged``."""
    path = Path(path)
    return path.with_name(path.name + STAGED)


def remove_leftovers(folder: Path) -> list[Path]:
    """Remove the staged and kept files a killed run left in ``folder``; those removed."""
    gone = []
    for suffix in (STAGED, KEPT):
        for p in Path(folder).glob(f"*{suffix}"):
            if p.is_file() or p.is_symlink():
                p.unlink(missing_ok=True)
                gone.append(p)
    return gone
