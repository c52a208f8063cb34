"""One short run of the GPU code paths, for a session that is lent a GPU machine. Not part of the tests.

    python benchmarks/gpu_check.py [--out outputs] [--quick]

Plain Python (GPU machines have torch but no Jupyter). Runs steps 1 to 7 on a
mid-sized GPT in bf16 on the visible GPUs and prints one table of what the CUDA
paths measured: CUDA-event step times, the datasheet peak, NVML health, the SDPA
backends (efficient, cuDNN, flash) and flash_attn, a reduced NCCL sweep, and the
CUDA trace of step 3 (kernels tied to their operators, breakdown, fusion candidates), and
step 4's inductor compile in default and reduce-overhead (CUDA graphs) modes, and step 5's FP8
policy (real torchao float8 timing when torchao is installed), and step 6 (co-location of two copies on one
GPU, the model calibrated by steps 1-2 on this GPU and checked against step 2's NCCL step).
Before the steps, the production monitor's GPU paths (``--monitor-only`` runs them alone): the DDP hook timed
with CUDA events, NVML per interval, a CUDA profiler window.
Results land in <out>/gpu-check/ like any job's. About 6-8 minutes on one H200.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from mfu_lab.core.job import load_job  # noqa: E402
from mfu_lab.steps import attention_comm, baseline, fp8, kernels, placement, verify  # noqa: E402
from mfu_lab.steps import compile as compiled  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=str(ROOT / "outputs"))
    ap.add_argument("--quick", action="store_true", help="step 1 only")
    ap.add_argument("--skip-verify", action="store_true", help="stop after step 6 (step 7 adds a few minutes)")
    ap.add_argument("--monitor-only", action="store_true", help="the production monitor's GPU paths alone (~30 s)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device visible; nothing to check here")
        return 2
    check_monitor(Path(args.out) / "gpu-check-monitor")
    if args.monitor_only:
        return 0
    job = dataclasses.replace(
        load_job(ROOT / "parameters" / "gpt2_124m_gpu.yaml"), job_name="gpu-check", out_dir=args.out,
        n_layers=6, d_model=768, n_heads=12, seq_len=1024, micro_batch=8, steps=30, warmup_steps=10,
        comm_hooks=["none", "allreduce", "bf16_compress", "powersgd"], comm_bucket_mb=[1, 25],
        comm_grad_as_bucket_view=[False], comm_steps=8, comm_warmup_steps=3, comm_timeout_s=60.0)
    print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.device_count()} x "
          f"{torch.cuda.get_device_name(0)}, capability {torch.cuda.get_device_capability(0)}")
    t0 = time.perf_counter()
    b = baseline.run(job)
    m = b.metrics
    print(f"\nstep 1 ({time.perf_counter() - t0:.0f} s): {b.timings.method}")
    for k in ("mfu", "step_time_median_s", "step_time_cv", "tokens_per_s", "peak_flops_per_s",
              "counted_flops_per_step", "model_flops_per_step", "data_wait_fraction", "peak_memory_bytes"):
        print(f"  {k:<24} {m[k].value!r:<24} [{m[k].source}] {m[k].note[:80]}")
    h = b.health
    print(f"  NVML: sampled={h.sampled} samples={h.samples} max {h.temperature_c_max} C, SM clock "
          f"{h.sm_clock_mhz_mean}/{h.sm_clock_mhz_max_supported} MHz, power {h.power_w_mean} W, "
          f"reasons {h.reasons_seen} {h.skipped_reason}")
    print("  ledger " + ", ".join(f"{i.name} {i.fraction:.1%}" for i in b.ledger.items))
    print(f"  environment: {b.environment.get('gpu')}")
    print(f"  contention: {b.timings.contention}; HFU {m['hfu'].value!r} (flash recompute "
          f"{b.flops.flash_recompute_flops_per_step:.3g} FLOP/step); peak {b.peak}")
    if args.quick:
        return 0
    t0 = time.perf_counter()
    r = attention_comm.run(job)
    print(f"\nstep 2 ({time.perf_counter() - t0:.0f} s), world {r.comm_layout['world_size']} over "
          f"{r.comm_layout['backend']}; free GPU memory at launch "
          f"{[x.get('free_memory') for x in r.comm_layout.get('launches', [])]}, rank 0 found "
          f"{r.comm_layout.get('free_memory')}; {r.comm_layout.get('skipped', '')}")
    for a in r.attention:
        figs = (f"err {a.rel_error:.1e} attn {a.attn_median_s * 1e3:.2f} ms step {a.step_median_s * 1e3:.1f} ms "
                f"mfu {a.mfu:.1%} kernel {a.kernel}" if a.status == "ok" else a.reason[:100])
        print(f"  {a.name:<24} {a.status:<12} {figs}")
    for c in r.comm:
        figs = (f"step {c.step_median_s * 1e3:.1f} ms, no_sync {c.no_sync_step_s * 1e3:.1f} ms, comm "
                f"{c.comm_share:.1%}, exposed {c.exposed_share:.1%}, diff {c.param_diff}" if c.status == "ok"
                else c.error[:120])
        print(f"  {c.hook:<14} {c.bucket_mb:>4g} MB {c.status:<11} {figs}")
    for row in r.allreduce:
        print(f"  all-reduce {row['bytes']:>10} B {row['time_s'] * 1e6:9.1f} us busbw {row['busbw_gbps']:.1f} GB/s")
    print("  " + r.recommendation.get("attention_text", "") + "\n  " + r.recommendation.get("comm_text", ""))
    t0 = time.perf_counter()
    k = kernels.run(job)
    a, km = k.analysis, k.metrics
    print(f"\nstep 3 ({time.perf_counter() - t0:.0f} s): {a.kind} trace, {a.steps} steps, "
          f"{a.step_time_s * 1e3:.1f} ms each; profiler overhead {km['profiler_overhead'].value:+.1%}; "
          f"bandwidth {km['memory_bandwidth_bytes_per_s'].value / 1e12:.2f} TB/s (measured)")
    for t in a.top[:12]:
        print(f"  {t.category:<13} {t.calls:>5} {t.total_s / a.steps * 1e3:8.3f} ms/step {t.share:6.1%}  "
              f"{t.name[:70]}  <- {t.launched_by}")
    print("  breakdown " + ", ".join(f"{n} {v:.1%}" for n, v in a.breakdown.parts().items()))
    for c in a.fusion[:6]:
        print(f"  fuse {c.pattern[:60]:<60} x{c.per_step:g} {c.time_per_step_s * 1e6:8.1f} us, saves "
              f"{c.saved_bytes_per_step / 1e6:.1f} MB = {(c.est_saving_per_step_s or 0) * 1e6:.1f} us")
    print("  optimizer", a.optimizer)
    t0 = time.perf_counter()
    c = compiled.run(dataclasses.replace(job, compile_modes=["default", "reduce-overhead"]))
    print(f"\nstep 4 ({time.perf_counter() - t0:.0f} s): shapes {c.audit.shapes}, recompiles on data "
          f"{c.recompiles[0].recompiles}, demo static/auto {c.recompiles[1].recompiles}/{c.recompiles[2].recompiles}, "
          f"graph breaks {c.breaks.breaks}")
    for t in [c.eager] + c.trials:
        figs = (f"step {t.step_median_s * 1e3:.2f} ms ({t.step_p10_s * 1e3:.2f}-{t.step_p90_s * 1e3:.2f}), "
                f"speedup {t.speedup}, compile cold {t.compile_cold_s} s warm {t.compile_warm_s} s, break-even "
                f"{t.break_even_cold}, drift {t.drift}, kernels/step {t.ops_per_step}" if t.status == "ok"
                else f"{t.reason or t.error}")
        print(f"  {t.mode:<28} {t.status:<8} {figs}")
    print("  " + c.recommendation["text"])
    t0 = time.perf_counter()
    f = fp8.run(dataclasses.replace(job, fp8_steps=20))
    print(f"\nstep 5 ({time.perf_counter() - t0:.0f} s): path {f.path}, speed {f.speed}")
    for g in f.sensitivity.get("tensorwise", []):
        print(f"  {g.group:<10} SNR out {g.output_snr_db:.1f} gin {g.grad_input_snr_db:.1f} "
              f"gw {g.grad_weight_snr_db:.1f} dB")
    for t in f.trials:
        print(f"  {t.name:<28} {t.status:<10} last loss {t.loss[-1]:.4f} {t.reason}")
    print("  " + f.choice["text"])
    print("  " + ", ".join(f"{k} {m.value} [{m.source}]" for k, m in f.metrics.items()))
    for r in f.precision.get("rungs", []):  # TF32, bf16, fp16 against float32, side by side (CUDA events)
        print(f"  precision {r['name']:<10} {r['status']:<11} step {r['step_median_s']} s, speedup {r['speedup']} "
              f"[{r['speedup_low']}, {r['speedup_high']}], final gap {r['final_gap']} {r['reason'][:60]}")
    print("  " + f.precision.get("choice", {}).get("text", "no precision choice"))
    t0 = time.perf_counter()
    pj = dataclasses.replace(job, cluster=str(ROOT / "parameters" / "clusters" / "example_h100.yaml"), coloc_steps=10)
    pr = placement.run(pj)
    print(f"\nstep 6 ({time.perf_counter() - t0:.0f} s): co-location {pr.coloc.status} alone "
          f"{pr.coloc.alone_median_s} s, pair {pr.coloc.pair_median_s} s, slowdown {pr.coloc.slowdown}")
    for c in pr.calibration:
        print(f"  {c['input']:<38} {c['value']!r:<22} [{c['source']}] {c['from'][:70]}")
    print(f"  check: {pr.check.reason or pr.check.config}")
    for row in pr.check.rows:
        print(f"  {row['name']:<45} predicted {row['predicted_s'] * 1e3:8.2f} ms, measured "
              f"{pr.check.measured_s * 1e3:8.2f} ms, error {row['error']:+.1%}")
    print("  " + ", ".join(f"{k} {m.value} [{m.source}]" for k, m in pr.metrics.items()))
    if args.skip_verify:
        return 0
    t0 = time.perf_counter()
    v = verify.run(dataclasses.replace(job, verify_rounds=3, verify_steps=5))  # one warm process per rung
    print(f"\nstep 7 ({time.perf_counter() - t0:.0f} s): {v.headline['text']}")
    for r in v.rungs:
        print(f"  {r.name:<22} {r.status:<9} median {r.step_median_s} s, MFU {r.mfu}, speedup {r.speedup} "
              f"[{r.speedup_low}, {r.speedup_high}] {r.reason[:70]}")
    print(f"  DDP: {v.ddp.get('text') or v.ddp.get('reason')}")
    return 0


def check_monitor(out: Path) -> None:
    """Step 0's GPU paths: a DDP model (NCCL, world of 1) trained with the Monitor: the communication hook timed
    with CUDA events, NVML sampled per interval, a CUDA profiler window analysed, the datasheet peak."""
    import json
    import shutil
    import tempfile

    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from mfu_lab.analysis.monitor_summary import summarise
    from mfu_lab.monitor import Monitor

    shutil.rmtree(out, ignore_errors=True)
    t0 = time.perf_counter()
    store = tempfile.mkdtemp()
    dist.init_process_group("nccl", init_method=f"file://{store}/s", rank=0, world_size=1)
    try:
        net = torch.nn.Sequential(*[torch.nn.Linear(4096, 4096) for _ in range(8)]).cuda()
        model = DDP(net)
        opt = torch.optim.AdamW(model.parameters(), fused=True)
        batches = [torch.randn(64, 4096, device="cuda") for _ in range(4)]
        with Monitor(out, model=model, every=10, dtype="bfloat16", profile_every_s=5.0, nvml_interval_s=0.2) as mon:
            for x in mon.loader(batches[i % 4] for i in range(61)):
                with torch.autocast("cuda", torch.bfloat16):
                    loss = model(x).float().pow(2).mean()
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
                mon.step(tokens=x.shape[0])
        torch.cuda.synchronize()
    finally:
        dist.destroy_process_group()
        shutil.rmtree(store, ignore_errors=True)
    start = json.loads(next(out.glob("*.jsonl")).read_text().splitlines()[0])
    s = summarise(out)
    print(f"\nstep 0, the monitor: comm timed {start['comm']['timed']} ({start['comm']['how'][:90]}); NVML "
          f"{start['nvml']}; peak {start['peak']}")
    print(f"  ({time.perf_counter() - t0:.0f} s): {s.read['intervals']} intervals, "
          f"{s.read['steps']} timed steps; MFU {s.mfu['value']} [{s.mfu['label']}] {s.mfu['note'][:60]}")
    for k, v in s.shares.items():
        print(f"  share {k:<20} {v['value']!r:<24} [{v['label']}] {v['note'][:70]}")
    print(f"  profile windows {s.profile['windows']}: {s.profile.get('breakdown')}")
    g = s.series["gpu"]
    print(f"  NVML per bin: clock ratio {g['clock_ratio'][:3]}, hottest {g['temperature_c_max'][:3]} C, "
          f"throttled {g['throttled_share'][:3]}, power {g['power_w'][:3]} W")
    print("  operations loss " + ", ".join(f"{k} {p['value']} [{p['label']}]"
                                          for k, p in s.operations_loss["parts"].items()))
    print(f"  verdict: {s.verdict}")


if __name__ == "__main__":
    sys.exit(main())
