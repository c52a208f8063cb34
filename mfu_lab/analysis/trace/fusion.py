"""Fusion candidates in a trace: runs of adjacent memory-bound operations, and what fusing them saves.

Fusion candidates are runs of adjacent memory-bound operations (elementwise,
normalisation, reduction, memory copy) between compute-bound ones on the same
thread (CPU) or stream (GPU), grouped by their sequence of operator names. On a GPU an operation is the run of
kernels one operator launched, classified by its heaviest kernel (cuBLAS 13's mm and cuDNN's attention launch a
memset first: a matmul is never a memory-bound operation because of it). For
each run a fused kernel would not write every intermediate result to memory and
read it back: estimated saving = 2 x (output bytes of every operation but the
last), an operation's output taken as the size of its largest tensor input
(true for elementwise, normalisation, softmax and dropout). At the device's
measured memory bandwidth that traffic costs ``bytes / bandwidth`` seconds.
"""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

from mfu_lab.analysis.trace.events import (
    EPS_US,
    FACTORY_RE,
    MEMORY_BOUND,
    REDUCES_RE,
    Event,
    categorise,
    is_view,
    shape_text,
    short_name,
    subtree,
    tensor_bytes,
)
from mfu_lab.analysis.trace.index import IndexedTrace


@dataclass
class FusionCandidate:
    pattern: str  # 'add + layer_norm + dropout'
    ops: list[str]
    categories: list[str]
    per_step: float  # occurrences per profiled step
    time_per_step_s: float  # measured time of these runs per step
    saved_bytes_per_step: float  # analytic: 2 x intermediate outputs
    est_saving_per_step_s: float | None = None  # saved bytes / measured bandwidth
    share_of_step: float = 0.0  # measured time / step time
    remedy: str = ""
    example_shapes: str = ""



@dataclass
class _Unit:
    """One operation in the order a thread or stream ran them: an operator the model called, an
    autograd node of the backward, or the kernels one operator launched."""

    name: str
    category: str
    ts: float
    time_us: float
    out_bytes: int
    shapes: str
    transparent: bool  # moves no data (views, pass-through autograd nodes)
    phase: str = ""  # forward | backward | optimizer: a fused kernel never spans two of them
    heaviest_us: float = 0.0  # GPU: the longest of the operator's kernels, whose category is the unit's



def _cpu_units(tr: IndexedTrace) -> dict[Any, list[_Unit]]:
    lanes: dict[Any, list[_Unit]] = defaultdict(list)
    for root in tr.roots:
        if not tr.in_window(root):
            continue
        backward = root.name.startswith("autograd::engine::evaluate_function")
        for op in (root.children if backward else [root]):
            real = [o for o in subtree(op) if not is_view(o.name) and not re.search(r"Backward\d*$|AccumulateGrad",
                                                                                    o.name)]
            name = short_name(op.name)
            if not real:
                lanes[(op.pid, op.tid)].append(_Unit(name, "other", op.ts, op.dur, 0, "", True))
                continue
            heaviest = max(real, key=lambda o: o.self_us)
            own = categorise(op.name)
            cat = (op.category if op.category in ("data loading", "optimizer", "communication")
                   else own if own != "other" or FACTORY_RE.match(name) else heaviest.category)
            # a backward node's own input is the incoming gradient; the work's tensors are on its operators
            args = heaviest.args if backward or not tensor_bytes(op.args) else op.args
            phase = "optimizer" if cat == "optimizer" else "backward" if backward else "forward"
            lanes[(op.pid, op.tid)].append(_Unit(name, cat, op.ts, op.dur, _out_bytes(name, args),
                                                 shape_text(args), False, phase))
    return lanes


def _out_bytes(name: str, args: dict[str, Any]) -> int:
    """Bytes an operation writes: its largest tensor input's size, or none for a full reduction."""
    return 0 if REDUCES_RE.match(name) else max(tensor_bytes(args), default=0)


def _gpu_units(tr: IndexedTrace) -> dict[Any, list[_Unit]]:
    lanes: dict[Any, list[_Unit]] = defaultdict(list)
    by_stream: dict[Any, list[Event]] = defaultdict(list)
    for d in tr.device:
        if tr.in_window(d):
            by_stream[(d.pid, d.args.get("stream", d.tid))].append(d)
    for lane, evs in by_stream.items():
        evs.sort(key=lambda d: d.ts)
        prev_ext = object()
        for d in evs:
            ext = d.args.get("External id")
            if ext is not None and ext == prev_ext:  # another kernel of the same operator: one unit
                u = lanes[lane][-1]
                u.time_us += d.dur
                if d.dur > u.heaviest_us:  # classified by its heaviest kernel: cuBLAS 13's mm and cuDNN's
                    u.heaviest_us, u.category = d.dur, d.category  # attention launch a memset first
                continue
            prev_ext = ext
            op = tr.linked_op(d)
            args = op.args if op is not None else {}
            name = short_name(op.name) if op is not None else d.name[:60]
            phase = tr.phase.get(id(op), "forward") if op is not None else "forward"
            lanes[lane].append(_Unit(name, d.category, d.ts, d.dur, _out_bytes(name, args), shape_text(args),
                                     False, "optimizer" if d.category == "optimizer" else phase, d.dur))
    return lanes



REMEDIES = (
    ("norm", "a fused norm kernel that takes the residual add (and dropout) in the same pass (Apex FusedLayerNorm, "
             "fused add+RMSNorm kernels), or torch.compile, which emits one kernel for the whole chain (step 4)"),
    ("softmax|nll_loss|cross_entropy", "torch.compile fuses the log-softmax and loss chain (step 4); a fused "
                                        "cross-entropy kernel avoids writing the logits' probabilities at all"),
    ("dropout", "torch.compile (step 4) generates dropout's mask inside the fused kernel"),
    ("", "torch.compile (step 4) fuses chains of elementwise operations into one kernel"),
)


def remedy_for(pattern: str) -> str:
    return next(text for key, text in REMEDIES if re.search(key, pattern))


def find_fusion(tr: IndexedTrace, step_time_s: float, bandwidth: float | None) -> list[FusionCandidate]:
    lanes = _gpu_units(tr) if tr.kind == "gpu" else _cpu_units(tr)
    step_bounds = [s.ts for s in tr.steps]
    runs: list[list[_Unit]] = []
    for units in lanes.values():
        run: list[_Unit] = []
        where_of_run = None
        for u in sorted(units, key=lambda u: u.ts):
            if u.transparent:
                continue
            where = (sum(1 for b in step_bounds if b <= u.ts + EPS_US), u.phase)
            if u.category in MEMORY_BOUND and (not run or where == where_of_run):
                run.append(u)
                where_of_run = where
                continue
            if len(run) >= 2:
                runs.append(run)
            run = [u] if u.category in MEMORY_BOUND else []
            where_of_run = where
        if len(run) >= 2:
            runs.append(run)
    groups: dict[tuple[str, ...], list[list[_Unit]]] = defaultdict(list)
    for run in runs:
        groups[tuple(u.name for u in run)].append(run)
    n = tr.n_steps
    out = []
    for names, rs in groups.items():
        pattern = " + ".join(names)
        saved = sum(2 * sum(u.out_bytes for u in r[:-1]) for r in rs) / n
        time_s = sum(u.time_us for r in rs for u in r) / 1e6 / n
        out.append(FusionCandidate(
            pattern, list(names), [u.category for u in rs[0]], len(rs) / n, time_s, saved,
            saved / bandwidth if bandwidth else None, time_s / step_time_s if step_time_s else 0.0,
            remedy_for(pattern), " | ".join(u.shapes for u in rs[0] if u.shapes)[:200]))
    out.sort(key=lambda c: (-(c.est_saving_per_step_s or 0.0), -c.saved_bytes_per_step, -c.time_per_step_s))
    return out

