"""torch.compile helpers for step 4: the data's shapes, recompiles with their guard messages,
graph breaks, break-even arithmetic and the compiled-vs-eager loss check.

Recompiles are decided by dynamo's guards before any backend runs, so counting
them needs no compilation at all: :func:`count_recompiles` uses the ``eager``
backend unless told otherwise, and takes milliseconds where inductor takes
minutes.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections import Counter
from dataclasses import dataclass, field

import torch

from mfu_lab.core.engine.batches import call_model
from mfu_lab.core.engine.workload import DYNAMIC, compile_kwargs

DRIFT_TOLERANCE = {"float32": 1e-3, "bfloat16": 2e-2, "float16": 2e-2}  # relative, per step


# ------------------------------------------------------------------ shapes of the data
@dataclass
class ShapeAudit:
    batches: int
    shapes: dict[str, int]  # "8x256" -> batches with that shape
    batch_sizes: list[int]
    seq_lens: list[int]
    padding_fraction: float  # target positions ignored (padding) / all positions
    varies: bool
    epoch_samples: int
    policy: str  # data, seq_policy, last_batch as one line


def audit_shapes(loader, label: str) -> ShapeAudit:
    """Read every batch of ``loader`` (one epoch) and tally the shapes of its inputs: (batch, length) for token
    ids, the input's whole shape for any other batch (core.engine.batches), whose -100 are not padding."""
    from mfu_lab.core.engine.batches import tensors
    from mfu_lab.core.engine.workload import IGNORE

    shapes: Counter = Counter()
    pad = total = n = samples = 0
    lengths = set()
    for batch in loader:
        x, y = batch
        first = tensors(x)[0]
        shapes[tuple(first.shape)] += 1
        if getattr(batch, "tokens", True):
            pad += int((y == IGNORE).sum())
            total += y.numel()
            lengths.add(first.shape[1] if first.dim() > 1 else 1)
        n += 1
        samples += first.shape[0] if first.dim() else 1
    return ShapeAudit(n, {"x".join(map(str, s)): c for s, c in sorted(shapes.items(), key=lambda kv: -kv[1])},
                      sorted({s[0] if s else 1 for s in shapes}), sorted(lengths), pad / total if total else 0.0,
                      len(shapes) > 1, samples, label)


def shape_text(x) -> str:
    """``8x256``: the shape of an input's first tensor."""
    from mfu_lab.core.engine.batches import tensors

    return "x".join(map(str, tensors(x)[0].shape))


# ------------------------------------------------------------------ recompiles
class RecompileLog(contextlib.AbstractContextManager):
    """Collect dynamo's 'Recompiling function ...' messages (with their guard failures) while active,
    without printing them."""

    def __init__(self):
        self.messages: list[str] = []
        self._loggers: list[logging.Logger] = []

    def __enter__(self):
        import torch._dynamo  # noqa: F401 - creates the artifact loggers

        torch._logging.set_logs(recompiles=True)
        names = [n for n in logging.root.manager.loggerDict if n.endswith("__recompiles")]
        outer = self

        class _Keep(logging.Handler):
            def emit(self, record):
                msg = record.getMessage()
                if "Recompiling function" in msg:
                    outer.messages.append(msg.strip())

        self._handler = _Keep()
        for n in names:
            lg = logging.getLogger(n)
            self._loggers.append((lg, lg.propagate))
            lg.addHandler(self._handler)
            lg.propagate = False  # keep them off stderr
        return self

    def __exit__(self, *exc):
        for lg, propagate in self._loggers:
            lg.removeHandler(self._handler)
            lg.propagate = propagate
        torch._logging.set_logs()
        return False

    @property
    def count(self) -> int:
        return len(self.messages)


@dataclass
class RecompileRun:
    label: str
    dynamic: str
    shapes: list[str]
    recompiles: int
    graphs: int  # graphs dynamo compiled, first compile included
    messages: list[str] = field(default_factory=list)


def count_recompiles(model: torch.nn.Module, inputs: list[torch.Tensor], dynamic: str, label: str,
                     backend: str = "eager") -> RecompileRun:
    """Run ``model`` compiled (forward) on each input in turn; count recompiles and keep their reasons."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(model, backend=backend, dynamic=DYNAMIC[dynamic])
    with RecompileLog() as log, torch.no_grad():
        for x in inputs:
            call_model(compiled, x, model)
    graphs = int(counters["stats"]["unique_graphs"])
    torch._dynamo.reset()
    return RecompileRun(label, dynamic, [shape_text(x) for x in inputs], log.count, graphs,
                        [guard_lines(m) for m in log.messages])


def guard_lines(message: str) -> str:
    """The useful part of a recompile message: which function, and the guard failures."""
    lines = [ln.strip() for ln in message.splitlines() if ln.strip()]
    head = lines[0].replace("Recompiling function", "recompiled").split(" in ")[0] if lines else ""
    fails = [ln.lstrip("- ") for ln in lines if ln.startswith("-")]
    return f"{head}: " + "; ".join(fails) if fails else message.strip()


@dataclass
class GraphBreaks:
    graphs: int
    breaks: int
    reasons: list[str]


def graph_breaks(model: torch.nn.Module, x: torch.Tensor) -> GraphBreaks:
    """torch._dynamo.explain on one forward: how many graphs, how many breaks, and why."""
    torch._dynamo.reset()
    with torch.no_grad():
        out = call_model(torch._dynamo.explain(model), x, model)
    torch._dynamo.reset()
    reasons = []
    for br in out.break_reasons:
        where = br.user_stack[-1] if getattr(br, "user_stack", None) else None
        place = f" ({where.filename.split('/')[-1]}:{where.lineno})" if where is not None else ""
        reasons.append(f"{br.reason}{place}")
    return GraphBreaks(out.graph_count, out.graph_break_count, reasons)


# ------------------------------------------------------------------ arithmetic
def compile_seconds(walls: list[float], warmup: int, steady_median: float, eager_extra: float = 0.0) -> float:
    """Compile time as the extra time of the first ``warmup`` steps over the steady state, minus the
    extra that the same first steps take without compiling (allocation, first-call work)."""
    return sum(walls[:warmup]) - warmup * steady_median - eager_extra


def break_even_steps(compile_s: float, eager_step_s: float, compiled_step_s: float) -> float | None:
    """Steps after which compiling has paid for itself: compile time / time saved per step.
    None when the compiled step is not faster (it never pays)."""
    saved = eager_step_s - compiled_step_s
    if saved <= 0:
        return None
    return max(compile_s, 0.0) / saved


def loss_drift(eager: list[float], compiled: list[float]) -> float:
    """Largest relative difference of the per-step losses (same seed, same data, same order)."""
    if len(eager) != len(compiled) or not eager:
        raise ValueError(f"loss curves of different lengths ({len(eager)} eager, {len(compiled)} compiled)")
    worst = 0.0
    for e, c in zip(eager, compiled):
        if not (math.isfinite(e) and math.isfinite(c)):
            return math.inf
        worst = max(worst, abs(c - e) / max(abs(e), 1e-12))
    return worst


mode_kwargs = compile_kwargs  # one home: mfu_lab.core.engine.workload.compile_kwargs
