"""Step 3 for a job in its own layout (FSDP2, tensor and sequence parallel, pipeline schedules): every rank traced.

When the job is more than plain DDP (``dp_mode: fsdp``, ``tp`` > 1 or ``pp`` > 1), step 3 runs it under torchrun in
that layout, in a launch of its own (``<job>/03_kernels/layout``, through :func:`mfu_lab.steps.baseline.layout.launch`:
the loss is checked against one process first, then warm-up and timed steps, then one profiled step per rank), instead
of the one-process profile and step 2's data-parallel per-rank profile. From that run:

- the unprofiled figures (step time, MFU, tokens/s) are step 1's in a layout: the slowest rank per optimizer step,
  all ranks' model FLOPs against the peak they share (:func:`mfu_lab.steps.baseline.layout.headline_metrics`);
- every rank's trace is analysed: its breakdown, with each collective kind (allgather, reduce_scatter, allreduce,
  send, recv...) as a category of its own (share of the traced step in all, and not under compute), and its top
  operators (kernels on a GPU);
- rank 0's trace is the step's main analysis (top table, categories, fusion candidates at the measured bandwidth);
- the ledger is the layout ledger (:func:`mfu_lab.core.measure.ledger.layout_ledger`): structure = the exposed
  collectives by kind on the most exposed rank + the pipeline bubble, all shares of that rank's traced step.

On a CPU the ranks talk over gloo: its collectives' times do not transfer to GPUs; their counts and bytes do. Every
figure that holds a collective's time says so (:data:`GLOO_NOTE`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mfu_lab.analysis.trace import breakdown as tr
from mfu_lab.core.advice import Advice
from mfu_lab.core.engine.layout import Layout, beyond_ddp
from mfu_lab.core.engine.layout_check import check_layout
from mfu_lab.core.errors import StepError
from mfu_lab.core.job.schema import Job
from mfu_lab.core.measure import device as dev
from mfu_lab.core.measure.ledger import Ledger
from mfu_lab.core.measure.timed import Timings, stats
from mfu_lab.core.process.progress import as_progress
from mfu_lab.core.registry import BY_KEY
from mfu_lab.core.store.results import Metric
from mfu_lab.core.thresholds import COMM_LIMIT
from mfu_lab.steps.baseline import layout as bl
from mfu_lab.steps.baseline.reference import step1_on
from mfu_lab.steps.fit import check_fit

GLOO_NOTE = "gloo's collective times on a CPU do not transfer to GPUs; counts and bytes do"
PROFILED_ONE_STEP = ("the layout's rank worker traces one step per rank, after its warm-up and timed steps "
                     "(profile_steps and profile_warmup_steps apply to the one-process profile)")


def in_layout(job: Job) -> bool:
    """The job is more than plain DDP: step 3 traces every rank of its layout."""
    return beyond_ddp(job)


@dataclass
class LayoutRankProfile:
    """One rank's traced step: its breakdown (collectives by kind in ``breakdown.comm_by_kind``) and top rows."""

    rank: int
    coords: str  # its place in the mesh: "pp0 dp0 tp1"
    trace_file: str  # relative to the step's folder
    step_time_s: float  # traced window / steps
    median_s: float | None  # its unprofiled median step
    breakdown: tr.Breakdown
    matmul_attention_share: float
    memory_bound_share: float
    top: list[tr.TopRow] = field(default_factory=list)
    top_share: float = 0.0
    kind: str = "cpu"  # gpu: the rows are kernels; cpu: operators


@dataclass
class LayoutProfile:
    """What the layout path gives step 3's result."""

    analysis: tr.TraceAnalysis  # rank 0's trace, with fusion candidates at the measured bandwidth
    bandwidth: float
    bandwidth_note: str
    ledger: Ledger
    unprofiled: Timings  # the timed steps, slowest rank per step
    profiled: Timings  # the most exposed rank's traced step
    metrics: dict[str, Metric]  # the run's figures (unprofiled, ledger window, per kind)
    reference: dict[str, Any] | None  # step 1's figures when it ran in the same layout on this device
    layout: dict[str, Any]  # the run's summary, its name, the per-rank profiles, the CPU caveat
    fit: dict[str, Any]
    trace_file: str  # rank 0's, relative to the step's folder
    skipped: list[dict[str, str]]


def coords(rank: int, layout: dict[str, Any]) -> str:
    """A rank's place in the mesh ("pp", "dp", "tp"), row-major as init_device_mesh lays it out."""
    dp, tp = layout["dp"], layout["tp"]
    return f"pp{rank // (dp * tp)} dp{(rank // tp) % dp} tp{rank % tp}"


def rank_profiles(traces: list[dict[str, Any]], run, folder: Path) -> list[LayoutRankProfile]:
    out = []
    for t in traces:
        a: tr.TraceAnalysis = t["analysis"]
        times = run.step_times_s[t["rank"]] if t["rank"] < len(run.step_times_s) else []
        out.append(LayoutRankProfile(
            t["rank"], coords(t["rank"], run.layout), os.path.relpath(t["path"], folder), a.step_time_s,
            stats(times).median if times else None, a.breakdown,
            a.category_share["matmul"] + a.category_share["attention"],
            sum(a.category_share[c] for c in tr.MEMORY_BOUND), a.top, a.top_share, a.kind))
    return out


def _reference(job: Job, device: dev.DeviceInfo, name: str) -> dict[str, Any] | None:
    """Step 1's figures when it ran this job in the same layout on this device (else no fair comparison)."""
    e = step1_on(job, device.name)
    if e is None or (e.data.get("layout") or {}).get("layout", {}).get("name") != name:
        return None
    m = e.data["metrics"]
    return {"source": f"step 1 result ({e.path})", "mfu": m["mfu"]["value"],
            "median_s": m["step_time_median_s"]["value"], "p10_s": m["step_time_p10_s"]["value"],
            "p90_s": m["step_time_p90_s"]["value"], "peak": m["peak_flops_per_s"]["value"],
            "peak_source": m["peak_flops_per_s"]["source"], "peak_note": m["peak_flops_per_s"]["note"]}


def profile(job: Job, device: dev.DeviceInfo, world: int, progress=None) -> LayoutProfile:
    """Run the job in its layout with one trace per rank and turn it into step 3's figures."""
    say = as_progress(progress).say
    check_layout(job, world, device.type)
    fit = check_fit(job, device.type, world, node_world=world)  # before anything is allocated
    name = Layout.from_job(job, world).name
    cpu = device.type != "cuda"
    say(f"running the job in its layout {name} on {world} ranks (torchrun), one trace per rank; the loss is "
        "checked against one process first")
    folder = job.step_dir(BY_KEY["kernels"].folder)
    run = bl.launch(job, device.type, BY_KEY["kernels"].folder, progress=progress, profile=True)
    if not run.trace_paths:
        raise StepError(f"the layout {name} ran but wrote no trace: {run.reason or 'no rank profiled'}")
    report = bl.meta_flops(job, device.type)
    ref = _reference(job, device, name)
    if ref:
        peak_total, source, note = ref["peak"], ref["peak_source"], ref["peak_note"] + " (as in step 1)"
    else:
        peak_total, source, note = bl.peak_of_world(job, device, world)
    metrics, unprofiled, mfu_value = bl.headline_metrics(job, run, report, peak_total, source, note)
    say(f"reading {len(run.trace_paths)} traces, one per rank")
    traces = bl.analysed_traces(run, job.top_n)
    say("measuring memory bandwidth")
    bandwidth, bw_note = dev.measure_memory_bandwidth(device.torch_device)
    first = traces[0]
    main = tr.analyse(tr.load_trace(first["path"]), job.top_n, bandwidth)  # fusion savings at the bandwidth
    main.notes.append(f"the trace of rank {first['rank']} of {name} ({coords(first['rank'], run.layout)}); "
                      f"every rank's breakdown and top rows are in the per-rank table; {PROFILED_ONE_STEP}")
    worst = max(traces, key=lambda t: t["breakdown"].communicating)
    traced = worst["analysis"].step_time_s
    dp = run.layout["dp"]
    mfu_profiled = report.model_flops_per_step * dp / (peak_total * traced)
    led = bl.ledger_for(run, mfu_profiled, report, traces, worst["breakdown"].waiting_for_data)
    if cpu:
        led.get("structure").explanation += f"; {GLOO_NOTE}"
    where = f"rank {worst['rank']}'s traced step (the most exposed of {len(traces)})"
    profiled = Timings([traced], [0.0], [traced], [0.0], 0,
                       f"{where}: the span of its profiled activity; the loss is not kept")
    caveat = f" ({GLOO_NOTE})" if cpu else ""
    metrics["profiled_mfu"] = Metric(mfu_profiled, "fraction", "measured",
                                     f"model FLOPs of all {dp} data-parallel ranks / (peak x {where}): the ledger's "
                                     "window")
    for kind, v in sorted(worst["breakdown"].comm_by_kind.items()):
        metrics[f"{kind}_share"] = Metric(v["total"], "fraction", "measured",
                                          f"{kind} in all, share of {where}{caveat}")
        metrics[f"exposed_{kind}_share"] = Metric(v["exposed"], "fraction", "measured",
                                                  f"{kind} not under compute, share of {where}{caveat}")
    metrics["layout_exposed_comm_share"] = Metric(worst["breakdown"].communicating, "fraction", "measured",
                                                  f"communication not under compute, {where}{caveat}")
    layout = bl.summary(run, bl.collective_rows(run, job)) | {
        "name": name, "profiles": rank_profiles(traces, run, folder), "caveat": GLOO_NOTE if cpu else "",
        "most_exposed_rank": worst["rank"]}
    skipped = [{"what": "one-process profile", "reason": f"the job runs in its layout {name}: step 3 traces every "
                "rank of it instead"},
               {"what": "per-rank profile (DDP, step 2's layout)",
                "reason": f"the job's own layout {name} is traced rank by rank instead"},
               {"what": "profile_steps / profile_warmup_steps", "reason": PROFILED_ONE_STEP}]
    if not ref:
        skipped.append({"what": "comparison with step 1",
                        "reason": f"step 1 has no result in the layout {name} on this device yet"})
    return LayoutProfile(main, bandwidth, bw_note, led, unprofiled, profiled, metrics, ref, layout, fit,
                         os.path.relpath(first["path"], folder), skipped)


FSDP_GATHER = ("FSDP's parameter all-gathers wait in the open: prefetch the next block's (fsdp_prefetch 1 or 2), "
               "or keep the gathered parameters after forward (fsdp_reshard_after_forward: false) if memory allows")
FSDP_REDUCE = ("FSDP's gradient reduce-scatters run after backward: a lower reduce dtype (fsdp_reduce_dtype) halves "
               "their bytes")
TP_REDUCE = ("tensor parallel's all-reduces sit on the critical path of every block: keep tp within the fastest link "
             "(one node's NVLink)")
TRADE = ", or trade them for all-gather + reduce-scatter with sp: true"
SP_COMM = ("sequence parallel's all-gathers and reduce-scatters sit on the critical path of every block: keep tp "
           "within the fastest link (one node's NVLink); they move the bytes TP's all-reduces would, and shard the "
           "norms' activations")
PP_WAIT = ("pipeline stages wait on each other: more pp_microbatches, or interleaved_1f1b with pp_virtual_stages 2, "
           "shrinks the bubble")


def lever(kind: str, lay: dict[str, Any]) -> str | None:
    """The layout's own lever for an exposed collective kind, by what issues that kind in this layout."""
    if kind in ("send", "recv"):
        return PP_WAIT if lay.get("pp", 1) > 1 else None
    if kind in ("allgather", "reduce_scatter"):
        if lay.get("dp_mode") == "fsdp" and lay.get("dp", 1) > 1:
            return FSDP_GATHER if kind == "allgather" else FSDP_REDUCE
        return SP_COMM if lay.get("sp") else None
    if kind == "allreduce" and lay.get("tp", 1) > 1:
        return TP_REDUCE + ("" if lay.get("sp") else TRADE)
    return None


def advice(layout: dict[str, Any], cpu: bool) -> list[Advice]:
    """What the per-rank traces say about the layout's communication: the most exposed kinds, with the layout's
    own levers (the DDP advice does not apply to them)."""
    profiles = layout.get("profiles") or []
    if not profiles:
        return []
    worst = max(profiles, key=lambda p: p.breakdown.communicating)
    b, name = worst.breakdown, layout["name"]
    caveat = f" ({GLOO_NOTE})" if cpu else ""
    out = []
    if b.communicating > COMM_LIMIT:
        kinds = sorted(b.comm_by_kind.items(), key=lambda kv: -kv[1]["exposed"])
        for kind, v in kinds[:2]:
            text = lever(kind, layout["layout"])
            if text and v["exposed"] > COMM_LIMIT / 2:
                out.append(Advice("act" if kind == kinds[0][0] else "look", f"{name}: {text}",
                                  f"rank {worst.rank}: {kind} {v['exposed']:.1%} of the traced step not under compute "
                                  f"({v['total']:.1%} in all){caveat}"))
    return out
