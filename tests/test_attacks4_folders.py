"""Issue 48, the fourth round of attacks: folders and the publish window.

- Medium 3: a run takes over a folder it did not make (or one inside the installed package).
- Medium 4: ``kill -9`` inside the publish window leaves a half-published set.
- Medium 5: ``mfu-lab report`` exports a running or interrupted step's notebook over its published report.
- Medium 9: a link at ``<job>/lab`` carries the lab's notebooks out of the job's folder.

The steps here are fakes that save a result (the bracket, the staging, the publication and the commands are the
real ones); the kill runs in a process of its own, since a kill is what is tested.
"""

import dataclasses
import json
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import mfu_lab
from mfu_lab import publish, runner
from mfu_lab.core.registry import BY_KEY
from mfu_lab.core.store import step_results as store
from mfu_lab.core.store.files import JOB_MARKER, PlantedLink, mark_job_root, read_json, write_json_atomic
from mfu_lab.core.store.history import load_history
from mfu_lab.core.store.results import source_digest
from mfu_lab.core.store.runstate import RUNNING_FILE, step_state
from mfu_lab.core.store.staging import JOURNAL

from .conftest import ROOT, TINY, in_process
from .test_publish import fake_export, result  # one stored result and a report without nbconvert

INFO = BY_KEY["baseline"]
NOTEBOOK = ROOT / "notebooks" / INFO.notebook




def tree(folder: Path) -> dict[str, bytes | None]:
    """Every file and folder below ``folder``: its bytes (None for a folder)."""
    return {str(p.relative_to(folder)): None if p.is_dir() else p.read_bytes() for p in sorted(folder.rglob("*"))}


def leftovers(root: Path) -> list[str]:
    return [str(p.relative_to(root)) for p in root.rglob("*") if p.name.endswith((".staged", ".kept", JOURNAL))]


# ------------------------------------------------------------------------------------------------------ Medium 3
def _foreign(tmp_path) -> tuple[Path, Path]:
    """``<out>/tiny``: a folder the workbook did not make, holding a page, a job file and a hidden folder."""
    out = tmp_path / "out"
    root = out / "tiny"
    (root / ".kernels").mkdir(parents=True)
    (root / ".kernels" / "kernel-1.json").write_text('{"key": "not mfu-lab\'s"}\n')
    (root / "index.html").write_text("<p>someone's own page</p>\n")
    (root / "tuned.yaml").write_text("someone: else\n")
    return out, root


def _commands(out: Path) -> dict[str, list[str]]:
    return {"run": ["run", str(TINY), "--steps", "baseline", "--out", str(out), "-q"],
            "step": ["step", "baseline", "--job", str(TINY), "--out", str(out)],
            "lab": ["lab", str(TINY), "--out", str(out), "--prepare-only"]}


@pytest.fixture
def fake_steps(monkeypatch):
    """``run``'s notebook and ``step``'s code faked (each saves a result, as the real ones would), so that a
    command that got past its start checks finishes in a moment."""
    def notebook(src, out, params, cwd, quiet, timeout=None):
        job = dataclasses.replace(runner.load_job(TINY), out_dir=params["out_dir"])
        store.save(job, INFO.key, result(0.2, job))
        shutil.copy(src, out)

    monkeypatch.setattr(runner, "execute_notebook", notebook)
    monkeypatch.setattr(publish, "export_html", fake_export)
    monkeypatch.setattr(INFO.load(), "run", lambda job, *a, **k: store.save(job, INFO.key, result(0.2, job)))


@pytest.mark.parametrize("command", ["run", "step", "lab"])
def test_a_folder_the_workbook_did_not_make_is_refused_and_nothing_in_it_changes(tmp_path, fake_steps, command):
    out, root = _foreign(tmp_path)
    before = tree(root)
    p = in_process(*_commands(out)[command])
    assert p.returncode == 2, p.stdout + p.stderr
    assert "key 'out_dir'" in p.stderr and f"{root} already holds files mfu-lab did not make" in p.stderr
    assert ".kernels, index.html, tuned.yaml" in p.stderr and f"no {JOB_MARKER} marker" in p.stderr
    assert "choose a new or empty folder" in p.stderr
    assert tree(root) == before


def test_an_empty_folder_and_one_an_earlier_run_made_are_taken(tmp_path, tiny_job):
    root = tiny_job.output_root()
    root.mkdir(parents=True)
    runner.check_output_folder(tiny_job, "job.yaml")  # empty: nothing to overwrite
    mark_job_root(root)
    (root / "index.html").write_text("<p>an earlier run's page</p>\n")
    runner.check_output_folder(tiny_job, "job.yaml")


@pytest.mark.parametrize("command", ["run", "step", "lab"])
def test_an_out_dir_inside_the_installed_package_is_refused_and_nothing_is_made(fake_steps, command):
    package = Path(mfu_lab.__file__).resolve().parent
    out = package / "attack48_outputs"
    digest = source_digest()
    try:
        p = in_process(*_commands(out)[command])
        assert p.returncode == 2, p.stdout + p.stderr
        assert "key 'out_dir'" in p.stderr and f"is inside the installed mfu_lab package ({package})" in p.stderr
        assert not out.exists()
        assert source_digest() == digest
    finally:
        shutil.rmtree(out, ignore_errors=True)


# ------------------------------------------------------------------------------------------------------ Medium 9
@pytest.mark.parametrize("marked", [True, False], ids=["run-before", "new-folder"])
def test_a_link_at_the_jobs_lab_folder_is_refused_and_nothing_goes_through_it(tmp_path, tiny_job, marked):
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "precious.txt").write_text("keep me\n")
    root = tiny_job.output_root()
    root.mkdir(parents=True)
    if marked:
        mark_job_root(root)
    (root / "lab").symlink_to(outside, target_is_directory=True)
    p = in_process("lab", TINY, "--out", root.parent, "--prepare-only")
    assert p.returncode == 2, p.stdout + p.stderr
    assert f"{root / 'lab'}: is a symbolic link inside the job's output folder" in p.stderr
    assert sorted(x.name for x in outside.iterdir()) == ["precious.txt"]
    if marked:  # the lab's own refusal, whoever calls it
        from mfu_lab.lab import prepare_lab

        with pytest.raises(PlantedLink):
            prepare_lab(tiny_job)
        assert sorted(x.name for x in outside.iterdir()) == ["precious.txt"]


def test_a_lab_marks_its_job_folder_so_a_run_may_follow(tmp_path, tiny_job):
    p = in_process("lab", TINY, "--out", tiny_job.output_root().parent, "--prepare-only")
    assert p.returncode == 0, p.stderr
    assert (tiny_job.output_root() / JOB_MARKER).is_file()
    runner.check_output_folder(tiny_job, "job.yaml")


# ------------------------------------------------------------------------------------------------------ Medium 4
KILLED = """
import dataclasses, os, shutil, signal, sys
from mfu_lab import publish
from mfu_lab.core.job.schema import load_job
from mfu_lab.core.registry import BY_KEY
from mfu_lab.core.store import step_results as store
from mfu_lab.core.store.files import write_atomic

tiny, out, run_id, point, notebook_src = sys.argv[1:6]
job = dataclasses.replace(load_job(tiny), out_dir=out)
info = BY_KEY["baseline"]
folder = job.step_dir(info.folder)
die = lambda: os.kill(os.getpid(), signal.SIGKILL)

def export(nb, html, result=None):
    if point == "export":
        die()
    return write_atomic(html, f"report of {nb.name}: mfu 0.2\\n")

real_append, real_replace = publish.append_history, os.replace

def append(root, text):
    if point == "history":
        die()
    return real_append(root, text)

def replace(src, dst, *a, **k):
    if point == "result" and str(src) == str(folder / "result.json.staged"):
        die()
    return real_replace(src, dst, *a, **k)

publish.export_html, publish.append_history, os.replace = export, append, replace
notebook = folder / info.notebook
with publish.step_bracket(job, info, "job.yaml", run_id, notebook=notebook):
    store.save(job, info.key, {"status": "ok", "elapsed_s": 1.0, "job": job.to_dict(),
                               "environment": {"created_at": "run 0.2"},
                               "metrics": {"mfu": {"value": 0.2, "unit": "", "source": "measured"}}})
    shutil.copy(notebook_src, notebook)
print("not killed")
"""
OLD, NEW = "20261201-000000", "20261201-000100"


def _previous(job, monkeypatch) -> dict[str, bytes]:
    """Step 1 published once (run OLD, mfu 0.1), as the set a later run starts from."""
    monkeypatch.setattr(publish, "export_html", fake_export)
    folder = job.step_dir(INFO.folder)
    with publish.step_bracket(job, INFO, "job.yaml", OLD, notebook=folder / INFO.notebook):
        store.save(job, INFO.key, result(0.1, job))
        shutil.copy(NOTEBOOK, folder / INFO.notebook)
    return {n: (folder / n).read_bytes() for n in ("result.json", "report.html")}


def _killed(job, point: str) -> None:
    """Run NEW of step 1 in a process of its own, killed (SIGKILL) at ``point`` of its publication."""
    p = subprocess.run([sys.executable, "-c", KILLED, str(TINY), job.out_dir, NEW, point, str(NOTEBOOK)],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == -9, p.stdout + p.stderr


def _history_runs(root: Path) -> list[str]:
    return [x["run"] for x in load_history(root)]


@pytest.mark.parametrize("point", ["history", "result"])
def test_a_kill_among_the_renames_is_rolled_forward_by_the_next_report(tiny_job, monkeypatch, point):
    root, folder = tiny_job.output_root(), tiny_job.step_dir(INFO.folder)
    _previous(tiny_job, monkeypatch)
    _killed(tiny_job, point)
    assert step_state(folder).status == "interrupted"  # half published, never shown as a finished step
    (folder / INFO.notebook).unlink()  # the report re-exports no notebook here: the report.html checked is the run's
    p = in_process("report", root)
    assert p.returncode == 0, p.stderr
    assert f"01_baseline: the publication of run {NEW} was cut short" in p.stdout and "rolled forward" in p.stdout
    assert read_json(folder / "result.json")["metrics"]["mfu"]["value"] == 0.2
    assert (folder / "report.html").read_text() == "report of 01_baseline.ipynb: mfu 0.2\n"
    assert read_json(root / "runs" / NEW / INFO.folder / "result.json")["metrics"]["mfu"]["value"] == 0.2
    assert _history_runs(root) == [OLD, NEW]  # the line once, whether or not the killed run had appended it
    assert leftovers(root) == [] and not (folder / RUNNING_FILE).exists()
    assert step_state(folder).status == "ok"
    again = in_process("report", root)
    assert "cut short" not in again.stdout and _history_runs(root) == [OLD, NEW]


def test_a_resumed_run_completes_a_killed_publication_first_and_says_so(tiny_job, monkeypatch, fake_steps):
    root, folder = tiny_job.output_root(), tiny_job.step_dir(INFO.folder)
    _previous(tiny_job, monkeypatch)
    _killed(tiny_job, "result")
    p = in_process("run", TINY, "--steps", "baseline", "--out", root.parent, "-q", "--resume")
    assert p.returncode == 0, p.stderr
    assert f"the publication of run {NEW} was cut short" in p.stdout and "rolled forward" in p.stdout
    assert p.stdout.index("rolled forward") < p.stdout.index("[1/1]")  # before the step is judged
    runs = _history_runs(root)  # the killed run's line once, then the resumed run's (its result is not kept)
    assert runs[:2] == [OLD, NEW] and len(runs) == 3 and runs[2] not in (OLD, NEW)
    assert leftovers(root) == [] and not (folder / RUNNING_FILE).exists()


def test_a_kill_before_any_rename_is_rolled_back_and_the_step_says_interrupted(tiny_job, monkeypatch):
    """Killed while the report was exported (nothing renamed yet): the previous set stands whole, the step says
    interrupted, and the next report takes the staged files back and keeps the published report."""
    root, folder = tiny_job.output_root(), tiny_job.step_dir(INFO.folder)
    before = _previous(tiny_job, monkeypatch)
    _killed(tiny_job, "export")
    assert step_state(folder).status == "interrupted"  # the running mark stays until the set is in place
    p = in_process("report", root)
    assert p.returncode == 0, p.stderr
    assert "01_baseline: a publication was cut short before any file was put in place; rolled back" in p.stdout
    assert {n: (folder / n).read_bytes() for n in before} == before
    assert _history_runs(root) == [OLD] and leftovers(root) == []
    assert f"kept {folder / 'report.html'}: 01_baseline is interrupted" in p.stdout


# ------------------------------------------------------------------------------------------------------ Medium 5
def test_report_during_a_run_keeps_the_running_steps_published_report(tiny_job, monkeypatch):
    root, folder = tiny_job.output_root(), tiny_job.step_dir(INFO.folder)
    before = _previous(tiny_job, monkeypatch)
    write_json_atomic(folder / RUNNING_FILE, {"step": INFO.key, "run": NEW, "pid": os.getpid(),
                                              "host": platform.node(), "started_at": "2026-12-01T00:01:00+00:00"})
    nb = json.loads(NOTEBOOK.read_text())  # the notebook papermill is writing: half of its cells so far
    nb["cells"] = nb["cells"][: len(nb["cells"]) // 2]
    (folder / INFO.notebook).write_text(json.dumps(nb))
    p = in_process("report", root)
    assert p.returncode == 0, p.stderr
    assert f"kept {folder / 'report.html'}: 01_baseline is running" in p.stdout
    assert (folder / "report.html").read_bytes() == before["report.html"]
    assert (root / "index.html").is_file()
