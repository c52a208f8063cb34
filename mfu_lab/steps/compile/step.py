"""Step 4, compile: does torch.compile pay for itself at fixed shapes, and what shape discipline
does it need first?

``run(job)`` (1) reads one epoch of the job's data and tallies the shapes it yields; (2) counts the
recompiles those shapes cause under the job's ``compile_dynamic`` setting, and in a demonstration
with a few sequence lengths under ``dynamic=False`` and torch's default, each with the guard
message that triggered it, and lists graph breaks (``torch._dynamo.explain``); (3) runs the
training steps eager and compiled in each mode, each trial in a fresh process: a cold compile
(empty compile cache) and a warm one (a second process reusing the cache). Per mode: compile time,
steady-state step time against eager, speedup, MFU, break-even step count and loss drift from
eager; (4) profiles each compiled mode like step 3 and compares operator/kernel counts and fusion
candidates. Writes ``<out>/<job>/04_compile/result.json``.
"""

from __future__ import annotations

import dataclasses
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from mfu_lab.analysis import racing
from mfu_lab.analysis import recompiles as cp
from mfu_lab.analysis.trace import breakdown as tr
from mfu_lab.core.advice import Advice
from mfu_lab.core.engine import fp8 as fp8_layers
from mfu_lab.core.engine.batches import to_device
from mfu_lab.core.engine.data import job_vocab
from mfu_lab.core.engine.layout_check import graphs_problem
from mfu_lab.core.engine.work import rate_metrics
from mfu_lab.core.engine.workload import build_loader, build_model, build_train_step
from mfu_lab.core.job.rules import CUDA_GRAPH_MODES
from mfu_lab.core.job.schema import Job
from mfu_lab.core.measure import device as dev
from mfu_lab.core.measure import flops as fl
from mfu_lab.core.measure.environment import environment
from mfu_lab.core.measure.flops import count_step_flops
from mfu_lab.core.measure.ledger import HardwareFlops, hardware_flops, trace_ledger
from mfu_lab.core.measure.timed import stats
from mfu_lab.core.process.budget import Clock, fit_compile, job_step_s
from mfu_lab.core.process.faults import guarded
from mfu_lab.core.process.progress import as_progress
from mfu_lab.core.registry import BY_KEY
from mfu_lab.core.store import step_results as store
from mfu_lab.core.store.results import Metric, StepResult, jsonable
from mfu_lab.steps.baseline.reference import reference_peak
from mfu_lab.steps.compile.confirm import confirm_mode
from mfu_lab.steps.compile.loss_race import race_in_step, reserve_s
from mfu_lab.steps.compile.worker import run_worker
from mfu_lab.steps.fit import one_process_note

INFO = BY_KEY["compile"]
WARM_STEPS = 3  # measured steps of the warm-cache run (only its compile time is used)
WARM_WORTH_S = 60.0  # on a CPU, a cold compile shorter than this is not worth a warm-cache run (GPU: always)


@dataclass
class Trial:
    mode: str  # eager | default | max-autotune-no-cudagraphs | reduce-overhead | max-autotune | options
    status: str  # ok | failed | timeout | skipped
    reason: str = ""
    error: str = ""
    traceback: str = ""
    step_median_s: float | None = None
    step_p10_s: float | None = None
    step_p90_s: float | None = None
    first_steps_s: list[float] = field(default_factory=list)
    compile_cold_s: float | None = None
    compile_warm_s: float | None = None
    warm_skipped: str = ""  # why the warm-cache compile was not measured (steps.compile.step._warm_skip)
    speedup: float | None = None  # eager median / this median
    faster_beyond_noise: bool = False  # this p90 below eager's p10
    mfu: float | None = None  # over the total wall time of the measured steps, as step 1
    steps_per_s: float | None = None  # measured steps / their total wall time (tokens/s and MFU)
    break_even_cold: float | None = None  # steps; None: never pays
    break_even_warm: float | None = None
    drift: float | None = None  # largest relative per-step loss difference from eager
    drift_ok: bool | None = None
    recompiles: int = 0
    recompile_messages: list[str] = field(default_factory=list)
    graphs: int = 0
    ops_per_step: float | None = None  # kernels (GPU) / operators (CPU) per profiled step
    fusion_left: list[str] = field(default_factory=list)
    trace_file: str = ""
    loss: list[float] = field(default_factory=list)
    seconds: float = 0.0  # wall time of the cold trial, process start included
    start_s: float | None = None  # eager's: its process beyond its steps and 3 profiled ones (fixed_costs)


@dataclass
class CompileResult(StepResult):
    step: str
    job: dict[str, Any]
    environment: dict[str, Any]
    metrics: dict[str, Metric]
    audit: cp.ShapeAudit
    recompiles: list[cp.RecompileRun]
    breaks: cp.GraphBreaks
    eager: Trial
    trials: list[Trial]
    step3: dict[str, Any]
    recommendation: dict[str, Any]
    advice: list[Advice]
    # mode -> the MFU ledger of its profiled steps (eager included): the index's "after" waterfall
    ledgers: dict[str, Any] = field(default_factory=dict)
    confirmation: racing.Confirmation | None = None  # the leading mode measured again beside eager
    loss_race: dict[str, Any] = field(default_factory=dict)  # steps.compile.loss_race: loss_impl raced side by side


Result = CompileResult  # the step contract: every step module names its result class Result


# ------------------------------------------------------------------ trials in fresh processes
def _fill(t: Trial, d: dict[str, Any], eager: Trial | None, eager_extra: float, flops: float, peak: float,
          tolerance: float) -> None:
    walls, warm = d["wall_s"], d["warmup"]
    st = stats(walls[warm:])
    t.step_median_s, t.step_p10_s, t.step_p90_s = st.median, st.p10, st.p90
    t.first_steps_s = walls[:warm]
    t.steps_per_s = len(walls[warm:]) / sum(walls[warm:])
    t.mfu = fl.mfu(flops, t.steps_per_s, peak)
    t.recompiles, t.recompile_messages, t.graphs = d["recompiles"], d["recompile_messages"], d["graphs"]
    t.loss = d["loss"]
    if eager is None:
        return
    t.compile_cold_s = cp.compile_seconds(walls, warm, st.median, eager_extra)
    t.speedup = eager.step_median_s / st.median
    t.faster_beyond_noise = st.p90 < eager.step_p10_s
    t.break_even_cold = cp.break_even_steps(t.compile_cold_s, eager.step_median_s, st.median)
    t.drift = cp.loss_drift(eager.loss, t.loss)
    t.drift_ok = t.drift <= tolerance


def _warm_skip(job: Job, device_type: str, t: Trial, clock: Clock, cold_trial_s: float) -> str:
    """Why the warm-cache compile is not measured for trial ``t`` ('' when it is): on a CPU, when the cold
    compile is too short for a cache to matter (under WARM_WORTH_S); always measured on a GPU and with
    ``thorough``; left out when the step's budget cannot fit another process as long as the cold trial."""
    if job.thorough:
        return ""
    if device_type != "cuda" and (t.compile_cold_s or 0.0) < WARM_WORTH_S:
        return (f"cold compile took {t.compile_cold_s or 0.0:.1f} s, under {WARM_WORTH_S:.0f} s: a warm cache could "
                "save at most that per restart (measured on GPUs always, and with --thorough)")
    if not clock.fits(cold_trial_s):
        clock.shorten(f"{t.mode}: warm-cache compile", f"{clock.left_s():.0f} s left of {clock.planned_s:.0f} s")
        return f"budget: {clock.left_s():.0f} s left of the step's {clock.planned_s:.0f} s"
    return ""


def _skip_reason(mode: str, device_type: str, job: Job) -> str:
    if mode in CUDA_GRAPH_MODES and device_type != "cuda":
        return f"'{mode}' captures CUDA graphs: it needs a CUDA device"
    if problem := graphs_problem(dataclasses.replace(job, compile_mode=mode), device_type):
        return f"'{mode}' {problem.expected}"  # the job's layout would refuse it (FSDP2 with accumulation)
    if job.compile_backend != "inductor" and mode != "default":
        return f"modes are options of the inductor backend; backend is '{job.compile_backend}'"
    return ""


# ------------------------------------------------------------------ the step
def _step3_reference(job: Job) -> dict[str, Any] | None:
    step3 = store.earlier(job, "kernels")
    if not step3:
        return None
    a = step3.data["analysis"]
    return {"source": f"step 3 result ({step3.path})", "ops_per_step": a.get("ops_per_step"), "kind": a["kind"],
            "patterns": [c["pattern"] for c in a["fusion"]]}


def _recommend(eager: Trial, trials: list[Trial], audit: cp.ShapeAudit, real: cp.RecompileRun) -> dict[str, Any]:
    ok = [t for t in trials if t.status == "ok"]
    good = [t for t in ok if t.drift_ok and t.faster_beyond_noise]
    rec: dict[str, Any] = {"shapes_first": audit.varies or real.recompiles > 0}
    if not good:
        why = ("no mode ran" if not ok else "no mode's step was faster beyond the noise (p90 below eager's p10) "
               "with a loss that stays with eager's")
        rec.update(compile=False, text=f"Stay eager: {why}. Eager step {eager.step_median_s * 1e3:.1f} ms.")
        return rec
    best = min(good, key=lambda t: t.step_median_s)
    pays = (f"pays for itself after {best.break_even_cold:.0f} steps of a cold compile ({best.compile_cold_s:.1f} s)"
            if best.break_even_cold is not None else "")
    if best.break_even_warm is not None:
        pays += f", {best.break_even_warm:.0f} steps with a warm cache ({best.compile_warm_s:.1f} s)"
    arg = "options=compile_options" if best.mode == "options" else f"mode='{best.mode}'"
    rec.update(compile=True, mode=best.mode, break_even_cold=best.break_even_cold,
               text=f"Compile with torch.compile(model, {arg}): step {eager.step_median_s * 1e3:.1f} -> "
                    f"{best.step_median_s * 1e3:.1f} ms ({best.speedup:.2f}x); {pays}.")
    return rec


def _confirmed(rec: dict[str, Any], confirmation: racing.Confirmation) -> dict[str, Any]:
    """The recommendation once its mode was measured again beside eager: kept when proven, else stay eager."""
    if confirmation.proven:
        return rec | {"text": f"{rec['text'][:-1]}; {confirmation.text()}."}
    how = ", but measured again beside eager: " if confirmation.status == "ok" else "; "
    return {"shapes_first": rec["shapes_first"], "compile": False, "led": rec["mode"],
            "text": f"Stay eager: mode {rec['mode']} led ({rec['text'].split(': ', 1)[1][:-1]}){how}"
                    f"{confirmation.text()}."}


def advise(r: CompileResult) -> list[Advice]:
    out: list[Advice] = []
    a, real = r.audit, r.recompiles[0]
    if a.varies or real.recompiles:
        fix = ("set seq_policy to pad or pack (one length) or bucket (a few), and last_batch to drop or pad"
               if a.seq_lens else "make the data's inputs one shape (resize or crop them) and set last_batch to "
               "drop or pad")
        out.append(Advice("act", "Fix the shapes before compiling: " + fix,
                          f"one epoch of the data has {len(a.shapes)} shapes ({', '.join(list(a.shapes)[:4])}...); "
                          f"they cause {real.recompiles} recompile(s) under compile_dynamic={real.dynamic}"))
    if a.padding_fraction > 0.10:
        out.append(Advice("look", "Padding fills a large share of each batch: packing (seq_policy: pack) trains on "
                          "the same tokens without it", f"{a.padding_fraction:.1%} of target positions are padding"))
    if r.breaks.breaks:
        out.append(Advice("look", "The model's forward has graph breaks: each splits the compiled graph and stops "
                          "fusion across it", "; ".join(r.breaks.reasons[:3])))
    sev = "act" if r.recommendation.get("compile") else "info"
    out.append(Advice(sev, r.recommendation["text"], "eager and each mode run side by side, each in a fresh process, "
                      "same seed and data"))
    lr = r.loss_race or {}
    if lr.get("ran"):
        out.append(Advice("act" if lr.get("adopted") else "info", f"The loss (mode {lr['mode']}): {lr['verdict']}",
                          lr.get("method", "")))
    elif lr.get("note"):
        out.append(Advice("info", f"The loss's implementations were not raced: {lr['note']}", "recorded"))
    for t in r.trials:
        if t.status == "ok" and t.drift_ok is False:
            out.append(Advice("look", f"Mode '{t.mode}' is not recommended: its loss drifts from eager's",
                              f"largest relative per-step difference {t.drift:.1e}"))
        elif t.status in ("failed", "timeout"):
            out.append(Advice("look", f"Mode '{t.mode}' {t.status}: {t.error}", "recorded; the other modes ran"))
    return out


@guarded("compile")
def run(job: Job, progress=None, write: bool = True) -> CompileResult:
    """Measure torch.compile against eager for the job; see the module docstring."""
    t_start = time.perf_counter()
    clock = Clock.for_step(job, INFO.key)
    say = as_progress(progress)
    device = dev.resolve_device(job.device)
    torch_device = device.torch_device
    skipped: list[dict[str, str]] = []
    note = one_process_note(job, "compile trials", "in the layout each rank would compile its own blocks "
                            "(core.engine.parallelize compiles per block, after TP and before FSDP)")
    if note:
        skipped.append(note)
    out_dir = job.step_dir(INFO.folder)

    # ---- 1. the data's shapes, one epoch
    quiet = dataclasses.replace(job, num_workers=0, synthetic_load_ms=0.0)
    epoch = job.dataset_samples or (job.compile_warmup_steps + job.steps) * job.micro_batch
    policy = (f"data={job.data}, seq_policy={job.seq_policy}, last_batch={job.last_batch}, "
              f"micro_batch={job.micro_batch}, {epoch} samples")
    say(f"reading one epoch of the data ({policy})")
    epoch_batches = list(build_loader(quiet, 0, "cpu", n_samples=epoch))
    audit = cp.audit_shapes(epoch_batches, policy)

    # ---- 2. recompiles (dynamo alone: no backend compile needed) and graph breaks
    model = build_model(job).to(torch_device).train()
    fp8_layers.apply(job, model, device.type)  # the model the trials compile: its fp8_layers converted as theirs
    batches = [x for x, _ in epoch_batches[:64]]
    tokens = getattr(epoch_batches[0], "tokens", True) if epoch_batches else True
    vocab = job_vocab(job) if tokens else 0  # vocab_size 0: the model's input embedding's rows
    say(f"counting recompiles: {len(batches)} batches of the data"
        + (f", then {job.seq_len}-token lengths varied" if tokens and vocab else ""))
    real = cp.count_recompiles(model, [to_device(x, torch_device) for x in batches], job.compile_dynamic,
                               "the data's own shapes")
    if tokens and vocab:  # the length demo: inputs that have a length
        b = min(job.micro_batch, 2)
        lengths = sorted({job.seq_len, max(1, job.seq_len // 2), max(1, 3 * job.seq_len // 4)}, reverse=True)
        demo_x = [torch.randint(vocab, (b, n), device=torch_device) for n in lengths]
        demo = [cp.count_recompiles(model, demo_x, "static", "lengths varied, dynamic=False"),
                cp.count_recompiles(model, demo_x, "auto", "lengths varied, torch's default (dynamic=None)")]
    else:
        demo = []
        skipped.append({"what": "the length-variation demo", "reason": "the batches are not token ids: their inputs "
                        "have no sequence length to vary (the recompile audit above reads the data's own shapes)"})
    breaks = cp.graph_breaks(model, to_device(demo_x[0] if demo else batches[0], torch_device))

    # ---- FLOPs and peak for MFU, as in step 1
    x0, y0 = next(iter(build_loader(quiet, 1, device.type)))
    report = count_step_flops(model, build_train_step(job, model, device.type), to_device(x0, torch_device),
                              to_device(y0, torch_device), cache_dir=job.output_root(),
                              key_extra=fl.job_key_extra(job))
    flops, hw = report.model_flops_per_step, hardware_flops(report)
    peak, *peak_label, _ = reference_peak(job, device)

    # ---- 3. trials, each in a fresh process
    work, caches = out_dir / "trials", out_dir / "cache"
    shutil.rmtree(caches, ignore_errors=True)
    tolerance = cp.DRIFT_TOLERANCE[job.dtype]
    steps = fit_compile(job, clock, job_step_s(store.earlier(job, "baseline").data), store.earlier(job, INFO.key).data)
    base = {"job": job.to_dict(), "warmup": job.compile_warmup_steps, "steps": steps}
    say(f"eager: {job.compile_warmup_steps} + {steps} steps in a fresh process")
    eager_trace = out_dir / "trace_eager.json.gz"
    d = run_worker(base | {"mode": "eager", "label": "eager", "trace": str(eager_trace)}, work, caches / "eager",
                   job.compile_timeout_s, say)
    if d["status"] != "ok":
        raise RuntimeError(f"the eager run failed, so nothing can be compared: {d.get('error')}\n"
                           f"{d.get('traceback', '')}")
    eager = Trial("eager", "ok", seconds=d["seconds"])
    method = d["method"]
    _fill(eager, d, None, 0.0, flops, peak, tolerance)
    eager.start_s = max(0.0, d["seconds"] - sum(d["wall_s"]) - 3 * (eager.step_median_s or 0.0))
    eager_extra = cp.compile_seconds(d["wall_s"], d["warmup"], eager.step_median_s)
    ref3 = _step3_reference(job)
    ledgers: dict[str, Any] = {}
    if eager_trace.is_file():
        a = tr.analyse(tr.load_trace(eager_trace), top_n=1)
        ledgers["eager"] = _trace_ledger(a, flops, peak, device.type, hw)
    if ref3 is None and eager_trace.is_file():
        ref3 = {"source": "the eager run's own trace (step 3 has not run)", "ops_per_step": a.ops_per_step,
                "kind": a.kind, "patterns": [c.pattern for c in a.fusion]}
    modes = list(job.compile_modes) + (["options"] if job.compile_options else [])
    trials: list[Trial] = []
    eta, keep = say.eta("compile modes", len(modes)), 0.0  # keep: the loss race's seconds, once a mode has run
    for i, mode in enumerate(modes, 1):
        why = _skip_reason(mode, device.type, job)
        if why:
            trials.append(Trial(mode, "skipped", why))
            skipped.append({"what": f"mode {mode}", "reason": why})
            continue
        trace = out_dir / f"trace_{mode}.json.gz"
        if trials and not clock.fits(max(t.seconds or 0.0 for t in trials) + keep):  # a cold trial as the longest
            why = (f"{clock.left_s():.0f} s of the step's {clock.planned_s:.0f} s left, less than one cold trial"
                   + (f" and the loss race's {keep:.0f} s, kept for it" if keep else ""))
            trials.append(Trial(mode, "skipped", "budget: " + why))
            clock.shorten(f"mode {mode}", why)
            continue
        say(f"[{i}/{len(modes)}] {mode}: cold compile (empty cache) and {steps} steps" + eta.tag(i - 1))
        d = run_worker(base | {"mode": mode, "label": f"{mode} cold", "trace": str(trace)}, work, caches / mode,
                       job.compile_timeout_s, say)
        t = Trial(mode, d["status"], error=d.get("error", ""), traceback=d.get("traceback", ""),
                  seconds=d["seconds"])
        trials.append(t)
        if t.status != "ok":
            say(f"  {mode} {t.status}: {t.error}")
            continue
        _fill(t, d, eager, eager_extra, flops, peak, tolerance)
        keep = keep or reserve_s(job, model, tokens, eager.step_median_s or 0.0, t.compile_cold_s or 0.0)
        why_not = _warm_skip(job, device.type, t, clock, d["seconds"])
        if why_not:
            t.warm_skipped = why_not
            skipped.append({"what": f"{mode}: warm-cache compile", "reason": why_not})
        else:
            say(f"[{i}/{len(modes)}] {mode}: warm compile (a second process reusing the cache)")
            w = run_worker(base | {"mode": mode, "label": f"{mode} warm", "steps": WARM_STEPS}, work,
                           caches / mode, job.compile_timeout_s, say)
        if not why_not and w["status"] == "ok":
            t.compile_warm_s = cp.compile_seconds(w["wall_s"], w["warmup"], stats(w["wall_s"][w["warmup"]:]).median,
                                                  eager_extra)
            t.break_even_warm = cp.break_even_steps(t.compile_warm_s, eager.step_median_s, t.step_median_s)
        if trace.is_file():
            a = tr.analyse(tr.load_trace(trace), top_n=1)
            t.ops_per_step, t.fusion_left, t.trace_file = a.ops_per_step, [c.pattern for c in a.fusion], trace.name
            ledgers[mode] = _trace_ledger(a, flops, peak, device.type, hw)

    eta.finish([t.reason for t in trials if t.status == "skipped"])

    # ---- 4. step 3's kernels against the compiled ones
    step3: dict[str, Any] = ref3 or {"source": "no eager trace to compare with"}
    if ref3:
        for t in trials:
            if t.status == "ok" and t.trace_file:
                step3[t.mode] = {"ops_per_step": t.ops_per_step,
                                 "removed": [p for p in ref3["patterns"] if p not in t.fusion_left],
                                 "left": [p for p in ref3["patterns"] if p in t.fusion_left]}
    rec = _recommend(eager, trials, audit, real)
    confirmation = None
    if rec.get("compile"):  # a mode faster beyond the noise across two processes: measured again side by side
        mode_trial = next(t for t in trials if t.mode == rec["mode"])
        confirmation = confirm_mode(job, device.type, rec["mode"], caches / rec["mode"], work / "confirm", clock,
                                    (eager.seconds or 0.0) + (mode_trial.seconds or 0.0), eager.step_median_s, say)
        say(confirmation.text())
        rec = _confirmed(rec, confirmation)
    best = next((t for t in trials if t.mode == rec.get("mode")), None)
    chosen = best or eager
    loss_race = race_in_step(job, rec, best, eager, trials, model, tokens, clock, skipped, say)
    del model
    # the figures of the recommended mode, or of the fastest mode that ran when none is recommended
    shown = best or min((t for t in trials if t.status == "ok"), key=lambda t: t.step_median_s, default=None)
    which = ("" if shown is None else f"mode {shown.mode}" + ("" if best else " (fastest, not recommended)") + ": ")
    metrics = {
        "mfu": Metric(chosen.mfu, "fraction", "measured",
                      f"{'compiled, mode ' + chosen.mode if best else 'eager (no mode recommended)'}: model FLOPs x "
                      "steps / (peak x wall time), over the total wall time of the measured steps"),
        "eager_mfu": Metric(eager.mfu, "fraction", "measured", "eager, in its own process, same steps: over the "
                            "total wall time of the measured steps"),
        "step_time_median_s": Metric(chosen.step_median_s, "s", "measured", method),
        "eager_step_time_median_s": Metric(eager.step_median_s, "s", "measured", "eager, fresh process"),
        **rate_metrics(job, chosen.steps_per_s, "over the total wall time of the measured steps"),
        "speedup": Metric(shown.speedup if shown else None, "x", "measured",
                          which + "eager median / compiled median"),
        "compile_cold_s": Metric(shown.compile_cold_s if shown else None, "s", "measured",
                                 which + "extra time of the first compiled steps over the steady state, minus "
                                 "eager's own first-step extra; empty compile cache"),
        "compile_warm_s": Metric(shown.compile_warm_s if shown else None, "s", "measured",
                                 which + "the same, in a second process reusing the on-disk compile cache"),
        "break_even_steps": Metric(shown.break_even_cold if shown else None, "steps", "analytic",
                                   which + "cold compile time / (eager step - compiled step); n/a: never pays"),
        "data_shapes": Metric(float(len(audit.shapes)), "shapes", "counted", f"distinct (batch, length) in one "
                              f"epoch ({audit.batches} batches)"),
        "padding_fraction": Metric(audit.padding_fraction, "fraction", "counted", "padding / all target positions"),
        "recompiles_on_data": Metric(float(real.recompiles), "recompiles", "counted",
                                     "dynamo recompiles over the data's batches, compile_dynamic="
                                     + job.compile_dynamic),
        "graph_breaks": Metric(float(breaks.breaks), "breaks", "counted", "torch._dynamo.explain, one forward"),
        "peak_flops_per_s": Metric(peak, "FLOP/s", peak_label[0], peak_label[1]),
    }
    result = CompileResult("compile", job.to_dict(), environment(device.name, device.type), metrics, audit,
                           [real, *demo], breaks, eager, trials, step3, rec, [], ledgers, confirmation, loss_race,
                           skipped=skipped)
    result.budget = clock.record()
    result.advice = advise(result)
    result.elapsed_s = time.perf_counter() - t_start
    if write:
        save(job, result)
    return result


def _trace_ledger(a: tr.TraceAnalysis, flops: float, peak: float, device_type: str,
                  hw: HardwareFlops | None) -> dict[str, Any]:
    """Step 3's ledger rule applied to one trial's profiled steps (MFU over the profiled window); the recompute
    share from the eager step's FLOP count (compiling fuses kernels, it does not add or drop matmuls)."""
    return jsonable(trace_ledger(a.breakdown, fl.mfu(flops, a.steps / a.window_s, peak), device_type, hw)) \
        if a.window_s else {}


def save(job: Job, result: CompileResult) -> Path:
    """Write result.json atomically and refresh the job\'s index page."""
    return store.save(job, INFO.key, result)
