"""Write tests/data/cpu_trace.json.gz: a real torch.profiler trace of one training step of a
one-layer GPT on CPU, trimmed to what mfu_lab.analysis.trace.breakdown reads (a few KB).

    python tools/make_trace_fixture.py

Kept: complete events ('X') with name, cat, ts, dur, pid, tid and the args
'Input Dims' and 'Input type'. Dropped: flow and metadata events and every other arg.
Times are shifted to start at 0 and rounded to 0.1 us, so tests can quote them.
"""

import gzip
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from mfu_lab.analysis.trace.breakdown import load_trace  # noqa: E402
from mfu_lab.core.engine.workload import build_loader, build_model, build_train_step  # noqa: E402
from mfu_lab.core.job.schema import Job  # noqa: E402
from mfu_lab.core.measure.timed import profile_steps  # noqa: E402

KEEP_ARGS = ("Input Dims", "Input type")  # External id only matters for GPU kernels


def main() -> None:
    torch.manual_seed(0)
    job = Job(job_name="fixture", device="cpu", n_layers=1, n_heads=2, d_model=16, vocab_size=32, seq_len=8,
              micro_batch=2)
    model = build_model(job).train()
    step = build_train_step(job, model, "cpu")
    with tempfile.TemporaryDirectory() as tmp:
        profile_steps(step, build_loader(job, 2, "cpu"), torch.device("cpu"), 1, 1, Path(tmp) / "t.json.gz")
        trace = load_trace(Path(tmp) / "t.json.gz")
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X" and e.get("cat") in ("cpu_op", "user_annotation")]
    t0 = min(e["ts"] for e in events)
    out = []
    for e in sorted(events, key=lambda e: (e["ts"], -e["dur"])):
        args = {k: v for k, v in (e.get("args") or {}).items() if k in KEEP_ARGS}
        start, end = round(e["ts"] - t0, 1), round(e["ts"] + e["dur"] - t0, 1)  # rounding both ends keeps nesting
        out.append({"ph": "X", "cat": e["cat"], "name": e["name"], "pid": 1, "tid": 1,
                    "ts": start, "dur": round(end - start, 1), "args": args})
    path = ROOT / "tests" / "data" / "cpu_trace.json.gz"
    with gzip.GzipFile(path, "wb", mtime=0) as f:
        f.write(json.dumps({"traceEvents": out}, separators=(",", ":")).encode())
    print(f"{path}: {len(out)} events, {path.stat().st_size} bytes")


if __name__ == "__main__":
    main()
