"""The monitor's profiler-window analysis runs in a child process that never outlives the job: killed at close when
it hangs (its stacks in the record), dead with a parent that dies without closing, and never holding the
launcher's pipes (a CI run once waited 300 s on torchrun's output: a bare fork() of a rank, stuck in CPython's
after-fork clean-up, still held its stdout). The hang is injected by running the real child module with its
analysis replaced by a sleep."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch
from torch import nn

from mfu_lab.monitor import Monitor, profiling

ROOT = Path(__file__).resolve().parents[1]

HANG = """
import os, sys, time
from pathlib import Path
import mfu_lab.analysis.trace.window as w
pid_file = Path(os.environ["MFU_LAB_TEST_PID_FILE"])
def analyse_window(path, keep, name):  # says who it is, then never answers
    pid_file.write_text(str(os.getpid()))
    time.sleep(3600)
w.analyse_window = analyse_window
sys.exit(w.main(sys.argv[1:]))
"""


def _gone(pid: int, within_s: float = 30.0) -> bool:
    """True once pid is no process or only a zombie nobody reaped yet (a container's init may not reap)."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError, IndexError):
            return True
        if state in ("Z", "X"):
            return True
        time.sleep(0.1)
    return False


def test_a_hanging_analysis_child_is_killed_at_close_and_its_window_says_so(tmp_path, monkeypatch):
    pid_file = tmp_path / "child.pid"
    monkeypatch.setenv("MFU_LAB_TEST_PID_FILE", str(pid_file))
    monkeypatch.setattr(profiling, "JOIN_S", 0.5)
    monkeypatch.setattr(profiling, "CHILD", [sys.executable, "-c", HANG])
    model = nn.Linear(16, 16)
    with Monitor(tmp_path / "mon", model=model, every=2, profile_every_s=1e-3, profile_steps=2, peak_flops=1e11) as mon:
        for _ in range(1000):  # until a window was handed to its child and the child reached its analysis
            model(torch.randn(4, 16)).sum().backward()
            mon.step(tokens=4)
            if pid_file.exists():
                break
            time.sleep(0.02)
    pid = int(pid_file.read_text())
    assert _gone(pid, within_s=1.0), f"the analysis child {pid} outlived close()"
    recs = [json.loads(line) for f in (tmp_path / "mon").glob("*.jsonl") for line in f.read_text().splitlines()]
    prof = [r for r in recs if r.get("kind") == "profile"]
    assert prof and all("killed" in r["error"] and "after the monitor closed" in r["error"] for r in prof), prof
    # where the child hung, from its own stacks (faulthandler on SIGUSR1), in the record of its window
    assert any("in analyse_window" in r.get("hang_stack", "") for r in prof), prof


SCRIPT = """
import os, sys, time
from pathlib import Path
import torch
from torch import nn
from mfu_lab.monitor import Monitor, profiling

pid_file = Path(os.environ["MFU_LAB_TEST_PID_FILE"])
profiling.CHILD = [sys.executable, "-c", sys.argv[1]]
model = nn.Linear(16, 16)
mon = Monitor(pid_file.parent / "mon", model=model, every=2, profile_every_s=1e-3, profile_steps=2, peak_flops=1e11)
for _ in range(3000):  # until a window's child reached its analysis
    model(torch.randn(4, 16)).sum().backward()
    mon.step(tokens=4)
    if pid_file.exists():
        break
    time.sleep(0.02)
print("child", pid_file.read_text(), flush=True)
os._exit(0)  # a rank that dies without closing its monitor
"""


def test_a_parent_dying_without_close_takes_its_child_along_and_no_pipe_is_held(tmp_path):
    pid_file = tmp_path / "child.pid"
    # capture_output: were the child's streams the parent's, run() would wait for the child's pipe to close
    p = subprocess.run([sys.executable, "-c", SCRIPT, HANG], capture_output=True, text=True, timeout=180, cwd=ROOT,
                       env={**os.environ, "MFU_LAB_TEST_PID_FILE": str(pid_file)})
    assert p.returncode == 0, p.stderr
    pid = int(pid_file.read_text())
    assert f"child {pid}" in p.stdout
    assert _gone(pid), f"the analysis child {pid} outlived its parent"


def test_the_analysis_child_loads_no_torch_and_answers_with_the_windows_figures(tmp_path):
    """The child as the monitor starts it: a real two-step trace in, its figures out, torch never imported."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                schedule=lambda _: torch.profiler.ProfilerAction.RECORD) as prof:
        for _ in range(3):
            nn.Linear(32, 32)(torch.randn(8, 32)).sum().backward()
            prof.step()
    trace = tmp_path / "r-1.json"
    prof.export_chrome_trace(str(trace))
    boot = profiling.CHILD[2].replace("sys.exit(main(sys.argv[1:]))",
                                      "code = main(sys.argv[1:]); print('\\ntorch:', 'torch' in sys.modules); "
                                      "sys.exit(code)")
    p = subprocess.run([sys.executable, "-c", boot, str(trace), "--keep", "1", "--name", "r", "--steps", "2"],
                       capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    figures, flag = p.stdout.strip().rsplit("\n", 1)
    fields = json.loads(figures)
    assert flag == "torch: False"
    assert fields["steps_in_trace"] >= 2 and fields["breakdown"]["computing"] > 0 and not fields.get("error"), fields
    assert fields["trace"] == "r-1.json.gz" and (tmp_path / "r-1.json.gz").exists() and not trace.exists()
