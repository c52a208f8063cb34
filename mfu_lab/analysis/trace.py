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

Fusion candidates are runs of adjacent memory-bound operations (elementwise,
normalisation, reduction, memory copy) between compute-bound ones on the same
thread (CPU) or stream (GPU), grouped by their sequence of operator names. For
each run a fused kernel would not write every intermediate result to memory and
read it back: estimated saving = 2 x (output bytes of every operation but the
last), an operation's output taken as the size of its largest tensor input
(true for elementwise, normalisation, softmax and dropout). At the device's
measured memory bandwidth that traffic costs ``bytes / bandwidth`` seconds.
"""

from __future__ import annotations

import gzip
import json
import math
import re
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

CATEGORIES = ("matmul", "attention", "normalisation", "elementwise", "reduction", "memory copy",
              "communication", "optimizer", "data loading", "other")
MEMORY_BOUND = ("elementwise", "normalisation", "reduction", "memory copy")
DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
STEP_PREFIX = "ProfilerStep#"
DATA_PREFIX = "enumerate(DataLoader)"
OPTIMIZER_PREFIX = "Optimizer.step#"
EPS_US = 1e-3  # timestamps are microseconds with float rounding

# Operators that only change a tensor's metadata (or do nothing): no memory traffic of their own.
VIEW_OPS = frozenset("""view _unsafe_view reshape _reshape_alias t transpose permute expand expand_as slice narrow
split split_with_sizes chunk select as_strided unsqueeze squeeze detach alias lift_fresh unflatten flatten view_as
unbind resolve_conj resolve_neg empty empty_like empty_strided numpy_t to contiguous _to_dtype set_ result_type
is_same_size item _local_scalar_dense""".split())

_RULES: tuple[tuple[str, re.Pattern], ...] = tuple((cat, re.compile(rx, re.I)) for cat, rx in (
    ("communication", r"nccl|gloo|c10d|all_?reduce|all_?gather|reduce_?scatter|all_?to_?all|broadcast_|"
                      r"record_param_comms"),
    ("optimizer", r"^_?foreach_|fused_adam|multi_tensor_apply|^adamw?(_|$)|^sgd(_|$)"),
    ("attention", r"attention|flash|fmha|sdpa"),
    ("matmul", r"(^|_)(mm|addmm|bmm|baddbmm|matmul|linear|addmv|mv|dot|scaled_mm|int_mm|conv\w*|convolution)"
               r"(_|$)|gemm|gemv|cutlass|cublas|xmma|nvjet|mkldnn_matmul"),
    ("normalisation", r"layer_?norm|rms_?norm|group_?norm|batch_?norm|instance_?norm"),
    ("reduction", r"softmax|reduce|(^|_)(sum|mean|amax|amin|max|min|argmax|argmin|norm|var|std|logsumexp|cumsum|"
                  r"prod|nll_loss|cross_entropy|cross_entropy_loss|mse_loss)(_|$)"),
    ("other", r"^(ones|zeros|full|empty|arange|linspace|scalar_tensor|tensor|randint|randn|rand|randperm|"
              r"ones_like|zeros_like|full_like|randn_like|rand_like|empty_like)$"),  # factories: nothing to fuse
    ("memory copy", r"copy|memcpy|memset|(^|_)(to|cat|stack|clone|fill|zero|zeros|ones|index_select|gather|"
                    r"scatter|embedding|index|masked_select|repeat|pad|constant_pad_nd)(_|$)"),
    ("elementwise", r"elementwise|(^|_)(add|sub|rsub|mul|div|gelu|relu|silu|tanh|sigmoid|exp|log|pow|sqrt|rsqrt|"
                    r"neg|abs|where|masked_fill|dropout|native_dropout|bernoulli|lerp|addcdiv|addcmul|clamp|"
                    r"threshold|sign|erf|sin|cos|maximum|minimum|triu|tril|reciprocal|square|eq|ne|lt|gt|le|ge|"
                    r"logical_and|logical_or|bitwise_and|softplus|hardtanh|leaky_relu|elu|mish)(_|$)"),
))
_FACTORY = re.compile(dict(_RULES)["other"].pattern)
# Reductions whose output is much smaller than their input (a fused kernel saves ~nothing writing it).
_REDUCES = re.compile(r"^(sum|mean|amax|amin|max|min|argmax|argmin|norm|var|std|logsumexp|nll_loss|nll_loss_nd|"
                      r"cross_entropy_loss|mse_loss|prod)$")
_DTYPE_BYTES = {"float": 4, "double": 8, "c10::half": 2, "c10::bfloat16": 2, "half": 2, "bfloat16": 2,
                "long int": 8, "int": 4, "short int": 2, "signed char": 1, "unsigned char": 1, "bool": 1,
                "c10::float8_e4m3fn": 1, "c10::float8_e5m2": 1, "c10::complex<float>": 8}


def short_name(name: str) -> str:
    """'aten::native_layer_norm' -> 'layer_norm'; 'NativeLayerNormBackward0' -> 'layer_norm_backward'."""
    n = name.split("::")[-1] if name.startswith(("aten::", "c10d::", "torch::autograd::")) else name
    if n.startswith("autograd::engine::evaluate_function: "):
        n = n.split(": ", 1)[1]
    m = re.fullmatch(r"(\w+?)Backward\d*", n)
    if m:  # autograd node: CamelCase -> snake_case
        n = re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", m.group(1)).lower() + "_backward"
    n = re.sub(r"^_+", "", n)
    for prefix in ("native_", "fused_"):
        if n.startswith(prefix) and not n.startswith("fused_adam"):
            n = n[len(prefix):]
    return n


def categorise(name: str) -> str:
    """The category of an operator or kernel from its name (see CATEGORIES)."""
    n = short_name(name)
    if "::" in n:  # kernel names such as 'void at::native::vectorized_elementwise_kernel<...>'
        n = name
    for cat, rx in _RULES:
        if rx.search(n):
            return cat
    return "other"


def is_view(name: str) -> bool:
    return short_name(name) in VIEW_OPS


def tensor_bytes(args: dict[str, Any]) -> list[int]:
    """Bytes of each tensor input of an operator, from recorded shapes and dtypes (record_shapes=True)."""
    dims, types = args.get("Input Dims") or [], args.get("Input type") or []
    out = []
    for d, t in zip(dims, types):
        size = _DTYPE_BYTES.get(str(t).lower())
        if size is None or not isinstance(d, list) or any(isinstance(x, list) for x in d):
            continue  # scalars, lists of tensors, unknown dtypes
        out.append(size * math.prod(d))
    return out


# ------------------------------------------------------------------ events and intervals
@dataclass
class Event:
    name: str
    cat: str
    ts: float  # microseconds
    dur: float
    pid: Any
    tid: Any
    args: dict[str, Any]
    children: list[Event] = field(default_factory=list, repr=False)
    self_us: float = 0.0
    category: str = "other"

    @property
    def end(self) -> float:
        return self.ts + self.dur


def load_trace(path: str | Path) -> dict[str, Any]:
    """A Chrome trace from ``.json`` or ``.json.gz``; a clear error when it is not one."""
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rt", encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: not a readable Chrome trace JSON ({exc})") from exc
    if isinstance(data, list):  # the bare-array form of the format
        data = {"traceEvents": data}
    if not isinstance(data, dict) or not isinstance(data.get("traceEvents"), list):
        raise ValueError(f"{path}: no 'traceEvents' list; expected a torch.profiler chrome trace")
    return data


def _events(trace: dict[str, Any]) -> list[Event]:
    out = []
    for e in trace["traceEvents"]:
        if e.get("ph") != "X" or not isinstance(e.get("dur"), (int, float)) or e["dur"] < 0:
            continue
        out.append(Event(str(e.get("name", "")), str(e.get("cat", "")), float(e["ts"]), float(e["dur"]),
                         e.get("pid"), e.get("tid"), e.get("args") or {}))
    return out


def union(spans) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for s, e in sorted(spans):
        if e <= s:
            continue
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return [(s, e) for s, e in out]


def measure(spans) -> float:
    return sum(e - s for s, e in spans)


def intersect(a, b) -> list[tuple[float, float]]:
    a, b = union(a), union(b)
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        s, e = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if s < e:
            out.append((s, e))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def subtract(a, b) -> list[tuple[float, float]]:
    out = []
    b = union(b)
    for s, e in union(a):
        cur = s
        for bs, be in b:
            if be <= cur or bs >= e:
                continue
            if bs > cur:
                out.append((cur, bs))
            cur = max(cur, be)
        if cur < e:
            out.append((cur, e))
    return out


def _nest(ops: list[Event]) -> list[Event]:
    """Nest operators per thread (parents contain children); fill self time. Returns the roots."""
    roots = []
    by_thread: dict[Any, list[Event]] = defaultdict(list)
    for op in ops:
        by_thread[(op.pid, op.tid)].append(op)
    for thread_ops in by_thread.values():
        thread_ops.sort(key=lambda o: (o.ts, -o.dur))
        stack: list[Event] = []
        for op in thread_ops:
            while stack and op.ts >= stack[-1].end - EPS_US:
                stack.pop()
            (stack[-1].children if stack else roots).append(op)
            stack.append(op)
    for op in ops:
        op.self_us = max(0.0, op.dur - sum(min(c.end, op.end) - c.ts for c in op.children))
    return roots


def _self_spans(op: Event) -> list[tuple[float, float]]:
    return subtract([(op.ts, op.end)], [(c.ts, c.end) for c in op.children])


def _inside(t: float, spans: list[tuple[float, float]]) -> bool:
    return any(s - EPS_US <= t < e for s, e in spans)


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

    def parts(self) -> dict[str, float]:
        return {"computing": self.computing, "communicating (exposed)": self.communicating,
                "copying memory": self.copying, "waiting for data": self.waiting_for_data, "idle": self.idle}


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
class _Trace:
    def __init__(self, trace: dict[str, Any]):
        ev = _events(trace)
        self.annotations = [e for e in ev if e.cat == "user_annotation"]
        self.steps = sorted((e for e in self.annotations if e.name.startswith(STEP_PREFIX)), key=lambda e: e.ts)
        self.device = [e for e in ev if e.cat in DEVICE_CATS]
        self.kind = "gpu" if any(e.cat == "kernel" for e in self.device) else "cpu"
        self.ops = [e for e in ev if e.cat == "cpu_op"]
        self.host_comm = [e for e in ev if e.cat in ("cpu_op", "user_annotation") and e.name.startswith("gloo:")]
        self.roots = _nest(self.ops)
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
                     else "optimizer" if _inside(root.ts, self.opt_spans) else "forward")
            for op in _subtree(root):
                self.phase[id(op)] = phase
        for d in self.device:
            d.category = self._device_category(d)

    def in_window(self, e: Event) -> bool:
        return self.window[0] - EPS_US <= e.ts < self.window[1]

    def _op_category(self, op: Event) -> str:
        cat = categorise(op.name)
        if cat == "communication":
            return cat
        if _inside(op.ts, self.data_spans):
            return "data loading"
        if _inside(op.ts, self.opt_spans):
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


def _shape_text(args: dict[str, Any]) -> str:
    dims, types = args.get("Input Dims") or [], args.get("Input type") or []
    parts = []
    for d, t in zip(dims, types):
        if isinstance(d, list) and d and not any(isinstance(x, list) for x in d):
            parts.append(f"{'x'.join(str(x) for x in d)} {t}")
        elif isinstance(d, list) and d and all(isinstance(x, list) for x in d):
            parts.append(f"[{len(d)} tensors]")
    return ", ".join(parts)


def _table(tr: _Trace, window_total_us: float) -> list[TopRow]:
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
        shapes = Counter(_shape_text(o.args) for o in shape_src if o is not None)
        shapes.pop("", None)
        launched = Counter(o.name for o in shape_src if o is not None) if tr.kind == "gpu" else Counter()
        rows.append(TopRow(name, cat, len(evs), total, total / len(evs), total * 1e6 / window_total_us,
                           shapes.most_common(1)[0][0] if shapes else "", len(shapes),
                           launched.most_common(1)[0][0] if launched else ""))
    rows.sort(key=lambda r: -r.total_s)
    return rows


def _breakdown(tr: _Trace) -> Breakdown:
    w0, w1 = tr.window
    window = [(w0, w1)]
    segs: dict[str, list] = defaultdict(list)
    if tr.kind == "gpu":
        for d in tr.device:
            segs[d.category].append((d.ts, d.end))
    else:
        for op in tr.ops:
            for s in _self_spans(op):
                segs[op.category].append(s)
        for c in tr.host_comm:  # gloo's own work events (its threads' all-reduce)
            segs["communication"].append((c.ts, c.end))
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
    return Breakdown(
        total / 1e6, tr.n_steps, measure(compute) / total, (c_total - overlapped) / total,
        measure(subtract(copy, union(compute + comm))) / total, measure(waiting) / total,
        (measure(idle) - measure(waiting)) / total, c_total / total, overlapped / total)


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


def _subtree(op: Event):
    yield op
    for c in op.children:
        yield from _subtree(c)


def _cpu_units(tr: _Trace) -> dict[Any, list[_Unit]]:
    lanes: dict[Any, list[_Unit]] = defaultdict(list)
    for root in tr.roots:
        if not tr.in_window(root):
            continue
        backward = root.name.startswith("autograd::engine::evaluate_function")
        for op in (root.children if backward else [root]):
            real = [o for o in _subtree(op) if not is_view(o.name) and not re.search(r"Backward\d*$|AccumulateGrad",
                                                                                    o.name)]
            name = short_name(op.name)
            if not real:
                lanes[(op.pid, op.tid)].append(_Unit(name, "other", op.ts, op.dur, 0, "", True))
                continue
            heaviest = max(real, key=lambda o: o.self_us)
            own = categorise(op.name)
            cat = (op.category if op.category in ("data loading", "optimizer", "communication")
                   else own if own != "other" or _FACTORY.match(name) else heaviest.category)
            # a backward node's own input is the incoming gradient; the work's tensors are on its operators
            args = heaviest.args if backward or not tensor_bytes(op.args) else op.args
            phase = "optimizer" if cat == "optimizer" else "backward" if backward else "forward"
            lanes[(op.pid, op.tid)].append(_Unit(name, cat, op.ts, op.dur, _out_bytes(name, args),
                                                 _shape_text(args), False, phase))
    return lanes


def _out_bytes(name: str, args: dict[str, Any]) -> int:
    """Bytes an operation writes: its largest tensor input's size, or none for a full reduction."""
    return 0 if _REDUCES.match(name) else max(tensor_bytes(args), default=0)


def _gpu_units(tr: _Trace) -> dict[Any, list[_Unit]]:
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
                continue
            prev_ext = ext
            op = tr.linked_op(d)
            args = op.args if op is not None else {}
            name = short_name(op.name) if op is not None else d.name[:60]
            phase = tr.phase.get(id(op), "forward") if op is not None else "forward"
            lanes[lane].append(_Unit(name, d.category, d.ts, d.dur, _out_bytes(name, args), _shape_text(args),
                                     False, "optimizer" if d.category == "optimizer" else phase))
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


def _fusion(tr: _Trace, step_time_s: float, bandwidth: float | None) -> list[FusionCandidate]:
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


def _optimizer(tr: _Trace, step_time_s: float) -> dict[str, Any]:
    """How the optimiser step runs: its time, how many operations it issues, foreach/fused or not."""
    if not tr.opt_spans:
        return {"found": False}
    names = [op.name for op in tr.roots if tr.in_window(op) and _inside(op.ts, tr.opt_spans)]
    kernels = [d for d in tr.device if tr.in_window(d) and d.category == "optimizer"]
    fused = any(re.search(r"foreach|fused|multi_tensor", n) for n in names + [k.name for k in kernels])
    span_s = measure(intersect(tr.opt_spans, [tr.window])) / 1e6 / tr.n_steps
    ops_per_step = (len(kernels) if tr.kind == "gpu" else len(names)) / tr.n_steps
    return {"found": True, "time_per_step_s": span_s, "share_of_step": span_s / step_time_s if step_time_s else 0.0,
            "ops_per_step": ops_per_step, "multi_tensor": fused,
            "what": "kernels" if tr.kind == "gpu" else "operators"}


def analyse(trace: dict[str, Any], top_n: int = 20, bandwidth: float | None = None) -> TraceAnalysis:
    """Top-N table, time breakdown, categories and fusion candidates of one trace.

    ``bandwidth`` (bytes/s, measured on the device) turns each candidate's saved
    traffic into time; without it only the bytes are given.
    """
    tr = _Trace(trace)
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
    fusion = _fusion(tr, step_time, bandwidth)
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
        _breakdown(tr), cat_share, fusion, _optimizer(tr, step_time), notes, ops)
