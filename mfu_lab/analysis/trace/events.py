"""Trace events: reading a Chrome trace, naming and categorising operators and kernels, and interval algebra.

The raw material of :mod:`mfu_lab.analysis.trace.breakdown`: the complete (``ph == "X"``)
events of a Chrome/Perfetto JSON exported by ``torch.profiler`` (Kineto format),
each operator's category from its name (see ``CATEGORIES``), the bytes of its
tensor inputs from recorded shapes, operators nested per thread (self time =
duration minus the children's), and union / intersection / difference / total
length of time spans.
"""

from __future__ import annotations

import gzip
import json
import math
import re
from collections import defaultdict
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
FACTORY_RE = re.compile(dict(_RULES)["other"].pattern)
# Reductions whose output is much smaller than their input (a fused kernel saves ~nothing writing it).
REDUCES_RE = re.compile(r"^(sum|mean|amax|amin|max|min|argmax|argmin|norm|var|std|logsumexp|nll_loss|nll_loss_nd|"
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


# A collective's kind from its name, or from the profiler's "Collective name" argument (record_param_comms).
COMM_KINDS: tuple[tuple[str, re.Pattern], ...] = tuple((k, re.compile(rx, re.I)) for k, rx in (
    ("reduce_scatter", r"reduce_?scatter"), ("allgather", r"all_?gather"), ("allreduce", r"all_?reduce"),
    ("alltoall", r"all_?to_?all"), ("broadcast", r"broadcast"), ("send", r"(^|[_:.])i?send"),
    ("recv", r"(^|[_:.])i?recv"), ("barrier", r"barrier"),
))


def comm_kind(name: str, args: dict[str, Any] | None = None) -> str:
    """allgather | reduce_scatter | allreduce | alltoall | broadcast | send | recv | barrier | other, for a
    communication operator or gloo work event (``gloo:all_reduce``, ``c10d::_allgather_base_``, ...)."""
    text = f"{(args or {}).get('Collective name', '')} {name}"
    return next((k for k, rx in COMM_KINDS if rx.search(text)), "other")


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


def events_of(trace: dict[str, Any]) -> list[Event]:
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


def nest(ops: list[Event]) -> list[Event]:
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


def self_spans(op: Event) -> list[tuple[float, float]]:
    return subtract([(op.ts, op.end)], [(c.ts, c.end) for c in op.children])


def inside(t: float, spans: list[tuple[float, float]]) -> bool:
    return any(s - EPS_US <= t < e for s, e in spans)


def subtree(op: Event):
    yield op
    for c in op.children:
        yield from subtree(c)


def shape_text(args: dict[str, Any]) -> str:
    dims, types = args.get("Input Dims") or [], args.get("Input type") or []
    parts = []
    for d, t in zip(dims, types):
        if isinstance(d, list) and d and not any(isinstance(x, list) for x in d):
            parts.append(f"{'x'.join(str(x) for x in d)} {t}")
        elif isinstance(d, list) and d and all(isinstance(x, list) for x in d):
            parts.append(f"[{len(d)} tensors]")
    return ", ".join(parts)

