"""No process outlives the run (issue 32, item 1): every place that starts processes, killed in the middle by
SIGINT, SIGTERM or SIGKILL, leaves no child or grandchild running.

Each test starts a "parent" (a small Python program standing for ``mfu-lab run``, a notebook kernel or a step),
waits until every process below it has said it is up, takes the tree of its descendants from ``/proc``, signals
the parent and waits (bounded) for the whole tree to be gone. A test that fails still ends what it started (the
``tree`` fixture). Where the real child is not the point, a stand-in takes its place: ``sys.executable`` set to a
shell script that writes its pid and ``exec``s ``sleep`` (same pid, PDEATHSIG kept); torchrun is real.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from mfu_lab.core.process import procs

pytestmark = pytest.mark.skipif(not procs.HAS_PDEATHSIG, reason="PDEATHSIG (prctl) is Linux's")

ROOT = Path(__file__).resolve().parents[1]
# procs.py imports nothing of mfu_lab: loading it by path spares a process the package's (torch's) import time
LOAD_PROCS = ("import importlib.util as _u; _s = _u.spec_from_file_location('procs', {!r}); procs = "
              "_u.module_from_spec(_s); _s.loader.exec_module(procs)").format(
                  str(ROOT / "mfu_lab/core/process/procs.py"))
PRELUDE = ("import signal, sys, time; from pathlib import Path; "
           "signal.signal(signal.SIGINT, signal.default_int_handler)\n")  # a background pytest ignores SIGINT
UP_S = 120.0  # bound on a start-up (imports of torch, a kernel, torchrun's rendezvous on 2 busy cores)
GONE_S = 30.0  # bound on the end of a tree: PDEATHSIG is at once; torchrun takes a few seconds to end its ranks


def _stat(pid: int) -> tuple[str, str] | None:
    """(state, start time) of a process from /proc, None when there is none."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_bytes().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return fields[0].decode(), fields[19].decode()


def _descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                ppid = int(d.joinpath("stat").read_bytes().rsplit(b")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(d.name))
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


class Tree:
    """A parent program and the processes below it, each known by (pid, start time) so a reused pid is not it."""

    def __init__(self, tmp: Path):
        self.tmp, self.pids = tmp, tmp / "pids"
        self.pids.mkdir()
        self.parent: subprocess.Popen | None = None
        self.known: dict[int, str] = {}
        self.stand_in = tmp / "stand_in.sh"
        self.stand_in.write_text(f'#!/bin/sh\necho "$*" > {self.pids}/$$\nexec sleep 600\n')
        self.stand_in.chmod(0o755)

    def start(self, code: str) -> None:
        self.log = open(self.tmp / "parent.log", "w")  # noqa: SIM115 - closed in end()
        env = {**os.environ, "PIDS": str(self.pids), "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
        # a session of its own (a JupyterLab stand-in in its group stays out of pytest's), dying with pytest
        self.parent = procs.popen([sys.executable, "-c", PRELUDE + textwrap.dedent(code)], cwd=ROOT, env=env,
                                  stdout=self.log, stderr=subprocess.STDOUT)

    def up(self, count: int) -> list[int]:
        """Wait until ``count`` processes have written their pid; the parent's descendants then."""
        deadline = time.monotonic() + UP_S
        while len(list(self.pids.iterdir())) < count:
            if self.parent.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"not up ({len(list(self.pids.iterdir()))} of {count}): "
                            + (self.tmp / "parent.log").read_text()[-3000:])
            time.sleep(0.05)
        below = _descendants(self.parent.pid)
        self.known = {pid: st[1] for pid in below if (st := _stat(pid))}
        assert {int(p.name) for p in self.pids.iterdir() if p.name.isdigit()} <= set(self.known)
        return below

    def alive(self) -> list[int]:
        return [pid for pid, t in self.known.items() if (st := _stat(pid)) and st[1] == t and st[0] not in "ZX"]

    def kill_parent(self, sig: int) -> None:
        os.kill(self.parent.pid, sig)
        self.parent.wait(timeout=GONE_S)

    def assert_none_left(self) -> None:
        deadline = time.monotonic() + GONE_S
        while (left := self.alive()) and time.monotonic() < deadline:
            time.sleep(0.05)
        cmd = {p: Path(f"/proc/{p}/cmdline").read_bytes().replace(b"\0", b" ")[:200] for p in left}
        assert not left, f"still running after the parent ended: {cmd}"

    def end(self) -> None:
        """Whatever the test saw or left: every process below the parent, then the parent."""
        if self.parent is None:
            return
        if self.parent.poll() is None:
            for pid in _descendants(self.parent.pid):
                self.known.setdefault(pid, (_stat(pid) or ("", ""))[1])
        for pid in self.alive():
            os.kill(pid, signal.SIGKILL)
        procs.kill(self.parent)
        self.log.close()


@pytest.fixture
def tree(tmp_path):
    t = Tree(tmp_path)
    yield t
    t.end()


SIGNALS = [signal.SIGKILL, signal.SIGTERM, signal.SIGINT]


# ------------------------------------------------------------------ the helper itself
@pytest.mark.parametrize("sig", SIGNALS, ids=lambda s: s.name)
def test_a_chain_of_children_dies_with_its_killed_parent(tree, sig):
    """parent -> child -> grandchild, each started by procs.popen in a session of its own: whichever way the
    parent ends (SIGTERM taken as Ctrl-C), nothing below it runs on."""
    child = PRELUDE + LOAD_PROCS + f"\nimport os\nprocs.popen([{str(tree.stand_in)!r}, 'grandchild'])\n" \
        "(Path(os.environ['PIDS']) / str(os.getpid())).write_text('child')\ntime.sleep(600)\n"
    tree.start(LOAD_PROCS + f"""
with procs.interrupt_on_sigterm(), procs.group():
    procs.popen([sys.executable, "-c", {child!r}])
    time.sleep(600)
""")
    assert len(tree.up(2)) == 2
    tree.kill_parent(sig)
    tree.assert_none_left()


def test_a_group_ends_its_processes_on_success_and_on_error():
    with procs.group() as g:
        ok = g.popen(["sleep", "600"])
    assert ok.returncode == -signal.SIGKILL
    with pytest.raises(ZeroDivisionError), procs.group():
        bad = procs.popen(["sleep", "600"])
        1 / 0  # noqa: B018
    assert bad.returncode == -signal.SIGKILL


def test_a_child_started_from_a_thread_that_ends_lives_on_until_its_group_ends():
    """PDEATHSIG follows the thread that forked: procs.popen forks on a thread that lives as long as the process."""
    box = []
    with procs.group() as g:
        t = threading.Thread(target=lambda: box.append(g.popen(["sleep", "600"])))
        t.start()
        t.join()
        time.sleep(0.2)  # a death signal on the thread's exit would have landed by now
        assert box[0].poll() is None
    assert box[0].returncode == -signal.SIGKILL


def test_kill_sends_sigterm_then_sigkill_to_the_group_and_a_second_interrupt_still_kills():
    p = procs.popen([sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                     "print(1, flush=True); time.sleep(600)"], grace_s=0.5, stdout=subprocess.PIPE)
    p.stdout.readline()  # its handler is in place
    assert procs.kill(p) == -signal.SIGKILL
    p.stdout.close()


def test_die_with_parent_in_a_process_we_did_not_start(tree):
    """A rank torchrun started calls die_with_parent(): SIGKILL of its parent ends it."""
    child = PRELUDE + LOAD_PROCS + "\nimport os\nprocs.die_with_parent()\n" \
        "(Path(os.environ['PIDS']) / str(os.getpid())).write_text('x')\ntime.sleep(600)\n"
    tree.start(f"import subprocess\nsubprocess.Popen([sys.executable, '-c', {child!r}], start_new_session=True)\n"
               "time.sleep(600)\n")
    tree.up(1)
    tree.kill_parent(signal.SIGKILL)
    tree.assert_none_left()


# ------------------------------------------------------------------ every place that starts processes
# Each place: (the parent's program, how many processes write their pid, the signal its parent gets). They run at
# once (their start-ups overlap), each in a tree of its own; every signal meets a real place.
JOB = "from mfu_lab.core.job.schema import load_job; job = load_job('tests/data/tiny.yaml')\n"


def _launch(t: Tree) -> str:
    """workers.launch: a real torchrun of two tiny ranks (which call die_with_parent, as ddp_rank does)."""
    rank = t.tmp / "rank.py"
    rank.write_text(PRELUDE + LOAD_PROCS + "\nprocs.die_with_parent()\nimport os\n"
                    "(Path(os.environ['PIDS']) / str(os.getpid())).write_text('rank')\ntime.sleep(600)\n")
    return JOB + f"""
from mfu_lab.workers import launch as L
L._torchrun_cmd = lambda job, nnodes, nproc, log_dir, spec: [sys.executable, "-m", "torch.distributed.run",
    "--standalone", "--nproc_per_node=2", f"--log-dir={{log_dir}}", "--redirects=3", {str(rank)!r}]
L.launch(job, {{}}, Path({str(t.tmp / 'work')!r}), 0, 1, 2)
"""


def _compile(t: Tree) -> str:
    return f"""
from mfu_lab.steps.compile import step as c
sys.executable = {str(t.stand_in)!r}
c.run_worker({{"label": "eager", "mode": "eager"}}, Path({str(t.tmp / 'work')!r}), Path("cache"), 600, print)
"""


def _rungs(t: Tree) -> str:
    """Two verify rungs; SIGTERM taken as Ctrl-C: close() ends them at once, without its 10 s wait for "quit"."""
    return f"""
from mfu_lab.core.process import procs
from mfu_lab.workers.verify_rung import RungProcess
sys.executable = {str(t.stand_in)!r}
with procs.interrupt_on_sigterm():
    rungs = [RungProcess({{"rung": n, "job": {{}}, "steps_total": 1}}, Path({str(t.tmp / 'work')!r}), 600)
             for n in "ab"]
    try:
        rungs[0].ready()  # a stand-in never answers
    finally:
        for r in rungs:
            r.close()
"""


def _coloc(t: Tree) -> str:
    return JOB + f"""
from mfu_lab.steps.placement import coloc as pc
sys.executable = {str(t.stand_in)!r}
pc.colocate(job, Path({str(t.tmp / 'work')!r}), "cpu", print)
"""


def _kernel(t: Tree) -> str:
    """runner.execute_notebook (how mfu-lab run executes a notebook): the kernel dies with it, the kernel's child with
    the kernel."""
    import nbformat

    cell = LOAD_PROCS + f"\nimport os\nprocs.popen([{str(t.stand_in)!r}, 'trial'])\n" \
        "(Path(os.environ['PIDS']) / str(os.getpid())).write_text('kernel')\ntime.sleep(600)\n"
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(PRELUDE + cell)])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nb, str(t.tmp / "in.ipynb"))
    return f"""
from mfu_lab import runner
runner.execute_notebook(Path({str(t.tmp / 'in.ipynb')!r}), Path({str(t.tmp / 'out.ipynb')!r}), {{}},
                         Path({str(t.tmp)!r}), quiet=True)
"""


def _lab(t: Tree) -> str:
    """mfu-lab lab: JupyterLab (a stand-in) stays in the parent's group, and gets SIGTERM when it dies."""
    return f"from mfu_lab import lab\nlab.start([{str(t.stand_in)!r}, 'jupyter-lab'], {{}})\n"


PLACES = {  # name: (program, processes that say they are up, signal to the parent, processes below it)
    "torchrun and its ranks (workers.launch)": (_launch, 2, signal.SIGKILL, 3),
    "compile trial (steps.compile.step)": (_compile, 1, signal.SIGTERM, 1),  # a kernel's default: it just ends
    "verify rungs (workers.verify_rung)": (_rungs, 2, signal.SIGTERM, 2),
    "co-located copies (steps.placement.coloc)": (_coloc, 1, signal.SIGINT, 1),
    "kernel and its child (runner), SIGKILL": (_kernel, 2, signal.SIGKILL, 2),
    "kernel and its child (runner), SIGTERM": (_kernel, 2, signal.SIGTERM, 2),
    "JupyterLab (lab)": (_lab, 1, signal.SIGKILL, 1),
}


@pytest.fixture
def trees(tmp_path):
    made: dict[str, Tree] = {}
    yield made, tmp_path
    for t in made.values():
        t.end()


def test_every_place_that_starts_processes_leaves_none_when_its_parent_is_killed(trees):
    made, tmp = trees
    for i, (name, (program, _, _, _)) in enumerate(PLACES.items()):
        (tmp / str(i)).mkdir()
        made[name] = t = Tree(tmp / str(i))
        t.start(program(t))
    failed = []
    for name, (_, count, sig, below) in PLACES.items():
        t = made[name]
        try:
            assert len(t.up(count)) == below, f"processes below the parent: {t.known}"
            t0 = time.monotonic()
            t.kill_parent(sig)
            assert time.monotonic() - t0 < 15, "the parent took long to end"
            t.assert_none_left()
        except (AssertionError, pytest.fail.Exception, subprocess.TimeoutExpired) as e:
            failed.append(f"{name} ({sig.name}): {e}")
    assert not failed, "\n".join(failed)


def test_a_started_command_runs_as_the_child_itself_with_no_signal_left_ignored():
    """procs.popen starts its command through a few lines of Python (the parent-death signal, then exec: no
    preexec_fn, whose Python in a forked child can deadlock): the command is the child itself (same pid), and the
    signals Python ignores (SIGPIPE, SIGXFSZ) are not left ignored in it. A shell line goes through /bin/sh."""
    p = procs.popen("echo $$; grep SigIgn /proc/$$/status", shell=True, stdout=subprocess.PIPE, text=True)
    out, _ = p.communicate(timeout=60)
    pid, ign = out.split("\n", 1)
    assert int(pid) == p.pid
    mask = int(ign.split()[1], 16)
    assert not mask & (1 << (signal.SIGPIPE - 1)) and not mask & (1 << (signal.SIGXFSZ - 1)), ign
    with pytest.raises(TypeError, match="one string"):
        procs.popen(["true"], shell=True)


def test_a_kernel_that_dies_before_its_first_reply_is_started_again_and_said(tmp_path, monkeypatch, capsys):
    """jupyter_client picks a kernel's ports and the kernel binds them a moment later: a CI run lost one to another
    process ("Address already in use"), and the kernel died before replying, no cell run. Such a start is tried
    again, up to KERNEL_START_TRIES in all; any other error is raised at once."""
    import papermill

    from mfu_lab import kernels

    calls = []

    def flaky(*a, **kw):
        calls.append(a)
        if len(calls) < kernels.KERNEL_START_TRIES:
            raise RuntimeError(kernels.NOT_STARTED)

    monkeypatch.setattr(papermill, "execute_notebook", flaky)
    kernels.execute_notebook(tmp_path / "in.ipynb", tmp_path / "out.ipynb", {}, tmp_path, quiet=True)
    assert len(calls) == kernels.KERNEL_START_TRIES
    err = capsys.readouterr().err
    assert f"starting it again (2 of {kernels.KERNEL_START_TRIES})" in err and "died before its first reply" in err

    def never(*a, **kw):
        calls.append(a)
        raise RuntimeError(kernels.NOT_STARTED)

    calls.clear()
    monkeypatch.setattr(papermill, "execute_notebook", never)
    with pytest.raises(RuntimeError, match="Kernel died"):  # never started: the last try's error is the run's
        kernels.execute_notebook(tmp_path / "in.ipynb", tmp_path / "out.ipynb", {}, tmp_path, quiet=True)
    assert len(calls) == kernels.KERNEL_START_TRIES

    def other(*a, **kw):
        calls.append(a)
        raise RuntimeError("a cell failed")

    calls.clear()
    monkeypatch.setattr(papermill, "execute_notebook", other)
    with pytest.raises(RuntimeError, match="a cell failed"):
        kernels.execute_notebook(tmp_path / "in.ipynb", tmp_path / "out.ipynb", {}, tmp_path, quiet=True)
    assert len(calls) == 1
