"""Progress of long work, with an estimate of the time left, in a terminal, a notebook and a saved report.

Two outputs for the same progress:

- printed lines (not a redrawn bar): the executed notebook and its HTML keep a short, honest record of
  how the run went, and ``mfu-lab run`` streams them to the terminal as they come;
- inside a Jupyter kernel, also one live progress bar (an HTML ``<progress>`` element updated in place
  through a display id). JupyterLab redraws it as work advances; papermill applies the same updates to
  the saved notebook, so the report shows the bar's final state, not a stale 0%.

The time left is the average time per finished item so far times the items left: an estimate, said so.

No silence over long work: counted work prints a line at each quarter *and* whenever :data:`GAP_S` seconds passed
since its last line, and a unit of work that may run longer than that (a timed run, a wait on worker processes)
calls a :class:`Heartbeat` from inside, which prints at most once per :data:`GAP_S` seconds, with the time
elapsed and, when a count is known, the time left. The lines are printed between timed steps, never inside one:
a training step's wall time includes at most one line's print every :data:`GAP_S` seconds (microseconds against a
step's milliseconds).

Every step's ``run(job, progress=None, write=True)`` takes the same ``progress``: a :class:`Progress`, or any
callable taking one line of text (``print`` will do; ``lambda msg: None`` silences a step). Counted work
(training steps, configurations, modes, trials) is reported through it with the time left.
"""

from __future__ import annotations

import html
import sys
import time

GAP_S = 15.0  # the longest silence of counted or long work, in seconds (issue 34: no gap over about 30 s)


def in_kernel() -> bool:
    """True inside a Jupyter (IPython) kernel, where rich output can be displayed and updated."""
    try:
        from IPython import get_ipython
    except ImportError:  # pragma: no cover - IPython comes with ipykernel, a dependency
        return False
    ip = get_ipython()
    return ip is not None and getattr(ip, "kernel", None) is not None


def eta_text(done: int, total: int, elapsed: float) -> str:
    """'12.0 s' when finished, else '12.0 s, about 30 s left' (mean time per finished item x items left)."""
    if done >= total:
        return f"{elapsed:.1f} s"
    if done == 0:
        return f"{elapsed:.1f} s, time left unknown until the first one finishes"
    left = elapsed / done * (total - done)
    return f"{elapsed:.1f} s, about {_human(left)} left"


def _human(s: float) -> str:
    if s < 90:
        return f"{s:.0f} s"
    if s < 5400:
        return f"{s / 60:.0f} min"
    return f"{s / 3600:.1f} h"


class LiveBar:
    """An HTML progress bar displayed once and updated in place (Jupyter only; a no-op elsewhere)."""

    def __init__(self, label: str, enabled: bool | None = None):
        self.label = label
        self.handle = None
        self.enabled = in_kernel() if enabled is None else enabled
        self.last = 0.0

    def html(self, done: int, total: int, elapsed: float, note: str = "") -> str:
        said = eta_text(done, total, elapsed) + (f"; {note}" if note else "")
        return (f'<div class="mfu-progress"><progress value="{done}" max="{max(total, 1)}" style="width:18em">'
                f"</progress> {html.escape(self.label)}: {done}/{total} ({html.escape(said)})</div>")

    def update(self, done: int, total: int, elapsed: float, note: str = "") -> None:
        if not self.enabled:
            return
        now = time.monotonic()
        if self.handle is not None and done < total and now - self.last < 0.5:
            return  # at most two redraws a second, and always the last one
        self.last = now
        from IPython.display import HTML, display

        if self.handle is None:
            self.handle = display(HTML(self.html(done, total, elapsed, note)), display_id=True)
        else:
            self.handle.update(HTML(self.html(done, total, elapsed, note)))


def printer(label: str, every: float = 0.25, stream=None, bar: bool | None = None, emit=None,
            gap_s: float = GAP_S, clock=None):
    """A ``progress(done, total, elapsed_s)`` callback: a line at each ``every`` fraction and whenever ``gap_s``
    seconds of ``clock`` passed since the last line, with time left, and a live bar in a notebook. Lines go to
    ``emit`` when given, else are printed to ``stream``."""
    marks: set[int] = set()
    live = LiveBar(label, bar)
    clock = clock or time.monotonic  # looked up now, so a test's fake clock counts
    last = [clock()]

    def progress(done: int, total: int, elapsed: float) -> None:
        live.update(done, total, elapsed)
        mark = int(done / total / every)
        now = clock()
        if mark in marks and done != total and now - last[0] < gap_s:
            return
        marks.add(mark)
        last[0] = now
        line = f"{label}: {done}/{total} ({eta_text(done, total, elapsed)})"
        if emit is not None:
            emit(line)
        else:
            print(line, file=stream or sys.stdout, flush=True)

    return progress


class Heartbeat:
    """Lines from inside long work, at most one per ``every_s`` seconds of ``clock``.

    ``beat(done, total)`` is cheap to call as often as the work likes (each training step, each poll of a worker's
    progress file): it prints only when ``every_s`` passed since the last line (the first line comes ``every_s``
    after the start), saying the time elapsed and, with a count (``done`` of ``total``), the time left.
    ``said()`` tells it that the caller printed a line of its own, so the gap counts from there.
    """

    def __init__(self, label: str, emit=None, total: int | None = None, every_s: float = GAP_S,
                 clock=None):
        self.label, self.total, self.every_s, self.clock = label, total, every_s, clock or time.monotonic
        self.emit = emit or (lambda line: print(line, flush=True))
        self.t0 = self.last = self.clock()
        self.lines = 0

    def said(self) -> None:
        self.last = self.clock()

    def restart(self) -> None:
        """A new unit of work: its time counts from now (the gap since the last line still counts)."""
        self.t0 = self.clock()

    def beat(self, done: int | None = None, total: int | None = None, what: str = "") -> bool:
        """A line when ``every_s`` passed since the last one (True when it printed)."""
        now = self.clock()
        if now - self.last < self.every_s:
            return False
        self.last = now
        total = self.total if total is None else total
        elapsed = now - self.t0
        if done is not None and total:
            state = f"{done}/{total} ({eta_text(done, total, elapsed)})"
        else:
            state = f"{elapsed:.0f} s so far, time left unknown"
        self.emit(f"{self.label}: still working{', ' + what if what else ''}, {state}")
        self.lines += 1
        return True


class Eta:
    """Progress over a known number of coarse items (configurations, compile modes, trials).

    ``tag(finished)`` returns the text to append to the item's own progress line and updates the live
    bar; ``finish()`` marks the whole as done.
    """

    def __init__(self, label: str, total: int, bar: bool | None = None):
        self.label, self.total = label, max(int(total), 0)
        self.t0 = time.perf_counter()
        self.live = LiveBar(label, bar)

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def tag(self, finished: int) -> str:
        e = self.elapsed()
        self.live.update(finished, self.total, e)
        return f" ({finished}/{self.total} done, {eta_text(finished, self.total, e)})" if finished else ""

    def finish(self, not_run: list[str] | tuple[str, ...] = ()) -> None:
        """The whole marked done; ``not_run``: the reasons of the items that were not run, which the bar counts
        ('budget' when each was the budget's, else 'see the table')."""
        why = "budget" if all(r.startswith("budget") for r in not_run) else "see the table"
        note = f"{len(not_run)} of them not run: {why}" if not_run else ""
        self.live.update(self.total, self.total, self.elapsed(), note)


class Progress:
    """Where a step reports what it is doing: lines of text (``say``), counted work with the time left
    (``items``, ``eta``) and, inside a notebook, live bars.

    ``say`` defaults to printing each line; a step called with ``progress=some_callable`` sends every line,
    counted ones included, to that callable instead.
    """

    def __init__(self, say=None, bar: bool | None = None):
        self._say = say
        self.bar = bar

    def say(self, msg: str) -> None:
        if self._say is None:
            print(msg, flush=True)
        else:
            self._say(msg)

    __call__ = say

    def items(self, label: str, every: float = 0.25):
        """A ``(done, total, elapsed_s)`` callback for counted work, e.g. training steps."""
        return printer(label, every, bar=self.bar, emit=self._say)

    def eta(self, label: str, total: int) -> Eta:
        """Time left over a known number of coarse items (configurations, compile modes, trials)."""
        return Eta(label, total, self.bar)

    def heartbeat(self, label: str, total: int | None = None, every_s: float = GAP_S) -> Heartbeat:
        """Throttled lines from inside one long unit of work (see :class:`Heartbeat`)."""
        return Heartbeat(label, self.say, total, every_s)


def as_progress(progress) -> Progress:
    """The one progress type of every step: ``None`` prints, a :class:`Progress` is kept, any other callable
    receives each line of text."""
    if isinstance(progress, Progress):
        return progress
    return Progress(progress)
