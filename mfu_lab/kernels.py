"""The step notebooks' kernels: one notebook executed through papermill (:func:`execute_notebook`), its kernel's
connection file kept in the job's folder (:func:`kernel_files_in`), its printed lines streamed, indented.

A kernel and every process it starts end with the call (:mod:`mfu_lab.core.process.procs`). jupyter_client picks
the kernel's ports as free ones and the kernel binds them a moment later: another process can take one between the
two (``ZMQError: Address already in use``, seen once in a CI run beside the suite's other worker), and the kernel
dies before its first reply with no cell run. Such a start is tried again (:data:`KERNEL_START_TRIES`), and said.
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from mfu_lab.core.process import procs, quick_imports

KERNEL_START_TRIES = 3
NOT_STARTED = "Kernel died before replying to kernel_info"  # jupyter_client's words when a kernel never answered

KERNEL_FILES = ".kernels"
# The kernel's own log (its transport warning at every start, ZMQ tracebacks when Ctrl-C reaches it) is plumbing,
# not the step's: a cell's error is in the executed notebook and its report, and the runner says what failed.
QUIET_KERNEL = ["--IPKernelApp.log_level=CRITICAL"]


@contextmanager
def kernel_files_in(folder: Path) -> Iterator[Path]:
    """Keep the notebook kernel's connection file (its ports and key, which jupyter_client writes with
    ``tempfile.mkstemp``) in the job's own folder rather than the machine's temp folder, and remove it after.
    A killed run leaves its file there; the next run of the job (holding the job's lock, so no other kernel of
    this job is alive) removes it first."""
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    before, tempfile.tempdir = tempfile.tempdir, str(folder)
    try:
        yield folder
    finally:
        tempfile.tempdir = before
        shutil.rmtree(folder, ignore_errors=True)


class _Indented:
    """A text stream that indents every line written through it (notebook output inside CLI output)."""

    def __init__(self, stream):
        self.stream, self.at_line_start = stream, True

    def write(self, text: str) -> None:
        for ch in text:
            if self.at_line_start and ch != "\n":
                self.stream.write("    ")
            self.stream.write(ch)
            self.at_line_start = ch == "\n"

    def flush(self) -> None:
        self.stream.flush()


def execute_notebook(src: Path, out: Path, params: dict, cwd: Path, quiet: bool, timeout: float | None = None) -> None:
    """One notebook through papermill, its printed lines streamed (indented) unless ``quiet``. Its kernel, and so
    every process the kernel starts, ends with this call however it ends (``procs``: SIGTERM is taken as Ctrl-C,
    and a kill of this process ends the kernel through its PDEATHSIG). A kernel that
    dies before its first reply is started again, up to :data:`KERNEL_START_TRIES` times in all, and said."""
    quick_imports.notebook_libraries()
    import papermill as pm  # lazy: over a second to import; `mfu-lab --help`, `validate`, `step` do without it

    # shutdown_kernel="immediate": the kernel is killed once its last cell has finished instead of being asked to
    # exit, which took 2.7 s a notebook (the interpreter's finalisation with torch and matplotlib loaded, 2-core AMD
    # EPYC). Every output has arrived by then and no step leaves work for exit: its result, notebook and processes
    # are done (procs ends any child with the kernel, as on any other kill).
    for attempt in range(1, KERNEL_START_TRIES + 1):
        try:
            with procs.interrupt_on_sigterm(), procs.group():
                pm.execute_notebook(str(src), str(out), parameters=params, progress_bar=False, cwd=str(cwd),
                                    kernel_name="python3", stdout_file=None if quiet else _Indented(sys.stdout),
                                    execution_timeout=timeout, extra_arguments=QUIET_KERNEL,
                                    kernel_manager_class=procs.kernel_manager_class(), shutdown_kernel="immediate")
            return
        except RuntimeError as e:  # no cell has run: the kernel died before its first reply
            if NOT_STARTED not in str(e) or attempt == KERNEL_START_TRIES:
                raise
            print(f"    the notebook's kernel died before its first reply ({NOT_STARTED}; another process may have "
                  f"taken one of its ports): starting it again ({attempt + 1} of {KERNEL_START_TRIES})",
                  file=sys.stderr, flush=True)
