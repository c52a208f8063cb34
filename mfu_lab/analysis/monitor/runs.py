"""Before the report reads a monitor folder: which run each launch belongs to, and how far each rank's clock is
off. One quick pass over the records (no sums kept), then :mod:`mfu_lab.analysis.monitor.read` reads one run.

Runs. A folder may hold several jobs: two launched into one folder, or one after the other. A launch belongs to
the run named in its start record (``run``, written by the monitor), else to the run in its file's name
(``<host>-<run>-rank<k>.jsonl``), else to the job its launch id names (torchrun's run id, Slurm's job and step,
without the restart count). Launches with none of these (a plain ``python train.py``: one launch id per
process) are chained: a launch joins a run when it runs at the same time as one of the run's launches with
other rank numbers (the other ranks of one job), or starts after the run's last record when the run's last
launch did not end cleanly (a restart after a crash), and the world sizes agree. Rank k cannot run twice at
once, so two launches with a common rank number at the same time are two jobs. A rank that starts again in
another process under a launch id already used (torchrun's default rendezvous id 'none' and port 29500 give
every such job one id) begins a new launch (:class:`Incarnations`): a restart of the run when the launch before
it did not end cleanly, else another job.

Clocks. Every rank of a data-parallel job leaves each step's collectives at the same moment, so the intervals
that end at the same step on two ranks end at the same time. A rank's clock offset is the median, over the
steps it shares with the reference rank (the one in most steps), of its interval's end time minus the
reference's. Offsets above ``CLOCK_TOLERANCE_S`` are corrected when the differences agree (their median
deviation within ``CLOCK_SPREAD``); otherwise they are named as not corrected.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mfu_lab.analysis.monitor.check import problem
from mfu_lab.core.store.monitor_files import ReadCount, iter_records

CLOCK_TOLERANCE_S = 1.0  # a rank's clock this far from the reference's is corrected (ranks leave a step
# within milliseconds of each other; the host work before step() adds tens)
CLOCK_SPREAD = 0.1  # ... when its differences deviate from their median by at most 10% of it (or the tolerance)
CLOCK_SAMPLES = 200  # interval records per rank and launch the clock estimate reads


@dataclass
class LaunchInfo:
    key: str
    first_t: float
    last_t: float
    ranks: set = field(default_factory=set)  # (node, rank)
    ended: set = field(default_factory=set)
    run: str = ""  # named in the start record or the file name, or derived from the launch id
    world: int | None = None
    records: int = 0
    group: str = ""  # the launches that ran together as one launch of one job (one per process for local ids)

    @property
    def rank_numbers(self) -> set[int]:
        return {r for _, r in self.ranks}


@dataclass
class Plan:
    """The runs of a folder, the one chosen, each launch's group, and the clock offsets of the chosen run."""

    runs: dict[str, dict[str, Any]]  # run -> {records, ranks, launches, first_t, last_t}
    chosen: str | None
    launch_run: dict[str, str]
    launch_group: dict[str, str]
    offsets: dict[tuple[str, int], float]  # (node, rank) -> seconds its clock is ahead of the reference
    clock: dict[str, Any]  # what was found: reference, offsets, corrected, not corrected and why
    t_lo: float | None = None
    t_hi: float | None = None


def launch_key(rec: dict[str, Any], file_run: str = "") -> str:
    """The launch a record belongs to: its launch id, within its run when the record or its file names one (two
    jobs may share a launch id: torchrun's default run id is 'none')."""
    launch, run = str(rec.get("launch") or ""), str(rec.get("run") or "") or file_run
    return f"{run}|{launch}" if run else launch


class Incarnations:
    """The launch of each record of one rank's files, read in order: :func:`launch_key`, and a new one each time
    a rank of that launch starts again in another process. Two jobs can share a launch id (torchrun's default
    rendezvous id is 'none', its port 29500): the second job's ranks start again under the same id."""

    def __init__(self, file_run: str = ""):
        self.file_run = file_run
        self._seen: dict[tuple[str, tuple[str, int]], tuple[int, Any]] = {}

    def key(self, rec: dict[str, Any]) -> str:
        base = launch_key(rec, self.file_run)
        who = (str(rec.get("node", "?")), int(rec.get("rank") or 0))
        n, pid = self._seen.get((base, who), (0, None))
        if rec["kind"] == "start":
            if (base, who) in self._seen and rec.get("pid") != pid:
                n += 1
            self._seen[(base, who)] = (n, rec.get("pid"))
        return base if n == 0 else f"{base}~{n}"


def _derived(launch: str) -> str:
    """The job a launch id names, without its restart count; '' for a per-process (local) id."""
    base, _, n = launch.rpartition("~")
    if base and n.isdigit():  # a second job under the same launch id (Incarnations)
        job = _derived(base)
        return f"{job}~{n}" if job else ""
    if launch.startswith(("torchrun:", "slurm:")):
        return launch.rsplit("#", 1)[0]
    return ""


def scan(files, run: str | None = None, progress=None) -> Plan:
    """One pass over every rank's records (``files``: :func:`rank_files`' answer) to tell runs apart and find
    the clock offsets; ``run`` chooses a run (default: the latest by start time)."""
    launches: dict[str, LaunchInfo] = {}
    samples: dict[tuple[str, int], dict[tuple[str, int], float]] = {}  # (launch, step) -> {(node, rank): t}
    sampled: dict[tuple[str, str, int], int] = {}
    for i, rf in enumerate(files):
        file_run = str(getattr(rf, "run", "") or "")
        incarnations = Incarnations(file_run)
        for rec in iter_records(rf.paths, ReadCount()):
            if problem(rec) is not None:
                continue
            key, t = incarnations.key(rec), float(rec["t"])
            who = (str(rec.get("node", "?")), int(rec.get("rank") or 0))
            lau = launches.get(key)
            if lau is None:
                lau = launches[key] = LaunchInfo(key, t, t, run=str(rec.get("run") or "") or file_run)
            lau.first_t, lau.last_t = min(lau.first_t, t), max(lau.last_t, t)
            lau.ranks.add(who)
            lau.records += 1
            kind = rec["kind"]
            if kind == "start":
                lau.world = rec.get("world") or lau.world
            elif kind == "end":
                lau.ended.add(who)
            elif kind == "interval" and rec.get("steps") and not rec.get("partial") and rec.get("step") is not None:
                n = sampled.get((key, *who), 0)
                if n < CLOCK_SAMPLES:
                    sampled[(key, *who)] = n + 1
                    samples.setdefault((key, rec["step"]), {})[who] = t
        if progress is not None and len(files) > 64 and (i + 1) % 64 == 0:
            progress(f"scanned {i + 1} of {len(files)} rank file(s) for runs and clocks")
    _assign(launches)
    runs: dict[str, dict[str, Any]] = {}
    for lau in launches.values():
        r = runs.setdefault(lau.run, {"records": 0, "ranks": set(), "launches": 0, "first_t": lau.first_t,
                                      "last_t": lau.last_t})
        r["records"] += lau.records
        r["ranks"] |= lau.ranks
        r["launches"] += 1
        r["first_t"], r["last_t"] = min(r["first_t"], lau.first_t), max(r["last_t"], lau.last_t)
    chosen = run if run is not None else max(runs, key=lambda k: (runs[k]["first_t"], k), default=None)
    mine = {k: lau for k, lau in launches.items() if lau.run == chosen}
    offsets, clock = _clocks(mine, samples)
    plan = Plan(runs, chosen, {k: lau.run for k, lau in launches.items()},
                {k: lau.group for k, lau in launches.items()}, offsets, clock)
    lo = [lau.first_t - _off(offsets, lau) for lau in mine.values()]
    hi = [lau.last_t - _off(offsets, lau) for lau in mine.values()]
    plan.t_lo, plan.t_hi = (min(lo), max(hi)) if lo else (None, None)
    return plan


def _off(offsets, lau: LaunchInfo) -> float:
    """The offset that moves a launch's span: its ranks share it when they share a host (the usual case)."""
    offs = [offsets.get(w, 0.0) for w in lau.ranks]
    return statistics.median(offs) if offs else 0.0


def _assign(launches: dict[str, LaunchInfo]) -> None:
    """Give every launch its run and group (module docstring)."""
    chains: list[dict[str, Any]] = []
    for lau in sorted(launches.values(), key=lambda x: (x.first_t, x.key)):
        base, _, n = lau.key.rpartition("~")
        if base and n.isdigit() and not lau.run:  # started again under a launch id already used
            prev = launches.get(base if n == "1" else f"{base}~{int(n) - 1}")
            crashed = prev is not None and prev.last_t <= lau.first_t and not prev.ended >= prev.ranks
            lau.run = prev.run if crashed and prev.run else _derived(lau.key) or lau.key
            lau.group = lau.key
            continue
        lau.run = lau.run or _derived(lau.key)
        if lau.run:
            lau.group = lau.key
            continue
        best, best_gap = None, None
        for ch in chains:
            if ch["world"] and lau.world and ch["world"] != lau.world:
                continue
            together = [p for p in ch["launches"] if p.first_t <= lau.last_t and lau.first_t <= p.last_t]
            if any(p.rank_numbers & lau.rank_numbers for p in together):
                continue  # rank k twice at once: another job
            if together:
                gap = min(abs(p.first_t - lau.first_t) for p in together)
            else:
                last = max(ch["launches"], key=lambda p: p.last_t)
                if lau.first_t < last.last_t or last.ended >= last.ranks:
                    continue  # overlapping, or the run closed cleanly: a new job, not a restart
                gap = lau.first_t - last.last_t + 1e9  # a restart: only when no running job takes it
            if best_gap is None or gap < best_gap:
                best, best_gap = ch, gap
        if best is None:
            best = {"run": lau.key, "world": lau.world, "launches": [], "groups": []}
            chains.append(best)
        together = [p for p in best["launches"] if p.first_t <= lau.last_t and lau.first_t <= p.last_t]
        lau.run = best["run"]
        lau.group = together[0].group if together else lau.key
        best["launches"].append(lau)
        best["world"] = best["world"] or lau.world


def _clocks(mine: dict[str, LaunchInfo], samples) -> tuple[dict[tuple[str, int], float], dict[str, Any]]:
    """Each rank's clock offset against the reference rank, from the steps both ended (module docstring)."""
    groups: dict[tuple[str, int], dict[tuple[str, int], float]] = {}
    for (launch, step), ts in samples.items():
        lau = mine.get(launch)
        if lau is not None:
            groups.setdefault((lau.group, step), {}).update(ts)
    ranks = sorted({w for g in groups.values() for w in g})  # the ranks with a timed step
    clock: dict[str, Any] = {"reference": None, "offsets_s": {}, "corrected": [], "not_corrected": [],
                             "not_compared": []}
    if len(ranks) < 2:
        return {}, clock
    seen = {w: sum(w in g for g in groups.values()) for w in ranks}
    ref = min(ranks, key=lambda w: (-seen[w], w))
    clock["reference"] = f"{ref[0]}/rank{ref[1]}"
    offsets = {}
    for w in ranks:
        if w == ref:
            continue
        name = f"{w[0]}/rank{w[1]}"
        diffs = [g[w] - g[ref] for g in groups.values() if w in g and ref in g]
        if not diffs:
            clock["not_compared"].append(name)
            continue
        off = statistics.median(diffs)
        spread = statistics.median(abs(d - off) for d in diffs)
        clock["offsets_s"][name] = off
        if abs(off) <= CLOCK_TOLERANCE_S:
            continue
        if spread <= max(CLOCK_TOLERANCE_S, CLOCK_SPREAD * abs(off)):
            offsets[w] = off
            clock["corrected"].append(name)
        else:
            clock["not_corrected"].append(f"{name} (its steps end {off:+.1f} s from the reference's, but vary "
                                          f"by {spread:.1f} s: no fixed offset)")
    return offsets, clock


def describe(plan: Plan, path: Path | None = None) -> list[str]:
    """The notes a report prints about the runs left out and the clocks."""
    notes = []
    others = {k: v for k, v in plan.runs.items() if k != plan.chosen}
    if others:
        import datetime as _dt

        def iso(t):
            return _dt.datetime.fromtimestamp(t, _dt.UTC).isoformat(timespec="seconds")

        listed = "; ".join(f"{k or '(no run id)'}: {v['records']:,} record(s) of {len(v['ranks'])} rank(s), "
                           f"{iso(v['first_t'])} to {iso(v['last_t'])}" for k, v in sorted(others.items()))
        notes.append(f"this folder holds {len(others)} other run(s), left out of this report (summarise one with "
                     f"mfu_lab.steps.monitor.run(DIR, run=RUN)): {listed}")
    c = plan.clock
    if c["corrected"]:
        offs = ", ".join(f"{n} {c['offsets_s'][n]:+.1f} s" for n in c["corrected"])
        notes.append(f"rank clocks disagreed with {c['reference']}'s and were corrected from the steps they end "
                     f"together: {offs}")
    if c["not_corrected"]:
        notes.append(f"rank clocks could not be corrected: {'; '.join(c['not_corrected'])}")
    if c["not_compared"]:
        notes.append(f"the clocks of {', '.join(c['not_compared'])} could not be compared with "
                     f"{c['reference']}'s: no step recorded by both")
    return notes
