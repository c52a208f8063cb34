"""mfu-lab works from any folder (issue 21): a job's relative paths start from the job file's folder, the workbook's
own files are found from the package (the checkout it runs from, else the copy installed with it), and a real,
non-editable install runs a step from a folder outside the checkout."""

import dataclasses
import json
import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

from mfu_lab.cli import main
from mfu_lab.core.job import paths
from mfu_lab.core.job.paths import find_workbook_root, workbook_file
from mfu_lab.core.job.schema import Job, load_job
from mfu_lab.runner import resolve_job

from .conftest import ROOT, TINY

CLUSTER = ROOT / "parameters" / "clusters" / "example_h100.yaml"


def job_beside_its_cluster(folder: Path, extra: str = "") -> Path:
    """``folder/job.yaml`` naming ``cluster: mine.yaml``, a cluster file beside it."""
    folder.mkdir(parents=True, exist_ok=True)
    shutil.copy(CLUSTER, folder / "mine.yaml")
    job = folder / "job.yaml"
    job.write_text(f"job_name: beside\ncluster: mine.yaml\n{extra}")
    return job


def test_the_workbook_files_are_the_checkouts_when_the_package_runs_from_it():
    assert paths.package_checkout() == ROOT
    assert workbook_file("notebooks/01_baseline.ipynb") == ROOT / "notebooks" / "01_baseline.ipynb"
    assert workbook_file("parameters/default.yaml").is_file()


def test_a_job_files_relative_paths_start_from_its_folder(tmp_path, monkeypatch):
    job_beside_its_cluster(tmp_path / "jobs", "monitor_dir: mon\n")
    (tmp_path / "jobs" / "mon").mkdir()
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    job = load_job(Path("..") / "jobs" / "job.yaml")
    assert job.cluster == str(tmp_path / "jobs" / "mine.yaml")  # absolute: a notebook's kernel gets the same file
    assert job.monitor_path() == tmp_path / "jobs" / "mon"
    assert job.output_root() == tmp_path / "elsewhere" / "outputs" / "beside"  # out_dir: the current folder
    assert main(["validate", str(job_beside_its_cluster(tmp_path / "other"))]) == 0


def test_a_missing_relative_file_is_reported_beside_the_job_file(tmp_path, monkeypatch, capsys):
    (tmp_path / "jobs").mkdir()
    (tmp_path / "jobs" / "job.yaml").write_text("cluster: nope.yaml\n")
    monkeypatch.chdir(tmp_path)
    assert main(["validate", str(tmp_path / "jobs" / "job.yaml")]) == 2
    assert str(tmp_path / "jobs" / "nope.yaml") in capsys.readouterr().err


def test_the_checkouts_jobs_keep_their_meaning_from_another_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    default = load_job(ROOT / "parameters" / "default.yaml")
    assert default.output_root() == ROOT / "outputs" / "default"  # out_dir: the checkout holding the job file
    assert default.cluster_path() == CLUSTER
    assert load_job(TINY).output_root() == ROOT / "outputs" / "tiny"
    assert main(["validate", str(ROOT / "parameters" / "default.yaml")]) == 0
    monkeypatch.chdir(ROOT / "notebooks")  # inside the checkout: the paths stay as written
    assert load_job(ROOT / "parameters" / "default.yaml") == dataclasses.replace(Job(), budget_min=4.5)


def test_the_default_job_from_another_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert Job().cluster_path() == CLUSTER  # not in the current folder: the workbook's own
    job, source = resolve_job(None, {}, None, writable=False)
    assert source == str(ROOT / "parameters" / "default.yaml")
    assert job == dataclasses.replace(Job(), budget_min=4.5)  # the embedded default job, with the demo's budget
    assert job.output_root() == tmp_path / "outputs" / "default"


def test_a_command_line_path_is_not_taken_from_the_job_files_folder(tmp_path, monkeypatch):
    job_file = job_beside_its_cluster(tmp_path / "jobs")
    monkeypatch.chdir(tmp_path)
    assert load_job(job_file, {"cluster": "mine.yaml"}).cluster_path() == tmp_path / "mine.yaml"


def test_the_packaged_copy_is_not_a_checkout(tmp_path, monkeypatch):
    packaged = tmp_path / "mfu_lab" / "_workbook"
    (packaged / "notebooks").mkdir(parents=True)
    (packaged / "notebooks" / "01_baseline.ipynb").write_text("{}")
    (packaged / "parameters").mkdir()
    (packaged / "parameters" / "default.yaml").write_text("out_dir: outputs\n")
    monkeypatch.setattr(paths, "PACKAGED", packaged)
    assert not paths.is_checkout(packaged)
    assert find_workbook_root(packaged / "notebooks") == packaged / "notebooks"
    monkeypatch.chdir(tmp_path)  # the packaged default job writes in the current folder, never in the package
    assert load_job(packaged / "parameters" / "default.yaml").output_root() == tmp_path / "outputs" / "default"


# ----------------------------------------------------------------------------- a real install, outside the checkout
@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """A virtual environment holding a wheel of this checkout (not editable), built from a copy of its sources;
    the test environment's other packages (torch, papermill...) are visible to it, the checkout is not."""
    tmp = tmp_path_factory.mktemp("anywhere")
    src = tmp / "src"
    src.mkdir()
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy(ROOT / name, src / name)
    skip = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info", "_workbook")
    for name in ("mfu_lab", "notebooks", "parameters"):
        shutil.copytree(ROOT / name, src / name, ignore=skip)
    pip = [sys.executable, "-m", "pip"]
    quiet = {"check": True, "capture_output": True, "timeout": 180}
    subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-w", str(tmp / "wheel"),
                    str(src)], **quiet)
    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], **quiet)
    python = venv / "bin" / "python"
    # -I: never uninstall anything (the test environment's own editable mfu-lab stays as it is)
    subprocess.run([*pip, "--python", str(python), "install", "-I", "--no-deps", "--no-index",
                    *map(str, (tmp / "wheel").glob("mfu_lab-*.whl"))], **quiet)
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          text=True, **quiet).stdout.strip()
    # a plain path line: the test environment's packages, without running its .pth files (its editable finder)
    (Path(site) / "_test_env.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    if (jupyter := Path(sys.prefix) / "share" / "jupyter").is_dir():  # nbconvert's templates, the kernel spec
        (venv / "share").mkdir(exist_ok=True)
        (venv / "share" / "jupyter").symlink_to(jupyter)
    return venv


def in_folder(venv: Path, cwd: Path, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    return subprocess.run(list(args), cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.e2e
def test_an_installed_mfu_lab_runs_a_job_from_any_folder(installed, tmp_path):
    cwd, jobs = tmp_path / "work", tmp_path / "jobs"
    cwd.mkdir()
    here = in_folder(installed, cwd, str(installed / "bin" / "python"), "-c",
                     "import mfu_lab; from mfu_lab.core.job import paths; from mfu_lab.runner import resolve_job; "
                     "from mfu_lab.core.store.results import source_digest; "
                     "job, source = resolve_job(None, {}, None, writable=False); "
                     "print(mfu_lab.__file__, paths.workbook_file('notebooks/01_baseline.ipynb'), source, "
                     "job.cluster_path(), job.output_root(), source_digest(), sep='\\n')")
    *found, digest = here.stdout.splitlines()
    package, notebook, default, cluster, out = map(Path, found)
    assert installed in package.parents and ROOT not in package.parents, here.stderr
    assert notebook.is_file() and installed in notebook.parents  # the copy the wheel carries
    assert default.name == "default.yaml" and installed in default.parents  # the default job: the packaged one...
    assert cluster.is_file() and installed in cluster.parents
    assert out == cwd / "outputs" / "default"  # ...writing in the current folder, never inside the package

    job_file = job_beside_its_cluster(jobs)
    (jobs / "plain.yaml").write_text("job_name: plain\n")  # the default cluster: the installed package's own
    mfu_lab = str(installed / "bin" / "mfu-lab")
    p = in_folder(installed, cwd, mfu_lab, "validate", os.path.relpath(job_file, cwd))
    assert p.returncode == 0 and str(jobs / "mine.yaml") in p.stdout, p.stdout + p.stderr
    p = in_folder(installed, cwd, mfu_lab, "validate", "../jobs/plain.yaml")  # no cluster here, nor a checkout
    assert p.returncode == 0, p.stdout + p.stderr

    shutil.copy(TINY, jobs / "tiny.yaml")
    p = in_folder(installed, cwd, mfu_lab, "run", "../jobs/tiny.yaml", "--steps", "baseline", "-q", timeout=240)
    assert p.returncode == 0, p.stdout + p.stderr
    step = cwd / "outputs" / "tiny" / "01_baseline"  # out_dir: outputs, from the current folder
    result = json.loads((step / "result.json").read_text())
    assert result["metrics"]["mfu"]["value"] > 0
    assert result["environment"]["source_digest"] == digest  # the kernel ran the installed copy, not the checkout
    executed = json.loads((step / "01_baseline.ipynb").read_text())
    assert installed in Path(executed["metadata"]["papermill"]["input_path"]).parents
    assert (step / "report.html").is_file() and (cwd / "outputs" / "tiny" / "index.html").is_file()
