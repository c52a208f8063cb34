"""Step 6's co-location experiment (measured): the job alone against two copies of it at once on this device,
each copy a ``python -m mfu_lab.workers.coloc`` process whose measured steps start together.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

from mfu_lab.analysis.placement.check import Coloc
from mfu_lab.core.job.schema import Job
from mfu_lab.core.measure.device import release_device_memory
from mfu_lab.core.measure.timed import stats
from mfu_lab.core.process import procs
from mfu_lab.core.process.progress import GAP_S, as_progress
from mfu_lab.core.store.files import read_json

READY_TIMEOUT_S = 600.0  # a co-location copy that has not finished its warm-up by then is ended


def colocate(job: Job, work: Path, device_type: str, say) -> Coloc:
    """Run the job alone, then two copies at once, each in its own process; measured steps start together.

    On a CPU each copy gets the thread count DDP's ranks get under torchrun (OMP_NUM_THREADS, 1 unless
    set), so the pair reproduces how step 2's two ranks share this CPU.
    """
    work.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if device_type == "cpu":
        env.setdefault("OMP_NUM_THREADS", "1")

    def launch(n: int, tag: str) -> list[dict]:
        go = work / f"{tag}.go"
        go.unlink(missing_ok=True)
        copies, specs, logs = [], [], []
        release_device_memory("cuda")  # the copies get the GPU the launcher let go of (a no-op without CUDA)
        beat = as_progress(say).heartbeat(f"  co-location ({tag})")  # a line at least every GAP_S seconds
        with procs.group() as group:  # the copies end with this call, however it ends (procs)
            try:
                for i in range(n):
                    spec = {"job": job.to_dict(), "warmup": max(1, job.warmup_steps), "steps": job.coloc_steps,
                            "ready": str(work / f"{tag}{i}.ready"), "go": str(go),
                            "out": str(work / f"{tag}{i}.json"), "wait_s": READY_TIMEOUT_S}
                    for k in ("ready", "out"):
                        Path(spec[k]).unlink(missing_ok=True)
                    path = work / f"{tag}{i}.spec.json"
                    path.write_text(json.dumps(spec))
                    logs.append(open(work / f"{tag}{i}.log", "w"))  # noqa: SIM115 - closed below
                    copies.append(group.popen([sys.executable, "-m", "mfu_lab.workers.coloc", "--spec", str(path)],
                                              stdout=logs[-1], stderr=logs[-1], env=env, cwd=os.getcwd()))
                    specs.append(spec)
                deadline = time.monotonic() + READY_TIMEOUT_S
                while not all(Path(s["ready"]).exists() for s in specs):
                    dead = [i for i, p in enumerate(copies) if p.poll() is not None]
                    if dead or time.monotonic() > deadline:
                        raise RuntimeError(f"copy {dead[0] if dead else '?'} ended or stalled before its measured "
                                           "steps")
                    beat.beat(what="warming up")
                    time.sleep(0.05)
                go.write_text("go")
                deadline = time.monotonic() + READY_TIMEOUT_S
                for p in copies:
                    while True:
                        try:
                            p.wait(timeout=max(0.0, min(GAP_S, deadline - time.monotonic())))
                            break
                        except subprocess.TimeoutExpired:
                            if time.monotonic() >= deadline:
                                raise
                            beat.beat(what="measured steps")
                if any(p.returncode for p in copies):
                    raise RuntimeError("a copy exited with an error")
                return [read_json(Path(s["out"])) for s in specs]
            except (RuntimeError, subprocess.TimeoutExpired) as e:
                group.kill_all()
                tail = "".join((work / f"{tag}{i}.log").read_text(errors="replace")[-800:] for i in range(n))
                raise RuntimeError(f"{e}; its log ends: {tail.strip()[-800:]}") from None
            finally:
                for f in logs:
                    f.close()

    try:
        say(f"co-location: the job alone ({job.coloc_steps} steps)")
        alone = launch(1, "alone")[0]
        say(f"co-location: two copies at once ({job.coloc_steps} steps each)")
        pair = launch(2, "pair")
    except RuntimeError as e:
        return Coloc("failed", str(e))
    a = stats(alone["wall_s"])
    both = [w for r in pair for w in r["wall_s"]]
    b = stats(both)
    return Coloc("ok", "", alone["device"], alone["threads"], alone["wall_s"], [r["wall_s"] for r in pair],
                 a.median, b.median, a.p10, a.p90, b.p10, b.p90, b.median / a.median)
