"""Step 1, baseline: where does the step time go today?

``run(job)`` trains the job's model for a few warm-up and measured steps and
returns a :class:`BaselineResult`: step-time statistics, tokens/s, MFU and HFU,
FLOPs (analytic and counted), the MFU ledger, device health and advice. It
writes ``<out>/<job>/01_baseline/result.json`` and refreshes the job's index page.
"""

from __future__ import annotations

import dataclasses
import resource
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mfu_lab.core.advice import Advice
from mfu_lab.core.engine.batches import describe, to_device
from mfu_lab.core.engine.layout import Layout, beyond_ddp
from mfu_lab.core.engine.layout_check import check_layout
from mfu_lab.core.engine.workload import build_loader, build_model, build_train_step
from mfu_lab.core.job.schema import Job
from mfu_lab.core.measure import device as dev
from mfu_lab.core.measure import flops as fl
from mfu_lab.core.measure import peak_cache
from mfu_lab.core.measure.environment import environment
from mfu_lab.core.measure.flops import FlopReport, count_step_flops
from mfu_lab.core.measure.health import HealthSampler, HealthSummary
from mfu_lab.core.measure.ledger import Ledger, hardware_flops, single_process_ledger
from mfu_lab.core.measure.timed import Stats, Timings, run_steps, stats
from mfu_lab.core.process import budget
from mfu_lab.core.process.faults import guarded
from mfu_lab.core.process.progress import as_progress
from mfu_lab.core.registry import BY_KEY
from mfu_lab.core.store import step_results as store
from mfu_lab.core.store.results import Metric, StepResult
from mfu_lab.core.thresholds import (
    CLOCK_LOW,
    CV_LIMIT,
    DATA_WAIT_LIMIT,
    FLOP_TOLERANCE,
    HOST_LIMIT,
    HOT_C,
    PEAK_RECHECK_FLOOR,
)
from mfu_lab.steps.baseline import layout as baseline_layout
from mfu_lab.steps.baseline.data_race import race_loader
from mfu_lab.steps.fit import check_fit
from mfu_lab.workers.launch import world_layout

INFO = BY_KEY["baseline"]


@dataclass
class BaselineResult(StepResult):
    step: str
    job: dict[str, Any]
    environment: dict[str, Any]
    metrics: dict[str, Metric]
    timings: Timings
    step_stats: Stats
    ledger: Ledger
    health: HealthSummary
    flops: FlopReport
    peak: dict[str, Any]
    advice: list[Advice]
    layout: dict[str, Any] = dataclasses.field(default_factory=dict)  # the job in its layout (steps.baseline.layout)
    fit: dict[str, Any] = dataclasses.field(default_factory=dict)  # memory per rank against what is available
    loader_race: dict[str, Any] = dataclasses.field(default_factory=dict)  # steps.baseline.data_race, when data waits
    data_notes: list[str] = dataclasses.field(default_factory=list)  # what the job's data kind implies
    fp8: dict[str, Any] = dataclasses.field(default_factory=dict)  # the job's fp8_layers: converted or why not


Result = BaselineResult  # the step contract: every step module names its result class Result



def _peak_memory(timings: Timings) -> Metric:
    if timings.peak_memory_bytes is not None:
        return Metric(float(timings.peak_memory_bytes), "bytes", "measured", timings.peak_memory_note)
    rss_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    return Metric(float(rss_kib * 1024), "bytes", "measured",
                  "peak resident memory of the whole process since it started (CPU run)")


@guarded("baseline")
def run(job: Job, progress=None, write: bool = True) -> BaselineResult:
    """Measure the job's baseline; see the module docstring."""
    t_start = time.perf_counter()
    p = as_progress(progress)
    device = dev.resolve_device(job.device)
    torch_device = device.torch_device
    skipped = []
    if job.pin_memory and device.type == "cpu":
        skipped.append({"what": "pin_memory", "reason": "pinned memory only speeds host-to-GPU copies; CPU run"})
    nnodes, nproc = world_layout(job, device.type)
    world = nnodes * nproc
    in_layout = beyond_ddp(job)
    if in_layout:
        check_layout(job, world, device.type)
    fit = check_fit(job, device.type, world if in_layout else 1, node_world=world)  # before anything is allocated
    if in_layout:
        return _run_in_layout(job, device, world, fit, p, skipped, t_start, write)
    peak = dev.resolve_peak(device, job.dtype, job.peak_flops, job.matmul_precision)

    model = build_model(job).to(torch_device).train()
    train_step = build_train_step(job, model, device.type)
    fp8 = train_step.fp8.record()
    if train_step.fp8.why_not:
        skipped.append({"what": "fp8_layers", "reason": train_step.fp8.why_not})
    loader = build_loader(job, job.warmup_steps + job.steps, device.type)
    # one batch for counting FLOPs, from an in-process loader so no worker starts for it
    b0 = next(iter(build_loader(dataclasses.replace(job, num_workers=0, synthetic_load_ms=0.0), 1, device.type)))
    x0, y0 = b0
    is_tokens = getattr(b0, "tokens", True)  # token ids (core.engine.batches), or images, rows...: samples only
    report = count_step_flops(model, train_step, to_device(x0, torch_device), to_device(y0, torch_device),
                              cache_dir=job.output_root(), key_extra=fl.job_key_extra(job))

    with HealthSampler(device.type, device.name, device.index) as sampler:
        timings, clock = _timed_steps(job, train_step, loader, torch_device, p, t_start)
    health = sampler.summary()
    if not health.sampled:
        skipped.append({"what": "device health (NVML)", "reason": health.skipped_reason})

    wall = timings.measured("wall_s")
    total_wall = sum(wall)
    st = stats(wall)
    n = len(wall)
    achieved = report.model_flops_per_step * n / total_wall
    if peak.source == "measured":
        peak = _recheck_after(job, device, peak, timings, achieved)
    window = f"over the total wall time of the measured steps ({n}; {job.warmup_steps} warm-up discarded)"
    counted_tokens = timings.measured_tokens()
    if counted_tokens:  # MFU over useful tokens: padding does no model work, however many FLOPs it costs
        useful, padded = counted_tokens
        # the FLOPs of an optimizer step (grad_accum micro-batches of the FLOP-count batch's shape) over its positions
        positions = x0.numel() * job.grad_accum
        per_token = report.model_flops_per_step / positions
        hw_per_token = report.hardware_flops_per_step / positions
        tokens_per_s, padding = useful / total_wall, 1 - useful / padded
        mfu_value = fl.mfu(per_token, tokens_per_s, peak.flops_per_s)
        hfu_value = fl.mfu(hw_per_token, tokens_per_s, peak.flops_per_s)
        tok_note = (f"non-padding target tokens (counted on the host per step: {useful:,} of {padded:,} "
                    f"positions) / wall time, {window}")
        mfu_how = (f"{report.model_flops_source} model FLOPs per token x non-padding tokens / ({peak.source} peak x "
                   f"measured wall time), {window}: padding ({padding:.1%} of positions) is not model work")
    else:  # batches without token targets, or not token ids at all: the step's FLOPs, never scaled by positions
        tokens_per_s, padding = (job.tokens_per_step * n / total_wall if is_tokens else None), None
        mfu_value = fl.mfu(report.model_flops_per_step, n / total_wall, peak.flops_per_s)
        hfu_value = fl.mfu(report.hardware_flops_per_step, n / total_wall, peak.flops_per_s)
        tok_note = ("tokens per step x steps / wall time, " + window if is_tokens else
                    "the batches are not token ids (" + describe(b0[0]) + "): no tokens; see samples_per_s")
        mfu_how = (f"{report.model_flops_source} model FLOPs per step x steps / ({peak.source} peak x measured wall "
                   f"time), {window}" + ("" if is_tokens else ": the batch's FLOPs as counted, not scaled by "
                                         "targets or positions (the batches are not token ids)"))
    samples = timings.measured_samples()
    samples_per_s = samples / total_wall if samples else None
    ledger = single_process_ledger(timings, mfu_value, health, hardware_flops(report))  # recompute = HFU - MFU
    data_f, compute_f = ledger_part(timings, "data_s"), ledger_part(timings, "compute_s")
    metrics = {
        "mfu": Metric(mfu_value, "fraction", "measured", mfu_how),
        "padding_share": Metric(padding, "fraction", "counted", "positions of the measured batches that are padding "
                                "(targets ignored by the loss)" if padding is not None else
                                "the batches carry no token targets: padding not counted"),
        "contention_other_cores": Metric(timings.contention.other_cores if timings.contention else None, "cores",
                                         "measured", "cores other processes kept busy while the steps ran ("
                                         + (timings.contention.text() if timings.contention else "not measured")
                                         + ")"),
        "hfu": Metric(hfu_value, "fraction", "measured", "as MFU, counting recomputed work too (checkpointed "
                      "activations, the scores a flash-style attention kernel recomputes in backward)"),
        "step_time_median_s": Metric(st.median, "s", "measured", timings.method),
        "step_time_p10_s": Metric(st.p10, "s", "measured"),
        "step_time_p90_s": Metric(st.p90, "s", "measured"),
        "step_time_cv": Metric(st.cv, "fraction", "measured", "standard deviation / mean of step times"),
        "tokens_per_s": Metric(tokens_per_s, "tokens/s", "measured", tok_note),
        "samples_per_s": Metric(samples_per_s, "samples/s", "measured",
                                f"samples (each batch's first dimension, counted on the host: {samples or 0:,}) / "
                                f"wall time, {window}"),
        "model_flops_per_step": Metric(report.model_flops_per_step, "FLOP", report.model_flops_source, report.formula),
        "hardware_flops_per_step": Metric(report.hardware_flops_per_step, "FLOP", report.model_flops_source,
                                          "model FLOPs + recomputed forward (activation checkpointing) + the score "
                                          "matmul a flash-style attention kernel recomputes in backward ("
                                          + (f"{report.flash_recompute_flops_per_step:.3g} FLOP here"
                                             if report.flash_recompute_flops_per_step else "none ran here") + ")"),
        "counted_flops_per_step": Metric(float(report.counted_flops_per_step), "FLOP", "counted",
                                         "torch.utils.flop_counter.FlopCounterMode, one forward+backward"),
        "flops_disagreement": Metric(report.disagreement, "fraction", "analytic",
                                     "|counted - analytic| / analytic; shown when above "
                                     f"{FLOP_TOLERANCE:.0%}" if report.disagreement is not None
                                     else "no formula applies to a user model"),
        "peak_flops_per_s": Metric(peak.flops_per_s, "FLOP/s", peak.source, peak.note),
        "achieved_flops_per_s": Metric(mfu_value * peak.flops_per_s, "FLOP/s", "measured",
                                       "model FLOPs per second over the measured steps"),
        "data_wait_fraction": Metric(data_f, "fraction", "measured",
                                     "time waiting for the batch (loader + copy) / wall time"),
        "host_fraction": Metric(max(0.0, 1 - data_f - compute_f), "fraction", "measured",
                                "loop bookkeeping outside data and compute / wall time"),
        "compute_fraction": Metric(compute_f, "fraction", "measured", "forward + backward + optimiser / wall time"),
        "peak_memory_bytes": _peak_memory(timings),
        "final_loss": Metric(timings.loss[-1], "nats", "measured", "training loss of the last step"),
    }
    race = race_loader(job, train_step, torch_device, device.type, data_f, DATA_WAIT_LIMIT,
                       p.say)
    result = BaselineResult(
        "baseline", job.to_dict(), environment(device.name, device.type), metrics, timings, st, ledger, health,
        report, dataclasses.asdict(peak) | {"device": device.name, "device_type": device.type}, [], fit=fit,
        skipped=skipped + clock.shortened, loader_race=race, data_notes=list(getattr(loader, "notes", ())), fp8=fp8)
    result.budget = clock.record()
    return _finish(job, result, t_start, write)




def _timed_steps(job: Job, train_step, loader, device, p, t_start: float) -> tuple[Timings, budget.Clock]:
    """The warm-up and timed steps. Without a budget: the job's counts, in one timed run. With one
    (core.process.budget): the warm-up first (fewer steps, at least one, when the estimate says the share needs it),
    then as many of the
    job's timed steps as the rest of step 1's share holds at the last warm-up step's time (at least
    ``STEP1_MIN_STEPS``), each cut said and recorded; the two runs' series are joined, warm-up first."""
    earlier = store.earlier(job, INFO.key).data or None
    clock = budget.Clock(budget.step1_share_s(job, earlier), started=t_start)
    if clock.planned_s is None:
        return run_steps(train_step, loader, device, job.warmup_steps, job.steps, p.items("baseline steps")), clock
    _, first, step_s, _ = budget.step1_estimate(job, earlier)
    fewest = min(budget.STEP1_MIN_STEPS, job.steps)
    warm = job.warmup_steps
    while warm > 1 and first + (warm - 1 + fewest) * step_s > clock.left_s() - budget.STEP1_RESERVE_S:
        warm -= 1
    if warm < job.warmup_steps:
        clock.shorten("warm-up steps", f"{warm} of the job's {job.warmup_steps}, so that {fewest} timed steps fit "
                      f"step 1's {clock.planned_s:.1f} s share")
    it = iter(loader)  # one iterator over both runs: the batches go on where the warm-up stopped
    w = run_steps(train_step, it, device, 0, warm, p.items("baseline warm-up")) if warm else None
    if w is not None:
        step_s = w.wall_s[-1]  # the last warm-up step: the nearest to a timed one (pessimistic after one)
    fit = int(max(0.0, clock.left_s() - budget.STEP1_RESERVE_S) // max(step_s, 1e-9))
    n = max(fewest, min(job.steps, fit))
    if n < job.steps:
        over = "" if fit >= fewest else (f"; even {fewest}, the fewest step 1 times, run about "
                                         f"{(fewest - fit) * step_s:.1f} s past the share")
        clock.shorten("timed steps", f"{n} of the job's {job.steps}: {clock.left_s():.1f} s of step 1's "
                      f"{clock.planned_s:.1f} s share left at about {step_s:.2g} s per step{over}")
        p.say(f"budget: timing {n} of the job's {job.steps} steps ({clock.left_s():.1f} s of step 1's "
              f"{clock.planned_s:.1f} s share left, about {step_s:.2g} s per step){over}")
    t = run_steps(train_step, it, device, 0, n, p.items("baseline steps"))
    if w is None:
        return t, clock
    mem = [m for m in (w.peak_memory_bytes, t.peak_memory_bytes) if m is not None]
    joined = dataclasses.replace(
        t, wall_s=w.wall_s + t.wall_s, data_s=w.data_s + t.data_s, compute_s=w.compute_s + t.compute_s,
        loss=w.loss + t.loss, warmup_steps=len(w.wall_s), peak_memory_bytes=max(mem) if mem else None,
        tokens=(w.tokens or []) + (t.tokens or []) or None,
        padded_tokens=(w.padded_tokens or []) + (t.padded_tokens or []) or None,
        samples=(w.samples or []) + (t.samples or []) or None,
        method=t.method + "; under a budget the warm-up ran first, timed apart, to size the timed steps")
    return joined, clock


def _finish(job: Job, result: BaselineResult, t_start: float, write: bool) -> BaselineResult:
    """The advice from the figures, the step's time, and result.json (and the index) when ``write``."""
    result.advice = advise(result)
    result.elapsed_s = time.perf_counter() - t_start
    if write:
        save(job, result)
    return result


def _recheck_after(job: Job, device: dev.DeviceInfo, peak: dev.Peak, timings: Timings,
                   achieved: float) -> dev.Peak:
    """The cached peak against the re-check before the steps and one after them (core.measure.peak_cache). Probes below
    the cache beyond their noise are a neighbour on the machine: contention, recorded, not a new peak. Probes above
    it, or a training step that outran it, mean the cached reading was a busy machine's: measured again, the
    better reading kept and cached, and said."""
    before = (peak.cache or {}).get("recheck")
    after = peak_cache.recheck_now(device.type, device.name, job.dtype)
    first = peak.flops_per_s
    if achieved > first or (after is not None and after.verdict == "above"):
        why = (f"the training step ({achieved / 1e9:.1f} GFLOP/s) outran the peak ({first / 1e9:.1f} GFLOP/s)"
               if achieved > first else f"the re-check after the steps read above the cache: {after.text()}")
        again = dev.remeasure_peak(device, job.dtype, floor=max(first, achieved))
        return dataclasses.replace(again, note=peak.note + (
            f"; measured again after the steps because {why}: {again.flops_per_s / 1e9:.1f} GFLOP/s (the better of "
            "the readings), cached from now on"))
    below = [(when, statistics.median(chk["rates"]) / chk["cached"])
             for when, chk in (("before", before), ("after", dataclasses.asdict(after) if after else None))
             if chk and chk["verdict"] == "below"]
    if timings.contention is not None and below:  # one phrase for both re-checks: the first screen reads it
        timings.contention.shared = True
        timings.contention.rechecks.append(
            f"the matmul rate re-checked {' and '.join(w for w, _ in below)} the steps was "
            f"{' and '.join(f'{r:.0%}' for _, r in below)} of the cached peak, "
            f"{'each time ' if len(below) > 1 else ''}its probes' p90 more than {PEAK_RECHECK_FLOOR:.0%} below it")
    if after is None:
        return peak
    return dataclasses.replace(peak, note=peak.note + f"; re-checked after the steps: {after.text()}")


def _run_in_layout(job: Job, device: dev.DeviceInfo, world: int, fit: dict, p, skipped: list, t_start: float,
                   write: bool) -> BaselineResult:
    """Step 1 for a job in its own layout (FSDP, TP, SP, PP): see :mod:`mfu_lab.steps.baseline.layout`."""
    layout = Layout.from_job(job, world)
    p.say(f"running the job in its layout {layout.name} on {world} ranks (torchrun); the loss is checked "
          "against one process first")
    m = baseline_layout.measure(job, device, world, p)
    health = HealthSummary(False, "not sampled during the layout's torchrun launch")
    skipped.append({"what": "device health (NVML)", "reason": health.skipped_reason})
    if m.fp8.get("why_not"):  # the ranks converted before the wrapper or the split (core.engine.parallelize)
        skipped.append({"what": "fp8_layers", "reason": m.fp8["why_not"]})
    result = BaselineResult(
        "baseline", job.to_dict(), environment(device.name, device.type), m.metrics, m.timings,
        stats(m.timings.measured("wall_s")), m.ledger, health, m.flops, m.peak, [], layout=m.layout, fit=fit,
        skipped=skipped, fp8=m.fp8)
    return _finish(job, result, t_start, write)


def _data_advice(job: dict, data: float, race: dict) -> Advice:
    evidence = f"data wait is {data:.1%} of wall time (limit {DATA_WAIT_LIMIT:.0%})"
    if race.get("adopted"):
        sp = race["speedup"]
        return Advice("act", f"The device waits on data: load with {race['pick']} (step 1's loader race: "
                      f"{sp['value']:.2f}x [{sp['low']:.2f}, {sp['high']:.2f}] over the job's own loader, measured); "
                      "tuned.yaml takes it and step 7 verifies it.", evidence + "; " + race["method"])
    if race.get("ran") is False:
        return Advice("act", f"The device waits on data: {race['note']}.", evidence)
    if job["num_workers"] == 0:
        fix = "load batches in background processes: set num_workers to 2 or more (one per free core)"
    else:
        fix = (f"raise num_workers (now {job['num_workers']}) or prefetch_factor (now {job['prefetch_factor']}); "
               "store data as large sequential shards")
    if race.get("ran"):
        sp = race["speedup"]
        fix += (f" (step 1's loader race found no loader proven faster: best {race['pick']}, {sp['value']:.2f}x "
                f"[{sp['low']:.2f}, {sp['high']:.2f}]; the loading itself is the cost)")
    return Advice("act", f"The device waits on data: {fix}.", evidence)


def advise(r: BaselineResult) -> list[Advice]:
    """Step 1's advice from its figures: data waits, host time, spread, compute efficiency loss, FLOP agreement,
    heat."""
    job, m = r.job, r.metrics
    out: list[Advice] = []
    data, host, cv = m["data_wait_fraction"].value or 0.0, m["host_fraction"].value or 0.0, m["step_time_cv"].value
    c = r.timings.contention
    shared = bool(c and c.shared)
    if (r.fp8 or {}).get("text"):  # what the job's fp8_layers did here: the figures below are with it, or without
        out.append(Advice("look" if r.fp8.get("why_not") else "info", f"FP8: {r.fp8['text']}.",
                          "fp8_layers in the job file (step 5 writes it)"))
    if shared:
        out.append(Advice("look", "The machine was shared while step 1 measured: its step times are a shared "
                          "machine's. Advice a slower step would explain (the MFU levers, unsteady steps) is "
                          "withheld; rerun on an idle machine before acting on these figures.", c.text()))
    mfu_v, hw = m["mfu"].value, r.ledger.get("efficiency").fraction
    on_gpu = r.peak["device_type"] == "cuda"

    if data > DATA_WAIT_LIMIT:
        out.append(_data_advice(job, data, r.loader_race or {}))
    for note in r.data_notes or []:
        out.append(Advice("look", f"Data: {note}.", f"data: {job['data']}"))
    if host > HOST_LIMIT:
        out.append(Advice("look", "Host-side overhead is visible between steps: larger micro-batches, "
                          "torch.compile (step 4) or CUDA graphs reduce per-step host work.",
                          f"host time is {host:.1%} of wall time"))
    if cv > CV_LIMIT and not shared:
        out.append(Advice("look", "Step times are unsteady: look for neighbours on the machine, throttling or "
                          "garbage collection, and measure more steps before trusting small differences.",
                          f"coefficient of variation of step time is {cv:.1%} (limit {CV_LIMIT:.0%})"))
    if hw < 0:
        out.append(Advice("act", "HFU (MFU and the recomputed work) exceeds the share of time spent computing, so "
                          "the peak is too low: set peak_flops in the job to the device's true dense peak.",
                          f"HFU {m['hfu'].value:.1%} (MFU {mfu_v:.1%}) > compute share "
                          + (f"{m['compute_fraction'].value:.1%}" if m["compute_fraction"].value is not None
                             else "(1 - structure - software loss)")))
    elif hw > 0.5 and not shared:
        levers = []
        if on_gpu and job["dtype"] == "float32":
            levers.append("train in bfloat16 (dtype: bfloat16) so matmuls use tensor cores")
        if job["attention"] == "unfused":
            levers.append("use fused attention (attention: sdpa; step 2 measures it)")
        ga = job.get("grad_accum", 1)
        levers.append(f"larger micro-batches for larger matmuls (micro_batch {job['micro_batch']}): "
                      + (f"step 3 races them against grad_accum {ga}, samples per optimizer step held" if ga > 1 else
                         "with grad_accum 1 that adds samples to each optimizer step, a change of the optimization "
                         "the workbook never adopts; split the step with grad_accum to let step 3 trade"))
        levers.append("fuse memory-bound ops (step 3 finds them, step 4 compiles them)")
        out.append(Advice("act", "Most of the peak is lost while the device is busy: " + "; ".join(levers) + ".",
                          f"compute efficiency loss is {hw:.1%} of peak at MFU {mfu_v:.1%}"))
    dis = r.flops.disagreement
    if dis is not None and dis > FLOP_TOLERANCE:
        out.append(Advice("look", "Counted and analytic FLOPs disagree: MFU rests on the analytic figure; "
                          "check which operators the count includes (flops.counted_by_op).",
                          f"|counted - analytic| / analytic = {dis:.1%} (tolerance {FLOP_TOLERANCE:.0%})"))
    h = r.health
    if h.sampled:
        if h.temperature_c_max is not None and h.temperature_c_max > HOT_C:
            out.append(Advice("act", "The GPU ran hot: check cooling and airflow; sustained heat lowers clocks.",
                              f"maximum temperature {h.temperature_c_max:.0f} C (limit {HOT_C:.0f} C)"))
        ratio = h.clock_ratio
        if ratio is not None and ratio < CLOCK_LOW and (h.throttled_fraction or 0) > 0:
            out.append(Advice("act", "Clocks were held down by power or heat (" + ", ".join(h.reasons_seen) + "): "
                              "this is operations loss no code change recovers.",
                              f"mean SM clock while busy {ratio:.0%} of {h.reference_clock[1]}"))
    if job["activation_checkpointing"]:
        out.append(Advice("info", "Activation checkpointing recomputes each block's forward: HFU exceeds MFU by "
                          "that work. Keep it only if the memory it frees buys a larger micro-batch.",
                          f"HFU {m['hfu'].value:.1%} vs MFU {mfu_v:.1%}"))
    if not on_gpu:
        out.append(Advice("info", "On a CPU the peak is this CPU's measured matmul rate, so MFU here says how "
                          "close the training step comes to the CPU's best matmul, not to a GPU's.",
                          f"peak {m['peak_flops_per_s'].value / 1e9:.1f} GFLOP/s, measured"))
    return out


def ledger_part(timings: Timings, name: str) -> float:
    return sum(timings.measured(name)) / sum(timings.measured("wall_s"))


def save(job: Job, result: BaselineResult) -> Path:
    """Write result.json atomically and refresh the job\'s index page."""
    return store.save(job, INFO.key, result)
