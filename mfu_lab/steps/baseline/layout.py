"""Step 1 for a job in its own layout (FSDP2, tensor and sequence parallel, pipeline schedules).

When the job is more than plain DDP (``dp_mode: fsdp``, ``tp`` > 1 or ``pp`` > 1), step 1 runs it under torchrun
in that layout (:func:`mfu_lab.workers.layout_launch.run_layout`: NCCL on GPUs, gloo on CPUs), after the rank
worker has checked the layout's losses against one process's. From that run:

- step time per optimizer step = the slowest rank's time of that step (every rank waits for it);
- MFU = model FLOPs of one optimizer step over every data-parallel rank x measured steps / (peak x their total
  wall time); model FLOPs are counted (or computed from the formula) on the meta device, so a model larger than
  this machine is never allocated; the peak is one GPU's x the world on GPUs, and on a CPU the whole CPU's
  measured matmul rate, which the ranks share;
- the ledger's structure loss names the exposed collectives by kind and the pipeline bubble as measured, from
  one profiled window per rank (:func:`mfu_lab.core.measure.ledger.layout_ledger`);
- memory per rank (peak, and the shards by kind) and the collectives of one step, counted, against their closed
  form.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mfu_lab.analysis.layouts import terms as lt
from mfu_lab.analysis.trace import breakdown as trace
from mfu_lab.core.engine.work import rate_metrics
from mfu_lab.core.engine.workload import build_model, build_train_step
from mfu_lab.core.errors import StepError
from mfu_lab.core.job.schema import Job
from mfu_lab.core.measure import device as dev
from mfu_lab.core.measure.flops import FlopReport, count_step_flops, job_key_extra
from mfu_lab.core.measure.ledger import Ledger, hardware_flops, layout_ledger
from mfu_lab.core.measure.timed import Timings, stats
from mfu_lab.core.process.progress import as_progress
from mfu_lab.core.registry import BY_KEY
from mfu_lab.core.store.results import Metric
from mfu_lab.workers.layout_launch import LayoutRun, run_layout

CPU_SHARED = ("on a CPU the ranks share one machine: their MFU is taken against the whole CPU's measured matmul "
              "rate, and the times of collectives over gloo do not transfer to GPUs (counts and bytes do)")


def meta_flops(job: Job, device_type: str) -> FlopReport:
    """One data-parallel rank's optimizer step (micro_batch samples) counted on the meta device: the same count
    as on real tensors (FlopCounterMode reads shapes only), without allocating the model."""
    with torch.device("meta"):
        model = build_model(job)
        x = torch.zeros(job.micro_batch, job.seq_len, dtype=torch.long)
    step = build_train_step(dataclasses.replace(job, compile_mode="off"), model, device_type, fp8=False)  # same count
    return count_step_flops(model, step, x, x.clone(), cache_dir=job.output_root(), key_extra=job_key_extra(job))


def slowest_rank_steps(run: LayoutRun) -> list[float]:
    """Per optimizer step, the slowest rank's time: the step ends for everyone when it ends for the last."""
    per_rank = [r for r in run.step_times_s if r]
    return [max(ts) for ts in zip(*per_rank)]


def coords(rank: int, lay: dict[str, Any]) -> str:
    """A rank's place on the mesh, whose dimensions are (pp, dp, tp), tp innermost (core.engine.layout.build_mesh)."""
    tp, dp = lay["tp"], lay["dp"]
    return f"pp {rank // (tp * dp)}, dp {(rank // tp) % dp}, tp {rank % tp}"


def rank_rows(run: LayoutRun) -> list[dict[str, Any]]:
    """One row per rank: its place on the mesh, its median step and its memory."""
    rows = []
    for rank, times in enumerate(run.step_times_s):
        mem = run.memory[rank] if rank < len(run.memory) else {}
        rows.append({"rank": rank, "median_s": statistics.median(times) if times else None,
                     "peak_bytes": mem.get("peak_bytes"), "peak_source": mem.get("peak_source", ""),
                     "shard_bytes": mem.get("shard_bytes") or {"params": None, "grads": None, "optimizer": None},
                     "coords": coords(rank, run.layout)})
    return rows


def exposed_by_kind(traces: list[dict[str, Any]]) -> tuple[dict[str, float], str]:
    """Each collective kind's exposed share of the step on the rank where communication is most exposed, from
    the ranks' analysed traces (``[{"rank", "breakdown"}]``); ({}, why) without traces."""
    if not traces:
        return {}, "no profiled window: exposed communication not measured"
    worst = max(traces, key=lambda t: t["breakdown"].communicating)
    kinds = {k: v["exposed"] for k, v in worst["breakdown"].comm_by_kind.items()}
    return kinds, f"rank {worst['rank']}'s profiled window (the most exposed of {len(traces)})"


def summary(run: LayoutRun, rows: list[dict[str, Any]]) -> dict[str, Any]:
    """What the result keeps of a layout run: the run itself and the rows the report shows."""
    return {**run.to_dict(), "ranks": rank_rows(run), "collective_rows": rows}


def headline_metrics(job: Job, run: LayoutRun, report: FlopReport, peak_total: float, peak_source: str,
                     peak_note: str) -> tuple[dict[str, Metric], Timings, float]:
    """The step's headline figures over the measured steps: (metrics, timings, MFU)."""
    walls = slowest_rank_steps(run)
    if not walls:
        raise StepError(f"the layout {run.layout.get('name')} measured no step: {run.reason or run.status}")
    dp = run.layout["dp"]
    total = sum(walls)
    n = len(walls)
    flops_per_step = report.model_flops_per_step * dp
    hw_per_step = report.hardware_flops_per_step * dp
    mfu_value = flops_per_step * n / (peak_total * total)
    hfu_value = hw_per_step * n / (peak_total * total)
    st = stats(walls)
    data = run.data_times_s if getattr(run, "data_times_s", None) else None
    data_s = [max(ts) for ts in zip(*data)] if data else [0.0] * n
    timings = Timings(walls, data_s, [w - d for w, d in zip(walls, data_s)], list(run.losses or [0.0] * n)[:n],
                      0, f"slowest of {run.world} ranks per optimizer step ({run.backend}); "
                      + ("CUDA events" if run.backend == "nccl" else "perf_counter after a barrier"))
    window = f"over {n} measured optimizer steps of {run.layout['name']}, slowest rank per step"
    metrics = {
        "mfu": Metric(mfu_value, "fraction", "measured",
                      f"{report.model_flops_source} model FLOPs of one rank's micro-batch x {dp} data-parallel "
                      f"ranks x steps / ({peak_source} peak x measured wall time) {window}; MFU over the total "
                      "wall time of the measured steps, not their median"),
        "hfu": Metric(hfu_value, "fraction", "measured", "as MFU, counting recomputed work too"),
        "step_time_median_s": Metric(st.median, "s", "measured", timings.method),
        "step_time_p10_s": Metric(st.p10, "s", "measured"),
        "step_time_p90_s": Metric(st.p90, "s", "measured"),
        "step_time_cv": Metric(st.cv, "fraction", "measured", "standard deviation / mean of step times"),
        **rate_metrics(job, n / total, f"x {dp} data-parallel ranks, total wall {window}", dp,
                       "micro_batch x seq_len x steps / wall time"),
        "model_flops_per_step": Metric(flops_per_step, "FLOP", report.model_flops_source,
                                       report.formula + f"; x {dp} data-parallel ranks"),
        "hardware_flops_per_step": Metric(hw_per_step, "FLOP", report.model_flops_source,
                                          "model FLOPs + recomputed work"),
        "counted_flops_per_step": Metric(float(report.counted_flops_per_step) * dp, "FLOP", "counted",
                                         "FlopCounterMode over one forward+backward on the meta device, x "
                                         f"{dp} data-parallel ranks"),
        "peak_flops_per_s": Metric(peak_total, "FLOP/s", peak_source, peak_note),
        "achieved_flops_per_s": Metric(mfu_value * peak_total, "FLOP/s", "measured",
                                       "model FLOPs per second over the measured steps, all ranks"),
        "final_loss": Metric(run.losses[-1] if run.losses else None, "nats", "measured",
                             "training loss of the last measured step"),
        "world_size": Metric(float(run.world), "ranks", "measured", f"{run.layout['name']} over {run.backend}"),
        "loss_check_gap": Metric((run.loss_check or {}).get("max_rel_gap"), "fraction", "measured",
                                 f"largest relative loss gap against {(run.loss_check or {}).get('reference')} "
                                 f"over {(run.loss_check or {}).get('steps')} steps (tolerance "
                                 f"{(run.loss_check or {}).get('tolerance')})"),
    }
    peaks = [m.get("peak_bytes") for m in run.memory if m.get("peak_bytes") is not None]
    if peaks:
        metrics["peak_memory_bytes"] = Metric(float(max(peaks)), "bytes", "measured",
                                              f"the largest rank's peak ({run.memory[0].get('peak_source', '')})")
    if run.bubble:
        rank, worst = bubble_share(run)
        metrics["pipeline_bubble"] = Metric(
            worst, "fraction", "measured",
            f"idle before the first and after the last of pipeline rank {rank}'s stages (until every pipeline "
            f"rank has left the schedule), over its step (the "
            f"largest of the pipeline ranks); analytic (p-1)/(v*m+p-1) = {run.bubble.get('analytic_of_step', 0):.1%} "
            f"of the step ((p-1)/(v*m) = {run.bubble['analytic']:.1%} of the compute); fill and drain only: idle "
            "inside the step is not counted")
    return metrics, timings, mfu_value


def bubble_share(run: LayoutRun) -> tuple[int, float]:
    """(pipeline rank, its measured fill + drain over its step) for the rank where it is largest: a rank idles
    until its earliest stage starts and after its latest one ends (``per_pp_rank``; ``per_stage`` for an older
    record)."""
    rows = run.bubble.get("per_pp_rank") or [dict(s, pp_rank=s["stage"]) for s in run.bubble["per_stage"]]
    worst = max(rows, key=lambda s: s["fraction"])
    return worst["pp_rank"], worst["fraction"]


def peak_of_world(job: Job, device: dev.DeviceInfo, world: int) -> tuple[float, str, str]:
    """(FLOP/s, source, note) the ranks together are measured against: one GPU's peak x the world, or on a CPU
    the whole CPU's (the ranks share it)."""
    p = dev.resolve_peak(device, job.dtype, job.peak_flops, job.matmul_precision)
    if device.type == "cuda":
        return p.flops_per_s * world, p.source, f"{p.note}; x {world} GPUs"
    return p.flops_per_s, p.source, f"{p.note}; {CPU_SHARED}"


def ledger_for(run: LayoutRun, mfu_value: float, report: FlopReport, traces: list[dict[str, Any]], data: float):
    kinds, where = exposed_by_kind(traces)
    bubble = bubble_share(run)[1] if run.bubble else None
    led = layout_ledger(mfu_value, kinds, bubble, data, run.layout["name"], run.world, hardware_flops(report),
                        comm_source="measured")
    led.get("structure").explanation += f" ({where})"
    return led


@dataclass
class Measured:
    metrics: dict[str, Metric]
    timings: Timings
    ledger: Ledger
    flops: FlopReport
    peak: dict[str, Any]
    layout: dict[str, Any]
    fp8: dict[str, Any] = dataclasses.field(default_factory=dict)  # the ranks' fp8_layers: converted, or why not


def analysed_traces(run: LayoutRun, top_n: int) -> list[dict[str, Any]]:
    """Each rank's profiled window, analysed as step 3 analyses a trace (``[{"rank", "path", "breakdown"}]``)."""
    out = []
    for path in run.trace_paths:
        rank = int(Path(path).name.split("rank")[-1].split(".")[0])
        a = trace.analyse(trace.load_trace(path), top_n=top_n)
        out.append({"rank": rank, "path": path, "breakdown": a.breakdown, "analysis": a})
    return sorted(out, key=lambda t: t["rank"])


def closed_forms(job: Job, lay: dict[str, Any]) -> tuple[dict[str, float], str]:
    """Rank 0's bytes per kind for one optimizer step in closed form (:mod:`mfu_lab.analysis.layouts.terms`), for
    the reference GPT in a layout of one kind (DDP, FSDP, TP with or without SP, or PP alone); ({}, why) else."""
    if job.model != "gpt":
        return {}, "the closed forms are written for the reference GPT"
    kinds = sum([lay["dp_mode"] == "fsdp" or lay["dp"] > 1, lay["tp"] > 1, lay["pp"] > 1])
    if kinds != 1:
        return {}, "no closed form here for a layout that combines data, tensor and pipeline parallel"
    with torch.device("meta"):
        model = build_model(job)
    params = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    blocks = sum(p.numel() for p in model.blocks.parameters())
    norms = [p for b in model.blocks for m in (b.ln1, b.ln2) for p in m.parameters()]
    size = {"float32": 4, "bfloat16": 2, "float16": 2}
    act = size[job.dtype]
    b, s, h, n = job.micro_batch, job.seq_len, job.d_model, job.n_layers
    if lay["pp"] > 1:
        p, m, v = lay["pp"], lay["pp_microbatches"], lay["pp_virtual_stages"]
        sends = lt.p2p_sends_of_rank(0, p, m, v) * lt.p2p_send_bytes(b // m, s, h, act)
        return {"send": sends, "recv": sends}, "p2p_sends_of_rank(0, p, m, v) x (b/m)*s*h*bytes, each way"
    if lay["tp"] > 1:
        per_layer = lt.tp_bytes_per_layer(b, s, h, act, lay["sp"], job.activation_checkpointing)
        out = {k: v * n for k, v in per_layer.items()}
        if lay["sp"]:
            out["allgather"] += lt.sp_boundary_bytes(b, s, h, act)["allgather"]
            out["allreduce"] = lt.sp_norm_grad_all_reduces(len(norms), sum(x.numel() for x in norms), 4,
                                                           uses=1)["bytes"]
            return out, ("per layer 4 all-gathers + 4 reduce-scatters of b*s*h*bytes, 2 more all-gathers at the "
                         "region's ends, each LayerNorm gradient all-reduced once")
        return out, "per layer 4 all-reduces of b*s*h*bytes (Megatron-LM)" + (
            ", +1 re-run by the checkpoint" if job.activation_checkpointing else "")
    if lay["dp_mode"] == "fsdp":
        gather = lt.fsdp_all_gather_bytes(params, size[lay["param_dtype"]], lay["reshard_after_forward"],
                                          params - blocks, root_reshards=True)
        return ({"allgather": gather, "reduce_scatter": lt.fsdp_reduce_scatter_bytes(params,
                                                                                      size[lay["reduce_dtype"]])},
                "FSDP2: parameters gathered twice with resharding (once without), gradients reduce-scattered once")
    return {"allreduce": lt.ddp_all_reduce_bytes(params)}, "DDP: every gradient all-reduced once"


MAX_ROW = "all-reduces that take a max, not in the closed form"
FP8_MAX_ROW = (MAX_ROW + ": with fp8_layers under tensor parallel, torchao's FP8 scales (the amax of each sharded "
               "weight, input or gradient: a scalar each for the tensorwise recipe, a row of them for rowwise)")


def collective_rows(run: LayoutRun, job: Job | None = None) -> list[dict[str, Any]]:
    """Rank 0's collectives of one step, counted, by kind, beside their closed form where one applies."""
    mine = run.collectives[0] if run.collectives else {}
    expected, formula = closed_forms(job, run.layout) if job is not None else ({}, "")
    rows = []
    for k, v in sorted(mine.items()):
        want = expected.get(k)
        if want:
            said = formula
        elif k == "allreduce_max":
            said = FP8_MAX_ROW if job is not None and job.fp8_layers else MAX_ROW
        else:
            said = "not in the closed form" if expected else formula
        rows.append({"kind": k, "count": v["count"], "bytes": v["bytes"], "formula_bytes": want,
                     "ratio": v["bytes"] / want if want else None, "formula": said})
    return rows


def measure(job: Job, device: dev.DeviceInfo, world: int, progress=None) -> Measured:
    """Run the job in its layout (profiled once per rank) and turn the run into step 1's figures."""
    say = as_progress(progress).say
    run = launch(job, device.type, BY_KEY["baseline"].folder, progress=progress, profile=True)
    lc = run.loss_check or {}
    gap = lc.get("max_rel_gap")
    say(f"  {run.layout['name']}: " + (f"loss check passed (largest relative gap {gap:.2g} against "
                                       f"{lc.get('reference')})" if gap is not None else
                                       f"loss not checked ({lc.get('reference', 'no reference')})")
        + f"; {len(run.step_times_s[0])} timed steps per rank")
    report = meta_flops(job, device.type)
    peak_total, source, note = peak_of_world(job, device, world)
    metrics, timings, mfu_value = headline_metrics(job, run, report, peak_total, source, note)
    traces = analysed_traces(run, job.top_n)
    led = ledger_for(run, mfu_value, report, traces, 0.0)
    not_timed = "not timed under a layout: the rank worker times whole optimizer steps, not the loader apart"
    metrics |= {"data_wait_fraction": Metric(None, "fraction", "measured", not_timed),
                "host_fraction": Metric(None, "fraction", "measured", not_timed),
                "compute_fraction": Metric(None, "fraction", "measured", not_timed)}
    for kind, share in exposed_by_kind(traces)[0].items():
        metrics[f"exposed_{kind}_share"] = Metric(share, "fraction", "measured",
                                                  f"{kind} not under compute, share of the profiled step on the "
                                                  "most exposed rank")
    peak = {"flops_per_s": peak_total, "source": source, "note": note, "device": device.name,
            "device_type": device.type, "precision": job.dtype, "world": world}
    layout = summary(run, collective_rows(run, job))
    layout["traces"] = [{"rank": t["rank"], "path": t["path"], "breakdown": dataclasses.asdict(t["breakdown"])}
                        for t in traces]
    return Measured(metrics, timings, led, report, peak, layout, run.fp8)


def work_dir(job: Job, folder: str) -> Path:
    return job.step_dir(folder) / "layout"


def on_events(progress):
    """The rank worker's events as progress lines and a counted bar with the time left."""
    p = as_progress(progress)
    state: dict[str, Any] = {}

    def on(ev: dict) -> None:
        kind = ev.get("event")
        if kind == "launch":
            p.say(f"  {ev['world_size']} ranks over {ev['backend']}, {ev['threads']} intra-op thread(s) per rank")
        elif kind == "start":
            p.say(f"  {ev['name']}: loss check against one process, then warm-up and timed steps")
            state["tick"] = p.items(f"{ev['name']} steps")
            state["t0"] = time.perf_counter()
        elif kind == "step" and "tick" in state:
            state["tick"](ev["done"], ev["total"], time.perf_counter() - state["t0"])
        elif kind == "quiet":  # workers.launch.watch: the ranks said nothing for a while (start-up, a long step)
            p.say(f"  still working: no event from the ranks for {ev['quiet_s']:.0f} s")  # once per GAP_S at most

    return on


def launch(job: Job, device_type: str, folder: str, progress=None, profile: bool = True) -> LayoutRun:
    """Run the job in its layout; a refused or failed run is an error that names the layout and the gap."""
    run = run_layout(job, device_type, work_dir(job, folder), progress=on_events(progress), profile=profile)
    if run.status != "ok":
        gap = run.loss_check or {}
        extra = (f" (largest relative loss gap {gap['max_rel_gap']:.3g} against {gap['reference']}, tolerance "
                 f"{gap['tolerance']:.0e})" if run.status == "refused" and gap.get("max_rel_gap") is not None else "")
        raise StepError(f"the job in its layout {run.layout.get('name')} {run.status}: {run.reason}{extra}")
    return run
