"""A pytest plugin: no process that the suite started outlives it.

At the start, the suite's process marks its environment (``MFU_LAB_TEST_SUITE=<pid>-<ns>``); every process it
starts, and every process those start, inherits the mark unless a test builds an environment from nothing. At the
end, any process still carrying this run's mark (found through ``/proc/<pid>/environ``, so one re-parented to
PID 1 after its parent died, in a session of its own, is found too) is a leftover. They get a grace period to end
on their own (a torchrun ending its ranks takes seconds), then each one is named, killed, and the run fails.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

MARK = "MFU_LAB_TEST_SUITE"
# a tree ending through PDEATHSIG ends at once; torchrun takes a few seconds to end its ranks
GRACE_S = float(os.environ.get("MFU_LAB_LEFTOVER_GRACE_S", "20"))


def _state(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/stat").read_bytes().rsplit(b")", 1)[1].split()[0].decode()
    except (OSError, IndexError):
        return None


def marked(value: str) -> list[int]:
    """Live (not zombie) processes other than this one whose environment carries ``MARK=value``."""
    needle = f"{MARK}={value}".encode() + b"\0"
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) == os.getpid():
            continue
        try:
            env = d.joinpath("environ").read_bytes() + b"\0"
        except OSError:  # gone, or not ours
            continue
        if needle in env and _state(int(d.name)) not in (None, "Z", "X"):
            out.append(int(d.name))
    return out


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")[:160]
    except OSError:
        return "?"


def pytest_configure(config) -> None:
    if not Path("/proc/self/environ").exists():  # not Linux: nothing to look in
        return
    os.environ[MARK] = f"{os.getpid()}-{time.time_ns()}"


def pytest_sessionfinish(session, exitstatus) -> None:
    value = os.environ.get(MARK)
    if not value or not value.startswith(f"{os.getpid()}-"):
        return
    deadline = time.monotonic() + GRACE_S
    while (left := marked(value)) and time.monotonic() < deadline:
        time.sleep(0.2)
    if not left:
        return
    names = {pid: _cmdline(pid) for pid in left}
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    lines = [f"{len(left)} process(es) started by the tests outlived them (killed now):"]
    lines += [f"  pid {pid}: {cmd}" for pid, cmd in names.items()]
    if reporter is not None:
        reporter.write_line("\n".join(lines), red=True)
    else:
        print("\n".join(lines))
    session.exitstatus = 1
