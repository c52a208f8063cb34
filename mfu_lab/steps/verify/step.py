"""Step 7, verify: how much did the workflow give back on this job, measured side by side?

Every earlier step measures its own change alone. This step stacks the changes they adopted
(:mod:`mfu_lab.analysis.tuning`) into the tuned job, writes it as ``<out>/<job>/tuned.yaml``, and measures
the **staircase**: the original job, then the job with each adopted change added in the workflow's order
(attention -> communication -> data -> compile -> precision -> FP8). Each rung runs in its own process
(compile and allocator state stay apart), warmed up first, then all rungs run in interleaved rounds
(A B C, A B C, ...) with the same seed and batches, so that drift hits every rung alike
(:mod:`mfu_lab.core.measure.sidebyside`). Per rung: median step time and p10-p90; tokens/s and MFU over the total wall
time of its measured steps, as in step 1; and the speedup
over the original and over the rung below, each with a bootstrap interval; a rung whose interval
contains 1.0 is "not proven". The loss curves of the original and the tuned job over the same steps
are compared at the end against ``loss_tolerance``. The ledgers before and after come from the same
method on both (the single-process ledger of the interleaved steps).

FP8 that is only emulated on this device is excluded from the speed staircase, and said to be. DDP
changes are verified under DDP (the original and the tuned DDP configuration alternated in one torchrun
launch) when the job runs data-parallel. Writes ``<out>/<job>/07_verify/result.json``.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mfu_lab.analysis import tuning
from mfu_lab.core.advice import Advice
from mfu_lab.core.engine.layout import beyond_ddp
from mfu_lab.core.errors import DeviceError
from mfu_lab.core.job.schema import Job, validate
from mfu_lab.core.measure import device as dev
from mfu_lab.core.measure.environment import environment
from mfu_lab.core.measure.health import HealthSummary
from mfu_lab.core.measure.ledger import HardwareFlops, Ledger, single_process_ledger
from mfu_lab.core.measure.sidebyside import bootstrap_speedup, interleave
from mfu_lab.core.measure.timed import Timings
from mfu_lab.core.process.budget import Clock, fit_verify, job_step_s
from mfu_lab.core.process.faults import guarded
from mfu_lab.core.process.progress import as_progress
from mfu_lab.core.registry import BY_KEY, STEPS
from mfu_lab.core.store import step_results as store
from mfu_lab.core.store.files import write_atomic
from mfu_lab.core.store.nodes import launcher_folder
from mfu_lab.core.store.results import Metric, StepResult
from mfu_lab.steps.verify.ddp import UNDER_TORCHRUN, ddp_configs, torchrun_reason, verify_ddp
from mfu_lab.steps.verify.layout import layout_change, measure_in_layout, rung_figures
from mfu_lab.workers.launch import world_layout
from mfu_lab.workers.verify_rung import RungProcess

INFO = BY_KEY["verify"]
TUNED_FILE = "tuned.yaml"
WALL = "over the total wall time of the measured steps"  # MFU and tokens/s, as in step 1 (rung_figures)
LOSS_WINDOW = 5  # steps averaged at the end of each loss curve


@dataclass
class Rung:
    name: str  # original, or the staircase stage it adds (attention, data, compile, precision, fp8)
    keys: dict[str, Any]  # what this rung changes over the rung below: key -> new value
    status: str  # ok | failed | excluded
    reason: str = ""
    dtype: str = "float32"
    step_median_s: float | None = None
    step_p10_s: float | None = None
    step_p90_s: float | None = None
    tokens_per_s: float | None = None
    mfu: float | None = None
    hardware_flops_ratio: float | None = None  # hardware / model FLOPs per step (recompute), as the rung counted
    flops_source: str = ""
    peak_flops_per_s: float | None = None
    peak_source: str = ""
    peak_precision: str = ""  # the peak's row: fp32, tf32 (float32 at matmul precision high), bf16, fp16
    speedup: float | None = None  # original median / this median
    speedup_low: float | None = None
    speedup_high: float | None = None
    gain: float | None = None  # the rung below's median / this median: what this rung's change gave
    gain_low: float | None = None
    gain_high: float | None = None
    proven: bool | None = None  # the gain's interval lies off 1.0
    challenger: bool = False  # a re-check of an earlier choice at the tuned precision, adopted only if it wins
    warmup_s: float | None = None
    wall_s: list[float] = field(default_factory=list)
    data_s: list[float] = field(default_factory=list)
    compute_s: list[float] = field(default_factory=list)
    loss: list[float] = field(default_factory=list)  # warm-up steps first, then the measured ones


@dataclass
class VerifyResult(StepResult):
    step: str
    job: dict[str, Any]
    environment: dict[str, Any]
    metrics: dict[str, Metric]
    changes: list[dict[str, Any]]  # every recommended change (analysis.tuning.Change), adopted or not
    tuned_file: str
    rungs: list[Rung]
    order: list[list]  # [round, rung] in the order run
    loss: dict[str, Any]
    ledgers: dict[str, Ledger]  # before, after
    ddp: dict[str, Any]
    headline: dict[str, Any]
    advice: list[Advice]


Result = VerifyResult  # the step contract: every step module names its result class Result


def earlier_results(job: Job) -> tuple[dict[str, dict], list[str]]:
    """The stored results of steps 1-6 (key -> dict), and why each missing one is missing."""
    found, missing = {}, []
    for info in STEPS:
        if info.number > 6:  # step 6 too: a layout it measured faster here is proposed (analysis.layouts.proposal)
            continue
        e = store.earlier(job, info.key)
        if e:
            found[info.key] = e.data
        else:
            missing.append(e.reason)
    return found, missing


def write_tuned(job: Job, keep: list[str] | tuple[str, ...] = (), source: str = "the job",
                run_id: str = "") -> tuple[Path, list[tuning.Change]]:
    """Write ``<out>/<job>/tuned.yaml`` from the steps' stored results; return its path and the changes."""
    results, _ = earlier_results(job)
    mine = store.earlier(job, INFO.key)
    if mine:  # what step 7 adopted itself (an attention re-checked at the tuned precision)
        results["verify"] = mine.data
    chosen = tuning.changes(job, results, keep)
    return _save_tuned(job, chosen, source, run_id), chosen


def _save_tuned(job: Job, chosen: list[tuning.Change], source: str = "the job", run_id: str = "") -> Path:
    return write_atomic(job.output_root() / TUNED_FILE, tuning.tuned_yaml(job, chosen, source, run_id))


def attention_recheck(job: Job, results: dict[str, dict], tuned: Job) -> tuple[Job, str] | None:
    """The tuned job with the other attention implementation, when step 2 chose attention at another precision
    than the tuned job trains in (a choice at float32 need not hold at bfloat16); None otherwise."""
    step2 = results.get("attention_comm")
    if not step2 or not job.uses_reference_model:
        return None
    measured_at = (step2.get("job") or {}).get("dtype", job.dtype)
    if measured_at == tuned.dtype:
        return None
    other = "unfused" if tuned.attention == "sdpa" else "sdpa"
    why = (f"step 2 chose {tuned.attention} at {measured_at}; the tuned job trains in {tuned.dtype}, so {other} "
           "is timed again beside it and adopted only if faster beyond the noise")
    return validate(tuned.to_dict() | {"attention": other}, f"attention re-check at {tuned.dtype}"), why


def _peaks(job: Job, device: dev.DeviceInfo, wanted: set[tuple[str, str]], say) -> dict[tuple, tuple]:
    """(FLOP/s or None, source, row) per (dtype, matmul precision): step 1's peak for the job's own; else the job's
    peak_flops for that dtype only, the datasheet row (a TF32 rung gets TF32's) or measured (CPU). A GPU with
    neither for a dtype gets no peak (no MFU), and the source says what it needs."""
    from mfu_lab.steps.baseline.step import reference_peak

    out: dict[tuple, tuple] = {}
    for dtype, mp in sorted(wanted):
        row = dev.float32_precision_key(mp) if dtype == "float32" else dev.DTYPE_KEY[dtype]
        if dtype == job.dtype and (dtype != "float32" or row == dev.float32_precision_key(job.matmul_precision)):
            out[(dtype, mp)] = (*reference_peak(job, device)[:2], row)
            continue
        say(f"peak FLOP/s for {dtype} (matmul precision {mp})")
        try:
            p = dev.resolve_peak(device, dtype, job.peak_flops, mp, job.dtype, job.matmul_precision)
            out[(dtype, mp)] = (p.flops_per_s, p.source, row)
        except DeviceError:
            out[(dtype, mp)] = (None, f"none: no datasheet row for {device.name} and no peak_flops for {dtype}; "
                                      f"give it in the job, e.g. peak_flops: {{{job.dtype}: ..., {dtype}: ...}}", row)
    return out


def _measure(job: Job, rungs: list[Rung], jobs: list[Job], work: Path, say) -> list[list]:
    """Start every measurable rung's process, warm them up, run the interleaved rounds; fill the rungs."""
    total = job.verify_rounds * job.verify_steps
    procs: dict[str, RungProcess] = {}
    flops: dict[str, float] = {}
    resident = sum(r.status == "ok" for r in rungs)  # on CUDA each rung's process gets 1/resident of the GPU
    try:
        for rung, rjob in zip(rungs, jobs):
            if rung.status != "ok":
                continue
            say(f"rung {rung.name}: starting its process, {job.verify_warmup_steps} warm-up steps")
            dev.release_device_memory("cuda")  # each rung's process gets the GPU the launcher let go of
            p = RungProcess({"rung": rung.name, "job": rjob.to_dict(), "steps_total": total,
                             "memory_fraction": 1 / resident}, work, job.compile_timeout_s)
            procs[rung.name] = p
            p.beat = lambda waited, name=rung.name: say(f"  rung {name}: still warming up ({waited:.0f} s so far; "
                                                        "a compiled rung compiles here)")
            try:
                ready = p.ready()
            except (RuntimeError, OSError) as e:
                rung.status, rung.reason = "failed", str(e)
                p.close()
                del procs[rung.name]
                continue
            rung.warmup_s, rung.loss = ready["warmup_s"], list(ready["warmup_loss"])
            flops[rung.name] = ready["model_flops_per_step"]
            if ready["model_flops_per_step"]:
                rung.hardware_flops_ratio = ready["hardware_flops_per_step"] / ready["model_flops_per_step"]
                rung.flops_source = ready.get("flops_source", "")
        if not procs:
            return []
        by_name = {r.name: r for r in rungs}

        def runner(name: str, p: RungProcess):
            def run(k: int):
                try:
                    return p.run(k)
                except (RuntimeError, OSError) as e:  # its process died (a closed stdin: BrokenPipeError) or hung:
                    # recorded, the others go on
                    by_name[name].status, by_name[name].reason = "failed", f"during the rounds: {e}"
                    return None
            return run

        eta, lines = as_progress(say).eta("interleaved rounds", job.verify_rounds * len(procs)), [0]

        def round_line(msg: str) -> None:  # interleave's line per rung and round, with the time left
            lines[0] += 1
            say(msg + eta.tag(min(lines[0], eta.total)))

        done = interleave({name: runner(name, p) for name, p in procs.items()}, job.verify_rounds,
                          job.verify_steps, round_line)
    finally:
        for p in procs.values():
            p.close()
    for rung in rungs:
        s = done.series.get(rung.name)
        if s is None or rung.status != "ok" or not s.wall_s:
            continue
        rung.wall_s, rung.data_s, rung.compute_s = s.wall_s, s.data_s, s.compute_s
        rung.loss += s.loss
        rung_figures(rung, flops[rung.name], job.tokens_per_step)
    return [[r, n] for r, n in done.order]


def _speedups(rungs: list[Rung]) -> None:
    measured = [r for r in rungs if r.wall_s]
    if not measured or measured[0].name != "original":
        return
    base = measured[0]
    for below, rung in zip(measured, measured[1:]):
        total = bootstrap_speedup(base.wall_s, rung.wall_s)
        gain = bootstrap_speedup(below.wall_s, rung.wall_s)
        rung.speedup, rung.speedup_low, rung.speedup_high = total.value, total.low, total.high
        rung.gain, rung.gain_low, rung.gain_high, rung.proven = gain.value, gain.low, gain.high, gain.proven
    base.speedup = base.speedup_low = base.speedup_high = 1.0


def _timings(r: Rung) -> Timings:
    return Timings(r.wall_s, r.data_s, r.compute_s, r.loss[-len(r.wall_s):], 0, "interleaved rounds, "
                   "time.perf_counter (CPU) or CUDA events around each phase")


def _loss(job: Job, original: Rung, tuned: Rung) -> dict[str, Any]:
    n = min(len(original.loss), len(tuned.loss))
    if n == 0 or tuned is original:
        return {"status": "skipped", "reason": "no tuned rung was measured", "tolerance": job.loss_tolerance}
    w = min(LOSS_WINDOW, n)
    a, b = original.loss[:n], tuned.loss[:n]
    gap = statistics.fmean(b[n - w:]) / statistics.fmean(a[n - w:]) - 1
    return {"status": "ok" if gap <= job.loss_tolerance else "off", "original": a, "tuned": b, "tuned_rung": tuned.name,
            "final_gap": gap, "window": w, "tolerance": job.loss_tolerance,
            "note": f"mean loss of the last {w} of {n} steps (same seed, same batches): tuned / original - 1"}


def _pct(v: float | None) -> str:
    if v is None:
        return "n/a"
    return f"{v:.1%}" if v >= 0.01 else f"{v:.3%}"


def _headline(before: Rung, after: Rung, rungs: list[Rung], loss: dict) -> dict[str, Any]:
    if after is None or after is before or after.speedup is None:
        return {"text": "No adopted change could be timed against the original here, so there is no measured gain "
                        "to show (see the changes and the skipped list)", "carried": []}
    carried = [r.name for r in rungs[1:] if r.proven and (r.gain or 0) > 1]
    same_peak = before.peak_flops_per_s == after.peak_flops_per_s
    ci = f"[{after.speedup_low:.2f}, {after.speedup_high:.2f}]"
    text = f"MFU {_pct(before.mfu)} -> {_pct(after.mfu)} (measured side by side, speedup {after.speedup:.2f}x {ci})"
    a, b = (r.peak_precision or r.dtype for r in (before, after))
    if not same_peak and before.peak_flops_per_s and after.peak_flops_per_s:
        text += (f"; each MFU is against its own precision's peak ({a}, then {b}), and this device's {b} peak is "
                 f"{after.peak_flops_per_s / before.peak_flops_per_s:.1f}x its {a} peak: across precisions "
                 "compare the speedup, not the MFU")
    elif not same_peak:
        text += "; no MFU without a peak: " + (after if before.peak_flops_per_s else before).peak_source
    return {"text": text, "mfu_before": before.mfu, "mfu_after": after.mfu, "speedup": after.speedup,
            "speedup_low": after.speedup_low, "speedup_high": after.speedup_high,
            "proven": after.speedup_low > 1.0 or after.speedup_high < 1.0, "carried": carried,
            "loss_ok": loss.get("status") == "ok"}


@guarded("verify")
def run(job: Job, progress=None, write: bool = True, keep: list[str] | tuple[str, ...] = ()) -> VerifyResult:
    """Write the tuned job and measure its staircase against the original; see the module docstring."""
    t_start = time.perf_counter()
    say = as_progress(progress)
    device = dev.resolve_device(job.device)
    results, missing = earlier_results(job)
    skipped = [{"what": "an earlier step's changes", "reason": m} for m in missing]
    chosen = tuning.changes(job, results, keep)
    tuned_path = job.output_root() / TUNED_FILE
    if write:
        _save_tuned(job, chosen)
    say(f"{sum(c.adopted for c in chosen)} change(s) adopted of {len(chosen)} recommended; tuned job: {tuned_path}")

    stairs = tuning.staircase(job, chosen)
    no_fp8_units = _fp8_reason(device)
    rungs, jobs = [], []
    for name, rjob, mine in stairs:
        keys = {c.key: c.new for c in mine}
        rung = Rung(name, keys, "ok", dtype=rjob.dtype)
        if name in UNDER_TORCHRUN:  # DDP settings, a layout change: verified under torchrun (steps.verify.ddp)
            rung.status, rung.reason = "excluded", UNDER_TORCHRUN[name]
        elif name == "fp8" and no_fp8_units:
            rung.status, rung.reason = "excluded", (f"FP8 is emulated on this device ({no_fp8_units}): adopted for "
                                                    "its numerics only, no speed is claimed or measured")
        elif name == "fp8":
            rung.status, rung.reason = "excluded", ("the training loop applies no FP8 conversion yet: measure FP8 "
                                                    "speed in step 5 (torchao, compiled)")
        rungs.append(rung)
        jobs.append(rjob)
    recheck = attention_recheck(job, results, stairs[-1][1])
    if recheck:
        rjob, why = recheck
        rungs.append(Rung(f"attention at {rjob.dtype}", {"attention": rjob.attention}, "ok", why, rjob.dtype,
                          challenger=True))
        jobs.append(rjob)
    peaks = _peaks(job, device, {(r.dtype, j.matmul_precision) for r, j in zip(rungs, jobs) if r.status == "ok"}, say)
    for r, j in zip(rungs, jobs):
        if r.status == "ok":
            r.peak_flops_per_s, r.peak_source, r.peak_precision = peaks[(r.dtype, j.matmul_precision)]
    work = launcher_folder(job.step_dir(INFO.folder) / "work")  # one per node: nodes share no progress file
    timed = (ok := sum(r.status == "ok" for r in rungs)) > 1  # the original and at least one rung to time against it
    nnodes, nproc = world_layout(job, device.type)
    clock = Clock.for_step(job, INFO.key)
    run_job = fit_verify(job, clock, job_step_s(results.get("baseline")), ok, bool(layout_change(job, chosen)),
                         ddp_configs(job, chosen) is not None)
    if beyond_ddp(job) and timed:
        order = measure_in_layout(run_job, rungs, jobs, work, say, device, nnodes * nproc)
    else:
        order = _measure(run_job, rungs, jobs, work, say) if timed else []
    if not timed:
        why = ("no change was adopted: the tuned job is the original" if len(rungs) == 1 else
               "no adopted change can be timed in one process here (" + "; ".join(
                   f"{r.name}: {r.reason}" for r in rungs[1:]) + ")")
        skipped.append({"what": "the staircase", "reason": why})
    _speedups(rungs)
    measured = [r for r in rungs if r.wall_s]
    before = measured[0] if measured and measured[0].name == "original" else None
    after = measured[-1] if measured else None
    if after is not None and after.challenger:
        if after.proven and after.gain > 1:
            chosen.append(tuning.Change(
                "attention", "verify", "attention", stairs[-1][1].attention, after.keys["attention"],
                f"step 7: {after.keys['attention']} {after.gain:.2f}x [{after.gain_low:.2f}, {after.gain_high:.2f}] "
                f"the tuned job's {stairs[-1][1].attention} at {after.dtype}, side by side (measured)", "measured"))
            after.reason = "adopted: faster at the tuned precision beyond the noise"
            if write:
                _save_tuned(job, chosen)
        else:
            after.reason = "not adopted: not faster than the tuned job beyond the noise"
            after = measured[-2] if len(measured) > 1 else None
    loss = _loss(job, before, after) if before else {"status": "skipped", "reason": "the original did not run"}
    health = HealthSummary(False, "not sampled by the verify step")
    ledgers = {}
    if before and after and after is not before:
        ledgers = {name: single_process_ledger(_timings(r), r.mfu or 0.0, health, HardwareFlops(
                   r.hardware_flops_ratio, r.flops_source, "as the rung's process counted them")
                   if r.hardware_flops_ratio else None) for name, r in (("before", before), ("after", after))}
    ddp = verify_ddp(run_job, device.type, chosen, work / "ddp", say)
    for r in rungs:
        r.reason = torchrun_reason(r, ddp)
    headline = _headline(before, after, rungs, loss)
    metrics = _metrics(before, after, loss)
    result = VerifyResult("verify", job.to_dict(), environment(device.name, device.type), metrics,
                          [c.to_dict() for c in chosen], str(tuned_path), rungs, order, loss, ledgers, ddp, headline,
                          [], skipped=skipped + clock.shortened)
    result.budget, result.advice = clock.record(), advise(result)
    result.elapsed_s = time.perf_counter() - t_start
    if write:
        save(job, result)
    return result


def _fp8_reason(device: dev.DeviceInfo) -> str:
    from mfu_lab.steps.fp8.step import fp8_hardware

    return fp8_hardware(device)


def _metrics(before: Rung | None, after: Rung | None, loss: dict) -> dict[str, Metric]:
    def m(v, unit, note):
        return Metric(v, unit, "measured", note)

    tuned = after is not None and after is not before
    shown = after if tuned else before  # the job the workflow leaves: the tuned one when it was measured
    return {
        "mfu": m(shown.mfu if shown else None, "fraction", ("the tuned job" if tuned else "the original job (nothing "
                 "adopted was timed)") + ", step 7's interleaved rounds: model FLOPs x steps / (its precision's peak x "
                 f"wall time), {WALL}"),
        "tokens_per_s": m(shown.tokens_per_s if shown else None, "tokens/s",
                          f"tokens per step x steps / wall time, {WALL}"),
        "step_time_median_s": m(shown.step_median_s if shown else None, "s", "median of the interleaved steps"),
        "mfu_before": m(before.mfu if before else None, "fraction", "the original job, interleaved rounds: model "
                        f"FLOPs x steps / (peak x wall time), {WALL}"),
        "mfu_after": m(after.mfu if tuned else None, "fraction", "the tuned job, the same rounds: model FLOPs x "
                       f"steps / (peak x wall time), {WALL}"),
        "speedup": m(after.speedup if tuned else None, "x", "original median step / tuned median step, side by side"),
        "speedup_low": m(after.speedup_low if tuned else None, "x", "2.5th percentile of the bootstrap"),
        "speedup_high": m(after.speedup_high if tuned else None, "x", "97.5th percentile of the bootstrap"),
        "final_loss_gap": m(loss.get("final_gap"), "fraction", "tuned / original mean loss over the last steps - 1"),
    }


def advise(r: VerifyResult) -> list[Advice]:
    out: list[Advice] = []
    h = r.headline
    if h.get("speedup") is not None:
        sev = "act" if h.get("proven") and h["speedup"] > 1 and h.get("loss_ok") else "look"
        out.append(Advice(sev, f"Adopt the tuned job ({Path(r.tuned_file).name}): {h['text']}",
                          "changes carried the gain: " + (", ".join(h["carried"]) or "none beyond the noise")))
    for rung in r.rungs[1:]:
        if rung.status == "ok" and rung.proven is False:
            out.append(Advice("look", f"The {rung.name} change is not proven on this job: its gain "
                              f"{rung.gain:.2f}x [{rung.gain_low:.2f}, {rung.gain_high:.2f}] includes 1.0",
                              "interleaved rounds, bootstrap interval of the ratio of medians"))
        elif rung.status in ("failed", "excluded"):
            out.append(Advice("info" if rung.status == "excluded" else "look",
                              f"Rung {rung.name} {rung.status}: {rung.reason}", "recorded; the other rungs ran"))
    if r.loss.get("status") == "off":
        out.append(Advice("act", "The tuned job's loss ends above the original's beyond loss_tolerance: refuse the "
                          "lossy changes (keep: [dtype, fp8_layers]) and verify again",
                          f"final gap {r.loss['final_gap']:+.2%} (tolerance {r.loss['tolerance']:.0%})"))
    for c in r.changes:
        if not c["adopted"]:
            out.append(Advice("info", f"Not adopted: {c['key']} -> {c['new']!r}: {c['reason']}", c["evidence"]))
    if r.ddp.get("status") == "ok":
        out.append(Advice("info" if r.ddp["proven"] and r.ddp["speedup"] > 1 else "look", r.ddp["text"],
                          "original and tuned DDP configurations alternated in one launch"))
    return out


def save(job: Job, result: VerifyResult) -> Path:
    """Write result.json atomically and refresh the job's index page."""
    return store.save(job, INFO.key, result)
