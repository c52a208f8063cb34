"""The MFU ledger: 100% of peak split into MFU, the recompute share and four named losses that add up to it.

One builder per way of measuring: :func:`single_process_ledger` from step 1's timed steps,
:func:`ddp_ledger` from a data-parallel launch (step 2), :func:`trace_ledger` from a profiler trace's
breakdown (steps 3 and 4).

For one process (step 1) the split is, over the measured steps' total wall time W:

- recompute       = HFU - MFU = (hardware FLOPs - model FLOPs) / (peak x W): work the device does that is
  not model work (activation-checkpointing recompute, the scores a flash-style attention kernel recomputes in
  backward); counted or analytic as the FLOPs were;
- software loss   = (data wait + host time) / W: the device waits on the loader or the loop;
- structure loss  = 0: one process, no communication or pipeline to expose;
- operations loss = compute/W x (1 - mean SM clock / max SM clock), counted only when NVML
  reported a power or thermal clock reason; unknown (0, and said so) where clocks are not read;
- compute efficiency loss = compute/W - MFU - recompute - operations loss: the residual, device busy below
  peak (memory-bound kernels, attention and optimizer kernels below peak, the launch gaps inside a step), which
  step 1 cannot attribute further; step 3's trace splits it.

Results stored before the recompute item existed name the residual ``"hardware"``: :data:`RENAMED` maps it to
``"efficiency"`` wherever a stored ledger is read back (:class:`LedgerItem` itself, and :func:`upgrade` for a
ledger still in JSON form), so no result format changes.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from mfu_lab.core.measure.health import HealthSummary
from mfu_lab.core.measure.timed import Timings

ORDER = ("mfu", "recompute", "efficiency", "structure", "software", "operations")
LABELS = {"mfu": "MFU", "recompute": "recompute (HFU - MFU)", "efficiency": "compute efficiency loss",
          "structure": "structure loss", "software": "software loss", "operations": "operations loss"}
RENAMED = {"hardware": "efficiency"}  # an earlier run's item name -> today's

RECOMPUTE_FORMULA = "HFU - MFU: (hardware FLOPs - model FLOPs) / (peak x wall)"
NOT_SEPARATED = "not separated here (within compute efficiency)"
EFFICIENCY_WHY = ("device busy below peak: memory-bound kernels, attention and optimizer kernels below peak, launch "
                  "gaps inside the step; step 3's trace splits it further")


@dataclass
class LedgerItem:
    name: str  # one of ORDER
    fraction: float  # of peak time
    source: str  # measured | analytic | ...
    explanation: str

    def __post_init__(self):
        self.name = RENAMED.get(self.name, self.name)  # a stored ledger from an earlier run

    @property
    def label(self) -> str:
        """The item's name as the report shows it: "compute efficiency loss" for ``efficiency``."""
        return LABELS.get(self.name, self.name)


@dataclass
class Ledger:
    items: list[LedgerItem]

    def get(self, name: str) -> LedgerItem:
        name = RENAMED.get(name, name)
        return next(i for i in self.items if i.name == name)

    @property
    def total(self) -> float:
        return sum(i.fraction for i in self.items)


def upgrade(ledger: dict[str, Any]) -> dict[str, Any]:
    """A stored ledger (its JSON form) with an earlier run's item names mapped to today's (see :data:`RENAMED`)."""
    return {**ledger, "items": [{**i, "name": RENAMED.get(i["name"], i["name"])} for i in ledger.get("items", [])]}


@dataclass(frozen=True)
class HardwareFlops:
    """A step's hardware FLOPs per model FLOP, from step 1's FLOP accounting: the recompute share is
    MFU x (ratio - 1), which is HFU - MFU over the same wall time and peak."""

    ratio: float  # hardware FLOPs / model FLOPs per step (1.0: nothing recomputed)
    source: str  # counted | analytic: how the FLOPs were obtained
    what: str = ""  # what is recomputed, in words


class FlopFigures(Protocol):
    """The figures of ``mfu_lab.core.measure.flops.FlopReport`` the recompute share needs."""

    model_flops_per_step: float
    model_flops_source: str
    hardware_flops_per_step: float
    flash_recompute_flops_per_step: float


def hardware_flops(report: FlopFigures) -> HardwareFlops | None:
    """The recompute ratio of a FLOP report (``mfu_lab.core.measure.flops.count_step_flops``); None without model
    FLOPs."""
    model = report.model_flops_per_step
    if not model:
        return None
    flash = report.flash_recompute_flops_per_step or 0.0
    ckpt = max(0.0, report.hardware_flops_per_step - model - flash)
    parts = ([f"activation checkpointing {ckpt / model:.1%} of model FLOPs"] if ckpt else []) + (
        [f"flash-style score recompute {flash / model:.1%}"] if flash else [])
    return HardwareFlops(report.hardware_flops_per_step / model, report.model_flops_source,
                         ", ".join(parts) or "nothing recomputed")


def recompute_item(mfu_value: float, hw: HardwareFlops | None, why_not: str = "") -> LedgerItem:
    """The recompute share of peak: HFU - MFU, or 0 (said so) where this measurement has no hardware FLOPs."""
    if hw is None:
        return LedgerItem("recompute", 0.0, "analytic", NOT_SEPARATED + (f": {why_not}" if why_not else ""))
    share = mfu_value * (hw.ratio - 1.0)
    return LedgerItem("recompute", share, hw.source,
                      f"{RECOMPUTE_FORMULA}; hardware FLOPs are {hw.ratio:.3f} x model FLOPs ({hw.what}): HFU "
                      f"{mfu_value + share:.1%} - MFU {mfu_value:.1%}")


def single_process_ledger(timings: Timings, mfu_value: float, health: HealthSummary,
                          hw: HardwareFlops | None = None) -> Ledger:
    wall = sum(timings.measured("wall_s"))
    data = sum(timings.measured("data_s")) / wall
    compute = sum(timings.measured("compute_s")) / wall
    host = 1.0 - data - compute  # wall = data + compute + host, by construction of the timings

    ratio = health.clock_ratio
    if health.sampled and ratio is not None and (health.throttled_fraction or 0) > 0:
        operations = compute * max(0.0, 1.0 - ratio)
        ops_why = (f"busy clocks averaged {ratio:.1%} of {health.reference_clock[1]} while NVML reported "
                   f"{', '.join(health.reasons_seen)} in {health.throttled_fraction:.0%} of busy samples; loss = "
                   "compute share x (1 - clock ratio)")
        ops_source = "measured"
    elif health.sampled:
        operations = 0.0
        ops_why = "NVML saw no power or thermal clock reason during the run"
        ops_source = "measured"
    else:
        operations = 0.0
        ops_why = f"unknown, not separated (counted within compute efficiency loss): {health.skipped_reason}"
        ops_source = "analytic"
    recompute = recompute_item(mfu_value, hw, "no hardware FLOP count given to this ledger")
    efficiency = compute - mfu_value - recompute.fraction - operations
    return Ledger([
        LedgerItem("mfu", mfu_value, "measured", "model FLOPs / (peak FLOP/s x measured wall time)"),
        recompute,
        LedgerItem("efficiency", efficiency, "measured",
                   f"compute share {compute:.1%} - MFU - recompute - operations loss: {EFFICIENCY_WHY}"),
        LedgerItem("structure", 0.0, "analytic", "single process: no communication or pipeline bubbles yet"),
        LedgerItem("software", data + host, "measured",
                   f"device waiting: data loading {data:.1%} + host/loop {host:.1%} of wall time"),
        LedgerItem("operations", operations, ops_source, ops_why),
    ])


def ddp_ledger(mfu_value: float, exposed: float, data: float, world: int, hw: HardwareFlops | None = None,
               why_not: str = "") -> Ledger:
    """A data-parallel step's ledger (step 2): ``exposed`` is the step time with DDP's all-reduce minus the same
    steps under ``no_sync``, over the step time; ``data`` the data-wait share; ``hw`` the hardware FLOPs per
    model FLOP of the ranks' step when known (else recompute stays within compute efficiency, ``why_not``
    says why); compute efficiency is the rest."""
    recompute = recompute_item(mfu_value, hw, why_not)
    efficiency = 1.0 - mfu_value - recompute.fraction - exposed - data
    return Ledger([
        LedgerItem("mfu", mfu_value, "measured", f"{world} ranks x model FLOPs / (total peak x measured step time)"),
        recompute,
        LedgerItem("efficiency", efficiency, "measured",
                   f"the rest, 1 - the other parts: {EFFICIENCY_WHY} (and the loop's host time, not separated in "
                   "the DDP step)"),
        LedgerItem("structure", exposed, "measured", "exposed communication: step time with DDP all-reduce minus "
                   "the same steps under no_sync (no communication) measured right after, over step time"),
        LedgerItem("software", data, "measured", "data wait share of the DDP step"),
        LedgerItem("operations", 0.0, "analytic", "not sampled during the DDP launch; step 1 reads clocks"),
    ])


class Breakdown(Protocol):
    """The shares of a profiled window a trace analysis gives (``mfu_lab.analysis.trace.breakdown.Breakdown``)."""

    computing: float
    copying: float
    communicating: float
    comm_total: float
    comm_overlapped: float
    waiting_for_data: float
    idle: float


def trace_ledger(b: Breakdown, mfu_profiled: float, device_type: str, hw: HardwareFlops | None = None) -> Ledger:
    """A profiled window's ledger (steps 3 and 4), by the trace's own split of the time; ``hw`` the hardware
    FLOPs per model FLOP of the profiled step (from its FLOP count), else recompute stays within compute
    efficiency."""
    recompute = recompute_item(mfu_profiled, hw, "no hardware FLOP count given to this ledger")
    return Ledger([
        LedgerItem("mfu", mfu_profiled, "measured", "model FLOPs x profiled steps / (peak x profiled window)"),
        recompute,
        LedgerItem("efficiency", b.computing + b.copying - mfu_profiled - recompute.fraction, "measured",
                   f"device busy below peak: computing {b.computing:.1%} + copying memory {b.copying:.1%} of the "
                   "profiled window - MFU - recompute (memory-bound kernels, attention and optimizer kernels below "
                   "peak; the kernel table and fusion candidates below split it)"),
        LedgerItem("structure", b.communicating, "measured",
                   f"communication not hidden behind compute ({b.comm_total:.1%} in all, {b.comm_overlapped:.1%} "
                   "overlapped)" if b.comm_total else "no communication in a one-process profile"),
        LedgerItem("software", b.waiting_for_data + b.idle, "measured",
                   f"device idle: waiting for data {b.waiting_for_data:.1%} + idle {b.idle:.1%} ("
                   + ("no kernel running: the host is launching, synchronising or in Python)" if device_type == "cuda"
                      else "no operator running: Python, the autograd engine and the loop between operators)")),
        LedgerItem("operations", 0.0, "analytic", "not separated while profiling (clocks are read in step 1)"),
    ])


P2P = ("send", "recv")


def layout_ledger(mfu_value: float, exposed_by_kind: dict[str, float], bubble: float | None, data: float,
                  layout_name: str, world: int, hw: HardwareFlops | None = None, why_not: str = "",
                  comm_source: str = "measured") -> Ledger:
    """The ledger of a job run in its own layout (FSDP, TP, SP, PP; step 1 under torchrun).

    ``exposed_by_kind``: each collective kind's time not under compute, as a share of the step (from the ranks'
    traces: :attr:`mfu_lab.analysis.trace.breakdown.Breakdown.comm_by_kind`); ``bubble``: the pipeline's fill and drain
    as a share of the step, measured per stage (None without a pipeline). A stage waiting out the bubble waits
    in its receive, so the point-to-point part of the structure loss is the larger of the two, not their sum:
    structure = exposed collectives other than send/recv + max(bubble, exposed send + recv).
    """
    recompute = recompute_item(mfu_value, hw, why_not)
    p2p = sum(v for k, v in exposed_by_kind.items() if k in P2P)
    others = {k: v for k, v in exposed_by_kind.items() if k not in P2P and v > 0}
    pipeline = max(bubble or 0.0, p2p)
    structure = sum(others.values()) + pipeline
    parts = [f"{k} {v:.1%}" for k, v in sorted(others.items(), key=lambda kv: -kv[1])]
    if bubble is not None:
        parts.append(f"pipeline bubble {bubble:.1%} (fill and drain, measured per stage) against send/recv "
                     f"waits {p2p:.1%}: the larger counts, {pipeline:.1%}")
    elif p2p:
        parts.append(f"send/recv {p2p:.1%}")
    efficiency = 1.0 - mfu_value - recompute.fraction - structure - data
    return Ledger([
        LedgerItem("mfu", mfu_value, "measured", f"model FLOPs of all {world} ranks / (peak x measured step time), "
                   f"{layout_name}"),
        recompute,
        LedgerItem("efficiency", efficiency, "measured",
                   f"the rest, 1 - the other parts: {EFFICIENCY_WHY} (and the loop's host time, not separated "
                   "under a layout)"),
        LedgerItem("structure", structure, comm_source,
                   "exposed communication by kind, share of the step not under compute on the slowest rank: "
                   + ("; ".join(parts) if parts else "none exposed")),
        LedgerItem("software", data, "measured", "data wait share of the step"),
        LedgerItem("operations", 0.0, "analytic", "not sampled during the layout's launch"),
    ])
