"""Read a monitor folder of any size in one streaming pass: every rank's records merged in time order, summed
into running totals, time bins and per-launch groups, never all in memory at once.

Memory grows with the number of ranks and time bins (at most ``MAX_BINS``), not with the number of records:
intervals of one launch are grouped across ranks by their step number (all ranks end an interval at the same
step) and each group is settled, and dropped, once the merged stream has moved ``HORIZON_S`` past it.

Before that pass, :func:`mfu_lab.analysis.monitor.runs.scan` tells the folder's runs apart (one is read, the
others are counted and named) and finds each rank's clock offset, which is taken off its records' times, so that
ranks whose clocks are hours apart still meet in one interval group. Every record passes
:func:`mfu_lab.analysis.monitor.check.problem` first: a wrong type, a value that is not finite or a negative
duration is skipped and counted, never summed.

Interval fields read (the contract in :mod:`mfu_lab.core.store.monitor_files`): ``wall_s`` (the steps' time), and inside
it ``data_s`` (the data wait, where it was timed: ``data_timed`` false says it was not; absent means timed, as
before), ``host_s`` (null: not timed), ``other_s`` (evaluation, checkpoints, logging outside the training steps)
and ``comm_s`` (a collective in flight). The record's MFU and tokens/s are over ``wall_s - other_s``, so they
are weighted by that time here.
"""

from __future__ import annotations

import heapq
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mfu_lab.analysis.monitor.check import Skipped, problem
from mfu_lab.analysis.monitor.runs import Incarnations, Plan, scan
from mfu_lab.core.store.monitor_files import ReadCount, iter_records, rank_files

MAX_BINS = 120
HORIZON_S = 900.0  # a group of intervals is settled once the stream is this far past it
STRAGGLER_NOISE = 0.05  # the slowest rank's work per step must exceed the group's median by 5% to count


@dataclass
class Sums:
    wall: float = 0.0
    data: float = 0.0
    data_wall: float = 0.0  # wall time of the intervals whose data wait was timed
    host_wall: float = 0.0  # wall time of the intervals whose host time was timed
    other: float = 0.0  # evaluation, checkpoints, logging outside the training steps
    other_wall: float = 0.0  # wall time of the intervals that recorded it (other_s; records since v2)
    host: float = 0.0
    comm: float = 0.0
    comm_wall: float = 0.0  # wall time of the intervals whose communication was timed
    tokens: float = 0.0
    tokens_wall: float = 0.0
    samples: float = 0.0  # work that is not tokens (images, rows): the monitor's samples= (issue 47)
    samples_wall: float = 0.0
    mfu_wall: float = 0.0  # sum of mfu x wall
    mfu_w: float = 0.0  # training time (wall - other) of the intervals with an MFU
    steps: int = 0
    step_med_sum: float = 0.0  # sum of interval medians x steps
    throttle_s: float = 0.0
    work: float = 0.0  # wall - time with a collective in flight (wall where collectives were not timed)
    intervals: int = 0

    def add(self, r: dict[str, Any]) -> None:
        wall = float(r.get("wall_s") or 0.0)
        other = min(wall, float(r.get("other_s") or 0.0))
        self.wall += wall
        self.other += other
        if r.get("other_s") is not None:
            self.other_wall += wall
        if r.get("data_timed") is not False:  # absent: timed (records written before the field existed)
            self.data += float(r.get("data_s") or 0.0)
            self.data_wall += wall
        if r.get("host_s") is not None:  # null: no loader wrapped, host time not timed
            self.host += float(r["host_s"])
            self.host_wall += wall
        self.work += wall
        if r.get("comm_s") is not None:
            self.comm += float(r["comm_s"])
            self.comm_wall += wall
            self.work -= float(r["comm_s"])
        train = wall - other  # the writer takes MFU and tokens/s over this: evaluation etc. left out
        if r.get("tokens") and train > 0:
            self.tokens += float(r["tokens"])
            self.tokens_wall += train
        if r.get("samples") and train > 0:
            self.samples += float(r["samples"])
            self.samples_wall += train
        if r.get("mfu") is not None and train > 0:
            self.mfu_wall += float(r["mfu"]) * train
            self.mfu_w += train
        n = int(r.get("steps") or 0)
        self.steps += n
        self.step_med_sum += float((r.get("step_s") or {}).get("median") or 0.0) * n
        self.throttle_s += throttle_seconds(r)
        self.intervals += 1

    def share(self, part: str) -> float | None:
        if part == "comm":
            return self.comm / self.comm_wall if self.comm_wall > 0 else None
        if part == "data":
            return self.data / self.data_wall if self.data_wall > 0 else None
        if part == "other":
            return self.other / self.other_wall if self.other_wall > 0 else None
        if part == "host":
            return self.host / self.host_wall if self.host_wall > 0 else None
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
    plan: Plan | None = None
    skipped: Skipped = field(default_factory=Skipped)
    left_out: dict[str, int] = field(default_factory=dict)  # run -> records read and left out
    flops: dict[tuple[str, int], dict[str, Any]] = field(default_factory=dict)  # (node, rank) -> its latest count
    framework: dict[tuple[str, int], dict[str, Any]] = field(default_factory=dict)  # its framework's own figure


PROGRESS_EVERY = 200_000  # records between two progress lines


def read_folder(folder: Path, progress=None, run: str | None = None) -> Folder:
    """One pass over the records of one run of ``folder`` (``run``; default: the latest by start time);
    ``progress(line)`` hears how far it got on long reads."""
    folder = Path(folder)
    files = rank_files(folder)
    total_bytes = sum(_size(p) for f in files for p in f.paths) or 1
    plan = scan(files, run, progress)
    t_lo = plan.t_lo if plan.t_lo is not None else 0.0
    t_hi = plan.t_hi if plan.t_hi is not None else t_lo
    n_bins = MAX_BINS if t_hi > t_lo else 1
    edges = [t_lo + (t_hi - t_lo) * i / n_bins for i in range(n_bins + 1)]
    st = Folder(folder, ReadCount(), sum(len(f.paths) for f in files), {}, Sums(), {}, {}, edges,
                [Sums() for _ in range(n_bins)], {}, {}, [GpuBin() for _ in range(n_bins)], [], {}, {}, {},
                plan=plan)
    pending: dict[tuple[str, int], dict[tuple[str, int], tuple[float, int]]] = {}
    pending_t: dict[tuple[str, int], float] = {}
    counts = [ReadCount() for _ in files]
    streams = [_checked(f, c, st) for f, c in zip(files, counts)]
    for n, r in enumerate(heapq.merge(*streams, key=lambda rec: rec["t"]), 1):
        _take(st, r, pending, pending_t)
        if progress is not None and n % PROGRESS_EVERY == 0:
            done = sum(c.bytes for c in counts)
            progress(f"read {n:,} records of {len(files)} rank file(s), {done / total_bytes:.0%} of "
                     f"{total_bytes / 2**20:.0f} MiB")
        if pending_t and r["t"] - min(pending_t.values()) > HORIZON_S:
            for key in [k for k, t in pending_t.items() if r["t"] - t > HORIZON_S]:
                _settle(st, pending.pop(key))
                pending_t.pop(key)
    for key in list(pending):
        _settle(st, pending.pop(key))
    st.world = max([int(s.get("world") or 1) for s in st.ranks.values()] + [len(st.ranks) or 1])
    for c in counts:
        _add_count(st.count, c)
    return st


def _size(p: Path) -> int:
    try:
        return p.stat().st_size
    except OSError:
        return 0


def _add_count(total: ReadCount, c: ReadCount) -> None:
    total.lines += c.lines
    total.bytes += c.bytes
    total.records += c.records
    total.skipped += c.skipped
    total.skipped_examples.extend(c.skipped_examples[: max(0, 5 - len(total.skipped_examples))])
    total.unreadable_files.extend(c.unreadable_files)


def _checked(rf, count: ReadCount, st: Folder):
    """One rank's records that pass the field check and belong to the chosen run, on the reference clock."""
    plan = st.plan
    one_part = len(rf.paths) == 1
    incarnations = Incarnations(str(getattr(rf, "run", "") or ""))
    for rec in iter_records(rf.paths, count):
        why = problem(rec)
        if why is not None:
            where = f"{rf.paths[0].name}:{count.lines}" if one_part else \
                f"{rf.host}-rank{rf.rank} (line {count.lines} of its {len(rf.paths)} files)"
            st.skipped.add(why, where)
            continue
        key = incarnations.key(rec)
        run = plan.launch_run.get(key, "")
        if run != plan.chosen:
            st.left_out[run] = st.left_out.get(run, 0) + 1
            continue
        off = plan.offsets.get((str(rec.get("node", "?")), int(rec.get("rank") or 0)))
        rec = dict(rec, launch=plan.launch_group.get(key, key))  # local ids: the launch its processes made
        if off:
            rec["t"] -= off
            if isinstance(rec.get("t0"), (int, float)):
                rec["t0"] -= off
        yield rec


def _bin(st: Folder, t: float) -> int:
    lo, hi = st.edges[0], st.edges[-1]
    if hi <= lo:
        return 0
    return min(len(st.bins) - 1, max(0, int((t - lo) / (hi - lo) * len(st.bins))))


def _take(st: Folder, r: dict[str, Any], pending, pending_t) -> None:
    kind, node, rank = r["kind"], str(r.get("node", "?")), int(r.get("rank") or 0)
    launch = str(r.get("launch") or "")
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
    elif kind == "flops" and (r.get("per_step") or (node, rank) not in st.flops):  # a failed count keeps the last
        st.flops[(node, rank)] = {k: r.get(k) for k in ("source", "per_step", "per_token", "per_sample", "step",
                                                        "tokens")} | {"launch": launch}
    elif kind == "end":
        if isinstance(r.get("framework"), dict):
            st.framework[(node, rank)] = r["framework"] | {"launch": launch}
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
        for table, key in ((st.node_bins, node), (st.rank_bins, (node, rank))):
            if key not in table:  # built once per node and rank, not per record
                table[key] = [Sums() for _ in st.bins]
            table[key][b].add(r)
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
