"""One trial of step 4 in a fresh process: the job's training steps, eager or compiled in one mode.

    python -m mfu_lab.workers.compile_trial --spec SPEC.json

Started by mfu_lab.steps.compile.step with TORCHINDUCTOR_CACHE_DIR (and TRITON_CACHE_DIR) pointing at
the trial's own cache folder: empty for a cold compile, filled by the cold run for a warm one. A
fresh process per trial keeps one mode's in-memory caches out of the next mode's compile time, and
a crash in one mode out of the others. Prints one progress line per step; writes its result JSON
to spec["out"] (status, per-step walls and losses, recompiles with their guard messages).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
import traceback
from pathlib import Path


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--spec", required=True)
    spec = json.loads(Path(ap.parse_args().spec).read_text())
    out = Path(spec["out"])
    result: dict = {"mode": spec["mode"], "status": "failed"}
    try:

        from mfu_lab.analysis.recompiles import RecompileLog, guard_lines
        from mfu_lab.core.engine.work import same_batches
        from mfu_lab.core.engine.workload import build_model, build_train_step, eager
        from mfu_lab.core.job.schema import validate
        from mfu_lab.core.measure.device import resolve_device
        from mfu_lab.core.measure.timed import run_steps
        from mfu_lab.core.process.progress import GAP_S

        job = validate(spec["job"], "step 4 worker spec")  # the trial compiles in its own mode, not the job's
        job = eager(job) if spec["mode"] == "eager" else dataclasses.replace(job, compile_mode=spec["mode"])
        if spec.get("loss_impl"):  # a loss_impl candidate of the race (core.engine.losses)
            job = dataclasses.replace(job, loss_impl=spec["loss_impl"])
        device = resolve_device(job.device)
        tdev = device.torch_device
        model = build_model(job).to(tdev).train()
        step = build_train_step(job, model, device.type)  # compiles the model, or its forward and loss as one
        warm, steps = spec["warmup"], spec["steps"]
        t0 = time.perf_counter()

        said = [0.0]

        def progress(done, total, elapsed):  # every compile step, then every quarter and every GAP_S seconds
            if (done <= warm or done == total or done % max(1, total // 4) == 0
                    or elapsed - said[0] >= GAP_S):
                said[0] = elapsed
                left = ("" if done <= warm or done == total else  # the timed steps' mean so far x those left
                        f", about {(elapsed - warm_s[0]) / (done - warm) * (total - done):.0f} s left")
                print(f"{spec['label']}: step {done}/{total} ({elapsed:.1f} s{left})", flush=True)
            if done == warm:
                warm_s[0] = elapsed

        warm_s = [0.0]

        from torch._dynamo.utils import counters

        counters.clear()
        with RecompileLog() as log:
            timings = run_steps(step, same_batches(job, warm + steps, device.type), tdev, warm, steps, progress)
        result.update(status="ok", wall_s=timings.wall_s, loss=timings.loss, warmup=warm, method=timings.method,
                      recompiles=log.count, recompile_messages=[guard_lines(m) for m in log.messages[:20]],
                      graphs=int(counters["stats"]["unique_graphs"]), seconds=time.perf_counter() - t0)
        if spec.get("trace"):
            from mfu_lab.core.measure.timed import profile_steps

            print(f"{spec['label']}: profiling 3 steps", flush=True)
            profile_steps(step, same_batches(job, 5, device.type), tdev, 2, 3, Path(spec["trace"]))
            result["trace"] = spec["trace"]
    except Exception as exc:  # recorded for the step; the other modes still run
        result["error"] = f"{type(exc).__name__}: {str(exc).strip().splitlines()[0] if str(exc).strip() else ''}"
        result["traceback"] = traceback.format_exc()[-4000:]
    out.write_text(json.dumps(result))  # read by the parent once this process has exited
    return 0 if result["status"] == "ok" else 1


if __name__ == "__main__":
    sys.exit(main())
