"""Step 5's real FP8 speed (measured, FP8 GPUs with torchao only): what the chosen policy buys in step time.

The emulated trials prove a policy keeps the loss but make no speed claim. On a GPU with FP8 units, the chosen
policy's groups go through torchao float8 training under torch.compile, timed against the same compiled model in
bfloat16 without it, in interleaved rounds (:func:`mfu_lab.core.measure.timed.interleaved`); the speedup is the
medians' ratio, and tokens/s and MFU (against both the bf16 and the FP8 datasheet peak, since MFU under FP8 is
ambiguous) come from the measured FP8 steps' total wall time. Any torchao failure is recorded with its reason and
never discards the emulated results measured before it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from mfu_lab.core.engine import fp8 as fp8_layers
from mfu_lab.core.engine.batches import to_device
from mfu_lab.core.engine.work import rate_metrics, same_batches
from mfu_lab.core.engine.workload import build_model, build_train_step
from mfu_lab.core.job.schema import Job
from mfu_lab.core.measure import device as dev
from mfu_lab.core.measure import flops as fl
from mfu_lab.core.measure.flops import count_step_flops
from mfu_lab.core.measure.timed import interleaved, run_steps, stats
from mfu_lab.core.store.results import Metric
from mfu_lab.steps.fp8 import group_speed


def _real_speed(job: Job, groups: list[str], device: torch.device, say) -> dict[str, Any]:  # pragma: no cover
    """On FP8 hardware: first each group of the policy probed on its own shapes (:mod:`.group_speed`), the groups
    not faster in FP8 dropped; then the kept groups through torchao float8 training under torch.compile, against
    the same compiled model without it, timed in interleaved rounds (:func:`mfu_lab.core.measure.timed.interleaved`).
    The config pads the inner dimension (``pad_inner_dim``): the grad-weight ``_scaled_mm`` has micro_batch x seq
    (which variable-length or odd batches leave unaligned) as its inner dimension. GPU only."""
    try:
        from torchao.float8 import convert_to_float8_training
    except ImportError:
        return {"status": "skipped", "reason": "torchao is not installed (pip install torchao)"}
    config = fp8_layers.float8_config(job.fp8_recipe)
    out: dict[str, Any] = {"status": "ok", "recipe": job.fp8_recipe, "pad_inner_dim": True}
    bf16 = dataclasses.replace(job, dtype="bfloat16")
    if device.type == "cuda":  # the probe times with CUDA events: FP8 units are NVIDIA's (and torchao's float8)
        rows = group_speed.probe(build_model(bf16), groups, job.micro_batch * job.seq_len, job.fp8_recipe, device,
                                 say)
        kept, dropped = group_speed.gate(rows)
    else:
        rows, kept, dropped = [], list(groups), {}
        out["group_probe_skipped"] = (f"no per-group probe on {device.type}: it times with CUDA events; every group "
                                      "of the policy is timed in the whole model")
    out.update(group_probe=rows, groups_asked=list(groups), groups_kept=kept, groups_dropped=dropped)
    if not kept:
        return out | {"status": "slower", "speedup": None,
                      "reason": "no group of the policy is faster in FP8 than in bf16 beyond the noise: "
                                + "; ".join(f"{g}: {w}" for g, w in dropped.items())}
    groups = kept
    timers = {}
    # each round draws its batches anew: in the loop's process (no DataLoader workers to start in a round's first
    # timed step) and without the job's synthetic load delay; both arms alike, they compare compute
    quiet = dataclasses.replace(job, num_workers=0, synthetic_load_ms=0.0)
    for label, use in (("bf16", False), ("fp8", True)):
        model = build_model(bf16).to(device).train()
        if use:
            convert_to_float8_training(model, config=config,
                                       module_filter_fn=lambda m, fqn: fp8_layers.is_candidate(fqn, m, groups))
        ts = build_train_step(bf16, torch.compile(model), "cuda", fp8=False)
        say(f"  compiling and warming {label} (3 steps)")
        run_steps(ts, same_batches(quiet, 3, "cuda"), device, 3, 0)
        timers[label] = (lambda n, ts=ts: run_steps(ts, same_batches(quiet, n, "cuda"), device, 0, n)
                         .measured("wall_s"))
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


def speed_metrics(job: Job, speed: dict[str, Any], device: dev.DeviceInfo,
                  batch: tuple[torch.Tensor, torch.Tensor]) -> dict[str, Metric]:  # pragma: no cover - FP8 GPUs only
    """The measured FP8 timing's metrics: speedup, tokens/s and MFU against both peaks. ``batch``: one of the
    job's batches, to count the model's FLOPs per step."""
    torch_device = device.torch_device
    metrics = {"fp8_speedup": Metric(speed["speedup"], "x", "measured", "bf16 step / fp8 step, both compiled")}
    fp8_rate = speed["fp8_steps"] / speed["fp8_total_s"]  # steps per second over the measured FP8 steps
    metrics |= rate_metrics(job, fp8_rate, "over the total wall time of the measured FP8 steps")
    chip = dev.lookup_chip(device.name)
    m0 = build_model(job).to(torch_device).train()
    x0, y0 = batch
    flops = count_step_flops(m0, build_train_step(job, m0, device.type, fp8=False), to_device(x0, torch_device),
                             to_device(y0, torch_device), cache_dir=job.output_root(),
                             key_extra=fl.job_key_extra(job)).model_flops_per_step
    for peak_name in ("bf16", "fp8"):
        pk = getattr(chip, peak_name) if chip else None
        metrics[f"mfu_vs_{peak_name}_peak"] = Metric(
            fl.mfu(flops, fp8_rate, pk) if pk else None, "fraction", "measured",
            f"model FLOPs x steps / ({peak_name.upper()} datasheet peak x wall time), over the total wall time "
            "of the measured FP8 steps: MFU under FP8 is ambiguous, so both")
    return metrics
