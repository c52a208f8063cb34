"""One rung of the verify step's staircase, in a process of its own, driven round by round.

    python -m mfu_lab.workers.verify_rung --spec SPEC.json

The process builds the rung's job (model, training step with its dtype, matmul precision and compile
mode, DataLoader), counts the model FLOPs of one step on an eager forward+backward, runs the warm-up
steps (compilation happens there), then answers commands on stdin, one JSON object per line:

    {"run": K}   -> K more training steps, continuing the same training; replies their timings
    {"quit": 1}  -> exits

On CUDA the spec's ``memory_fraction`` (the rung's share by its need: steps/verify/memory_share.py) bounds the
process's caching allocator (``torch.cuda.set_per_process_memory_fraction``): every rung stays resident on the one
GPU. Where the rungs do not fit together the spec says ``release``: no bound, the process frees its cached blocks
after each turn and runs one untimed step at the start of the next (``turns`` of them: one more batch each).

Replies are single stdout lines that start with ``@mfu-lab@`` followed by JSON, so a library printing to
stdout cannot be mistaken for a reply. A fresh process per rung keeps one rung's compiled code, caches
and allocator out of the next, and lets every rung stay warm while the parent alternates between them.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import queue
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path

from mfu_lab.core.engine.batches import to_device
from mfu_lab.core.process import procs
from mfu_lab.core.process.progress import GAP_S

PREFIX = "@mfu-lab@"


class RungProcess:
    """The parent's handle on one rung's process: start it, wait for it to be warm, run rounds, close it.

    Every read has a deadline: a rung that hangs (a compile that never ends, a dead DataLoader worker) is
    ended and reported, never waited on forever.
    """

    def __init__(self, spec: dict, work: Path, timeout_s: float, env: dict[str, str] | None = None):
        work.mkdir(parents=True, exist_ok=True)
        stem = "rung_" + spec["rung"].replace(" ", "_")  # "original again": step 7's second turn
        spec_path = work / f"{stem}.json"
        spec_path.write_text(json.dumps(spec))
        self.name, self.timeout_s = spec["rung"], timeout_s
        self.stderr_path = work / f"{stem}.log"
        self._err = open(self.stderr_path, "w")
        env = {**os.environ, **(env or {}), "PYTHONUNBUFFERED": "1"}  # env: e.g. a compile cache to reuse
        # a session of its own, dies with this process (procs.popen); ended by close(), or at the latest when the
        # open procs.group() of the caller ends or the interpreter exits
        self.proc = procs.popen([sys.executable, "-m", "mfu_lab.workers.verify_rung", "--spec", str(spec_path)],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._err, text=True, env=env)
        self._lines: queue.Queue = queue.Queue()
        self.beat = None  # called with the seconds waited, every GAP_S seconds without an answer (a long warm-up)

        def pump():
            for line in self.proc.stdout:
                if line.startswith(PREFIX):
                    self._lines.put(json.loads(line[len(PREFIX):]))
            self._lines.put(None)  # the process closed its output: it exited

        threading.Thread(target=pump, daemon=True).start()

    def _next(self) -> dict:
        t0 = time.monotonic()
        while True:
            waited = time.monotonic() - t0
            try:
                msg = self._lines.get(timeout=max(0.0, min(GAP_S, self.timeout_s - waited)))
                break
            except queue.Empty:
                waited = time.monotonic() - t0
                if waited < self.timeout_s:
                    if self.beat is not None:
                        self.beat(waited)
                    continue
                self.close()
                raise RuntimeError(f"rung {self.name}: no answer for {self.timeout_s:.0f} s; the process was ended "
                                   f"(its log: {self.stderr_path})") from None
        if msg is None:
            tail = self.stderr_path.read_text(errors="replace").strip().splitlines()[-3:]
            raise RuntimeError(f"rung {self.name}: the process exited ({' | '.join(tail) or 'no message'})")
        if msg.get("error"):
            raise RuntimeError(f"rung {self.name}: {msg['error']}")
        return msg

    def ready(self) -> dict:
        return self._next()

    def run(self, steps: int) -> dict:
        """The next ``steps`` steps' timings; RuntimeError when the process died, hung or failed (a dead process's
        closed stdin, BrokenPipeError or another OSError, is said as its exit, with its log's last lines)."""
        try:
            self.proc.stdin.write(json.dumps({"run": steps}) + "\n")
            self.proc.stdin.flush()
        except (OSError, ValueError) as e:  # BrokenPipeError: the process is gone; ValueError: stdin was closed
            self.proc.poll()
            tail = self.stderr_path.read_text(errors="replace").strip().splitlines()[-3:]
            raise RuntimeError(f"rung {self.name}: the process exited (code {self.proc.returncode}; "
                               f"{type(e).__name__} writing to it: {' | '.join(tail) or 'no message'})") from None
        return self._next()

    def close(self) -> None:
        """Ask the process to quit and wait up to 10 s, then end it; at once when Ctrl-C (or SIGTERM) is why the
        caller is closing it (a rung in the middle of its steps would read the quit only after them)."""
        if isinstance(sys.exc_info()[1], KeyboardInterrupt):
            procs.kill(self.proc)
        if self.proc.poll() is None:
            with contextlib.suppress(OSError, ValueError):
                self.proc.stdin.write(json.dumps({"quit": 1}) + "\n")
                self.proc.stdin.flush()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
            finally:  # its group too, even when the wait was interrupted
                procs.kill(self.proc)
        self._err.close()

    def __enter__(self) -> RungProcess:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def reply(obj: dict) -> None:
    sys.stdout.write(PREFIX + json.dumps(obj) + "\n")
    sys.stdout.flush()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--spec", required=True)
    spec = json.loads(Path(ap.parse_args().spec).read_text())
    try:
        import dataclasses

        import torch

        from mfu_lab.core.engine.work import same_batches
        from mfu_lab.core.engine.workload import build_loader, build_model, build_train_step
        from mfu_lab.core.job.schema import validate
        from mfu_lab.core.measure import flops as fl
        from mfu_lab.core.measure.device import resolve_device
        from mfu_lab.core.measure.timed import run_steps

        job = validate(spec["job"], f"verify rung {spec['rung']}")
        device = resolve_device(job.device)
        tdev = device.torch_device
        if device.type == "cuda" and spec.get("memory_fraction"):  # pragma: no cover - GPU only
            # every rung stays resident on the one GPU (allocator reserve, CUDA-graph pools): each gets its share,
            # so rung 2 of a job sized to fill the GPU fails on its own bound, not on the others' leftovers
            torch.cuda.set_per_process_memory_fraction(float(spec["memory_fraction"]), tdev)
        release = device.type == "cuda" and bool(spec.get("release"))
        model = build_model(job).to(tdev).train()
        step = build_train_step(job, model, device.type)
        quiet = dataclasses.replace(job, num_workers=0, synthetic_load_ms=0.0)
        x0, y0 = next(iter(build_loader(quiet, 1, device.type)))
        report = fl.count_step_flops(model, step, to_device(x0, tdev), to_device(y0, tdev))
        torch.manual_seed(job.seed)  # every rung starts its steps from the same random state, whatever counting drew
        total = job.verify_warmup_steps + spec["steps_total"] + (int(spec.get("turns", 0)) if release else 0)
        batches = iter(same_batches(job, total, device.type))
        t0 = time.perf_counter()
        warm = run_steps(step, batches, tdev, job.verify_warmup_steps, 0) if job.verify_warmup_steps else None
        reply({"ready": True, "model_flops_per_step": report.model_flops_per_step,
               "hardware_flops_per_step": report.hardware_flops_per_step, "flops_source": report.model_flops_source,
               "warmup_s": time.perf_counter() - t0, "warmup_wall_s": warm.wall_s if warm else [],
               "warmup_loss": warm.loss if warm else [], "fp8_why_not": step.fp8.why_not})
    except Exception as exc:  # reported to the parent, which records the rung as failed
        reply({"ready": False, "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-3000:]})
        return 1
    for line in sys.stdin:
        cmd = json.loads(line)
        if "quit" in cmd:
            break
        try:
            t = run_steps(step, batches, tdev, 1 if release else 0, int(cmd["run"]))  # release: 1 untimed first
            reply({"wall_s": t.measured("wall_s"), "data_s": t.measured("data_s"),
                   "compute_s": t.measured("compute_s"), "loss": t.measured("loss")})
            if release:  # pragma: no cover - GPU only: the next rung's turn gets the memory this one cached
                torch.cuda.empty_cache()
        except Exception as exc:
            reply({"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()[-3000:]})
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
