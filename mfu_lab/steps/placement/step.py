"""Step 6, placement: how should this job be placed on a shared cluster, at what size does it stop
paying, and what should the scheduler be told?

No cluster is at hand, so the cluster figures are ``modelled`` (mfu_lab.analysis.placement.model) and every one says
what it was calibrated from: the job's FLOPs (counted here), its single-GPU efficiency (measured in
steps 1, 2 and 4 when they ran on the cluster's GPU, else the job's ``assumed_mfu``), its overlap of
gradient all-reduce (step 2), link bandwidths (the cluster file, or step 2's all-reduce benchmark on
the cluster's GPU), and, only when this node's layouts were timed over NCCL on GPUs, the pipeline bubble's overhead
and the intra-node TP link from them (mfu_lab.analysis.layouts.calibration; over gloo shown, not used). Two things
are measured here: the job alone against two copies of it at once on
this device (co-location), and the model's prediction of step 2's two-process data-parallel step
against what step 2 measured. Writes ``<out>/<job>/06_placement/result.json``.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mfu_lab.analysis.layouts.calibration import layout_calibration
from mfu_lab.analysis.layouts.node_layouts import calibration_rows
from mfu_lab.analysis.placement import collectives
from mfu_lab.analysis.placement import model as pl
from mfu_lab.analysis.placement.calibration import CALIBRATED_FROM, calibrate
from mfu_lab.analysis.placement.check import Check, Coloc, model_check
from mfu_lab.analysis.placement.cluster_files import load_cluster
from mfu_lab.analysis.placement.scheduler_hints import hints
from mfu_lab.analysis.placement.scheduler_sim import gang_rows
from mfu_lab.analysis.placement.strategies import (
    best_layout,
    placed_row,
    shared_rows,
    size_sweep,
    strategy_rows,
)
from mfu_lab.core.advice import Advice
from mfu_lab.core.engine.batches import to_device
from mfu_lab.core.engine.meta_shape import shaped
from mfu_lab.core.engine.work import token_job
from mfu_lab.core.engine.workload import build_loader, build_model, build_train_step
from mfu_lab.core.job.schema import Job
from mfu_lab.core.measure import device as dev
from mfu_lab.core.measure.environment import environment
from mfu_lab.core.measure.flops import count_step_flops, job_key_extra
from mfu_lab.core.process.budget import Clock, fit_count, job_step_s
from mfu_lab.core.process.faults import guarded
from mfu_lab.core.process.progress import as_progress
from mfu_lab.core.registry import BY_KEY
from mfu_lab.core.store import step_results as store
from mfu_lab.core.store.results import Metric, StepResult
from mfu_lab.steps.placement.coloc import colocate
from mfu_lab.steps.placement.layouts import measure_layouts

INFO = BY_KEY["placement"]


@dataclass
class PlacementResult(StepResult):
    step: str
    job: dict[str, Any]
    environment: dict[str, Any]
    metrics: dict[str, Metric]
    cluster: dict[str, Any]
    shape: dict[str, Any]
    calibration: list[dict]  # input, value, unit, source, from
    coloc: Coloc
    check: Check
    sweep: list[dict]
    efficient_size: int | None
    chosen: dict | None
    strategies: list[dict]
    shared: list[dict]
    gang: list[dict]
    hints: dict[str, str]
    advice: list[Advice]
    # issue 29: every layout of this node measured, each term beside the model's (analysis.layouts.node_layouts)
    layouts: list[dict] = dataclasses.field(default_factory=list)
    layouts_run: dict = dataclasses.field(default_factory=dict)  # world, backend, steps, seconds (or skipped)
    # the node's time terms the cluster predictions took (NCCL on GPUs) and not (analysis.layouts.calibration)
    calibrated_here: str = ""
    # issue 47: the unit of the throughput shown (the model counts tokens: samples x seq_len) and tokens per unit
    unit: str = "tokens"
    per_unit: int = 1


Result = PlacementResult  # the step contract: every step module names its result class Result


# ------------------------------------------------------------------ inputs
def earlier_results(job: Job) -> dict[str, dict]:
    """The result.json dicts of the earlier steps that calibrate the model, by key; a step that has not run
    is absent."""
    found = {key: store.earlier(job, key) for key in CALIBRATED_FROM}
    return {key: e.data for key, e in found.items() if e}


def job_shape(job: Job, device: dev.DeviceInfo) -> tuple[pl.Shape, str]:
    """The job's shape for the model; FLOPs per sample counted here (one forward and backward)."""
    model = build_model(job).to(device.torch_device).train()
    x, y = next(iter(build_loader(dataclasses.replace(job, num_workers=0, synthetic_load_ms=0.0), 1, device.type)))
    fl = count_step_flops(model, build_train_step(job, model, device.type), to_device(x, device.torch_device),
                          to_device(y, device.torch_device), cache_dir=job.output_root(), key_extra=job_key_extra(job))
    params = float(sum(p.numel() for p in model.parameters()))
    dims = shaped(job)  # a factory model's layers, heads and width read from the model (core.engine.meta_shape)
    shape = pl.Shape(dims.n_layers, dims.n_heads, dims.d_model, job.seq_len, job.micro_batch, params,
                     fl.model_flops_per_step / (job.micro_batch * job.grad_accum),  # an optimizer step's samples
                     4 if job.dtype == "float32" else 2, 4,
                     job.attention == "unfused", job.activation_checkpointing, dropout=False, residual_bytes=4,
                     grad_as_bucket_view=job.ddp_grad_as_bucket_view, sequence_parallel=job.sp and job.tp > 1,
                     checkpoint_early_stop=True, fsdp_reshard=job.fsdp_reshard_after_forward,
                     checkpoint_policy=job.checkpoint_policy)
    return shape, (f"{fl.model_flops_source} model FLOPs of one optimizer step (grad_accum {job.grad_accum} "
                   f"micro-batches) / its samples; {params:.4g} parameters")


def model_choices(shape: pl.Shape, job: Job) -> list[dict]:
    """The simplifications the model keeps, each a row of the calibration table with what it assumes."""
    ref = "the reference model" if job.uses_reference_model else "assumed for a user model"
    return [
        {"input": "dropout", "value": "none" if not shape.dropout else "on", "unit": "", "source": "analytic",
         "from": f"{ref}: activation memory without dropout masks (s*b*h*(8 + 24/t), 2*a*s^2*b/t unfused)"},
        {"input": "sequence parallelism", "value": "on" if shape.sequence_parallel else "off", "unit": "",
         "source": "analytic", "from": "SP: activations (8 + 24)/t per layer plus the gathered attention input, "
                                       "p2p 1/t of b*s*h" if shape.sequence_parallel else
         "plain tensor parallelism: each stage sends the whole b*s*h from every rank to the next"},
        {"input": "checkpointed layer input", "value": shape.residual_bytes, "unit": "bytes/element",
         "source": "analytic", "from": "the residual stream stays in the parameters' dtype (float32)"},
        {"input": "TP all-reduces per layer", "value": collectives.tp_collectives_per_layer(
            False, shape.checkpointing, shape.checkpoint_early_stop)["allreduce"], "unit": "", "source": "counted",
         "from": "2 forward + 2 backward (Megatron-LM); with activation checkpointing the job's checkpoint "
                 "(torch.utils.checkpoint's default, non-reentrant) re-runs 1 (5 a layer; early_stop=False: 6)"},
        {"input": "pipeline sends per rank", "value": "2*m*(p*v-1)/p", "unit": "", "source": "counted",
         "from": "p*v - 1 stage boundaries, m micro-batches each way (was 2*v*m before issue 29)"},
        {"input": "DDP gradient copy", "value": 0 if shape.grad_as_bucket_view else shape.grad_bytes,
         "unit": "bytes/param", "source": "analytic", "from": "ddp_grad_as_bucket_view: "
                                                              f"{job.ddp_grad_as_bucket_view}"},
        {"input": "pipeline bubble", "value": "critical path", "unit": "", "source": "analytic",
         "from": "(p-1)/(v*m) of compute + TP + p2p per micro-batch (Narayanan et al. 2021)"},
    ]


# ------------------------------------------------------------------ the step
@guarded("placement")
def run(job: Job, progress=None, write: bool = True) -> PlacementResult:
    t_start = time.perf_counter()
    p = as_progress(progress)
    cluster = load_cluster(job.cluster_path())  # a bad cluster file stops here, before any work
    device = dev.resolve_device(job.device)
    skipped: list[dict[str, str]] = []
    earlier = earlier_results(job)

    p.say("counting the job's FLOPs")
    shape, shape_from = job_shape(job, device)
    cluster, cal, cal_rows = calibrate(job, cluster, earlier)
    cal_rows += model_choices(shape, job)

    clock = Clock.for_step(job, INFO.key)
    step_s = job_step_s(earlier.get("baseline"))
    coloc = colocate(coloc_job(job, clock, step_s), job.step_dir(INFO.folder) / "coloc", device.type, p.say)
    if coloc.status != "ok":
        skipped.append({"what": "co-location experiment", "reason": coloc.reason})
    layouts, layouts_run = [], {"skipped": "placement_layouts: false in the job"}
    try:
        if job.placement_layouts:
            layouts, layouts_run = measure_layouts(job, device.type, job.step_dir(INFO.folder) / "layouts", shape,
                                                   coloc.pair_median_s if coloc.status == "ok" else None, p,
                                                   clock.left_s(), step_s)
    except Exception as e:  # noqa: BLE001 - the layouts inform the model; their failure never ends the step
        layouts_run = {"skipped": f"{type(e).__name__}: {e}"}
    if layouts_run.get("skipped"):
        skipped.append({"what": "the node's layouts", "reason": layouts_run["skipped"]})
    if layouts_run.get("budget"):
        clock.shorten("the node's layouts", layouts_run["budget"])
    skipped += [{"what": f"layout {e['layout']}", "reason": f"{e['status']}: {e['reason']}"}
                for e in layouts if e["status"] != "ok"]
    cal_rows += calibration_rows(layouts)
    node_cal = layout_calibration(layouts, layouts_run, device.type)
    cal = node_cal.apply(cal)  # unchanged unless timed over NCCL on GPUs
    cal_rows += node_cal.rows()
    check = model_check(shape, earlier, coloc, device)
    if not check.available:
        skipped.append({"what": "model check against step 2", "reason": check.reason})

    p.say("size sweep")
    sweep, size = size_sweep(cluster, shape, cal, job.global_batch, job.min_marginal_efficiency,
                             job.cluster_tp, job.cluster_pp, job.cluster_interleave)

    gpus = job.gpus or size
    chosen = (best_layout(cluster, shape, gpus, job.global_batch, cal, job.cluster_tp, job.cluster_pp,
                          job.cluster_interleave) if gpus else None)
    strategies, shared, hint = [], [], {}
    if chosen is None:
        skipped.append({"what": "placement comparison", "reason": f"no layout of {gpus} GPUs fits the job "
                        f"(global_batch {job.global_batch}, micro_batch {job.micro_batch}, cluster_tp "
                        f"{job.cluster_tp}, cluster_pp {job.cluster_pp})"})
    else:
        p.say(f"placing {gpus} GPUs ({chosen.layout.label()}) four ways")
        strategies = strategy_rows(cluster, shape, chosen.layout, cal, job.seed)
        shared, why = shared_rows(cluster, shape, cal, job.placement_jobs, gpus, job.global_batch,
                                  job.cluster_tp, job.cluster_pp, job.cluster_interleave)
        if why:
            skipped.append({"what": "several jobs sharing the cluster", "reason": why})
        hint = hints(job, cluster, chosen, (earlier.get("baseline") or {}).get("health"))

    p.say("gang-scheduling simulation")
    gang = gang_rows(cluster, job.seed)

    chosen_row = placed_row(cluster, chosen) if chosen else None
    result = PlacementResult(
        "placement", job.to_dict(), environment(device.name, device.type), {}, cluster.to_dict(),
        dataclasses.asdict(shape) | {"from": shape_from}, cal_rows, coloc, check, sweep, size, chosen_row,
        strategies, shared, gang, hint, [], layouts, layouts_run, node_cal.statement(),
        skipped=skipped + clock.shortened)
    if not token_job(job):  # the model counts global_batch x seq_len per step: samples are that over seq_len
        result.unit, result.per_unit = "samples", shape.seq_len
    result.budget = clock.record()
    result.metrics = _metrics(result, cal)
    result.advice = advise(result)
    result.elapsed_s = time.perf_counter() - t_start
    if write:
        save(job, result)
    return result


COLOC_START_S = 6.0  # one co-location launch's process start and model build (2-core AMD EPYC, 2026-12-03: 5-7 s)


def coloc_job(job: Job, clock: Clock, step_s: tuple[float, str]) -> Job:
    """The job as the co-location experiment runs it: under a budget, one warm-up and the ``coloc_steps`` that fit
    a third of step 6's share (the layouts get the rest), at least 3 (a median). Each co-location step is timed
    alone and then in the pair, each copy on one thread: about 2 x 2 x the job's step (``step_s``), after two
    launches' :data:`COLOC_START_S`."""
    left = clock.left_s()
    if left is None:
        return job
    each = 4 * step_s[0]
    n = fit_count(left / 3, job.coloc_steps, each, fixed_s=2 * COLOC_START_S + each, least=3)
    if n < job.coloc_steps:
        clock.shorten("co-location steps", f"{n} of coloc_steps {job.coloc_steps}, after 1 warm-up ({left / 3:.0f} s, "
                      f"a third of step 6's {left:.0f} s left; about {each:.1f} s a step: 2 x 2 x {step_s[1]})")
    return dataclasses.replace(job, coloc_steps=n, warmup_steps=min(job.warmup_steps, 1))


def _metrics(r: PlacementResult, cal: pl.Calibration) -> dict[str, Metric]:
    cal_note = "modelled: " + "; ".join(f"{k} {v}" for k, v in cal.sources.items())
    if r.calibrated_here:
        cal_note += f"; node layouts' times: {r.calibrated_here}"
    c = r.chosen or {}
    ok = [s for s in r.strategies if s.get("status") == "ok"]
    worst = max(ok, key=lambda s: s["step_s"]) if ok else None
    used = r.check.used()
    m = {
        "predicted_mfu": Metric(c.get("mfu"), "fraction", "modelled",
                                f"chosen layout {c.get('label', '-')}; {cal_note}"),
        "predicted_step_s": Metric(c.get("step_s"), "s", "modelled", "one optimizer step of global_batch samples"),
        "predicted_tokens_per_s": Metric(c.get("tokens_per_s") if r.unit == "tokens" else None, "tokens/s",
                                         "modelled", "global_batch x seq_len / predicted step time" if r.unit ==
                                         "tokens" else "the batches are not token ids: see predicted_samples_per_s"),
        "predicted_samples_per_s": Metric(c["tokens_per_s"] / r.per_unit if c.get("tokens_per_s") else None,
                                          "samples/s", "modelled", "global_batch / predicted step time"),
        "placement_gpus": Metric(float(c["layout"]["tp"] * c["layout"]["pp"] * c["layout"]["dp"]) if c else None,
                                 "GPUs", "modelled", "the job's gpus key, or the efficient size"),
        "efficient_size": Metric(float(r.efficient_size) if r.efficient_size else None, "GPUs", "modelled",
                                 f"largest size whose marginal efficiency stays >= "
                                 f"{r.job['min_marginal_efficiency']:.0%}"),
        "worst_placement_slowdown": Metric(worst.get("vs_aware") if worst else None, "x", "modelled",
                                           f"{worst['strategy'] if worst else '-'} step time / topology-aware"),
        "coloc_slowdown": Metric(r.coloc.slowdown, "x", "measured", "two copies at once on this device: median step "
                                 "/ the job alone, measured side by side"),
        "check_error": Metric(used["error"] if used else None, "fraction", "modelled",
                              "(predicted - measured) / measured of step 2's data-parallel step, for the row the "
                              f"cluster predictions use ({r.check.headline or 'none'}); the table shows the others"),
        "ddp_step_measured_s": Metric(r.check.measured_s, "s", "measured", "step 2, recommended configuration"),
        "layouts_measured": Metric(float(sum(e["status"] == "ok" for e in r.layouts)), "layouts", "counted",
                                   f"of {len(r.layouts)} this node's ranks can form, run in one launch"),
    }
    return m


def advise(r: PlacementResult) -> list[Advice]:
    """What to do about the placement, from the result alone."""
    out = []
    ok = {s["strategy"]: s for s in r.strategies if s.get("status") == "ok"}
    if "topology-aware" in ok:
        a = ok["topology-aware"]
        worse = [(n, s["vs_aware"]) for n, s in ok.items() if n != "topology-aware" and s["vs_aware"] > 1.02]
        if worse:
            out.append(Advice("act", f"Place topology-aware: each TP group inside one node, the job under "
                              f"{a['switches']} leaf switch(es). Other placements are predicted slower: "
                              + ", ".join(f"{n} {x:.2f}x" for n, x in worse) + ".",
                              f"modelled on {r.cluster['name']}; see the strategy table"))
        else:
            out.append(Advice("info", "The placement strategies are predicted within 2% of each other for this "
                              "layout: its communication is small against compute.", "modelled"))
    if r.efficient_size:
        sw = [s for s in r.sweep if s["status"] == "ok"]
        nxt = next((s for s in sw if s["gpus_n"] > r.efficient_size), None)
        tail = (f"; at {nxt['gpus_n']} GPUs the added GPUs bring {nxt['marginal_efficiency']:.0%} of the per-GPU "
                f"throughput (MFU {nxt['mfu']:.1%})" if nxt else "; the cluster's free GPUs end the sweep")
        out.append(Advice("act", f"Run at {r.efficient_size} GPUs: the largest size whose added GPUs still bring "
                          f"{r.job['min_marginal_efficiency']:.0%} of the per-GPU throughput{tail}.",
                          "modelled size sweep with the fastest layout per size"))
    sh = [s for s in r.shared if s.get("status") == "ok"]
    if sh:
        by = {}
        for s in sh:
            by.setdefault(s["partition"], []).append(s["step_s"])
        if len(by) == 2:
            racks, inter = statistics.fmean(by["whole racks"]), statistics.fmean(by["interleaved nodes"])
            if inter > racks * 1.01:
                out.append(Advice("act", f"Give each job whole racks: interleaving nodes between jobs is predicted "
                                  f"{inter / racks - 1:.1%} slower per step, as their traffic shares uplinks.",
                                  "modelled, jobs sharing links split their bandwidth"))
            else:
                out.append(Advice("info", "Whole racks and interleaved nodes are predicted alike here: the copies' "
                                  "cross-switch traffic stays under the uplinks' capacity.",
                                  f"mean step {racks * 1e3:.2f} vs {inter * 1e3:.2f} ms"))
    g = {x["policy"]: x for x in r.gang}
    if g.get("greedy", {}).get("deadlock_h") is not None:
        out.append(Advice("act", "Gang-schedule: with partial starts, jobs holding parts of the cluster waited on each "
                          f"other from hour {g['greedy']['deadlock_h']:g} on (a deadlock); all-or-nothing starts "
                          "finished the whole queue.", f"idle GPU-hours {g['greedy']['idle_gpu_hours']:.0f} vs "
                          f"{g['gang']['idle_gpu_hours']:.0f} over the same {g['gang']['horizon_h']:g} h"))
    elif g:
        out.append(Advice("info", "Gang against partial starts on this queue: see the table.",
                          f"idle GPU-hours {g['greedy']['idle_gpu_hours']:.0f} vs {g['gang']['idle_gpu_hours']:.0f}"))
    if r.coloc.status == "ok" and r.coloc.slowdown and r.coloc.slowdown > 1.2:
        out.append(Advice("look", f"Sharing this device with a copy of itself slowed the job {r.coloc.slowdown:.2f}x "
                          "(measured): do not pack two jobs onto one device.", "co-location experiment"))
    out += _layout_advice(r)
    used = r.check.used() if r.check.available else None
    if used:
        out.append(Advice("info", f"The model, with the inputs its cluster predictions use ('{used['name']}'), "
                          f"predicts step 2's data-parallel step within {used['error']:+.0%}; trust the cluster "
                          "figures as far as this check goes (the table shows the other compute sources).",
                          f"predicted {used['predicted_s'] * 1e3:.0f} ms vs measured "
                          f"{r.check.measured_s * 1e3:.0f} ms"))
    if any(row["source"] == "modelled" and row["input"].startswith("single-GPU") for row in r.calibration):
        out.append(Advice("look", "The single-GPU efficiency is an assumption (assumed_mfu): run steps 1 to 4 on the "
                          "cluster's GPU and rerun this step to calibrate it.", "no measurement on the cluster's GPU"))
    return out


def _layout_advice(r: PlacementResult) -> list[Advice]:
    """What this node's layouts said about the model: the counted terms it gets right, those it does not."""
    ok = [e for e in r.layouts if e["status"] == "ok"]
    if not ok:
        return []
    counted = [(e["layout"], t) for e in ok for t in e["terms"] if t["source"] == "counted" and t["ratio"]]
    off = [(lay, t) for lay, t in counted if abs(t["ratio"] - 1) > 0.01]
    exact = len(counted) - len(off)
    msg = (f"{len(ok)} of {len(r.layouts)} layouts of this node measured; {exact} of {len(counted)} counted terms "
           "(collective bytes, pipeline sends, shard bytes) match the placement model within 1%")
    if off:
        worst = sorted(off, key=lambda x: -abs(x[1]["ratio"] - 1))[:3]
        msg += "; it is off on " + ", ".join(f"{lay} {t['term']} ({t['ratio']:.3f}x)" for lay, t in worst)
    fastest = min(ok, key=lambda e: next((t["observed"] for t in e["terms"] if t["term"] == "step_time_s"),
                                         None) or float("inf"))
    timed = ok[0].get("timed_on", "")
    msg += (f". Fastest here: {fastest['layout']}" + (" (over gloo on a CPU: a GPU node's ranking may differ)"
                                                      if timed == "gloo" else "") + ".")
    return [Advice("info", msg, "counted and measured on this node; see the layouts table")]


def save(job: Job, result: PlacementResult) -> Path:
    """Write result.json atomically and refresh the job's index page."""
    return store.save(job, INFO.key, result)
