"""Starting processes that never outlive the run: the one launcher every part of the workbook uses.

The chain ``mfu-lab run`` -> notebook kernel -> torchrun -> ranks (and the kernel's compile trials, verify rungs
and co-located copies) spans several sessions: the kernel and every child below it are started in sessions of
their own, so neither Ctrl-C nor a kill of ``mfu-lab run`` reaches them by itself. Three guarantees close that:

- :func:`popen` starts a child in a process group (session) of its own and asks the Linux kernel, through
  ``prctl(PR_SET_PDEATHSIG)`` in the child before it runs its command (a few lines of Python the child execs
  first, which then exec the command: no ``preexec_fn``, see :data:`_ARM`), to send it ``death_signal`` the
  moment this process ends, however it ends (SIGKILL included). A child started from a thread other than the main one
  is forked from a spawner thread that lives as long as the process, since the signal comes when the *thread*
  that forked the child ends.
- :func:`group` ends, on every way out of its block (success, exception, Ctrl-C, SIGTERM made Ctrl-C by
  :func:`interrupt_on_sigterm`), every process group started inside it; :func:`kill_all` (registered with
  ``atexit``) ends any left when the interpreter exits.
- :func:`die_with_parent` lets a process started by code that is not ours (torchrun's ranks) ask for the
  same signal from its first lines.

torchrun is started with ``death_signal=SIGTERM``: on SIGTERM it ends its ranks itself (they are in sessions of
their own) and exits, and the ranks, which call :func:`die_with_parent`, then die with it whatever happened.
Processes that our children start on their own (DataLoader workers, inductor's compile workers) watch their
parent themselves. Elsewhere than Linux there is no PDEATHSIG: groups are still ended on every way out this
process takes, but a SIGKILL of it leaves its children running (:func:`die_with_parent` polls instead).
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

PR_SET_PDEATHSIG = 1


def _load_prctl():
    if not sys.platform.startswith("linux"):
        return None
    try:
        import ctypes

        fn = ctypes.CDLL(None, use_errno=True).prctl
        fn.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
        fn.restype = ctypes.c_int
        return fn
    except (OSError, AttributeError):  # pragma: no cover - a libc without prctl
        return None


_PRCTL = _load_prctl()  # resolved once, here: the child between fork and exec only calls it
HAS_PDEATHSIG = _PRCTL is not None

_lock = threading.Lock()
_live: dict[int, subprocess.Popen] = {}  # pid -> every process popen started, until it is ended or seen to exit
_local = threading.local()  # .groups: this thread's open groups, innermost last
_spawner: ThreadPoolExecutor | None = None


def die_with(parent: int, death_signal: int = signal.SIGKILL) -> None:
    """In a forked child (before exec, or a fork that never execs): receive ``death_signal`` when ``parent``
    ends (Linux); if it already ended, die now."""
    if _PRCTL is not None:
        _PRCTL(PR_SET_PDEATHSIG, int(death_signal), 0, 0, 0)
    if os.getppid() != parent:  # the parent ended between fork and prctl
        os.kill(os.getpid(), signal.SIGKILL)


# Run as the child's first program, between fork and the command's exec: the parent-death signal, then the command
# (execvp keeps the pid and the signal). Not a preexec_fn: Python code run in a forked child of a process with
# threads can deadlock before it starts (CPython 3.11's PyOS_AfterFork_Child waited forever on a lock a thread held
# at the fork, in the monitor's profiler-window children); Popen without preexec_fn runs no Python in the child.
# Python ignores SIGPIPE and SIGXFSZ; an ignored signal would stay ignored in the command, so both are reset.
_ARM = ("import ctypes, os, signal, sys\n"
        "sig, parent = int(sys.argv[1]), int(sys.argv[2])\n"
        "try:\n    ctypes.CDLL(None, use_errno=True).prctl(1, sig, 0, 0, 0)\n"
        "except (OSError, AttributeError):\n    pass\n"
        "if os.getppid() != parent:\n    os.kill(os.getpid(), signal.SIGKILL)\n"
        "for s in ('SIGPIPE', 'SIGXFSZ'):\n"
        "    hasattr(signal, s) and signal.signal(getattr(signal, s), signal.SIG_DFL)\n"
        "os.execvp(sys.argv[3], sys.argv[3:])\n")


_PYTHON = sys.executable  # the interpreter that runs _ARM, fixed at import (a test may point sys.executable elsewhere)


def armed(cmd, death_signal: int, parent: int) -> list[str]:
    """``cmd`` (a list, or a shell line) started through :data:`_ARM`: it gets ``death_signal`` when ``parent``
    ends (Linux), and runs as the same process (exec). Elsewhere than Linux, ``cmd`` unchanged."""
    argv = ["/bin/sh", "-c", cmd] if isinstance(cmd, str) else [str(c) for c in cmd]
    if _PRCTL is None:
        return argv
    return [_PYTHON, "-S", "-E", "-c", _ARM, str(int(death_signal)), str(parent), *argv]


def _start(cmd, kw: dict[str, Any]) -> subprocess.Popen:
    proc = subprocess.Popen(cmd, **kw)
    with _lock:
        for pid in [p for p, q in _live.items() if q.returncode is not None]:  # reaped by their owner: forget
            del _live[pid]
        _live[proc.pid] = proc
    return proc


def popen(cmd, *, death_signal: int = signal.SIGKILL, new_session: bool = True, grace_s: float = 0.0,
          **kw: Any) -> subprocess.Popen:
    """``subprocess.Popen(cmd, **kw)`` for a child that never outlives this process.

    - ``new_session``: the child leads a session and process group of its own (``start_new_session``), so that
      :func:`kill` ends it with whatever it started in its group, and a Ctrl-C at the terminal does not reach it
      behind this process's back. ``False`` keeps it in this process's group (a foreground program such as
      JupyterLab, which answers Ctrl-C itself); it is then ended alone, never this group.
    - ``death_signal``: sent to the child when this process ends, even by SIGKILL (Linux). SIGKILL by default;
      SIGTERM for a child that must end children of its own in other sessions (torchrun).
    - ``grace_s``: how long :func:`kill` (and a group's exit) waits after SIGTERM before SIGKILL; 0: SIGKILL.
    - The child is ended by the innermost open :func:`group` of the calling thread and by :func:`kill_all`.

    ``preexec_fn`` and ``start_new_session`` are this function's own; every other Popen argument passes through.
    """
    if "preexec_fn" in kw or "start_new_session" in kw or "executable" in kw:
        raise TypeError("procs.popen sets the program, preexec_fn and start_new_session itself (new_session=...)")
    if kw.pop("shell", False) and not isinstance(cmd, str):
        raise TypeError("procs.popen(shell=True) takes the command as one string")
    cmd = armed(cmd, death_signal, os.getpid())
    kw = {**kw, "start_new_session": new_session}
    if threading.current_thread() is threading.main_thread():
        proc = _start(cmd, kw)
    else:  # fork from a thread that lives as long as the process: PDEATHSIG follows the forking thread
        proc = _spawner_pool().submit(_start, cmd, kw).result()
    proc.mfu_group, proc.mfu_grace = new_session, grace_s  # type: ignore[attr-defined]
    for g in getattr(_local, "groups", [])[-1:]:
        g.procs.append(proc)
    return proc


def _spawner_pool() -> ThreadPoolExecutor:
    global _spawner
    with _lock:
        if _spawner is None:
            _spawner = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mfu-lab-spawner")
        return _spawner


def adopt(proc: subprocess.Popen, *, new_session: bool = True, grace_s: float = 0.0) -> subprocess.Popen:
    """Put a process started elsewhere (a notebook kernel jupyter_client started) under the same care as one
    :func:`popen` started: ended by the innermost open :func:`group` and by :func:`kill_all`."""
    with _lock:
        _live[proc.pid] = proc
    proc.mfu_group, proc.mfu_grace = new_session, grace_s  # type: ignore[attr-defined]
    for g in getattr(_local, "groups", [])[-1:]:
        g.procs.append(proc)
    return proc


def _signal(proc: subprocess.Popen, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        if getattr(proc, "mfu_group", False) and proc.pid != os.getpgrp():
            os.killpg(proc.pid, sig)
        else:
            proc.send_signal(sig)


def kill(proc: subprocess.Popen, grace_s: float | None = None) -> int | None:
    """End ``proc`` and its process group, and reap it; its exit status. SIGTERM first when ``grace_s`` (default:
    the one given to :func:`popen`) is above 0, SIGKILL after it; SIGKILL is sent even when a second Ctrl-C
    interrupts the wait. A process its owner has already reaped is left alone (its pid may have been reused)."""
    grace = getattr(proc, "mfu_grace", 0.0) if grace_s is None else grace_s
    unreaped = proc.returncode is None  # its pid (and group id) cannot have been reused
    try:
        if unreaped and grace > 0 and proc.poll() is None:
            _signal(proc, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=grace)
    finally:
        if unreaped:  # SIGKILL to the group even when the leader just exited: what it left in its group goes too
            _signal(proc, signal.SIGKILL)
            proc.wait()
        with _lock:
            _live.pop(proc.pid, None)
    return proc.returncode


class Group:
    """The processes started inside one :func:`group` block (``.procs``); :meth:`popen` starts one in it."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen] = []

    def popen(self, cmd, **kw: Any) -> subprocess.Popen:
        """:func:`popen`, the child belonging to this group whichever group is innermost."""
        proc = popen(cmd, **kw)
        if proc not in self.procs:
            self.procs.append(proc)
        return proc

    def kill_all(self) -> None:
        """End every process of the group now (each with its own grace), the last started first."""
        errors = []
        for proc in reversed(self.procs):
            try:
                kill(proc)
            except BaseException as e:  # noqa: BLE001 - the others are ended all the same, then it is raised
                errors.append(e)
        if errors:
            raise errors[0]


@contextlib.contextmanager
def group() -> Iterator[Group]:
    """A block whose processes end with it: every process :func:`popen` starts in this thread while the block
    runs (or through ``Group.popen``) is ended, with its process group, on every way out of the block."""
    g = Group()
    stack = _local.__dict__.setdefault("groups", [])
    stack.append(g)
    try:
        yield g
    finally:
        stack.remove(g)
        g.kill_all()


def kill_all() -> None:
    """End every process :func:`popen` started that is still running (at interpreter exit, by ``atexit``)."""
    with _lock:
        procs = list(_live.values())
    for proc in procs:
        with contextlib.suppress(Exception):
            kill(proc, grace_s=0.0)


atexit.register(kill_all)


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised as Ctrl-C is, so that the same cleanup runs."""


@contextlib.contextmanager
def interrupt_on_sigterm() -> Iterator[None]:
    """Inside the block, SIGTERM raises :class:`Terminated` (a KeyboardInterrupt) in the main thread, so a
    terminated run cleans up as an interrupted one does; the previous handler is back after it. Elsewhere than
    the main thread it does nothing (Python delivers signals there only)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def raise_interrupt(signum, frame):
        raise Terminated(f"terminated by signal {signum} (SIGTERM)")

    before = signal.signal(signal.SIGTERM, raise_interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, before)


LAUNCHER_ENV = "MFU_LAB_LAUNCHER_PID"  # in torchrun's environment (launcher_env()): the process that started it


def launcher_env() -> dict[str, str]:
    """Environment for a launcher whose children call :func:`die_with_parent` (torchrun): this process's pid, so
    that a rank that finds neither its parent nor its grandparent to be this process knows it was orphaned before
    it could ask for its death signal (torchrun killed while the rank started up)."""
    return {LAUNCHER_ENV: str(os.getpid())}


def _parent_of(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return int(f.read().rsplit(b")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def die_with_parent(death_signal: int = signal.SIGKILL) -> bool:
    """Ask for ``death_signal`` when this process's parent ends: for a process that code other than ours started
    (a rank torchrun started); call it first thing. When the parent has already gone (it changed during the call,
    or :data:`LAUNCHER_ENV` names a launcher that is neither the parent nor the parent's parent), the signal comes
    now. True when the kernel will send it (Linux); elsewhere a daemon thread polls the parent once a second."""
    parent = os.getppid()
    if _PRCTL is not None:
        _PRCTL(PR_SET_PDEATHSIG, int(death_signal), 0, 0, 0)
    launcher = os.environ.get(LAUNCHER_ENV, "")
    orphaned = os.getppid() != parent
    if launcher.isdigit() and _PRCTL is not None and (grand := _parent_of(parent)) is not None:
        orphaned = orphaned or int(launcher) not in (parent, grand)
    if orphaned:
        os.kill(os.getpid(), death_signal)
    if _PRCTL is not None:
        return True

    def watch() -> None:  # pragma: no cover - not Linux
        while os.getppid() == parent:
            time.sleep(1.0)
        os.kill(os.getpid(), death_signal)

    threading.Thread(target=watch, name="mfu-lab-parent-watch", daemon=True).start()
    return False


@functools.cache
def kernel_manager_class():
    """A jupyter_client kernel manager whose kernels die with this process (PDEATHSIG SIGKILL; the kernel's own
    children die with it in turn) and are ended by the innermost open :func:`group`. papermill takes it as
    ``execute_notebook(..., kernel_manager_class=procs.kernel_manager_class())``."""
    from jupyter_client.manager import AsyncKernelManager

    class DyingKernelManager(AsyncKernelManager):
        async def _async_launch_kernel(self, kernel_cmd, **kw):
            await super()._async_launch_kernel(armed(kernel_cmd, signal.SIGKILL, os.getpid()), **kw)
            proc = getattr(self.provisioner, "process", None)
            if isinstance(proc, subprocess.Popen):
                adopt(proc)

    return DyingKernelManager


@contextlib.contextmanager
def env_set(name: str, value: str) -> Iterator[str]:
    """``os.environ[name]`` set to ``value`` for the length of the block (the children started meanwhile inherit
    it), then restored as it was, removed when it was not set."""
    before = os.environ.get(name)
    os.environ[name] = value
    try:
        yield value
    finally:
        if before is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = before
