"""Step 3's time breakdown beside HolisticTraceAnalysis' (HTA, Meta's trace analyser) on the same GPU trace: by
default the shared H200 run's (tests/data/h200/step3_trace.json.gz, GPT-2 124M, 3 profiled steps).

    pip install HolisticTraceAnalysis   # into mfu_lab's environment (HTA brings pandas and plotly)
    python benchmarks/try_hta.py [TRACE.json.gz]

Prints, for the same steps: the device's busy time (the union of kernels, copies and memsets) by both and straight
from the trace's events; each one's denominator and idle share; and where their categories part. HTA reads every
profiled step here (``include_last_profiler_step=True``; by default it drops the last one).
"""

from __future__ import annotations

import gzip
import json
import math
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEVICE = ("kernel", "gpu_memcpy", "gpu_memset")


def union_us(intervals: list[tuple[float, float]]) -> float:
    """The length of a union of (start, end) intervals."""
    total, cur = 0.0, None
    for s, e in sorted(intervals):
        if cur is None or s > cur[1]:
            total += 0.0 if cur is None else cur[1] - cur[0]
            cur = [s, e]
        else:
            cur[1] = max(cur[1], e)
    return total + (cur[1] - cur[0] if cur else 0.0)


def main() -> None:
    trace = Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT / "tests" / "data" / "h200" / "step3_trace.json.gz"
    try:
        from hta.trace_analysis import TraceAnalysis
    except ImportError:
        sys.exit("HTA is not installed: pip install HolisticTraceAnalysis")
    from mfu_lab.analysis.trace.breakdown import analyse
    from mfu_lab.analysis.trace.events import load_trace

    opened = gzip.open if trace.suffix == ".gz" else open
    events = [e for e in json.load(opened(trace))["traceEvents"] if e.get("ph") == "X"]
    dev = [(float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in events if e.get("cat") in DEVICE]
    raw_busy, span = union_us(dev) / 1e3, (max(e for _, e in dev) - min(s for s, _ in dev)) / 1e3
    # HTA's parser (trace_parser.py, for ns-resolution traces) moves each start up and each end down to a whole us
    rounded = union_us([(math.ceil(s), max(math.ceil(s), math.floor(e))) for s, e in dev]) / 1e3

    a = analyse(load_trace(trace))  # what step 3 and mfu-lab trace run
    b = a.breakdown
    window = b.window_s * 1e3
    ours_busy = (b.computing + b.communicating + b.copying) * window

    with tempfile.TemporaryDirectory() as d:  # HTA reads a folder of traces, one per rank
        shutil.copy(trace, Path(d) / ("rank-0.json" + (".gz" if trace.suffix == ".gz" else "")))
        t = TraceAnalysis(trace_dir=d, include_last_profiler_step=True)
        row = t.get_temporal_breakdown(visualize=False).iloc[0]
        kinds, _ = t.get_gpu_kernel_breakdown(visualize=False, num_kernels=5, include_memory_kernels=True)
        n_dev = int(t.t.get_trace(0)["stream"].ne(-1).sum())
    hta_busy = (row["kernel_time(us)"] - row["idle_time(us)"]) / 1e3
    print(f"{trace}: {b.steps} profiled steps, {len(dev)} device events")
    print(f"device busy (union of kernels, copies, memsets): from the trace's events {raw_busy:.2f} ms; mfu_lab "
          f"{ours_busy:.2f} ms; HTA {hta_busy:.2f} ms ({hta_busy / raw_busy - 1:+.1%}: HTA moves each of its "
          f"{n_dev} events' start up and end down to a whole microsecond; the events so rounded give "
          f"{rounded:.2f} ms; the rest, {rounded - hta_busy:.2f} ms, not traced down)")
    hta_span = row["kernel_time(us)"] / 1e3
    print(f"idle: mfu_lab {b.idle:.1%} of the profiled window ({window:.1f} ms: the steps' ProfilerStep spans, which "
          f"begin before the first kernel); HTA {row['idle_time_pctg']:.1f}% of its span ({hta_span:.1f} ms: first "
          f"kernel to last, {span:.1f} ms from the events); neither is the unprofiled step's: mfu-lab trace "
          "--step-ms gives that")
    print("categories: mfu_lab " + ", ".join(f"{k} {v:.1%}" for k, v in b.parts().items()) + "; HTA " +
          ", ".join(f"{r.kernel_type} {r.percentage:.1f}%" for r in kinds.itertuples()) +
          " (HTA's MEMORY is memcpy and memset only: a cast or copy kernel is COMPUTATION there, 'copying memory' in"
          " mfu_lab)")


if __name__ == "__main__":
    main()
