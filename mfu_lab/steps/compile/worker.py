"""Step 4's trial processes: one compile trial through ``python -m mfu_lab.workers.compile_trial``, its compile
caches in a folder of its own, its printed lines passed on with a heartbeat while it is silent, ended with the call
however the call ends (``core.process.procs.group``), and its result read back."""

from __future__ import annotations

import json
import os
import selectors
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from mfu_lab.core.measure import device as dev
from mfu_lab.core.process import procs
from mfu_lab.core.process.progress import as_progress


def run_worker(spec: dict[str, Any], work: Path, cache: Path, timeout_s: float, say) -> dict[str, Any]:
    """One trial through ``python -m mfu_lab.workers.compile_trial``; its compile caches live in ``cache``."""
    work.mkdir(parents=True, exist_ok=True)
    tag = f"{spec['label'].replace(' ', '_')}"
    spec = {**spec, "out": str(work / f"{tag}.json")}
    spec_path = work / f"{tag}.spec.json"
    spec_path.write_text(json.dumps(spec))
    Path(spec["out"]).unlink(missing_ok=True)
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache / "inductor"), "TRITON_CACHE_DIR": str(cache / "triton"),
           "PYTHONUNBUFFERED": "1"}
    log = work / f"{tag}.stderr.log"
    dev.release_device_memory("cuda")  # the trial gets the GPU the launcher let go of (a no-op without CUDA)
    t0 = time.perf_counter()
    with open(log, "w") as err, procs.group():  # the trial ends with this call, however it ends
        proc = procs.popen([sys.executable, "-m", "mfu_lab.workers.compile_trial", "--spec", str(spec_path)],
                           stdout=subprocess.PIPE, stderr=err, text=True, env=env)
        deadline = time.monotonic() + timeout_s
        timed_out = False
        sel = selectors.DefaultSelector()
        sel.register(proc.stdout, selectors.EVENT_READ)
        beat = as_progress(say).heartbeat(f"  {spec['label']}")  # a compile can be silent for minutes
        while True:
            if time.monotonic() > deadline:
                timed_out = True
                procs.kill(proc)
                break
            if sel.select(timeout=0.5):
                line = proc.stdout.readline()
                if not line:
                    break
                say("  " + line.rstrip())
                beat.said()
            elif proc.poll() is not None:
                break
            else:
                beat.beat(what=f"no line from the trial for {time.monotonic() - beat.last:.0f} s")
        proc.wait()
        sel.close()
    seconds = time.perf_counter() - t0
    if timed_out:
        return {"status": "timeout", "error": f"ended after compile_timeout_s = {timeout_s:g} s", "seconds": seconds}
    out = Path(spec["out"])
    if not out.is_file():
        tail = "\n".join(ln for ln in log.read_text(errors="replace").splitlines() if not ln.startswith("USDT:"))
        return {"status": "failed", "error": f"the trial process exited with code {proc.returncode} and no result",
                "traceback": tail[-3000:], "seconds": seconds}
    return json.loads(out.read_text()) | {"seconds": seconds}
