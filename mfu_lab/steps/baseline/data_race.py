"""Step 1's loader race: when the device waits on data, the loader's own knobs are raced side by side.

The knobs are the DataLoader's: ``num_workers``, ``prefetch_factor``, ``pin_memory`` (CUDA) and
``persistent_workers``. Each candidate is the job with some of them changed. Each round is one epoch of each
candidate's loader (a fresh iterator: idle workers of one candidate cannot fill their queue while the others run,
which would hide its waits); its first step, which pays the workers' start and first fetch, is discarded, then
the same model trains on for a few steps, in interleaved rounds
(:func:`mfu_lab.core.measure.sidebyside.interleave`: drift lands on every candidate alike). ``persistent_workers`` only
changes what an epoch boundary costs, which the
discarded step hides, so it stays at the job's value: the race cannot rank it. The pick is
the candidate of the lowest median step time; it is adopted only when its bootstrap interval against the job's own
loader lies above 1 (:func:`mfu_lab.core.measure.sidebyside.bootstrap_speedup`). A user's own DataLoader or iterable
fixes its knobs: the race says which cannot be changed from outside and does not run.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
from typing import Any

from mfu_lab.core.engine.data import LOADER_KNOBS, build_loader, data_kind
from mfu_lab.core.job.schema import Job
from mfu_lab.core.measure.sidebyside import bootstrap_speedup, interleave
from mfu_lab.core.measure.timed import run_steps

ROUNDS = 3  # interleaved rounds per candidate
STEPS_PER_ROUND = 4  # timed steps per candidate and round, after one discarded step (its workers' start)


def knobs(job: Job) -> dict[str, Any]:
    return {k: getattr(job, k) for k in LOADER_KNOBS}


def label(k: dict[str, Any]) -> str:
    if not k["num_workers"]:
        return "num_workers=0"
    return (f"num_workers={k['num_workers']} prefetch_factor={k['prefetch_factor']}"
            + (" pin_memory" if k["pin_memory"] else "") + (" persistent" if k["persistent_workers"] else ""))


def candidates(job: Job, device_type: str, cores: int | None = None) -> list[dict[str, Any]]:
    """The job's own knobs first, then in-process loading, 1 and 2 workers (and one per core, up to 4) with the
    default and a deeper prefetch, pinned on CUDA; each distinct once."""
    cores = cores or os.cpu_count() or 1
    own = knobs(job)
    out = [own]
    workers = sorted({0, 1, 2, min(4, cores)})
    for w in workers:
        for pf in ((2, 4) if w else (2,)):
            k = {"num_workers": w, "prefetch_factor": pf if w else job.prefetch_factor,
                 "pin_memory": device_type == "cuda" and w > 0, "persistent_workers": job.persistent_workers}
            if label(k) not in {label(c) for c in out}:
                out.append(k)
    return out


def shutdown(loader: Any) -> None:
    """End a DataLoader's (or a Feed's) worker processes now rather than at garbage collection."""
    inner = getattr(loader, "loader", loader)
    it = getattr(inner, "_iterator", None)
    if it is not None and hasattr(it, "_shutdown_workers"):
        it._shutdown_workers()
        inner._iterator = None


def race_loader(job: Job, train_step, torch_device, device_type: str, data_wait: float, limit: float,
                progress=None) -> dict[str, Any]:
    """The race's record for ``result.json`` (``loader_race``): the candidates, their measured medians and data
    wait, the pick and its interval against the job's own loader; ``{}`` when the data wait is within ``limit``."""
    if data_wait <= limit:
        return {}
    why = f"step 1 measured data wait {data_wait:.1%} of wall time (limit {limit:.0%})"
    if data_kind(job) == "factory":
        probe = build_loader(job, 1, device_type)
        fixed = list(getattr(probe, "fixed", ()))
        if fixed:
            return {"why": why, "ran": False, "fixed": fixed,
                    "note": f"the data factory ({job.data}) returns its own loader or iterable: its "
                            f"{', '.join(fixed)} cannot be changed from outside; set them where it builds its "
                            "DataLoader"}
    cands = candidates(job, device_type)
    names = [label(c) for c in cands]
    loaders = {n: build_loader(dataclasses.replace(job, **c), 1 + STEPS_PER_ROUND, device_type)
               for n, c in zip(names, cands)}

    def runner(name):
        def run(steps):
            t = run_steps(train_step, loaders[name], torch_device, 1, steps)  # one epoch: a fresh iterator
            return {"wall_s": t.measured("wall_s"), "data_s": t.measured("data_s"), "loss": t.loss[1:]}
        return run

    say = (lambda m: progress(f"loader race {m}")) if callable(progress) else None
    try:
        inter = interleave({n: runner(n) for n in names}, ROUNDS, STEPS_PER_ROUND, say, abba=True)
    finally:
        for loader in loaders.values():  # persistent workers end here, whatever happened
            shutdown(loader)
    rows = []
    for n, c in zip(names, cands):
        s = inter.series[n]
        rows.append({"candidate": n, "knobs": c, "steps": len(s.wall_s), "median_step_s": statistics.median(s.wall_s),
                     "data_wait_fraction": sum(s.data_s) / sum(s.wall_s)})
    best = min(rows, key=lambda r: r["median_step_s"])
    sp = bootstrap_speedup(inter.series[names[0]].wall_s, inter.series[best["candidate"]].wall_s)
    adopted = best["candidate"] != names[0] and sp.low > 1.0
    return {"why": why, "ran": True, "rows": rows, "reference": names[0], "pick": best["candidate"],
            "pick_knobs": best["knobs"], "speedup": {"value": sp.value, "low": sp.low, "high": sp.high},
            "adopted": adopted, "source": "measured",
            "method": f"{len(names)} loaders in {ROUNDS} interleaved rounds (ABBA order), each round one epoch of "
                      f"each loader: its first step discarded (the workers' start), {STEPS_PER_ROUND} timed; the "
                      "same model training on; speedup = median(own loader) / median(pick), 95% bootstrap "
                      "interval; persistent_workers left at the job's value (it changes only epoch boundaries)"}
