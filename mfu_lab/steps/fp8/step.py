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
under tensorwise, rowwise and no scaling; (2) it trains the job's model from the same seed on the same
batches for ``fp8_steps`` steps under each policy (the reference precision; FP8 on the MLP; on every group
but the most sensitive; everywhere; everywhere without scaling; plus the job's own), with the divergence
watch; (3) it picks the policy that puts the most matmul FLOPs into FP8 while its loss stays within
``fp8_tolerance`` of the reference, and writes it as a job-file fragment. On a GPU with FP8 units and
torchao installed it also times the chosen policy for real (torchao float8 training under torch.compile)
against the same model without it. Everything from the emulated path is labelled ``emulated`` and makes no
speed claim; the precision ladder's figures are ``measured``.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from mfu_lab.analysis import fp8_numerics as f8
from mfu_lab.analysis import precision as pr
from mfu_lab.core.advice import Advice
from mfu_lab.core.engine.data import same_batches
from mfu_lab.core.engine.workload import build_loader, build_model, build_train_step
from mfu_lab.core.errors import JobError, JobProblem
from mfu_lab.core.job.schema import Job
from mfu_lab.core.measure import device as dev
from mfu_lab.core.measure import flops as fl
from mfu_lab.core.measure.environment import environment
from mfu_lab.core.measure.flops import count_step_flops
from mfu_lab.core.measure.timed import interleaved, run_steps, stats
from mfu_lab.core.process.budget import Clock, job_step_s
from mfu_lab.core.process.faults import guarded
from mfu_lab.core.process.progress import as_progress
from mfu_lab.core.registry import BY_KEY
from mfu_lab.core.store import step_results as store
from mfu_lab.core.store.results import Metric, StepResult
from mfu_lab.steps.fit import one_process_note
from mfu_lab.steps.fp8.precision_ladder import NOT_RUN, ladder, train_trial

INFO = BY_KEY["fp8"]
FP8_CAPABILITY = (8, 9)  # Ada / Hopper and later have FP8 tensor cores


@dataclass
class PolicyTrial:
    name: str
    groups: list[str]
    recipe: str  # tensorwise | rowwise | rowwise_with_gw_hp | none (no scaling)
    flops_share: float  # share of linear-layer FLOPs in FP8 (analytic)
    status: str  # reference | ok | diverged | off (loss beyond tolerance) | skipped
    reason: str = ""
    loss: list[float] = field(default_factory=list)
    grad_norm: list[float] = field(default_factory=list)
    stopped_at: int | None = None
    final_gap: float | None = None  # last-window mean loss / reference's - 1
    study: bool = False  # part of the scaling study, not a candidate policy


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
    """'' when this device has FP8 units, else why not."""
    if device.type != "cuda":
        return "a CPU has no FP8 matmul units (torch._scaled_mm runs on CPU, far too slowly to train with)"
    cap = torch.cuda.get_device_capability(device.index)
    if cap < FP8_CAPABILITY and not torch.version.hip:
        return f"CUDA capability {cap[0]}.{cap[1]} has no FP8 tensor cores (8.9 and up do)"
    return ""


def _policies(job: Job, groups: list[str], most_sensitive: str) -> list[tuple[str, list[str], str, bool]]:
    """(name, groups, recipe, study) for every trial."""
    mlp = [g for g in groups if "mlp" in g or "ffn" in g or "fc" in g]
    out = [("reference", [], job.fp8_recipe, False)]
    if mlp:
        out.append(("mlp only", mlp, job.fp8_recipe, False))
    if len(groups) > 1:
        out.append((f"all but {most_sensitive}", [g for g in groups if g != most_sensitive], job.fp8_recipe, False))
    out.append(("all linears", list(groups), job.fp8_recipe, False))
    if job.fp8_layers:
        out.append(("the job's fp8_layers", list(job.fp8_layers), job.fp8_recipe, False))
    for name, gs in job.fp8_policies.items():
        out.append((name, list(gs), job.fp8_recipe, False))
    other = "rowwise" if job.fp8_recipe == "tensorwise" else "tensorwise"
    out.append((f"all linears, {other}", list(groups), other, True))
    out.append(("all linears, no scaling", list(groups), "none", True))
    return out


def _check_groups(job: Job, groups: list[str]) -> None:
    problems = []
    for key, lists in (("fp8_layers", {"fp8_layers": job.fp8_layers}), ("fp8_policies", job.fp8_policies)):
        for name, gs in lists.items():
            if not isinstance(gs, list):
                problems.append(JobProblem(key, gs, f"{name}: must be a list of layer groups"))
                continue
            unknown = [g for g in gs if g not in groups]
            if unknown:
                problems.append(JobProblem(key, gs, f"{name}: unknown layer group(s) {', '.join(map(str, unknown))}; "
                                           f"this model's groups: {', '.join(groups)}"))
    if problems:
        raise JobError("the job", problems)


def _real_speed(job: Job, groups: list[str], device: torch.device, say) -> dict[str, Any]:  # pragma: no cover
    """On FP8 hardware: the chosen policy through torchao float8 training under torch.compile, against the same
    compiled model without it, timed in interleaved rounds (:func:`mfu_lab.core.measure.timed.interleaved`). The
    config pads the inner dimension (``pad_inner_dim``): the grad-weight ``_scaled_mm`` has micro_batch x seq
    (which variable-length or odd batches leave unaligned) as its inner dimension. GPU only."""
    try:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    except ImportError:
        return {"status": "skipped", "reason": "torchao is not installed (pip install torchao)"}
    config = dataclasses.replace(Float8LinearConfig.from_recipe_name(job.fp8_recipe), pad_inner_dim=True)
    out: dict[str, Any] = {"status": "ok", "recipe": job.fp8_recipe, "pad_inner_dim": True}
    bf16 = dataclasses.replace(job, dtype="bfloat16")
    timers = {}
    for label, use in (("bf16", False), ("fp8", True)):
        model = build_model(bf16).to(device).train()
        if use:
            def keep(mod, fqn):
                return f8.group_of(fqn) in groups and mod.in_features % 16 == 0 and mod.out_features % 16 == 0

            convert_to_float8_training(model, config=config, module_filter_fn=keep)
        ts = build_train_step(bf16, torch.compile(model), "cuda")
        say(f"  compiling and warming {label} (3 steps)")
        run_steps(ts, same_batches(job, 3, "cuda"), device, 3, 0)
        timers[label] = (lambda n, ts=ts: run_steps(ts, same_batches(job, n, "cuda"), device, 0, n).measured("wall_s"))
    rounds = min(3, job.steps)
    say(f"  timing bf16 and fp8 (compiled) in {rounds} interleaved rounds, {job.steps} steps each")
    walls = interleaved(timers, rounds, job.steps)
    for label, wall in walls.items():
        out[f"{label}_step_s"] = stats(wall).median  # the speedup is the medians' ratio
        out[f"{label}_steps"], out[f"{label}_total_s"] = len(wall), sum(wall)  # MFU and tokens/s: the total wall
    out["rounds"] = rounds
    out["speedup"] = out["bf16_step_s"] / out["fp8_step_s"]
    return out


def real_speed_or_failure(job: Job, groups: list[str], device: torch.device, say,
                          skipped: list[dict[str, str]]) -> dict[str, Any]:
    """The real FP8 timing, or its failure recorded with the reason: a torchao error (a version mismatch, a shape
    it refuses, an out-of-memory) never discards the emulated results measured before it."""
    try:
        return _real_speed(job, groups, device, say)
    except Exception as err:  # noqa: BLE001 - anything torchao or inductor raises
        why = f"{type(err).__name__}: {err}"[:400]
        skipped.append({"what": "FP8 speed (torchao)", "reason": why})
        if device.type == "cuda":  # pragma: no cover - GPU only
            torch.cuda.empty_cache()
        return {"status": "failed", "reason": why}


LADDER_REUSED = ("the precision ladder's float32 loss curve: the same model, seed, batches, precision and "
                 "divergence watch, so not trained a second time")


def _ladder_reference(job: Job, precision: dict[str, Any]) -> tuple[list[float], list[float], float] | None:
    """(losses, gradient norms, seconds) of the ladder's float32 curve when it is the FP8 reference's training: the
    job trains in float32 at the rung's matmul precision, and the curve ran every FP8 step without stopping."""
    r = next((r for r in precision.get("rungs", []) if r["name"] == "float32"), None)
    if (r is None or (job.dtype, job.matmul_precision) != (r["dtype"], r["matmul_precision"]) or r.get("diverged")
            or len(r.get("loss") or []) != job.fp8_steps or len(r.get("grad_norm") or []) != job.fp8_steps):
        return None
    return list(r["loss"]), list(r["grad_norm"]), r.get("loss_s") or 0.0


def _precision(job: Job, batches: list, device: dev.DeviceInfo, say, skipped: list[dict[str, str]],
               no_fp8: str = "") -> dict[str, Any]:
    """The precision ladder; an error outside any one rung is recorded, and the FP8 part still runs. ``no_fp8``:
    why no FP8 trial runs (the budget), so float32's curve is trained only if a rung needs it."""
    try:
        out = ladder(job, batches, device, say, no_fp8)
    except Exception as err:  # noqa: BLE001 - the FP8 part does not depend on the ladder
        why = f"{type(err).__name__}: {err}"[:400]
        skipped.append({"what": "precision ladder", "reason": why})
        out = {"rungs": [], "order": [], "native_bf16": None,
               "choice": {"dtype": job.dtype, "matmul_precision": job.matmul_precision, "rung": job.dtype,
                          "adopted": False, "text": f"Keep the job's precision ({job.dtype}, matmul "
                          f"{job.matmul_precision}): the precision ladder failed ({why})", "speedup": None,
                          "speedup_low": None, "speedup_high": None, "final_gap": None, "label": "measured"}}
    for r in out["rungs"]:
        if r["status"] in NOT_RUN:  # cannot run here, failed, or its matmul probe cannot reach float32's
            skipped.append({"what": f"precision {r['name']}", "reason": f"{r['status']}: {r['reason']}"
                            if r["status"] == pr.CANNOT_BE_FASTER else r["reason"]})
    return out


def _fp8_budget(job: Job, clock: Clock) -> str:
    """Why no FP8 policy can be trained within step 5's share ('' when one can, or without a budget): the float32
    reference and one policy need 2 x ``fp8_steps`` training steps at step 1's step time at least (an emulated FP8
    step takes longer still). Said once in the budget's cuts; the policies each carry it."""
    step_s, where = job_step_s(store.earlier(job, "baseline").data)
    need = 2 * job.fp8_steps * step_s
    if clock.fits(need):
        return ""
    why = (f"{max(clock.left_s(), 0.0):.0f} s of step 5's {clock.planned_s:.0f} s share left, less than the float32 "
           f"reference and one policy ({2 * job.fp8_steps} steps, about {need:.0f} s: {where})")
    clock.shorten("FP8 policy trials", why)
    return why


def advise(r: Fp8Result) -> list[Advice]:
    out = []
    pc = r.precision.get("choice")
    if pc:
        change = pc["adopted"] and (pc["dtype"], pc["matmul_precision"]) != (r.job["dtype"], r.job["matmul_precision"])
        ruled = [g["name"] for g in r.precision.get("rungs", []) if g.get("status") == pr.CANNOT_BE_FASTER]
        out.append(Advice("act" if change else "info", pc["text"], "step times of each precision in interleaved "
                          "rounds against float32 (speedup with a 95% bootstrap interval, measured) and loss curves "
                          "from the same seed and batches under the divergence watch" + (
                              f"; {', '.join(ruled)}: matmul probes beside float32's (measured), not timed"
                              if ruled else "")))
    out += [Advice("act" if r.choice.get("groups") else "info", r.choice["text"],
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
    _check_groups(job, groups)
    share = f8.group_flops_share(model)
    quiet = dataclasses.replace(job, num_workers=0, synthetic_load_ms=0.0)
    batches = list(build_loader(quiet, max(job.fp8_sensitivity_batches, job.fp8_steps), device.type))
    say(f"sensitivity: {len(groups)} layer groups on {job.fp8_sensitivity_batches} batches, 3 scalings")
    ts = build_train_step(job, model, device.type)
    sens = f8.sensitivity(model, lambda m, x, y: ts.loss(x.to(torch_device), y.to(torch_device)),
                          batches[:job.fp8_sensitivity_batches])
    scaling = f8.RECIPES[job.fp8_recipe][0]  # the sensitivity column that matches the job's recipe
    most = min(sens[scaling], key=lambda g: g.worst_snr_db).group
    del model
    no_fp8 = _fp8_budget(job, clock)
    precision = _precision(job, batches, device, say, skipped, no_fp8)

    trials: list[PolicyTrial] = []
    reference: list[float] | None = None
    plan = _policies(job, groups, most)
    if not job.thorough:  # race: the broadest policy first; once one keeps the loss, narrower ones cannot win
        plan = plan[:1] + sorted((p for p in plan[1:] if not p[3]), key=lambda p: -sum(share[g] for g in p[1]))
    last_s = 0.0  # the last trial's seconds: the next one's estimate against the budget
    passed: float | None = None  # FLOP share of the broadest policy that kept the loss (racing)
    eta = say.eta("FP8 policy trials", len(plan))
    for i, (name, gs, recipe, study) in enumerate(plan, 1):
        if passed is not None and sum(share[g] for g in gs) < passed:
            trials.append(PolicyTrial(name, gs, recipe, sum(share[g] for g in gs), "skipped",
                                      f"not run: a policy with {passed:.0%} of the linear FLOPs in FP8 already kept "
                                      "the loss, and the choice is the broadest such policy (--thorough runs it)"))
            continue
        if no_fp8:  # not even the reference and one policy fit: none is trained, each said
            trials.append(PolicyTrial(name, gs, recipe, sum(share[g] for g in gs), "skipped", "budget: " + no_fp8,
                                      study=study))
            continue
        if trials and gs and not clock.fits(last_s):  # the reference always runs: the others compare with it
            why = (f"{clock.left_s():.0f} s of the step's {clock.planned_s:.0f} s left, less than one trial "
                   f"({last_s:.0f} s)")
            trials.append(PolicyTrial(name, gs, recipe, sum(share[g] for g in gs), "skipped", "budget: " + why,
                                      study=study))
            clock.shorten(f"FP8 policy {name}", why)
            continue
        ladder_curve = None if gs else _ladder_reference(job, precision)
        if ladder_curve:  # the same training the ladder's float32 rung already ran: its curve, not a second run
            losses, norms, last_s = ladder_curve
            reference = losses
            trials.append(PolicyTrial(name, gs, recipe, 0.0, "reference", LADDER_REUSED, losses, norms))
            say(f"[{i}/{len(plan)}] {name}: {LADDER_REUSED}")
            continue
        t_trial = time.perf_counter()
        say(f"[{i}/{len(plan)}] {name}: {job.fp8_steps} steps" + (f", FP8 on {', '.join(gs)} ({recipe})" if gs
                                                                  else ", no FP8 (the reference)") + eta.tag(i - 1))
        watch = f8.Watch(reference, job.fp8_tolerance, job.fp8_window, job.fp8_spike)
        losses, norms, why, at = train_trial(job, gs, recipe, batches[:job.fp8_steps], torch_device, watch,
                                             say.heartbeat(f"  {name}", job.fp8_steps))
        t = PolicyTrial(name, gs, recipe, sum(share[g] for g in gs), "reference" if not gs else "ok", why or "",
                        losses, norms, at, study=study)
        if not gs:
            reference = losses
        elif why:
            t.status = "diverged"
        else:
            w = min(job.fp8_window, len(losses))
            t.final_gap = (sum(losses[-w:]) / w) / (sum(reference[-w:]) / w) - 1
            if t.final_gap > job.fp8_tolerance:
                t.status, t.reason = "off", f"final loss {t.final_gap:+.1%} from the reference"
        trials.append(t)
        last_s = time.perf_counter() - t_trial
        if t.status == "ok" and not study and not job.thorough:
            passed = t.flops_share if passed is None else max(passed, t.flops_share)
        say(f"  {t.status}" + (f": {t.reason}" if t.reason else "") + f"; last loss {losses[-1]:.4f}")
    if not job.thorough:
        skipped.append({"what": "FP8 scaling study (the other recipe, no scaling)",
                        "reason": "a study for the report, not a candidate policy: run with --thorough to see it"})
    eta.finish()

    good = [t for t in trials if t.status == "ok" and not t.study]
    best = max(good, key=lambda t: (t.flops_share, -len(t.groups)), default=None)
    if best:
        fragment = f"fp8_layers: [{', '.join(best.groups)}]\nfp8_recipe: {job.fp8_recipe}"
        choice = {"policy": best.name, "groups": best.groups, "recipe": job.fp8_recipe, "flops_share": best.flops_share,
                  "fragment": fragment,
                  "text": f"Train {', '.join(best.groups)} in FP8 ({job.fp8_recipe} scaling): {best.flops_share:.0%} "
                          f"of the linear-layer FLOPs, loss within {job.fp8_tolerance:.0%} of the reference over "
                          f"{job.fp8_steps} steps (final gap {best.final_gap:+.2%}). Job-file fragment: "
                          + fragment.replace("\n", "; ")}
    else:
        tried = [t for t in trials if t.groups and t.status in ("ok", "off", "diverged")]
        cut = [t.name for t in trials if t.groups and t.status == "skipped" and t.reason.startswith("budget: ")]
        why = (f"no FP8 policy kept the loss within {job.fp8_tolerance:.0%} of the reference without diverging"
               if tried else "no FP8 policy was trained")
        if cut:
            why += (f"; {', '.join(cut)} not trained: the budget ran out first (a larger --budget, or none, "
                    "trains them)")
        choice = {"policy": None, "groups": [], "recipe": job.fp8_recipe, "flops_share": 0.0, "fragment": "",
                  "text": "Keep every layer in high precision: " + why}

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
                                    f"float32 step / {pc['rung']} step, median of interleaved rounds (95% interval "
                                    f"{pc['speedup_low'] or 0:.2f}-{pc['speedup_high'] or 0:.2f})" if pc["adopted"]
                                    else "no lower precision was adopted"),
        "fp8_flops_share": Metric(choice["flops_share"], "fraction", "analytic",
                                  "linear-layer FLOPs of the chosen groups / all linear-layer FLOPs (in x out)"),
        "policies_kept": Metric(float(len(good)), "policies", "counted", "policies whose loss stayed within "
                                f"fp8_tolerance ({job.fp8_tolerance:.0%}) without diverging, of "
                                f"{sum(not t.study and t.groups != [] for t in trials)}"),
        "worst_group_snr_db": Metric(min(g.worst_snr_db for g in sens[scaling]), "dB", label,
                                     f"the most sensitive group ({most}), {scaling} scaling, worst of output, "
                                     "input-gradient and weight-gradient SNR against float32"),
        "reference_final_loss": Metric(ref_t.loss[-1] if ref_t.loss else None, "nats", "measured",
                                       f"the reference precision ({job.dtype}), step {len(ref_t.loss)}" if ref_t.loss
                                       else "not trained: " + ref_t.reason),
        "chosen_final_gap": Metric(best.final_gap if best else None, "fraction", label,
                                   "chosen policy's last-window mean loss / the reference's - 1"),
        "no_scaling_grad_underflow": Metric(max(g.grad_underflow for g in sens["none"]), "fraction", label,
                                            "largest share of nonzero output gradients that a plain cast to e5m2 "
                                            "flushes to zero"),
    }
    if speed.get("status") == "ok":  # pragma: no cover - FP8 GPUs only
        metrics["fp8_speedup"] = Metric(speed["speedup"], "x", "measured", "bf16 step / fp8 step, both compiled")
        fp8_rate = speed["fp8_steps"] / speed["fp8_total_s"]  # steps per second over the measured FP8 steps
        metrics["tokens_per_s"] = Metric(job.tokens_per_step * fp8_rate, "tokens/s", "measured",
                                         "tokens per step x steps / wall time, over the total wall time of the "
                                         "measured FP8 steps")
        chip = dev.lookup_chip(device.name)
        m0 = build_model(job).to(torch_device).train()
        x0, y0 = batches[0]
        flops = count_step_flops(m0, build_train_step(job, m0, device.type), x0.to(torch_device),
                                 y0.to(torch_device), cache_dir=job.output_root(),
                                 key_extra=fl.job_key_extra(job)).model_flops_per_step
        for peak_name in ("bf16", "fp8"):
            pk = getattr(chip, peak_name) if chip else None
            metrics[f"mfu_vs_{peak_name}_peak"] = Metric(
                fl.mfu(flops, fp8_rate, pk) if pk else None, "fraction", "measured",
                f"model FLOPs x steps / ({peak_name.upper()} datasheet peak x wall time), over the total wall time "
                "of the measured FP8 steps: MFU under FP8 is ambiguous, so both")
    result = Fp8Result("fp8", job.to_dict(), environment(device.name, device.type), metrics, path, sens, trials,
                       choice, speed, [], precision, skipped=skipped + clock.shortened)
    result.budget = clock.record()
    result.advice = advise(result)
    result.elapsed_s = time.perf_counter() - t_start
    if write:
        save(job, result)
    return result


def save(job: Job, result: Fp8Result) -> Path:
    """Write result.json atomically and refresh the job's index page."""
    return store.save(job, INFO.key, result)
