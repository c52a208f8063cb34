"""The MFU ledger: 100% of peak split into MFU and four named losses that add up to it.

One builder per way of measuring: :func:`single_process_ledger` from step 1's timed steps,
:func:`ddp_ledger` from a data-parallel launch (step 2), :func:`trace_ledger` from a profiler trace's
breakdown (steps 3 and 4).

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
from typing import Protocol

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


def ddp_ledger(mfu_value: float, exposed: float, data: float, world: int) -> Ledger:
    """A data-parallel step's ledger (step 2): ``exposed`` is the step time with DDP's all-reduce minus the same
    steps under ``no_sync``, over the step time; ``data`` the data-wait share; hardware is the rest."""
    hardware = 1.0 - mfu_value - exposed - data
    return Ledger([
        LedgerItem("mfu", mfu_value, "measured", f"{world} ranks x model FLOPs / (total peak x measured step time)"),
        LedgerItem("hardware", hardware, "measured", "the rest: computing below peak (1 - the other parts)"),
        LedgerItem("structure", exposed, "measured", "exposed communication: step time with DDP all-reduce minus "
                   "the same steps under no_sync (no communication) measured right after, over step time"),
        LedgerItem("software", data, "measured", "data wait share of the DDP step"),
        LedgerItem("operations", 0.0, "analytic", "not sampled during the DDP launch; step 1 reads clocks"),
    ])


class Breakdown(Protocol):
    """The shares of a profiled window a trace analysis gives (``mfu_lab.analysis.trace.Breakdown``)."""

    computing: float
    copying: float
    communicating: float
    comm_total: float
    comm_overlapped: float
    waiting_for_data: float
    idle: float


def trace_ledger(b: Breakdown, mfu_profiled: float, device_type: str) -> Ledger:
    """A profiled window's ledger (steps 3 and 4), by the trace's own split of the time."""
    return Ledger([
        LedgerItem("mfu", mfu_profiled, "measured", "model FLOPs x profiled steps / (peak x profiled window)"),
        LedgerItem("hardware", b.computing + b.copying - mfu_profiled, "measured",
                   f"device busy below peak: computing {b.computing:.1%} + copying memory {b.copying:.1%} of the "
                   "profiled window, minus MFU"),
        LedgerItem("structure", b.communicating, "measured",
                   f"communication not hidden behind compute ({b.comm_total:.1%} in all, {b.comm_overlapped:.1%} "
                   "overlapped)" if b.comm_total else "no communication in a one-process profile"),
        LedgerItem("software", b.waiting_for_data + b.idle, "measured",
                   f"device idle: waiting for data {b.waiting_for_data:.1%} + idle {b.idle:.1%} ("
                   + ("no kernel running: the host is launching, synchronising or in Python)" if device_type == "cuda"
                      else "no operator running: Python, the autograd engine and the loop between operators)")),
        LedgerItem("operations", 0.0, "analytic", "not separated while profiling (clocks are read in step 1)"),
    ])
