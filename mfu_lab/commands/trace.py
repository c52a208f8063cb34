"""``mfu-lab trace FILE``: step 3's analysis of a torch.profiler trace the user already has (``.json`` or
``.json.gz``): the time breakdown, the top kernels (GPU) or operators (CPU) and the fusion candidates.

It reads through step 3's own analysis (:func:`mfu_lab.analysis.trace.breakdown.analyse`,
:func:`~mfu_lab.analysis.trace.events.load_trace`), never through the monitor's window reader, which removes or
compresses the file it reads. The profiler slows the host, so the window's shares are of the profiled step; with
``--step-ms`` (the step timed without the profiler) the idle share and every share of the step are taken against
that step instead, and the output says which basis it used.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from mfu_lab.analysis.trace.breakdown import TraceAnalysis, analyse, idle_share
from mfu_lab.analysis.trace.events import load_trace
from mfu_lab.commands.common import EXIT_OK
from mfu_lab.core.errors import JobError, JobProblem


def _refuse(key: str, value: Any, why: str) -> JobError:
    return JobError("command line", [JobProblem(key, value, why)])


def read(path: str, step_ms: float | None, top: int) -> dict[str, Any]:
    """The trace's figures as one JSON-able object, in step 3's own names."""
    if step_ms is not None and not (math.isfinite(step_ms) and step_ms > 0):
        raise _refuse("--step-ms", step_ms, "must be the step's time in milliseconds, > 0 (timed without the "
                      "profiler, e.g. step 1's median step)")
    if top < 1:
        raise _refuse("--top", top, "must be a whole number >= 1")
    p = Path(path)
    if not p.is_file():
        raise _refuse("FILE", path, "no such file: give a torch.profiler trace (.json or .json.gz, as "
                      "export_chrome_trace or tensorboard_trace_handler write it)")
    step_s = step_ms / 1e3 if step_ms else None
    try:
        a = analyse(load_trace(p), top_n=top, step_s=step_s)  # the candidates' shares of that step
    except ValueError as e:  # not JSON, no traceEvents, no operators or kernels
        raise _refuse("FILE", path, str(e)) from e
    return figures(a, step_s) | {"file": str(p)}


def figures(a: TraceAnalysis, step_s: float | None) -> dict[str, Any]:
    idle, basis, how = idle_share(a, step_s)
    per_step = step_s or a.step_time_s  # the step the shares below are of
    return {
        "kind": a.kind, "steps": a.steps, "window_s": a.window_s, "profiled_step_s": a.step_time_s,
        "step_s": per_step, "basis": basis,
        "idle_share": {"value": idle, "basis": basis, "how": how, "source": "measured"},
        "breakdown": {"basis": "window", **a.breakdown.parts()},
        "top": [{"name": r.name, "category": r.category, "calls": r.calls, "total_s": r.total_s,
                 "share_of_step": r.total_s / a.steps / per_step, "shapes": r.shapes, "launched_by": r.launched_by}
                for r in a.top],
        "fusion": [{"pattern": c.pattern, "ops": c.ops, "categories": c.categories, "per_step": c.per_step,
                    "time_per_step_s": c.time_per_step_s, "share_of_step": c.share_of_step,
                    "saved_bytes_per_step": c.saved_bytes_per_step, "remedy": c.remedy} for c in a.fusion],
        "category_share": a.category_share, "optimizer": a.optimizer, "notes": a.notes,
    }


def text(f: dict[str, Any]) -> list[str]:
    unit = "kernels" if f["kind"] == "gpu" else "operators (self time)"
    of = (f"of the {f['step_s'] * 1e3:.1f} ms step without the profiler (--step-ms)" if f["basis"] == "step_ms"
          else f"of the profiled step ({f['profiled_step_s'] * 1e3:.1f} ms; give --step-ms for the real one)")
    out = [f"{f['file']}: a {f['kind'].upper()} trace, {f['steps']} profiled step(s), "
           f"{f['profiled_step_s'] * 1e3:.1f} ms a profiled step",
           f"idle: {f['idle_share']['value']:.1%} {of} (measured: {f['idle_share']['how']})",
           "time breakdown of the profiled window (measured): " + ", ".join(
               f"{k} {v:.1%}" for k, v in f["breakdown"].items() if k != "basis")]
    out.append(f"top {len(f['top'])} {unit}, shares {of}:")
    out += [f"  {r['share_of_step']:6.1%}  {r['total_s'] / f['steps'] * 1e3:8.2f} ms/step  {r['calls']:>6} calls  "
            f"[{r['category']}] {r['name'][:90]}" for r in f["top"]]
    out.append(f"fusion candidates ({len(f['fusion'])}; runs of adjacent memory-bound operations, shares {of}; "
               "ordered by the traffic fusing would save, estimated from the bytes passed between them):")
    out += [f"  {c['share_of_step']:6.1%}  {c['time_per_step_s'] * 1e3:8.2f} ms/step  "
            + f"{c['saved_bytes_per_step'] / 2**30:6.2f} GiB/step of traffic to save (analytic)  "
            + f"{c['pattern'][:100]}\n"
            f"          {c['remedy']}" for c in f["fusion"]]
    out += [f"note: {n}" for n in f["notes"]]
    return out


def cmd_trace(args) -> int:
    f = read(args.file, args.step_ms, args.top)
    print(json.dumps(f, default=str) if args.json else "\n".join(text(f)))
    return EXIT_OK
