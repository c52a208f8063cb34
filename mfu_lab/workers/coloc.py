"""One copy of the job for step 6's co-location experiment, in its own process.

    python -m mfu_lab.workers.coloc --spec SPEC.json

The spec holds the job's parameters, the step counts and three paths: ``ready`` (written after the
warm-up steps), ``go`` (waited for, so that copies start their measured steps together) and ``out``
(the measured step times, written atomically).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--spec", required=True)
    spec = json.loads(Path(ap.parse_args().spec).read_text())

    from mfu_lab.core.engine.workload import build_loader, build_model, build_train_step, eager
    from mfu_lab.core.job.schema import validate
    from mfu_lab.core.measure import device as dev
    from mfu_lab.core.measure.timed import run_steps
    from mfu_lab.core.store.files import write_json_atomic

    job = eager(validate(spec["job"], "co-location spec"))
    torch.manual_seed(job.seed)
    device = dev.resolve_device(job.device)
    model = build_model(job).to(device.torch_device).train()
    step = build_train_step(job, model, device.type)
    warm = run_steps(step, build_loader(job, spec["warmup"], device.type), device.torch_device, spec["warmup"], 0)
    del warm
    Path(spec["ready"]).write_text("ready")
    deadline = time.monotonic() + spec["wait_s"]
    while not Path(spec["go"]).exists():
        if time.monotonic() > deadline:
            raise SystemExit(f"co-location worker: no go signal within {spec['wait_s']} s")
        time.sleep(0.01)
    t = run_steps(step, build_loader(job, spec["steps"], device.type), device.torch_device, 0, spec["steps"])
    write_json_atomic(Path(spec["out"]), {"wall_s": t.wall_s, "method": t.method, "threads": torch.get_num_threads(),
                                          "device": device.name})


if __name__ == "__main__":
    main()
