"""Advice computed from a result's numbers. Each item says which figure triggered it.

Thresholds come from ../shared/FIELD-NOTES.md where one is given there
(throttling above 80 C, communication under 15%...) and are named constants here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    from mfu_lab.steps.baseline import BaselineResult

DATA_WAIT_LIMIT = 0.03  # above 3% of the step, the loader is worth fixing first
HOST_LIMIT = 0.05
CV_LIMIT = 0.10  # step times spread more than 10%: results are noisy
HOT_C = 80.0  # sustained temperatures above 80 C mean throttling (FIELD-NOTES, "Heat")
CLOCK_LOW = 0.90


@dataclass
class Advice:
    severity: str  # "act" (do this), "look" (worth a look), "info"
    message: str
    because: str  # the figures that triggered it


def baseline_advice(r: BaselineResult, flop_tolerance: float) -> list[Advice]:
    job, m = r.job, r.metrics
    out: list[Advice] = []
    data, host, cv = m["data_wait_fraction"].value, m["host_fraction"].value, m["step_time_cv"].value
    mfu_v, hw = m["mfu"].value, r.ledger.get("hardware").fraction
    on_gpu = r.peak["device_type"] == "cuda"

    if data > DATA_WAIT_LIMIT:
        if job["num_workers"] == 0:
            fix = "load batches in background processes: set num_workers to 2 or more (one per free core)"
        else:
            fix = (f"raise num_workers (now {job['num_workers']}) or prefetch_factor (now {job['prefetch_factor']}); "
                   "store data as large sequential shards")
        out.append(Advice("act", f"The device waits on data: {fix}.",
                          f"data wait is {data:.1%} of wall time (limit {DATA_WAIT_LIMIT:.0%})"))
    if host > HOST_LIMIT:
        out.append(Advice("look", "Host-side overhead is visible between steps: larger micro-batches, "
                          "torch.compile (step 4) or CUDA graphs reduce per-step host work.",
                          f"host time is {host:.1%} of wall time"))
    if cv > CV_LIMIT:
        out.append(Advice("look", "Step times are unsteady: look for neighbours on the machine, throttling or "
                          "garbage collection, and measure more steps before trusting small differences.",
                          f"coefficient of variation of step time is {cv:.1%} (limit {CV_LIMIT:.0%})"))
    if hw < 0:
        out.append(Advice("act", "MFU exceeds the share of time spent computing, so the peak is too low: "
                          "set peak_flops in the job to the device's true dense peak.",
                          f"MFU {mfu_v:.1%} > compute share {m['compute_fraction'].value:.1%}"))
    elif hw > 0.5:
        levers = []
        if on_gpu and job["dtype"] == "float32":
            levers.append("train in bfloat16 (dtype: bfloat16) so matmuls use tensor cores")
        if job["attention"] == "unfused":
            levers.append("use fused attention (attention: sdpa; step 2 measures it)")
        levers.append(f"raise micro_batch (now {job['micro_batch']}) while memory allows, for larger matmuls")
        levers.append("fuse memory-bound ops (step 3 finds them, step 4 compiles them)")
        out.append(Advice("act", "Most of the peak is lost while the device is busy: " + "; ".join(levers) + ".",
                          f"hardware loss is {hw:.1%} of peak at MFU {mfu_v:.1%}"))
    dis = r.flops.disagreement
    if dis is not None and dis > flop_tolerance:
        out.append(Advice("look", "Counted and analytic FLOPs disagree: MFU rests on the analytic figure; "
                          "check which operators the count includes (flops.counted_by_op).",
                          f"|counted - analytic| / analytic = {dis:.1%} (tolerance {flop_tolerance:.0%})"))
    h = r.health
    if h.sampled:
        if h.temperature_c_max is not None and h.temperature_c_max > HOT_C:
            out.append(Advice("act", "The GPU ran hot: check cooling and airflow; sustained heat lowers clocks.",
                              f"maximum temperature {h.temperature_c_max:.0f} C (limit {HOT_C:.0f} C)"))
        ratio = h.clock_ratio
        if ratio is not None and ratio < CLOCK_LOW and (h.throttled_fraction or 0) > 0:
            out.append(Advice("act", "Clocks were held down by power or heat (" + ", ".join(h.reasons_seen) + "): "
                              "this is operations loss no code change recovers.",
                              f"mean SM clock {ratio:.0%} of maximum"))
    if job["activation_checkpointing"]:
        out.append(Advice("info", "Activation checkpointing recomputes each block's forward: HFU exceeds MFU by "
                          "that work. Keep it only if the memory it frees buys a larger micro-batch.",
                          f"HFU {m['hfu'].value:.1%} vs MFU {mfu_v:.1%}"))
    if not on_gpu:
        out.append(Advice("info", "On a CPU the peak is this CPU's measured matmul rate, so MFU here says how "
                          "close the training step comes to the CPU's best matmul, not to a GPU's.",
                          f"peak {m['peak_flops_per_s'].value / 1e9:.1f} GFLOP/s, measured"))
    return out
