"""gpu_check's workbook mode (``--workbook``): the whole workbook on ``parameters/gpt2_124m_gpu.yaml`` through papermill
(``mfu-lab run``, a child process) in one 10-minute call, then step 7's staircase, the original against the tuned job
side by side, with step 1's MFU and the tuned MFU, written to ``<out>/gpu-check/workbook.md`` and ``workbook.json``.

The plan (:func:`make_plan`), before anything starts: each step's seconds on one H200, estimated from the fixed costs
of the first H200 run (2026-12-04, ``docs/gpu-check.md``: a process start about 10 s, a cold compile 22 s, a
notebook 10 s, 49 ms a training step of this job) and the job's own counts (:func:`estimates`). When the whole run
without a budget fits ``--limit-s`` (counted from the check's own start), it runs without one. Otherwise it runs with
``mfu-lab run --budget`` sized to the time left, and names each step whose estimate is over its share of that
budget (each step then shortens itself by the rule in README 'Cost' and records what it left out, which the table
reads back from its result); when even the steps' minimums do not fit, it leaves steps out (``--steps``), in
:data:`DROP_ORDER`, and says so. Steps whose changes step 7 times nothing of on the job (:func:`untimed_steps`) are
also left out, said why, when the budget would otherwise cut the races of steps 3 and 4 (:data:`LEVER_STEPS`). A
child that is still running at the deadline is stopped (SIGTERM, then SIGKILL after :data:`GRACE_S`), and the table
is built from what finished.

No torch import at the module's top: the tests read all of it on a machine without a GPU, and the mode says a missing
Jupyter stack before torch's import (:func:`estimates` reads the races' sizes from mfu_lab, after it).
"""

from __future__ import annotations

import dataclasses
import datetime
import importlib.util
import json
import math
import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# mfu_lab's package imports torch (its facade): it is imported inside the functions that need it, so that the mode
# says a missing Jupyter stack before torch's ~10 s import. The steps as mfu_lab.core.registry names them (a test
# holds the two the same):
FOLDER = {"baseline": "01_baseline", "attention_comm": "02_attention_and_comm", "kernels": "03_kernels",
          "compile": "04_compile", "fp8": "05_fp8", "placement": "06_placement", "verify": "07_verify"}
KEYS = tuple(FOLDER)  # baseline ... verify, in the workbook's order
NUMBER = {k: i for i, k in enumerate(KEYS, 1)}

# What `mfu-lab run` needs beyond what the GPU machine has (torch, matplotlib, jinja2, pyyaml): the Jupyter stack.
NEEDED = ("papermill", "nbformat", "nbconvert", "ipykernel")
WHEELS_SCRIPT = "../shared/tools/gpu_wheels.sh"
INSTALL_LINE = ("python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site "
                ".whl/*.whl && export PYTHONPATH=/tmp/site:$PWD JUPYTER_PATH=/tmp/site/share/jupyter "
                "PATH=/tmp/site/bin:$PATH MPLBACKEND=Agg")


def missing_modules(names: tuple[str, ...] = NEEDED) -> list[str]:
    """The modules of ``names`` this interpreter cannot import (found without importing them)."""
    out = []
    for n in names:
        try:
            found = importlib.util.find_spec(n) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            out.append(n)
    return out


def install_hint(missing: list[str], root: Path) -> str:
    """What to do when the Jupyter stack is missing: the wheels to carry and the line that installs them."""
    have = sorted(p.name for p in (root / ".whl").glob("*.whl")) if (root / ".whl").is_dir() else []
    where = (f".whl/ here holds {len(have)} wheels" if have else
             f"no .whl/ here: fill it on the workstation first (bash {WHEELS_SCRIPT}, from the project's root) and "
             "carry .whl with the device call")
    return (f"gpu_check --workbook: {', '.join(missing)} not installed: mfu-lab run executes the notebooks through "
            f"papermill, which this machine lacks ({where}). Start the command with:\n  {INSTALL_LINE} &&\n"
            "  python3 benchmarks/gpu_check.py --workbook ...")


# ---------------------------------------------------------------------- the estimates
@dataclass(frozen=True)
class Costs:
    """Fixed costs of one H200 (the first run of the workbook on a GPU, 2026-12-04, /work/shared/h200-2026-12-04)."""

    process_start_s: float = 10.0  # a fresh Python process with torch imported (a compile trial's, a rung's)
    cold_compile_s: float = 22.0  # step 4's default-mode cold compile of GPT-2 124M ("default cold: step 1/5 (22.2 s)")
    notebook_s: float = 10.0  # a step's notebook beside its own work (kernel start, report, export)
    step_s: float = 0.049  # one micro-batch of 16 x 1024 tokens of GPT-2 124M in bf16 (a72853b's step 1: 48.7 ms)
    fp32_step_s: float = 0.30  # the same micro-batch in float32 (step 5's ladder: 299 ms)
    source: str = ("the first H200 run, 2026-12-04 (docs/gpu-check.md): a process start ~10 s, a cold compile ~22 s, "
                   "a notebook ~10 s, 48.7 ms a step in bf16 and 299 ms in float32")


H200 = Costs()
COSTS_MICRO_BATCH = 16  # the samples of the step that Costs.step_s timed (a72853b's job: 16 x 1024, no accumulation)

# The parts of each step the first run measured under --budget 4 (its console): the step's own work less what the
# formulas below add. Guesses where the first run did not go (no budget): each is printed beside the actual seconds
# after the run, to be corrected by it.
BASELINE_SETUP_S = 7.0  # step 1: 20 s with its notebook, 60 steps of 49 ms
ATTENTION_S = 25.0  # step 2 on one GPU: 34 s with its notebook (the candidates, a race of 5, the final 6 steps)
DDP_SWEEP_S = 120.0  # step 2 with 2+ GPUs: the DDP race and the all-reduce benchmark (a guess: not run on a GPU)
KERNELS_SETUP_S = 8.0  # step 3: 26 s with its notebook (60 unprofiled steps, 5 profiled, the bandwidth, the trace)
TRACE_READ_S = 5.0
RECOMPILES_S = 25.0  # step 4: one epoch of the data and the recompile count (82 s less eager and one mode, less 10)
MODE_COMPILE = {"default": 1.0, "reduce-overhead": 1.2, "max-autotune-no-cudagraphs": 4.0, "max-autotune": 4.5}
WARM_COMPILE = 0.3  # a warm-cache compile, of the cold one (a guess)
CONFIRM_S = 55.0  # step 4's confirmation of its leader beside eager ("the confirmation needs about 55 s")
FP8_BUDGETED_S = 70.0  # step 5 under --budget 4: the sensitivity, the probes, the ladder and its loss curves (82 s)
FP8_POLICIES = 6  # policies trained for fp8_steps each, in emulated float8 over float32 (a guess: 2x float32's step)
FP8_EMULATION = 2.0
PLACEMENT_S = 30.0  # step 6 on one GPU: 40 s with its notebook (co-location, the size sweep, the placements)
# step 7: a rung per adopting step, each a process of its own: the original, step 3's batch split (and AdamW), step
# 4's compile (its leader, the loss in its region), step 5's precision; the rungs from step 4's on compile, the first
# cold, the later ones on a warm cache (a guess: the first run timed two rungs)
VERIFY_RUNGS, VERIFY_COMPILED = 4, 2
RACE_BUILD_S = 2.0  # steps 3 and 4's in-process races: a model and its optimizer built per candidate (a guess)
VERIFY_SETUP_S = 5.0


@dataclass
class Estimate:
    full_s: float  # the step's own work without a budget (its notebook apart)
    min_s: float  # the least it runs under any budget
    how: str
    levers_s: float | None = None  # what it needs to race every change it can carry into tuned.yaml (steps 3, 4)


def estimates(job: Any, costs: Costs = H200, world: int = 1) -> dict[str, Estimate]:
    """Each step's seconds on one H200 for ``job`` (its counts: steps, modes, rounds), its notebook apart. The
    costs are a72853b's, whose step was one micro-batch; an optimizer step of the job is ``grad_accum`` of them
    (the first run had none; gpt2_124m_gpu.yaml now has 4), scaled by the job's micro_batch against their 16."""
    scale = job.grad_accum * job.micro_batch / COSTS_MICRO_BATCH
    s, fp32_s = costs.step_s * scale, costs.fp32_step_s * scale
    timed = job.warmup_steps + job.steps
    out: dict[str, Estimate] = {}
    out["baseline"] = Estimate(BASELINE_SETUP_S + timed * s, BASELINE_SETUP_S + 4 * s,
                               f"set-up ~{BASELINE_SETUP_S:.0f} s and {timed} steps of {s * 1e3:.0f} ms")
    ddp = DDP_SWEEP_S if world >= 2 else 0.0
    out["attention_comm"] = Estimate(ATTENTION_S + ddp, 15.0 + (0.3 * ddp),
                                     f"the attention candidates ~{ATTENTION_S:.0f} s"
                                     + (f", the DDP race ~{ddp:.0f} s" if ddp else " (one GPU: no DDP race)"))
    prof = 1.5 * (job.profile_warmup_steps + job.profile_steps) * s + TRACE_READ_S
    from mfu_lab.steps.kernels.batch_race import splits
    from mfu_lab.steps.key_race import cost_s

    n_splits = len(splits(job)) if job.grad_accum > 1 else 0
    races = (cost_s(2, s) + RACE_BUILD_S * 2  # foreach against fused AdamW
             + (cost_s(n_splits, s) + n_splits * (RACE_BUILD_S + s) if n_splits > 1 else 0.0))  # + a probed step each
    full = KERNELS_SETUP_S + timed * s + prof + races
    out["kernels"] = Estimate(full, KERNELS_SETUP_S + 4 * s + prof,
                              f"{timed} unprofiled steps, {job.profile_steps} profiled, the trace read, the AdamW"
                              + (f" and batch ({n_splits} splits)" if n_splits > 1 else "") + f" races ~{races:.0f} s",
                              full)
    each = (job.compile_warmup_steps + 3 + job.steps) * s
    eager = costs.process_start_s + each
    modes, parts, first = 0.0, [], 0.0
    for m in job.compile_modes:
        cold = costs.cold_compile_s * MODE_COMPILE.get(m, MODE_COMPILE["max-autotune"])
        modes += 2 * costs.process_start_s + cold * (1 + WARM_COMPILE) + 2 * each
        first = first or modes  # the first mode's trial: the least that leaves a compile mode to propose
        parts.append(f"{m} ~{cold:.0f} s cold")
    least = (RECOMPILES_S + costs.process_start_s + 5 * s + costs.process_start_s + costs.cold_compile_s
             + (job.compile_warmup_steps + 6) * s)
    loss = cost_s(2, s, costs.cold_compile_s) + 2 * RACE_BUILD_S  # eager against compiled: one cold compile
    out["compile"] = Estimate(RECOMPILES_S + eager + modes + CONFIRM_S + loss, least,
                              f"recompile count ~{RECOMPILES_S:.0f} s, eager, {', '.join(parts) or 'no mode'} and a "
                              f"warm compile each, the confirmation ~{CONFIRM_S:.0f} s, the loss race ~{loss:.0f} s",
                              RECOMPILES_S + eager + first + loss)  # a leader proposed to step 7, and the loss raced
    policies = FP8_POLICIES * job.fp8_steps * fp32_s * FP8_EMULATION
    speed = 2 * costs.cold_compile_s + job.precision_rounds * 2 * job.steps * s
    out["fp8"] = Estimate(FP8_BUDGETED_S + policies + speed, FP8_BUDGETED_S,
                          f"the ladder ~{FP8_BUDGETED_S:.0f} s, {FP8_POLICIES} FP8 policies ~{policies:.0f} s, "
                          f"torchao float8 against bf16 ~{speed:.0f} s (two compiles)")
    out["placement"] = Estimate(PLACEMENT_S + (ddp / 2), 20.0, f"co-location and the size sweep ~{PLACEMENT_S:.0f} s")
    rungs = VERIFY_RUNGS * (costs.process_start_s + VERIFY_SETUP_S + job.verify_warmup_steps * s)
    rounds = VERIFY_RUNGS * job.verify_rounds * job.verify_steps * s
    compiles = costs.cold_compile_s * (1 + (VERIFY_COMPILED - 1) * WARM_COMPILE)
    least = rungs + compiles + VERIFY_RUNGS * 2 * job.verify_steps * s
    out["verify"] = Estimate(rungs + compiles + rounds, least,
                             f"{VERIFY_RUNGS} rung processes ({VERIFY_COMPILED} compiled, ~{compiles:.0f} s), "
                             f"{job.verify_rounds} rounds of {job.verify_steps} steps")
    return out


# ---------------------------------------------------------------------- the plan
CHILD_END_S = 5.0  # `mfu-lab run` after its last step: the summary page, the tuned file
GRACE_S = 10.0  # a child stopped at the deadline: SIGTERM (it ends its notebook kernels), SIGKILL after this
TABLE_S = 5.0  # reading the results and writing the table
MARGIN = 0.9  # of the seconds left, what the budget plans for (a budgeted run ends past it by a cold compile or so)
# Steps left out, in this order, when even their minimums do not fit: the steps least likely to change the tuned job
# of a one-GPU run first (the first H200 run: step 6's layouts need 2+ GPUs; step 5 kept bf16, and torchao float8 ran
# 0.70x of bf16 on the small job; step 2's own SDPA choice is flash on Hopper), step 4's compile last (1.13x there).
# Steps 1 and 7 are the proof: they always run.
DROP_ORDER = ("placement", "fp8", "attention_comm", "kernels", "compile")


@dataclass
class Plan:
    limit_s: float
    elapsed_s: float  # of the check at planning (its start-up: torch's import)
    available_s: float  # for `mfu-lab run`'s steps: the limit less start-up, the child's start and end, the stop
    full_s: float  # the whole run without a budget, notebooks included
    steps: list[str]
    budget_min: float | None = None  # None: no budget
    shares: dict[str, float] = field(default_factory=dict)
    dropped: list[tuple[str, str]] = field(default_factory=list)
    shortened: list[tuple[str, str]] = field(default_factory=list)  # predicted: a step over its rolled share
    rolled: dict[str, float] = field(default_factory=dict)  # each step's share as the run rolls it (:func:`roll`)
    refused: str = ""  # why not even steps 1 and 7 fit ('' when they do)
    estimates: dict[str, Estimate] = field(default_factory=dict)

    def cli_args(self) -> list[str]:
        """The options for `mfu-lab run` (``--keep-going``: step 7 runs whatever failed before it)."""
        args = ["--keep-going"]
        if len(self.steps) < len(KEYS):
            args += ["--steps", ",".join(self.steps)]
        if self.budget_min is not None:
            args += ["--budget", f"{self.budget_min:g}"]
        return args

    def text(self, costs: Costs = H200) -> str:
        lines = [f"workbook plan: --limit-s {self.limit_s:.0f}, {self.elapsed_s:.0f} s used by the check's start-up; "
                 f"about {self.available_s:.0f} s for the steps (less the child's start ~{costs.process_start_s:.0f} "
                 f"s and end ~{CHILD_END_S:.0f} s, a stop's {GRACE_S:.0f} s and the table's {TABLE_S:.0f} s)",
                 f"  estimates from {costs.source}; they are guesses where the first run did not go, printed beside "
                 "the actual seconds after the run"]
        for k in KEYS:
            e = self.estimates.get(k)
            if e:
                lines.append(f"  step {NUMBER[k]} {k:<15} ~{e.full_s:4.0f} s in full, ~{e.min_s:3.0f} s at least "
                             f"(+ a notebook ~{costs.notebook_s:.0f} s): {e.how}")
        lines.append(f"  the whole workbook without a budget: ~{self.full_s:.0f} s")
        if self.refused:
            lines.append("  REFUSED: " + self.refused)
            return "\n".join(lines)
        if self.budget_min is None:
            lines.append("  fits: runs without a budget, every step in full")
        else:
            lines.append(f"  does not fit: runs with --budget {self.budget_min:g} (min), spread by README 'Cost': "
                         + ", ".join(f"step {NUMBER[k]} ~{v:.0f} s" for k, v in self.shares.items())
                         + ("" if not self.dropped else
                            f" (a budget is spread over all seven steps' weights: the {len(self.steps)} run here get "
                            f"about {sum(self.shares.values()):.0f} s of it, their notebooks apart)"))
            if self.rolled:
                lines.append("  as the run rolls them (before each step, what the run has left is spread again over "
                             "it and the steps after it), by these estimates: "
                             + ", ".join(f"step {NUMBER[k]} ~{v:.0f} s" for k, v in self.rolled.items()))
        for k, why in self.dropped:
            lines.append(f"  left out: step {NUMBER[k]} ({k}): {why}")
        for k, why in self.shortened:
            lines.append(f"  shortened: step {NUMBER[k]} ({k}): {why}")
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d["cli_args"] = self.cli_args()
        return d


def budget_min_for(seconds: float, keys: list[str], overhead_s: float) -> float:
    """The ``--budget`` (minutes, rounded down to a tenth) whose plan for the steps ``keys``, their notebooks
    included, adds up to at most ``seconds`` (:func:`mfu_lab.core.process.budget.plan` inverted)."""
    from mfu_lab.core.process import budget

    total = sum(budget.WEIGHTS.values())
    mine = sum(budget.WEIGHTS[k] for k in keys)
    work = max(0.0, seconds - len(keys) * overhead_s)
    return math.floor(((work * total / mine + len(budget.WEIGHTS) * overhead_s) / 60.0) * 10 + 1e-9) / 10


def make_plan(limit_s: float, elapsed_s: float, est: dict[str, Estimate], costs: Costs = H200,
              overhead_s: float | None = None, untimed: dict[str, str] | None = None) -> Plan:
    """What to run inside ``limit_s``: every step without a budget when the estimates fit, else a ``--budget``
    sized to the seconds left (each step over its share named), else fewer steps (:data:`DROP_ORDER`), each named
    with why. ``overhead_s``: a notebook's seconds as the runner's budget counts them (``budget.overhead``; the
    reference CPU's without it). ``untimed``: steps whose changes step 7 times nothing of on this job, with why
    (:func:`untimed_steps`): under a budget that would cut steps 3 or 4's races (:data:`LEVER_STEPS`, their
    ``levers_s``), they are left out in :data:`DROP_ORDER`, one at a time, until those races fit their rolled
    shares."""
    from mfu_lab.core.process import budget

    overhead_s = budget.STEP_OVERHEAD_S if overhead_s is None else overhead_s
    available = limit_s - elapsed_s - costs.process_start_s - CHILD_END_S - GRACE_S - TABLE_S
    nb = costs.notebook_s
    full = sum(e.full_s + nb for e in est.values())
    plan = Plan(limit_s, elapsed_s, available, full, list(KEYS), estimates=est)
    if full <= available:
        return plan
    steps = list(KEYS)
    while True:
        target = MARGIN * available
        b = budget_min_for(target, steps, overhead_s) if target > len(steps) * overhead_s else 0.0
        shares = budget.plan(b, steps, overhead_s) if b > 0 else {k: 0.0 for k in steps}
        need = sum(max(shares[k], est[k].min_s) + nb for k in steps)
        if b > 0 and need <= available:
            break
        drop = next((k for k in DROP_ORDER if k in steps), None)
        if drop is None:
            plan.steps, plan.refused = steps, (
                f"steps 1 and 7 alone need about {need:.0f} s at least, more than the {available:.0f} s left of "
                f"--limit-s {limit_s:.0f}: give a larger --limit-s")
            return plan
        steps.remove(drop)
        plan.dropped.append((drop, f"the minimums of the steps need about {need:.0f} s, more than the "
                                   f"{available:.0f} s left; left out in the order {', '.join(DROP_ORDER)} "
                                   "(the least likely to change a one-GPU tuned job first)"))
    _budgeted(plan, steps, b, shares, est, overhead_s, nb)
    def races_cut() -> list[str]:  # the lever steps whose races the rolled share would cut (beyond the noise)
        return [k for k in LEVER_STEPS if k in steps
                and (est[k].levers_s or 0.0) > plan.rolled[k] + max(2.0, 0.1 * plan.rolled[k])]

    for drop in [k for k in DROP_ORDER if k in (untimed or {}) and k in steps]:
        short = races_cut()
        if not short:
            break
        said = ", ".join(f"step {NUMBER[k]}'s ~{est[k].levers_s:.0f} s against its ~{plan.rolled[k]:.0f} s"
                         for k in short)
        kept = (list(steps), b, dict(plan.shares))
        steps = [k for k in steps if k != drop]
        b = budget_min_for(MARGIN * available, steps, overhead_s)
        shares = budget.plan(b, steps, overhead_s)
        if sum(max(shares[k], est[k].min_s) + nb for k in steps) > available:  # cannot happen by much: kept as was
            steps, b, shares = kept
            _budgeted(plan, steps, b, shares, est, overhead_s, nb)
            break
        _budgeted(plan, steps, b, shares, est, overhead_s, nb)
        plan.dropped.append((drop, f"{untimed[drop]}; its share goes to the races that carry changes into "
                                   f"tuned.yaml, which the budget would cut ({said})"))
    if plan.dropped and (still := races_cut()):
        plan.shortened = [(k, why + f"; its races (~{est[k].levers_s:.0f} s) are still cut" if k in still else why)
                          for k, why in plan.shortened]
    return plan


LEVER_STEPS = ("kernels", "compile")  # their races (AdamW, batch split; loss) carry the changes step 7 times


def untimed_steps(job: Any, world: int) -> dict[str, str]:
    """The steps whose changes step 7 times nothing of on ``job`` at ``world`` GPUs, with why: step 6 on one GPU
    (a cluster's placement, modelled), step 5 for a job that already trains in 16 bits (its ladder keeps the job's
    own rung unless another is faster beyond the noise, and an FP8 policy is adopted only where it measured faster:
    GPT-2 124M's measured 0.70x of bf16 on the first H200 run)."""
    out = {}
    if world == 1:
        out["placement"] = ("on one GPU step 6 models a cluster's placement: nothing it recommends is a change step 7 "
                            "times in one process")
    if job.dtype in ("bfloat16", "float16"):
        out["fp8"] = (f"the job already trains in {job.dtype}: step 5's ladder keeps the job's own rung unless "
                      "another is faster beyond the noise (the first H200 run kept bf16), and its FP8 policy is "
                      "adopted only where it measured faster (GPT-2 124M's: 0.70x of bf16 on that run), so the "
                      "races of steps 3 and 4 come first")
    return out


def _budgeted(plan: Plan, steps: list[str], b: float, shares: dict[str, float], est: dict[str, Estimate],
              overhead_s: float, nb: float) -> None:
    """Fill ``plan`` for ``steps`` under ``--budget b``: the shares (step 1's as the runner gives it), the shares
    as the run rolls them, and each step over its rolled share, named."""
    from mfu_lab.core.process import budget

    if "baseline" in shares:  # step 1 takes what its full run needs, up to STEP1_MOST of the work (budget.py)
        shares["baseline"] = max(shares["baseline"], min(est["baseline"].full_s,
                                                         budget.STEP1_MOST * sum(budget.plan(b).values())))
    plan.steps, plan.budget_min, plan.shares = steps, b, shares
    plan.rolled = roll(b, steps, est, shares, overhead_s, nb)
    plan.shortened = []
    for k in steps:
        e, share = est[k], plan.rolled[k]
        if e.full_s > share + max(2.0, 0.1 * share):  # within a tenth of its share: the estimate's noise
            why = (f"about {e.full_s:.0f} s in full, its share of --budget {b:g} about {share:.0f} s as the run "
                   "rolls it: it shortens to fit and its result says what it left out")
            if e.min_s > share:
                why += f"; its least (~{e.min_s:.0f} s) is over the share, so the steps after it get less"
            plan.shortened.append((k, why))


def roll(budget_min: float, steps: list[str], est: dict[str, Estimate], shares: dict[str, float],
         overhead_s: float, notebook_s: float) -> dict[str, float]:
    """Each step's share as ``mfu-lab run`` rolls the budget (``floors.roll``): each step before it taking its
    estimate, at least its least and at most its share, and a notebook of ``notebook_s``. Step 1 keeps its own
    share (``shares``: the runner gives it what its full run needs, up to ``budget.STEP1_MOST``)."""
    from mfu_lab.core.process import budget, floors

    return floors.roll(budget.plan(budget_min, steps, overhead_s),
                       lambda k, share: max(est[k].min_s, min(est[k].full_s, share)), overhead_s, notebook_s,
                       {k: shares[k] for k in ("baseline",) if k in shares})[0]


# ---------------------------------------------------------------------- the child
LINE_START = re.compile(r"^\[(\d+)/(\d+)\] (\d\d_\w+): ")
LINE_DONE = re.compile(r"^\[(\d+)/(\d+)\] (\d\d_\w+) done in (\d+) s")
LINE_FAILED = re.compile(r"^\[(\d+)/(\d+)\] (\d\d_\w+) FAILED: (.*)")


@dataclass
class Outcome:
    rc: int | None = None  # the child's exit status (None: it never started)
    seconds: float = 0.0
    stopped: str = ""  # why the check stopped it ('' when it ended by itself)
    walls: dict[str, float] = field(default_factory=dict)  # step folder -> seconds, from its "done in" line
    failed: dict[str, str] = field(default_factory=dict)
    running: str = ""  # the step folder that had started last
    lines: int = 0
    interrupted: bool = False  # Ctrl-C or SIGTERM reached the check


def watch_line(line: str, out: Outcome) -> None:
    """Note what one line of `mfu-lab run`'s output says about its steps."""
    if m := LINE_DONE.match(line):
        out.walls[m.group(3)] = float(m.group(4))
    elif m := LINE_FAILED.match(line):
        out.failed[m.group(3)] = m.group(4)
    elif m := LINE_START.match(line):
        out.running = m.group(3)


def child_env(root: Path) -> dict[str, str]:
    """The child's environment: the checkout on PYTHONPATH (``python -m mfu_lab`` without an install), unbuffered
    lines, a headless plot backend, and nbconvert's templates where the wheels were installed (--target DIR puts
    them under DIR/share/jupyter, which Jupyter does not look in by itself)."""
    env = dict(os.environ)
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    if str(root) not in paths:
        paths.append(str(root))
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env["PYTHONUNBUFFERED"] = "1"
    env.setdefault("MPLBACKEND", "Agg")
    spec = importlib.util.find_spec("papermill")
    if spec and spec.origin and "JUPYTER_PATH" not in env:
        share = Path(spec.origin).resolve().parents[1] / "share" / "jupyter"
        if share.is_dir() and not share.is_relative_to(Path(sys.prefix).resolve()):
            env["JUPYTER_PATH"] = str(share)
    return env


def run_child(cmd: list[str], env: dict[str, str], cwd: Path, deadline: float, say=print,
              grace_s: float = GRACE_S) -> Outcome:
    """Run ``cmd`` (`mfu-lab run ...`), its lines echoed as they come, until it ends or ``deadline``
    (``time.monotonic()``), when it is stopped: SIGTERM to its process group (`mfu-lab run` takes it as Ctrl-C and
    ends its notebook kernel and what that started), SIGKILL after ``grace_s``. The child and its group end with
    this call however it ends (an exception, Ctrl-C, SIGTERM: :mod:`mfu_lab.core.process.procs`), and with this
    process if it is killed (the child's parent-death signal, SIGTERM)."""
    from mfu_lab.core.process import procs

    out = Outcome()
    t0 = time.monotonic()
    with procs.interrupt_on_sigterm(), procs.group():
        proc = procs.popen(cmd, death_signal=signal.SIGTERM, grace_s=grace_s, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, text=True, errors="replace",
                           bufsize=1, env=env, cwd=str(cwd))

        def read() -> None:
            for line in proc.stdout:
                line = line.rstrip("\n")
                out.lines += 1
                watch_line(line, out)
                say(line)

        reader = threading.Thread(target=read, name="gpu-check-workbook-reader", daemon=True)
        reader.start()
        try:
            while proc.poll() is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    out.stopped = (f"stopped at the deadline ({time.monotonic() - t0:.0f} s into the run)"
                                   + (f", while {out.running} was running" if out.running else ""))
                    say(f"gpu_check --workbook: {out.stopped}; SIGTERM, then SIGKILL after {grace_s:.0f} s")
                    procs.kill(proc, grace_s=grace_s)
                    break
                try:
                    proc.wait(timeout=min(1.0, left))
                except subprocess.TimeoutExpired:
                    pass
        except KeyboardInterrupt as e:  # Ctrl-C, or SIGTERM (procs.Terminated): the child ends with the group
            out.interrupted = True
            out.stopped = (f"interrupted ({e or 'Ctrl-C'}) {time.monotonic() - t0:.0f} s into the run"
                           + (f", while {out.running} was running" if out.running else ""))
            say(f"gpu_check --workbook: {out.stopped}; ending the run (SIGTERM, then SIGKILL after {grace_s:.0f} s)")
        finally:
            out.rc = proc.poll()
            out.seconds = time.monotonic() - t0
        # the group's exit ends the child's process group (whatever it left there) on every way out
    reader.join(timeout=2.0)
    return out


# ---------------------------------------------------------------------- the results and the table
def read_results(job_root: Path, since: float) -> tuple[dict[str, dict], dict[str, str]]:
    """Each step's ``result.json`` written by this run (its file's time at or after ``since``, a ``time.time()``),
    by key; and, for a step without one, why: not run, failed (``failure.json``), or an earlier run's (stale, left
    out: a failed step keeps its previous result)."""
    results, notes = {}, {}
    for k in KEYS:
        folder = job_root / FOLDER[k]
        res, fail = folder / "result.json", folder / "failure.json"
        if fail.is_file() and fail.stat().st_mtime >= since - 1:
            try:
                f = json.loads(fail.read_text())
                notes[k] = f"{f.get('status', 'failed')}: {str(f.get('error', ''))[:160]}"
            except (OSError, ValueError):
                notes[k] = "failed (failure.json unreadable)"
            continue
        if not res.is_file():
            notes[k] = "no result (not run)"
            continue
        if res.stat().st_mtime < since - 1:
            notes[k] = "stale: an earlier run's result, left out"
            continue
        try:
            results[k] = json.loads(res.read_text())
        except (OSError, ValueError) as e:
            notes[k] = f"unreadable result.json: {e}"
    return results, notes


def _num(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def pct(x: Any) -> str:
    return "-" if not _num(x) else f"{x:.1%}" if abs(x) >= 0.01 or x == 0 else f"{x:.3%}"


def ms(x: Any) -> str:
    return f"{x * 1e3:.1f} ms" if _num(x) else "-"


def times(x: Any, lo: Any = None, hi: Any = None) -> str:
    if not _num(x):
        return "-"
    return f"{x:.2f}x" + (f" [{lo:.2f}, {hi:.2f}]" if _num(lo) and _num(hi) else "")


def rate(x: Any) -> str:
    return f"{x:,.0f}" if _num(x) else "-"


def _metric(d: dict | None, name: str) -> dict:
    return ((d or {}).get("metrics") or {}).get(name) or {}


def withdrawn_rungs(verify: dict) -> list[str]:
    """The rungs step 7 withdrew (a change of its own that puts a rung's keys back: not faster beyond the noise)."""
    return list(dict.fromkeys(c.get("rung", "") for c in verify.get("changes") or []
                              if c.get("step") == "verify" and c.get("adopted", True) and c.get("rung")))


SECOND_TURN = ("original again", "tuned as written")  # mfu_lab.steps.verify.retime's rungs


def tuned_rung(rungs: list[dict], withdrawn: list[str] = ()) -> tuple[dict | None, dict | None]:
    """(the original, the tuned job's rung): step 7's second turn (the tuned file as written, timed again beside the
    original after a withdrawal below the top) where it ran; else the first measured rung, and the highest measured
    rung that the tuned job keeps, None when that is the original (a rung step 7 withdrew is not the tuned job, nor
    a challenger (a re-check at the tuned precision) that step 7 did not adopt)."""
    measured = [r for r in rungs if r.get("wall_s")]
    pair = {r.get("name"): r for r in measured if r.get("name") in SECOND_TURN}
    if len(pair) == 2:  # step 7 timed the tuned file as written again, beside the original: that pair is the proof
        return pair[SECOND_TURN[0]], pair[SECOND_TURN[1]]
    measured = [r for r in measured if r.get("name") not in SECOND_TURN]
    before = measured[0] if measured and measured[0].get("name") == "original" else None
    for r in reversed(measured[1:] if before is not None else measured):
        if r.get("challenger") and not str(r.get("reason", "")).startswith("adopted"):
            continue
        if r.get("name") in withdrawn:
            continue
        return before, r
    return before, None


def side_by_side(baseline: dict | None, verify: dict | None) -> dict[str, Any]:
    """The proof from steps 1 and 7's results: step 1's MFU, the staircase (a row per rung), the original against
    the tuned job figure by figure, the tuned MFU, the changes, and what step 7 skipped. The tuned job is the
    highest rung step 7 measured and kept; a rung it withdrew is shown in the staircase, marked, and never as the
    tuned job."""
    m1 = _metric(baseline, "mfu")
    peak1 = _metric(baseline, "peak_flops_per_s")
    step1 = {"mfu": m1.get("value"), "label": m1.get("source", ""),
             "step_s": _metric(baseline, "step_time_median_s").get("value"),
             "tokens_per_s": _metric(baseline, "tokens_per_s").get("value"),
             "peak": peak1.get("value"), "peak_source": peak1.get("source", "")}
    out: dict[str, Any] = {"step1": step1, "rungs": [], "pair": [], "tuned_mfu": None, "original_mfu": None,
                           "speedup": None, "tuned_rung": None, "withdrawn": [], "headline": "", "changes": [],
                           "skipped": [], "loss": {}}
    if verify is None:
        out["headline"] = "step 7 left no result from this run"
        return out
    rungs = verify.get("rungs") or []
    withdrawn = out["withdrawn"] = withdrawn_rungs(verify)
    for r in rungs:
        keys = ", ".join(f"{k}={v}" for k, v in (r.get("keys") or {}).items()) or "-"
        out["rungs"].append({
            "rung": r.get("name", "?"), "changes": keys,
            "status": r.get("status", "?") + (", withdrawn by step 7" if r.get("name") in withdrawn else ""),
            "step": _step(r), "tokens/s": rate(r.get("tokens_per_s")),
            "MFU": pct(r.get("mfu")) + (f" ({r['peak_precision']})" if r.get("peak_precision") and
                                        _num(r.get("mfu")) else ""),
            "speedup": times(r.get("speedup"), r.get("speedup_low"), r.get("speedup_high")),
            "gain": times(r.get("gain"), r.get("gain_low"), r.get("gain_high")),
            "gain off 1.0": {True: "yes", False: "no"}.get(r.get("proven"), "-"),
            "note": str(r.get("reason", ""))[:90]})
    before, after = tuned_rung(rungs, withdrawn)
    loss = verify.get("loss") or {}
    out["loss"] = {k: loss.get(k) for k in ("status", "final_gap", "tolerance", "reason") if k in loss}
    if before is not None:
        tuned = after or before
        same = after is None
        name = tuned.get("name", "?")
        if same:
            name += (f" (step 7 withdrew {', '.join(withdrawn)}: the tuned job is the original)" if withdrawn else
                     " (nothing adopted was timed)")
        figs = [("rung", "original", name),
                ("dtype", before.get("dtype", "-"), tuned.get("dtype", "-")),
                ("median step (p10-p90)", _step(before), _step(tuned)),
                ("tokens/s", rate(before.get("tokens_per_s")), rate(tuned.get("tokens_per_s"))),
                ("MFU", pct(before.get("mfu")), pct(tuned.get("mfu"))),
                ("peak", _peak(before), _peak(tuned)),
                ("speedup over the original", "1.00x", "-" if same else times(
                    tuned.get("speedup"), tuned.get("speedup_low"), tuned.get("speedup_high")))]
        if _num(loss.get("final_gap")) and loss.get("tuned_rung", tuned.get("name")) == tuned.get("name"):
            figs.append(("final loss, tuned / original - 1", "-", f"{loss['final_gap']:+.2%} ({loss.get('status')}, "
                         f"tolerance {loss.get('tolerance', 0):.0%})"))
        out["pair"] = [{"figure": f, "original": a, "tuned": b} for f, a, b in figs]
        out["original_mfu"] = before.get("mfu")
        out["tuned_mfu"] = None if same else tuned.get("mfu")
        out["speedup"] = None if same else tuned.get("speedup")
        out["tuned_rung"] = None if same else tuned.get("name")
    out["headline"] = str((verify.get("headline") or {}).get("text", ""))
    out["changes"] = [f"{c.get('key')}: {c.get('old')!r} -> {c.get('new')!r} (step {c.get('step')}, "
                      f"{c.get('label')}){'' if c.get('adopted') else ', not adopted: ' + str(c.get('reason'))[:80]}"
                      + (f": {str(c.get('reason'))[:100]}" if c.get("step") == "verify" and c.get("reason") else "")
                      for c in verify.get("changes") or []]
    out["skipped"] = [f"{x.get('what')}: {x.get('reason')}" for x in verify.get("skipped") or []]
    return out


def _step(r: dict) -> str:
    spread = (f" ({r['step_p10_s'] * 1e3:.1f}-{r['step_p90_s'] * 1e3:.1f})"
              if _num(r.get("step_p10_s")) and _num(r.get("step_p90_s")) else "")
    return ms(r.get("step_median_s")) + spread


def _peak(r: dict) -> str:
    p = r.get("peak_flops_per_s")
    return (f"{p / 1e12:.1f} TFLOP/s {r.get('peak_precision', '')} ({r.get('peak_source', '')})".replace("  ", " ")
            if _num(p) else "-")


def shortened_by_steps(results: dict[str, dict]) -> list[str]:
    """What each step of this run left out under its budget share, as its result recorded it."""
    out = []
    for k in KEYS:
        for s in ((results.get(k) or {}).get("budget") or {}).get("shortened") or []:
            out.append(f"step {NUMBER[k]} ({k}): {s.get('what')}: {str(s.get('reason', ''))[:200]}")
    return out


def _grid(rows: list[dict[str, str]]) -> tuple[list[str], list[list[str]]]:
    cols = list(rows[0]) if rows else []
    return cols, [[str(r.get(c, "")).replace("\n", " ") for c in cols] for r in rows]


def text_table(rows: list[dict[str, str]]) -> str:
    """Rows (dicts with the same keys) as aligned plain text."""
    cols, body = _grid(rows)
    if not cols:
        return "(none)"
    widths = [max(len(x) for x in [c] + [b[i] for b in body]) for i, c in enumerate(cols)]
    lines = [" | ".join(x.ljust(w) for x, w in zip(line, widths)).rstrip() for line in [cols] + body]
    lines.insert(1, "-+-".join("-" * w for w in widths))
    return "\n".join(lines)


def md_table(rows: list[dict[str, str]]) -> str:
    cols, body = _grid(rows)
    if not cols:
        return "(none)"

    def esc(s: str) -> str:
        return s.replace("|", "\\|")

    return "\n".join(["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
                     + ["| " + " | ".join(esc(x) for x in b) + " |" for b in body])


def mfu_lines(table: dict[str, Any]) -> list[str]:
    s1 = table["step1"]
    one = (f"step 1's MFU: {pct(s1['mfu'])} [{s1['label'] or '-'}], {ms(s1['step_s'])} a step, "
           f"{rate(s1['tokens_per_s'])} tokens/s, against {s1['peak'] / 1e12:.1f} TFLOP/s ({s1['peak_source']})"
           if _num(s1["mfu"]) and _num(s1["peak"]) else "step 1's MFU: - (no step-1 result from this run)")
    if _num(table["tuned_mfu"]):
        tuned = (f"tuned MFU (step 7, side by side, rung {table['tuned_rung']}): {pct(table['tuned_mfu'])}; the "
                 f"original in the same rounds {pct(table['original_mfu'])}; speedup {times(table['speedup'])}")
    elif table["withdrawn"] and _num(table["original_mfu"]):
        tuned = (f"tuned MFU: the original's, {pct(table['original_mfu'])} in step 7's rounds (step 7 withdrew "
                 f"{', '.join(table['withdrawn'])}: not faster beyond the noise; the tuned job is the original)")
    else:
        tuned = "tuned MFU: - (no tuned job was timed against the original: " + (table["headline"] or "no step 7") + ")"
    return [one, tuned]


def format_report(table: dict[str, Any], steps: list[dict[str, str]], shortened: list[str], plan: Plan | None,
                  outcome: Outcome | None) -> str:
    """What the mode prints last: the steps' seconds, what was shortened, the staircase, the original against the
    tuned job, and the two MFUs."""
    out = ["", "steps (estimated, actual):", text_table(steps)]
    if plan is not None and (plan.dropped or plan.budget_min is not None):
        out.append("\nplanned: " + (f"--budget {plan.budget_min:g}" if plan.budget_min is not None else "no budget")
                   + (f"; left out {', '.join(k for k, _ in plan.dropped)}" if plan.dropped else ""))
    if shortened:
        out += ["\nshortened by the steps themselves (their results' budget records):"] + ["  " + s for s in shortened]
    if outcome is not None and outcome.stopped:
        out.append("\n" + outcome.stopped)
    out += ["\nstep 7's staircase (a row per rung; interleaved rounds, one process each):", text_table(table["rungs"]),
            "\nthe original against the tuned job, side by side:", text_table(table["pair"]) if table["pair"] else
            "(no original was measured: " + (table["headline"] or "no step 7") + ")"]
    if table["changes"]:
        out += ["\nchanges:"] + ["  " + c for c in table["changes"]]
    if table["skipped"]:
        out += ["step 7 skipped:"] + ["  " + s for s in table["skipped"]]
    out += [""] + mfu_lines(table)
    return "\n".join(out)


def markdown(header: dict[str, Any], table: dict[str, Any], steps: list[dict[str, str]], shortened: list[str],
             plan: Plan | None) -> str:
    out = ["# GPU check: the workbook, original against tuned", ""]
    out += [f"- {k}: {v}" for k, v in header.items()] + [""] + [f"- {x}" for x in mfu_lines(table)] + [""]
    out += ["## Steps", "", md_table(steps), ""]
    if plan is not None:
        out += ["```", plan.text(), "```", ""]
    if shortened:
        out += ["Shortened by the steps themselves:", ""] + [f"- {s}" for s in shortened] + [""]
    out += ["## Step 7's staircase", "", md_table(table["rungs"]), "", "## Original against tuned", "",
            md_table(table["pair"]) if table["pair"] else "(no original was measured: " + table["headline"] + ")", ""]
    if table["headline"]:
        out += [f"Step 7: {table['headline']}", ""]
    if table["changes"]:
        out += ["Changes:", ""] + [f"- {c}" for c in table["changes"]] + [""]
    if table["skipped"]:
        out += ["Step 7 skipped:", ""] + [f"- {s}" for s in table["skipped"]] + [""]
    return "\n".join(out)


def step_rows(plan: Plan | None, outcome: Outcome | None, results: dict[str, dict],
              notes: dict[str, str]) -> list[dict[str, str]]:
    """A row per step: the plan's estimate (with its notebook), the actual seconds (the runner's "done in" line),
    the step's own seconds (``elapsed_s``), and what became of it."""
    rows = []
    nb = H200.notebook_s
    for k in KEYS:
        e = plan.estimates.get(k) if plan else None
        planned = "left out" if plan and k not in plan.steps else (
            f"~{max(e.min_s, min(e.full_s, plan.rolled.get(k, plan.shares[k]))) + nb:.0f} s"  # as the run rolls it
            if e and plan.budget_min is not None and k in plan.shares
            else f"~{e.full_s + nb:.0f} s" if e else "-")
        wall = (outcome.walls.get(FOLDER[k]) if outcome else None)
        own = (results.get(k) or {}).get("elapsed_s")
        state = "ok" if k in results else notes.get(k, "-")
        if outcome and FOLDER[k] in outcome.failed:
            state = "FAILED: " + outcome.failed[FOLDER[k]][:100]
        rows.append({"step": f"{NUMBER[k]} {k}", "planned": planned, "actual": f"{wall:.0f} s" if _num(wall) else "-",
                     "step's own": f"{own:.0f} s" if _num(own) else "-", "result": state})
    return rows


def write_report(folder: Path, header: dict[str, Any], table: dict[str, Any], steps: list[dict[str, str]],
                 shortened: list[str], plan: Plan | None, outcome: Outcome | None) -> tuple[Path, Path]:
    """``<folder>/workbook.md`` and ``workbook.json``; returns both paths."""
    folder.mkdir(parents=True, exist_ok=True)
    md, js = folder / "workbook.md", folder / "workbook.json"
    md.write_text(markdown(header, table, steps, shortened, plan))
    js.write_text(json.dumps({"header": header, "plan": plan.to_dict() if plan else None,
                              "outcome": dataclasses.asdict(outcome) if outcome else None, "steps": steps,
                              "shortened": shortened, "table": table}, indent=1, default=str) + "\n")
    return md, js


def now_iso() -> str:
    return datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
