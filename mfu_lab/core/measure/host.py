"""The host's memory and cores as this process may use them: the machine's, or its cgroup's when lower.

Containers and Slurm jobs run inside a cgroup whose limits are far below the machine's: inside a 1 GiB cgroup,
``/proc/meminfo`` still says the machine's 22.9 GiB are available, and ranks that trust it are OOM-killed. So
what is available is the lower of ``MemAvailable`` and, for this process's cgroup and each one above it, its limit
less its usage (page cache that can be dropped, ``inactive_file``, not counted as used):

- cgroup v2: ``<root>/<path>/memory.max`` (``max``: none) and ``memory.current``;
- cgroup v1: ``<root>/memory/<path>/memory.limit_in_bytes`` (a number near 2**63: none) and ``memory.usage_in_bytes``.

The cores are this process's CPU affinity, or the cgroup's CPU quota when lower (v2 ``cpu.max``, v1
``cpu/cpu.cfs_quota_us`` over ``cpu.cfs_period_us``). Every reader takes the cgroup root folder (and
``/proc/meminfo``) as a parameter, so a test points it at files of its own. Imports nothing of torch.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
MEMINFO = Path("/proc/meminfo")
PROC_CGROUP = Path("/proc/self/cgroup")
NO_LIMIT = 2 ** 60  # cgroup v1 writes "no limit" as a page-rounded 2**63 - 1
GIB = 2 ** 30


@dataclass(frozen=True)
class Available:
    """Bytes this process may still take, and how that was read (a sentence for messages)."""

    bytes: float
    how: str
    cgroup_limit: float | None = None  # the lowest cgroup limit in force, when one is


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except (OSError, ValueError):
        return None


def _number(path: Path) -> float | None:
    text = _read(path)
    try:
        return float(text) if text is not None else None
    except ValueError:  # "max", or damaged
        return None


def _inactive_file(stat: Path, key: str) -> float:
    for line in (_read(stat) or "").splitlines():
        name, _, value = line.partition(" ")
        if name == key and value.strip().isdigit():
            return float(value)
    return 0.0


def own_cgroup(controller: str, proc_cgroup: Path | None = None) -> str:
    """This process's cgroup path for ``controller`` ('' for v2's unified line), from ``/proc/self/cgroup``."""
    for line in (_read(proc_cgroup or PROC_CGROUP) or "").splitlines():
        parts = line.split(":", 2)
        if len(parts) == 3 and controller in parts[1].split(","):
            return parts[2].strip("/")
    return ""


def _levels(base: Path, path: str) -> list[Path]:
    """``base/path`` and every folder above it up to ``base``, those that exist (a cgroup namespace shows ``/``)."""
    here = base / path if path else base
    out = [here, *[p for p in here.parents if base in p.parents or p == base]]
    return [p for p in dict.fromkeys(out) if p.is_dir()]


def cgroup_memory(root: Path | None = None, proc_cgroup: Path | None = None) -> tuple[float, float, str] | None:
    """(limit, usage, the limit's file) of the tightest cgroup memory limit over this process, None without one.
    ``usage`` leaves out the cgroup's inactive file pages (cache the kernel drops before it OOM-kills)."""
    root = root or CGROUP_ROOT
    best: tuple[float, float, str] | None = None
    v2 = [(d / "memory.max", d / "memory.current", d / "memory.stat", "inactive_file")
          for d in _levels(root, own_cgroup("", proc_cgroup))]
    v1 = [(d / "memory.limit_in_bytes", d / "memory.usage_in_bytes", d / "memory.stat", "total_inactive_file")
          for d in _levels(root / "memory", own_cgroup("memory", proc_cgroup))] if (root / "memory").is_dir() else []
    for limit_file, usage_file, stat, inactive in v2 + v1:
        limit = _number(limit_file)
        if limit is None or limit >= NO_LIMIT:
            continue
        usage = max(0.0, (_number(usage_file) or 0.0) - _inactive_file(stat, inactive))
        if best is None or limit - usage < best[0] - best[1]:
            best = (limit, usage, str(limit_file))
    return best


def mem_available(meminfo: Path | None = None) -> float:
    """The machine's available memory, ``/proc/meminfo`` MemAvailable (free pages where that cannot be read)."""
    for line in (_read(meminfo or MEMINFO) or "").splitlines():
        if line.startswith("MemAvailable:"):
            return float(line.split()[1]) * 1024
    return float(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))


def available_memory(root: Path | None = None, meminfo: Path | None = None,
                     proc_cgroup: Path | None = None) -> Available:
    """What this process (and the processes it starts) may still take: MemAvailable, or the cgroup's limit less
    its usage when that is lower."""
    machine = mem_available(meminfo)
    how = f"this machine's available memory ({machine / GIB:.1f} GiB, /proc/meminfo MemAvailable)"
    group = cgroup_memory(root, proc_cgroup)
    if group is None:
        return Available(machine, how)
    limit, usage, where = group
    left = max(0.0, limit - usage)
    if left >= machine:
        return Available(machine, how, limit)
    return Available(left, f"this process's cgroup: {left / GIB:.2f} GiB left of its {limit / GIB:.2f} GiB limit "
                           f"({where}; {usage / GIB:.2f} GiB in use), below the machine's "
                           f"{machine / GIB:.1f} GiB available", limit)


def usable_cores(root: Path | None = None, proc_cgroup: Path | None = None) -> tuple[int, str]:
    """(cores, how): this process's CPU affinity, or its cgroup's CPU quota (rounded up) when lower."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    how = f"{cores} core(s) in this process's CPU affinity"
    root = root or CGROUP_ROOT
    quotas = []
    for d in _levels(root, own_cgroup("", proc_cgroup)):
        quota, _, period = (_read(d / "cpu.max") or "").partition(" ")
        if quota.isdigit() and period.strip().isdigit() and int(period):
            quotas.append((int(quota) / int(period), str(d / "cpu.max")))
    if (root / "cpu").is_dir():
        for d in _levels(root / "cpu", own_cgroup("cpu", proc_cgroup)):
            quota, period = _number(d / "cpu.cfs_quota_us"), _number(d / "cpu.cfs_period_us")
            if quota and quota > 0 and period:
                quotas.append((quota / period, str(d / "cpu.cfs_quota_us")))
    if quotas:
        share, where = min(quotas)
        if math.ceil(share) <= cores:
            return max(1, math.ceil(share)), f"the cgroup's CPU quota of {share:g} core(s) ({where})"
    return cores, how
