"""The verify step's figures from the measured staircase: speedups, the loss check, the ledgers and the headline.

Once the rungs ran (steps.verify.rungs, or steps.verify.layout in the job's own layout), each measured rung gets its
speedup over the original and its gain over the rung below, each with a bootstrap interval of the ratio of medians
(:func:`mfu_lab.core.measure.sidebyside.bootstrap_speedup`); a gain whose interval contains 1.0 is "not proven". The
loss curves of the original and the tuned rung over the same steps are compared at the end against
``loss_tolerance``; the ledgers before and after come from the same method on both (the single-process ledger of the
interleaved steps); and the headline and the step's metrics say MFU and tokens/s over the total wall time of the
measured steps, as step 1 does, each MFU against its own precision's peak.
"""

from __future__ import annotations

import statistics
from typing import Any

from mfu_lab.core.engine.work import NO_TOKENS
from mfu_lab.core.job.schema import Job
from mfu_lab.core.measure.health import HealthSummary
from mfu_lab.core.measure.ledger import HardwareFlops, Ledger, single_process_ledger
from mfu_lab.core.measure.sidebyside import bootstrap_speedup
from mfu_lab.core.measure.timed import Timings
from mfu_lab.core.store.results import Metric
from mfu_lab.steps.verify.rungs import Rung

WALL = "over the total wall time of the measured steps"  # MFU and tokens/s, as in step 1 (rung_figures)
LOSS_WINDOW = 5  # steps averaged at the end of each loss curve


def speedups(rungs: list[Rung], base_name: str = "original") -> None:
    """Each measured rung's speedup over the original (the first rung, named ``base_name``) and gain over the rung
    below, with their intervals."""
    measured = [r for r in rungs if r.wall_s]
    if not measured or measured[0].name != base_name:
        return
    base = measured[0]
    for below, rung in zip(measured, measured[1:]):
        total = bootstrap_speedup(base.wall_s, rung.wall_s)
        gain = bootstrap_speedup(below.wall_s, rung.wall_s)
        rung.speedup, rung.speedup_low, rung.speedup_high = total.value, total.low, total.high
        rung.gain, rung.gain_low, rung.gain_high, rung.proven = gain.value, gain.low, gain.high, gain.proven
    base.speedup = base.speedup_low = base.speedup_high = 1.0


def compare_losses(job: Job, original: Rung, tuned: Rung) -> dict[str, Any]:
    """The tuned rung's loss against the original's over the same steps: the gap of their final means."""
    n = min(len(original.loss), len(tuned.loss))
    if n == 0 or tuned is original:
        return {"status": "skipped", "reason": "no tuned rung was measured", "tolerance": job.loss_tolerance}
    w = min(LOSS_WINDOW, n)
    a, b = original.loss[:n], tuned.loss[:n]
    gap = statistics.fmean(b[n - w:]) / statistics.fmean(a[n - w:]) - 1
    return {"status": "ok" if gap <= job.loss_tolerance else "off", "original": a, "tuned": b, "tuned_rung": tuned.name,
            "final_gap": gap, "window": w, "tolerance": job.loss_tolerance,
            "note": f"mean loss of the last {w} of {n} steps (same seed, same batches): tuned / original - 1"}


def ledgers(before: Rung, after: Rung) -> dict[str, Ledger]:
    """The ledgers before and after: the single-process ledger of each one's interleaved steps."""
    health = HealthSummary(False, "not sampled by the verify step")
    return {name: single_process_ledger(_timings(r), r.mfu or 0.0, health, HardwareFlops(
            r.hardware_flops_ratio, r.flops_source, "as the rung's process counted them")
            if r.hardware_flops_ratio else None) for name, r in (("before", before), ("after", after))}


def _timings(r: Rung) -> Timings:
    return Timings(r.wall_s, r.data_s, r.compute_s, r.loss[-len(r.wall_s):], 0, "interleaved rounds, "
                   "time.perf_counter (CPU) or CUDA events around each phase")


def _pct(v: float | None) -> str:
    if v is None:
        return "n/a"
    return f"{v:.1%}" if v >= 0.01 else f"{v:.3%}"


def headline(before: Rung, after: Rung, rungs: list[Rung], loss: dict) -> dict[str, Any]:
    """The step's headline: MFU before and after, the speedup with its interval, the changes that carried it."""
    if after is None or after is before or after.speedup is None:
        return {"text": "No adopted change could be timed against the original here, so there is no measured gain "
                        "to show (see the changes and the skipped list)", "carried": []}
    carried = [r.name for r in rungs[1:] if r.proven and (r.gain or 0) > 1]
    same_peak = before.peak_flops_per_s == after.peak_flops_per_s
    ci = f"[{after.speedup_low:.2f}, {after.speedup_high:.2f}]"
    a, b = (r.peak_precision or r.dtype for r in (before, after))
    if not same_peak and before.peak_flops_per_s and after.peak_flops_per_s:  # the speedup first: MFUs differ in peak
        text = (f"speedup {after.speedup:.2f}x {ci}, measured side by side; MFU {_pct(before.mfu)} -> "
                f"{_pct(after.mfu)}, each against its own precision's peak ({a}, then {b}), and this device's {b} "
                f"peak is {after.peak_flops_per_s / before.peak_flops_per_s:.1f}x its {a} peak: across precisions "
                "compare the speedup, not the MFU")
    else:
        text = f"MFU {_pct(before.mfu)} -> {_pct(after.mfu)} (measured side by side, speedup {after.speedup:.2f}x {ci})"
        text += tail_note(before, after) if same_peak else ""
        if not same_peak:
            text += "; no MFU without a peak: " + (after if before.peak_flops_per_s else before).peak_source
    return {"text": text, "mfu_before": before.mfu, "mfu_after": after.mfu, "speedup": after.speedup,
            "speedup_low": after.speedup_low, "speedup_high": after.speedup_high,
            "proven": after.speedup_low > 1.0 or after.speedup_high < 1.0, "carried": carried,
            "loss_ok": loss.get("status") == "ok"}


def tail_note(before: Rung, after: Rung) -> str:
    """Why the MFU ratio falls outside the speedup's interval, when it does: MFU divides by the total wall time of
    the measured steps, the speedup compares median steps, and a few slow steps (a neighbour, a collection) weigh
    in the first only. Names the rung whose mean step is furthest above its median, and its slowest step. Said only
    when the MFUs' ratio is the ratio of the mean steps (the two rungs count the same FLOPs per step)."""
    if not (before.mfu and after.mfu and after.speedup_low and after.speedup_high and before.wall_s and after.wall_s):
        return ""
    ratio = after.mfu / before.mfu
    walls = statistics.fmean(before.wall_s) / statistics.fmean(after.wall_s)  # the MFUs' ratio at equal FLOPs
    if after.speedup_low <= ratio <= after.speedup_high or abs(ratio / walls - 1) > 0.01:
        return ""  # inside the interval, or the rungs count other FLOPs per step: not a matter of slow steps
    name, r = max((("the tuned job", after), ("the original", before)),
                  key=lambda nr: statistics.fmean(nr[1].wall_s) / statistics.median(nr[1].wall_s))
    med = statistics.median(r.wall_s)
    return (f"; the MFUs' ratio ({ratio:.2f}x) is outside the speedup's interval because MFU counts the total wall "
            f"time and the speedup the median step: {name}'s mean step is {statistics.fmean(r.wall_s) / med:.2f}x "
            f"its median, its slowest {max(r.wall_s) * 1e3:.1f} ms against a median of {med * 1e3:.1f} ms")


def metrics(before: Rung | None, after: Rung | None, loss: dict) -> dict[str, Metric]:
    """The step's metrics: the job the workflow leaves (the tuned one when it was measured), before and after."""
    def m(v, unit, note):
        return Metric(v, unit, "measured", note)

    tuned = after is not None and after is not before
    shown = after if tuned else before  # the job the workflow leaves: the tuned one when it was measured
    return {
        "mfu": m(shown.mfu if shown else None, "fraction", ("the tuned job" if tuned else "the original job (nothing "
                 "adopted was timed)") + ", step 7's interleaved rounds: model FLOPs x steps / (its precision's peak x "
                 f"wall time), {WALL}"),
        "tokens_per_s": m(shown.tokens_per_s if shown else None, "tokens/s",
                          f"tokens per step x steps / wall time, {WALL}" if not shown or shown.tokens_per_s is not None
                          else NO_TOKENS),
        "samples_per_s": m(getattr(shown, "samples_per_s", None) if shown else None, "samples/s",
                           f"samples per step x steps / wall time, {WALL}"),
        "step_time_median_s": m(shown.step_median_s if shown else None, "s", "median of the interleaved steps"),
        "mfu_before": m(before.mfu if before else None, "fraction", "the original job, interleaved rounds: model "
                        f"FLOPs x steps / (peak x wall time), {WALL}"),
        "mfu_after": m(after.mfu if tuned else None, "fraction", "the tuned job, the same rounds: model FLOPs x "
                       f"steps / (peak x wall time), {WALL}"),
        "speedup": m(after.speedup if tuned else None, "x", "original median step / tuned median step, side by side"),
        "speedup_low": m(after.speedup_low if tuned else None, "x", "2.5th percentile of the bootstrap"),
        "speedup_high": m(after.speedup_high if tuned else None, "x", "97.5th percentile of the bootstrap"),
        "final_loss_gap": m(loss.get("final_gap"), "fraction", "tuned / original mean loss over the last steps - 1"),
    }
