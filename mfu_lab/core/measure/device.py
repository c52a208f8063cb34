"""Device facts: which device runs the job, and its peak FLOP/s for the training dtype.

Peaks are dense (no 2:4 sparsity) vendor figures. An unknown GPU is an error
asking for ``peak_flops`` in the job: guessing another chip's peak would make
every MFU figure wrong without anyone noticing. On a CPU no vendor peak
applies, so the peak is this CPU's measured matmul rate for the dtype.
"""

from __future__ import annotations

import platform
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from mfu_lab.core.errors import DeviceError
from mfu_lab.core.measure import peak_cache

T = 1e12


@dataclass(frozen=True)
class Chip:
    """A datasheet row: dense peak FLOP/s per precision, and where it came from."""

    name: str
    pattern: str  # regex matched against torch.cuda.get_device_name()
    fp32: float  # non-tensor FP32
    tf32: float
    bf16: float
    fp16: float
    fp8: float | None
    source: str
    sms: int | None = None  # streaming multiprocessors (NVIDIA whitepapers), for the reference clock
    bf16_flops_per_clock_sm: int | None = None  # dense bf16 tensor FLOPs per SM per clock (2 x FMA)

    @property
    def reference_clock_mhz(self) -> float | None:
        """The SM clock the datasheet's dense bf16 peak assumes: peak / (SMs x FLOPs per SM per clock). None
        where the SM count or the per-SM rate is not in the row. H100 SXM: 989.4e12 / (132 x 4096) = 1830 MHz,
        below NVML's maximum of 1980 MHz, so a GPU at its rated clock is not throttled."""
        if not (self.sms and self.bf16_flops_per_clock_sm):
            return None
        return self.bf16 / (self.sms * self.bf16_flops_per_clock_sm) / 1e6


# SM counts and dense tensor rates per SM per clock (for each row's reference clock, Chip.reference_clock_mhz):
# NVIDIA A100 whitepaper (108 SMs; 1024 dense FP16/BF16 FMA per SM per clock = 2048 FLOPs) and H100 whitepaper
# (SXM5 132 SMs, PCIe 114 SMs; twice Ampere's rate per SM = 4096 FLOPs). H200 is the same GH100 with 132 SMs; the
# NVL boards have 132 SMs at a lower rated clock. Rows without them compare clocks against NVML's maximum.
# Order matters: the first pattern that matches wins, so the most specific rows come first (H100 NVL/PCIe and
# H800 PCIe before the SXM row, H200 NVL before H200, GB200 before B200, which its name contains).
PEAK_TABLE: tuple[Chip, ...] = (
    Chip("A100", r"A100", 19.5 * T, 156 * T, 312 * T, 312 * T, None,
         "NVIDIA A100 Tensor Core GPU datasheet (SXM and PCIe; dense)",
         108, 2048),
    Chip("H100 NVL", r"H100.*NVL", 60 * T, 417.5 * T, 835.5 * T, 835.5 * T, 1670.5 * T,
         "NVIDIA H100 datasheet, H100 NVL column (half the sparse figures)",
         132, 4096),
    Chip("H100 PCIe", r"H100.*PCIe", 51 * T, 378 * T, 756 * T, 756 * T, 1513 * T,
         "NVIDIA H100 datasheet, H100 PCIe column (half the sparse figures)",
         114, 4096),
    Chip("H800 PCIe", r"H800.*PCIe", 51 * T, 378 * T, 756 * T, 756 * T, 1513 * T,
         "NVIDIA H800 PCIe: the H100 PCIe's compute (the H800 differs in NVLink and FP64), H100 datasheet PCIe "
         "column (half the sparse figures)",
         114, 4096),
    Chip("H100 SXM", r"H100|H800", 67 * T, 494.7 * T, 989.4 * T, 989.4 * T, 1978.9 * T,
         "NVIDIA H100 datasheet, H100 SXM column (half the sparse figures)",
         132, 4096),
    Chip("H200 NVL", r"H200.*NVL", 60 * T, 417.5 * T, 835.5 * T, 835.5 * T, 1670.5 * T,
         "NVIDIA H200 datasheet, H200 NVL column (half the sparse figures)",
         132, 4096),
    Chip("H200", r"H200", 67 * T, 494.7 * T, 989.4 * T, 989.4 * T, 1978.9 * T,
         "NVIDIA H200 datasheet, SXM (half the sparse figures)",
         132, 4096),
    Chip("GB200", r"GB200", 80 * T, 1250 * T, 2500 * T, 2500 * T, 5000 * T,
         "NVIDIA GB200 NVL72 datasheet, per GPU (the rack's figures / 72 GPUs, half the sparse figures)"),
    Chip("B200", r"B200", 75 * T, 1100 * T, 2250 * T, 2250 * T, 4500 * T,
         "NVIDIA HGX B200 datasheet, per GPU (half the sparse figures)"),
    Chip("L40S", r"L40S", 91.6 * T, 183 * T, 362.05 * T, 362.05 * T, 733 * T,
         "NVIDIA L40S datasheet (dense; the starred figures are sparse)"),
    Chip("MI300X", r"MI300X", 163.4 * T, 653.7 * T, 1307.4 * T, 1307.4 * T, 2614.9 * T,
         "AMD Instinct MI300X data sheet (dense matrix figures)"),
)

DTYPE_KEY = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}

# The compute die under each row (NVIDIA's whitepapers): the same die runs the same kernels on the same SM design,
# so one chip's measured MFU is the best evidence for another's (labelled so: memory and clocks still differ).
DIES = {"A100": "GA100", "H100 NVL": "GH100", "H100 PCIe": "GH100", "H800 PCIe": "GH100", "H100 SXM": "GH100",
        "H200 NVL": "GH100", "H200": "GH100", "GB200": "GB100", "B200": "GB100"}


def same_die(a: str, b: str) -> str | None:
    """The die two chip rows share (``DIES``), None when they differ or either is unknown."""
    die = DIES.get(a)
    return die if die is not None and die == DIES.get(b) else None


@dataclass(frozen=True)
class DeviceInfo:
    type: str  # "cpu" or "cuda"
    name: str
    index: int | None
    capability: str | None  # CUDA compute capability, e.g. "9.0"
    threads: int | None  # torch intra-op threads on CPU

    @property
    def torch_device(self) -> torch.device:
        return torch.device("cuda", self.index) if self.type == "cuda" else torch.device("cpu")


@dataclass(frozen=True)
class Peak:
    """Peak FLOP/s for the training dtype, with its provenance."""

    flops_per_s: float
    source: str  # datasheet | measured
    precision: str  # fp32, tf32, bf16, fp16
    note: str
    cache: dict | None = None  # a measured peak: the per-user cache's record and its re-check (core.measure.peak_cache)


def resolve_device(requested: str) -> DeviceInfo:
    """Turn the job's ``device`` (auto | cpu | cuda) into a concrete device."""
    has_cuda = torch.cuda.is_available()
    if requested == "cuda" and not has_cuda:
        raise DeviceError("the job asks for device 'cuda', but torch sees no CUDA device "
                          f"(torch {torch.__version__}); use device: auto or cpu")
    if requested == "cpu" or not has_cuda:
        return DeviceInfo("cpu", cpu_name(), None, None, torch.get_num_threads())
    idx = torch.cuda.current_device()
    major, minor = torch.cuda.get_device_capability(idx)
    return DeviceInfo("cuda", torch.cuda.get_device_name(idx), idx, f"{major}.{minor}", None)


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "CPU"


def lookup_chip(device_name: str) -> Chip | None:
    for chip in PEAK_TABLE:
        if re.search(chip.pattern, device_name, re.IGNORECASE):
            return chip
    return None


def float32_precision_key(matmul_precision: str | None = None) -> str:
    """'tf32' when float32 matmuls may run on TF32 tensor cores, else 'fp32': the job's ``matmul_precision``
    when given, else torch's current setting."""
    setting = matmul_precision or torch.get_float32_matmul_precision()
    return "fp32" if setting == "highest" else "tf32"


def datasheet_peak(device_name: str, dtype: str, matmul_precision: str | None = None) -> Peak:
    """Dense peak of a known GPU for ``dtype``; DeviceError for an unknown one."""
    chip = lookup_chip(device_name)
    if chip is None:
        known = ", ".join(c.name for c in PEAK_TABLE)
        raise DeviceError(f"no datasheet peak for GPU '{device_name}' (known: {known}). "
                          "Set peak_flops in the job file to its dense peak FLOP/s for the training dtype, "
                          "e.g. peak_flops: 989.4e12")
    key = float32_precision_key(matmul_precision) if dtype == "float32" else DTYPE_KEY[dtype]
    why = (f" (float32 matmuls at precision '{matmul_precision or torch.get_float32_matmul_precision()}': "
           + ("TF32 tensor cores)" if key == "tf32" else "true float32)")) if dtype == "float32" else ""
    return Peak(getattr(chip, key), "datasheet", key, f"{chip.name} {key} dense peak{why}: {chip.source}")


def measure_matmul_peak(dtype: torch.dtype, device: str = "cpu", sizes=(512, 1024, 1536),
                        budget_s: float = 1.5) -> tuple[float, str]:
    """Best achieved FLOP/s of square matmuls (2 n^3 FLOPs each) on this device.

    The best over sizes and repeats stands in for the peak, since no vendor
    figure applies (CPUs). Each size gets an untimed warm-up call first.
    Returns (flop/s, a note saying how it was measured).
    """
    best, best_n, tried = 0.0, 0, []
    per_size = budget_s / len(sizes)
    for n in sizes:
        a = torch.randn(n, n, device=device).to(dtype)
        b = torch.randn(n, n, device=device).to(dtype)
        t0 = time.perf_counter()
        torch.mm(a, b)  # warm-up: first call pays allocation and kernel selection
        tried.append(n)
        if time.perf_counter() - t0 > per_size:  # slow dtype here (e.g. bf16 without AMX): stop growing
            best, best_n = max((best, best_n), (2 * n**3 / (time.perf_counter() - t0), n))
            break
        start = time.perf_counter()
        while time.perf_counter() - start < per_size:
            t0 = time.perf_counter()
            torch.mm(a, b)
            if device != "cpu":
                torch.cuda.synchronize()  # sync point: the kernel must finish inside the timed region
            dt = time.perf_counter() - t0
            if 2 * n**3 / dt > best:
                best, best_n = 2 * n**3 / dt, n
    note = (f"best of square {str(dtype).replace('torch.', '')} matmuls (n in {tried}) on "
            f"{torch.get_num_threads()} threads; best at n={best_n}")
    return best, note


def override_for(override: float | Mapping[str, float] | None, dtype: str, matmul_precision: str | None = None,
                 job_dtype: str | None = None, job_matmul_precision: str | None = None) -> float | None:
    """The job's ``peak_flops`` for ``dtype``, or None: a mapping's entry for that dtype; a single number only for
    the job's own dtype (``job_dtype``; None: ``dtype`` is the job's). An override is never carried across dtypes,
    nor, for float32, across matmul precisions: with ``job_matmul_precision`` given, a float32 figure is for the
    job's float32 (TF32 or true float32) and a float32 rung at the other precision gets none."""
    if override is None:
        return None
    if isinstance(override, Mapping):
        value = override.get(dtype)
    else:
        value = override if dtype == (job_dtype or dtype) else None
    if (value is not None and dtype == "float32" and job_matmul_precision is not None
            and float32_precision_key(matmul_precision) != float32_precision_key(job_matmul_precision)):
        return None
    return value


def resolve_peak(device: DeviceInfo, dtype: str, override: float | Mapping[str, float] | None,
                 matmul_precision: str | None = None, job_dtype: str | None = None,
                 job_matmul_precision: str | None = None) -> Peak:
    """The peak MFU is measured against: the job's override for this dtype (:func:`override_for`), the datasheet
    (GPU; for float32 the TF32 or the float32 row, by ``matmul_precision``), or this CPU's measured peak, measured
    once per machine and dtype and re-checked at each use (:mod:`mfu_lab.core.measure.peak_cache`). A GPU without a
    datasheet row and no override for the dtype is a DeviceError asking for ``peak_flops``."""
    key = DTYPE_KEY[dtype]
    value = override_for(override, dtype, matmul_precision, job_dtype, job_matmul_precision)
    if value is not None:
        return Peak(float(value), "datasheet", key, f"peak_flops given in the job file (for {dtype})")
    if device.type == "cuda":
        return datasheet_peak(device.name, dtype, matmul_precision)
    flops, note, record = peak_cache.measured_peak(device.type, device.name, dtype, measure_matmul_peak)
    return Peak(flops, "measured", key, f"CPU: no vendor peak applies; measured matmul rate of this CPU ({note})",
                record)


def remeasure_peak(device: DeviceInfo, dtype: str, floor: float) -> Peak:
    """Measure this machine's peak again and cache the better of it and ``floor`` (step 1, when the training step
    outran the cached peak: that reading was a busy machine's)."""
    flops, record = peak_cache.remeasure(device.type, device.name, dtype, measure_matmul_peak, floor)
    return Peak(flops, "measured", DTYPE_KEY[dtype], f"{record['how']}; measured again and cached since "
                f"{record['date']} ({peak_cache.describe(record['conditions'])})", record)


def measure_memory_bandwidth(device: torch.device, mib: int = 256, budget_s: float = 1.0) -> tuple[float, str]:
    """Best achieved bytes/s copying a large float32 buffer on the device (read + write: 2 x size / time).

    Stands in for the bandwidth that memory-bound kernels can reach here, the
    same way the best matmul stands in for a CPU's peak FLOP/s.
    """
    n = mib * 2**20 // 4
    src = torch.ones(n, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)  # warm-up: first touch pays page faults / allocation
    cuda = device.type == "cuda"
    best, count = 0.0, 0
    start = time.perf_counter()
    while time.perf_counter() - start < budget_s or count < 3:
        if cuda:  # pragma: no cover - GPU only
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            dst.copy_(src)
            b.record()
            b.synchronize()  # sync point: read the events once the copy is done
            dt = a.elapsed_time(b) / 1e3
        else:
            t0 = time.perf_counter()
            dst.copy_(src)
            dt = time.perf_counter() - t0
        best = max(best, 2 * src.nbytes / dt)
        count += 1
    how = "CUDA events" if cuda else f"time.perf_counter on {torch.get_num_threads()} threads"
    return best, f"best of {count} copies of a {mib} MiB float32 buffer (2 x size / time; {how})"


def release_device_memory(device_type: str) -> dict | None:
    """Before a child process starts on the same GPU (torchrun ranks, compile trials, co-located copies, verify
    rungs): collect this process's unreferenced tensors and hand the caching allocator's reserve back to the
    driver, so the child is not measured on a GPU the launcher still fills. Returns the free and total bytes the
    child will find (None on a CPU, or when this process never touched CUDA)."""
    if device_type != "cuda" or not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return None  # nothing of this process sits on a GPU
    import gc  # pragma: no cover - GPU only

    gc.collect()  # pragma: no cover - GPU only
    torch.cuda.empty_cache()  # pragma: no cover - GPU only
    free, total = torch.cuda.mem_get_info()  # pragma: no cover - GPU only
    return {"free_bytes": free, "total_bytes": total}  # pragma: no cover - GPU only
