"""The run's time budget (``budget_min``, ``mfu-lab run --budget``), spread over the steps by one stated rule.

Rule: each step's own work gets what is left of the budget after :data:`STEP_OVERHEAD_S` for each of the seven
steps' notebook (its kernel's start, the imports, the report and its export), times the step's weight over the sum
of the weights. The weights are the step functions' own seconds (``elapsed_s`` in each ``result.json``) in the
default run of the default job on a 2-core AMD EPYC without native bf16 (2026-12-03: step 1 16 s, step 2 121 s,
step 3 37 s, step 4 133 s, step 5 61 s, step 6 136 s; step 7 118 s, the 127 s it took in the run of 2026-12-02
where it verified a proposed layout under torchrun, less its notebook's 9 s), with one move: step 5 weighs 105 s,
44 s taken from step 6 (112 s) and step 7 (98 s). Under a budget step 5 times the job's own precision beside each
rung it keeps (2026-12-05), and the default job's float32 and bfloat16 side by side need about 30 s of its share
on a 2-core AMD EPYC with native bf16; at 61 s the 4.5-minute budget gave it 23 s, and the bf16 gain (1.76x) was
never timed. So a budget cuts every step in the same proportion. A step run alone gets the same share it would
get in a whole run.

Within a run of several steps the shares roll: before each step the runner sets :data:`LEFT_ENV` to the seconds
left (the planned seconds of the steps selected, with their notebooks, less the time the run has taken so far) and
the steps still to run; the step's share is that time, less a notebook's :data:`STEP_OVERHEAD_S` for each of
them, times its weight over theirs (:func:`share_s`). A step that ran past its share (a cold compile longer than
its estimate) so shortens the ones after it, and one that finished early (nothing to verify) leaves them more,
so the run as a whole keeps to the budget.

Step 1 is the baseline every later step compares with, so it may take more than its share: what the job's full
step 1 needs (its set-up, warm-up and timed steps, estimated as :func:`step1_estimate` does), up to
:data:`STEP1_MOST` of the steps' work (:func:`step1_share_s`); in a run, the steps after it then share what is left.

Every step keeps to its share. A step that measures in rounds (steps 2, 4, 5 and 7) checks its clock before each
round: when the next round would end past the step's share, it shortens the round (fewer candidates, fewer steps
or rounds, no warm-cache compile) and records what it left out, with the planned and the used seconds. Step 1
times its warm-up first and then as many of the job's timed steps as fit its share (never fewer than
:data:`STEP1_MIN_STEPS`), and says what it cut; a budget whose share cannot hold step 1's minimum is refused before
the run starts (``floors.step1_refusal``), with the estimate. Step 3 times fewer unprofiled steps and leaves out the
data-parallel traces; step 6 times fewer co-location steps and fewer of the node's layouts (the job's own first,
then one of each family). Each estimate is the job's own step time as step 1 measured it, times the steps the
work runs, and says so (:func:`fit_count`).
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import time
from dataclasses import dataclass, field

from mfu_lab.core.store import fixed_costs

WEIGHTS = {"baseline": 16, "attention_comm": 121, "kernels": 37, "compile": 133, "fp8": 105, "placement": 112,
           "verify": 98}
# A step's notebook beside the step's own work: its wall time less its elapsed_s, 9-19 s a step in the run above
# (median 11 s): the kernel's start and imports, the report, the HTML export, the index.
STEP_OVERHEAD_S = 11.0


def overhead(device: str = "auto") -> tuple[float, str]:
    """(seconds, where from) of one step's notebook on this machine: the median of the notebooks measured here
    (:mod:`mfu_lab.core.store.fixed_costs`, recorded by the runner after each step), else :data:`STEP_OVERHEAD_S`,
    the reference CPU's, said so."""
    return measured_here(device, "notebook_s", "notebooks") or (
        STEP_OVERHEAD_S, "the reference CPU's notebooks (none measured on this machine yet)")


def measured_here(device: str, kind: str, what: str) -> tuple[float, str] | None:
    """(the median of this machine's figures of ``kind``, "this machine's <what>, measured (median of n)") from
    :mod:`mfu_lab.core.store.fixed_costs`, or None when none is kept."""
    m = fixed_costs.median(fixed_costs.machine_key(device), kind)
    return (m[0], f"this machine's {what}, measured (median of {m[1]})") if m else None


def plan(budget_min: float, keys: list[str] | None = None, overhead_s: float = STEP_OVERHEAD_S) -> dict[str, float]:
    """Seconds per step by the rule above (all steps, or those in ``keys``), each notebook costing ``overhead_s``;
    {} without a budget."""
    if not budget_min:
        return {}
    total = sum(WEIGHTS.values())
    work = max(0.0, budget_min * 60.0 - len(WEIGHTS) * overhead_s)
    return {k: work * w / total for k, w in WEIGHTS.items() if keys is None or k in keys}


LEFT_ENV = "MFU_LAB_BUDGET_LEFT"  # "<seconds left>;<key>,<key>...;<a notebook's s>": set by the runner before a step


def left_env(budget_min: float, keys: list[str], used_s: float, key: str,
             overhead_s: float = STEP_OVERHEAD_S) -> str:
    """:data:`LEFT_ENV`'s value before step ``key`` of a run of ``keys`` that has taken ``used_s`` seconds, each
    notebook costing ``overhead_s``."""
    p = plan(budget_min, keys, overhead_s)
    left = sum(p.values()) + len(p) * overhead_s - used_s
    return f"{left:.3f};{','.join(keys[keys.index(key):])};{overhead_s:.3f}"


def share_s(budget_min: float, key: str) -> float | None:
    """Step ``key``'s seconds: rolled over what the run has left (:data:`LEFT_ENV`, when the runner set it for
    this step), else its share of the plan; None without a budget."""
    if not budget_min:
        return None
    left, _, rest_of = os.environ.get(LEFT_ENV, "").partition(";")
    keys, _, each = rest_of.partition(";")
    rest = [k for k in keys.split(",") if k in WEIGHTS]
    if not rest or rest[0] != key:
        return plan(budget_min).get(key)
    try:
        each_s = float(each) if each else STEP_OVERHEAD_S
    except ValueError:
        each_s = STEP_OVERHEAD_S
    return rolled_share(float(left), rest, each_s)


def rolled_share(left_s: float, rest: list[str], each_s: float = STEP_OVERHEAD_S) -> float:
    """The seconds of ``rest[0]``, the next step, when ``left_s`` of the budget remain for it and the steps after
    it (``rest``), each notebook costing ``each_s``: what remains less their notebooks, spread by the weights."""
    work = max(0.0, left_s - len(rest) * each_s)
    return work * WEIGHTS[rest[0]] / sum(WEIGHTS[k] for k in rest)


def plan_text(budget_min: float, keys: list[str], numbers: dict[str, int],
              overhead: tuple[float, str] = (STEP_OVERHEAD_S, "")) -> str:
    """The plan as one line the runner prints before the first step; ``overhead``: a notebook's seconds and where
    from (:func:`overhead`)."""
    p = plan(budget_min, keys, overhead[0])
    if not p:
        return ""
    parts = ", ".join(f"step {numbers.get(k, '?')} {s:.0f} s" for k, s in p.items())
    return (f"budget {budget_min:g} min, spread by each step's share of the default run (README, 'Cost'): {parts} "
            f"(step 1 takes more, up to {STEP1_MOST:.0%} of the steps' work, when the job's full step 1 needs it); "
            f"{sum(p.values()) / 60:.1f} min planned for the steps' own work, and about {overhead[0]:.0f} s "
            f"for each step's notebook and report" + (f" ({overhead[1]})" if overhead[1] else "")
            + "; before each step, what the run has left is spread again over it and the steps after it")


STEP1_MIN_STEPS = 3  # timed steps step 1 keeps under a budget: a median and a spread (the job's own minimum is 2)
# Step 1 of the default job on a 2-core Intel CPU (2026-12-01), 15 s in all: about 3 s of set-up (the peak, the
# FLOP count, the model) and 23 training steps (3 warm-up, 20 timed) of about 0.5 s. Used when the job has no
# step-1 result of its own to estimate from.
REFERENCE_SETUP_S, REFERENCE_STEP_S = 3.0, 0.5


def step1_estimate(job, earlier: dict | None = None) -> tuple[float, float, float, str]:
    """(set-up s, first step s, later steps s each, where from) for step 1 of ``job``: from ``earlier`` (the job's
    step-1 result.json as a dict) when there is one, else the reference CPU's default job (said so)."""
    t = (earlier or {}).get("timings") or {}
    walls = t.get("wall_s") or []
    warm = t.get("warmup_steps", 0)
    if earlier and earlier.get("elapsed_s") and len(walls) > warm:
        step = statistics.median(walls[warm:])
        return (max(0.0, earlier["elapsed_s"] - sum(walls)), walls[0], step,
                f"this job's last step-1 run ({len(walls)} steps, {earlier['elapsed_s']:.0f} s)")
    return (REFERENCE_SETUP_S, REFERENCE_STEP_S, REFERENCE_STEP_S, "the default job's step 1 on the reference "
            "2-core CPU (README, 'Cost'), as this job has no step-1 result yet; a larger model takes longer")


def step1_minimum_s(job, earlier: dict | None = None) -> tuple[float, str]:
    """Seconds step 1 needs at least: its set-up, one warm-up step (none if the job has none) and
    ``STEP1_MIN_STEPS`` timed steps (the job's count if fewer); and the estimate's text."""
    setup, first, step, source = step1_estimate(job, earlier)
    warm = min(getattr(job, "warmup_steps", 1), 1)
    timed = min(getattr(job, "steps", STEP1_MIN_STEPS), STEP1_MIN_STEPS)
    need = setup + (first if warm else 0.0) + timed * step
    return need, (f"set-up about {setup:.0f} s, then {warm} warm-up and {timed} timed steps at about {step:.2g} s "
                  f"each; from {source}")


STEP1_MOST = 0.25  # of the steps' planned work: the most step 1 takes to time the job's full count of steps
STEP1_RESERVE_S = 1.0  # step 1's work after its timed steps (the peak's re-check, the figures, the write)


def step1_share_s(job, earlier: dict | None = None) -> float | None:
    """Step 1's seconds under the job's budget (None without one): its share (:func:`share_s`), or, when more, what
    the job's full step 1 needs by :func:`step1_estimate`, up to :data:`STEP1_MOST` of the steps' planned work."""
    budget_min = getattr(job, "budget_min", 0.0) or 0.0
    share = share_s(budget_min, "baseline")
    if share is None:
        return None
    setup, first, step, _ = step1_estimate(job, earlier)
    warm = getattr(job, "warmup_steps", 1)
    full = (setup + (first + (warm - 1) * step if warm else 0.0) + getattr(job, "steps", STEP1_MIN_STEPS) * step
            + STEP1_RESERVE_S)
    return max(share, min(full, STEP1_MOST * sum(plan(budget_min).values())))


def fit_count(left_s: float | None, wanted: int, each_s: float, fixed_s: float = 0.0, least: int = 1) -> int:
    """How many of ``wanted`` items of about ``each_s`` seconds each, after ``fixed_s`` seconds of set-up, end
    inside ``left_s`` seconds: ``wanted`` without a budget (None), never fewer than ``least`` (nor more than
    ``wanted``)."""
    left = left_s
    if left is None or each_s <= 0:
        return wanted
    return max(min(least, wanted), min(wanted, int((left - fixed_s) // each_s)))


def job_step_s(earlier: dict | None) -> tuple[float, str]:
    """(seconds, where from) of one training step of the job in one process: step 1's median (measured) when the
    job has a step-1 result, else the reference CPU's (:data:`REFERENCE_STEP_S`), said so."""
    m = ((earlier or {}).get("metrics") or {}).get("step_time_median_s") or {}
    if m.get("value"):
        return float(m["value"]), f"step 1's median step {m['value'] * 1e3:.0f} ms (measured)"
    return REFERENCE_STEP_S, (f"the reference CPU's {REFERENCE_STEP_S:g} s step (the job has no step-1 result; "
                              "a larger model takes longer)")


def fit_kernels(job, clock: Clock, step_s: tuple[float, str]) -> tuple[object, bool]:
    """(the job as the unprofiled timing runs it, whether the per-rank traces are taken) within step 3's share:
    the profiled steps always (the step's point, about 1.5 steps' time each and 5 s to read the trace), then at
    least 3 timed steps after 1 warm-up, then the per-rank traces (a launch, about 10 s, and the profiled steps on
    two ranks), then as many timed steps as are left, up to the job's; each step at ``step_s``."""
    left = clock.left_s()
    if left is None:
        return job, True
    each = step_s[0]
    profiled = 1.5 * each * (job.profile_warmup_steps + job.profile_steps) + 5.0
    ranks = (10.0 + 2 * profiled) if job.profile_ddp else 0.0
    with_ddp = not job.profile_ddp or left - profiled - 4 * each >= ranks
    n = fit_count(left - profiled - (ranks if with_ddp else 0.0), job.steps, each, fixed_s=each, least=3)
    how = f"{left:.0f} s of step 3's share left, about {each:.2f} s a step: {step_s[1]}"
    if not with_ddp:
        clock.shorten("per-rank profile", f"the data-parallel traces (about {ranks:.0f} s) do not fit ({how})")
    if n < job.steps:
        clock.shorten("unprofiled steps", f"{n} of the job's {job.steps} timed, after 1 warm-up ({how})")
    return dataclasses.replace(job, steps=n, warmup_steps=min(job.warmup_steps, 1)) if n < job.steps else job, with_ddp


RUNG_START_S = 5.0  # a step-7 rung process's start-up


def rung_turns_s(job, rungs: int, rounds: int, each_s: float) -> float:
    """Seconds of ``rungs`` step-7 rung processes, each started, warmed up and timed ``rounds`` x ``verify_steps``
    steps of about ``each_s``."""
    return rungs * (RUNG_START_S + (job.verify_warmup_steps + rounds * job.verify_steps) * each_s)


def fit_verify(job, clock: Clock, step_s: tuple[float, str], rungs: int, layout: bool, ddp: bool,
               reserve: tuple[float, str] = (0.0, "")):
    """The job as step 7 times it within its share: ``verify_rounds`` lowered to the most rounds whose estimate
    fits, never below 2 (a spread of the ratio; 1 without a staircase). A round times each of the ``rungs``
    processes for ``verify_steps`` (after a start-up of about 5 s and its warm-up each); the layout check
    (``layout``) runs min(rounds, 3) turns of both sides, each about 15 + ``verify_steps`` steps (the check's
    steps in the layout and in one process, the rebuild, the warm-up) on ranks of one thread (2 x ``step_s``);
    the DDP check (``ddp``) min(rounds, 5) turns of both sides, each 2 + ``comm_warmup_steps`` + ``verify_steps``
    such steps; each check's launch about 10 s. ``reserve``: (seconds, what for) kept back from the rounds (step
    7's second turn, steps.verify.retime)."""
    left = clock.left_s()
    if left is None:
        return job
    left -= reserve[0]
    each = step_s[0]

    def need(r: int) -> float:
        stairs = rung_turns_s(job, rungs, r, each) if rungs > 1 else 0.0
        lay = 10.0 + min(r, 3) * 2 * (15 + job.verify_steps) * 2 * each if layout else 0.0
        dp = 10.0 + min(r, 5) * 2 * (2 + job.comm_warmup_steps + job.verify_steps) * 2 * each if ddp else 0.0
        return stairs + lay + dp

    least = 2 if rungs > 1 else 1
    rounds = next((r for r in range(job.verify_rounds, least - 1, -1) if need(r) <= left), least)
    if rounds >= job.verify_rounds:
        return job
    clock.shorten("verify rounds", f"{rounds} of verify_rounds {job.verify_rounds} (about {need(rounds):.0f} s of the "
                  f"{left:.0f} s of step 7's share left; {rungs} rung(s)" + (", the layout check" if layout else "")
                  + (", the DDP check" if ddp else "") + f"; about {each:.2f} s a step: {step_s[1]}"
                  + (f"; {reserve[1]}" if reserve[0] else "") + ")")
    return dataclasses.replace(job, verify_rounds=rounds)


TRIAL_START_S = 10.0  # a compile trial's process start, model build and trace (2-core AMD EPYC, 2026-12-03: ~10 s)
TRACE_ONLY = ("eager", "aot_eager")  # backends that trace and generate no code


def trial_start(job) -> tuple[float, str]:
    """(seconds, where from) of a step-4 trial beyond its timed steps and 3 profiled ones: the median of this
    machine's eager trials (:mod:`mfu_lab.core.store.fixed_costs`; the process's start, the model's build, the
    profiler's 2 warm-up steps, its overhead and the trace's export, whatever the job), else :data:`TRIAL_START_S`,
    the reference CPU's."""
    return (measured_here(getattr(job, "device", "auto"), "trial_start_s", "trial starts")
            or (TRIAL_START_S, "the reference CPU's"))


COLD_COMPILE_S = 30.0  # the default job's cold compile there (26-33 s), when the job has no step-4 result of its own
TRACE_ONLY_S = 5.0  # assumed for a backend without code generation (eager, aot_eager): dynamo's tracing alone


def cold_compile(job, earlier: dict | None = None) -> tuple[float, str]:
    """(seconds, where from) of a cold compile of ``job``: the longest of the job's last step 4 with the same backend
    (measured), else the median of the cold compiles measured on this machine with that backend
    (:mod:`mfu_lab.core.store.fixed_costs`), else the default job's on the reference CPU (:data:`COLD_COMPILE_S`),
    or, for a backend without code generation (:data:`TRACE_ONLY`), :data:`TRACE_ONLY_S`, assumed."""
    backend = getattr(job, "compile_backend", "inductor") or "inductor"
    same = ((earlier or {}).get("job") or {}).get("compile_backend", "inductor") == backend
    trials = (earlier or {}).get("trials") or [] if same else []
    colds = [t["compile_cold_s"] for t in trials if t.get("compile_cold_s")]
    if colds:
        return max(colds), "this job's last step 4, measured"
    m = measured_here(getattr(job, "device", "auto"), fixed_costs.cold_compile_kind(backend),
                      "cold compiles" + ("" if backend == "inductor" else f" with {backend}"))
    if m:
        return m
    if backend in TRACE_ONLY:
        return TRACE_ONLY_S, f"assumed: compile_backend {backend} traces, it generates no code"
    return COLD_COMPILE_S, "the default job's on the reference CPU" + (
        "" if backend == "inductor" else f" with inductor (compile_backend {backend} has no figure here yet)")


def fit_compile(job, clock: Clock, step_s: tuple[float, str], earlier: dict | None = None) -> int:
    """Timed steps of each compile trial within step 4's share, so that eager and one compiled mode fit: each trial
    a start (:func:`trial_start`), ``compile_warmup_steps`` and 3 profiled steps and the timed steps at
    ``step_s``, the compiled one also a cold compile (:func:`cold_compile`); the job's ``steps`` without a budget,
    never fewer than 3."""
    left = clock.left_s()
    if left is None:
        return job.steps
    cold, where = cold_compile(job, earlier)
    each = step_s[0]
    fixed = 2 * (trial_start(job)[0] + (job.compile_warmup_steps + 3) * each) + cold
    n = fit_count(left, job.steps, 2 * each, fixed_s=fixed, least=3)
    if n < job.steps:
        clock.shorten("trial steps", f"{n} of the job's {job.steps} timed in each trial ({left:.0f} s of step 4's "
                      f"share left for eager and one mode: about {fixed:.0f} s of starts, warm-up and a {cold:.0f} s "
                      f"cold compile ({where}), then {2 * each:.2f} s a step: {step_s[1]})")
    return n


@dataclass
class Clock:
    """One step's share of the budget and what the step left out to keep to it."""

    planned_s: float | None  # None: no budget
    started: float = field(default_factory=time.perf_counter)
    shortened: list[dict[str, str]] = field(default_factory=list)

    @classmethod
    def for_step(cls, job, key: str) -> Clock:
        return cls(share_s(getattr(job, "budget_min", 0.0) or 0.0, key))

    @property
    def used_s(self) -> float:
        return time.perf_counter() - self.started

    def left_s(self) -> float | None:
        return None if self.planned_s is None else self.planned_s - self.used_s

    def fits(self, estimate_s: float) -> bool:
        """Whether work of ``estimate_s`` seconds ends inside the step's share (always, without a budget)."""
        left = self.left_s()
        return left is None or estimate_s <= left

    def shorten(self, what: str, why: str) -> None:
        self.shortened.append({"what": what, "reason": f"budget: {why}"})

    def record(self) -> dict:
        """What the step's result keeps: planned and used seconds, and what was left out."""
        return {"planned_s": self.planned_s, "used_s": self.used_s, "shortened": list(self.shortened)}
