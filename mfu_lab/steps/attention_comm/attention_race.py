"""Step 2's attention comparison: every implementation checked against unfused float32 and timed alone, one per
kernel, then their training steps raced (:mod:`mfu_lab.analysis.racing`) and the pick made beyond the noise.

Used by :mod:`mfu_lab.steps.attention_comm.step`, which owns the step's result.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from mfu_lab.analysis import attention as att
from mfu_lab.analysis import racing
from mfu_lab.core.engine.meta_shape import shaped
from mfu_lab.core.engine.workload import build_loader, build_model, build_train_step, eager
from mfu_lab.core.measure import flops as fl
from mfu_lab.core.measure.timed import run_steps, stats
from mfu_lab.core.process.budget import fit_count

DDP_HALF = 0.5  # of step 2's share left after the attention first round: the DDP race's, when it runs
FINAL_LEAST = 5  # timed steps of each final-round run under a budget, at least: a median and a spread to compare
JOB_IMPL = {"sdpa": "sdpa (torch's choice)", "unfused": "unfused"}  # the job's attention among the candidates
IMPOSSIBLE_SHARE = ("attention share above 100%: n_layers x the standalone timing exceeds the whole step, so the "
                    "standalone timing does not represent the kernel's cost inside the step; not used for any "
                    "recommendation")


@dataclass
class AttentionRow:
    name: str
    status: str  # ok | wrong | unavailable | same kernel | dropped
    reason: str = ""
    rel_error: float | None = None
    tolerance: float | None = None
    attn_median_s: float | None = None  # forward + backward of one attention layer
    attn_p10_s: float | None = None
    attn_p90_s: float | None = None
    step_median_s: float | None = None
    step_p10_s: float | None = None
    step_p90_s: float | None = None
    mfu: float | None = None
    speedup: float | None = None  # baseline step time / this step time
    attention_share: float | None = None  # n_layers x attention time / step time
    kernel: str = ""  # aten operators the forward dispatches to (same kernel, same signature)


def attention_section(job, device, torch_device, flops_per_step, peak, progress, clock,
                      ddp_half: bool = True) -> tuple[list, Any]:
    """Every implementation checked against unfused float32 and timed alone; then their training steps raced
    (:mod:`mfu_lab.analysis.racing`): ``race_steps`` steps each, the survivors (the job's own attention always) for
    the job's ``steps``, side by side. ``thorough``: every correct implementation for the full ``steps``.
    Under a budget the final round fits :data:`DDP_HALF` of step 2's share left when the DDP half runs after it
    (``ddp_half``), else the whole of it: nothing is held back for a DDP race that will not run (world size 1)."""
    job = shaped(job)  # a factory model's own width and heads (core.engine.meta_shape), not the file's
    hd = job.d_model // job.n_heads
    check_shape = (min(2, job.micro_batch), job.n_heads, job.seq_len, hd)
    time_shape = (job.micro_batch, job.n_heads, job.seq_len, hd)
    rows, fns = [], {}
    impls = att.candidates(device.type, job.dtype)
    eta = progress.eta("attention implementations", len(impls))
    for n, impl in enumerate(impls, 1):
        progress(f"attention [{n}/{len(impls)}] {impl.name}" + eta.tag(n - 1))
        if impl.fn is None:
            rows.append(AttentionRow(impl.name, "unavailable", impl.skipped))
            continue
        c = att.check(impl.fn, check_shape, job.dtype, torch_device, job.seed)
        if c.error:
            rows.append(AttentionRow(impl.name, "unavailable", c.error, tolerance=c.tolerance))
            continue
        if not c.ok:
            rows.append(AttentionRow(impl.name, "wrong", f"relative error {c.rel_error:.2e} > tolerance "
                                     f"{c.tolerance:.0e} against unfused float32; not timed, never recommended",
                                     c.rel_error, c.tolerance))
            continue
        a = att.time_fwd_bwd(impl.fn, time_shape, job.dtype, torch_device)
        kernel = att.kernel_signature(impl.fn, check_shape, job.dtype, torch_device)
        rows.append(AttentionRow(impl.name, "ok", "", c.rel_error, c.tolerance, a.median, a.p10, a.p90, kernel=kernel))
        fns[impl.name] = impl.fn
    eta.finish()

    def train(name: str, steps: int, full: bool = False) -> list[float]:
        model = build_model(job).to(torch_device).train()
        model.set_attention(fns[name])
        if full:  # the full-length runs: a line each quarter and at least every GAP_S seconds, with time left
            tick = progress.items(f"  attention {name}: steps")
        else:  # a screening's few steps: a line only if they run long (between steps, never inside one)
            hb = progress.heartbeat(f"  attention {name} (first round)")
            tick = lambda done, total, elapsed: hb.beat(done, total)  # noqa: E731
        t = run_steps(build_train_step(eager(job), model, device.type), build_loader(job, job.warmup_steps + steps,
                      device.type), torch_device, job.warmup_steps, steps, tick)
        return t.measured("wall_s")

    ok = [r for r in rows if r.status == "ok"]
    own = next((r for r in ok if r.name == JOB_IMPL[job.attention]), None)
    ok = _one_per_kernel(ok, own)
    refs = [own.name] if own else []
    log = racing.RaceLog("exhaustive" if job.thorough else "racing", refs)
    walls: dict[str, list[float]] = {}
    final = [r.name for r in ok]
    steps = job.steps  # of each final-round run: fewer when the budget's half for attention cannot hold them
    if not job.thorough and len(ok) > 2:
        t0 = time.perf_counter()
        first = progress.eta("attention first round", len(ok))
        screen = {}
        for i, r in enumerate(ok, 1):
            progress(f"attention first round [{i}/{len(ok)}] {r.name}: {job.race_steps} steps" + first.tag(i - 1))
            screen[r.name] = train(r.name, job.race_steps)
        first.finish()
        final, dropped = racing.survivors(screen, refs)
        each = (time.perf_counter() - t0) / len(ok) / (job.warmup_steps + job.race_steps)  # one step, measured
        left = clock.left_s()
        half = None if left is None else left * (1 - DDP_HALF if ddp_half else 1.0)  # the rest: the DDP race's
        whose = (f"half of step 2's {left or 0:.0f} s left; the other half is the DDP race's" if ddp_half else
                 f"step 2's {left or 0:.0f} s left, all of it: no DDP race runs after it")
        if half is not None and each * (job.warmup_steps + job.steps) * len(final) > half:
            cut = [k for k in final[1:] if k not in refs]
            final = [k for k in final if k not in cut]
            dropped |= {k: "budget: the final round measures the leader and the job's attention only" for k in cut}
            if cut:
                clock.shorten("attention final round", f"{', '.join(cut)} not measured for the full {job.steps} "
                              f"steps ({whose})")
        if half is not None:
            steps = fit_count(half, job.steps, each * len(final), fixed_s=each * job.warmup_steps * len(final),
                              least=min(job.steps, FINAL_LEAST))
            if steps < job.steps:
                clock.shorten("attention final steps", f"{steps} of the job's {job.steps} for each of "
                              f"{', '.join(final)}: {whose}, at {each:.2f} s a step (measured in the first round)")
        log.rounds.append(racing.log_round(1, job.race_steps, screen, final, dropped, time.perf_counter() - t0))
        for r in ok:
            if r.name in dropped:
                walls[r.name] = screen[r.name]
                r.status, r.reason = "dropped", dropped[r.name] + f" (figures from {job.race_steps} steps)"
    t0 = time.perf_counter()
    full = progress.eta("attention final round", len(final))
    for i, name in enumerate(final, 1):
        progress(f"attention [{i}/{len(final)}] {name}: {steps} steps" + full.tag(i - 1))
        walls[name] = train(name, steps, full=True)
    full.finish()
    log.rounds.append(racing.log_round(len(log.rounds) + 1, steps, {k: walls[k] for k in final}, final, {},
                                       time.perf_counter() - t0))
    for r in rows:
        if r.name in walls:
            st = stats(walls[r.name])
            r.step_median_s, r.step_p10_s, r.step_p90_s = st.median, st.p10, st.p90
            r.mfu = fl.mfu(flops_per_step, len(walls[r.name]) / sum(walls[r.name]), peak)
            # attention runs n_layers times per micro-batch, grad_accum micro-batches per (timed) optimizer step
            r.attention_share = job.n_layers * job.grad_accum * r.attn_median_s / st.median
            if r.attention_share > 1.0:  # impossible: flagged in the table, used for nothing
                r.reason = "; ".join(x for x in (r.reason, IMPOSSIBLE_SHARE) if x)
    return rows, log


def _one_per_kernel(ok: list[AttentionRow], own: AttentionRow | None) -> list[AttentionRow]:
    """The rows whose training steps are timed: one per kernel (the job's own attention for its kernel, else the
    first row that dispatches to it). The others run the same code, so their steps are not timed again: they are
    marked ``same kernel`` and neither raced nor recommended."""
    keep: dict[str, AttentionRow] = {}
    for r in ([own] if own else []) + [r for r in ok if r is not own]:
        if not r.kernel or r.kernel not in keep:
            keep[r.kernel or r.name] = r
        else:
            r.status = "same kernel"
            r.reason = (f"dispatches to the same kernel as {keep[r.kernel].name} here ({r.kernel}): its training "
                        "step is that one's, so it is not timed again (a difference would be run-to-run noise)")
    return [r for r in ok if r.status == "ok"]


def _pick(rows: list, reference):
    """The fastest row, but only if it beats ``reference`` beyond the noise; else the reference.

    Beyond the noise: its p90 step time is below the reference's p10 (the ranges do not overlap).
    """
    if not rows:
        return None
    pool = list(rows) + ([reference] if reference is not None and all(r is not reference for r in rows) else [])
    figures = {i: (r.step_median_s, r.step_p10_s, r.step_p90_s) for i, r in enumerate(pool)}
    ref = next((i for i, r in enumerate(pool) if r is reference), None)
    return pool[racing.beyond_noise(figures, ref)]
