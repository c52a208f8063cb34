"""One trace, indexed: its kind (GPU or CPU), profiled window, steps, operators nested per thread,
device events tied to the operators that launched them, and each event's category and phase."""

from __future__ import annotations

from typing import Any

from mfu_lab.analysis.trace.events import (
    DATA_PREFIX,
    DEVICE_CATS,
    EPS_US,
    OPTIMIZER_PREFIX,
    STEP_PREFIX,
    Event,
    categorise,
    events_of,
    inside,
    nest,
    subtree,
    union,
)


class IndexedTrace:
    def __init__(self, trace: dict[str, Any]):
        ev = events_of(trace)
        self.annotations = [e for e in ev if e.cat == "user_annotation"]
        self.steps = sorted((e for e in self.annotations if e.name.startswith(STEP_PREFIX)), key=lambda e: e.ts)
        self.device = [e for e in ev if e.cat in DEVICE_CATS]
        self.kind = "gpu" if any(e.cat == "kernel" for e in self.device) else "cpu"
        self.ops = [e for e in ev if e.cat == "cpu_op"]
        self.host_comm = [e for e in ev if e.cat in ("cpu_op", "user_annotation") and e.name.startswith("gloo:")]
        self.roots = nest(self.ops)
        self.data_spans = union((e.ts, e.end) for e in self.annotations if e.name.startswith(DATA_PREFIX))
        self.opt_spans = union((e.ts, e.end) for e in self.annotations if e.name.startswith(OPTIMIZER_PREFIX))
        if self.steps:
            start = self.steps[0].ts
            end = max(self.steps[-1].end, max((d.end for d in self.device if d.ts >= start), default=start))
            self.n_steps = len(self.steps)
        else:
            everything = self.ops + self.device
            if not everything:
                raise ValueError("the trace holds no operators or kernels")
            start, end = min(e.ts for e in everything), max(e.end for e in everything)
            self.n_steps = 1
        self.window = (start, end)
        self.by_external = {}
        for op in self.ops:
            ext = op.args.get("External id")
            if ext is not None:
                self.by_external.setdefault(ext, op)
        for op in self.ops:
            op.category = self._op_category(op)
        self.phase: dict[int, str] = {}  # id(op) -> forward | backward | optimizer
        for root in self.roots:
            phase = ("backward" if root.name.startswith("autograd::engine::evaluate_function")
                     else "optimizer" if inside(root.ts, self.opt_spans) else "forward")
            for op in subtree(root):
                self.phase[id(op)] = phase
        for d in self.device:
            d.category = self._device_category(d)

    def in_window(self, e: Event) -> bool:
        return self.window[0] - EPS_US <= e.ts < self.window[1]

    def _op_category(self, op: Event) -> str:
        cat = categorise(op.name)
        if cat == "communication":
            return cat
        if inside(op.ts, self.data_spans):
            return "data loading"
        if inside(op.ts, self.opt_spans):
            return "optimizer"
        return cat

    def _device_category(self, d: Event) -> str:
        if d.cat in ("gpu_memcpy", "gpu_memset"):
            return "memory copy"
        by_name = categorise(d.name)
        if by_name in ("communication", "attention", "matmul"):
            return by_name  # the kernel says it best (a matmul inside aten::linear, nccl inside a hook)
        op = self.linked_op(d)
        if op is not None and op.category not in ("other", "data loading"):
            return op.category
        return by_name

    def linked_op(self, d: Event) -> Event | None:
        ext = d.args.get("External id")
        return self.by_external.get(ext) if ext is not None else None

