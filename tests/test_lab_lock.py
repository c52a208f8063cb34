"""A step holds its job's folder while it measures (issue 32, item 8): a lab notebook's ``run(job)`` is refused at
once while another process (``mfu-lab run``) holds the job, naming the folder and the holder; the runner's own
notebooks (its run id in the environment) and ``mfu-lab step`` (the same process) go on; the lock goes when the
step returns or raises; nested calls do not deadlock; ``write=False`` takes no lock.

``mfu-lab lab`` with its port taken (issue 32, item 12): the hint names the port JupyterLab is given; without
JupyterLab the command says so before anything about starting."""

import dataclasses
import os
import socket
import subprocess
import sys

import pytest

from mfu_lab import lab
from mfu_lab.cli import main
from mfu_lab.core.job.schema import Job
from mfu_lab.core.process import faults
from mfu_lab.core.registry import STEPS
from mfu_lab.core.store.history import RUN_ENV
from mfu_lab.core.store.runstate import JobBusy, job_lock
from mfu_lab.core.store.steplock import lock_holder

from .conftest import ROOT, TINY

OTHER_RUN = "20261202-000000"
HOLD = ("import sys, time\nfrom pathlib import Path\nfrom mfu_lab.core.store.runstate import job_lock\n"
        "with job_lock(Path(sys.argv[1]), sys.argv[2]):\n    print('held', flush=True)\n    time.sleep(120)\n")


@pytest.fixture
def job(tmp_path) -> Job:
    return Job(out_dir=str(tmp_path / "out"), job_name="locked")


@pytest.fixture(scope="module")
def held(tmp_path_factory):
    """A job whose folder another process holds, as ``mfu-lab run`` does: (job, that process)."""
    job = Job(out_dir=str(tmp_path_factory.mktemp("held")), job_name="busy")
    p = subprocess.Popen([sys.executable, "-c", HOLD, str(job.output_root()), OTHER_RUN], cwd=ROOT,
                         stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "held"
        yield job, p
    finally:
        p.kill()
        p.wait()
        p.stdout.close()


def fake_step(body=lambda job: "measured"):
    """A step's run as the steps carry it (``faults.guarded``), its measuring replaced by ``body``."""

    @faults.guarded("demo")
    def run(job, progress=None, write=True):
        return body(job)

    return run


@pytest.mark.parametrize("info", STEPS, ids=lambda s: s.key)
def test_every_step_is_refused_at_once_while_another_run_holds_the_job(held, info, monkeypatch):
    monkeypatch.delenv(RUN_ENV, raising=False)
    job, p = held
    with pytest.raises(JobBusy) as e:
        info.load().run(job)  # refused before it measures anything: no model built, nothing written
    msg = str(e.value)
    assert f"step {info.key} cannot measure now" in msg and str(job.output_root()) in msg
    assert f"run {OTHER_RUN} (pid {p.pid} on " in msg and "since 20" in msg
    assert "Wait for it to finish, or stop it" in msg and "result.json" in msg
    assert not (job.output_root() / info.folder).exists()


def test_the_runners_own_notebook_goes_on_and_another_run_id_does_not(held, monkeypatch):
    job, _ = held
    monkeypatch.setenv(RUN_ENV, OTHER_RUN)  # what `mfu-lab run` hands its notebooks' kernels
    assert fake_step()(job) == "measured"
    monkeypatch.setenv(RUN_ENV, "20261202-000001")
    with pytest.raises(JobBusy, match=f"in use by run {OTHER_RUN}"):
        fake_step()(job)


def test_write_false_measures_without_the_lock(held, monkeypatch):
    monkeypatch.delenv(RUN_ENV, raising=False)
    job, _ = held
    assert fake_step()(job, write=False) == "measured"
    assert fake_step()(job, None, False) == "measured"


def test_the_step_holds_the_job_while_it_runs_and_lets_go_after(job, monkeypatch):
    monkeypatch.delenv(RUN_ENV, raising=False)
    root = job.output_root()

    def body(job):
        assert lock_holder(root)["pid"] == os.getpid()
        with pytest.raises(JobBusy, match="in use by run of step demo from a notebook or script"):
            with job_lock(root, "20261202-000002"):  # what `mfu-lab run` meets meanwhile
                pass
        return "measured"

    assert fake_step(body)(job) == "measured"
    with job_lock(root, "20261202-000003"):  # let go after it returned
        pass

    def fails(job):
        raise ValueError("broken model")

    with pytest.raises(ValueError, match="broken model"):
        fake_step(fails)(job)
    with job_lock(root, "20261202-000004"):  # and after it raised
        pass


def test_nested_steps_and_mfu_lab_step_do_not_deadlock(job, monkeypatch):
    monkeypatch.delenv(RUN_ENV, raising=False)
    root = job.output_root()
    inner = fake_step(lambda job: "inner")
    assert fake_step(lambda job: inner(job) + inner(job))(job) == "innerinner"
    with job_lock(root, "(starting)") as holder:  # `mfu-lab step`: the step runs in the process holding the job
        holder("20261202-000005")
        assert fake_step()(job) == "measured"
    with job_lock(root, "20261202-000006"):  # nothing left held
        pass


def test_a_function_without_write_is_no_step_and_takes_no_lock(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)

    @faults.guarded("demo")
    def run(job):
        return "ran"

    job = dataclasses.replace(Job(), out_dir=str(tmp_path / "o"))
    assert run(job) == "ran" and not (tmp_path / "o").exists()


@pytest.fixture
def taken_port():
    """A port something else listens on (as another JupyterLab would)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


def test_a_taken_port_moves_the_lab_and_the_hint_names_the_port_it_gets(tmp_path, taken_port, monkeypatch, capsys):
    started = []
    monkeypatch.setattr(lab, "start", lambda cmd, env: started.append(cmd) or 0)  # no JupyterLab started here
    assert not lab.port_free(taken_port)
    assert main(["lab", str(TINY), "--out", str(tmp_path), "--port", str(taken_port)]) == 0
    out = capsys.readouterr().out
    used = next(int(a.split("=")[1]) for a in started[0] if a.startswith("--port="))
    assert used > taken_port and "--ServerApp.port_retries=0" in started[0]  # exactly there, or not at all
    assert f"port {taken_port} is taken: JupyterLab gets port {used}" in out
    assert f"like http://localhost:{used}/lab/tree/" in out and f"localhost:{taken_port}/" not in out
    assert "starting JupyterLab" in out


def test_a_free_port_is_kept_and_named(tmp_path, monkeypatch, capsys):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    started = []
    monkeypatch.setattr(lab, "start", lambda cmd, env: started.append(cmd) or 0)
    assert main(["lab", str(TINY), "--out", str(tmp_path), "--port", str(port)]) == 0
    out = capsys.readouterr().out
    assert f"--port={port}" in started[0] and "is taken" not in out and f"like http://localhost:{port}/lab" in out


def test_without_jupyterlab_the_error_comes_first_and_nothing_says_starting(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(lab, "jupyterlab_installed", lambda: False)
    assert main(["lab", str(TINY), "--out", str(tmp_path)]) != 0
    out, err = capsys.readouterr()
    assert "starting" not in out.lower() and "JupyterLab is not installed here: pip install jupyterlab" in err
    assert (tmp_path / "tiny" / "lab" / STEPS[0].notebook).is_file()  # the lab is prepared all the same
    assert main(["lab", str(TINY), "--out", str(tmp_path), "--prepare-only"]) == 0  # prepare-only: a note, no error
    out = capsys.readouterr().out
    assert "JupyterLab is not installed here" in out and "prepared only" in out and "starting" not in out.lower()
