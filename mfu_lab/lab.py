"""A lab per job: the job's own copy of the step notebooks, for stepping through it in JupyterLab.

``mfu-lab lab JOB.yaml`` copies the step notebooks (``01_*`` to ``07_*``, and ``00_monitor`` when the job names
its monitor's folder) into ``outputs/<job>/lab/`` with the job's parameters injected the way ``mfu-lab run``
injects them (papermill's ``injected-parameters`` cell), without running them, then starts JupyterLab there. The
committed notebooks in ``notebooks/`` are only read: JupyterLab's autosave writes into the lab, never into the
checkout. A lab notebook that exists is the user's work and is kept unless ``--fresh`` asks for new copies.

Results land where ``mfu-lab run`` puts them (``outputs/<job>/NN_step/``): the injected ``out_dir`` is absolute,
and a relative ``cluster`` or ``monitor_dir`` that would point elsewhere from the lab folder (a notebook's kernel
starts in the notebook's folder; the runner's in the workbook root) is injected as the absolute path it has here.
"""

from __future__ import annotations

import errno
import json
import os
import shlex
import signal
import socket
import sys
from dataclasses import dataclass, field
from importlib.util import find_spec
from pathlib import Path

from mfu_lab.core.errors import MfuLabError
from mfu_lab.core.job.overrides import OVERRIDES_ENV
from mfu_lab.core.job.paths import find_workbook_root, workbook_file
from mfu_lab.core.job.schema import Job
from mfu_lab.core.process import procs, quick_imports
from mfu_lab.core.registry import STEPS
from mfu_lab.core.store.files import mark_job_root, refuse_links

LAB = "lab"  # the lab's folder inside the job's output folder
MONITOR_NOTEBOOK = "00_monitor.ipynb"
ROOT_NOTE = "running as root: JupyterLab needs --allow-root, added"
DEFAULT_PORT = 8888  # JupyterLab's own default; taken, the lab starts it on the next free port (pick_port)
PORT_TRIES = 50  # ports tried from the one wanted (JupyterLab's own port_retries)


def lab_folder(job: Job) -> Path:
    """``outputs/<job>/lab``: where the job's lab notebooks live."""
    return job.output_root() / LAB


def step_parameters(job: Job, lab: Path | None = None) -> dict:
    """The parameters a step notebook gets: those ``mfu-lab run`` injects (the job, with ``out_dir`` absolute),
    and ``cluster`` / ``monitor_dir`` made absolute where the lab folder's kernel would read them elsewhere."""
    params = job.to_dict() | {"out_dir": str(job.output_root().parent)}
    there = find_workbook_root(lab or lab_folder(job))
    for key, where in (("cluster", job.cluster_path), ("monitor_dir", job.monitor_path)):
        here = where()
        if params.get(key) and here is not None and here != where(there):
            params[key] = str(here)
    return params


def lab_notebooks(job: Job) -> list[tuple[str, Path, dict]]:
    """``(name, source, parameters)`` of each notebook of the job's lab, in order: ``00_monitor`` when the job
    names its monitor's folder (reading it, its summary into ``outputs/<job>/00_monitor``), then every step."""
    out = []
    monitor = job.monitor_path()
    if monitor is not None:
        out.append((MONITOR_NOTEBOOK, workbook_file(Path("notebooks") / MONITOR_NOTEBOOK),
                    {"monitor_dir": str(monitor), "out": str(job.output_root() / Path(MONITOR_NOTEBOOK).stem)}))
    params = step_parameters(job)
    out += [(s.notebook, workbook_file(Path("notebooks") / s.notebook), params) for s in STEPS]
    return out


@dataclass
class Lab:
    """What :func:`prepare_lab` did."""

    folder: Path
    prepared: list[str] = field(default_factory=list)  # new copies
    replaced: list[str] = field(default_factory=list)  # earlier copies replaced (--fresh)
    kept: list[str] = field(default_factory=list)  # earlier copies kept (the user's work)
    differ: dict[str, list[str]] = field(default_factory=dict)  # kept notebook -> parameters that now differ
    unreadable: list[str] = field(default_factory=list)  # kept notebooks whose parameters could not be read

    @property
    def first(self) -> str:
        return next((n for n in (*self.prepared, *self.replaced, *self.kept) if n != MONITOR_NOTEBOOK), "")


def _injected(notebook: Path) -> dict | None:
    """The parameters papermill injected into a lab notebook (its metadata), None when not readable."""
    try:
        params = json.loads(notebook.read_text(encoding="utf-8"))["metadata"]["papermill"]["parameters"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return params if isinstance(params, dict) else None


def _changed(old: dict, new: dict) -> list[str]:
    """``key old -> new`` for each parameter whose value differs."""
    return [f"{k} {old.get(k, '(unset)')!r} -> {new.get(k, '(unset)')!r}" for k in sorted(set(old) | set(new))
            if old.get(k) != new.get(k)]


def prepare_lab(job: Job, fresh: bool = False) -> Lab:
    """Write the job's lab notebooks into :func:`lab_folder`: each committed notebook with the job's parameters
    injected and nothing executed (papermill ``prepare_only``). An existing lab notebook is kept unless ``fresh``;
    one kept whose injected parameters differ from the job's now is named in ``Lab.differ``."""
    quick_imports.notebook_libraries()
    try:
        import papermill as pm  # lazy: over a second to import
    except ImportError:
        raise MfuLabError("a lab needs papermill to prepare its notebooks: pip install papermill") from None
    notebooks = lab_notebooks(job)
    missing = [str(src) for _, src, _ in notebooks if not src.is_file()]
    if missing:
        raise MfuLabError(f"notebook {missing[0]} not found: this mfu_lab was installed without its notebooks; "
                          "reinstall it from the workbook's source (pip install <checkout>), or run it from the "
                          "checkout")
    lab = Lab(lab_folder(job))
    mark_job_root(job.output_root())  # the workbook's folder: a later run may write into it
    refuse_links(lab.folder, include_self=True)  # <job>/lab a link would carry the notebooks out of the job's folder
    lab.folder.mkdir(parents=True, exist_ok=True)
    for name, src, params in notebooks:
        dst = lab.folder / name
        if dst.exists() and not fresh:
            lab.kept.append(name)
            old = _injected(dst)
            if old is None:
                lab.unreadable.append(name)
            elif changed := _changed(old, json.loads(json.dumps(params))):  # as the notebook's metadata holds it
                lab.differ[name] = changed
            continue
        (lab.replaced if dst.exists() else lab.prepared).append(name)
        part = lab.folder / f".{Path(name).stem}.partial.ipynb"  # hidden in JupyterLab; replaced in one move
        try:
            pm.execute_notebook(str(src), str(part), parameters=params, prepare_only=True, progress_bar=False,
                                kernel_name="python3")
            os.replace(part, dst)
        finally:
            part.unlink(missing_ok=True)
    return lab


def running_as_root() -> bool:
    return hasattr(os, "geteuid") and os.geteuid() == 0


def jupyterlab_installed() -> bool:
    return find_spec("jupyterlab") is not None


def wanted_port(asked: int | None = None) -> int:
    """The port JupyterLab is wanted on: ``asked`` (``--port``), else ``$JUPYTER_PORT`` (JupyterLab's own), else
    8888."""
    env = os.environ.get("JUPYTER_PORT", "")
    return asked or (int(env) if env.isdigit() and 0 < int(env) < 65536 else DEFAULT_PORT)


def port_free(port: int, host: str = "localhost") -> bool:
    """Whether JupyterLab could listen on ``port`` now: every address of ``host`` bound as it binds them
    (``SO_REUSEADDR``, so a port left only in TIME_WAIT is free; an IPv6 address the host lacks is skipped)."""
    try:
        addrs = {(a[0], a[1], a[4]) for a in socket.getaddrinfo(host, port, socket.AF_UNSPEC, socket.SOCK_STREAM,
                                                                0, socket.AI_PASSIVE)}
    except OSError:
        addrs = {(socket.AF_INET, socket.SOCK_STREAM, ("127.0.0.1", port))}
    for family, kind, addr in addrs:
        with socket.socket(family, kind) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                s.bind(addr)
            except OSError as e:
                if family == socket.AF_INET6 and e.errno == errno.EADDRNOTAVAIL:
                    continue
                return False
    return True


def pick_port(asked: int | None = None) -> int:
    """The port JupyterLab starts on: the wanted one (:func:`wanted_port`), or when it is taken the next free one
    above it. The lab then starts JupyterLab on exactly that port (``--ServerApp.port_retries=0``), so the address
    it prints is the one JupyterLab listens on."""
    first = wanted_port(asked)
    for port in range(first, min(first + PORT_TRIES, 65536)):
        if port_free(port):
            return port
    raise MfuLabError(f"no free port for JupyterLab from {first} to {min(first + PORT_TRIES, 65536) - 1}: free one, "
                      "or name another with --port")


def lab_command(folder: Path, port: int | None = None, browser: bool = True, *extra: str) -> list[str]:
    """The command that starts JupyterLab on the lab ``folder``; ``--allow-root`` when this process is root
    (JupyterLab refuses to start as root without it). A ``port`` is kept to (``--ServerApp.port_retries=0``: no
    moving on to another port, which the address the lab prints would not name)."""
    cmd = [sys.executable, "-m", "jupyter", "lab", f"--ServerApp.root_dir={folder}"]
    if port is not None:
        cmd += [f"--port={port}", "--ServerApp.port_retries=0"]
    if not browser:
        cmd.append("--no-browser")
    if running_as_root():
        cmd.append("--allow-root")
    return cmd + list(extra)


def kernel_env(job: Job, folder: Path, overrides: dict | None = None) -> dict[str, str]:
    """Environment the lab's kernels need beyond this one's: the command line's ``-p`` overrides
    (``MFU_LAB_OVERRIDES``, as under ``mfu-lab run``: each step's result records them, so the index and the reports
    show them beside the figures); and a ``module:function`` model is imported from the workbook root, which a
    kernel started in a lab outside the checkout does not see."""
    env = {}
    kept = {k: v for k, v in (overrides or {}).items() if k != "out_dir"}
    if kept:
        env[OVERRIDES_ENV] = json.dumps(kept, default=str)
    root = find_workbook_root()
    if ":" in job.model and find_workbook_root(folder) != root:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(root), os.environ.get("PYTHONPATH", "")) if p)
    return env


def shell_line(cmd: list[str], env: dict[str, str]) -> str:
    """``cmd`` (with ``env`` set before it) as one line a POSIX shell runs."""
    return " ".join([f"{k}={shlex.quote(v)}" for k, v in env.items()] + [shlex.join(cmd)])


def describe(job: Job, source: str, lab: Lab, cmd: list[str], env: dict[str, str], port: int | None,
             start: bool, asked: int | None = None) -> list[str]:
    """What ``mfu-lab lab`` says: the folder, what was prepared and kept, where results land, how to start.
    ``port``: the one JupyterLab gets (:func:`pick_port`), ``asked`` the one ``--port`` asked for. Without
    JupyterLab nothing is said about starting it: :func:`start` says it is missing."""
    lines = [f"mfu-lab: lab for job '{job.job_name}' from {source}: {lab.folder}"]
    if lab.prepared:
        lines.append(f"  prepared (parameters injected, not run): {', '.join(lab.prepared)}")
    if lab.replaced:
        lines.append(f"  prepared afresh (--fresh; the earlier copies replaced): {', '.join(lab.replaced)}")
    if lab.kept:
        lines.append(f"  kept as they were (your work; --fresh replaces them): {', '.join(lab.kept)}")
    groups: dict[tuple[str, ...], list[str]] = {}  # the same change in several notebooks: said once
    for name, changed in lab.differ.items():
        groups.setdefault(tuple(changed), []).append(name)
    for changed, names in groups.items():
        shown = "; ".join(changed[:4]) + (f"; and {len(changed) - 4} more" if len(changed) > 4 else "")
        lines.append(f"  note: kept {', '.join(names)} {'was' if len(names) == 1 else 'were'} prepared with other "
                     f"parameters than the job's now ({shown}) and run{'s' if len(names) == 1 else ''} with "
                     "those; --fresh prepares new copies with the job's")
    for name in lab.unreadable:
        lines.append(f"  note: {name} has no parameters papermill injected (not prepared by mfu-lab lab?): kept")
    lines.append(f"  results land in {job.output_root()}/NN_step/, as with mfu-lab run; "
                 f"the summary page: {job.output_root() / 'index.html'}")
    if "--allow-root" in cmd:
        lines.append(f"mfu-lab: {ROOT_NOTE}")
    url = f"http://localhost:{port or wanted_port()}/lab/tree/{lab.first}"
    if start:  # nothing said about starting a JupyterLab that is not there: start() says it is missing
        if not jupyterlab_installed():
            return lines
        if port is not None and port != wanted_port(asked):
            lines.append(f"mfu-lab: port {wanted_port(asked)} is taken: JupyterLab gets port {port}")
        lines.append(f"mfu-lab: starting JupyterLab in {lab.folder}; open the address with the token it prints "
                     f"below (like {url}), run the cells top to bottom; Ctrl-C twice stops it")
    else:
        if not jupyterlab_installed():
            lines.append("mfu-lab: JupyterLab is not installed here: pip install jupyterlab")
        lines.append("mfu-lab: prepared only; to start JupyterLab on the lab:")
        lines.append(f"  {shell_line(cmd, env)}")
        lines.append(f"  then open the address with the token it prints (like {url})")
    return lines


def start(cmd: list[str], env: dict[str, str]) -> int:
    """Run JupyterLab until it stops; its exit status. Ctrl-C is JupyterLab's to answer (it asks, or stops on
    a second one), so this process waits on through it. JupyterLab stays in this process's group (Ctrl-C reaches
    it) and gets SIGTERM, on which it shuts its kernels down, when this process ends, however it ends (procs)."""
    if not jupyterlab_installed():
        raise MfuLabError("JupyterLab is not installed here: pip install jupyterlab (the lab's notebooks are "
                          "prepared; mfu-lab lab starts it once it is there)")
    with procs.group():
        proc = procs.popen(cmd, env={**os.environ, **env}, new_session=False, death_signal=signal.SIGTERM,
                           grace_s=10.0)
        while True:
            try:
                return proc.wait()
            except KeyboardInterrupt:
                continue
