"""Progress lines for long work, readable in a terminal, a notebook and a saved report alike.

Plain printed lines (not a redrawn bar) so that the executed notebook and its
HTML keep a short, honest record of how the run went.
"""

from __future__ import annotations

import sys


def printer(label: str, every: float = 0.25, stream=None):
    """A ``progress(done, total, elapsed_s)`` callback printing at each ``every`` fraction, with time left."""
    marks: set[int] = set()

    def progress(done: int, total: int, elapsed: float) -> None:
        mark = int(done / total / every)
        if mark in marks and done != total:
            return
        marks.add(mark)
        left = elapsed / done * (total - done) if done else 0.0
        tail = f"{elapsed:.1f} s" if done == total else f"{elapsed:.1f} s, about {left:.0f} s left"
        print(f"{label}: {done}/{total} ({tail})", file=stream or sys.stdout, flush=True)

    return progress
