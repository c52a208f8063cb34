"""Step 5's precision ladder (measured): float32 -> TF32 -> bf16 / fp16 autocast, before the FP8 layer groups.

Every rung trains a model built from the job's seed on the same batches. Its speed is measured side by side
with float32 (highest matmul precision), in interleaved rounds (:mod:`mfu_lab.core.measure.sidebyside`), and its
speedup carries a bootstrap interval; its loss curve over ``fp8_steps`` steps runs under the same
divergence watch as the FP8 trials, against float32's curve. :func:`mfu_lab.analysis.precision.judge`
adopts the fastest rung that is proven faster and kept the loss; otherwise the job keeps its precision.
A rung that cannot run here is skipped with its reason, and one that raises is recorded as failed while the
others go on. Before anything is built, every rung's matmul rate is probed beside float32's (:func:`probe`); a
rung that cannot reach float32's within the probes' noise is recorded as "cannot be faster here" with both
rates and is neither trained nor timed (:func:`mfu_lab.analysis.precision.cannot_be_faster`), unless the job is
``thorough``.

Under a budget (a ``clock`` with a share) the ladder plans its rungs from the share it is given (:func:`_fit`): the
job's own precision is the reference, built and probed first, so a job already in bf16 is judged against bf16 and
float32 is only one more rung; each other rung's step is probed once (:func:`probe_step`, after one warm-up step)
and the rungs are taken cheapest first while their timing rounds and loss curves, at their probed steps, fit what
is left of the share: the others are skipped with the seconds, and none is timed when none fits. Without a budget
everything is as above, against float32.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from mfu_lab.analysis import fp8_numerics as f8
from mfu_lab.analysis import precision as pr
from mfu_lab.core.engine.batches import to_device
from mfu_lab.core.engine.workload import build_model, build_train_step, eager
from mfu_lab.core.job.schema import Job
from mfu_lab.core.measure import device as dev
from mfu_lab.core.measure.sidebyside import bootstrap_speedup, interleave
from mfu_lab.core.measure.timed import run_steps, stats
from mfu_lab.core.process.progress import as_progress

TF32_CAPABILITY = (8, 0)  # Ampere and later have TF32 tensor cores
REFERENCE = "float32"
SETTINGS = {"float32": ("float32", "highest"), "tf32": ("float32", "high"),
            "bfloat16": ("bfloat16", "highest"), "float16": ("float16", "highest")}
WORDS = {"float32": "float32", "tf32": "TF32 matmuls", "bfloat16": "bfloat16 autocast",
         "float16": "float16 autocast with a loss scaler"}
PROBE_N = {"cpu": 256, "cuda": 2048}  # square matmul size of the probes: big enough to be compute-bound
PROBE_S = 0.02  # seconds each probe times (after its warm-up call): PROBES x rungs probes stay well under 1 s
NOT_RUN = (pr.SKIPPED, pr.FAILED, pr.CANNOT_BE_FASTER)  # statuses of a rung that is not (or no longer) trained
NO_NATIVE_BF16 = ("this CPU has no native bf16 (no avx512_bf16 / amx_bf16 flag in /proc/cpuinfo), so bf16 autocast "
                  "is emulated in software and much slower, and it is not adopted")


@dataclass
class Rung:
    name: str
    dtype: str
    matmul_precision: str
    own: bool = False  # the job's own precision
    status: str = ""
    reason: str = ""
    step_median_s: float | None = None
    step_p10_s: float | None = None
    step_p90_s: float | None = None
    speedup: float | None = None
    speedup_low: float | None = None
    speedup_high: float | None = None
    final_gap: float | None = None
    diverged: str = ""
    stopped_at: int | None = None
    scaler_skipped: int = 0  # float16 steps the loss scaler skipped (an overflow lowered its scale)
    loss: list[float] = field(default_factory=list)
    grad_norm: list[float] = field(default_factory=list)  # per step of the loss curve (the divergence watch's)
    loss_s: float | None = None  # seconds the loss curve took to train
    loss_skipped: str = ""  # why no loss curve was trained (racing: not proven faster, so never adoptable)
    probe: dict = field(default_factory=dict)  # its matmul probes (measured), float32's beside a ruled-out rung's
    step_probe_s: float | None = None  # under a budget: one training step before the rounds (measured, an estimate)

    def fail(self, what: str, err: BaseException) -> None:
        if self.status != pr.FAILED:
            self.status, self.reason = pr.FAILED, f"{what}: {type(err).__name__}: {err}"[:400]


def plan(job: Job, own_first: bool = False) -> list[Rung]:
    """float32 first (the reference), the job's rungs, and the job's own precision when it is none of them;
    ``own_first`` (under a budget): the job's own precision first instead, as the reference."""
    own = (job.dtype, job.matmul_precision)
    names = [REFERENCE] + [n for n in dict.fromkeys(job.precision_rungs) if n != REFERENCE]
    rungs = [Rung(n, *SETTINGS[n]) for n in names]
    mine = next((r for r in rungs if (r.dtype, r.matmul_precision) == own), None)
    if mine is None:
        name = job.dtype if job.matmul_precision == "highest" or job.dtype == "float32" else f"{job.dtype} + tf32"
        mine = Rung("tf32" if own == SETTINGS["tf32"] else name, *own)
        rungs.append(mine)
    mine.own = True
    if own_first:
        rungs = [mine] + [r for r in rungs if r is not mine]
    return rungs


def unavailable(rung: Rung, device: dev.DeviceInfo) -> str:
    """'' when the rung can run on this device, else why not."""
    if rung.name != "tf32":
        return ""
    if device.type != "cuda":
        return ("TF32 is a tensor-core format of NVIDIA GPUs (capability 8.0 and up); a CPU has none, and "
                "matmul_precision 'high' changes nothing here")
    cap = torch.cuda.get_device_capability(device.index)
    if cap < TF32_CAPABILITY and not torch.version.hip:
        return f"CUDA capability {cap[0]}.{cap[1]} has no TF32 tensor cores (8.0 and up do)"
    return ""


def probe(rung: Rung, device: dev.DeviceInfo) -> float:
    """One short probe of the rung's matmul rate (FLOP/s, measured): the CPU peak's own measurement
    (:func:`mfu_lab.core.measure.device.measure_matmul_peak`) at one size and a ~20 ms budget, in the rung's dtype (what
    autocast casts a linear layer's inputs to) and float32 matmul precision."""
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision(rung.matmul_precision)
    try:
        return dev.measure_matmul_peak(getattr(torch, rung.dtype), device.type, sizes=(PROBE_N.get(device.type, 256),),
                                       budget_s=PROBE_S)[0]
    finally:
        torch.set_float32_matmul_precision(before)


def _probe_all(job: Job, rungs: list[Rung], device: dev.DeviceInfo, say) -> None:
    """Probe every runnable rung, interleaved (each once per round, ``PROBES`` rounds); rule out, before they are
    built, the rungs whose rate cannot reach float32's within the probes' noise (``thorough``: only say so)."""
    live = [r for r in rungs if r.status not in NOT_RUN]
    rates: dict[str, list[float]] = {r.name: [] for r in live}
    t0 = time.perf_counter()
    try:
        for _ in range(pr.PROBES):
            for r in live:
                rates[r.name].append(probe(r, device))
    except Exception as err:  # noqa: BLE001 - without probes every rung is timed, as before
        say(f"matmul probes failed ({type(err).__name__}: {err}): every rung is timed")
        return
    n = PROBE_N.get(device.type, 256)
    how = (f"{pr.PROBES} interleaved probes of square {n} x {n} matmuls, each the best over {PROBE_S * 1e3:.0f} ms "
           "(core.measure.device.measure_matmul_peak, the CPU peak's measurement)")
    for r in live:
        r.probe = pr.probe_summary(rates[r.name]) | {"how": how}
    ref, name = rungs[0].probe, rungs[0].name
    say(f"matmul probes ({time.perf_counter() - t0:.2f} s): " + ", ".join(
        f"{r.name} {pr.gflops(r.probe)}" for r in live))
    for r in live:
        if r is rungs[0] or not pr.cannot_be_faster(r.probe, ref):
            continue
        r.probe |= {"cannot_be_faster": True, "float32_flops_per_s": ref["flops_per_s"], "float32_p10": ref["p10"],
                    "float32_p90": ref["p90"], "reference": name,  # float32_*: the reference's (its name)
                    "reason": pr.probe_reason(r.probe, ref, job.thorough, name)}
        if not job.thorough:
            r.status, r.reason = pr.CANNOT_BE_FASTER, r.probe["reason"]
        say(f"  {r.name}: {pr.CANNOT_BE_FASTER}: {r.probe['reason']}")


def as_job(job: Job, rung: Rung) -> Job:
    return dataclasses.replace(job, dtype=rung.dtype, matmul_precision=rung.matmul_precision)


def train_trial(job: Job, groups: list[str], recipe: str, batches, device: torch.device,
                watch: f8.Watch, beat=None) -> tuple[list[float], list[float], str | None, int | None]:
    """Train a fresh model (the job's seed, dtype and matmul precision, eager) on ``batches``, with ``groups``
    in emulated FP8; stop on the watch. Under float16 the loss scaler runs as in training; a step it skips
    (an overflow, which lowers its scale) is not a divergence and gives the watch no gradient norm. ``beat``: a
    :class:`mfu_lab.core.process.progress.Heartbeat`, called after each step (it prints at most every GAP_S seconds)."""
    model = build_model(job).to(device).train()
    f8.apply_policy(model, groups, recipe)
    ts = build_train_step(eager(job), model, device.type)  # emulation hooks run eager
    for i, (x, y) in enumerate(batches):
        loss = ts.loss(to_device(x, device), to_device(y, device))
        ts.scaler.scale(loss).backward()
        ts.scaler.unscale_(ts.optimizer)
        norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), math.inf))
        ts.scaler.step(ts.optimizer)
        ts.scaler.update()
        ts.optimizer.zero_grad(set_to_none=True)
        value = float(loss.detach())
        if beat is not None:
            beat.beat(i + 1, len(batches), "steps")
        if ts.scaler.is_enabled() and not math.isfinite(norm) and math.isfinite(value):
            watch.losses.append(value)
            continue
        why = watch.check(value, norm)
        if why:
            return watch.losses, watch.grad_norms, why, i
    return watch.losses, watch.grad_norms, None, None


def _loss_check(job: Job, rungs: list[Rung], batches, device: torch.device, say) -> None:
    """Each runnable rung's loss curve under the divergence watch, against the reference rung's (float32's, or the
    job's own under a budget), trained first; final-window gap."""
    reference: list[float] | None = None
    ref_name = next((r.name for r in rungs if r.status == pr.REFERENCE), REFERENCE)
    p = as_progress(say)
    todo = [r for r in rungs if r.status not in NOT_RUN]
    eta = p.eta("loss curves", len(todo))
    for r in rungs:
        if r.status in NOT_RUN:
            continue
        if r.status != pr.REFERENCE and reference is None:
            r.status, r.reason = pr.FAILED, f"no {ref_name} loss curve to compare with"
            continue
        watch = f8.Watch(reference, job.loss_tolerance, job.fp8_window, job.fp8_spike)
        t0 = time.perf_counter()
        try:
            beat = p.heartbeat(f"  {r.name}: loss curve", len(batches))
            losses, norms, why, at = train_trial(as_job(job, r), [], job.fp8_recipe, batches, device, watch, beat)
        except Exception as err:  # noqa: BLE001 - one rung's failure must not end the step
            r.fail("loss curve", err)
            say(f"  {r.name}: loss curve failed: {r.reason}")
            continue
        r.loss, r.grad_norm, r.loss_s, r.diverged, r.stopped_at = losses, norms, time.perf_counter() - t0, why or "", at
        r.scaler_skipped = len(losses) - len(watch.grad_norms)
        if r.status == pr.REFERENCE:
            reference = losses
        elif not why:
            w = min(job.fp8_window, len(losses), len(reference))
            r.final_gap = (sum(losses[-w:]) / w) / (sum(reference[-w:]) / w) - 1
        say(f"  {r.name}: loss {losses[0]:.4f} -> {losses[-1]:.4f}" + (f"; stopped: {why}" if why else "")
            + eta.tag(todo.index(r) + 1))


class _Runner:
    """One rung's model and training step, continuing over the shared batches round after round."""

    def __init__(self, job: Job, rung: Rung, batches: list, device: torch.device, say, tally: dict | None = None,
                 warm: bool = True):
        self.rung, self.device, self.say = rung, device, say
        self.tally = tally  # shared by the rungs: {"n": rounds run, "eta": Eta, "beat": Heartbeat} (time left)
        self.job = as_job(job, rung)
        self.model = build_model(self.job).to(device).train()
        self.step = build_train_step(self.job, self.model, device.type)
        self.batches = itertools.cycle(batches)
        if job.warmup_steps and warm:  # warm=False: the budget's probe warms it (probe_step, then warm_rest)
            self.steps(job.warmup_steps)

    def warm_rest(self, done: int) -> None:
        """The job's warm-up steps less the ``done`` ones already run (the probe's)."""
        if self.job.warmup_steps > done:
            self.steps(self.job.warmup_steps - done)

    def steps(self, k: int):
        torch.set_float32_matmul_precision(self.rung.matmul_precision)  # process-wide: set for each round
        beat = self.tally["beat"] if self.tally else None  # a line between steps, at most every GAP_S seconds
        tick = None if beat is None else (lambda done, total, _: beat.beat(done, total, f"{self.rung.name}, steps"))
        if beat is not None:
            beat.restart()  # the time left counts this run's steps
        return run_steps(self.step, self.batches, self.device, 0, k, tick)

    def __call__(self, k: int) -> dict[str, list[float]]:
        if self.rung.status != pr.FAILED:
            try:
                t = self.steps(k)
                tag = ""
                if self.tally:
                    self.tally["n"] += 1
                    tag = self.tally["eta"].tag(min(self.tally["n"], self.tally["eta"].total))
                    self.tally["beat"].said()
                self.say(f"  {self.rung.name}: {stats(t.wall_s).median * 1e3:.1f} ms per step" + tag)
                return {"wall_s": t.wall_s, "data_s": t.data_s, "compute_s": t.compute_s, "loss": t.loss}
            except Exception as err:  # noqa: BLE001 - the other rungs keep their rounds
                self.rung.fail("timing", err)
                self.say(f"  {self.rung.name}: timing failed: {self.rung.reason}")
        return {"wall_s": [math.nan] * k}  # a failed rung's slot: kept in the order, its times are not used


def _tally(say) -> dict:
    p = as_progress(say)
    return {"n": 0, "eta": p.eta("precision rounds", 0), "beat": p.heartbeat("  precision ladder")}


def round_steps(job: Job) -> int:
    """Steps of each rung in each interleaved round."""
    return max(2, job.steps // job.precision_rounds)


PROBE_STEPS = 2  # steps a budget's probe runs on a fresh rung: one warm-up, then the one it times


def probe_step(runner: _Runner) -> float:
    """Seconds of one training step of the runner's rung (measured, the second step of its fresh model, after one
    warm-up step; both count towards the job's warm-up): the budget's estimate of each of its steps."""
    runner.steps(1)
    return float(runner.steps(1).wall_s[0])


def _fit(job: Job, rungs: list[Rung], batches, device: torch.device, say, clock, reserve_s: float,
         ref_curve: bool, tally: dict) -> tuple[dict[str, _Runner], dict[str, tuple[float, float]]]:
    """Under a budget: (the runners the share holds, warmed, the reference first; {rung: (build s, step s)} as
    probed). The reference (``rungs[0]``, the job's own) is built and probed first, then every other runnable rung
    while the share left holds a probe (about the reference's build and :data:`PROBE_STEPS` steps). Each rung's
    cost is its interleaved rounds and the rest of its warm-up at its probed step, and its loss curve (a build and
    ``fp8_steps`` steps), since only a rung with a loss curve can be adopted; the reference's curve counts when
    only the ladder needs it (``ref_curve``). The other rungs are taken cheapest first while the reference's cost
    and theirs fit the share left less ``reserve_s`` (what step 5 keeps for what comes after); the rest are
    skipped with the seconds. None fits: nothing is timed, the reference included."""
    ref, live = rungs[0], [r for r in rungs[1:] if r.status not in NOT_RUN]
    if not live:
        return {}, {}
    where = (f"step 5's {clock.planned_s:.0f} s share" + (f", less {reserve_s:.0f} s kept for the FP8 trials"
                                                          if reserve_s else ""))

    def left() -> float:
        return clock.left_s() - reserve_s

    def skip(r: Rung, why: str) -> None:
        r.status, r.reason = pr.SKIPPED, "budget: " + why + " (a larger --budget, or none, times it)"
        clock.shorten(f"precision {r.name}", r.reason.removeprefix("budget: "))

    if left() <= 0:
        for r in live:
            skip(r, f"not probed or timed: {max(left(), 0.0):.1f} s left of {where}")
        ref.reason = f"not timed: no time left of {where} for another precision"
        return {}, {}
    runners: dict[str, _Runner] = {}
    costs: dict[str, tuple[float, float]] = {}
    probe_s = 0.0  # the reference's build and probe: what one more probe costs, about
    for r in [ref] + live:
        if r is not ref and left() < probe_s:
            skip(r, f"not probed or timed: {left():.1f} s left of {where}, less than one probe (about {probe_s:.1f} "
                    f"s: {ref.name}'s build and {PROBE_STEPS} steps, measured)")
            continue
        t0 = time.perf_counter()
        try:
            runner = _Runner(job, r, batches, device, say, tally, warm=False)
            build = time.perf_counter() - t0
            r.step_probe_s = probe_step(runner)
        except Exception as err:  # noqa: BLE001 - one rung's failure must not end the step
            r.fail("building and probing", err)
            say(f"  {r.name}: failed: {r.reason}")
            if r is ref:  # nothing to time the others against
                return {}, {}
            continue
        runners[r.name], costs[r.name] = runner, (build, r.step_probe_s)
        if r is ref:
            probe_s = time.perf_counter() - t0
    k = round_steps(job)
    rest = max(job.warmup_steps - PROBE_STEPS, 0) + job.precision_rounds * k  # steps after the probe

    def cost(name: str, curve: bool) -> float:
        build, step = costs[name]
        return rest * step + (build + job.fp8_steps * step if curve else 0.0)

    need = cost(ref.name, ref_curve) if ref.name in runners else 0.0
    kept = []
    for r in sorted((r for r in live if r.name in runners), key=lambda r: r.step_probe_s):
        c = cost(r.name, True)
        if need + c <= left():
            kept.append(r)
            need += c
            continue
        skip(r, f"not timed: its rounds and loss curve need about {c:.1f} s ({rest} steps and a {job.fp8_steps}-step "
                f"curve at {r.step_probe_s * 1e3:.0f} ms a step, its one-step probe, measured), but {left():.1f} s of "
                f"{where} are left and {', '.join([ref.name] + [x.name for x in kept])} take about {need:.1f} s of "
                "them")
        del runners[r.name]
    say("precision ladder: one-step probes (measured): " + ", ".join(
        f"{r.name} {r.step_probe_s * 1e3:.0f} ms" for r in [ref] + live if r.step_probe_s is not None)
        + f"; {', '.join(x.name for x in kept) or 'none'} timed against {ref.name} within {where}")
    if not kept:
        ref.reason = f"not timed: no other precision's rounds and loss curve fit {where}"
        return {}, costs
    for r in [ref] + kept:
        try:
            runners[r.name].warm_rest(PROBE_STEPS)
        except Exception as err:  # noqa: BLE001 - one rung's failure must not end the step
            r.fail("warming up", err)
            say(f"  {r.name}: failed: {r.reason}")
            del runners[r.name]
    return runners, costs


def _speed(job: Job, rungs: list[Rung], batches, device: torch.device, say,
           runners: dict[str, _Runner] | None = None, tally: dict | None = None) -> list[list]:
    """Interleaved timing of every runnable rung (``runners``: built and warmed already, under a budget); fills
    step times and speedups against the reference (``rungs[0]``); returns the order run."""
    p = as_progress(say)
    tally = tally or _tally(say)
    if runners is None:
        runners = {}
        for r in rungs:
            if r.status in NOT_RUN:
                continue
            try:
                runners[r.name] = _Runner(job, r, batches, device, say, tally)
            except Exception as err:  # noqa: BLE001 - one rung's failure must not end the step
                r.fail("building and warming up", err)
                say(f"  {r.name}: failed: {r.reason}")
    if not runners:
        return []
    k = round_steps(job)
    say(f"timing {', '.join(runners)}: {job.precision_rounds} interleaved rounds of {k} steps each")
    tally["eta"] = p.eta("precision rounds", job.precision_rounds * len(runners))  # counted from here
    run = interleave(runners, job.precision_rounds, k)
    ref = rungs[0]
    for r in rungs:
        if r.name not in runners or r.status == pr.FAILED:
            continue
        s = stats(run.series[r.name].wall_s)
        r.step_median_s, r.step_p10_s, r.step_p90_s = s.median, s.p10, s.p90
        if r is ref:
            r.speedup = 1.0
        elif ref.status != pr.FAILED and ref.name in runners:
            sp = bootstrap_speedup(run.series[ref.name].wall_s, run.series[r.name].wall_s)
            r.speedup, r.speedup_low, r.speedup_high = sp.value, sp.low, sp.high
    return [[i, name] for i, name in run.order]


def ladder(job: Job, batches: list, device: dev.DeviceInfo, say, reference: str = "", clock=None,
           reserve_s: float = 0.0) -> dict[str, Any]:
    """The precision ladder on this device: every rung's figures, the interleave order and the choice.
    ``reference``: why no one needs the reference's loss curve beyond the ladder (step 5's budget holds no FP8
    trial); then, when no other rung is timed, that curve is not trained either ("" trains it). ``clock``: step 5's
    :class:`mfu_lab.core.process.budget.Clock`; with a share, the ladder takes the job's own precision as its
    reference and times only the rungs that fit the share left less ``reserve_s`` (:func:`_fit`); without one (no
    budget), float32 is the reference and every runnable rung is timed."""
    torch_device = device.torch_device
    budget = clock is not None and clock.left_s() is not None
    rungs = plan(job, own_first=budget)
    ref = rungs[0]
    for r in rungs[1:]:  # the reference is what the job trains in (float32, or the job's own under a budget)
        why = unavailable(r, device)
        if why:
            r.status, r.reason = pr.SKIPPED, why
    ref.status = pr.REFERENCE
    native = pr.native_bf16() if device.type == "cpu" else None
    out = {"reference": ref.name, "native_bf16": native}
    if len(rungs) == 1:  # precision_rungs is empty and the job trains in float32: nothing to compare
        ref.reason = "no lower precision to try (precision_rungs is empty)"
        return out | {"rungs": [dataclasses.asdict(ref)], "order": [], "choice": choose(job, rungs, None)}
    costs: dict[str, tuple[float, float]] = {}
    try:
        _probe_all(job, rungs, device, say)
        runners, tally = None, _tally(say)
        if budget:
            runners, costs = _fit(job, rungs, batches, torch_device, say, clock, reserve_s, bool(reference), tally)
        timed = any(r.status not in NOT_RUN for r in rungs[1:])
        if not timed and not ref.reason:  # nothing left to race the reference against: its loss curve only
            ref.reason = "not timed: no other precision can be faster here or run here"
        if job.thorough:
            say(f"precision ladder: loss curves over {job.fp8_steps} steps, same seed and batches")
            _loss_check(job, rungs, batches[:job.fp8_steps], torch_device, say)
            order = _speed(job, rungs, batches, torch_device, say, runners, tally) if timed else []
        else:  # race: time first; only a rung proven faster can be adopted, so only those need a loss curve
            order = _speed(job, rungs, batches, torch_device, say, runners, tally) if timed else []
            runners = None  # their models are not needed for the loss curves
            check = [r for r in rungs if r is ref or r.status not in NOT_RUN and (
                r.speedup_low is None or r.speedup_low > 1.0)]
            if budget:
                check = _curves_fit(job, check, clock, reserve_s, costs, bool(reference))
            if reference and check == [ref]:  # nothing to compare with it, and no FP8 trial to reuse it
                ref.loss_skipped, check = f"loss curve not trained: {reference}", []
            for r in rungs:
                if r not in check and r.status not in NOT_RUN:
                    r.loss_skipped = (f"loss curve not trained: not proven faster than {ref.name}, so it cannot be "
                                      "adopted (--thorough trains it)")
            if check:
                say(f"precision ladder: loss curves over {job.fp8_steps} steps for "
                    f"{', '.join(r.name for r in check)}")
                _loss_check(job, check, batches[:job.fp8_steps], torch_device, say)
    finally:
        torch.set_float32_matmul_precision(job.matmul_precision)
    choice = choose(job, rungs, settle(job, rungs, native))
    return out | {"rungs": [dataclasses.asdict(r) for r in rungs], "order": order, "choice": choice}


def _curves_fit(job: Job, check: list[Rung], clock, reserve_s: float, costs: dict[str, tuple[float, float]],
                ref_curve: bool) -> list[Rung]:
    """Under a budget, the rungs of ``check`` (the reference first) whose loss curves still fit the share left less
    ``reserve_s`` after the timing, at their probed steps; a rung proven faster whose curve does not fit is skipped
    with the seconds (it cannot be adopted without one). The reference's curve counts only when the ladder alone
    needs it (``ref_curve``: no FP8 trial reuses it)."""
    ref, out, need = check[0], check[:1], 0.0
    left = clock.left_s() - reserve_s
    if ref_curve and ref.name in costs:
        build, step = costs[ref.name]
        need = build + job.fp8_steps * step
    for r in check[1:]:
        build, step = costs.get(r.name, (0.0, 0.0))
        c = build + job.fp8_steps * step
        if need + c <= left:
            out.append(r)
            need += c
            continue
        why = (f"proven faster than {ref.name} ({_figures(r, ref.name)}), but its {job.fp8_steps}-step loss curve "
               f"(about {c:.1f} s at its probed {step * 1e3:.0f} ms a step) does not fit the "
               f"{max(left - need, 0.0):.1f} s left of step 5's share, so it cannot be adopted (a larger --budget, or "
               "none, trains it)")
        r.status, r.reason = pr.SKIPPED, "budget: " + why
        clock.shorten(f"precision {r.name} loss curve", why)
    return out


def settle(job: Job, rungs: list[Rung], native: dict | None) -> str | None:
    """Each rung's status and reason under the adoption rule (:func:`mfu_lab.analysis.precision.judge`), with
    what this device adds to them; returns the adopted rung's name or None."""
    if rungs[0].status == pr.FAILED:  # no reference (float32, or the job's own): nothing else can be judged
        for r in rungs[1:]:
            if r.status not in (pr.SKIPPED, pr.FAILED):
                r.status, r.reason = pr.FAILED, f"the {rungs[0].name} reference failed: " + rungs[0].reason
    figures = [pr.Figures(r.name, r.speedup, r.speedup_low, r.speedup_high, r.final_gap, r.diverged,
                          r.status if r.status in pr.UNJUDGED else "", r.loss_skipped) for r in rungs]
    verdicts, adopted = pr.judge(figures, job.loss_tolerance, next((r.name for r in rungs if r.own), ""),
                                 rungs[0].name)
    for r, (status, reason) in zip(rungs, verdicts):
        if r.status not in pr.UNJUDGED:
            r.status, r.reason = status, reason
        slow = status in (pr.SLOWER, pr.CANNOT_BE_FASTER) or (status == pr.NOT_FASTER and (r.speedup or 1.0) < 1.0)
        if r.dtype == "bfloat16" and slow and native and native["native"] is False:
            r.reason += f"; {NO_NATIVE_BF16}"
        if r.probe.get("cannot_be_faster") and r.status != pr.CANNOT_BE_FASTER:  # timed anyway: --thorough
            r.reason += f"; {r.probe['reason']}"
        if r.scaler_skipped:
            r.reason += f"; the loss scaler skipped {r.scaler_skipped} step(s) on overflow"
    return adopted


def _figures(r: Rung, reference: str = REFERENCE) -> str:
    out = []
    if r.speedup_low is not None:
        out.append(f"{r.speedup:.2f}x [{r.speedup_low:.2f}, {r.speedup_high:.2f}] against {reference}")
    if r.final_gap is not None:
        out.append(f"final loss {r.final_gap:+.2%}")
    return ", ".join(out)


def _note(r: Rung) -> str:
    """The part of a rung's reason the choice repeats: why it could not run, or why its bf16 is slow."""
    if r.status in (pr.SKIPPED, pr.FAILED, pr.DIVERGED, pr.CANNOT_BE_FASTER):
        return f" ({r.reason.split(';')[0]})"
    return f"; {NO_NATIVE_BF16}" if NO_NATIVE_BF16 in r.reason else ""


def choose(job: Job, rungs: list[Rung], adopted: str | None) -> dict[str, Any]:
    """The precision this job should train in, with one sentence that carries the figures. ``rungs[0]`` is the
    reference every figure is against (float32, or the job's own under a budget)."""
    tol, k, ref = job.loss_tolerance, round_steps(job), rungs[0]
    how = (f"{job.precision_rounds} interleaved rounds of {k} steps; loss over {job.fp8_steps} steps from the same "
           f"seed and batches, tolerance {tol:.0%}")
    out = [r.name for r in rungs if r.status == pr.CANNOT_BE_FASTER]
    if out:
        how += (f"; {', '.join(out)} ruled out before any training by {pr.PROBES} matmul probes beside {ref.name}'s "
                "(measured), so not timed")
    cut = [r.name for r in rungs if r.status == pr.SKIPPED and r.reason.startswith("budget: ")]
    if cut:
        how += f"; {', '.join(cut)} left out by step 5's share of the budget (each with its seconds)"
    pick = next((r for r in rungs if r.name == adopted), None) or next(r for r in rungs if r.own)
    if adopted:
        verb, mine = ("Keep", " (the job's own precision)") if pick.own else ("Train in", "")
        text = (f"{verb} {WORDS.get(pick.name, pick.name)}{mine}: "
                f"{_figures(pick, ref.name)} ({how}). Job-file: dtype: {pick.dtype}; matmul_precision: "
                f"{pick.matmul_precision}")
    else:
        others = [f"{r.name} {r.status}" + (f" ({_figures(r, ref.name)})" if _figures(r) else "") + _note(r)
                  for r in rungs if r is not ref]
        than = "lower precision was" if ref.name == REFERENCE else f"other precision was proven faster than {ref.name}"
        text = (f"Keep the job's precision ({pick.dtype}, matmul {pick.matmul_precision}): no {than}"
                + (" proven faster" if ref.name == REFERENCE else "") + " with its loss kept"
                + (f" — {'; '.join(others)}" if others else "") + f" ({how})")
        if pick.own and pick.status in (pr.OFF, pr.DIVERGED):
            text += f". The job's own {pick.name} did not keep float32's loss ({pick.reason}): consider float32"
        if pick.own and pick.status == pr.CANNOT_BE_FASTER:
            text += (f". The job's own {pick.name} cannot be faster than float32 here "
                     f"({pick.reason.split(';')[0]}): consider float32")
    measured = pick is not ref
    return {"dtype": pick.dtype, "matmul_precision": pick.matmul_precision, "rung": pick.name,
            "adopted": adopted is not None, "text": text,
            "speedup": pick.speedup if measured else None, "speedup_low": pick.speedup_low if measured else None,
            "speedup_high": pick.speedup_high if measured else None,
            "final_gap": pick.final_gap if measured else None, "label": "measured"}
