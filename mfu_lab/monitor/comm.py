"""Time a DDP model's collectives from inside its communication hook, never with a synchronisation in the step.

Each bucket's all-reduce is bracketed from the moment DDP hands the bucket to the hook until its future
completes: on a CPU with ``time.perf_counter`` (the future's callback runs when gloo finishes), on CUDA with
two CUDA events, the second recorded in the future's callback on the stream that waits for NCCL. The events
are read only once they have completed (``query()``), at the monitor's interval boundary; an unfinished one
waits for the next boundary. Overlapping buckets are merged (their union), so the figure is the time during
which any collective of the step was in flight, waiting for a slower rank included.

The hook DDP already has is kept: the user's own (registered through :meth:`CommTimer.wrap`) or, when the
model has none, DDP's default all-reduce, registered wrapped.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import torch


def union_seconds(spans: list[tuple[float, float]]) -> float:
    """Total length of the union of ``(start, end)`` spans (seconds)."""
    total, cur_s, cur_e = 0.0, None, None
    for s, e in sorted(spans):
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                total += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    if cur_e is not None:
        total += cur_e - cur_s
    return total


class CommTimer:
    def __init__(self, cuda: bool):
        self.cuda = cuda
        self._lock = threading.Lock()
        self._spans: list[tuple[float, float]] = []  # CPU: perf_counter seconds
        self._events: list[tuple[Any, Any, Any]] = []  # CUDA: (reference, start, end) events
        self._ref = None
        self.dropped = 0
        self.how = ("CUDA events around each bucket's collective (read once completed, no synchronisation)" if cuda
                    else "time.perf_counter from the hook's call to its future's completion, per bucket")

    def new_interval(self) -> None:
        """The spans that follow get a new reference event, recorded by the first hook on its own stream and
        device (CUDA: elapsed times stay short and precise, and never cross devices)."""
        self._ref = None

    def discard(self) -> None:
        """Forget every span so far, finished or not: steps left out of the timing (the warm-up step, a
        profiler window) must not lend their collectives to the next interval."""
        with self._lock:
            self._spans, self._events = [], []
        self._ref = None

    def wrap(self, hook):
        """``hook(state, bucket) -> Future`` timed; the value it produces is passed on unchanged."""

        def timed(state, bucket):
            if self.cuda:  # pragma: no cover - GPU only
                if self._ref is None:
                    self._ref = torch.cuda.Event(enable_timing=True)
                    self._ref.record()
                ref, start = self._ref, torch.cuda.Event(enable_timing=True)
                start.record()
            else:
                t0 = time.perf_counter()
            fut = hook(state, bucket)

            def done(f):
                if self.cuda:  # pragma: no cover - GPU only
                    end = torch.cuda.Event(enable_timing=True)
                    end.record()
                    with self._lock:
                        self._events.append((ref, start, end))
                else:
                    t1 = time.perf_counter()
                    with self._lock:
                        self._spans.append((t0, t1))
                return f.value()

            return fut.then(done)

        timed.__name__ = f"timed_{getattr(hook, '__name__', 'hook')}"
        timed.mfu_lab_timer = self
        return timed

    def take(self) -> float:
        """Seconds with a collective in flight since the last call (only spans that have finished)."""
        with self._lock:
            spans, self._spans = self._spans, []
            events, self._events = self._events, []
        if self.cuda:  # pragma: no cover - GPU only
            finished, pending, by_ref = [], [], {}
            for ev in events:
                (finished if all(e.query() for e in ev) else pending).append(ev)
            with self._lock:
                self._events.extend(pending)
            for r, s, e in finished:  # one time base per reference event
                try:
                    by_ref.setdefault(id(r), []).append((r.elapsed_time(s) / 1e3, r.elapsed_time(e) / 1e3))
                except RuntimeError:  # never stop the job over a timing: the span is dropped, and counted
                    self.dropped += 1
            return sum(union_seconds(v) for v in by_ref.values())
        return union_seconds(spans)


def attach(model, timer: CommTimer) -> tuple[bool, str]:
    """Register a timed hook on a DDP model. Returns (timed, what was done or why not)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    if not isinstance(model, DDP):
        kind = type(model).__name__
        if "FullyShardedDataParallel" in kind or hasattr(model, "reshard"):
            return False, (f"{kind}: FSDP has no hook the monitor can time without changing it; the profiler "
                           "windows give its exposed communication")
        return False, "the model is not wrapped in DistributedDataParallel: no collectives to time"
    hooks = [h for h, _ in getattr(model, "_comm_hooks", None) or []]
    if any(getattr(h, "mfu_lab_timer", None) is timer for h in hooks):
        return True, f"the job's own communication hook, timed through Monitor.wrap_hook; {timer.how}"
    if hooks:
        return False, ("DDP already has a communication hook; register it through Monitor.wrap_hook(hook) to "
                       "have it timed (DDP accepts one hook)")
    if getattr(model, "_use_python_reducer", False):
        return False, "DDP runs its Python reducer here, whose hooks take other arguments: collectives not timed"
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    try:
        model.register_comm_hook(model.process_group, timer.wrap(default_hooks.allreduce_hook))
    except RuntimeError as e:  # a built-in hook (register_builtin_comm_hook) is not listed in _comm_hooks
        return False, f"DDP refused a hook ({str(e).splitlines()[0][:160]}): it already has one; collectives not timed"
    return True, f"DDP's default all-reduce registered as a timed hook; {timer.how}"
