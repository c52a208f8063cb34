"""One short run of the GPU code paths, for a session that is lent a GPU machine. Not part of the tests.

    python benchmarks/gpu_check.py [--out outputs] [--steps monitor,baseline,...] [--limit-s 560]
    python benchmarks/gpu_check.py --part 1        # one 10-minute call each: --part 1, 2, 3 (riskiest first)
    python benchmarks/gpu_check.py --quick          # step 1 alone (= --steps baseline)
    python benchmarks/gpu_check.py --monitor-only   # the production monitor's GPU paths alone (= --steps monitor)
    python benchmarks/gpu_check.py --workbook       # the whole workbook through papermill, original against tuned

Plain Python (GPU machines have torch but no Jupyter). Runs the selected steps (default: all, in the workbook's
order) on a small GPT in bf16 with the fewest trials that still take every GPU path: CUDA events, the datasheet
peak, NVML; the monitor's DDP hook and profiler window; the SDPA backends (flash, efficient, cuDNN); NCCL DDP and
its all-reduce benchmark with 2+ GPUs (one GPU: skipped by design); step 3's CUDA trace; step 4's reduce-overhead
(CUDA graphs); step 5's precision ladder and torchao float8 on SM 8.9+; step 6's co-location; step 7's rungs.

It is meant to fit one 10-minute call on one H200, start-up included: ranks are capped at min(visible, 2) when
more than 8 GPUs are visible or more are asked for; a step whose rough estimate no longer fits ``--limit-s``
(counted from this process's start) is skipped ("time"); a failing step is recorded and the next goes on. The
last thing printed is one table, path | figure | value | label | pass/fail, also written to
<out>/gpu-check/table.md and table.json. Exit 0: no row failed; 1: some row failed; 2: no CUDA device.

``--workbook`` runs the whole workbook instead (``mfu-lab run parameters/gpt2_124m_gpu.yaml`` under papermill, a
child process that ends with this one), without a budget when the estimates fit ``--limit-s``, else with the
``--budget`` (and, if need be, the ``--steps``) that fit, the plan printed first with each step it shortens and why
(benchmarks/gpu_check_workbook.py). It ends with step 7's staircase, the original against the tuned job side by side,
step 1's MFU and the tuned MFU, also written to <out>/gpu-check/workbook.md and workbook.json. Exit 0: step 7 ran;
1: a step failed, step 7 left no result, or the run was stopped at the limit; 2: no CUDA device, the Jupyter stack
missing (the line that installs it is printed), or the limit too small for steps 1 and 7; 130: interrupted.
"""

from __future__ import annotations

import time

T0 = time.monotonic()  # run as a script, --limit-s counts from here: the process's start-up (the torch import) is in it

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import datetime  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import traceback  # noqa: E402
from pathlib import Path  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import gpu_check_workbook as wb  # noqa: E402
from gpu_check_race import confirmation_row, round_rows, step_race_one_rank  # noqa: E402
from gpu_check_table import (  # noqa: E402
    DEFAULT_STEPS,
    PARTS,
    PATHS,
    STEPS,
    Ctx,
    Row,
    StepsError,
    add,
    estimate_s,
    fail_row,
    figure_row,
    finite,
    format_table,
    fp8_applied_row,
    fp8_speed_row,
    ms,
    one_gpu,
    pace,
    parse_steps,
    skip_row,
    summary,
    time_guard,
    world_guard,
    write_table,
)

JOB_FILE = ROOT / "parameters" / "gpt2_124m_gpu.yaml"
# The check's small job over gpt2_124m_gpu.yaml: every GPU path, the fewest steps and trials (README, "Benchmark").
FP8_GROUPS = ("mlp_up", "mlp_down", "lm_head")  # step 5's choice for GPT-2-sized layers: the large matmuls
SMALL_JOB = dict(
    job_name="gpu-check", n_layers=2, d_model=768, n_heads=12, vocab_size=8192, seq_len=512, micro_batch=8,
    # 2 micro-batches a step (the job file has 4): accumulation under reduce-overhead's CUDA graphs, and every
    # rate over an optimizer step's tokens, still run; the estimates below were timed with one a step
    grad_accum=2,
    steps=20, warmup_steps=5, race_steps=2,
    comm_hooks=["none", "bf16_compress"], comm_bucket_mb=[25], comm_grad_as_bucket_view=[False], comm_steps=4,
    comm_warmup_steps=1, comm_timeout_s=60.0,
    profile_warmup_steps=2, profile_steps=2,
    compile_modes=["reduce-overhead"], compile_timeout_s=240.0,
    precision_rounds=2, fp8_steps=10, fp8_sensitivity_batches=1,
    cluster=str(ROOT / "parameters" / "clusters" / "example_h100.yaml"), coloc_steps=5,
    verify_rounds=2, verify_steps=5, verify_warmup_steps=3)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    def steps_type(text: str) -> list[str]:
        try:
            return parse_steps(text)
        except StepsError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=str(ROOT / "outputs"), help="results folder (<out>/gpu-check/)")
    pick = ap.add_mutually_exclusive_group()
    pick.add_argument("--steps", type=steps_type, default=list(DEFAULT_STEPS),
                      help=f"comma-separated, run in this order: {','.join(STEPS)} (default: all but layouts, "
                           "which is a call of its own: --steps layouts)")
    pick.add_argument("--quick", action="store_true", help="step 1 alone (= --steps baseline)")
    pick.add_argument("--monitor-only", action="store_true", help="the monitor's GPU paths alone (= --steps monitor)")
    pick.add_argument("--part", type=int, choices=sorted(PARTS),
                      help="one part of the check, each one 10-minute call, riskiest first: "
                           + "; ".join(f"{k}: {','.join(v)}" for k, v in PARTS.items())
                           + " (part 2 reads part 1's results: give both the same --out)")
    pick.add_argument("--workbook", action="store_true",
                      help="the whole workbook on --job through papermill (mfu-lab run), without a budget when it "
                           "fits --limit-s, else with the budget that fits (the plan says which steps it shortens); "
                           "ends with the original against the tuned job (<out>/gpu-check/workbook.md)")
    ap.add_argument("--job", default=str(JOB_FILE), help="--workbook: the job file (default: parameters/"
                    "gpt2_124m_gpu.yaml; the plan's estimates are this job's on one H200)")
    ap.add_argument("--allow-cpu", action="store_true",
                    help="--workbook: run without a CUDA device (to try the plumbing on a small CPU job, e.g. "
                         "--job tests/data/tiny.yaml; the estimates are an H200's)")
    ap.add_argument("--skip-verify", action="store_true", help="leave step 7 out")
    ap.add_argument("--limit-s", type=float, default=560.0,
                    help="seconds the whole check may take, start-up included; a step whose rough estimate no "
                         "longer fits is skipped (default 560: one 10-minute call with a margin)")
    args = ap.parse_args(argv)
    if args.workbook and args.skip_verify:
        ap.error("--skip-verify leaves out a step of the check; --workbook always runs step 7 (its proof)")
    if (args.allow_cpu or args.job != str(JOB_FILE)) and not args.workbook:
        ap.error("--job and --allow-cpu go with --workbook")
    args.job = Path(args.job).expanduser().resolve()
    args.steps = (["baseline"] if args.quick else ["monitor"] if args.monitor_only
                  else list(PARTS[args.part]) if args.part else args.steps)
    if args.skip_verify:
        args.steps = [s for s in args.steps if s != "verify"]
    args.out = Path(args.out).expanduser().resolve()
    return args


# ---------------------------------------------------------------------- the steps
def step_monitor(ctx: Ctx, rows: list[Row]) -> None:
    """Step 0's GPU paths: a DDP model (NCCL, world of 1) trained with the Monitor: the communication hook timed
    with CUDA events, NVML sampled per interval, a CUDA profiler window analysed, the datasheet peak."""
    import shutil
    import tempfile

    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from mfu_lab.analysis.monitor.summary import summarise
    from mfu_lab.monitor import Monitor

    out = ctx.out / "gpu-check-monitor"
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
    recs = [json.loads(ln) for f in out.glob("*.jsonl") for ln in f.read_text().splitlines() if ln.strip()]
    start = next(r for r in recs if r.get("kind") == "start")
    intervals = [r for r in recs if r.get("kind") == "interval"]
    s = summarise(out)
    p = "monitor"
    comm = s.shares["communication"]
    how = str(start["comm"]["how"])
    add(rows, p, "DDP hook CUDA events", lambda: figure_row(
        p, "DDP hook CUDA events", comm["value"], "comm share {:.1%}", "(CUDA events around each bucket)" if
        "CUDA events" in how else f"(not CUDA events: {how[:50]})", comm["label"],
        ok=bool(start["comm"]["timed"]) and "CUDA events" in how))
    nv = sum(1 for r in intervals if r.get("gpu"))
    add(rows, p, "NVML per interval", lambda: figure_row(
        p, "NVML per interval", nv, "{} intervals with NVML", f"of {len(intervals)}",
        ok=bool(start["nvml"]["sampled"]) and nv > 0))
    add(rows, p, "CUDA profiler window", lambda: figure_row(
        p, "CUDA profiler window", s.profile["windows"], "{} window(s)", ok=s.profile["windows"] > 0))
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
    print("  operations loss " + ", ".join(f"{k} {v['value']} [{v['label']}]"
                                          for k, v in s.operations_loss["parts"].items()))
    print(f"  verdict: {s.verdict}")


def step_baseline(ctx: Ctx, rows: list[Row]) -> None:
    from mfu_lab.steps.baseline import step as baseline

    b = baseline.run(ctx.job)
    m, h, p = b.metrics, b.health, "step 1"
    add(rows, p, "CUDA-event step time", lambda: figure_row(
        p, "CUDA-event step time", ms(m["step_time_median_s"].value), "{:.1f} ms",
        label=m["step_time_median_s"].source, ok="CUDA events" in b.timings.method))
    add(rows, p, "MFU (datasheet peak)", lambda: figure_row(
        p, "MFU (datasheet peak)", m["mfu"].value, "{:.1%}", f"of {m['peak_flops_per_s'].value:.3g} FLOP/s "
        f"({m['peak_flops_per_s'].source})", ok=m["peak_flops_per_s"].source == "datasheet"))
    add(rows, p, "NVML health sampled", lambda: figure_row(
        p, "NVML health sampled", h.samples, "yes, {} samples", ok=h.samples > 0)
        if h.sampled else fail_row(p, "NVML health sampled", "not sampled: " + h.skipped_reason))
    print(f"\nstep 1: {b.timings.method}")
    for k in ("mfu", "step_time_median_s", "step_time_cv", "tokens_per_s", "peak_flops_per_s",
              "counted_flops_per_step", "model_flops_per_step", "data_wait_fraction", "peak_memory_bytes"):
        print(f"  {k:<24} {m[k].value!r:<24} [{m[k].source}] {m[k].note[:80]}")
    print(f"  NVML: sampled={h.sampled} samples={h.samples} max {h.temperature_c_max} C, SM clock "
          f"{h.sm_clock_mhz_mean}/{h.sm_clock_mhz_max_supported} MHz, power {h.power_w_mean} W, "
          f"reasons {h.reasons_seen} {h.skipped_reason}")
    print("  ledger " + ", ".join(f"{i.name} {i.fraction:.1%}" for i in b.ledger.items))
    print(f"  environment: {b.environment.get('gpu')}")
    print(f"  contention: {b.timings.contention}; HFU {m['hfu'].value!r} (flash recompute "
          f"{b.flops.flash_recompute_flops_per_step:.3g} FLOP/step); peak {b.peak}")


def _attention_row(r, name: str, figure: str) -> Row:
    a = next((x for x in r.attention if x.name == name), None)
    if a is None:
        return fail_row("step 2", figure, f"'{name}' is not among the candidates")
    if a.status in ("ok", "dropped"):  # dropped: timed alone, left out of the race's final round
        return figure_row("step 2", figure, ms(a.attn_median_s), "{:.2f} ms fwd+bwd", f"(error {a.rel_error:.1e})")
    if a.status == "same kernel":  # torch's own SDPA choice dispatches to it (flash on Hopper in bf16): its twin ran
        twin = a.reason.split("same kernel as ", 1)[-1].split(" here", 1)[0]
        return Row("step 2", figure, f"same kernel as {twin} ({a.kernel or '?'}): timed once, as it", "measured",
                   "pass")
    if "not installed" in a.reason:
        return skip_row("step 2", figure, a.reason)
    return fail_row("step 2", figure, f"{a.status}: {a.reason}")


def step_attention_comm(ctx: Ctx, rows: list[Row]) -> None:
    from mfu_lab.steps.attention_comm import step as attention_comm

    r = attention_comm.run(ctx.job)
    p = "step 2"
    for name, figure in (("sdpa flash", "SDPA flash"), ("sdpa efficient", "SDPA efficient"),
                         ("sdpa cudnn", "SDPA cuDNN"), ("flash_attn package", "flash_attn package")):
        add(rows, p, figure, lambda name=name, figure=figure: _attention_row(r, name, figure))
    world, backend = r.comm_layout["world_size"], r.comm_layout["backend"]
    ok = [c for c in r.comm if c.status == "ok" and finite(c.step_median_s)]
    add(rows, p, "NCCL DDP world", lambda: one_gpu(ctx, p, "NCCL DDP world") or figure_row(
        p, "NCCL DDP world", world, "{} ranks", f"over {backend}, {len(ok)}/{len(r.comm)} configurations ok",
        ok=backend == "nccl" and bool(ok)))
    bus = [x["busbw_gbps"] for x in r.allreduce]
    add(rows, p, "all-reduce CUDA events", lambda: one_gpu(ctx, p, "all-reduce CUDA events") or figure_row(
        p, "all-reduce CUDA events", max(bus, default=None), "busbw {:.1f} GB/s", f"(largest of {len(bus)} sizes)",
        ok=all(finite(x) for x in bus) and all("CUDA events" in x.get("method", "") for x in r.allreduce)))
    if ctx.world >= 2:  # the race's rounds and its confirmation (one GPU: the forced world-of-1 rows instead)
        for row in round_rows(p, r.races.get("ddp")):
            rows.append(row)
    print(f"\nstep 2: world {world} over {backend}; free GPU memory at launch "
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
    for x in r.allreduce:
        print(f"  all-reduce {x['bytes']:>10} B {x['time_s'] * 1e6:9.1f} us busbw {x['busbw_gbps']:.1f} GB/s")
    print("  " + r.recommendation.get("attention_text", "") + "\n  " + r.recommendation.get("comm_text", ""))


def step_kernels(ctx: Ctx, rows: list[Row]) -> None:
    from mfu_lab.steps.kernels import step as kernels

    k = kernels.run(ctx.job)
    a, km, p = k.analysis, k.metrics, "step 3"
    tied = sum(1 for t in a.top if t.launched_by)
    add(rows, p, "CUDA trace kernels tied to ops", lambda: figure_row(
        p, "CUDA trace kernels tied to ops", tied, "{} top kernels tied to their operator",
        f"(of {len(a.top)}; {a.ops_per_step:.0f} kernels/step, {a.kind} trace)", ok=a.kind == "gpu" and tied > 0))
    prof = km["profiled_step_time_median_s"].value
    ratio = a.step_time_s / prof if finite(prof) and prof else None
    add(rows, p, "window sync'd at warm-up end", lambda: figure_row(
        p, "window sync'd at warm-up end", ratio, "trace window / CUDA events {:.2f}x",
        f"({a.step_time_s * 1e3:.2f} ms/step over {a.steps} steps)",
        ok=a.steps == ctx.job.profile_steps and 0.5 < (ratio or 0) < 1.5))
    bw = km["memory_bandwidth_bytes_per_s"]
    add(rows, p, "memory bandwidth", lambda: figure_row(
        p, "memory bandwidth", bw.value / 1e12 if finite(bw.value) else bw.value, "{:.2f} TB/s", label=bw.source))
    d = k.ddp
    add(rows, p, "per-rank CUDA traces (DDP)", lambda: one_gpu(ctx, p, "per-rank CUDA traces (DDP)") or (
        figure_row(p, "per-rank CUDA traces (DDP)", len(d.get("ranks", [])), "{} rank traces",
                   f"over {d.get('backend')}", ok=bool(d.get("ranks"))) if d.get("status") == "ok" else
        skip_row(p, "per-rank CUDA traces (DDP)", d.get("reason", "")) if d.get("status") == "skipped" else
        fail_row(p, "per-rank CUDA traces (DDP)", str(d.get("error", d)))))
    print(f"\nstep 3: {a.kind} trace, {a.steps} steps, {a.step_time_s * 1e3:.1f} ms each; profiler overhead "
          f"{km['profiler_overhead'].value:+.1%}; bandwidth {bw.value / 1e12:.2f} TB/s ({bw.source})")
    for t in a.top[:12]:
        print(f"  {t.category:<13} {t.calls:>5} {t.total_s / a.steps * 1e3:8.3f} ms/step {t.share:6.1%}  "
              f"{t.name[:70]}  <- {t.launched_by}")
    print("  breakdown " + ", ".join(f"{n} {v:.1%}" for n, v in a.breakdown.parts().items()))
    for c in a.fusion[:6]:
        print(f"  fuse {c.pattern[:60]:<60} x{c.per_step:g} {c.time_per_step_s * 1e6:8.1f} us, saves "
              f"{c.saved_bytes_per_step / 1e6:.1f} MB = {(c.est_saving_per_step_s or 0) * 1e6:.1f} us")
    print("  optimizer", a.optimizer, f"\n  per-rank profile: {d.get('status')} {d.get('reason', d.get('error', ''))}")


def step_compile(ctx: Ctx, rows: list[Row]) -> None:
    from mfu_lab.steps.compile import step as compiled

    c = compiled.run(ctx.job)
    p = "step 4"
    t = next((x for x in c.trials if x.mode == "reduce-overhead"), None)
    figure = "reduce-overhead (CUDA graphs)"
    add(rows, p, figure, lambda: fail_row(p, figure, "no reduce-overhead trial") if t is None else figure_row(
        p, figure, ms(t.step_median_s), "{:.2f} ms/step", f"({t.speedup or 0:.2f}x eager, cold compile "
        f"{t.compile_cold_s or 0:.0f} s)") if t.status == "ok" else skip_row(p, figure, t.reason)
        if t.status == "skipped" else fail_row(p, figure, f"{t.status}: {t.error or t.reason}"))
    rows.append(confirmation_row(p, "confirmation (leading mode beside eager)", c.confirmation))
    add(rows, p, "warm-cache compile", lambda: skip_row(p, "warm-cache compile", "no cold trial ran")
        if t is None or t.status != "ok" else skip_row(p, "warm-cache compile", t.warm_skipped) if t.warm_skipped
        else figure_row(p, "warm-cache compile", t.compile_warm_s, "{:.1f} s"))
    print(f"\nstep 4: shapes {c.audit.shapes}, recompiles on data {c.recompiles[0].recompiles}, demo static/auto "
          f"{c.recompiles[1].recompiles}/{c.recompiles[2].recompiles}, graph breaks {c.breaks.breaks}")
    for x in [c.eager] + c.trials:
        figs = (f"step {x.step_median_s * 1e3:.2f} ms ({x.step_p10_s * 1e3:.2f}-{x.step_p90_s * 1e3:.2f}), "
                f"speedup {x.speedup}, compile cold {x.compile_cold_s} s warm {x.compile_warm_s} s, break-even "
                f"{x.break_even_cold}, drift {x.drift}, kernels/step {x.ops_per_step}" if x.status == "ok"
                else f"{x.reason or x.error}")
        print(f"  {x.mode:<28} {x.status:<8} {figs}")
    print("  " + c.recommendation["text"])


def step_fp8(ctx: Ctx, rows: list[Row]) -> None:
    from mfu_lab.steps.fp8 import step as fp8

    f = fp8.run(ctx.job)
    p = "step 5"
    rungs = f.precision.get("rungs", [])
    timed = [r for r in rungs if finite(r.get("step_median_s"))]
    failed = [r for r in rungs if r.get("status") == "failed"]
    add(rows, p, "precision ladder (CUDA events)", lambda: figure_row(
        p, "precision ladder (CUDA events)", len(timed), "{} rungs timed", "(" + ", ".join(
            f"{r['name']} {r['speedup']:.2f}x" if finite(r.get("speedup")) else r["name"] for r in timed) + ")",
        ok=len(timed) >= 2) if not failed else fail_row(
        p, "precision ladder (CUDA events)", f"{failed[0]['name']}: {failed[0]['reason']}"))
    figure = "torchao float8 real speed"
    add(rows, p, figure, lambda: fp8_speed_row(p, figure, f.speed, ctx.capability))
    # a job file with fp8_layers (tuned.yaml's, step 5's fragment) trains them in FP8: step 1 on such a job
    from mfu_lab.steps.baseline import step as baseline

    figure = "fp8_layers trained in FP8 (step 1)"
    try:
        b = baseline.run(dataclasses.replace(ctx.job, fp8_layers=list(FP8_GROUPS)), write=False)
        add(rows, p, figure, lambda: fp8_applied_row(p, figure, b.fp8, b.metrics["step_time_median_s"].value,
                                                     ctx.capability))
        print(f"  step 1 with fp8_layers {list(FP8_GROUPS)}: {b.fp8.get('text')}; step "
              f"{b.metrics['step_time_median_s'].value} s, MFU {b.metrics['mfu'].value}")
    except Exception as e:  # noqa: BLE001 - recorded as the row's failure, the check goes on
        rows.append(fail_row(p, figure, e))
    print(f"\nstep 5: path {f.path}, speed {f.speed}")
    for g in f.sensitivity.get("tensorwise", []):
        print(f"  {g.group:<10} SNR out {g.output_snr_db:.1f} gin {g.grad_input_snr_db:.1f} "
              f"gw {g.grad_weight_snr_db:.1f} dB")
    for t in f.trials:
        print(f"  {t.name:<28} {t.status:<10} last loss {t.loss[-1] if t.loss else None} {t.reason}")
    print("  " + f.choice["text"])
    print("  " + ", ".join(f"{k} {m.value} [{m.source}]" for k, m in f.metrics.items()))
    for r in rungs:  # TF32, bf16, fp16 against float32, side by side (CUDA events)
        print(f"  precision {r['name']:<10} {r['status']:<11} step {r['step_median_s']} s, speedup {r['speedup']} "
              f"[{r['speedup_low']}, {r['speedup_high']}], final gap {r['final_gap']} {r['reason'][:60]}")
    print("  " + f.precision.get("choice", {}).get("text", "no precision choice"))


def step_placement(ctx: Ctx, rows: list[Row]) -> None:
    from mfu_lab.steps.placement import step as placement

    pr = placement.run(ctx.job)
    p, co, ck = "step 6", pr.coloc, pr.check
    add(rows, p, "co-location", lambda: figure_row(
        p, "co-location", co.slowdown, "slowdown {:.2f}x", f"(alone {(co.alone_median_s or 0) * 1e3:.1f} ms, "
        f"pair {(co.pair_median_s or 0) * 1e3:.1f} ms)") if co.status == "ok" else
        fail_row(p, "co-location", co.reason))
    used = ck.used() if ck.available else None
    add(rows, p, "model check vs step 2's NCCL step", lambda: one_gpu(ctx, p, "model check vs step 2's NCCL step")
        or (figure_row(p, "model check vs step 2's NCCL step", used["error"] if used else None,
                       "error {:+.1%}", f"({ck.headline})", "modelled") if ck.available else
            skip_row(p, "model check vs step 2's NCCL step", ck.reason)))
    print(f"\nstep 6: co-location {co.status} alone {co.alone_median_s} s, pair {co.pair_median_s} s, slowdown "
          f"{co.slowdown} {co.reason[:100]}")
    for c in pr.calibration:
        print(f"  {c['input']:<38} {c['value']!r:<22} [{c['source']}] {c['from'][:70]}")
    print(f"  check: {ck.reason or ck.config}")
    for row in ck.rows:
        print(f"  {row['name']:<45} predicted {row['predicted_s'] * 1e3:8.2f} ms, measured "
              f"{(ck.measured_s or 0) * 1e3:8.2f} ms, error {row['error']:+.1%}")
    print("  " + ", ".join(f"{k} {m.value} [{m.source}]" for k, m in pr.metrics.items()))


def step_verify(ctx: Ctx, rows: list[Row]) -> None:
    from mfu_lab.steps.verify import step as verify

    v = verify.run(ctx.job)  # one warm process per rung
    p = "step 7"
    ok = [r for r in v.rungs if r.status == "ok" and r.name not in ("original again", "tuned as written")]
    failed = [r for r in v.rungs if r.status == "failed"]
    why = next((x["reason"] for x in v.skipped if x.get("what") == "the staircase"), "")
    sp = v.headline.get("speedup")
    add(rows, p, "rung processes on CUDA", lambda: fail_row(
        p, "rung processes on CUDA", f"{failed[0].name}: {failed[0].reason}") if failed else skip_row(
        p, "rung processes on CUDA", why) if len(ok) < 2 else figure_row(
        p, "rung processes on CUDA", len(ok), "{} rungs timed", f"(tuned {sp:.2f}x original)" if finite(sp) else "",
        ok=all(finite(r.step_median_s) for r in ok)))
    d = v.ddp
    add(rows, p, "DDP alternation (NCCL)", lambda: figure_row(
        p, "DDP alternation (NCCL)", d.get("speedup"), "tuned {:.2f}x original", f"over {d.get('world_size')} ranks")
        if d.get("status") == "ok" else skip_row(p, "DDP alternation (NCCL)", d.get("reason", ""))
        if d.get("status") == "skipped" else fail_row(p, "DDP alternation (NCCL)", str(d.get("reason", d))))
    print(f"\nstep 7: {v.headline['text']}")
    for r in v.rungs:
        print(f"  {r.name:<22} {r.status:<9} median {r.step_median_s} s, MFU {r.mfu}, speedup {r.speedup} "
              f"[{r.speedup_low}, {r.speedup_high}] {r.reason[:70]}")
    print(f"  DDP: {d.get('text') or d.get('reason')}")


def step_layouts(ctx: Ctx, rows: list[Row]) -> None:
    """The job in its own layout over NCCL (README, "Your job's layout"): FSDP2 at world 1 with a bf16
    MixedPrecisionPolicy (one GPU can check NCCL, the policy, the memory readings and CUDA-event timing); with 2+
    GPUs also TP2+SP and an interleaved PP2. FSDP x TP and PP x FSDP wait for a node of 4+ GPUs."""
    from mfu_lab.steps.baseline import step as baseline

    p = "layouts"
    runs = [("FSDP2 world 1, bf16 policy", dict(dp_mode="fsdp", nproc_per_node=1, fsdp_param_dtype="bfloat16"))]
    if ctx.world >= 2:
        runs += [("TP2+SP", dict(tp=2, sp=True, nproc_per_node=2)),
                 ("PP2 interleaved v2 m4", dict(pp=2, pp_schedule="interleaved_1f1b", pp_virtual_stages=2,
                                                pp_microbatches=4, n_layers=4, nproc_per_node=2))]
    else:
        rows.append(skip_row(p, "TP2+SP, PP2 over NCCL", f"{ctx.visible} GPU visible: TP and PP need 2 ranks, and "
                             "two NCCL ranks cannot share one GPU"))
    for name, over in runs:
        job = dataclasses.replace(ctx.job, job_name=f"gpu-check-{name.split()[0].lower()}", **over)
        add(rows, p, f"{name}: step 1 in the layout", lambda job=job, name=name: _layout_rows(
            baseline.run(job), p, name, rows))


def _layout_rows(b, p: str, name: str, rows: list[Row]) -> Row:
    lay, m = b.layout, b.metrics
    lc = lay["loss_check"]
    rows.append(figure_row(p, f"{name}: loss check vs one process", lc["max_rel_gap"], "{:.2e}",
                           f"tolerance {lc['tolerance']:.0e}, {lc['reference']}", ok=bool(lc["passed"])))
    rows.append(figure_row(p, f"{name}: CUDA-event step time", ms(m["step_time_median_s"].value), "{:.1f} ms",
                           ok="CUDA events" in b.timings.method and lay["backend"] == "nccl"))
    peak = max(r["peak_bytes"] or 0 for r in lay["ranks"])
    rows.append(figure_row(p, f"{name}: peak memory per rank", peak / 2 ** 30, "{:.2f} GiB",
                           lay["ranks"][0]["peak_source"], ok=peak > 0 and "cuda" in lay["ranks"][0]["peak_source"]))
    kinds = ", ".join(f"{c['kind']} {c['count']}" for c in lay["collective_rows"]) or "none"
    print(f"\n{name}: {b.timings.method}; MFU {m['mfu'].value:.1%}; collectives {kinds}; notes {lay['notes']}")
    print("  ledger " + ", ".join(f"{i.name} {i.fraction:.1%}" for i in b.ledger.items))
    return figure_row(p, f"{name}: MFU, all ranks", m["mfu"].value, "{:.1%}", f"collectives: {kinds}",
                      ok=finite(m["mfu"].value) and m["mfu"].value > 0)


def workbook_main(args: argparse.Namespace, t_start: float) -> int:
    """``--workbook``: plan, run `mfu-lab run` on the job as a child, then the original against the tuned job."""
    missing = wb.missing_modules()
    if missing:  # before torch's import: on a GPU machine without the wheels this says so in a second
        print(wb.install_hint(missing, ROOT))
        return 2
    import torch

    cuda = torch.cuda.is_available()
    if not cuda and not args.allow_cpu:
        print("gpu_check --workbook: no CUDA device visible; nothing to check here (--allow-cpu runs the plumbing "
              "on a CPU job)")
        return 2
    from mfu_lab.core.job.schema import load_job
    from mfu_lab.core.process import budget

    job = load_job(args.job)
    visible = torch.cuda.device_count() if cuda else 0
    world = (job.nproc_per_node or visible) if cuda else 1
    header = {"date": wb.now_iso(), "torch": torch.__version__, "CUDA": torch.version.cuda,
              "GPU": f"{visible} x {torch.cuda.get_device_name(0)}" if cuda else "none (--allow-cpu)",
              "job": str(args.job.relative_to(ROOT) if args.job.is_relative_to(ROOT) else args.job),
              "limit_s": args.limit_s}
    print("\n".join(f"{k}: {v}" for k, v in header.items()))
    est = wb.estimates(job, wb.H200, world)
    plan = wb.make_plan(args.limit_s, time.monotonic() - t_start, est, wb.H200, budget.overhead(job.device)[0],
                        wb.untimed_steps(job, world))
    print(plan.text(), flush=True)
    header["plan"] = " ".join(plan.cli_args())
    if plan.refused:
        return 2
    cmd = [sys.executable, "-m", "mfu_lab", "run", str(args.job), "--out", str(args.out)] + plan.cli_args()
    print("running: " + " ".join(cmd), flush=True)
    since = time.time()
    deadline = t_start + args.limit_s - wb.GRACE_S - wb.TABLE_S
    outcome = wb.run_child(cmd, wb.child_env(ROOT), ROOT, deadline, lambda line: print(line, flush=True))
    header["run"] = (f"exit {outcome.rc} after {outcome.seconds:.0f} s" + (f"; {outcome.stopped}" if outcome.stopped
                                                                           else ""))
    results, notes = wb.read_results(args.out / job.job_name, since)
    table = wb.side_by_side(results.get("baseline"), results.get("verify"))
    steps = wb.step_rows(plan, outcome, results, notes)
    shortened = wb.shortened_by_steps(results)
    md, js = wb.write_report(args.out / "gpu-check", header, table, steps, shortened, plan, outcome)
    print(f"\nwrote {md} and {js}; {time.monotonic() - t_start:.0f} s of --limit-s {args.limit_s:.0f}")
    print(wb.format_report(table, steps, shortened, plan, outcome))
    if outcome.interrupted:
        return 130
    return 0 if outcome.rc == 0 and "verify" in results else 1


RUN = {"monitor": step_monitor, "baseline": step_baseline, "attention_comm": step_attention_comm,
       "kernels": step_kernels, "compile": step_compile, "fp8": step_fp8, "placement": step_placement,
       "verify": step_verify, "layouts": step_layouts, "race1": step_race_one_rank}


def main(argv: list[str] | None = None, started: float | None = None) -> int:
    """Run the check. ``started``: the ``time.monotonic()`` that ``--limit-s`` counts from; the script passes its
    import time (start-up included), a caller that passes nothing gets this call's start (never the time since
    some earlier import, which in a test suite is however long the suite has run)."""
    t_start = time.monotonic() if started is None else started
    args = parse_args(argv)
    if args.workbook:
        return workbook_main(args, t_start)
    import torch

    if not torch.cuda.is_available():
        print("gpu_check: no CUDA device visible; nothing to check here")
        return 2
    visible = torch.cuda.device_count()
    from mfu_lab.core.job.schema import load_job

    base = load_job(JOB_FILE)
    nproc, world_note = world_guard(visible, base.nproc_per_node)  # never more ranks than GPUs
    job = dataclasses.replace(base, out_dir=str(args.out), nproc_per_node=nproc, **SMALL_JOB)
    ctx = Ctx(job, visible, job.nnodes * nproc, tuple(torch.cuda.get_device_capability(0)), args.out)
    header = {"date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
              "torch": torch.__version__, "CUDA": torch.version.cuda,
              "GPU": f"{visible} x {torch.cuda.get_device_name(0)}, capability {ctx.capability}",
              "ranks": world_note, "steps": ",".join(args.steps), "limit_s": args.limit_s,
              "job": f"{JOB_FILE.name} with " + ", ".join(f"{k}={v}" for k, v in SMALL_JOB.items() if k != "cluster")}
    print("\n".join(f"{k}: {v}" for k, v in header.items()))
    rows: list[Row] = []
    estimated, actual = [], []
    for step in args.steps:
        est = estimate_s(step, ctx.world) * pace(estimated, actual)
        why = time_guard(time.monotonic() - t_start, args.limit_s, est)
        if why:
            print(f"\n{PATHS[step]} ({step}): skipped, {why}")
            rows.append(skip_row(PATHS[step], f"{step} run", "time", why))
            continue
        t0 = time.monotonic()
        try:
            RUN[step](ctx, rows)
        except Exception as e:  # noqa: BLE001 - recorded in the table; the next step goes on
            print(f"\n{PATHS[step]} ({step}) FAILED: {type(e).__name__}: {e}")
            traceback.print_exc(limit=-8, file=sys.stdout)
            rows.append(fail_row(PATHS[step], f"{step} run", e))
        try:  # the next step starts with the memory this one held given back (unless the device itself failed)
            gc.collect()
            torch.cuda.empty_cache()
        except Exception as e:  # noqa: BLE001
            print(f"  (freeing GPU memory after {step} failed: {type(e).__name__}: {e})")
        took = time.monotonic() - t0
        estimated.append(estimate_s(step, ctx.world))
        actual.append(took)
        print(f"  [{step}: {took:.0f} s, estimated {est:.0f} s; {time.monotonic() - t_start:.0f} s of "
              f"{args.limit_s:.0f} s used]")
        write_table(rows, header, args.out / "gpu-check")  # after every step: a call that overruns keeps its rows
    md, js = write_table(rows, header, args.out / "gpu-check")
    print(f"\nwrote {md} and {js}\n\nGPU check, {header['date']}: torch {header['torch']}, CUDA {header['CUDA']}, "
          f"{header['GPU']}; {world_note}; {time.monotonic() - t_start:.0f} s\n")
    print(format_table(rows) + "\n" + summary(rows))
    return 1 if any(r.status == "fail" for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main(started=T0))
