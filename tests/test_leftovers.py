"""The suite's own end check (tests/leftovers.py): a process a test leaves running is named, killed, and fails
the run, even one in a session of its own whose parent has ended."""

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_bytes().rsplit(b")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in (b"Z", b"X")


def _run_inner(tmp_path: Path, body: str) -> subprocess.CompletedProcess:
    (tmp_path / "conftest.py").write_text('pytest_plugins = ["tests.leftovers"]\n')
    (tmp_path / "test_inner.py").write_text(textwrap.dedent(body))
    env = {k: v for k, v in os.environ.items() if k != "MFU_LAB_TEST_SUITE"}
    env |= {"PYTHONPATH": str(ROOT), "MFU_LAB_LEFTOVER_GRACE_S": "1"}
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180)


def test_a_process_left_running_fails_the_run_and_is_killed(tmp_path):
    pidfile = tmp_path / "orphan.pid"
    p = _run_inner(tmp_path, f"""
        import subprocess, sys, time
        def test_leaves_one():
            # a middle process starts a grandchild in a session of its own and exits: the grandchild is re-parented
            code = "import subprocess, sys; p = subprocess.Popen(['sleep', '120'], start_new_session=True); "\\
                   "open({str(pidfile)!r}, 'w').write(str(p.pid))"
            subprocess.run([sys.executable, '-c', code], check=True)
    """)
    out = p.stdout + p.stderr
    assert p.returncode == 1, out
    assert "outlived them" in out and "sleep 120" in out, out
    pid = int(pidfile.read_text())
    deadline = time.monotonic() + 10
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(pid)


def test_a_clean_run_passes(tmp_path):
    p = _run_inner(tmp_path, """
        import subprocess
        def test_waits():
            subprocess.run(['true'], check=True)
    """)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "outlived" not in p.stdout
