"""Step 2, attention and communication: what do a fused attention kernel and bucketed,
overlapped gradient all-reduce give back?

``run(job)`` (1) checks every attention implementation on this device against the
unfused form in float32, times attention alone and the whole training step with
each, and (2) runs data-parallel training through torchrun across DDP bucket sizes,
communication hooks and gradient_as_bucket_view, and FSDP2 candidates (one knob at a
time from the job's own settings, or their product: ``comm_screen``), with an
all-reduce bandwidth benchmark. Every figure is measured here. Writes
``<out>/<job>/02_attention_and_comm/result.json``.

At world size 1 (one GPU, ``nproc_per_node: 1``) no rank exchanges gradients: the DDP half does not run (no
launch, no time planned for it: the attention half plans with the whole share), and the result records why
(:func:`mfu_lab.steps.attention_comm.comm_race.one_rank_skip`), with no DDP rows, race or figure.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mfu_lab.analysis import racing
from mfu_lab.analysis.dp_family import LOSSY_HOOKS
from mfu_lab.core.advice import Advice
from mfu_lab.core.engine.batches import to_device
from mfu_lab.core.engine.workload import GPT, build_loader, build_model, build_train_step
from mfu_lab.core.job.schema import Job
from mfu_lab.core.measure import device as dev
from mfu_lab.core.measure import flops as fl
from mfu_lab.core.measure.environment import environment
from mfu_lab.core.measure.flops import count_step_flops
from mfu_lab.core.measure.ledger import Ledger, hardware_flops
from mfu_lab.core.process.budget import Clock
from mfu_lab.core.process.faults import guarded
from mfu_lab.core.process.progress import as_progress
from mfu_lab.core.registry import BY_KEY
from mfu_lab.core.store import step_results as store
from mfu_lab.core.store.nodes import launcher_folder
from mfu_lab.core.store.results import Metric, StepResult
from mfu_lab.steps.attention_comm.attention_race import (
    IMPOSSIBLE_SHARE,
    JOB_IMPL,
    AttentionRow,
    _pick,
    attention_section,
)
from mfu_lab.steps.attention_comm.comm_race import confirm_pick, ddp_half_runs, job_config, race_ddp, skipped_sweep
from mfu_lab.steps.attention_comm.comm_rows import (
    DDP_DEFAULT,
    CommRow,
    comm_rows_of,
    config_of,
    ddp_ledger_of,
    loss_check,
)
from mfu_lab.steps.baseline.reference import step1_reference
from mfu_lab.workers.comm_configs import config_key, config_name, fsdp_job_keys, is_fsdp, screened_configs
from mfu_lab.workers.launch import world_layout

INFO = BY_KEY["attention_comm"]


@dataclass
class AttentionCommResult(StepResult):
    step: str
    job: dict[str, Any]
    environment: dict[str, Any]
    metrics: dict[str, Metric]
    baseline: dict[str, Any]  # where the comparison point came from, and its figures
    attention: list[AttentionRow]
    comm_layout: dict[str, Any]
    comm: list[CommRow]
    allreduce: list[dict]
    ledger: Ledger | None
    recommendation: dict[str, Any]
    advice: list[Advice]
    races: dict[str, racing.RaceLog | None] = dataclasses.field(default_factory=dict)  # how each sweep ran


Result = AttentionCommResult  # the step contract: every step module names its result class Result



def _baseline_reference(job: Job, device_name: str) -> dict | None:
    """Step 1's figures this step compares with, when it ran on this device."""
    ref = step1_reference(job, device_name)
    keys = ("source", "mfu", "step_mean_s", "step_median_s", "peak", "peak_source", "peak_note")
    return {k: ref[k] for k in keys} if ref else None


@guarded("attention_comm")
def run(job: Job, progress=None, write: bool = True) -> AttentionCommResult:
    t_start = time.perf_counter()
    clock = Clock.for_step(job, INFO.key)
    say = as_progress(progress)
    device = dev.resolve_device(job.device)
    torch_device = device.torch_device
    skipped: list[dict[str, str]] = []
    nnodes, nproc = world_layout(job, device.type)  # before any work: a world of one rank has no DDP half
    ddp, no_ddp = ddp_half_runs(job, device.type)
    one_rank = nnodes * nproc < 2

    model = build_model(job).to(torch_device).train()
    x, y = next(iter(build_loader(dataclasses.replace(job, num_workers=0, synthetic_load_ms=0.0), 1, device.type)))
    flops = count_step_flops(model, build_train_step(job, model, device.type), to_device(x, torch_device),
                             to_device(y, torch_device), cache_dir=job.output_root(),
                             key_extra=fl.job_key_extra(job))
    ref = _baseline_reference(job, device.name)
    if ref:
        peak = ref["peak"]
        peak_label = (ref["peak_source"], ref["peak_note"] + " (as in step 1)")
    else:
        p = dev.resolve_peak(device, job.dtype, job.peak_flops, job.matmul_precision)
        peak, peak_label = p.flops_per_s, (p.source, p.note)
    fps = flops.model_flops_per_step

    # ---- attention
    att_race = None
    if isinstance(model, GPT):
        rows, att_race = attention_section(job, device, torch_device, fps, peak, say, clock, ddp_half=ddp)
    else:
        rows = []
        skipped.append({"what": "attention comparison", "reason": "a user model's attention cannot be swapped by "
                        "mfu-lab; only the communication sweep runs"})
    ok_rows = [r for r in rows if r.status == "ok"]
    job_impl = next((r for r in ok_rows if r.name == JOB_IMPL[job.attention]), None)
    if ref is None:
        src = "step 1 has not run on this device: the baseline is the job's own attention, measured here"
        ref = {"source": src, "mfu": job_impl.mfu if job_impl else None,
               "step_median_s": job_impl.step_median_s if job_impl else None}
        skipped.append({"what": "step 1 baseline", "reason": src})
    for r in ok_rows:  # side by side in this run, against the job's own attention
        r.speedup = job_impl.step_median_s / r.step_median_s if job_impl else None
    # Only a different kernel can be a real change: a row sharing a timed row's kernel was not timed again.
    best_att = _pick(ok_rows, job_impl)
    for r in rows:
        if r.status == "same kernel":
            skipped.append({"what": f"timing {r.name}'s training step", "reason": r.reason})

    # ---- communication
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    del model  # the ranks share this GPU: the launcher keeps no model on it (launch() empties the allocator's cache)
    if one_rank:  # world size 1: nothing launched, nothing timed, no figure; said once, with why
        say(f"communication: skipped, {no_ddp}")
        sweep, comm_rows, best_comm, ledger, race = skipped_sweep(job, device.type, no_ddp), [], None, None, None
    else:
        sweep, comm_rows, best_comm, ledger, race = _communication(job, device.type, grad_bytes, flops, peak, best_att,
                                                                   job_impl, clock, say)
    if sweep.layout.get("skipped"):
        skipped.append({"what": "DDP sweep and all-reduce benchmark", "reason": sweep.layout["skipped"]})
    if sweep.layout.get("fp8", {}).get("why_not"):  # the ranks trained every configuration without FP8
        skipped.append({"what": "fp8_layers in the data-parallel ranks", "reason": sweep.layout["fp8"]["why_not"]})

    rec = _recommend(job, best_att, best_comm, ref, race.confirmation if race else None)
    metrics = _metrics(ref, best_att, job_impl, best_comm, ledger, sweep, peak, peak_label)
    result = AttentionCommResult("attention_comm", job.to_dict(), environment(device.name, device.type), metrics, ref,
                                 rows, sweep.layout | {"launches": sweep.launches}, comm_rows, sweep.allreduce, ledger,
                                 rec, [], skipped=skipped)
    result.races = {"attention": att_race, "ddp": race}  # ddp None: the DDP half did not run (world size 1)
    result.skipped += clock.shortened
    result.budget = clock.record()
    result.advice = advise(result)
    result.elapsed_s = time.perf_counter() - t_start
    if write:
        save(job, result)
    return result


def _communication(job: Job, device_type: str, grad_bytes: int, flops, peak: float, best_att: AttentionRow | None,
                   job_impl: AttentionRow | None, clock: Clock, say) -> tuple:
    """Step 2's DDP half, two ranks or more: (the sweep, its rows, the recommended row or None, the data-parallel
    ledger or None, how the race ran)."""
    fps = flops.model_flops_per_step
    n_configs = len(screened_configs(job, job_config(job)))
    screen = ("one knob at a time from the job's own settings (comm_screen: factors)" if job.comm_screen == "factors"
              else "every combination of the comm_* lists")
    say(f"communication: {n_configs} configurations, " + ("each measured in full (thorough)" if job.thorough else
        f"{screen}, raced: {job.race_steps} steps each, then the survivors in full"))
    done = {"n": 0, "total": n_configs, "eta": say.eta("communication configurations", n_configs), "cfg": "",
            "full": set()}
    beat = say.heartbeat("  comm")  # inside a configuration and while the ranks start: a line at least every GAP_S

    def on_event(ev):
        kind = ev["event"]
        if kind == "start":
            done["cfg"] = config_name(ev["config"])
            beat.restart()
        elif kind == "step":
            beat.beat(ev["done"], ev["total"], f"{done['cfg']}, steps")
        elif kind == "quiet":  # workers.launch.watch: no event from the ranks for a while (start-up, a long step)
            beat.beat(what=f"{done['cfg'] or 'starting the ranks'}, no event from the ranks for {ev['quiet_s']:.0f} s")
        elif kind == "round" and ev.get("number") == 1 and ev.get("kept"):  # the race's final round counts on
            done["total"] += len(set(ev["kept"]) - done["full"])  # the references were measured in full already
            done["eta"].total = done["total"]
        if kind in ("done", "unsupported", "failed", "hung", "skipped", "dropped"):  # one line per configuration
            done["n"] += 1
            c = ev["config"]
            if kind == "done" and not ev.get("screen"):
                done["full"].add(config_name(c))
            took = "" if kind != "done" else (
                f", {statistics.median(ev['wall_s']) * 1e3:.0f} ms/step" + (" (first round)" if ev.get("screen") else
                f" ({statistics.median(ev['no_sync_wall_s']) * 1e3:.0f} without communication)"))
            what = config_name(c) if is_fsdp(c) else (f"{c['hook']}, bucket {c['bucket_mb']} MB, "
                                                     f"gradient_as_bucket_view={c['grad_as_bucket_view']}")
            why = ""
            if kind in ("skipped", "dropped") and ev.get("error") != done.get("why"):  # each reason once, first
                done["why"] = why = ev.get("error", "")
            say(f"  comm [{done['n']}/{done['total']}] {what}: {kind}{took}" + (f" ({why})" if why else "")
                + done["eta"].tag(min(done["n"], done["total"])))
            beat.said()

    work = launcher_folder(job.step_dir(INFO.folder) / "ddp")  # one per node's launcher
    sweep, race, configs = race_ddp(job, device_type, best_att.name if best_att else None, work, on_event,
                                    grad_bytes, DDP_DEFAULT, clock)
    say(f"communication: {race.text()}")
    world = sweep.layout["world_size"]
    peak_total = peak * world if device_type == "cuda" else peak  # CPU ranks share one CPU's cores
    comm_rows = comm_rows_of(configs, sweep, fps, peak_total, world)
    good = [r for r in comm_rows if r.status == "ok"]
    ddp_default = next((r for r in good if (r.hook, float(r.bucket_mb), r.grad_as_bucket_view) == DDP_DEFAULT), None)
    best_comm = _pick(loss_check(good, ddp_default, job.loss_tolerance), ddp_default)
    decided = sweep.confirm  # the worker's pick, by the same rule on rank 0's figures, the same on every node
    if decided is not None and "error" not in decided and ddp_default is not None:
        best_comm = next((r for r in good if config_name(config_of(r)) == decided.get("candidate")), ddp_default)
    if best_comm is not None and ddp_default is not None and best_comm is not ddp_default:
        say(f"communication: {config_name(config_of(best_comm))} led; measured again beside DDP's defaults, "
            "alternating")
        race.confirmation = confirm_pick(job, device_type, best_att.name if best_att else None, sweep,
                                         config_of(ddp_default), config_of(best_comm), work, clock,
                                         max(ddp_default.step_median_s, best_comm.step_median_s), say)
        say(f"communication: {race.confirmation.text()}")
        if not race.confirmation.proven:
            best_comm = ddp_default
    ledger = None
    if best_comm:
        ev = sweep.outcomes[config_key(config_of(best_comm))]
        # the FLOP count is the job's own attention's: its recompute share holds when the ranks ran that kernel
        own = best_att is None or best_att is job_impl
        ledger = ddp_ledger_of(best_comm, ev, world, hardware_flops(flops) if own else None,
                             "" if own else f"the ranks ran {best_att.name}, the FLOPs were counted with the job's "
                             "own attention")
    return sweep, comm_rows, best_comm, ledger, race


def _recommend(job: Job, best_att: AttentionRow | None, best_comm: CommRow | None, ref: dict,
               confirmation: racing.Confirmation | None = None) -> dict:
    rec: dict[str, Any] = {}
    if best_att:
        rec["attention"] = best_att.name
        origin = "step 1" if ref["source"].startswith("step 1 result") else "the job's attention, measured here"
        mfu_change = f"; MFU {ref['mfu']:.1%} ({origin}) -> {best_att.mfu:.1%}" if ref.get("mfu") else ""
        if best_att.name == JOB_IMPL[job.attention]:
            rec["attention_text"] = (f"Keep the job's attention ({best_att.name}): no other implementation was "
                                     f"faster beyond the noise (p10-p90 ranges overlap){mfu_change}.")
        else:
            rec["attention_text"] = (f"Switch attention to {best_att.name}: step {best_att.step_median_s * 1e3:.1f} "
                                     f"ms, {best_att.speedup:.2f}x the job's own attention in the same run"
                                     f"{mfu_change}.")
        rec["job_fragment"] = {"attention": "unfused" if best_att.name == "unfused" else "sdpa"}
    if best_comm and best_comm.kind == "fsdp":  # a layout change: dp_mode fsdp and its keys (tuned.yaml, step 7)
        rec["comm"] = {"kind": "fsdp", "hook": best_comm.hook, "bucket_cap_mb": 0.0, "gradient_as_bucket_view": False,
                       "job_keys": fsdp_job_keys(config_of(best_comm))}
        gap = f", final loss {best_comm.loss_gap:.2%} from DDP's defaults'" if best_comm.loss_gap is not None else ""
        confirmed = f"; {confirmation.text()}" if confirmation is not None else ""
        rec["comm_text"] = (f"Train with FSDP2 instead of DDP ({best_comm.hook}; job keys "
                            + ", ".join(f"{k}: {v}" for k, v in rec["comm"]["job_keys"].items())
                            + f"): step {best_comm.step_median_s * 1e3:.1f} ms, exposed communication "
                            f"{(best_comm.exposed_share or 0):.1%} of the step{gap} (within loss_tolerance "
                            f"{job.loss_tolerance:.0%}){confirmed}. A layout change: step 7 verifies it under "
                            "torchrun beside the original job.")
    elif best_comm:
        rec["comm"] = {"hook": best_comm.hook, "bucket_cap_mb": best_comm.bucket_mb,
                       "gradient_as_bucket_view": best_comm.grad_as_bucket_view}
        figures = (f"step {best_comm.step_median_s * 1e3:.1f} ms, exposed communication "
                   f"{(best_comm.exposed_share or 0):.1%} of the step, DDP MFU {best_comm.mfu:.1%}")
        if best_comm.hook in LOSSY_HOOKS:
            figures += ("; this hook compresses gradients (lossy), so confirm the loss curve matches before "
                        "adopting it")
        best = (best_comm.hook, float(best_comm.bucket_mb), best_comm.grad_as_bucket_view)
        rec["comm"]["keep"] = best == (job.ddp_hook, float(job.ddp_bucket_mb), job.ddp_grad_as_bucket_view)
        if best == DDP_DEFAULT:
            why = ("no configuration was faster beyond the noise" if confirmation is None else
                   f"{confirmation.candidate} led the sweep" + (", but measured again beside them: " if
                                                                confirmation.status == "ok" else "; ")
                   + confirmation.text())
            head = ("Keep DDP's defaults (bucket_cap_mb=25, no hook)" if rec["comm"]["keep"] else
                    f"Use DDP's defaults (bucket_cap_mb=25, no hook, gradient_as_bucket_view=False), not the job's "
                    f"(bucket_cap_mb={job.ddp_bucket_mb:g}, hook {job.ddp_hook}, gradient_as_bucket_view="
                    f"{job.ddp_grad_as_bucket_view})")
            rec["comm_text"] = f"{head}: {why}; {figures}."
        else:
            confirmed = f"; {confirmation.text()}" if confirmation is not None else ""
            rec["comm_text"] = (f"Use DDP(bucket_cap_mb={best_comm.bucket_mb}, gradient_as_bucket_view="
                                f"{best_comm.grad_as_bucket_view}) with hook '{best_comm.hook}': {figures}"
                                f"{confirmed}.")
    return rec


def _metrics(ref, best_att, job_impl, best_comm, ledger, sweep, peak, peak_label) -> dict[str, Metric]:
    def m(v, unit, src="measured", note=""):
        return Metric(v, unit, src, note)

    bus = max((r["busbw_gbps"] for r in sweep.allreduce), default=None)
    return {
        "mfu": m(best_att.mfu if best_att else (ref.get("mfu")), "fraction", "measured",
                 "single process with the recommended attention implementation: model FLOPs x steps / (peak x wall "
                 "time), over the total wall time of the measured steps (as step 1)"),
        "baseline_mfu": m(ref.get("mfu"), "fraction", "measured", ref["source"]),
        "attention_speedup": m(best_att.speedup if best_att else None, "x", "measured",
                               "job's own attention step time / recommended attention's, side by side in one run"),
        "best_attention_step_median_s": m(best_att.step_median_s if best_att else None, "s"),
        "attention_share": m(job_impl.attention_share if job_impl else None, "fraction", "measured",
                             "n_layers x attention forward+backward / step time, job's own attention"
                             + (f"; {IMPOSSIBLE_SHARE}" if job_impl and (job_impl.attention_share or 0) > 1 else "")),
        "ddp_mfu": m(best_comm.mfu if best_comm else None, "fraction", "measured",
                     "recommended DDP configuration: ranks x model FLOPs x steps / (total peak x wall time), over the "
                     "total wall time of the measured steps"),
        "ddp_step_median_s": m(best_comm.step_median_s if best_comm else None, "s"),
        "exposed_comm_share": m(best_comm.exposed_share if best_comm else None, "fraction", "measured",
                                "recommended DDP configuration: (step - no_sync step) / step"),
        "structure_loss": m(ledger.get("structure").fraction if ledger else None, "fraction"),
        "allreduce_busbw_max_gbps": m(bus, "GB/s", "measured", "all-reduce bus bandwidth, largest over sizes "
                                      "(nccl-tests definition: algbw x 2(n-1)/n)"),
        "peak_flops_per_s": Metric(peak, "FLOP/s", peak_label[0], peak_label[1]),
    }


def advise(r: AttentionCommResult) -> list[Advice]:
    out = []
    rec = r.recommendation
    if rec.get("attention_text"):  # keeping the job's own attention is nothing to do: info, not act
        keep = rec.get("attention") == JOB_IMPL[r.job["attention"]]
        out.append(Advice("info" if keep else "act", rec["attention_text"],
                          "correct implementations timed side by side"))
    wrong = [a.name for a in r.attention if a.status == "wrong"]
    if wrong:
        out.append(Advice("look", f"Wrong results from: {', '.join(wrong)}; they are never recommended.",
                          "relative error above tolerance against unfused float32"))
    if rec.get("comm_text"):
        keep = (rec.get("comm") or {}).get("keep") is True  # the job's own DDP settings won: nothing to change
        out.append(Advice("info" if keep else "act", rec["comm_text"],
                          "DDP configurations and FSDP2 candidates timed in one launch, DDP's ranks in sync; a change "
                          "is recommended only when its p10-p90 range clears the default's and its final loss stays "
                          "within loss_tolerance of the default's"))
    fp8 = r.comm_layout.get("fp8") or {}
    if fp8.get("text"):  # every configuration trained alike: with the job's FP8, or all without it
        out.append(Advice("look" if fp8.get("why_not") else "info", f"FP8 in the data-parallel ranks: {fp8['text']}.",
                          "fp8_layers in the job file, converted before each configuration's DDP or FSDP2 wrapper"))
    best = r.metric("exposed_comm_share")
    if best is not None and best > 0.15:
        out.append(Advice("look", "Exposed communication stays above 15% of the step even at the best setting: "
                          "larger micro-batches (more compute to hide behind), compression hooks on NCCL, or "
                          "a placement with faster links (step 6).", f"exposed share {best:.1%}"))
    own = next((a for a in r.attention if a.status == "ok" and a.name == JOB_IMPL[r.job["attention"]]), None)
    step1 = r.baseline.get("step_mean_s")  # MFU rests on the mean step time, outliers included
    if own and step1 and r.baseline["source"].startswith("step 1 result") and not (
            own.step_p10_s <= step1 <= own.step_p90_s):
        out.append(Advice("look", "Step 1 and this step disagree on the same configuration, so the MFU change "
                          "against step 1 mixes in run-to-run noise (a busy machine in one of the runs); trust the "
                          "side-by-side comparisons made within this step.",
                          f"step 1 mean step {step1 * 1e3:.0f} ms vs median {own.step_median_s * 1e3:.0f} ms here "
                          f"(p10-p90 {own.step_p10_s * 1e3:.0f}-{own.step_p90_s * 1e3:.0f} ms)"))
    bad = [c for c in r.comm if c.status in ("hung", "failed", "out of sync")]
    if bad:
        out.append(Advice("look", "Some DDP configurations hung, failed or lost sync; see the table for errors "
                          "and each rank's stderr.", f"{len(bad)} configuration(s)"))
    if r.comm_layout.get("skipped"):
        out.append(Advice("info", "No data parallelism was tuned: " + r.comm_layout["skipped"],
                          f"world size {r.comm_layout.get('world_size')}"))
    elif r.comm_layout.get("backend") == "gloo":
        out.append(Advice("info", "Two gloo processes on one CPU share its cores and memory: communication here "
                          "is shared-memory traffic, far from a GPU cluster's network. Read the relative ranking "
                          "of settings, not the absolute shares.", f"world size {r.comm_layout.get('world_size')}"))
    return out


def save(job: Job, result: AttentionCommResult) -> Path:
    """Write result.json atomically and refresh the job\'s index page."""
    return store.save(job, INFO.key, result)
