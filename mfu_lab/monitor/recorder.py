"""The production monitor: a few lines in the user's own training loop, one JSON-lines file per rank.

::

    from mfu_lab.monitor import Monitor

    with Monitor("mon/", model=model) as mon:
        for batch in mon.loader(train_loader):      # times the waits for data
            loss = train_step(batch)
            mon.step(tokens=batch["input_ids"].numel())

Per step the monitor takes three clock readings on the host (no device synchronisation):

- the step's wall time: from one ``step()`` call to the next;
- data wait: the time spent inside the loader's ``next()`` (through :meth:`Monitor.loader`, or given as
  ``step(data_wait_s=...)`` by a framework callback);
- host time outside the step: from ``step()`` returning to the loader being asked for the next batch (logging,
  checkpoints, evaluation between steps; the monitor's own bookkeeping counts here too);

and, for a DDP model, the communication time from the communication hook (:mod:`mfu_lab.monitor.comm`).
Every ``every`` steps one ``interval`` record is appended (see :mod:`mfu_lab.core.monitor_files`). At a low duty
cycle a torch.profiler window of ``profile_steps`` steps is taken (the first at the first interval boundary, so
a short job gets one too, then one every ``profile_every_s`` seconds) and its breakdown recorded with the
workbook's trace analysis; those steps are left out of the timing statistics.

FLOPs: ``flops_per_token`` when given (the job's formula: analytic); otherwise, with ``model``, the first step
runs under torch's FlopCounterMode (counted: everything the step ran, forward and backward, recomputation
included) and is left out of the timing. Peak: ``peak_flops`` when given; on a GPU the datasheet row of
:mod:`mfu_lab.core.device`; on a CPU this CPU's measured matmul rate, the same cached peak step 1 uses
(:mod:`mfu_lab.core.peak_cache`: measured once per machine and dtype, re-checked at start with five short probes).
"""

from __future__ import annotations

import os
import statistics
import time
import traceback
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch

from mfu_lab.core import __version__
from mfu_lab.core.device import DeviceInfo, cpu_name, resolve_peak
from mfu_lab.core.measure import percentile, without_usdt_lines
from mfu_lab.core.monitor_files import VERSION, RecordWriter, record_path, safe_host
from mfu_lab.monitor.comm import CommTimer, attach
from mfu_lab.monitor.context import NvmlProbe, launch_id, ranks, scheduler_env, slurm_queue


class Monitor:
    def __init__(self, out_dir: str | os.PathLike, *, model: torch.nn.Module | None = None,
                 flops_per_token: float | None = None, peak_flops: float | None = None, every: int = 50,
                 dtype: str | None = None, profile_every_s: float | None = 1800.0, profile_steps: int = 3,
                 nvml_interval_s: float = 1.0, fsync_s: float = 60.0, max_bytes: int = 64 * 2**20,
                 tensorboard: bool = False, count_flops: bool = True, keep_traces: int = 2):
        if not isinstance(every, int) or every < 1:
            raise ValueError(f"Monitor(every={every!r}): must be a whole number of steps >= 1")
        if profile_every_s is not None and not profile_every_s > 0:
            raise ValueError(f"Monitor(profile_every_s={profile_every_s!r}): seconds > 0, or None for no profiling")
        if not isinstance(profile_steps, int) or profile_steps < 1:
            raise ValueError(f"Monitor(profile_steps={profile_steps!r}): must be a whole number >= 1")
        if dtype is not None and dtype not in ("float32", "bfloat16", "float16"):
            raise ValueError(f"Monitor(dtype={dtype!r}): one of float32, bfloat16, float16 (the training dtype "
                             "whose peak MFU is measured against)")
        self.out_dir, self.model, self.every = Path(out_dir), model, every
        self.flops_per_token, self.peak_flops, self.dtype = flops_per_token, peak_flops, dtype
        self.profile_every_s, self.profile_steps, self.keep_traces = profile_every_s, profile_steps, keep_traces
        self.nvml_interval_s, self.fsync_s, self.max_bytes = nvml_interval_s, fsync_s, max_bytes
        self.tensorboard, self.count_flops = tensorboard, count_flops
        self.ids = ranks()
        self.host = safe_host()
        self.launch = ""
        self.cuda = self._device_type() == "cuda"
        self.comm = CommTimer(self.cuda)
        self.steps_done = 0
        self.flops_per_step: float | None = None
        self._writer: RecordWriter | None = None
        self._started = self._closed = False
        self.write_errors = 0

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
        if self._started:
            return self
        self._started = True
        now = time.time()
        self.launch = launch_id(fallback=f"local:{self.host}:{os.getpid()}:{now:.3f}")
        self._writer = RecordWriter(record_path(self.out_dir, self.host, self.ids["rank"]), self.fsync_s,
                                    self.max_bytes)
        device = self._device()
        peak = self._peak(device)
        comm_timed, comm_how = attach(self.model, self.comm) if self.model is not None else \
            (False, "no model given: collectives not timed")
        self._comm_timed = comm_timed
        self.nvml = None
        nvml_why = "CPU run: NVML reads NVIDIA GPUs only"
        if self.cuda:  # pragma: no cover - GPU only
            self.nvml = NvmlProbe(device.index or 0, self.nvml_interval_s).start()
            nvml_why = self.nvml.skipped
        self._tb, tb_why = self._tensorboard()
        flops = ({"per_token": float(self.flops_per_token), "source": "analytic",
                  "note": "flops_per_token given to the monitor (the job's formula)"}
                 if self.flops_per_token else
                 {"source": "counted", "note": "counted on the first step with FlopCounterMode"}
                 if self.model is not None and self.count_flops else
                 {"source": None, "note": "no flops_per_token and no model given: MFU is not computed"})
        self._emit("start", pid=os.getpid(), world=self.ids["world"], local_rank=self.ids["local_rank"],
                   node_rank=self.ids["node_rank"], device={"type": device.type, "name": device.name},
                   peak=peak, flops=flops, comm={"timed": comm_timed, "how": comm_how},
                   nvml={"sampled": bool(self.nvml and not self.nvml.skipped), "why": nvml_why},
                   tensorboard=tb_why, scheduler=scheduler_env(), mfu_lab=__version__, torch=torch.__version__,
                   settings={"every": self.every, "profile_every_s": self.profile_every_s,
                             "profile_steps": self.profile_steps, "dtype": self._dtype()})
        self._peak_flops = peak["flops_per_s"] if peak else None
        slurm_id = os.environ.get("SLURM_JOB_ID")
        if slurm_id and self.ids["rank"] == 0:
            import threading

            threading.Thread(target=self._cluster_record, args=(slurm_id,), daemon=True).start()
        self._t_wall0 = time.time()
        self._reset_interval()
        self._mark = time.perf_counter()
        self._host_from: float | None = None
        self._data_pending = 0.0
        self._host_pending = 0.0
        self._counter = None
        if self.flops_per_token is None and self.model is not None and self.count_flops:
            from torch.utils.flop_counter import FlopCounterMode

            self._counter = FlopCounterMode(display=False)
            self._counter.__enter__()
        self._next_profile = time.monotonic() if self.profile_every_s else None
        self._prof = None
        self._prof_left = 0
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
            try:
                batch = next(it)
            except StopIteration:
                return
            self._data_pending += time.perf_counter() - t0
            yield batch

    def step(self, tokens: int | None = None, data_wait_s: float | None = None, host_s: float | None = None) -> None:
        """Mark the end of one training step: ``tokens`` processed in it (for tokens/s and MFU), and
        ``data_wait_s`` / ``host_s`` when the caller timed the data wait or host work between steps itself
        (framework callbacks). After :meth:`close` it does nothing."""
        if self._closed:
            return
        if not self._started:
            self.start()
        now = time.perf_counter()
        if data_wait_s is not None:
            self._data_pending += float(data_wait_s)
        if host_s is not None:
            self._host_pending += float(host_s)
        dur, self._mark = now - self._mark, now
        data, host = self._data_pending, self._host_pending
        self._data_pending = self._host_pending = 0.0
        self.steps_done += 1
        if self.steps_done == 1:  # warm-up (and, without a formula, counted under FlopCounterMode): not timed
            if self._counter is not None:
                self._finish_count(tokens)
            self.comm.discard()
        elif self._prof is not None:
            if self._profile_step(dur):  # the window closed and was analysed: that time is not the job's
                now = time.perf_counter()
                self._mark = now
        else:
            iv = self._iv
            iv["durs"].append(dur)
            iv["data"] += data
            iv["host"] += host
            if tokens is not None:
                iv["tokens"] = (iv["tokens"] or 0) + int(tokens)
            if len(iv["durs"]) >= self.every:
                self._interval()
                if self._next_profile is not None and time.monotonic() >= self._next_profile:
                    self._start_profile()
        self._host_from = time.perf_counter()  # the monitor's own time from here on counts as host time

    def close(self, why: str = "closed") -> None:
        if not self._started or self._closed:
            return
        self._closed = True
        if self._counter is not None:
            self._counter.__exit__(None, None, None)
            self._counter = None
        if self._prof is not None:
            self._prof.stop()
            self._prof = None
        if self._iv["durs"]:
            self._interval(partial=True)
        if self.nvml is not None:
            self.nvml.stop()
        self._emit("end", steps=self.steps_done, reason=why)
        writer, self._writer = self._writer, None
        writer.close()
        if self._tb is not None:
            self._tb.close()

    # ------------------------------------------------------------------ records
    def _emit(self, kind: str, **fields: Any) -> None:
        """Append one record. A record that cannot be written (a full disk, a closed file) is counted in
        ``write_errors`` and warned about once: the monitor never stops the training job."""
        rec = {"kind": kind, "v": VERSION, "t": time.time(), "launch": self.launch, "rank": self.ids["rank"],
               "node": self.host, **fields}
        writer = self._writer
        if writer is None:
            return
        try:
            writer.write(rec)
        except (OSError, ValueError, TypeError) as e:
            self.write_errors += 1
            if self.write_errors == 1:
                import warnings

                warnings.warn(f"mfu-lab monitor: a record could not be written to {writer.path} ({e}); training "
                              "goes on, later failures are counted in Monitor.write_errors", stacklevel=3)

    def _reset_interval(self) -> None:
        self._iv: dict[str, Any] = {"t0": time.time(), "durs": [], "data": 0.0, "host": 0.0, "tokens": None,
                                    "profiled": 0, "profiled_s": 0.0}

    def _interval(self, partial: bool = False) -> None:
        iv, durs = self._iv, self._iv["durs"]
        wall = sum(durs)
        comm = self.comm.take() if self._comm_timed else None
        tokens = iv["tokens"]
        mfu = None
        if self._peak_flops and wall > 0:
            if self.flops_per_token and tokens:
                mfu = self.flops_per_token * tokens / (wall * self._peak_flops)
            elif self.flops_per_step:
                mfu = self.flops_per_step * len(durs) / (wall * self._peak_flops)
        gpu = self.nvml.take() if self.nvml is not None else None
        rec = {
            "t0": iv["t0"], "step": self.steps_done, "steps": len(durs), "partial": partial,
            "step_s": {"median": statistics.median(durs), "p90": percentile(durs, 90), "max": max(durs),
                       "mean": wall / len(durs)},
            "wall_s": wall, "data_s": iv["data"], "host_s": iv["host"], "comm_s": comm,
            "tokens": tokens, "tokens_per_s": tokens / wall if tokens and wall > 0 else None, "mfu": mfu,
            "profiled_steps": iv["profiled"], "profiled_s": iv["profiled_s"], "gpu": gpu,
        }
        self._emit("interval", **rec)
        if self._tb is not None:
            for name, value in (("mfu", mfu), ("tokens_per_s", rec["tokens_per_s"]),
                                ("step_s_median", rec["step_s"]["median"]), ("data_share", iv["data"] / wall),
                                ("comm_share", comm / wall if comm is not None else None)):
                if value is not None:
                    self._tb.add_scalar(f"mfu_lab/{name}", value, self.steps_done)
        self._reset_interval()
        self.comm.new_interval()

    def _finish_count(self, tokens: int | None) -> None:
        counter, self._counter = self._counter, None
        counter.__exit__(None, None, None)
        total = float(counter.get_total_flops())
        if total <= 0:
            self._emit("flops", source=None, note="FlopCounterMode counted no FLOPs on the first step (a compiled "
                       "or custom-kernel model?): pass flops_per_token")
            return
        if tokens:
            self.flops_per_token = total / tokens
        self.flops_per_step = total
        self._emit("flops", source="counted", per_step=total, per_token=self.flops_per_token, tokens=tokens,
                   note="FlopCounterMode over the first step as it ran (forward and backward; recomputation, if "
                        "any, included); that step is left out of the timing")

    # ------------------------------------------------------------------ profiler windows
    def _start_profile(self) -> None:
        from torch.profiler import ProfilerAction, ProfilerActivity, profile

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
        # a schedule that always records: it also turns on the ProfilerStep#N spans the trace analysis needs
        self._prof = profile(activities=acts, record_shapes=False, schedule=lambda _: ProfilerAction.RECORD)
        with without_usdt_lines():
            self._prof.start()  # opens ProfilerStep#0; each later step() closes one and opens the next
        self._prof_left = self.profile_steps
        self._prof_t0 = time.perf_counter()

    def _profile_step(self, dur: float) -> bool:
        """One step of a profiler window; True when it was the last (the window was analysed)."""
        self._iv["profiled"] += 1
        self._iv["profiled_s"] += dur
        self._prof_left -= 1
        if self._prof_left > 0:
            self._prof.step()
            return False
        prof, self._prof = self._prof, None
        t0 = time.perf_counter()
        with without_usdt_lines():
            prof.stop()
        fields: dict[str, Any] = {"steps": self.profile_steps}
        try:
            fields.update(self._analyse(prof))
        except Exception as e:  # a failed analysis costs one record, never the training job
            fields["error"] = f"{type(e).__name__}: {e}"
        fields["overhead_s"] = time.perf_counter() - t0
        self._emit("profile", **fields)
        self._next_profile = time.monotonic() + self.profile_every_s
        self.comm.discard()  # the window's collectives belong to steps left out of the timing
        return True

    def _analyse(self, prof) -> dict[str, Any]:
        from mfu_lab.analysis.trace import analyse
        from mfu_lab.analysis.trace_events import load_trace

        traces = self.out_dir / "traces"
        traces.mkdir(parents=True, exist_ok=True)
        name = traces / f"{self.host}-rank{self.ids['rank']}-{int(time.time())}.json.gz"
        prof.export_chrome_trace(str(name))  # torch gzips a path ending in .gz
        a = analyse(load_trace(name), top_n=5)
        kept = sorted(traces.glob(f"{self.host}-rank{self.ids['rank']}-*.json.gz"))
        for old in kept[:-self.keep_traces] if self.keep_traces > 0 else kept:
            old.unlink(missing_ok=True)
        b = a.breakdown
        return {"window_s": a.window_s, "trace_kind": a.kind, "steps_in_trace": a.steps, "notes": a.notes,
                "trace": name.name if self.keep_traces > 0 else None,
                "breakdown": {"computing": b.computing, "communicating": b.communicating, "copying": b.copying,
                              "waiting_for_data": b.waiting_for_data, "idle": b.idle, "comm_total": b.comm_total},
                "top": [{"name": r.name, "share": r.share} for r in a.top]}

    # ------------------------------------------------------------------ device, peak, scheduler
    def _device_type(self) -> str:
        if self.model is not None:
            p = next(iter(self.model.parameters()), None)
            if p is not None:
                return p.device.type
        return "cuda" if torch.cuda.is_available() else "cpu"

    def _device(self) -> DeviceInfo:
        if self.cuda:  # pragma: no cover - GPU only
            p = next(iter(self.model.parameters()), None) if self.model is not None else None
            idx = p.device.index if p is not None and p.device.index is not None else torch.cuda.current_device()
            return DeviceInfo("cuda", torch.cuda.get_device_name(idx), idx, None, None)
        return DeviceInfo("cpu", cpu_name(), None, None, torch.get_num_threads())

    def _dtype(self) -> str:
        if self.dtype:
            return self.dtype
        p = next(iter(self.model.parameters()), None) if self.model is not None else None
        name = str(p.dtype).replace("torch.", "") if p is not None else "float32"
        return name if name in ("float32", "bfloat16", "float16") else "float32"

    def _peak(self, device: DeviceInfo) -> dict[str, Any] | None:
        if self.peak_flops is None and self.flops_per_token is None and (self.model is None or not self.count_flops):
            return None  # no FLOPs: no MFU, so no peak is measured
        try:
            p = resolve_peak(device, self._dtype(), self.peak_flops)
        except Exception as e:  # an unknown GPU: MFU is left out, said so
            return {"flops_per_s": None, "source": None, "note": str(e)}
        if self.peak_flops is not None:
            return {"flops_per_s": p.flops_per_s, "source": "given", "precision": p.precision,
                    "note": "peak_flops given to the monitor"}
        guessed = "" if self.dtype else (f" (the training dtype {self._dtype()} is the parameters'; under autocast "
                                         "pass Monitor(dtype=...) so MFU is taken against that precision's peak)")
        return {"flops_per_s": p.flops_per_s, "source": p.source, "precision": p.precision, "note": p.note + guessed}

    def _tensorboard(self):
        if not self.tensorboard:
            return None, "off"
        try:
            from torch.utils.tensorboard import SummaryWriter
        except Exception as e:
            return None, f"requested but unavailable: {e}"
        folder = self.out_dir / "tensorboard" / f"{self.host}-rank{self.ids['rank']}"
        return SummaryWriter(log_dir=str(folder)), f"writing to {folder}"

    def _cluster_record(self, job_id: str) -> None:
        self._emit("cluster", slurm=slurm_queue(job_id))  # a no-op once closed
