"""Device health during a run: temperature, SM clock against its maximum, power, throttle reasons.

NVIDIA GPUs are sampled through NVML (``nvidia-ml-py``) from a background
thread. Anywhere else the summary says it was skipped and why; nothing is
invented.
"""

from __future__ import annotations

import statistics
import threading
from dataclasses import dataclass, field

from mfu_lab.core.measure.device import lookup_chip
from mfu_lab.core.thresholds import HOT_C

# Clock-event ("throttle") reason bits, from NVML's nvml.h (nvmlClocksEventReason*).
CLOCK_EVENT_REASONS = {
    0x1: "GPU idle",
    0x2: "applications clocks setting",
    0x4: "SW power cap",
    0x8: "HW slowdown",
    0x10: "sync boost",
    0x20: "SW thermal slowdown",
    0x40: "HW thermal slowdown",
    0x80: "HW power brake slowdown",
    0x100: "display clock setting",
}
# Reasons that mean the clocks were pulled down by power or heat (operations loss), not by idleness.
THROTTLE_BITS = 0x4 | 0x8 | 0x20 | 0x40 | 0x80


def decode_reasons(mask: int) -> list[str]:
    return [name for bit, name in CLOCK_EVENT_REASONS.items() if mask & bit]


@dataclass
class HealthSummary:
    sampled: bool
    skipped_reason: str = ""
    samples: int = 0
    interval_s: float = 0.0
    temperature_c_max: float | None = None
    temperature_c_mean: float | None = None
    sm_clock_mhz_mean: float | None = None
    sm_clock_mhz_min: float | None = None
    sm_clock_mhz_max_supported: float | None = None
    power_w_mean: float | None = None
    power_limit_w: float | None = None
    reasons_seen: list[str] = field(default_factory=list)
    throttled_fraction: float | None = None  # share of busy samples with a power/thermal reason set
    busy_samples: int | None = None  # samples with the GPU busy (None: utilisation not readable, e.g. MIG)
    sm_clock_mhz_reference: float | None = None  # the clock the datasheet peak assumes (device.Chip)

    @property
    def reference_clock(self) -> tuple[float | None, str]:
        """The clock operations loss compares against, and which: the datasheet peak's clock when the chip's row
        gives one, else NVML's maximum SM clock (which overstates the loss where boost exceeds the rated clock)."""
        if self.sm_clock_mhz_reference:
            return self.sm_clock_mhz_reference, "the clock the datasheet peak assumes"
        return self.sm_clock_mhz_max_supported, "NVML's maximum SM clock (no datasheet clock for this chip)"

    @property
    def clock_ratio(self) -> float | None:
        """Mean SM clock while busy over the reference clock, capped at 1: a GPU at or above the clock its peak
        is quoted at loses nothing to operations."""
        ref = self.reference_clock[0]
        if self.sm_clock_mhz_mean is None or not ref:
            return None
        return min(1.0, self.sm_clock_mhz_mean / ref)


def nvml_handle(nv, index: int):
    """The NVML handle of torch's CUDA device ``index``. NVML numbers physical GPUs and ignores
    CUDA_VISIBLE_DEVICES (and MIG), so the device is matched by UUID, then by PCI bus id; the index itself is
    trusted only when CUDA_VISIBLE_DEVICES is unset. Raises LookupError when nothing matches."""
    import os

    import torch

    try:
        props = torch.cuda.get_device_properties(index)
    except Exception:  # no CUDA in this torch (tests with a stand-in NVML), or the device vanished
        props = None
    uuid = getattr(props, "uuid", None)
    if uuid is not None:
        try:
            return nv.nvmlDeviceGetHandleByUUID(f"GPU-{uuid}")
        except Exception:
            pass  # a MIG instance's UUID is not a GPU's: try the bus id
    bus = getattr(props, "pci_bus_id", None)
    if bus is not None:
        bus_id = f"{getattr(props, 'pci_domain_id', 0):08x}:{bus:02x}:{getattr(props, 'pci_device_id', 0):02x}.0"
        try:
            return nv.nvmlDeviceGetHandleByPciBusId(bus_id)
        except Exception:
            pass
    if not os.environ.get("CUDA_VISIBLE_DEVICES"):
        return nv.nvmlDeviceGetHandleByIndex(index)
    raise LookupError(f"CUDA device {index} matches no NVML device by UUID or PCI bus id, and "
                      f"CUDA_VISIBLE_DEVICES={os.environ['CUDA_VISIBLE_DEVICES']} makes the index unreliable")


def _nvml():
    import pynvml  # provided by nvidia-ml-py

    return pynvml


class HealthSampler:
    """Context manager sampling one NVIDIA GPU every ``interval_s`` while the run goes on."""

    def __init__(self, device_type: str, device_name: str, index: int | None, interval_s: float = 0.2):
        self.device_type, self.device_name, self.index, self.interval_s = device_type, device_name, index, interval_s
        self.rows: list[tuple[float, float, float, int, bool | None]] = []
        self.skipped = ""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> HealthSampler:
        if self.device_type != "cuda":
            self.skipped = "CPU run: NVML reads NVIDIA GPUs only, and no portable CPU clock/thermal source is used"
            return self
        if "NVIDIA" not in self.device_name.upper() and "AMD" in self.device_name.upper():
            self.skipped = f"{self.device_name}: NVML reads NVIDIA GPUs only (rocm-smi is not integrated)"
            return self
        try:
            nv = _nvml()
            nv.nvmlInit()
            self._handle = self._find_handle(nv)
            self._max_clock = nv.nvmlDeviceGetMaxClockInfo(self._handle, nv.NVML_CLOCK_SM)
            try:
                self._power_limit = nv.nvmlDeviceGetEnforcedPowerLimit(self._handle) / 1000.0
            except nv.NVMLError:
                self._power_limit = None
        except Exception as e:  # ImportError, NVMLError: either way no samples
            self.skipped = f"NVML unavailable: {e}"
            return self
        self._thread = threading.Thread(target=self._loop, name="mfu-lab-nvml", daemon=True)
        self._thread.start()
        return self

    def _find_handle(self, nv):
        return nvml_handle(nv, self.index or 0)

    def _reasons(self, nv) -> int:
        fn = getattr(nv, "nvmlDeviceGetCurrentClocksEventReasons", None) or nv.nvmlDeviceGetCurrentClocksThrottleReasons
        return int(fn(self._handle))

    def _busy(self, nv) -> bool | None:
        """Whether the GPU ran a kernel in the last sample period; None where NVML gives no utilisation (MIG)."""
        try:
            return nv.nvmlDeviceGetUtilizationRates(self._handle).gpu > 0
        except Exception:
            return None

    def _loop(self) -> None:
        nv = _nvml()
        while not self._stop.is_set():
            try:
                self.rows.append((
                    float(nv.nvmlDeviceGetTemperature(self._handle, nv.NVML_TEMPERATURE_GPU)),
                    float(nv.nvmlDeviceGetClockInfo(self._handle, nv.NVML_CLOCK_SM)),
                    nv.nvmlDeviceGetPowerUsage(self._handle) / 1000.0,
                    self._reasons(nv),
                    self._busy(nv),
                ))
            except Exception as e:  # a failing read ends sampling; what was read is kept
                self.skipped = f"NVML read failed after {len(self.rows)} samples: {e}"
                return
            self._stop.wait(self.interval_s)

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread:
            self._thread.join(timeout=5)
            try:
                _nvml().nvmlShutdown()
            except Exception:
                pass

    def summary(self) -> HealthSummary:
        if not self.rows:
            return HealthSummary(False, self.skipped or "no NVML samples were taken (run too short?)")
        temps, clocks, power, masks, busy = zip(*self.rows)
        known = all(b is not None for b in busy)
        # clocks of an idle GPU drop by design: only busy samples say anything (all, where busy is unknown)
        work = [i for i, b in enumerate(busy) if b] if known else list(range(len(busy)))
        all_bits = 0
        for m in masks:
            all_bits |= m
        chip = lookup_chip(self.device_name)
        return HealthSummary(
            True, self.skipped, len(self.rows), self.interval_s,
            max(temps), statistics.fmean(temps),
            statistics.fmean(clocks[i] for i in work) if work else None, min(clocks), float(self._max_clock),
            statistics.fmean(power), self._power_limit, decode_reasons(all_bits),
            sum(1 for i in work if masks[i] & THROTTLE_BITS) / len(work) if work else 0.0,
            len(work) if known else None, chip.reference_clock_mhz if chip else None,
        )


def gate(max_temp_c: float = HOT_C) -> tuple[bool, list[str]]:
    """A pre-launch health gate over every NVIDIA GPU of this node, through NVML.

    Fails a GPU above ``max_temp_c`` or with a power/thermal/hardware slowdown reason set
    (``THROTTLE_BITS``). Clocks are not compared with their maximum: an idle GPU clocks down.
    Returns (all passed, one line per GPU or the reason nothing could be read).
    """
    try:
        nv = _nvml()
        nv.nvmlInit()
    except Exception as e:
        return False, [f"NVML unavailable ({e}): no NVIDIA GPU can be checked on this node"]
    lines, ok = [], True
    try:
        for i in range(nv.nvmlDeviceGetCount()):
            h = nv.nvmlDeviceGetHandleByIndex(i)
            temp = float(nv.nvmlDeviceGetTemperature(h, nv.NVML_TEMPERATURE_GPU))
            fn = getattr(nv, "nvmlDeviceGetCurrentClocksEventReasons", None) or \
                nv.nvmlDeviceGetCurrentClocksThrottleReasons
            bad = decode_reasons(int(fn(h)) & THROTTLE_BITS)
            fail = temp > max_temp_c or bool(bad)
            ok = ok and not fail
            lines.append(f"GPU {i}: {temp:.0f} °C, slowdown reasons: {', '.join(bad) or 'none'}"
                         + (f"  FAIL (limit {max_temp_c:g} °C, no slowdown reason allowed)" if fail else "  ok"))
        if not lines:
            return False, ["NVML sees no GPU on this node"]
    finally:
        try:
            nv.nvmlShutdown()
        except Exception:
            pass
    return ok, lines


def gpu_environment(index: int) -> dict:  # pragma: no cover - GPU only
    """What a GPU's timings depend on beyond its name, recorded with every result: CUDA, cuDNN and NCCL versions,
    SM count, power limit against its default, application clocks against theirs, MIG and persistence mode,
    uncorrected ECC errors, and the other processes computing on it (a shared GPU is named before its timings
    are trusted). A field the driver does not answer is left out; NVML's absence is said."""
    import os

    import torch

    def get(fn, default=None):
        try:
            return fn()
        except Exception:
            return default

    props = get(lambda: torch.cuda.get_device_properties(index))
    env = {"cudnn": get(torch.backends.cudnn.version),
           "nccl": get(lambda: ".".join(map(str, torch.cuda.nccl.version()))),
           "sm_count": getattr(props, "multi_processor_count", None),
           "memory_bytes": getattr(props, "total_memory", None)}
    try:
        nv = _nvml()
        nv.nvmlInit()
    except Exception as e:
        env["nvml"] = f"unavailable: {e}"
        return env
    try:
        h = nvml_handle(nv, index)
        env["power_limit_w"] = get(lambda: nv.nvmlDeviceGetEnforcedPowerLimit(h) / 1000.0)
        env["power_limit_default_w"] = get(lambda: nv.nvmlDeviceGetPowerManagementDefaultLimit(h) / 1000.0)
        env["sm_clock_application_mhz"] = get(lambda: nv.nvmlDeviceGetApplicationsClock(h, nv.NVML_CLOCK_SM))
        env["sm_clock_application_default_mhz"] = get(lambda: nv.nvmlDeviceGetDefaultApplicationsClock(
            h, nv.NVML_CLOCK_SM))
        env["sm_clock_max_mhz"] = get(lambda: nv.nvmlDeviceGetMaxClockInfo(h, nv.NVML_CLOCK_SM))
        env["mig_mode"] = get(lambda: nv.nvmlDeviceGetMigMode(h)[0])
        env["persistence_mode"] = get(lambda: nv.nvmlDeviceGetPersistenceMode(h))
        env["ecc_uncorrected_volatile"] = get(lambda: nv.nvmlDeviceGetTotalEccErrors(
            h, nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nv.NVML_VOLATILE_ECC))
        env["ecc_uncorrected_aggregate"] = get(lambda: nv.nvmlDeviceGetTotalEccErrors(
            h, nv.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nv.NVML_AGGREGATE_ECC))
        procs = get(lambda: nv.nvmlDeviceGetComputeRunningProcesses(h), [])
        env["other_processes"] = [{"pid": p.pid, "used_bytes": getattr(p, "usedGpuMemory", None)} for p in procs
                                  if p.pid != os.getpid()]
    except Exception as e:
        env["nvml"] = f"device not matched: {e}"
    finally:
        get(nv.nvmlShutdown)
    return env
