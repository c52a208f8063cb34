"""Activation checkpointing's three settings side by side: none, selective, full. Not part of the test suite.

    python benchmarks/bench_checkpoint.py [--job parameters/default.yaml] [--micro-batch 8] [--rounds 5]

Prints, measured in this one run on the job's model (the reference gpt) and batches:
  1. the training step's median time of each setting, in interleaved rounds (ABAB..., so drift hits all alike),
     and each against no checkpoint (measured);
  2. the activation bytes each keeps, from the placement model's formula (analytic) and, on a GPU, the step's
     torch.cuda.max_memory_allocated (measured);
  3. hardware FLOPs per step against model FLOPs (analytic, core.measure.flops), the recompute each costs.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from mfu_lab.analysis.placement import model as pl  # noqa: E402
from mfu_lab.core.engine.workload import build_loader, build_model, build_train_step  # noqa: E402
from mfu_lab.core.job.schema import load_job  # noqa: E402
from mfu_lab.core.measure import device as dev  # noqa: E402
from mfu_lab.core.measure.flops import count_step_flops  # noqa: E402
from mfu_lab.core.measure.timed import run_steps  # noqa: E402

SETTINGS = {"none": {"activation_checkpointing": False},
            "selective": {"activation_checkpointing": True, "checkpoint_policy": "selective"},
            "full": {"activation_checkpointing": True, "checkpoint_policy": "full"}}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--job", default=str(ROOT / "parameters" / "default.yaml"))
    ap.add_argument("--micro-batch", type=int, default=0, help="0: the job's")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=3, help="timed steps per setting per round")
    args = ap.parse_args()
    job = load_job(Path(args.job))
    if args.micro_batch:
        job = dataclasses.replace(job, micro_batch=args.micro_batch)
    device = dev.resolve_device(job.device)
    td = device.torch_device
    print(f"device: {device.name}; job {job.job_name}: {job.n_layers} layers, d_model {job.d_model}, seq_len "
          f"{job.seq_len}, micro_batch {job.micro_batch}, {job.dtype}")
    runs, mem, flops = {}, {}, {}
    for name, keys in SETTINGS.items():
        j = dataclasses.replace(job, **keys)
        model = build_model(j).to(td).train()
        step = build_train_step(j, model, device.type)
        batches = list(build_loader(j, 2, device.type))
        x, y = batches[0]
        fr = count_step_flops(model, step, x.to(td), y.to(td))
        flops[name] = fr.hardware_flops_per_step / fr.model_flops_per_step
        if device.type == "cuda":  # pragma: no cover - GPU only
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats(td)
        run_steps(step, iter(batches), td, 2, 0)  # warm-up
        if device.type == "cuda":  # pragma: no cover - GPU only
            mem[name] = torch.cuda.max_memory_allocated(td)
        runs[name] = (step, batches, [])
        shape = pl.Shape(job.n_layers, job.n_heads, job.d_model, job.seq_len, job.micro_batch, 0.0, 0.0,
                         4 if job.dtype == "float32" else 2, unfused_attention=job.attention == "unfused",
                         checkpointing=keys["activation_checkpointing"],
                         checkpoint_policy=keys.get("checkpoint_policy", "full"))
        mem.setdefault(name + "_analytic", pl.activation_bytes(shape, pl.Layout(1, 1, 1, 1)))
    for r in range(args.rounds):
        order = list(SETTINGS) if r % 2 == 0 else list(reversed(SETTINGS))
        for name in order:
            step, batches, times = runs[name]
            t = run_steps(step, iter(batches * args.steps), td, 0, args.steps)
            times += t.wall_s
    base = statistics.median(runs["none"][2])
    print(f"{'setting':10} {'median ms':>10} {'vs none':>8} {'hw/model FLOPs':>15} {'activations (analytic)':>23}"
          + (f" {'peak allocated (measured)':>26}" if device.type == "cuda" else ""))
    for name in SETTINGS:
        med = statistics.median(runs[name][2])
        line = (f"{name:10} {med * 1e3:10.1f} {base / med:7.2f}x {flops[name]:15.3f} "
                f"{mem[name + '_analytic'] / 2**20:20.1f} MiB")
        if device.type == "cuda":  # pragma: no cover - GPU only
            line += f" {mem[name] / 2**30:23.2f} GiB"
        print(line)
    print(f"({args.rounds} interleaved rounds of {args.steps} steps; 'vs none': no checkpoint's median / this one's, "
          "above 1 is faster)")


if __name__ == "__main__":
    main()
