"""The production monitor: a few lines in the user's own training loop, one JSON-lines file per rank.

::

    from mfu_lab.monitor import Monitor

    with Monitor("mon/", model=model) as mon:       # or mon = Monitor(...).start() ... mon.close()
        for batch in mon.loader(train_loader):      # times the waits for data
            loss = train_step(batch)
            mon.step(tokens=batch["input_ids"].numel())

Work that is not tokens (images, rows of a table) is counted in samples instead: ``mon.step(samples=len(images))``
gives samples/s, and MFU from ``flops_per_sample`` (the job's formula) or from the FLOPs counted in one step;
the records name the unit (``unit``: ``tokens/s`` or ``samples/s``).

A loop without a loader times its own fetch with ``with mon.fetch(): x, y = get_batch()`` (or passes
``step(data_wait_s=...)``), and may mark evaluation, checkpoints and logging with ``with mon.other(): ...``.
``step()`` without ``with`` or ``start()`` starts the monitor on the first call.

Per step the monitor takes a few clock readings on the host (no device synchronisation):

- the step's wall time: from one ``step()`` call to the next;
- data wait, only where it was timed: inside the wrapped loader's ``next()``, inside ``fetch()``, or given as
  ``step(data_wait_s=...)`` (a framework adapter); an interval without any is recorded as ``data_timed: false``
  and ``data_s: null`` ("not timed"), never as 0;
- other time (``other_s``): evaluation, checkpoints and logging between steps, marked by ``other()`` or by an
  adapter from the framework's own hooks;
- host time outside the step (with the wrapped loader only): from ``step()`` returning to the loader being asked
  for the next batch;

and, for a DDP model, the communication time from the communication hook (:mod:`mfu_lab.monitor.comm`).
Every ``every`` steps one ``interval`` record is appended (:mod:`mfu_lab.monitor.intervals`; the fields and their
contract: :mod:`mfu_lab.core.store.monitor_files`). MFU and tokens/s are over the training steps and the data wait,
with the other time left out, as Lightning's ``ThroughputMonitor`` leaves evaluation out::

    mfu = flops_per_step * steps / ((wall_s - other_s) * peak_flops_per_s)

At a low duty cycle a torch.profiler window of ``profile_steps`` steps is taken (the first at the first interval
boundary, so a short job gets one too, then one every ``profile_every_s`` seconds; a run shorter than ``every``
+ 2 + ``profile_steps`` steps gets none), its steps left out of the timing and its analysis run off the loop
(:mod:`mfu_lab.monitor.profiling`); no window opens while the last one's analysis is still running.

FLOPs: ``flops_per_token`` (with ``step(tokens=)``) or ``flops_per_sample`` (with ``step(samples=)``) when given
(the job's formula: analytic); otherwise, with ``model``, one training
step is counted with the workbook's counter (:mod:`mfu_lab.monitor.flops_window`: the window between the first
and the second ``step()``, or an adapter's batch hooks; a window with an evaluation in it is replaced by the
next) and left out of the timing. Peak: ``peak_flops`` when given; else :mod:`mfu_lab.monitor.setup`.

Never a harm to the job: bad arguments raise here, at construction, before training starts. After that every
failure inside the monitor (a folder it cannot write, the open-file limit, a failed rotation, a non-finite token
count, a failed analysis) is counted in ``Monitor.errors``, warned about once per kind, and training goes on
(:mod:`mfu_lab.monitor.records`).

Threads and forks: ``step()`` may move to another thread (the FLOP window then opens again there, and no counting
mode stays on either thread: :mod:`mfu_lab.monitor.flops_window`). A forked child (a DataLoader worker, or a process
that goes on with the loop) records nothing: the file, the rank and the run are the parent's, so the child's copy
of the monitor is closed at the fork without writing, and an open FLOP window is taken off its thread.
"""

from __future__ import annotations

import os
import threading
import time
import traceback
import weakref
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from mfu_lab.core import __version__
from mfu_lab.core.store.monitor_files import RecordWriter, record_path, safe_host
from mfu_lab.monitor import setup
from mfu_lab.monitor.comm import CommTimer, attach
from mfu_lab.monitor.context import NvmlProbe, launch_id, ranks, run_id, scheduler_env, slurm_queue
from mfu_lab.monitor.flops_window import CountsOneStep, StepFlops
from mfu_lab.monitor.intervals import SplitsSteps
from mfu_lab.monitor.profiling import ProfileWindows
from mfu_lab.monitor.records import WritesRecords

_LIVE: weakref.WeakSet = weakref.WeakSet()  # the monitors of this process, for the fork handler below


def _after_fork_in_child() -> None:
    for mon in list(_LIVE):
        mon._forked()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


class Monitor(CountsOneStep, SplitsSteps, WritesRecords):
    def __init__(self, out_dir: str | os.PathLike, *, model: torch.nn.Module | None = None,
                 flops_per_token: float | None = None, peak_flops: float | None = None, every: int = 50,
                 dtype: str | None = None, profile_every_s: float | None = 1800.0, profile_steps: int = 3,
                 nvml_interval_s: float = 1.0, fsync_s: float = 60.0, max_bytes: int = 64 * 2**20,
                 tensorboard: bool = False, count_flops: bool = True, keep_traces: int = 2, run: str | None = None,
                 flops_per_sample: float | None = None):
        setup.check(out_dir, model=model, flops_per_token=flops_per_token, peak_flops=peak_flops, every=every,
                    dtype=dtype, profile_every_s=profile_every_s, profile_steps=profile_steps,
                    nvml_interval_s=nvml_interval_s, fsync_s=fsync_s, max_bytes=max_bytes, keep_traces=keep_traces,
                    run=run, flops_per_sample=flops_per_sample)
        self.out_dir, self.model, self.every = Path(out_dir), model, every
        self.flops_per_token, self.peak_flops, self.dtype = flops_per_token, peak_flops, dtype
        self.flops_per_sample = flops_per_sample
        self.profile_every_s, self.profile_steps, self.keep_traces = profile_every_s, profile_steps, keep_traces
        self.nvml_interval_s, self.fsync_s, self.max_bytes = nvml_interval_s, fsync_s, max_bytes
        self.tensorboard, self.count_flops, self.run_given = tensorboard, count_flops, run
        self.ids = ranks()
        self.host = safe_host()
        self.launch = self.run = ""
        self.cuda = setup.device_type(model) == "cuda"
        self.comm = CommTimer(self.cuda)
        self.steps_done = 0
        self.flops_per_step: float | None = None
        self.errors: dict[str, int] = {}  # the monitor's own failures, by kind (the job went on)
        self.write_errors = 0
        self.framework = ""  # set by an adapter: FLOPs counted between its batch hooks, data timed from its hooks
        # set by an adapter whose framework keeps a FLOP figure of its own, before close(): {"name", "per_step",
        # "steps", "how"}, recorded in the end record so that the report can say how far it is from the count
        self.framework_flops: dict[str, Any] | None = None
        self._writer: RecordWriter | None = None
        self._writer_path: Path | None = None
        self._unwritten_start: dict[str, Any] | None = None
        self._started = self._closed = self._writer_closed = False
        self._peak_flops, self._comm_timed, self.nvml, self._tb = None, False, None, None
        self._flops: StepFlops | None = None
        self._prof: ProfileWindows | None = None
        self._next_profile: float | None = None  # when the next profiler window may open (None: never)
        self._reset_pending()
        self._reset_interval()
        self._mark = time.perf_counter()
        self._host_from: float | None = None
        self._pid = os.getpid()  # a record is written by this process only (records.WritesRecords._emit)
        _LIVE.add(self)

    # ------------------------------------------------------------------ public
    def wrap_hook(self, hook):
        """The job's own DDP communication hook, timed: ``ddp.register_comm_hook(state, mon.wrap_hook(hook))``."""
        return self.comm.wrap(hook)

    def __enter__(self) -> Monitor:
        self.start()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        why = "closed" if exc_type is None else "".join(traceback.format_exception_only(exc_type, exc)).strip()
        self.close(why)

    def start(self) -> Monitor:
        """Open the record file, look up the peak, write the start record. Never raises: what cannot be set up is
        counted in ``errors`` and warned about."""
        if self._started:
            return self
        self._started = True
        try:
            self._start()
        except Exception as e:
            self._fail("start", e)
        self._reset_pending()
        self._reset_interval()
        self._mark = time.perf_counter()
        return self

    def loader(self, iterable: Iterable) -> Iterator:
        """Yield the batches of ``iterable``, timing each wait for the next one (data wait) and the host time
        between a ``step()`` call and the next request (host time outside the step)."""
        if not self._started:
            self.start()
        it = iter(iterable)
        while True:
            t0 = time.perf_counter()
            if self._host_from is not None:
                self._host_pending += t0 - self._host_from
                self._host_from = None
                self._host_timed = True
            try:
                batch = next(it)
            except StopIteration:
                return
            self._data_pending += time.perf_counter() - t0
            self._data_timed = True
            yield batch

    @contextmanager
    def fetch(self):
        """``with mon.fetch(): x, y = get_batch()``: the time inside is data wait (for loops without a loader)."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self._data_pending += time.perf_counter() - t0
            self._data_timed = True

    @contextmanager
    def other(self):
        """``with mon.other(): evaluate()``: time between training steps that is neither training nor data
        (evaluation, checkpoints, logging); recorded as ``other_s`` and left out of MFU."""
        t0 = time.perf_counter()
        if self._flops is not None:
            self._flops.taint("Monitor.other() ran inside the window")
        try:
            yield
        finally:
            self._other_pending += time.perf_counter() - t0

    def batch_begin(self) -> None:
        """Adapters: the training computation of the current step starts (FLOPs are counted only between
        ``batch_begin`` and ``batch_end``, until one step is counted)."""
        if self._flops is not None and not self._closed:
            try:
                self._flops.resume()
            except Exception as e:
                self._give_up_count(e)

    def batch_end(self) -> None:
        if self._flops is not None:
            try:
                self._flops.pause()
            except Exception as e:
                self._give_up_count(e)

    def step(self, tokens: int | None = None, data_wait_s: float | None = None, host_s: float | None = None,
             other_s: float | None = None, samples: int | None = None) -> None:
        """Mark the end of one training step: ``tokens`` processed in it (for tokens/s and MFU), or for work that
        is not tokens (images, rows) ``samples`` (for samples/s and MFU; both may be given, and tokens/s is then
        the record's unit); ``data_wait_s`` / ``host_s`` / ``other_s`` when the caller timed the data wait, host
        work or evaluation/checkpoint/logging time between steps itself (framework adapters). Never raises; after
        :meth:`close` it does nothing."""
        if self._closed:
            return
        if not self._started:
            self.start()  # the first step() starts the monitor: this step is its warm-up, as after start()
        try:
            self._step(time.perf_counter(), tokens, data_wait_s, host_s, other_s, samples)
        except Exception as e:
            self._fail("step", e)
        self._host_from = time.perf_counter()  # the monitor's own time from here on counts as host time

    def close(self, why: str = "closed") -> None:
        if not self._started or self._closed:
            return
        self._closed = True
        try:
            if self._flops is not None:
                f, self._flops = self._flops, None
                f.close()
                self._emit("flops", source=None, step=self.steps_done, rejected_windows=f.rejected,
                           note=f"the run ended after {self.steps_done} step(s), before a training step's window was "
                                "counted (it needs two step() calls, and a window without an evaluation): MFU is not "
                                "computed")
            if self._prof is not None:
                self._prof.stop()  # waits for a window still being analysed, so its record is written
            tail = 0 if self._iv["durs"] else self._iv["profiled"]  # profiled steps after the last timed one
            if self._iv["durs"]:
                self._interval(partial=True)
            if self.nvml is not None:
                self.nvml.stop()
            self._emit("end", steps=self.steps_done, reason=why, errors=dict(self.errors), profiled_steps=tail,
                       **({"framework": self.framework_flops} if self.framework_flops else {}))
        except Exception as e:
            self._fail("close", e)
        finally:
            writer, self._writer, self._writer_closed = self._writer, None, True
            for closing in (writer, self._tb):
                try:
                    if closing is not None:
                        closing.close()
                except Exception as e:
                    self._fail("close", e)

    def _forked(self) -> None:
        """In a forked child: closed without a record (the parent's file, rank and run are not the child's), the
        writer's descriptor left to the parent, an open FLOP window taken off this thread. Never raises."""
        self._closed = self._writer_closed = True
        self._writer, self._prof, self.nvml, self._tb = None, None, None, None
        f, self._flops = self._flops, None
        try:
            if f is not None:
                f.drop_in_child()
        except Exception:  # noqa: BLE001 - the child goes on, as the job does after any failure in the monitor
            pass

    # ------------------------------------------------------------------ start and steps
    def _start(self) -> None:
        now = time.time()
        self.launch = launch_id(fallback=f"local:{self.host}:{os.getpid()}:{now:.3f}")
        self.run = run_id(self.run_given, self.host, now)
        self._writer_path = record_path(self.out_dir, self.host, self.ids["rank"], self.run)
        try:
            self._writer = RecordWriter(self._writer_path, self.fsync_s, self.max_bytes)
        except Exception as e:  # an unwritable folder, the open-file limit: retried at each record
            self._fail("write", e)
        device = setup.device_info(self.model, self.cuda)
        dtype = setup.train_dtype(self.model, self.dtype)
        wants_peak = self.peak_flops is not None or self.flops_per_token is not None or \
            self.flops_per_sample is not None or (self.model is not None and self.count_flops)
        peak = setup.peak_record(device, dtype, self.dtype, self.peak_flops) if wants_peak else None
        self._peak_flops = peak["flops_per_s"] if peak else None
        self._comm_timed, comm_how = attach(self.model, self.comm) if self.model is not None else \
            (False, "no model given: collectives not timed")
        nvml_why = "CPU run: NVML reads NVIDIA GPUs only"
        if self.cuda:  # pragma: no cover - GPU only
            self.nvml = NvmlProbe(device.index or 0, self.nvml_interval_s).start()
            nvml_why = self.nvml.skipped
        self._tb, tb_why = setup.tensorboard(self.tensorboard, self.out_dir / "tensorboard"
                                             / f"{self.host}-{self.run}-rank{self.ids['rank']}")
        counting = (self.flops_per_token is None and self.flops_per_sample is None and self.model is not None
                    and self.count_flops)
        window = ("between the framework's batch-start and batch-end hooks of one optimizer step" if self.framework
                  else "between the first and the second step() calls (one training iteration)")
        flops = ({"per_token": float(self.flops_per_token), "source": "analytic", "unit": "tokens",
                  "note": "flops_per_token given to the monitor (the job's formula)"} if self.flops_per_token else
                 {"per_sample": float(self.flops_per_sample), "source": "analytic", "unit": "samples",
                  "note": "flops_per_sample given to the monitor (the job's formula): MFU from step(samples=)"}
                 if self.flops_per_sample else
                 {"source": "counted", "note": f"one training step counted {window}, with the workbook's counter "
                  "(fused attention counted); a window with an evaluation in it is replaced by the next"}
                 if counting else
                 {"source": None, "note": "no flops_per_token, flops_per_sample or model given: MFU is not "
                  "computed"})
        data = ({"how": f"{self.framework}: the gap before each batch, less the evaluation, checkpoint and logging "
                 "time its hooks mark (other_s)"} if self.framework else
                {"how": "the wrapped loader's next(), Monitor.fetch() or step(data_wait_s=); an interval with none "
                 "of them says data_timed false (not timed)"})
        self._emit("start", pid=os.getpid(), world=self.ids["world"], local_rank=self.ids["local_rank"],
                   node_rank=self.ids["node_rank"], device={"type": device.type, "name": device.name},
                   peak=peak, flops=flops, data=data, comm={"timed": self._comm_timed, "how": comm_how},
                   nvml={"sampled": bool(self.nvml and not self.nvml.skipped), "why": nvml_why},
                   tensorboard=tb_why, scheduler=scheduler_env(), mfu_lab=__version__, torch=torch.__version__,
                   framework=self.framework or None,
                   settings={"every": self.every, "profile_every_s": self.profile_every_s,
                             "profile_steps": self.profile_steps, "dtype": dtype, "max_bytes": self.max_bytes})
        slurm_id = os.environ.get("SLURM_JOB_ID")
        if slurm_id and self.ids["rank"] == 0:
            threading.Thread(target=self._cluster_record, args=(slurm_id,), daemon=True).start()
        if counting:
            self._flops = StepFlops(self.model)
        if self.profile_every_s:
            self._prof = ProfileWindows(self.out_dir, f"{self.host}-{self.run}-rank{self.ids['rank']}", self.cuda,
                                        self.profile_steps, self.keep_traces, self._emit, self._fail)
            self._next_profile = time.monotonic()

    def _step(self, now: float, tokens, data_wait_s, host_s, other_s, samples=None) -> None:
        tokens = self._tokens(tokens)
        samples = self._tokens(samples, "samples")
        given = [self._seconds(v) for v in (data_wait_s, host_s, other_s)]
        data, data_timed, host, host_timed, other = self._take_pending(given)
        dur, self._mark = now - self._mark, now
        self.steps_done += 1
        counted = self._count(tokens, samples)
        if self.steps_done == 1 or counted:  # the warm-up, and a step counted under the FLOP counter: not timed
            self.comm.discard()
            return
        if self._prof is not None and self._prof.open:
            self._add_profiled(dur)
            if self._prof.step():  # the window closed: its stop is not the next step's time
                self._next_profile = time.monotonic() + self.profile_every_s
                self.comm.discard()  # the window's collectives belong to steps left out of the timing
                self._mark = time.perf_counter()
            return
        if self._add_timed(dur, other, data, data_timed, host, host_timed, tokens, samples):
            self._interval()
            if (self._next_profile is not None and self._flops is None and time.monotonic() >= self._next_profile
                    and not self._prof.analysing):  # one window's child at a time: none piles up on the cores
                try:
                    self._prof.start()
                except Exception as e:
                    self._fail("profiler", e)
                    self._next_profile = time.monotonic() + self.profile_every_s

    def _cluster_record(self, job_id: str) -> None:
        self._emit("cluster", slurm=slurm_queue(job_id))  # a no-op once closed
