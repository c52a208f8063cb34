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

    def fail(self, what: str, err: BaseException) -> None:
        if self.status != pr.FAILED:
            self.status, self.reason = pr.FAILED, f"{what}: {type(err).__name__}: {err}"[:400]


def plan(job: Job) -> list[Rung]:
    """float32 first (the reference), the job's rungs, and the job's own precision when it is none of them."""
    own = (job.dtype, job.matmul_precision)
    names = [REFERENCE] + [n for n in dict.fromkeys(job.precision_rungs) if n != REFERENCE]
    rungs = [Rung(n, *SETTINGS[n]) for n in names]
    mine = next((r for r in rungs if (r.dtype, r.matmul_precision) == own), None)
    if mine is None:
        name = job.dtype if job.matmul_precision == "highest" or job.dtype == "float32" else f"{job.dtype} + tf32"
        mine = Rung("tf32" if own == SETTINGS["tf32"] else name, *own)
        rungs.append(mine)
    mine.own = True
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
    ref = rungs[0].probe
    say(f"matmul probes ({time.perf_counter() - t0:.2f} s): " + ", ".join(
        f"{r.name} {pr.gflops(r.probe)}" for r in live))
    for r in live:
        if r is rungs[0] or not pr.cannot_be_faster(r.probe, ref):
            continue
        r.probe |= {"cannot_be_faster": True, "float32_flops_per_s": ref["flops_per_s"], "float32_p10": ref["p10"],
                    "float32_p90": ref["p90"], "reason": pr.probe_reason(r.probe, ref, job.thorough)}
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
    """Each runnable rung's loss curve under the divergence watch, against float32's; final-window gap."""
    reference: list[float] | None = None
    p = as_progress(say)
    todo = [r for r in rungs if r.status not in NOT_RUN]
    eta = p.eta("loss curves", len(todo))
    for r in rungs:
        if r.status in NOT_RUN:
            continue
        if r.name != REFERENCE and reference is None:
            r.status, r.reason = pr.FAILED, "no float32 loss curve to compare with"
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
        if r.name == REFERENCE:
            reference = losses
        elif not why:
            w = min(job.fp8_window, len(losses), len(reference))
            r.final_gap = (sum(losses[-w:]) / w) / (sum(reference[-w:]) / w) - 1
        say(f"  {r.name}: loss {losses[0]:.4f} -> {losses[-1]:.4f}" + (f"; stopped: {why}" if why else "")
            + eta.tag(todo.index(r) + 1))


class _Runner:
    """One rung's model and training step, continuing over the shared batches round after round."""

    def __init__(self, job: Job, rung: Rung, batches: list, device: torch.device, say, tally: dict | None = None):
        self.rung, self.device, self.say = rung, device, say
        self.tally = tally  # shared by the rungs: {"n": rounds run, "eta": Eta, "beat": Heartbeat} (time left)
        self.job = as_job(job, rung)
        self.model = build_model(self.job).to(device).train()
        self.step = build_train_step(self.job, self.model, device.type)
        self.batches = itertools.cycle(batches)
        if job.warmup_steps:
            self.steps(job.warmup_steps)

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


def _speed(job: Job, rungs: list[Rung], batches, device: torch.device, say) -> list[list]:
    """Interleaved timing of every runnable rung; fills step times and speedups; returns the order run."""
    runners: dict[str, _Runner] = {}
    p = as_progress(say)
    tally = {"n": 0, "eta": p.eta("precision rounds", 0), "beat": p.heartbeat("  precision ladder")}
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
    k = max(2, job.steps // job.precision_rounds)
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


def ladder(job: Job, batches: list, device: dev.DeviceInfo, say, reference: str = "") -> dict[str, Any]:
    """The precision ladder on this device: every rung's figures, the interleave order and the choice.
    ``reference``: why no one needs float32's loss curve beyond the ladder (step 5's budget holds no FP8 trial);
    then, when no other rung is timed, that curve is not trained either ("" trains it)."""
    torch_device = device.torch_device
    rungs = plan(job)
    for r in rungs:
        why = unavailable(r, device)
        if why:
            r.status, r.reason = pr.SKIPPED, why
    rungs[0].status = pr.REFERENCE
    native = pr.native_bf16() if device.type == "cpu" else None
    if len(rungs) == 1:  # precision_rungs is empty and the job trains in float32: nothing to compare
        rungs[0].reason = "no lower precision to try (precision_rungs is empty)"
        return {"rungs": [dataclasses.asdict(rungs[0])], "order": [], "native_bf16": native,
                "choice": choose(job, rungs, None)}
    try:
        _probe_all(job, rungs, device, say)
        timed = any(r.status not in NOT_RUN for r in rungs[1:])
        if not timed:  # nothing left to race float32 against: its loss curve only (the FP8 reference reuses it)
            rungs[0].reason = "not timed: no other precision can be faster here or run here"
        if job.thorough:
            say(f"precision ladder: loss curves over {job.fp8_steps} steps, same seed and batches")
            _loss_check(job, rungs, batches[:job.fp8_steps], torch_device, say)
            order = _speed(job, rungs, batches, torch_device, say) if timed else []
        else:  # race: time first; only a rung proven faster can be adopted, so only those need a loss curve
            order = _speed(job, rungs, batches, torch_device, say) if timed else []
            check = [r for r in rungs if r is rungs[0] or r.status not in NOT_RUN and (
                r.speedup_low is None or r.speedup_low > 1.0)]
            if reference and check == [rungs[0]]:  # nothing to compare with it, and no FP8 trial to reuse it
                rungs[0].loss_skipped, check = f"loss curve not trained: {reference}", []
            for r in rungs:
                if r not in check and r.status not in NOT_RUN:
                    r.loss_skipped = ("loss curve not trained: not proven faster than float32, so it cannot be "
                                      "adopted (--thorough trains it)")
            if check:
                say(f"precision ladder: loss curves over {job.fp8_steps} steps for "
                    f"{', '.join(r.name for r in check)}")
                _loss_check(job, check, batches[:job.fp8_steps], torch_device, say)
    finally:
        torch.set_float32_matmul_precision(job.matmul_precision)
    choice = choose(job, rungs, settle(job, rungs, native))
    return {"rungs": [dataclasses.asdict(r) for r in rungs], "order": order, "native_bf16": native,
            "choice": choice}


def settle(job: Job, rungs: list[Rung], native: dict | None) -> str | None:
    """Each rung's status and reason under the adoption rule (:func:`mfu_lab.analysis.precision.judge`), with
    what this device adds to them; returns the adopted rung's name or None."""
    if rungs[0].status == pr.FAILED:  # no float32 reference: nothing else can be judged
        for r in rungs[1:]:
            if r.status not in (pr.SKIPPED, pr.FAILED):
                r.status, r.reason = pr.FAILED, "the float32 reference failed: " + rungs[0].reason
    figures = [pr.Figures(r.name, r.speedup, r.speedup_low, r.speedup_high, r.final_gap, r.diverged,
                          r.status if r.status in pr.UNJUDGED else "", r.loss_skipped) for r in rungs]
    verdicts, adopted = pr.judge(figures, job.loss_tolerance, next((r.name for r in rungs if r.own), ""))
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


def _figures(r: Rung) -> str:
    out = []
    if r.speedup_low is not None:
        out.append(f"{r.speedup:.2f}x [{r.speedup_low:.2f}, {r.speedup_high:.2f}] against float32")
    if r.final_gap is not None:
        out.append(f"final loss {r.final_gap:+.2%}")
    return ", ".join(out)


def _note(r: Rung) -> str:
    """The part of a rung's reason the choice repeats: why it could not run, or why its bf16 is slow."""
    if r.status in (pr.SKIPPED, pr.FAILED, pr.DIVERGED, pr.CANNOT_BE_FASTER):
        return f" ({r.reason.split(';')[0]})"
    return f"; {NO_NATIVE_BF16}" if NO_NATIVE_BF16 in r.reason else ""


def choose(job: Job, rungs: list[Rung], adopted: str | None) -> dict[str, Any]:
    """The precision this job should train in, with one sentence that carries the figures."""
    tol, k = job.loss_tolerance, max(2, job.steps // job.precision_rounds)
    how = (f"{job.precision_rounds} interleaved rounds of {k} steps; loss over {job.fp8_steps} steps from the same "
           f"seed and batches, tolerance {tol:.0%}")
    out = [r.name for r in rungs if r.status == pr.CANNOT_BE_FASTER]
    if out:
        how += (f"; {', '.join(out)} ruled out before any training by {pr.PROBES} matmul probes beside float32's "
                "(measured), so not timed")
    pick = next((r for r in rungs if r.name == adopted), None) or next(r for r in rungs if r.own)
    if adopted:
        verb, mine = ("Keep", " (the job's own precision)") if pick.own else ("Train in", "")
        text = (f"{verb} {WORDS.get(pick.name, pick.name)}{mine}: "
                f"{_figures(pick)} ({how}). Job-file: dtype: {pick.dtype}; matmul_precision: {pick.matmul_precision}")
    else:
        others = [f"{r.name} {r.status}" + (f" ({_figures(r)})" if _figures(r) else "") + _note(r) for r in rungs
                  if r.name != REFERENCE]
        text = (f"Keep the job's precision ({pick.dtype}, matmul {pick.matmul_precision}): no lower precision was "
                f"proven faster with its loss kept" + (f" — {'; '.join(others)}" if others else "") + f" ({how})")
        if pick.own and pick.status in (pr.OFF, pr.DIVERGED):
            text += f". The job's own {pick.name} did not keep float32's loss ({pick.reason}): consider float32"
        if pick.own and pick.status == pr.CANNOT_BE_FASTER:
            text += (f". The job's own {pick.name} cannot be faster than float32 here "
                     f"({pick.reason.split(';')[0]}): consider float32")
    measured = pick.name != REFERENCE
    return {"dtype": pick.dtype, "matmul_precision": pick.matmul_precision, "rung": pick.name,
            "adopted": adopted is not None, "text": text,
            "speedup": pick.speedup if measured else None, "speedup_low": pick.speedup_low if measured else None,
            "speedup_high": pick.speedup_high if measured else None,
            "final_gap": pick.final_gap if measured else None, "label": "measured"}
