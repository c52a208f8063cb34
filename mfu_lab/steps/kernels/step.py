"""Step 3, kernels: which kernels eat the time, and which adjacent operations could be fused?

``run(job)`` times the job's training step without the profiler, then records a
few steps with ``torch.profiler`` (shapes recorded) and reads the trace with
:mod:`mfu_lab.analysis.trace.breakdown`: the top-N kernels (GPU) or operators (CPU) by self time,
a time breakdown of the profiled steps in the ledger's terms, time by category,
and fusion candidates with their memory traffic at the device's measured
bandwidth. The trace is kept, gzipped, as ``<out>/<job>/03_kernels/trace.json.gz``
next to ``result.json``.

A job that is more than plain DDP (``dp_mode: fsdp``, ``tp`` > 1 or ``pp`` > 1) is traced in its own layout instead,
every rank of it, with the collectives as categories and the layout ledger: see :mod:`mfu_lab.steps.kernels.layout`.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mfu_lab.analysis.trace import breakdown as tr
from mfu_lab.core.advice import Advice
from mfu_lab.core.engine.batches import to_device
from mfu_lab.core.engine.work import rate_metrics
from mfu_lab.core.engine.workload import build_loader, build_model, build_train_step
from mfu_lab.core.job.schema import Job
from mfu_lab.core.measure import device as dev
from mfu_lab.core.measure import flops as fl
from mfu_lab.core.measure.environment import environment
from mfu_lab.core.measure.flops import count_step_flops
from mfu_lab.core.measure.ledger import Ledger, hardware_flops, trace_ledger
from mfu_lab.core.measure.timed import Timings, profile_steps, run_steps, stats
from mfu_lab.core.process.budget import Clock, fit_kernels, job_step_s
from mfu_lab.core.process.faults import guarded
from mfu_lab.core.process.progress import as_progress
from mfu_lab.core.registry import BY_KEY
from mfu_lab.core.store import step_results as store
from mfu_lab.core.store.nodes import launcher_folder
from mfu_lab.core.store.results import Metric, StepResult, rebuild
from mfu_lab.core.thresholds import (
    COMM_LIMIT,
    DATA_WAIT_LIMIT,
    FUSION_LIMIT,
    IDLE_LIMIT,
    MEMORY_BOUND_LIMIT,
    OPTIMIZER_LIMIT,
    PROFILER_OVERHEAD_LIMIT,
)
from mfu_lab.steps.baseline.reference import reference_peak, step1_reference
from mfu_lab.steps.kernels import layout as kl
from mfu_lab.steps.kernels.batch_race import race_batch
from mfu_lab.steps.kernels.figures import compare_with_step1, trace_metrics
from mfu_lab.steps.kernels.optimizer_race import race_optimizer
from mfu_lab.workers.launch import error_lines, launch, world_layout

INFO = BY_KEY["kernels"]
TRACE_FILE = "trace.json.gz"
OPEN_TRACE = ("open it in https://ui.perfetto.dev (Open trace file; the file stays on your machine) or in "
              "chrome://tracing; both read the .gz as it is")


@dataclass
class RankProfile:
    rank: int
    trace_file: str
    step_time_s: float  # profiled window / steps
    breakdown: tr.Breakdown
    matmul_attention_share: float
    memory_bound_share: float


@dataclass
class KernelsResult(StepResult):
    step: str
    job: dict[str, Any]
    environment: dict[str, Any]
    metrics: dict[str, Metric]
    analysis: tr.TraceAnalysis
    ledger: Ledger
    unprofiled: Timings
    profiled: Timings
    compare: dict[str, Any]  # against step 1, when it ran on this device
    trace_file: str
    advice: list[Advice]
    ddp: dict[str, Any] = field(default_factory=dict)  # the per-rank profile: status, config, ranks
    # the job in its own layout (steps.kernels.layout): the run's summary, "name", "profiles" (one per rank), "caveat"
    layout: dict[str, Any] = field(default_factory=dict)
    fit: dict[str, Any] = field(default_factory=dict)  # the layout's memory per rank against what is available
    optimizer_race: dict[str, Any] = field(default_factory=dict)  # steps.kernels.optimizer_race, when AdamW costs
    batch_race: dict[str, Any] = field(default_factory=dict)  # steps.kernels.batch_race: micro_batch x grad_accum

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> KernelsResult:
        """As every result, by field name; the per-rank profiles inside ``ddp`` and ``layout`` (free-form dicts)
        too."""
        r = super().from_dict(d)
        r.ddp = {**r.ddp, "ranks": [rebuild(RankProfile, x) for x in r.ddp.get("ranks", [])]}
        if r.layout:
            r.layout = {**r.layout, "profiles": [rebuild(kl.LayoutRankProfile, x) for x in r.layout["profiles"]]}
        return r

    def ledger_title(self) -> str:
        """The ledger plot's title: which steps it is of, and under a layout which one ran (and gloo's caveat)."""
        if not self.layout:
            return "MFU ledger of the profiled steps"
        caveat = f"\n{self.layout['caveat']}" if self.layout.get("caveat") else ""
        return (f"MFU ledger of {self.layout['name']}'s traced step, rank {self.layout['most_exposed_rank']} "
                f"(the most exposed){caveat}")


Result = KernelsResult  # the step contract: every step module names its result class Result


def _comm_config(job: Job) -> tuple[dict[str, Any], str]:
    """Step 2's recommended DDP configuration when it has one, else the job's own (ddp_* keys)."""
    step2 = store.earlier(job, "attention_comm")
    rec = (step2.data.get("recommendation") or {}).get("comm") if step2 else None
    if rec and rec.get("kind") == "fsdp":  # a layout change (step 7 verifies it): DDP is profiled as the job has it
        return ({"hook": job.ddp_hook, "bucket_mb": job.ddp_bucket_mb,
                 "grad_as_bucket_view": job.ddp_grad_as_bucket_view},
                f"the job's own (ddp_* keys; step 2 recommends FSDP2, {rec['hook']}, a layout change)")
    if rec:
        return ({"hook": rec["hook"], "bucket_mb": rec["bucket_cap_mb"],
                 "grad_as_bucket_view": rec["gradient_as_bucket_view"]}, "step 2's recommendation")
    return ({"hook": job.ddp_hook, "bucket_mb": job.ddp_bucket_mb, "grad_as_bucket_view": job.ddp_grad_as_bucket_view},
            "the job's own (ddp_* keys; step 2 has no result)")


def profile_ranks(job: Job, device_type: str, out_dir: Path, say) -> dict[str, Any]:
    """Profile the job data-parallel (step 2's layout) through torchrun; analyse each rank's trace."""
    nnodes, nproc = world_layout(job, device_type)
    if nnodes * nproc < 2:
        return {"status": "skipped", "reason": f"{nnodes * nproc} process in step 2's layout: no ranks to compare"}
    cfg, source = _comm_config(job)
    for old in out_dir.glob("trace_rank*.json.gz"):
        old.unlink()  # never mix ranks from an earlier run
    spec = {"job": job.to_dict(), "device_type": device_type, "attention": None, "configs": [],
            "allreduce_max_bytes": None,
            "profile": {"config": cfg, "warmup": job.profile_warmup_steps, "steps": job.profile_steps,
                        "dir": str(out_dir)}}
    total = job.profile_warmup_steps + job.profile_steps
    beat = as_progress(say).heartbeat("  per-rank profile", total)

    def on_event(ev):
        if ev["event"] == "launch":
            say(f"  {ev['world_size']} ranks over {ev['backend']}: hook {cfg['hook']}, bucket {cfg['bucket_mb']} MB "
                f"({source})")
            beat.said()
        elif ev["event"] == "step" and ev["done"] == total:
            say("  profiled steps done; writing each rank's trace")
            beat.said()
        elif ev["event"] == "step":
            beat.beat(ev["done"], total, "profiled steps")
        elif ev["event"] == "quiet":
            beat.beat(what=f"no event from the ranks for {ev['quiet_s']:.0f} s")

    result: dict[str, Any] = {"config": cfg, "config_source": source, "nnodes": nnodes, "nproc_per_node": nproc,
                              "ranks": []}
    got = launch(job, spec, launcher_folder(out_dir / "ddp"), 0, nnodes, nproc, on_event)  # one per node
    launched = next((e for e in got.events if e["event"] == "launch"), {})
    result |= {"world_size": launched.get("world_size", nnodes * nproc), "backend": launched.get("backend", "")}
    traces = sorted(out_dir.glob("trace_rank*.json.gz"), key=lambda p: int(p.name[10:].split(".")[0]))
    if got.returncode != 0 or not traces:
        why = ("no step finished for comm_timeout_s" if got.returncode is None
               else error_lines(got.rank_stderr) or got.launcher_stderr[-400:])
        return result | {"status": "failed", "error": why,
                         "stderr": "\n".join(f"{k}: {v}" for k, v in got.rank_stderr.items())[-3000:]}
    for path in traces:
        a = tr.analyse(tr.load_trace(path), top_n=1)
        result["ranks"].append(RankProfile(
            int(path.name[10:].split(".")[0]), path.name, a.step_time_s, a.breakdown,
            a.category_share["matmul"] + a.category_share["attention"],
            sum(a.category_share[c] for c in tr.MEMORY_BOUND)))
    if nnodes > 1:
        result["note"] = "each node keeps its own ranks' traces; this page reads this node's"
    return result | {"status": "ok", "seconds": got.seconds}


FIRST_BUCKET_MB = 1.0  # DDP puts the last-produced gradients into a small first bucket (1 MiB)


def advise(r: KernelsResult) -> list[Advice]:
    """Advice from the trace's own figures; each item says which figures triggered it."""
    a, overhead, compare = r.analysis, r.metric("profiler_overhead"), r.compare
    device_type, ddp = r.environment["device_type"], r.ddp
    ranks, grad_bytes = ddp.get("ranks", []), ddp.get("gradient_bytes", 0)
    out: list[Advice] = []
    comm = sum(r.breakdown.comm_total for r in ranks)
    hidden = sum(r.breakdown.comm_overlapped for r in ranks) / comm if comm else None
    if hidden is not None and hidden < 0.10 and ddp and grad_bytes:
        cap = float(ddp["config"]["bucket_mb"])
        mib = grad_bytes / 2**20
        buckets = 1 + math.ceil(max(0.0, mib - FIRST_BUCKET_MB) / cap)
        if buckets <= 2:
            out.append(Advice("look", f"Almost no communication is hidden under backward: the {mib:.1f} MiB of "
                              f"gradients fill {buckets} bucket(s) of bucket_cap_mb={cap:g}, so the all-reduce of "
                              "nearly all of them can only start when backward ends. Smaller buckets let it start "
                              "while backward still runs (step 2 times them)",
                              f"{hidden:.1%} of communication under compute across the ranks' traces"))
    exposed = max(ranks, key=lambda r: r.breakdown.communicating, default=None)
    if exposed and exposed.breakdown.communicating > COMM_LIMIT:
        b = exposed.breakdown
        out.append(Advice("act", "Data-parallel, communication is exposed on some ranks: overlap it (step 2's "
                          "bucket size and hooks) or shrink it (a compressing hook, fewer, larger buckets)",
                          f"rank {exposed.rank}: {b.communicating:.1%} of the step communicating outside compute "
                          f"({b.comm_total:.1%} in all, aim under {COMM_LIMIT:.0%})"))
    b = a.breakdown
    unit = "kernels" if a.kind == "gpu" else "operators"
    if overhead is not None and overhead > PROFILER_OVERHEAD_LIMIT:
        out.append(Advice("look", "The profiler slowed the step down; the shares below are of the profiled step, "
                          "in which per-operator overheads weigh more than in the real one",
                          f"profiled step {overhead:+.1%} against the unprofiled steps of this run"))
    if compare.get("consistent") is False:
        out.append(Advice("look", "This run's step time differs from step 1's beyond its spread: the machine's load "
                          "changed between the runs, so compare shares rather than times",
                          f"unprofiled median {compare['this_median_s'] * 1e3:.1f} ms vs step 1 "
                          f"{compare['median_s'] * 1e3:.1f} ms (p10-p90 {compare['p10_s'] * 1e3:.1f}-"
                          f"{compare['p90_s'] * 1e3:.1f} ms)"))
    if b.waiting_for_data > DATA_WAIT_LIMIT:
        out.append(Advice("act", "The device waits for the next batch: load in background workers (num_workers, "
                          "prefetch_factor, pin_memory on GPU)", f"waiting for data {b.waiting_for_data:.1%}"))
    if r.layout:
        out += kl.advice(r.layout, device_type != "cuda")
    elif b.communicating > COMM_LIMIT:
        out.append(Advice("act", "Communication is exposed: use step 2's bucket size and hook to overlap it",
                          f"exposed communication {b.communicating:.1%} (aim under {COMM_LIMIT:.0%})"))
    idle = r.metric("idle_share")  # against the step without the profiler (the window's own is slowed by it)
    if idle is not None and idle > IDLE_LIMIT:
        fix = ("launch overhead: CUDA graphs via torch.compile(mode='reduce-overhead') (step 4), fewer and larger "
               "kernels (fusion, below), or a larger micro-batch" if device_type == "cuda" else
               "per-operator overhead between small operators: torch.compile (step 4) removes most of it; a larger "
               "micro-batch amortises it")
        out.append(Advice("act", f"The device is idle between {unit} for a large share of the step: {fix}",
                          f"idle {idle:.1%} of the step without the profiler"))
    for c in a.fusion[:3]:
        if c.share_of_step >= FUSION_LIMIT:
            saving = (f", estimated {c.est_saving_per_step_s * 1e3:.2f} ms of traffic saved per step"
                      if c.est_saving_per_step_s is not None else "")
            out.append(Advice("act" if c is a.fusion[0] else "look", f"Fuse '{c.pattern}': {c.remedy}",
                              f"{c.per_step:g} run{'' if c.per_step == 1 else 's'} per step taking "
                              f"{c.time_per_step_s * 1e3:.2f} ms "
                              f"({c.share_of_step:.1%} of the step){saving}"))
    opt, race = a.optimizer, r.optimizer_race or {}
    if opt.get("found") and (opt["share_of_step"] > OPTIMIZER_LIMIT or race.get("ran")):
        seen = (f"optimizer step {opt['share_of_step']:.1%} of the step, {opt['ops_per_step']:.0f} {opt['what']} per "
                "step")
        if race.get("ran"):  # raced side by side: adopted into tuned.yaml, or said why not
            out.append(Advice("act" if race.get("adopted") else "info",
                              f"AdamW's implementation, raced side by side: {race['verdict']}"
                              + (" (tuned.yaml carries it; step 7 verifies it)" if race.get("adopted") else ""),
                              seen + "; " + race.get("method", "")))
        elif not opt["multi_tensor"]:
            out.append(Advice("act", "The optimiser updates one parameter at a time: torch.optim.AdamW(..., "
                              "fused=True) or foreach=True does it in a few multi-tensor kernels. Not raced here ("
                              + race.get("note", "no race ran") + "): set adamw_impl in the job file by hand", seen))
    br = r.batch_race or {}
    if br.get("ran"):
        out.append(Advice("act" if br.get("adopted") else "info",
                          f"Micro-batch against accumulation, {br['samples_per_step']} samples per optimizer step "
                          f"held: {br['verdict']}" + (" (tuned.yaml carries it; step 7 verifies it)"
                                                      if br.get("adopted") else ""), br.get("method", "")))
    elif br.get("note"):
        out.append(Advice("info", f"A larger micro_batch: {br['note']}", "the batch race's rule"))
    mem = sum(a.category_share[c] for c in tr.MEMORY_BOUND)
    if mem > MEMORY_BOUND_LIMIT:
        out.append(Advice("look", "Memory-bound operations take a large share: their cost is bytes moved, not "
                          "FLOPs, so fusing them (torch.compile, step 4) pays more than faster matmuls",
                          f"elementwise + normalisation + reduction + memory copy {mem:.1%} of the step"))
    dense = a.category_share["matmul"] + a.category_share["attention"]
    out.append(Advice("info", f"Matmuls and attention, the {unit} that do the model's FLOPs, take {dense:.1%} of "
                      "the profiled step; the rest is where MFU goes",
                      "self time by category, from the trace"))
    return out


def _run_in_layout(job: Job, device: dev.DeviceInfo, say, t_start: float, write: bool) -> KernelsResult:
    """Step 3 for a job in its own layout: every rank traced (see :mod:`mfu_lab.steps.kernels.layout`)."""
    nnodes, nproc = world_layout(job, device.type)
    lp = kl.profile(job, device, nnodes * nproc, say)
    a, m, name = lp.analysis, lp.metrics, lp.layout["name"]
    rank0 = f" (rank 0's trace of {name})"
    median, traced = stats(lp.unprofiled.measured("wall_s")).median, lp.profiled.wall_s[0]
    metrics = {
        "mfu": m["mfu"], "profiled_mfu": m["profiled_mfu"], "step_time_median_s": m["step_time_median_s"],
        "profiled_step_time_median_s": Metric(traced, "s", "measured", lp.profiled.method),
        "profiler_overhead": Metric(traced / median - 1, "fraction", "measured",
                                    "the most exposed rank's traced step / the unprofiled median (slowest rank per "
                                    "step) - 1; a traced span, not the profiled step's wall-clock"),
        "tokens_per_s": m["tokens_per_s"],
    } | trace_metrics(a, lp.bandwidth, lp.bandwidth_note, rank0, step_s=median) | {
        k: v for k, v in m.items() if k not in ("mfu", "profiled_mfu", "step_time_median_s", "tokens_per_s")}
    if lp.layout["caveat"]:  # every figure that holds a collective's time, on a CPU
        for k in ("exposed_comm_share", "profiled_mfu", "profiler_overhead"):
            metrics[k] = dataclasses.replace(metrics[k], note=f"{metrics[k].note} ({lp.layout['caveat']})")
    ddp = {"status": "skipped", "reason": f"the job runs in its own layout {name}: every rank is traced instead"}
    result = KernelsResult("kernels", job.to_dict(), environment(device.name, device.type), metrics, a, lp.ledger,
                           lp.unprofiled, lp.profiled, compare_with_step1(lp.reference, median, traced),
                           lp.trace_file, [], ddp, layout=lp.layout, fit=lp.fit, skipped=lp.skipped)
    result.advice = advise(result)
    result.elapsed_s = time.perf_counter() - t_start
    if write:
        save(job, result)
    return result


@guarded("kernels")
def run(job: Job, progress=None, write: bool = True) -> KernelsResult:
    """Profile the job's training step; see the module docstring."""
    t_start = time.perf_counter()
    say = as_progress(progress)
    device = dev.resolve_device(job.device)
    torch_device = device.torch_device
    skipped: list[dict[str, str]] = []
    if kl.in_layout(job):
        return _run_in_layout(job, device, say, t_start, write)
    out_dir = job.step_dir(INFO.folder)
    trace_path = out_dir / TRACE_FILE

    model = build_model(job).to(torch_device).train()
    train_step = build_train_step(job, model, device.type)
    x0, y0 = next(iter(build_loader(dataclasses.replace(job, num_workers=0, synthetic_load_ms=0.0), 1, device.type)))
    flops = count_step_flops(model, train_step, to_device(x0, torch_device), to_device(y0, torch_device),
                             cache_dir=job.output_root(), key_extra=fl.job_key_extra(job))
    ref = step1_reference(job, device.name)
    peak, *peak_label, _ = reference_peak(job, device)
    if not ref:
        skipped.append({"what": "comparison with step 1", "reason": "step 1 has no result on this device yet"})

    clock = Clock.for_step(job, INFO.key)
    nnodes, nproc = world_layout(job, device.type)  # one rank (a single GPU): no per-rank traces to budget for
    timed, with_ddp = fit_kernels(dataclasses.replace(job, profile_ddp=job.profile_ddp and nnodes * nproc > 1), clock,
                                  job_step_s(store.earlier(job, "baseline").data))
    say(f"timing {timed.steps} steps without the profiler ({timed.warmup_steps} warm-up)")
    unprofiled = run_steps(train_step, build_loader(timed, timed.warmup_steps + timed.steps, device.type),
                           torch_device, timed.warmup_steps, timed.steps, say.items("unprofiled steps"))
    say(f"profiling {job.profile_steps} steps ({job.profile_warmup_steps} warm-up) with shapes recorded")
    profiled = profile_steps(
        train_step, build_loader(job, job.profile_warmup_steps + job.profile_steps, device.type), torch_device,
        job.profile_warmup_steps, job.profile_steps, trace_path, say.items("profiled steps"))
    trace = tr.load_trace(trace_path)
    if job.profile_ddp and with_ddp:
        say("profiling the job data-parallel, one trace per rank")
        ddp = profile_ranks(job, device.type, out_dir, say)
        if ddp["status"] == "skipped":
            skipped.append({"what": "per-rank profile", "reason": ddp["reason"]})
        elif ddp["status"] == "failed":
            say(f"  the per-rank profile failed: {ddp['error']}")
    else:
        ddp = {"status": "skipped", "reason": "profile_ddp is false in the job" if not job.profile_ddp else
               "budget: " + clock.shortened[-1]["reason"].removeprefix("budget: ")}
        if not job.profile_ddp:  # a budget's cut is in clock.shortened already, which the skipped list takes in
            skipped.append({"what": "per-rank profile", "reason": ddp["reason"]})
    say("measuring memory bandwidth")
    bandwidth, bw_note = dev.measure_memory_bandwidth(torch_device)
    say(f"reading the trace ({trace_path.stat().st_size / 1e6:.1f} MB gzipped)")
    plain, prof = stats(unprofiled.measured("wall_s")), stats(profiled.measured("wall_s"))
    a = tr.analyse(trace, job.top_n, bandwidth, step_s=plain.median)  # shares of the step without the profiler
    del trace

    opt_race = {"ran": False, "note": "the trace shows no optimizer step to race (no Optimizer.step span)"}
    if a.optimizer.get("found") and a.optimizer["share_of_step"] <= OPTIMIZER_LIMIT and not job.thorough:
        opt_race["note"] = (f"the optimizer step takes {a.optimizer['share_of_step']:.1%} of the step, under the "
                            f"{OPTIMIZER_LIMIT:.0%} that makes a race worth its time (--thorough races it at any "
                            "share)")
    if a.optimizer.get("found") and (a.optimizer["share_of_step"] > OPTIMIZER_LIMIT or job.thorough):
        say("racing AdamW's implementations side by side (" + (f"the optimizer's share is above {OPTIMIZER_LIMIT:.0%}"
            if a.optimizer["share_of_step"] > OPTIMIZER_LIMIT else "--thorough races it at any share") + ")")
        opt_race = race_optimizer(job, torch_device, a.optimizer["share_of_step"], clock.left_s(), plain.median, say)
        if not opt_race.get("ran"):
            skipped.append({"what": "optimizer race", "reason": opt_race["note"]})
    batch = race_batch(job, torch_device, clock.left_s(), plain.median, say)
    if not batch.get("ran"):
        skipped.append({"what": "batch race", "reason": batch["note"]})
    overhead = prof.median / plain.median - 1
    compare = compare_with_step1(ref, plain.median, prof.median)
    n = len(unprofiled.measured("wall_s"))
    mfu_plain = fl.mfu(flops.model_flops_per_step, n / sum(unprofiled.measured("wall_s")), peak)
    mfu_profiled = fl.mfu(flops.model_flops_per_step, a.steps / a.window_s, peak)
    ledger = trace_ledger(a.breakdown, mfu_profiled, device.type, hardware_flops(flops))
    metrics = {
        "mfu": Metric(mfu_plain, "fraction", "measured",
                      f"{flops.model_flops_source} model FLOPs x steps / (peak x wall time), over the total wall "
                      f"time of the measured steps ({n} unprofiled steps of this run), as in step 1"),
        "profiled_mfu": Metric(mfu_profiled, "fraction", "measured", "the same over the profiled window instead (the "
                               "steps the trace covers, torch.profiler's overhead included): the window the ledger "
                               "splits"),
        "step_time_median_s": Metric(plain.median, "s", "measured", unprofiled.method + ", without the profiler"),
        "profiled_step_time_median_s": Metric(prof.median, "s", "measured", "the same steps under torch.profiler"),
        "profiler_overhead": Metric(overhead, "fraction", "measured", "profiled median / unprofiled median - 1, "
                                    "side by side in this run"),
    } | rate_metrics(job, n / sum(unprofiled.measured("wall_s")), "unprofiled steps") | trace_metrics(
        a, bandwidth, bw_note, step_s=plain.median) | {
        "peak_flops_per_s": Metric(peak, "FLOP/s", peak_label[0], peak_label[1]),
    }
    ranks = ddp.get("ranks", [])
    if ranks:
        worst = max(ranks, key=lambda r: r.breakdown.communicating)
        comm_total = sum(r.breakdown.comm_total for r in ranks)
        metrics["ddp_exposed_comm_share"] = Metric(
            worst.breakdown.communicating, "fraction", "measured",
            f"communication not under compute, rank {worst.rank} (the most exposed of {len(ranks)})")
        metrics["ddp_comm_hidden"] = Metric(
            sum(r.breakdown.comm_overlapped for r in ranks) / comm_total if comm_total else 0.0, "fraction",
            "measured", "communication under compute / all communication, over every rank's trace")
        metrics["ddp_step_time_s"] = Metric(max(r.step_time_s for r in ranks), "s", "measured",
                                            "profiled window / steps, slowest rank")
    result = KernelsResult("kernels", job.to_dict(), environment(device.name, device.type), metrics, a, ledger,
                           unprofiled, profiled, compare, TRACE_FILE, [], ddp, skipped=skipped + clock.shortened,
                           optimizer_race=opt_race, batch_race=batch)
    result.budget = clock.record()
    if ranks:  # advice sizes DDP's buckets against the gradients
        ddp["gradient_bytes"] = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    result.advice = advise(result)
    result.elapsed_s = time.perf_counter() - t_start
    if write:
        save(job, result)
    return result


def save(job: Job, result: KernelsResult) -> Path:
    """Write result.json atomically and refresh the job\'s index page."""
    return store.save(job, INFO.key, result)
