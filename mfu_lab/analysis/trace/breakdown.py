"""Reading torch.profiler traces: the top-N table, a time breakdown and fusion candidates.

Everything here works on the Chrome/Perfetto JSON that ``torch.profiler`` exports
(Kineto format), so the same code reads a trace from this run, a committed test
fixture, or a trace a user recorded elsewhere. Two kinds of trace:

- GPU traces hold device activity (``kernel``, ``gpu_memcpy``, ``gpu_memset``
  events on CUDA streams). The table ranks kernels; each kernel is tied to the
  operator that launched it through its ``External id`` (for shapes and category).
- CPU-only traces hold operators (``cpu_op``) on host threads. The table ranks
  operators by *self* time (their time minus the operators nested inside them),
  which is where a CPU spends its time.

The time breakdown partitions the profiled window (the ``ProfilerStep#N`` spans;
the whole trace when there are none) into: computing, communicating not hidden
behind compute, copying memory, waiting for data (host inside the DataLoader
while the device is idle) and idle. The parts add up to the window exactly.
HolisticTraceAnalysis computes a similar breakdown for GPU traces but fails on
CPU-only ones, so this module does both the same way.

Fusion candidates (runs of adjacent memory-bound operations, with the traffic a fused kernel would save)
are found by :mod:`.fusion`, whose docstring gives the formula.

The parts: :mod:`.events` (reading, categorising, intervals), :mod:`.index`
(one trace indexed), :mod:`.fusion` (fusion candidates); this module holds the table,
the breakdown and :func:`analyse`, and re-exports the parts' names.
"""

from __future__ import annotations

import re
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from typing import Any

from mfu_lab.analysis.trace.events import (
    CATEGORIES,
    MEMORY_BOUND,  # noqa: F401 - re-exported (callers use trace.MEMORY_BOUND)
    Event,
    categorise,  # noqa: F401 - re-exported (callers use trace.categorise)
    comm_kind,
    inside,
    intersect,
    load_trace,  # noqa: F401 - re-exported (callers use trace.load_trace)
    measure,
    self_spans,
    shape_text,
    short_name,  # noqa: F401 - re-exported (callers use trace.short_name)
    subtract,
    union,
)
from mfu_lab.analysis.trace.fusion import (
    FusionCandidate,
    find_fusion,
)
from mfu_lab.analysis.trace.index import IndexedTrace


# ------------------------------------------------------------------ results
@dataclass
class TopRow:
    name: str
    category: str
    calls: int
    total_s: float
    mean_s: float
    share: float  # of the profiled window
    shapes: str = ""  # the most frequent input shapes (and dtypes) of the operator
    shape_variants: int = 0
    launched_by: str = ""  # GPU: the operator that launched the kernel


@dataclass
class Breakdown:
    window_s: float
    steps: int
    computing: float  # fractions of the window; the five parts add up to 1
    communicating: float  # communication not overlapped by compute
    copying: float
    waiting_for_data: float
    idle: float
    comm_total: float  # all communication, hidden or not
    comm_overlapped: float  # communication under compute
    # per collective kind (allgather, reduce_scatter, allreduce, send, recv, ...): {"total": share of the window,
    # "exposed": share not under compute}; kinds may overlap each other, so the exposed shares can add up to a
    # little more than ``communicating``
    comm_by_kind: dict[str, dict[str, float]] = field(default_factory=dict)

    def parts(self) -> dict[str, float]:
        return {"computing": self.computing, "communicating (exposed)": self.communicating,
                "copying memory": self.copying, "waiting for data": self.waiting_for_data, "idle": self.idle}



@dataclass
class TraceAnalysis:
    kind: str  # gpu | cpu
    steps: int
    window_s: float
    step_time_s: float  # window / steps
    top: list[TopRow]
    top_share: float  # the top rows' shares added up
    rest_share: float  # every other row
    rest_count: int
    breakdown: Breakdown
    category_share: dict[str, float]
    fusion: list[FusionCandidate]
    optimizer: dict[str, Any]
    notes: list[str] = field(default_factory=list)
    ops_per_step: float = 0.0  # kernels and copies (GPU) / operators (CPU) per profiled step, counted



# ------------------------------------------------------------------ analysis
def _table(tr: IndexedTrace, window_total_us: float) -> list[TopRow]:
    """Every kernel (GPU) or operator (CPU) with its self time, largest first."""
    groups: dict[tuple[str, str], list[Event]] = defaultdict(list)
    if tr.kind == "gpu":
        for d in tr.device:
            if tr.in_window(d):
                groups[(d.name, d.category)].append(d)
        self_us = lambda e: e.dur  # noqa: E731 - a kernel's whole duration is its own
    else:
        for op in tr.ops:
            if tr.in_window(op):
                groups[(op.name, op.category)].append(op)
        self_us = lambda e: e.self_us  # noqa: E731
    rows = []
    for (name, cat), evs in groups.items():
        total = sum(self_us(e) for e in evs) / 1e6
        shape_src = [(tr.linked_op(e) if tr.kind == "gpu" else e) for e in evs]
        shapes = Counter(shape_text(o.args) for o in shape_src if o is not None)
        shapes.pop("", None)
        launched = Counter(o.name for o in shape_src if o is not None) if tr.kind == "gpu" else Counter()
        rows.append(TopRow(name, cat, len(evs), total, total / len(evs), total * 1e6 / window_total_us,
                           shapes.most_common(1)[0][0] if shapes else "", len(shapes),
                           launched.most_common(1)[0][0] if launched else ""))
    rows.sort(key=lambda r: -r.total_s)
    return rows


def _breakdown(tr: IndexedTrace) -> Breakdown:
    w0, w1 = tr.window
    window = [(w0, w1)]
    segs: dict[str, list] = defaultdict(list)
    kinds: dict[str, list] = defaultdict(list)
    if tr.kind == "gpu":
        for d in tr.device:
            segs[d.category].append((d.ts, d.end))
            if d.category == "communication":
                kinds[comm_kind(d.name, d.args)].append((d.ts, d.end))
    else:
        last: dict[Any, str] = {}  # per thread, the kind of the collective issued last
        for op in sorted(tr.ops, key=lambda o: o.ts):
            kind = comm_kind(op.name, op.args) if op.category == "communication" else ""
            if kind == "other" and "wait" in op.name:  # a functional collective's wait_tensor: the last one's
                kind = last.get((op.pid, op.tid), "other")
            elif kind and kind != "other":
                last[(op.pid, op.tid)] = kind
            for s in self_spans(op):
                segs[op.category].append(s)
                if kind:
                    kinds[kind].append(s)
        by_ops = bool(kinds)  # the caller's own collective operators name their kinds
        for c in tr.host_comm:  # gloo's own work events (its threads' all-reduce)
            segs["communication"].append((c.ts, c.end))
            if not by_ops:  # gloo runs a reduce-scatter as an all-reduce: its thread's names are not the kinds
                kinds[comm_kind(c.name, c.args)].append((c.ts, c.end))
    comm = intersect(union(segs.pop("communication", [])), window)
    copy = intersect(union(segs.pop("memory copy", [])), window)
    segs.pop("data loading", None)  # a CPU run's loader work is the device waiting for data
    compute = intersect(union(s for v in segs.values() for s in v), window)
    busy = union(compute + comm + copy)
    idle = subtract(window, busy)
    waiting = intersect(idle, tr.data_spans)
    total = w1 - w0
    c_total = measure(comm)
    overlapped = measure(intersect(comm, compute))
    by_kind = {}
    for kind, spans in sorted(kinds.items()):
        mine = intersect(union(spans), window)
        if mine:
            by_kind[kind] = {"total": measure(mine) / total, "exposed": measure(subtract(mine, compute)) / total}
    # a collective seen twice (the caller's wait and gloo's own thread) must not count twice: where the kinds'
    # exposed shares add up to more than the exposed union, they are scaled down to it, in proportion
    exposed_sum = sum(v["exposed"] for v in by_kind.values())
    exposed_union = (c_total - overlapped) / total
    if exposed_sum > exposed_union > 0:
        for v in by_kind.values():
            v["exposed"] *= exposed_union / exposed_sum
    return Breakdown(
        total / 1e6, tr.n_steps, measure(compute) / total, (c_total - overlapped) / total,
        measure(subtract(copy, union(compute + comm))) / total, measure(waiting) / total,
        (measure(idle) - measure(waiting)) / total, c_total / total, overlapped / total, by_kind)



def _optimizer(tr: IndexedTrace, step_time_s: float) -> dict[str, Any]:
    """How the optimiser step runs: its time, how many operations it issues, foreach/fused or not."""
    if not tr.opt_spans:
        return {"found": False}
    names = [op.name for op in tr.roots if tr.in_window(op) and inside(op.ts, tr.opt_spans)]
    kernels = [d for d in tr.device if tr.in_window(d) and d.category == "optimizer"]
    fused = any(re.search(r"foreach|fused|multi_tensor", n) for n in names + [k.name for k in kernels])
    span_s = measure(intersect(tr.opt_spans, [tr.window])) / 1e6 / tr.n_steps
    ops_per_step = (len(kernels) if tr.kind == "gpu" else len(names)) / tr.n_steps
    return {"found": True, "time_per_step_s": span_s, "share_of_step": span_s / step_time_s if step_time_s else 0.0,
            "ops_per_step": ops_per_step, "multi_tensor": fused,
            "what": "kernels" if tr.kind == "gpu" else "operators"}


def analyse(trace: dict[str, Any], top_n: int = 20, bandwidth: float | None = None,
            step_s: float | None = None) -> TraceAnalysis:
    """Top-N table, time breakdown, categories and fusion candidates of one trace.

    ``bandwidth`` (bytes/s, measured on the device) turns each candidate's saved
    traffic into time; without it only the bytes are given. ``step_s``, the step timed without the profiler,
    is what the fusion candidates' and the optimizer's shares of the step are of (the profiled window's step,
    ``step_time_s``, without it: on the H200 74 ms against the real 48.7 ms).
    """
    tr = IndexedTrace(trace)
    w0, w1 = tr.window
    window_us = w1 - w0
    all_rows = _table(tr, window_us)
    top, rest = all_rows[:top_n], all_rows[top_n:]
    rest_share, rest_count = sum(r.share for r in rest), len(rest)
    cat_share = dict.fromkeys(CATEGORIES, 0.0)
    for r in all_rows:
        cat_share[r.category] += r.share
    step_time = window_us / 1e6 / tr.n_steps
    notes = []
    if not tr.steps:
        notes.append("no ProfilerStep# spans in the trace: the whole trace is taken as one step")
    if tr.kind == "cpu" and not any(o.args.get("Input Dims") for o in tr.ops):
        notes.append("recorded without shapes (record_shapes=False): no shapes, and no traffic estimates")
    fusion = find_fusion(tr, step_s or step_time, bandwidth)
    if any(c.saved_bytes_per_step for c in fusion):  # shapes were recorded: drop runs that pass nothing along
        passless = [c for c in fusion if not c.saved_bytes_per_step]
        fusion = [c for c in fusion if c.saved_bytes_per_step]
        if passless:
            notes.append(f"{len(passless)} run pattern(s) of adjacent memory-bound operations pass no tensor from "
                         "one to the next (e.g. a bias-gradient sum beside an activation's backward), so fusing "
                         "them saves no traffic; left out: " + "; ".join(c.pattern for c in passless))
    work = tr.device if tr.kind == "gpu" else tr.ops
    ops = sum(1 for e in work if tr.in_window(e)) / tr.n_steps
    return TraceAnalysis(
        tr.kind, tr.n_steps, window_us / 1e6, step_time, top, sum(r.share for r in top), rest_share, rest_count,
        _breakdown(tr), cat_share, fusion, _optimizer(tr, step_s or step_time), notes, ops)


def idle_share(a: TraceAnalysis, step_s: float | None = None) -> tuple[float, str, str]:
    """The device's idle share, outside data loading: ``(share, basis, how)``.

    Basis ``window``: the profiled window's idle time over the window. Basis ``step_ms``: against a step timed
    without the profiler, ``1 - (busy + waiting for data) per profiled step / step_s``, busy being computing,
    exposed communication and copying. The profiler slows the host (its window's steps run longer: 32% on the
    first H200 run), not the device's kernels, so the device's busy time per step carries over to the real step
    while the window's idle time does not; clamped at 0 when the real step is shorter than the busy time."""
    b = a.breakdown
    if not step_s:
        return b.idle, "window", "nothing running on the device, outside data loading / profiled window"
    busy = (b.computing + b.communicating + b.copying + b.waiting_for_data) * a.window_s / a.steps
    return (max(0.0, 1.0 - busy / step_s), "step_ms",
            f"1 - device busy per profiled step ({busy * 1e3:.2f} ms: computing, exposed communication, copies, "
            f"data wait) / the step without the profiler ({step_s * 1e3:.2f} ms)")

