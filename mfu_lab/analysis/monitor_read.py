"""Read a monitor folder of any size in one streaming pass: every rank's records merged in time order, summed
into running totals, time bins and per-launch groups, never all in memory at once.

Memory grows with the number of ranks and time bins (at most ``MAX_BINS``), not with the number of records:
intervals of one launch are grouped across ranks by their step number (all ranks end an interval at the same
step) and each group is settled, and dropped, once the merged stream has moved ``HORIZON_S`` past it.
"""

from __future__ import annotations

import heapq
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mfu_lab.core.monitor_files import ReadCount, first_and_last_time, iter_records, rank_files

MAX_BINS = 120
HORIZON_S = 900.0  # a group of intervals is settled once the stream is this far past it
STRAGGLER_NOISE = 0.05  # the slowest rank's work per step must exceed the group's median by 5% to count


@dataclass
class Sums:
    wall: float = 0.0
    data: float = 0.0
    host: float = 0.0
    comm: float = 0.0
    comm_wall: float = 0.0  # wall time of the intervals whose communication was timed
    tokens: float = 0.0
    tokens_wall: float = 0.0
    mfu_wall: float = 0.0  # sum of mfu x wall
    mfu_w: float = 0.0  # wall with an MFU
    steps: int = 0
    step_med_sum: float = 0.0  # sum of interval medians x steps
    throttle_s: float = 0.0
    work: float = 0.0  # wall - time with a collective in flight (wall where collectives were not timed)
    intervals: int = 0

    def add(self, r: dict[str, Any]) -> None:
        wall = float(r.get("wall_s") or 0.0)
        self.wall += wall
        self.data += float(r.get("data_s") or 0.0)
        self.host += float(r.get("host_s") or 0.0)
        self.work += wall
        if r.get("comm_s") is not None:
            self.comm += float(r["comm_s"])
            self.comm_wall += wall
            self.work -= float(r["comm_s"])
        if r.get("tokens"):
            self.tokens += float(r["tokens"])
            self.tokens_wall += wall
        if r.get("mfu") is not None:
            self.mfu_wall += float(r["mfu"]) * wall
            self.mfu_w += wall
        n = int(r.get("steps") or 0)
        self.steps += n
        self.step_med_sum += float((r.get("step_s") or {}).get("median") or 0.0) * n
        self.throttle_s += throttle_seconds(r)
        self.intervals += 1

    def share(self, part: str) -> float | None:
        if part == "comm":
            return self.comm / self.comm_wall if self.comm_wall > 0 else None
        return getattr(self, part) / self.wall if self.wall > 0 else None

    @property
    def mfu(self) -> float | None:
        return self.mfu_wall / self.mfu_w if self.mfu_w > 0 else None

    @property
    def step_median(self) -> float | None:
        return self.step_med_sum / self.steps if self.steps else None

    @property
    def work_per_step(self) -> float | None:
        return self.work / self.steps if self.steps else None


def throttle_seconds(r: dict[str, Any]) -> float:
    """Time lost to throttled clocks in one interval: wall x share of busy samples with a power or thermal
    clock reason x (1 - their mean clock / the clock the datasheet peak assumes, or NVML's maximum where the
    chip's row gives none; the ratio capped at 1)."""
    gpu = r.get("gpu") or {}
    ratio, share = gpu.get("throttled_clock_ratio"), gpu.get("throttled_share")
    if not ratio or not share:
        return 0.0
    return float(r.get("wall_s") or 0.0) * float(share) * max(0.0, 1.0 - float(ratio))


@dataclass
class GpuBin:
    temperature_c_max: float | None = None
    clock_sum: float = 0.0
    clock_n: int = 0
    throttled_sum: float = 0.0
    power_sum: float = 0.0
    n: int = 0
    xid: int = 0
    ecc: int = 0

    def add(self, gpu: dict[str, Any]) -> None:
        t = gpu.get("temperature_c_max")
        if t is not None:
            self.temperature_c_max = t if self.temperature_c_max is None else max(self.temperature_c_max, t)
        ref = gpu.get("sm_clock_mhz_reference") or gpu.get("sm_clock_mhz_max")
        if gpu.get("sm_clock_mhz_busy_mean") and ref:
            self.clock_sum += min(1.0, gpu["sm_clock_mhz_busy_mean"] / ref)
            self.clock_n += 1
        self.throttled_sum += float(gpu.get("throttled_share") or 0.0)
        self.power_sum += float(gpu.get("power_w_mean") or 0.0)
        self.n += 1
        self.xid += len(gpu.get("xid") or [])
        self.ecc += int(gpu.get("ecc_uncorrected_new") or 0)


@dataclass
class Straggling:
    """Per rank (or node): how often it was the slowest of its interval group, and the time the others lost
    waiting for it (rank-seconds)."""

    groups: int = 0
    slowest: int = 0
    lost_s: float = 0.0
    excess: list[float] = field(default_factory=list)  # its work per step over the group's median, when slowest


@dataclass
class Launch:
    first_t: float
    last_t: float
    first_interval_t0: float | None = None
    ranks: set = field(default_factory=set)
    ended: set = field(default_factory=set)
    end_reasons: dict = field(default_factory=dict)
    slurm: dict = field(default_factory=dict)


@dataclass
class Folder:
    """Everything one pass over a monitor folder gathered."""

    path: Path
    count: ReadCount
    files: int
    ranks: dict[tuple[str, int], dict[str, Any]]  # (node, rank) -> its latest start record (slimmed)
    total: Sums
    per_rank: dict[tuple[str, int], Sums]
    per_node: dict[str, Sums]
    edges: list[float]
    bins: list[Sums]
    node_bins: dict[str, list[Sums]]
    rank_bins: dict[tuple[str, int], list[Sums]]
    gpu_bins: list[GpuBin]
    profiles: list[dict[str, Any]]
    launches: dict[str, Launch]
    stragglers: dict[tuple[str, int], Straggling]
    node_stragglers: dict[str, Straggling]
    groups: int = 0
    wait_s: float = 0.0  # rank-seconds every rank but the slowest spent waiting for it
    world: int = 1


PROGRESS_EVERY = 200_000  # records between two progress lines


def read_folder(folder: Path, progress=None) -> Folder:
    """One pass over every record of ``folder``; ``progress(line)`` hears how far it got on long reads."""
    folder = Path(folder)
    files = rank_files(folder)
    total_bytes = sum(p.stat().st_size for f in files for p in f.paths if p.is_file()) or 1
    count = ReadCount()
    times = [first_and_last_time(f.paths) for f in files]
    t_lo = min((a for a, _ in times if a is not None), default=0.0)
    t_hi = max((b for _, b in times if b is not None), default=t_lo)
    n_bins = MAX_BINS if t_hi > t_lo else 1
    edges = [t_lo + (t_hi - t_lo) * i / n_bins for i in range(n_bins + 1)]
    st = Folder(folder, count, sum(len(f.paths) for f in files), {}, Sums(), {}, {}, edges,
                [Sums() for _ in range(n_bins)], {}, {}, [GpuBin() for _ in range(n_bins)], [], {}, {}, {})
    pending: dict[tuple[str, int], dict[tuple[str, int], tuple[float, int]]] = {}
    pending_t: dict[tuple[str, int], float] = {}
    streams = [iter_records(f.paths, count) for f in files]
    for n, r in enumerate(heapq.merge(*streams, key=lambda rec: rec["t"]), 1):
        _take(st, r, pending, pending_t)
        if progress is not None and n % PROGRESS_EVERY == 0:
            progress(f"read {n:,} records of {len(files)} rank file(s), {count.bytes / total_bytes:.0%} of "
                     f"{total_bytes / 2**20:.0f} MiB")
        if pending_t and r["t"] - min(pending_t.values()) > HORIZON_S:
            for key in [k for k, t in pending_t.items() if r["t"] - t > HORIZON_S]:
                _settle(st, pending.pop(key))
                pending_t.pop(key)
    for key in list(pending):
        _settle(st, pending.pop(key))
    st.world = max([int(s.get("world") or 1) for s in st.ranks.values()] + [len(st.ranks) or 1])
    return st


def _bin(st: Folder, t: float) -> int:
    lo, hi = st.edges[0], st.edges[-1]
    if hi <= lo:
        return 0
    return min(len(st.bins) - 1, max(0, int((t - lo) / (hi - lo) * len(st.bins))))


def _take(st: Folder, r: dict[str, Any], pending, pending_t) -> None:
    kind, node, rank = r["kind"], str(r.get("node", "?")), int(r.get("rank") or 0)
    launch = str(r.get("launch", ""))
    lau = st.launches.get(launch)
    if lau is None:
        lau = st.launches[launch] = Launch(r["t"], r["t"])
    lau.first_t, lau.last_t = min(lau.first_t, r["t"]), max(lau.last_t, r["t"])
    lau.ranks.add((node, rank))
    if kind == "start":
        st.ranks[(node, rank)] = {k: r.get(k) for k in ("world", "local_rank", "node_rank", "device", "peak",
                                                         "flops", "comm", "nvml", "scheduler", "settings")}
    elif kind == "cluster":
        lau.slurm = r.get("slurm") or {}
    elif kind == "end":
        lau.ended.add((node, rank))
        lau.end_reasons[f"{node}/rank{rank}"] = r.get("reason")
    elif kind == "profile" and r.get("breakdown"):
        st.profiles.append({"t": r["t"], "node": node, "rank": rank, "window_s": r.get("window_s"),
                            "breakdown": r["breakdown"], "overhead_s": r.get("overhead_s")})
    elif kind == "interval" and r.get("steps"):
        b = _bin(st, r["t"])
        st.total.add(r)
        st.per_rank.setdefault((node, rank), Sums()).add(r)
        st.per_node.setdefault(node, Sums()).add(r)
        st.bins[b].add(r)
        st.node_bins.setdefault(node, [Sums() for _ in st.bins])[b].add(r)
        st.rank_bins.setdefault((node, rank), [Sums() for _ in st.bins])[b].add(r)
        if r.get("gpu"):
            st.gpu_bins[b].add(r["gpu"])
        t0 = r.get("t0")
        if isinstance(t0, (int, float)):
            lau.first_interval_t0 = t0 if lau.first_interval_t0 is None else min(lau.first_interval_t0, t0)
        if r.get("comm_s") is not None and not r.get("partial"):
            key = (launch, int(r.get("step") or 0))
            work = (float(r["wall_s"]) - float(r["comm_s"])) / int(r["steps"])
            pending.setdefault(key, {})[(node, rank)] = (work, int(r["steps"]))
            pending_t.setdefault(key, r["t"])


def _settle(st: Folder, group: dict[tuple[str, int], tuple[float, int]]) -> None:
    """One interval across ranks: the slowest rank's work per step against the others'. Every other rank
    waited (slowest - its own) per step in its collectives."""
    if len(group) < 2:
        return
    st.groups += 1
    works = {k: w for k, (w, _) in group.items()}
    steps = min(n for _, n in group.values())
    slow = max(works, key=works.get)
    med = statistics.median(works.values())
    lost = sum(works[slow] - w for w in works.values()) * steps
    st.wait_s += lost
    for k in works:
        st.stragglers.setdefault(k, Straggling()).groups += 1
    s = st.stragglers[slow]
    if med > 0 and works[slow] > med * (1 + STRAGGLER_NOISE):
        s.slowest += 1
        s.lost_s += lost
        s.excess.append(works[slow] / med - 1)
    nodes: dict[str, list[float]] = {}
    for (node, _), w in works.items():
        nodes.setdefault(node, []).append(w)
    if len(nodes) > 1:
        node_work = {n: max(ws) for n, ws in nodes.items()}  # a node is as slow as its slowest rank
        slow_node = max(node_work, key=node_work.get)
        node_med = statistics.median(node_work.values())
        for n in node_work:
            st.node_stragglers.setdefault(n, Straggling()).groups += 1
        if node_med > 0 and node_work[slow_node] > node_med * (1 + STRAGGLER_NOISE):
            ns = st.node_stragglers[slow_node]
            ns.slowest += 1
            ns.lost_s += sum(node_work[slow_node] - w for w in works.values()) * steps
            ns.excess.append(node_work[slow_node] / node_med - 1)
