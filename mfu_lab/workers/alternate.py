"""Configurations alternated in one launch: each runs several turns in ABBA order (A B, B A, ...), a fresh DDP model
timed for the race's screening steps each turn, so a steady drift over the launch lands on every configuration alike.
Step 7's DDP rung (:mod:`mfu_lab.steps.verify.ddp`) times the original against the tuned configuration this way;
:func:`turn_lines` is the launch's progress for it, a line per finished turn with the time left.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from mfu_lab.core.job.schema import Job
from mfu_lab.core.process.progress import as_progress
from mfu_lab.workers.comm_configs import config_key, config_name
from mfu_lab.workers.launch import error_lines, launch, world_layout


def turn_lines(progress, label: str, total: int):
    """A launch's ``progress`` for alternated turns (:func:`alternate`): a line per finished turn with the time
    left over ``total`` turns, and a heartbeat (core.process.progress) on the ranks' step and quiet events in
    between."""
    p = as_progress(progress)
    eta, beat, state = p.eta(label, total), p.heartbeat("  " + label), {"n": 0}

    def on(ev: dict) -> None:
        kind = ev.get("event")
        if kind in ("done", "unsupported", "error"):
            state["n"] += 1
            name = config_name(ev["config"]) if ev.get("config") else "the launch"
            p.say(f"  {label} [{state['n']}/{total}] {name}: {kind}" + eta.tag(min(state["n"], total)))
            beat.said()
        elif kind == "step":
            beat.beat(state["n"], total, f"turn {state['n'] + 1}, step {ev['done']}/{ev['total']}")
        elif kind == "quiet":
            beat.beat(state["n"], total, f"no event from the ranks for {ev['quiet_s']:.0f} s")

    return on


@dataclass
class Alternation:
    """Configurations alternated in one launch: each one's per-step times pooled over its turns."""

    walls: dict[tuple, list[float]]  # config_key -> the timed steps of all its turns
    order: list[tuple]  # config keys in the order their turns ran
    error: str = ""  # set when the launch did not finish every turn
    seconds: float = 0.0


def alternate(job: Job, device_type: str, attention: str | None, configs: list[dict], turns: int, work: Path,
              progress=None) -> Alternation:
    """``configs`` run ``turns`` times in one launch, in that order and then reversed (A B, B A, A B, ...), each turn
    a fresh DDP model timed for ``comm_steps`` steps after ``comm_warmup_steps`` (the race's screening protocol:
    nothing else is measured), so a steady drift over the launch lands on every configuration alike."""
    nnodes, nproc = world_layout(job, device_type)
    plan = [c for t in range(turns) for c in (configs if t % 2 == 0 else configs[::-1])]  # ABBA: drift lands evenly
    spec = {"job": job.to_dict(), "device_type": device_type, "attention": attention, "configs": plan,
            "allreduce_max_bytes": None, "fault": None, "screen": job.comm_steps}
    run = launch(job, spec, work, 0, nnodes, nproc, progress)
    done = [e for e in run.events if e["event"] == "done"]
    walls: dict[tuple, list[float]] = {config_key(c): [] for c in configs}
    order = []
    for e in done:
        walls[config_key(e["config"])] += e["wall_s"]
        order.append(config_key(e["config"]))
    error = ""
    if run.returncode != 0 or len(done) != len(plan):
        other = next((e.get("error") for e in run.events if e["event"] in ("error", "unsupported")), "")
        error = other or (f"the launch ended with code {run.returncode} after {len(done)} of {len(plan)} turns"
                          + (f": {error_lines(run.rank_stderr)}" if error_lines(run.rank_stderr) else ""))
    return Alternation(walls, order, error, run.seconds)
