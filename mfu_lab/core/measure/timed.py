"""Timed training steps: per-step wall, data-wait and compute time, then their statistics.

Each step's time is split three ways on the device's own timeline:

- data: from the end of the previous step until this step's batch is on the
  device (waiting on the DataLoader, plus the host-to-device copy); on CUDA no
  more of that gap than the host spent fetching the batch and issuing its copy
  (the rest of the gap is the loop's host time, not the loader's);
- compute: from the batch being ready until the optimiser step has finished;
- host: the rest of the wall time (the loop's own bookkeeping).

On CPU everything is synchronous and ``time.perf_counter`` brackets each
phase. On CUDA the loop records CUDA events and never synchronises inside the
loop (so the host may run ahead as in real training); events are read once at
the end.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from mfu_lab.core.engine.batches import IGNORE, samples_of, to_device
from mfu_lab.core.measure.contention import Contention, ContentionProbe


@dataclass
class Timings:
    """Per-step series, warm-up steps first (``warmup_steps`` of them)."""

    wall_s: list[float]
    data_s: list[float]
    compute_s: list[float]
    loss: list[float]
    warmup_steps: int
    method: str
    peak_memory_bytes: int | None = None
    peak_memory_note: str = ""
    contention: Contention | None = None  # was the machine shared while these steps ran (core.measure.contention)
    tokens: list[int] | None = None  # per step: targets that are not padding (IGNORE), counted on the host
    padded_tokens: list[int] | None = None  # per step: every position of the batch, padding included
    samples: list[int] | None = None  # per step: the batch's samples (its first dimension)

    def measured_samples(self) -> int | None:
        """Samples over the measured steps, None when they were not counted."""
        if not self.samples:
            return None
        return sum(self.samples[self.warmup_steps:])

    def measured_tokens(self) -> tuple[int, int] | None:
        """(useful, padded) tokens over the measured steps, None when the batches had no token targets."""
        if not self.tokens or not self.padded_tokens:
            return None
        return sum(self.tokens[self.warmup_steps:]), sum(self.padded_tokens[self.warmup_steps:])

    def measured(self, name: str) -> list[float]:
        return getattr(self, name)[self.warmup_steps:]

    @property
    def host_s(self) -> list[float]:
        return [max(w - d - c, 0.0) for w, d, c in zip(self.wall_s, self.data_s, self.compute_s)]


@dataclass
class Stats:
    median: float
    p10: float
    p90: float
    mean: float
    std: float
    cv: float  # coefficient of variation: std / mean
    n: int


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolation percentile (numpy's default method), q in [0, 100]."""
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def stats(values: list[float]) -> Stats:
    if not values:
        raise ValueError("no values to summarise")
    mean = statistics.fmean(values)
    std = statistics.stdev(values) if len(values) > 1 else 0.0
    return Stats(statistics.median(values), percentile(values, 10), percentile(values, 90), mean, std,
                 std / mean if mean else 0.0, len(values))


Progress = Callable[[int, int, float], None]


def _count(batch, useful: list[int], padded: list[int], samples: list[int]) -> None:
    """Samples of one batch, and its non-padding targets when it is token ids, counted on the host before the copy
    (no device synchronisation), with numpy: no torch operator runs, so a profiled window's trace holds the job's
    operators only. A batch that is not token ids (core.engine.batches) has no tokens: its -100 scale nothing."""
    samples.append(samples_of(batch))
    if not getattr(batch, "tokens", True):
        return
    y = batch[1]
    if not isinstance(y, torch.Tensor) or y.device.type != "cpu" or y.requires_grad:
        return  # not a batch of token targets on the host: not counted (a device tensor would need a sync)
    try:
        import numpy as np

        useful.append(int(np.count_nonzero(y.numpy() != IGNORE)))
    except (ImportError, RuntimeError, TypeError):  # no numpy, or a dtype numpy lacks (bfloat16)
        return
    padded.append(y.numel())


def _kwargs(batch, device, non_blocking: bool = False) -> dict:
    """The model's extra keyword tensors a batch brings (:class:`mfu_lab.core.engine.batches.Batch`), on ``device``."""
    return {k: v.to(device, non_blocking=non_blocking) for k, v in (getattr(batch, "kwargs", None) or {}).items()}


def run_steps(step: Callable, batches: Iterable, device: torch.device, warmup: int, steps: int,
              progress: Progress | None = None, loop_end: Callable[[], None] | None = None) -> Timings:
    """Run ``warmup + steps`` training steps, timing each; ``step(x, y)`` returns the loss tensor. A step with
    ``grad_accum`` k > 1 (core.engine.workload.TrainStep) takes k micro-batches per optimizer step
    (``step.accumulate``): a time, a loss and the counted tokens and samples are an optimizer step's.
    ``loop_end`` is called as soon as the loop has synchronised and read its timings, before the contention probe
    ends (NVML, a walk of the process tree) and the losses are checked: where a profiler window closes."""
    from mfu_lab.core.process.faults import check_losses

    run = _run_cuda if device.type == "cuda" else _run_cpu
    with ContentionProbe(device.type, device.index) as probe:
        t = run(step, batches, device, warmup, steps, progress)
        if loop_end is not None:
            loop_end()
    t.contention = probe.result
    check_losses(t.loss)  # a NaN or infinite loss ends the measurement, naming the step
    return t


def _take(it, step, device, non_blocking: bool, useful, padded, samples) -> list[tuple]:
    """One optimizer step's micro-batches from ``it`` (``step.grad_accum`` of them, 1 for a plain callable), each
    counted on the host and copied to ``device``: ``[(x, y, kwargs), ...]``."""
    parts = []
    for _ in range(max(1, int(getattr(step, "grad_accum", 1) or 1))):
        batch = next(it)
        x, y = batch
        _count(batch, useful, padded, samples)
        parts.append((to_device(x, device, non_blocking), to_device(y, device, non_blocking),
                      _kwargs(batch, device, non_blocking)))
    return parts


def _call(step, parts: list[tuple]):
    """One optimizer step: ``step(x, y, **kwargs)`` for one micro-batch, ``step.accumulate(parts)`` for several."""
    if len(parts) == 1:
        x, y, kw = parts[0]
        return step(x, y, **kw)
    return step.accumulate(parts)


def _per_step(values: list[int], k: int) -> list[int]:
    """Per-micro-batch counts summed per optimizer step of ``k`` micro-batches."""
    return [sum(values[i:i + k]) for i in range(0, len(values), k)] if k > 1 else values


def _run_cpu(step, batches, device, warmup, steps, progress) -> Timings:
    n = warmup + steps
    k = max(1, int(getattr(step, "grad_accum", 1) or 1))
    wall, data, compute, losses = [], [], [], []
    it = iter(batches)
    useful, padded, samples = [], [], []
    start = prev_end = time.perf_counter()
    for i in range(n):
        t0 = time.perf_counter()
        parts = _take(it, step, device, False, useful, padded, samples)
        t1 = time.perf_counter()
        losses.append(_call(step, parts))
        end = time.perf_counter()
        wall.append(end - prev_end)
        data.append(t1 - t0)
        compute.append(end - t1)
        prev_end = end
        if progress:
            progress(i + 1, n, end - start)
    return Timings(wall, data, compute, [float(v) for v in losses], warmup,
                   "time.perf_counter around each phase (CPU runs synchronously)",
                   tokens=_per_step(useful, k) or None, padded_tokens=_per_step(padded, k) or None,
                   samples=_per_step(samples, k) or None)


def _run_cuda(step, batches, device, warmup, steps, progress) -> Timings:  # pragma: no cover - GPU only
    n = warmup + steps
    ev = lambda: torch.cuda.Event(enable_timing=True)  # noqa: E731
    ready, done = [ev() for _ in range(n)], [ev() for _ in range(n)]
    origin = ev()
    losses = []
    torch.cuda.reset_peak_memory_stats(device)
    it = iter(batches)
    torch.cuda.synchronize(device)  # sync point: start from an idle device
    start = time.perf_counter()
    origin.record()
    fetch = []  # host seconds spent getting each batch and issuing its copy: the only part that is data wait
    useful, padded, samples = [], [], []
    k = max(1, int(getattr(step, "grad_accum", 1) or 1))
    for i in range(n):
        t0 = time.perf_counter()
        parts = _take(it, step, device, True, useful, padded, samples)
        fetch.append(time.perf_counter() - t0)
        ready[i].record()
        losses.append(_call(step, parts))
        done[i].record()
        if progress:
            progress(i + 1, n, time.perf_counter() - start)
    torch.cuda.synchronize(device)  # sync point: every event has completed before we read them
    wall, data, compute = [], [], []
    prev = origin
    for r, d, f in zip(ready, done, fetch):
        w = prev.elapsed_time(d) / 1e3
        c = r.elapsed_time(d) / 1e3
        wall.append(w)
        compute.append(c)
        # the device's wait before the batch was ready, as far as the host was fetching it; the rest of that
        # wait is the loop's own host time (launch overhead), left to host = wall - data - compute
        data.append(min(max(w - c, 0.0), f))
        prev = d
    return Timings(wall, data, compute, torch.stack(losses).float().cpu().tolist(), warmup,
                   "CUDA events on the device timeline (no synchronisation inside the loop); data wait: the "
                   "device's idle time before each batch was ready, up to the host's time fetching it",
                   torch.cuda.max_memory_allocated(device), "torch.cuda.max_memory_allocated",
                   tokens=_per_step(useful, k) or None, padded_tokens=_per_step(padded, k) or None,
                   samples=_per_step(samples, k) or None)


def interleaved(timers: dict[str, Callable[[int], list[float]]], rounds: int, steps: int) -> dict[str, list[float]]:
    """Time candidates in turn rather than each once: ``rounds`` rounds, each running every ``timers[label](n)``
    (which times ``n`` steps and returns their walls) in order, the order reversed every other round, so a drift
    of the machine (clocks, heat, a neighbour) falls on every candidate alike. ``steps`` are spread over the
    rounds (at least one per round). Returns every label's walls, all rounds together."""
    rounds = max(1, min(rounds, steps))
    per = [steps // rounds + (1 if r < steps % rounds else 0) for r in range(rounds)]
    out: dict[str, list[float]] = {label: [] for label in timers}
    order = list(timers)
    for r, n in enumerate(per):
        for label in (order if r % 2 == 0 else order[::-1]):
            out[label].extend(timers[label](n))
    return out


def profile_steps(step, batches, device: torch.device, warmup: int, active: int, trace_path: Path,
                  progress=None) -> Timings:
    """Run ``warmup + active`` steps under torch.profiler, recording the last ``active`` of them.

    Shapes are recorded; the trace is exported to ``trace_path`` (gzipped when it ends in .gz), under a
    partial name first and renamed when complete. ``step(x, y)`` returns the loss. Read the trace with
    :func:`mfu_lab.analysis.trace.breakdown.load_trace`.
    """
    from torch.profiler import ProfilerActivity, profile, schedule

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    trace_path = Path(trace_path)
    trace_path.parent.mkdir(parents=True, exist_ok=True)
    tmp = trace_path.with_name(trace_path.name.replace(".json", ".partial.json"))
    ready = []  # the trace is exported after the loop, so no timed step pays for the export
    with without_usdt_lines(), profile(activities=activities, record_shapes=True,
                                        schedule=schedule(wait=0, warmup=warmup, active=active, repeat=1),
                                        on_trace_ready=ready.append) as prof:
        calls = {"n": 0}

        def stepped(*args, **kw):  # (x, y, **kw), or one optimizer step's micro-batches (grad_accum)
            loss = step(*args, **kw) if len(args) == 2 else step.accumulate(*args)
            calls["n"] += 1
            if calls["n"] == warmup and device.type == "cuda":  # pragma: no cover - GPU only
                # sync point: the warm-up's kernels finish before the recorded window opens at prof.step()
                torch.cuda.synchronize(device)
            if calls["n"] < warmup + active:
                prof.step()  # the profiler's step boundary: ProfilerStep#N spans in the trace
            return loss

        stepped.grad_accum = getattr(step, "grad_accum", 1)
        stepped.accumulate = stepped
        # the last boundary stops the recording: after the loop's own synchronisation (the window ends with the
        # device's last kernel), outside the timed steps, so none pays for it, and before the contention probe's
        # end (NVML, the process tree: about 31 ms in the first H200 run's window of 5 steps)
        timings = run_steps(stepped, batches, device, warmup, active, progress, loop_end=prof.step)
    if ready:
        ready[0].export_chrome_trace(str(tmp))
    if not tmp.is_file():
        raise RuntimeError(f"torch.profiler exported no trace to {tmp}")
    tmp.replace(trace_path)
    return timings


@contextlib.contextmanager
def without_usdt_lines():
    """Some torch builds' Kineto print 'USDT: ... profiler_start/stop' on the C++ stderr at every start and
    stop; notebooks show them as errors. Hold the process's stderr (fd 2) while profiling and pass on every
    other line afterwards."""
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError):  # no real fd 2 (some embedded interpreters): leave stderr alone
        yield
        return
    with tempfile.TemporaryFile() as held:
        os.dup2(held.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            held.seek(0)
            rest = [ln for ln in held.read().decode("utf-8", "replace").splitlines(True) if not ln.startswith("USDT:")]
            if rest:
                sys.stderr.write("".join(rest))
                sys.stderr.flush()
