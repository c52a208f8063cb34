"""Step 4's pick, confirmed: eager and the leading compile mode timed side by side before the mode is recommended.

Each trial of step 4 runs in a fresh process, one after the other, and a fresh process on a small or shared machine
can land 10% faster or slower than the next (measured on a 2-core CPU: the same eager step 218 ms in one run, 241 ms
in another). A mode whose p90 lies below eager's p10 across two such processes can therefore be luck. Here eager
and the mode each get a warm process of their own (:class:`mfu_lab.workers.verify_rung.RungProcess`; the mode's
reuses the cold trial's compile cache, so it compiles in seconds), then ``RACE_CONFIRM_TURNS`` interleaved rounds
(:func:`mfu_lab.core.measure.sidebyside.interleave`, in ABBA order) time both, and the mode stands only when the
bootstrap interval of its speedup over eager lies above 1.0 (:func:`mfu_lab.analysis.racing.confirm`).
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path

from mfu_lab.analysis import racing
from mfu_lab.core.engine.workload import eager
from mfu_lab.core.job.schema import Job
from mfu_lab.core.measure.device import release_device_memory
from mfu_lab.core.measure.sidebyside import interleave
from mfu_lab.core.process.budget import Clock
from mfu_lab.core.process.progress import as_progress
from mfu_lab.core.thresholds import RACE_CONFIRM_TURNS
from mfu_lab.workers.verify_rung import RungProcess


def turn_steps(job: Job) -> int:
    """Timed steps per candidate per round: the trial's steps spread over the rounds, at least the race's."""
    return max(job.race_steps, job.steps // (RACE_CONFIRM_TURNS + 1))


def confirm_mode(job: Job, device_type: str, mode: str, cache: Path, work: Path, clock: Clock, trials_s: float,
                 eager_step_s: float, say) -> racing.Confirmation:
    """Eager against ``mode`` in interleaved rounds (ABBA); ``cache`` is the cold trial's compile cache folder.

    Its time is estimated from above: ``trials_s``, the eager and the cold trial's whole seconds (each a process
    start, a build, a compile without a cache, warm-up and steps), plus the rounds' steps at eager's median step.
    On a GPU the launcher's own memory is released first and the two processes start one after the other, so the
    second does not meet the first's start-up peak."""
    rounds, steps = RACE_CONFIRM_TURNS, turn_steps(job)
    estimate = trials_s + 2 * rounds * steps * eager_step_s
    if not clock.fits(estimate):
        why = f"{clock.left_s():.0f} s of the step's share left, the confirmation needs about {estimate:.0f} s"
        clock.shorten("compile confirmation", f"mode {mode} not measured again beside eager ({why}); eager stays")
        return racing.Confirmation(mode, "eager", "skipped", "budget: " + why)
    t0 = time.perf_counter()
    base = dataclasses.replace(eager(job), verify_warmup_steps=job.compile_warmup_steps)
    specs = {"eager": base, mode: dataclasses.replace(base, compile_mode=mode)}
    env = {"TORCHINDUCTOR_CACHE_DIR": str(cache / "inductor"), "TRITON_CACHE_DIR": str(cache / "triton")}
    say(f"confirming {mode}: eager and {mode} in warm processes of their own, {rounds} interleaved rounds of "
        f"{steps} steps")
    procs: dict[str, RungProcess] = {}
    failed: dict[str, str] = {}
    release_device_memory(device_type)  # the rungs get the GPU the launcher let go of (a no-op on a CPU)

    def ready(name: str) -> None:
        try:
            procs[name].ready()
        except (RuntimeError, OSError) as e:
            failed[name] = str(e)

    try:
        for name, j in specs.items():  # on a CPU started together: each builds and warms up while the other does
            procs[name] = RungProcess({"rung": name.replace("/", "_"), "job": j.to_dict(),
                                       "steps_total": rounds * steps}, work, job.compile_timeout_s,
                                      env if name != "eager" else None)
            procs[name].beat = lambda waited, name=name: say(f"  {name}: still warming up ({waited:.0f} s so far)")
            if device_type == "cuda":
                ready(name)
        if device_type != "cuda":
            for name in procs:
                ready(name)

        def runner(name):
            def run(k):
                try:
                    return procs[name].run(k)
                except (RuntimeError, OSError) as e:  # OSError: its stdin closed, the process had died
                    failed[name] = str(e)
                    return None
            return run

        eta, lines = as_progress(say).eta("confirmation rounds", rounds * len(procs)), [0]

        def line(msg: str) -> None:  # interleave's line per process and round, with the time left
            lines[0] += 1
            say("  " + msg + eta.tag(min(lines[0], eta.total)))

        got = None if failed else interleave({name: runner(name) for name in procs}, rounds, steps, line, abba=True)
    finally:
        for proc in procs.values():
            proc.close()
    if failed:
        return racing.Confirmation(mode, "eager", "failed", "; ".join(failed.values()), rounds, steps,
                                   seconds=time.perf_counter() - t0)
    return racing.confirm(mode, "eager", got.series["eager"].wall_s, got.series[mode].wall_s, rounds, steps,
                          [name for _, name in got.order], time.perf_counter() - t0)
