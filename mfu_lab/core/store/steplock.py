"""A step holds its job's folder while it measures, wherever it is called from.

``mfu-lab run`` and ``mfu-lab step`` hold the job's folder (:func:`mfu_lab.core.store.runstate.job_lock`) for the
length of a run. A step's ``run(job)`` called anywhere else (a notebook of ``mfu-lab lab``, a script) takes the
same lock for as long as it measures (:func:`holds_job`), so that it cannot measure alongside a run of the same
job and overwrite its ``result.json``, nor be overwritten by it: while another process holds the folder, the step
is refused at once, naming the folder and the holder. An idle lab kernel holds nothing.

The lock is the caller's already, and the step goes on, when

- this process holds it (``mfu-lab step`` runs the step in the process that took the lock), or the step is called
  from inside another step's ``run`` (the calls nest: only the outermost one takes the lock);
- the process that holds it is the ``mfu-lab run`` that executes this notebook: the runner names its run id in the
  lock and hands the same id to the notebooks' kernels in ``MFU_LAB_RUN_ID`` (``history.RUN_ENV``), so a kernel
  whose run id is the holder's is that run's own.

``run(job, write=False)`` (tests, benchmarks) writes nothing, and takes no lock.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import json
import os
import platform
import threading
from collections.abc import Iterator
from pathlib import Path

from mfu_lab.core.store.files import open_nofollow
from mfu_lab.core.store.history import run_id_from_env
from mfu_lab.core.store.runstate import LOCK_FILE, JobBusy, job_lock

_HELD: dict[Path, int] = {}  # job folders this process holds for a step's run(), with how deep the calls nest
_GUARD = threading.Lock()


def lock_holder(job_root: Path) -> dict:
    """Who holds the job's folder, as its lock file names them (``run``, ``pid``, ``host``, ``since``); ``{}``
    when there is no lock file or it cannot be read."""
    try:
        with os.fdopen(open_nofollow(Path(job_root) / LOCK_FILE, os.O_RDONLY), encoding="utf-8") as f:
            holder = json.loads(f.read() or "{}")
    except (OSError, ValueError):
        return {}
    return holder if isinstance(holder, dict) else {}


def held_by_us(holder: dict) -> bool:
    """The holder is this process, or the ``mfu-lab run`` whose notebook this kernel executes (its run id, on
    this host, is the one the runner handed down in ``MFU_LAB_RUN_ID``)."""
    if holder.get("host") != platform.node():
        return False
    if holder.get("pid") == os.getpid():
        return True
    rid = run_id_from_env()
    return rid is not None and holder.get("run") == rid


def busy_message(job_root: Path, step: str, holder: dict) -> str:
    who = (f"run {holder.get('run', '?')} (pid {holder.get('pid', '?')} on {holder.get('host', '?')}, "
           f"since {holder.get('since', '?')})")
    return (f"step {step} cannot measure now: the job's folder {job_root} is in use by {who}. Measuring alongside "
            "it would spoil both measurements on a shared device, and the last to finish would overwrite the "
            f"other's result.json. Wait for it to finish, or stop it (pid {holder.get('pid', '?')}), then run the "
            "step again.")


@contextlib.contextmanager
def holding(job_root: Path, step: str) -> Iterator[None]:
    """Hold the job's folder for ``step`` until the block ends (see the module's docstring); :class:`JobBusy`
    naming the folder and the holder when another process holds it."""
    job_root = Path(job_root)
    key = job_root.resolve()
    with _GUARD:
        nested = _HELD.get(key, 0) > 0
        if nested:
            _HELD[key] += 1
    if nested:
        try:
            yield
        finally:
            with _GUARD:
                _HELD[key] -= 1
        return
    with contextlib.ExitStack() as stack:
        label = run_id_from_env() or f"of step {step} from a notebook or script"
        try:
            stack.enter_context(job_lock(job_root, label))
        except JobBusy:
            holder = lock_holder(job_root)
            if not held_by_us(holder):
                raise JobBusy(busy_message(job_root, step, holder)) from None
        with _GUARD:
            _HELD[key] = _HELD.get(key, 0) + 1
        try:
            yield
        finally:
            with _GUARD:
                _HELD[key] -= 1
                if not _HELD[key]:
                    del _HELD[key]


def holds_job(step: str):
    """Decorate a step's ``run(job, progress=None, write=True, ...)``: with ``write`` (the default) it holds the
    job's folder for as long as it runs (:func:`holding`), refused at once while another process holds it; with
    ``write=False`` it writes nothing and takes no lock. A function without a ``write`` parameter is no step's
    ``run`` and is returned as it is."""

    def wrap(fn):
        sig = inspect.signature(fn)
        if "write" not in sig.parameters:
            return fn  # not a step's run (it writes nothing the contract's way): nothing to hold

        @functools.wraps(fn)
        def run(*args, **kwargs):
            try:
                bound = sig.bind(*args, **kwargs)
            except TypeError:
                return fn(*args, **kwargs)  # the step's own TypeError, as without the decorator
            job = bound.arguments.get("job")
            write = bound.arguments.get("write", sig.parameters["write"].default)
            if not write or job is None:
                return fn(*args, **kwargs)
            with holding(job.output_root(), step):
                return fn(*args, **kwargs)

        return run

    return wrap
