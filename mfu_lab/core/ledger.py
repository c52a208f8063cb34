"""The MFU ledger: 100% of peak split into MFU and four named losses that add up to it.

For one process (step 1) the split is, over the measured steps' total wall time W:

- software loss   = (data wait + host time) / W: the device waits on the loader or the loop;
- structure loss  = 0: one process, no communication or pipeline to expose;
- operations loss = compute/W x (1 - mean SM clock / max SM clock), counted only when NVML
  reported a power or thermal clock reason; unknown (0, and said so) where clocks are not read;
- hardware loss   = compute/W - MFU - operations loss: busy below peak (memory-bound kernels,
  low occupancy, and the launch gaps inside a step, which step 3's trace separates).
"""

from __future__ import annotations

from dataclasses import dataclass

from mfu_lab.core.health import HealthSummary
from mfu_lab.core.measure import Timings

ORDER = ("mfu", "hardware", "structure", "software", "operations")


@dataclass
class LedgerItem:
    name: str  # one of ORDER
    fraction: float  # of peak time
    source: str  # measured | analytic | ...
    explanation: str


@dataclass
class Ledger:
    items: list[LedgerItem]

    def get(self, name: str) -> LedgerItem:
        return next(i for i in self.items if i.name == name)

    @property
    def total(self) -> float:
        return sum(i.fraction for i in self.items)


def single_process_ledger(timings: Timings, mfu_value: float, health: HealthSummary) -> Ledger:
    wall = sum(timings.measured("wall_s"))
    data = sum(timings.measured("data_s")) / wall
    compute = sum(timings.measured("compute_s")) / wall
    host = 1.0 - data - compute  # wall = data + compute + host, by construction of the timings

    ratio = health.clock_ratio
    if health.sampled and ratio is not None and (health.throttled_fraction or 0) > 0:
        operations = compute * max(0.0, 1.0 - ratio)
        ops_why = (f"clocks averaged {ratio:.1%} of max while NVML reported {', '.join(health.reasons_seen)} "
                   f"in {health.throttled_fraction:.0%} of samples; loss = compute share x (1 - clock ratio)")
        ops_source = "measured"
    elif health.sampled:
        operations = 0.0
        ops_why = "NVML saw no power or thermal clock reason during the run"
        ops_source = "measured"
    else:
        operations = 0.0
        ops_why = f"unknown, not separated (counted within hardware loss): {health.skipped_reason}"
        ops_source = "analytic"
    hardware = compute - mfu_value - operations
    return Ledger([
        LedgerItem("mfu", mfu_value, "measured", "model FLOPs / (peak FLOP/s x measured wall time)"),
        LedgerItem("hardware", hardware, "measured",
                   "device computing below peak: compute share - MFU - operations loss "
                   "(includes launch gaps inside the step; step 3 splits them out)"),
        LedgerItem("structure", 0.0, "analytic", "single process: no communication or pipeline bubbles yet"),
        LedgerItem("software", data + host, "measured",
                   f"device waiting: data loading {data:.1%} + host/loop {host:.1%} of wall time"),
        LedgerItem("operations", operations, ops_source, ops_why),
    ])
