"""Where a monitored process runs: its ranks and scheduler ids (torchrun, Slurm), the queue wait Slurm reports,
and the GPU's health over each interval (NVML, from a background thread).

Nothing here is invented: a field the environment does not give is left out, and the NVML probe says why it
took no samples.
"""

from __future__ import annotations

import datetime as _dt
import os
import re
import shutil
import subprocess
import threading
from typing import Any

from mfu_lab.core.measure.device import lookup_chip
from mfu_lab.core.measure.health import THROTTLE_BITS, decode_reasons, nvml_handle
from mfu_lab.core.store.monitor_files import safe_run

TORCHRUN_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "TORCHELASTIC_RUN_ID",
                 "TORCHELASTIC_RESTART_COUNT", "MASTER_ADDR", "MASTER_PORT")
SLURM_VARS = ("SLURM_JOB_ID", "SLURM_JOB_NAME", "SLURM_STEP_ID", "SLURMD_NODENAME", "SLURM_PROCID",
              "SLURM_LOCALID", "SLURM_NTASKS", "SLURM_NNODES", "SLURM_RESTART_COUNT", "SLURM_JOB_PARTITION")


def ranks(env: dict[str, str] | None = None) -> dict[str, int]:
    """rank, local_rank, world and node_rank from torchrun's variables, else Slurm's, else torch.distributed."""
    env = os.environ if env is None else env

    def num(*names: str, default: int) -> int:
        for n in names:
            if str(env.get(n, "")).isdigit():
                return int(env[n])
        return default

    rank, world = num("RANK", "SLURM_PROCID", default=-1), num("WORLD_SIZE", "SLURM_NTASKS", default=-1)
    if rank < 0:
        try:
            import torch.distributed as dist

            if dist.is_available() and dist.is_initialized():
                rank, world = dist.get_rank(), dist.get_world_size()
        except Exception:
            pass
    return {"rank": max(rank, 0), "world": max(world, 1), "local_rank": num("LOCAL_RANK", "SLURM_LOCALID", default=0),
            "node_rank": num("GROUP_RANK", "SLURM_NODEID", default=0)}


def launch_id(env: dict[str, str] | None = None, fallback: str = "") -> str:
    """An id every rank of one launch shares and a restart changes: torchrun's run id and restart count, else
    Slurm's job, step and restart count, else ``fallback`` (the process's own start)."""
    env = os.environ if env is None else env
    if env.get("TORCHELASTIC_RUN_ID"):
        return (f"torchrun:{env['TORCHELASTIC_RUN_ID']}:{env.get('MASTER_ADDR', '')}:{env.get('MASTER_PORT', '')}"
                f"#{env.get('TORCHELASTIC_RESTART_COUNT', '0')}")
    if env.get("SLURM_JOB_ID"):
        return f"slurm:{env['SLURM_JOB_ID']}.{env.get('SLURM_STEP_ID', '')}#{env.get('SLURM_RESTART_COUNT', '0')}"
    return fallback


def _stamp(t: float) -> str:
    return _dt.datetime.fromtimestamp(t, _dt.UTC).strftime("%Y%m%dT%H%M%SZ")


def _agent_start(pid: int) -> float | None:
    """Unix start time of process ``pid`` (Linux /proc), None where unknown."""
    try:
        ticks = int(open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[19])
        boot = next(float(line.split()[1]) for line in open("/proc/stat") if line.startswith("btime"))
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return None


def run_id(given: str | None, host: str, now: float, env: dict[str, str] | None = None, ppid: int | None = None) -> str:
    """The run id (see :mod:`mfu_lab.core.store.monitor_files`): ``given``; else Slurm's job, step and the job's start
    time; else torchrun's rendezvous id, with the torchrun agent's start time when all ranks are on this node (the
    agent is every local rank's parent); else ``<host>.<pid>.<now>``. Safe for a file name (:func:`safe_run`)."""
    env = os.environ if env is None else env
    if given:
        return safe_run(given)
    if env.get("SLURM_JOB_ID"):
        parts = [f"slurm{env['SLURM_JOB_ID']}"] + ([f"s{env['SLURM_STEP_ID']}"] if env.get("SLURM_STEP_ID") else [])
        start = env.get("SLURM_JOB_START_TIME", "")
        if start.isdigit():
            parts.append(_stamp(int(start)))
        return safe_run(".".join(parts))
    if env.get("TORCHELASTIC_RUN_ID"):
        rid = f"torchrun_{env['TORCHELASTIC_RUN_ID']}"
        if env.get("LOCAL_WORLD_SIZE") and env.get("LOCAL_WORLD_SIZE") == env.get("WORLD_SIZE"):
            agent = _agent_start(os.getppid() if ppid is None else ppid)
            if agent is not None:
                rid += "." + _stamp(agent)
        return safe_run(rid)
    return safe_run(f"{host}.{os.getpid()}.{_stamp(now)}")


def scheduler_env(env: dict[str, str] | None = None) -> dict[str, dict[str, str]]:
    env = os.environ if env is None else env
    out = {"torchrun": {k: env[k] for k in TORCHRUN_VARS if k in env},
           "slurm": {k: env[k] for k in SLURM_VARS if k in env}}
    return {k: v for k, v in out.items() if v}


_SCONTROL_FIELDS = ("SubmitTime", "EligibleTime", "StartTime", "Restarts", "NodeList", "JobState")


def parse_scontrol(text: str) -> dict[str, Any]:
    """The fields of ``scontrol show job -o ID`` the monitor keeps; times as unix seconds (local time)."""
    out: dict[str, Any] = {}
    for key in _SCONTROL_FIELDS:
        m = re.search(rf"(?:^|\s){key}=(\S+)", text)
        if not m or m.group(1) in ("Unknown", "None", "(null)"):
            continue
        value = m.group(1)
        if key.endswith("Time"):
            t = _parse_time(value)
            if t is not None:
                out[key] = t
        elif key == "Restarts" and value.isdigit():
            out[key] = int(value)
        else:
            out[key] = value
    if "SubmitTime" in out and "StartTime" in out:
        out["queue_wait_s"] = max(0.0, out["StartTime"] - out["SubmitTime"])
    return out


def _parse_time(value: str) -> float | None:
    try:
        return _dt.datetime.fromisoformat(value).timestamp()
    except ValueError:
        return None


def slurm_queue(job_id: str, timeout_s: float = 20.0) -> dict[str, Any]:
    """Submit and start times (queue wait) and restarts of a Slurm job, from ``scontrol`` (else ``sacct``);
    ``{"why": ...}`` when neither answers."""
    if shutil.which("scontrol"):
        try:
            r = subprocess.run(["scontrol", "show", "job", "-o", str(job_id)], capture_output=True, text=True,
                               timeout=timeout_s, check=False)
            if r.returncode == 0 and r.stdout.strip():
                return {"source": "scontrol", **parse_scontrol(r.stdout)}
        except (OSError, subprocess.SubprocessError):
            pass
    if shutil.which("sacct"):
        try:
            r = subprocess.run(["sacct", "-j", str(job_id), "-X", "-n", "-P", "-o", "Submit,Eligible,Start"],
                               capture_output=True, text=True, timeout=timeout_s, check=False)
            line = r.stdout.strip().splitlines()[0] if r.returncode == 0 and r.stdout.strip() else ""
            if line:
                submit, eligible, start = (line.split("|") + ["", "", ""])[:3]
                return {"source": "sacct", **parse_scontrol(f"SubmitTime={submit} EligibleTime={eligible} "
                                                            f"StartTime={start}")}
        except (OSError, subprocess.SubprocessError):
            pass
    return {"why": "neither scontrol nor sacct answered on this node"}


def _optional(read, default):
    try:
        return read()
    except Exception:
        return default


class NvmlProbe:
    """Samples one NVIDIA GPU every ``interval_s`` from a daemon thread and hands back a summary per interval
    (:meth:`take`): temperature, SM clock while busy against the maximum, power against the limit, clock-event
    reasons and the share of busy samples with a power or thermal reason, new uncorrected ECC errors and XID
    events. Memory stays constant however long the job runs: each :meth:`take` resets the sums."""

    def __init__(self, index: int, interval_s: float = 1.0):
        self.index, self.interval_s = index, interval_s
        self.skipped = ""
        self.busy_unknown = False
        self.reference_clock: float | None = None  # the clock the datasheet peak assumes (device.Chip), if known
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._reset()

    def _reset(self) -> None:
        self._n = self._busy = self._throttled = 0
        self._temp_max = None
        self._clock_sum = self._power_sum = self._throttled_clock_sum = 0.0
        self._reasons = 0
        self._xids: list[int] = []

    def start(self) -> NvmlProbe:  # pragma: no cover - GPU only
        try:
            import pynvml as nv

            nv.nvmlInit()
            self._nv, self._h = nv, nvml_handle(nv, self.index)
            self.max_clock = float(nv.nvmlDeviceGetMaxClockInfo(self._h, nv.NVML_CLOCK_SM))
            import torch

            chip = lookup_chip(torch.cuda.get_device_name(self.index))
            self.reference_clock = chip.reference_clock_mhz if chip else None
        except Exception as e:
            self.skipped = f"NVML unavailable: {e}"
            return self
        try:
            self.power_limit = nv.nvmlDeviceGetEnforcedPowerLimit(self._h) / 1000.0
        except Exception:
            self.power_limit = None  # not supported on every board: the rest is still sampled
        self._ecc0 = self._ecc()
        self._events = None
        try:
            self._events = nv.nvmlEventSetCreate()
            nv.nvmlDeviceRegisterEvents(self._h, nv.nvmlEventTypeXidCriticalError, self._events)
        except Exception:
            self._events = None  # XID events need root on some drivers: the rest is still sampled
        threading.Thread(target=self._loop, name="mfu-lab-monitor-nvml", daemon=True).start()
        return self

    def _ecc(self) -> int | None:  # pragma: no cover - GPU only
        nv = self._nv
        try:
            return int(nv.nvmlDeviceGetTotalEccErrors(self._h, nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED,
                                                      nv.NVML_VOLATILE_ECC))
        except Exception:
            return None  # ECC off or not supported

    def _loop(self) -> None:  # pragma: no cover - GPU only
        nv, h = self._nv, self._h
        reasons = getattr(nv, "nvmlDeviceGetCurrentClocksEventReasons", None) or \
            nv.nvmlDeviceGetCurrentClocksThrottleReasons
        while not self._stop.is_set():
            try:
                temp = float(nv.nvmlDeviceGetTemperature(h, nv.NVML_TEMPERATURE_GPU))
                clock = float(nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_SM))
                mask = int(reasons(h))
            except Exception as e:
                self.skipped = f"NVML read failed: {e}"
                return
            power = _optional(lambda: nv.nvmlDeviceGetPowerUsage(h) / 1000.0, 0.0)
            # utilisation is not supported on MIG: every sample then counts as busy (said in the record)
            busy = _optional(lambda: nv.nvmlDeviceGetUtilizationRates(h).gpu > 0, None)
            if busy is None:
                self.busy_unknown, busy = True, True
            with self._lock:
                self._n += 1
                self._temp_max = temp if self._temp_max is None else max(self._temp_max, temp)
                self._power_sum += power
                self._reasons |= mask
                if busy:  # clocks of an idle GPU drop by design: only busy samples say anything
                    self._busy += 1
                    self._clock_sum += clock
                    if mask & THROTTLE_BITS:
                        self._throttled += 1
                        self._throttled_clock_sum += clock
            while self._events is not None:  # drain every XID event waiting, not one per sample
                try:
                    ev = nv.nvmlEventSetWait_v2(self._events, 0)
                except nv.NVMLError_Timeout:
                    break
                except Exception as e:
                    self.skipped = f"XID events unreadable: {e}"
                    self._events = None
                    break
                with self._lock:
                    self._xids.append(int(ev.eventData))
            self._stop.wait(self.interval_s)
        self._cleanup()

    def _cleanup(self) -> None:  # pragma: no cover - GPU only
        try:
            if self._events is not None:
                self._nv.nvmlEventSetFree(self._events)
            self._nv.nvmlShutdown()
        except Exception:
            pass

    def take(self) -> dict[str, Any] | None:
        """The summary since the last call (None when nothing was sampled)."""
        if self.skipped and not self._n:
            return None
        with self._lock:
            n, busy, thr = self._n, self._busy, self._throttled
            out = None if not n else {
                "samples": n, "busy_samples": busy, "temperature_c_max": self._temp_max,
                "power_w_mean": self._power_sum / n, "power_limit_w": self.power_limit,
                "sm_clock_mhz_busy_mean": self._clock_sum / busy if busy else None,
                "sm_clock_mhz_max": self.max_clock, "sm_clock_mhz_reference": self.reference_clock,
                "throttled_share": thr / busy if busy else 0.0,
                # against the clock the datasheet peak assumes (NVML's maximum where unknown), capped at 1
                "throttled_clock_ratio": min(1.0, self._throttled_clock_sum / thr
                                             / (self.reference_clock or self.max_clock)) if thr else None,
                "reasons": decode_reasons(self._reasons), "xid": list(self._xids),
                "busy_known": not self.busy_unknown,  # False on MIG: NVML gives no utilisation there
            }
            self._reset()
        if out is not None:
            ecc = self._ecc()
            out["ecc_uncorrected_new"] = None if ecc is None or self._ecc0 is None else ecc - self._ecc0
            self._ecc0 = ecc
        return out

    def stop(self) -> None:
        self._stop.set()
