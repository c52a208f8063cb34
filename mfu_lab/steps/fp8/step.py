"""Step 5, precision: which precision can this job train in, layer by layer, and keep the loss curve?

``run(job)`` climbs a ladder of precisions before FP8 (:mod:`.precision_ladder`): float32 (highest matmul
precision, the reference) -> TF32 matmuls (GPUs of capability 8.0 and up; skipped with the reason elsewhere)
-> bfloat16 autocast -> float16 autocast with a loss scaler. Each rung is timed side by side with float32 in
interleaved rounds (speedup with a 95% bootstrap interval) and trains from the same seed on the same batches
under the divergence watch; the fastest rung proven faster whose loss stays within ``loss_tolerance`` is
adopted (:func:`mfu_lab.analysis.precision.judge`), else the job keeps its precision. On a CPU the step
records whether it has native bf16 (``/proc/cpuinfo`` flags): without it, bf16 autocast runs in software. Before
any rung is built, a few short matmul probes (under a second) measure each rung's rate beside float32's; a rung
that cannot reach float32's within the probes' noise is recorded as "cannot be faster here" with both rates and
is neither trained nor timed (``thorough`` still times it).

Then FP8 layer groups: (1) it records every linear layer's input and output gradient on real batches and
measures each layer group's FP8 error against float32 (signal-to-noise in dB, underflow and saturation)
under tensorwise, rowwise and no scaling (:mod:`.sensitivity`); (2) it trains the job's model from the same
seed on the same batches for ``fp8_steps`` steps under each policy (the reference precision; FP8 on the MLP;
on every group but the most sensitive; everywhere; everywhere without scaling; plus the job's own), with the
divergence watch; (3) it picks the policy that puts the most matmul FLOPs into FP8 while its loss stays within
``fp8_tolerance`` of the reference, and writes it as a job-file fragment (:mod:`.policies`). On a GPU with FP8
units and torchao installed it also times the chosen policy for real (torchao float8 training under
torch.compile) against the same model without it (:mod:`.torchao_speed`). Everything from the emulated path is
labelled ``emulated`` and makes no speed claim; the precision ladder's figures are ``measured``.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mfu_lab.analysis import fp8_numerics as f8
from mfu_lab.analysis import precision as pr
from mfu_lab.core.advice import Advice
from mfu_lab.core.engine.fp8 import fp8_units
from mfu_lab.core.engine.workload import build_loader, build_model
from mfu_lab.core.job.schema import Job
from mfu_lab.core.measure import device as dev
from mfu_lab.core.measure.environment import environment
from mfu_lab.core.process.budget import Clock
from mfu_lab.core.process.faults import guarded
from mfu_lab.core.process.progress import as_progress
from mfu_lab.core.registry import BY_KEY
from mfu_lab.core.store import step_results as store
from mfu_lab.core.store.results import Metric, StepResult
from mfu_lab.steps.fit import one_process_note
from mfu_lab.steps.fp8.policies import (
    PolicyTrial,
    check_groups,
    choose,
    kept,
    train_policies,
    trials_minimum_s,
    why_no_trial_fits,
)
from mfu_lab.steps.fp8.precision_ladder import NOT_RUN, ladder
from mfu_lab.steps.fp8.sensitivity import study
from mfu_lab.steps.fp8.torchao_speed import real_speed_or_failure, speed_metrics

INFO = BY_KEY["fp8"]


@dataclass
class Fp8Result(StepResult):
    step: str
    job: dict[str, Any]
    environment: dict[str, Any]
    metrics: dict[str, Metric]
    path: str  # emulated | fp8 hardware
    sensitivity: dict[str, list[f8.GroupSensitivity]]
    trials: list[PolicyTrial]
    choice: dict[str, Any]
    speed: dict[str, Any]
    advice: list[Advice]
    precision: dict[str, Any] = field(default_factory=dict)  # the precision ladder (absent from older results)


Result = Fp8Result  # the step contract: every step module names its result class Result


def fp8_hardware(device: dev.DeviceInfo) -> str:
    """'' when this device has FP8 units, else why not (:func:`mfu_lab.core.engine.fp8.fp8_units`)."""
    return fp8_units(device.type, device.index)


def _precision(job: Job, batches: list, device: dev.DeviceInfo, say, skipped: list[dict[str, str]],
               no_fp8: str = "", clock: Clock | None = None, reserve_s: float = 0.0) -> dict[str, Any]:
    """The precision ladder; an error outside any one rung is recorded, and the FP8 part still runs. ``no_fp8``:
    why no FP8 trial runs (the budget), so the reference's curve is trained only if a rung needs it. ``clock``
    (step 5's) and ``reserve_s`` (seconds kept for the FP8 trials): the ladder's share of the budget."""
    try:
        out = ladder(job, batches, device, say, no_fp8, clock, reserve_s)
    except Exception as err:  # noqa: BLE001 - the FP8 part does not depend on the ladder
        why = f"{type(err).__name__}: {err}"[:400]
        skipped.append({"what": "precision ladder", "reason": why})
        out = {"rungs": [], "order": [], "native_bf16": None,
               "choice": {"dtype": job.dtype, "matmul_precision": job.matmul_precision, "rung": job.dtype,
                          "adopted": False, "text": f"Keep the job's precision ({job.dtype}, matmul "
                          f"{job.matmul_precision}): the precision ladder failed ({why})", "speedup": None,
                          "speedup_low": None, "speedup_high": None, "final_gap": None, "label": "measured"}}
    for r in out["rungs"]:
        if r["reason"].startswith("budget: "):  # said once, in the budget's cuts (clock.shortened)
            continue
        if r["status"] in NOT_RUN:  # cannot run here, failed, or its matmul probe cannot reach float32's
            skipped.append({"what": f"precision {r['name']}", "reason": f"{r['status']}: {r['reason']}"
                            if r["status"] == pr.CANNOT_BE_FASTER else r["reason"]})
    return out


def advise(r: Fp8Result) -> list[Advice]:
    out = []
    pc = r.precision.get("choice")
    if pc:
        change = pc["adopted"] and (pc["dtype"], pc["matmul_precision"]) != (r.job["dtype"], r.job["matmul_precision"])
        ruled = [g["name"] for g in r.precision.get("rungs", []) if g.get("status") == pr.CANNOT_BE_FASTER]
        ref = r.precision.get("reference", "float32")
        out.append(Advice("act" if change else "info", pc["text"], "step times of each precision in interleaved "
                          f"rounds against {ref} (speedup with a 95% bootstrap interval, measured) and loss curves "
                          "from the same seed and batches under the divergence watch" + (
                              f"; {', '.join(ruled)}: matmul probes beside {ref}'s (measured), not timed"
                              if ruled else "")))
    emulated = r.path == "emulated"  # numerics only: nothing here to time, so nothing to adopt (analysis.tuning)
    out += [Advice("act" if r.choice.get("groups") and not emulated else "info", r.choice["text"] + (
        "; not adopted here: this device emulates FP8's numerics only, and has no FP8 speed to give"
        if r.choice.get("groups") and emulated else ""),
                   "loss curves from the same seed and batches, under the divergence watch")]
    sens = r.sensitivity.get(r.job["fp8_recipe"] if r.job["fp8_recipe"] != "rowwise_with_gw_hp" else "rowwise", [])
    if sens:
        worst = min(sens, key=lambda g: g.worst_snr_db)
        out.append(Advice("look", f"Keep '{worst.group}' in high precision first if any group must stay out: it "
                          "loses the most to FP8", f"worst SNR {worst.worst_snr_db:.1f} dB (emulated)"))
    none = next((t for t in r.trials if t.recipe == "none"), None)
    if none and none.status in ("diverged", "off"):
        out.append(Advice("info", "Without scaling, FP8 training goes wrong here: a scaler is not optional",
                          f"no-scaling trial: {none.reason}"))
    lost = max(r.sensitivity.get("none", []), key=lambda g: g.grad_underflow, default=None)
    if lost and lost.grad_underflow > 0.5:
        out.append(Advice("info", f"Without scaling, most of the gradients of '{lost.group}' cast to zero: a "
                          "scaler is not optional, even where a short loss curve does not show it yet",
                          f"{lost.grad_underflow:.1%} of its output gradients underflow e5m2; gradient SNR "
                          f"{min(lost.grad_input_snr_db, lost.grad_weight_snr_db):.1f} dB (emulated)"))
    ref = r.trials[0].loss if r.trials else []
    if ref and max(ref) - min(ref) < 0.01 * abs(ref[0]):
        out.append(Advice("look", "The reference loss barely moves over the trial window (random synthetic tokens "
                          "cannot be learned), so the loss curves are weak evidence: judge by the sensitivity "
                          "table too, and confirm on real data over a longer window",
                          f"reference loss {r.trials[0].loss[0]:.3f} -> {r.trials[0].loss[-1]:.3f}"))
    if r.path == "emulated":
        out.append(Advice("info", "FP8 numerics were emulated on this device: the policy is sound, but its speed "
                          "must be measured on FP8 hardware (capability 8.9+ with torchao)", r.speed.get("reason", "")))
    return out


@guarded("fp8")
def run(job: Job, progress=None, write: bool = True) -> Fp8Result:
    """Choose a precision (the ladder up to 16 bits) and an FP8 policy for the job; see the module docstring."""
    t_start = time.perf_counter()
    clock = Clock.for_step(job, INFO.key)
    say = as_progress(progress)
    device = dev.resolve_device(job.device)
    torch_device = device.torch_device
    skipped: list[dict[str, str]] = []
    note = one_process_note(job, "precision ladder and FP8 trials",
                            "under FSDP2 the MixedPrecisionPolicy (fsdp_param_dtype, fsdp_reduce_dtype) replaces "
                            "autocast, and under TP or PP each rank runs its shard at the same precision")
    if note:
        skipped.append(note)
    no_hw = fp8_hardware(device)
    path = "emulated" if no_hw else "fp8 hardware"
    label = "emulated"  # the loss curves and errors always come from emulation; only speed can be measured

    model = build_model(job).to(torch_device).train()
    groups = list(f8.linear_groups(model))
    check_groups(job, groups)
    share = f8.group_flops_share(model)
    quiet = dataclasses.replace(job, num_workers=0, synthetic_load_ms=0.0)
    batches = list(build_loader(quiet, max(job.fp8_sensitivity_batches, job.fp8_steps), device.type))
    sens = study(job, model, batches, device, say)
    del model
    no_fp8 = why_no_trial_fits(job, clock)
    # the ladder's share: what is left, less the FP8 trials' minimum when they fit and FP8 runs here
    # (ladder_share.fit). Without FP8 units the trials are numerics only (emulated: nothing step 7 can time),
    # so the ladder's rungs, real speed, come first and the trials take what they leave
    reserve = 0.0 if no_fp8 or no_hw or clock.left_s() is None else trials_minimum_s(job)[0]
    precision = _precision(job, batches, device, say, skipped, no_fp8, clock, reserve)
    trials = train_policies(job, groups, sens.most, share, batches, torch_device, precision, clock, no_fp8, say,
                            skipped)
    best, choice = choose(job, trials)

    if no_hw:
        speed = {"status": "skipped", "reason": no_hw}
        skipped.append({"what": "FP8 speed", "reason": no_hw})
    elif best:  # pragma: no cover - FP8 GPUs only
        speed = real_speed_or_failure(job, best.groups, torch_device, say, skipped)
    else:
        speed = {"status": "skipped", "reason": "no policy chosen"}
    ref_t = trials[0]
    pc = precision["choice"]
    metrics = {
        "precision_speedup": Metric(pc["speedup"] if pc["adopted"] else None, "x", "measured",
                                    f"{precision.get('reference', 'float32')} step / {pc['rung']} step, median of "
                                    "interleaved rounds (95% interval "
                                    f"{pc['speedup_low'] or 0:.2f}-{pc['speedup_high'] or 0:.2f})" if pc["adopted"]
                                    else "no lower precision was adopted"),
        "fp8_flops_share": Metric(choice["flops_share"], "fraction", "analytic",
                                  "linear-layer FLOPs of the chosen groups / all linear-layer FLOPs (in x out)"),
        "policies_kept": Metric(float(len(kept(trials))), "policies", "counted", "policies whose loss stayed within "
                                f"fp8_tolerance ({job.fp8_tolerance:.0%}) without diverging, of "
                                f"{sum(not t.study and t.groups != [] for t in trials)}"),
        "worst_group_snr_db": Metric(sens.worst_snr_db, "dB", label,
                                     f"the most sensitive group ({sens.most}), {sens.scaling} scaling, worst of "
                                     "output, input-gradient and weight-gradient SNR against float32"),
        "reference_final_loss": Metric(ref_t.loss[-1] if ref_t.loss else None, "nats", "measured",
                                       f"the reference precision ({job.dtype}), step {len(ref_t.loss)}" if ref_t.loss
                                       else "not trained: " + ref_t.reason),
        "chosen_final_gap": Metric(best.final_gap if best else None, "fraction", label,
                                   "chosen policy's last-window mean loss / the reference's - 1"),
        "no_scaling_grad_underflow": Metric(sens.no_scaling_underflow, "fraction", label,
                                            "largest share of nonzero output gradients that a plain cast to e5m2 "
                                            "flushes to zero"),
    }
    if speed.get("status") == "ok":  # pragma: no cover - FP8 GPUs only
        metrics.update(speed_metrics(job, speed, device, batches[0]))
    result = Fp8Result("fp8", job.to_dict(), environment(device.name, device.type), metrics, path,
                       sens.by_scaling, trials, choice, speed, [], precision, skipped=skipped + clock.shortened)
    result.budget = clock.record()
    result.advice = advise(result)
    result.elapsed_s = time.perf_counter() - t_start
    if write:
        save(job, result)
    return result


def save(job: Job, result: Fp8Result) -> Path:
    """Write result.json atomically and refresh the job's index page."""
    return store.save(job, INFO.key, result)
