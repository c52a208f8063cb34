"""Was the machine shared while we measured? Every timed measurement (``core.measure.timed.run_steps``) is wrapped in a
:class:`ContentionProbe`, so a slow step caused by a neighbour is named instead of being tuned against.

CPU: the CPU time every process on the machine used (``/proc/stat``, busy jiffies) minus the CPU time of this
process and its children (``psutil`` when installed, else this process alone, said so), less the counters'
rounding (one tick per core and two for our own), over the wall time: the cores other processes kept busy. The
1-minute load average is kept beside it. GPU: the other compute processes NVML lists on the device. The machine
counts as shared when other processes kept at least ``CONTENTION_CORES`` cores busy *and* at least
``CONTENTION_SHARE`` of the cores this process may run on (a quarter of a core matters on 2 cores, not on 128), or
when another process computed on the GPU.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

from mfu_lab.core.thresholds import CONTENTION_CORES, CONTENTION_SHARE


@dataclass
class Contention:
    sampled: bool
    reason: str = ""  # why not sampled, or how
    elapsed_s: float = 0.0
    other_cpu_s: float | None = None  # CPU seconds of every other process during the measurement
    other_cores: float | None = None  # other_cpu_s / elapsed: cores other processes kept busy
    usable_cores: int = 0
    load_1min: float | None = None
    gpu_processes: list[str] = field(default_factory=list)  # other compute processes on the GPU (pid: name)
    shared: bool = False
    gpu_unknown: list[str] = field(default_factory=list)  # pids NVML gave from another PID namespace: cannot tell
    rechecks: list[str] = field(default_factory=list)  # a peak re-check below the cache (step 1): why it is shared

    def text(self) -> str:
        parts = []
        if self.other_cores is not None:
            parts.append(f"other processes kept {self.other_cores:.2f} of {self.usable_cores} cores busy")
        if self.gpu_processes:
            parts.append(f"other processes computed on the GPU ({', '.join(self.gpu_processes[:4])})")
        if self.gpu_unknown:
            parts.append(f"NVML lists {len(self.gpu_unknown)} GPU process(es) by pids this machine does not hold "
                         f"({', '.join(self.gpu_unknown[:4])}: a container, whose older driver gives host pids), so "
                         "whether another process used the GPU cannot be told")
        if self.load_1min is not None:
            parts.append(f"load average {self.load_1min:.2f}")
        parts += self.rechecks  # the matmul rate fell while no process here used the cores: the host's neighbours
        return "; ".join(parts) or self.reason


def _busy_jiffies() -> int | None:
    try:
        with open("/proc/stat", encoding="ascii") as f:
            fields = [int(v) for v in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    # user nice system idle iowait irq softirq steal (guest is inside user): busy = all but idle and iowait
    return sum(fields[:8]) - fields[3] - fields[4]


def _own_cpu_s() -> tuple[float, str]:
    try:
        import psutil

        me = psutil.Process()
        t = os.times()
        total = sum(me.cpu_times()[:2]) + t.children_user + t.children_system  # children that ended are in os.times
        for child in me.children(recursive=True):
            try:
                total += sum(child.cpu_times()[:2])
            except psutil.Error:
                pass  # ended meanwhile
        return total, "this process and its children (live ones through psutil, ended ones through os.times)"
    except ImportError:
        t = os.times()
        return t.user + t.system + t.children_user + t.children_system, "this process (psutil not installed: " \
                                                                        "live child processes count as others)"


def sort_gpu_pids(pids: list[int], mine: set[int], proc: str = "/proc") -> tuple[list[str], list[str]]:
    """NVML's compute processes on the device, less our own: (others, foreign). A pid NVML lists that this
    machine's ``/proc`` does not hold is *foreign*: NVML answered in another PID namespace (a container on an older
    driver returns host PIDs, nvidia-docker issue 1483), so that pid may be our own process as the host numbers it.
    Such a pid cannot tell whether another process shared the GPU, so it never marks the measurement shared: it is
    reported as not known. A pid that ``/proc`` holds is matched as it is."""
    others, foreign = [], []
    for pid in pids:
        if pid in mine:
            continue
        if os.path.exists(f"{proc}/{pid}"):
            others.append(str(pid))
        else:
            foreign.append(str(pid))
    return others, foreign


def _gpu_others(index: int | None) -> tuple[list[str], list[str]]:  # pragma: no cover - GPU only
    """(other compute processes on the GPU, pids NVML gave from another PID namespace): see :func:`sort_gpu_pids`."""
    try:
        import pynvml as nv

        from mfu_lab.core.measure.health import nvml_handle

        nv.nvmlInit()
        try:
            h = nvml_handle(nv, index or 0)
            mine = {os.getpid(), *(c.pid for c in _children())}
            return sort_gpu_pids([p.pid for p in nv.nvmlDeviceGetComputeRunningProcesses(h)], mine)
        finally:
            nv.nvmlShutdown()
    except Exception:
        return [], []


def _children():  # pragma: no cover - GPU only
    try:
        import psutil

        return psutil.Process().children(recursive=True)
    except Exception:
        return []


class ContentionProbe:
    """``with ContentionProbe(device) as probe: ...`` then ``probe.result``."""

    def __init__(self, device_type: str = "cpu", index: int | None = None):
        self.device_type, self.index = device_type, index
        self.result = Contention(False, "not measured yet")

    def __enter__(self) -> ContentionProbe:
        self._t0, self._busy0 = time.perf_counter(), _busy_jiffies()
        self._own0, _ = _own_cpu_s()
        return self

    def __exit__(self, *exc) -> None:
        elapsed = time.perf_counter() - self._t0
        busy1 = _busy_jiffies()
        own1, how = _own_cpu_s()
        cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
        gpu, unknown = _gpu_others(self.index) if self.device_type == "cuda" else ([], [])
        if self._busy0 is None or busy1 is None or elapsed <= 0:
            self.result = Contention(bool(gpu), "no /proc/stat on this system: CPU contention not measured",
                                     elapsed, usable_cores=cores, gpu_processes=gpu, gpu_unknown=unknown,
                                     shared=bool(gpu))
            return
        tick = os.sysconf("SC_CLK_TCK")
        # each core's counter and our own are read in whole ticks: that much of "other" may be rounding, not work
        rounding = ((os.cpu_count() or 1) + 2) / tick
        other = max(0.0, (busy1 - self._busy0) / tick - (own1 - self._own0) - rounding)
        other_cores = other / elapsed
        try:
            load = os.getloadavg()[0]
        except OSError:
            load = None
        shared = (other_cores >= CONTENTION_CORES and other_cores / cores >= CONTENTION_SHARE) or bool(gpu)
        self.result = Contention(True, f"/proc/stat busy time minus {how}", elapsed, other, other_cores, cores, load,
                                 gpu, shared, unknown)


def busy_now(seconds: float = 0.5, device_type: str = "cpu") -> Contention:
    """Is the machine busy right now? A :class:`ContentionProbe` over ``seconds`` of this process sleeping: what
    other processes did meanwhile (``mfu-lab run`` asks before its first step, to warn and suggest a budget)."""
    with ContentionProbe(device_type) as probe:
        time.sleep(seconds)
    return probe.result
