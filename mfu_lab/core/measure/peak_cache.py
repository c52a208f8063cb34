"""One peak per machine: a CPU's measured peak is measured once per machine and dtype and kept in a per-user cache
with the conditions it was measured in, so MFU does not move with a peak measured anew by every step. (A GPU's
peak comes from its datasheet row or the job's ``peak_flops``; a GPU without either is asked for one, see
``device.resolve_peak``.)

The cache is ``$XDG_CACHE_HOME/mfu-lab/peaks.json`` (``~/.cache/mfu-lab`` without it), written atomically and keyed
by the conditions: device model, usable cores, torch threads, torch version, dtype. A file that cannot be read as
JSON, or an entry whose rates are not finite numbers > 0 (a hand edit; JSON reads NaN and Infinity as numbers), is
measured again and rewritten, and the note names the file and what was wrong. At each use a quick re-check
runs: five short probes (a small square matmul, best of a few calls each; well under a second in all), compared
with the probes taken around the peak's measurement (the lower median of those before and after it). "Beyond the
noise" means outside the re-check probes' own p10-p90:

- below the cache (the re-check's p90 more than ``PEAK_RECHECK_FLOOR``, 5%, under the cached probe rate: five
  best-of probes spread by 1-2%, while a VM's host drifts by a few % between runs): the machine is shared
  (contention). The cached peak is kept and the re-check says so; it is not a new peak.
- above the cache (the cached probe rate below the re-check's p10): the cache is stale (it was measured on a busy
  machine, or the machine changed). The peak is measured again, the cache updated, and the note says so.

``device.resolve_peak`` is the one caller (and ``device.remeasure_peak``); the job's ``peak_flops`` and a GPU's
datasheet row are resolved there first and never touch the cache. The cache is written with its own few lines of
atomic write rather than ``files.write_atomic``: ``files`` imports ``results``, which imports ``health`` and so
``device``, and ``device`` imports this module (an import cycle the architecture test refuses).
"""

from __future__ import annotations

import json
import math
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch

from mfu_lab.core.thresholds import PEAK_RECHECK_FLOOR

PROBES = 5  # short probes per re-check
PROBE_N = {"cpu": 384, "cuda": 4096}  # square matmul size of a probe: a few ms on a 2-core CPU in float32
PROBE_N_HALF = 256  # bfloat16/float16 on a CPU: 30 ms a call where the CPU has no native support (1 GFLOP/s)
PROBE_S = 0.03  # each probe times calls for this long (at least two), best rate
GPU_SIZES = (2048, 4096, 8192)  # a GPU's full measurement: sizes that fill it (a CPU's are measure_matmul_peak's)

Measure = Callable[..., tuple[float, str]]  # device.measure_matmul_peak's signature


def cache_path() -> Path:
    """``$XDG_CACHE_HOME/mfu-lab/peaks.json``, or ``~/.cache/mfu-lab/peaks.json``."""
    root = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(root) / "mfu-lab" / "peaks.json"


def conditions(device_type: str, device_name: str, dtype: str) -> dict[str, Any]:
    """What a measured peak depends on; the cache key is made of these."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return {"device_type": device_type, "model": device_name, "cores": cores, "threads": torch.get_num_threads(),
            "torch": torch.__version__, "dtype": dtype}


def key_of(cond: dict[str, Any]) -> str:
    return "|".join(str(cond[k]) for k in ("device_type", "model", "cores", "threads", "torch", "dtype"))


def describe(cond: dict[str, Any]) -> str:
    what = "this CPU" if cond["device_type"] == "cpu" else "this GPU"
    return (f"{what}: {cond['model']}, {cond['cores']} cores, {cond['threads']} torch threads, "
            f"torch {cond['torch']}, {cond['dtype']}")


def _read() -> dict[str, Any]:
    try:
        data = json.loads(cache_path().read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError):
        return {}  # none yet, or damaged (not UTF-8, not JSON, nested past the parser): measured again and rewritten
    return data if isinstance(data, dict) and isinstance(data.get("peaks"), dict) else {}


def _write(key: str, entry: dict[str, Any]) -> None:
    data = _read() or {"about": "mfu-lab's measured peaks, one per machine and dtype (mfu_lab.core.measure.peak_cache)",
                       "peaks": {}}
    data["peaks"][key] = entry
    path = cache_path()
    try:  # atomically: a temporary file in the same folder renamed over the cache (os.replace)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(json.dumps(data, indent=2) + "\n")
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
    except OSError:
        pass  # a read-only home: the peak is still right for this run, only not kept


def probe_once(dtype: str, device_type: str, a: torch.Tensor, b: torch.Tensor) -> float:
    """One short probe: the best FLOP/s of square matmuls timed for ``PROBE_S`` (at least two calls)."""
    n, best, calls = a.shape[0], 0.0, 0
    start = time.perf_counter()
    while calls < 2 or time.perf_counter() - start < PROBE_S:
        t0 = time.perf_counter()
        torch.mm(a, b)
        if device_type != "cpu":
            torch.cuda.synchronize()  # sync point: the kernel must finish inside the timed region
        best = max(best, 2 * n**3 / (time.perf_counter() - t0))
        calls += 1
    return best


def probe_n(dtype: str, device_type: str = "cpu") -> int:
    """The probe's matmul size: the same at measurement and at every re-check (kept in the cache entry)."""
    return PROBE_N_HALF if device_type == "cpu" and dtype != "float32" else PROBE_N.get(device_type, 384)


def probe_rates(dtype: str, device_type: str = "cpu") -> list[float]:
    """``PROBES`` short probes' FLOP/s, after one untimed warm-up call."""
    n = probe_n(dtype, device_type)
    dev = "cuda" if device_type == "cuda" else "cpu"
    a = torch.randn(n, n, device=dev).to(getattr(torch, dtype))
    b = torch.randn(n, n, device=dev).to(getattr(torch, dtype))
    torch.mm(a, b)  # warm-up: first call pays allocation and kernel selection
    return [probe_once(dtype, device_type, a, b) for _ in range(PROBES)]


def _quantile(xs: list[float], q: float) -> float:
    s = sorted(xs)
    pos = q * (len(s) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


@dataclass
class Recheck:
    """The quick re-check against a cached peak, in the peak's terms (each probe x cached peak / cached probe)."""

    rates: list[float]  # the probes scaled to the peak
    p10: float
    p90: float
    cached: float  # the cached peak
    verdict: str  # steady | below (contention) | above (stale cache) | new (nothing cached: measured now)

    @property
    def below(self) -> bool:
        return self.verdict == "below"

    @property
    def ratio(self) -> float:
        return statistics.median(self.rates) / self.cached if self.cached else float("nan")

    def text(self) -> str:
        band = f"{PROBES} probes {self.p10 / 1e9:.1f}-{self.p90 / 1e9:.1f} GFLOP/s (p10-p90)"
        if self.verdict == "below":
            return (f"{band}, more than {PEAK_RECHECK_FLOOR:.0%} below the cached {self.cached / 1e9:.1f} GFLOP/s: "
                    "the machine is "
                    "shared now (contention); the cached peak is kept, not replaced")
        if self.verdict == "above":
            return f"{band}, above the cached {self.cached / 1e9:.1f} GFLOP/s beyond the noise: the cache was stale"
        return f"{band}, within the noise of the cached {self.cached / 1e9:.1f} GFLOP/s"


def recheck(entry: dict[str, Any], rates: list[float]) -> Recheck:
    """Judge ``rates`` (raw probes) against a cached entry: beyond the noise = outside the probes' p10-p90."""
    scale = entry["flops_per_s"] / entry["probe_flops_per_s"]
    scaled = [r * scale for r in rates]
    p10, p90 = _quantile(scaled, 0.10), _quantile(scaled, 0.90)
    cached = entry["flops_per_s"]
    verdict = "below" if p90 < cached * (1 - PEAK_RECHECK_FLOOR) else "above" if cached < p10 else "steady"
    return Recheck(scaled, p10, p90, cached, verdict)


def _measure_entry(measure: Measure, device_type: str, dtype: str, cond: dict[str, Any],
                   floor: float = 0.0) -> dict[str, Any]:
    # probes before and after the full measurement, the lower median kept: a neighbour that came or went meanwhile
    # makes the reference low rather than high, so a later quiet re-check reads it as stale and measures again
    # instead of keeping a contended peak for good
    before = probe_rates(dtype, device_type)
    if device_type == "cuda":  # pragma: no cover - GPU only
        flops, how = measure(getattr(torch, dtype), "cuda", sizes=GPU_SIZES)
    else:
        flops, how = measure(getattr(torch, dtype))
    ref = min(statistics.median(before), statistics.median(probe_rates(dtype, device_type)))
    now = datetime.now(UTC)
    return {"flops_per_s": max(flops, floor), "how": how, "probe_flops_per_s": ref,
            "probe_n": probe_n(dtype, device_type), "measured_at": now.isoformat(timespec="seconds"),
            "date": now.date().isoformat(), "conditions": cond}


def _rate(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0


def damage(entry: Any) -> str | None:
    """What is wrong with a cache entry's values (a hand edit, a torn write, NaN or Infinity, which JSON reads
    as numbers), None when they are sound: rates finite numbers > 0, the date and how it was measured text."""
    if not isinstance(entry, dict):
        return f"the entry is {type(entry).__name__}, not a mapping"
    for k in ("flops_per_s", "probe_flops_per_s"):
        if not _rate(entry.get(k)):
            return f"{k} is {entry.get(k)!r:.40}, not a finite number > 0"
    for k in ("how", "date"):
        if not isinstance(entry.get(k), str):
            return f"{k} is {entry.get(k)!r:.40}, not text"
    return None


def _usable(entry: Any, cond: dict[str, Any], dtype: str) -> bool:
    """A sound cache entry for these conditions whose probes were taken the way a re-check takes them now."""
    return (damage(entry) is None and entry.get("conditions") == cond
            and entry.get("probe_n") == probe_n(dtype, cond["device_type"]))


def cached(device_type: str, device_name: str, dtype: str) -> float | None:
    """The cached peak (FLOP/s) for these conditions, read only (nothing measured, nothing written); None when
    nothing sound is cached (:func:`damage`)."""
    entry = _read().get("peaks", {}).get(key_of(conditions(device_type, device_name, dtype)))
    return None if entry is None or damage(entry) else float(entry["flops_per_s"])


def measured_peak(device_type: str, device_name: str, dtype: str, measure: Measure) -> tuple[float, str, dict]:
    """(FLOP/s, note, record) of this machine's peak for ``dtype``: the cached one after a quick re-check, or one
    measured now (nothing cached, or the cache stale) and cached. ``record`` (JSON-ready) holds the conditions,
    the date, the re-check's probes and verdict."""
    cond = conditions(device_type, device_name, dtype)
    key = key_of(cond)
    entry = _read().get("peaks", {}).get(key)
    if not _usable(entry, cond, dtype):
        why = damage(entry) if entry is not None else None
        entry = _measure_entry(measure, device_type, dtype, cond)
        _write(key, entry)
        found = (f"the entry for these conditions in {cache_path()} was damaged ({why}) and is replaced" if why
                 else f"nothing cached for these conditions in {cache_path()}")
        note = f"{entry['how']}; measured now and cached from {entry['date']} ({describe(cond)}; {found})"
        return entry["flops_per_s"], note, {"cache": str(cache_path()), **entry, "recheck": None,
                                            "verdict": "new"}
    chk = recheck(entry, probe_rates(dtype, device_type))
    if chk.verdict == "above":
        old = entry  # measured again; the better of the two readings kept, as a peak is the best rate seen
        entry = _measure_entry(measure, device_type, dtype, cond, floor=old["flops_per_s"])
        _write(key, entry)
        note = (f"{entry['how']}; the cached peak was stale: re-checked now: {chk.text()} (cached since "
                f"{old['date']}), so measured again ({entry['flops_per_s'] / 1e9:.1f} GFLOP/s) and cached since "
                f"{entry['date']} ({describe(cond)})")
    else:
        note = f"{entry['how']}; cached since {entry['date']} ({describe(cond)}; re-checked now: {chk.text()})"
    return entry["flops_per_s"], note, {"cache": str(cache_path()), **entry, "recheck": asdict(chk),
                                        "verdict": chk.verdict}


def remeasure(device_type: str, device_name: str, dtype: str, measure: Measure, floor: float) -> tuple[float, dict]:
    """Measure the peak again (a training step outran it: the cached reading was a busy machine's) and cache the
    better of ``floor`` and the new reading. (FLOP/s, record)."""
    cond = conditions(device_type, device_name, dtype)
    entry = _measure_entry(measure, device_type, dtype, cond, floor)
    _write(key_of(cond), entry)
    return entry["flops_per_s"], {"cache": str(cache_path()), **entry, "verdict": "remeasured"}


def recheck_now(device_type: str, device_name: str, dtype: str) -> Recheck | None:
    """A re-check alone (five probes) against the cached peak, e.g. after a step's timed steps; None when nothing
    is cached for these conditions."""
    cond = conditions(device_type, device_name, dtype)
    entry = _read().get("peaks", {}).get(key_of(cond))
    if not _usable(entry, cond, dtype):
        return None
    return recheck(entry, probe_rates(dtype, device_type))
