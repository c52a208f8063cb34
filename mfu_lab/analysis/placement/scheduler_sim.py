"""Gang scheduling against partial starts: an event-driven simulation of a queue of jobs on a cluster's GPUs,
and step 6's comparison of the two policies on the cluster file's queue (or a seeded synthetic one).
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass

from mfu_lab.analysis.placement.cluster_files import Cluster, QueueEntry


@dataclass
class SimJob:
    name: str
    arrival_h: float
    gpus: int
    hours: float
    start_h: float | None = None
    end_h: float | None = None
    first_grab_h: float | None = None  # when it first held a GPU (partial starts)


@dataclass
class SimResult:
    policy: str
    jobs: list[SimJob]
    idle_gpu_hours: float  # GPUs held by jobs not yet running, plus free GPUs while a job waits
    makespan_h: float | None
    mean_completion_h: float | None  # end - arrival, over jobs that finished
    deadlock_h: float | None  # when nothing could progress any more (partial starts only)
    timeline: list[tuple[float, int, int]]  # (time, running GPUs, held-but-idle GPUs)


def simulate(queue: list[QueueEntry], total_gpus: int, policy: str, horizon_h: float | None = None) -> SimResult:
    """Event-driven queue simulation, first come first served.

    gang: a job starts only when all its GPUs are free at once (all-or-nothing).
    greedy: pods start one GPU at a time, handed out in turn to the waiting jobs (as a scheduler without
    gang semantics places pods of several jobs); a job holds what it got and runs once it holds all its GPUs.
    Two jobs holding parts of the cluster can then wait on each other forever: a deadlock.
    """
    if policy not in ("gang", "greedy"):
        raise ValueError("policy must be gang or greedy")
    jobs = [SimJob(q.name, q.arrival_h, q.gpus, q.hours) for q in sorted(queue, key=lambda q: q.arrival_h)]
    held = {j.name: 0 for j in jobs}
    t, free, idle = 0.0, total_gpus, 0.0
    timeline: list[tuple[float, int, int]] = []
    deadlock = None
    while True:
        waiting = [j for j in jobs if j.arrival_h <= t and j.start_h is None]
        if policy == "gang":
            for j in waiting:  # strict FIFO: the head blocks the rest
                if j.gpus > free:
                    break
                free -= j.gpus
                held[j.name] = j.gpus
                j.start_h = j.first_grab_h = t
                j.end_h = t + j.hours
        else:
            while free and any(held[j.name] < j.gpus for j in waiting):
                for j in waiting:
                    if free and held[j.name] < j.gpus:
                        held[j.name] += 1
                        free -= 1
                        j.first_grab_h = t if j.first_grab_h is None else j.first_grab_h
            for j in waiting:
                if held[j.name] == j.gpus:
                    j.start_h, j.end_h = t, t + j.hours
        running = [j for j in jobs if j.start_h is not None and j.end_h > t]
        idle_held = sum(held[j.name] for j in jobs if j.start_h is None)
        still_waiting = [j for j in jobs if j.start_h is None and j.arrival_h <= t]
        timeline.append((t, sum(j.gpus for j in running), idle_held))
        events = [j.end_h for j in running] + [j.arrival_h for j in jobs if j.arrival_h > t]
        if not events:
            if still_waiting:
                deadlock = t
            break
        nxt = min(events)
        if horizon_h is not None and nxt > horizon_h:
            nxt = horizon_h
        idle += (nxt - t) * (idle_held + (free if still_waiting else 0))
        if horizon_h is not None and nxt >= horizon_h:
            t = nxt
            break
        t = nxt
        for j in running:
            if j.end_h <= t:
                free += held[j.name]
                held[j.name] = 0
    if deadlock is not None and horizon_h is not None and horizon_h > t:
        idle += (horizon_h - t) * (sum(held.values()) + free)
    done = [j for j in jobs if j.end_h is not None]
    return SimResult(policy, jobs, idle, max((j.end_h for j in done), default=None) if len(done) == len(jobs) else None,
                     sum(j.end_h - j.arrival_h for j in done) / len(done) if done else None, deadlock, timeline)


def synthetic_queue(cluster: Cluster, seed: int) -> list[QueueEntry]:
    """Six jobs of a half, an eighth, a quarter, all, a sixteenth and a quarter of the cluster, arriving and
    running for seeded random times: the queue when the cluster file gives none."""
    rng = random.Random(seed)
    n = cluster.n_gpus
    sizes = [max(1, n // d) for d in (2, 8, 4, 1, 16, 4)]
    return [QueueEntry(f"job{i}", round(i * rng.uniform(0.2, 1.0), 2), min(s, n), round(rng.uniform(1, 6), 1))
            for i, s in enumerate(sizes)]


def gang_rows(cluster: Cluster, seed: int) -> list[dict]:
    """Both policies on the cluster's queue (or :func:`synthetic_queue`), over the gang run's makespan: a row each."""
    queue = cluster.queue or synthetic_queue(cluster, seed)
    q_from = "the cluster file's queue" if cluster.queue else f"a seeded synthetic queue (seed {seed})"
    horizon = simulate(queue, cluster.n_gpus, "gang").makespan_h
    rows = []
    for policy in ("gang", "greedy"):
        r = simulate(queue, cluster.n_gpus, policy, horizon_h=horizon)
        rows.append({"policy": policy, "idle_gpu_hours": r.idle_gpu_hours, "makespan_h": r.makespan_h,
                     "mean_completion_h": r.mean_completion_h, "deadlock_h": r.deadlock_h, "queue_from": q_from,
                     "horizon_h": horizon, "jobs": [dataclasses.asdict(j) for j in r.jobs],
                     "timeline": r.timeline})
    return rows
